"""``save_pretrained`` on a model holding adapters never writes a directory that
``from_pretrained`` refuses: with every LoRA adapter merged it writes the plain model (the
merged weights under the base keys; it loads and computes what the adapted model computes);
an unmerged LoRA, a bottleneck adapter or a prefix is refused in one line naming
``save_adapter``; once the adapters are gone it is the class's own method again. And the
int8 model: unmerging after quantizing, or adding adapters to it, says that it is quantized.

Oracles: the adapted model's own logits (unmerged, before any saving); the key set of a plain
GPT built from the same config. fp32: merged vs unmerged within atol 1e-5.
"""

from __future__ import annotations

import copy

import pytest
import torch

from qkv.generation.quantize import quantize
from qkv.models import GPT, GPTConfig
from qkv.peft import (
    AdapterConfig,
    LoraConfig,
    PrefixConfig,
    add_adapters,
    add_lora,
    add_prefix,
    load_adapter,
    merge,
    remove_adapters,
    remove_prefix,
    save_adapter,
    unload,
    unmerge,
)

IDS = torch.tensor([[1, 5, 9, 3, 7], [2, 2, 8, 30, 4]])


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.from_name("gpt-tiny", vocab_size=40, max_len=32, dim=32,
                                   num_heads=4, num_layers=2)).eval()


def randomise(model: GPT) -> None:
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def test_a_merged_lora_model_saves_as_the_plain_model(tmp_path):
    model = gpt()
    add_lora(model, LoraConfig(r=4, alpha=8, targets=("q", "v", "ffn_in")))
    randomise(model)
    with torch.no_grad():
        want = model(IDS)  # the adapted model, unmerged
    merge(model)
    model.save_pretrained(tmp_path / "plain")
    plain = GPT.from_pretrained(tmp_path / "plain")
    assert set(plain.state_dict()) == set(GPT(model.config).state_dict())
    with torch.no_grad():
        torch.testing.assert_close(plain(IDS), want, atol=1e-5, rtol=0)
    # the model still holds its adapter, merged; unmerging gives the base again
    assert any(".lora." in k for k in model.state_dict())
    unmerge(model)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["lora", "bottleneck", "prefix"])
def test_an_unmerged_adapter_is_refused_naming_save_adapter(tmp_path, kind):
    model = gpt()
    {"lora": lambda: add_lora(model, LoraConfig(r=2)),
     "bottleneck": lambda: add_adapters(model, AdapterConfig(reduction_factor=4)),
     "prefix": lambda: add_prefix(model, PrefixConfig(num_tokens=2))}[kind]()
    with pytest.raises(ValueError, match=r"GPT\.save_pretrained: .*not merged") as err:
        model.save_pretrained(tmp_path / "out")
    text = str(err.value)
    assert "\n" not in text and "qkv.peft.save_adapter(model, DIR)" in text
    assert ("qkv.peft.merge(model)" in text) == (kind == "lora")
    assert ("cannot be merged" in text) == (kind != "lora")
    assert not (tmp_path / "out").exists()
    save_adapter(model, tmp_path / "adapter")  # the way it points to works
    load_adapter(gpt(), tmp_path / "adapter")


def test_without_adapters_save_pretrained_is_the_class_method_again(tmp_path):
    model = gpt()
    add_lora(model, LoraConfig(r=2))
    add_adapters(model, AdapterConfig(reduction_factor=4), name="b")
    add_prefix(model, PrefixConfig(num_tokens=2), name="p")
    removals = [lambda: remove_prefix(model, "p"), lambda: remove_adapters(model, "b"),
                  lambda: unload(model)]
    for step in removals:
        assert "save_pretrained" in vars(model)
        step()
    assert "save_pretrained" not in vars(model)
    model.save_pretrained(tmp_path / "base")
    with torch.no_grad():
        torch.testing.assert_close(GPT.from_pretrained(tmp_path / "base")(IDS), gpt()(IDS),
                                   atol=0, rtol=0)


def test_a_copy_guards_its_own_saves(tmp_path):
    model = gpt()
    add_lora(model, LoraConfig(r=2))
    randomise(model)
    merge(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight.mul_(2.0)
        want = twin(IDS)
    twin.save_pretrained(tmp_path / "twin")
    with torch.no_grad():
        torch.testing.assert_close(GPT.from_pretrained(tmp_path / "twin")(IDS), want,
                                   atol=1e-5, rtol=0)


def test_unmerging_or_adapting_an_int8_model_says_it_is_quantized():
    model = gpt()
    add_lora(model, LoraConfig(r=2))
    merge(model)
    quantize(model, "int8")
    with pytest.raises(ValueError, match=r"unmerge: the model is quantized to int8.*before "
                                         r"quantizing"):
        unmerge(model)
    q = gpt()
    quantize(q, "int8")
    for add in (lambda m: add_lora(m, LoraConfig(r=2)),
                lambda m: add_adapters(m, AdapterConfig(reduction_factor=4)),
                lambda m: add_prefix(m, PrefixConfig(num_tokens=2))):
        with pytest.raises(ValueError, match="quantized to int8"):
            add(q)
