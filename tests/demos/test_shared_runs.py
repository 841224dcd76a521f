"""tests/shared_runs.py's shared runs: one build per session across pytest-xdist workers,
the same run for every test that asks, a failed build failing the others at once; and
tests/conftest.py's file order (``LONG_FIRST``), which starts the shared dates run's builder
before the files that read it.

Oracle: an inner pytest session (pytester) with that conftest, two xdist workers and
``--dist each`` (every test runs on both workers, so the two always ask for the same run
from two processes, about at once); each build appends one line to a log beside the runs,
and each test writes down what it was given, read back here. The order: the test files'
own text (which of them use ``full_dates_demo``) and hand-made node ids.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

from conftest import LONG_FIRST, pytest_collection_modifyitems

pytest_plugins = ["pytester"]
TESTS = Path(__file__).parents[1]
CONFTEST = (TESTS / "shared_runs.py").read_text(encoding="utf-8")

INNER = """
import os
import time


def _log(path, line):
    with open(path.parent / "builds.log", "a") as f:
        f.write(line + "\\n")


def test_one_build(shared_runs):
    worker = os.environ["PYTEST_XDIST_WORKER"]

    def build(path):
        _log(path, f"run {worker}")
        time.sleep(0.5)  # the other worker asks meanwhile
        path.mkdir()
        (path / "weights").write_text(worker)
        return f"built by {worker}"

    run = shared_runs.get("run", build)
    (run.path.parent / f"seen-{worker}.txt").write_text(
        f"{run.printed}|{(run.path / 'weights').read_text()}")


def test_failed_build(shared_runs):
    worker = os.environ["PYTEST_XDIST_WORKER"]

    def build(path):
        _log(path, f"broken {worker}")
        time.sleep(0.5)
        raise ValueError(f"boom in {worker}")

    shared_runs.get("broken", build)
"""


def test_a_shared_run_is_built_once_for_both_workers(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_inner=INNER)
    base = pytester.path / "base"
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "-n", "2",
                                           "--dist", "each", f"--basetemp={base}",
                                           timeout=120)
    result.assert_outcomes(passed=2, failed=2)
    runs = base / "shared-runs"
    builds = (runs / "builds.log").read_text().splitlines()
    assert sorted(line.split()[0] for line in builds) == ["broken", "run"], builds
    builder = next(line.split()[1] for line in builds if line.startswith("run "))
    seen = {p.name: p.read_text() for p in runs.glob("seen-*.txt")}
    assert seen == {f"seen-{w}.txt": f"built by {builder}|{builder}" for w in ("gw0", "gw1")}
    # the broken build: its own error where it ran, the first failure named on the other worker
    text = result.stdout.str()
    assert text.count("boom in") >= 2 and "failed when an earlier test built it" in text


def test_long_first_names_files_that_exist_and_starts_the_dates_builder_first():
    """Every ``LONG_FIRST`` entry is a test file, named once; the dates demo's file (the
    shared run's builder: it asks for nothing else) starts before every other file whose
    tests use ``full_dates_demo``, each of them listed."""
    root = TESTS.parent
    assert len(set(LONG_FIRST)) == len(LONG_FIRST)
    assert all((root / path).is_file() for path in LONG_FIRST), LONG_FIRST
    readers = sorted(p.relative_to(root).as_posix() for p in TESTS.rglob("test_*.py")
                     if re.search(r"def test_\w+\([^)]*\bfull_dates_demo\b",
                                  p.read_text(encoding="utf-8")))
    builder = "tests/demos/test_dates_demo.py"
    assert builder in readers and len(readers) >= 3, readers
    assert set(readers) <= set(LONG_FIRST), readers
    assert all(LONG_FIRST.index(builder) < LONG_FIRST.index(r) for r in readers
               if r != builder), LONG_FIRST


def test_the_long_files_go_first_under_xdist_only():
    """The hook moves the tests of ``LONG_FIRST``'s files to the front, file by file in that
    order, every file's tests together and in their order; other files keep theirs; a run
    without xdist (no ``workerinput``) keeps the collection as it is."""
    first, second = LONG_FIRST[0], LONG_FIRST[1]
    ids = ["tests/a.py::t1", f"{second}::x[1]", "tests/b.py::t", f"{first}::y",
           f"{second}::x[2]", "tests/a.py::t2"]
    want = [f"{first}::y", f"{second}::x[1]", f"{second}::x[2]", "tests/a.py::t1",
            "tests/b.py::t", "tests/a.py::t2"]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    pytest_collection_modifyitems(SimpleNamespace(workerinput={}), items)
    assert [item.nodeid for item in items] == want
    items = [SimpleNamespace(nodeid=i) for i in ids]
    pytest_collection_modifyitems(SimpleNamespace(), items)
    assert [item.nodeid for item in items] == ids
