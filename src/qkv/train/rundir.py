"""The run directory: where it keeps its checkpoint, its one writer at a time (an advisory
lock on ``RUN/.lock``), and the claim a run makes on it on every process — what a new run
or a resume checks of the directory, writes into it first (run.json, metrics.jsonl), and
removes again when it fails.

Layout (the whole of it, and what a checkpoint holds: ``qkv.train.checkpoint``): the
checkpoint is ``RUN/checkpoint``; a save writes ``checkpoint.tmp`` first and renames the
previous one to ``checkpoint.old``; ``find_checkpoint``, which every reader of a run (plain,
sharded, adapter) starts from, falls back to ``checkpoint.old``.

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
rank 0 takes it (``RunDirClaim``: rank 0 creates and locks the directory and refuses one that
holds a run; every rank learns rank 0's verdict through ``broadcast_object`` and raises
together). What a new run wrote before a failure is removed again, never anything that was
there before.

``file_fingerprint(path)`` (the size and SHA-256 of a data file, stored in run.json so that
``--resume`` notices a file changed since the run began) is ``qkv.train.data``'s, named here
too.

Shapes: none (files only).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..files import CHECKPOINT_DIR, CheckpointError, atomic_write, read_json
from .data import file_fingerprint
from .distributed import World, broadcast_object

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["CHECKPOINT_DIR", "LOCK_NAME", "METRICS", "OLD_DIR", "TMP_DIR", "NullLog",
           "RunDirBusyError", "RunDirClaim", "RunDirLock", "check_checkpoint_agrees",
           "file_fingerprint", "find_checkpoint", "last_evaluation", "lock_holder",
           "metric_rows", "never_saved", "refuse_existing", "resume_checkpoint",
           "truncate_metrics"]

LOCK_NAME, METRICS = ".lock", "metrics.jsonl"
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


# --- RUN/metrics.jsonl: one JSON object per logged step and per evaluation ----------------------
# (an evaluation row is written after its checkpoint, so it means that checkpoint was complete)
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


def _row(line: str) -> dict[str, Any] | None:
    """One line of a metrics file as its JSON object; None for a partial or malformed line."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None


def metric_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON-object rows of a metrics file ([] when it cannot be read); partial or
    malformed lines are skipped."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    return [row for row in map(_row, lines) if row is not None]


def last_evaluation(path: Path) -> int | None:
    """The step of the last evaluation row of metrics.jsonl (written after each checkpoint),
    or None when there is none."""
    steps = [r.get("step") for r in metric_rows(path) if "loss" not in r and "step" in r]
    return steps[-1] if steps else None


def truncate_metrics(path: Path, step: int) -> None:
    """Drop the lines logged after the checkpoint's step (the resumed run logs them again),
    and a partial last line a killed process may have left."""
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    text = "".join(line + "\n" for line in lines
                   if (row := _row(line)) is not None and row.get("step", 0) <= step)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def never_saved(out: Path) -> bool:
    """A run directory whose run stopped before its first checkpoint: no checkpoint, no
    evaluation logged. Such a run has nothing to resume, so a new run may start over in it."""
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


def resume_checkpoint(out: Path, eval_every: int) -> Path:
    """The checkpoint a resume of the run in ``out`` continues; ``CheckpointError`` telling a
    checkpoint deleted since (metrics.jsonl records a save) from one never written (the run
    stopped before its first save, one every ``eval_every`` steps)."""
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


#: run.json fields that may differ from the checkpoint's copy: ``--resume --steps M`` rewrites
#: steps, ``--accept-changed-data`` the data fingerprint, and a resume may change
#: ``--grad-accum`` / ``--activation-checkpointing`` (the same math), before the next checkpoint
_MAY_DIFFER = ("steps", "data_fingerprint", "grad_accum", "activation_checkpointing")


def check_checkpoint_agrees(out: Path, ckpt: Path, config: Any) -> None:
    """Refuse a run.json that disagrees with the checkpoint's copy (an edited run.json would
    build the wrong model or loss) — before anything is written. ``config``: the run's
    ``TrainConfig``; the copy is read back as one (``from_dict``: an older run's gets the
    defaults of fields it lacks)."""
    path = ckpt / "run.json"
    if not path.is_file():  # not written by qkv train: nothing to compare
        return
    try:
        saved = type(config).from_dict(read_json(path)).to_dict()
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


class RunDirClaim:
    """The hold of one run on ``out_dir`` under ``world`` (see the module docstring).

    Args:
        out_dir: the run directory.
        world: this process's rank and the number of processes.
        lock: a held ``RunDirLock`` on ``out_dir`` of the caller's (then neither taken nor
            released here), or None: rank 0 takes one in ``take_lock`` / ``claim_new``.
        log: a function taking one line of text (rank 0's notes).

    A new run calls ``refuse_held`` before any work and ``start_new`` once everything is
    checked; a resume calls ``take_lock`` before it reads the run and ``continue_from`` once
    its checkpoint is loaded. ``written``: the files a new run wrote (names in ``out_dir``),
    removed by ``undo_new``.
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

    def refuse_held(self) -> None:
        """Before a new run does any work, on every rank: refuse a directory that holds a run
        (``ValueError``; ``RunDirBusyError`` when a process writes it now). A run that never
        saved a checkpoint is not refused: ``claim_new`` starts it over."""
        if (self.out / "run.json").exists() and not never_saved(self.out):
            refuse_existing(self.out)

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

    def start_new(self, run_info: dict[str, Any]) -> None:
        """A new run's first files, once everything is checked: the directory claimed
        (``claim_new``), then on rank 0 run.json (``run_info``, the settings ``--resume``
        continues) and an empty metrics.jsonl. A failure removes what was written
        (``undo_new``) and is raised."""
        self.claim_new()
        try:
            if self.world.is_main:
                self._write_run_json(run_info)
                (self.out / METRICS).write_text("")
                self.written.append(METRICS)
        except BaseException:
            self.undo_new()
            raise

    def continue_from(self, step: int, run_info: dict[str, Any]) -> None:
        """A resumed run's rewrite (call it once every rank has loaded its checkpoint of
        ``step``): on rank 0 metrics.jsonl cut at ``step`` (the resumed run logs the later
        lines again) and run.json rewritten with ``run_info`` (the new total steps,
        fingerprint...)."""
        if self.world.is_main:
            truncate_metrics(self.out / METRICS, step)
            self._write_run_json(run_info)

    def _write_run_json(self, run_info: dict[str, Any]) -> None:
        text = json.dumps(run_info, indent=2, sort_keys=True)
        atomic_write(self.out / "run.json", lambda tmp: Path(tmp).write_text(text))
        self.written.append("run.json")

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
