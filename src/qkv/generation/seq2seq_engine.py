"""The encoder-decoder decode engine: the backends that decode a ``Seq2SeqPlan`` (each
declaring what it supports, as the decoder-only ``qkv.generation.backends``), ``choose_seq2seq``
(the first that accepts, or the fastest measured), ``seq2seq_stepper`` and
``explain_seq2seq`` (which backend would decode a ``Transformer``, and why each other one
refuses).

Shapes: B sources, K beams, R = B·K rows decoded together, T new tokens.

``supports(plan, rows, dtype, device, threads) -> None | reason`` (``plan`` None when the
model has none: only ``modules`` accepts); ``linears(plan)`` the weight form the decoder
layers (``Seq2SeqLayers``) multiply with; ``stepper(plan, src, src_mask, start, beams,
max_new_tokens)`` the ``Seq2SeqPlanStepper``. In the order tried:

- ``int8-kernel``: int8 plans on the CPU, each projection one C call (one thread), the
  encoder's too (``qkv.generation.seq2seq_encoder``).
- ``int8-torch``: int8 plans, ``QuantizedLinear``'s torch ops (the int8 reference), the
  encoder's too.
- ``onednn-packed``: fp32 on the CPU from ``MIN_ROWS`` rows, oneDNN matmuls on packed
  weights (the activation and the residual add fused into the call).
- ``torch``: fp32/fp64 plans, torch ops on (in, out) copies, any device.
- ``modules``: any Transformer, through its own modules (``Transformer.decode`` with
  ``new_cache``; built by ``qkv.generation.steppers.Seq2SeqStepper``).

The decoder-only engine's C layer backends (``c-layer-int8``, ``c-layer-fp32``) compute a
pre-norm self-attention layer: they have no cross-attention and do not serve a Transformer.

Measured, not assumed: when more than one backend (``modules`` aside) accepts, a few decode
steps of each are timed on B random sources and the fastest runs (remembered for the process
per plan shape, B, K and threads); ``QKV_DECODE_MEASURE=0`` (or ``measure=False``): the first
accepting backend runs.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from . import attention_kernel, int8_kernel
from .explain_lines import backend_lines, ms_per_step
from .linears import (
    DenseLinears,
    Int8KernelLinears,
    Int8Linears,
    PackedLinears,
    packed_refusal,
)
from .plan import Unplannable, plan_check
from .seq2seq_plan import Seq2SeqPlan, seq2seq_plan
from .seq2seq_stepper import Seq2SeqPlanStepper

__all__ = ["MEASURE_STEPS", "SEQ2SEQ_BACKENDS", "Seq2SeqBackend", "Seq2SeqChoice", "attention",
           "choose_seq2seq", "explain_seq2seq", "measuring", "seq2seq_stepper", "step_seconds"]

MEASURE_STEPS = 4
"""Timed decode steps per backend when the engine measures (after the prefill and
``WARM_STEPS`` untimed steps: a first call of an op shape sets up its kernels)."""
WARM_STEPS = 2
_MEASURED: dict[tuple, dict[str, float]] = {}  # (shape, B, K, threads, names) -> s/step


def measuring(measure: bool | None) -> bool:
    """``measure`` if given, else whether ``QKV_DECODE_MEASURE`` is unset or not "0" /
    "false" / "off" / "no" (as the decoder-only engine)."""
    if measure is not None:
        return measure
    return os.environ.get("QKV_DECODE_MEASURE", "1").strip().lower() not in (
        "0", "false", "off", "no")


class Seq2SeqBackend:
    """One way to decode a Transformer: ``name``, ``supports`` (None or the reason it
    refuses), ``linears`` (the weight form) and ``stepper``. ``one_thread``: its products
    run on one thread whatever torch's thread count (the C kernels)."""

    name = ""
    one_thread = False

    def supports(self, plan: Seq2SeqPlan | None, rows: int, dtype: torch.dtype,
                 device: torch.device, threads: int) -> str | None:
        raise NotImplementedError

    def linears(self, plan: Seq2SeqPlan):
        raise NotImplementedError

    def encoder_linears(self, plan: Seq2SeqPlan):
        """The weight form of ``plan.encoder``, or None: the encoder runs through the
        model's modules (fp32: those already run oneDNN's matmul on the T real rows)."""
        return None

    def stepper(self, plan: Seq2SeqPlan, src: Tensor, src_mask: Tensor | None, start: int,
                beams: int, max_new_tokens: int) -> Seq2SeqPlanStepper:
        """The stepper (only called when ``supports`` said None); the C attention kernel
        where it serves (``attention``)."""
        return Seq2SeqPlanStepper(plan, self.name, self.linears, src, src_mask, start, beams,
                                  max_new_tokens, attention_kernel=attention(plan),
                                  encoder_linears=self.encoder_linears(plan))



