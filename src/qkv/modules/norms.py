"""Normalisation layers, computed in fp32 for half-precision inputs.

Shapes: B batch, N length, C model width; every norm maps (..., C) -> (..., C).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LayerNorm", "RMSNorm", "make_norm"]

_HALF = (torch.float16, torch.bfloat16)


class LayerNorm(nn.LayerNorm):
    """``torch.nn.LayerNorm`` over the last dim (C), statistics in fp32 for fp16/bf16 input
    (a constant fp16 input stays finite). Default eps 1e-5; BERT uses 1e-12."""

    def __init__(self, dim: int, *, eps: float = 1e-5, bias: bool = True, device=None,
                 dtype=None) -> None:
        super().__init__(dim, eps=eps, bias=bias, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        """x (..., C) -> (..., C) in x's dtype."""
        if x.dtype in _HALF:
            w = None if self.weight is None else self.weight.float()
            b = None if self.bias is None else self.bias.float()
            return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).to(x.dtype)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019): x / rms(x) · weight, at least fp32."""

    def __init__(self, dim: int, *, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        """x (..., C) -> (..., C) in x's dtype; fp16/bf16 computed in fp32, fp64 in fp64."""
        compute = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(compute)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.to(compute)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def make_norm(kind: str, dim: int, *, eps: float | None = None, bias: bool = True,
              device=None, dtype=None) -> nn.Module:
    """A norm by name: "layernorm" (``bias`` selects its additive term) or "rmsnorm"."""
    if kind == "layernorm":
        return LayerNorm(dim, eps=1e-5 if eps is None else eps, bias=bias, device=device,
                         dtype=dtype)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=1e-6 if eps is None else eps, device=device, dtype=dtype)
    raise ValueError(f"norm must be 'layernorm' or 'rmsnorm', got {kind!r}")
