"""Decode backends over the static-shape step (``qkv.generation.static_layer``): ``compiled``
runs it under ``torch.compile``, ``static-eager`` runs the same step without compiling (the
tests' view of what the compiled code computes).

Shapes: R rows decoded together, cap the caches' capacity.

Both serve fp32/fp64 plans (not int8, not bf16) on any device, one new token per row per
step (a multi-token ``run`` is fed one token at a time). ``compiled`` also needs
``torch.compile`` to work here: ``compile_probe(device)`` compiles a small function with the
step's kinds of ops (a matmul, softmax, an in-place ``index_copy_`` into an input) once per
process and device type and compares it with eager; on failure the backend refuses with the
error. The first step of each new set of shapes compiles (tens of seconds on a small CPU);
later steppers with the same shapes reuse the code (``static_layer.compiled_step``).
"""

from __future__ import annotations

import torch

from .backends import _PlanBackend
from .static_layer import COMPILE_MODES, StaticLayers

__all__ = ["Compiled", "StaticEager", "compile_probe"]

_PROBES: dict[str, str | None] = {}  # device type -> None (works) or the reason


def _probe_fn(x, w, buf, slot):
    """x (M, K), w (K, N), buf (M, 4, N) written at slot (1,) -> softmax(x w) (M, N)."""
    y = torch.softmax(torch.mm(x, w) * 0.5 + 1.0, dim=-1)
    buf.index_copy_(1, slot, y[:, None])
    return y


def compile_probe(device: torch.device | str = "cpu") -> str | None:
    """None when ``torch.compile(fullgraph=True, dynamic=False)`` compiles and runs a small
    step-like function on ``device`` with the eager results (checked once per process and
    device type), else the reason (the error, one line)."""
    device = torch.device(device)
    if device.type not in _PROBES:
        try:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(3, 8, generator=g).to(device)
            w = torch.randn(8, 5, generator=g).to(device)
            slot = torch.tensor([2], device=device)
            want_buf = torch.zeros(3, 4, 5, device=device)
            got_buf = want_buf.clone()
            with torch.no_grad():
                want = _probe_fn(x, w, want_buf, slot)
                fn = torch.compile(_probe_fn, fullgraph=True, dynamic=False)
                got = fn(x, w, got_buf, slot)
            ok = torch.allclose(got, want, rtol=1e-5, atol=1e-6) and torch.allclose(
                got_buf, want_buf, rtol=1e-5, atol=1e-6)
            _PROBES[device.type] = None if ok else (
                "torch.compile ran a probe here but its results differ from eager")
        except Exception as e:  # any compiler failure means: cannot compile here
            first = (str(e).strip().splitlines() or [""])[0][:200]
            _PROBES[device.type] = (f"torch.compile does not work here "
                                    f"({type(e).__name__}: {first})")
    return _PROBES[device.type]


def _static_check(plan, dtype: torch.dtype, device: torch.device) -> str | None:
    """The reason the static step cannot decode ``plan``, or None."""
    if plan is None:
        return "the model has no decode plan"
    if plan.int8:
        return "the weights are int8 (the static step multiplies fp32/fp64)"
    if dtype not in (torch.float32, torch.float64):
        return f"the static step computes fp32/fp64, not {dtype}"
    if dtype != plan.dtype:
        return f"activations in {dtype}, the plan's are {plan.dtype}"
    if device != plan.device:
        return f"device {device}, the weights are on {plan.device}"
    if plan.qk_norm:
        return "the static step has no per-head q/k norms (Qwen3)"
    if plan.rope is not None and plan.rope.position_dependent:
        return ("dynamic RoPE scaling: the angles depend on each call's largest position, "
                "not a table of the capacity")
    return None


class StaticEager(_PlanBackend):
    """``static_layer.StaticLayers`` without compiling: the static step's math eagerly."""

    name = "static-eager"

    def supports(self, plan, rows, dtype, device, threads):
        return _static_check(plan, dtype, torch.device(device))

    def runner(self, plan, cache, bias):
        return StaticLayers(plan, cache, bias)


class Compiled(_PlanBackend):
    """The static step under ``torch.compile(fullgraph=True, dynamic=False, mode=mode)``
    (``static_layer.COMPILE_MODES``; default "default")."""

    name = "compiled"

    def __init__(self, mode: str = "default") -> None:
        if mode not in COMPILE_MODES:
            raise ValueError(f"Compiled: mode must be one of {COMPILE_MODES}, got {mode!r}")
        self.mode = mode

    def supports(self, plan, rows, dtype, device, threads):
        device = torch.device(device)
        return _static_check(plan, dtype, device) or compile_probe(device)

    def runner(self, plan, cache, bias):
        return StaticLayers(plan, cache, bias, compile=self.mode)
