"""Adapter files that lie or are corrupt are refused before anything is allocated, and
leave the model as it was: an ``adapter_config.json`` whose size (LoRA ``r``, a bottleneck
``reduction_factor``, a prefix's ``num_tokens``) disagrees with the tensors beside it — qkv's
files and HF PEFT's; NaN/inf weights; non-float weights; a LoRA ``alpha`` (or a parallel
adapter's ``scaling``) too large for any real setting.

Oracles: the file's shapes are read here from the raw safetensors header (8-byte little-endian
length + JSON), not through qkv; "before allocating" is shown by the kind's parameter
constructor failing the test if it is ever called.
"""

from __future__ import annotations

import ast
import json
import math
import re
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qkv.models import GPT, CheckpointError, GPTConfig
from qkv.peft import (
    AdapterConfig,
    LoraConfig,
    PrefixConfig,
    adapter_names,
    adapter_shapes,
    add_adapters,
    add_lora,
    add_prefix,
    load_adapter,
    save_adapter,
)
from qkv.peft import adapters as adapters_module
from qkv.peft import lora as lora_module
from qkv.peft import prefix as prefix_module

ADD = {"lora": lambda m: add_lora(m, LoraConfig(r=4, targets=("q", "v"))),
       "bottleneck": lambda m: add_adapters(m, AdapterConfig(reduction_factor=8)),
       "prefix": lambda m: add_prefix(m, PrefixConfig(num_tokens=3))}
#: the config field that sizes each kind, a huge value of it, and the class that allocates
HUGE = {"lora": ("r", 2_000_000, (lora_module, "LoraUpdate")),
        "bottleneck": ("reduction_factor", 1e-5, (adapters_module, "Bottleneck")),
        "prefix": ("num_tokens", 100_000_000, (prefix_module, "PrefixKV"))}


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.from_name("gpt-tiny", vocab_size=40, max_len=32, dim=32,
                                   num_heads=4, num_layers=2)).eval()


def raw_header(file: Path) -> dict:
    """The safetensors header, parsed by hand."""
    data = file.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    return header


def saved(tmp_path: Path, kind: str) -> Path:
    model = gpt()
    ADD[kind](model)
    with torch.no_grad():  # random values everywhere (B / up start at zero)
        for p in model.parameters():
            if p.requires_grad:
                p.normal_()
    return save_adapter(model, tmp_path / kind)


def edit_config(path: Path, **fields) -> None:
    meta = json.loads((path / "adapter_config.json").read_text())
    meta["config"].update(fields)
    (path / "adapter_config.json").write_text(json.dumps(meta))


def never_built(monkeypatch, where) -> None:
    module, name = where

    def refuse(*args, **kwargs):
        raise AssertionError(f"{name} was built: something was allocated before the check")

    monkeypatch.setattr(module, name, refuse)


def untouched(model: GPT) -> bool:
    return adapter_names(model) == [] and all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("kind", list(HUGE))
def test_a_config_size_beyond_the_file_is_refused_before_allocating(tmp_path, kind,
                                                                    monkeypatch):
    path = saved(tmp_path, kind)
    field, value, where = HUGE[kind]
    edit_config(path, **{field: value})
    header = raw_header(path / "adapter_model.safetensors")
    model = gpt()
    never_built(monkeypatch, where)
    with pytest.raises(CheckpointError) as err:
        load_adapter(model, path)
    text = str(err.value)
    assert f"{field}={value!r}" in text or f"{field}={value}" in text, text
    # both shapes: the file's (from the raw header) and the one the config implies
    key, file_shape = next((k, tuple(v["shape"])) for k, v in sorted(header.items())
                           if f"file {tuple(v['shape'])}" in text)
    assert max(file_shape) < 1000 and "model (" in text
    implied = text.split(f"{key}: file {file_shape}, model ", 1)[1].split(")", 1)[0] + ")"
    assert math.prod(ast.literal_eval(implied)) > 100 * math.prod(file_shape)
    assert untouched(model)


