"""tests/shared_runs.py's shared runs: one build per session across pytest-xdist workers,
the same run for every test that asks, a failed build failing the others at once.

Oracle: an inner pytest session (pytester) with that conftest, two xdist workers and
``--dist each`` (every test runs on both workers, so the two always ask for the same run
from two processes, about at once); each build appends one line to a log beside the runs,
and each test writes down what it was given, read back here.
"""

from __future__ import annotations

from pathlib import Path

pytest_plugins = ["pytester"]
CONFTEST = (Path(__file__).parents[1] / "shared_runs.py").read_text(encoding="utf-8")

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
