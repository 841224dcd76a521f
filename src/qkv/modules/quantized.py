"""int8 linear layers: per-output-channel int8 weights, per-row dynamic int8 activations
(``QuantizedLinear``), and the int8 math they run (``quantize_weight``, ``quantize_rows``,
``int8_linear``). ``qkv.quantize(model, "int8")`` (``qkv.models.quantized``) puts them into a
model; loading a quantized directory (``qkv.models.loading``) builds empty ones to load into.

Shapes: M rows (every leading dim of an input flattened), K input features, N output
features (channels).

The int8 math (the reference the fast decode step in ``qkv.generation``'s int8 backends
reproduces):

- weight, once: per output channel n, ``s[n] = max_k |W[n, k]| / 127`` and
  ``Wq[n, k] = round(W[n, k] / s[n])`` in [-127, 127] (a zero row has s = 0, Wq = 0), so the
  dequantized weight ``Wq·s`` is within ``s/2`` of W entry by entry;
- activations, per call and per row (dynamic, symmetric): ``a[m] = max_k |x[m, k]|`` and
  ``xq[m, k] = round(127·x[m, k] / a[m])`` (round half to even) in [-127, 127];
- ``acc = xq @ Wqᵀ`` in int32 (exact: |acc| ≤ 127²·K < 2³¹ for K < 133 000), then
  ``y = acc · (a · s/127) + b`` in fp32.

Every row is quantized on its own, so a row of a batch gives what it gives alone, and the
last row of an uncached forward gives what a cached single-token step gives (up to the fp32
rounding of the non-linear parts, as for fp32 models).

The int8 matmul is ``torch._int_mm`` (a core aten op, the one torchao and inductor lower to;
on x86 CPUs a oneDNN/VNNI kernel). Not used: ``torch.ao.quantization`` / the fbgemm
``quantized::linear_dynamic`` ops (their packed weights need quantized-dtype tensors, which
torch 2.13 warns "are deprecated and will be removed in a future PyTorch release", and they
quantize activations per tensor, so a row would depend on its batch), torchao 0.18 (its
eager CPU int8 paths ran at 0.4× / 1× fp32 here without ``torch.compile``),
``aten._weight_int8pack_mm`` (slower than fp32 here).

Error bound: for one layer and output n,
``|y[n] - (x·W[n] + b[n])| ≤ Σ_k |x[k]|·s[n]/2 + (a/254)·Σ_k |Wq[n, k]|·s[n]`` (+ fp32
rounding) — the weight rounding (≤ s/2 per entry) plus the activation rounding (≤ a/254 per
entry).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["QuantizedLinear", "int8_linear", "quantize_rows", "quantize_weight", "scale127"]

_TINY = torch.finfo(torch.float32).tiny
# 1.5·2²³: adding it to a float32 in [-2²², 2²²] rounds it to an integer (half to even) held
# in the low mantissa bits, so the low byte of the bits is the int8 value (little endian)
_MAGIC = 12582912.0
_LITTLE = sys.byteorder == "little"
_MAGIC_T = torch.full((1,), _MAGIC)  # (1,) fp32, broadcast to every row


def quantize_weight(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Per-output-channel symmetric int8: weight (N, K) fp32 -> (Wq (N, K) int8, s (N,) fp32)
    with ``s = max|W[n]| / 127`` and ``Wq = round(W / s)`` in [-127, 127]; a zero row gets
    s = 0 and Wq = 0. ``Wq·s`` is within ``s/2`` of W entry by entry."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_weight: weight must be (N, K), got {tuple(weight.shape)}")
    w = weight.detach().double()  # fp64 division: the rounding is of W/s itself
    s = w.abs().amax(dim=1) / 127.0  # (N,)
    q = torch.round(w / s.clamp_min(_TINY)[:, None]).clamp_(-127, 127)  # (N, K)
    return q.to(torch.int8), s.to(torch.float32)


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row symmetric int8 of activations: x (M, K) fp32 -> (xq (M, K) int8 contiguous,
    a (M, 1) fp32) with ``a = max|x[m]|`` (at least the smallest normal float) and
    ``xq = round(127·x / a)`` (half to even) in [-127, 127]. A row holding NaN/inf has a
    non-finite ``a``, which the linear layer's output then carries."""
    if x.dtype != torch.float32 or x.dim() != 2:
        raise TypeError(f"quantize_rows: x must be a float32 (M, K) tensor, got {x.dtype} "
                        f"{tuple(x.shape)}")
    a = torch.linalg.vector_norm(x, ord=math.inf, dim=-1, keepdim=True).clamp_min_(_TINY)
    if _LITTLE:  # 3 kernels: fused scale-and-round, then the low bytes copied out
        m = _MAGIC_T if x.device.type == "cpu" else torch.full((1,), _MAGIC, device=x.device)
        q = torch.addcdiv(m, x, a, value=127.0).view(torch.int8)[..., ::4].contiguous()
    else:
        q = torch.addcdiv(torch.zeros((1,), dtype=x.dtype, device=x.device), x, a,
                          value=127.0).round_().to(torch.int8)
    return q, a  # (M, K), (M, 1)


def scale127(scale: Tensor) -> Tensor:
    """``s/127`` (N,) as the int8 layers use it: ``scale * (1/127)`` in fp32."""
    return scale * (1.0 / 127.0)


