"""Run directories and checkpoints — safetensors + JSON only, written atomically.

A run directory written by ``qkv train --out RUN``::

    RUN/.lock                  while a process writes RUN: its pid (``qkv.train.rundir``)
    RUN/run.json               the training configuration (what ``--resume`` continues),
                               with the data file's size and SHA-256
    RUN/metrics.jsonl          one JSON object per logged step / evaluation
    RUN/checkpoint/            the latest checkpoint, complete and self-contained:
        config.json, model.safetensors   the model (``Model.from_pretrained(RUN/checkpoint)``)
                                         — or, for a run with ``peft`` (``qkv.train.finetune``):
        adapter_config.json,             the adapter only (``qkv.peft.load_adapter``), and
        adapter_model.safetensors, base.json  the base it adapts: {path, sha256 of weights,
                                         config_sha256}
        tokenizer.json                   the ``qkv.data`` tokenizer (a HuggingFace base's
                                         own files instead: tokenizer.json and
                                         tokenizer_config.json, or an encoder-decoder's
                                         spiece.model / Marian's source.spm + target.spm +
                                         vocab.json: ``qkv.train.hf_seq2seq``)
        (kind's own JSON files)          e.g. clip: preprocessor_config.json (images)
        run.json                         a copy of the training configuration
        trainer_state.json               step, data position, optimizer hyper-parameters
        trainer_state.safetensors        optimizer moments, RNG state

A checkpoint is written into ``RUN/checkpoint.tmp`` and then swapped in by renames
(``checkpoint`` -> ``checkpoint.old``, ``checkpoint.tmp`` -> ``checkpoint``, old removed):
a process killed at any point leaves a complete checkpoint under ``checkpoint`` or, between
the two renames, ``checkpoint.old``, which ``find_checkpoint`` falls back to. Every file of
the new checkpoint and its directory are fsynced before the renames, and the run directory
after them, so a power cut cannot leave a renamed-in checkpoint whose files are still empty.
Only one process writes a run directory at a time (``qkv.train.rundir.RunDirLock``).
``find_checkpoint`` and the three directory names are ``qkv.train.rundir``'s, named here too.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..files import CheckpointError, atomic_write, read_json
from ..models import from_pretrained, registry
from .hf_seq2seq import save_run_tokenizer
from .kinds import get_kind
from .rundir import CHECKPOINT_DIR, OLD_DIR, TMP_DIR, find_checkpoint

__all__ = ["CHECKPOINT_DIR", "MODEL_CLASSES", "OLD_DIR", "TMP_DIR", "find_checkpoint", "load_run",
           "load_trainer_state", "read_run_info", "save_checkpoint", "trained_on_pairs"]

_TMP, _OLD = TMP_DIR, OLD_DIR
STATE_JSON, STATE_TENSORS = "trainer_state.json", "trainer_state.safetensors"

#: config.json ``model_type`` -> model class, qkv's own and HF's: the one table of model types
#: (``qkv.models.registry``), as a dict
MODEL_CLASSES: dict[str, type[nn.Module]] = {
    t: registry.model_class(t) for t in registry.known_model_types()}


def _fsync(path: Path) -> None:
    """Flush a file or a directory (its entries: renames, new files) to the disk. A
    directory that cannot be opened for syncing (some platforms) is skipped."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if Path(path).is_dir():
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not Path(path).is_dir():
            raise
    finally:
        os.close(fd)


