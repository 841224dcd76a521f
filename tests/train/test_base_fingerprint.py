"""What an adapter run's base.json fingerprints: the base's weights *and* its config. An
edited config.json (activation gelu_tanh -> relu: the same weights, another model) is refused
by ``load_run`` naming the base and its config.json; re-indenting config.json is not a change;
a base.json written before the config was recorded still loads, its weights still checked.
Flamingo's bases likewise: a base whose config differs from the recorded one is refused.

Oracles: the config hash is recomputed here with hashlib over json.dumps(sort_keys,
compact separators); "another model" is shown by the edited base's logits differing.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qkv.data import CharTokenizer
from qkv.models import GPT, CheckpointError, Flamingo, GPTConfig, ViT, ViTConfig
from qkv.peft import LoraConfig, add_lora, save_adapter
from qkv.train import load_run
from qkv.train.finetune import load_base


def make_run(tmp_path: Path) -> tuple[Path, Path]:
    """(base checkpoint dir, adapter run dir): a tiny GPT base and a LoRA run on it, laid out
    as ``qkv train --init-from BASE --lora`` lays them out."""
    torch.manual_seed(0)
    tok = CharTokenizer("abcdefgh")
    base = tmp_path / "base"
    GPT(GPTConfig.from_name("gpt-tiny", vocab_size=tok.vocab_size, max_len=16, dim=32,
                            num_heads=4, num_layers=1)).save_pretrained(base)
    tok.save(base / "tokenizer.json")
    loaded = load_base(base, "gpt")
    add_lora(loaded.model, LoraConfig(r=2, targets=("q", "v")))
    ckpt = tmp_path / "run" / "checkpoint"
    save_adapter(loaded.model, ckpt)
    (ckpt / "base.json").write_text(json.dumps(loaded.info()))
    tok.save(ckpt / "tokenizer.json")
    return base, tmp_path / "run"


def canonical_sha(config_file: Path) -> str:
    text = json.dumps(json.loads(config_file.read_text()), sort_keys=True,
                      separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def set_activation(config_file: Path, value: str) -> None:
    data = json.loads(config_file.read_text())
    data["activation"] = value
    config_file.write_text(json.dumps(data, indent=2))


def test_base_json_records_the_config_and_the_weights(tmp_path):
    base, run = make_run(tmp_path)
    info = json.loads((run / "checkpoint" / "base.json").read_text())
    assert info == {"path": str(base.resolve()),
                    "sha256": hashlib.sha256((base / "model.safetensors").read_bytes())
                    .hexdigest(),
                    "config_sha256": canonical_sha(base / "config.json")}


def test_a_changed_activation_in_the_base_config_is_refused(tmp_path):
    base, run = make_run(tmp_path)
    ids = torch.tensor([[4, 5, 6, 7]])
    before = GPT.from_pretrained(base)(ids)
    load_run(run)  # fine as it is
    set_activation(base / "config.json", "relu")
    with torch.no_grad():  # the same weights, another model
        assert not torch.allclose(GPT.from_pretrained(base)(ids), before, atol=1e-3)
    with pytest.raises(CheckpointError, match=r"config\.json") as err:
        load_run(run)
    assert str(base.resolve()) in str(err.value) and "changed since" in str(err.value)
    set_activation(base / "config.json", "gelu_tanh")  # put back: the same model again
    load_run(run)


def test_a_reformatted_config_is_the_same_model(tmp_path):
    base, run = make_run(tmp_path)
    data = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps(dict(reversed(list(data.items()))),
                                                 indent=7))
    model, _ = load_run(run)
    assert model.config.activation == "gelu_tanh"


def test_an_old_base_json_without_the_config_still_loads_and_checks_the_weights(tmp_path):
    base, run = make_run(tmp_path)
    info_file = run / "checkpoint" / "base.json"
    info = json.loads(info_file.read_text())
    del info["config_sha256"]  # as runs made before the config was recorded
    info_file.write_text(json.dumps(info))
    load_run(run)
    set_activation(base / "config.json", "relu")  # not recorded: not checked (documented)
    load_run(run)
    state = load_file(str(base / "model.safetensors"))
    key = sorted(state)[0]
    state[key] = state[key] + 1e-3
    save_file(state, str(base / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="changed since"):
        load_run(run)


def test_flamingo_refuses_a_base_whose_config_changed(tmp_path):
    torch.manual_seed(0)
    lm = GPT(GPTConfig.from_name("gpt-tiny", vocab_size=24, max_len=64, dim=32, num_heads=4,
                                 num_layers=2))
    vit = ViT(ViTConfig.from_name("vit-tiny", dim=16, image_size=16, patch_size=8))
    model = Flamingo(lm, vit, image_token_id=5, num_latents=3).eval()
    lm.save_pretrained(tmp_path / "lm")
    vit.save_pretrained(tmp_path / "vit")
    out = model.save_pretrained(tmp_path / "fl", lm_path=tmp_path / "lm",
                                vision_path=tmp_path / "vit")
    Flamingo.from_pretrained(out)  # fine as it is
    # the qkv version that wrote the recorded config is not part of the model
    meta = json.loads((out / "flamingo_config.json").read_text())
    meta["bases"]["lm"]["config"]["qkv_version"] = "0.0.1"
    (out / "flamingo_config.json").write_text(json.dumps(meta))
    Flamingo.from_pretrained(out)
    set_activation(tmp_path / "lm" / "config.json", "relu")  # same weights, another model
    with pytest.raises(CheckpointError, match=r"the lm base .*config differs.*activation"):
        Flamingo.from_pretrained(out)
    relu = GPT(GPTConfig(**{**lm.config.__dict__, "activation": "relu"}))
    relu.load_state_dict(lm.state_dict())
    with pytest.raises(CheckpointError, match="activation 'gelu_tanh' -> 'relu'"):
        Flamingo.from_pretrained(out, lm=relu)


def test_init_from_a_sharded_run_says_export_it_first(tmp_path):
    """A ``qkv train --fsdp`` checkpoint (config.json + sharded.json + DCP shards, no
    model.safetensors) was blamed on a missing pytorch_model.bin."""
    ckpt = tmp_path / "run" / "checkpoint"
    (ckpt / "sharded").mkdir(parents=True)
    (ckpt / "config.json").write_text(json.dumps({"model_type": "qkv-gpt"}))
    (ckpt / "sharded.json").write_text(json.dumps({"format": "qkv-dcp-1", "world_size": 2}))
    with pytest.raises(CheckpointError, match=r"--fsdp.*qkv export .* --out DIR"):
        load_base(ckpt, "gpt")
