"""Attention methods side by side: time and peak memory against sequence length
(``qkv bench attention``).

Shapes: B batch (1), H heads (8), N = S sequence length (self-attention), D head dim (64),
W window. Inputs fp32 on CPU; each call is a forward under ``torch.inference_mode``.

Methods (``METHODS``):
- ``dense``: torch SDPA with ``is_causal=True`` (the flash kernel: O(N²) time, O(N) memory);
- ``alibi``: ``qkv.attention(causal=True, bias=ALiBi(H), backend="chunked")`` (a relative
  bias computed per block);
- ``window``: ``qkv.attention(mask=SlidingWindow(W, causal=True))`` (only the band);
- ``bigbird``: ``qkv.attention(mask=BigBird(64, causal=True))`` (local + global + 3 random
  blocks; only live blocks);
- ``linear``: ``qkv.linear_attention(causal=True)`` (elu features, chunkwise; O(N)).

Time is the median of ``repeat`` calls after one warm-up call; peak memory is the peak
resident memory during the warm-up call above the resident memory before it (inputs
allocated), with the high-water mark reset first (Linux ``/proc/self/clear_refs``; elsewhere
the growth of ``ru_maxrss``, which an earlier, larger peak can hide). With ``isolate`` each
(method, N) runs in a fresh ``python -m qkv.bench`` process, so that memory freed by an
earlier case and kept by the allocator cannot hide a later case's growth.

A case that fails (out of memory, a crashed or timed-out subprocess, Ctrl-C) becomes a
``Measurement`` with ``error`` set; the cases measured before and after it are kept, and the
table lists it with the reason. ``min_bytes`` is what a case allocates at the least (its
inputs and output), for refusing up front a length this machine cannot hold.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = ["DEFAULT_LENGTHS", "METHODS", "QUICK_LENGTHS", "Measurement", "fit_exponent",
           "format_table", "make_call", "measure", "measure_isolated", "min_bytes",
           "peak_growth_mib", "plot", "run"]

#: the shape of every case but N: B, H, D (fp32)
SHAPE = {"batch": 1, "heads": 8, "head_dim": 64}
#: method key -> label used in tables and plots
METHODS: dict[str, str] = {
    "dense": "dense causal SDPA",
    "alibi": "biased chunked (ALiBi)",
    "window": "sliding window",
    "bigbird": "BigBird (64, causal)",
    "linear": "causal linear (elu)",
}
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192, 16384)
QUICK_LENGTHS = (128, 256)


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One (method, N) case: median ``seconds`` per call and ``peak_mib`` above the inputs;
    a case that failed has ``error`` (why, one line) and NaN figures."""

    method: str
    n: int
    seconds: float
    peak_mib: float
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Whether the case was measured."""
        return self.error is None


def min_bytes(method: str, n: int) -> int:
    """Bytes one case of ``method`` at length ``n`` allocates at the least, whatever the
    method: q, k, v and the output, 4 × (B, H, N, D) fp32 (the methods' working memory
    comes on top)."""
    if method not in METHODS:
        raise ValueError(f"bench: unknown method {method!r}; known: {list(METHODS)}")
    return 4 * SHAPE["batch"] * SHAPE["heads"] * n * SHAPE["head_dim"] * 4


def make_call(method: str, n: int, *, batch: int = 1, heads: int = 8, head_dim: int = 64,
              window: int = 512, seed: int = 0) -> Callable[[], torch.Tensor]:
    """A zero-argument call running ``method`` on fresh random q, k, v (B, H, N, D) fp32."""
    import qkv
    from qkv.masks import BigBird, SlidingWindow
    from qkv.positions import ALiBi

    if method not in METHODS:
        raise ValueError(f"bench: unknown method {method!r}; known: {list(METHODS)}")
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, n, head_dim, generator=gen) for _ in range(3))
    if method == "dense":
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if method == "alibi":
        bias = ALiBi(heads)
        return lambda: qkv.attention(q, k, v, causal=True, bias=bias, backend="chunked")
    if method == "window":
        mask = SlidingWindow(window, causal=True)
        return lambda: qkv.attention(q, k, v, mask=mask)
    if method == "bigbird":
        mask = BigBird(64, causal=True)
        return lambda: qkv.attention(q, k, v, mask=mask)
    return lambda: qkv.linear_attention(q, k, v, causal=True)


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise KeyError(key)


def peak_growth_mib(call: Callable[[], object]) -> float:
    """Peak resident memory during ``call()`` above the resident memory before it, MiB
    (never negative).

    On Linux the high-water mark is reset first (``/proc/self/clear_refs``), so that the
    peak of importing torch (larger than a small call's growth) does not hide it; elsewhere
    the growth of ru_maxrss (which that earlier peak can hide). Also used by benchmarks/."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current VmRSS
        before = _status_mib("VmRSS")
        call()
        return max(0.0, _status_mib("VmHWM") - before)
    except (OSError, KeyError):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        call()
        return max(0.0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before)


def measure(method: str, n: int, *, repeat: int = 3, window: int = 512,
            threads: int | None = None) -> Measurement:
    """Time and peak memory of one case in this process (see the module docstring);
    ``threads`` sets torch's intra-op threads first (None: leave them)."""
    if threads is not None:
        torch.set_num_threads(threads)
    call = make_call(method, n, window=window)

    def run_once() -> None:
        with torch.inference_mode():
            call()

    peak = peak_growth_mib(run_once)  # also the warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        run_once()
        times.append(time.perf_counter() - t0)
    return Measurement(method, n, statistics.median(times), peak)


def measure_isolated(method: str, n: int, *, repeat: int = 3, window: int = 512,
                     threads: int | None = None, timeout: float | None = None
                     ) -> Measurement:
    """``measure`` in a fresh ``python -m qkv.bench`` process."""
    cmd = [sys.executable, "-m", "qkv.bench", "--measure", method, "--n", str(n),
           "--repeat", str(repeat), "--window", str(window)]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:]
        if done.returncode < 0:  # e.g. SIGKILL from the kernel's out-of-memory killer
            tail = [f"killed by signal {-done.returncode}"
                    f"{' (out of memory?)' if done.returncode == -9 else ''}", *tail]
        raise RuntimeError(f"bench: {method} at N={n} failed in its subprocess: "
                           f"{(tail or ['(no output)'])[0]}")
    return Measurement(**json.loads(done.stdout.strip().splitlines()[-1]))


