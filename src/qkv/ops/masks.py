"""Typed attention masks. True means "may attend" — everywhere in qkv, no exceptions.

Shapes: B batch, H query heads, N query length, S key length. A mask describes which
(query i, key j) pairs may interact; it is materialised only on request (``dense``) or one
block at a time (``block``), so that backends can skip blocks that are entirely masked.

Query/key alignment: query ``i`` of ``N`` sits at absolute position ``i + offset`` where
``offset = S - N`` for bottom-right alignment (what decoding with a KV cache needs: the new
queries are the last ``N`` positions of the ``S`` keys) and ``0`` for top-left alignment.

A mask block is returned as one of
- ``True``: every pair in the block may attend,
- ``False``: no pair in the block may attend (the block can be skipped),
- a bool tensor broadcastable to (B, H, n, s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "And",
    "Causal",
    "DenseMask",
    "Mask",
    "MaskBlock",
    "Padding",
    "as_mask",
]

MaskBlock = bool | Tensor
Alignment = Literal["bottom_right", "top_left"]


class Mask:
    """Base class of typed masks. Subclasses implement ``block`` and ``describe``.

    Combine masks with ``&``: ``Causal() & Padding(lengths)`` allows a pair only when every
    part allows it. ``sparse`` marks patterns where a dense kernel would waste most of its
    work; ``tile`` (when not None) is the block size a tiled backend should use.
    """

    sparse: bool = False
    tile: int | None = None

    def block(self, i0: int, i1: int, j0: int, j1: int, n: int, s: int,
              device: torch.device) -> MaskBlock:
        """Mask of queries ``i0:i1`` against keys ``j0:j1`` for a problem of N=n, S=s.

        Returns True, False, or a bool tensor broadcastable to (B, H, i1 - i0, j1 - j0).
        """
        raise NotImplementedError

    def key_range(self, i0: int, i1: int, n: int, s: int) -> tuple[int, int]:
        """Keys ``[lo, hi)`` outside of which queries ``i0:i1`` attend nothing (a hint)."""
        return 0, s

    def dense(self, n: int, s: int, device: torch.device | str = "cpu") -> Tensor:
        """The whole mask as a bool tensor broadcastable to (B, H, N, S)."""
        blk = self.block(0, n, 0, s, n, s, torch.device(device))
        if isinstance(blk, bool):
            return torch.full((1, 1, n, s), blk, dtype=torch.bool, device=device)
        return blk

    def validate(self, batch: int, heads: int, n: int, s: int) -> None:
        """Raise ValueError if the mask cannot apply to a (B, H, N, S) problem."""

    def describe(self) -> str:
        """A short human-readable description, used in error messages."""
        return type(self).__name__

    def __and__(self, other: Mask | Tensor) -> And:
        return And((self, as_mask(other)))

    def __rand__(self, other: Mask | Tensor) -> And:
        return And((as_mask(other), self))

    def __repr__(self) -> str:
        return self.describe()


def _and_blocks(a: MaskBlock, b: MaskBlock) -> MaskBlock:
    if a is False or b is False:
        return False
    if a is True:
        return b
    if b is True:
        return a
    return a & b


@dataclass(frozen=True, eq=False)
class Causal(Mask):
    """Causal mask: query i may attend key j when ``j <= i + offset``.

    ``alignment="bottom_right"`` (default) puts the queries at the end of the keys
    (``offset = S - N``): with N < S this is what a KV-cache decode step needs; with N > S
    the first ``N - S`` query rows see no key and return zeros.
    ``alignment="top_left"`` uses ``offset = 0`` (torch's ``is_causal`` for N != S).
    For N == S the two alignments are the same lower-triangular matrix.

    Example (N=2, S=5): bottom_right = [[1,1,1,1,0],[1,1,1,1,1]],
    top_left = [[1,0,0,0,0],[1,1,0,0,0]].
    """

    alignment: Alignment = "bottom_right"

    def __post_init__(self) -> None:
        if self.alignment not in ("bottom_right", "top_left"):
            raise ValueError(
                f"Causal: alignment must be 'bottom_right' or 'top_left', got {self.alignment!r}"
            )

    def offset(self, n: int, s: int) -> int:
        """Key index minus query index on the mask's diagonal."""
        return s - n if self.alignment == "bottom_right" else 0

    def allows_all(self, n: int, s: int) -> bool:
        """True when every query sees every key (e.g. one decode step, bottom-right)."""
        return s - 1 <= self.offset(n, s)

    def key_range(self, i0, i1, n, s):
        return 0, max(0, min(s, i1 + self.offset(n, s)))

    def block(self, i0, i1, j0, j1, n, s, device):
        off = self.offset(n, s)
        if j1 - 1 <= i0 + off:  # the block's last key is visible to its first query
            return True
        if j0 > i1 - 1 + off:  # the block's first key is past its last query
            return False
        qi = torch.arange(i0, i1, device=device)[:, None] + off
        kj = torch.arange(j0, j1, device=device)[None, :]
        return (kj <= qi)[None, None]

    def describe(self) -> str:
        return f"Causal(alignment={self.alignment!r})"


class Padding(Mask):
    """Key padding: in batch row b, only the first ``lengths[b]`` keys may be attended.

    Build it from ``lengths`` (B,) integers, or from ``keep``, a (B, S) bool tensor where
    True marks a real (attendable) key. Note that ``torch.nn.MultiheadAttention``'s
    ``key_padding_mask`` uses the opposite convention (True = ignore): pass ``~kpm`` here.
    """

    def __init__(self, lengths: Tensor | None = None, *, keep: Tensor | None = None) -> None:
        if (lengths is None) == (keep is None):
            raise ValueError("Padding: give exactly one of `lengths` (B,) or `keep` (B, S)")
        if lengths is not None:
            if not isinstance(lengths, Tensor):
                lengths = torch.as_tensor(lengths)
            if lengths.dim() != 1 or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
                raise ValueError(
                    f"Padding: lengths must be a 1-D integer tensor (B,), got "
                    f"shape {tuple(lengths.shape)} dtype {lengths.dtype}"
                )
            if (lengths < 0).any():
                raise ValueError(f"Padding: lengths must be >= 0, got {lengths.tolist()}")
        if keep is not None and (
                not isinstance(keep, Tensor) or keep.dtype != torch.bool or keep.dim() != 2):
            got = (f"shape {tuple(keep.shape)} dtype {keep.dtype}"
                   if isinstance(keep, Tensor) else type(keep).__name__)
            raise ValueError(f"Padding: keep must be a (B, S) bool tensor, got {got}")
        self.lengths = lengths
        self.keep = keep

    @property
    def batch(self) -> int:
        """B, the batch size this mask was built for."""
        return (self.lengths if self.lengths is not None else self.keep).shape[0]

    def validate(self, batch, heads, n, s):
        if self.batch not in (1, batch):
            raise ValueError(f"Padding: built for batch {self.batch}, attention has batch {batch}")
        if self.keep is not None and self.keep.shape[1] != s:
            raise ValueError(
                f"Padding: keep has {self.keep.shape[1]} keys (shape {tuple(self.keep.shape)}), "
                f"attention has S={s}"
            )
        if self.lengths is not None and self.lengths.numel() and int(self.lengths.max()) > s:
            raise ValueError(
                f"Padding: a length ({int(self.lengths.max())}) exceeds the key length S={s}"
            )

    def block(self, i0, i1, j0, j1, n, s, device):
        if self.keep is not None:
            return self.keep[:, None, None, j0:j1].to(device)
        lengths = self.lengths.to(device)
        kj = torch.arange(j0, j1, device=device)
        return (kj[None, :] < lengths[:, None])[:, None, None, :]

    def describe(self) -> str:
        return "Padding(lengths)" if self.lengths is not None else "Padding(keep)"


class DenseMask(Mask):
    """A plain bool tensor broadcastable to (B, H, N, S), True = may attend."""

    def __init__(self, tensor: Tensor) -> None:
        if not isinstance(tensor, Tensor):
            raise TypeError(f"mask: expected a bool tensor or a qkv.masks.Mask, got "
                            f"{type(tensor).__name__}")
        if tensor.dtype != torch.bool:
            raise TypeError(
                f"mask: must be a bool tensor (True = may attend), got dtype {tensor.dtype}; "
                f"pass additive float masks as `bias=`"
            )
        if tensor.dim() > 4:
            raise ValueError(f"mask: at most 4 dims (B, H, N, S), got shape {tuple(tensor.shape)}")
        while tensor.dim() < 4:
            tensor = tensor[None]
        self.tensor = tensor

    def validate(self, batch, heads, n, s):
        want = (batch, heads, n, s)
        for got, full, name in zip(self.tensor.shape, want, "BHNS", strict=True):
            if got not in (1, full):
                raise ValueError(
                    f"mask: shape {tuple(self.tensor.shape)} is not broadcastable to "
                    f"(B, H, N, S) = {want} (dim {name})"
                )

    def block(self, i0, i1, j0, j1, n, s, device):
        t = self.tensor
        rows = slice(i0, i1) if t.shape[2] != 1 else slice(None)
        cols = slice(j0, j1) if t.shape[3] != 1 else slice(None)
        return t[:, :, rows, cols].to(device)

    def describe(self) -> str:
        return f"DenseMask{tuple(self.tensor.shape)}"


class And(Mask):
    """Conjunction of masks: a pair may attend only if every part allows it."""

    def __init__(self, parts: tuple[Mask, ...]) -> None:
        flat: list[Mask] = []
        for p in parts:
            flat.extend(p.parts if isinstance(p, And) else (p,))
        self.parts = tuple(flat)

    def validate(self, batch, heads, n, s):
        for p in self.parts:
            p.validate(batch, heads, n, s)

    @property
    def sparse(self) -> bool:
        return any(p.sparse for p in self.parts)

    @property
    def tile(self) -> int | None:
        return next((p.tile for p in self.parts if p.tile is not None), None)

    def live_key_tiles(self, i0: int, i1: int, n: int, s: int) -> list[tuple[int, int]] | None:
        """A block-sparse part's live key blocks (the other parts only narrow them further,
        which ``block`` applies); None when no part lists its blocks."""
        for p in self.parts:
            tiles = getattr(p, "live_key_tiles", None)
            if tiles is not None:
                return tiles(i0, i1, n, s)
        return None

    def key_range(self, i0, i1, n, s):
        lo, hi = 0, s
        for p in self.parts:
            a, b = p.key_range(i0, i1, n, s)
            lo, hi = max(lo, a), min(hi, b)
        return lo, max(lo, hi)

    def block(self, i0, i1, j0, j1, n, s, device):
        out: MaskBlock = True
        for p in self.parts:
            out = _and_blocks(out, p.block(i0, i1, j0, j1, n, s, device))
            if out is False:
                return False
        return out

    def describe(self) -> str:
        return " & ".join(p.describe() for p in self.parts)


def as_mask(mask: Mask | Tensor | None) -> Mask | None:
    """Turn a user's ``mask=`` argument into a Mask (None stays None).

    Accepts a qkv Mask or a bool tensor broadcastable to (B, H, N, S). Float tensors are
    refused with a pointer to ``bias=``.
    """
    if mask is None or isinstance(mask, Mask):
        return mask
    return DenseMask(mask)


def split_causal(mask: Mask | None) -> tuple[Causal | None, Mask | None]:
    """Split a mask into its causal part (if exactly one) and the rest (None if nothing left).

    Backends use this to hand causality to fused kernels and keep the rest as a tensor.
    """
    if mask is None:
        return None, None
    if isinstance(mask, Causal):
        return mask, None
    if isinstance(mask, And):
        causals = [p for p in mask.parts if isinstance(p, Causal)]
        if len(causals) == 1:
            rest = [p for p in mask.parts if not isinstance(p, Causal)]
            if not rest:
                return causals[0], None
            return causals[0], rest[0] if len(rest) == 1 else And(tuple(rest))
    return None, mask
