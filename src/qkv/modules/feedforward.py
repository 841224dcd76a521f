"""Position-wise feed-forward networks.

Shapes: B batch, N length, C model width, F hidden width; (B, N, C) -> (B, N, C).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ACTIVATIONS", "FeedForward", "SwiGLU", "quick_gelu"]


def quick_gelu(x: Tensor) -> Tensor:
    """OpenAI CLIP's GELU approximation x·sigmoid(1.702·x) (HF "quick_gelu"), any shape."""
    return x * torch.sigmoid(1.702 * x)


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
