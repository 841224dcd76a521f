"""One entry point for every adapter kind: ``save_adapter`` / ``load_adapter`` round trips
for LoRA, bottleneck adapters and prefixes; ``set_adapter`` / ``disable_adapters`` switch
them all; ``MultiHeadAttention.to_torch`` refuses an unmerged LoRA."""

from __future__ import annotations

import copy
import json
import zlib

import pytest
import torch

from qkv.models import GPT, CheckpointError, GPTConfig
from qkv.peft import (
    AdapterConfig,
    LoraConfig,
    PrefixConfig,
    active_adapter,
    adapter_kinds,
    adapter_names,
    add_adapters,
    add_lora,
    add_prefix,
    disable_adapters,
    load_adapter,
    merge,
    save_adapter,
    set_adapter,
    unmerge,
)


def gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.from_name("gpt-tiny", vocab_size=40, max_len=32, dim=32,
                                   num_heads=4, num_layers=2)).eval()


def randomise(model: torch.nn.Module) -> None:
    """Give every trainable (adapter) parameter random values: B / up are zero at init, so
    a round trip of fresh adapters would prove nothing."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


ADD = {"lora": lambda m, name: add_lora(m, LoraConfig(r=3, targets=("q", "v", "ffn_out")),
                                        name=name),
       "bottleneck": lambda m, name: add_adapters(m, AdapterConfig(reduction_factor=4),
                                                  name=name),
       "prefix": lambda m, name: add_prefix(m, PrefixConfig(num_tokens=3), name=name)}
IDS = torch.tensor([[1, 5, 7, 9, 11, 3], [2, 4, 6, 8, 10, 12]])


@pytest.mark.parametrize("kind", list(ADD))
def test_save_load_round_trip_every_kind(tmp_path, kind):
    model = gpt()
    base = copy.deepcopy(model)
    ADD[kind](model, "task")
    randomise(model)
    with torch.no_grad():
        want = model(IDS)
    path = save_adapter(model, tmp_path / "a")  # the active adapter
    meta = json.loads((path / "adapter_config.json").read_text())
    assert meta["kind"] == kind and meta["name"] == "task"

    fresh = copy.deepcopy(base)
    assert load_adapter(fresh, path) == "task"
    assert active_adapter(fresh) == "task" and adapter_kinds(fresh) == {"task": [kind]}
    with torch.no_grad():
        assert torch.equal(fresh(IDS), want)
        with disable_adapters(fresh):
            assert torch.equal(fresh(IDS), base(IDS))
    trainable = {n for n, p in fresh.named_parameters() if p.requires_grad}
    assert trainable and all(("task" in n) for n in trainable)


MARKS = {"lora": ".lora.lora.", "bottleneck": ".adapters.bottleneck.",
         "prefix": ".prefixes.prefix."}


def fill(model: torch.nn.Module, kind: str) -> None:
    """Give adapter ``kind``'s parameters values that depend only on their name as the base
    model would spell it (wrappers' '.base' removed), so that the same adapter gets the same
    values in a model holding it alone and in one holding every kind."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            plain = name.replace(".base.", ".")
            if MARKS[kind] in plain:
                g = torch.Generator().manual_seed(zlib.crc32(plain.encode()))
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def test_set_adapter_switches_between_kinds():
    base = gpt()
    solo = {}
    for kind in ADD:
        solo[kind] = copy.deepcopy(base)
        ADD[kind](solo[kind], kind)
        fill(solo[kind], kind)
    mixed = copy.deepcopy(base)
    for kind in ADD:  # the same adapters, all in one model (add_* each activate their own)
        ADD[kind](mixed, kind)
        fill(mixed, kind)
    assert adapter_names(mixed) == ["lora", "bottleneck", "prefix"]
    with torch.no_grad():
        for kind in ADD:
            set_adapter(mixed, kind)
            assert active_adapter(mixed) == kind
            trainable = [n for n, p in mixed.named_parameters() if p.requires_grad]
            assert trainable and all(MARKS[kind] in n.replace(".base.", ".")
                                     for n in trainable)
            torch.testing.assert_close(mixed(IDS), solo[kind](IDS), atol=1e-6, rtol=0)
        with disable_adapters(mixed):
            assert torch.equal(mixed(IDS), base(IDS))
        torch.testing.assert_close(mixed(IDS), solo["prefix"](IDS), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="no adapter named 'nope'"):
        set_adapter(mixed, "nope")


def test_load_adapter_refuses_a_mismatch_and_leaves_the_model_as_it_was(tmp_path):
    for kind in ("bottleneck", "prefix"):
        model = gpt()
        ADD[kind](model, "x")
        save_adapter(model, tmp_path / kind)
        other = GPT(GPTConfig.from_name("gpt-tiny", vocab_size=40, max_len=32, dim=48,
                                        num_heads=4, num_layers=2)).eval()
        keys = set(other.state_dict())
        with pytest.raises(CheckpointError, match="do not fit"):
            load_adapter(other, tmp_path / kind)
        assert set(other.state_dict()) == keys and adapter_names(other) == []
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd/adapter_config.json").write_text('{"kind": "ia3"}')
    with pytest.raises(CheckpointError, match="not a qkv adapter"):
        load_adapter(gpt(), tmp_path / "odd")


def test_disable_adapters_needs_an_adapter_and_save_needs_a_name():
    with pytest.raises(ValueError, match="has no adapter"), disable_adapters(gpt()):
        pass
    model = gpt()
    with pytest.raises(ValueError, match="no adapter named"):
        save_adapter(model, "unused")


def test_to_torch_refuses_an_unmerged_lora_and_exports_a_merged_one():
    model = gpt()
    add_lora(model, LoraConfig(r=2, targets=("q", "k", "v", "out")))
    randomise(model)
    attn = model.layers[0].attn
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        want = attn(x)
    with pytest.raises(ValueError, match=r"in_proj is a LoraLinear.*merge"):
        attn.to_torch()
    merge(model)
    with torch.no_grad():
        got, _ = attn.to_torch()(x, x, x, need_weights=False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    unmerge(model)
    with disable_adapters(model), torch.no_grad():
        base, _ = attn.to_torch()(x, x, x, need_weights=False)
        torch.testing.assert_close(base, attn(x), atol=1e-6, rtol=0)


def test_load_adapter_makes_the_loaded_adapter_the_only_active_one(tmp_path):
    """Loading a LoRA into a model with an active bottleneck adapter: the bottleneck steps
    aside, the model computes base + LoRA only."""
    base = gpt()
    solo = copy.deepcopy(base)
    ADD["lora"](solo, "lora")
    fill(solo, "lora")
    save_adapter(solo, tmp_path / "lora")
    model = copy.deepcopy(base)
    ADD["bottleneck"](model, "bottleneck")
    fill(model, "bottleneck")
    load_adapter(model, tmp_path / "lora")
    assert active_adapter(model) == "lora"
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), solo(IDS), atol=1e-6, rtol=0)
        set_adapter(model, "bottleneck")
        assert not torch.allclose(model(IDS), solo(IDS))