def int8_linear(x: Tensor, weight_t: Tensor, s127: Tensor, bias: Tensor | None) -> Tensor:
    """The int8 layer on rows: x (M, K) fp32, weight_t (K, N) int8 (``Wqᵀ``, any strides
    ``torch._int_mm`` takes), s127 (N,) = ``scale127(s)``, bias (N,) or None -> (M, N) fp32
    ``(xq @ Wqᵀ)·(a·s/127) + b``."""
    q, a = quantize_rows(x)  # (M, K) int8, (M, 1)
    # (M, N) int32, exact; torch 2.13's CPU _int_mm returns wrong sums for K = 1
    acc = torch._int_mm(q, weight_t) if q.shape[1] > 1 else torch.mm(q.int(), weight_t.int())
    a_s = a * s127  # (M, N)
    return torch.mul(acc, a_s) if bias is None else torch.addcmul(bias, acc, a_s)


class QuantizedLinear(nn.Module):
    """An ``nn.Linear`` with int8 weights and per-output-channel fp32 scales, inference only.

    Args:
        weight: (N, K) int8, ``Wq``.
        scale: (N,) fp32, ``s`` (W ≈ Wq·s).
        bias: (N,) fp32 or None.

    Forward: x (..., K) fp32 -> (..., N) fp32, ``y = (xq @ Wqᵀ)·(a·s/127) + b`` with the
    per-row activation quantization of ``quantize_rows`` (module docstring).

    Buffers (the state dict): ``weight_int8`` (N, K), ``weight_scale`` (N,), ``bias``.
    ``weight`` is the dequantized (N, K) fp32 weight, computed on each access (for code that
    reads a layer's weight for its dtype or to export it), not a parameter.
    """

    def __init__(self, weight: Tensor, scale: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        if not isinstance(weight, Tensor) or weight.dtype != torch.int8 or weight.dim() != 2:
            got = (f"{weight.dtype} {tuple(weight.shape)}" if isinstance(weight, Tensor)
                   else type(weight).__name__)
            raise TypeError(f"QuantizedLinear: weight must be an int8 (N, K) tensor, got {got}")
        n, k = weight.shape
        if (not isinstance(scale, Tensor) or scale.dtype != torch.float32
                or tuple(scale.shape) != (n,)):
            raise TypeError(f"QuantizedLinear: scale must be fp32 (N,) = ({n},), got "
                            f"{getattr(scale, 'dtype', type(scale).__name__)} "
                            f"{tuple(getattr(scale, 'shape', ()))}")
        if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (n,)):
            raise TypeError(f"QuantizedLinear: bias must be fp32 (N,) = ({n},) or None, got "
                            f"{bias.dtype} {tuple(bias.shape)}")
        self.in_features, self.out_features = k, n
        self.register_buffer("weight_int8", weight.contiguous())
        self.register_buffer("weight_scale", scale.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> QuantizedLinear:
        """Quantize an fp32 ``nn.Linear`` (its weight (N, K) and bias)."""
        q, s = quantize_weight(linear.weight)
        return cls(q, s, None if linear.bias is None else linear.bias.detach())

    @classmethod
    def from_weight(cls, weight: Tensor, bias: Tensor | None = None) -> QuantizedLinear:
        """Quantize a plain fp32 (N, K) weight (a tied embedding table used as an LM head)."""
        q, s = quantize_weight(weight)
        return cls(q, s, None if bias is None else bias.detach())

    @classmethod
    def empty(cls, out_features: int, in_features: int, *, bias: bool) -> QuantizedLinear:
        """A zero (N, K) int8 layer to load a saved state into (no quantization work)."""
        return cls(torch.zeros(out_features, in_features, dtype=torch.int8),
                   torch.zeros(out_features), torch.zeros(out_features) if bias else None)

    @property
    def weight(self) -> Tensor:
        """The dequantized weight (N, K) fp32, ``Wq·s`` (a new tensor on each access)."""
        return self.weight_int8.float() * self.weight_scale[:, None]

    def _check(self, x: Any) -> None:
        if not isinstance(x, Tensor) or x.dtype != torch.float32:
            got = x.dtype if isinstance(x, Tensor) else type(x).__name__
            raise TypeError(f"QuantizedLinear: input must be a float32 tensor, got {got}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"QuantizedLinear: input must have shape (..., K={self.in_features}),"
                             f" got {tuple(x.shape)}")
        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError("QuantizedLinear: an int8 layer has no gradient (rounding has "
                               "none), so a quantized model cannot be trained; train the fp32 "
                               "model and quantize it after, or run under torch.no_grad()")

    def _rows(self, x: Tensor, start: int, stop: int) -> Tensor:
        lead = x.shape[:-1]
        whole = (start, stop) == (0, self.out_features)
        w = self.weight_int8 if whole else self.weight_int8[start:stop]  # (N', K) contiguous
        b = self.bias if self.bias is None or whole else self.bias[start:stop]
        s = self.weight_scale if whole else self.weight_scale[start:stop]
        y = int8_linear(x.reshape(-1, self.in_features), w.t(), scale127(s), b)  # (M, N')
        return y.reshape(*lead, stop - start)  # (..., N')

    def forward(self, x: Tensor) -> Tensor:
        """x (..., K) fp32 -> (..., N) fp32."""
        self._check(x)
        return self._rows(x, 0, self.out_features)

    def project_rows(self, x: Tensor, start: int, stop: int) -> Tensor:
        """Output channels [start, stop) only: x (..., K) -> (..., stop - start) (the row
        blocks of a fused projection, ``qkv.modules.attention.project_rows``)."""
        self._check(x)
        if not 0 <= start < stop <= self.out_features:
            raise ValueError(f"QuantizedLinear.project_rows: need 0 <= start < stop <= "
                             f"{self.out_features}, got start={start}, stop={stop}")
        return self._rows(x, start, stop)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int8 per-channel")
