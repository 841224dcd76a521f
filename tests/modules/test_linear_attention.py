"""LinearAttention: the module's math against an fp64 quadratic form, cached decoding ==
full forward, key padding, weights, FAVOR+ features in the state dict.

Shapes: B batch, N length, S key length, C width, H heads, Hkv kv heads, D head dim.

Oracle: the module's own projections followed by out = A V / (A 1 + eps) with
A = φ(Q) φ(K)ᵀ (lower-triangular when causal) written plainly in fp64. Tolerances: fp32
module vs the fp64 oracle atol/rtol 1e-5 (outputs O(1)); cached decode vs full forward in
fp32 atol/rtol 1e-5; padded row vs row alone atol/rtol 1e-5.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from qkv.masks import Causal, Padding
from qkv.modules.cache import LinearCache
from qkv.modules.linear_attention import LinearAttention, default_num_features
from qkv.positions import RoPE

FP32 = {"atol": 1e-5, "rtol": 1e-5}


def make(feature_map="elu", heads=4, kv_heads=None, rope=False, dim=32, seed=0):
    torch.manual_seed(seed)
    m = LinearAttention(dim, heads, num_kv_heads=kv_heads, feature_map=feature_map,
                        rope=RoPE(dim // heads) if rope else None)
    with torch.no_grad():  # non-trivial biases
        m.in_proj.bias.normal_(0, 0.3)
        m.out_proj.bias.normal_(0, 0.3)
    return m.eval()


def oracle(m: LinearAttention, x, *, causal, keep=None, eps=1e-6):
    """fp64 quadratic form on the module's projections (B, N, C)."""
    b, n, _ = x.shape
    w, bias = m.in_proj.weight.double(), m.in_proj.bias.double()
    q, k, v = F.linear(x.double(), w, bias).split(m._splits, dim=-1)
    d = m.head_dim
    q = q.view(b, n, m.num_heads, d).transpose(1, 2)
    k = k.view(b, n, m.num_kv_heads, d).transpose(1, 2)
    v = v.view(b, n, m.num_kv_heads, d).transpose(1, 2)
    if m.rope is not None:
        q, k = m.rope.rotate(q, torch.arange(n)), m.rope.rotate(k, torch.arange(n))
    g = m.num_heads // m.num_kv_heads
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    if m.feature_map == "elu":
        def phi(t):
            return torch.where(t > 0, t + 1, torch.exp(t))
    else:
        proj = m.feature_projection.double()

        def phi(t):
            ts = t / d ** 0.25
            return torch.exp(ts @ proj.T - (ts * ts).sum(-1, keepdim=True) / 2) / math.sqrt(
                proj.shape[0])
    a = phi(q) @ phi(k).transpose(-1, -2)  # (B, H, N, S)
    if keep is not None:
        a = a * keep[:, None, None, :].double()
    if causal:
        a = a.tril()
    out = (a @ v) / (a.sum(-1, keepdim=True) + eps)  # (B, H, N, D)
    out = out.transpose(1, 2).reshape(b, n, -1)
    return F.linear(out, m.out_proj.weight.double(), m.out_proj.bias.double())


@pytest.mark.parametrize("feature_map,kv_heads,rope,causal", [
    ("elu", None, False, True), ("elu", 2, True, True), ("favor", None, True, True),
    ("favor", 1, False, False), ("elu", None, False, False),
])
def test_forward_equals_fp64_quadratic_form(feature_map, kv_heads, rope, causal):
    m = make(feature_map, kv_heads=kv_heads, rope=rope)
    x = torch.randn(2, 37, 32)
    with torch.no_grad():
        out = m(x, causal=causal)
    torch.testing.assert_close(out.double(), oracle(m, x, causal=causal), **FP32)


@pytest.mark.parametrize("feature_map,rope", [("elu", False), ("favor", True)])
@pytest.mark.parametrize("chunks", [[1] * 19, [6, 1, 1, 11]])
def test_cached_decode_equals_full_forward(feature_map, rope, chunks):
    m = make(feature_map, kv_heads=2, rope=rope)
    x = torch.randn(2, 19, 32)
    with torch.no_grad():
        full = m(x, causal=True)
        cache = m.new_cache(2)
        outs, t = [], 0
        for c in chunks:
            outs.append(m(x[:, t:t + c], causal=True, cache=cache))
            t += c
    torch.testing.assert_close(torch.cat(outs, dim=1), full, **FP32)
    assert cache.length == 19 and cache.state.kv.shape == (2, 4, m.num_features, 8)


@pytest.mark.parametrize("feature_map", ["elu", "favor"])
def test_left_padding_equals_rows_alone(feature_map):
    m = make(feature_map, rope=True)
    lengths = [9, 4]
    rows = [torch.randn(1, n, 32) for n in lengths]
    x = torch.cat([torch.cat([torch.randn(1, 9 - n, 32) * 5, r], 1) for n, r in
                   zip(lengths, rows, strict=True)])  # (2, 9, C), left padded with junk
    keep = torch.arange(9)[None] >= torch.tensor([9 - n for n in lengths])[:, None]
    pos = (keep.long().cumsum(1) - 1).clamp_min(0)  # each row counts from its first token
    with torch.no_grad():
        out = m(x, causal=True, mask=Padding(keep=keep), positions=pos)
        cache = m.new_cache(2)
        steps = [m(x[:, :3], causal=True, cache=cache, mask=Padding(keep=keep[:, :3]),
                   positions=pos[:, :3])]
        for t in range(3, 9):
            steps.append(m(x[:, t:t + 1], causal=True, cache=cache,
                           mask=Padding(keep=keep[:, :t + 1]), positions=pos[:, t:t + 1]))
        stepped = torch.cat(steps, dim=1)
        for i, r in enumerate(rows):
            alone = m(r, causal=True)
            torch.testing.assert_close(out[i, 9 - lengths[i]:], alone[0], **FP32)
            torch.testing.assert_close(stepped[i, 9 - lengths[i]:], alone[0], **FP32)


