"""One optimizer step of the trainer, apart from the loop: the objective (model + the kind's
loss, what DDP wraps), the model placed over the processes (FSDP2 shards or a DDP wrapper),
AdamW's parameter groups, this rank's rows of the global batch, the forward under the run's
precision, and the step itself (K micro-batches with one gradient sync, the loss summed
over ranks, non-finite checks, clipping, the update).

Shapes: a batch is the kind's dict of tensors with the global batch's B rows first; a rank
gets rows ``[rank * B / W, (rank + 1) * B / W)`` of it (W processes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .config import TrainConfig
from .distributed import World, all_reduce_sum
from .kinds import ModelKind
from .schedules import lr_multiplier
from .sharding import PRECISIONS, accumulate_gradients, grad_norm_, shard_model, split_batch

__all__ = ["Objective", "TrainingError", "build_optimizer", "collective_failure",
           "forward", "optimizer_step", "place_model", "rank_batch", "step_lr"]


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss or gradient); the message names the step and
    the last good checkpoint."""


#: words of the errors a collective raises when a peer is gone or silent (gloo, nccl)
_LOST_PEER = ("connection closed", "connection reset", "timed out", "timeout", "gloo", "nccl",
              "broken pipe", "processgroup")


def collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that failed (torch's DistError, or the RuntimeError
    gloo raises when a peer closed its connection or the timeout passed)."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return any(word in text for word in _LOST_PEER)


class Objective(nn.Module):
    """The model plus its kind's loss, so that DistributedDataParallel sees one forward.
    ``forward(batch)`` returns the kind's (summed loss, count), both 0-dim."""

    def __init__(self, kind: ModelKind, model: nn.Module, label_smoothing: float) -> None:
        super().__init__()
        self.kind, self.model, self.label_smoothing = kind, model, label_smoothing

    def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        return self.kind.loss(self.model, batch, label_smoothing=self.label_smoothing)


def place_model(objective: Objective, *, config: TrainConfig, world: World,
                device: torch.device, policy: Any) -> tuple[nn.Module, nn.Module]:
    """The model of ``objective`` (on ``device``) over the processes: with ``config.fsdp``
    sharded in place by FSDP2 (``policy``: its mixed-precision policy), else wrapped in DDP
    when there are several processes. Returns ``(objective, sync)``: what a step calls, and
    the module whose gradient sync ``accumulate_gradients`` holds back (the sharded model,
    the DDP wrapper, or the objective itself)."""
    if config.fsdp:  # each rank keeps 1/world of parameters, gradients, optimizer state
        shard_model(objective.model, mp_policy=policy)
        return objective, objective.model
    if world.size > 1:
        ids = [device.index] if device.type == "cuda" else None
        wrapped = nn.parallel.DistributedDataParallel(objective, device_ids=ids)
        return wrapped, wrapped
    return objective, objective


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not biases, norms or embedding tables); built
    after sharding, on the shards."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 and id(p) not in tables else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": config.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.adam_eps)


def rank_batch(kind: ModelKind, data: Any, tokenizer: Any, *, config: TrainConfig,
               world: World, step: int, device: torch.device) -> dict[str, Tensor]:
    """The batch of optimizer step ``step`` (0-based) for this rank: its rows of the global
    batch, built whole on every rank (same padding width, same MLM corruption), so that N
    processes compute exactly the sums one process would."""
    batch = kind.make_batch(data.train(step * config.batch_size, config.batch_size),
                            tokenizer, step=step, seed=config.seed)
    per_rank = config.batch_size // world.size
    rows = slice(world.rank * per_rank, (world.rank + 1) * per_rank)
    return {k: t[rows].to(device) for k, t in batch.items()}


def step_lr(config: TrainConfig, step: int) -> float:
    """The learning rate of optimizer step ``step`` (1-based) under the run's schedule."""
    return config.lr * lr_multiplier(step, schedule=config.schedule, warmup=config.warmup,
                                     total=config.steps, min_ratio=config.min_lr_ratio)


def forward(objective: nn.Module, batch: dict[str, Tensor], *, config: TrainConfig,
            device: torch.device) -> tuple[Tensor, Tensor]:
    """The objective on one micro-batch, under ``torch.autocast`` for bf16 without FSDP
    (FSDP2's policy casts the gathered parameters itself)."""
    if config.fsdp or config.precision == "fp32":
        return objective(batch)
    # the precision was checked (and any warning given) when the run was set up
    with torch.autocast(device.type, dtype=PRECISIONS[config.precision]):
        return objective(batch)


def optimizer_step(batch: dict[str, Tensor], *, lr: float, forward: Callable[..., Any],
               sync: nn.Module, model: nn.Module, optimizer: torch.optim.Optimizer,
               config: TrainConfig, world: World, kind: ModelKind,
               stop: Callable[[str], None]) -> tuple[float, float]:
    """One optimizer step on this rank's ``batch`` at learning rate ``lr``: K micro-batches
    (``config.grad_accum``), the gradient sync (DDP / FSDP) in the last backward only, every
    micro-batch's loss divided by the step's global count (DDP/FSDP average over ranks);
    then clipping and the update. ``stop(what)`` is called (and must raise) on a non-finite
    loss or gradient norm, before the update. Returns ``(loss, grad_norm)``, the loss
    averaged over the global batch."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss_sum, total = accumulate_gradients(
        forward, split_batch(batch, config.grad_accum), model=sync, world_size=world.size,
        count=kind.loss_count)
    loss = (all_reduce_sum(loss_sum, world) / total).item()
    if not math.isfinite(loss):
        stop(f"loss is {loss}")
    norm = grad_norm_(model.parameters(), config.clip_norm)  # all shards
    if not math.isfinite(norm):
        stop(f"the gradient norm is {norm}")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, norm
