"""KVCache, and MultiHeadAttention decoding with it == the full causal forward.

Shapes: B batch, N query length, S key length, C model width, H heads, Hkv kv heads,
D head dim.

Tolerance: fp32 atol/rtol 1e-5 (the issue's bar; a decode step and the full forward reduce
over the same keys in a different blocking, ~1e-7 apart).
"""

from __future__ import annotations

import pytest
import torch

from qkv.masks import Causal, Padding
from qkv.modules import KVCache, MultiHeadAttention

FP32 = {"atol": 1e-5, "rtol": 1e-5}


# --- the cache itself --------------------------------------------------------------------------
def test_append_write_rewind_reset():
    cache = KVCache(2, 3, 8, 4, value_dim=5, dtype=torch.float32)
    assert (cache.length, cache.capacity, cache.keys.shape, cache.values.shape) == (
        0, 8, (2, 3, 8, 4), (2, 3, 8, 5))
    k, v = torch.randn(2, 3, 3, 4), torch.randn(2, 3, 3, 5)
    ks, vs = cache.append(k, v)
    assert cache.length == 3 and torch.equal(ks, k) and torch.equal(vs, v)
    k2, v2 = torch.randn(2, 3, 2, 4), torch.randn(2, 3, 2, 5)
    ks, vs = cache.append(k2, v2)
    assert cache.length == 5 and torch.equal(ks, torch.cat([k, k2], 2))
    assert ks.data_ptr() == cache.keys.data_ptr()  # a view of the buffer, no copy
    # write at a position before the end rewinds: the cache then ends after that write
    k3, v3 = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 5)
    ks, vs = cache.write(k3, v3, 1)
    assert cache.length == 2
    assert torch.equal(ks, torch.cat([k[:, :, :1], k3], 2))
    assert torch.equal(vs, torch.cat([v[:, :, :1], v3], 2))
    cache.reset()
    assert cache.length == 0 and cache.get()[0].shape == (2, 3, 0, 4)
    assert "length=0" in repr(cache)


def test_write_past_capacity_raises_and_keeps_state():
    cache = KVCache(1, 2, 4, 8)
    cache.append(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
    with pytest.raises(ValueError, match=r"would fill 5 > capacity 4"):
        cache.append(torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8))
    assert cache.length == 3
    cache.append(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))  # exactly full is fine
    assert cache.length == 4


@pytest.mark.parametrize("call,exc,match", [
    (lambda c: c.append(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 2, 8)), ValueError,
     "lengths differ"),
    (lambda c: c.append(torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8)), ValueError,
     r"k must have shape \(B, Hkv, n, D\) = \(1, 2, 'n', 8\), got \(1, 3, 1, 8\)"),
    (lambda c: c.append(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 7)), ValueError, "v must"),
    (lambda c: c.append(torch.randn(1, 2, 1, 8).double(), torch.randn(1, 2, 1, 8).double()),
     TypeError, "float64"),
    (lambda c: c.write(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), 3), ValueError,
     "no gaps"),
    (lambda c: c.append(torch.randn(1, 2, 1, 8, requires_grad=True), torch.randn(1, 2, 1, 8)),
     RuntimeError, "no_grad"),
    (lambda c: c.append("k", "v"), TypeError, "k must be a torch.Tensor"),
])
def test_bad_writes(call, exc, match):
    cache = KVCache(1, 2, 4, 8)
    with pytest.raises(exc, match=match):
        call(cache)
    assert cache.length == 0


@pytest.mark.parametrize("kw,match", [
    ({"capacity": 0}, "capacity must be a positive int"),
    ({"head_dim": 2.0}, "head_dim"),
    ({"dtype": torch.int64}, "floating dtype"),
])
def test_bad_construction(kw, match):
    args = {"batch": 1, "num_kv_heads": 2, "capacity": 4, "head_dim": 8, **kw}
    with pytest.raises((ValueError, TypeError), match=match):
        KVCache(args.pop("batch"), args.pop("num_kv_heads"), args.pop("capacity"),
                args.pop("head_dim"), **args)


