"""A finished run leaves its process group so that the process exits 0 (issue 12's gloo abort).

The abort: gloo's worker threads live as long as the process-group object; one that
releases its last collective's tensors during the interpreter's shutdown is ended by
CPython with pthread_exit, which unwinds into std::terminate (SIGABRT, "terminate called
without an active exception"). Oracles: the threads themselves (their names in
/proc/self/task: gloo's workers are "pt_gloo_runloop"), and whether the interpreter's
shutdown ran (an atexit line) in a real ``python -m qkv.cli`` process.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import qkv.cli.train as train_cli
from conftest import run_bounded
from qkv.cli import main
from qkv.train.distributed import World, teardown_world

TINY = ["--task", "copy", "--model", "gpt", "--preset", "gpt-tiny", "--set", "dim=32", "--set",
        "num_heads=2", "--batch-size", "8", "--warmup", "1", "--eval-every", "2",
        "--eval-examples", "8", "--steps", "2", "--no-progress", "--device", "cpu"]
TASKS = Path("/proc/self/task")


def gloo_workers() -> set[str]:
    """The thread ids of gloo's worker threads running in this process."""
    out = set()
    for t in TASKS.iterdir():
        with contextlib.suppress(OSError):  # a thread that just ended
            if (t / "comm").read_text().strip() == "pt_gloo_runloop":
                out.add(t.name)
    return out


@pytest.mark.skipif(not TASKS.is_dir(), reason="needs /proc (Linux)")
@pytest.mark.parametrize("release", [True, False])
def test_teardown_frees_the_group_once_its_holder_lets_go(release):
    """A DDP wrapper holds the group: dropped after the barrier (``release``), leaving the
    group frees it and joins gloo's workers; kept, the group and its threads live on."""
    before = gloo_workers()  # other tests' sharded models may keep groups of their own
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    box = {"ddp": nn.parallel.DistributedDataParallel(nn.Linear(3, 2))}
    box["ddp"](torch.ones(4, 3)).sum().backward()  # a collective with Python tensors
    ours = gloo_workers() - before
    assert ours
    freed = teardown_world(World(own_group=True),
                           release=(lambda: box.clear()) if release else None)
    assert not dist.is_initialized()
    assert freed is release
    assert (ours & gloo_workers()) == (set() if release else ours)
    box.clear()


def test_teardown_after_an_error_calls_no_release():
    """After an error (clean=False) nothing is freed: freeing waits for unfinished
    collectives, which a lost peer would hold up to the timeout."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    called = []
    assert teardown_world(World(own_group=True), clean=False,
                          release=lambda: called.append(1)) is False
    assert called == [] and not dist.is_initialized()
    assert teardown_world(World(), release=lambda: called.append(1)) is False  # no group
    assert called == []


def test_the_cli_ends_its_process_only_after_a_successful_run_whose_group_outlives_it(
        tmp_path, monkeypatch, capsys):
    ended: list[int] = []
    monkeypatch.setattr(train_cli, "_end_process", ended.append)
    assert not train_cli._is_cli_process()  # pytest called main(): never ended here
    assert main(["train", *TINY, "--fsdp", "--out", str(tmp_path / "a")]) == 0
    assert ended == []
    monkeypatch.setattr(train_cli, "_is_cli_process", lambda: True)
    assert main(["train", *TINY, "--fsdp", "--out", str(tmp_path / "b")]) == 0
    assert ended == [0]  # a sharded model keeps the group (torch's DTensor caches)
    assert "qkv train: done" in capsys.readouterr().out
    assert main(["train", *TINY, "--out", str(tmp_path / "c")]) == 0  # no group: exits normally
    # a refused run is not ended early: main prints the error and returns 2
    assert main(["train", "--resume", str(tmp_path / "b"), "--steps", "2", "--no-progress",
                 "--device", "cpu"]) == 2
    assert ended == [0]


_RUN_AS_CLI = """
import atexit, runpy, sys
atexit.register(lambda: print("interpreter shutdown ran", flush=True))
sys.argv = ["qkv", *sys.argv[1:]]
runpy.run_module("qkv.cli", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("fsdp", [True, False])
def test_python_m_qkv_cli_skips_the_shutdown_only_when_the_group_outlives_the_run(
        tmp_path, fsdp):
    """In a real ``python -m qkv.cli`` process a finished --fsdp run exits 0 without the
    interpreter's shutdown (where gloo's threads aborted it); a plain run exits normally."""
    args = ["train", *TINY, "--out", str(tmp_path / "run")] + (["--fsdp"] if fsdp else [])
    done = run_bounded([sys.executable, "-c", _RUN_AS_CLI, *args], timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "qkv train: done" in done.stdout
    assert ("interpreter shutdown ran" in done.stdout) is not fsdp


_TRAIN_AND_REPORT = """
import json, os, sys
from pathlib import Path
from qkv.train import TrainConfig, Trainer
config = TrainConfig(model="gpt", task="copy", preset="gpt-tiny", steps=2, batch_size=8,
                     warmup=1, eval_every=2, eval_examples=8, fsdp=sys.argv[2] == "fsdp",
                     overrides=dict(dim=32, num_heads=2, ffn_hidden=64))
trainer = Trainer(config, sys.argv[1], progress=False, log=lambda line: None)
trainer.run()
workers = sum((t / "comm").read_text().strip() == "pt_gloo_runloop"
              for t in Path("/proc/self/task").iterdir())
report = {"outlives": trainer.group_outlives_run, "workers": workers}
Path(sys.argv[1], f"rank{os.environ['RANK']}.json").write_text(json.dumps(report))
if trainer.group_outlives_run:  # what the qkv command does (qkv.cli.train._end_process)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
"""


@pytest.mark.slow
@pytest.mark.skipif(not TASKS.is_dir(), reason="needs /proc (Linux)")
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.timeout(420)  # its subprocesses' own limits, with room
def test_two_processes_free_the_group_under_ddp_and_say_so_under_fsdp(tmp_path, mode):
    """Under torchrun: after a DDP run the trainer dropped its wrapper and leaving the group
    joined gloo's workers on both ranks; after a sharded run the group outlives the run
    (torch's DTensor caches) and the trainer says so (what the CLI acts on)."""
    from test_distributed import free_port

    script = tmp_path / "run.py"
    script.write_text(_TRAIN_AND_REPORT)
    out = tmp_path / "run"
    done = run_bounded([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                        "2", "--master-port", str(free_port()), str(script), str(out), mode],
                       timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "QKV_DIST_TIMEOUT": "60"})
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        report = json.loads((out / f"rank{rank}.json").read_text())
        if mode == "ddp":
            assert report == {"outlives": False, "workers": 0}, rank
        else:
            assert report["outlives"] is True and report["workers"] > 0, rank
