"""Fast path of the chunked backend for structured relative biases: most of the work runs in
torch's fused CPU flash kernel, and partial results merge exactly through their log-sum-exp.

Shapes: B batch, H heads (keys/values already expanded), N queries, S keys, D head dim.

Two facts make a relative bias cheap (see BiasProducer):
- far field (T5 buckets, Shaw): beyond a distance W the bias does not depend on the key, so
  the far keys are one plain attention (a causal mask shifted by W, or its mirror image)
  whose log-sum-exp is moved by a per-row term, and whose output gains a constant value
  vector (Shaw); only the band |j - pos_i| < W needs explicit tiles.
- key-linear (ALiBi): on the causal side slope·(j - pos_i) = slope·(j - ref) + row term, and
  slope·(j - ref)/scale fits in one extra query/key dimension (query 1, key value). ``ref`` is
  the middle row of a block of ``ALIBI_ROWS`` queries, so the folded term stays small near
  the diagonal (where the weight is) and the logits keep fp32 accuracy.
The right-hand (future) side of a bidirectional bias is the left side of the time-reversed
problem, so every flash call is a top-left causal or an unmasked one.

Backward calls the kernel's own backward on each segment with the *merged* output and LSE
(shifted by the segment's row term), which yields exactly that segment's share of dQ, dK, dV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .bias import BiasProducer
from .masks import Causal, Mask
from .reference import compute_dtype

__all__ = ["ALIBI_ROWS", "Band", "FlashSegment", "fast_path_refusal", "plan_segments"]

ALIBI_ROWS = 1024  # torch's CPU kernel uses its largest query tiles from 768 rows

_flash_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class Band(Mask):
    """Keys with ``lo < j - pos_i < hi`` (pos_i = i + S - N): the explicit part of a fast plan."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi

    def key_range(self, i0, i1, n, s):
        first = max(0, i0 + s - n + self.lo + 1)
        return first, max(first, min(s, i1 - 1 + s - n + self.hi))

    def block(self, i0, i1, j0, j1, n, s, device):
        rel = (torch.arange(j0, j1, device=device)[None, :]
               - torch.arange(i0, i1, device=device)[:, None] - (s - n))
        return ((rel > self.lo) & (rel < self.hi))[None, None]

    def describe(self) -> str:
        return f"Band({self.lo}, {self.hi})"


@dataclass
class FlashSegment:
    """One flash-kernel call: rows t0:t1 against keys c0:c1 of a frame.

    ``flipped`` frames are time-reversed (the right/future side). ``causal``: top-left causal
    within the segment. ``side``: -1/+1 for a producer's far field on the left/right, 0 for
    none. ``slope_ref``: for ALiBi, the reference position of the folded key-linear term.
    """

    t0: int
    t1: int
    c0: int
    c1: int
    causal: bool
    flipped: bool
    side: int = 0
    slope_ref: int | None = None


def _region_segments(c: int, n: int, s: int, t0: int, t1: int, **kw) -> list[FlashSegment]:
    """Segments for rows t0:t1 where row t sees keys j <= t + c (j in [0, s))."""
    t0 = max(t0, -c)  # rows before this see no key
    if t0 >= t1:
        return []
    k0 = t0 + c  # keys [0, k0) are visible to every row
    if k0 >= s:
        return [FlashSegment(t0, t1, 0, s, False, **kw)]
    segs = [FlashSegment(t0, t1, 0, k0, False, **kw)] if k0 > 0 else []
    segs.append(FlashSegment(t0, t1, k0, min(s, k0 + t1 - t0), True, **kw))
    return segs


def fast_path_refusal(q: Tensor, k: Tensor, mask: Mask | None, producer,
                      dropout_p: float, *, softcap: float | None = None) -> str | None:
    """Why the fused fast path cannot serve this request (None: it can)."""
    if not isinstance(producer, BiasProducer):
        return "no structured bias producer"
    if q.device.type != "cpu":
        return "fused relative-bias path uses torch's CPU flash kernel"
    if dropout_p > 0.0:
        return "dropout"
    if softcap is not None:
        return f"logit soft-capping (softcap={softcap!r}): the flash kernel has no tanh step"
    if mask is not None and not isinstance(mask, Causal):
        return f"mask {mask.describe()} is not plain causal"
    n, s = q.shape[2], k.shape[2]
    if isinstance(mask, Causal) and mask.alignment == "top_left" and n != s:
        return "top-left causal with N != S"
    if producer.key_linear_slopes() is None and producer.far_field() is None:
        return f"{type(producer).__name__} declares no far field or key-linear structure"
    return None


