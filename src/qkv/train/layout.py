"""Where a run directory keeps its checkpoint: ``RUN/checkpoint``, the ``checkpoint.tmp`` a
save writes first and the ``checkpoint.old`` it renames the previous one to (the whole
layout, and what a checkpoint holds: ``qkv.train.checkpoint``), and ``find_checkpoint``,
which every reader of a run (plain, sharded, adapter) starts from.

Shapes: none (paths only).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..files import CHECKPOINT_DIR, CheckpointError

__all__ = ["CHECKPOINT_DIR", "OLD_DIR", "TMP_DIR", "find_checkpoint"]

TMP_DIR, OLD_DIR = f"{CHECKPOINT_DIR}.tmp", f"{CHECKPOINT_DIR}.old"


def find_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint directory of ``path``: ``path`` itself when it holds config.json (or
    adapter_config.json: an adapter run's checkpoint), else ``path/checkpoint``, else
    ``path/checkpoint.old`` (a save interrupted between its two renames). Raises
    ``CheckpointError`` when there is none."""
    path = Path(path)
    for candidate in (path, path / CHECKPOINT_DIR, path / OLD_DIR):
        if (candidate / "config.json").is_file() or (
                (candidate / "adapter_config.json").is_file()
                and (candidate / "base.json").is_file()):
            return candidate
    if not path.exists():
        raise CheckpointError(f"{path}: no such run directory")
    raise CheckpointError(f"{path}: not a qkv run directory (no config.json in it or in "
                          f"{path / CHECKPOINT_DIR})")
