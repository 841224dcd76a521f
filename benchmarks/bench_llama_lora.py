"""LoRA fine-tuning of a Llama-family checkpoint (SmolLM2-135M's shape, random weights): qkv.peft
vs HF PEFT, side by side, on the same weights; step time and peak memory.

Shapes: B batch, T sequence length, C width, L layers, V vocab, r rank.

The model is benchmarks/bench_llama_decode.py's (``llama_config``, ``random_llama``: L=30,
C=576, 9 heads, 3 kv heads, F=1536, V=49152, tied embeddings, rope_theta 1e5), saved with
``save_pretrained`` into a temporary directory; both sides load that directory.

Training step = forward + next-token cross-entropy (mean over the B·(T-1) predicted positions)
+ backward + AdamW step (lr 1e-3) on the adapter parameters only, fp32 CPU, train mode (the
model has no dropout; LoRA dropout 0):

- qkv: ``qkv.models.from_pretrained(dir)``, ``qkv.peft.add_lora(model, LoraConfig(r, alpha,
  targets))``, ``model.loss(ids, targets)`` (targets = ids shifted left, the last -100: the
  LM head fused with the loss, no (B·T, V) logits), ``backward()``, ``step()``;
- HF PEFT: ``peft.get_peft_model(LlamaForCausalLM.from_pretrained(dir), peft.LoraConfig(r,
  lora_alpha, target_modules))`` (sdpa attention), ``model(input_ids=ids, labels=ids).loss``,
  ``backward()``, ``step()``.

Targets (``--targets``): "q,v" (qkv ("q", "v") against PEFT ["q_proj", "v_proj"]) and
"all-linear" (qkv "all-linear" against PEFT's "all-linear": q, k, v, o, gate, up, down of every
layer, the LM head not); "both" (the default) runs the two pairs. The trainable parameter
counts of each pair are checked to be equal, and the first-step losses printed (the adapters
start at B = 0, so every contender starts from the base model's loss).

Steps alternate between contenders (the order flips each repeat) after ``--warmup`` untimed
rounds; medians of ``--repeats``, by ``--clock`` (wall, or this process's CPU time).

Memory, each contender in a fresh subprocess that builds it from the saved directory and runs
one training step (the first: it allocates the gradients and AdamW's state):

- "step peak MiB": the peak resident memory during that step above the resident memory just
  before it (Linux ``/proc/self/clear_refs`` resets the high-water mark first;
  ``qkv.bench.peak_growth_mib``): the activations kept for backward, the transient logits and
  gradients, AdamW's state — what the step costs on top of the loaded model;
- "process peak MiB": the process's resident high-water mark over its life (``VmHWM`` of
  /proc/self/status before the step and after it; not ``ru_maxrss``, which a child inherits
  from the process it was forked from): everything, the interpreter, the imported libraries
  (HF's process imports transformers and peft; qkv's neither, as the script prints) and the
  model's weights (~540 MB fp32 at the full shape) included.
tracemalloc does not see torch's allocations, so neither figure comes from it; both are
resident-set figures (pages touched), not allocator bookkeeping.

Usage: python -m benchmarks.bench_llama_lora [--quick] [--batch 8 --seq 128 --layers 30
       --rank 8 --alpha 16 --targets both|q,v|all-linear --repeats 5 --warmup 1 --threads 0
       --clock wall|cpu]
(``--threads 0``: torch's default. ``--quick``: 2 layers, V=4096, B=2, T=32, one timed
repeat, so the test suite can run it.)
"""

from __future__ import annotations

import argparse
import json
import resource
import shlex
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks._harness import (
    CLOCKS,
    alternate_times,
    case_runner,
    load_average,
    peak_growth_mib,
    print_cpu,
    print_table,
)
from benchmarks.bench_llama_decode import llama_config, random_llama
from benchmarks.bench_lora import step_fn
from qkv import models
from qkv.peft import LoraConfig, add_lora

