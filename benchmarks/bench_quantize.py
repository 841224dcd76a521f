"""int8 weights (``qkv.quantize(model, "int8")``): decode speed against fp32 qkv and HF GPT-2,
translation agreement on the dates task, perplexity of a trained GPT.

Shapes: N prompt length, T new tokens, C width, L layers, H heads, V vocab.

1. Decode, batch 1, greedy, T new tokens from an N-token prompt, fp32 on CPU under inference
   mode. An HF ``GPT2LMHeadModel`` with random weights is saved with safetensors and loaded
   into qkv with ``GPT.from_hf`` (the same weights); a deep copy is quantized. Contenders:
   HF ``generate``; ``qkv.generate`` (fp32, its fast decode step); the int8 model through
   ``qkv.generate`` (which dispatches it to the decode engine's int8 backends, with
   the fused C int8 layer of ``qkv.generation.int8_kernel`` when it builds here); the int8
   step alone (prefill + T - 1 steps + argmax, no search loop) with the fused kernel and with
   the plain torch ops (``kernel=False``, each layer ~7 ops through ``torch._int_mm``);
   the int8 model's modules through the generic stepper (``GPTStepper``, calling the
   ``QuantizedLinear`` modules). Rounds alternate (the order flips each repeat) for each
   thread count of ``--threads``; the table shows the median and best tokens/s and the ratios
   to qkv fp32 and HF, and with 1 thread the same from the process's CPU time (a shared
   machine stretches wall time while a run waits for a core; CPU time much less). The int8
   tokens are checked to equal the quantized model's uncached greedy forward on the first 16
   tokens.
2. Dates: the demo's encoder-decoder Transformer trained on the dates task
   (``qkv.demos.dates`` settings, ``--dates-steps``; or a run directory of ``qkv demo``,
   ``--dates-run DIR``), then ``translate`` on held-out inputs
   with the fp32 model and with its int8 copy: the share of identical outputs, and each
   model's exact match against the reference dates.
3. Perplexity: a small GPT trained on the dates task as a language model (``--gpt-steps``);
   exp(mean next-token cross-entropy) of its held-out examples' target tokens, from
   ``model(ids)``'s logits, fp32 vs int8, and the ratio (goal: within 1 %).

Usage: python -m benchmarks.bench_quantize [--quick] [--tokens 128 --prompt 8 --dim 384
       --layers 6 --heads 6 --vocab 8192 --repeats 5 --threads 1 2 --dates-steps 600
       --dates-examples 1000 --dates-run DIR --gpt-steps 600 --gpt-batch 64]
(``--quick``: tiny sizes, one repeat, a few training steps, so the test suite can run it.)
"""

from __future__ import annotations

import argparse
import copy
import math
import shlex
import statistics
import sys
import tempfile
import time

import torch

from benchmarks._harness import print_cpu, print_table
from qkv import generate, quantize
from qkv.generation import int8_kernel
from qkv.generation.engine import decoder_stepper
from qkv.generation.steppers import GPTStepper
from qkv.models import GPT


def build(args) -> tuple[torch.nn.Module, GPT, GPT]:
    """HF GPT2LMHeadModel (random weights), the qkv GPT with its weights, an int8 copy."""
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
    return hf, model, quantize(copy.deepcopy(model), "int8")


def int8_decode(model: GPT, ids: torch.Tensor, tokens: int, kernel: bool | None = None,
                generic: bool = False):
    """The int8 decode alone: prefill + ``tokens`` - 1 steps, argmax; returns (1, T) ids.
    ``generic``: through ``GPTStepper`` (the modules) instead of the decode engine;
    ``kernel``: True forces the ``c-layer-int8`` backend, False ``int8-torch``, None the
    engine's choice."""
    backend = {True: "c-layer-int8", False: "int8-torch", None: None}[kernel]

    def run() -> torch.Tensor:
        with torch.inference_mode():
            stepper = (GPTStepper(model, ids, None, tokens, True) if generic else
                       decoder_stepper(model, ids, None, ids.shape[1] + tokens,
                                       backend=backend))
            logits, out = stepper.prefill(), []
            for i in range(tokens):
                out.append(logits.argmax(dim=-1))
                if i < tokens - 1:
                    logits = stepper.step(out[-1])
            return torch.stack(out, dim=1)

    return run


