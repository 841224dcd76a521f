"""What ``Trainer.resume`` checks before a run goes on: its run.json read back with the
changes a resume may make (``steps``, ``grad_accum``, ``activation_checkpointing``; ``fsdp``
and ``precision`` are fixed for a run), and its data file unchanged since the run began (the
size and SHA-256 that run.json records, as the model kind takes them).

Shapes: none (settings and files only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..files import CheckpointError, read_json
from .config import TrainConfig
from .kinds import ModelKind

__all__ = ["check_data_unchanged", "data_fingerprint", "resumed_config"]


def resumed_config(out_dir: Path, *, steps: int | None = None, grad_accum: int | None = None,
                   activation_checkpointing: bool | None = None, fsdp: bool | None = None,
                   precision: str | None = None,
                   log: Callable[[str], Any] = print) -> TrainConfig:
    """The ``TrainConfig`` of the run in ``out_dir`` (its run.json) with the given changes;
    ``log`` gets a note when a cosine schedule is re-stretched to new total ``steps``.

    Raises:
        CheckpointError: no such directory, or an unreadable / invalid run.json.
        ValueError: ``fsdp`` or ``precision`` given and not the run's own.
    """
    if not out_dir.is_dir():
        raise CheckpointError(f"{out_dir}: cannot resume: no such run directory")
    try:
        data = read_json(out_dir / "run.json")
    except (OSError, ValueError, CheckpointError) as exc:
        raise CheckpointError(f"{out_dir}: cannot resume: {exc}") from exc
    try:
        config = TrainConfig.from_dict(data)
    except ValueError as exc:
        raise CheckpointError(f"{out_dir / 'run.json'}: cannot resume: {exc}") from exc
    for name, value in (("fsdp", fsdp), ("precision", precision)):
        if value is not None and value != getattr(config, name):
            raise ValueError(f"{name} {value!r}: {out_dir} was trained with {name}="
                             f"{getattr(config, name)!r}, which is fixed for a run "
                             f"(resume continues it; start a new run to change it)")
    changes: dict[str, Any] = {}
    if steps is not None and steps != config.steps:
        changes["steps"] = steps
    if grad_accum is not None:
        changes["grad_accum"] = grad_accum
    if activation_checkpointing is not None:
        changes["activation_checkpointing"] = activation_checkpointing
    if changes:
        config = dataclasses.replace(config, **changes)  # checked again, as from_dict does
        if "steps" in changes and config.schedule == "cosine":
            log(f"note: the cosine schedule is re-stretched from {data['steps']} to "
                f"{steps} total steps; later learning rates differ from those of a run "
                f"started with --steps {steps}")
    return config


def data_fingerprint(kind: ModelKind, path: Path) -> dict[str, Any]:
    """The data's fingerprint as ``kind`` takes it (a file's bytes, a folder's).

    Raises:
        CheckpointError: the data cannot be read."""
    try:
        return kind.data_fingerprint(path)
    except OSError as exc:
        raise CheckpointError(f"--data {path}: cannot read it: {exc}") from exc


def check_data_unchanged(config: TrainConfig, out_dir: Path, kind: ModelKind, *,
                         accept_changed: bool, note: Callable[[str], Any]) -> TrainConfig:
    """The data file of a resumed run must be the one the run began with (size and SHA-256
    in run.json); returns the config with the fingerprint to record. ``note`` gets a line
    when run.json holds no fingerprint, or when a changed file is accepted.

    Raises:
        CheckpointError: the file is missing, unreadable, or changed (unless
            ``accept_changed``)."""
    if config.data is None:
        return config
    path = Path(config.data)
    if not path.exists():
        raise CheckpointError(f"{out_dir}: the run's data file {path} is missing; a "
                              f"resume trains on the file the run began with")
    now = data_fingerprint(kind, path)
    before = config.data_fingerprint
    if before is None:
        note(f"note: {out_dir / 'run.json'} holds no fingerprint of {path} (a run "
             f"from an older qkv): cannot check that the file is unchanged since the "
             f"run began; recording it now")
    elif now != before:
        change = (f"size {before['size']} -> {now['size']} bytes, sha256 "
                  f"{before['sha256'][:12]}... -> {now['sha256'][:12]}...")
        if not accept_changed:
            raise CheckpointError(
                f"--data {path} changed since the run in {out_dir} began ({change}): "
                f"resuming on other data is not the same run (and may fail); restore the "
                f"file, or pass --accept-changed-data to continue on it anyway")
        note(f"note: continuing {out_dir} on the changed {path} ({change}), as "
             f"--accept-changed-data asks; the run is no longer reproducible")
    return dataclasses.replace(config, data_fingerprint=now)
