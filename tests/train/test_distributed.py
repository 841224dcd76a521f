"""Two processes under torchrun (gloo) give the loss of one process with the same global
batch (fp32 reduction tolerance), and only rank 0 writes."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest

from conftest import run_bounded

ARGS = ["train", "--task", "copy", "--set", "dim=32", "--set", "num_heads=2", "--set",
        "dropout=0.0", "--steps", "4", "--batch-size", "8", "--lr", "1e-2", "--warmup", "1",
        "--eval-every", "4", "--eval-examples", "8", "--no-progress", "--device", "cpu"]
MODELS = {"transformer": ["--preset", "transformer-tiny"],
          # BERT's MLM corruption is random: ranks must corrupt their rows of the global batch
          # exactly as one process would
          "bert-mlm": ["--model", "bert-mlm", "--preset", "bert-tiny", "--set",
                       "attn_dropout=0.0"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def step_losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.timeout(660)  # its subprocesses' own limits, with room
def test_two_gloo_processes_match_one(tmp_path, model):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [*ARGS, *MODELS[model]]
    one = run_bounded([sys.executable, "-m", "qkv.cli", *args, "--out", str(tmp_path / "one")],
                      env=env, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    two = run_bounded([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                       "--master-port", str(free_port()), "-m", "qkv.cli", *args, "--out",
                       str(tmp_path / "two")], env=env, timeout=300)
    assert two.returncode == 0, two.stderr[-2000:]
    a, b = step_losses(tmp_path / "one"), step_losses(tmp_path / "two")
    assert len(a) == len(b) == 4
    assert b == pytest.approx(a, rel=1e-5, abs=1e-6)  # the same math, reduced in another order
    if model == "transformer":  # lr 1e-2 moves the weights: later losses depend on the sync
        assert a[-1] < a[0]
    assert two.stdout.count("qkv train: done") == 1  # rank 0 prints and writes
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == [
        "checkpoint", "metrics.jsonl", "run.json"]


def test_resolve_device():
    import torch

    from qkv.train.distributed import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("not-a-device")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")
