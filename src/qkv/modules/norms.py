"""Normalisation layers, computed in fp32 for half-precision inputs.

Shapes: B batch, N length, C model width; every norm maps (..., C) -> (..., C).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["NORMS", "LayerNorm", "RMSNorm", "make_norm"]

#: the norms ``make_norm`` builds by name
NORMS = ("layernorm", "rmsnorm", "rmsnorm_plus_one")

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
    """Root-mean-square norm (Zhang & Sennrich 2019): x / rms(x) · weight, at least fp32.

    ``unit_offset=True`` scales by (1 + weight) instead (Gemma's norm, whose stored weight
    is the offset from 1; it starts at zeros), also in at least fp32."""

    def __init__(self, dim: int, *, eps: float = 1e-6, unit_offset: bool = False, device=None,
                 dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = bool(unit_offset)
        init = torch.zeros if self.unit_offset else torch.ones
        self.weight = nn.Parameter(init(dim, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        """x (..., C) -> (..., C) in x's dtype; fp16/bf16 computed in fp32, fp64 in fp64."""
        compute = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(compute)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.to(compute)
        return (xf * (1.0 + w if self.unit_offset else w)).to(x.dtype)

    def reset_parameters(self) -> None:
        """The identity scale: ones (zeros with ``unit_offset``)."""
        nn.init.constant_(self.weight, 0.0 if self.unit_offset else 1.0)

    def extra_repr(self) -> str:
        offset = ", unit_offset=True" if self.unit_offset else ""
        return f"{self.weight.shape[0]}, eps={self.eps}{offset}"


def make_norm(kind: str, dim: int, *, eps: float | None = None, bias: bool = True,
              device=None, dtype=None) -> nn.Module:
    """A norm by name (``NORMS``): "layernorm" (``bias`` selects its additive term),
    "rmsnorm", or "rmsnorm_plus_one" (``RMSNorm(unit_offset=True)``, Gemma)."""
    if kind == "layernorm":
        return LayerNorm(dim, eps=1e-5 if eps is None else eps, bias=bias, device=device,
                         dtype=dtype)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=1e-6 if eps is None else eps, device=device, dtype=dtype)
    if kind == "rmsnorm_plus_one":
        return RMSNorm(dim, eps=1e-6 if eps is None else eps, unit_offset=True, device=device,
                       dtype=dtype)
    raise ValueError(f"norm must be one of {list(NORMS)}, got {kind!r}")
