"""GPT training step: qkv ``GPT`` vs HF ``GPT2LMHeadModel`` (SDPA attention), side by side.

Shapes: B batch, T sequence length, C width, L layers, H heads, V vocab.

One training step = forward + next-token cross-entropy + backward + AdamW step, fp32 on CPU.
AdamW is the same for both models: torch's default (per-tensor loop on CPU), or
``--adamw fused`` (``fused=True``, one kernel).
Both models hold identical weights (HF's, converted with ``qkv.models.hf_gpt2``); the first
losses are printed to show they compute the same thing. Steps of the two models alternate
(which goes first flips each round), after warm-up; the table shows median seconds per step,
tokens/s (B·T / step time), the speed ratio qkv / HF, and achieved GFLOP/s against this CPU's
fp32 matmul peak, measured in the same run with a large ``torch.mm``.

FLOPs per step (stated once, used for both models):
    6 · P · B·T               weights: forward 2·P·BT, backward 4·P·BT, P = parameters that
                              multiply activations (the tied (V, C) table counted once, as
                              the LM head; the position table is not a matmul)
  + 6 · L · B · T² · C        attention scores q·kᵀ and weights·v: 2 matmuls of 2·T²·C
                              FLOPs each per layer and sequence forward (4·T²·C), ×3 with
                              backward, halved for causality -> 6·L·B·T²·C

Usage: python -m benchmarks.bench_gpt_train [--quick] [--batch 8 --seq 256 --dim 384
       --layers 6 --heads 6 --vocab 8192 --repeats 7 --warmup 2 --adamw default|fused]
(``--quick``: tiny sizes and one timed step, so the test suite can run it.)
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Callable

import torch

from benchmarks._harness import add_gpt_size_args, print_cpu, print_table, side_by_side
from qkv.models.gpt import GPT
from qkv.models.hf_gpt2 import config_from_hf, convert_hf_state_dict


def matmul_peak_gflops(n: int, repeats: int) -> float:
    """fp32 GFLOP/s of an (n, n) @ (n, n) torch.mm, best of ``repeats``."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def build(args) -> tuple[torch.nn.Module, GPT]:
    """HF GPT2LMHeadModel with random weights and a qkv GPT holding the same weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=args.dim, n_layer=args.layers, n_head=args.heads,
                     n_positions=args.seq, vocab_size=args.vocab, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(cfg).train()
    config = config_from_hf(cfg.to_dict())
    model = GPT(config).train()
    model.load_state_dict(convert_hf_state_dict(hf.state_dict(), config), strict=True)
    return hf, model


def step_fns(hf, model: GPT, ids: torch.Tensor, adamw: str = "default"
             ) -> dict[str, Callable[[], float]]:
    """One training step for each model (the same AdamW for both); returns the loss."""
    targets = ids.roll(-1, dims=1)
    targets[:, -1] = -100  # what HF's shifted labels do: the last position predicts nothing
    kw = {"fused": True} if adamw == "fused" else {}
    opt_hf = torch.optim.AdamW(hf.parameters(), lr=1e-4, **kw)
    opt_qkv = torch.optim.AdamW(model.parameters(), lr=1e-4, **kw)

    def hf_step() -> float:
        loss = hf(input_ids=ids, labels=ids).loss
        opt_hf.zero_grad(set_to_none=True)
        loss.backward()
        opt_hf.step()
        return loss.item()

    def qkv_step() -> float:
        loss = model.loss(ids, targets)
        opt_qkv.zero_grad(set_to_none=True)
        loss.backward()
        opt_qkv.step()
        return loss.item()

    return {"HF GPT2LMHeadModel (sdpa)": hf_step, "qkv GPT": qkv_step}


def flops_per_step(model: GPT, batch: int, seq: int) -> float:
    """6·P·B·T + 6·L·B·T²·C (see the module docstring)."""
    c = model.config
    params = sum(p.numel() for p in model.parameters()) - model.positions.weight.numel()
    return 6 * params * batch * seq + 6 * c.num_layers * batch * seq**2 * c.dim


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gpt_size_args(p, repeats=7, warmup=2)
    p.add_argument("--adamw", choices=("default", "fused"), default="default",
                   help="torch's default AdamW or AdamW(fused=True); the same for both models")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.seq, args.dim, args.layers, args.heads, args.vocab = 2, 32, 64, 2, 4, 128
        args.repeats, args.warmup = 1, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    print("command: python -m benchmarks.bench_gpt_train "
          + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)))
    print_cpu()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32 CPU; "
          f"B={args.batch} T={args.seq} C={args.dim} L={args.layers} H={args.heads} "
          f"V={args.vocab}, AdamW {args.adamw}")

    hf, model = build(args)
    torch.manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    fns = step_fns(hf, model, ids, args.adamw)
    first = {name: fn() for name, fn in fns.items()}  # same weights: same first loss
    print("first-step losses: " + ", ".join(f"{k} {v:.6f}" for k, v in first.items()))

    peak = matmul_peak_gflops(256 if args.quick else 2048, 2 if args.quick else 5)
    times = side_by_side(fns, args.warmup, args.repeats)
    peak = max(peak, matmul_peak_gflops(256 if args.quick else 2048, 2 if args.quick else 5))
    tokens = args.batch * args.seq
    flops = flops_per_step(model, args.batch, args.seq)
    hf_name = next(iter(fns))
    rows = []
    for name, t in times.items():
        gflops = flops / t / 1e9
        rows.append([name, f"{t * 1e3:.0f}", f"{tokens / t:.0f}",
                     f"{times[hf_name] / t:.2f}x", f"{gflops:.1f}", f"{100 * gflops / peak:.0f}%"])
    print_table(f"GPT training step (fwd+bwd+AdamW), fp32 CPU, median of {args.repeats}; "
                f"{flops / 1e9:.1f} GFLOP/step; matmul peak {peak:.1f} GFLOP/s",
                ["model", "ms/step", "tokens/s", "speed vs HF", "GFLOP/s", "of matmul peak"],
                rows)


if __name__ == "__main__":
    main()
