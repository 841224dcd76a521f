"""``qkv peft merge RUN --out DIR``: fold the LoRA adapter of a ``qkv train --lora`` run into
its base and write a plain model directory (config.json + model.safetensors +
tokenizer.json + run.json), loadable by ``Model.from_pretrained(DIR)`` and
``qkv.train.load_run(DIR)``, whose outputs equal the adapted model's (within fp32 rounding)
at the base model's inference cost. Bottleneck adapters and prefixes add computation of
their own and cannot be merged."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

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
    from ..models.hub import atomic_write
    from ..outputs import new_output_dir
    from ..peft import adapter_file_kind, merge, unload
    from ..train.checkpoint import find_checkpoint, load_run, read_run_info
    from ..train.finetune import is_adapter_checkpoint
    from . import UserError

    ckpt = find_checkpoint(args.run)
    if not is_adapter_checkpoint(ckpt):
        raise UserError(f"{args.run} holds a whole model, not an adapter run (`qkv train "
                        f"--init-from BASE --lora ...`): there is nothing to merge")
    kind = adapter_file_kind(ckpt)
    if kind != "lora":
        what = "bottleneck adapters add layers" if kind == "bottleneck" else \
            "a prefix adds key/value positions"
        raise UserError(f"{args.run} trained a {kind} adapter; only LoRA merges into the base "
                        f"weights ({what} of their own, which a plain model does not have)")
    model, tokenizer = load_run(ckpt)  # checks the base is there and unchanged
    out = new_output_dir(args.out)
    merge(model)
    unload(model)
    model.save_pretrained(out)
    tokenizer.save(out / "tokenizer.json")
    info = read_run_info(args.run)
    if info:  # how `qkv generate` frames prompts (a pair task or text), as the run trained
        info = {**info, "init_from": None, "peft": None}
        text = json.dumps(info, indent=2, sort_keys=True, ensure_ascii=False)
        atomic_write(out / "run.json", lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    print(f"qkv peft merge: {args.run} (LoRA) + its base -> {out} (config.json, "
          f"model.safetensors, tokenizer.json)")
    return 0
