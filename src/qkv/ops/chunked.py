"""The ``chunked`` backend: exact attention in blocks, O(N·block) memory, any bias producer.

Shapes: B batch, H query heads, Hkv key/value heads, N queries, S keys, D head dim, Dv value
dim. Output (B, H, N, Dv) in q's dtype; gradients never need an N×S tensor.

Work is split into parts whose (output, LSE) pairs merge exactly:
- explicit tiles (tiles.py): online softmax with any mask, dense bias or bias producer;
- flash segments (fused.py): for structured relative biases (ALiBi, T5, Shaw) under no mask
  or a causal mask, the bulk runs in torch's fused CPU kernel;
- sparse.py: plain sliding-window and block-sparse masks (the latter also ``& Padding``) run
  in that kernel per query block.
Logit soft-capping (``softcap``) runs on the explicit tiles only (the flash kernel has no tanh
step): a sliding-window or block-sparse mask still visits only its live key range / blocks
there (``TileProblem.key_blocks``), so the work stays O(N·(block + window)).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .bias import BiasProducer
from .fused import SegmentRunner, fast_path_refusal, plan_segments
from .masks import And, Causal, Mask
from .reference import compute_dtype, expand_kv
from .sparse import block_sparse_attention, block_sparse_refusal, window_attention, window_refusal
from .tiles import TileProblem, tiles_backward, tiles_forward

__all__ = ["chunked_attention"]


def _merge(parts: list[tuple[slice, bool, Tensor, Tensor]], like: Tensor, lse_like: Tensor
           ) -> tuple[Tensor, Tensor]:
    """Merge partial (out, lse) over row slices: exact through log-sum-exp."""
    lse = torch.full_like(lse_like, float("-inf"))
    for rows, flip, _, part_lse in parts:
        part_lse = part_lse.flip(2) if flip else part_lse
        lse[:, :, rows] = torch.logaddexp(lse[:, :, rows], part_lse)
    safe = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf")))
    out = torch.zeros_like(like)
    for rows, flip, part_out, part_lse in parts:
        if flip:
            part_out, part_lse = part_out.flip(2), part_lse.flip(2)
        weight = torch.exp(part_lse - safe[:, :, rows])  # (B, H, r)
        out[:, :, rows] += weight[..., None] * part_out
    return out, lse


class _Plan:
    """What to compute: explicit tiles (``tiles``), flash segments, and the bias params."""

    def __init__(self, q: Tensor, k: Tensor, mask: Mask | None, bias, scale: float,
                 dropout_p: float, block_q: int, block_k: int,
                 softcap: float | None = None) -> None:
        n, s = q.shape[2], k.shape[2]
        producer = bias if isinstance(bias, BiasProducer) else None
        self.scale = scale
        self.producer = producer
        self.segments = []
        self.params = [] if producer is None else [
            p for p in producer.parameters() if p.requires_grad]
        self.tiles = None
        seed = int(torch.randint(0, 2**31 - 1, ()).item()) if dropout_p > 0 else 0
        tile_bias = None if producer is not None else bias
        if (producer is not None and block_q is None and block_k is None
                and fast_path_refusal(q, k, mask, producer, dropout_p, softcap=softcap) is None):
            self.segments, band = plan_segments(n, s, isinstance(mask, Causal), producer)
            if band is not None:  # one tile per 64 queries spans the whole band
                self.tiles = TileProblem(
                    n=n, s=s, scale=scale, mask=band if mask is None else And((band, mask)),
                    producer=producer, block_q=64, block_k=64 + band.hi - band.lo,
                    device=q.device)
            return
        self.tiles = TileProblem(
            n=n, s=s, scale=scale, mask=mask, bias=tile_bias, producer=producer,
            dropout_p=dropout_p, seed=seed, block_q=block_q or 128, block_k=block_k or 512,
            softcap=softcap, device=q.device)


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Plan, q, k, v, bias_tensor, *params):
        parts = []
        n = q.shape[2]
        runner = None
        if plan.segments:
            runner = SegmentRunner(q, k, v, plan.scale, plan.producer)
            for seg in plan.segments:
                seg_out, seg_lse = runner.forward(seg)
                rows = (slice(seg.t0, seg.t1) if not seg.flipped
                        else slice(n - seg.t1, n - seg.t0))
                parts.append((rows, seg.flipped, seg_out, seg_lse))
        if plan.tiles is not None:
            t_out, t_lse = tiles_forward(plan.tiles, q, k, v)
            if not parts:
                out, lse = t_out, t_lse
            else:
                parts.append((slice(None), False, t_out, t_lse))
        if parts:
            cdt = compute_dtype(q.dtype)
            like = torch.zeros(*q.shape[:3], v.shape[-1], dtype=cdt, device=q.device)
            out, lse = _merge(parts, like, like[..., 0])
        ctx.plan, ctx.parts = plan, parts
        ctx.save_for_backward(q, k, v, bias_tensor, out, lse, *params)
        result = out.to(q.dtype)
        ctx.mark_non_differentiable(lse)
        return result, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out, _d_lse):
        q, k, v, bias_tensor, out, lse, *params = ctx.saved_tensors
        plan: _Plan = ctx.plan
        cdt = out.dtype
        d_out = d_out.to(cdt)
        delta = (d_out * out).sum(dim=-1)  # (B, H, N)
        grads = {
            "q": torch.zeros(q.shape, dtype=cdt, device=q.device),
            "k": torch.zeros(k.shape, dtype=cdt, device=q.device),
            "v": torch.zeros(v.shape, dtype=cdt, device=q.device),
            "params": [torch.zeros_like(p) for p in params],
        }
        if bias_tensor is not None and ctx.needs_input_grad[4]:
            grads["bias"] = torch.zeros(bias_tensor.shape, dtype=cdt, device=q.device)
        if plan.tiles is not None:
            tiles_backward(plan.tiles, q, k, v, d_out, delta, lse, params, grads)
        if plan.segments:
            runner = SegmentRunner(q, k, v, plan.scale, plan.producer)
            for seg, (_, _, seg_out, seg_lse) in zip(plan.segments, ctx.parts, strict=False):
                runner.backward(seg, runner.rows(seg, d_out), runner.rows(seg, out),
                                runner.rows(seg, lse), runner.rows(seg, delta),
                                seg_out, seg_lse, params, grads)
        d_bias = grads["bias"].to(bias_tensor.dtype) if "bias" in grads else None
        return (None, grads["q"].to(q.dtype), grads["k"].to(k.dtype), grads["v"].to(v.dtype),
                d_bias, *[g.to(p.dtype) for g, p in zip(grads["params"], params, strict=True)])


def chunked_attention(q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | None = None,
                      bias: Tensor | BiasProducer | None = None, scale: float,
                      dropout_p: float = 0.0, block_q: int | None = None,
                      block_k: int | None = None, softcap: float | None = None
                      ) -> tuple[Tensor, Tensor]:
    """Exact attention in blocks. q (B, H, N, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv).

    Returns ``(out, lse)``: out (B, H, N, Dv) in q's dtype, lse (B, H, N) (-inf for rows that
    attend to nothing, whose output is 0; None from the sliding-window path). Giving
    ``block_q``/``block_k`` forces plain explicit tiles of that size (no fused fast path); by
    default structured bias producers, a plain ``SlidingWindow`` and a plain ``BigBird`` /
    ``BlockSparse`` / ``Longformer``, alone or ``& Padding(...)`` (no bias or dropout), take
    fused paths; other block-sparse masks use their block size as the tile. ``softcap``
    (a positive float, or None) caps q kᵀ · scale as ``softcap · tanh(· / softcap)`` before
    the bias and the mask; it always runs on the explicit tiles (no fused path).
    """
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if size is not None and (isinstance(size, bool) or not isinstance(size, int)
                                 or size < 1):
            raise ValueError(f"chunked_attention: {name} must be a positive int or None, "
                             f"got {size!r}")
    heads = q.shape[1]
    k, v = expand_kv(k, heads), expand_kv(v, heads)  # (B, H, S, D)
    if (block_q is None and block_k is None
            and window_refusal(q, mask, bias, dropout_p, softcap=softcap) is None):
        out = window_attention(q, k, v, window=mask, scale=scale)
        return out, None
    if (block_q is None and block_k is None
            and block_sparse_refusal(q, mask, bias, dropout_p, softcap=softcap) is None):
        return block_sparse_attention(q, k, v, mask=mask, scale=scale)
    if mask is not None and mask.tile is not None:  # block-sparse layouts: tiles = blocks
        block_q = block_q or mask.tile
        block_k = block_k or mask.tile
    plan = _Plan(q, k, mask, bias, scale, dropout_p, block_q, block_k, softcap)
    bias_tensor = bias if isinstance(bias, Tensor) else None
    out, lse = _ChunkedAttention.apply(plan, q, k, v, bias_tensor, *plan.params)
    return out, lse