def run(lengths: Iterable[int], methods: Iterable[str] = tuple(METHODS), *, repeat: int = 3,
        window: int = 512, isolate: bool = True, threads: int | None = None,
        log: Callable[[str], None] | None = None) -> list[Measurement]:
    """Measure every (method, N): for each N in turn, every method (so that a machine's
    drift hits the methods at one N alike); ``log`` gets one line per case.

    A case that raises (out of memory, a failed subprocess) is recorded with its ``error``
    and the run goes on; Ctrl-C records the case it interrupted as "interrupted" and returns
    what was measured so far."""
    out = []
    fn = measure_isolated if isolate else measure
    for n in lengths:
        for method in methods:
            try:
                m = fn(method, n, repeat=repeat, window=window, threads=threads)
            except KeyboardInterrupt:
                out.append(_failed(method, n, "interrupted"))
                return out
            except Exception as exc:  # recorded in the table, not hidden
                m = _failed(method, n, str(exc).strip().splitlines()[0] if str(exc).strip()
                            else type(exc).__name__)
            out.append(m)
            if log is not None:
                log(f"{_label(m.method, window):<24} N={n:>6}: "
                    + (f"{m.seconds:.4f} s, {m.peak_mib:.0f} MiB" if m.ok
                       else f"failed: {m.error}"))
    return out


def _failed(method: str, n: int, why: str) -> Measurement:
    return Measurement(method, n, math.nan, math.nan, error=why)


def fit_exponent(ns: Sequence[int], seconds: Sequence[float]) -> float:
    """Least-squares slope of log(seconds) against log(N) (1 = linear, 2 = quadratic); nan
    with fewer than two points."""
    if len(ns) < 2:
        return float("nan")
    xs, ys = [math.log(n) for n in ns], [math.log(max(s, 1e-9)) for s in seconds]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den


