"""CLIP: qkv ``CLIP`` vs HF ``CLIPModel`` (sdpa) with the same config and weights, fp32 CPU.

Shapes: B batch, N text length, T image tokens, C tower width, L layers per tower.

1. Training step = forward of both towers + symmetric contrastive loss + backward + AdamW
   step. HF: ``CLIPModel(..., return_loss=True).loss``; qkv: ``CLIP.loss`` (``clip_loss``).
   Steps alternate between the contenders (the order flips each round) after warm-up;
   medians and the ratio HF / qkv (> 1: qkv faster; goal >= 1.2).
2. Image-encoding throughput in eval (no grad): ``get_image_features`` vs ``encode_image``,
   images per second, alternating; goal >= 1.3x HF.

The encoding is timed first, as in an inference job; ``--train-first`` times it after the
training steps instead. The order matters here through glibc's heap: after the training
steps' large allocations its thresholds have grown, so later large tensors come from the
already-mapped heap, while in a process that only encodes each large intermediate is fresh
memory (page faults) — HF allocates more of them than qkv, so its encoding is faster after
training than in an encode-only process, and the ratio lower.

What qkv computes: ``encode_image`` / ``encode_text`` (and so ``loss``) read only the pooled
rows, so they skip what nobody reads — the last layer's query projection, attention, output
projection and FFN run at the class / end-of-text token only (every token still a key/value),
and the causal text tower runs on the real tokens up to each text's end-of-text token (the
padding is never computed; HF computes it and masks it). Every plain ``nn.Linear`` goes
through ``qkv.ops.fast_linear`` (oneDNN's matmul on CPU fp32, bias fused; its input gradient
too) via ``qkv.modules.linear_call.apply_linear``. Without gradients quick_gelu is folded
into the MLP's projections (silu(1.702·z) / 1.702: one in-place SiLU pass); with gradients
it is one autograd Function saving only its input. Same math: the logits are compared
before timing. ``--no-onednn`` runs qkv with ``onednn_linear(False)`` (F.linear).

Default sizes: ViT-S-like towers (C=384, L=12, 6 heads, MLP 1536) at 64 px with 8-px patches
(T = 65), text N = 32 right-padded to lengths in [8, 32], B = 32 (``CLIPConfig``
"clip-s-64"). The qkv model is loaded from the HF model's saved directory by ``from_hf``.

Usage: python -m benchmarks.bench_clip [--quick] [--batch 32 --text-len 32 --repeats 5
       --warmup 1 --threads 1 --clock wall|cpu --no-onednn --train-first]
(``--quick``: tiny towers and one timed round, so the test suite can run it.
``--clock cpu``: this process's CPU time (``time.process_time``) instead of wall time — on a
machine shared with other jobs the wall time of a single-threaded run counts the time spent
waiting for a core; with 1 thread CPU time measures the work itself.)
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile

import torch

from benchmarks._harness import load_average, print_cpu, print_table, side_by_side
from qkv.models import CLIP
from qkv.ops.fast_linear import onednn_linear, onednn_linear_active


def hf_model(args):
    """HF CLIPModel (sdpa), seeded random weights."""
    from transformers import CLIPConfig, CLIPModel

    text = dict(hidden_size=args.dim, num_hidden_layers=args.layers,
                num_attention_heads=args.heads, intermediate_size=4 * args.dim,
                vocab_size=args.vocab, max_position_embeddings=77, eos_token_id=args.vocab - 1,
                bos_token_id=args.vocab - 2, pad_token_id=0)
    vision = dict(hidden_size=args.dim, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, intermediate_size=4 * args.dim,
                  image_size=args.image, patch_size=args.patch)
    cfg = CLIPConfig(text_config=text, vision_config=vision, projection_dim=args.dim)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return CLIPModel(cfg)


def inputs(args):
    g = torch.Generator().manual_seed(1)
    px = torch.randn(args.batch, 3, args.image, args.image, generator=g)
    n = args.text_len
    ids = torch.randint(1, args.vocab - 2, (args.batch, n), generator=g)
    lengths = torch.randint(min(8, n), n + 1, (args.batch,), generator=g)
    mask = (torch.arange(n)[None] < lengths[:, None]).long()  # (B, N) right padding
    ids = ids * mask
    ids[torch.arange(args.batch), lengths - 1] = args.vocab - 1  # eos ends every text
    return px, ids, mask


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, one round (tests)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--text-len", type=int, default=32)
    p.add_argument("--image", type=int, default=64)
    p.add_argument("--patch", type=int, default=8)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--vocab", type=int, default=49408)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time.perf_counter (wall) or time.process_time (this process's CPU)")
    p.add_argument("--no-onednn", action="store_true",
                   help="qkv with onednn_linear(False): every linear is F.linear")
    p.add_argument("--train-first", action="store_true",
                   help="time the image encoding after the training steps, not before")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.text_len, args.image, args.dim, args.layers, args.heads = \
            4, 8, 16, 32, 2, 2
        args.vocab, args.repeats, args.warmup = 100, 1, 1
    torch.set_num_threads(args.threads)
    print("command: python -m benchmarks.bench_clip " + shlex.join(sys.argv[1:] if argv is None
                                                                   else argv))
    print(f"load average {load_average()}")
    print_cpu()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, B={args.batch}, "
          f"image {args.image}px patch {args.patch} (T={1 + (args.image // args.patch) ** 2}), "
          f"text N={args.text_len}, C={args.dim}, L={args.layers}, heads={args.heads}")

    with onednn_linear(not args.no_onednn):
        print(f"qkv linears through oneDNN: {onednn_linear_active()}")
        _run(args)


def _run(args) -> None:
    hf = hf_model(args).train()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = CLIP.from_hf(d).train()
    px, ids, mask = inputs(args)
    with torch.no_grad():  # the same model: equal logits before timing anything
        hf.eval()
        ours.eval()
        a = hf(input_ids=ids, pixel_values=px, attention_mask=mask).logits_per_image
        b = ours(px, ids, mask).logits_per_image
        diff = (a - b).abs().max().item()
    print(f"max |logits HF - qkv| = {diff:.2e}")

    opt_hf = torch.optim.AdamW(hf.parameters(), lr=1e-5)
    opt_q = torch.optim.AdamW(ours.parameters(), lr=1e-5)

    def step_hf():
        opt_hf.zero_grad(set_to_none=True)
        hf(input_ids=ids, pixel_values=px, attention_mask=mask, return_loss=True).loss.backward()
        opt_hf.step()

    def step_qkv():
        opt_q.zero_grad(set_to_none=True)
        ours.loss(px, ids, mask).backward()
        opt_q.step()
        ours.clamp_logit_scale_()

    def enc_hf():
        with torch.inference_mode():
            hf.get_image_features(pixel_values=px)

    def enc_qkv():
        with torch.inference_mode():
            ours.encode_image(px)

    def train_phase() -> dict[str, float]:
        hf.train()
        ours.train()
        return side_by_side({"HF CLIPModel": step_hf, "qkv CLIP": step_qkv}, args.warmup,
                            args.repeats, args.clock)

    def encode_phase() -> dict[str, float]:
        hf.eval()
        ours.eval()
        return side_by_side({"HF CLIPModel": enc_hf, "qkv CLIP": enc_qkv}, args.warmup,
                            3 * args.repeats, args.clock)

    print("order: " + ("training steps, then image encoding" if args.train_first
                       else "image encoding, then training steps"))
    if args.train_first:
        train = train_phase()
        enc = encode_phase()
    else:
        enc = encode_phase()
        train = train_phase()
    rows = []
    for name in ("HF CLIPModel", "qkv CLIP"):
        rows.append([name, f"{train[name] * 1e3:.0f}",
                     f"{train['HF CLIPModel'] / train[name]:.2f}x",
                     f"{args.batch / enc[name]:.1f}", f"{enc['HF CLIPModel'] / enc[name]:.2f}x"])
    print_table(f"CLIP training step and image encoding (fp32 CPU, medians, {args.clock} "
                f"time)",
                ["model", "train step (ms)", "speed vs HF", "encode_image (img/s)",
                 "speed vs HF"], rows)
    print(f"\nload average at the end {load_average()} (1, 5, 15 min; the machine's cores: "
          f"{os.cpu_count()})")


if __name__ == "__main__":
    main()