@pytest.mark.parametrize("feature_map", ["elu", "favor"])
def test_weights_reproduce_the_output(feature_map):
    m = make(feature_map)
    x = torch.randn(1, 12, 32)
    keep = torch.arange(12)[None] >= 3
    with torch.no_grad():
        out, w = m(x, causal=True, mask=Padding(keep=keep), need_weights=True)
        v = m.in_proj(x).split(m._splits, dim=-1)[2].view(1, 12, 4, 8).transpose(1, 2)
        mixed = (w @ v).transpose(1, 2).reshape(1, 12, 32)
        want = m.out_proj(mixed)
    assert w.shape == (1, 4, 12, 12)
    assert torch.equal(w[..., :3], torch.zeros_like(w[..., :3]))  # padded keys
    assert torch.equal(w.triu(1), torch.zeros_like(w))  # causal
    torch.testing.assert_close(w[:, :, 3:].sum(-1), torch.ones(1, 4, 9, dtype=w.dtype))
    torch.testing.assert_close(out[:, 3:], want[:, 3:], **FP32)


def test_gradients_reach_every_parameter():
    m = make("favor", kv_heads=2, rope=True).train()
    x = torch.randn(2, 70, 32, requires_grad=True)
    m(x, causal=True).square().mean().backward()
    for name, p in [*m.named_parameters(), ("x", x)]:
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, \
            name
    assert m.feature_projection.grad is None  # a buffer, not trained


def test_favor_projection_is_state_and_redrawable():
    m = make("favor")
    assert m.num_features == default_num_features(8) == 17
    x = torch.randn(1, 10, 32)
    other = LinearAttention(32, 4, feature_map="favor")
    other.load_state_dict(m.state_dict())
    with torch.no_grad():
        assert torch.equal(other(x, causal=True), m(x, causal=True))
        before = m(x, causal=True)
        old = m.feature_projection.clone()
        rng = torch.get_rng_state()
        m.redraw_features(torch.Generator().manual_seed(1))
        assert torch.equal(rng, torch.get_rng_state())  # a given generator is the only source
        assert not torch.equal(old, m.feature_projection)
        drawn = m.feature_projection.clone()
        m.redraw_features(torch.Generator().manual_seed(1))
        assert torch.equal(drawn, m.feature_projection)
        assert not torch.allclose(m(x, causal=True), before)
    with pytest.raises(ValueError, match="elu' has no random features"):
        make("elu").redraw_features()


@pytest.mark.parametrize("call,exc,match", [
    (lambda m: m(torch.randn(1, 3, 32), mask=Causal()), ValueError,
     "mask must be None or qkv.masks.Padding"),
    (lambda m: m(torch.randn(1, 3, 32), cache=m.new_cache(1)), ValueError, "causal=True"),
    (lambda m: m(torch.randn(1, 3, 32), causal=True, cache=m.new_cache(1), need_weights=True),
     ValueError, "need_weights"),
    (lambda m: m(torch.randn(1, 3, 32), torch.randn(1, 3, 32)), ValueError,
     "self-attention only"),
    (lambda m: m(torch.randn(1, 3, 32), bias=torch.zeros(3, 3)), ValueError, "bias"),
    (lambda m: m(torch.randn(1, 3, 16)), ValueError, r"x must have shape \(B, N, C=32\)"),
    (lambda m: m(torch.randn(1, 3, 32), causal=True, cache=[]), TypeError, "LinearCache"),
    (lambda m: m(torch.randn(2, 3, 32), causal=True, cache=m.new_cache(1)), ValueError,
     "cache is for batch 1"),
    (lambda m: m(torch.randn(1, 3, 32), causal=True, cache=m.new_cache(1, 2)), ValueError,
     "capacity 2"),
    (lambda m: LinearAttention(32, 4, num_features=8), ValueError, "num_features=8 is for"),
    (lambda m: LinearAttention(32, 4, feature_map="relu"), ValueError, "feature_map must"),
    (lambda m: LinearAttention(30, 4), ValueError, "not divisible"),
])
def test_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call(make())


def test_cache_is_constant_size():
    m = make("elu")
    cache = m.new_cache(1)
    assert isinstance(cache, LinearCache)
    with torch.no_grad():
        m(torch.randn(1, 5, 32), causal=True, cache=cache)
        size = cache.nbytes
        for _ in range(50):
            m(torch.randn(1, 1, 32), causal=True, cache=cache)
    assert cache.nbytes == size == (4 * 8 * 8 + 4 * 8) * 4 and cache.length == 55