# --- decoding with MultiHeadAttention ----------------------------------------------------------
@pytest.mark.parametrize("batch,n,dim,heads,kv_heads,prefill", [
    (1, 7, 16, 4, 4, 0),      # token by token from the start
    (2, 17, 32, 4, 2, 5),     # GQA, prefill then decode
    (3, 9, 24, 6, 1, 1),      # MQA, head dim 4
    (2, 12, 80, 1, 1, 11),    # one head, head dim 80, a single decode step
])
def test_decode_equals_full_causal_forward(batch, n, dim, heads, kv_heads, prefill):
    torch.manual_seed(0)
    mha = MultiHeadAttention(dim, heads, num_kv_heads=kv_heads).eval()
    x = torch.randn(batch, n, dim)  # (B, N, C)
    with torch.no_grad():
        full, full_w = mha(x, causal=True, need_weights=True)
        cache = mha.new_cache(batch, n + 3)
        assert cache.keys.shape == (batch, kv_heads, n + 3, dim // heads)
        outs = []
        if prefill:
            outs.append(mha(x[:, :prefill], cache=cache, causal=True))
        for t in range(prefill, n):
            out, w = mha(x[:, t:t + 1], cache=cache, causal=True, need_weights=True)
            assert w.shape == (batch, heads, 1, t + 1)  # (B, H, 1, S)
            torch.testing.assert_close(w[:, :, 0], full_w[:, :, t, :t + 1], **FP32)
            outs.append(out)
    assert cache.length == n
    torch.testing.assert_close(torch.cat(outs, 1), full, **FP32)


def test_decode_with_left_padding_equals_full_forward():
    """Left-padded prompts: Padding(keep) over the keys so far, under inference_mode."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, num_kv_heads=2).eval()
    x = torch.randn(2, 10, 16)
    keep = torch.ones(2, 10, dtype=torch.bool)
    keep[1, :3] = False  # row 1 starts with 3 pad tokens
    cache = mha.new_cache(2, 10)  # created outside inference_mode, written inside: allowed
    with torch.inference_mode():
        full = mha(x, mask=Causal() & Padding(keep=keep))
        outs = [mha(x[:, :4], cache=cache, mask=Causal() & Padding(keep=keep[:, :4]))]
        for t in range(4, 10):
            outs.append(mha(x[:, t:t + 1], cache=cache, mask=Padding(keep=keep[:, :t + 1]),
                            causal=True))
    got = torch.cat(outs, 1)
    torch.testing.assert_close(got, full, **FP32)
    # pad queries attend nothing: their attention output is 0, so out == out_proj.bias
    torch.testing.assert_close(got[1, :3], mha.out_proj.bias.expand(3, 16), atol=0, rtol=0)


def test_cache_overflow_and_mismatch_through_module():
    mha = MultiHeadAttention(16, 4, num_kv_heads=2).eval()
    with torch.no_grad():
        cache = mha.new_cache(1, 4)
        mha(torch.randn(1, 3, 16), cache=cache, causal=True)
        with pytest.raises(ValueError, match="capacity 4"):
            mha(torch.randn(1, 2, 16), cache=cache, causal=True)
        assert cache.length == 3
        with pytest.raises(ValueError, match=r"k must have shape \(B, Hkv, n, D\)"):
            mha(torch.randn(1, 1, 16), cache=KVCache(1, 4, 8, 4), causal=True)  # Hkv 4 != 2
        with pytest.raises(TypeError, match="float64"):
            mha(torch.randn(1, 1, 16), cache=KVCache(1, 2, 8, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="no_grad"):  # autograd recording: refused clearly
        mha(torch.randn(1, 1, 16), cache=mha.new_cache(1, 4), causal=True)


def test_encoder_decoder_step_with_cross_kv_reused():
    """A decoder step = self-attention with a cache + cross-attention on project_kv(memory)
    computed once; token by token equals running the whole target at once."""
    torch.manual_seed(0)
    self_attn = MultiHeadAttention(16, 4).eval()
    cross = MultiHeadAttention(16, 4, num_kv_heads=2, kv_dim=12).eval()
    memory = torch.randn(2, 5, 12)  # (B, S, Ckv) encoder output
    y = torch.randn(2, 6, 16)  # (B, N, C) target
    src_keep = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])  # (B, S)

    def layer(h, cache=None, kv=None):
        h = h + self_attn(h, cache=cache, causal=True)
        return h + cross(h, kv=kv, mask=Padding(keep=src_keep))

    with torch.no_grad():
        kv = cross.project_kv(memory)
        full = layer(y, kv=kv)
        torch.testing.assert_close(full, y + self_attn(y, causal=True) + cross(
            y + self_attn(y, causal=True), memory, mask=Padding(keep=src_keep)), **FP32)
        cache = self_attn.new_cache(2, 6)
        steps = [layer(y[:, t:t + 1], cache=cache, kv=kv) for t in range(6)]
    torch.testing.assert_close(torch.cat(steps, 1), full, **FP32)
