"""Shared timing and peak-memory helpers for the benchmark scripts (not a public API).

Times are the median of ``repeat`` runs after one warm-up. Peak memory is measured in a fresh
subprocess as the peak resident memory during the call above the resident memory before it
(inputs allocated), with the high-water mark reset first (``peak_growth_mib``); in ``--quick``
mode only a script's first case gets a subprocess of its own (``case_runner``).

Every script prints ``cpu_line()`` in its header: the CPU's model name and vector extensions
(machines differ between runs, and a figure means little without them).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from qkv.bench import peak_growth_mib  # noqa: F401  (re-exported: one implementation, shared with `qkv bench`)
from qkv.train.precision import cpu_description


def cpu_line() -> str:
    """The header line naming the CPU a benchmark ran on, e.g. "cpu: Intel(R) Xeon(R)
    Processor (x86_64; amx_bf16 ... avx512_bf16 ... fma)"."""
    return f"cpu: {cpu_description()}"


def print_cpu() -> None:
    """Print ``cpu_line()`` (every benchmark's header has it)."""
    print(cpu_line())


def add_gpt_size_args(p, *, repeats: int, warmup: int) -> None:
    """The GPT training benchmarks' shared flags: ``--quick``, the model and batch sizes
    (B=8 T=256 C=384 L=6 H=6 V=8192), ``--repeats`` and ``--warmup``."""
    p.add_argument("--quick", action="store_true", help="tiny sizes, one timed step")
    for name, default in (("batch", 8), ("seq", 256), ("dim", 384), ("layers", 6),
                          ("heads", 6), ("vocab", 8192)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--warmup", type=int, default=warmup)


def median_time(fn: Callable[[], object], repeat: int = 3, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
"""``--clock`` choices: wall time, or this process's CPU time (all its threads together; on a
machine shared with other jobs, a 1-thread run's CPU time measures its own work, not the
time spent waiting for a core)."""


def alternate_times(fns: dict[str, Callable[[], object]], warmup: int, repeats: int,
                    clock: str = "wall") -> dict[str, list[float]]:
    """Seconds (by ``CLOCKS[clock]``) of every timed call of each function, timed alternately
    in one loop (the order flips every repeat), so that a machine's drift hits every
    contender alike; ``warmup`` untimed rounds first."""
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {clock!r}")
    now = CLOCKS[clock]
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = now()
            fns[name]()
            times[name].append(now() - t0)
    return times


def side_by_side(fns: dict[str, Callable[[], object]], warmup: int, repeats: int,
                 clock: str = "wall") -> dict[str, float]:
    """Median seconds per call of each function (``alternate_times``)."""
    return {name: statistics.median(ts)
            for name, ts in alternate_times(fns, warmup, repeats, clock).items()}


def load_average() -> str:
    """The 1/5/15-minute load averages, e.g. "1.02, 0.87, 0.60" (other processes skew wall
    times), or "unknown"."""
    try:
        return ", ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "unknown"


def rss_peak_mib() -> float:
    """This process's resident-set high-water mark in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_growth_in_subprocess(module: str, case: str, *args: str) -> dict:
    """Run ``python -m module --measure case args`` and parse the JSON line it prints."""
    cmd = [sys.executable, "-m", module, "--measure", case, *args]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def peak_growth_in_process(module: str, case: str, *args: str) -> dict:
    """What ``peak_growth_in_subprocess`` returns, from the same ``--measure`` run made here:
    ``module``'s ``main(["--measure", case, *args])`` in this process, its JSON line parsed.
    No interpreter start-up (about 3 CPU-seconds a case: most of a ``--quick`` run), but the
    peak is not the case's alone (memory an earlier case freed may be reused), so only
    ``--quick`` runs, whose tiny sizes make no figure worth keeping, use it."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        importlib.import_module(module).main(["--measure", case, *args])
    return json.loads(buf.getvalue().strip().splitlines()[-1])


def case_runner(quick: bool) -> Callable[..., dict]:
    """How a script with one subprocess per case measures its cases: always
    ``peak_growth_in_subprocess``, except in ``--quick`` mode, where only the first case asked
    for starts its own process (the path every full run takes, checked each time) and the
    rest run the same ``--measure`` code in this one (``peak_growth_in_process``)."""
    if not quick:
        return peak_growth_in_subprocess
    calls = []

    def run(module: str, case: str, *args: str) -> dict:
        calls.append(case)
        fn = peak_growth_in_subprocess if len(calls) == 1 else peak_growth_in_process
        return fn(module, case, *args)

    return run


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    """Print a markdown table."""
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
