"""``set_adapter`` with several adapters of each kind: exactly the named one trains.

Two LoRA adapters, two bottleneck adapters and two prefixes in one model; after
``set_adapter(model, name)`` the trainable parameters are exactly those of ``name`` (found by
their state-dict path, ``...lora.<name>.``, ``...adapters.<name>.``, ``...prefixes.<name>.``),
and a backward pass gives gradients to those and to nothing else.

Shapes: B batch, N length, V vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from qkv.models import GPT, GPTConfig
from qkv.peft import (
    AdapterConfig,
    LoraConfig,
    PrefixConfig,
    active_adapter,
    add_adapters,
    add_lora,
    add_prefix,
    set_adapter,
)

NAMES = ("l1", "l2", "b1", "b2", "p1", "p2")


def _model() -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("gpt-tiny", vocab_size=40, max_len=32, dim=32,
                                    num_heads=4, num_layers=2))
    add_lora(model, LoraConfig(r=2, targets=("q", "v")), name="l1")
    add_lora(model, LoraConfig(r=2, targets=("k", "ffn_out")), name="l2")
    add_adapters(model, AdapterConfig(reduction_factor=4), name="b1")
    add_adapters(model, AdapterConfig(reduction_factor=8), name="b2")
    add_prefix(model, PrefixConfig(num_tokens=2), name="p1")
    add_prefix(model, PrefixConfig(num_tokens=3), name="p2")
    return model


def _owned(model: GPT, name: str) -> set[str]:
    marks = (f".lora.{name}.", f".adapters.{name}.", f".prefixes.{name}.")
    return {n for n, _ in model.named_parameters() if any(m in n for m in marks)}


@pytest.mark.parametrize("order", [NAMES, NAMES[::-1]], ids=["forward", "reverse"])
def test_set_adapter_leaves_only_the_named_adapter_trainable(order):
    model = _model()
    owned = {name: _owned(model, name) for name in NAMES}
    assert all(owned.values()), owned
    ids = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(1))
    for name in order:
        set_adapter(model, name)
        assert active_adapter(model) == name
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable == owned[name], (name, sorted(trainable ^ owned[name])[:6])
        model.zero_grad(set_to_none=True)
        model(ids).logsumexp(-1).sum().backward()
        graded = {n for n, p in model.named_parameters() if p.grad is not None}
        assert graded <= owned[name], (name, sorted(graded - owned[name])[:6])
