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

``--format hf`` writes a HuggingFace directory instead (``qkv.models.hf_export.to_hf``):
config.json + model.safetensors that ``transformers.AutoModelForCausalLM`` (a GPT: as GPT-2,
Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2 or Phi-3, chosen from its config or by
``--hf-type``), ``BertForMaskedLM`` / ``BertModel`` (a BERT) or ``AutoModelForSeq2SeqLM``
(an encoder-decoder Transformer: as T5, BART or Marian, by its positions or ``--hf-type``;
with a generation_config.json of its start / eos / pad ids) loads with the same logits.
RUN may then also be a model directory (qkv's or HF's, anything
``qkv.models.from_pretrained`` loads). The source's HF tokenizer files (tokenizer.json,
tokenizer_config.json, special_tokens_map.json, generation_config.json, chat_template.jinja,
vocabularies, T5's spiece.model, Marian's source.spm / target.spm / vocab.json /
target_vocab.json) are copied; a qkv BPE tokenizer becomes HF's tokenizer.json (with a
tokenizer_config.json for ``PreTrainedTokenizerFast``); a qkv char or word tokenizer has no HF
form and is left out (the message says so). A model no HF class computes exactly (linear
attention, a window on layers its family does not window, ALiBi positions...) is refused
with the reason.
"""

from __future__ import annotations

import argparse
import json
import shutil
import warnings
from pathlib import Path

EXAMPLES = """examples:
  torchrun --nproc-per-node 8 -m qkv.cli train --fsdp --model gpt --data corpus.txt --out runs/big
  qkv export runs/big --out runs/big-model
  qkv generate runs/big-model --prompt "Once upon a time"
  qkv export runs/big --format hf --out runs/big-hf        # transformers loads runs/big-hf
  qkv export path/to/hf-phi3 --format hf --hf-type phi3 --out phi3-again
  qkv export runs/translate --format hf --out runs/translate-hf   # a MarianMTModel
"""

#: files of a plain checkpoint that belong to the training state, not to the model
_TRAINER_FILES = frozenset({"trainer_state.json", "trainer_state.safetensors"})


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``qkv export`` to the command parsers."""
    p = sub.add_parser("export", help="write a run's model as a plain config.json + "
                                      "model.safetensors directory (also from --fsdp runs)",
                       description=__doc__, epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="run directory of `qkv train` (or its checkpoint directory; "
                               "with --format hf also a qkv or HF model directory)")
    p.add_argument("--out", required=True, help="the model directory to write (new or empty)")
    p.add_argument("--format", choices=("qkv", "hf"), default="qkv",
                   help="qkv: the run's own model files (default); hf: a HuggingFace "
                        "directory transformers loads")
    p.add_argument("--hf-type", default=None, metavar="MODEL_TYPE",
                   help="with --format hf: the HF model_type to write (gpt2, llama, mistral, "
                        "qwen2, qwen3, gemma, gemma2, phi3, bert; t5, bart, marian for an "
                        "encoder-decoder); default: the source's when it is an HF directory, "
                        "else chosen from the model's config")
    p.set_defaults(func=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    from . import UserError

    if args.format == "hf":
        return _run_export_hf(args)
    if args.hf_type is not None:
        raise UserError("--hf-type is for --format hf")
    return _run_export_qkv(args)


def _hf_source(ckpt: Path) -> tuple[str | None, dict]:
    """(the source's HF model_type when its config.json is an HF one qkv exports, its
    bos/eos/pad (and an encoder-decoder's decoder_start) token ids)."""
    from ..files import read_json
    from ..models.hf_export import EXPORT_MODEL_TYPES
    from ..models.hf_export_seq2seq import SEQ2SEQ_EXPORT_TYPES

    data = read_json(ckpt / "config.json") if (ckpt / "config.json").is_file() else {}
    if data.get("model_type") not in EXPORT_MODEL_TYPES:
        return None, {}
    names = ("bos_token_id", "eos_token_id", "pad_token_id") + (
        ("decoder_start_token_id",) if data["model_type"] in SEQ2SEQ_EXPORT_TYPES else ())
    ids = {k: data[k] for k in names if data.get(k) is not None}
    return data["model_type"], ids


def _write_tokenizer(ckpt: Path, out: Path) -> tuple[str, dict]:
    """The source's tokenizer files into ``out`` (generation_config.json aside): (a note on
    what was left out, the special-token ids of a qkv tokenizer)."""
    from ..data.files import DataError
    from ..data.tokenizer import BPETokenizer, read_tokenizer
    from ..data.tokenizer_base import SPECIALS
    from ..files import atomic_write
    from ..models.hf_export import GENERATION_CONFIG_NAME, TOKENIZER_FILES, copy_tokenizer_files

    src = ckpt / "tokenizer.json"
    names = tuple(n for n in TOKENIZER_FILES if n != GENERATION_CONFIG_NAME)  # after to_hf
    if not src.is_file():
        copy_tokenizer_files(ckpt, out, names)
        return "", {}
    try:
        tok = read_tokenizer(src)
    except DataError:  # not qkv's format: an HF tokenizer.json, copied as it is
        copy_tokenizer_files(ckpt, out, names)
        return "", {}
    names = tuple(n for n in names if n not in ("tokenizer.json", "tokenizer_config.json"))
    copy_tokenizer_files(ckpt, out, names)
    ids = {name: SPECIALS.index(token) for name, token in (
        ("pad_token_id", "<pad>"), ("bos_token_id", "<bos>"), ("eos_token_id", "<eos>"))}
    if not isinstance(tok, BPETokenizer):
        return (f"; its {tok.kind} tokenizer is qkv's own format, with no HF form: not "
                f"written"), ids
    text = tok.hf.to_str()
    atomic_write(out / "tokenizer.json", lambda tmp: Path(tmp).write_text(text, "utf-8"))
    pad, bos, eos, unk = SPECIALS
    config = json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": pad,
                         "bos_token": bos, "eos_token": eos, "unk_token": unk}, indent=2)
    atomic_write(out / "tokenizer_config.json", lambda tmp: Path(tmp).write_text(config))
    return "", ids


