"""Fixtures of the demo tests (registered by tests/conftest.py, which imports them): full
demo runs built once per session and shared. A module of its own, not tests/demos/conftest.py:
a second conftest.py would take the module name ``conftest`` that the tests import
``run_bounded`` from.

A full demo trains for minutes; where two slow tests need the same run, it is built once.
Under pytest-xdist every worker has its own session fixtures, and ``--dist loadfile`` may put
the two tests on different workers, so a shared run lives in a directory all the workers of
the session see (the session's base temporary directory: a worker's own is a folder in it),
and a file lock (``filelock``, a dependency of torch) lets the first test that needs the run
build it while a test on another worker waits for it, then reads it.

The build runs inside the test that first asks for it (the fixtures below return a function,
not the run), so that the test's timeout covers it and the suite's per-test guards
(tests/conftest.py: thread-local state left behind) check the demo's code as before.
"""

from __future__ import annotations

import contextlib
import io
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock

#: the folder of the shared runs, in the session's base temporary directory
SHARED = "shared-runs"


@dataclass(frozen=True)
class SharedRun:
    """A run built once per session: its directory and what its build printed."""

    path: Path
    printed: str


class SharedRuns:
    """Runs built once per pytest session, whichever xdist worker asks first (see the module
    docstring). ``root``: a directory every worker of the session sees."""

    def __init__(self, root: Path) -> None:
        self.root = root / SHARED
        self.root.mkdir(parents=True, exist_ok=True)

    def get(self, name: str, build: Callable[[Path], str]) -> SharedRun:
        """The run ``name``: ``build(path)`` writes it into the new directory ``path`` and
        returns what it printed, the first time any worker asks; later calls wait for that
        build (the lock) and return the same run. A build that raised fails every later
        call at once, naming the first failure (a minutes-long build is not tried twice); a
        build whose worker died half-way (no marker written) is started again."""
        path = self.root / name
        printed = self.root / f"{name}.printed.txt"  # written last: the run is complete
        failed = self.root / f"{name}.failed.txt"
        with FileLock(self.root / f"{name}.lock"):
            if failed.exists():
                pytest.fail(f"the shared run {name!r} failed when an earlier test built it: "
                            f"{failed.read_text(encoding='utf-8')}", pytrace=False)
            if not printed.exists():
                if path.exists():
                    shutil.rmtree(path)
                try:
                    text = build(path)
                except BaseException as exc:  # a timeout is a BaseException (pytest's Failed)
                    failed.write_text(f"{type(exc).__name__}: {exc}"[:3000], encoding="utf-8")
                    raise
                tmp = printed.with_suffix(".tmp")
                tmp.write_text(text, encoding="utf-8")
                tmp.replace(printed)
        return SharedRun(path, printed.read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def shared_runs(request, tmp_path_factory) -> SharedRuns:
    """The session's ``SharedRuns``: in the base temporary directory of the whole session (an
    xdist worker's own is ``<session base>/popen-gwN``, hence its parent there)."""
    base = tmp_path_factory.getbasetemp()
    return SharedRuns(base.parent if hasattr(request.config, "workerinput") else base)


def _printed_by(command: list[str]) -> str:
    """What ``qkv <command>`` printed (run in-process; it must exit 0)."""
    from qkv.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        status = main(command)
    assert status == 0, buf.getvalue()[-3000:]
    return buf.getvalue()


def _build_full_dates_demo(path: Path) -> str:
    return _printed_by(["demo", "--out", str(path)])


@pytest.fixture
def full_dates_demo(shared_runs) -> Callable[[], SharedRun]:
    """``full_dates_demo()``: the full default ``qkv demo`` (the dates model: DEMO_MODEL,
    DEMO_TRAINING, seed 0), run once per session: the run directory (checkpoint/, demo.json,
    ...) and what the demo printed. tests/demos/test_dates_demo.py checks its bar, and
    tests/demos/test_lora_demo.py adapts it with ``--base`` (the base that demo would train
    itself: the same TrainConfig, test_the_base_is_the_dates_demo_run)."""
    return lambda: shared_runs.get("dates-full", _build_full_dates_demo)
