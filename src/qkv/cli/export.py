"""``qkv export RUN --out DIR``: the plain model directory of a run — config.json +
model.safetensors (+ tokenizer.json, run.json and a model kind's own JSON files), loadable by
``Model.from_pretrained(DIR)`` and ``qkv.train.load_run(DIR)`` — from its latest checkpoint.

A sharded checkpoint (``qkv train --fsdp``: DCP shards, one per rank) is gathered into whole
tensors on this one process (no torchrun, no process group; it needs the memory of the whole
model). A plain checkpoint's model files are copied as they are. The trainer state (optimizer
moments, RNG) is not exported: the result is for inference and fine-tuning, not ``--resume``.
An adapter run: a LoRA run (``--lora``) is refused, pointing to ``qkv peft merge``, which
makes its plain model. Bottleneck adapters (``--adapters``) and prefixes (``--prefix``) add
computation of their own and cannot become plain weights; their export is the adapter
directory — adapter_config.json, adapter_model.safetensors, base.json (the base's path and
fingerprint), tokenizer.json, run.json — which ``qkv generate DIR`` / ``qkv translate DIR`` /
``qkv.train.load_run(DIR)`` load onto the base, as they load the run itself; the base must
stay where base.json says, unchanged.
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
    from ..files import atomic_write, read_json
    from ..outputs import new_output_dir
    from ..peft import adapter_file_kind
    from ..train.checkpoint import find_checkpoint
    from ..train.finetune import check_base, is_adapter_checkpoint
    from ..train.sharded_checkpoint import export_sharded, is_sharded_checkpoint
    from . import UserError
    from .peft import UNMERGEABLE

    ckpt = find_checkpoint(args.run)
    sharded = is_sharded_checkpoint(ckpt)
    adapter = None
    if not sharded and not (ckpt / "model.safetensors").is_file():
        if not is_adapter_checkpoint(ckpt):
            raise UserError(f"{ckpt}: no model.safetensors and no sharded state to export")
        adapter = adapter_file_kind(ckpt)
        if adapter == "lora":
            raise UserError(f"{args.run} trained a LoRA adapter, not a whole model: `qkv peft "
                            f"merge {args.run} --out DIR` writes its plain model (the adapter "
                            f"merged into the base weights)")
        check_base(ckpt)  # the copy names the same base: refuse now if it changed
    out = new_output_dir(args.out)
    if adapter is not None:
        for src in sorted(ckpt.iterdir()):
            if src.is_file() and src.name not in _TRAINER_FILES:
                atomic_write(out / src.name, lambda p, s=src: shutil.copyfile(s, p))
        base = read_json(ckpt / "base.json")["path"]
        names = ", ".join(sorted(p.name for p in Path(out).iterdir()))
        print(f"qkv export: {args.run} -> {out} (its {adapter} adapter with its base "
              f"reference: {names}); {UNMERGEABLE[adapter]}, so this is no plain "
              f"model: `qkv generate {out}` and qkv.train.load_run load it onto the base "
              f"{base}, which must stay there unchanged")
        return 0
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
