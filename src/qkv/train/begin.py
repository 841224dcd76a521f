"""What a new run starts from (``begin_run``): its config as run.json records it (the data
file's absolute path and fingerprint, which a resume checks: ``qkv.train.fingerprint``), torch's
RNG seeded, and the model, tokenizer and data — built from scratch for the data (sizes
checked on the ``meta`` device first), or the base of ``init_from`` with the adapter of
``peft`` attached (``qkv.train.finetune``) — with one optimizer step checked to fit in
memory (``qkv.train.memory.check_step_fits``). Nothing is written here: the run directory is
claimed afterwards (``qkv.train.rundir.RunDirClaim.start_new``).

Shapes: none (settings, files and whole models).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from .config import TrainConfig
from .finetune import attach_peft, load_base
from .fingerprint import record_data
from .kinds import ModelKind
from .memory import check_step_fits

__all__ = ["RunStart", "begin_run"]


@dataclasses.dataclass
class RunStart:
    """What a run trains (``begin_run``; a resume's ``qkv.train.resume.Resumed``):
    ``config`` (as run.json records it), ``model`` (on the CPU), ``tokenizer``, ``data`` (the
    kind's: ``train(start, count)``, ``heldout(count)``), ``max_len`` (the model's context
    length) and ``base`` (base.json of a run that trains an adapter, else None)."""

    config: TrainConfig
    model: nn.Module
    tokenizer: Any
    data: Any
    max_len: int
    base: dict[str, str] | None


def begin_run(config: TrainConfig, kind: ModelKind, *, processes: int,
              device: torch.device) -> RunStart:
    """The start of a new run of ``config`` (see the module docstring) on ``processes``
    processes, each training on ``device``; torch's global RNG is seeded with
    ``config.seed`` before any model is built.

    Raises:
        CheckpointError: the data cannot be read; no base at ``init_from`` (or one that
            cannot be fine-tuned: ``qkv.train.finetune.load_base``).
        ValueError: the data, the model config or the adapter refused; one step cannot fit
            in memory (naming what to lower)."""
    config = record_data(config, kind)
    torch.manual_seed(config.seed)
    if config.init_from is not None:  # the base fixes the model, tokenizer and max_len
        base = load_base(config.init_from, config.model)
        config = dataclasses.replace(config, init_from=str(base.path))
        data, max_len, seq_len = kind.prepare_base_data(config, base.tokenizer, base.max_len)
        if config.peft is not None:
            attach_peft(base.model, config.peft)
        check_step_fits(kind, base.model, config, processes=processes, seq_len=seq_len,
                        max_len=max_len, device=device, doing="fine-tuning")
        return RunStart(config, base.model, base.tokenizer, data, max_len,
                        base.info() if config.peft is not None else None)
    data, tokenizer, max_len, seq_len = kind.prepare_data(config)  # tokenizer fitted to it
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        shape_only = kind.build_model(config, tokenizer, max_len)
    kind.check_model(shape_only.config, tokenizer, max_len)
    check_step_fits(kind, shape_only, config, processes=processes, seq_len=seq_len,
                    max_len=max_len, device=device, doing="training")
    return RunStart(config, kind.build_model(config, tokenizer, max_len), tokenizer, data,
                    max_len, None)
