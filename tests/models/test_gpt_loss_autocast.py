"""``GPT.loss`` (the chunked LM-head loss) under CPU autocast: it raised "mat1 and mat2 must
have the same dtype" when the hidden states came out bf16 and the head was fp32.

Oracle: the same model's plain fp32 ``cross_entropy`` of its full logits; bf16 computes the
layers with an 8-bit mantissa, so the loss agrees within rel 2e-2 and gradients flow."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qkv.models import GPT, GPTConfig


def test_gpt_loss_under_bf16_autocast_matches_fp32_and_backpropagates():
    model = GPT(GPTConfig(vocab_size=50, dim=32, num_layers=2, num_heads=4, max_len=16))
    ids = torch.randint(0, 50, (2, 12))
    targets = torch.randint(0, 50, (2, 12))
    want = F.cross_entropy(model(ids).flatten(0, 1).double(), targets.flatten())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model.loss(ids, targets)
    assert got.dtype == torch.float32
    assert abs(got.item() - want.item()) <= 2e-2 * want.item()
    got.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.lm_head.weight.grad.abs().sum() > 0
