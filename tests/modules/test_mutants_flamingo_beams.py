"""Flamingo beams: each of a bound row's K beam rows sees that row's images — compared with
the row bound and run alone (one row, so no per-beam repetition is involved at all).

``FlamingoDecoder`` takes R = B·K rows, each bound row repeated K times consecutively (beam
search's order); its gated cross-attention keys/values must follow that order.

Shapes: B bound rows, K beams, N text length, V vocab, T image slots.
Tolerance: fp32 logits atol 1e-5 (other batch sizes pick other kernels and summation orders).
"""

from __future__ import annotations

import torch

from qkv.models import GPT, Flamingo, GPTConfig, ViT, ViTConfig

IMG = 5
V = 24


def _model() -> Flamingo:
    torch.manual_seed(0)
    lm = GPT(GPTConfig.from_name("gpt-tiny", vocab_size=V, max_len=64, dim=32, num_heads=4,
                                 num_layers=2))
    vit = ViT(ViTConfig.from_name("vit-tiny", dim=16, image_size=16, patch_size=8))
    model = Flamingo(lm, vit, image_token_id=IMG, num_latents=3).eval()
    with torch.no_grad():
        for block in model.gated.values():  # open the gates (0 at init: images unseen)
            block.attn_gate.fill_(0.8)
            block.ff_gate.fill_(-0.4)
    return model


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(IMG + 1, V, (2, 7), generator=g)
    ids[0, 0] = ids[1, 1] = ids[1, 4] = IMG
    images = torch.randn(2, 2, 3, 16, 16, generator=g) * 2
    return ids, images, torch.tensor([1, 2])


def test_every_beam_row_equals_its_row_alone():
    model = _model()
    ids, images, counts = _inputs()
    k = 3
    dec = model.bind_images(images, image_counts=counts)
    with torch.no_grad():
        beams = dec(ids.repeat_interleave(k, dim=0))  # (B·K, N, V)
        for b in range(2):
            alone = model.bind_images(images[b:b + 1], image_counts=counts[b:b + 1])
            want = alone(ids[b:b + 1])  # (1, N, V)
            for j in range(k):
                torch.testing.assert_close(beams[b * k + j:b * k + j + 1], want, atol=1e-5,
                                           rtol=0, msg=f"row {b}, beam {j}")