def attention(plan: Seq2SeqPlan, threads: int | None = None):
    """The C attention function for fp32 activations on one CPU thread (``threads``, default
    torch's count), else None (torch's ops)."""
    threads = torch.get_num_threads() if threads is None else threads
    if plan.dtype is torch.float32 and plan.device.type == "cpu" and threads == 1:
        return attention_kernel.load()
    return None


class Int8Kernel(Seq2SeqBackend):
    name = "int8-kernel"
    one_thread = True

    def supports(self, plan, rows, dtype, device, threads):
        why = plan_check(plan, dtype, device, int8=True)
        if why is None and device.type != "cpu":
            why = f"C kernels run on the CPU, not {device}"
        if why is None and int8_kernel.load() is None:
            why = "the int8 kernel is off or cannot be built here (QKV_INT8_KERNEL, a C compiler)"
        return why

    def linears(self, plan):
        return Int8KernelLinears(plan, int8_kernel.load())

    def encoder_linears(self, plan):
        return None if plan.encoder is None else Int8KernelLinears(plan.encoder,
                                                                   int8_kernel.load())


class Int8Torch(Seq2SeqBackend):
    name = "int8-torch"

    def supports(self, plan, rows, dtype, device, threads):
        return plan_check(plan, dtype, device, int8=True)

    def linears(self, plan):
        return Int8Linears(plan)

    def encoder_linears(self, plan):
        return None if plan.encoder is None else Int8Linears(plan.encoder)


class OneDNNPacked(Seq2SeqBackend):
    name = "onednn-packed"

    def supports(self, plan, rows, dtype, device, threads):
        return (plan_check(plan, dtype, device, int8=False)
                or packed_refusal(plan, rows, dtype, device))

    def linears(self, plan):
        return PackedLinears(plan)


class Torch(Seq2SeqBackend):
    name = "torch"

    def supports(self, plan, rows, dtype, device, threads):
        return plan_check(plan, dtype, device, int8=False)

    def linears(self, plan):
        return DenseLinears(plan)


class Modules(Seq2SeqBackend):
    """The model's own modules (``qkv.generation.steppers.Seq2SeqStepper`` builds that
    stepper: it calls ``Transformer.decode``)."""

    name = "modules"

    def supports(self, plan, rows, dtype, device, threads):
        return None

    def stepper(self, plan, src, src_mask, start, beams, max_new_tokens):
        raise TypeError("the modules backend's stepper is qkv.generation.steppers."
                        "Seq2SeqStepper(..., backend='modules')")


SEQ2SEQ_BACKENDS: tuple[Seq2SeqBackend, ...] = (Int8Kernel(), Int8Torch(), OneDNNPacked(),
                                                Torch(), Modules())
"""Every encoder-decoder backend, in the order the engine tries them."""


@dataclass(frozen=True)
class Seq2SeqChoice:
    """The outcome of ``choose_seq2seq``: the ``backend`` that runs, the ``plan`` (None when
    the model has none), ``why_no_plan`` (the plan's refusal, or None), ``refusals``:
    (name, reason) of every other backend tried, and ``measured``: seconds per decode step
    of the backends timed against each other (empty when none was)."""

    backend: Seq2SeqBackend
    plan: Seq2SeqPlan | None
    why_no_plan: str | None
    refusals: tuple[tuple[str, str], ...]
    measured: dict[str, float] = field(default_factory=dict)


def _shape_key(plan: Seq2SeqPlan) -> tuple:
    return (len(plan.layers), plan.width, plan.heads, plan.head_dim, plan.ffn, plan.vocab,
            plan.activation, plan.gated, plan.norm_kind, plan.norm_first, plan.int8,
            plan.dtype, plan.device.type, plan.model.config.num_encoder_layers)


