"""Atomic file writes (``qkv.files.atomic_write``) into folders created on demand, for
the files ``qkv.viz`` produces."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ..files import atomic_write

__all__ = ["write_output"]


def write_output(path: str | os.PathLike, write: Callable[[str], object]) -> Path:
    """``write(tmp)`` then rename onto ``path`` (``atomic_write``: ordinary 0666-less-umask
    permissions), creating parent folders; returns ``path`` as a ``Path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, write)
    return path
