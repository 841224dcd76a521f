"""One writer per run directory: an advisory lock on ``RUN/.lock``, and what a new run or a
resume checks of the directory (a run already there, run.json against its checkpoint).

Everything that writes into a run directory (``qkv train``, ``--resume``, the demos that call
``Trainer``) first takes ``RunDirLock(RUN)`` and holds it until it has written its last file::

    with RunDirLock(run_dir):        # RunDirBusyError if another process holds it
        ...write run.json, metrics.jsonl, checkpoint/...

The lock is ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``RUN/.lock``, which holds the pid (and host)
of its holder so that a refused writer can say who has the directory. The kernel drops a
flock when its process dies, so a lock left by a killed process (``kill -9``, a power cut,
an out-of-memory kill) is stale by construction: the file may remain, but the next writer
takes it. A clean release deletes ``.lock`` (while still holding it; an acquirer checks that
the file it locked is still the one at ``RUN/.lock`` and retries otherwise, so deleting never
lets two writers in). Where ``fcntl`` is missing (Windows) the lock degrades to an exclusive
create of the file, which a killed process leaves behind: the error message then says to
delete it.

The lock is advisory and per machine: it guards against other qkv processes, not against
``rm``, and on network file systems it is only as good as their ``flock``. Under torchrun only
rank 0 takes it (see ``Trainer``), and every rank stops when it is refused.

``file_fingerprint(path)`` (the size and SHA-256 of a data file, stored in run.json so that
``--resume`` notices a file changed since the run began) is ``qkv.train.data``'s, named here
too.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Any

from ..files import CheckpointError
from .data import file_fingerprint

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_NAME", "RunDirBusyError", "RunDirLock", "check_checkpoint_agrees",
           "file_fingerprint", "lock_holder", "never_saved", "refuse_existing",
           "resume_checkpoint"]

LOCK_NAME = ".lock"


class RunDirBusyError(CheckpointError):
    """Another process is writing to the run directory (the message names it and its pid)."""


class RunDirLock:
    """An exclusive, non-blocking lock on a run directory (see the module docstring).

    Args:
        run_dir: the directory; it must exist when ``acquire`` is called.

    ``acquire()`` takes the lock or raises ``RunDirBusyError``; ``release()`` (idempotent)
    gives it back and deletes ``RUN/.lock``. Also a context manager. The lock is released
    when the object is garbage-collected or the process exits, at the latest.
    """

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> RunDirLock:
        """Take the lock; returns self.

        Raises:
            RunDirBusyError: another process (or another ``RunDirLock`` in this process)
                holds it; the message names the directory and the holder's pid when known.
            OSError: the directory does not exist or is not writable.
        """
        if self._fd is not None:
            return self
        if fcntl is None:  # pragma: no cover - Windows
            return self._acquire_by_create()
        for _ in range(100):  # retried only when a releasing holder deleted the file we locked
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunDirBusyError(self.busy_message()) from None
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                self._fd = fd
                self._write_holder()
                return self
            os.close(fd)  # locked a file a releasing holder had just deleted: again
        raise RunDirBusyError(f"{self.run_dir}: could not take {self.path} (it keeps being "
                              f"replaced by another process)")

    def _acquire_by_create(self) -> RunDirLock:  # pragma: no cover - Windows
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise RunDirBusyError(self.busy_message() + f" (if no such process is running, "
                                  f"delete {self.path})") from None
        self._fd = fd
        self._write_holder()
        return self

    def _write_holder(self) -> None:
        assert self._fd is not None
        text = f"pid {os.getpid()} on {socket.gethostname()}\n".encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, text, 0)

    def holder(self) -> str | None:
        """Who holds the lock as its file says ("pid N on HOST"), or None if unknown."""
        try:
            text = self.path.read_text(encoding="utf-8", errors="replace").strip()
        except OSError:
            return None
        return text.splitlines()[0] if text else None

    def busy_message(self) -> str:
        """The refusal: the directory is in use, by whom (pid and host) when known."""
        who = self.holder()
        by = f"another process ({who})" if who else "another process"
        return (f"{self.run_dir} is in use by {by}: one run directory takes one writer at a "
                f"time; wait for it to finish, or choose another directory")

    def release(self) -> None:
        """Give the lock back and delete ``RUN/.lock`` (nothing if not held)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)  # still ours: we hold the lock while deleting
        os.close(fd)

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.release()

    def __repr__(self) -> str:
        return f"RunDirLock({str(self.run_dir)!r}, held={self.held})"


