"""The fused block-sparse path (qkv.ops.sparse.block_sparse_attention: torch's CPU flash
kernel per query block over the gathered live key blocks) against the chunked backend's
explicit tiles and a dense fp64 reference over a keep matrix rebuilt here from each
pattern's documented meaning (``independent_keep``; ``mask.dense`` only for BigBird's
random blocks, which cannot be recomputed and are checked in test_sparse_oracle.py).

Tolerances: fp32 outputs and q/k/v gradients vs the fp64 reference at atol 5e-5, rtol 5e-6
(the fused and tile paths each, hence also against each other); fp64 at 1e-10.
"""

from __future__ import annotations

import pytest
import torch

from qkv.masks import And, BigBird, BlockSparse, Causal, Longformer, Padding
from qkv.ops import chunked as chunked_mod
from qkv.ops import sparse as sparse_mod
from qkv.ops.chunked import chunked_attention
from qkv.ops.sparse import block_sparse_attention, block_sparse_refusal

SCALE = 0.3


def _qkv(b, h, n, s, d, dtype, seed=0, hkv=None):
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, h, n, d), (b, hkv or h, s, d), (b, hkv or h, s, d))
    return tuple(torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()
                 for shape in shapes)


def _dense(q, k, v, keep):
    """fp64 masked softmax attention; rows with no key -> 0."""
    heads = q.shape[1]
    k = k.double().repeat_interleave(heads // k.shape[1], dim=1)
    v = v.double().repeat_interleave(heads // v.shape[1], dim=1)
    scores = (q.double() @ k.transpose(-2, -1)) * SCALE
    p = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1).nan_to_num(0.0)
    return p @ v


def _grads(out, inputs, d_out):
    return torch.autograd.grad(out, inputs, d_out)


def _per_head_layout(h, nb, sb, seed, empty_row=None):
    g = torch.Generator().manual_seed(seed)
    lay = torch.rand(h, nb, sb, generator=g) < 0.4
    if empty_row is not None and nb > empty_row + 1:
        lay[:, empty_row] = False  # a fully-masked query block in every head
        lay[0, (empty_row + 1) % nb] = False  # ... and one in head 0 only
    return lay


PATTERNS = {
    "bigbird": lambda n, s: BigBird(8, window_blocks=3, global_blocks=1, random_blocks=2,
                                    seed=1),
    "bigbird-causal": lambda n, s: BigBird(8, window_blocks=3, global_blocks=1,
                                           random_blocks=1, seed=3, causal=True),
    "bigbird-global2": lambda n, s: BigBird(8, window_blocks=1, global_blocks=2,
                                            random_blocks=0),
    "blocksparse-heads": lambda n, s: BlockSparse(
        _per_head_layout(2, -(-n // 8), -(-s // 8), 2, empty_row=1), 8),
    "blocksparse-batch-heads": lambda n, s: BlockSparse(
        torch.rand(2, 2, -(-n // 8), -(-s // 8), generator=torch.Generator().manual_seed(5))
        < 0.3, 8),
    "longformer": lambda n, s: Longformer(5, [g for g in (0, 3, 20) if g < min(n, s)]),
    "longformer-causal": lambda n, s: Longformer(4, [g for g in (1, 17) if g < min(n, s)],
                                                 causal=True),
}
SHAPES = [(45, 45), (29, 61), (61, 29), (8, 8), (1, 1)]


def _expand(lay, n, s, bs):
    """Element keep (..., N, S) of a block layout (..., ceil(N/bs), ceil(S/bs))."""
    return lay[..., (torch.arange(n) // bs)[:, None], (torch.arange(s) // bs)[None, :]]


def _longformer_keep(n, s, window, glob, causal):
    """Longformer from its docstring: query i at p = i + S - N sees the window band
    (causal: 0 <= p - j < W; else |j - p| < W), global query rows and global key columns;
    causal also j <= p."""
    rows = []
    for i in range(n):
        p = i + s - n
        rows.append([((0 <= p - j < window) if causal else abs(j - p) < window)
                     or i in glob or j in glob for j in range(s)])
        if causal:
            rows[-1] = [ok and j <= p for j, ok in enumerate(rows[-1])]
    return torch.tensor(rows, dtype=torch.bool).reshape(n, s)


def _bigbird_plain_keep(n, s, bs, window_blocks, global_blocks):
    """BigBird without random blocks, not causal: query block a sits at key block
    a' = (a·bs + S - N) // bs and sees |b - a'| <= (w-1)/2, the first G key blocks, and
    everything when 0 <= a' < G."""
    nb, sb = -(-n // bs), -(-s // bs)
    half = (window_blocks - 1) // 2
    lay = torch.tensor([[abs(b - (a * bs + s - n) // bs) <= half or b < global_blocks
                         or 0 <= (a * bs + s - n) // bs < global_blocks for b in range(sb)]
                        for a in range(nb)], dtype=torch.bool).reshape(nb, sb)
    return _expand(lay, n, s, bs)


def independent_keep(name, n, s):
    """The keep matrix of ``PATTERNS[name]`` rebuilt without qkv.masks, or None where the
    pattern draws random blocks (those are checked against their documented structure in
    test_sparse_oracle.py; here ``mask.dense`` stands in)."""
    nb, sb = -(-n // 8), -(-s // 8)
    if name == "blocksparse-heads":
        return _expand(_per_head_layout(2, nb, sb, 2, empty_row=1), n, s, 8)[None]
    if name == "blocksparse-batch-heads":
        lay = torch.rand(2, 2, nb, sb, generator=torch.Generator().manual_seed(5)) < 0.3
        return _expand(lay, n, s, 8)
    if name == "longformer":
        return _longformer_keep(n, s, 5, [g for g in (0, 3, 20) if g < min(n, s)], False)
    if name == "longformer-causal":
        return _longformer_keep(n, s, 4, [g for g in (1, 17) if g < min(n, s)], True)
    if name == "bigbird-global2":
        return _bigbird_plain_keep(n, s, 8, 1, 2)
    return None


def _keep(name, mask, n, s):
    keep = independent_keep(name, n, s)
    return mask.dense(n, s) if keep is None else keep
CASES = [(name, n, s) for name in PATTERNS for n, s in SHAPES]


def _tiles(q, k, v, mask):
    """The explicit-tile path (forced by giving block sizes)."""
    bq, bk = (mask.tile, mask.tile) if mask.tile is not None else (16, 32)
    return chunked_attention(q, k, v, mask=mask, scale=SCALE, block_q=bq, block_k=bk)[0]


@pytest.mark.parametrize("name,n,s", CASES)
def test_fused_equals_tiles_equals_fp64_reference(name, n, s, monkeypatch):
    mask = PATTERNS[name](n, s)
    mask.validate(2, 2, n, s)
    calls = []
    real = sparse_mod.block_sparse_attention
    monkeypatch.setattr(chunked_mod, "block_sparse_attention",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = _qkv(2, 2, n, s, 8, torch.float32, seed=n * 100 + s)
    d_out = torch.randn(2, 2, n, 8, generator=torch.Generator().manual_seed(9))
    keep = _keep(name, mask, n, s)
    want = _dense(q, k, v, keep)
    want_g = _grads(want, (q, k, v), d_out.double())
    fused = chunked_attention(q, k, v, mask=mask, scale=SCALE)[0]
    assert calls, "the fused block-sparse path did not run"
    tiles = _tiles(q, k, v, mask)
    for got in (fused, tiles):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, atol=5e-5, rtol=5e-6)
        for a, b in zip(_grads(got, (q, k, v), d_out), want_g, strict=True):
            torch.testing.assert_close(a.double(), b.double(), atol=5e-5, rtol=5e-6)


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_fp64_at_1e10_and_lse(name):
    n, s = 37, 53
    mask = PATTERNS[name](n, s)
    q, k, v = _qkv(2, 2, n, s, 8, torch.float64, seed=4)
    keep = _keep(name, mask, n, s)
    out, lse = chunked_attention(q, k, v, mask=mask, scale=SCALE)
    torch.testing.assert_close(out, _dense(q, k, v, keep), atol=1e-10, rtol=1e-10)
    scores = (q @ k.transpose(-2, -1)) * SCALE
    want_lse = torch.logsumexp(scores.masked_fill(~keep, float("-inf")), dim=-1)
    torch.testing.assert_close(lse, want_lse, atol=1e-10, rtol=1e-10)  # -inf where dead
    got = torch.autograd.grad(out.sum(), (q, k, v))
    ref = torch.autograd.grad(_dense(q, k, v, keep).sum(), (q, k, v))
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_fully_masked_query_blocks_are_zero_with_zero_grads():
    """Empty layout rows (all heads, and head 0 only): zeros, finite zero grads, lse -inf."""
    n = s = 40
    lay = _per_head_layout(2, 5, 5, 7, empty_row=2)
    mask = BlockSparse(lay, 8)
    q, k, v = _qkv(1, 2, n, s, 8, torch.float32, seed=1)
    out, lse = chunked_attention(q, k, v, mask=mask, scale=SCALE)
    dead = ~mask.dense(n, s).any(dim=-1).expand(1, 2, n)  # (B, H, N)
    assert dead[:, :, 16:24].all() and dead[0, 0, 24:32].all() and not dead[0, 1, 24:32].any()
    assert torch.equal(out[dead], torch.zeros_like(out[dead]))
    assert torch.isinf(lse[dead]).all() and torch.isfinite(lse[~dead]).all()
    gq, gk, gv = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in (gq, gk, gv))
    assert torch.equal(gq[dead], torch.zeros_like(gq[dead]))


def test_causal_bigbird_with_more_queries_than_keys():
    """N > S causal: the first N - S rows see no key -> zeros; the rest match fp64."""
    n, s = 50, 21
    mask = BigBird(8, window_blocks=3, global_blocks=1, random_blocks=1, causal=True)
    q, k, v = _qkv(1, 2, n, s, 8, torch.float32, seed=2)
    out = chunked_attention(q, k, v, mask=mask, scale=SCALE)[0]
    assert torch.equal(out[:, :, :n - s], torch.zeros_like(out[:, :, :n - s]))
    torch.testing.assert_close(out.double(), _dense(q, k, v, mask.dense(n, s)),
                               atol=5e-5, rtol=5e-6)
    gq = torch.autograd.grad(out.sum(), q)[0]
    assert torch.isfinite(gq).all() and not gq[:, :, :n - s].any()


def test_longformer_row_blocks_and_grouped_kv():
    """Longformer with several row blocks (rows=16), global rows inside and across blocks,
    and grouped keys/values (Hkv=1 expanded by the caller) against fp64."""
    n = s = 70
    mask = Longformer(6, [0, 15, 16, 40, 69])
    q, k, v = _qkv(1, 4, n, s, 8, torch.float32, seed=3, hkv=1)
    ke, ve = k.expand(1, 4, s, 8), v.expand(1, 4, s, 8)
    out, lse = block_sparse_attention(q, ke, ve, mask=mask, scale=SCALE, rows=16)
    want = _dense(q, k, v, mask.dense(n, s))
    torch.testing.assert_close(out.double(), want, atol=5e-5, rtol=5e-6)
    assert torch.isfinite(lse).all()  # every row sees its own window
    d_out = torch.randn(1, 4, n, 8, generator=torch.Generator().manual_seed(1))
    for a, b in zip(_grads(out, (q, k, v), d_out), _grads(want, (q, k, v), d_out.double()),
                    strict=True):
        torch.testing.assert_close(a.double(), b.double(), atol=5e-5, rtol=5e-6)


def _spy_flash_refuse_tiles(monkeypatch) -> dict[str, int]:
    """Count calls of the flash forward/backward ops ({"fwd": n, "bwd": n}, updated as they
    run) and make the explicit tile loops raise."""
    counts = {"fwd": 0, "bwd": 0}
    real_fwd, real_bwd = sparse_mod._flash_fwd, sparse_mod._flash_bwd

    def fwd(*a, **kw):
        counts["fwd"] += 1
        return real_fwd(*a, **kw)

    def bwd(*a, **kw):
        counts["bwd"] += 1
        return real_bwd(*a, **kw)

    def refuse(*a, **kw):
        raise AssertionError("explicit tiles ran")

    monkeypatch.setattr(sparse_mod, "_flash_fwd", fwd)
    monkeypatch.setattr(sparse_mod, "_flash_bwd", bwd)
    monkeypatch.setattr(chunked_mod, "tiles_forward", refuse)
    monkeypatch.setattr(chunked_mod, "tiles_backward", refuse)
    return counts


def test_fused_path_calls_the_kernel_and_never_the_tiles(monkeypatch):
    """Spy: with a plain BigBird mask the flash forward/backward ops run (one call per
    query block at most) and the explicit tile loops never do."""
    counts = _spy_flash_refuse_tiles(monkeypatch)
    q, k, v = _qkv(1, 2, 64, 64, 8, torch.float32)
    out = chunked_attention(q, k, v, mask=BigBird(8, random_blocks=1), scale=SCALE)[0]
    out.sum().backward()
    # 8 query blocks; the global block 0 sees every key; non-causal: it stands alone
    assert 1 <= counts["fwd"] <= 8 and counts["bwd"] == counts["fwd"]


def test_refusals_keep_the_tile_path():
    q = torch.randn(1, 1, 16, 4)
    bb = BigBird(8)
    assert block_sparse_refusal(q, bb, None, 0.0) is None
    assert "bias" in block_sparse_refusal(q, bb, torch.zeros(16, 16), 0.0)
    assert "dropout" in block_sparse_refusal(q, bb, None, 0.1)
    assert block_sparse_refusal(q, bb & Padding(torch.tensor([9])), None, 0.0) is None
    assert block_sparse_refusal(q, bb & Causal(), None, 0.0) is not None
    assert block_sparse_refusal(q, bb & BigBird(8), None, 0.0) is not None
    assert block_sparse_refusal(q, Padding(torch.tensor([9])), None, 0.0) is not None


# --- block-sparse & Padding ------------------------------------------------------------------

PADDINGS = {
    # lengths 0 and 1, and ends inside a block (not a multiple of 8); clipped to S
    "lengths-0": lambda s: Padding(torch.tensor([0, max(0, s - 3)])),
    "lengths-1": lambda s: Padding(torch.tensor([1, min(s, 13)])),
    "keep": lambda s: Padding(keep=torch.rand(2, s, generator=torch.Generator().manual_seed(s))
                              < 0.7),
    "two-paddings": lambda s: And((Padding(torch.tensor([s, min(s, 21)])),
                                   Padding(torch.tensor([min(s, 30), s])))),
}
PAD_SHAPES = [(45, 45), (29, 61), (61, 29)]


def _padding_keep(pad: str, s: int):
    """``PADDINGS[pad]`` from its meaning (key j of row b is real iff j < lengths[b], or
    keep[b, j]), without qkv.masks: (B, 1, 1, S)."""
    def below(lengths):
        return torch.tensor([[j < length for j in range(s)] for length in lengths])
    if pad == "lengths-0":
        rows = below([0, max(0, s - 3)])
    elif pad == "lengths-1":
        rows = below([1, min(s, 13)])
    elif pad == "keep":
        rows = torch.rand(2, s, generator=torch.Generator().manual_seed(s)) < 0.7
    else:
        rows = below([s, min(s, 21)]) & below([min(s, 30), s])
    return rows[:, None, None, :]
PAD_CASES = [(name, pad, n, s) for name in PATTERNS for pad in PADDINGS
             for n, s in PAD_SHAPES]


@pytest.mark.parametrize("name,pad,n,s", PAD_CASES)
def test_padded_fused_equals_tiles_equals_fp64_reference(name, pad, n, s, monkeypatch):
    mask = PATTERNS[name](n, s) & PADDINGS[pad](s)
    mask.validate(2, 2, n, s)
    assert block_sparse_refusal(torch.zeros(1), mask, None, 0.0) is None
    calls = []
    real = sparse_mod.block_sparse_attention
    monkeypatch.setattr(chunked_mod, "block_sparse_attention",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = _qkv(2, 2, n, s, 8, torch.float32, seed=n * 100 + s + 7)
    d_out = torch.randn(2, 2, n, 8, generator=torch.Generator().manual_seed(9))
    keep = _keep(name, PATTERNS[name](n, s), n, s) & _padding_keep(pad, s)
    want = _dense(q, k, v, keep)
    want_g = _grads(want, (q, k, v), d_out.double())
    fused, lse = chunked_attention(q, k, v, mask=mask, scale=SCALE)
    assert calls, "the fused block-sparse path did not run"
    dead = ~keep.any(dim=-1).expand(2, 2, n)
    assert torch.isinf(lse[dead]).all() and torch.isfinite(lse[~dead]).all()
    tiles = _tiles(q, k, v, mask)
    for got in (fused, tiles):
        assert torch.equal(got[dead], torch.zeros_like(got[dead]))
        torch.testing.assert_close(got.double(), want, atol=5e-5, rtol=5e-6)
        grads = _grads(got, (q, k, v), d_out)
        assert torch.equal(grads[0][dead], torch.zeros_like(grads[0][dead]))
        for a, b in zip(grads, want_g, strict=True):
            torch.testing.assert_close(a.double(), b.double(), atol=5e-5, rtol=5e-6)


@pytest.mark.parametrize("name", ["bigbird-causal", "blocksparse-heads", "longformer"])
def test_padded_fp64_at_1e10_and_lse(name):
    n, s = 37, 53
    mask = PATTERNS[name](n, s) & Padding(torch.tensor([19, 0]))
    q, k, v = _qkv(2, 2, n, s, 8, torch.float64, seed=5)
    keep = mask.dense(n, s)
    out, lse = chunked_attention(q, k, v, mask=mask, scale=SCALE)
    torch.testing.assert_close(out, _dense(q, k, v, keep), atol=1e-10, rtol=1e-10)
    scores = (q @ k.transpose(-2, -1)) * SCALE
    want_lse = torch.logsumexp(scores.masked_fill(~keep, float("-inf")), dim=-1)
    torch.testing.assert_close(lse, want_lse, atol=1e-10, rtol=1e-10)
    assert torch.isinf(lse[1]).all() and not out[1].any()  # length 0: nothing to see
    got = torch.autograd.grad(out.sum(), (q, k, v))
    ref = torch.autograd.grad(_dense(q, k, v, keep).sum(), (q, k, v))
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_padded_fused_path_never_runs_the_tiles(monkeypatch):
    """Spy: BigBird & Padding runs the flash ops and never the explicit tile loops; through
    qkv.attention, NaN in the padded keys/values (zeroed there first) does not leak in."""
    import qkv

    counts = _spy_flash_refuse_tiles(monkeypatch)
    n = s = 64
    mask = BigBird(8, random_blocks=1, causal=True) & Padding(torch.tensor([64, 37]))
    q, k, v = _qkv(2, 2, n, s, 8, torch.float32)
    with torch.no_grad():
        k[1, :, 37:] = float("nan")
        v[1, :, 37:] = float("nan")
    out = qkv.attention(q, k, v, mask=mask, scale=SCALE, backend="chunked")
    gq, gk, gv = torch.autograd.grad(out.sum(), (q, k, v))
    assert counts["fwd"] >= 1 and counts["bwd"] == counts["fwd"]
    keep = mask.dense(n, s)
    clean = [t.detach().clone() for t in (k, v)]
    for t in clean:
        t[1, :, 37:] = 0.0
    torch.testing.assert_close(out.double(), _dense(q, *clean, keep), atol=5e-5, rtol=5e-6)
    assert all(torch.isfinite(g).all() for g in (gq, gk, gv))
    assert not gk[1, :, 37:].any() and not gv[1, :, 37:].any()
