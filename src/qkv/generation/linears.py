"""How the torch decode layer (``torch_layer``) multiplies: one class per weight form, each
holding the copies it needs of a plan's projections, made when a stepper is built (once per
``generate`` call) and dropped with it.

Shapes: M rows (R·n tokens), K in features, N out features, V vocab size. Projection i of a
plan is ``plan.linears()[i]``: 4 per layer (qkv, out, ffn_in, ffn_out), then the head.

Every kind has the same three calls: ``linear(x, i)`` -> x Wᵢᵀ + bᵢ (M, N); ``add(x, i, res)``
-> res + x Wᵢᵀ + bᵢ (res (M, N) may be overwritten and returned); ``act(x, i)`` -> the plan's
activation of ``linear(x, i)`` (gated: act(gate)·up, (M, N/2)). The kinds:

- ``DenseLinears``: (in, out) contiguous copies through ``addmm``/``mm`` (a row vector times an
  (in, out) matrix streams faster through torch's CPU GEMM than times the transpose of an
  (out, in) one; ``BENCHMARKS.md``, generation).
- ``PackedLinears``: oneDNN-packed copies through ``torch.ops.mkldnn._linear_pointwise`` with
  the activation (where oneDNN has it) and the residual add fused into the call.
- ``Int8Linears``: ``QuantizedLinear``'s math (``int8_linear``) on the weights as stored.
- ``Int8KernelLinears``: the same math in one C call per projection (``int8_kernel``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..modules.activations import ACTIVATION_TABLE
from ..modules.quantized import int8_linear
from ..ops import fast_linear as _fast_linear
from . import kernel_registry
from .plan import DecodePlan

__all__ = ["PACKED_MIN_WEIGHTS", "DenseLinears", "Int8KernelLinears", "Int8Linears",
           "PackedLinears", "packed_refusal", "packing_works"]


class _Kind:
    """The activation handling every kind shares."""

    def __init__(self, plan: DecodePlan) -> None:
        self.gated = plan.gated
        self.inplace = ACTIVATION_TABLE[plan.activation].inplace

    def act(self, x: Tensor, i: int) -> Tensor:
        """act(x Wᵢᵀ + bᵢ) (M, N), or act(gate)·up (M, N/2) for a gated FFN."""
        y = self.linear(x, i)
        if self.gated:
            gate, up = y.chunk(2, dim=-1)
            return self.inplace(gate).mul(up)
        return self.inplace(y)

    def linear(self, x: Tensor, i: int) -> Tensor:  # pragma: no cover - every kind has one
        raise NotImplementedError


class DenseLinears(_Kind):
    """fp32/fp64 projections as (in, out) contiguous copies."""

    def __init__(self, plan: DecodePlan) -> None:
        super().__init__(plan)
        self.w = [lin.weight.detach().t().contiguous() for lin in plan.linears()]  # (K, N)
        self.b = [lin.bias for lin in plan.linears()]

    def linear(self, x: Tensor, i: int) -> Tensor:
        """x (M, K) -> (M, N)."""
        b = self.b[i]
        return torch.mm(x, self.w[i]) if b is None else torch.addmm(b, x, self.w[i])

    def add(self, x: Tensor, i: int, res: Tensor) -> Tensor:
        """res + x Wᵢᵀ + bᵢ, (M, N)."""
        return self.linear(x, i).add_(res)


PACKED_MIN_WEIGHTS = 1 << 17
"""Fewest weights per projection (the mean over the layers and the head) for which the packed
oneDNN kind is used: each call costs more than ``addmm`` by a fixed amount, which small layers
do not earn back (``BENCHMARKS.md``, generation)."""
_PACK_ROWS = 16  # the batch-size hint the weights are packed for (any row count works)
_PACKING: dict[str, bool] = {}


def packed_refusal(plan: object, rows: int, dtype: torch.dtype, device: torch.device
                   ) -> str | None:
    """Why the oneDNN-packed form would not pay (or cannot run) for a fp32 plan (a
    ``DecodePlan`` or ``Seq2SeqPlan``, with ``linears()``) decoding ``rows`` rows, or None:
    fp32 on the CPU only, at least ``MIN_ROWS`` rows, projections of ``PACKED_MIN_WEIGHTS``
    weights on average, and a torch build that packs."""
    if dtype is not torch.float32 or device.type != "cpu":
        return "oneDNN packing is for fp32 on the CPU"
    if rows < _fast_linear.MIN_ROWS:
        return f"{rows} rows < {_fast_linear.MIN_ROWS} (a few rows stream faster by addmm)"
    lins = plan.linears()
    mean = sum(lin.weight.numel() for lin in lins) / len(lins)
    if mean < PACKED_MIN_WEIGHTS:
        return f"{mean:.0f} weights per projection < {PACKED_MIN_WEIGHTS}"
    if not packing_works():
        return "this torch build does not pack weights for oneDNN (or onednn_linear(False))"
    return None


def packing_works() -> bool:
    """True when this torch build packs linear weights for oneDNN and the packed matmul
    agrees with ``F.linear`` on a small input (checked once per process), and
    ``qkv.ops.fast_linear.onednn_linear(False)`` is not in force."""
    if "ok" not in _PACKING:
        _PACKING["ok"] = False
        op = _fast_linear.onednn_op()
        if op is not None:
            try:
                g = torch.Generator().manual_seed(0)
                x = torch.randn(5, 16, generator=g)
                w = torch.randn(24, 16, generator=g)
                b = torch.randn(24, generator=g)
                with torch.no_grad():
                    got = op(x, torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS), b,
                             "none", [], "")
                _PACKING["ok"] = bool(got.shape == (5, 24) and torch.allclose(
                    got, F.linear(x, w, b), rtol=1e-5, atol=1e-5))
            except (AttributeError, RuntimeError):  # no such op in this build
                pass
    return _PACKING["ok"] and _fast_linear.onednn_linear_active()


class PackedLinears(_Kind):
    """fp32 CPU projections packed for oneDNN (opaque ``mkldnn`` tensors); needs
    ``packing_works()``."""

    def __init__(self, plan: DecodePlan) -> None:
        super().__init__(plan)
        reorder = torch.ops.mkldnn._reorder_linear_weight
        self.w = [reorder(lin.weight.detach(), _PACK_ROWS) for lin in plan.linears()]
        self.b = [lin.bias for lin in plan.linears()]
        self.op = _fast_linear.onednn_op()
        self.binary = torch.ops.mkldnn._linear_pointwise.binary
        fused = ACTIVATION_TABLE[plan.activation].onednn
        self.fused = None if plan.gated else fused  # (attr, algorithm) or None

    def linear(self, x: Tensor, i: int) -> Tensor:
        """x (M, K) contiguous -> (M, N)."""
        return self.op(x, self.w[i], self.b[i], "none", [], "")

    def add(self, x: Tensor, i: int, res: Tensor) -> Tensor:
        """res + x Wᵢᵀ + bᵢ in one oneDNN call (M, N)."""
        return self.binary(x.contiguous(), res, self.w[i], self.b[i], "add")

    def act(self, x: Tensor, i: int) -> Tensor:
        """The activation fused into the matmul where oneDNN has it."""
        if self.fused is None:
            return super().act(x, i)
        attr, algo = self.fused
        return self.op(x, self.w[i], self.b[i], attr, [], algo)


class Int8Linears(_Kind):
    """int8 projections (``qkv.quantize``) through ``int8_linear``'s torch ops."""

    def __init__(self, plan: DecodePlan) -> None:
        super().__init__(plan)
        self.parts = [(lin.weight_int8.t(), lin.scale127, lin.bias)  # (K, N) view, (N,), (N,)
                      for lin in plan.linears()]

    def linear(self, x: Tensor, i: int) -> Tensor:
        """x (M, K) fp32 -> (M, N) fp32, each row quantized on its own."""
        return int8_linear(x, *self.parts[i])

    def add(self, x: Tensor, i: int, res: Tensor) -> Tensor:
        """res + the int8 layer of x, (M, N)."""
        return self.linear(x, i).add_(res)


