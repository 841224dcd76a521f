"""Prompt-lookup decoding on / off: ``qkv.generate(..., prompt_lookup_num_tokens=k)`` vs plain
greedy on the same trained models, side by side; the outputs are checked to be identical.

Shapes: B batch (1 and 16), k draft tokens, T new tokens.

Cases (each model trained here, from scratch, for ``--steps`` steps with ``qkv.train``):
- dates, copy, reverse: the encoder-decoder Transformer (the dates demo's size) translating
  held-out test sources (``qkv.translate``); the source is the text drafts are copied from.
  copy copies it all, dates copies the year and digits of some formats, reverse copies
  nothing forwards (its drafts come only from repeats in its own output).
- text: a character GPT trained on this repository's README.md, continuing prompts cut from
  it (``qkv.complete``, plain text); prompts are 48 characters, continuations 64.
- random GPT: the GPT-2-size random-weight GPT of bench_generate.py (C=384, L=6, V=8192)
  continuing random prompts: nothing to copy — the cost of looking up and verifying drafts
  that fail.

Per case and batch size: the median seconds to decode ``--examples`` inputs (alternating on /
off, the order flipping each repeat), the speed-up, and forward passes per new-token position
with the lookup (plain greedy: 1; a batch advances all its rows together). Timings vary with
the machine's load: read the ratios.

Usage: python -m benchmarks.bench_prompt_lookup [--quick] [--steps 400 --examples 32 --k 10
       --repeats 3 --threads 1 --cases dates,copy,reverse,text,random]
(``--quick``: tiny models, 2 training steps, 4 examples, so the test suite can run it.)
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks._harness import print_cpu, print_table, side_by_side
from qkv.generation import api, complete, prompt_lookup, translate

CASES = ("dates", "copy", "reverse", "text", "random")
README = Path(__file__).resolve().parents[1] / "README.md"


class PassCounter:
    """Counts prompt-lookup forward passes and decoding steps (new-token positions: a batch
    of B rows decoding T tokens is T positions) through the loop's stats."""

    def __init__(self) -> None:
        self.passes = self.tokens = 0
        self._real = prompt_lookup.prompt_lookup_greedy

    def __enter__(self) -> PassCounter:
        def spy(stepper, texts, max_new_tokens, **kw):
            stats: dict = {}
            out = self._real(stepper, texts, max_new_tokens, stats=stats, **kw)
            self.passes += stats["passes"] + 1  # + the prefill
            self.tokens += out.shape[1]
            return out

        api.prompt_lookup_greedy = spy
        return self

    def __exit__(self, *exc) -> None:
        api.prompt_lookup_greedy = self._real