def test_the_implied_shapes_are_those_the_add_functions_build():
    """``adapter_shapes`` (what files are checked against) == what each add function builds
    and ``save_adapter`` writes, for every kind and LoRA target set."""
    configs = [LoraConfig(r=3, targets=("q", "k", "v", "out", "ffn_in", "ffn_out")),
               LoraConfig(r=2, targets=("qkv",)),
               AdapterConfig(reduction_factor=4, placement="houlsby"),
               AdapterConfig(reduction_factor=2, placement="parallel"),
               PrefixConfig(num_tokens=5)]
    adders = {LoraConfig: add_lora, AdapterConfig: add_adapters, PrefixConfig: add_prefix}
    for config in configs:
        model = gpt()
        want = adapter_shapes(model, config)
        adders[type(config)](model, config)
        with tempfile.TemporaryDirectory() as tmp:
            save_adapter(model, tmp)
            header = raw_header(Path(tmp) / "adapter_model.safetensors")
        assert {k: tuple(v["shape"]) for k, v in header.items()} == want, config


def test_a_peft_file_whose_rank_disagrees_is_refused_before_allocating(tmp_path,
                                                                      monkeypatch):
    """An HF PEFT LoRA directory (GPT-2's c_attn, keys as PEFT writes them) with r=2
    tensors and "r": 2000000 in its config."""
    model = gpt()
    c, r = 32, 2
    tensors = {}
    for i in range(2):
        pre = f"base_model.model.transformer.h.{i}.attn.c_attn"
        tensors[f"{pre}.lora_A.weight"] = torch.randn(r, c)
        tensors[f"{pre}.lora_B.weight"] = torch.randn(3 * c, r)
    path = tmp_path / "peft"
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    meta = {"peft_type": "LORA", "r": r, "lora_alpha": 4, "target_modules": ["c_attn"],
            "bias": "none", "fan_in_fan_out": True}
    (path / "adapter_config.json").write_text(json.dumps(meta))
    load_adapter(gpt(), path)  # as written, it loads
    meta["r"] = 2_000_000
    (path / "adapter_config.json").write_text(json.dumps(meta))
    never_built(monkeypatch, (lora_module, "LoraUpdate"))
    with pytest.raises(CheckpointError, match=r"r=2000000.*file \(2, 32\), model "
                                              r"\(2000000, 32\)"):
        load_adapter(model, path)
    assert untouched(model)


@pytest.mark.parametrize("kind", list(HUGE))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_adapter_weights_are_refused(tmp_path, kind, bad):
    path = saved(tmp_path, kind)
    file = path / "adapter_model.safetensors"
    state = load_file(str(file))
    key = sorted(state)[-1]
    state[key].view(-1)[[0, 3]] = bad
    save_file(state, str(file))
    model = gpt()
    with pytest.raises(CheckpointError, match="non-finite") as err:
        load_adapter(model, path)
    assert f"{key}: 2 of {state[key].numel()}" in str(err.value)
    assert untouched(model)


@pytest.mark.parametrize("kind", list(HUGE))
def test_non_float_adapter_weights_are_refused(tmp_path, kind):
    path = saved(tmp_path, kind)
    file = path / "adapter_model.safetensors"
    state = load_file(str(file))
    key = sorted(state)[0]
    state[key] = state[key].to(torch.int32)
    save_file(state, str(file))
    model = gpt()
    with pytest.raises(CheckpointError, match=re.escape(f"{key}: dtype I32")):
        load_adapter(model, path)
    assert untouched(model)


def test_an_absurd_lora_scale_is_refused_and_a_large_real_one_kept(tmp_path):
    for alpha, r, rslora in [(1e300, 8, False), (1001.0, 1, False), (4e3, 9, True)]:
        with pytest.raises(ValueError, match=r"alpha=.*scale.*beyond 1000"):
            LoraConfig(r=r, alpha=alpha, rslora=rslora)
    assert LoraConfig(r=1, alpha=1000.0).scale == 1000.0  # the bound itself is allowed
    assert LoraConfig(r=64, alpha=128, rslora=True).scale == 16.0
    with pytest.raises(ValueError, match=r"scaling=1e\+300"):
        AdapterConfig(placement="parallel", scaling=1e300)
    path = saved(tmp_path, "lora")
    edit_config(path, alpha=1e300)
    model = gpt()
    with pytest.raises(CheckpointError, match=r"adapter_config\.json.*alpha=1e\+300"):
        load_adapter(model, path)
    assert untouched(model)
