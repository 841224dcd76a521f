"""The data a run trains on, fingerprinted: a new run records its data file as an absolute
path with the fingerprint its model kind takes of it (size and SHA-256 of a file's bytes, or
of a folder's: ``ModelKind.data_fingerprint``) in run.json (``record_data``); a resume checks
that the file is still the one the run began with (``check_data_unchanged``).

Shapes: none (settings and files only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..files import CheckpointError
from .config import TrainConfig
from .kinds import ModelKind

__all__ = ["check_data_unchanged", "data_fingerprint", "record_data"]


def data_fingerprint(kind: ModelKind, path: Path) -> dict[str, Any]:
    """The data's fingerprint as ``kind`` takes it (a file's bytes, a folder's).

    Raises:
        CheckpointError: the data cannot be read."""
    try:
        return kind.data_fingerprint(path)
    except OSError as exc:
        raise CheckpointError(f"--data {path}: cannot read it: {exc}") from exc


def record_data(config: TrainConfig, kind: ModelKind) -> TrainConfig:
    """The config a new run records: its data file as an absolute path (a resume works from
    any directory) with the fingerprint that ``qkv.train.resume.check_data_unchanged``
    compares (``config`` itself without ``data``).

    Raises:
        CheckpointError: the data cannot be read."""
    if config.data is None:
        return config
    data = Path(config.data).resolve()
    return dataclasses.replace(config, data=str(data),
                               data_fingerprint=data_fingerprint(kind, data))


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
