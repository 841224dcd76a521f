"""qkv.modules.MultiHeadAttention against oracles nobody here wrote.

Shapes: B batch, N query length, S key length, C model width, H heads, Hkv kv heads,
D head dim.

Oracles: the seed document's naive SelfAttention (seed 000), torch.nn.MultiheadAttention
(both weight-conversion directions, fast and slow paths), and plain fp64 math.
Tolerances: fp32 atol/rtol 1e-5 (the issue's bar; fp32 rounding of these small problems is
~1e-7); fp64 atol 1e-10 (any semantic difference shows up far above that).
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.masks import Padding
from qkv.modules import KVCache, MultiHeadAttention

FP32 = {"atol": 1e-5, "rtol": 1e-5}
FP64 = {"atol": 1e-10, "rtol": 1e-10}


class SelfAttention(nn.Module):
    """Seed 000's naive multi-head self-attention, verbatim but for formatting: the oracle."""

    def __init__(self, d_model, num_heads):
        super().__init__()
        self.d_model = d_model
        self.num_heads = num_heads
        self.depth = d_model // num_heads
        self.WQ = nn.Linear(d_model, d_model)
        self.WK = nn.Linear(d_model, d_model)
        self.WV = nn.Linear(d_model, d_model)
        self.dense = nn.Linear(d_model, d_model)

    def split_heads(self, x, batch_size):
        x = x.view(batch_size, -1, self.num_heads, self.depth)
        return x.permute(0, 2, 1, 3)

    def forward(self, x):
        batch_size = x.size(0)
        Q = self.split_heads(self.WQ(x), batch_size)
        K = self.split_heads(self.WK(x), batch_size)
        V = self.split_heads(self.WV(x), batch_size)
        logits = torch.matmul(Q, K.transpose(-2, -1)) / torch.sqrt(
            torch.tensor(K.size(-1), dtype=torch.float32))
        w = torch.softmax(logits, dim=-1)
        out = torch.matmul(w, V)
        out = out.permute(0, 2, 1, 3).contiguous().view(batch_size, -1, self.d_model)
        return self.dense(out)


def _randomize(module: nn.Module, gen: torch.Generator) -> None:
    """Give every parameter (biases too) random values, so that none is trivially zero."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) / math.sqrt(p.shape[-1]))


# --- seed 000 ----------------------------------------------------------------------------------
@pytest.mark.parametrize("d_model,heads,batch,n", [(512, 8, 2, 10), (64, 4, 1, 1), (48, 3, 3, 17),
                                                   (80, 1, 2, 5)])
def test_seed_000_equivalence(d_model, heads, batch, n):
    torch.manual_seed(0)
    seed = SelfAttention(d_model, heads)
    mha = MultiHeadAttention(d_model, heads)
    with torch.no_grad():
        mha.in_proj.weight.copy_(torch.cat([seed.WQ.weight, seed.WK.weight, seed.WV.weight]))
        mha.in_proj.bias.copy_(torch.cat([seed.WQ.bias, seed.WK.bias, seed.WV.bias]))
        mha.out_proj.weight.copy_(seed.dense.weight)
        mha.out_proj.bias.copy_(seed.dense.bias)
    x = torch.randn(batch, n, d_model)  # (B, N, C)
    torch.testing.assert_close(mha(x), seed(x), **FP32)
    # fp64: the seed's sqrt is an fp32 tensor; promote both modules and compare tighter
    seed, mha, x = seed.double(), mha.double(), x.double()
    torch.testing.assert_close(mha(x), seed(x), atol=1e-7, rtol=1e-7)  # sqrt(D) rounded in fp32


# --- torch.nn.MultiheadAttention on random configurations --------------------------------------
def _torch_config(i: int) -> dict:
    rng = random.Random(1000 + i)
    heads = rng.choice([1, 2, 3, 4])
    head_dim = rng.choice([1, 2, 5, 8, 24])
    dim = heads * head_dim
    cross = rng.random() < 0.4
    kv_dim = rng.choice([dim, 7, 13]) if cross else dim
    n = rng.choice([1, 2, 5, 17])
    s = rng.choice([1, 3, 17]) if cross else n
    direction = rng.choice(["from_torch", "to_torch"])
    kv_heads = heads
    if direction == "to_torch":
        kv_heads = rng.choice([h for h in (1, 2, heads) if heads % h == 0])
    attn = rng.choice(["none", "none", "float"] if cross else
                      ["none", "causal_bool", "causal_hint", "float"])
    return {"heads": heads, "kv_heads": kv_heads, "dim": dim, "kv_dim": kv_dim, "cross": cross,
            "n": n, "s": s, "batch": rng.choice([1, 2, 3]), "bias": rng.random() < 0.7,
            "batch_first": rng.random() < 0.5, "padding": rng.random() < 0.4, "attn": attn,
            "direction": direction}


def _pair(cfg: dict, gen: torch.Generator, dtype: torch.dtype):
    """(torch module, qkv module) with equal weights, converted in cfg's direction."""
    if cfg["direction"] == "from_torch":
        ref = nn.MultiheadAttention(cfg["dim"], cfg["heads"], bias=cfg["bias"],
                                    kdim=cfg["kv_dim"], vdim=cfg["kv_dim"],
                                    batch_first=cfg["batch_first"], dtype=dtype)
        _randomize(ref, gen)
        return ref, MultiHeadAttention.from_torch(ref)
    mha = MultiHeadAttention(cfg["dim"], cfg["heads"], num_kv_heads=cfg["kv_heads"],
                             kv_dim=cfg["kv_dim"], bias=cfg["bias"], dtype=dtype)
    _randomize(mha, gen)
    ref = mha.to_torch()
    assert ref.batch_first
    if not cfg["batch_first"]:  # the same weights in a seq-first torch module
        seq_first = nn.MultiheadAttention(cfg["dim"], cfg["heads"], bias=cfg["bias"],
                                          kdim=cfg["kv_dim"], vdim=cfg["kv_dim"], dtype=dtype)
        seq_first.load_state_dict(ref.state_dict())
        ref = seq_first
    return ref, mha


