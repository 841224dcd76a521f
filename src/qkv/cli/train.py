"""``qkv train``: train a Transformer, GPT or BERT on an embedded task or your own file, with
checkpoints you can resume bit-identically, under one process or ``torchrun``."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

EXAMPLES = """examples:
  qkv train --task dates --steps 1000 --out runs/dates
  qkv train --resume runs/dates --steps 2000          # continue the same run to step 2000
  qkv train --resume runs/mine --accept-changed-data  # continue although --data was edited
  qkv train --task reverse --preset transformer-small --set dim=128 --set dropout=0.0
  qkv train --data pairs.tsv --tokenizer bpe --bpe-vocab-size 2000 --steps 5000
  qkv train --model gpt --data corpus.txt --max-len 256 --schedule cosine --lr 6e-4
  qkv train --model gpt --task addition --set positions=rope
  qkv train --model bert-mlm --data corpus.txt
  torchrun --nproc-per-node 2 -m qkv.cli train --task dates --batch-size 128
  torchrun --nproc-per-node 4 -m qkv.cli train --data pairs.tsv --device cuda   # nccl

--data: a TSV file (source<TAB>target per line) for --model transformer; plain UTF-8 text for
gpt / bert-mlm. --steps always counts the optimizer steps of the whole run. The run directory
holds run.json, metrics.jsonl and checkpoint/ (config.json, model.safetensors, tokenizer.json,
trainer state): load it with qkv.train.load_run(DIR) or Model.from_pretrained(DIR/checkpoint).
One process writes a run directory at a time (RUN/.lock while it trains); a second qkv train
on the same --out or --resume is refused, naming the holder's pid. Before anything is
written, settings, data, model sizes and memory are checked: what is refused leaves nothing.
"""

#: (flag, TrainConfig field, type, help); every one defaults to the TrainConfig default
_SETTINGS: tuple[tuple[str, str, Any, str], ...] = (
    ("--model", "model", str, "transformer (default), gpt or bert-mlm"),
    ("--preset", "preset", str, "model preset (default: transformer-tiny, gpt-tiny, bert-tiny)"),
    ("--task", "task", str, "embedded task: dates (default), copy, reverse, sort, addition"),
    ("--data", "data", str, "a TSV pairs file (transformer) or a text file (gpt, bert-mlm)"),
    ("--tokenizer", "tokenizer", str, "char (default) or bpe"),
    ("--bpe-vocab-size", "bpe_vocab_size", int, "BPE vocabulary size (default 1000)"),
    ("--steps", "steps", int, "optimizer steps of the whole run (default 1000)"),
    ("--batch-size", "batch_size", int, "examples per step, all processes (default 64)"),
    ("--lr", "lr", float, "peak learning rate (default 1e-3)"),
    ("--schedule", "schedule", str, "inverse_sqrt (default, the paper's), cosine, constant"),
    ("--warmup", "warmup", int, "linear warm-up steps (default 100)"),
    ("--min-lr-ratio", "min_lr_ratio", float, "cosine: final lr / peak (default 0)"),
    ("--weight-decay", "weight_decay", float, "AdamW weight decay (default 0.01)"),
    ("--label-smoothing", "label_smoothing", float, "default 0.1 (the paper's)"),
    ("--clip-norm", "clip_norm", float, "gradient-norm clipping, 0 = off (default 1.0)"),
    ("--eval-every", "eval_every", int, "steps between evaluations/checkpoints (default 200)"),
    ("--eval-examples", "eval_examples", int, "held-out examples per evaluation (default 200)"),
    ("--max-len", "max_len", int, "longest sequence / text window in tokens (default: derived)"),
    ("--seed", "seed", int, "seed of initialisation, dropout and data order (default 0)"),
)


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``qkv train`` to the command parsers."""
    p = sub.add_parser("train", help="train a model on a task or your data",
                       description=__doc__, epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, field, kind, text in _SETTINGS:
        p.add_argument(flag, dest=field, type=kind, default=None, help=text)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model config field (JSON value or a string), repeatable")
    p.add_argument("--out", default=None, help="run directory (default runs/<model>-<data>-"
                   "<time>)")
    p.add_argument("--resume", default=None, metavar="RUN",
                   help="continue the run in RUN up to --steps (its own settings otherwise)")
    p.add_argument("--accept-changed-data", action="store_true",
                   help="with --resume: continue even though the --data file changed since the "
                        "run began (it is then no longer the same run)")
    p.add_argument("--device", default="auto",
                   help="auto (CUDA when available, default), cpu, cuda or cuda:N; under "
                        "torchrun cuda means each rank's cuda:LOCAL_RANK (nccl)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run)


def _overrides(items: list[str]) -> dict[str, Any]:
    from . import UserError

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


#: TrainConfig field -> the flag that sets it
_FLAGS = {field: flag for flag, field, _, _ in _SETTINGS} | {"overrides": "--set"}


def _run(args: argparse.Namespace) -> int:
    from ..train.config import ConfigError
    from . import UserError

    try:
        return _train(args)
    except ConfigError as exc:  # name the flag a user typed, not only the field
        flag = _FLAGS.get(exc.field)
        raise UserError(f"{flag}: {exc}" if flag else str(exc)) from exc


def _train(args: argparse.Namespace) -> int:
    from ..train import TrainConfig, Trainer, TrainingError
    from . import UserError

    given = {field: getattr(args, field) for _, field, _, _ in _SETTINGS
             if getattr(args, field) is not None}
    progress = not args.no_progress
    if args.resume:
        extra = sorted(set(given) - {"steps"}) + (["--set"] if args.overrides else []) + (
            ["--out"] if args.out else [])
        if extra:
            raise UserError(f"--resume continues a run with its own settings; only --steps may "
                            f"be given with it (got {', '.join(extra)})")
        trainer = Trainer.resume(args.resume, steps=given.get("steps"), progress=progress,
                                 device=args.device,
                                 accept_changed_data=args.accept_changed_data)
        out = Path(args.resume)
    else:
        if args.accept_changed_data:
            raise UserError("--accept-changed-data goes with --resume (a new run records the "
                            "data file as it is)")
        if "data" in given and "task" not in given:
            given["task"] = None
        if "data" in given and not Path(given["data"]).is_file():
            raise UserError(f"--data {given['data']}: no such file")
        config = TrainConfig(**given, overrides=_overrides(args.overrides))
        stem = Path(config.data).stem if config.data else config.task
        out = Path(args.out or f"runs/{config.model}-{stem}-{time.strftime('%Y%m%d-%H%M%S')}")
        trainer = Trainer(config, out, progress=progress, device=args.device)
    if trainer.world.is_main:
        n = sum(p.numel() for p in trainer.model.parameters())
        print(f"qkv train: {trainer.config.model} ({n / 1e6:.2f}M parameters) on "
              f"{trainer.device}, steps "
              f"{trainer.step} -> {trainer.config.steps}, run directory {out}")
    try:
        result = trainer.run()
    except TrainingError as exc:
        raise UserError(str(exc)) from exc
    if trainer.world.is_main:
        shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in result.items())
        print(f"qkv train: done ({shown}); checkpoint in {out / 'checkpoint'}")
    return 0
