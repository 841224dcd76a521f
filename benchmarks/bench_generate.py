"""Greedy generation: ``qkv.generate`` vs HF ``GPT2LMHeadModel.generate``, side by side.

Shapes: B batch (1), N prompt length, T new tokens, C width, L layers, H heads, V vocab.

Both models hold identical weights: an HF ``GPT2LMHeadModel`` with random weights is saved
with safetensors and loaded into qkv with ``GPT.from_hf``. Each run generates exactly T new
tokens greedily from the same prompt (HF: ``do_sample=False, max_new_tokens=T,
min_new_tokens=T``; qkv: ``eos_token_id=None``), fp32 on CPU, under inference mode; the two
outputs are checked to be the same tokens. Runs alternate (which goes first flips each round)
after warm-up; the table shows the median seconds per run, tokens/s (T / time) and the
speed ratio qkv / HF, per round and overall.

A decode step at B=1 is ~2·P FLOPs (P ≈ 14.6M weights here, ~30 MFLOP) but reads every
weight once (~58 MB fp32): on a CPU its time is dispatch overhead plus memory traffic.
``--floor`` also times, in the same alternation, a run that only reads the weights T times
(one (1, in) @ (in, out) product per linear layer and the LM head, nothing else): no decoder
that reads its fp32 weights once per token goes faster than that on this machine.

Usage: python -m benchmarks.bench_generate [--quick] [--tokens 128 --prompt 8 --dim 384
       --layers 6 --heads 6 --vocab 8192 --repeats 5 --warmup 1 --rounds 1 --threads 1
       --floor]
(``--quick``: tiny sizes and one timed run, so the test suite can run it.)
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile

import torch

from benchmarks._harness import print_table, side_by_side
from qkv import generate
from qkv.models import GPT


def build(args) -> tuple[torch.nn.Module, GPT]:
    """HF GPT2LMHeadModel with random weights and a qkv GPT loaded from its safetensors."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=args.dim, n_layer=args.layers, n_head=args.heads,
                     n_positions=args.prompt + args.tokens, vocab_size=args.vocab,
                     bos_token_id=0, eos_token_id=0, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(cfg).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d, safe_serialization=True)
        model = GPT.from_hf(d).eval()
    return hf, model


def weight_reads(model: GPT, tokens: int):
    """A run that only reads every linear weight once per token, as (1, in) @ (in, out)
    products (the fast layout), ``tokens`` times: the memory-traffic floor of a decoder."""
    mats = []
    for layer in model.layers:
        for lin in (layer.attn.in_proj, layer.attn.out_proj, layer.ffn.fc_in,
                    layer.ffn.fc_out):
            mats.append(lin.weight.detach().t().contiguous())
    mats.append(model.lm_head.weight.detach().t().contiguous())
    xs = [torch.randn(1, m.shape[0]) for m in mats]

    def run() -> None:
        with torch.inference_mode():
            for _ in range(tokens):
                for x, m in zip(xs, mats, strict=True):
                    x @ m

    return run


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, one timed run")
    p.add_argument("--tokens", type=int, default=128, help="new tokens T")
    p.add_argument("--prompt", type=int, default=8, help="prompt length N")
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1,
                   help="independent side-by-side rounds (the median ratio is reported)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (0: torch's default). Default 1: a B=1 decode step's "
                        "ops are too small to split, and a second OpenMP thread on a shared "
                        "2-core machine makes every op wait for it")
    p.add_argument("--floor", action="store_true",
                   help="also time the weight reads alone (the memory-traffic floor)")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.prompt, args.dim, args.layers, args.heads, args.vocab = \
            8, 4, 64, 2, 4, 128
        args.repeats, args.warmup, args.rounds = 1, 1, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    print("command: python -m benchmarks.bench_generate "
          + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32 CPU; B=1 "
          f"N={args.prompt} T={args.tokens} C={args.dim} L={args.layers} H={args.heads} "
          f"V={args.vocab}, greedy")

    hf, model = build(args)
    torch.manual_seed(1)
    ids = torch.randint(1, args.vocab, (1, args.prompt))
    t = args.tokens

    def hf_run() -> torch.Tensor:
        with torch.inference_mode():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=t, min_new_tokens=t, pad_token_id=0)

    def qkv_run() -> torch.Tensor:
        return generate(model, ids, max_new_tokens=t)

    a, b = hf_run(), qkv_run()
    same = int((a[0] == b[0]).sum()) if a.shape == b.shape else -1
    print(f"same tokens: {a.shape == b.shape and torch.equal(a, b)} ({same} of "
          f"{a.shape[1]} positions agree; HF {tuple(a.shape)}, qkv {tuple(b.shape)})")

    fns = {"HF GPT2LMHeadModel.generate": hf_run, "qkv.generate": qkv_run}
    if args.floor:
        fns["weight reads alone (floor)"] = weight_reads(model, t)
    rows, ratios = [], []
    for r in range(args.rounds):
        times = side_by_side(fns, args.warmup, args.repeats)
        hf_t, qkv_t = times["HF GPT2LMHeadModel.generate"], times["qkv.generate"]
        ratios.append(hf_t / qkv_t)
        for name, sec in times.items():
            rows.append([str(r + 1), name, f"{sec * 1e3:.0f}", f"{sec / t * 1e3:.2f}",
                         f"{t / sec:.0f}", f"{hf_t / sec:.2f}x"])
    print_table(f"Greedy generation, B=1, {t} new tokens, fp32 CPU, median of {args.repeats} "
                f"per round", ["round", "generate", "ms/run", "ms/token", "tokens/s",
                               "speed vs HF"], rows)
    print(f"\nqkv / HF tokens/s: median {statistics.median(ratios):.2f}x over {len(ratios)} "
          f"round(s) (min {min(ratios):.2f}x, max {max(ratios):.2f}x)")


if __name__ == "__main__":
    main()