def _inputs(cfg: dict, gen: torch.Generator, dtype: torch.dtype):
    """x, context, torch kwargs and the equivalent qkv kwargs."""
    b, n, s = cfg["batch"], cfg["n"], cfg["s"]
    x = torch.randn(b, n, cfg["dim"], generator=gen, dtype=dtype)  # (B, N, C)
    ctx = torch.randn(b, s, cfg["kv_dim"], generator=gen, dtype=dtype) if cfg["cross"] else x
    t_kw: dict = {}
    q_kw: dict = {}
    masks = []
    if cfg["padding"]:
        lengths = torch.randint(1, s + 1, (b,), generator=gen)  # >= 1: no fully masked row
        keep = torch.arange(s)[None, :] < lengths[:, None]  # (B, S), True = real key
        t_kw["key_padding_mask"] = ~keep  # torch: True = ignore
        if cfg["attn"] == "float":  # torch wants both masks of one kind: additive here
            t_kw["key_padding_mask"] = torch.zeros(b, s, dtype=dtype).masked_fill(
                ~keep, float("-inf"))
        masks.append(Padding(keep=keep))
    if cfg["attn"] in ("causal_bool", "causal_hint"):
        t_kw["attn_mask"] = torch.ones(n, s, dtype=torch.bool).triu(1)  # torch: True = ignore
        if cfg["attn"] == "causal_hint":
            t_kw["is_causal"] = True
        q_kw["causal"] = True
    elif cfg["attn"] == "float":
        t_kw["attn_mask"] = torch.randn(n, s, generator=gen, dtype=dtype)  # additive
        q_kw["bias"] = t_kw["attn_mask"]
    if masks:
        q_kw["mask"] = masks[0]
    return x, ctx, t_kw, q_kw


def _run_torch(ref: nn.MultiheadAttention, cfg: dict, x, ctx, t_kw: dict, **extra):
    if ref.batch_first:
        return ref(x, ctx, ctx, **t_kw, **extra)
    out, w = ref(x.transpose(0, 1), ctx.transpose(0, 1), ctx.transpose(0, 1), **t_kw, **extra)
    return out.transpose(0, 1), w


def _run_qkv(mha: MultiHeadAttention, cfg: dict, x, ctx, q_kw: dict, **extra):
    return mha(x, ctx, **q_kw, **extra) if cfg["cross"] else mha(x, **q_kw, **extra)


