"""Sliding-window and block-sparse attention in torch's fused CPU (flash) kernel.

Shapes: B batch, H heads (keys/values already expanded), N queries, S keys, D head dim,
W window, R rows per block. Query i sits at position ``p = i + S - N``.

Each block of R query rows sees the keys ``[p0 - W + 1, p_last + hi)``: one kernel call per
block with a small (R, R + W - 1) additive mask — the rows are complete, so no merging is
needed; backward calls the kernel's backward per block with the saved output and LSE.
Work is O(N·(R + W)) instead of O(N·S); memory O(N·D + R·(R + W)).
Block-sparse patterns (``BigBird``, ``BlockSparse``, ``Longformer``) without padding, bias
or dropout take the same kernel: each query block gathers its live key blocks (index_select,
contiguous) and makes one call, with an additive mask only where the pattern is not all-True
inside the gathered tile (causal diagonals, per-head layouts, window edges); backward calls
the kernel's backward per block and scatter-adds dK, dV through the gather. Longformer's
global query rows run apart against every key. A pattern ``& Padding(...)`` (key padding,
one or more) takes the same calls: the gathered keys padded in every batch row are dropped,
and a tile holding keys padded in some rows gets a per-batch-row additive mask (B, h, R, K).
Other combined masks run on the chunked backend's explicit tiles, which skip dead tiles.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .masks import And, Padding
from .reference import compute_dtype
from .sparse_masks import BigBird, BlockSparse, Longformer, SlidingWindow

__all__ = ["block_sparse_attention", "block_sparse_refusal", "window_attention",
           "window_refusal"]

_flash_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _kernel_refusal(q: Tensor, bias, dropout_p: float, softcap: float | None) -> str | None:
    """What torch's CPU flash kernel paths of this file cannot take (None: nothing)."""
    if bias is not None:
        return "a bias"
    if dropout_p > 0:
        return "dropout"
    if softcap is not None:
        return f"logit soft-capping (softcap={softcap!r}): the flash kernel has no tanh step"
    if q.device.type != "cpu":
        return "uses torch's CPU flash kernel"
    return None


def _backward_buffers(q: Tensor, k: Tensor, v: Tensor, d_out: Tensor, cdt: torch.dtype
                      ) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """The kernel paths' backward start: (q, k, v, dOut) in the compute dtype, and zeroed
    (dQ, dK, dV) accumulators of q/k/v's shapes in it."""
    inputs = (q.to(cdt), k.to(cdt), v.to(cdt), d_out.to(cdt))
    grads = tuple(torch.zeros(t.shape, dtype=cdt, device=q.device) for t in (q, k, v))
    return inputs, grads


def window_refusal(q: Tensor, mask, bias, dropout_p: float, *,
                   softcap: float | None = None) -> str | None:
    """Why the window fast path cannot serve (None: it can)."""
    if not isinstance(mask, SlidingWindow):
        return "not a plain SlidingWindow mask"
    return _kernel_refusal(q, bias, dropout_p, softcap)


def _blocks(n: int, s: int, window: SlidingWindow, rows: int):
    """(t0, t1, lo, hi, mask) per block of live rows: keys [lo, hi), additive mask (R, K)."""
    delta = s - n
    for t0 in range(0, n, rows):
        t1 = min(n, t0 + rows)
        lo, hi = window.key_range(t0, t1, n, s)
        if lo >= hi:
            continue
        rel = (torch.arange(lo, hi)[None, :] - torch.arange(t0, t1)[:, None] - delta)
        keep = (rel > -window.window) & (rel < window.hi)  # (R, K)
        live = keep.any(dim=1)
        if not bool(live.all()):  # rows that see no key stay zero; trim them off
            idx = live.nonzero().squeeze(1)
            if idx.numel() == 0:
                continue
            t0, t1 = t0 + int(idx[0]), t0 + int(idx[-1]) + 1
            keep = keep[int(idx[0]):int(idx[-1]) + 1]
        yield t0, t1, lo, hi, keep


