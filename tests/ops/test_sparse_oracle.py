"""Sparse patterns against an independent oracle: each pattern is rebuilt here from its
documented definition as a list of lists of bools (plain Python loops, no qkv code), then
compared with ``mask.dense(N, S)`` and, through ``qkv.attention``, with fp64 softmax attention
over that oracle mask (checklist 10; tests/ops/test_sparse.py checks the backends against
the masks' own ``dense``).

Conventions read from the docstrings (src/qkv/ops/sparse_masks.py): query i sits at position
``p = i + S - N`` (bottom-right, as ``Causal``).
- SlidingWindow(W, causal=True): key j iff ``p - W < j <= p``; causal=False: ``|j - p| < W``.
- Longformer(W, g, causal): the window above, or query index in g, or key index in g; with
  causal also ``j <= p``.
- BigBird(bs, window_blocks=w, global_blocks=G, random_blocks=R): query block a sits at key
  block ``a' = (a·bs + S - N) // bs`` (the block holding its first query's position); it sees
  key blocks ``|b - a'| <= (w - 1) // 2`` (w must be odd: exactly w blocks), the first G key
  blocks, and everything when ``0 <= a' < G``; causal = that pattern and ``j <= p``
  elementwise, and the layout keeps only key blocks starting at or before the block's last
  query position. Random blocks cannot be recomputed: their structure is checked instead
  (at most R extra blocks per query block, exactly min(R, free) of the blocks that are
  neither local, global nor, when causal, wholly in the future).
- BlockSparse(layout, bs): (i, j) iff ``layout[..., i // bs, j // bs]``.

Shapes: N, S in {1, 2, 17, 113, 203} (all pairs), windows 1, 2, 7, 64, block sizes 1, 16,
64. Attention: fp32 outputs and q/k/v gradients against the fp64 oracle at atol 5e-5,
rtol 5e-6, on the auto and chunked backends, with and without ``Padding``, and at
N, S ~ 1100, window 64, where the chunked backend (auto's choice at B·H·N·S > 2**22) takes
its fused window path.
The four BigBird cases that once disagreed with the docstring (misaligned causal blocks,
global rows before the first key, even windows, random blocks repeating local ones) each
keep a test of their own.
"""

from __future__ import annotations

import random

import pytest
import torch

import qkv
import qkv.ops.chunked as chunked_module
from qkv.masks import BigBird, BlockSparse, Longformer, Padding, SlidingWindow

SIZES = (1, 2, 17, 113, 203)
PAIRS = [(n, s) for n in SIZES for s in SIZES]
WINDOWS = (1, 2, 7, 64)
BLOCKS = (1, 16, 64)
ATOL, RTOL = 5e-5, 5e-6


# ---------------------------------------------------------------- oracles (plain Python)

def window_oracle(n: int, s: int, window: int, causal: bool) -> list[list[bool]]:
    """SlidingWindow: (N, S) bools."""
    rows = []
    for i in range(n):
        p = i + s - n
        row = []
        for j in range(s):
            row.append(0 <= p - j < window if causal else abs(j - p) < window)
        rows.append(row)
    return rows


def longformer_oracle(n: int, s: int, window: int, global_tokens, causal: bool
                      ) -> list[list[bool]]:
    """Longformer: window band, plus global query rows and global key columns (indices)."""
    g = set(global_tokens)
    band = window_oracle(n, s, window, causal)
    rows = []
    for i in range(n):
        p = i + s - n
        row = []
        for j in range(s):
            ok = band[i][j] or i in g or j in g
            row.append(ok and (not causal or j <= p))
        rows.append(row)
    return rows


