"""LoRA fine-tuning: qkv.peft (LoRA on q, k, v of the fused projection) vs HF PEFT (LoRA on
GPT-2's ``c_attn``), side by side, on the same HF GPT-2 weights; memory vs full fine-tuning;
merged / unmerged inference vs the base model.

Shapes: B batch, T sequence length, C width, L layers, H heads, V vocab, r rank.

1. Training step = forward + next-token cross-entropy + backward + AdamW step on the
   trainable parameters, fp32 CPU. Contenders: HF ``GPT2LMHeadModel`` (sdpa) + PEFT LoRA on
   ``c_attn`` (r, ``fan_in_fan_out``); qkv ``GPT`` + ``add_lora`` on ("q", "k", "v") (three
   rank-r updates); qkv with ("qkv",) (PEFT's exact parameter count); qkv full fine-tuning.
   Steps alternate between contenders (the order flips each round) after warm-up; medians.
2. Peak memory of the first training step (which allocates the gradients and AdamW's state),
   each case in a fresh subprocess (peak resident growth), and AdamW state bytes.
3. Inference forward (eval, no grad): the base model, LoRA merged (``merge``: the wrappers step
   aside, so it runs the base model's code) and unmerged (q, k, v, B != 0), side by side,
   3 x repeats rounds.

Usage: python -m benchmarks.bench_lora [--quick] [--batch 8 --seq 256 --dim 384 --layers 6
       --heads 6 --vocab 8192 --rank 8 --repeats 5 --warmup 1 --threads 1 --clock wall|cpu]
(``--quick``: tiny sizes and one timed run, so the test suite can run it. ``--clock cpu``:
this process's CPU time (``time.process_time``) instead of wall time — on a machine shared
with other work, a 1-thread process's CPU time counts its own work only.)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import sys
from collections.abc import Callable

import torch

from benchmarks._harness import (
    add_gpt_size_args,
    load_average,
    peak_growth_in_subprocess,
    peak_growth_mib,
    print_cpu,
    print_table,
    side_by_side,
)
from qkv.models.gpt import GPT, GPTConfig
from qkv.models.hf_gpt2 import config_from_hf, convert_hf_state_dict
from qkv.peft import LoraConfig, add_lora, count_parameters, merge

CASES = ("hf-peft-lora", "qkv-lora-q,k,v", "qkv-lora-qkv", "qkv-full")


def hf_model(args):
    """HF GPT2LMHeadModel (sdpa) with seeded random weights, train mode."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=args.dim, n_layer=args.layers, n_head=args.heads,
                     n_positions=args.seq, vocab_size=args.vocab, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).train()


def qkv_model(hf) -> GPT:
    """A qkv GPT holding the HF model's weights."""
    config = config_from_hf(hf.config.to_dict())
    model = GPT(config).train()
    model.load_state_dict(convert_hf_state_dict(hf.state_dict(), config), strict=True)
    return model


def build(case: str, args, *, hf_weights: bool = True
          ) -> tuple[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    """(model, loss_fn(ids)) for one contender; trainable parameters set. Without
    ``hf_weights`` a qkv contender gets its own seeded weights (no transformers import: the
    memory subprocesses)."""
    if case == "hf-peft-lora":
        import peft

        model = peft.get_peft_model(hf_model(args), peft.LoraConfig(
            r=args.rank, lora_alpha=2 * args.rank, target_modules=["c_attn"],
            fan_in_fan_out=True, lora_dropout=0.0)).train()
        return model, lambda ids: model(input_ids=ids, labels=ids).loss
    if hf_weights:
        model = qkv_model(hf_model(args))
    else:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=args.vocab, max_len=args.seq, dim=args.dim,
                              num_layers=args.layers, num_heads=args.heads)).train()
    if case != "qkv-full":
        targets = ("q", "k", "v") if case == "qkv-lora-q,k,v" else ("qkv",)
        add_lora(model, LoraConfig(r=args.rank, alpha=2 * args.rank, targets=targets))

    def loss(ids: torch.Tensor) -> torch.Tensor:
        targets = ids.roll(-1, dims=1)
        targets[:, -1] = -100  # as HF's shifted labels: the last position predicts nothing
        return model.loss(ids, targets)

    return model, loss


def step_fn(model, loss_fn, ids) -> tuple[Callable[[], float], torch.optim.Optimizer]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def step() -> float:
        loss = loss_fn(ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    return step, opt


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))


def measure(case: str, args) -> dict:
    """In this (fresh) process: peak resident growth of the first training step."""
    model, loss_fn = build(case, args, hf_weights=False)
    torch.manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    step, opt = step_fn(model, loss_fn, ids)
    peak = peak_growth_mib(step)
    return {"peak_mib": peak, "opt_bytes": optimizer_state_bytes(opt),
            "trainable": count_parameters(model)[0]}