def _write_json(path: Path, data: Any) -> None:
    text = json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Split ``optimizer.state_dict()`` into safetensors-able tensors and a JSON part."""
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, entry in sd["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{idx}.{name}"] = value.detach().cpu().contiguous().clone()
            else:
                scalars.setdefault(str(idx), {})[name] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars,
                     "state_keys": {str(i): sorted(e) for i, e in sd["state"].items()}}


def save_checkpoint(run_dir: str | os.PathLike, *, model: nn.Module, tokenizer: Any,
                    optimizer: torch.optim.Optimizer, step: int, run_info: dict[str, Any],
                    data_position: int, base: dict[str, str] | None = None,
                    extra_files: dict[str, Any] | None = None) -> Path:
    """Write a complete checkpoint of a run at optimizer step ``step`` and swap it in
    atomically (see the module docstring). Returns the checkpoint directory.

    ``model`` may be wrapped (DistributedDataParallel): its ``.module`` is saved.
    ``run_info`` is the JSON training configuration; ``data_position`` the number of
    training examples consumed so far (documentation: batches are a function of the step).
    ``base``: for a run that trains an adapter, base.json's ``{"path", "sha256"}``; then only
    the active adapter is saved (``qkv.peft.save_adapter``), never the base weights.
    ``extra_files``: more JSON files (name -> content) the model kind keeps beside the model
    (``ModelKind.checkpoint_files``).
    """
    run_dir = Path(run_dir)
    model = getattr(model, "module", model)
    tmp, final, old = run_dir / _TMP, run_dir / CHECKPOINT_DIR, run_dir / _OLD
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    if base is None:
        model.save_pretrained(tmp)
    else:
        from ..peft import save_adapter

        save_adapter(model, tmp)
        _write_json(tmp / "base.json", base)
    save_run_tokenizer(tokenizer, tmp)
    for name, content in (extra_files or {}).items():
        _write_json(tmp / name, content)
    _write_json(tmp / "run.json", run_info)
    tensors, opt_json = _optimizer_tensors(optimizer)
    tensors["rng.torch"] = torch.get_rng_state()
    device = next(model.parameters()).device
    if device.type == "cuda":  # dropout on CUDA draws from the device's generator
        tensors["rng.cuda"] = torch.cuda.get_rng_state(device)
    atomic_write(tmp / STATE_TENSORS, lambda path: save_file(tensors, path))
    _write_json(tmp / STATE_JSON, {"step": step, "data_position": data_position,
                                   "optimizer": opt_json})
    for path in sorted(tmp.iterdir()):  # durable before it becomes the checkpoint
        if path.is_file():
            _fsync(path)
    _fsync(tmp)
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync(run_dir)
    if old.exists():
        shutil.rmtree(old)
    return final


def load_run(path: str | os.PathLike) -> tuple[nn.Module, Any]:
    """Load a run directory (or a checkpoint directory) written by ``qkv train``.

    Returns:
        ``(model, tokenizer)``: the model (``Transformer``, ``GPT``, ``BERT`` or ``CLIP``,
        chosen by config.json's ``model_type``) in eval mode, read by the one door
        ``qkv.models.from_pretrained``, and the ``qkv.data`` tokenizer. A sharded checkpoint
        (``--fsdp``) is gathered whole on this process (the reader ``qkv.train`` registers
        for sharded.json: ``qkv.train.sharded_checkpoint.read_sharded_checkpoint``; no
        process group). For a run that trained an adapter (``TrainConfig.peft``): its base
        (base.json) with the adapter attached and active (the reader registered for
        adapter_config.json: ``qkv.train.finetune.read_adapter_run``; ``disable_adapters``
        gives the base). The tokenizer is qkv's, a HuggingFace base's with its special
        ids and chat template, or an HF encoder-decoder's ``Seq2SeqTokenizer`` for a run that
        fine-tunes T5 / BART / Marian (``qkv.train.hf_tokenizer.read_run_tokenizer``).

    Raises:
        CheckpointError: no checkpoint, an unknown model type, or missing/mismatched files;
        for an adapter run, a base that is missing or changed (naming its path).
    """
    from .hf_tokenizer import read_run_tokenizer

    ckpt = find_checkpoint(path)
    model = from_pretrained(ckpt)  # an adapter run or a sharded one: qkv.train's readers
    return model, read_run_tokenizer(ckpt)


def read_run_info(path: str | os.PathLike) -> dict[str, Any]:
    """The training settings (run.json) of a run or checkpoint directory: the checkpoint's
    copy first, else the run directory's; {} when neither exists.

    Raises:
        CheckpointError: a run.json that is not a readable JSON object.
    """
    path = Path(path)
    for candidate in (find_checkpoint(path) / "run.json", path / "run.json"):
        if candidate.is_file():
            data = read_json(candidate)
            if not isinstance(data, dict):
                raise CheckpointError(f"{candidate}: run.json is not a JSON object")
            return data
    return {}


def trained_on_pairs(info: dict[str, Any]) -> bool:
    """Whether a run (its ``read_run_info``) trained on source/target pairs — an embedded
    task, or a TSV for an encoder-decoder — so a GPT reads bos + prompt + eos and answers up
    to eos. False for plain-text runs, for chat-formatted pairs (``chat``: the chat template
    frames a prompt, not bos + eos) and for checkpoints without run.json."""
    if info.get("chat"):
        return False
    if info.get("task") is not None:
        return True
    try:
        kind = get_kind(info.get("model"))
    except ValueError:  # no run.json, or a kind this qkv does not know
        return False
    return bool(getattr(kind, "reads_pairs_file", False))


def load_trainer_state(checkpoint: str | os.PathLike,
                       optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore ``optimizer`` and the torch RNG (the CPU one, and the CUDA one of the
    optimizer's device when the checkpoint was written on CUDA) from a checkpoint; returns
    the JSON state (``step``, ``data_position``).

    Raises:
        CheckpointError: missing or inconsistent trainer state (e.g. a different model).
    """
    checkpoint = Path(checkpoint)
    try:
        meta = read_json(checkpoint / STATE_JSON)
        tensors = load_file(str(checkpoint / STATE_TENSORS))
        opt, rng, step = meta["optimizer"], tensors["rng.torch"], int(meta["step"])
        state: dict[int, dict[str, Any]] = {}
        for idx, keys in opt["state_keys"].items():
            entry = dict(opt["scalars"].get(idx, {}))
            for name in keys:
                key = f"optimizer.{idx}.{name}"
                if key in tensors:
                    entry[name] = tensors[key]
            state[int(idx)] = entry
    except Exception as exc:  # OSError, JSON/safetensors errors, missing entries
        raise CheckpointError(f"{checkpoint}: cannot read the trainer state "
                              f"({type(exc).__name__}: {exc})") from exc
    try:
        optimizer.load_state_dict({"state": state, "param_groups": opt["param_groups"]})
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"{checkpoint}: the optimizer state does not fit this model: "
                              f"{exc}") from exc
    torch.set_rng_state(rng)
    device = optimizer.param_groups[0]["params"][0].device
    if "rng.cuda" in tensors and device.type == "cuda":
        torch.cuda.set_rng_state(tensors["rng.cuda"], device)
    return {"step": step, "data_position": int(meta.get("data_position", 0))}
