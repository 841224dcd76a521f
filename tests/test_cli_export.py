"""``qkv export RUN --out DIR``: a plain run's model files copied, a sharded (DCP) run's
gathered into config.json + model.safetensors; the exported directory loads with
``load_run`` / ``from_pretrained`` to exactly the run's weights. (2-rank sharded checkpoints:
tests/train/test_sharded_checkpoint.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qkv.cli import main
from qkv.train import load_run
from qkv.train.checkpoint import read_run_info
from qkv.train.sharded_checkpoint import save_sharded_checkpoint

SMALL = ["--model", "gpt", "--task", "copy", "--set", "dim=32", "--set", "num_layers=1",
         "--set", "num_heads=2", "--steps", "2", "--batch-size", "4", "--eval-every", "2",
         "--eval-examples", "4", "--warmup", "1", "--no-progress", "--device", "cpu"]


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "run"
    assert main(["train", *SMALL, "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def sharded_run(plain_run) -> tuple[Path, dict[str, torch.Tensor]]:
    """A sharded checkpoint (one process, no process group) of the plain run's model after
    one more optimizer step, with its tokenizer and run.json."""
    model, tokenizer = load_run(plain_run)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    model(ids).logsumexp(-1).mean().backward()
    opt.step()
    out = plain_run.parent / "sharded"
    save_sharded_checkpoint(out, model=model, optimizer=opt, step=3, tokenizer=tokenizer,
                            run_info=read_run_info(plain_run),
                            extra_files={"notes.json": {"kind": "test"}})
    return out, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_export_of_a_plain_run_copies_the_model(plain_run, tmp_path, capsys):
    out = tmp_path / "model"
    assert main(["export", str(plain_run), "--out", str(out)]) == 0
    assert "copied from its checkpoint" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors",
                                                      "run.json", "tokenizer.json"]
    want, _ = load_run(plain_run)
    got, _ = load_run(out)
    ckpt = plain_run / "checkpoint"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "run.json"):
        assert (out / name).read_bytes() == (ckpt / name).read_bytes(), name
    for (k, a), (k2, b) in zip(got.state_dict().items(), want.state_dict().items(),
                               strict=True):
        assert k == k2 and torch.equal(a, b), k


def test_export_of_a_sharded_run_gathers_the_model(sharded_run, tmp_path, capsys):
    run, want = sharded_run
    out = tmp_path / "model"
    assert main(["export", str(run), "--out", str(out)]) == 0
    assert "gathered from its sharded checkpoint" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model.safetensors", "notes.json", "run.json", "tokenizer.json"]
    assert json.loads((out / "notes.json").read_text()) == {"kind": "test"}
    model, _ = load_run(out)
    state = model.state_dict()
    assert state.keys() == want.keys()
    for k in want:
        assert torch.equal(state[k], want[k]), k
    assert model.lm_head.weight is model.embed.weight  # the tie, restored on load


def test_export_refuses_a_non_empty_out_and_a_missing_run(plain_run, tmp_path, capsys):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", str(plain_run), "--out", str(out)]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
    assert main(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "no such run directory" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
