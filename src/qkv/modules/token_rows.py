"""``TokenRows``: the T real tokens of a padded (B, N) batch, packed into (T, ...) rows.

Shapes: B batch, N padded length, T real tokens in all (T = B·N when nothing is padded),
C model width.

Token-wise ops (norms, projections, feed-forwards) run on the packed rows; attention alone
unpacks them into the padded (B, H, N, D) layout (``MultiHeadAttention.forward(x, rows=...)``,
``EncoderLayer.forward(x, rows=...)``). Here, below both, so that the attention module and
the layers share one description of the layout. ``chosen_queries``: the mask and bias of one
query per sequence (``at=``) out of those of all N queries.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..ops import BiasProducer
from ..ops.masks import as_mask

__all__ = ["TokenRows", "chosen_queries"]


class TokenRows:
    """Where the T real tokens of a padded (B, N) batch sit, to pack them into (T, C) rows.

    Args:
        keep: (B, N) bool, True = real token (any padding pattern, left or right); None:
            nothing is padded (give ``batch`` and ``length``: T = B·N, packing is a view).

    Attributes: ``index`` (T,) flat positions of the real tokens in B·N (ascending), or None
    when nothing is padded; ``batch`` B; ``length`` N; ``count`` T.
    """

    def __init__(self, keep: Tensor | None, *, batch: int | None = None,
                 length: int | None = None) -> None:
        if keep is None:
            if batch is None or length is None:
                raise ValueError("TokenRows: without keep, give batch and length")
            self.batch, self.length, self.index = batch, length, None
            return
        if not isinstance(keep, Tensor) or keep.dtype != torch.bool or keep.dim() != 2:
            got = (f"shape {tuple(keep.shape)} dtype {keep.dtype}"
                   if isinstance(keep, Tensor) else type(keep).__name__)
            raise ValueError(f"TokenRows: keep must be a (B, N) bool tensor, got {got}")
        self.batch, self.length = keep.shape
        self.index = keep.reshape(-1).nonzero().squeeze(1)  # (T,)

    @property
    def count(self) -> int:
        """T, the number of packed rows."""
        return self.batch * self.length if self.index is None else self.index.numel()

    def pack(self, x: Tensor) -> Tensor:
        """x (B, N, ...) -> the real tokens' rows (T, ...)."""
        flat = x.reshape(self.batch * self.length, *x.shape[2:])  # (B·N, ...)
        return flat if self.index is None else flat.index_select(0, self.index)

    def unpack(self, h: Tensor, *, out: Tensor | None = None,
               bufs: dict[str, Tensor] | None = None) -> Tensor:
        """Rows h (T, ...) -> (B, N, ...) with zeros at padded positions (or written into
        ``out`` (B·N, ...), whose padded rows are left as they are).

        ``bufs`` (instead of ``out``): a dict shared by the calls of one no-grad forward;
        ``out`` is its ``"full"`` buffer, zeros where first made and reused while its shape,
        dtype and device fit (only real rows are ever written: its padded rows stay zero).
        """
        shape = (self.batch, self.length, *h.shape[1:])
        if self.index is None:
            return h.view(shape)
        if bufs is not None and out is None:
            out = bufs.get("full")
            if (out is None or out.shape != (self.batch * self.length, *h.shape[1:])
                    or out.dtype != h.dtype or out.device != h.device):
                out = bufs["full"] = h.new_zeros(self.batch * self.length, *h.shape[1:])
        if out is None:
            return h.new_zeros(self.batch * self.length, *h.shape[1:]).index_copy(
                0, self.index, h).view(shape)
        return out.index_copy_(0, self.index, h).view(shape)

    def columns(self, at: Tensor) -> Tensor:
        """The padded positions of one chosen row per sequence: at (B,) integer rows of the
        (T, ...) packing, ``at[b]`` a token of sequence b -> (B,) its column 0 ≤ c < N.

        Raises:
            ValueError when ``at`` is not a (B,) integer tensor, a row is outside [0, T),
            or ``at[b]`` is a token of another sequence than b.
        """
        b, t = self.batch, self.count
        if (not isinstance(at, Tensor) or at.dtype.is_floating_point or at.dtype.is_complex
                or at.dtype == torch.bool or tuple(at.shape) != (b,)):
            got = (f"shape {tuple(at.shape)} dtype {at.dtype}" if isinstance(at, Tensor)
                   else type(at).__name__)
            raise ValueError(f"TokenRows: at must be a (B,) = ({b},) integer tensor of rows, "
                             f"got {got}")
        if b and not bool(((at >= 0) & (at < t)).all()):
            raise ValueError(f"TokenRows: at must hold rows in [0, T={t}), got {at.tolist()}")
        flat = at if self.index is None else self.index[at]  # (B,) positions in B·N
        seq = torch.div(flat, self.length, rounding_mode="floor")
        if not torch.equal(seq, torch.arange(b, device=at.device, dtype=seq.dtype)):
            raise ValueError(f"TokenRows: at[b] must be a token of sequence b; at "
                             f"{at.tolist()} lies in sequences {seq.tolist()}")
        return flat - seq * self.length  # (B,)


