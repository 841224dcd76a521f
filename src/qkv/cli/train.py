"""``qkv train``: train a Transformer, GPT or BERT on an embedded task or your own file, or a
CLIP on image-caption pairs (the shapes task or your folder of images), with checkpoints
you can resume bit-identically, under one process or ``torchrun``."""

from __future__ import annotations

import argparse
import json
import os
import sys
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
  qkv train --model clip --task shapes --batch-size 256 --steps 1300 --lr 1e-3 --label-smoothing 0
  qkv train --model clip --data photos/ --set vision.image_size=64   # photos/captions.tsv
  qkv train --task dates-long --init-from runs/dates --lora r=8,alpha=16,targets=q+v
  qkv train --task dates-long --init-from runs/dates --adapters reduction_factor=16
  qkv train --model gpt --data corpus.txt --init-from runs/gpt-text --prefix 16
  qkv train --task dates-long --init-from runs/dates           # full fine-tuning
  qkv train --init-from models/qwen2-0.5b-instruct --chat --data chats.jsonl --lora r=8
  qkv train --init-from models/llama-instruct --chat --data qa.tsv --lr 2e-5 --steps 200
  qkv train --init-from models/opus-mt-en-de --data pairs.tsv --lora r=8,targets=q+v
  torchrun --nproc-per-node 2 -m qkv.cli train --task dates --batch-size 128
  torchrun --nproc-per-node 4 -m qkv.cli train --data pairs.tsv --device cuda   # nccl
  torchrun --nproc-per-node 8 -m qkv.cli train --fsdp --model gpt --preset gpt2-medium \
      --data corpus.txt --batch-size 64 --grad-accum 4 --activation-checkpointing \
      --precision bf16 --device cuda --out runs/big
  torchrun --nproc-per-node 2 -m qkv.cli train --resume runs/big   # any number of processes
  qkv export runs/big --out runs/big-model    # plain config.json + model.safetensors

--data: a TSV file (source<TAB>target per line) for --model transformer; plain UTF-8 text for
gpt / bert-mlm; for clip a folder of images with captions.tsv (file<TAB>caption per line).
--model clip trains only on --task shapes (the default for it) or such a folder; it reports
eval_loss, recall_at_1 (text -> image) and, for shapes, zero_shot_accuracy on the held-out
colour/shape combinations; --set vision.FIELD=V / text.FIELD=V set a tower's field.
--steps always counts the optimizer steps of the whole run. The run directory
holds run.json, metrics.jsonl and checkpoint/ (config.json, model.safetensors, tokenizer.json,
trainer state): load it with qkv.train.load_run(DIR) or Model.from_pretrained(DIR/checkpoint).
One process writes a run directory at a time (RUN/.lock while it trains); a second qkv train
on the same --out or --resume is refused, naming the holder's pid. Before anything is
written, settings, data, model sizes and memory are checked: what is refused leaves nothing.

