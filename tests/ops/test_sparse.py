"""Sparse patterns (SlidingWindow, Longformer, BigBird, BlockSparse) against dense attention
with the same boolean mask, materialised only here (checklist 10).

Tolerances: fp64 paths vs the fp64 reference at 1e-10; fp32 vs the fp64 reference at
atol 5e-5, rtol 5e-6 (outputs and gradients).
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.masks import BigBird, BlockSparse, Causal, Longformer, Padding, SlidingWindow
from qkv.ops.chunked import chunked_attention


def _qkv(b, h, n, s, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, length, d, generator=g, dtype=dtype).requires_grad_()
                 for length in (n, s, s))


def _dense(q, k, v, keep, scale):
    """Plain masked softmax attention in fp64 with empty rows -> 0."""
    scores = (q.double() @ k.double().transpose(-2, -1)) * scale
    scores = scores.masked_fill(~keep, float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return p @ v.double()


def _layout(nb, sb, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(nb, sb, generator=g) < 0.35


PATTERNS = {
    "window-causal": lambda n, s: SlidingWindow(7, causal=True),
    "window-bidir": lambda n, s: SlidingWindow(5, causal=False),
    "window-wide": lambda n, s: SlidingWindow(300, causal=True),
    "longformer": lambda n, s: Longformer(4, [g for g in (0, 3, n - 1) if g < n]),
    "bigbird": lambda n, s: BigBird(8, window_blocks=3, global_blocks=1, random_blocks=2,
                                    seed=1),
    "bigbird-causal": lambda n, s: BigBird(8, random_blocks=1, causal=True),
    "blocksparse": lambda n, s: BlockSparse(_layout(-(-n // 8), -(-s // 8), 2), 8),
}


SHAPES = [(1, 1), (17, 17), (45, 45), (29, 61), (61, 29)]
CASES = [(name, n, s) for name in PATTERNS for n, s in SHAPES
         if name != "longformer" or n == s]  # Longformer's global tokens: self-attention


@pytest.mark.parametrize("name,n,s", CASES)
@pytest.mark.parametrize("padded", [False, True], ids=["", "padding"])
def test_pattern_equals_dense_fp64(name, n, s, padded):
    mask = PATTERNS[name](n, s)
    if padded:
        mask = mask & Padding(torch.tensor([s, max(1, s // 2)]))
    q, k, v = _qkv(2, 2, n, s, 8, torch.float64)
    out = qkv.attention(q, k, v, mask=mask, scale=0.4, backend="chunked")
    keep = mask.dense(n, s)
    want = _dense(q, k, v, keep, 0.4)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    g = torch.randn_like(want)
    got = torch.autograd.grad(out, (q, k, v), g)
    ref = torch.autograd.grad(want, (q, k, v), g)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("name", ["window-causal", "window-bidir", "bigbird"])
def test_fp32_against_fp64(name):
    n = 203
    mask = PATTERNS[name](n, n)
    q, k, v = _qkv(1, 4, n, n, 24, torch.float32, seed=3)
    out = qkv.attention(q, k, v, mask=mask, backend="chunked")
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = _dense(q64, k64, v64, mask.dense(n, n), 24 ** -0.5)
    torch.testing.assert_close(out.double(), want, atol=5e-5, rtol=5e-6)
    g = torch.randn_like(want)
    got = torch.autograd.grad(out, (q, k, v), g.float())
    ref = torch.autograd.grad(want, (q64, k64, v64), g)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a.double(), b, atol=5e-5, rtol=5e-6)


def test_window_fast_path_equals_explicit_tiles():
    """The fused window path and the generic tiles agree (fp64, 1e-12)."""
    q, k, v = _qkv(1, 2, 300, 300, 16, torch.float64)
    mask = SlidingWindow(33, causal=True)
    fast = qkv.attention(q, k, v, mask=mask, backend="chunked")
    tiles = chunked_attention(q, k, v, mask=mask, scale=0.25, block_q=64, block_k=64)[0]
    torch.testing.assert_close(fast, tiles, atol=1e-12, rtol=1e-12)


def test_rows_without_keys_are_zero_with_finite_grads():
    """Causal window with N > S: the first N - S queries see nothing."""
    q, k, v = _qkv(1, 2, 9, 4, 8, torch.float32)
    out = qkv.attention(q, k, v, mask=SlidingWindow(3), backend="chunked")
    assert torch.equal(out[:, :, :5], torch.zeros_like(out[:, :, :5]))
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.equal(q.grad[:, :, :5],
                                                          torch.zeros_like(q.grad[:, :, :5]))


def test_auto_sends_long_sparse_masks_to_chunked():
    q = k = v = torch.randn(1, 1, 2048, 8)
    reasons = qkv.explain(q, k, v, mask=SlidingWindow(64))
    assert "sparse mask" in reasons["sdpa"] and reasons["chunked"] is None
    short = qkv.explain(q[:, :, :64], k[:, :, :64], v[:, :, :64], mask=SlidingWindow(8))
    assert short["sdpa"] is None  # small problems: a dense kernel is fastest


def test_tiles_skip_dead_blocks():
    """BlockSparse with an empty layout row: that query block attends nothing (zeros) and
    the tile loop never asks for its tiles."""
    layout = torch.ones(4, 4, dtype=torch.bool)
    layout[1] = False
    mask = BlockSparse(layout, 8)
    q, k, v = _qkv(1, 1, 32, 32, 4, torch.float64)
    out = qkv.attention(q, k, v, mask=mask, backend="chunked")
    assert torch.equal(out[:, :, 8:16], torch.zeros_like(out[:, :, 8:16]))
    assert mask.block(8, 16, 0, 32, 32, 32, torch.device("cpu")) is False


def test_bigbird_is_reproducible_and_seeded():
    a, b, c = BigBird(16, seed=5), BigBird(16, seed=5), BigBird(16, seed=6)
    assert torch.equal(a.layout(256, 256), b.layout(256, 256))
    assert not torch.equal(a.layout(256, 256), c.layout(256, 256))


def test_sparse_masks_combine_with_causal_and_validate():
    mask = Causal() & SlidingWindow(4, causal=False)
    assert mask.sparse
    keep = mask.dense(6, 6)[0, 0]
    assert keep.sum(dim=1).tolist() == [1, 2, 3, 4, 4, 4]
    q = k = v = torch.randn(1, 1, 16, 4)
    with pytest.raises(ValueError, match="layout has"):
        qkv.attention(q, k, v, mask=BlockSparse(torch.ones(3, 3, dtype=torch.bool), 8))
    with pytest.raises(ValueError, match="window must be a positive int"):
        SlidingWindow(0)


def test_window_in_multihead_attention():
    mha = qkv.MultiHeadAttention(32, 4).eval()
    x = torch.randn(2, 40, 32)
    full = mha(x, mask=SlidingWindow(6))
    dense = mha(x, mask=SlidingWindow(6).dense(40, 40))
    torch.testing.assert_close(full, dense, atol=1e-5, rtol=1e-5)


def test_gathered_block_tiles_with_bias_and_padding():
    """Block-sparse masks gather each query block's live key blocks into one tile; with a
    dense bias (its gradient too) and padding, fp64 against the reference at 1e-10."""
    n = 100
    q, k, v = _qkv(2, 2, n, n, 8, torch.float64, seed=4)
    bias = torch.randn(1, 2, n, n, dtype=torch.float64, requires_grad=True)
    mask = BigBird(8, random_blocks=2, seed=3) & Padding(torch.tensor([100, 37]))
    out = qkv.attention(q, k, v, mask=mask, bias=bias, backend="chunked")
    want = qkv.attention(q, k, v, mask=mask, bias=bias, backend="reference")
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    got = torch.autograd.grad(out.sum(), (q, k, v, bias))
    ref = torch.autograd.grad(want.sum(), (q, k, v, bias))
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("n,s", [(203, 203), (45, 203), (203, 45), (2, 1), (61, 29)])
def test_bigbird_live_tiles_are_the_live_blocks(n, s, causal):
    """live_key_tiles (what the chunked backend gathers) lists exactly the key blocks in
    which some query of the block may attend some key, misaligned and causal included."""
    bs = 16
    mask = BigBird(bs, window_blocks=3, global_blocks=1, random_blocks=2, seed=2,
                   causal=causal)
    dense = mask.dense(n, s)[0, 0]
    for i0 in range(0, n, bs):
        i1 = min(n, i0 + bs)
        want = [(j0, min(s, j0 + bs)) for j0 in range(0, s, bs)
                if bool(dense[i0:i1, j0:j0 + bs].any())]
        assert mask.live_key_tiles(i0, i1, n, s) == want, (i0, i1)