def plan_segments(n: int, s: int, causal: bool, producer: BiasProducer
                  ) -> tuple[list[FlashSegment], Band | None]:
    """Flash segments plus the band (explicit tiles, or None) that together cover the pairs."""
    delta = s - n  # position of row 0 in the unflipped frame; 0 in the flipped frame
    segs: list[FlashSegment] = []
    slopes = producer.key_linear_slopes()
    if slopes is not None:
        for t0 in range(0, n, ALIBI_ROWS):
            t1 = min(n, t0 + ALIBI_ROWS)
            mid = (t0 + t1) // 2  # the folded term stays within ±slope·ALIBI_ROWS/2
            segs += _region_segments(delta, n, s, t0, t1, flipped=False, slope_ref=mid + delta)
            if not causal:
                segs += _region_segments(-1, n, s, t0, t1, flipped=True, slope_ref=mid)
        return segs, None
    width = producer.far_field().distance
    segs += _region_segments(delta - width, n, s, 0, n, flipped=False, side=-1)
    if not causal:
        segs += _region_segments(-width, n, s, 0, n, flipped=True, side=1)
    return segs, Band(-width, 1 if causal else width)


class SegmentRunner:
    """Runs flash segments forward and backward on one (q, k, v) problem."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, scale: float,
                 producer: BiasProducer) -> None:
        # Half-precision inputs run in fp32: the folded ALiBi column and the merged LSE
        # need fp32 accuracy (and fp32 is the fast CPU kernel anyway).
        cdt = compute_dtype(q.dtype)
        self.q, self.k, self.v = q.to(cdt), k.to(cdt), v.to(cdt)
        self.scale, self.prod = scale, producer
        self.n, self.s = q.shape[2], k.shape[2]
        self._flipped: tuple[Tensor, Tensor, Tensor] | None = None
        self._buffers: dict = {}
        slopes = producer.key_linear_slopes()
        self.slopes = None if slopes is None else slopes.to(q.device, cdt)

    def frame(self, flipped: bool) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v of the frame (time-reversed copies made once)."""
        if not flipped:
            return self.q, self.k, self.v
        if self._flipped is None:
            self._flipped = (self.q.flip(2), self.k.flip(2), self.v.flip(2))
        return self._flipped

    def rows(self, seg: FlashSegment, x: Tensor) -> Tensor:
        """Rows of seg from an unflipped (B, H, N, ...) tensor, in the frame's order."""
        if not seg.flipped:
            return x[:, :, seg.t0:seg.t1]
        return x[:, :, self.n - seg.t1:self.n - seg.t0].flip(2)

    def _alibi_buffers(self, flipped: bool) -> tuple[Tensor, Tensor]:
        """k and v of a frame with one extra column, allocated once (B, H, S, D + 1).

        Each segment rewrites only the key column it uses, instead of copying k and v."""
        key = ("alibi", flipped)
        if key not in self._buffers:
            _, k, v = self.frame(flipped)
            self._buffers[key] = (_pad(k, 0.0), _pad(v, 0.0))
        return self._buffers[key]

    def inputs(self, seg: FlashSegment) -> tuple[Tensor, Tensor, Tensor]:
        """Kernel inputs of a segment, with ALiBi's extra dimension where needed."""
        q, k, v = self.frame(seg.flipped)
        if seg.slope_ref is None:
            return q[:, :, seg.t0:seg.t1], k[:, :, seg.c0:seg.c1], v[:, :, seg.c0:seg.c1]
        kbuf, vbuf = self._alibi_buffers(seg.flipped)
        keys = torch.arange(seg.c0, seg.c1, device=q.device, dtype=q.dtype) - seg.slope_ref
        kbuf[:, :, seg.c0:seg.c1, -1] = self.slopes[:, None] * keys[None, :] / self.scale
        return (_pad(q[:, :, seg.t0:seg.t1], 1.0), kbuf[:, :, seg.c0:seg.c1],
                vbuf[:, :, seg.c0:seg.c1])

    def row_term(self, seg: FlashSegment, q_rows: Tensor | None) -> Tensor | None:
        """Additive LSE shift of the segment's rows, (B|1, H, r), or None."""
        if seg.slope_ref is not None:
            pos = torch.arange(seg.t0, seg.t1, device=self.q.device, dtype=torch.float64)
            pos = pos + (0 if seg.flipped else self.s - self.n)
            return (self.slopes.double()[:, None] * (seg.slope_ref - pos)[None, :])[None].to(
                self.q.dtype)
        if seg.side == 0:
            return None
        return self.prod.far_row_term(q_rows, seg.side, self.scale)

    def forward(self, seg: FlashSegment) -> tuple[Tensor, Tensor]:
        """(out, lse) of a segment, in the frame's row order, row term and value vector in."""
        qs, ks, vs = self.inputs(seg)
        out, lse = _flash_fwd(qs, ks, vs, 0.0, seg.causal, scale=self.scale)
        out = out[..., : self.v.shape[-1]]
        q_rows = self.frame(seg.flipped)[0][:, :, seg.t0:seg.t1] if self.prod.needs_query else None
        shift = self.row_term(seg, q_rows)
        lse = lse.to(out.dtype)
        if shift is not None:
            lse = lse + shift
        if seg.side != 0:
            vec = self.prod.far_value_vector(seg.side)
            if vec is not None:
                out = out + _per_head(vec, out)
        return out, lse

    def backward(self, seg: FlashSegment, d_out: Tensor, out: Tensor, lse: Tensor,
                 delta: Tensor, seg_out: Tensor, seg_lse: Tensor, params: list[Tensor],
                 grads: dict) -> None:
        """Add the segment's share of dQ, dK, dV (and producer grads) into ``grads``.

        d_out, out (B, H, r, Dv), lse, delta (B, H, r) are the merged ones for the segment's
        rows in frame order; seg_out, seg_lse are what ``forward`` returned.
        """
        qs, ks, vs = self.inputs(seg)
        frame_q = self.frame(seg.flipped)[0]
        needs_q = self.prod.needs_query and seg.side != 0
        with torch.enable_grad():
            q_leaf = frame_q[:, :, seg.t0:seg.t1].detach().requires_grad_(needs_q)
            shift = self.row_term(seg, q_leaf if needs_q else None)
            vec = self.prod.far_value_vector(seg.side) if seg.side != 0 else None
        base = out if vec is None else out - _per_head(vec.detach(), out)
        kern_lse = lse if shift is None else lse - shift.detach()
        dq, dk, dv = _flash_bwd(_pad(d_out, 0.0) if seg.slope_ref is not None else d_out,
                                qs, ks, vs,
                                _pad(base, 0.0) if seg.slope_ref is not None else base,
                                kern_lse.to(torch.float32 if qs.dtype != torch.float64
                                            else qs.dtype).contiguous(),
                                0.0, seg.causal, scale=self.scale)
        d = self.q.shape[-1]
        self._scatter(seg, grads, dq[..., :d], dk[..., :d], dv[..., : self.v.shape[-1]])
        if shift is None and vec is None:
            return
        # Gradients of the row term and value vector: the segment holds a fraction
        # mass = exp(seg_lse - lse) of each row's probability.
        mass = torch.exp(seg_lse - lse)  # (B, H, r)
        inputs = ([q_leaf] if needs_q else []) + list(params)
        if not inputs:
            return
        outs, grad_outs = [], []
        if shift is not None and shift.requires_grad:
            d_shift = mass * ((d_out * seg_out).sum(-1) - delta)
            outs.append(shift)
            grad_outs.append(d_shift.sum_to_size(shift.shape))
        if vec is not None and vec.requires_grad:
            d_vec = (mass[..., None] * d_out).sum(dim=2)  # (B, H, Dv)
            outs.append(vec)
            grad_outs.append(d_vec.sum_to_size(vec.shape) if vec.dim() == 2
                             else d_vec.sum(dim=(0, 1)))
        if not outs:
            return
        got = torch.autograd.grad(outs, inputs, grad_outs, allow_unused=True)
        if needs_q:
            self._scatter(seg, grads, got[0], None, None)
            got = got[1:]
        for buf, g in zip(grads["params"], got, strict=True):
            if g is not None:
                buf += g

    def _scatter(self, seg, grads, dq, dk, dv) -> None:
        n, s = self.n, self.s
        if not seg.flipped:
            grads["q"][:, :, seg.t0:seg.t1] += dq
            if dk is not None:
                grads["k"][:, :, seg.c0:seg.c1] += dk
                grads["v"][:, :, seg.c0:seg.c1] += dv
            return
        grads["q"][:, :, n - seg.t1:n - seg.t0] += dq.flip(2)
        if dk is not None:
            grads["k"][:, :, s - seg.c1:s - seg.c0] += dk.flip(2)
            grads["v"][:, :, s - seg.c1:s - seg.c0] += dv.flip(2)


def _pad(x: Tensor, value: float) -> Tensor:
    """Append one constant column to the last dim."""
    return torch.cat([x, x.new_full((*x.shape[:-1], 1), value)], dim=-1)


def _per_head(vec: Tensor, like: Tensor) -> Tensor:
    """(Dv,) or (H, Dv) -> broadcastable to (B, H, r, Dv)."""
    vec = vec.to(like.dtype)
    return vec if vec.dim() == 1 else vec[None, :, None, :]
