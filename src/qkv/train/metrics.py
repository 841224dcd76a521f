"""RUN/metrics.jsonl: one JSON object per logged training step and per evaluation (an
evaluation row is written after its checkpoint, so it means that checkpoint was complete).
Helpers the trainer uses to read it back, cut it at a resumed step, and stand in for it on
ranks that log nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..files import atomic_write

__all__ = ["METRICS", "NullLog", "last_evaluation", "metric_rows", "truncate_metrics"]

METRICS = "metrics.jsonl"


class NullLog:
    """A metrics file that writes nothing (ranks other than 0)."""

    def __enter__(self) -> NullLog:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def write(self, text: str) -> None:
        return None

    def flush(self) -> None:
        return None


def truncate_metrics(path: Path, step: int) -> None:
    """Drop the lines logged after the checkpoint's step (the resumed run logs them again),
    and a partial last line a killed process may have left."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and row.get("step", 0) <= step:
            keep.append(line)
    text = "".join(line + "\n" for line in keep)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def metric_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON-object rows of a metrics file ([] when it cannot be read); partial or
    malformed lines are skipped."""
    rows: list[dict[str, Any]] = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return rows
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def last_evaluation(path: Path) -> int | None:
    """The step of the last evaluation row of metrics.jsonl (written after each checkpoint),
    or None when there is none."""
    steps = [r.get("step") for r in metric_rows(path) if "loss" not in r and "step" in r]
    return steps[-1] if steps else None