class _WindowAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, window: SlidingWindow, scale: float, rows: int):
        cdt = compute_dtype(q.dtype)
        qc, kc, vc = q.to(cdt), k.to(cdt), v.to(cdt)
        n, s = q.shape[2], k.shape[2]
        out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=cdt, device=q.device)
        lse = torch.zeros(q.shape[:3], dtype=torch.float32 if cdt != torch.float64 else cdt,
                          device=q.device)
        blocks = []
        for t0, t1, lo, hi, keep in _blocks(n, s, window, rows):
            add = torch.zeros(keep.shape, dtype=cdt).masked_fill_(~keep, float("-inf"))
            add = add.to(q.device)[None, None]  # (1, 1, R, K)
            o, l_ = _flash_fwd(qc[:, :, t0:t1], kc[:, :, lo:hi], vc[:, :, lo:hi], 0.0, False,
                               attn_mask=add, scale=scale)
            out[:, :, t0:t1], lse[:, :, t0:t1] = o, l_
            blocks.append((t0, t1, lo, hi, add))
        ctx.blocks, ctx.scale = blocks, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        cdt = out.dtype
        (qc, kc, vc, dc), (dq, dk, dv) = _backward_buffers(q, k, v, d_out, cdt)
        for t0, t1, lo, hi, add in ctx.blocks:
            gq, gk, gv = _flash_bwd(dc[:, :, t0:t1].contiguous(), qc[:, :, t0:t1],
                                    kc[:, :, lo:hi], vc[:, :, lo:hi],
                                    out[:, :, t0:t1].contiguous(),
                                    lse[:, :, t0:t1].contiguous(), 0.0, False,
                                    attn_mask=add, scale=ctx.scale)
            dq[:, :, t0:t1] += gq
            dk[:, :, lo:hi] += gk
            dv[:, :, lo:hi] += gv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def window_attention(q: Tensor, k: Tensor, v: Tensor, *, window: SlidingWindow, scale: float,
                     rows: int = 256) -> Tensor:
    """Sliding-window attention. q (B, H, N, D), k (B, H, S, D), v (B, H, S, Dv) (keys and
    values already at H heads) -> (B, H, N, Dv); rows that see no key are zeros."""
    return _WindowAttention.apply(q, k, v, window, scale, rows)


# --- block-sparse patterns (BigBird, BlockSparse, Longformer) in the same kernel ------------


def block_sparse_refusal(q: Tensor, mask, bias, dropout_p: float, *,
                         softcap: float | None = None) -> str | None:
    """Why the fused block-sparse path cannot serve (None: it can): it takes a plain
    ``BigBird`` / ``BlockSparse`` / ``Longformer`` mask, alone or ``& Padding(...)``, with no
    bias, dropout or soft cap."""
    if _split_padding(mask) is None:
        return "not a BigBird / BlockSparse / Longformer mask, alone or & Padding"
    return _kernel_refusal(q, bias, dropout_p, softcap)


def _split_padding(mask) -> tuple | None:
    """(pattern, paddings) for a block-sparse pattern alone or ``& Padding(...)``; None for
    anything else."""
    parts = mask.parts if isinstance(mask, And) else (mask,)
    patterns = [p for p in parts if isinstance(p, (BigBird, BlockSparse, Longformer))]
    pads = [p for p in parts if isinstance(p, Padding)]
    if len(patterns) != 1 or len(patterns) + len(pads) != len(parts):
        return None
    return patterns[0], pads


def _key_padding(pads, s: int, device) -> Tensor | None:
    """The Padding parts as one (B|1, S) bool tensor (True = real key); None when none."""
    keep = None
    for p in pads:
        blk = p.block(0, 1, 0, s, 1, s, device)[:, 0, 0, :]  # (B|1, S)
        keep = blk if keep is None else keep & blk
    return keep


