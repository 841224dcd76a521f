"""Checkpoint files: config + safetensors round trip, atomic writes, pickle refused,
malformed files and mismatched keys/shapes give clean errors (checklist 16, 25, 27, 28)."""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from torch import nn

from qkv.models.hub import (
    CheckpointError,
    ModelConfig,
    PretrainedMixin,
    atomic_write,
    load_state_dict_file,
)


@dataclasses.dataclass(frozen=True)
class TinyConfig(ModelConfig):
    MODEL_TYPE: ClassVar[str] = "qkv-tiny-test"
    PRESETS: ClassVar[dict] = {"tiny": {"dim": 4}}
    dim: int = 4


class Tiny(PretrainedMixin, nn.Module):
    config_class = TinyConfig

    def __init__(self, config: TinyConfig):
        super().__init__()
        self.config = config
        self.lin = nn.Linear(config.dim, config.dim)


def test_round_trip_exact(tmp_path):
    model = Tiny(TinyConfig.from_name("tiny"))
    model.save_pretrained(tmp_path)
    loaded = Tiny.from_pretrained(tmp_path)
    assert loaded.config == model.config
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k])
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qkv-tiny-test"


def test_unknown_config_field_and_preset():
    with pytest.raises(ValueError, match="unknown config fields"):
        TinyConfig.from_dict({"dim": 4, "dimm": 5})
    with pytest.raises(ValueError, match="unknown preset"):
        TinyConfig.from_name("huge")


def test_atomic_write_keeps_previous_file_on_failure(tmp_path):
    target = tmp_path / "f.txt"
    target.write_text("old")

    def broken(tmp):
        Path(tmp).write_text("half")
        raise KeyboardInterrupt  # a kill while writing

    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, broken)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]  # no temp file left


def test_mismatched_keys_and_shapes_load_nothing(tmp_path):
    Tiny(TinyConfig(dim=4)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["dim"] = 5
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="shape mismatches"):
        Tiny.from_pretrained(tmp_path)


def test_malformed_safetensors(tmp_path):
    Tiny(TinyConfig()).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CheckpointError, match="not a valid safetensors"):
        Tiny.from_pretrained(tmp_path)


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "pwned"))


def test_pickle_refused_by_default_and_weights_only_when_allowed(tmp_path):
    marker = tmp_path / "marker"
    with open(tmp_path / "pytorch_model.bin", "wb") as f:
        pickle.dump({"lin.weight": _Evil(str(marker))}, f, protocol=2)
    with pytest.raises(CheckpointError, match="pickle"):
        load_state_dict_file(tmp_path)
    with pytest.raises(CheckpointError, match="weights_only"):
        load_state_dict_file(tmp_path, allow_pickle=True)
    assert not marker.exists()


def test_plain_tensor_pickle_loads_only_when_allowed(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError):
        load_state_dict_file(tmp_path)
    assert torch.equal(load_state_dict_file(tmp_path, allow_pickle=True)["w"], torch.ones(2))
