"""qkv.MultiHeadAttention vs torch.nn.MultiheadAttention, side by side in one run.

Shapes: B batch, N sequence length, C model width, H heads.

Both modules hold the same weights (``MultiHeadAttention.from_torch``). Two cases:
- eval forward: eval mode, ``torch.inference_mode()``, torch with ``batch_first=True`` and
  ``need_weights=False`` (torch's fused "fast path");
- forward+backward: training mode (dropout 0), gradient of a fixed random cotangent.
Each repeat times torch and qkv back to back (alternating which goes first), so drift in the
machine's speed hits both; the table shows medians and the ratio torch / qkv (> 1: qkv is
faster).

Usage: python -m benchmarks.bench_mha [--quick] [--batch 8 --seq 512 --dim 512 --heads 8]
(``--quick``: tiny sizes, one repeat; the test suite runs it so that the script never rots.)
"""

from __future__ import annotations

import argparse
import shlex
import sys

import torch
from torch import Tensor, nn

from benchmarks._harness import print_cpu, print_table, side_by_side
from qkv.modules import MultiHeadAttention


def run(batch: int, seq: int, dim: int, heads: int, warmup: int, repeats: int,
        dtype: torch.dtype) -> list[tuple[str, float, float]]:
    """Rows ``(case, torch seconds, qkv seconds)``."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(dim, heads, batch_first=True, dtype=dtype)
    mha = MultiHeadAttention.from_torch(ref)
    x = torch.randn(batch, seq, dim, dtype=dtype)  # (B, N, C)

    ref.eval()
    mha.eval()
    with torch.inference_mode():
        want = ref(x, x, x, need_weights=False)[0]
        got = mha(x)
        err = (want - got).abs().max().item()
        if err > 1e-3:
            raise SystemExit(f"bench_mha: outputs differ by {err:.3g}; not timing")
        eval_times = side_by_side({
            "torch": lambda: ref(x, x, x, need_weights=False),
            "qkv": lambda: mha(x),
        }, warmup, repeats)

    ref.train()
    mha.train()
    xg = x.clone().requires_grad_(True)
    grad = torch.randn_like(x)  # (B, N, C)

    def torch_step() -> None:
        out: Tensor = ref(xg, xg, xg, need_weights=False)[0]
        out.backward(grad)

    def qkv_step() -> None:
        mha(xg).backward(grad)

    train_times = side_by_side({"torch": torch_step, "qkv": qkv_step}, warmup, repeats)
    return [("eval forward (inference_mode)", eval_times["torch"], eval_times["qkv"]),
            ("forward+backward (train)", train_times["torch"], train_times["qkv"])]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="B")
    parser.add_argument("--seq", type=int, default=512, help="N")
    parser.add_argument("--dim", type=int, default=512, help="C")
    parser.add_argument("--heads", type=int, default=8, help="H")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes and one repeat: checks the script runs, times nothing")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.seq, args.dim, args.heads, args.warmup, args.repeats = 2, 16, 32, 4, 1, 1
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    print("command:", shlex.join([sys.executable, "-m", "benchmarks.bench_mha", *argv]))
    print_cpu()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; B={args.batch} "
          f"N={args.seq} C={args.dim} H={args.heads} {args.dtype}; median of {args.repeats} "
          f"(after {args.warmup} warm-up)")
    rows = run(args.batch, args.seq, args.dim, args.heads, args.warmup, args.repeats, dtype)
    table = [[case, f"{t_torch * 1e3:.2f}", f"{t_qkv * 1e3:.2f}", f"{t_torch / t_qkv:.2f}x"]
             for case, t_torch, t_qkv in rows]
    print_table("qkv.MultiHeadAttention vs torch.nn.MultiheadAttention",
                ["case", "torch MHA (ms)", "qkv MHA (ms)", "torch / qkv"], table)


if __name__ == "__main__":
    main()
