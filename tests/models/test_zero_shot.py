"""``qkv.models.zero_shot``'s prompt ensembles, zero-shot accuracy and chunked contrastive
loss against oracles written here: fp64 formulas spelled out per class, per image and per
chunk, on a toy two-tower model (an embedding table and a linear map: any module with
``encode_text`` / ``encode_image`` will do), and ``clip_loss`` for a single chunk.

Tolerances: fp32 against fp64 at atol 1e-6 (values of order 1; seen ~1e-7).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.models import clip_loss
from qkv.models.zero_shot import (
    chunked_contrastive_loss,
    prompt_weights,
    zero_shot_accuracy,
    zero_shot_weights,
)

E, V = 6, 50


class Towers(nn.Module):
    """encode_text: the mean of the real tokens' embeddings; encode_image: a linear map of
    the flattened (3, 2, 2) pixels."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, E)
        self.proj = nn.Linear(12, E)

    def encode_text(self, ids, mask=None):
        mask = torch.ones_like(ids) if mask is None else mask
        m = mask.to(self.embed.weight.dtype)[..., None]  # (n, N, 1)
        return (self.embed(ids) * m).sum(1) / m.sum(1)  # (n, E)

    def encode_image(self, pixel_values):
        return self.proj(pixel_values.flatten(1))  # (B, E)


def tokenize(texts):
    """Each character its own id (ord mod V), right-padded with 0 under a mask."""
    n = max(len(t) for t in texts)
    ids = torch.zeros(len(texts), n, dtype=torch.long)
    mask = torch.zeros(len(texts), n, dtype=torch.long)
    for i, t in enumerate(texts):
        ids[i, :len(t)] = torch.tensor([ord(c) % V for c in t])
        mask[i, :len(t)] = 1
    return ids, mask


def text_embedding64(m: Towers, text: str) -> torch.Tensor:
    """One prompt alone (no padding), fp64."""
    rows = m.embed.weight.double()[[ord(c) % V for c in text]]
    return rows.mean(0)


PROMPTS = [["a red one", "red!"], ["blue", "a blue thing"], ["green", "greenish"]]  # K=3, M=2


def test_prompt_weights_is_the_renormalised_mean_of_normalised_prompts():
    m = Towers()
    want = []
    for class_prompts in PROMPTS:
        e = torch.stack([F.normalize(text_embedding64(m, p), dim=0) for p in class_prompts])
        want.append(F.normalize(e.mean(0), dim=0))
    got = prompt_weights(m, tokenize, PROMPTS, batch_size=4)  # 6 prompts: batches 4 + 2
    assert got.shape == (3, E) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), torch.stack(want), atol=1e-6, rtol=0)
    # zero_shot_weights writes the same prompts from templates
    both = zero_shot_weights(m, tokenize, ["red", "blue"], ["a {} one", "{}!"])
    written = prompt_weights(m, tokenize, [["a red one", "red!"], ["a blue one", "blue!"]])
    torch.testing.assert_close(both, written, atol=0, rtol=0)


@pytest.mark.parametrize("bad", [[], [[]], [["a"], ["b", "c"]], [["a", 3]], "abc"])
def test_prompt_weights_refuses_ragged_or_empty_prompts(bad):
    with pytest.raises(ValueError, match="prompt_weights: prompts"):
        prompt_weights(Towers(), tokenize, bad)


def test_zero_shot_accuracy_is_the_argmax_over_the_ensembles():
    m = Towers()
    g = torch.Generator().manual_seed(1)
    px = torch.randn(7, 3, 2, 2, generator=g)
    with torch.no_grad():
        classes = torch.stack([F.normalize(torch.stack(
            [F.normalize(text_embedding64(m, p), dim=0) for p in ps]).mean(0), dim=0)
            for ps in PROMPTS])  # (K, E)
        img = F.normalize(m.proj.weight.double() @ px.double().flatten(1).t()
                          + m.proj.bias.double()[:, None], dim=0).t()  # (B, E)
    predicted = (img @ classes.t()).argmax(1)  # (B,)
    assert len(set(predicted.tolist())) > 1  # the classes are told apart at all
    assert zero_shot_accuracy(m, tokenize, PROMPTS, px, predicted, batch_size=3) == 1.0
    assert zero_shot_accuracy(m, tokenize, PROMPTS, px, (predicted + 1) % 3) == 0.0
    half = predicted.clone()
    half[:3] = (half[:3] + 1) % 3
    assert zero_shot_accuracy(m, tokenize, PROMPTS, px, half, batch_size=2) == \
        pytest.approx(4 / 7)
    with pytest.raises(ValueError, match="pixel_values"):
        zero_shot_accuracy(m, tokenize, PROMPTS, px[0], predicted)
    with pytest.raises(ValueError, match="labels"):
        zero_shot_accuracy(m, tokenize, PROMPTS, px, predicted[:3])


def _infonce64(img: torch.Tensor, txt: torch.Tensor, scale: float) -> float:
    """Symmetric InfoNCE of (image i, text i), fp64, written out row by row."""
    a, t = F.normalize(img.double(), dim=1), F.normalize(txt.double(), dim=1)
    logits = scale * a @ t.t()
    i2t = -sum(logits[i, i] - torch.logsumexp(logits[i], 0) for i in range(len(a))) / len(a)
    t2i = -sum(logits[i, i] - torch.logsumexp(logits[:, i], 0) for i in range(len(a))) / len(a)
    return float((i2t + t2i) / 2)


@pytest.mark.parametrize("chunk", [1, 2, 5, 17, 256])
def test_chunked_contrastive_loss_averages_each_chunks_loss_by_pairs(chunk):
    g = torch.Generator().manual_seed(2)
    img, txt = torch.randn(17, E, generator=g), torch.randn(17, E, generator=g)
    scale = 7.5
    parts = [(len(img[i:i + chunk]), _infonce64(img[i:i + chunk], txt[i:i + chunk], scale))
             for i in range(0, 17, chunk)]
    want = sum(n * loss for n, loss in parts) / 17
    got = chunked_contrastive_loss(img, txt, torch.tensor(scale), chunk=chunk)
    assert got == pytest.approx(want, abs=1e-6)
    if chunk >= 17:  # one chunk: the training loss of one process
        assert got == pytest.approx(float(clip_loss(img, txt, scale)), abs=1e-6)


def test_chunked_contrastive_loss_refusals():
    x = torch.randn(4, E)
    with pytest.raises(ValueError, match="text_embeds"):
        chunked_contrastive_loss(x, x[:3], 1.0)
    with pytest.raises(ValueError, match="chunk"):
        chunked_contrastive_loss(x, x, 1.0, chunk=0)
    with pytest.raises(ValueError, match="image_embeds"):
        chunked_contrastive_loss(x[0], x, 1.0)
