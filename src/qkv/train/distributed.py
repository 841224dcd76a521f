"""Data parallelism under ``torchrun``: one process per rank, the global batch split across
ranks, gradients averaged by ``DistributedDataParallel`` (gloo on CPU, nccl on CUDA: rank r
uses ``cuda:LOCAL_RANK``).

Single-process runs (no ``WORLD_SIZE`` in the environment) use none of this, except a
1-process ``--fsdp`` run, which joins a process group of its own (FSDP2 and DCP need one).

Every collective is bounded: the process group's timeout is ``QKV_DIST_TIMEOUT`` seconds
(default 600), so a rank that dies or hangs makes the others fail within it instead of
waiting forever. ``teardown_world`` meets every rank at a barrier before leaving the group
(a clean gloo shutdown: exit status 0), except after an error (a peer may be gone).

Leaving a group should also free it: ``destroy_process_group`` only drops torch's own
references, and gloo's worker threads live as long as the group object. Left running into
the interpreter's shutdown, a worker that releases its last collective's work (it holds
Python tensors) asks for the GIL during ``Py_FinalizeEx``; CPython ends such a thread with
``pthread_exit``, whose unwinding through gloo's noexcept destructor calls
``std::terminate``: "terminate called without an active exception", SIGABRT, after a run
that had finished and saved. ``teardown_world(..., release=...)`` lets the caller drop its
references (a DDP wrapper) after the barrier, so that the group is freed and its threads
joined there, and says whether that happened. A sharded (FSDP2) model cannot give the group
back (torch's DTensor caches keep it for the process's life): the ``qkv train`` command then
ends its process with ``os._exit`` after a successful run (``qkv.cli.train``).

Freeing a gloo group must also never deadlock (pytorch/pytorch#56297's kind): the group's
destructor joins its worker threads while holding the GIL (pybind11 does not release it there),
and a worker that is still destroying a finished collective's work may need the GIL to drop a
Python object captured in that work's thread-local state. ``teardown_world`` therefore waits,
with the GIL released, until every gloo worker thread sleeps idle (``settle_gloo_workers``)
before torch's references to the group go, whatever the caller drops later.
"""

from __future__ import annotations

import gc
import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported before any process group exists, on purpose (12 ms). DDP's construction imports it
# when it is not yet loaded, and imported then, while a gloo group is live, it leaves a
# reference that keeps the group alive after destroy_process_group: its worker threads are
# never joined (tests/train/test_shutdown.py, test_gloo_teardown_stress.py). It used to come
# in with torch.distributed.checkpoint, which qkv no longer imports at start-up (0.7 s).
import torch.distributed._shard

__all__ = ["TIMEOUT_ENV", "World", "all_reduce_sum", "barrier", "broadcast_object",
           "dist_timeout", "resolve_device", "settle_gloo_workers", "setup_world",
           "teardown_world"]


#: environment variable: the process group's collective timeout in seconds (default 600)
TIMEOUT_ENV = "QKV_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 600


@dataclass(frozen=True)
class World:
    """This process's rank and the number of processes (1 without torchrun); ``own_group``:
    a 1-process group joined by ``setup_world(group=True)`` (left by ``teardown_world``)."""

    rank: int = 0
    size: int = 1
    own_group: bool = False

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


def dist_timeout() -> timedelta:
    """The collective timeout: ``QKV_DIST_TIMEOUT`` seconds (a positive number), default 600.

    Raises:
        ValueError: ``QKV_DIST_TIMEOUT`` is set but not a positive number."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return timedelta(seconds=DEFAULT_TIMEOUT_S)
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {text!r}")
    return timedelta(seconds=seconds)


def setup_world(device: torch.device, *, group: bool = False) -> World:
    """Join the process group torchrun describes (``WORLD_SIZE`` > 1), else a 1-process world;
    with ``group=True`` a 1-process world joins a process group of its own (an in-memory
    store), which FSDP2 and DCP need. The backend is nccl for CUDA devices, gloo otherwise;
    the timeout ``dist_timeout()``."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if size <= 1:
        if not group or dist.is_initialized():
            return World()
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=dist_timeout())
        return World(own_group=True)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=dist_timeout())
    return World(rank=dist.get_rank(), size=dist.get_world_size())


