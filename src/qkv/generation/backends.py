"""The decode engine's backends: small classes behind a ``DecodePlan``, each declaring what it
supports, in the style of ``qkv.attention``'s dispatch; ``choose`` takes the first that
accepts, ``explain`` says which would run and why each other one refused.

Shapes: R rows decoded together (batch × beams), N prompt length, cap the caches' capacity.

``supports(plan, rows, dtype, device, threads) -> None | reason``: ``plan`` is the model's
plan (None when it has none: only ``modules`` accepts), ``rows`` R, ``dtype`` the
activations' dtype, ``device`` the device, ``threads`` torch's intra-op thread count.
``stepper(plan, model, ids, keep, capacity)`` builds the stepper (``prefill``/``step``/
``run``/``rewind``/``reorder``). In the order tried:

- ``c-layer-int8``: int8 plans on CPU, every layer one C call for all rows (one thread).
- ``int8-kernel``: int8 plans on CPU, each projection one C call (one thread), torch ops
  between.
- ``int8-torch``: int8 plans, ``QuantizedLinear``'s torch ops.
- ``c-layer-fp32``: one fp32 row on CPU, every layer one C call (one thread).
- ``onednn-packed``: fp32 on CPU from ``MIN_ROWS`` rows, oneDNN matmuls on packed weights.
- ``bf16-packed``: bf16 models on a CPU with native bf16 (``qkv.ops.cpu.cpu_bf16``, detected
  at run time), oneDNN matmuls on packed bf16 weights (half of fp32's bytes), any rows.
- ``torch``: fp32/fp64 plans (bf16 where native), torch ops on (in, out) copies (the C
  attention kernel where fp32 on one CPU thread).
- ``modules``: any model, through its own modules and caches (``GPTStepper``): the generic
  path, which runs every hook and every module as written.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops.cpu import cpu_bf16
from . import attention_kernel, gemv_kernel, int8_kernel, row_step_kernel
from .c_layer import CLayers
from .linears import (
    DenseLinears,
    Int8KernelLinears,
    Int8Linears,
    PackedLinears,
    packed_refusal,
    packing_works,
)
from .plan import DecodePlan, plan_check
from .stepper import PlanStepper
from .steppers import GPTStepper
from .torch_layer import TorchLayers

__all__ = ["BACKENDS", "Backend"]


class Backend:
    """One way to decode: ``name``, ``supports`` (None or the reason it refuses), and
    ``stepper`` (only called when ``supports`` said None). ``one_thread``: the backend runs
    its layers on one thread whatever torch's thread count (the C kernels); the others use
    torch's threads. Which is faster here is measured, not assumed
    (``qkv.generation.engine.choose``)."""

    name = ""
    one_thread = False
    one_token_only = False
    """``run(n)`` feeds the n tokens one call each (n plain steps' cost), not in one pass."""

    def supports(self, plan: DecodePlan | None, rows: int, dtype: torch.dtype,
                 device: torch.device, threads: int) -> str | None:
        raise NotImplementedError

    def stepper(self, plan: DecodePlan | None, model: nn.Module, ids: Tensor,
                keep: Tensor | None, capacity: int):
        raise NotImplementedError


def _c_layer_check(plan: DecodePlan) -> str | None:
    """The reason the C layer kernel cannot compute ``plan``, or None."""
    from ..modules.activations import ACTIVATION_TABLE
    if ACTIVATION_TABLE[plan.activation].c_code is None:
        return f"the C layer has no {plan.activation}"
    if plan.norm_kind not in ("layernorm", "rmsnorm"):
        return f"the C layer has no {plan.norm_kind}"
    if plan.qk_norm:
        return "the C layer has no per-head q/k norms (Qwen3)"
    if plan.group > attention_kernel.MAX_GROUP:
        return f"{plan.group} query heads per kv head > the kernel's {attention_kernel.MAX_GROUP}"
    if row_step_kernel.load() is None or attention_kernel.disabled():
        return "the C layer kernel is off or cannot be built here (QKV_ROW_KERNEL, a C compiler)"
    return None


def _cpu(device: torch.device) -> str | None:
    return None if device.type == "cpu" else f"C kernels run on the CPU, not {device}"


class _PlanBackend(Backend):
    """A backend over a plan: ``runner(plan, cache, bias)`` makes the layer runner."""

    prefill_on_rows = True

    def runner(self, plan: DecodePlan, cache, bias):
        raise NotImplementedError

    def stepper(self, plan, model, ids, keep, capacity):
        return PlanStepper(plan, self.name, self.runner, ids, keep, capacity,
                           prefill_on_rows=self.prefill_on_rows)


def _int8_kernel_check(plan: DecodePlan | None, dtype: torch.dtype,
                       device: torch.device) -> str | None:
    """Why an int8 plan cannot use the C int8 products here, or None."""
    why = plan_check(plan, dtype, device, int8=True) or _cpu(device)
    if why is None and int8_kernel.load() is None:
        why = "the int8 kernel is off or cannot be built here (QKV_INT8_KERNEL, a C compiler)"
    return why


def _c_layers(name: str, plan: DecodePlan, cache, bias, **kernels) -> CLayers:
    """``CLayers.build`` for a backend whose ``supports`` accepted the plan."""
    c = CLayers.build(plan, cache, bias, **kernels)
    if c is None:
        raise RuntimeError(f"{name}: RowLayers.build refused a supported plan")
    return c


class CLayerInt8(_PlanBackend):
    name = "c-layer-int8"
    prefill_on_rows = False
    one_thread = True
    one_token_only = True

    def supports(self, plan, rows, dtype, device, threads):
        return _int8_kernel_check(plan, dtype, device) or _c_layer_check(plan)

    def runner(self, plan, cache, bias):
        return _c_layers(self.name, plan, cache, bias, int8=int8_kernel.load())


class Int8Kernel(_PlanBackend):
    name = "int8-kernel"
    prefill_on_rows = False
    one_thread = True

    def supports(self, plan, rows, dtype, device, threads):
        return _int8_kernel_check(plan, dtype, device)

    def runner(self, plan, cache, bias):
        return TorchLayers(plan, Int8KernelLinears(plan, int8_kernel.load()), cache, bias)


class Int8Torch(_PlanBackend):
    name = "int8-torch"
    prefill_on_rows = False

    def supports(self, plan, rows, dtype, device, threads):
        return plan_check(plan, dtype, device, int8=True)

    def runner(self, plan, cache, bias):
        return TorchLayers(plan, Int8Linears(plan), cache, bias)


def _attention_kernel(plan: DecodePlan, threads: int):
    """The C attention function for fp32 on one CPU thread, else None (torch's ops)."""
    if (plan.dtype is torch.float32 and plan.device.type == "cpu" and threads == 1
            and plan.group <= attention_kernel.MAX_GROUP):
        return attention_kernel.load()
    return None


class CLayerFP32(_PlanBackend):
    name = "c-layer-fp32"
    one_thread = True
    one_token_only = True

    def supports(self, plan, rows, dtype, device, threads):
        why = plan_check(plan, dtype, device, int8=False) or _cpu(device)
        if why is None and dtype is not torch.float32:
            why = f"the C layer computes fp32, not {dtype}"
        if why is None and rows != 1:
            why = f"the fp32 C layer decodes one row, not {rows}"
        if why is None and gemv_kernel.load() is None:
            why = "the GEMV kernel is off or cannot be built here (QKV_GEMV_KERNEL)"
        return why or _c_layer_check(plan)

    def runner(self, plan, cache, bias):
        return _c_layers(self.name, plan, cache, bias, gemv=gemv_kernel.load())


def _packing_check() -> str | None:
    if packing_works():
        return None
    return "this torch build does not pack weights for oneDNN (or onednn_linear(False))"


class OneDNNPacked(_PlanBackend):
    name = "onednn-packed"

    def supports(self, plan, rows, dtype, device, threads):
        return (plan_check(plan, dtype, device, int8=False)
                or packed_refusal(plan, rows, dtype, device))

    def runner(self, plan, cache, bias):
        threads = torch.get_num_threads()
        return TorchLayers(plan, PackedLinears(plan), cache, bias,
                           attention_kernel=_attention_kernel(plan, threads))


def _bf16_check(device: torch.device) -> str | None:
    """Why bf16 decoding does not pay on ``device`` (a CPU without native bf16), or None."""
    if device.type != "cpu":
        return None
    support = cpu_bf16()
    return None if support.native else f"bf16 is not native on this CPU ({support})"


class Bf16Packed(_PlanBackend):
    name = "bf16-packed"

    def supports(self, plan, rows, dtype, device, threads):
        why = plan_check(plan, dtype, device, int8=False)
        if why is None and (dtype is not torch.bfloat16 or device.type != "cpu"):
            why = "for bf16 models on the CPU"
        return why or _bf16_check(device) or _packing_check()

    def runner(self, plan, cache, bias):
        return TorchLayers(plan, PackedLinears(plan), cache, bias)


class Torch(_PlanBackend):
    name = "torch"

    def supports(self, plan, rows, dtype, device, threads):
        why = plan_check(plan, dtype, device, int8=False)
        if why is None and dtype is torch.bfloat16:
            why = _bf16_check(device)
        return why

    def runner(self, plan, cache, bias):
        threads = torch.get_num_threads()
        return TorchLayers(plan, DenseLinears(plan), cache, bias,
                           attention_kernel=_attention_kernel(plan, threads))


class Modules(Backend):
    name = "modules"

    def supports(self, plan, rows, dtype, device, threads):
        return None

    def stepper(self, plan, model, ids, keep, capacity):
        stepper = GPTStepper(model, ids, keep, capacity - ids.shape[1], use_cache=True)
        stepper.backend = self.name
        return stepper


BACKENDS: tuple[Backend, ...] = (CLayerInt8(), Int8Kernel(), Int8Torch(), CLayerFP32(),
                                 OneDNNPacked(), Bf16Packed(), Torch(), Modules())
"""Every backend, in the order the engine tries them."""