def lock_holder(run_dir: str | os.PathLike) -> RunDirLock | None:
    """A ``RunDirLock`` of ``run_dir`` describing its holder (``busy_message()``) when another
    process (or lock object) holds the directory now; None when it is free. Takes nothing."""
    lock = RunDirLock(run_dir)
    if fcntl is None:  # pragma: no cover - Windows
        return lock if lock.path.exists() else None
    try:
        fd = os.open(lock.path, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return lock
    finally:
        os.close(fd)  # closing drops a lock we may have taken
    return None


def never_saved(out: Path) -> bool:
    """A run directory whose run stopped before its first checkpoint: no checkpoint, no
    evaluation logged. Such a run has nothing to resume, so a new run may start over in it."""
    from .layout import find_checkpoint
    from .metrics import METRICS, last_evaluation

    try:
        find_checkpoint(out)
        return False
    except CheckpointError:
        pass
    return last_evaluation(out / METRICS) is None


def refuse_existing(out: Path) -> None:
    """Raise: ``out`` holds a run (``RunDirBusyError`` when a process is writing it now)."""
    busy = lock_holder(out)
    if busy is not None:
        raise RunDirBusyError(busy.busy_message())
    raise ValueError(f"{out} already holds a run; continue it with qkv train --resume {out}, "
                     f"or choose another directory")


#: run.json fields that may differ from the checkpoint's copy: ``--resume --steps M`` rewrites
#: steps, ``--accept-changed-data`` the data fingerprint, and a resume may change
#: ``--grad-accum`` / ``--activation-checkpointing`` (the same math), before the next checkpoint
_MAY_DIFFER = ("steps", "data_fingerprint", "grad_accum", "activation_checkpointing")


def check_checkpoint_agrees(out: Path, ckpt: Path, config: Any) -> None:
    """Refuse a run.json that disagrees with the checkpoint's copy (an edited run.json would
    build the wrong model or loss) — before anything is written."""
    from ..files import read_json
    from .config import TrainConfig

    path = ckpt / "run.json"
    if not path.is_file():  # not written by qkv train: nothing to compare
        return
    try:
        saved = TrainConfig.from_dict(read_json(path)).to_dict()
    except ValueError as exc:
        raise CheckpointError(f"{path}: not a valid training configuration: {exc}") from exc
    ours = config.to_dict()
    diff = [f"{k}: {ours[k]!r} vs {saved[k]!r}" for k in sorted(ours)
            if k not in _MAY_DIFFER and ours[k] != saved[k]]
    if diff:
        raise CheckpointError(
            f"{out / 'run.json'} disagrees with {path} ({'; '.join(diff)}): run.json was edited "
            f"after the checkpoint was written; a resume continues the checkpoint's settings "
            f"(only --steps, --grad-accum and --activation-checkpointing may change): restore "
            f"run.json from {path}")


def resume_checkpoint(out: Path, eval_every: int) -> Path:
    """The checkpoint a resume of the run in ``out`` continues; ``CheckpointError`` telling a
    checkpoint deleted since (metrics.jsonl records a save) from one never written (the run
    stopped before its first save, one every ``eval_every`` steps)."""
    from .layout import CHECKPOINT_DIR, find_checkpoint
    from .metrics import METRICS, last_evaluation

    try:
        return find_checkpoint(out)
    except CheckpointError:
        if not (out / "run.json").exists():
            raise
    saved = last_evaluation(out / METRICS)
    if saved is not None:
        raise CheckpointError(
            f"{out} has no checkpoint, although {METRICS} records one saved at step "
            f"{saved}: {out / CHECKPOINT_DIR} was deleted or moved; put it back to resume")
    raise CheckpointError(
        f"{out} has no checkpoint yet: the run stopped before its first save (one every "
        f"eval_every={eval_every} steps); start it again with the same settings and --out "
        f"(it starts over), or choose another directory")