def uncached_greedy(model: GPT, ids: torch.Tensor, tokens: int) -> torch.Tensor:
    """Greedy tokens (1, T) from the model's full forward recomputed every step."""
    with torch.inference_mode():
        for _ in range(tokens):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[:, -tokens:]


def decode_speed(args) -> None:
    hf, fp32, int8 = build(args)
    torch.manual_seed(1)
    ids = torch.randint(1, args.vocab, (1, args.prompt))
    t = args.tokens
    fns = {
        "HF GPT2LMHeadModel.generate": lambda: hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=t,
            min_new_tokens=t, pad_token_id=0),
        "qkv.generate fp32": lambda: generate(fp32, ids, max_new_tokens=t, eos_token_id=None),
        "int8 qkv.generate": lambda: generate(int8, ids, max_new_tokens=t, eos_token_id=None),
        "int8 step, torch ops": int8_decode(int8, ids, t, kernel=False),
        "int8 step, generic stepper": int8_decode(int8, ids, t, generic=True),
    }
    if int8_kernel.load() is not None:
        fns["int8 step, C kernel"] = int8_decode(int8, ids, t, kernel=True)
    print("fused int8 C kernel: " + ("built and loaded" if "int8 step, C kernel" in fns else
                                     "not available here (qkv.generate uses the torch ops)"))
    check = min(t, 16)
    slow = uncached_greedy(int8, ids, check)
    same = all(torch.equal(int8_decode(int8, ids, check, kernel=k)(), slow)
               for k in ([False, True] if int8_kernel.load() is not None else [False]))
    same = same and torch.equal(fns["int8 qkv.generate"]()[:, -t:][:, :check], slow)
    with torch.inference_mode():
        agree = (fns["int8 qkv.generate"]()[0, -t:] == fns["qkv.generate fp32"]()[0, -t:]).float()
    print(f"int8 qkv.generate and int8 steps == int8 uncached forward on the first {check} "
          f"tokens: {same}; "
          f"int8 tokens equal to fp32's: {agree.mean().item():.0%} (random weights: the "
          f"argmax of nearly flat logits, not a quality measure)")
    threads0 = torch.get_num_threads()
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        times: dict[str, list[float]] = {name: [] for name in fns}
        cpu: dict[str, list[float]] = {name: [] for name in fns}
        names = list(fns)
        with torch.inference_mode():
            for name in names:  # warm-up
                fns[name]()
            for r in range(args.repeats):
                for name in names if r % 2 == 0 else names[::-1]:
                    c0, t0 = time.process_time(), time.perf_counter()
                    fns[name]()
                    times[name].append(time.perf_counter() - t0)
                    cpu[name].append(time.process_time() - c0)
        med = {n: t / statistics.median(v) for n, v in times.items()}  # tokens/s
        med_cpu = {n: t / statistics.median(v) for n, v in cpu.items()}
        for name in names:
            rows.append([str(threads), name, f"{med[name]:.0f}", f"{t / min(times[name]):.0f}",
                         f"{med[name] / med['qkv.generate fp32']:.2f}x",
                         f"{med[name] / med['HF GPT2LMHeadModel.generate']:.2f}x",
                         f"{med_cpu[name]:.0f}" if threads == 1 else "-",
                         f"{med_cpu[name] / med_cpu['qkv.generate fp32']:.2f}x"
                         if threads == 1 else "-"])
    torch.set_num_threads(threads0)
    print_table(f"decode, batch 1, N={args.prompt} prompt, T={t} new tokens",
                ["threads", "decode", "tok/s median", "tok/s best", "vs qkv fp32", "vs HF",
                 "CPU-time tok/s", "CPU-time vs qkv fp32"], rows)
    print("CPU-time columns (1 thread only): tokens per second of this process's CPU time, "
          "which a machine shared with other jobs inflates less than wall time.")


