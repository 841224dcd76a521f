"""The decode engine's front: ``decoder_stepper`` (what ``qkv.generate`` decodes a
decoder-only model with) and ``explain`` (which backend would run, and why each other one
refused).

Shapes: R rows decoded together, N prompt length, cap the caches' capacity.

The model's ``DecodePlan`` is derived once per call (``decode_plan``); a model without one
(a hook, a LoRA wrapper, an unknown config field, a sliding window, ...) decodes on the
``modules`` backend, which calls its modules. Otherwise the first backend of
``qkv.generation.backends.BACKENDS`` whose ``supports`` accepts (rows, dtype, device,
threads) builds the stepper.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .backends import BACKENDS, Backend, backend_named
from .plan import DecodePlan, Unplannable, decode_plan

__all__ = ["Choice", "choose", "decoder_stepper", "explain"]


@dataclass(frozen=True)
class Choice:
    """The outcome of ``choose``: the ``backend`` that runs, the ``plan`` (None when the
    model has none), ``why_no_plan`` (the plan's refusal, or None), and ``refusals``: (name,
    reason) of every backend tried before it."""

    backend: Backend
    plan: DecodePlan | None
    why_no_plan: str | None
    refusals: tuple[tuple[str, str], ...]


def _plan(model: nn.Module) -> tuple[DecodePlan | None, str | None]:
    try:
        return decode_plan(model), None
    except Unplannable as e:
        return None, str(e)


def choose(model: nn.Module, rows: int, *, dtype: torch.dtype | None = None,
           device: torch.device | str | None = None, threads: int | None = None,
           backend: str | None = None) -> Choice:
    """The backend that decodes ``model`` for ``rows`` rows, with the reasons the earlier ones
    refused. ``dtype``/``device`` default to the model's embedding's, ``threads`` to
    ``torch.get_num_threads()``. ``backend`` forces one by name (ValueError when it refuses,
    with its reason)."""
    plan, why_no_plan = _plan(model)
    weight = next((p for p in model.parameters()), None)
    if dtype is None:
        dtype = plan.dtype if plan is not None else getattr(weight, "dtype", torch.float32)
    if device is None:
        device = plan.device if plan is not None else getattr(weight, "device", "cpu")
    device = torch.device(device)
    threads = torch.get_num_threads() if threads is None else threads
    refusals = []
    candidates = BACKENDS if backend is None else (backend_named(backend),)
    for b in candidates:
        why = b.supports(plan, rows, dtype, device, threads)
        if why is None:
            return Choice(b, plan, why_no_plan, tuple(refusals))
        refusals.append((b.name, why))
    raise ValueError(f"decode backend {backend!r} cannot decode this model: {refusals[-1][1]}")


def decoder_stepper(model: nn.Module, ids: Tensor, keep: Tensor | None, capacity: int, *,
                    backend: str | None = None):
    """A cached stepper for the decoder-only ``model`` on prompts ``ids`` (R, N), left-padded
    with ``keep`` (R, N) bool (True = real token) or None, with caches of ``capacity``
    positions; its ``backend`` attribute names the backend that runs. ``backend`` forces one
    by name (tests, benchmarks)."""
    choice = choose(model, ids.shape[0], device=ids.device, backend=backend)
    return choice.backend.stepper(choice.plan, model, ids, keep, capacity)


def explain(model: nn.Module, *, batch: int = 1, num_beams: int = 1,
            dtype: torch.dtype | None = None, device: torch.device | str | None = None,
            threads: int | None = None) -> str:
    """What ``qkv.generate`` would decode ``model`` with for ``batch`` prompts (× ``num_beams``
    rows each): the backend that would run and, for every other one, why it refuses (or
    that it was not tried). ``dtype``, ``device``, ``threads`` default as ``choose``'s. Returns
    the text (also printed by ``qkv.generation.explain``'s callers as they like)."""
    rows = batch * num_beams
    choice = choose(model, rows, dtype=dtype, device=device, threads=threads)
    threads = torch.get_num_threads() if threads is None else threads
    lines = [f"decode: {type(model).__name__}, {rows} row(s), {threads} thread(s)"]
    lines.append("  plan: " + ("none: " + choice.why_no_plan if choice.plan is None else
                               _describe(choice.plan)))
    refused = dict(choice.refusals)
    for b in BACKENDS:
        if b is choice.backend:
            lines.append(f"  * {b.name}: runs")
        elif b.name in refused:
            lines.append(f"    {b.name}: {refused[b.name]}")
        else:
            lines.append(f"    {b.name}: not tried (an earlier backend runs)")
    return "\n".join(lines)


def _describe(plan: DecodePlan) -> str:
    """One line: the plan's layer form."""
    pos = "rope" if plan.rope is not None else "learned" if plan.pos_table is not None \
        else "none"
    ffn = f"gated {plan.activation}" if plan.gated else plan.activation
    return (f"{len(plan.layers)} layers, width {plan.width}, {plan.heads} heads "
            f"({plan.kv_heads} kv), {plan.norm_kind}, {ffn}, {pos} positions, "
            f"{'int8' if plan.int8 else str(plan.dtype).replace('torch.', '')} weights")
