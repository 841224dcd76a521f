"""Resuming a run: ``open_run`` does every check and load of a resume, in order, and returns
what the trainer continues (``Resumed``: the run's config, model, tokenizer, data, and the
trainer state it restores once the model is placed). The checks: the lock taken first (no
other writer may change what is checked), the checkpoint found (or why there is none),
run.json against the checkpoint's copy, the data file unchanged since the run began (the
size and SHA-256 that run.json records, as the model kind takes them, put there by
``qkv.train.fingerprint``), ``fsdp`` as the checkpoint was written.
``resumed_config`` is the run.json read back with the changes a resume may make
(``steps``, ``grad_accum``, ``activation_checkpointing``; ``fsdp`` and ``precision`` are
fixed for a run).

A refusal leaves the directory as it was: nothing is written here (the run directory's
rewrite is ``qkv.train.rundir.RunDirClaim.continue_from``).

Shapes: none (settings and files only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..files import CheckpointError, read_json
from .begin import RunStart
from .checkpoint import load_run, load_trainer_state
from .config import TrainConfig
from .finetune import BASE_JSON
from .fingerprint import check_data_unchanged, data_fingerprint
from .kinds import ModelKind
from .rundir import RunDirClaim, check_checkpoint_agrees, resume_checkpoint
from .sharded_checkpoint import (
    build_checkpoint_model,
    is_sharded_checkpoint,
    load_sharded_checkpoint,
)

__all__ = ["Resumed", "check_data_unchanged", "data_fingerprint", "open_run", "resumed_config"]


def resumed_config(out_dir: Path, *, steps: int | None = None, grad_accum: int | None = None,
                   activation_checkpointing: bool | None = None, fsdp: bool | None = None,
                   precision: str | None = None,
                   log: Callable[[str], Any] = print) -> TrainConfig:
    """The ``TrainConfig`` of the run in ``out_dir`` (its run.json) with the given changes;
    ``log`` gets a note when a cosine schedule is re-stretched to new total ``steps``.

    Raises:
        CheckpointError: no such directory, or an unreadable / invalid run.json.
        ValueError: ``fsdp`` or ``precision`` given and not the run's own.
    """
    if not out_dir.is_dir():
        raise CheckpointError(f"{out_dir}: cannot resume: no such run directory")
    try:
        data = read_json(out_dir / "run.json")
    except (OSError, ValueError, CheckpointError) as exc:
        raise CheckpointError(f"{out_dir}: cannot resume: {exc}") from exc
    try:
        config = TrainConfig.from_dict(data)
    except ValueError as exc:
        raise CheckpointError(f"{out_dir / 'run.json'}: cannot resume: {exc}") from exc
    for name, value in (("fsdp", fsdp), ("precision", precision)):
        if value is not None and value != getattr(config, name):
            raise ValueError(f"{name} {value!r}: {out_dir} was trained with {name}="
                             f"{getattr(config, name)!r}, which is fixed for a run "
                             f"(resume continues it; start a new run to change it)")
    changes: dict[str, Any] = {}
    if steps is not None and steps != config.steps:
        changes["steps"] = steps
    if grad_accum is not None:
        changes["grad_accum"] = grad_accum
    if activation_checkpointing is not None:
        changes["activation_checkpointing"] = activation_checkpointing
    if changes:
        config = dataclasses.replace(config, **changes)  # checked again, as from_dict does
        if "steps" in changes and config.schedule == "cosine":
            log(f"note: the cosine schedule is re-stretched from {data['steps']} to "
                f"{steps} total steps; later learning rates differ from those of a run "
                f"started with --steps {steps}")
    return config


@dataclasses.dataclass
class Resumed(RunStart):
    """What a resume continues (``open_run``): a ``qkv.train.begin.RunStart`` (``config``
    as run.json will record it; ``model`` on the CPU, a sharded run's still without its
    weights, which ``restore`` fills after sharding; ``tokenizer``; ``data``; ``max_len``;
    ``base``, an adapter run's base.json, checked against its base) and where it continues:
    ``out`` (the run directory) and ``checkpoint`` (its checkpoint directory)."""

    out: Path
    checkpoint: Path

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """Load the trainer state into ``model`` (placed: sharded or wrapped) and
        ``optimizer`` — a sharded run's weights too — and the torch RNG; returns the step.

        Raises:
            CheckpointError: the state does not fit the model / optimizer.
            ValueError: the run is already at ``config.steps`` or beyond."""
        state = (load_sharded_checkpoint(self.checkpoint, model=model, optimizer=optimizer)
                 if self.config.fsdp else load_trainer_state(self.checkpoint, optimizer))
        step = state["step"]
        if step >= self.config.steps:
            raise ValueError(f"{self.out} is already at step {step}; give --steps "
                             f"greater than {step} to continue it")
        return step


def open_run(config: TrainConfig, out: Path, *, kind: ModelKind, claim: RunDirClaim,
             accept_changed_data: bool, note: Callable[[str], Any]) -> Resumed:
    """Every check and load of a resume of the run in ``out`` with ``config``
    (``resumed_config``), before anything is written: ``claim``'s lock taken, the
    checkpoint found (``resume_checkpoint``), run.json against the checkpoint's copy, the
    data file unchanged (``check_data_unchanged``; ``note`` gets its lines), ``fsdp`` as the
    checkpoint was written; then the model and tokenizer (an adapter run: its base checked),
    and the kind's data.

    Raises:
        RunDirBusyError: another process holds the directory.
        CheckpointError: any check above refused."""
    claim.take_lock()  # before reading: no other writer may change what we check
    ckpt = resume_checkpoint(out, config.eval_every)
    check_checkpoint_agrees(out, ckpt, config)
    config = check_data_unchanged(config, out, kind, accept_changed=accept_changed_data,
                                  note=note)
    sharded = is_sharded_checkpoint(ckpt)
    if sharded != config.fsdp:
        raise CheckpointError(
            f"{ckpt} is {'a sharded' if sharded else 'a plain'} checkpoint but run.json "
            f"says fsdp={config.fsdp}: fsdp is fixed for a run; restore run.json from "
            f"{ckpt / 'run.json'}")
    if sharded:  # weights come with the optimizer state, after sharding (restore)
        from .hf_tokenizer import read_run_tokenizer

        model, tokenizer = build_checkpoint_model(ckpt), read_run_tokenizer(ckpt)
    else:
        model, tokenizer = load_run(ckpt)  # an adapter run: base checked
    # an adapter run's base.json, checked against its base by load_run just now
    base = read_json(ckpt / BASE_JSON) if (ckpt / BASE_JSON).is_file() else None
    max_len = kind.max_len_of(model)
    return Resumed(config, model, tokenizer, kind.load_data(config, tokenizer, max_len),
                   max_len, base, out=out, checkpoint=ckpt)
