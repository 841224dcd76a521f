"""``qkv.ops.fast_linear`` (oneDNN) vs ``F.linear`` (MKL), fp32 CPU: without gradients, and
forward + backward with a trained and with a frozen weight.

Shapes: M rows, K input width, N output width. The cases are the GEMMs qkv runs in eval:
a ViT-S layer at 64 px, batch 32 (M = 32·65 = 2080; q/k/v fused, output, FFN in and out)
and a GPT-2 small decode step at batch 1, 4 and 16 (fused q/k/v, FFN, LM head N = 50257).
The contenders alternate (the order flips every round) and the table gives medians and the
ratio F.linear / fast_linear (> 1: oneDNN faster). Both results are compared first. The
gradient cases time ``y = f(x, w, b); y.backward(g)`` for a ViT-S / GPT-2 training batch
(M = 2048-2080) with w trained (a full training step) or frozen (LoRA: the base weights).

Usage: python -m benchmarks.bench_fast_linear [--quick] [--repeats 15] [--threads 1]
"""

from __future__ import annotations

import argparse
import shlex
import sys

import torch
import torch.nn.functional as F

from benchmarks._harness import print_cpu, print_table, side_by_side
from qkv.ops.fast_linear import fast_linear, onednn_linear_active

CASES = [  # (name, M, K, N)
    ("ViT-S qkv", 2080, 384, 1152), ("ViT-S out", 2080, 384, 384),
    ("ViT-S ffn in", 2080, 384, 1536), ("ViT-S ffn out", 2080, 1536, 384),
    ("GPT-2 qkv M=16", 16, 768, 2304), ("GPT-2 ffn in M=16", 16, 768, 3072),
    ("GPT-2 ffn out M=16", 16, 3072, 768),
    ("GPT-2 head M=1", 1, 768, 50257), ("GPT-2 head M=4", 4, 768, 50257),
    ("GPT-2 head M=16", 16, 768, 50257),
]

GRAD_CASES = [  # (name, M, K, N, weight trained)
    ("ViT-S qkv", 2080, 384, 1152, True), ("ViT-S ffn out", 2080, 1536, 384, True),
    ("GPT qkv (LoRA base)", 2048, 384, 1152, False),
    ("GPT ffn in (LoRA base)", 2048, 384, 1536, False),
    ("GPT ffn out (LoRA base)", 2048, 1536, 384, False),
]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes, few rounds (tests)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    cases = CASES
    if args.quick:
        cases = [("small", 64, 32, 48), ("one row", 1, 32, 48)]
        args.repeats = 3
    torch.set_num_threads(args.threads)
    print("command: python -m benchmarks.bench_fast_linear "
          + shlex.join(sys.argv[1:] if argv is None else argv))
    print_cpu()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"oneDNN linear active: {onednn_linear_active()}")
    rows = []
    g = torch.Generator().manual_seed(0)
    for name, m, k, n in cases:
        x = torch.randn(m, k, generator=g)
        w = torch.randn(n, k, generator=g) / k ** 0.5
        b = torch.randn(n, generator=g)
        with torch.inference_mode():
            want = F.linear(x, w, b)
            diff = (fast_linear(x, w, b) - want).abs().max().item()
            t = side_by_side({"F.linear": lambda x=x, w=w, b=b: F.linear(x, w, b),
                              "fast_linear":
                                  lambda x=x, w=w, b=b: fast_linear(x, w, b)},
                             1, args.repeats if n < 10000 else max(3, args.repeats // 3))
        rows.append([name, f"{m}x{k}x{n}", f"{t['F.linear'] * 1e3:.3f}",
                     f"{t['fast_linear'] * 1e3:.3f}",
                     f"{t['F.linear'] / t['fast_linear']:.2f}x", f"{diff:.1e}"])
    print_table("no-grad linear, fp32 CPU (medians)",
                ["case", "M x K x N", "F.linear (ms)", "fast_linear (ms)", "speed-up",
                 "max |diff|"], rows)
    grad_cases = GRAD_CASES if not args.quick else [("small", 64, 512, 512, True)]
    rows = []
    for name, m, k, n, trained in grad_cases:
        x = torch.randn(m, k, generator=g).requires_grad_()
        w = (torch.randn(n, k, generator=g) / k ** 0.5).requires_grad_(trained)
        b = torch.randn(n, generator=g).requires_grad_(trained)
        up = torch.randn(m, n, generator=g)

        def run(f, x=x, w=w, b=b, up=up):
            x.grad = w.grad = b.grad = None
            f(x, w, b).backward(up)
            return x.grad.clone()

        diff = (run(fast_linear) - run(F.linear)).abs().max().item()
        t = side_by_side({"F.linear": lambda run=run: run(F.linear),
                          "fast_linear": lambda run=run: run(fast_linear)}, 1, args.repeats)
        rows.append([name, "trained" if trained else "frozen", f"{m}x{k}x{n}",
                     f"{t['F.linear'] * 1e3:.2f}", f"{t['fast_linear'] * 1e3:.2f}",
                     f"{t['F.linear'] / t['fast_linear']:.2f}x", f"{diff:.1e}"])
    print_table("forward + backward, fp32 CPU (medians; max |diff| of the input gradient)",
                ["case", "weight", "M x K x N", "F.linear (ms)", "fast_linear (ms)",
                 "speed-up", "max |diff|"], rows)


if __name__ == "__main__":
    main()
