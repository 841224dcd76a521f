"""LoRA dropout > 0 in eval mode on the composed (unfused) LoRA path: it must do nothing.

The composed path serves mixed-adapter batches (``adapter_rows``), autocast and
``onednn_linear(False)``; the fused path is tested elsewhere. The oracle is the merged model
(W + scale · B A folded into the weight, a plain ``nn.Linear``): it has no dropout at all.

Shapes: B batch, N length, V vocabulary.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from qkv.models import GPT, GPTConfig
from qkv.ops import onednn_linear
from qkv.peft import LoraConfig, adapter_rows, add_lora, disable_adapters, merge, set_adapter

NAMES = ["b", "base", "a", "b", "a"]


def _model() -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=61, max_len=32, dim=48, num_layers=2, num_heads=4))
    add_lora(model, LoraConfig(r=4, targets=("q", "v", "out", "ffn_in"), dropout=0.5),
             name="a")
    add_lora(model, LoraConfig(r=2, targets=("k", "ffn_out"), dropout=0.5), name="b")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora." in name:  # B = 0 at init would hide every update
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return model.eval()


def _merged(model: nn.Module, name: str) -> nn.Module:
    """A copy with adapter ``name`` folded into the weights (or the base for "base")."""
    m = copy.deepcopy(model)
    if name == "base":
        return m
    set_adapter(m, name)
    merge(m)
    return m


def _rows_oracle(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = []
    for i, name in enumerate(NAMES):
        m = _merged(model, name)
        if name == "base":
            with disable_adapters(m):
                out.append(m(ids[i:i + 1]))
        else:
            out.append(m(ids[i:i + 1]))
    return torch.cat(out)  # (B, N, V)


def test_eval_mixed_adapter_rows_apply_no_dropout():
    model = _model()
    ids = torch.randint(0, 61, (len(NAMES), 9), generator=torch.Generator().manual_seed(2))
    want = _rows_oracle(model, ids)
    with torch.no_grad():
        for seed in (3, 4):  # two RNG states: dropout would give two different answers
            torch.manual_seed(seed)
            with adapter_rows(model, NAMES):
                got = model(ids)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_eval_with_onednn_off_applies_no_dropout():
    model = _model()
    set_adapter(model, "a")
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(2))
    want = _merged(model, "a")(ids)
    with torch.no_grad(), onednn_linear(False):
        for seed in (3, 4):
            torch.manual_seed(seed)
            torch.testing.assert_close(model(ids), want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="CPU bf16 autocast")
def test_eval_under_autocast_applies_no_dropout():
    model = _model()
    set_adapter(model, "b")
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(2))
    want = _merged(model, "b")(ids)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(3)
        first = model(ids).float()
        torch.manual_seed(4)
        second = model(ids).float()
    torch.testing.assert_close(first, second, atol=0, rtol=0)  # deterministic in eval
    torch.testing.assert_close(first, want, atol=0.15, rtol=0.05)  # bf16 GEMMs vs fp32


def test_training_mode_does_apply_dropout_on_these_paths():
    """The same paths in train mode do drop (so the eval tests above can tell)."""
    model = _model().train()
    ids = torch.randint(0, 61, (len(NAMES), 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), adapter_rows(model, NAMES):
        torch.manual_seed(3)
        first = model(ids)
        torch.manual_seed(4)
        second = model(ids)
    assert (first[2] - second[2]).abs().max() > 1e-3
