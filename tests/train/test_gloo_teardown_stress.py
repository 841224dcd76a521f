"""Leaving a gloo group never deadlocks, however soon the caller drops what holds it.

The deadlock (pytorch/pytorch#56297's kind): a DDP wrapper that holds the last reference to a
group, dropped right after a backward pass, runs ``~Reducer`` -> ``~ProcessGroupGloo`` ->
``std::thread::join`` with the GIL held, while a gloo worker still destroying the backward's
all-reduce work waits for the GIL to drop a Python object kept in the work's thread-local state.
Seen in the suite as a worker idle at 0 % CPU forever. ``teardown_world`` waits for gloo's
workers to go idle first (``settle_gloo_workers``).

Oracle: the pattern repeated many times in a child process under a watchdog (faulthandler
dumps every thread's stack and exits 1 on a hang); without the settling it hangs within a few
dozen rounds here (checked by running the child with ``settle=0``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROUNDS = 150
WATCHDOG_S = 60

_CHILD = """
import faulthandler, sys
import torch, torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
import qkv.train.distributed as qd

rounds, mode, settle = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
faulthandler.dump_traceback_later(float(sys.argv[4]), exit=True)
if not settle:
    qd.settle_gloo_workers = lambda **kw: True


class Passthrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


if mode == "hooks":  # a Python object in every collective's thread-local state
    torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t).__enter__()
elif mode == "function-mode":
    Passthrough().__enter__()
for i in range(rounds):
    release = i % 2 == 0
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    box = {"ddp": nn.parallel.DistributedDataParallel(nn.Linear(3, 2))}
    box["ddp"](torch.ones(4, 3)).sum().backward()
    freed = qd.teardown_world(qd.World(own_group=True),
                              release=(lambda: box.clear()) if release else None)
    assert freed is release, (i, freed)
    box.clear()  # release=False: the wrapper held the group's last reference
print("rounds done", rounds, flush=True)
"""


def _run(mode: str, *, settle: bool, rounds: int = ROUNDS) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _CHILD, str(rounds), mode, "1" if settle else "0",
         str(WATCHDOG_S)], capture_output=True, text=True, timeout=WATCHDOG_S + 60,
        env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc (Linux)")
@pytest.mark.parametrize("mode", ["plain", "hooks", "function-mode"])
def test_leaving_a_gloo_group_many_times_never_hangs(mode):
    done = _run(mode, settle=True)
    assert done.returncode == 0 and f"rounds done {ROUNDS}" in done.stdout, (
        f"exit {done.returncode} (1 with 'Timeout' below: the watchdog found a hang); "
        f"stderr:\n{done.stderr[-4000:]}")
