"""Position-wise feed-forward networks.

Shapes: B batch, N length, C model width, F hidden width; (B, N, C) -> (B, N, C).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ACTIVATIONS", "FeedForward", "QuickGELU", "SwiGLU", "quick_gelu", "quick_gelu_"]

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


ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,  # exact (erf) GELU: BERT
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's "gelu_new"
    "silu": F.silu,
    "quick_gelu": quick_gelu,  # OpenAI CLIP
}


class FeedForward(nn.Module):
    """Linear(C -> F), activation, dropout, Linear(F -> C) (Vaswani et al.: ReLU, F = 4C).

    ``activation`` is one of ``ACTIVATIONS``: "relu", "gelu" (erf), "gelu_tanh", "silu",
    "quick_gelu" (CLIP).
    """

    def __init__(self, dim: int, hidden: int, *, activation: str = "relu", bias: bool = True,
                 dropout: float = 0.0, device=None, dtype=None) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"FeedForward: activation must be one of {sorted(ACTIVATIONS)}, "
                             f"got {activation!r}")
        self.activation = activation
        self.fc_in = nn.Linear(dim, hidden, bias=bias, device=device, dtype=dtype)
        self.fc_out = nn.Linear(hidden, dim, bias=bias, device=device, dtype=dtype)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """x (B, N, C) -> (B, N, C)."""
        return self.fc_out(self.dropout(ACTIVATIONS[self.activation](self.fc_in(x))))


class SwiGLU(nn.Module):
    """Gated FFN (Shazeer 2020): Linear(F -> C)(silu(x W_gate) ∘ x W_up), one fused C -> 2F."""

    def __init__(self, dim: int, hidden: int, *, bias: bool = False, dropout: float = 0.0,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.fc_in = nn.Linear(dim, 2 * hidden, bias=bias, device=device, dtype=dtype)
        self.fc_out = nn.Linear(hidden, dim, bias=bias, device=device, dtype=dtype)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """x (B, N, C) -> (B, N, C)."""
        gate, up = self.fc_in(x).chunk(2, dim=-1)  # (B, N, F) each
        return self.fc_out(self.dropout(F.silu(gate) * up))
