"""Batched greedy generation: ``qkv.generate`` vs HF ``GPT2LMHeadModel.generate`` at batch B,
side by side, and the weight matmuls alone at the same batch (what no decoder can beat).

Shapes: B batch (16), N prompt length, T new tokens, C width, L layers, H heads, V vocab.

Both models hold identical weights: an HF ``GPT2LMHeadModel`` with random weights is saved with
safetensors and loaded into qkv with ``GPT.from_hf``. The prompts are left-padded to N with
real lengths cycling through N, N-1, ... (``--no-padding``: all N real); each run generates
exactly T tokens per row greedily (HF: ``do_sample=False, max_new_tokens=T,
min_new_tokens=T``; qkv: ``eos_token_id=None``), fp32 on CPU under inference mode, and the two
outputs are checked to be the same tokens. Runs alternate (the order flips every repeat) after
a warm-up; the table shows medians per round: seconds per run, tokens/s (B·T / time) and the
speed relative to HF.

"matmuls alone": per token step, one (B, in) x weight product per linear layer and the LM
head, nothing else (no attention, norms, embedding, argmax), through two layouts: ``mm`` by an
(in, out) copy (what the 1-row step uses) and oneDNN's matmul on packed weights
(``torch.ops.mkldnn._linear_pointwise``, what qkv's step uses from 4 rows on where this torch
build has it); the faster by median is the floor a decoder approaches (the table marks it).

``--clock cpu`` times with ``time.process_time`` (the CPU time of this process: with one
thread, its own work, less disturbed by other jobs on a shared machine than wall time); the
load average is printed before and after each round.

Usage: python -m benchmarks.bench_batched_generate [--quick] [--batch 16 --tokens 64
       --prompt 16 --dim 384 --layers 6 --heads 6 --vocab 8192 --repeats 3 --warmup 1
       --rounds 3 --threads 1 --clock wall --no-padding]
(``--quick``: tiny sizes and one timed run, so the test suite can run it.)
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile

import torch

from benchmarks._harness import load_average, print_cpu, print_table, side_by_side
from qkv import generate
from qkv.generation.linears import packing_works
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


def matmuls_alone(model: GPT, batch: int, tokens: int, layout: str = "mm"):
    """T steps of one (B, in) x weight product per linear layer and the LM head: ``mm`` by
    (in, out) copies, or ``onednn`` (``_linear_pointwise`` on packed weights)."""
    ws = []
    for layer in model.layers:
        for lin in (layer.attn.in_proj, layer.attn.out_proj, layer.ffn.fc_in,
                    layer.ffn.fc_out):
            ws.append(lin.weight.detach())
    ws.append(model.lm_head.weight.detach())  # (out, in)
    xs = [torch.randn(batch, w.shape[1]) for w in ws]
    if layout == "mm":
        mats = [w.t().contiguous() for w in ws]  # (in, out)

        def body() -> None:
            for x, m in zip(xs, mats, strict=True):
                x @ m
    elif layout == "onednn":
        op = torch.ops.mkldnn._linear_pointwise.default
        with torch.no_grad():
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in ws]

        def body() -> None:
            for x, m in zip(xs, packed, strict=True):
                op(x, m, None, "none", [], "")
    else:
        raise ValueError(f"matmuls_alone: layout must be 'mm' or 'onednn', got {layout!r}")

    def run() -> None:
        with torch.inference_mode():
            for _ in range(tokens):
                body()

    return run


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, one timed run")
    p.add_argument("--batch", type=int, default=16, help="rows B")
    p.add_argument("--tokens", type=int, default=64, help="new tokens T per row")
    p.add_argument("--prompt", type=int, default=16, help="prompt length N (padded)")
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3,
                   help="independent side-by-side rounds (the median ratio is reported)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: time.perf_counter; cpu: time.process_time (this process)")
    p.add_argument("--no-padding", action="store_true", help="every prompt N real tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.tokens, args.prompt, args.dim, args.layers, args.heads, args.vocab = \
            4, 6, 5, 64, 2, 4, 128
        args.repeats, args.warmup, args.rounds = 1, 1, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    print("command: python -m benchmarks.bench_batched_generate "
          + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)))
    b, n, t = args.batch, args.prompt, args.tokens
    print_cpu()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32 CPU; B={b} "
          f"N={n} ({'unpadded' if args.no_padding else 'left-padded'}) T={t} C={args.dim} "
          f"L={args.layers} H={args.heads} V={args.vocab}, greedy, {args.clock} clock; load "
          f"average {load_average()}")

    hf, model = build(args)
    torch.manual_seed(1)
    ids = torch.randint(1, args.vocab, (b, n))
    mask = torch.ones(b, n, dtype=torch.long)
    if not args.no_padding:
        for r in range(b):
            mask[r, :r % n] = 0
    ids = ids * mask

    def hf_run() -> torch.Tensor:
        with torch.inference_mode():
            return hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=t,
                               min_new_tokens=t, pad_token_id=0)

    def qkv_run() -> torch.Tensor:
        return generate(model, ids, attention_mask=mask, max_new_tokens=t)

    a, c = hf_run(), qkv_run()
    same = a.shape == c.shape and torch.equal(a, c)
    agree = int((a == c).sum()) if a.shape == c.shape else -1
    print(f"same tokens: {same} ({agree} of {a.numel()} positions agree)")

    fns = {"HF GPT2LMHeadModel.generate": hf_run, "qkv.generate": qkv_run,
           "matmuls alone: mm(x, W_t)": matmuls_alone(model, b, t, "mm")}
    if packing_works():
        fns["matmuls alone: oneDNN packed"] = matmuls_alone(model, b, t, "onednn")
    rows, ratios, floors, loads = [], [], [], [load_average()]
    for r in range(args.rounds):
        times = side_by_side(fns, args.warmup, args.repeats, args.clock)
        loads.append(load_average())
        hf_t, qkv_t = times["HF GPT2LMHeadModel.generate"], times["qkv.generate"]
        floor = min((n for n in times if n.startswith("matmuls alone")), key=times.__getitem__)
        ratios.append(hf_t / qkv_t)
        floors.append(times[floor] / qkv_t)
        for name, sec in times.items():
            tag = " (floor)" if name == floor else ""
            rows.append([str(r + 1), name + tag, f"{sec * 1e3:.0f}", f"{b * t / sec:.0f}",
                         f"{hf_t / sec:.2f}x"])
    print_table(f"Greedy generation, B={b}, {t} new tokens per row, fp32 CPU, median of "
                f"{args.repeats} per round ({args.clock} clock)",
                ["round", "run", "ms/run", "tokens/s", "speed vs HF"], rows)
    print(f"\nqkv / HF tokens/s at B={b}: median {statistics.median(ratios):.2f}x over "
          f"{len(ratios)} round(s) (min {min(ratios):.2f}x, max {max(ratios):.2f}x); qkv runs "
          f"at {statistics.median(floors):.2f} of the matmuls-alone speed; load average "
          f"{' -> '.join(loads)}")


if __name__ == "__main__":
    main()
