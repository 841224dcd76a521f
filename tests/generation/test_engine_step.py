"""The decode engine's torch backend (``qkv.generation.engine.decoder_stepper``, backend
"torch": ``TorchLayers`` on (in, out) weight copies) against the model's own uncached
forward, in fp64: one row (q as a view of the fused projection), GQA, RoPE, a prompt padded
on the left, up to the cache's capacity, and ``reorder`` with rows taken from other prompts.

Shapes: R rows, N prompt length, T new tokens, V vocab size.
"""

from __future__ import annotations

import pytest
import torch

from qkv.generation.engine import decoder_stepper
from qkv.generation.plan import decode_plan
from qkv.models import GPT, GPTConfig

F64 = dict(atol=1e-12, rtol=1e-10)  # fp64: same math, another op order


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=40, max_len=64, dim=32, num_layers=2, num_heads=4, **kw)
    model = GPT(GPTConfig(**cfg), dtype=torch.float64)
    with torch.no_grad():  # weights large enough that every part matters
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5)
    return model.eval()


def _forward_logits(model, ids, keep, new):
    """Logits (R, T + 1, V) of the last prompt position and each new token, uncached."""
    full = torch.cat((ids, new), dim=1)
    mask = None if keep is None else torch.cat((keep, torch.ones_like(new, dtype=torch.bool)),
                                               dim=1)
    with torch.no_grad():
        return model(full, attention_mask=mask)[:, ids.shape[1] - 1:]


@pytest.mark.parametrize("kw", [dict(), dict(num_kv_heads=2), dict(num_kv_heads=1,
                                                                   positions="rope")],
                         ids=["mha", "gqa", "mqa-rope"])
def test_one_row_to_capacity_equals_forward(kw):
    """R = 1 takes the view path for q; T steps fill the cache to its last slot. An fp64
    plan decodes on the torch backend without forcing it (the C layer and oneDNN are fp32)."""
    model = _gpt(**kw)
    assert not decode_plan(model).int8
    torch.manual_seed(3)
    ids, new = torch.randint(1, 40, (1, 5)), torch.randint(1, 40, (1, 9))
    with torch.inference_mode():
        stepper = decoder_stepper(model, ids, None, ids.shape[1] + new.shape[1])
        assert stepper.backend == "torch"
        got = [stepper.prefill()] + [stepper.step(new[:, i]) for i in range(new.shape[1])]
    torch.testing.assert_close(torch.stack(got, dim=1), _forward_logits(model, ids, None, new),
                               **F64)


@pytest.mark.parametrize("kw", [dict(), dict(num_kv_heads=2, positions="rope")],
                         ids=["mha", "gqa-rope"])
def test_reorder_takes_rows_from_other_prompts(kw):
    """After ``reorder(idx)`` row r continues row idx[r]'s sequence — its cache, padding
    and positions — even across differently padded prompts (beam search only reorders
    within one prompt's beams, where those coincide)."""
    model = _gpt(**kw)
    torch.manual_seed(4)
    ids = torch.randint(1, 40, (3, 6))
    keep = torch.ones(3, 6, dtype=torch.bool)
    keep[1, :4] = False
    keep[2, :1] = False
    ids = ids * keep
    new = torch.randint(1, 40, (3, 4))
    idx = torch.tensor([1, 2, 1])
    with torch.inference_mode():
        stepper = decoder_stepper(model, ids, keep, ids.shape[1] + 4)
        assert stepper.backend == "torch"
        stepper.prefill()
        stepper.step(new[:, 0])
        stepper.reorder(idx)
        got = torch.stack([stepper.step(new[idx, i]) for i in (1, 2, 3)], dim=1)
    want = _forward_logits(model, ids[idx], keep[idx], new[idx])[:, 2:]  # (3, 3, V)
    torch.testing.assert_close(got, want, **F64)
