"""Where a command may write: one rule for every qkv command that writes a directory or a
file the user names (``qkv demo --out``, ``qkv demo coref --out``, ``qkv attention --out``,
``qkv bench attention --out``).

- ``new_output_dir(path)``: a new or empty directory, created here. A directory that holds
  anything is refused (``ValueError`` naming the flag and the path), so a user's files, or a
  training run's checkpoint, are never overwritten or mixed with new ones. A command that
  rewrites only its own files (``qkv attention`` redrawing ``attention_*.png``) names them
  in ``replaceable``; anything else in the directory is still refused.
- ``new_output_file(path)``: one file (a plot): refused when the path is a directory or has
  the wrong suffix; an existing file of that suffix is replaced (atomically by the writer);
  missing parent folders are created.

Neither writes inside a training checkpoint directory (``RUN/checkpoint``,
``checkpoint.old``, ``checkpoint.tmp``: what ``qkv.train`` replaces at every save, which
would delete or block anything put there). The lock that keeps two ``qkv train`` processes
out of one run directory is ``qkv.train``'s own.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["inside_checkpoint", "new_output_dir", "new_output_file"]

_CHECKPOINT_NAMES = ("checkpoint", "checkpoint.old", "checkpoint.tmp")


def inside_checkpoint(path: str | os.PathLike) -> Path | None:
    """The training checkpoint directory that ``path`` is (or lies in), or None: a folder
    named checkpoint / checkpoint.old / checkpoint.tmp holding ``trainer_state.json`` or
    sitting in a run directory (beside ``run.json``)."""
    p = Path(path).absolute()
    for d in (p, *p.parents):
        if d.name in _CHECKPOINT_NAMES and d.is_dir() and (
                (d / "trainer_state.json").is_file() or (d.parent / "run.json").is_file()):
            return d
    return None


def new_output_dir(path: str | os.PathLike, *, flag: str = "--out",
                   replaceable: Sequence[str] = ()) -> Path:
    """Create (with its parents) and return the output directory ``path``, which must not
    exist yet or be empty.

    Args:
        path: the directory.
        flag: how the caller names the path in errors (``--out``, ``out``).
        replaceable: glob patterns of the files the command itself writes there (e.g.
            ``["attention_*.png", "attention.html"]``): a directory holding only such files
            is accepted and they get overwritten; anything else in it is refused.

    Raises:
        ValueError: ``path`` is a file, a non-empty directory (besides ``replaceable``
            files), or inside a training checkpoint directory.
    """
    p = Path(path)
    ckpt = inside_checkpoint(p)
    if ckpt is not None:
        raise ValueError(f"{flag} {p} is inside the training checkpoint directory {ckpt}, "
                         f"which every save replaces; choose a directory outside it")
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {p} is a file, not a directory")
    if p.is_dir():
        others = sorted(e.name for e in p.iterdir()
                        if not (e.is_file() and any(fnmatch.fnmatch(e.name, pat)
                                                    for pat in replaceable)))
        if others:
            shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
            raise ValueError(f"{flag} {p} is not empty (holds {shown}); this command writes "
                             f"a new directory: choose another {flag} or empty it")
    p.mkdir(parents=True, exist_ok=True)
    return p


def new_output_file(path: str | os.PathLike, *, flag: str = "--out",
                    suffix: str = ".png") -> Path:
    """Check the output file ``path`` before the work that produces it and create its parent
    folders; returns it as a Path. An existing file with ``suffix`` will be replaced.

    Raises:
        ValueError: ``path`` does not end in ``suffix``, is a directory, or lies inside a
            training checkpoint directory.
    """
    p = Path(path)
    if p.suffix.lower() != suffix:
        raise ValueError(f"{flag} {p}: the file name must end in {suffix}")
    if p.is_dir():
        raise ValueError(f"{flag} {p} is a directory; give a file name ending in {suffix}")
    ckpt = inside_checkpoint(p.parent)
    if ckpt is not None:
        raise ValueError(f"{flag} {p} is inside the training checkpoint directory {ckpt}, "
                         f"which every save replaces; choose a path outside it")
    if p.parent.exists() and not p.parent.is_dir():
        raise ValueError(f"{flag} {p}: {p.parent} is a file, not a directory")
    p.parent.mkdir(parents=True, exist_ok=True)
    return p