PAIRS = {"q,v": (("q", "v"), ["q_proj", "v_proj"]), "all-linear": (("all-linear",), "all-linear")}
GOAL = 1.3  # qkv step speed over HF PEFT's


def cases(which: str) -> list[str]:
    """The contenders of ``--targets``: "hf-peft <pair>" and "qkv <pair>" per pair."""
    pairs = list(PAIRS) if which == "both" else [which]
    return [f"{side} {pair}" for pair in pairs for side in ("hf-peft", "qkv")]


def build(case: str, hf_dir: Path, args) -> tuple[torch.nn.Module, Callable[[torch.Tensor],
                                                                              torch.Tensor]]:
    """(model, loss_fn(ids (B, T)) -> scalar loss) for one contender, loaded from ``hf_dir``,
    train mode, only the adapter trainable."""
    side, pair = case.split(" ")
    qkv_targets, peft_targets = PAIRS[pair]
    if side == "hf-peft":
        from transformers import LlamaForCausalLM

        import peft

        base = LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa")
        model = peft.get_peft_model(base, peft.LoraConfig(
            r=args.rank, lora_alpha=args.alpha, target_modules=peft_targets,
            lora_dropout=0.0)).train()
        return model, lambda ids: model(input_ids=ids, labels=ids).loss
    model = models.from_pretrained(hf_dir).train()
    add_lora(model, LoraConfig(r=args.rank, alpha=args.alpha, targets=qkv_targets))

    def loss(ids: torch.Tensor) -> torch.Tensor:
        targets = ids.roll(-1, dims=1)  # (B, T)
        targets[:, -1] = -100  # as HF's shifted labels: the last position predicts nothing
        return model.loss(ids, targets)

    return model, loss


def trainable(model: torch.nn.Module) -> int:
    """Parameters with ``requires_grad``."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def batch_ids(args, vocab: int) -> torch.Tensor:
    """The seeded (B, T) training batch (never the last id, the stand-in eos)."""
    torch.manual_seed(1)
    return torch.randint(0, vocab - 1, (args.batch, args.seq))


def measure(case: str, args) -> dict:
    """In this (fresh) process: the first training step's peak resident growth, the
    process's ru_maxrss after it, the trainable parameter count."""
    model, loss_fn = build(case, Path(args.dir), args)
    step, _ = step_fn(model, loss_fn, batch_ids(args, model_vocab(args)))
    before = process_peak_mib()  # imports and the model's load
    peak = peak_growth_mib(step)  # resets the high-water mark to the current resident set
    return {"step_peak_mib": peak, "process_peak_mib": max(before, process_peak_mib()),
            "trainable": trainable(model),
            "transformers_imported": "transformers" in sys.modules}


