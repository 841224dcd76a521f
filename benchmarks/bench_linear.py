"""Causal linear attention (elu, chunkwise) vs dense causal torch SDPA, and its scaling in N.

Usage: python -m benchmarks.bench_linear [--quick] [--n 16384] [--ns 4096,8192,...]
                                         [--chunk 64] [--repeats 3]

Shapes B=1, H=8, D=Dv=64, fp32, CPU, forward under inference_mode.
1. Side by side at N=--n in one process (alternating, median of --repeats): torch SDPA
   is_causal=True, qkv causal linear attention (elu), non-causal linear attention.
2. Causal linear attention at chunk sizes 64, 128, 256, side by side at N=--n.
3. Causal linear attention at each N of --ns, each in a fresh subprocess: time and peak
   memory (peak resident memory during the call above that before it, inputs allocated),
   with the exponent of a least-squares fit of log time against log N (1 = linear).
4. Causal linear attention forward + backward (autograd) at two N: time and peak memory
   (memory per position stays flat: nothing per-position of size D'·Dv is kept).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from benchmarks._harness import (
    median_time,
    peak_growth_in_subprocess,
    peak_growth_mib,
    print_cpu,
    print_table,
    side_by_side,
)
from qkv.bench import fit_exponent
from qkv.ops.linear import linear_attention

B, H, D = 1, 8, 64


def _inputs(n: int):
    torch.manual_seed(0)
    return tuple(torch.randn(B, H, n, D) for _ in range(3))  # (B, H, N, D) each


def _call(case: str, q, k, v, chunk: int):
    if case == "sdpa causal":
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if case == "linear causal":
        return lambda: linear_attention(q, k, v, causal=True, chunk_size=chunk)
    if case == "linear non-causal":
        return lambda: linear_attention(q, k, v, causal=False)
    raise ValueError(f"bench_linear: unknown case {case!r}")


def measure(case: str, n: int, chunk: int, repeat: int) -> dict:
    """Time and peak-memory growth of one case in this (fresh) process; a case ending in
    " train" runs forward + backward instead of a forward under inference_mode."""
    train = case.endswith(" train")
    q, k, v = _inputs(n)
    if train:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        fwd = _call(case.removesuffix(" train"), q, k, v, chunk)

        def call():
            fwd().sum().backward()
            for t in (q, k, v):
                t.grad = None

        peak = peak_growth_mib(call)  # also the warm-up
        seconds = median_time(call, repeat=repeat, warmup=0)
        return {"seconds": seconds, "peak_mib": peak}
    call = _call(case, q, k, v, chunk)
    with torch.inference_mode():
        peak = peak_growth_mib(call)  # also the warm-up
        seconds = median_time(call, repeat=repeat, warmup=0)
    return {"seconds": seconds, "peak_mib": peak}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat")
    parser.add_argument("--n", type=int, default=16384, help="N of the side-by-side tables")
    parser.add_argument("--ns", default="4096,8192,16384,32768,65536",
                        help="comma-separated N of the scaling table")
    parser.add_argument("--chunk", type=int, default=64, help="chunk size C (causal)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.ns, args.repeats = 512, "256,512,1024", 1
    if args.measure:
        print(json.dumps(measure(args.measure, args.n, args.chunk, args.repeats)))
        return
    print(f"command: python -m benchmarks.bench_linear {' '.join(sys.argv[1:])}")
    print_cpu()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, B={B} H={H} D=Dv={D} "
          f"fp32, forward under inference_mode, chunk C={args.chunk}")

    q, k, v = _inputs(args.n)
    cases = ("sdpa causal", "linear causal", "linear non-causal")
    with torch.inference_mode():
        secs = side_by_side({c: _call(c, q, k, v, args.chunk) for c in cases},
                            warmup=1, repeats=args.repeats)
    base = secs["sdpa causal"]
    calls = {"sdpa causal": "F.scaled_dot_product_attention(is_causal=True)",
             "linear causal": f"linear_attention(causal=True, chunk_size={args.chunk})",
             "linear non-causal": "linear_attention(causal=False)"}
    print_table(f"N={args.n}, side by side, median of {args.repeats}",
                ["case", "call", "seconds", "speed-up vs causal SDPA"],
                [[c, calls[c], f"{secs[c]:.3f}", f"{base / secs[c]:.1f}×"] for c in cases])

    chunks = (64, 128, 256)
    with torch.inference_mode():
        csecs = side_by_side({c: _call("linear causal", q, k, v, c) for c in chunks},
                             warmup=1, repeats=args.repeats)
    print_table(f"causal linear attention by chunk size, N={args.n}, side by side",
                ["chunk C", "seconds"], [[str(c), f"{csecs[c]:.3f}"] for c in chunks])
    del q, k, v

    ns = [int(x) for x in args.ns.split(",")]
    runs = [peak_growth_in_subprocess("benchmarks.bench_linear", "linear causal", "--n",
                                      str(n), "--chunk", str(args.chunk), "--repeats",
                                      str(args.repeats)) for n in ns]
    times = [r["seconds"] for r in runs]
    slope = fit_exponent(ns, times)
    rows = [[str(n), f"{r['seconds']:.3f}", f"{r['seconds'] / n * 1e6:.2f}",
             f"{r['peak_mib']:.0f}"] for n, r in zip(ns, runs, strict=True)]
    print_table(f"causal linear attention (elu, C={args.chunk}) vs N, fresh process per N; "
                f"fitted exponent of time vs N: {slope:.2f}",
                ["N", "seconds", "µs per position", "peak MiB"], rows)

    train_ns = [ns[0], ns[-1]]
    runs = [peak_growth_in_subprocess("benchmarks.bench_linear", "linear causal train", "--n",
                                      str(n), "--chunk", str(args.chunk), "--repeats",
                                      str(args.repeats)) for n in train_ns]
    rows = [[str(n), f"{r['seconds']:.3f}", f"{r['peak_mib']:.0f}",
             f"{r['peak_mib'] * 2 ** 20 / n / 1024:.1f}"] for n, r in zip(train_ns, runs,
                                                                         strict=True)]
    print_table(f"causal linear attention forward + backward (autograd), C={args.chunk}, fresh "
                f"process per N", ["N", "seconds", "peak MiB", "KiB per position"], rows)


if __name__ == "__main__":
    main()