def _run_export_hf(args: argparse.Namespace) -> int:
    from ..models import Transformer, from_pretrained
    from ..models.hf_export import (
        GENERATION_CONFIG_NAME,
        copy_tokenizer_files,
        hf_config_for,
        to_hf,
    )
    from ..outputs import new_output_dir
    from ..peft import adapter_file_kind
    from ..train.checkpoint import find_checkpoint
    from ..train.finetune import is_adapter_checkpoint
    from . import UserError

    ckpt = find_checkpoint(args.run)
    if is_adapter_checkpoint(ckpt):
        kind = adapter_file_kind(ckpt)
        how = (f"`qkv peft merge {args.run} --out DIR` writes its plain model, which `qkv "
               f"export DIR --format hf` exports" if kind == "lora" else
               "its adapters compute what no plain HF model does")
        raise UserError(f"{args.run} holds a {kind} adapter, not a whole model: {how}")
    source_type, ids = _hf_source(ckpt)
    model = from_pretrained(ckpt)
    wanted = args.hf_type if args.hf_type is not None else source_type
    try:
        with warnings.catch_warnings():  # to_hf warns, once
            warnings.simplefilter("ignore")
            hf_config_for(model.config, model_type=wanted)  # refuse before writing anything
    except TypeError as err:
        raise UserError(f"{args.run}: {type(model).__name__} has no HF export "
                        f"(GPT, BERT and encoder-decoder Transformer models do)") from err
    existed = Path(args.out).exists()
    out = new_output_dir(args.out)
    try:
        note, qkv_ids = _write_tokenizer(ckpt, out)
        if isinstance(model, Transformer):  # its config holds pad, eos and the start id
            qkv_ids = {}
        to_hf(model, out, model_type=wanted, token_ids={**qkv_ids, **ids} or None)
        # the source's generation defaults, over the token ids to_hf wrote
        copy_tokenizer_files(ckpt, out, (GENERATION_CONFIG_NAME,))
    except BaseException:
        for path in out.iterdir():  # the directory was new or empty: only our files
            path.unlink()
        if not existed:
            out.rmdir()
        raise
    model_type = json.loads((out / "config.json").read_text())["model_type"]
    names = ", ".join(sorted(p.name for p in out.iterdir()))
    print(f"qkv export: {args.run} -> {out} (HuggingFace {model_type!r}: {names}){note}")
    return 0


def _run_export_qkv(args: argparse.Namespace) -> int:
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
