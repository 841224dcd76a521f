"""Peak memory of one `qkv train --model gpt` step with a 50k vocabulary: the gpt kind's loss
through ``GPT.loss`` (the LM head fused with the cross-entropy over chunks of rows) against
the full (B, N, V) logits + ``F.cross_entropy`` it replaced.

Usage: python -m benchmarks.bench_train_memory [--quick] [--rounds 5] [--label-smoothing 0.1]

Shapes B=8, N=256, V=50257 (GPT-2's vocabulary), C=128, L=2, H=4, fp32, CPU. One step is
what the trainer does: the kind's summed loss over the predicted tokens (text windows: every
position predicts), divided by their count, backward, gradient clipping, an AdamW update.
"full logits" is the token kinds' shared loss (``TokenKind.loss``: ``model(ids)`` then
``F.cross_entropy``), "GPT.loss" the gpt kind's own (``GPTKind.loss``). Each case runs in a
fresh subprocess: the model, its optimizer and the batch are built first, then the peak
resident memory during the step above the resident memory before it is recorded
(``peak_growth_mib``; it includes AdamW's moments, created by the first step, the same for
both). The cases alternate (the order flips every round) ``--rounds`` times; the figures are
medians, the ratio full / fused. ``--label-smoothing`` (0.1 is ``TrainConfig``'s default)
smooths both: ``GPT.loss`` smooths inside its chunks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from benchmarks._harness import (
    load_average,
    peak_growth_in_subprocess,
    peak_growth_mib,
    print_cpu,
    print_table,
)

CASES = {
    "full logits": "TokenKind.loss: model(ids) (B, N, V), then F.cross_entropy",
    "GPT.loss": "GPTKind.loss: hidden states, LM head + cross-entropy fused over row chunks",
}


def measure(case: str, *, batch: int, seq: int, vocab: int, dim: int, layers: int,
            heads: int, label_smoothing: float) -> dict:
    """Peak memory growth and seconds of one training step of ``case`` in this process."""
    from qkv.models import GPT, GPTConfig
    from qkv.train.kinds import TokenKind, get_kind

    torch.manual_seed(0)
    kind = get_kind("gpt")
    model = GPT(GPTConfig.from_name("gpt-tiny", vocab_size=vocab, max_len=seq, dim=dim,
                                    num_layers=layers, num_heads=heads)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    windows = torch.randint(4, vocab, (batch, seq + 1))  # (B, N + 1): text windows
    data = kind.make_batch(windows, None)  # ids (B, N), targets (B, N)
    loss_of = (kind.loss if case == "GPT.loss"
               else lambda m, b, **kw: TokenKind.loss(kind, m, b, **kw))
    losses: list[float] = []

    def step() -> None:
        loss_sum, count = loss_of(model, data, label_smoothing=label_smoothing)
        (loss_sum / count).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss_sum.detach()) / int(count))

    t0 = time.perf_counter()
    peak = peak_growth_mib(step)
    return {"peak_mib": peak, "seconds": time.perf_counter() - t0, "loss": losses[0]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round")
    for name, default in (("batch", 8), ("seq", 256), ("vocab", 50257), ("dim", 128),
                          ("layers", 2), ("heads", 4)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--rounds", type=int, default=5, help="times each case is run")
    parser.add_argument("--label-smoothing", type=float, default=0.1,
                        help="as TrainConfig.label_smoothing (its default 0.1)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.seq, args.vocab, args.dim, args.rounds = 2, 32, 2000, 32, 1
    sizes = dict(batch=args.batch, seq=args.seq, vocab=args.vocab, dim=args.dim,
                 layers=args.layers, heads=args.heads)
    if args.measure:
        print(json.dumps(measure(args.measure, **sizes,
                                 label_smoothing=args.label_smoothing)))
        return
    print(f"command: python -m benchmarks.bench_train_memory {' '.join(sys.argv[1:])}")
    print_cpu()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load "
          f"{load_average()}; B={args.batch} N={args.seq} V={args.vocab} C={args.dim} "
          f"L={args.layers} H={args.heads} fp32, label_smoothing {args.label_smoothing}")
    extra = [f"--{k}={v}" for k, v in sizes.items()]
    extra.append(f"--label-smoothing={args.label_smoothing}")
    runs: dict[str, list[dict]] = {case: [] for case in CASES}
    for r in range(args.rounds):
        for case in list(CASES) if r % 2 == 0 else list(CASES)[::-1]:
            runs[case].append(peak_growth_in_subprocess("benchmarks.bench_train_memory",
                                                        case, *extra))
    peak = {c: statistics.median(x["peak_mib"] for x in rs) for c, rs in runs.items()}
    secs = {c: statistics.median(x["seconds"] for x in rs) for c, rs in runs.items()}
    logits_mib = 4 * args.batch * args.seq * args.vocab / 2**20
    rows = [[case, CASES[case], f"{peak[case]:.0f}",
             f"{peak['full logits'] / max(peak[case], 1e-9):.2f}×", f"{secs[case]:.2f}",
             f"{runs[case][0]['loss']:.4f}"] for case in CASES]
    print_table(f"one training step, peak memory above the built model (median of "
                f"{args.rounds} rounds; one (B, N, V) fp32 logits tensor is "
                f"{logits_mib:.1f} MiB)",
                ["case", "loss computed by", "peak MiB", "full / this", "step s", "loss"],
                rows)


if __name__ == "__main__":
    main()
