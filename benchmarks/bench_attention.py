"""qkv.attention vs torch SDPA: plain causal, and relative-position causal attention.

Usage: python -m benchmarks.bench_attention [--quick] [--n 16384] [--rounds 3] [--no-train]

Shapes B=1, H=8, N=S=16384, D=64, fp32, CPU. Every case runs in its own subprocess so that
its peak memory (growth of the resident-set high-water mark during the call, inputs already
allocated) is its own. The cases run in turn, ``--rounds`` times (a shared machine drifts);
each figure is the median over rounds, and ratios are against plain causal torch SDPA.
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
    "sdpa causal (torch)": "torch SDPA, is_causal=True",
    "qkv causal": "qkv.attention(causal=True)",
    "qkv ALiBi": "qkv.attention(causal=True, bias=ALiBi(8))",
    "qkv T5 buckets": "qkv.attention(causal=True, bias=T5Bias(8, bidirectional=False))",
    "qkv Shaw k=16": "qkv.attention(causal=True, bias=ShawRelative(64, max_distance=16))",
}


def _make_call(case: str, q, k, v):
    import qkv
    from qkv.positions import ALiBi, ShawRelative, T5Bias

    if case == "sdpa causal (torch)":
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    bias = {"qkv causal": None, "qkv ALiBi": ALiBi(8),
            "qkv T5 buckets": T5Bias(8, bidirectional=False),
            "qkv Shaw k=16": ShawRelative(64, max_distance=16)}[case]
    return lambda: qkv.attention(q, k, v, causal=True, bias=bias)


def measure(case: str, n: int, repeat: int, train: bool) -> dict:
    """Time and peak memory of one case in this process."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, n, 64, requires_grad=train) for _ in range(3))
    call = _make_call(case, q, k, v)

    def step():
        if train:
            call().sum().backward()
            for t in (q, k, v):
                t.grad = None
        else:
            with torch.inference_mode():
                call()

    peak = peak_growth_mib(step)  # warm-up, and the call whose peak we record
    return {"seconds": median_time(step, repeat=repeat, warmup=0), "peak_mib": peak}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat")
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=3, help="times each case is run")
    parser.add_argument("--repeat", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--no-train", action="store_true", help="skip forward+backward")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--train", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.rounds = 256, 1
    if args.measure:
        print(json.dumps(measure(args.measure, args.n, args.repeat, args.train)))
        return
    print(f"command: python -m benchmarks.bench_attention {' '.join(sys.argv[1:])}")
    print_cpu()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, B=1 H=8 N=S={args.n} "
          f"D=64 fp32")
    if args.quick:
        print("--quick: the first case runs in a subprocess of its own, the others in this "
              "process (their peak MiB is not isolated)")
    modes = [("forward (inference_mode)", False)]
    if not args.no_train:
        modes.append(("forward + backward", True))
    run_case = case_runner(args.quick)
    for title, train in modes:
        runs: dict[str, list[dict]] = {case: [] for case in CASES}
        for _ in range(args.rounds):
            for case in CASES:
                extra = ["--n", str(args.n), "--repeat", "1"]
                runs[case].append(run_case(
                    "benchmarks.bench_attention", case, *extra, *(["--train"] if train else [])))
        secs = {c: statistics.median(r["seconds"] for r in rs) for c, rs in runs.items()}
        base = secs["sdpa causal (torch)"]
        rows = [[case, CASES[case], f"{secs[case]:.3f}", f"{secs[case] / base:.2f}×",
                 f"{max(r['peak_mib'] for r in runs[case]):.0f}"] for case in CASES]
        print_table(f"{title}, N={args.n}, median of {args.rounds} rounds",
                    ["case", "call", "seconds", "vs causal SDPA", "peak MiB"], rows)


if __name__ == "__main__":
    main()