def process_peak_mib() -> float:
    """This process's resident-set high-water mark in MiB: ``VmHWM`` of /proc/self/status
    (since this program's exec, or since ``peak_growth_mib`` last reset it), else
    ``ru_maxrss`` (which on Linux a child inherits from the process it was forked from: a
    subprocess of a 6 GB benchmark would report 6 GB)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def model_vocab(args) -> int:
    return 4096 if args.quick else 49152


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="2 layers, V=4096, B=2, T=32, one timed repeat")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--targets", choices=("both", *PAIRS), default="both")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--clock", choices=tuple(CLOCKS), default="wall")
    p.add_argument("--measure", help=argparse.SUPPRESS)  # subprocess: one case
    p.add_argument("--dir", help=argparse.SUPPRESS)  # subprocess: the saved checkpoint
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.seq, args.layers, args.repeats, args.warmup = 2, 32, 2, 1, 1
    if min(args.batch, args.seq, args.layers, args.rank, args.repeats) < 1 or args.seq < 2:
        p.error("--batch, --layers, --rank, --repeats must be >= 1 and --seq >= 2")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.measure:
        print(json.dumps(measure(args.measure, args)))
        return
    print("command: python -m benchmarks.bench_llama_lora "
          + shlex.join(sys.argv[1:] if argv is None else argv))
    print_cpu()
    import transformers

    import peft

    vocab = model_vocab(args)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, peft "
          f"{peft.__version__}; {torch.get_num_threads()} torch thread(s), fp32 CPU; "
          f"load average at start {load_average()}")
    print(f"model: random-weight Llama, L={args.layers} C=576 H=9 Hkv=3 F=1536 V={vocab} tied; "
          f"B={args.batch} T={args.seq}, r={args.rank}, alpha={args.alpha:g}, AdamW lr 1e-3; "
          f"median of {args.repeats} after {args.warmup} warm-up, {args.clock} clock")
    names = cases(args.targets)
    loads = [load_average()]
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "hf"
        random_llama(llama_config(args.layers, vocab)).save_pretrained(hf_dir)
        ids = batch_ids(args, vocab)
        fns, counts = {}, {}
        for case in names:
            model, loss_fn = build(case, hf_dir, args)
            fns[case], _ = step_fn(model, loss_fn, ids)
            counts[case] = trainable(model)
        for pair in {c.split(" ")[1] for c in names}:
            if counts[f"qkv {pair}"] != counts[f"hf-peft {pair}"]:
                raise RuntimeError(f"{pair}: trainable parameters differ: qkv "
                                   f"{counts[f'qkv {pair}']:,}, HF PEFT "
                                   f"{counts[f'hf-peft {pair}']:,}")
        first = {case: fn() for case, fn in fns.items()}  # B = 0: each starts at the base
        print("first-step losses: " + ", ".join(f"{k} {v:.6f}" for k, v in first.items()))
        times = alternate_times(fns, args.warmup, args.repeats, args.clock)
        loads.append(load_average())
        del fns
        run_case = case_runner(args.quick)
        extra = [f"--{k}={getattr(args, k)}" for k in ("batch", "seq", "layers", "rank",
                                                        "alpha", "threads")]
        extra += ["--quick"] * args.quick + [f"--dir={hf_dir}"]
        mem = {case: run_case("benchmarks.bench_llama_lora", case, *extra) for case in names}
        loads.append(load_average())

    tokens = args.batch * args.seq
    rows, ratio_rows = [], []
    for case in names:
        ts = times[case]
        med = statistics.median(ts)
        pair = case.split(" ")[1]
        ref = statistics.median(times[f"hf-peft {pair}"])
        rows.append([case, f"{counts[case]:,}", f"{med * 1e3:.0f}",
                     f"{min(ts) * 1e3:.0f}-{max(ts) * 1e3:.0f}", f"{tokens / med:.0f}",
                     f"{ref / med:.2f}x", f"{mem[case]['step_peak_mib']:.0f}",
                     f"{mem[case]['process_peak_mib']:.0f}"])
        if case.startswith("qkv"):
            ratio = ref / med
            ratio_rows.append([f"qkv / HF PEFT, {pair}", f"{ratio:.2f}x", f">= {GOAL}x",
                               "met" if ratio >= GOAL else "not met"])
    print_table(f"LoRA training step (fwd+bwd+AdamW), B={args.batch} T={args.seq}, median of "
                f"{args.repeats} alternating, {args.clock} time; memory: first step in a fresh "
                f"process",
                ["contender", "trainable params", "ms/step", "min-max ms", "tokens/s",
                 "speed vs HF PEFT", "step peak MiB", "process peak MiB"], rows)
    print("memory processes that imported transformers: "
          + ", ".join(f"{c} {'yes' if m['transformers_imported'] else 'no'}"
                      for c, m in mem.items()))
    print_table("step speed against the issue's goal", ["ratio", "measured", "goal", ""],
                ratio_rows)
    print(f"\nload average during the run: {' -> '.join(loads)}")


if __name__ == "__main__":
    main()
