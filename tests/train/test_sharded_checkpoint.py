"""Sharded (DCP) checkpoints: written by 2 FSDP ranks, loaded on 1 process and on 2 ranks;
written by 1 process, loaded on 2 ranks — the same model and optimizer state, bit for bit
(DCP only moves bytes). Export == the model's state. A rank that fails while saving makes
every rank raise (no hang) and leaves the previous checkpoint in place. The DCP metadata
pickle is read by a restricted unpickler.

Oracle: the full state (``DTensor.full_tensor()`` / the plain tensors) of the model and of
the optimizer (``get_optimizer_state_dict``, keyed by parameter name) at the save.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from _spawn import spawn
from safetensors.torch import load_file, save_file
from torch import nn

from qkv.models import GPT, CheckpointError, GPTConfig
from qkv.train.sharded_checkpoint import (
    export_sharded,
    is_sharded_checkpoint,
    load_sharded_checkpoint,
    load_sharded_model,
    save_sharded_checkpoint,
)
from qkv.train.sharding import shard_model


def build(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.from_name("gpt-tiny", vocab_size=64, max_len=16, dim=32))


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": rest, "weight_decay": 0.0}], lr=1e-2,
                             betas=(0.8, 0.95))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, rows: slice = slice(None)) -> float:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 64, (4, 12), generator=g)[rows]
    loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def full_state(model: nn.Module, opt: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """Model and optimizer state by name, unsharded (a collective under FSDP)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    def full(t: torch.Tensor) -> torch.Tensor:
        f = getattr(t, "full_tensor", None)
        return (f() if f is not None else t).detach().clone().contiguous()

    msd, osd = get_state_dict(model, opt)
    out = {f"model.{k}": full(v) for k, v in msd.items() if k != "lm_head.weight"}
    for name, moments in osd["state"].items():
        for m, v in moments.items():
            out[f"optim.{name}.{m}"] = full(v).reshape(-1) if v.dim() == 0 else full(v)
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def _worker(rank: int, world: int, out: str) -> None:
    """1 -> 2: load the 1-process checkpoint; then train, save on 2 ranks, reload on 2."""
    out_dir = Path(out)
    # 1 -> 2
    model = shard_model(build(seed=3))
    opt = optimizer(model)
    info = load_sharded_checkpoint(out_dir / "run1" / "checkpoint", model=model, optimizer=opt)
    assert info == {"step": 1, "data_position": 4}
    state = full_state(model, opt)
    assert opt.param_groups[0]["betas"] == (0.8, 0.95)
    if rank == 0:
        save_file(state, str(out_dir / "loaded-1to2.safetensors"))
    # train one more step (rows of this rank), save on 2 ranks
    per = 4 // world
    train_step(model, opt, slice(rank * per, (rank + 1) * per))
    save_sharded_checkpoint(out_dir / "run2", model=model, optimizer=opt, step=2,
                            data_position=8, run_info={"model": "gpt"})
    state = full_state(model, opt)
    if rank == 0:
        save_file(state, str(out_dir / "want2.safetensors"))
        names = sorted(p.name for p in (out_dir / "run2" / "checkpoint" / "sharded").iterdir())
        assert names == [".metadata", "__0_0.distcp", "__1_0.distcp"], names
    # 2 -> 2, into a differently initialised model
    model2 = shard_model(build(seed=4))
    opt2 = optimizer(model2)
    load_sharded_checkpoint(out_dir / "run2", model=model2, optimizer=opt2)
    state2 = full_state(model2, opt2)
    if rank == 0:
        save_file(state2, str(out_dir / "loaded-2to2.safetensors"))


@pytest.mark.slow  # 2 spawned processes: 20-40 s on 2 shared cores
def test_resharding_round_trips(tmp_path):
    model = build()
    opt = optimizer(model)
    train_step(model, opt)
    save_sharded_checkpoint(tmp_path / "run1", model=model, optimizer=opt, step=1,
                            data_position=4)  # one process, no process group
    want1 = full_state(model, opt)
    errors = spawn(_worker, 2, tmp_path, str(tmp_path))
    assert errors == ["", ""], "\n".join(errors)
    assert_same(load_file(str(tmp_path / "loaded-1to2.safetensors")), want1)
    want2 = load_file(str(tmp_path / "want2.safetensors"))
    assert not torch.equal(want2["model.embed.weight"], want1["model.embed.weight"])
    assert_same(load_file(str(tmp_path / "loaded-2to2.safetensors")), want2)
    # 2 -> 1: a plain model and optimizer, no process group
    model1 = build(seed=5)
    opt1 = optimizer(model1)
    ckpt = tmp_path / "run2" / "checkpoint"
    assert is_sharded_checkpoint(ckpt)
    assert load_sharded_checkpoint(ckpt, model=model1, optimizer=opt1) == {
        "step": 2, "data_position": 8}
    assert_same(full_state(model1, opt1), want2)
    assert model1.lm_head.weight is model1.embed.weight
    # export == the model's state; loadable by from_pretrained
    out = tmp_path / "export"
    out.mkdir()
    export_sharded(tmp_path / "run2", out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors",
                                                      "run.json"]
    loaded = GPT.from_pretrained(out)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, want2[f"model.{'embed.weight' if k == 'lm_head.weight' else k}"])
    assert loaded.lm_head.weight is loaded.embed.weight