@pytest.mark.parametrize("i", range(100))
def test_matches_torch_multihead_attention(i):
    cfg = _torch_config(i)
    for dtype, tol in ((torch.float32, FP32), (torch.float64, FP64)):
        gen = torch.Generator().manual_seed(i)
        ref, mha = _pair(cfg, gen, dtype)
        x, ctx, t_kw, q_kw = _inputs(cfg, gen, dtype)
        ref.eval()
        mha.eval()
        with torch.no_grad():  # torch's fast path where it applies (batch_first, no weights)
            want, _ = _run_torch(ref, cfg, x, ctx, t_kw, need_weights=False)
            torch.testing.assert_close(_run_qkv(mha, cfg, x, ctx, q_kw), want, **tol)
            want, want_w = _run_torch(ref, cfg, x, ctx, t_kw, need_weights=True,
                                      average_attn_weights=False)  # (B, H, N, S)
            got, got_w = _run_qkv(mha, cfg, x, ctx, q_kw, need_weights=True)
        torch.testing.assert_close(got, want, **tol)
        assert got_w.shape == (cfg["batch"], cfg["heads"], cfg["n"], cfg["s"])
        torch.testing.assert_close(got_w, want_w, **tol)


@pytest.mark.parametrize("i", [0, 3, 5, 8, 13, 21])
def test_gradients_match_torch(i):
    """Training mode (dropout 0), fp64: input and weight gradients equal torch's (1e-10)."""
    cfg = {**_torch_config(i), "direction": "from_torch"}
    gen = torch.Generator().manual_seed(i)
    ref, mha = _pair(cfg, gen, torch.float64)
    x, ctx, t_kw, q_kw = _inputs(cfg, gen, torch.float64)
    x1 = x.clone().requires_grad_(True)
    c1 = x1 if not cfg["cross"] else ctx.clone().requires_grad_(True)
    x2 = x.clone().requires_grad_(True)
    c2 = x2 if not cfg["cross"] else ctx.clone().requires_grad_(True)
    cot = torch.randn(cfg["batch"], cfg["n"], cfg["dim"], generator=gen, dtype=torch.float64)
    want, _ = _run_torch(ref.train(), cfg, x1, c1, t_kw, need_weights=False)
    want.backward(cot)
    got = _run_qkv(mha.train(), cfg, x2, c2, q_kw)
    got.backward(cot)
    torch.testing.assert_close(got, want, **FP64)
    torch.testing.assert_close(x2.grad, x1.grad, **FP64)
    if cfg["cross"]:
        torch.testing.assert_close(c2.grad, c1.grad, **FP64)
    if ref._qkv_same_embed_dim:
        torch.testing.assert_close(mha.in_proj.weight.grad, ref.in_proj_weight.grad, **FP64)
    else:
        torch.testing.assert_close(mha.q_proj.weight.grad, ref.q_proj_weight.grad, **FP64)
        torch.testing.assert_close(mha.kv_proj.weight.grad,
                                   torch.cat([ref.k_proj_weight.grad, ref.v_proj_weight.grad]),
                                   **FP64)
    torch.testing.assert_close(mha.out_proj.weight.grad, ref.out_proj.weight.grad, **FP64)


def test_round_trip_keeps_weights():
    torch.manual_seed(0)
    for kv_dim in (None, 6):
        mha = MultiHeadAttention(16, 4, kv_dim=kv_dim)
        _randomize(mha, torch.Generator().manual_seed(1))
        back = MultiHeadAttention.from_torch(mha.to_torch())
        for (name, p), (name2, p2) in zip(mha.state_dict().items(), back.state_dict().items(),
                                          strict=True):
            assert name == name2
            assert torch.equal(p, p2), name


def test_gqa_equals_expanded_heads():
    """A GQA module equals plain MHA whose k/v weights repeat each kv head (fp64, 1e-10)."""
    torch.manual_seed(0)
    gqa = MultiHeadAttention(24, 6, num_kv_heads=2, dtype=torch.float64)
    _randomize(gqa, torch.Generator().manual_seed(2))
    wq, wk, wv = gqa.in_proj.weight.split([24, 8, 8])
    bq, bk, bv = gqa.in_proj.bias.split([24, 8, 8])
    heads = lambda t: t.reshape(2, 4, *t.shape[1:]).repeat_interleave(3, 0).reshape(24, -1)
    full = MultiHeadAttention(24, 6, dtype=torch.float64)
    with torch.no_grad():
        full.in_proj.weight.copy_(torch.cat([wq, heads(wk), heads(wv)]))
        full.in_proj.bias.copy_(torch.cat([bq, heads(bk[:, None])[:, 0], heads(bv[:, None])[:, 0]]))
        full.out_proj.load_state_dict(gqa.out_proj.state_dict())
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    torch.testing.assert_close(gqa(x, causal=True), full(x, causal=True), **FP64)
    assert gqa.in_proj.weight.shape == ((6 + 2 * 2) * 4, 24)  # one fused (H + 2 Hkv)·D x C


