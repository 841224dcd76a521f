"""Greedy decoding with fp32, bf16 and int8 weights side by side, through ``qkv.generate``.

The same random-weight GPT three ways: as built (fp32), ``model.bfloat16()`` (bf16 weights
and activations: the decode engine's ``bf16-packed`` backend where the CPU has native bf16,
half of fp32's weight bytes) and ``qkv.quantize(model, "int8")``. For each batch size and
thread count the three alternate over rounds (the order flips every repeat); the table shows
the median ms per generated token (a whole ``generate`` call / T, prompt included), each
against fp32, the backend ``qkv.generation.explain`` names, and how many of the greedy tokens
equal fp32's. Run ``python -m benchmarks.bench_decode_dtypes`` (``--quick``: a tiny model).

On a CPU without native bf16 (bf16 matmuls ~100x slower than fp32) the bf16 model decodes on
its modules and is slow: the benchmark says so in the header (``qkv.ops.cpu.cpu_bf16``).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks._harness import alternate_times, print_cpu
from qkv import generate, quantize
from qkv.generation import explain
from qkv.models import GPT, GPTConfig
from qkv.ops.cpu import cpu_bf16


def build(args) -> dict[str, torch.nn.Module]:
    """The fp32 GPT (seeded random weights), its bf16 copy and its int8 copy."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, max_len=args.prompt + args.tokens, dim=args.dim,
                    num_layers=args.layers, num_heads=args.heads)
    fp32 = GPT(cfg).eval()
    bf16 = GPT(cfg).eval()
    bf16.load_state_dict(fp32.state_dict())
    int8 = GPT(cfg).eval()
    int8.load_state_dict(fp32.state_dict())
    return {"fp32": fp32, "bf16": bf16.bfloat16(), "int8": quantize(int8, "int8")}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny model, few tokens, one round")
    p.add_argument("--tokens", type=int, default=64, help="new tokens T")
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 0],
                   help="torch threads per run; 0 = torch's default")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.prompt, args.dim, args.layers, args.heads, args.vocab = (
            4, 4, 64, 2, 2, 256)
        args.batches, args.threads, args.repeats = [1, 4], [1], 1
    default_threads = torch.get_num_threads()
    print_cpu()
    print(f"bf16: {cpu_bf16()}")
    print(f"GPT: {args.layers} layers, width {args.dim}, vocab {args.vocab}; prompt "
          f"{args.prompt}, {args.tokens} new tokens, greedy")
    models = build(args)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads or default_threads)
        for batch in args.batches:
            ids = torch.randint(0, args.vocab, (batch, args.prompt), generator=gen)
            out: dict[str, torch.Tensor] = {}

            def run(m, n, _ids=ids, _out=out):
                with torch.inference_mode():
                    _out[n] = generate(m, _ids, max_new_tokens=args.tokens)

            fns = {name: (lambda m=m, n=name: run(m, n)) for name, m in models.items()}
            times = alternate_times(fns, warmup=1, repeats=args.repeats)
            base = statistics.median(times["fp32"])
            for name, m in models.items():
                med = statistics.median(times[name])
                line = next(ln for ln in explain(m, batch=batch).splitlines() if "* " in ln)
                same = int((out[name][:, args.prompt:] == out["fp32"][:, args.prompt:]).sum())
                rows.append((threads or default_threads, batch, name,
                             med / args.tokens * 1e3, base / med,
                             line.split("* ")[1].split(":")[0],
                             f"{same}/{batch * args.tokens}"))
    print("| threads | batch | weights | ms/token | speed vs fp32 | backend | tokens = fp32 |")
    print("|---|---|---|---|---|---|---|")
    for t, b, name, ms, speed, backend, same in rows:
        print(f"| {t} | {b} | {name} | {ms:.2f} | {speed:.2f}x | {backend} | {same} |")


if __name__ == "__main__":
    main()
