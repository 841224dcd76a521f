"""Sliding-window attention that computes only the band, in torch's fused CPU kernel.

Shapes: B batch, H heads (keys/values already expanded), N queries, S keys, D head dim,
W window, R rows per block. Query i sits at position ``p = i + S - N``.

Each block of R query rows sees the keys ``[p0 - W + 1, p_last + hi)``: one kernel call per
block with a small (R, R + W - 1) additive mask — the rows are complete, so no merging is
needed; backward calls the kernel's backward per block with the saved output and LSE.
Work is O(N·(R + W)) instead of O(N·S); memory O(N·D + R·(R + W)).
Other sparse patterns (Longformer, BigBird, BlockSparse) run on the chunked backend's
explicit tiles, which skip dead tiles.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .reference import compute_dtype
from .sparse_masks import SlidingWindow

__all__ = ["window_attention", "window_refusal"]

_flash_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def window_refusal(q: Tensor, mask, bias, dropout_p: float) -> str | None:
    """Why the window fast path cannot serve (None: it can)."""
    if not isinstance(mask, SlidingWindow):
        return "not a plain SlidingWindow mask"
    if bias is not None:
        return "a bias"
    if dropout_p > 0:
        return "dropout"
    if q.device.type != "cpu":
        return "uses torch's CPU flash kernel"
    return None


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
        qc, kc, vc, dc = q.to(cdt), k.to(cdt), v.to(cdt), d_out.to(cdt)
        dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
        dk = torch.zeros(k.shape, dtype=cdt, device=q.device)
        dv = torch.zeros(v.shape, dtype=cdt, device=q.device)
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
