"""Learning-rate schedules: a multiplier of the peak learning rate as a pure function of the
optimizer step, so a resumed run gets exactly the rates of an uninterrupted one.

- ``inverse_sqrt`` — Vaswani et al. 2017, §5.3: linear warm-up for ``warmup`` steps, then
  decay with the inverse square root of the step; the paper's
  ``d_model^-0.5 · min(step^-0.5, step · warmup^-1.5)`` is this shape with the peak
  ``(d_model · warmup)^-0.5``; qkv takes the peak as ``lr`` instead.
- ``cosine`` — linear warm-up, then half a cosine from the peak down to ``min_ratio`` · peak
  at ``total`` steps.
- ``constant`` — linear warm-up, then the peak.
"""

from __future__ import annotations

import math

__all__ = ["SCHEDULES", "lr_multiplier"]

SCHEDULES = ("inverse_sqrt", "cosine", "constant")


def lr_multiplier(step: int, *, schedule: str, warmup: int, total: int,
                  min_ratio: float = 0.0) -> float:
    """The learning rate of optimizer step ``step`` (1-based: the first update is step 1) as a
    fraction of the peak.

    Args:
        step: 1 .. total.
        schedule: one of ``SCHEDULES``.
        warmup: steps of linear warm-up (0: none).
        total: the run's total optimizer steps (used by "cosine").
        min_ratio: "cosine" only: the final fraction of the peak.

    Raises:
        ValueError: an unknown schedule, a negative warm-up, step < 1.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if step < 1:
        raise ValueError(f"step must be >= 1 (the first update is step 1), got {step}")
    if step <= warmup:
        return step / warmup
    if schedule == "constant":
        return 1.0
    if schedule == "inverse_sqrt":
        return math.sqrt(max(warmup, 1) / step)
    span = max(total - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
