"""Position-wise feed-forward networks.

Shapes: B batch, N length, C model width, F hidden width; (B, N, C) -> (B, N, C).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.fast_linear import fast_linear
from .activations import ACTIVATION_TABLE, QUICK_GELU_ALPHA, QuickGELU, quick_gelu, quick_gelu_
from .linear_call import apply_linear, is_plain_linear

__all__ = ["ACTIVATIONS", "GATED_ACTIVATIONS", "FeedForward", "QuickGELU", "SwiGLU", "quick_gelu",
           "quick_gelu_"]

# the one activation table (``qkv.modules.activations``), as name -> function
ACTIVATIONS = {name: a.fn for name, a in ACTIVATION_TABLE.items()}
_INPLACE_ACTIVATIONS = {name: a.inplace for name, a in ACTIVATION_TABLE.items()}
_FOLD_DTYPES = (torch.float32, torch.float64)
#: the gated FFNs by config name -> the activation of their gate (``SwiGLU(activation=)``)
GATED_ACTIVATIONS = {"swiglu": "silu", "geglu_tanh": "gelu_tanh", "geglu": "gelu"}


class FeedForward(nn.Module):
    """Linear(C -> F), activation, dropout, Linear(F -> C) (Vaswani et al.: ReLU, F = 4C).

    ``activation`` is one of ``ACTIVATIONS``: "relu", "gelu" (erf), "gelu_tanh", "silu",
    "quick_gelu" (CLIP).

    Plain ``nn.Linear`` projections (``qkv.modules.linear_call.is_plain_linear``) run
    through ``qkv.ops.fast_linear``; others (LoRA wrappers, quantized layers, hooks) are
    called as modules. Without gradients, quick_gelu between two plain projections is
    computed as quick_gelu(z) = z·sigmoid(a·z) = silu(a·z) / a (a = 1.702) with a folded
    into fc_in's weight and bias and 1/a into fc_out's weight: one fused SiLU pass instead
    of quick_gelu's three (the same function up to rounding, ~1e-7 relative in fp32; fp32
    and fp64 only: half-precision weights would round the scaled copies coarsely). With
    gradients the scaled weights would be extra saved tensors for a gain measured within
    noise, so training uses ``QuickGELU`` (lean backward) as written.
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
        return self.run(x)

    def run(self, x: Tensor, *, inplace: bool = False) -> Tensor:
        """``forward`` on x (..., C) -> (..., C) (any leading dims: token rows (T, C) too).
        ``inplace``: apply the activation in place on the hidden (..., F) tensor (only
        without gradients, as ``EncoderLayer.forward`` does on token rows with bufs)."""
        fc_in, fc_out = self.fc_in, self.fc_out
        if (self.activation == "quick_gelu" and not torch.is_grad_enabled()
                and fc_in.weight.dtype in _FOLD_DTYPES
                and is_plain_linear(fc_in) and is_plain_linear(fc_out)):
            a = QUICK_GELU_ALPHA
            b_in = None if fc_in.bias is None else fc_in.bias * a
            f = fast_linear(x, fc_in.weight * a, b_in)  # (..., F) = a·z, a fresh tensor
            f = F.silu(f, inplace=True)  # a·quick_gelu(z)
            return fast_linear(self.dropout(f), fc_out.weight * (1 / a), fc_out.bias)
        f = apply_linear(fc_in, x)  # (..., F)
        # in place only on a plain projection's output (a fresh tensor)
        act = (_INPLACE_ACTIVATIONS.get(self.activation)
               if inplace and is_plain_linear(fc_in) else None)
        f = act(f) if act is not None else ACTIVATIONS[self.activation](f)
        return apply_linear(fc_out, self.dropout(f))  # (..., C)


class SwiGLU(nn.Module):
    """Gated FFN (Shazeer 2020): Linear(F -> C)(act(x W_gate) ∘ x W_up), one fused C -> 2F
    (output rows [gate (F); up (F)]).

    ``activation``: the gate's, one of ``ACTIVATIONS``: "silu" (SwiGLU, Llama), "gelu_tanh"
    (GeGLU as Gemma computes it), "gelu"...
    """

    def __init__(self, dim: int, hidden: int, *, bias: bool = False, dropout: float = 0.0,
                 activation: str = "silu", device=None, dtype=None) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"SwiGLU: activation must be one of {sorted(ACTIVATIONS)}, "
                             f"got {activation!r}")
        self.activation = activation
        self.fc_in = nn.Linear(dim, 2 * hidden, bias=bias, device=device, dtype=dtype)
        self.fc_out = nn.Linear(hidden, dim, bias=bias, device=device, dtype=dtype)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """x (B, N, C) -> (B, N, C)."""
        gate, up = apply_linear(self.fc_in, x).chunk(2, dim=-1)  # (B, N, F) each
        act = F.silu if self.activation == "silu" else ACTIVATIONS[self.activation]
        return apply_linear(self.fc_out, self.dropout(act(gate) * up))
