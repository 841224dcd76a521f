"""Sparse attention patterns as typed masks (True = may attend): sliding window, Longformer,
BigBird, and a general block-sparse layout.

Shapes: B batch, H heads, N queries, S keys; query i sits at position ``i + S - N``
(bottom-right alignment, as ``Causal``). ``block`` answers per tile with True / False /
a bool tensor, so backends skip dead tiles: the work shrinks with the pattern. ``sparse``
tells ``qkv.attention`` that a dense kernel would waste most of its work.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .masks import Mask

__all__ = ["BigBird", "BlockSparse", "Longformer", "SlidingWindow"]


def _rel(i0, i1, j0, j1, n, s, device) -> Tensor:
    """Key position minus query position, (i1 - i0, j1 - j0)."""
    return (torch.arange(j0, j1, device=device)[None, :]
            - torch.arange(i0, i1, device=device)[:, None] - (s - n))


class SlidingWindow(Mask):
    """Each query sees the ``window`` nearest positions: keys with
    ``pos_i - window < j <= pos_i`` (``causal=True``) or ``|j - pos_i| < window``.

    ``qkv.attention(q, k, v, mask=SlidingWindow(512, causal=True))`` computes only the band
    (O(N·window) time and memory).
    """

    sparse = True

    def __init__(self, window: int, *, causal: bool = True) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"SlidingWindow: window must be a positive int, got {window!r}")
        self.window, self.causal = window, bool(causal)

    @property
    def hi(self) -> int:
        """Largest allowed key-minus-query distance, exclusive."""
        return 1 if self.causal else self.window

    def key_range(self, i0, i1, n, s):
        lo = max(0, i0 + s - n - self.window + 1)
        return lo, max(lo, min(s, i1 - 1 + s - n + self.hi))

    def block(self, i0, i1, j0, j1, n, s, device):
        # Extremes of (key - query) over the tile decide full / empty without a tensor.
        rel_min = j0 - (i1 - 1) - (s - n)
        rel_max = (j1 - 1) - i0 - (s - n)
        if rel_min > -self.window and rel_max < self.hi:
            return True
        if rel_max <= -self.window or rel_min >= self.hi:
            return False
        rel = _rel(i0, i1, j0, j1, n, s, device)
        return ((rel > -self.window) & (rel < self.hi))[None, None]

    def describe(self) -> str:
        return f"SlidingWindow({self.window}, causal={self.causal})"


class BlockSparse(Mask):
    """A block layout: ``layout[a, b]`` True lets query block a attend key block b.

    ``layout`` is (ceil(N / block_size), ceil(S / block_size)) bool, optionally with leading
    (B, H) or (H,) dims for per-head patterns; the last partial blocks cover what is left.
    """

    sparse = True

    def __init__(self, layout: Tensor, block_size: int) -> None:
        if not isinstance(layout, Tensor) or layout.dtype != torch.bool or layout.dim() < 2:
            got = (f"shape {tuple(layout.shape)} dtype {layout.dtype}"
                   if isinstance(layout, Tensor) else type(layout).__name__)
            raise ValueError(f"BlockSparse: layout must be a bool tensor (..., N/blk, S/blk), "
                             f"got {got}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"BlockSparse: block_size must be a positive int, got "
                             f"{block_size!r}")
        while layout.dim() < 4:
            layout = layout[None]
        self.layout, self.block_size = layout, block_size

    @property
    def tile(self) -> int:
        """The tile size backends should use (the layout's block size)."""
        return self.block_size

    def validate(self, batch, heads, n, s):
        bs = self.block_size
        want = (-(-n // bs), -(-s // bs))
        if tuple(self.layout.shape[-2:]) != want:
            raise ValueError(f"BlockSparse: layout has {tuple(self.layout.shape[-2:])} blocks, "
                             f"N={n}, S={s} with block_size={bs} need {want}")
        for got, full, name in zip(self.layout.shape[:2], (batch, heads), "BH", strict=True):
            if got not in (1, full):
                raise ValueError(f"BlockSparse: layout dim {name} is {got}, attention has "
                                 f"{full}")

    def live_key_tiles(self, i0: int, i1: int, n: int, s: int) -> list[tuple[int, int]]:
        """Key ranges [j0, j1) of the blocks that queries i0:i1 may attend (any batch/head),
        read off the layout without visiting dead blocks."""
        bs = self.block_size
        row = self.layout[..., i0 // bs:(i1 - 1) // bs + 1, :].reshape(-1, self.layout.shape[-1])
        cols = row.any(dim=0).nonzero().squeeze(1).tolist()
        return [(c * bs, min(s, (c + 1) * bs)) for c in cols]

    def block(self, i0, i1, j0, j1, n, s, device):
        bs = self.block_size
        sub = self.layout[..., i0 // bs:(i1 - 1) // bs + 1, j0 // bs:(j1 - 1) // bs + 1]
        if bool(sub.all()):
            return True
        if not bool(sub.any()):
            return False
        rows = torch.arange(i0, i1, device=device) // bs - i0 // bs
        cols = torch.arange(j0, j1, device=device) // bs - j0 // bs
        return sub.to(device)[..., rows[:, None], cols[None, :]]

    def describe(self) -> str:
        return f"BlockSparse(layout {tuple(self.layout.shape)}, block_size={self.block_size})"


class Longformer(Mask):
    """Longformer (Beltagy et al. 2020): a sliding window plus global tokens, which attend
    to every key and are attended by every query.

    ``global_tokens``: positions (a list or a 1-D integer tensor of key/query indices; for
    self-attention N == S). ``window``: as ``SlidingWindow`` (causal=False by default).
    """

    sparse = True

    def __init__(self, window: int, global_tokens, *, causal: bool = False) -> None:
        self.local = SlidingWindow(window, causal=causal)
        g = torch.as_tensor(global_tokens, dtype=torch.long).reshape(-1)
        if (g < 0).any():
            raise ValueError(f"Longformer: global token positions must be >= 0, got "
                             f"{g.tolist()}")
        self.global_tokens = torch.unique(g)
        self.causal = causal

    def validate(self, batch, heads, n, s):
        if self.global_tokens.numel() and int(self.global_tokens.max()) >= min(n, s):
            raise ValueError(f"Longformer: global token {int(self.global_tokens.max())} is "
                             f"outside N={n} / S={s}")

    def block(self, i0, i1, j0, j1, n, s, device):
        local = self.local.block(i0, i1, j0, j1, n, s, device)
        g = self.global_tokens.to(device)
        g_cols = g[(g >= j0) & (g < j1)]
        g_rows = g[(g >= i0) & (g < i1)]
        if local is True or (g_cols.numel() == 0 and g_rows.numel() == 0):
            return local
        keep = torch.zeros(i1 - i0, j1 - j0, dtype=torch.bool, device=device)
        if local is not False:
            keep |= local[0, 0]
        keep[:, g_cols - j0] = True
        keep[g_rows - i0, :] = True
        if self.causal:
            keep &= _rel(i0, i1, j0, j1, n, s, device) <= 0
        return keep[None, None]

    def describe(self) -> str:
        return (f"Longformer(window={self.local.window}, "
                f"{self.global_tokens.numel()} global tokens, causal={self.causal})")


class BigBird(Mask):
    """BigBird (Zaheer et al. 2020) block pattern, served as a ``BlockSparse`` layout.

    Queries and keys are cut into blocks of ``block_size`` (the last ones partial). Query
    block a, whose first query sits at position ``a·block_size + S - N`` (bottom-right, as
    ``Causal``), is placed at key block ``a' = floor(that position / block_size)``. It attends:

    - local: the ``window_blocks`` key blocks ``|b - a'| <= (window_blocks - 1) // 2``
      (``window_blocks`` must be odd: 3 = block a' and one neighbour each side, as in the
      paper);
    - global: the first ``global_blocks`` key blocks, and every key when a' itself is one
      of them (``0 <= a' < global_blocks``; query blocks before the first key, a' < 0,
      are never global);
    - random: up to ``random_blocks`` further key blocks drawn without replacement from the
      blocks that are neither local nor global for that query block (all that remain when
      fewer are free), once per (N, S) from ``seed`` with a private generator: the same
      seed gives the same layout whatever the global torch RNG.

    ``causal=True``: the pattern above & ``Causal()`` element by element (query at position
    p sees key j only if ``j <= p``), so every query keeps each allowed key up to its own
    position, its own key included when ``window_blocks >= 3``; random blocks are then drawn
    only among key blocks holding a position some query of the block may see (at or before
    the block's last query). Layout blocks holding only future keys are dropped, so backends
    never visit them.
    """

    sparse = True

    def __init__(self, block_size: int = 64, *, window_blocks: int = 3, global_blocks: int = 2,
                 random_blocks: int = 3, seed: int = 0, causal: bool = False) -> None:
        for name, val, low in (("block_size", block_size, 1), ("window_blocks", window_blocks, 1),
                               ("global_blocks", global_blocks, 0),
                               ("random_blocks", random_blocks, 0)):
            if isinstance(val, bool) or not isinstance(val, int) or val < low:
                kind = "a positive" if low else "a non-negative"
                raise ValueError(f"BigBird: {name} must be {kind} int, got {val!r}")
        if window_blocks % 2 == 0:
            raise ValueError(f"BigBird: window_blocks must be odd (the block itself and "
                             f"(window_blocks - 1) // 2 neighbours each side), got "
                             f"{window_blocks!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"BigBird: seed must be an int, got {seed!r}")
        self.block_size, self.window_blocks = block_size, window_blocks
        self.global_blocks, self.random_blocks = global_blocks, random_blocks
        self.seed, self.causal = seed, bool(causal)
        self._cache: dict[tuple[int, int], BlockSparse] = {}

    @property
    def tile(self) -> int:
        """The tile size backends should use."""
        return self.block_size

    def layout(self, n: int, s: int) -> Tensor:
        """The (ceil(N/blk), ceil(S/blk)) bool layout for this problem size (with
        ``causal``, ``block`` also applies ``j <= p`` inside the live blocks)."""
        bs = self.block_size
        nb, sb = -(-n // bs), -(-s // bs)
        first = torch.arange(nb) * bs + (s - n)  # position of each query block's first query
        a = torch.div(first, bs, rounding_mode="floor")[:, None]  # its key block a', (nb, 1)
        b = torch.arange(sb)[None, :]  # (1, sb)
        base = ((b - a).abs() <= (self.window_blocks - 1) // 2) | (b < self.global_blocks)
        base |= (a >= 0) & (a < self.global_blocks)  # global query blocks see every key
        if self.causal:  # key blocks starting at or before the block's last query position
            last = torch.clamp(torch.arange(1, nb + 1) * bs, max=n) - 1 + (s - n)
            visible = b * bs <= last[:, None]
        else:
            visible = torch.ones(nb, sb, dtype=torch.bool)
        layout = base & visible
        if self.random_blocks > 0:
            free = ~base & visible
            gen = torch.Generator().manual_seed(self.seed)
            keys = torch.rand(nb, sb, generator=gen).masked_fill(~free, 2.0)
            picks = keys.argsort(dim=1)[:, : self.random_blocks]
            drawn = torch.zeros(nb, sb, dtype=torch.bool).scatter_(1, picks, True)
            layout |= drawn & free  # rows with fewer free blocks take all of them
        return layout

    def _sparse(self, n: int, s: int) -> BlockSparse:
        if (n, s) not in self._cache:
            self._cache[(n, s)] = BlockSparse(self.layout(n, s), self.block_size)
        return self._cache[(n, s)]

    def live_key_tiles(self, i0: int, i1: int, n: int, s: int) -> list[tuple[int, int]]:
        """Key ranges of the live blocks of queries i0:i1 (see ``BlockSparse``)."""
        return self._sparse(n, s).live_key_tiles(i0, i1, n, s)

    def block(self, i0, i1, j0, j1, n, s, device):
        blk = self._sparse(n, s).block(i0, i1, j0, j1, n, s, device)
        if self.causal and blk is not False:
            rel = _rel(i0, i1, j0, j1, n, s, device) <= 0
            blk = rel[None, None] if blk is True else blk & rel
            if bool(blk.all()):
                return True
            if not bool(blk.any()):
                return False
        return blk

    def describe(self) -> str:
        return (f"BigBird(block_size={self.block_size}, window={self.window_blocks}, "
                f"global={self.global_blocks}, random={self.random_blocks}, seed={self.seed}, "
                f"causal={self.causal})")