def size_args(args) -> list[str]:
    return [f"--{k}={getattr(args, k)}" for k in ("batch", "seq", "dim", "layers", "heads",
                                                  "vocab", "rank", "threads")]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gpt_size_args(p, repeats=5, warmup=1)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time.perf_counter (wall) or time.process_time (this process's CPU)")
    p.add_argument("--measure", choices=CASES, help=argparse.SUPPRESS)  # subprocess case
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.seq, args.dim, args.layers, args.heads, args.vocab = 2, 32, 64, 2, 4, 128
        args.repeats, args.warmup = 1, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.measure:
        print(json.dumps(measure(args.measure, args)))
        return
    print("command: python -m benchmarks.bench_lora "
          + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)))
    print_cpu()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32 CPU; "
          f"B={args.batch} T={args.seq} C={args.dim} L={args.layers} H={args.heads} "
          f"V={args.vocab}, r={args.rank}, alpha={2 * args.rank}; {args.clock} clock; "
          f"load average {load_average()} (1, 5, 15 min; {os.cpu_count()} cores)")

    # 1. training step, side by side
    torch.manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    fns, counts = {}, {}
    for case in CASES:
        model, loss_fn = build(case, args)
        fns[case], _ = step_fn(model, loss_fn, ids)
        counts[case] = count_parameters(model)
    first = {name: fn() for name, fn in fns.items()}  # B = 0: every LoRA starts at the base
    print("first-step losses: " + ", ".join(f"{k} {v:.6f}" for k, v in first.items()))
    times = side_by_side(fns, args.warmup, args.repeats, args.clock)
    ref = times["hf-peft-lora"]
    tokens = args.batch * args.seq
    rows = [[name, f"{counts[name][0]:,}", f"{t * 1e3:.0f}", f"{tokens / t:.0f}",
             f"{ref / t:.2f}x"] for name, t in times.items()]
    print_table(f"LoRA training step (fwd+bwd+AdamW), median of {args.repeats}, "
                f"{args.clock} time",
                ["contender", "trainable params", "ms/step", "tokens/s", "speed vs HF PEFT"],
                rows)

    # 2. memory: first training step in fresh subprocesses
    mem = {case: peak_growth_in_subprocess("benchmarks.bench_lora", case, *size_args(args))
           for case in CASES}
    full = mem["qkv-full"]
    rows = [[name, f"{m['trainable']:,}", f"{m['peak_mib']:.0f}",
             f"{m['peak_mib'] / full['peak_mib']:.2f}" if full["peak_mib"] else "-",
             f"{m['opt_bytes'] / 2**20:.2f}",
             f"{m['opt_bytes'] / full['opt_bytes']:.4f}"] for name, m in mem.items()]
    print_table("First training step: peak resident growth and AdamW state (fresh process)",
                ["contender", "trainable params", "peak MiB", "vs full", "AdamW state MiB",
                 "vs full"], rows)

    # 3. inference: base vs merged vs unmerged
    hf = hf_model(args)
    base = qkv_model(hf).eval()
    unmerged = qkv_model(hf).eval()
    add_lora(unmerged, LoraConfig(r=args.rank, alpha=2 * args.rank, targets=("q", "k", "v")))
    with torch.no_grad():  # a trained adapter: B != 0
        for name, prm in unmerged.named_parameters():
            if ".B_" in name:
                prm.normal_(std=0.02)
    merged = copy.deepcopy(unmerged)
    merge(merged)
    with torch.no_grad():
        diff = (merged(ids) - unmerged(ids)).abs().max().item()
    print(f"merged vs unmerged logits: max |diff| {diff:.2e}")

    def forward(m):
        def run():
            with torch.no_grad():
                m(ids)
        return run

    repeats = 3 * args.repeats  # a forward is cheap: more rounds against the noise
    inf = side_by_side({"base": forward(base), "LoRA merged": forward(merged),
                        "LoRA unmerged": forward(unmerged)}, args.warmup, repeats, args.clock)
    rows = [[name, f"{t * 1e3:.1f}", f"{t / inf['base']:.3f}",
             f"{100 * (t / inf['base'] - 1):+.1f}%"] for name, t in inf.items()]
    print_table(f"Inference forward (eval, no grad), B={args.batch} T={args.seq}, median of "
                f"{repeats}, {args.clock} time",
                ["model", "ms/forward", "time vs base", "overhead"], rows)
    print(f"\nload average at the end {load_average()}")


if __name__ == "__main__":
    main()
