"""Atomic file writes with ordinary permissions for the files ``qkv.viz`` produces."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ..models.hub import atomic_write

__all__ = ["write_output"]


def write_output(path: str | os.PathLike, write: Callable[[str], object]) -> Path:
    """``write(tmp)`` then rename onto ``path`` (``atomic_write``), creating parent folders;
    the file gets the permissions a plain ``open(path, "w")`` would (0666 less the umask),
    not the temporary file's private 0600, so a page or plot can be shared or served."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    umask = os.umask(0o022)
    os.umask(umask)

    def write_public(tmp: str) -> None:
        write(tmp)
        os.chmod(tmp, 0o666 & ~umask)

    atomic_write(path, write_public)
    return path
