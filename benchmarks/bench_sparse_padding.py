"""Block-sparse & Padding: the fused flash path vs the explicit tiles, in one process.

Usage: python -m benchmarks.bench_sparse_padding [--quick] [--n 16384] [--repeats 3]

BigBird(64, causal=True, random_blocks=3) & Padding(lengths=[N, 0.73·N]), B=2, H=8, N=S,
D=64, fp32, CPU: forward (inference_mode) and forward+backward through
``qkv.ops.chunked.chunked_attention``: default dispatch (fused) against block_q=block_k=64
(the explicit tiles such a mask ran on before). Timed alternately (``side_by_side``), one
warm-up call each; each figure is the median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks._harness import print_cpu, print_table, side_by_side


def main(argv: list[str] | None = None) -> None:
    from qkv.masks import BigBird, Padding
    from qkv.ops.chunked import chunked_attention

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat")
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.repeats = 512, 1
    n = args.n
    lengths = [n, round(n * 0.7324)]  # 16384 -> 12000
    mask = BigBird(64, causal=True, random_blocks=3) & Padding(torch.tensor(lengths))
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, n, 64) for _ in range(3))
    k[1, :, lengths[1]:] = 0.0  # what qkv.attention hands the backends
    v[1, :, lengths[1]:] = 0.0
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    scale = 64 ** -0.5

    def run(train: bool, tiles: bool):
        blocks = {"block_q": 64, "block_k": 64} if tiles else {}

        def step():
            if train:
                chunked_attention(q, k, v, mask=mask, scale=scale, **blocks)[0].sum().backward()
            else:
                with torch.inference_mode():
                    chunked_attention(q, k, v, mask=mask, scale=scale, **blocks)
        return step

    print(f"command: python -m benchmarks.bench_sparse_padding {' '.join(sys.argv[1:])}")
    print_cpu()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, B=2 H=8 N=S={n} "
          f"D=64 fp32, lengths {lengths}")
    rows = []
    for title, train in (("forward (inference_mode)", False), ("forward + backward", True)):
        secs = side_by_side({"tiles": run(train, True), "fused": run(train, False)},
                            warmup=1, repeats=args.repeats)
        rows.append([title, f"{secs['tiles']:.3f}", f"{secs['fused']:.3f}",
                     f"{secs['tiles'] / secs['fused']:.2f}×"])
    print_table(f"BigBird(64, causal, random 3) & Padding, N={n}, median of {args.repeats}",
                ["pass", "explicit tiles s", "fused s", "speed-up"], rows)


if __name__ == "__main__":
    main()
