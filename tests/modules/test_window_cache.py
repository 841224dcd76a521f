"""WindowKVCache (ring buffer for sliding-window attention) and LinearCache.

Shapes: B batch, N query length, S key length, C model width, H heads, Hkv kv heads,
D head dim, W window.

Oracles: a plain KVCache holding every position (the window cache must return exactly its
last ``kept + n`` positions: torch.equal), and MultiHeadAttention's full forward with the
band materialised as a dense bool mask (fp32 atol/rtol 1e-5, as tests/modules/test_kv_cache).
"""

from __future__ import annotations

import pytest
import torch

from qkv.masks import SlidingWindow
from qkv.modules import KVCache, MultiHeadAttention
from qkv.modules.cache import LinearCache, WindowKVCache
from qkv.ops.linear import LinearState
from qkv.positions import RoPE

FP32 = {"atol": 1e-5, "rtol": 1e-5}


def band(n: int, w: int) -> torch.Tensor:
    """(N, N) bool: j <= i and i - j < W."""
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return (j <= i) & (i - j < w)


@pytest.mark.parametrize("window", [1, 2, 5])
def test_append_returns_last_positions_and_memory_stays(window):
    full = KVCache(2, 3, 64, 4, value_dim=5)
    cache = WindowKVCache(2, 3, window, 4, value_dim=5)
    shapes = (cache.keys.shape, cache.values.shape)
    assert shapes == ((2, 3, window - 1, 4), (2, 3, window - 1, 5))
    nbytes = cache.nbytes
    for n in (1, 3, 1, 7, 1, 1, 2, 10, 1):
        start = full.length
        k, v = torch.randn(2, 3, n, 4), torch.randn(2, 3, n, 5)
        assert cache.key_length(n) == min(start, window - 1) + n
        fk, fv = full.append(k, v)
        ks, vs = cache.append(k, v)
        first = start - min(start, window - 1)
        assert torch.equal(ks, fk[:, :, first:]) and torch.equal(vs, fv[:, :, first:])
        assert cache.length == full.length and cache.kept == min(full.length, window - 1)
        gk, gv = cache.get()
        assert torch.equal(gk, fk[:, :, fk.shape[2] - cache.kept:])
        assert torch.equal(gv, fv[:, :, fv.shape[2] - cache.kept:])
        assert (cache.keys.shape, cache.values.shape) == shapes and cache.nbytes == nbytes
    cache.reset()
    assert cache.length == 0 and cache.get()[0].shape == (2, 3, 0, 4)
    assert "window=" in repr(cache)


def test_capacity_bounds_length_not_memory():
    cache = WindowKVCache(1, 2, 4, 8, capacity=5)
    assert cache.capacity == 5 and cache.slots == 3
    cache.append(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))
    with pytest.raises(ValueError, match=r"would fill 6 > capacity 5"):
        cache.append(torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8))
    assert cache.length == 4
    assert WindowKVCache(1, 2, 16, 8, capacity=3).slots == 3  # never more than capacity
    assert WindowKVCache(1, 2, 16, 8).capacity is None


@pytest.mark.parametrize("call,exc,match", [
    (lambda c: c.write(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), 0), ValueError,
     "writes only append"),
    (lambda c: c.append(torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8)), ValueError,
     r"WindowKVCache: k must have shape"),
    (lambda c: c.append(torch.randn(1, 2, 1, 8).double(), torch.randn(1, 2, 1, 8).double()),
     TypeError, "float64"),
    (lambda c: c.append(torch.randn(1, 2, 1, 8, requires_grad=True), torch.randn(1, 2, 1, 8)),
     RuntimeError, "no_grad"),
])
def test_bad_writes(call, exc, match):
    cache = WindowKVCache(1, 2, 4, 8)
    cache.append(torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8))
    with pytest.raises(exc, match=match):
        call(cache)
    assert cache.length == 2


@pytest.mark.parametrize("kw,match", [
    ({"window": 0}, "window must be a positive int"),
    ({"capacity": 0}, "capacity must be a positive int"),
    ({"dtype": torch.int64}, "floating dtype"),
])
def test_bad_construction(kw, match):
    args = {"window": 4, **kw}
    with pytest.raises((ValueError, TypeError), match=match):
        WindowKVCache(1, 2, args.pop("window"), 8, **args)


@pytest.mark.parametrize("heads,kv_heads,rope,chunks", [
    (4, 4, False, [1] * 23),              # token by token
    (4, 2, True, [5, 1, 1, 9, 1, 6]),     # GQA + RoPE, prefill and chunks longer than W
    (2, 1, True, [23]),                   # one call: the cache only keeps the tail
])
def test_mha_window_decode_equals_full_band_forward(heads, kv_heads, rope, chunks):
    w, n, dim = 4, 23, 16
    torch.manual_seed(0)
    mha = MultiHeadAttention(dim, heads, num_kv_heads=kv_heads,
                             rope=RoPE(dim // heads) if rope else None).eval()
    x = torch.randn(2, n, dim)
    with torch.no_grad():
        want = mha(x, mask=band(n, w))  # the band as a dense bool mask
        cache = WindowKVCache(2, kv_heads, w, dim // heads)
        outs, t = [], 0
        for c in chunks:
            outs.append(mha(x[:, t:t + c], mask=SlidingWindow(w, causal=True), cache=cache))
            t += c
    torch.testing.assert_close(torch.cat(outs, dim=1), want, **FP32)
    assert cache.length == n and cache.keys.shape[2] == w - 1


def test_linear_cache_state_and_errors():
    cache = LinearCache(2, 4, 8, 6, capacity=3)
    assert cache.nbytes == 0 and cache.state is None and cache.key_length(2) == 2
    state = LinearState(torch.zeros(2, 4, 8, 6), torch.zeros(2, 4, 8))
    cache.update(state, 2)
    assert cache.length == 2 and cache.nbytes == (2 * 4 * 8 * 6 + 2 * 4 * 8) * 4
    with pytest.raises(ValueError, match="would pass capacity 3"):
        cache.update(state, 2)
    with pytest.raises(ValueError, match=r"state.kv must be \(B, H, D', Dv\)"):
        cache.update(LinearState(torch.zeros(2, 4, 8, 5), torch.zeros(2, 4, 8)), 1)
    with pytest.raises(TypeError, match="LinearState"):
        cache.update((state.kv, state.z), 1)
    cache.reset()
    assert cache.length == 0 and cache.state is None and "LinearCache(" in repr(cache)
    with pytest.raises(ValueError, match="feature_dim must be a positive int"):
        LinearCache(1, 1, 0, 4)


def test_reorder_rows_for_beam_search():
    cache = WindowKVCache(3, 2, 4, 8)
    k, v = torch.randn(3, 2, 6, 8), torch.randn(3, 2, 6, 8)
    cache.append(k, v)
    idx = torch.tensor([2, 0, 0])
    cache.reorder(idx)
    gk, gv = cache.get()
    assert torch.equal(gk, k[idx, :, 3:]) and torch.equal(gv, v[idx, :, 3:])
    lin = LinearCache(3, 2, 8, 6)
    lin.update(LinearState(torch.randn(3, 2, 8, 6), torch.randn(3, 2, 8), torch.randn(3, 2)), 1)
    before = lin.state
    lin.reorder(idx)
    assert all(torch.equal(a, b[idx]) for a, b in zip(lin.state, before, strict=True))