def _failing_worker(rank: int, world: int, out: str, scenarios: list[str]) -> None:
    """Rank 1 fails during a save in each way of ``scenarios``, one after another; every
    rank records the error it got."""
    import torch.distributed.checkpoint as dcp

    import qkv.train.sharded_checkpoint as sc

    model = shard_model(build())
    opt = optimizer(model)
    train_step(model, opt)
    save_sharded_checkpoint(Path(out), model=model, optimizer=opt, step=1)
    plain_write, plain_states = dcp.FileSystemWriter.write_data, sc._states
    for where in scenarios:
        if rank == 1:
            if where == "write":  # inside DCP's write phase: an I/O error on this rank's shard
                def write_data(self, plan, planner):
                    raise OSError(28, "No space left on device")

                dcp.FileSystemWriter.write_data = write_data
            elif where == "state":  # in qkv's own phase, before DCP is entered
                def states(model, optimizer):
                    raise RuntimeError("state dict exploded")

                sc._states = states
            else:  # the process dies
                os._exit(3)
        try:
            save_sharded_checkpoint(Path(out), model=model, optimizer=opt, step=2)
            got = "no error"
        except Exception as exc:
            got = f"{type(exc).__name__}: {exc}"
        dcp.FileSystemWriter.write_data, sc._states = plain_write, plain_states
        Path(out, f"rank{rank}-{where}.txt").write_text(got)
    if "die" in scenarios:
        os._exit(0)  # the group is broken: skip the harness's shutdown barrier


def _previous_checkpoint_loads(run: Path) -> None:
    model = build(seed=9)
    assert load_sharded_checkpoint(run, model=model)["step"] == 1


@pytest.mark.slow  # 2 spawned processes: 20-40 s on 2 shared cores
def test_a_failing_rank_stops_every_rank(tmp_path):
    errors = spawn(_failing_worker, 2, tmp_path, str(tmp_path), ["write", "state"],
                   timeout=60)
    assert errors == ["", ""], "\n".join(errors)
    for where, what in (("write", "rank 1 failed: OSError: [Errno 28] No space left"),
                        ("state", "rank 1 failed: RuntimeError: state dict exploded")):
        for rank in (0, 1):
            text = (tmp_path / f"rank{rank}-{where}.txt").read_text()
            assert text.startswith("CheckpointError: sharded checkpoint"), text
            assert what in text, text
    _previous_checkpoint_loads(tmp_path)
    assert not (tmp_path / "checkpoint.tmp" / "sharded.json").exists()


@pytest.mark.slow
def test_a_dead_rank_stops_the_others(tmp_path):
    errors = spawn(_failing_worker, 2, tmp_path, str(tmp_path), ["die"], timeout=60)
    assert errors == ["exit code 0, no report", "exit code 3, no report"]
    text = (tmp_path / "rank0-die.txt").read_text()
    assert text.startswith("CheckpointError: sharded checkpoint"), text
    assert "another rank did not answer" in text
    _previous_checkpoint_loads(tmp_path)


def test_crafted_metadata_pickle_refused(tmp_path):
    model = build()
    opt = optimizer(model)
    ckpt = save_sharded_checkpoint(tmp_path, model=model, optimizer=opt, step=1)

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (ckpt / "sharded" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match=r"(posix|os)\.system"):
        load_sharded_model(ckpt)
    assert not (tmp_path / "pwned").exists()


def test_not_a_sharded_checkpoint(tmp_path):
    model = build()
    model.save_pretrained(tmp_path / "plain")
    with pytest.raises(CheckpointError, match="not a sharded checkpoint"):
        load_sharded_checkpoint(tmp_path / "plain", model=model)
    with pytest.raises(CheckpointError, match="not a sharded checkpoint"):
        export_sharded(tmp_path / "plain", tmp_path / "out")


def test_checkpoint_for_another_model_refused(tmp_path):
    model = build()
    save_sharded_checkpoint(tmp_path, model=model, optimizer=optimizer(model), step=1)
    other = GPT(GPTConfig.from_name("gpt-tiny", vocab_size=64, max_len=16, dim=64))
    with pytest.raises(CheckpointError, match="does not fit"):
        load_sharded_checkpoint(tmp_path / "checkpoint", model=other)
    assert json.loads((tmp_path / "checkpoint" / "sharded.json").read_text()) == {
        "format": "qkv-dcp-1", "world_size": 1}
