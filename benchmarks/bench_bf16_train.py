"""GPT training step on the CPU: bf16 compute (``--precision bf16``) vs fp32, side by side.

Shapes: B batch, T sequence length, C width, L layers, H heads, V vocab.

One training step = forward + next-token cross-entropy + backward + AdamW step, as ``qkv
train`` runs it (the gpt kind's objective: logits, then ``token_cross_entropy`` in fp32): the
bf16 step computes under ``torch.autocast(cpu, bfloat16)`` (``qkv.train.sharding.autocast``)
with fp32 master weights, gradients and AdamW state; the fp32 step is plain fp32. Both models
start from the same weights (the first losses are printed to show they compute the same
thing, bf16 within its rounding). Steps alternate (which goes first flips each round) after
warm-up; the table shows median seconds per step, tokens/s (B·T / step time) and the speed of
each against fp32. The header names the CPU (model name and
vector extensions) and what ``qkv train`` decides on it: the probe behind that decision
(``qkv.train.precision``, a 512² matmul in bf16 and fp32) is printed too.

Usage: python -m benchmarks.bench_bf16_train [--quick] [--batch 8 --seq 256 --dim 384
       --layers 6 --heads 6 --vocab 8192 --repeats 7 --warmup 2 --threads 0 --clock wall]
(``--quick``: tiny sizes and one timed step, so the test suite can run it.)
"""

from __future__ import annotations

import argparse
import copy
import shlex
import statistics
import sys
import warnings
from collections.abc import Callable

import torch

from benchmarks._harness import (
    CLOCKS,
    add_gpt_size_args,
    alternate_times,
    load_average,
    print_cpu,
    print_table,
)
from qkv.models.gpt import GPT, GPTConfig
from qkv.train.kinds import get_kind
from qkv.train.precision import cpu_bf16
from qkv.train.sharding import autocast


def build(args: argparse.Namespace) -> GPT:
    """A GPT with random weights (seed 0), dropout off."""
    config = GPTConfig.from_name("gpt-tiny", vocab_size=args.vocab, max_len=args.seq,
                                 dim=args.dim, num_heads=args.heads, ffn_hidden=4 * args.dim,
                                 num_layers=args.layers, dropout=0.0)
    torch.manual_seed(0)
    return GPT(config).train()


def step_fn(model: GPT, ids: torch.Tensor, precision: str) -> Callable[[], float]:
    """One training step of ``model`` in ``precision`` (its own AdamW); returns the loss."""
    targets = ids.roll(-1, dims=1)
    targets[:, -1] = -100
    batch, kind = {"ids": ids, "targets": targets}, get_kind("gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> float:
        with warnings.catch_warnings():  # measured on any CPU: forced where not native
            warnings.simplefilter("ignore", UserWarning)
            context = autocast(precision, "cpu", force=True)
        with context:
            loss_sum, count = kind.loss(model, batch)
            loss = loss_sum / count
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gpt_size_args(p, repeats=7, warmup=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall time (default) or this process's CPU time")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.seq, args.dim, args.layers, args.heads, args.vocab = 2, 32, 64, 2, 4, 128
        args.repeats, args.warmup = 1, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    print("command: python -m benchmarks.bench_bf16_train "
          + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)))
    print_cpu()
    support = cpu_bf16()
    verdict = ("trains in bf16" if support.native
               else "refuses bf16 unless --force-precision")
    print(f"bf16 probe: {support}; qkv train {verdict} on this CPU")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU; "
          f"B={args.batch} T={args.seq} C={args.dim} L={args.layers} H={args.heads} "
          f"V={args.vocab}; {args.clock} clock; load average at start {load_average()}")

    fp32_model = build(args)
    bf16_model = copy.deepcopy(fp32_model)
    torch.manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    fns = {"fp32": step_fn(fp32_model, ids, "fp32"), "bf16 (autocast, fp32 master)":
           step_fn(bf16_model, ids, "bf16")}
    first = {name: fn() for name, fn in fns.items()}  # same weights: close first losses
    print("first-step losses: " + ", ".join(f"{k} {v:.6f}" for k, v in first.items()))
    assert all(p.dtype == torch.float32 for p in bf16_model.parameters())  # master weights

    times = alternate_times(fns, args.warmup, args.repeats, args.clock)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    tokens = args.batch * args.seq
    rows = [[name, f"{t * 1e3:.1f}", f"{min(times[name]) * 1e3:.1f}", f"{tokens / t:.0f}",
             f"{medians['fp32'] / t:.2f}x"] for name, t in medians.items()]
    print_table(f"GPT training step (fwd+bwd+AdamW) on the CPU, bf16 vs fp32, median of "
                f"{args.repeats} alternating rounds",
                ["precision", "ms/step median", "ms/step best", "tokens/s", "speed vs fp32"],
                rows)
    bf16 = next(name for name in medians if name.startswith("bf16"))
    print(f"\nbf16 / fp32 training speed: {medians['fp32'] / medians[bf16]:.2f}x "
          f"(load average at end {load_average()})")


if __name__ == "__main__":
    main()