def teardown_world(world: World, *, clean: bool = True,
                   release: Callable[[], None] | None = None) -> bool:
    """Leave the process group (if one was joined). ``clean``: first wait for every rank at a
    barrier, so that no rank tears gloo's connections down under another (gloo may then
    abort the process); give ``clean=False`` after an error, when a peer may be gone.

    ``release``: called after that barrier (only when it succeeded, or in a 1-process
    group): it drops the caller's references to the group, e.g. a sharded or DDP-wrapped
    model, so that destroying the group frees it and joins gloo's worker threads now rather
    than leaving them to the interpreter's exit (see the module docstring). Not called after
    an error: freeing a group waits for its unfinished collectives, which a lost peer would
    hold up to the timeout.

    Returns whether the group was freed (False when none was joined, when ``release`` was
    not called, or when something else still holds the group)."""
    if not (world.size > 1 or world.own_group) or not dist.is_initialized():
        return False
    met = world.size == 1
    if clean and world.size > 1:
        try:
            dist.barrier()
            met = True
        except Exception:  # a peer left already: nothing to wait for
            met = False
    group = weakref.ref(dist.group.WORLD)
    if clean and met and release is not None:
        release()
    else:
        release = None
    # before the last reference can go (here or in whatever the caller drops later): no gloo
    # worker may still be finishing work that needs the GIL (see the module docstring)
    settle_gloo_workers(timeout_s=SETTLE_TIMEOUT_S if met else 2.0)
    dist.destroy_process_group()
    if release is None:
        return False
    gc.collect()  # a sharded model's modules and hooks form cycles
    return group() is None


#: how long ``teardown_world`` waits for gloo's workers to go idle (seconds)
SETTLE_TIMEOUT_S = 30.0
_GLOO_WORKER = "pt_gloo_runloop"  # the thread name gloo's worker threads carry
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}
_FUTEX_WAIT_BITSET = 9  # glibc's condition-variable wait; a mutex wait is FUTEX_WAIT (0)


def _worker_states() -> list[str] | None:
    """``/proc/self/task/*/syscall`` of gloo's worker threads, or None where that cannot be
    read (not Linux, an unknown architecture)."""
    futex = _SYS_FUTEX.get(os.uname().machine) if hasattr(os, "uname") else None
    tasks = "/proc/self/task"
    if futex is None or not os.path.isdir(tasks):
        return None
    states = []
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/comm") as f:
                if f.read().strip() != _GLOO_WORKER:
                    continue
            with open(f"{tasks}/{tid}/syscall") as f:
                states.append(f.read().strip())
        except OSError:  # a thread that just ended, or no permission
            continue
    return states


def _idle(state: str) -> bool:
    """A gloo worker asleep on its work queue: in ``futex(addr, FUTEX_WAIT_BITSET, ...)`` with
    no timeout. A worker waiting for the GIL waits with a timeout (CPython's take_gil), one
    waiting for the queue's mutex uses FUTEX_WAIT; a running one is in no syscall."""
    fields = state.split()
    futex = _SYS_FUTEX.get(os.uname().machine)
    try:
        return (len(fields) >= 5 and int(fields[0]) == futex
                and int(fields[2], 16) & 0x7F == _FUTEX_WAIT_BITSET and int(fields[4], 16) == 0)
    except ValueError:
        return False


def settle_gloo_workers(*, timeout_s: float = SETTLE_TIMEOUT_S) -> bool:
    """Wait, with the GIL released, until every gloo worker thread of this process sleeps idle
    on its work queue: then dropping a group's last reference (whose destructor joins those
    threads while holding the GIL) cannot deadlock with a worker that needs the GIL to finish
    destroying a collective's work. Two idle readings in a row, 1 ms apart, count.

    Returns True when settled (or when there are no gloo workers), False after ``timeout_s``
    seconds; where thread states cannot be read (not Linux) it waits 0.2 s and returns False.
    """
    states = _worker_states()
    if states is None:
        time.sleep(0.2)  # let any worker take the GIL and finish
        return False
    deadline = time.monotonic() + timeout_s
    calm = 0
    while True:
        calm = calm + 1 if all(_idle(s) for s in states) else 0
        if calm >= 2:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)  # releases the GIL: a worker waiting for it finishes now
        states = _worker_states() or []


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
