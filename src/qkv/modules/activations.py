"""The one table of feed-forward activations: every path that applies one (the modules, the
decode engine's torch and oneDNN steps, the C layer kernel) takes it from here.

Shapes: any (...) -> the same shape.

Each ``Activation`` names the function (``fn``, autograd-safe), an in-place form for fresh
buffers without gradients (``inplace``), the oneDNN post-op ``(attr, algorithm)`` that
``torch.ops.mkldnn._linear_pointwise`` fuses into a matmul (None where oneDNN has none), and
the code the C layer kernel's ``switch`` computes it under (``c_code``; None where the C
source has no case). A new activation is one entry here (and, for the C path, one case in
``generation/kernels``' layer source).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ACTIVATION_TABLE", "QUICK_GELU_ALPHA", "Activation", "QuickGELU", "activation",
           "quick_gelu", "quick_gelu_"]

QUICK_GELU_ALPHA = 1.702


class QuickGELU(torch.autograd.Function):
    """x·sigmoid(1.702·x) with a lean backward, any shape -> the same shape.

    The forward is the same arithmetic as ``x * torch.sigmoid(1.702 * x)`` (bitwise); it
    saves only x (autograd's composition saves x and the sigmoid). The derivative
    sigmoid(a·x) + a·x·sigmoid(a·x)·(1 - sigmoid(a·x)) is SiLU's at y = a·x, so the backward
    is one fused ``silu_backward(grad, a·x)`` (autograd's: five elementwise passes); with
    ``create_graph`` it is composed of differentiable ops (double backward works).
    """

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # x (...) -> (...)
        ctx.save_for_backward(x)
        return torch.mul(x, QUICK_GELU_ALPHA).sigmoid_().mul_(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        y = x * QUICK_GELU_ALPHA
        if torch.is_grad_enabled():  # create_graph: silu_backward has no derivative
            s = torch.sigmoid(y)
            return grad * s * (1 + y * (1 - s))
        return torch.ops.aten.silu_backward(grad, y)


def quick_gelu(x: Tensor) -> Tensor:
    """OpenAI CLIP's GELU approximation x·sigmoid(1.702·x) (HF "quick_gelu"), any shape.

    With gradients (x requires grad) it runs ``QuickGELU`` (same values, a lean backward)."""
    if x.requires_grad and torch.is_grad_enabled():
        return QuickGELU.apply(x)
    return x * torch.sigmoid(QUICK_GELU_ALPHA * x)


def quick_gelu_(x: Tensor, *, buffer: Tensor | None = None) -> Tensor:
    """``quick_gelu`` in place (no autograd): x (...) is overwritten and returned, the same
    values as ``quick_gelu(x)`` bitwise. ``buffer``: scratch of x's shape, dtype and device
    for the sigmoid (reused between calls: no fresh allocation); default a new one."""
    if buffer is None:
        buffer = torch.empty_like(x)
    torch.mul(x, QUICK_GELU_ALPHA, out=buffer)
    return x.mul_(buffer.sigmoid_())


@dataclass(frozen=True)
class Activation:
    """One activation in every form a path needs.

    Attributes:
        name: the ``activation`` config value ("relu", "gelu", ...).
        fn: x (...) -> (...), autograd-safe.
        inplace: the same values written into x (...) (a fresh buffer, no gradients).
        onednn: ``(attr, algorithm)`` of oneDNN's fused post-op, or None.
        c_code: the C layer kernel's code for it, or None (no C form).
    """

    name: str
    fn: Callable[[Tensor], Tensor]
    inplace: Callable[[Tensor], Tensor]
    onednn: tuple[str, str] | None
    c_code: int | None


ACTIVATION_TABLE: dict[str, Activation] = {a.name: a for a in (
    Activation("relu", F.relu, torch.relu_, ("relu", ""), 0),
    Activation("gelu", F.gelu, torch.ops.aten.gelu_, ("gelu", "none"), 1),  # erf: BERT
    Activation("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's "gelu_new"
               lambda x: torch.ops.aten.gelu_(x, approximate="tanh"), ("gelu", "tanh"), 2),
    Activation("silu", F.silu, lambda x: F.silu(x, inplace=True), ("swish", ""), 3),
    Activation("quick_gelu", quick_gelu, quick_gelu_, None, 4),  # OpenAI CLIP
)}


def activation(name: str) -> Activation:
    """The table's entry for ``name``; ValueError listing the known names otherwise."""
    try:
        return ACTIVATION_TABLE[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; known: "
                         f"{sorted(ACTIVATION_TABLE)}") from None