def _query_rows(t: Tensor, cols: Tensor) -> Tensor:
    """t broadcastable to (B, H, N, S) -> (B|1, H|1, 1, S|1): batch row b's query row
    ``cols[b]`` (t itself when it does not vary over the queries)."""
    while t.dim() < 4:
        t = t[None]
    if t.shape[2] == 1:
        return t
    b = cols.shape[0]
    t = t.expand(b, *t.shape[1:])  # (B, H|1, N, S|1)
    return t[torch.arange(b, device=cols.device), :, cols][:, :, None]  # (B, H|1, 1, S|1)


def chosen_queries(mask: Any, causal: bool, bias: Any, cols: Tensor, heads: int, n: int,
                   s: int) -> tuple[Tensor | None, Tensor | None]:
    """The mask and bias of one query per sequence, out of those of all N queries.

    Args:
        mask: a ``qkv.masks.Mask``, a bool tensor broadcastable to (B, H, N, S), or None.
        causal: whether the N queries are causal (bottom-right: query column c sits at key
            position S - N + c).
        bias: an additive float tensor broadcastable to (B, H, N, S), or None.
        cols: (B,) integer, sequence b's query column 0 ≤ c < N (``TokenRows.columns``).
        heads, n, s: H, N and S of the full problem.

    Returns:
        ``(mask, bias)``: a bool (B|1, H|1, 1, S) tensor (the causal part folded in; None
        when every key may be attended) and the bias' rows (B|1, H|1, 1, S|1) or None —
        what attention of the B chosen queries (B, H, 1, D) takes for the same result as
        their rows of the N queries' attention.

    Raises:
        ValueError for a bias producer (it places queries by their count, not their
        columns), a bias tensor not broadcastable to (B, H, N, S), or a mask that does not
        fit (the mask's own ``validate``).
    """
    if isinstance(bias, BiasProducer):
        raise ValueError(f"chosen_queries: bias must be a tensor for chosen queries (at=), "
                         f"not a bias producer ({type(bias).__name__}); run all rows")
    b, device = cols.shape[0], cols.device
    m, sel = as_mask(mask), None
    if m is not None:
        m.validate(b, heads, n, s)
        blk = m.block(0, n, 0, s, n, s, device)
        if blk is False:
            sel = torch.zeros(1, 1, 1, s, dtype=torch.bool, device=device)
        elif blk is not True:
            sel = _query_rows(blk, cols)
    if causal:  # query at column c is key s - n + c
        keys = torch.arange(s, device=device) <= (cols + (s - n))[:, None]  # (B, S)
        sel = keys[:, None, None, :] if sel is None else sel & keys[:, None, None, :]
    if bias is not None:
        full = (b, heads, n, s)
        if (not isinstance(bias, Tensor) or bias.dim() > 4
                or any(g not in (1, f) for g, f in zip(bias.shape[::-1], full[::-1],
                                                       strict=False))):
            got = tuple(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__
            raise ValueError(f"chosen_queries: bias must be broadcastable to (B, H, N, S) = "
                             f"{full}, got {got}")
        bias = _query_rows(bias, cols)
    return sel, bias