Fine-tuning: --init-from RUN_OR_HF_DIR starts from a trained base (a qkv run or checkpoint,
or a HuggingFace directory qkv loads: GPT-2, BERT, Llama, Mistral, Qwen2/3, Gemma 1/2,
Phi-3, with its tokenizer.json; T5 / Flan-T5, BART, Marian with their tokenizer files —
tokenizer.json, spiece.model, or source.spm + target.spm + vocab.json); the base fixes the
model, tokenizer and max_len (--preset, --set, --tokenizer, --bpe-vocab-size are refused;
--model defaults to the base's kind). An encoder-decoder trains on --data pairs as
transformers does: sources and targets framed by its own tokenizer, the loss on the target
tokens (eos included), the decoder started at its decoder_start_token_id; its checkpoints
keep that tokenizer's files, which `qkv translate RUN` and load_run read.
--chat (gpt, with --init-from a base that has a chat template): --data holds pairs to
render with the base's template — a TSV of input<TAB>output lines (one user message each)
or a .jsonl of {"messages": [...]} conversations (the last message, the assistant's, is the
answer); each prompt is the template's (add_generation_prompt), followed by the answer and
the template's end-of-turn token, and the loss counts only those; a base without a chat
template is refused. With --lora / --adapters / --prefix only the new adapter trains
(qkv.peft) and the checkpoint holds the adapter and base.json (the base's path and
sha256): resume, translate, generate and attention refuse a changed base.
--lora KEYS: r (int), alpha, dropout, targets (roles joined by +: q k v qkv out ffn_in
gate up ffn_out down all-linear; gate/up: a gated FFN's halves), rslora (true/false).
--adapters KEYS: reduction_factor, placement (houlsby, pfeiffer, parallel), activation,
dropout, scaling. --prefix N: N prefix positions per layer.
Keys are comma-separated KEY=VALUE (--lora alone: the defaults). `qkv peft merge RUN --out
DIR` folds a LoRA run into a plain model directory.

Scale: --fsdp shards parameters, gradients and AdamW moments over the processes (FSDP2, one
group per Transformer layer plus the root; also in one process) and writes sharded (DCP)
checkpoints, one shard per process, that --resume continues on any number of processes;
`qkv export RUN --out DIR` gathers them into a plain model directory. --batch-size stays the
examples per optimizer step over all processes; --grad-accum K cuts each process's rows into
K micro-batches with one gradient sync (the same losses; --batch-size must divide by
processes x K; not with clip). --activation-checkpointing recomputes each layer in backward
(the same gradients, less memory). --precision bf16 computes in bf16 with fp32 master weights
and optimizer state, on CUDA and on CPUs where bf16 is native (AVX-512 BF16 / AMX, Arm BF16,
confirmed by a short matmul probe); on other CPUs it is refused with the measured speeds
unless --force-precision. fp16 is refused: it needs loss scaling. With --resume, --grad-accum
and --activation-checkpointing may change; --fsdp and --precision are fixed for a run.
Multi-node: torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint
HOST:PORT --rdzv-id JOB (a run directory every node sees); QKV_DIST_TIMEOUT (seconds, default
600) bounds every collective, so a rank that dies makes the others stop with an error instead
of hanging.
"""

#: (flag, TrainConfig field, type, help); every one defaults to the TrainConfig default
_SETTINGS: tuple[tuple[str, str, Any, str], ...] = (
    ("--model", "model", str, "transformer (default), gpt, bert-mlm or clip"),
    ("--preset", "preset", str, "model preset (default: transformer-tiny, gpt-tiny, bert-tiny, "
                                "clip-shapes)"),
    ("--task", "task", str, "embedded task: dates (default), copy, reverse, sort, addition, "
                            "dates-long; shapes (clip's, image-caption pairs)"),
    ("--data", "data", str, "a TSV pairs file (transformer), a text file (gpt, bert-mlm), a "
                            "folder of images with captions.tsv (clip); with --chat a TSV or "
                            ".jsonl of conversations"),
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
    ("--init-from", "init_from", str, "fine-tune a trained base: a qkv run/checkpoint or a "
                                      "HuggingFace directory (GPT-2, BERT, Llama, Mistral, "
                                      "Qwen2/3, Gemma 1/2, Phi-3, T5, BART, Marian)"),
)

#: --lora / --adapters keys -> (parser, what the value must be)
_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _lora_fields() -> dict[str, Any]:
    from ..peft import TARGETS
    from .checks import float_in, int_in

    def targets(text: str) -> list[str]:
        roles = [t.strip() for t in text.split("+")]
        bad = [t for t in roles if t not in TARGETS]
        if bad:
            raise argparse.ArgumentTypeError(f"roles joined by '+' from {'/'.join(TARGETS)}, "
                                             f"got {text!r}")
        return roles

    return {"r": int_in(1), "alpha": float_in(0, low_open=True),
            "dropout": float_in(0, 1, high_open=True), "targets": targets, "rslora": _bool}


def _adapter_fields() -> dict[str, Any]:
    from ..modules.feedforward import ACTIVATIONS
    from ..peft.adapters import PLACEMENTS
    from .checks import float_in

    return {"reduction_factor": _number(float_in(0, low_open=True)),
            "placement": _choice(PLACEMENTS), "activation": _choice(tuple(ACTIVATIONS)),
            "dropout": float_in(0, 1, high_open=True), "scaling": float_in()}


def _bool(text: str) -> bool:
    if text.strip().lower() not in _BOOLS:
        raise argparse.ArgumentTypeError(f"true or false, got {text!r}")
    return _BOOLS[text.strip().lower()]


def _choice(options: tuple[str, ...]) -> Any:
    def parse(text: str) -> str:
        if text not in options:
            raise argparse.ArgumentTypeError(f"one of {', '.join(options)}, got {text!r}")
        return text

    return parse


def _number(parse_float: Any) -> Any:
    """A float type that keeps integers as ints (reduction_factor=16 stays 16)."""

    def parse(text: str) -> float | int:
        value = parse_float(text)
        return int(value) if float(value).is_integer() else value

    return parse


def key_values(flag: str, kind: str, fields: Any) -> Any:
    """An argparse type for ``--lora r=8,alpha=16,targets=q+v``-style flags: comma-separated
    KEY=VALUE pairs, each KEY one of ``fields()`` (name -> an argparse type), giving
    ``{"kind": kind, KEY: value, ...}`` (a ``TrainConfig.peft``), checked whole with
    ``qkv.train.finetune.peft_config``. Errors name the flag's bad key or value (argparse
    prefixes ``argument FLAG:``)."""

    def parse(text: str) -> dict[str, Any]:
        from ..train.finetune import peft_config

        table = fields()
        out: dict[str, Any] = {"kind": kind}
        for item in (i.strip() for i in text.split(",")):
            if not item:
                continue
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or not key:
                raise argparse.ArgumentTypeError(f"expects KEY=VALUE pairs separated by commas "
                                                 f"({', '.join(table)}), got {item!r}")
            if key not in table:
                raise argparse.ArgumentTypeError(f"unknown key {key!r} (known: "
                                                 f"{', '.join(table)})")
            if key in out:
                raise argparse.ArgumentTypeError(f"key {key!r} given twice")
            try:
                out[key] = table[key](value.strip())
            except argparse.ArgumentTypeError as exc:
                raise argparse.ArgumentTypeError(f"{key}={value}: must be {exc}".replace(
                    "must be must be", "must be")) from None
        try:
            peft_config(out)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return out

    parse.__name__ = f"{flag} KEY=VALUE list"
    return parse


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``qkv train`` to the command parsers."""
    p = sub.add_parser("train", help="train a model on a task or your data",
                       description=__doc__, epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, field, kind, text in _SETTINGS:
        p.add_argument(flag, dest=field, type=kind, default=None, help=text)
    from .checks import int_in

    peft = p.add_mutually_exclusive_group()
    peft.add_argument("--lora", nargs="?", const={"kind": "lora"}, default=None,
                      type=key_values("--lora", "lora", _lora_fields), metavar="KEY=VALUE,...",
                      help="with --init-from: train a LoRA adapter only, e.g. "
                           "r=8,alpha=16,targets=q+v (keys: r, alpha, dropout, targets, rslora)")
    peft.add_argument("--adapters", nargs="?", const={"kind": "adapters"}, default=None,
                      type=key_values("--adapters", "adapters", _adapter_fields),
                      metavar="KEY=VALUE,...",
                      help="with --init-from: train bottleneck adapters only, e.g. "
                           "reduction_factor=16,placement=houlsby (keys: reduction_factor, "
                           "placement, activation, dropout, scaling)")
    peft.add_argument("--prefix", type=int_in(1), default=None, metavar="N",
                      help="with --init-from: train N-position key/value prefixes only")
    scale = p.add_argument_group("scale (see below)")
    scale.add_argument("--fsdp", action="store_const", const=True, default=None,
                       help="shard parameters, gradients and optimizer state over the "
                            "processes (FSDP2); sharded checkpoints that resume on any number "
                            "of processes")
    scale.add_argument("--grad-accum", dest="grad_accum", type=int_in(1), default=None,
                       metavar="K", help="K micro-batches per optimizer step, one gradient "
                                         "sync (default 1); --batch-size must divide by "
                                         "processes x K")
    scale.add_argument("--activation-checkpointing", dest="activation_checkpointing",
                       action="store_const", const=True, default=None,
                       help="recompute each layer's activations in backward (less memory, "
                            "the same gradients)")
    scale.add_argument("--precision", default=None, choices=("fp32", "bf16", "fp16"),
                       help="fp32 (default) or bf16 compute with fp32 master weights (CUDA, "
                            "or a CPU with native bf16); fp16 is refused (needs loss scaling)")
    scale.add_argument("--force-precision", action="store_true",
                       help="allow --precision bf16 on a CPU without native bf16 (refused "
                            "there with the measured bf16 and fp32 matmul speeds)")
    p.add_argument("--chat", action="store_const", const=True, default=None,
                   help="with --init-from a base with a chat template: --data holds pairs "
                        "(TSV input<TAB>output, or .jsonl {\"messages\": [...]}) rendered "
                        "with the template; the loss counts the answers only (see below)")
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


#: the scale settings (TrainConfig fields, flags of their own kinds)
_SCALE = ("fsdp", "grad_accum", "activation_checkpointing", "precision")
#: TrainConfig field -> the flag that sets it
_FLAGS = {field: flag for flag, field, _, _ in _SETTINGS} | {
    "overrides": "--set", "peft": "--lora/--adapters/--prefix", "chat": "--chat",
    **{field: "--" + field.replace("_", "-") for field in _SCALE}}


def _peft(args: argparse.Namespace) -> dict[str, Any] | None:
    """The TrainConfig.peft of --lora / --adapters / --prefix (at most one: argparse)."""
    if args.lora is not None:
        return dict(args.lora)
    if args.adapters is not None:
        return dict(args.adapters)
    if args.prefix is not None:
        return {"kind": "prefix", "num_tokens": args.prefix}
    return None


def _check_init_from(args: argparse.Namespace, given: dict[str, Any]) -> None:
    """Refuse what the base fixes; --model defaults to the base's kind."""
    from ..train.finetune import base_model_kind
    from . import UserError

    fixed = [flag for flag, field in (("--preset", "preset"), ("--tokenizer", "tokenizer"),
                                      ("--bpe-vocab-size", "bpe_vocab_size"))
             if field in given] + (["--set"] if args.overrides else [])
    if fixed:
        raise UserError(f"--init-from {given['init_from']}: the base fixes the architecture and "
                        f"tokenizer; leave out {', '.join(fixed)}")
    if "model" not in given:
        given["model"] = base_model_kind(given["init_from"])


def _own_tasks(model: str | None) -> tuple[str, ...] | None:
    """The tasks only ``model``'s kind trains (clip: shapes); None for the text kinds or an
    unknown kind (which TrainConfig names)."""
    from ..train.kinds import KINDS

    kind = KINDS.get(model) if isinstance(model, str) else None
    return None if kind is None else kind.tasks


def _run(args: argparse.Namespace) -> int:
    from ..train.config import ConfigError
    from ..train.trainer import RunInterrupted
    from . import UserError

    try:
        return _train(args)
    except ConfigError as exc:  # name the flag a user typed, not only the field
        flag = _FLAGS.get(exc.field)
        raise UserError(f"{flag}: {exc}" if flag else str(exc)) from exc
    except RunInterrupted as exc:  # Ctrl-C or SIGTERM while the Trainer was set up
        return _interrupted(exc, main=os.environ.get("RANK", "0") == "0")


def _interrupted(exc: Any, *, main: bool) -> int:
    """A ``RunInterrupted`` (Ctrl-C or SIGTERM, the clean-up done): its line on stderr (the
    main process), exit status 128 + the signal (130 for SIGINT, 143 for SIGTERM)."""
    if main:
        print(f"qkv train: {exc}", file=sys.stderr)
    return 128 + exc.signum


def _train(args: argparse.Namespace) -> int:
    from ..train import TrainConfig, Trainer, TrainingError
    from . import UserError

    given = {field: getattr(args, field) for _, field, _, _ in _SETTINGS
             if getattr(args, field) is not None}
    scale = {field: getattr(args, field) for field in _SCALE if getattr(args, field) is not None}
    progress = not args.no_progress
    if args.resume:
        extra = sorted(_FLAGS.get(f, f) for f in set(given) - {"steps"}) + (
            ["--set"] if args.overrides else []) + (["--out"] if args.out else [])
        extra += [f for f in ("--lora", "--adapters", "--prefix", "--chat")
                  if getattr(args, f[2:]) is not None]
        if extra:
            raise UserError(f"--resume continues a run with its own settings; only --steps may "
                            f"be given with it, and --grad-accum / --activation-checkpointing "
                            f"(got {', '.join(extra)})")
        trainer = Trainer.resume(args.resume, steps=given.get("steps"), progress=progress,
                                 device=args.device,
                                 accept_changed_data=args.accept_changed_data,
                                 force_precision=args.force_precision, **scale)
        out = Path(args.resume)
    else:
        if args.accept_changed_data:
            raise UserError("--accept-changed-data goes with --resume (a new run records the "
                            "data file as it is)")
        if "data" in given and "task" not in given:
            given["task"] = None
        if "data" not in given and "task" not in given:  # a kind's own task (clip: shapes)
            tasks = _own_tasks(given.get("model"))
            if tasks:
                given["task"] = tasks[0]
        if "data" in given:
            _check_data_path(given["data"])
        if args.chat:
            given["chat"] = True
        peft = _peft(args)
        if peft is not None and "init_from" not in given:
            flag = {"lora": "--lora", "adapters": "--adapters", "prefix": "--prefix"}[
                peft["kind"]]
            raise UserError(f"{flag} needs --init-from RUN_OR_HF_DIR: an adapter trains on a "
                            f"frozen, trained base")
        if "init_from" in given:
            _check_init_from(args, given)
        config = TrainConfig(**given, **scale, overrides=_overrides(args.overrides), peft=peft)
        stem = Path(config.data).stem if config.data else config.task
        out = Path(args.out or f"runs/{config.model}-{stem}-{time.strftime('%Y%m%d-%H%M%S')}")
        trainer = Trainer(config, out, progress=progress, device=args.device,
                          force_precision=args.force_precision)
    if trainer.world.is_main:
        from ..peft import trainable_summary
        from ..train.finetune import PEFT_LABELS

        n = sum(p.numel() for p in trainer.model.parameters())
        c = trainer.config
        start = f" from {c.init_from}" if c.init_from else ""
        adapter = f" + {PEFT_LABELS[c.peft['kind']][0]}" if c.peft else ""
        print(f"qkv train: {c.model}{adapter} ({n / 1e6:.2f}M parameters){start} on "
              f"{trainer.device}, steps {trainer.step} -> {c.steps}, run directory {out}")
        print(f"qkv train: {trainable_summary(trainer.model)}")
        if c.fsdp or c.grad_accum > 1 or c.activation_checkpointing or c.precision != "fp32":
            print(f"qkv train: fsdp {c.fsdp} over {trainer.world.size} process(es), "
                  f"grad-accum {c.grad_accum}, activation checkpointing "
                  f"{c.activation_checkpointing}, precision {c.precision}")
        if c.precision == "bf16" and trainer.device.type == "cpu":  # what decided it
            from ..train.precision import cpu_bf16

            print(f"qkv train: bf16 on the CPU: {cpu_bf16()}")
    from ..train.trainer import RunInterrupted

    try:
        result = trainer.run()
    except TrainingError as exc:
        raise UserError(str(exc)) from exc
    except RunInterrupted as exc:  # Ctrl-C or SIGTERM: lock released, last checkpoint named
        status = _interrupted(exc, main=trainer.world.is_main)
        if trainer.group_outlives_run and _is_cli_process():
            _end_process(status)
        return status
    if trainer.world.is_main:
        shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in result.items())
        print(f"qkv train: done ({shown}); checkpoint in {out / 'checkpoint'}")
    if trainer.group_outlives_run and _is_cli_process():
        _end_process(0)
    return 0


def _check_data_path(data: str) -> None:
    """--data must be a directory (clip's image folder) or a regular file, checked before
    anything reads it: a device (``/dev/zero``), a FIFO or a pipe (``<(cat f)``) would be
    read forever or consumed by the fingerprint before training reads it."""
    from ..data.files import regular_file
    from . import UserError

    path = Path(data)
    if not path.exists():
        raise UserError(f"--data {data}: no such file or directory")
    if not path.is_dir():
        regular_file(path, name="--data")


def _is_cli_process() -> bool:
    """Whether this process is the ``qkv`` command itself (``python -m qkv.cli``, what
    torchrun runs, or the ``qkv`` script), not a program that called ``qkv.cli.main``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return (spec is not None and spec.name == "qkv.cli.__main__") or (
        Path(sys.argv[0]).name == "qkv")


def _end_process(status: int) -> None:
    """End the process now with ``status``, after flushing stdout and stderr, skipping the
    interpreter's shutdown. Only after a successful run whose process group outlived it (a
    sharded model: torch's DTensor caches keep the group, so ``destroy_process_group``
    cannot free it and gloo's worker threads keep running). At shutdown such a thread that
    releases its last collective's tensors asks for the GIL; CPython then ends it with
    ``pthread_exit``, which unwinds through gloo's noexcept destructor into
    ``std::terminate`` ("terminate called without an active exception", SIGABRT) although
    the run finished. Everything of the run is written and closed by then (the checkpoint
    and metrics are fsynced or flushed, the lock released, every rank met at a barrier)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