# --- weights, masks, dropout -------------------------------------------------------------------
def test_need_weights_per_head_rows_sum_to_one_and_masked_rows_zero():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 5, 16, requires_grad=True)
    out, w = mha(x, need_weights=True)
    assert w.shape == (2, 4, 5, 5)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 5), **FP32)
    # batch row 0 has no real key: its rows attend nothing -> zero weights, output = out bias
    out, w = mha(x, mask=Padding(torch.tensor([0, 3])), need_weights=True)
    assert torch.equal(w[0], torch.zeros(4, 5, 5))
    torch.testing.assert_close(w[1].sum(-1), torch.ones(4, 5), **FP32)
    assert torch.equal(w[1, ..., 3:], torch.zeros(4, 5, 2))
    torch.testing.assert_close(out[0], mha.out_proj.bias.expand(5, 16), atol=0, rtol=0)
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    # bottom-right causal with N > S (cross): the first N - S query rows see no key
    ctx = torch.randn(2, 3, 16)
    _, w = mha(x, ctx, causal=True, need_weights=True)
    assert torch.equal(w[:, :, :2], torch.zeros(2, 4, 2, 3))
    torch.testing.assert_close(w[:, :, 2:].sum(-1), torch.ones(2, 4, 3), **FP32)


def test_bool_tensor_mask_and_float_bias_pass_through():
    """mask= (True = may attend) and bias= reach qkv.attention: fp64 math oracle (1e-10)."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(12, 3, dtype=torch.float64)
    x = torch.randn(2, 6, 12, dtype=torch.float64)
    keep = torch.rand(2, 1, 6, 6) > 0.3
    keep[..., 0] = True
    add = torch.randn(1, 3, 6, 6, dtype=torch.float64)
    q, k, v = mha.in_proj(x).view(2, 6, 3, 3, 4).permute(2, 0, 3, 1, 4)  # (B, H, N, D) each
    scores = (q @ k.transpose(-1, -2)) / 2.0 + add  # (B, H, N, S), D = 4
    w = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    want = mha.out_proj((w @ v).transpose(1, 2).reshape(2, 6, 12))
    torch.testing.assert_close(mha(x, mask=keep, bias=add), want, **FP64)


def test_dropout_only_in_training():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2, dropout=0.5)
    x = torch.randn(2, 7, 16)
    mha.eval()
    a, b = mha(x), mha(x)
    assert torch.equal(a, b)  # eval is deterministic
    mha.train()
    c, d = mha(x), mha(x)
    assert not torch.allclose(c, a) and not torch.allclose(c, d)
    mha.dropout = 0.0
    torch.testing.assert_close(mha(x), a, atol=0, rtol=0)  # dropout 0 in training == eval


def test_batch_row_equals_row_alone():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, num_kv_heads=2).eval()
    x = torch.randn(3, 11, 16)
    full = mha(x, causal=True)
    for b in range(3):
        torch.testing.assert_close(full[b:b + 1], mha(x[b:b + 1], causal=True), **FP32)


def test_half_precision_error_within_twice_torch():
    """bf16: error vs an fp64 oracle at most 2x torch's own bf16 module's error (+ slack)."""
    torch.manual_seed(0)
    ref64 = nn.MultiheadAttention(64, 4, batch_first=True, dtype=torch.float64).eval()
    x64 = torch.randn(2, 33, 64, dtype=torch.float64)
    with torch.no_grad():
        want = ref64(x64, x64, x64, need_weights=False)[0]
        ref16 = nn.MultiheadAttention(64, 4, batch_first=True, dtype=torch.bfloat16).eval()
        ref16.load_state_dict(ref64.state_dict())
        x16 = x64.to(torch.bfloat16)
        err_torch = (ref16(x16, x16, x16, need_weights=False)[0].double() - want).abs().max()
        got = MultiHeadAttention.from_torch(ref16).eval()(x16)
    assert got.dtype == torch.bfloat16
    assert (got.double() - want).abs().max() <= 2 * err_torch + 1e-3


# --- cross-attention -----------------------------------------------------------------------------
@pytest.mark.parametrize("kv_dim", [None, 10])
def test_project_kv_reused_equals_context(kv_dim):
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, num_kv_heads=2, kv_dim=kv_dim)
    ctx = torch.randn(2, 7, kv_dim or 16)
    k, v = mha.project_kv(ctx)
    assert k.shape == v.shape == (2, 2, 7, 4)  # (B, Hkv, S, D)
    for n in (1, 3):
        x = torch.randn(2, n, 16)
        torch.testing.assert_close(mha(x, kv=(k, v)), mha(x, ctx), atol=0, rtol=0)
    if kv_dim is None:  # the fused module's cross path == the seed-style self path on x
        x = torch.randn(2, 5, 16)
        torch.testing.assert_close(mha(x, x), mha(x), **FP32)


# --- rotary positions --------------------------------------------------------------------------
class FakeRoPE(nn.Module):
    """Tiny stand-in for qkv.positions.RoPE: rotate-half rotary embedding; records positions."""

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        self.seen: list[torch.Tensor] = []

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.seen.append(positions)
        ang = positions.to(torch.float64)[..., None] * self.inv_freq  # (N|B,N, D/2)
        if ang.dim() == 3:
            ang = ang[:, None]  # (B, 1, N, D/2)
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        x1, x2 = x[..., : self.head_dim // 2], x[..., self.head_dim // 2:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def test_rope_rotates_q_and_k_at_absolute_positions():
    torch.manual_seed(0)
    rope = FakeRoPE(8)
    mha = MultiHeadAttention(32, 4, num_kv_heads=2, rope=rope, dtype=torch.float64)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    q, k, v = mha.in_proj(x).split([32, 16, 16], -1)
    q = q.view(2, 6, 4, 8).transpose(1, 2)  # (B, H, N, D)
    k = k.view(2, 6, 2, 8).transpose(1, 2)  # (B, Hkv, N, D)
    v = v.view(2, 6, 2, 8).transpose(1, 2)  # (B, Hkv, N, D)
    pos = torch.arange(6)
    q, k = rope.rotate(q, pos), rope.rotate(k, pos)
    o = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                       is_causal=True)
    want = mha.out_proj(o.transpose(1, 2).reshape(2, 6, 32))
    torch.testing.assert_close(mha(x, causal=True), want, **FP64)
    # explicit per-row positions (B, N): shifting all positions leaves attention unchanged
    torch.testing.assert_close(mha(x, causal=True, positions=(pos + 5).expand(2, 6)), want,
                               atol=1e-9, rtol=1e-9)
    with pytest.raises(ValueError, match="to_torch"):
        mha.to_torch()


def test_rope_decode_with_cache_equals_full_forward():
    torch.manual_seed(0)
    rope = FakeRoPE(8)
    mha = MultiHeadAttention(32, 4, num_kv_heads=2, rope=rope).eval()
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        full = mha(x, causal=True)
        cache = mha.new_cache(2, 16)
        rope.seen.clear()
        steps = [mha(x[:, :4], cache=cache, causal=True)]  # prefill 4, then one at a time
        steps += [mha(x[:, t:t + 1], cache=cache, causal=True) for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), full, **FP32)
    # q and k rotated at prefill length + step (checklist 20)
    assert [p.tolist() for p in rope.seen[::2]] == [[0, 1, 2, 3], [4], [5], [6], [7], [8]]


def test_real_rope_matches_fake_convention():
    from qkv.modules import positions  # a plain import: a rename must fail, not skip

    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4, rope=positions.RoPE(8)).eval()
    x = torch.randn(1, 7, 32)
    fake = MultiHeadAttention(32, 4, rope=FakeRoPE(8)).eval()
    fake.load_state_dict(mha.state_dict())
    with torch.no_grad():
        full = mha(x, causal=True)
        torch.testing.assert_close(full, fake(x, causal=True), **FP32)  # same convention
        cache = mha.new_cache(1, 8)
        steps = [mha(x[:, t:t + 1], cache=cache, causal=True) for t in range(7)]
    torch.testing.assert_close(torch.cat(steps, 1), full, **FP32)


# --- errors ------------------------------------------------------------------------------------
def _mha(**kw) -> MultiHeadAttention:
    return MultiHeadAttention(16, 4, **kw)


@pytest.mark.parametrize("make,exc,match", [
    (lambda: MultiHeadAttention(10, 3), ValueError, "not divisible by num_heads=3"),
    (lambda: MultiHeadAttention(16, 4, num_kv_heads=3), ValueError, "multiple of num_kv_heads"),
    (lambda: MultiHeadAttention(16, 0), ValueError, "num_heads must be a positive int"),
    (lambda: MultiHeadAttention(16, 4, dropout=1.0), ValueError, "dropout"),
    (lambda: MultiHeadAttention(16, 4, backend="flash3"), ValueError, "backend"),
    (lambda: MultiHeadAttention(16, 4, rope=object()), TypeError, "rotate"),
    (lambda: MultiHeadAttention(16, 4, rope=FakeRoPE(8)), ValueError, "head_dim=8"),
])
def test_bad_construction(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


@pytest.mark.parametrize("call,exc,match", [
    (lambda m: m(torch.randn(5, 16)), ValueError, r"x must have shape .*got \(5, 16\)"),
    (lambda m: m(torch.randn(2, 5, 12)), ValueError, r"x must have shape \(B, N, C=16\)"),
    (lambda m: m([[1.0]]), TypeError, "x must be a torch.Tensor"),
    (lambda m: m(torch.randn(2, 5, 16), torch.randn(2, 3, 8)), ValueError,
     r"context must have shape \(B, S, Ckv=16\).*\(2, 3, 8\)"),
    (lambda m: m(torch.randn(2, 5, 16), torch.randn(3, 3, 16)), ValueError, "context has batch 3"),
    (lambda m: m(torch.randn(2, 5, 16), positions=torch.arange(5)), ValueError, "no rope"),
    (lambda m: m(torch.randn(2, 5, 16), torch.randn(2, 3, 16), cache=KVCache(2, 4, 8, 4)),
     ValueError, "project_kv"),
    (lambda m: m(torch.randn(2, 5, 16), cache="cache"), TypeError, "KVCache"),
    (lambda m: m(torch.randn(2, 5, 16), kv=torch.randn(2, 4, 3, 4)), TypeError, "pair"),
    (lambda m: m(torch.randn(2, 5, 16), kv=(torch.randn(2, 4, 3, 4), torch.randn(2, 4, 3, 5))),
     ValueError, r"\(B, Hkv, S, D\)"),
    (lambda m: m(torch.randn(2, 5, 16), torch.randn(2, 3, 16), kv=m.project_kv(
        torch.randn(2, 3, 16))), ValueError, "not both"),
    (lambda m: m(torch.randn(2, 5, 16), mask=torch.ones(2, 5, 5)), TypeError, "bool"),
])
def test_bad_forward_inputs(call, exc, match):
    with pytest.raises(exc, match=match):
        call(_mha())


def test_cross_only_module_refuses_self_attention():
    mha = MultiHeadAttention(16, 4, kv_dim=6)
    assert mha.in_proj is None
    with pytest.raises(ValueError, match="cross-attention only"):
        mha(torch.randn(1, 3, 16))


def test_bad_positions_with_rope():
    mha = MultiHeadAttention(32, 4, rope=FakeRoPE(8))
    with pytest.raises(ValueError, match=r"positions must be an integer tensor of shape \(N,\)"):
        mha(torch.randn(2, 5, 32), positions=torch.arange(4))
    with pytest.raises(ValueError, match="positions apply to self-attention"):
        mha(torch.randn(2, 5, 32), torch.randn(2, 3, 32), positions=torch.arange(5))


@pytest.mark.parametrize("kw,match", [
    ({"add_bias_kv": True}, "add_bias_kv"),
    ({"add_zero_attn": True}, "add_zero_attn"),
    ({"kdim": 6, "vdim": 7}, "kdim=6 != vdim=7"),
])
def test_from_torch_refusals(kw, match):
    with pytest.raises(ValueError, match=match):
        MultiHeadAttention.from_torch(nn.MultiheadAttention(16, 4, **kw))
    with pytest.raises(TypeError, match="MultiheadAttention"):
        MultiHeadAttention.from_torch(nn.Linear(4, 4))


def test_repr_and_attributes():
    mha = MultiHeadAttention(64, 8, num_kv_heads=2, kv_dim=32, bias=False, dropout=0.1)
    assert (mha.head_dim, mha.num_kv_heads, mha.kv_dim) == (8, 2, 32)
    assert mha.kv_proj.weight.shape == (2 * 2 * 8, 32) and mha.q_proj.bias is None
    assert "num_kv_heads=2" in repr(mha) and "kv_dim=32" in repr(mha)
