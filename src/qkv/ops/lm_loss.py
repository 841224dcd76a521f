"""The LM head fused with its cross-entropy: ``linear_cross_entropy(hidden, weight, targets)``
equals ``F.cross_entropy(hidden @ weight.T, targets)`` without ever holding the (M, V)
logits — with a 50k vocabulary they are most of a training step's memory.

Shapes: M rows (B·N tokens flattened), C model width, V vocabulary.

How: the rows are taken ``chunk`` at a time; each (chunk, V) block of logits is made, its
softmax turned into the gradient in place, and dropped. The gradients are computed in the
forward pass (the loss is a scalar) and scaled by the incoming gradient in the backward;
under ``torch.no_grad`` (evaluation) none is computed.

Precision: each block's logits, softmax, log-sum-exp and the sum over rows are fp32 whatever
the dtype of ``hidden`` and ``weight`` (as autocast runs cross-entropy in fp32); the two
gradient matmuls run in the weight's dtype. The loss is returned in fp32.

Label smoothing as ``F.cross_entropy(label_smoothing=s)``: the target's weight is
``1 - s + s/V`` and every class gets ``s/V``, so a row's loss is
``(1 - s)·(lse - z_target) + s·(lse - mean(z))``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .fast_linear import fast_linear

__all__ = ["linear_cross_entropy"]


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean (label-smoothed) cross-entropy of ``h @ weightᵀ`` against ``targets`` over row
    chunks (see the module docstring). The logits and the input gradient of each chunk go
    through ``qkv.ops.fast_linear`` (oneDNN's matmul where it pays); the weight gradient
    (only when the head trains) is ``addmm_``."""

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, targets: Tensor, ignore_index: int,
                smoothing: float, chunk: int, grads: bool) -> Tensor:
        # h (M, C), weight (V, C), targets (M,)
        valid = targets != ignore_index  # (M,)
        count = valid.sum().clamp_min(1).to(torch.float32)
        need_h = grads and ctx.needs_input_grad[0]
        need_w = grads and ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        safe = targets.masked_fill(~valid, 0)
        vocab = weight.shape[0]
        for i in range(0, h.shape[0], chunk):
            hc, tc, vc = h[i:i + chunk], safe[i:i + chunk], valid[i:i + chunk]
            logits = fast_linear(hc, weight).float()  # (m, V); grad mode is off in here
            top = logits.amax(dim=-1, keepdim=True)  # (m, 1)
            picked = logits.gather(1, tc[:, None])  # (m, 1)
            mean_logit = logits.mean(dim=-1, keepdim=True) if smoothing else None  # (m, 1)
            p = logits.sub_(top).exp_()  # unnormalised softmax, in place (m, V)
            denom = p.sum(dim=-1, keepdim=True)  # (m, 1)
            lse = denom.log() + top  # (m, 1) log-sum-exp of the logits
            nll = lse - picked
            if smoothing:
                nll = (1 - smoothing) * nll + smoothing * (lse - mean_logit)
            weight_rows = vc.to(torch.float32)  # (m,) 1 where the row counts
            total = total + (nll.squeeze(1) * weight_rows).sum()
            if need_h or need_w:
                # d(mean loss)/d(logits) = (softmax - (1 - s)·onehot - s/V) · valid / count
                scale = (weight_rows / count)[:, None]  # (m, 1)
                p.mul_(scale / denom)
                if smoothing:
                    p.sub_(scale * (smoothing / vocab))
                p.scatter_add_(1, tc[:, None], -(1 - smoothing) * scale)
                p = p.to(weight.dtype)
                if need_h:
                    grad_h[i:i + chunk] = fast_linear(p, weight.t())  # (m, C) = p @ weight
                if need_w:
                    grad_w.addmm_(p.t().float(), hc.float())  # (V, C)
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        ctx.save_for_backward(grad_h, grad_w)
        return total / count

    @staticmethod
    def backward(ctx, g: Tensor):
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is not None:
            grad_h = grad_h * g.to(grad_h.dtype)
        if grad_w is not None:
            grad_w = grad_w * g.to(grad_w.dtype)
        return grad_h, grad_w, None, None, None, None, None


def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, *,
                         ignore_index: int = -100, label_smoothing: float = 0.0,
                         chunk: int = 512) -> Tensor:
    """Mean cross-entropy of the logits ``hidden @ weightᵀ`` against ``targets``, the (M, V)
    logits never materialised (the fused LM head + loss of ``GPT.loss`` and
    ``Flamingo.loss``; see the module docstring).

    Args:
        hidden: (M, C) hidden states (the rows of (B, N, C) flattened).
        weight: (V, C) the LM head's weight, of ``hidden``'s dtype.
        targets: (M,) int64 token ids in [0, V), or ``ignore_index`` (left out of the mean).
        label_smoothing: s in [0, 1], as ``F.cross_entropy``'s.
        chunk: rows of logits computed at a time (a positive int).

    Returns:
        an fp32 scalar tensor, ``F.cross_entropy((hidden @ weight.T).float(), targets,
        label_smoothing=s)`` up to rounding (0 when every target is ignored);
        differentiable in ``hidden`` and ``weight`` (gradients in their dtypes).

    Raises:
        ValueError: ``label_smoothing`` outside [0, 1], ``chunk`` not a positive int, or
            ``hidden`` and ``weight`` of other dtypes or widths.
    """
    if (not isinstance(label_smoothing, (int, float)) or isinstance(label_smoothing, bool)
            or not 0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"linear_cross_entropy: label_smoothing must be in [0, 1], got "
                         f"{label_smoothing!r}")
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"linear_cross_entropy: chunk must be a positive int, got {chunk!r}")
    if hidden.dtype != weight.dtype or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"linear_cross_entropy: hidden {tuple(hidden.shape)} {hidden.dtype} "
                         f"and weight {tuple(weight.shape)} {weight.dtype} must share dtype "
                         f"and width")
    return _LinearCrossEntropy.apply(hidden, weight, targets, ignore_index,
                                     float(label_smoothing), chunk, torch.is_grad_enabled())
