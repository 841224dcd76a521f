"""``clip_loss``: CLIP's symmetric contrastive (InfoNCE) loss, one process or many.

Shapes: B the local batch (pairs image i <-> text i), W processes, B·W the global batch,
E the embedding width.

Under ``torch.distributed`` (initialised, world size W > 1) every process gathers the
normalised features of all W processes with gradients (``gather_with_grad``: an all-gather
whose backward sums each process's gradient for every slice and hands each process its
own, a reduce-scatter) and computes the loss of its own B rows against all B·W columns
(open_clip's ``--gather-with-grad --local-loss``). The mean over processes of the local
losses is the loss of the global batch, and, with DDP averaging parameter gradients over
processes, the gradients are those of one process on the global batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

__all__ = ["clip_loss", "gather_with_grad"]


class _GatherWithGrad(torch.autograd.Function):
    """all_gather along dim 0 whose backward sums the gradients of all processes and
    returns this process's slice."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        world = dist.get_world_size(group)
        ctx.group, ctx.rank, ctx.rows = group, dist.get_rank(group), x.shape[0]
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)  # (W·B, E)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)  # every loss's share
        start = ctx.rank * ctx.rows
        return grad[start:start + ctx.rows], None  # (B, E)


def gather_with_grad(x: Tensor, group=None) -> Tensor:
    """All processes' ``x`` (B, ...) concatenated in rank order, (W·B, ...), with gradients
    flowing back to every process's own slice (summed over the processes' losses).
    Every process must pass the same shape."""
    return _GatherWithGrad.apply(x, group)


def _distributed(group) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def clip_loss(image_embeds: Tensor, text_embeds: Tensor, logit_scale: Tensor | float, *,
              group=None) -> Tensor:
    """Symmetric InfoNCE of the pairs (image i, text i).

    ``loss = (CE(s · Î T̂ᵀ, arange) + CE(s · T̂ Îᵀ, arange)) / 2`` with Î, T̂ the
    L2-normalised rows and s = ``logit_scale``, the multiplier (already exponentiated:
    ``model.logit_scale.exp()``). Logits and cross-entropies are computed in fp32 (at
    least).

    Args:
        image_embeds: (B, E), not necessarily normalised.
        text_embeds: (B, E), row i the caption of image i.
        logit_scale: a float or a 1-element tensor (gradients flow into it).
        group: the process group (default: the world) when torch.distributed is initialised.

    Returns:
        a scalar tensor. With torch.distributed initialised and W > 1 processes: this
        process's rows against the gathered global batch (see the module docstring); every
        process must hold the same B.

    Raises:
        TypeError / ValueError naming the argument: not tensors, not 2-D, mismatched shapes,
        a ``logit_scale`` with more than one element, different B across processes.
    """
    for name, t in (("image_embeds", image_embeds), ("text_embeds", text_embeds)):
        if not isinstance(t, Tensor) or not t.dtype.is_floating_point:
            got = t.dtype if isinstance(t, Tensor) else type(t).__name__
            raise TypeError(f"clip_loss: {name} must be a floating-point tensor (B, E), "
                            f"got {got}")
        if t.dim() != 2 or t.shape[0] == 0:
            raise ValueError(f"clip_loss: {name} must have shape (B, E) with B >= 1, "
                             f"got {tuple(t.shape)}")
    if image_embeds.shape != text_embeds.shape:
        raise ValueError(f"clip_loss: image_embeds {tuple(image_embeds.shape)} and "
                         f"text_embeds {tuple(text_embeds.shape)} must have the same shape "
                         f"(B, E): row i of each is one pair")
    if isinstance(logit_scale, Tensor):
        if logit_scale.numel() != 1:
            raise ValueError(f"clip_loss: logit_scale must be a number or a 1-element tensor "
                             f"(the multiplier exp(log scale)), got shape "
                             f"{tuple(logit_scale.shape)}")
        logit_scale = logit_scale.reshape(())
    elif not isinstance(logit_scale, (int, float)) or isinstance(logit_scale, bool):
        raise TypeError(f"clip_loss: logit_scale must be a number or a 1-element tensor, "
                        f"got {type(logit_scale).__name__}")
    dtype = torch.promote_types(image_embeds.dtype, torch.float32)
    img = F.normalize(image_embeds.to(dtype), dim=-1)  # (B, E)
    txt = F.normalize(text_embeds.to(dtype), dim=-1)  # (B, E)
    b = img.shape[0]
    offset = 0
    all_img, all_txt = img, txt
    if _distributed(group):
        mine = torch.tensor([b], device=img.device)
        sizes = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(sizes, mine, group=group)
        sizes = [int(s) for s in sizes]
        if len(set(sizes)) != 1:
            raise ValueError(f"clip_loss: every process must hold the same local batch B to "
                             f"gather features; got B per rank {sizes}")
        all_img = gather_with_grad(img, group)  # (W·B, E)
        all_txt = gather_with_grad(txt, group)  # (W·B, E)
        offset = dist.get_rank(group) * b
    labels = torch.arange(offset, offset + b, device=img.device)  # (B,)
    logits_per_image = logit_scale * (img @ all_txt.t())  # (B, W·B)
    logits_per_text = logit_scale * (txt @ all_img.t())  # (B, W·B)
    return (F.cross_entropy(logits_per_image, labels)
            + F.cross_entropy(logits_per_text, labels)) / 2