def bigbird_block_oracle(n: int, s: int, bs: int, window_blocks: int, global_blocks: int,
                         causal: bool = False) -> list[list[bool]]:
    """BigBird without random blocks, at block level: (ceil(N/bs), ceil(S/bs)) bools; with
    causal, only key blocks starting at or before the block's last query position."""
    nb, sb = -(-n // bs), -(-s // bs)
    half = (window_blocks - 1) // 2
    rows = []
    for a in range(nb):
        a_pos = (a * bs + s - n) // bs  # key block holding the block's first query position
        last = min(n, (a + 1) * bs) - 1 + s - n  # the block's last query position
        row = []
        for b in range(sb):
            row.append((abs(b - a_pos) <= half or b < global_blocks
                        or 0 <= a_pos < global_blocks) and (not causal or b * bs <= last))
        rows.append(row)
    return rows


def bigbird_free_blocks(n: int, s: int, bs: int, window_blocks: int, global_blocks: int,
                        causal: bool) -> list[list[int]]:
    """Per query block: the key blocks a random draw may pick (neither local nor global;
    causal: starting at or before the block's last query position)."""
    base = bigbird_block_oracle(n, s, bs, window_blocks, global_blocks)
    free = []
    for a, row in enumerate(base):
        last = min(n, (a + 1) * bs) - 1 + s - n
        free.append([b for b, x in enumerate(row) if not x and (not causal or b * bs <= last)])
    return free


def expand_blocks(layout, n: int, s: int, bs: int, causal: bool) -> list[list[bool]]:
    """Element mask of a block layout (query index i in block i // bs), optionally & causal."""
    return [[bool(layout[i // bs][j // bs]) and (not causal or j <= i + s - n)
             for j in range(s)] for i in range(n)]


def bigbird_oracle(n, s, bs, window_blocks, global_blocks, causal):
    return expand_blocks(bigbird_block_oracle(n, s, bs, window_blocks, global_blocks),
                         n, s, bs, causal)


def random_layout(rows: int, cols: int, seed: int, p: float = 0.35) -> list[list[bool]]:
    rng = random.Random(seed)
    return [[rng.random() < p for _ in range(cols)] for _ in range(rows)]


# ---------------------------------------------------------------- helpers

def dense_lists(mask, n: int, s: int, batch: int = 1, heads: int = 1):
    """mask.dense(N, S) broadcast to (B, H, N, S), as nested lists."""
    return torch.broadcast_to(mask.dense(n, s), (batch, heads, n, s)).tolist()


def first_diff(got, want):
    """First (i, j, got, want) where two (N, S) nested lists differ, or None."""
    assert len(got) == len(want), (len(got), len(want))
    for i, (rg, rw) in enumerate(zip(got, want, strict=True)):
        if rg != rw:
            j = next(j for j, (x, y) in enumerate(zip(rg, rw, strict=True)) if x != y)
            return i, j, rg[j], rw[j]
    return None


def assert_same(mask, n, s, want):
    diff = first_diff(dense_lists(mask, n, s)[0][0], want)
    assert diff is None, f"{mask!r} N={n} S={s}: (i, j, dense, oracle) = {diff}"


# ---------------------------------------------------------------- masks vs oracle

@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("window", WINDOWS)
def test_sliding_window_dense_equals_oracle(window, causal):
    mask = SlidingWindow(window, causal=causal)
    for n, s in PAIRS:
        assert_same(mask, n, s, window_oracle(n, s, window, causal))


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("window", WINDOWS)
def test_longformer_dense_equals_oracle(window, causal):
    for n, s in PAIRS:
        m = min(n, s)
        for glob in ([], [0], [m - 1, 0, m - 1], [g for g in (0, 3, m // 2, m - 1) if g < m]):
            mask = Longformer(window, glob, causal=causal)
            assert_same(mask, n, s, longformer_oracle(n, s, window, glob, causal))


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("bs", BLOCKS)
def test_bigbird_without_random_blocks_equals_oracle(bs, causal):
    for window_blocks in (1, 3, 5):
        for global_blocks in (0, 2):
            mask = BigBird(bs, window_blocks=window_blocks, global_blocks=global_blocks,
                           random_blocks=0, causal=causal)
            for n, s in PAIRS:
                assert_same(mask, n, s, bigbird_oracle(n, s, bs, window_blocks,
                                                       global_blocks, causal))
                lay = mask.layout(n, s).tolist()
                want = bigbird_block_oracle(n, s, bs, window_blocks, global_blocks, causal)
                assert lay == want, f"{mask!r} N={n} S={s}: layout"


@pytest.mark.parametrize("n,s", [(2, 1), (17, 203), (113, 203), (203, 17), (45, 203)])
def test_bigbird_causal_keeps_the_diagonal_when_misaligned(n, s):
    """(S - N) % block_size != 0: a query block straddles two key blocks; causality is
    elementwise, so each query keeps every allowed key up to its own position (N=2, S=1:
    query 1 sees key 0), and with window_blocks >= 3 its own key."""
    mask = BigBird(64, window_blocks=3, global_blocks=0, random_blocks=0, causal=True)
    assert_same(mask, n, s, bigbird_oracle(n, s, 64, 3, 0, True))
    dense = dense_lists(mask, n, s)[0][0]
    for i in range(max(0, n - s), n):
        assert dense[i][i + s - n], (n, s, i)


@pytest.mark.parametrize("n,s,bs,global_blocks", [(203, 17, 64, 0), (203, 113, 16, 1)])
def test_bigbird_no_global_rows_before_the_keys(n, s, bs, global_blocks):
    """N > S: query blocks before the first key (a' < 0) are not global (N=203, S=17,
    bs=64, no global blocks: query 0 attends nothing)."""
    mask = BigBird(bs, window_blocks=3, global_blocks=global_blocks, random_blocks=0)
    assert_same(mask, n, s, bigbird_oracle(n, s, bs, 3, global_blocks, False))
    if global_blocks == 0:
        assert not any(dense_lists(mask, n, s)[0][0][0])


@pytest.mark.parametrize("window_blocks", [1, 3, 5, 7])
def test_bigbird_window_has_window_blocks_blocks(window_blocks):
    mask = BigBird(16, window_blocks=window_blocks, global_blocks=0, random_blocks=0)
    counts = [sum(row) for row in mask.layout(320, 320).tolist()]
    assert counts[4:16] == [window_blocks] * 12, counts


@pytest.mark.parametrize("window_blocks", [2, 4, 0, -1, True, 3.0])
def test_bigbird_rejects_even_or_bad_windows(window_blocks):
    with pytest.raises(ValueError, match=r"BigBird: window_blocks must be .*"
                                         + repr(window_blocks).replace(".", r"\.")):
        BigBird(16, window_blocks=window_blocks)


@pytest.mark.parametrize("kwargs", [{"global_blocks": -1}, {"random_blocks": -2},
                                    {"block_size": 0}, {"seed": 1.5}])
def test_bigbird_rejects_bad_arguments(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"BigBird: {name} must be"):
        BigBird(**kwargs)


BIGBIRD_RANDOM = [(16, 203, 203), (16, 113, 203), (1, 113, 203), (64, 203, 203)]


def _extras(mask, n, s, bs):
    """Per query block: the key blocks the layout adds beyond the local + global oracle."""
    want = bigbird_block_oracle(n, s, bs, mask.window_blocks, mask.global_blocks,
                                mask.causal)
    layout = mask.layout(n, s).tolist()
    for a, (row, orow) in enumerate(zip(layout, want, strict=True)):
        missing = [b for b, (x, y) in enumerate(zip(row, orow, strict=True)) if y and not x]
        assert not missing, f"{mask!r} N={n} S={s}: query block {a} lacks {missing}"
    return [[b for b, (x, y) in enumerate(zip(row, orow, strict=True)) if x and not y]
            for row, orow in zip(layout, want, strict=True)], want


@pytest.mark.parametrize("bs,n,s", BIGBIRD_RANDOM)
def test_bigbird_random_blocks_structure(bs, n, s):
    """Local + global as the oracle, plus at most random_blocks whole extra key blocks per
    query block; seeded: same seed same mask, another seed another (when some query block
    has more free blocks than random_blocks: bs=64 has 4 blocks, all drawn), global RNG
    untouched."""
    mask = BigBird(bs, window_blocks=3, global_blocks=1, random_blocks=2, seed=7)
    torch.manual_seed(0)
    dense = dense_lists(mask, n, s)[0][0]
    torch.manual_seed(123)  # the draw must not depend on the global RNG
    again = dense_lists(BigBird(bs, window_blocks=3, global_blocks=1, random_blocks=2,
                                seed=7), n, s)[0][0]
    assert first_diff(again, dense) is None
    other = dense_lists(BigBird(bs, window_blocks=3, global_blocks=1, random_blocks=2,
                                seed=8), n, s)[0][0]
    choice = any(len(f) > 2 for f in bigbird_free_blocks(n, s, bs, 3, 1, False))
    assert choice == (bs != 64)
    assert (first_diff(other, dense) is not None) == choice

    extras, base = _extras(mask, n, s, bs)
    assert all(len(e) <= mask.random_blocks for e in extras), extras
    assert sum(map(len, extras)) > 0
    full = [[x or b in extras[a] for b, x in enumerate(row)] for a, row in enumerate(base)]
    assert_same(mask, n, s, expand_blocks(full, n, s, bs, False))


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("n,s,bs,window_blocks,random_blocks", [
    (203, 203, 16, 3, 3), (113, 203, 16, 1, 2), (203, 113, 16, 3, 2), (17, 203, 4, 5, 6),
    (203, 203, 64, 3, 8)])
def test_bigbird_random_blocks_are_extra(n, s, bs, window_blocks, random_blocks, causal):
    """Random blocks are drawn from the free blocks only (neither local nor global; causal:
    not wholly in the future): exactly min(random_blocks, free) per query block."""
    mask = BigBird(bs, window_blocks=window_blocks, global_blocks=1,
                   random_blocks=random_blocks, seed=0, causal=causal)
    extras, _ = _extras(mask, n, s, bs)
    free = bigbird_free_blocks(n, s, bs, window_blocks, 1, causal)
    for a, (e, f) in enumerate(zip(extras, free, strict=True)):
        assert set(e) <= set(f), (a, e, f)
        assert len(e) == min(random_blocks, len(f)), (a, e, f)
    assert sum(map(len, extras)) > 0
    want = expand_blocks([[x or b in extras[a] for b, x in enumerate(row)] for a, row in
                          enumerate(bigbird_block_oracle(n, s, bs, window_blocks, 1))],
                         n, s, bs, causal)
    assert_same(mask, n, s, want)


def test_bigbird_causal_random_is_seeded():
    """Causal random draws: same seed same layout whatever the global RNG, another seed
    another layout."""
    def lay(seed):
        return BigBird(16, global_blocks=1, random_blocks=2, seed=seed,
                       causal=True).layout(203, 203)

    torch.manual_seed(0)
    first = lay(4)
    torch.manual_seed(99)
    assert torch.equal(lay(4), first)
    assert not torch.equal(lay(5), first)


@pytest.mark.parametrize("bs", BLOCKS)
def test_block_sparse_dense_equals_oracle(bs):
    for n, s in PAIRS:
        nb, sb = -(-n // bs), -(-s // bs)
        lay = random_layout(nb, sb, seed=n * 1000 + s)
        mask = BlockSparse(torch.tensor(lay, dtype=torch.bool).reshape(nb, sb), bs)
        assert_same(mask, n, s, expand_blocks(lay, n, s, bs, False))


@pytest.mark.parametrize("lead", [(3,), (2, 3)], ids=["per-head", "per-batch-head"])
def test_block_sparse_per_head_layouts(lead):
    n, s, bs, heads = 113, 203, 16, 3
    batch = lead[0] if len(lead) == 2 else 1
    nb, sb = -(-n // bs), -(-s // bs)
    lays = [[random_layout(nb, sb, seed=10 * b + h) for h in range(heads)]
            for b in range(batch)]
    tensor = torch.tensor(lays, dtype=torch.bool).reshape(*lead, nb, sb)
    got = dense_lists(BlockSparse(tensor, bs), n, s, batch, heads)
    for b in range(batch):
        for h in range(heads):
            diff = first_diff(got[b][h], expand_blocks(lays[b][h], n, s, bs, False))
            assert diff is None, f"b={b} h={h}: {diff}"


# ---------------------------------------------------------------- attention vs fp64 oracle

def _inputs(b, h, n, s, d, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, length, d, generator=g) for length in (n, s, s))
    return q, k, v, torch.randn(b, h, n, d, generator=g, dtype=torch.float64)


def _oracle_attention(q, k, v, keep):
    """fp64 softmax(q kᵀ / sqrt(D)) v over keep (B|1, 1, N, S); empty rows give zeros."""
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    empty = ~keep.any(dim=-1, keepdim=True)
    scores = scores.masked_fill(~keep, float("-inf")).masked_fill(empty, 0.0)
    p = torch.softmax(scores, dim=-1).masked_fill(~keep, 0.0)
    return p @ v


def _padding_oracle(lengths, s):
    return [[j < length for j in range(s)] for length in lengths]


def check_attention(mask, want_lists, q, k, v, d_out, *, backend, lengths=None):
    """qkv.attention in fp32 (outputs, q/k/v grads) against the fp64 oracle over want_lists
    (N, S), intersected with Padding(lengths) when given."""
    keep = torch.tensor(want_lists, dtype=torch.bool)[None, None]  # (1, 1, N, S)
    if lengths is not None:
        pad = torch.tensor(_padding_oracle(lengths, k.shape[2]), dtype=torch.bool)
        keep = keep & pad[:, None, None, :]  # (B, 1, N, S)
        mask = mask & Padding(torch.tensor(lengths))
    q32, k32, v32 = (t.clone().requires_grad_() for t in (q, k, v))
    out = qkv.attention(q32, k32, v32, mask=mask, backend=backend)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    want = _oracle_attention(q64, k64, v64, keep)
    torch.testing.assert_close(out.double(), want, atol=ATOL, rtol=RTOL)
    got = torch.autograd.grad(out, (q32, k32, v32), d_out.float())
    ref = torch.autograd.grad(want, (q64, k64, v64), d_out)
    for name, a, b in zip("qkv", got, ref, strict=True):
        torch.testing.assert_close(a.double(), b, atol=ATOL, rtol=RTOL,
                                   msg=lambda m, name=name: f"d{name}: {m}")


def _bigbird_with_extras(mask, n, s):
    extras, base = _extras(mask, n, s, mask.block_size)
    full = [[x or b in extras[a] for b, x in enumerate(row)] for a, row in enumerate(base)]
    return expand_blocks(full, n, s, mask.block_size, mask.causal)


def _glob(tokens, n, s):
    """Global token indices that exist in both N and S, plus the last one."""
    m = min(n, s)
    return [g for g in tokens if g < m] + [m - 1]


ATTN_PATTERNS = {
    "window7-causal": (lambda n, s: SlidingWindow(7, causal=True),
                       lambda n, s: window_oracle(n, s, 7, True)),
    "window2-causal": (lambda n, s: SlidingWindow(2, causal=True),
                       lambda n, s: window_oracle(n, s, 2, True)),
    "window64-bidir": (lambda n, s: SlidingWindow(64, causal=False),
                       lambda n, s: window_oracle(n, s, 64, False)),
    "longformer": (lambda n, s: Longformer(7, _glob((0, 50, 300), n, s)),
                   lambda n, s: longformer_oracle(n, s, 7, _glob((0, 50, 300), n, s), False)),
    "longformer-causal": (lambda n, s: Longformer(2, _glob((1, 60), n, s), causal=True),
                          lambda n, s: longformer_oracle(n, s, 2, _glob((1, 60), n, s),
                                                         True)),
    "bigbird": (lambda n, s: BigBird(16, window_blocks=3, global_blocks=1, random_blocks=0),
                lambda n, s: bigbird_oracle(n, s, 16, 3, 1, False)),
    "bigbird-random": (lambda n, s: BigBird(16, window_blocks=3, global_blocks=1,
                                            random_blocks=2, seed=3),
                       lambda n, s: _bigbird_with_extras(BigBird(
                           16, window_blocks=3, global_blocks=1, random_blocks=2, seed=3),
                           n, s)),
    "bigbird-causal": (lambda n, s: BigBird(64, window_blocks=3, global_blocks=1,
                                            random_blocks=0, causal=True),
                       lambda n, s: bigbird_oracle(n, s, 64, 3, 1, True)),
    "bigbird-random-causal": (lambda n, s: BigBird(16, window_blocks=3, global_blocks=1,
                                                   random_blocks=2, seed=3, causal=True),
                              lambda n, s: _bigbird_with_extras(BigBird(
                                  16, window_blocks=3, global_blocks=1, random_blocks=2,
                                  seed=3, causal=True), n, s)),
    "blocksparse": (lambda n, s: BlockSparse(torch.tensor(
                        random_layout(-(-n // 16), -(-s // 16), 5), dtype=torch.bool)
                        .reshape(-(-n // 16), -(-s // 16)), 16),
                    lambda n, s: expand_blocks(random_layout(-(-n // 16), -(-s // 16), 5),
                                               n, s, 16, False)),
}
ATTN_SHAPES = [(203, 203), (75, 203), (1, 113)]


@pytest.mark.parametrize("padded", [False, True], ids=["", "padding"])
@pytest.mark.parametrize("backend", ["auto", "chunked"])
@pytest.mark.parametrize("n,s", ATTN_SHAPES)
@pytest.mark.parametrize("name", list(ATTN_PATTERNS))
def test_attention_matches_fp64_oracle(name, n, s, backend, padded):
    build, oracle = ATTN_PATTERNS[name]
    q, k, v, d_out = _inputs(2, 1, n, s, 16, seed=sum(map(ord, name)) + 7 * n + s)
    lengths = [s, s // 3 if n > 1 else 0] if padded else None  # 0: every row empty
    check_attention(build(n, s), oracle(n, s), q, k, v, d_out, backend=backend,
                    lengths=lengths)


@pytest.mark.parametrize("padded", [False, True], ids=["", "padding"])
@pytest.mark.parametrize("n,s", [(17, 203), (203, 113), (2, 1), (45, 203)])
@pytest.mark.parametrize("name", [k for k in ATTN_PATTERNS if k.startswith("bigbird")])
def test_bigbird_misaligned_attention_matches_fp64_oracle(name, n, s, padded):
    """(S - N) % block_size != 0 and N > S: query blocks straddle key blocks (chunked
    backend: only the live key blocks are gathered)."""
    build, oracle = ATTN_PATTERNS[name]
    q, k, v, d_out = _inputs(2, 1, n, s, 16, seed=sum(map(ord, name)) + 7 * n + s)
    lengths = [s, max(1, s // 3)] if padded else None
    check_attention(build(n, s), oracle(n, s), q, k, v, d_out, backend="chunked",
                    lengths=lengths)


@pytest.mark.parametrize("n,s,heads,causal,backend,padded,fused", [
    (1100, 1100, 4, True, "auto", False, True),
    (1100, 1100, 1, False, "chunked", False, True),
    (1000, 1100, 1, True, "chunked", False, True),
    (1100, 1100, 2, True, "chunked", True, False),
], ids=["causal-auto", "bidir-chunked", "N<S-causal-chunked", "causal-padding-chunked"])
def test_long_window_matches_fp64_oracle(n, s, heads, causal, backend, padded, fused,
                                         monkeypatch):
    """Window 64 at N, S ~ 1100: the chunked backend's fused window path serves a plain
    SlidingWindow (auto picks chunked once B·H·N·S > 2**22: sdpa refuses the sparse mask,
    and below that size auto materialises with the reference math); with Padding the
    chunked backend runs explicit tiles."""
    calls = []
    fused_fn = chunked_module.window_attention

    def spy(*args, **kwargs):
        calls.append(1)
        return fused_fn(*args, **kwargs)

    monkeypatch.setattr(chunked_module, "window_attention", spy)
    mask = SlidingWindow(64, causal=causal)
    q, k, v, d_out = _inputs(1, heads, n, s, 8, seed=n + s + causal)
    assert "sparse mask" in (qkv.explain(q, k, v, mask=mask)["sdpa"] or "")
    lengths = [s - 77] if padded else None
    check_attention(mask, window_oracle(n, s, 64, causal), q, k, v, d_out, backend=backend,
                    lengths=lengths)
    assert len(calls) == int(fused)