def _label(method: str, window: int) -> str:
    return f"{METHODS[method]} {window}" if method == "window" else METHODS[method]


def format_table(results: Sequence[Measurement], *, window: int = 512) -> str:
    """Two markdown tables (seconds, peak MiB): one row per method, one column per N, plus
    the fitted time exponent and the speed-up over dense at the largest N (if measured);
    a failed case is a "failed" cell, and a third table gives each failure's reason."""
    failed = [m for m in results if not m.ok]
    lengths = sorted({m.n for m in results})
    methods = [k for k in METHODS if any(m.method == k for m in results)]
    cell = {(m.method, m.n): m for m in results if m.ok}
    gone = {(m.method, m.n) for m in failed}
    if not lengths:
        return "(no cases)"
    top = lengths[-1]
    dense = cell.get(("dense", top))
    head = ["method", *(f"N={n}" for n in lengths)]
    lines = ["seconds per call (median):", "",
             "| " + " | ".join([*head, "time ~ N^k", f"vs dense at N={top}"]) + " |",
             "|" + "---|" * (len(head) + 2)]
    for k in methods:
        row = [cell.get((k, n)) for n in lengths]
        got = [(m.n, m.seconds) for m in row if m is not None]
        expo = fit_exponent([g[0] for g in got], [g[1] for g in got])
        speed = (f"{dense.seconds / cell[(k, top)].seconds:.2f}×"
                 if dense and (k, top) in cell else "–")
        lines.append("| " + " | ".join([_label(k, window),
                                        *(f"{m.seconds:.4f}" if m else
                                          "failed" if (k, n) in gone else "–"
                                          for m, n in zip(row, lengths, strict=True)),
                                        f"{expo:.2f}", speed]) + " |")
    lines += ["", "peak MiB above the inputs:", "", "| " + " | ".join(head) + " |",
              "|" + "---|" * len(head)]
    for k in methods:
        row = [cell.get((k, n)) for n in lengths]
        lines.append("| " + " | ".join([_label(k, window),
                                        *(f"{m.peak_mib:.0f}" if m else
                                          "failed" if (k, n) in gone else "–"
                                          for m, n in zip(row, lengths, strict=True))])
                     + " |")
    if failed:
        lines += ["", "failed cases:", "", "| method | N | why |", "|---|---|---|"]
        lines += [f"| {_label(m.method, window)} | {m.n} | {m.error} |" for m in failed]
    return "\n".join(lines)


def plot(results: Sequence[Measurement], path: str | Path, *, window: int = 512,
         title: str | None = None) -> Path:
    """A log-log PNG: time (left) and peak memory (right) against N, one line per method.
    Written atomically (temp + rename); returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .files import atomic_write

    path = Path(path)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.5))
    for k in METHODS:
        pts = sorted((m.n, m.seconds, m.peak_mib) for m in results if m.method == k and m.ok)
        if not pts:
            continue
        ns = [p[0] for p in pts]
        ax_t.plot(ns, [p[1] for p in pts], marker="o", label=_label(k, window))
        ax_m.plot(ns, [max(p[2], 0.1) for p in pts], marker="o", label=_label(k, window))
    for ax, ylabel in ((ax_t, "seconds per call"),
                       (ax_m, "peak MiB above the inputs (0 drawn at 0.1)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=8)
    fig.suptitle(title or "qkv bench attention: B=1 H=8 D=64 fp32, causal, forward")
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)
    return path


def _main(argv: list[str] | None = None) -> None:
    """Worker entry of ``measure_isolated``: print one case as a JSON line."""
    p = argparse.ArgumentParser(prog="python -m qkv.bench")
    p.add_argument("--measure", required=True, choices=list(METHODS))
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    m = measure(a.measure, a.n, repeat=a.repeat, window=a.window, threads=a.threads)
    print(json.dumps(dataclasses.asdict(m)))


if __name__ == "__main__":
    _main()
