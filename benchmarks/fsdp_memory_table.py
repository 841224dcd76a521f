"""Memory per rank and the communication/compute model of ``qkv train --fsdp`` for GPT-2
small/medium/large and vaswani-big at 1, 8 and 64 GPUs — numbers for the README's multi-node
recipe, computed (not measured) from the models' parameter counts on the meta device and the
formulas of ``qkv.train.memory`` (``estimate_training_bytes`` + ``scale_estimate``).

Shapes: P parameters, W ranks (GPUs), L layers, C width, F feed-forward width, V vocabulary,
b sequences per micro-batch per rank, T tokens per sequence.

Assumptions (printed with the table):
- AdamW, fp32 master weights, gradients and moments: 16 P bytes, sharded 1/W under FSDP,
  plus the gathered groups (root + two layers) at 4 bytes a parameter; bf16 compute would
  halve only the gathered copies and the activations, not the 16 P.
- Activations as ``qkv.train.memory``: 4 (10 C + 2 F) bytes per token per layer (encoder-
  decoder: a decoder layer counts twice), one layer's attention scores, the logits and their
  gradient; with activation checkpointing 4 C bytes per token per layer plus one layer's full
  set. One micro-batch of b = 1 sequence of T = 1024 tokens (GPT-2) / 256 source + target
  tokens (vaswani-big). Activations do not shrink with W (data parallel: each rank has its
  own micro-batch); the other parts do.
- GPT-2 large is GPT-2 small's preset with dim 1280, 36 layers, 20 heads (qkv has presets
  gpt2 and gpt2-medium only).
- Throughput: per optimizer step each rank all-gathers the parameters twice (forward, and
  again in backward: layers are resharded after forward) and reduce-scatters the gradients:
  (2 s_p + s_g) P (W-1)/W bytes, s_p = 2 (bf16 gathers), s_g = 4 (fp32 reductions); DDP
  all-reduces 2 s_g P (W-1)/W. Compute is 6 P n FLOPs for n tokens per rank per step (attention
  FLOPs left out: they only make compute longer). Communication hides behind compute while
  t_comm <= t_compute, i.e. n >= (2 s_p + s_g) F_eff (W-1)/W / (6 BW): with a fixed global
  batch of N tokens, scaling stops paying beyond W ~ N / n_min ranks.

Usage: python benchmarks/fsdp_memory_table.py [--quick] [--tokens-per-step 524288]
       [--flops 4e14] [--bw-intra 4.5e11] [--bw-inter 5e10]
"""

from __future__ import annotations

import argparse

import torch

from qkv.models import GPT, GPTConfig, Transformer, TransformerConfig
from qkv.train.memory import estimate_training_bytes, scale_estimate

GIB = 2**30
WORLDS = (1, 8, 64)


def models(quick: bool) -> list[tuple[str, torch.nn.Module, int]]:
    """(name, model on the meta device, tokens per sequence)."""
    specs = [("gpt2 (small)", lambda: GPT(GPTConfig.from_name("gpt2")), 1024),
             ("gpt2-medium", lambda: GPT(GPTConfig.from_name("gpt2-medium")), 1024),
             ("gpt2-large", lambda: GPT(GPTConfig.from_name("gpt2", dim=1280, num_layers=36,
                                                           num_heads=20)), 1024),
             ("vaswani-big", lambda: Transformer(TransformerConfig.from_name(
                 "vaswani-big", src_vocab_size=37000, tgt_vocab_size=37000,
                 share_embeddings=True)), 256)]
    if quick:
        specs = specs[:1]
    out = []
    for name, build, tokens in specs:
        with torch.device("meta"):
            out.append((name, build(), tokens))
    return out


