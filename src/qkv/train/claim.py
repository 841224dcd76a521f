"""A run directory claimed by the trainer on every process: rank 0 creates and locks it
(``qkv.train.rundir.RunDirLock``) and refuses one that holds a run; every rank learns rank 0's
verdict (``broadcast_object``) and raises together. What a new run wrote before a failure is
removed again, never anything that was there before.

Shapes: none (files only).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .distributed import World, broadcast_object
from .layout import TMP_DIR
from .rundir import RunDirBusyError, RunDirLock, never_saved, refuse_existing

__all__ = ["RunDirClaim"]


class RunDirClaim:
    """The hold of one run on ``out_dir`` under ``world``.

    Args:
        out_dir: the run directory.
        world: this process's rank and the number of processes.
        lock: a held ``RunDirLock`` on ``out_dir`` of the caller's (then neither taken nor
            released here), or None: rank 0 takes one in ``take_lock`` / ``claim_new``.
        log: a function taking one line of text (rank 0's notes).

    ``written``: the files a new run wrote (names in ``out_dir``), removed by ``undo_new``.
    """

    def __init__(self, out_dir: Path, world: World, *, lock: RunDirLock | None = None,
                 log: Callable[[str], Any] = print) -> None:
        self.out, self.world, self.log = Path(out_dir), world, log
        self._lock, self._own_lock = lock, lock is None
        self._made_dir = False
        self.written: list[str] = []

    def _agree(self, verdict: str | None, error: type[Exception]) -> None:
        verdict = broadcast_object(verdict, self.world)  # type: ignore[assignment]
        if verdict is not None:
            raise error(verdict)

    def take_lock(self) -> None:
        """Rank 0 takes the run-directory lock; every rank raises ``RunDirBusyError`` if it
        was refused."""
        verdict: str | None = None
        if self.world.is_main and self._lock is None:
            lock = RunDirLock(self.out)
            try:
                lock.acquire()
            except RunDirBusyError as exc:
                verdict = str(exc)
            except OSError as exc:
                verdict = f"{self.out}: cannot lock the run directory: {exc}"
            else:
                self._lock = lock
        self._agree(verdict, RunDirBusyError)

    def release(self) -> None:
        """Release the lock if it was taken here; idempotent."""
        if self._own_lock and self._lock is not None:
            self._lock.release()
            self._lock = None

    def claim_new(self) -> None:
        """Create (if needed) and lock the directory of a new run; refuse one that holds a run
        (a run that never saved a checkpoint is started over). Every rank raises together:
        ``OSError`` (cannot create), ``RunDirBusyError``, ``ValueError`` (holds a run)."""
        verdict: str | None = None
        if self.world.is_main and not self.out.is_dir():
            try:
                self.out.mkdir(parents=True)
                self._made_dir = True
            except FileExistsError:  # another process made it just now: fine
                pass
            except OSError as exc:
                verdict = f"{self.out}: cannot create the run directory: {exc}"
        self._agree(verdict, OSError)
        self.take_lock()
        verdict = None
        if self.world.is_main and (self.out / "run.json").exists():
            if never_saved(self.out):
                self.log(f"note: {self.out} holds a run that stopped before its first "
                         f"checkpoint; starting it over")
                shutil.rmtree(self.out / TMP_DIR, ignore_errors=True)
            else:
                try:
                    refuse_existing(self.out)
                except ValueError as exc:
                    verdict = str(exc)
        self._agree(verdict, ValueError)

    def undo_new(self) -> None:
        """After a failure while a new run wrote its first files: remove what it wrote (and
        the directory if it made it), never anything that was there before; release."""
        if not self.world.is_main:
            return
        for name in self.written:
            (self.out / name).unlink(missing_ok=True)
        self.release()
        if self._made_dir:
            with contextlib.suppress(OSError):
                self.out.rmdir()  # only when empty
