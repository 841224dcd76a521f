"""The decode engine's front: ``decoder_stepper`` (what ``qkv.generate`` decodes a
decoder-only model with) and ``explain`` (which backend would run, and why each other one
refused).

Shapes: R rows decoded together, N prompt length, cap the caches' capacity.

The model's ``DecodePlan`` is derived once per call (``decode_plan``); a model without one
(a hook, a LoRA wrapper, an unknown config field, a sliding window, ...) decodes on the
``modules`` backend, which calls its modules. Otherwise the first backend of
``qkv.generation.backends.BACKENDS`` whose ``supports`` accepts (rows, dtype, device,
threads) builds the stepper.

Measured, not assumed: which backend is fastest depends on the CPU, the thread count and the
rows (on the machine of BENCHMARKS.md the one-thread C layer wins at one row and loses to
the int8 C projections with torch's ops between at 16, and torch's threaded int8 matmuls win
at two threads). When more than one backend (``modules`` aside) accepts, the engine times a
few decode steps of each on ``rows`` random prompts (``step_seconds``) and runs the fastest;
the outcome is remembered for the process per (plan shape, rows, threads), so ``explain`` and
``generate`` agree and the measurement is paid once (a stepper build and ``MEASURE_STEPS`` + 1
steps per candidate). ``QKV_DECODE_MEASURE=0`` (or ``measure=False``) turns measuring off:
the first accepting backend in ``BACKENDS`` order runs.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..models.transformer import Transformer
from .backends import BACKENDS, Backend
from .defaults import describe_settings, model_settings
from .explain_lines import backend_lines, ms_per_step
from .plan import DecodePlan, Unplannable, decode_plan
from .seq2seq_engine import explain_seq2seq
from .static_backend import Compiled, StaticEager

__all__ = ["MEASURE_STEPS", "OPT_IN", "Choice", "choose", "decoder_stepper", "explain",
           "named_backend", "step_seconds"]

OPT_IN: tuple[Backend, ...] = (Compiled(), StaticEager())
"""Backends that run only when asked by name (``backend="compiled"``): the static-shape step
under ``torch.compile`` (its first step of each shape compiles for tens of seconds; measured
against the hand paths in BENCHMARKS.md, which kept them) and the same step eager."""


def named_backend(name: str) -> Backend:
    """The backend called ``name``, of ``BACKENDS`` or ``OPT_IN``; ValueError listing the
    names otherwise."""
    for b in (*BACKENDS, *OPT_IN):
        if b.name == name:
            return b
    raise ValueError(f"unknown decode backend {name!r}; known: "
                     f"{[b.name for b in (*BACKENDS, *OPT_IN)]}")


@dataclass(frozen=True)
class Choice:
    """The outcome of ``choose``: the ``backend`` that runs, the ``plan`` (None when the
    model has none), ``why_no_plan`` (the plan's refusal, or None), and ``refusals``: (name,
    reason) of every backend tried before it."""

    backend: Backend
    plan: DecodePlan | None
    why_no_plan: str | None
    refusals: tuple[tuple[str, str], ...]
    measured: dict[str, float] = field(default_factory=dict)
    """Seconds per decode step of the backends measured against each other (empty when
    nothing was measured)."""


MEASURE_STEPS = 5
"""Timed decode steps per backend when the engine measures (after one untimed step)."""
_MEASURED: dict[tuple, dict[str, float]] = {}  # (plan shape, rows, threads, names) -> s/step


def _measuring(measure: bool | None) -> bool:
    if measure is not None:
        return measure
    return os.environ.get("QKV_DECODE_MEASURE", "1").strip().lower() not in (
        "0", "false", "off", "no")


def _shape_key(plan: DecodePlan) -> tuple:
    return (len(plan.layers), plan.width, plan.heads, plan.kv_heads, plan.head_dim, plan.ffn,
            plan.vocab, plan.activation, plan.gated, plan.norm_kind, plan.int8, plan.dtype,
            plan.rope is not None, plan.qk_norm, plan.device.type)


def step_seconds(backend: Backend, plan: DecodePlan, rows: int) -> float:
    """The median wall time of one decode step of ``backend`` on ``plan`` for ``rows`` rows
    of a short random prompt (``MEASURE_STEPS`` timed steps after one untimed), in seconds."""
    n = 8
    if plan.pos_table is not None:
        n = max(1, min(n, plan.pos_table.shape[0] - MEASURE_STEPS - 2))
    window = plan.model.config.attention_window  # planned only for caches within it
    if window is not None:
        n = max(1, min(n, window - MEASURE_STEPS - 1))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, plan.vocab, (rows, n), generator=g).to(plan.device)
    times = []
    with torch.inference_mode():
        st = backend.stepper(plan, plan.model, ids, None, n + MEASURE_STEPS + 1)
        tok = st.prefill().argmax(dim=-1)
        for i in range(MEASURE_STEPS + 1):
            start = time.perf_counter()
            tok = st.step(tok).argmax(dim=-1)
            if i:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure(plan: DecodePlan, rows: int, threads: int, backends: list[Backend]
             ) -> dict[str, float]:
    key = (_shape_key(plan), rows, threads, tuple(b.name for b in backends))
    if key not in _MEASURED:
        _MEASURED[key] = {b.name: step_seconds(b, plan, rows) for b in backends}
    return _MEASURED[key]


def _plan(model: nn.Module, capacity: int | None = None
          ) -> tuple[DecodePlan | None, str | None]:
    try:
        return decode_plan(model, capacity), None
    except Unplannable as e:
        return None, str(e)


def choose(model: nn.Module, rows: int, *, dtype: torch.dtype | None = None,
           device: torch.device | str | None = None, threads: int | None = None,
           backend: str | None = None, measure: bool | None = None,
           multi_token: bool = False, capacity: int | None = None) -> Choice:
    """The backend that decodes ``model`` for ``rows`` rows, with the reasons the earlier ones
    refused. ``dtype``/``device`` default to the model's embedding's, ``threads`` to
    ``torch.get_num_threads()``. ``backend`` forces one by name (ValueError when it refuses,
    with its reason). ``measure``: time every accepting backend (but ``modules``) against
    each other and run the fastest (module docstring); False: the first accepting one runs;
    None: measure unless ``QKV_DECODE_MEASURE=0``. ``multi_token``: the caller feeds several
    tokens per ``run`` (prompt lookup, speculative verification): backends that feed one
    token per call (``Backend.one_token_only``) refuse. ``capacity``: the caches' positions
    (a sliding-window model is planned when they fit in its window, ``decode_plan``)."""
    plan, why_no_plan = _plan(model, capacity)
    weight = next((p for p in model.parameters()), None)
    if dtype is None:
        dtype = plan.dtype if plan is not None else getattr(weight, "dtype", torch.float32)
    if device is None:
        device = plan.device if plan is not None else getattr(weight, "device", "cpu")
    device = torch.device(device)
    threads = torch.get_num_threads() if threads is None else threads
    refusals: list[tuple[str, str]] = []
    accepting: list[Backend] = []
    for b in BACKENDS if backend is None else (named_backend(backend),):
        why = b.supports(plan, rows, dtype, device, threads)
        if why is None and multi_token and b.one_token_only:
            why = "feeds one token per call; several per pass were asked (multi_token)"
        if why is None:
            accepting.append(b)
            if backend is not None or not _measuring(measure):
                break  # the first accepting backend runs
        else:
            refusals.append((b.name, why))
    if not accepting:
        raise ValueError(f"decode backend {backend!r} cannot decode this model: "
                         f"{refusals[-1][1]}")
    timed = [b for b in accepting if b.name != "modules"]
    if len(timed) < 2:
        return Choice(accepting[0], plan, why_no_plan, _in_order(refusals))
    measured = _measure(plan, rows, threads, timed)
    best = min(timed, key=lambda b: measured[b.name])
    for b in timed:
        if b is not best:
            refusals.append((b.name, f"measured slower here: "
                                     f"{ms_per_step(measured[b.name])} against "
                                     f"{best.name}'s {ms_per_step(measured[best.name])}"))
    return Choice(best, plan, why_no_plan, _in_order(refusals), measured)


def _in_order(refusals: list[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """The refusals (name, reason) in ``BACKENDS`` order (measured ones after the chosen
    backend included)."""
    order = {b.name: i for i, b in enumerate((*BACKENDS, *OPT_IN))}
    return tuple(sorted(refusals, key=lambda r: order.get(r[0], len(order))))



def decoder_stepper(model: nn.Module, ids: Tensor, keep: Tensor | None, capacity: int, *,
                    backend: str | None = None, multi_token: bool = False):
    """A cached stepper for the decoder-only ``model`` on prompts ``ids`` (R, N), left-padded
    with ``keep`` (R, N) bool (True = real token) or None, with caches of ``capacity``
    positions; its ``backend`` attribute names the backend that runs. ``backend`` forces one
    by name (tests, benchmarks); ``multi_token`` as for ``choose``."""
    choice = choose(model, ids.shape[0], device=ids.device, backend=backend,
                    multi_token=multi_token, capacity=capacity)
    return choice.backend.stepper(choice.plan, model, ids, keep, capacity)


def explain(model: nn.Module, *, batch: int = 1, num_beams: int = 1,
            dtype: torch.dtype | None = None, device: torch.device | str | None = None,
            threads: int | None = None, multi_token: bool = False) -> str:
    """What ``qkv.generate`` would decode ``model`` with for ``batch`` prompts (× ``num_beams``
    rows each): the backend that would run and, for every other one, why it refuses (or
    that it was not tried). ``dtype``, ``device``, ``threads`` default as ``choose``'s;
    ``multi_token=True`` for what prompt lookup (``prompt_lookup_num_tokens``) and the target
    of speculative decoding run on. Returns the text; its last line says which of
    ``generate``'s defaults the model's generation settings give
    (``qkv.generation.defaults.describe_settings``). An encoder-decoder ``Transformer`` is
    explained by ``qkv.generation.seq2seq_engine.explain_seq2seq`` (its own backends;
    ``multi_token`` does not change them: each feeds several tokens per pass)."""
    seq2seq = isinstance(model, Transformer)
    settings = describe_settings(model_settings(model), encoder_decoder=seq2seq)
    if seq2seq:
        return explain_seq2seq(model, batch=batch, num_beams=num_beams, dtype=dtype,
                               device=device, threads=threads) + "\n  " + settings
    rows = batch * num_beams
    choice = choose(model, rows, dtype=dtype, device=device, threads=threads,
                    multi_token=multi_token)
    threads = torch.get_num_threads() if threads is None else threads
    lines = [f"decode: {type(model).__name__}, {rows} row(s), {threads} thread(s)"]
    lines.append("  plan: " + ("none: " + choice.why_no_plan if choice.plan is None else
                               _describe(choice.plan)))
    lines += backend_lines(BACKENDS, choice)
    lines.append("  opt-in (backend=...): " + ", ".join(b.name for b in OPT_IN))
    lines.append("  " + settings)
    return "\n".join(lines)


def _describe(plan: DecodePlan) -> str:
    """One line: the plan's layer form."""
    pos = "rope" if plan.rope is not None else "learned" if plan.pos_table is not None \
        else "none"
    ffn = f"gated {plan.activation}" if plan.gated else plan.activation
    return (f"{len(plan.layers)} layers, width {plan.width}, {plan.heads} heads "
            f"({plan.kv_heads} kv), {plan.norm_kind}, {ffn}, {pos} positions, "
            f"{'int8' if plan.int8 else str(plan.dtype).replace('torch.', '')} weights")
