"""``qkv demo`` (the default): train the seeds' encoder-decoder Transformer to normalise
human-readable dates ("Sat, 3 March 2021", "03/03/21", "二〇二一年三月三日", ...) to ISO
"2021-03-03", then report exact match on 1,000 held-out examples (dates never seen in
training), show a few translations and draw the cross-attention alignment.

The model and schedule below were tuned to pass 95 % exact match within three minutes on 2
CPU cores; the full run takes about 1.5 minutes there (86 s measured; BENCHMARKS.md has the
measured wall time and accuracy).
"""

from __future__ import annotations

import json
import time
import unicodedata
from pathlib import Path
from typing import Any

import torch

__all__ = ["DEMO_MODEL", "DEMO_TRAINING", "QUICK_TRAINING", "display_ljust", "run_dates_demo"]

#: the Transformer: post-norm as the paper, small enough for a CPU
DEMO_MODEL: dict[str, Any] = dict(dim=128, num_encoder_layers=2, num_decoder_layers=2,
                                  num_heads=4, ffn_hidden=256, dropout=0.0)
#: training settings of the full demo (TrainConfig fields)
DEMO_TRAINING: dict[str, Any] = dict(steps=600, batch_size=128, lr=3e-3, warmup=100,
                                     schedule="cosine",
                                     label_smoothing=0.0, eval_every=200, eval_examples=200)
#: ``--quick``: seconds, for smoke tests (accuracy will be low)
QUICK_TRAINING: dict[str, Any] = dict(steps=10, batch_size=16, lr=3e-3, warmup=5,
                                      label_smoothing=0.0, eval_every=10, eval_examples=10)
TEST_EXAMPLES = 1000
#: shown after training: one per family of formats
SHOWCASE = ("Sat, 3 March 2021", "03/03/21", "the third of march 2021", "2021年3月3日",
            "二〇二一年三月三日", "December 25th, 1999", "1988.07.14")
ALIGNMENT_EXAMPLE = "3 March 2021"


def display_ljust(text: str, width: int) -> str:
    """``text`` padded with spaces on the right to ``width`` terminal columns, as
    ``str.ljust`` but counting East Asian wide and fullwidth characters
    (``unicodedata.east_asian_width`` "W" / "F": 年, 〇, ２) as two columns, so that the
    demos' columns line up after Chinese inputs. Text already that wide is returned as is."""
    used = sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)
    return text + " " * max(0, width - used)


def _alignment(model: torch.nn.Module, tokenizer: Any, source: str, target: str,
               path: Path) -> Path:
    """Cross-attention of the last decoder layer (mean over heads) for one translation: rows
    are output characters, columns the source characters each output step looks at."""
    from ..train.kinds import get_kind
    from ..viz import plot_alignment
    from ..viz.maps import attention_maps

    batch = get_kind("transformer").make_batch([(source, target)], tokenizer)
    maps = attention_maps(model, batch["src"], target_ids=batch["tgt_in"])
    # row i is the decoder step that outputs target token i: label rows by that output
    return plot_alignment(maps["cross"][-1],
                          source_tokens=tokenizer.tokens(batch["src"][0].tolist()),
                          target_tokens=tokenizer.tokens(batch["tgt_out"][0].tolist()),
                          path=path, title=f"cross-attention, last decoder layer: {source!r} "
                                           f"-> {target!r}")


def run_dates_demo(*, out: str | None = None, quick: bool = False, seed: int = 0) -> int:
    """Train, evaluate and report (see the module docstring); returns the exit status 0.

    Args:
        out: the run directory, new or empty (default ``runs/demo-dates-<time>``; see
            ``qkv.outputs.new_output_dir``).
        quick: a short run for smoke tests (accuracy will be low).
        seed: model initialisation and dropout.
    """
    from ..data import get_task
    from ..files import atomic_write
    from ..generation import translate
    from ..outputs import new_output_dir
    from ..train import TrainConfig, Trainer, exact_match
    from ..train.rundir import RunDirLock

    t0 = time.perf_counter()
    run_dir = new_output_dir(out or f"runs/demo-dates-{time.strftime('%Y%m%d-%H%M%S')}")
    with RunDirLock(run_dir) as lock:  # one writer, up to demo.json
        training = QUICK_TRAINING if quick else DEMO_TRAINING
        config = TrainConfig(model="transformer", task="dates", overrides=DEMO_MODEL, seed=seed,
                             **training)
        task = get_task("dates")  # seed 0: the same 1,000 test dates whatever the training seed
        print("qkv demo: the encoder-decoder Transformer (Vaswani et al. 2017) learns to normalise "
              "dates.\nTraining examples (generated; held-out dates never appear in training):")
        for source, target in task.examples("train", 0, 4):
            print(f"  {display_ljust(repr(source), 40)} -> {target}")
        trainer = Trainer(config, run_dir, log=lambda line: print(f"  {line}"),
                          lock=lock)
        n_params = sum(p.numel() for p in trainer.model.parameters())
        print(f"Training {n_params / 1e6:.2f}M parameters for {config.steps} steps of "
              f"{config.batch_size} examples ({torch.get_num_threads()} CPU threads)...")
        trainer.run()
        train_s = time.perf_counter() - t0
        model, tok = trainer.model.eval(), trainer.tokenizer
        count = 50 if quick else TEST_EXAMPLES
        test = task.examples("test", 0, count)
        with torch.no_grad():
            preds = translate(model, tok, [s for s, _ in test], batch_size=250)
            shown = translate(model, tok, list(SHOWCASE))
        accuracy = exact_match(preds, [t for _, t in test])
        print("\nExamples:")
        for source, pred in zip(SHOWCASE, shown, strict=True):
            print(f"  {display_ljust(repr(source), 32)} -> {pred}")
        misses = [(s, p, t) for (s, t), p in zip(test, preds, strict=True) if p != t][:3]
        for source, pred, target in misses:
            print(f"  miss: {source!r} -> {pred!r} (expected {target})")
        png = _alignment(model, tok, ALIGNMENT_EXAMPLE,
                         translate(model, tok, [ALIGNMENT_EXAMPLE])[0],
                         run_dir / "cross_attention.png")
        wall = time.perf_counter() - t0
        summary = {"exact_match": accuracy, "test_examples": count, "steps": config.steps,
                   "train_seconds": round(train_s, 1), "wall_seconds": round(wall, 1),
                   "threads": torch.get_num_threads()}
        text = json.dumps(summary, indent=2) + "\n"
        atomic_write(run_dir / "demo.json", lambda tmp: Path(tmp).write_text(text))
        print(f"\nexact match: {100 * accuracy:.1f}% on {count} held-out dates "
              f"({wall:.0f} s in all, {train_s:.0f} s of training)")
        print(f"run directory: {run_dir}\n  checkpoint: {run_dir / 'checkpoint'}  (qkv translate "
              f"{run_dir} --input 'July 4, 1976')\n  metrics:    {run_dir / 'metrics.jsonl'}\n"
              f"  attention:  {png}")
    return 0