def dates_agreement(args) -> None:
    from qkv.data import get_task
    from qkv.demos.dates import DEMO_MODEL, DEMO_TRAINING
    from qkv.generation import translate
    from qkv.train import TrainConfig, Trainer, exact_match

    training = {**DEMO_TRAINING, "steps": args.dates_steps,
                "eval_every": max(args.dates_steps, 1), "eval_examples": 10}
    if args.quick:
        training.update(batch_size=16, warmup=5)
    if args.dates_run:  # a run of `qkv demo` (or `qkv train --task dates`): no training here
        from qkv.train.checkpoint import load_run

        model, tok = load_run(args.dates_run)
        what = f"loaded from {args.dates_run}"
    else:
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            trainer = Trainer(TrainConfig(model="transformer", task="dates",
                                          overrides=DEMO_MODEL, seed=0, **training), d,
                              log=lambda line: None)
            trainer.run()
            what = f"trained {args.dates_steps} steps ({time.perf_counter() - t0:.0f} s)"
            model, tok = trainer.model.eval(), trainer.tokenizer
    int8 = quantize(copy.deepcopy(model), "int8")
    test = get_task("dates").examples("test", 0, args.dates_examples)
    sources, refs = [s for s, _ in test], [t for _, t in test]
    with torch.no_grad():
        t0 = time.perf_counter()
        a = translate(model, tok, sources, batch_size=250)
        fp_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        b = translate(int8, tok, sources, batch_size=250)
        q_s = time.perf_counter() - t0
    same = sum(x == y for x, y in zip(a, b, strict=True)) / len(a)
    print(f"\ndates: Transformer {what}; {len(sources)} held-out inputs")
    print_table("dates: fp32 vs int8", ["model", "exact match", "translate s (batch 250)"],
                [["fp32", f"{exact_match(a, refs):.1%}", f"{fp_s:.1f}"],
                 ["int8", f"{exact_match(b, refs):.1%}", f"{q_s:.1f}"]])
    print(f"int8 translations identical to fp32: {same:.1%} (goal >= 99 %)")


def perplexity(args) -> None:
    from qkv.data import get_task
    from qkv.train import TrainConfig, Trainer
    from qkv.train.kinds import get_kind

    over = dict(dim=128, num_layers=4, num_heads=4, max_len=64)
    steps = args.gpt_steps
    cfg = TrainConfig(model="gpt", task="dates", overrides=over, steps=steps,
                      batch_size=args.gpt_batch, lr=3e-3, warmup=min(50, steps),
                      schedule="cosine", label_smoothing=0.0, eval_every=max(steps, 1),
                      eval_examples=10, seed=0)
    with tempfile.TemporaryDirectory() as d:
        trainer = Trainer(cfg, d, log=lambda line: None)
        trainer.run()
        model, tok = trainer.model.eval(), trainer.tokenizer
    int8 = quantize(copy.deepcopy(model), "int8")
    test = get_task("dates").examples("test", 0, 40 if args.quick else 500)

    def ppl(m: GPT) -> float:
        total, count = 0.0, 0
        with torch.no_grad():
            for i in range(0, len(test), 100):
                batch = get_kind("gpt").make_batch(test[i:i + 100], tok)
                logits = m(batch["ids"])  # (B, N, V)
                t = batch["targets"]
                nll = torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), t.flatten(), ignore_index=-100, reduction="sum")
                total += nll.item()
                count += int((t != -100).sum())
        return math.exp(total / count)

    p32, p8 = ppl(model), ppl(int8)
    print(f"\nperplexity: GPT ({over}) trained {steps} steps of {args.gpt_batch} on dates as "
          f"a language model, "
          f"{len(test)} held-out examples' target tokens")
    print_table("perplexity", ["model", "perplexity"],
                [["fp32", f"{p32:.4f}"], ["int8", f"{p8:.4f}"]])
    print(f"int8 / fp32 perplexity: {p8 / p32:.4f} (goal within 1 %)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt", type=int, default=8)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--dates-steps", type=int, default=600)
    p.add_argument("--dates-examples", type=int, default=1000)
    p.add_argument("--dates-run", default=None,
                   help="a trained dates run directory (e.g. `qkv demo --out DIR`) to use "
                        "instead of training one here")
    p.add_argument("--gpt-steps", type=int, default=600)
    p.add_argument("--gpt-batch", type=int, default=64)
    p.add_argument("--skip", nargs="*", default=[], choices=["decode", "dates", "perplexity"])
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.prompt, args.dim, args.layers, args.heads, args.vocab = \
            8, 4, 64, 2, 2, 256
        args.repeats, args.threads = 1, [1]
        args.dates_steps, args.dates_examples, args.gpt_steps, args.gpt_batch = 5, 20, 5, 16
    print("command: python -m benchmarks.bench_quantize "
          + shlex.join(sys.argv[1:] if argv is None else argv))
    print_cpu()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads available to torch")
    if "decode" not in args.skip:
        decode_speed(args)
    if "dates" not in args.skip:
        dates_agreement(args)
    if "perplexity" not in args.skip:
        perplexity(args)


if __name__ == "__main__":
    main()