def step_seconds(backend: Seq2SeqBackend, plan: Seq2SeqPlan, batch: int, beams: int
                 ) -> float:
    """The median wall time of one decode step of ``backend`` for ``batch`` random
    8-token sources × ``beams`` rows (``MEASURE_STEPS`` timed steps after the prefill and
    ``WARM_STEPS`` untimed ones)."""
    c = plan.model.config
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, c.src_vocab_size, (batch, 8), generator=g).to(plan.device)
    keep = torch.ones_like(src, dtype=torch.bool)
    times = []
    with torch.inference_mode():
        st = backend.stepper(plan, src, keep, c.bos_id, beams, WARM_STEPS + MEASURE_STEPS + 1)
        tok = st.prefill().argmax(dim=-1)
        for i in range(WARM_STEPS + MEASURE_STEPS):
            start = time.perf_counter()
            tok = st.step(tok).argmax(dim=-1)
            if i >= WARM_STEPS:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def choose_seq2seq(model: nn.Module, batch: int, beams: int = 1, *,
                   dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                   threads: int | None = None, backend: str | None = None,
                   measure: bool | None = None) -> Seq2SeqChoice:
    """The backend that decodes the Transformer ``model`` for ``batch`` sources × ``beams``
    rows, with the reasons the others refused. ``dtype``/``device`` default to the plan's
    (the model's), ``threads`` to ``torch.get_num_threads()``. ``backend`` forces one by name
    (ValueError when unknown or when it refuses, with its reason). ``measure``: time the
    accepting backends (``modules`` aside) against each other and run the fastest; False:
    the first accepting one runs; None: measure unless ``QKV_DECODE_MEASURE=0``."""
    try:
        plan, why_no_plan = seq2seq_plan(model), None
    except Unplannable as e:
        plan, why_no_plan = None, str(e)
    weight = next((p for p in model.parameters()), None)
    if dtype is None:
        dtype = plan.dtype if plan is not None else getattr(weight, "dtype", torch.float32)
    if device is None:
        device = plan.device if plan is not None else getattr(weight, "device", "cpu")
    device = torch.device(device)
    threads = torch.get_num_threads() if threads is None else threads
    rows = batch * beams
    names = [b.name for b in SEQ2SEQ_BACKENDS]
    if backend is not None and backend not in names:
        raise ValueError(f"unknown encoder-decoder decode backend {backend!r}; known: {names}")
    refusals: list[tuple[str, str]] = []
    accepting: list[Seq2SeqBackend] = []
    for b in SEQ2SEQ_BACKENDS:
        if backend is not None and b.name != backend:
            continue
        why = b.supports(plan, rows, dtype, device, threads)
        if why is None:
            accepting.append(b)
            if backend is not None or not measuring(measure):
                break
        else:
            refusals.append((b.name, why))
    if not accepting:
        raise ValueError(f"decode backend {backend!r} cannot decode this model: "
                         f"{refusals[-1][1]}")
    timed = [b for b in accepting if b.name != "modules"]
    if len(timed) < 2:
        return Seq2SeqChoice(accepting[0], plan, why_no_plan, tuple(refusals))
    key = (_shape_key(plan), batch, beams, threads, tuple(b.name for b in timed))
    if key not in _MEASURED:
        _MEASURED[key] = {b.name: step_seconds(b, plan, batch, beams) for b in timed}
    measured = _MEASURED[key]
    best = min(timed, key=lambda b: measured[b.name])
    for b in timed:
        if b is not best:
            refusals.append((b.name, f"measured slower here: "
                                     f"{ms_per_step(measured[b.name])} against "
                                     f"{best.name}'s {ms_per_step(measured[best.name])}"))
    order = {name: i for i, name in enumerate(names)}
    refusals.sort(key=lambda r: order[r[0]])
    return Seq2SeqChoice(best, plan, why_no_plan, tuple(refusals), measured)


def seq2seq_stepper(model: nn.Module, src: Tensor, src_mask: Tensor | None, start: int,
                    beams: int, max_new_tokens: int, *, backend: str | None = None
                    ) -> Seq2SeqPlanStepper | None:
    """The plan stepper of the backend ``choose_seq2seq`` picks for ``model`` on the sources
    ``src`` (B, S) (``src_mask`` (B, S) bool or None) × ``beams``, or None when that is the
    ``modules`` backend (``qkv.generation.steppers.Seq2SeqStepper`` then decodes through the
    modules). ``backend`` forces one by name."""
    choice = choose_seq2seq(model, src.shape[0], beams, device=src.device, backend=backend)
    if choice.backend.name == "modules":
        return None
    return choice.backend.stepper(choice.plan, src, src_mask, start, beams, max_new_tokens)


def explain_seq2seq(model: nn.Module, *, batch: int = 1, num_beams: int = 1,
                    dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                    threads: int | None = None) -> str:
    """What ``qkv.generate`` would decode the Transformer ``model`` with for ``batch``
    sources × ``num_beams`` rows: the plan, the backend that would run (with what was
    measured) and why each other one refuses (or that it was not tried). Returns the text."""
    choice = choose_seq2seq(model, batch, num_beams, dtype=dtype, device=device,
                            threads=threads)
    threads = torch.get_num_threads() if threads is None else threads
    rows = batch * num_beams
    lines = [f"decode: {type(model).__name__} (encoder-decoder), {batch} source(s) x "
             f"{num_beams} beam(s) = {rows} row(s), {threads} thread(s)",
             "  plan: " + ("none: " + choice.why_no_plan if choice.plan is None
                           else choice.plan.describe())]
    if choice.plan is not None:
        enc = choice.plan.why_no_encoder
        lines.append("  encoder: " + (f"modules ({enc})" if enc is not None else
                                      "plan (on the int8 backends' weight forms), else modules"))
    lines += backend_lines(SEQ2SEQ_BACKENDS, choice)
    lines.append("    c-layer-int8, c-layer-fp32: decoder-only layers (no cross-attention); "
                 "not for a Transformer")
    return "\n".join(lines)
