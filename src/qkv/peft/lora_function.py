"""The fused LoRA linear: one autograd Function for a LoRA-wrapped linear layer with one
active adapter (``qkv.peft.lora_layers.LoraUpdate`` uses it when ``fusable`` says it may).

Shapes: M rows, In / Out the layer's widths, r the rank, S the segments (q, k, v of a fused
projection: each segment j has its own A_j (r, In) and B_j (hi_j - lo_j, r)).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from ..ops.fast_linear import fast_linear, onednn_linear_active

__all__ = ["LoraLinearFunction", "fusable"]

_PLAIN = (Tensor, nn.Parameter)


class LoraLinearFunction(torch.autograd.Function):
    """y = x Wᵀ + b + scale · (xd A_jᵀ) B_jᵀ on each segment's columns [lo_j, hi_j) of y.

    forward(x (M, In), xd (M, In) or None (= x: no dropout), weight (Out, In), bias (Out,) or
    None, scale, spans ((lo_j, hi_j), ...), A_1 (r, In), B_1 (hi_1 - lo_1, r), A_2, B_2, ...)
    -> y (M, Out). The base GEMM and its input gradient go through ``fast_linear`` (oneDNN
    where it pays); the S segments share one x A_catᵀ (M, S·r) product; each update is added
    in place into its columns. Once differentiable.
    """

    @staticmethod
    def forward(ctx, x: Tensor, xd: Tensor | None, weight: Tensor, bias: Tensor | None,
                scale: float, spans: tuple[tuple[int, int], ...], *ab: Tensor) -> Tensor:
        a_parts, b_parts = ab[0::2], ab[1::2]
        r = a_parts[0].shape[0]
        a = a_parts[0] if len(a_parts) == 1 else torch.cat(a_parts)  # (S·r, In)
        src = x if xd is None else xd
        y = fast_linear(x, weight, bias)  # (M, Out); grad mode is off in here
        h = src.mm(a.t())  # (M, S·r)
        for j, ((lo, hi), b) in enumerate(zip(spans, b_parts, strict=True)):
            y[:, lo:hi].addmm_(h[:, j * r:(j + 1) * r], b.t(), alpha=scale)  # (M, hi - lo)
        ctx.scale, ctx.spans, ctx.r, ctx.has_bias = scale, spans, r, bias is not None
        ctx.save_for_backward(x, xd, weight, a, h, *b_parts)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, g: Tensor):  # g (M, Out)
        x, xd, weight, a, h, *b_parts = ctx.saved_tensors
        need = ctx.needs_input_grad  # x, xd, weight, bias, scale, spans, A_1, B_1, ...
        scale, spans, r = ctx.scale, ctx.spans, ctx.r
        src = x if xd is None else xd
        # The thin products are laid out with the rank as the row count (r x M times
        # M x Rows): MKL runs them ~4x as fast as with the rank as the column count.
        gh_t = torch.cat([b.t().mm(g[:, lo:hi].t())
                          for (lo, hi), b in zip(spans, b_parts, strict=True)]
                         ).mul_(scale)  # (S·r, M) = (d loss / d h)ᵀ
        grad_x = grad_xd = grad_w = grad_bias = None
        if need[0]:
            grad_x = fast_linear(g, weight.t())  # (M, In) = g W
            if xd is None:
                grad_x.addmm_(gh_t.t(), a)  # + the update's part, in place
        if xd is not None and need[1]:
            grad_xd = gh_t.t().mm(a)  # (M, In)
        if need[2]:
            grad_w = g.t().mm(x)  # (Out, In): only when the base weight trains
        if ctx.has_bias and need[3]:
            grad_bias = g.sum(0)  # (Out,)
        grads_a = gh_t.mm(src).split(r)  # (r, In) each
        grads_ab: list[Tensor | None] = []
        for j, ((lo, hi), _) in enumerate(zip(spans, b_parts, strict=True)):
            grads_ab.append(grads_a[j] if need[6 + 2 * j] else None)
            grads_ab.append(h[:, j * r:(j + 1) * r].t().mm(g[:, lo:hi]).mul_(scale).t()
                            if need[7 + 2 * j] else None)  # (hi - lo, r)
        return grad_x, grad_xd, grad_w, grad_bias, None, None, *grads_ab


def fusable(*tensors: Tensor | None) -> bool:
    """True when ``LoraLinearFunction`` may stand in for the composed ops: plain tensors, no
    autocast or functorch transform, ``onednn_linear`` not switched off."""
    x = tensors[0]
    return (all(t is None or type(t) in _PLAIN for t in tensors) and x.dim() >= 1
            and not torch.is_autocast_enabled(x.device.type)
            and not torch._C._are_functorch_transforms_active()
            and onednn_linear_active())
