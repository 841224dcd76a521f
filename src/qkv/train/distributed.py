"""Data parallelism under ``torchrun``: one process per rank, the global batch split across
ranks, gradients averaged by ``DistributedDataParallel`` (gloo for CPU tensors, nccl for
CUDA ones; the ``Trainer`` runs on the CPU for now).

Single-process runs (no ``WORLD_SIZE`` in the environment) use none of this.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["World", "all_reduce_sum", "barrier", "setup_world", "teardown_world"]


@dataclass(frozen=True)
class World:
    """This process's rank and the number of processes (1 without torchrun)."""

    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that prints, evaluates and writes files."""
        return self.rank == 0


def setup_world(device: torch.device) -> World:
    """Join the process group torchrun describes (``WORLD_SIZE`` > 1), else a 1-process world.
    The backend is nccl for CUDA devices, gloo otherwise."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return World(rank=dist.get_rank(), size=dist.get_world_size())


def teardown_world(world: World) -> None:
    """Leave the process group (if one was joined)."""
    if world.size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(x: torch.Tensor, world: World) -> torch.Tensor:
    """Sum of ``x`` over ranks (``x`` itself in a 1-process world); ``x`` is not modified."""
    if world.size == 1:
        return x
    y = x.detach().clone()
    dist.all_reduce(y)
    return y


def barrier(world: World) -> None:
    """Wait for every rank (nothing in a 1-process world)."""
    if world.size > 1:
        dist.barrier()
