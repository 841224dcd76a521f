"""Sparse attention vs dense causal torch SDPA: sliding window and BigBird.

Usage: python -m benchmarks.bench_sparse [--quick] [--n 16384] [--rounds 3]

B=1, H=8, N=S=16384, D=64, fp32, CPU, forward (inference_mode) and forward+backward. Each
case runs in its own subprocess (peak MiB = growth of the resident-set high-water mark
during the call, inputs allocated); the cases run in turn ``--rounds`` times and each figure
is the median. "live" is the fraction of the N×S (query, key) pairs the pattern allows.
``--quick`` (tiny sizes, for the test suite): only the first case starts a subprocess, the
others run the same ``--measure`` code in this process (``_harness.case_runner``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

from benchmarks._harness import (
    case_runner,
    median_time,
    peak_growth_mib,
    print_cpu,
    print_table,
)

CASES = {
    "dense causal SDPA (torch)": None,
    "SlidingWindow(512, causal)": ("window", 512),
    "BigBird(64, causal, random 0)": ("bigbird", 0),
    "BigBird(64, causal, random 3)": ("bigbird", 3),
    "BigBird(64, causal, random 8)": ("bigbird", 8),
}


def _mask(case: str):
    from qkv.masks import BigBird, SlidingWindow

    kind, arg = CASES[case]
    if kind == "window":
        return SlidingWindow(arg, causal=True)
    return BigBird(64, random_blocks=arg, causal=True)


def live_fraction(case: str, n: int) -> float:
    """Fraction of the N×N pairs the case computes (dense causal: the lower triangle)."""
    if CASES[case] is None:
        return (n + 1) / (2 * n)
    mask = _mask(case)
    total = 0
    for i0 in range(0, n, 1024):  # count block by block, never an N×N tensor
        blk = mask.block(i0, min(n, i0 + 1024), 0, n, n, n, torch.device("cpu"))
        total += (min(n, i0 + 1024) - i0) * n if blk is True else int(blk is not False
                                                                      and blk.sum())
    return total / (n * n)


def measure(case: str, n: int, train: bool) -> dict:
    import qkv

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, n, 64, requires_grad=train) for _ in range(3))
    if CASES[case] is None:
        call = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        mask = _mask(case)
        call = lambda: qkv.attention(q, k, v, mask=mask)

    def step():
        if train:
            call().sum().backward()
        else:
            with torch.inference_mode():
                call()

    peak = peak_growth_mib(step)
    return {"seconds": median_time(step, repeat=1, warmup=0), "peak_mib": peak}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round")
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--train", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.rounds = 512, 1
    if args.measure:
        print(json.dumps(measure(args.measure, args.n, args.train)))
        return
    print(f"command: python -m benchmarks.bench_sparse {' '.join(sys.argv[1:])}")
    print_cpu()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, B=1 H=8 N=S={args.n} "
          f"D=64 fp32")
    if args.quick:
        print("--quick: the first case runs in a subprocess of its own, the others in this "
              "process (their peak MiB is not isolated)")
    live = {case: live_fraction(case, args.n) for case in CASES}
    run_case = case_runner(args.quick)
    for title, train in (("forward (inference_mode)", False), ("forward + backward", True)):
        runs: dict[str, list[dict]] = {case: [] for case in CASES}
        for _ in range(args.rounds):
            for case in CASES:
                runs[case].append(run_case(
                    "benchmarks.bench_sparse", case, "--n", str(args.n),
                    *(["--train"] if train else [])))
        secs = {c: statistics.median(r["seconds"] for r in rs) for c, rs in runs.items()}
        base = secs["dense causal SDPA (torch)"]
        rows = [[case, f"{live[case]:.4f}", f"{secs[case]:.3f}", f"{base / secs[case]:.2f}×",
                 f"{secs[case] / base / (live[case] / live['dense causal SDPA (torch)']):.2f}",
                 f"{max(r['peak_mib'] for r in runs[case]):.0f}"] for case in CASES]
        print_table(f"{title}, N={args.n}, median of {args.rounds} rounds",
                    ["case", "live pairs", "seconds", "speed-up vs dense causal",
                     "time share / live share", "peak MiB"], rows)


if __name__ == "__main__":
    main()
