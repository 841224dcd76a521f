"""``qkv peft merge RUN --out DIR``: fold the LoRA adapter of a ``qkv train --lora`` run into
its base and write a plain model directory (config.json + model.safetensors +
tokenizer.json + run.json), loadable by ``Model.from_pretrained(DIR)`` and
``qkv.train.load_run(DIR)``, whose outputs equal the adapted model's (within fp32 rounding)
at the base model's inference cost. Bottleneck adapters and prefixes add computation of
their own and cannot be merged into plain weights: such a run is used as it is (``qkv
generate RUN``, ``qkv translate RUN``, ``qkv.train.load_run(RUN)`` put the adapter on its
base), and ``qkv export RUN --out DIR`` copies the adapter with its base reference."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: what each adapter kind adds that a plain model lacks (why it cannot be merged)
UNMERGEABLE = {"bottleneck": "bottleneck adapters add layers of their own",
               "prefix": "a prefix adds key/value positions of its own"}


def no_plain_model(run: str, kind: str) -> str:
    """The one-line refusal for making a plain model of a ``kind`` (bottleneck / prefix)
    adapter run, with what to do instead."""
    return (f"{run} trained a {kind} adapter; only LoRA merges into the base weights "
            f"({UNMERGEABLE[kind]}, which a plain model does not have), so there "
            f"is no plain model to write: use the run as it is (`qkv generate {run}`, `qkv "
            f"translate {run}` or qkv.train.load_run put the adapter on its base), or copy it "
            f"with its base reference by `qkv export {run} --out DIR`")


EXAMPLES = """examples:
  qkv train --task dates-long --init-from runs/dates --lora r=8,targets=q+v --out runs/long
  qkv peft merge runs/long --out runs/long-merged
  qkv translate runs/long-merged --input "March 3, 2021"
"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``qkv peft`` (subcommand ``merge``) to the command parsers."""
    p = sub.add_parser("peft", help="adapter runs: merge a LoRA run into a plain model",
                       description=__doc__, epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    m = verbs.add_parser("merge", help="fold a LoRA run's adapter into its base",
                         description=__doc__, epilog=EXAMPLES,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    m.add_argument("run", help="run directory of `qkv train --init-from ... --lora ...` (or its "
                               "checkpoint directory)")
    m.add_argument("--out", required=True,
                   help="the merged model's directory (new or empty)")
    m.set_defaults(func=_run_merge)


def _run_merge(args: argparse.Namespace) -> int:
    from ..files import atomic_write
    from ..outputs import new_output_dir
    from ..peft import adapter_file_kind, merge, unload
    from ..train.checkpoint import find_checkpoint, load_run, read_run_info
    from ..train.finetune import is_adapter_checkpoint
    from ..train.hf_seq2seq import save_run_tokenizer
    from . import UserError

    ckpt = find_checkpoint(args.run)
    if not is_adapter_checkpoint(ckpt):
        raise UserError(f"{args.run} holds a whole model, not an adapter run (`qkv train "
                        f"--init-from BASE --lora ...`): there is nothing to merge")
    kind = adapter_file_kind(ckpt)
    if kind != "lora":
        raise UserError(no_plain_model(args.run, kind))
    model, tokenizer = load_run(ckpt)  # checks the base is there and unchanged
    out = new_output_dir(args.out)
    merge(model)
    unload(model)
    model.save_pretrained(out)
    save_run_tokenizer(tokenizer, out)  # a Seq2SeqTokenizer writes its own files
    info = read_run_info(args.run)
    if info:  # how `qkv generate` frames prompts (a pair task or text), as the run trained
        info = {**info, "init_from": None, "peft": None}
        text = json.dumps(info, indent=2, sort_keys=True, ensure_ascii=False)
        atomic_write(out / "run.json", lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    written = ", ".join(("config.json", "model.safetensors",
                         *getattr(tokenizer, "files", ("tokenizer.json",))))
    print(f"qkv peft merge: {args.run} (LoRA) + its base -> {out} ({written})")
    return 0