def train(kind: str, task: str | None, data: str | None, steps: int, quick: bool, out: str):
    """A model trained with ``qkv.train`` for ``steps`` steps -> (model, tokenizer)."""
    from qkv.train import TrainConfig, Trainer

    if kind == "transformer":
        overrides = dict(dim=128, num_encoder_layers=2, num_decoder_layers=2, num_heads=4,
                         ffn_hidden=256, dropout=0.0)
    else:
        overrides = dict(dim=128, num_layers=3, num_heads=4, dropout=0.0)
    if quick:
        overrides = dict(overrides, dim=32, ffn_hidden=64) if kind == "transformer" else \
            dict(overrides, dim=32, num_layers=1)
    config = TrainConfig(model=kind, task=task, data=data, overrides=overrides, steps=steps,
                         batch_size=8 if quick else 64, lr=3e-3, warmup=max(1, steps // 6),
                         schedule="cosine", label_smoothing=0.0, eval_every=steps,
                         eval_examples=4, **({"max_len": 112} if kind == "gpt" else {}))
    trainer = Trainer(config, out, log=lambda line: None)
    trainer.run()
    return trainer.model.eval(), trainer.tokenizer


def random_gpt(quick: bool):
    from qkv.models import GPT, GPTConfig

    torch.manual_seed(0)
    size = dict(dim=64, num_layers=2, num_heads=4, vocab_size=128) if quick else \
        dict(dim=384, num_layers=6, num_heads=6, vocab_size=8192)
    return GPT(GPTConfig(max_len=256, **size)).eval()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny models, 2 steps, 4 examples")
    p.add_argument("--steps", type=int, default=400, help="training steps per model")
    p.add_argument("--examples", type=int, default=32, help="inputs decoded per timed run")
    p.add_argument("--k", type=int, default=10, help="prompt_lookup_num_tokens")
    p.add_argument("--batches", default="1,16", help="batch sizes, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--cases", default=",".join(CASES))
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.examples, args.repeats, args.warmup = 2, 4, 1, 0
        args.batches = "1,4"
    if args.threads:
        torch.set_num_threads(args.threads)
    cases = args.cases.split(",")
    if not set(cases) <= set(CASES):
        p.error(f"--cases must be among {CASES}, got {args.cases!r}")
    batches = [int(b) for b in args.batches.split(",")]
    print("command: python -m benchmarks.bench_prompt_lookup "
          + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)))
    print_cpu()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32 CPU; k={args.k}, "
          f"{args.examples} inputs per run, batches {batches}, models trained {args.steps} "
          f"steps")

    from qkv.data import get_task

    rows, speedups = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            if case in ("dates", "copy", "reverse"):
                model, tok = train("transformer", case, None, args.steps, args.quick,
                                   f"{tmp}/{case}")
                inputs = [s for s, _ in get_task(case).examples("test", 0, args.examples)]

                def decode(xs, bs, model=model, tok=tok, **kw):
                    return translate(model, tok, xs, batch_size=bs, **kw)
            elif case == "text":
                text = README.read_text(encoding="utf-8")
                path = Path(tmp) / "readme.txt"
                path.write_text(text, encoding="utf-8")
                model, tok = train("gpt", None, str(path), args.steps, args.quick,
                                   f"{tmp}/text")
                step = max(1, (len(text) - 48) // args.examples)
                inputs = [text[i:i + 48] for i in range(0, step * args.examples, step)]

                def decode(xs, bs, model=model, tok=tok, **kw):
                    return complete(model, tok, xs, framed=False, batch_size=bs,
                                    max_new_tokens=64, **kw)
            else:
                model = random_gpt(args.quick)
                vocab = model.config.vocab_size
                torch.manual_seed(1)
                prompts = torch.randint(0, vocab, (args.examples, 16))

                def decode(xs, bs, model=model, **kw):
                    return [api.generate(model, xs[i:i + bs], max_new_tokens=64, **kw)
                            for i in range(0, len(xs), bs)]
                inputs = prompts
            for bs in batches:
                def off(decode=decode, inputs=inputs, bs=bs):
                    with torch.inference_mode():
                        return decode(inputs, bs)

                def on(decode=decode, inputs=inputs, bs=bs):
                    with torch.inference_mode():
                        return decode(inputs, bs, prompt_lookup_num_tokens=args.k)

                plain = off()
                with PassCounter() as counter:
                    looked = on()
                same = all(torch.equal(a, b) for a, b in zip(plain, looked, strict=True)) \
                    if case == "random" else plain == looked
                times = side_by_side({"off": off, "on": on}, args.warmup, args.repeats)
                ratio = times["off"] / times["on"]
                speedups[(case, bs)] = ratio
                rows.append([case, str(bs), f"{times['off'] * 1e3:.0f}",
                             f"{times['on'] * 1e3:.0f}", f"{ratio:.2f}x",
                             f"{counter.passes / max(1, counter.tokens):.2f}", str(same)])
    print_table(f"Prompt lookup (k={args.k}) vs plain greedy, median of {args.repeats}",
                ["case", "batch", "greedy ms", "lookup ms", "speed-up",
                 "passes per position", "same output"], rows)
    print("\nspeed-ups: " + ", ".join(f"{c} B={b}: {r:.2f}x" for (c, b), r in speedups.items()))


if __name__ == "__main__":
    main()