def _with_padding(groups: list, pad: Tensor, device) -> list:
    """Narrow planned groups (q_rows, keys, keep) by key padding ``pad`` (B|1, S): drop the
    keys padded in every batch row, mask the ones padded in some (keep becomes (B, h, R, K))."""
    out = []
    for q_rows, keys, keep in groups:
        pk = pad[:, keys]  # (B|1, K)
        if bool(pk.all()):
            out.append((q_rows, keys, keep))
            continue
        cols = pk.any(dim=0)  # (K,)
        if not bool(cols.any()):
            continue
        if not bool(cols.all()):
            idx = cols.nonzero().squeeze(1)
            whole = (torch.arange(keys.start, keys.stop, device=device)
                     if isinstance(keys, slice) else keys)
            keys, pk = whole[idx], pk[:, idx]
            if keep is not True:
                keep = keep[..., idx]
            if bool(pk.all()):
                out.append((q_rows, keys, keep))
                continue
        rows = q_rows.stop - q_rows.start
        keep = pk[:, None, None, :] if keep is True else keep & pk[:, None, None, :]
        out.append((q_rows, keys, keep.expand(*keep.shape[:2], rows, keep.shape[-1])))
    return out


def _runs(cols: list[int]) -> list[tuple[int, int]]:
    """Sorted indices -> contiguous runs [a, b)."""
    runs: list[tuple[int, int]] = []
    for c in cols:
        if runs and runs[-1][1] == c:
            runs[-1] = (runs[-1][0], c + 1)
        else:
            runs.append((c, c + 1))
    return runs


def _tile_keep(mask, rows: tuple[int, int], runs, n: int, s: int, device):
    """The mask over queries rows[0]:rows[1] against the concatenated key runs: True, or a
    bool tensor (b, h, R, K); None when no pair is live."""
    i0, i1 = rows
    parts = []
    for j0, j1 in runs:
        blk = mask.block(i0, i1, j0, j1, n, s, device)
        if blk is not False:
            parts.append((j0, j1, blk))
    if not parts:
        return None, []
    live_runs = [(j0, j1) for j0, j1, _ in parts]
    if all(blk is True for _, _, blk in parts):
        return True, live_runs
    tensors = [blk for _, _, blk in parts if blk is not True]
    b = max(t.shape[0] for t in tensors)
    h = max(t.shape[1] for t in tensors)
    keep = torch.cat([torch.ones(b, h, i1 - i0, j1 - j0, dtype=torch.bool, device=device)
                      if blk is True else blk.expand(b, h, i1 - i0, j1 - j0)
                      for j0, j1, blk in parts], dim=-1)
    return keep, live_runs


def _keys_of(runs, device):
    """A slice for one run, else an index tensor over all runs."""
    if len(runs) == 1:
        return slice(*runs[0])
    return torch.cat([torch.arange(j0, j1, device=device) for j0, j1 in runs])