class Int8KernelLinears(_Kind):
    """int8 projections, each one call of the C kernel ``int8_kernel`` (quantize, int8 dot
    products and epilogue); ``fn`` is its loaded function. Each projection's weight, scale and
    bias are checked against the kernel's declaration once (``kernel_registry.check``); the
    per-call inputs are this class's own contiguous fp32 rows and scratch."""

    def __init__(self, plan: DecodePlan, fn) -> None:
        super().__init__(plan)
        self.fn = fn
        self.keep: list[Tensor] = []  # the contiguous tensors whose pointers the specs hold
        self.specs = [self._spec(lin) for lin in plan.linears()]
        widest_k = max(s[2] for s in self.specs)
        widest_n = max(s[1] for s in self.specs)
        self.widest = (widest_k, widest_n)
        self.scratch_rows = 0
        self.scratch: tuple[int, int, int] | None = None

    def _ptr(self, t: Tensor | None) -> int | None:
        if t is None:
            return None
        t = t.contiguous()
        self.keep.append(t)
        return t.data_ptr()

    def _spec(self, lin) -> tuple:
        n, k = lin.shape  # (w, N, K, s/127, bias)
        w, s, b = (None if t is None else t.contiguous()
                   for t in (lin.weight_int8, lin.scale127, lin.bias))
        kernel_registry.check(  # the fixed tensors against the declaration, once
            "int8_linear", x=torch.empty(1, k, dtype=torch.float32), m=1, k=k, w=w, n=n,
            s127=s, bias=b, res=None, y=torch.empty(1, n, dtype=torch.float32),
            xq=torch.empty(1, k, dtype=torch.int8), acc=torch.empty(1, n, dtype=torch.int32),
            a=torch.empty(1, dtype=torch.float32))
        return (self._ptr(w), n, k, self._ptr(s), self._ptr(b))

    def _scratch(self, rows: int) -> tuple[int, int, int]:
        if rows > self.scratch_rows:
            k, n = self.widest
            self.bufs = (torch.empty(rows, k, dtype=torch.int8),  # (M, K) quantized rows
                         torch.empty(rows, n, dtype=torch.int32),  # (M, N) accumulators
                         torch.empty(rows, dtype=torch.float32))  # (M,) row maxima
            self.scratch = tuple(b.data_ptr() for b in self.bufs)
            self.scratch_rows = rows
        return self.scratch

    def _call(self, x: Tensor, i: int, res: Tensor | None) -> Tensor:
        w, n, k, s, b = self.specs[i]
        x = x.contiguous()
        m = x.shape[0]
        # in place on res is exact: the C loop reads res[j] before it writes y[j]
        out = res if res is not None else torch.empty(m, n, dtype=torch.float32)
        xq, acc, amax = self._scratch(m)
        self.fn(x.data_ptr(), m, k, w, n, s, b, None if res is None else res.data_ptr(),
                out.data_ptr(), xq, acc, amax)
        return out

    def linear(self, x: Tensor, i: int) -> Tensor:
        """x (M, K) fp32 -> (M, N) fp32."""
        return self._call(x, i, None)

    def add(self, x: Tensor, i: int, res: Tensor) -> Tensor:
        """res + the int8 layer of x, written into res (M, N) contiguous."""
        return self._call(x, i, res)
