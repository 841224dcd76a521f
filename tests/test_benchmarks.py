"""Every benchmark script runs in --quick mode, so that none of them rots.

Only that it runs and prints its table, with the CPU it ran on in its header, is checked:
timings are never asserted.

A script gets this test's torch thread count as ``OMP_NUM_THREADS`` (one under xdist, where
tests/conftest.py gives each worker one thread): with torch's default of one thread per core,
its OpenMP threads spin waiting for one another while the other worker holds a core, which
cost bench_quantize --quick 45 CPU-seconds under load instead of 6. A script that sets its
own thread counts (``--threads``) still does.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_bounded

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("bench_*.py"))


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_quick_mode_runs(script):
    if script == "bench_ctranslate2" and importlib.util.find_spec("ctranslate2") is None:
        pytest.skip("ctranslate2 (the benchmark-only 'bench' extra) is not installed")
    # under the test's 300-s limit, so that a hang shows the script's own stacks
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    result = run_bounded([sys.executable, "-m", f"benchmarks.{script}", "--quick"], cwd=ROOT,
                         timeout=270, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "|" in result.stdout  # printed a table
    # and the CPU it ran on, model name and vector extensions (benchmarks/_harness.cpu_line)
    header = result.stdout.split("|", 1)[0]
    assert any(line.startswith("cpu: ") and "(" in line for line in header.splitlines()), \
        header[-2000:]
