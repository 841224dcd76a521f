"""Data parallelism under ``torchrun``: one process per rank, the global batch split across
ranks, gradients averaged by ``DistributedDataParallel`` (gloo on CPU, nccl on CUDA: rank r
uses ``cuda:LOCAL_RANK``).

Single-process runs (no ``WORLD_SIZE`` in the environment) use none of this.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["World", "all_reduce_sum", "barrier", "broadcast_object", "resolve_device",
           "setup_world", "teardown_world"]


@dataclass(frozen=True)
class World:
    """This process's rank and the number of processes (1 without torchrun)."""

    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that prints, evaluates and writes files."""
        return self.rank == 0


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The training device: "cpu", "cuda", "cuda:N", or None / "auto" (CUDA when available).
    Under torchrun a bare "cuda" means ``cuda:LOCAL_RANK``.

    Raises:
        ValueError: an unknown device string, or CUDA asked for where there is none.
    """
    if device is None or device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}"
                         ) from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r}: CUDA is not available here")
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise ValueError(f"device must be a CPU or CUDA device, got {str(device)!r}")
    return device


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


def broadcast_object(obj: object, world: World) -> object:
    """Rank 0's ``obj`` on every rank (``obj`` itself in a 1-process world): e.g. rank 0's
    verdict on the run-directory lock, so that every rank stops when it is refused."""
    if world.size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