def _plan_block_sparse(mask, n: int, s: int, rows: int, device) -> list:
    """Groups (q_rows, keys, keep, dead_rows): ``q_rows`` a slice, ``keys`` a slice or index
    tensor, ``keep`` True or a bool tensor (b, h, R, K), ``dead_rows`` None or a bool tensor
    (b, h, R) of rows that see no key in this group."""
    mask, pads = _split_padding(mask)
    pad = _key_padding(pads, s, device)
    groups = []
    if isinstance(mask, Longformer):
        g = mask.global_tokens.tolist()
        g_rows = [i for i in g if i < n]
        for i0 in range(0, n, rows):
            i1 = min(n, i0 + rows)
            lo, hi = mask.local.key_range(i0, i1, n, s)
            cols = sorted(set(range(lo, hi)) | {j for j in g if j < s})
            keep, runs = _tile_keep(mask, (i0, i1), _runs(cols), n, s, device)
            inside = [i - i0 for i in g_rows if i0 <= i < i1]
            if keep is None or len(inside) == i1 - i0:
                continue
            if inside:  # global rows run in their own group below
                if keep is True:
                    k_len = sum(j1 - j0 for j0, j1 in runs)
                    keep = torch.ones(1, 1, i1 - i0, k_len, dtype=torch.bool, device=device)
                else:
                    keep = keep.clone()
                keep[:, :, inside] = False
            groups.append((slice(i0, i1), _keys_of(runs, device), keep))
        for i in g_rows:  # global rows see every key (causal: up to their position)
            keep, runs = _tile_keep(mask, (i, i + 1), [(0, s)], n, s, device)
            if keep is not None:
                groups.append((slice(i, i + 1), _keys_of(runs, device), keep))
        groups = _merge_rows(groups, device)
    else:
        bs = mask.tile
        layout = (mask._sparse(n, s) if isinstance(mask, BigBird) else mask).layout
        causal = isinstance(mask, BigBird) and mask.causal
        for i0 in range(0, n, bs):
            i1 = min(n, i0 + bs)
            tiles = mask.live_key_tiles(i0, i1, n, s)
            if not tiles:
                continue
            keys = _keys_of(_runs_of_tiles(tiles), device)
            keep = _layout_keep(layout[..., i0 // bs, :], tiles, bs, i1 - i0, device)
            if causal:  # j <= position of the query, element by element
                idx = torch.arange(keys.start, keys.stop) if isinstance(keys, slice) else keys
                pos = torch.arange(i0, i1, device=device) + (s - n)
                c = (idx.to(device)[None, :] <= pos[:, None])
                if not bool(c.all()):
                    keep = c[None, None] if keep is True else keep & c
            groups.append((slice(i0, i1), keys, keep))
        groups = _merge_rows(groups, device)
    if pad is not None and not bool(pad.all()):
        groups = _with_padding(groups, pad, device)
    out = []
    for q_rows, keys, keep in groups:
        dead = None
        if keep is not True:
            dead = ~keep.any(dim=-1)
            if bool(dead.all()):
                continue
            if not bool(dead.any()):
                dead = None
        out.append((q_rows, keys, keep, dead))
    return out


def _layout_keep(row: Tensor, tiles, bs: int, rows: int, device):
    """Mask of one layout row ``row`` (b, h, S/bs) over the gathered ``tiles``: True when
    every (batch, head) sees them all, else a bool tensor (b, h, R, K)."""
    lay = row[..., [j0 // bs for j0, _ in tiles]]  # (b, h, T)
    if bool(lay.all()):
        return True
    widths = torch.tensor([j1 - j0 for j0, j1 in tiles])
    full = lay.repeat_interleave(widths, dim=-1).to(device)  # (b, h, K)
    return full[:, :, None, :].expand(*full.shape[:2], rows, full.shape[-1])


def _runs_of_tiles(tiles) -> list[tuple[int, int]]:
    """Merge adjacent [j0, j1) tiles into contiguous runs."""
    runs: list[tuple[int, int]] = []
    for j0, j1 in tiles:
        if runs and runs[-1][1] == j0:
            runs[-1] = (runs[-1][0], j1)
        else:
            runs.append((j0, j1))
    return runs


def _same_keys(a, b) -> bool:
    if isinstance(a, slice) or isinstance(b, slice):
        return isinstance(a, slice) and isinstance(b, slice) and (a.start, a.stop) == (
            b.start, b.stop)
    return a.shape == b.shape and bool(torch.equal(a, b))


def _merge_rows(groups: list, device) -> list:
    """Join consecutive row groups with the same keys into one kernel call (e.g. BigBird's
    global query blocks, which all see every key)."""
    merged: list = []
    for q_rows, keys, keep in groups:
        if merged:
            p_rows, p_keys, p_keep = merged[-1]
            if p_rows.stop == q_rows.start and _same_keys(p_keys, keys) and (
                    p_keep is True and keep is True):
                merged[-1] = (slice(p_rows.start, q_rows.stop), p_keys, True)
                continue
        merged.append((q_rows, keys, keep))
    return merged


class _Gather:
    """Gathers rows (dim 2) of k / v into buffers reused by calls of the same length: a
    fresh allocation of a few MiB per kernel call costs more than the copy itself."""

    def __init__(self) -> None:
        self.bufs: dict = {}

    def __call__(self, t: Tensor, idx, slot: str) -> Tensor:
        if isinstance(idx, slice):
            return t[:, :, idx]
        shape = (*t.shape[:2], idx.numel(), t.shape[3])
        buf = self.bufs.get((slot, shape))
        if buf is None:
            buf = self.bufs[(slot, shape)] = torch.empty(shape, dtype=t.dtype, device=t.device)
        return torch.index_select(t, 2, idx, out=buf)


def _additive(keep, dtype) -> Tensor | None:
    if keep is True:
        return None
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(
        ~keep, float("-inf"))


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, groups, scale: float):
        cdt = compute_dtype(q.dtype)
        qc, kc, vc = q.to(cdt), k.to(cdt), v.to(cdt)
        out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=cdt, device=q.device)
        lse = torch.zeros(q.shape[:3], dtype=cdt, device=q.device)  # the kernel's
        take = _Gather()
        for q_rows, keys, keep, _ in groups:
            o, l_ = _flash_fwd(qc[:, :, q_rows], take(kc, keys, "k"), take(vc, keys, "v"), 0.0,
                               False, attn_mask=_additive(keep, cdt), scale=scale)
            out[:, :, q_rows], lse[:, :, q_rows] = o, l_.to(cdt)
        ctx.groups, ctx.scale = groups, scale
        ctx.save_for_backward(q, k, v, out, lse)
        live = torch.zeros(q.shape[:3], dtype=torch.bool, device=q.device)
        for q_rows, _, _, dead in groups:
            live[:, :, q_rows] = True if dead is None else ~dead
        user_lse = lse.masked_fill(~live, float("-inf"))
        ctx.mark_non_differentiable(user_lse)
        return out.to(q.dtype), user_lse

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out, _d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        cdt = out.dtype
        (qc, kc, vc, dc), (dq, dk, dv) = _backward_buffers(q, k, v, d_out, cdt)
        take = _Gather()
        for q_rows, keys, keep, _ in ctx.groups:
            gq, gk, gv = _flash_bwd(dc[:, :, q_rows].contiguous(), qc[:, :, q_rows],
                                    take(kc, keys, "k"), take(vc, keys, "v"),
                                    out[:, :, q_rows].contiguous(),
                                    lse[:, :, q_rows].contiguous(), 0.0, False,
                                    attn_mask=_additive(keep, cdt), scale=ctx.scale)
            dq[:, :, q_rows] += gq
            if isinstance(keys, slice):
                dk[:, :, keys] += gk
                dv[:, :, keys] += gv
            else:
                dk.index_add_(2, keys, gk)
                dv.index_add_(2, keys, gv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def block_sparse_attention(q: Tensor, k: Tensor, v: Tensor, *, mask, scale: float,
                           rows: int = 256) -> tuple[Tensor, Tensor]:
    """Block-sparse attention (``BigBird``, ``BlockSparse``, ``Longformer``, alone or
    ``& Padding(...)``) in torch's CPU flash kernel. q (B, H, N, D), k (B, H, S, D),
    v (B, H, S, Dv) (keys and values already at H heads) -> out (B, H, N, Dv) in q's dtype
    and lse (B, H, N) (-inf, and out 0, for rows that see no key).

    Each query block (the mask's ``tile`` rows; ``rows`` rows for Longformer, whose global
    query rows run apart against all keys) gathers its live key blocks into one contiguous
    tile and makes one kernel call, with an additive mask only where the pattern is not
    all-True; backward calls the kernel's backward per block and scatter-adds dK, dV.
    Key padding drops the keys padded in every batch row and masks, per batch row, those
    padded in some (their weight is exactly 0; ``qkv.attention`` zeroes padded k/v first, so
    NaN/inf there cannot leak in).
    """
    groups = _plan_block_sparse(mask, q.shape[2], k.shape[2], rows, q.device)
    return _BlockSparseAttention.apply(q, k, v, groups, scale)
