"""What both decode engines' ``explain`` print for their backends: one line per backend —
the one that runs (with what was measured), the reason each earlier one refused, and those
not tried (docs/ARCHITECTURE.md: Decode backends)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["backend_lines", "ms_per_step"]


def ms_per_step(seconds: float) -> str:
    """Seconds per step as "1.23 ms/step"."""
    return f"{seconds * 1e3:.2f} ms/step"


def backend_lines(backends: Iterable[Any], choice: Any) -> list[str]:
    """The lines of ``backends`` (each with ``name`` and ``one_thread``) for ``choice`` (its
    ``backend``, ``measured`` {name: seconds per step} and ``refusals`` [(name, reason)])."""
    refused = dict(choice.refusals)
    lines = []
    for b in backends:
        one = " [runs on one thread]" if b.one_thread else ""
        if b is choice.backend:
            how = ""
            if choice.measured:
                how = " (measured: " + ", ".join(
                    f"{name} {ms_per_step(sec)}" for name, sec in choice.measured.items()) + ")"
            lines.append(f"  * {b.name}: runs{how}{one}")
        elif b.name in refused:
            lines.append(f"    {b.name}: {refused[b.name]}{one}")
        else:
            lines.append(f"    {b.name}: not tried (an earlier backend runs){one}")
    return lines
