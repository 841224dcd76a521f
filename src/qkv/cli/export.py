"""``qkv export RUN --out DIR``: the plain model directory of a run — config.json +
model.safetensors (+ tokenizer.json, run.json and a model kind's own JSON files), loadable by
``Model.from_pretrained(DIR)`` and ``qkv.train.load_run(DIR)`` — from its latest checkpoint.

A sharded checkpoint (``qkv train --fsdp``: DCP shards, one per rank) is gathered into whole
tensors on this one process (no torchrun, no process group; it needs the memory of the whole
model). A plain checkpoint's model files are copied as they are. The trainer state (optimizer
moments, RNG) is not exported: the result is for inference and fine-tuning, not ``--resume``.
An adapter run (``--lora``...) is refused: ``qkv peft merge`` makes its plain model.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

EXAMPLES = """examples:
  torchrun --nproc-per-node 8 -m qkv.cli train --fsdp --model gpt --data corpus.txt --out runs/big
  qkv export runs/big --out runs/big-model
  qkv generate runs/big-model --prompt "Once upon a time"
"""

#: files of a plain checkpoint that belong to the training state, not to the model
_TRAINER_FILES = frozenset({"trainer_state.json", "trainer_state.safetensors"})


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``qkv export`` to the command parsers."""
    p = sub.add_parser("export", help="write a run's model as a plain config.json + "
                                      "model.safetensors directory (also from --fsdp runs)",
                       description=__doc__, epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="run directory of `qkv train` (or its checkpoint directory)")
    p.add_argument("--out", required=True, help="the model directory to write (new or empty)")
    p.set_defaults(func=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    from ..models.hub import atomic_write
    from ..outputs import new_output_dir
    from ..train.checkpoint import find_checkpoint
    from ..train.sharded_checkpoint import export_sharded, is_sharded_checkpoint
    from . import UserError

    ckpt = find_checkpoint(args.run)
    sharded = is_sharded_checkpoint(ckpt)
    if not sharded and not (ckpt / "model.safetensors").is_file():
        if (ckpt / "adapter_config.json").is_file():
            raise UserError(f"{args.run} trained an adapter, not a whole model: `qkv peft "
                            f"merge {args.run} --out DIR` writes its plain model")
        raise UserError(f"{ckpt}: no model.safetensors and no sharded state to export")
    out = new_output_dir(args.out)
    if sharded:
        export_sharded(ckpt, out)
        how = "gathered from its sharded checkpoint"
    else:
        for src in sorted(ckpt.iterdir()):
            if src.is_file() and src.name not in _TRAINER_FILES:
                atomic_write(out / src.name, lambda p, s=src: shutil.copyfile(s, p))
        how = "copied from its checkpoint"
    names = ", ".join(sorted(p.name for p in Path(out).iterdir()))
    print(f"qkv export: {args.run} -> {out} ({how}: {names})")
    return 0