def memory_rows(quick: bool) -> list[str]:
    rows = ["| model | P | W | params+grads+Adam /rank | gathered | activations "
            "| act. (ckpt) | total /rank | total (ckpt) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, model, tokens in models(quick):
        p = sum(t.numel() for t in model.parameters())
        est = estimate_training_bytes(model, batch_size=1, seq_len=tokens)
        for w in WORLDS:
            plain = scale_estimate(est, model, shards=w)
            ckpt = scale_estimate(est, model, shards=w, checkpointing=True)
            state = 16 * p / w
            gathered = plain["parameters"] - state if w > 1 else 0
            rows.append(
                f"| {name} | {p / 1e6:.0f}M | {w} | {state / GIB:.2f} GiB "
                f"| {gathered / GIB:.2f} GiB | {plain['activations'] / GIB:.2f} GiB "
                f"| {ckpt['activations'] / GIB:.2f} GiB "
                f"| {(plain.total) / GIB:.2f} GiB "
                f"| {(ckpt.total) / GIB:.2f} GiB |")
    return rows


def throughput_rows(args: argparse.Namespace, quick: bool) -> list[str]:
    s_p, s_g = 2, 4
    rows = ["| model | link | W | FSDP bytes/rank/step | tokens/rank (N/W) | t_compute "
            "| t_comm FSDP | t_comm DDP | comm hidden? |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, model, _ in models(quick):
        p = sum(t.numel() for t in model.parameters())
        for w in (8, 64):
            link, bw = ("NVLink (1 node)", args.bw_intra) if w <= 8 else \
                ("InfiniBand (nodes)", args.bw_inter)
            frac = (w - 1) / w
            fsdp_bytes = (2 * s_p + s_g) * p * frac
            ddp_bytes = 2 * s_g * p * frac
            n = args.tokens_per_step / w
            t_compute = 6 * p * n / args.flops
            t_fsdp, t_ddp = fsdp_bytes / bw, ddp_bytes / bw
            rows.append(f"| {name} | {link} | {w} | {fsdp_bytes / GIB:.2f} GiB | {n:,.0f} "
                        f"| {t_compute * 1e3:.0f} ms | {t_fsdp * 1e3:.0f} ms "
                        f"| {t_ddp * 1e3:.0f} ms | {'yes' if t_fsdp <= t_compute else 'NO'} |")
    n_min_intra = (2 * s_p + s_g) * args.flops / (6 * args.bw_intra)
    n_min_inter = (2 * s_p + s_g) * args.flops / (6 * args.bw_inter)
    rows += ["", f"n_min (tokens per rank per step for FSDP's traffic to hide behind compute; "
                 f"independent of P): NVLink {n_min_intra:,.0f}, InfiniBand "
                 f"{n_min_inter:,.0f}; with N = {args.tokens_per_step:,} tokens per step "
                 f"scaling stops paying beyond W ~ {args.tokens_per_step / n_min_inter:,.0f} "
                 f"ranks across nodes ({args.tokens_per_step / n_min_intra:,.0f} within "
                 f"NVLink reach)"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="GPT-2 small only")
    ap.add_argument("--tokens-per-step", type=int, default=512 * 1024,
                    help="global tokens per optimizer step N (default 0.5M, GPT-2's)")
    ap.add_argument("--flops", type=float, default=4e14,
                    help="achieved FLOP/s per GPU (default 4e14: ~40%% of an H100's bf16)")
    ap.add_argument("--bw-intra", type=float, default=4.5e11,
                    help="collective bus bandwidth per GPU in a node, bytes/s (NVLink)")
    ap.add_argument("--bw-inter", type=float, default=5e10,
                    help="collective bandwidth per GPU across nodes, bytes/s (400 Gb/s IB)")
    args = ap.parse_args()
    print("Memory per rank, qkv train --fsdp, fp32 AdamW state, one micro-batch of 1 "
          "sequence (T = 1024; vaswani-big 256):")
    print("\n".join(memory_rows(args.quick)))
    print()
    print(f"Throughput model, N = {args.tokens_per_step:,} tokens per step, "
          f"{args.flops:.1e} FLOP/s per GPU, bf16 gathers + fp32 reduce-scatter:")
    print("\n".join(throughput_rows(args, args.quick)))


if __name__ == "__main__":
    main()
