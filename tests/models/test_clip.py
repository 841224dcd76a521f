"""``qkv.models.CLIP`` (own configs): the text tower against torch's
``nn.TransformerEncoderLayer`` with a causal mask (fp64), logits against cosine similarities
computed here, the 1-element logit scale and its clamp, pooling rules, configs, save/load,
input errors; zero-shot weights / accuracy / recall against hand computations; CLIP image
preprocessing against transformers' ``CLIPImageProcessorPil``.

Shapes: B batch, N text length, E embedding width, K classes, M templates.
Tolerances: fp64 atol 1e-10; fp32 atol 1e-5; preprocessing one uint8 step (1/255/std).
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.data.image_preprocess import CLIP_MEAN, CLIP_STD, preprocess_image, preprocess_images
from qkv.models import (
    CLIP,
    CLIPConfig,
    CLIPTextConfig,
    retrieval_recall,
    topk_accuracy,
    zero_shot_classify,
    zero_shot_weights,
)
from qkv.modules.feedforward import quick_gelu

CFG = CLIPConfig.from_name("clip-tiny", text={"vocab_size": 40, "max_len": 10, "dim": 32,
                                               "num_layers": 2, "num_heads": 4,
                                               "eos_token_id": 39})
EOS = 39


def model(cfg: CLIPConfig = CFG) -> CLIP:
    torch.manual_seed(0)
    m = CLIP(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return m


def texts():
    torch.manual_seed(3)
    ids = torch.randint(0, EOS, (3, 10))
    mask = torch.ones(3, 10, dtype=torch.long)
    for i, n in enumerate([10, 4, 7]):
        ids[i, n - 1] = EOS
        ids[i, n:] = 0
        mask[i, n:] = 0
    return ids, mask


def text_reference(m: CLIP, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Pooled text features (B, Ct) by torch's TransformerEncoderLayer, fp64."""
    c = m.config.text
    t = m.text.double()
    x = t.token_embed.weight[ids] + t.position.weight[:ids.shape[1]]
    n = ids.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).triu(1)  # True = may NOT attend (torch)
    blocked = causal[None] | ~mask.bool()[:, None, :]  # (B, N, N)
    blocked = blocked.repeat_interleave(c.num_heads, 0)  # (B·H, N, N)
    for layer in t.layers:
        ref = nn.TransformerEncoderLayer(c.dim, c.num_heads, 4 * c.dim, dropout=0.0,
                                         activation=quick_gelu, layer_norm_eps=c.norm_eps,
                                         batch_first=True, norm_first=True).double().eval()
        with torch.no_grad():
            ref.self_attn.in_proj_weight.copy_(layer.attn.in_proj.weight)
            ref.self_attn.in_proj_bias.copy_(layer.attn.in_proj.bias)
            ref.self_attn.out_proj.load_state_dict(layer.attn.out_proj.state_dict())
            ref.linear1.load_state_dict(layer.ffn.fc_in.state_dict())
            ref.linear2.load_state_dict(layer.ffn.fc_out.state_dict())
            ref.norm1.load_state_dict(layer.norm1.state_dict())
            ref.norm2.load_state_dict(layer.norm2.state_dict())
        x = ref(x, src_mask=blocked)
    x = F.layer_norm(x, (c.dim,), t.norm.weight, t.norm.bias, c.norm_eps)
    first_eos = torch.stack([(row == c.eos_token_id).nonzero()[0, 0] for row in ids])
    return x[torch.arange(len(ids)), first_eos]


def test_text_tower_vs_torch_layers_fp64():
    m = model().double()
    ids, mask = texts()
    with torch.no_grad():
        pooled = m.text(ids, mask).pooled
        want = text_reference(m, ids, mask)
    torch.testing.assert_close(pooled, want, atol=1e-10, rtol=1e-10)


def test_logits_are_scaled_cosines():
    m = model()
    with torch.no_grad():
        m.logit_scale.fill_(2.0)
    px = torch.randn(5, 3, 32, 32)
    ids, mask = texts()
    with torch.no_grad():
        out = m(px, ids, mask)
        img, txt = m.encode_image(px).double(), m.encode_text(ids, mask).double()
    assert img.shape == (5, 64) and txt.shape == (3, 64)
    cos = (img @ txt.T) / img.norm(dim=1)[:, None] / txt.norm(dim=1)[None]
    torch.testing.assert_close(out.logits_per_image.double(), math.exp(2.0) * cos,
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(out.logits_per_text, out.logits_per_image.T)
    torch.testing.assert_close(out.image_embeds.norm(dim=1), torch.ones(5))


def test_logit_scale_one_element_and_clamp():
    m = CLIP(CFG)
    assert m.logit_scale.shape == (1,)
    torch.testing.assert_close(m.logit_scale, torch.tensor([math.log(1 / 0.07)]))
    with torch.no_grad():
        m.logit_scale.fill_(7.0)
    m.clamp_logit_scale_()
    torch.testing.assert_close(m.logit_scale.exp(), torch.tensor([100.0]))
    with torch.no_grad():
        m.logit_scale.fill_(-1.0)
    m.clamp_logit_scale_()
    assert m.logit_scale.item() == 0.0


def test_loss_equals_clip_loss_and_trains():
    from qkv.models import clip_loss

    torch.manual_seed(0)
    m = CLIP(CFG).train()
    px = torch.randn(6, 3, 32, 32)
    ids = torch.randint(0, EOS, (6, 8))
    ids[:, -1] = EOS
    loss = m.loss(px, ids)
    torch.testing.assert_close(loss, clip_loss(m.encode_image(px), m.encode_text(ids),
                                               m.logit_scale.exp()))
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
    first = loss.item()
    for _ in range(25):  # a tiny CLIP overfits six pairs
        opt.zero_grad()
        loss = m.loss(px, ids)
        loss.backward()
        opt.step()
        m.clamp_logit_scale_()
    assert all(p.grad is not None for p in m.parameters())
    assert loss.item() < 0.1 * first


def test_padding_and_rows_alone():
    m = model()
    ids, mask = texts()
    with torch.no_grad():
        full = m.encode_text(ids, mask)
        for i, n in enumerate(mask.sum(1).tolist()):
            torch.testing.assert_close(full[i], m.encode_text(ids[i:i + 1, :n])[0],
                                       atol=1e-5, rtol=1e-5)


def test_pooling_rules():
    ids = torch.tensor([[5, 39, 2, 39], [39, 1, 3, 0]])
    eos = CLIP(CFG).text
    assert eos.pool_positions(ids).tolist() == [1, 0]
    cfg = dataclasses.replace(CFG, text=dataclasses.replace(CFG.text, pooling="argmax"))
    argmax = CLIP(cfg).text
    assert argmax.pool_positions(torch.tensor([[5, 9, 2, 9], [1, 0, 3, 0]])).tolist() == [1, 2]
    with pytest.raises(ValueError, match=r"input_ids rows \[1\].*eos_token_id=39"):
        eos.pool_positions(torch.tensor([[5, 39], [1, 2]]))


@pytest.mark.parametrize("call, err, msg", [
    (lambda m: m.encode_text(torch.full((2, 11), EOS)), ValueError, "max_len=10"),
    (lambda m: m.encode_text(torch.full((2, 3), 40)), ValueError, "token id 40"),
    (lambda m: m.encode_text(torch.full((2, 3), 39.0)), TypeError, "input_ids"),
    (lambda m: m.encode_text(torch.full((2, 3), EOS), torch.ones(2, 4)), ValueError,
     "attention_mask"),
    (lambda m: m.encode_image(torch.randn(2, 4, 32, 32)), ValueError, "pixel_values.*4 ch"),
    (lambda m: m.encode_image(torch.randn(2, 3, 30, 32)), ValueError, "pixel_values"),
    (lambda m: m(torch.zeros(1, 3, 32, 32, dtype=torch.uint8), torch.full((1, 2), EOS)),
     TypeError, "pixel_values"),
])
def test_input_errors(call, err, msg):
    with pytest.raises(err, match=msg):
        call(model())


def test_config_presets_round_trip(tmp_path):
    for name in CLIPConfig.PRESETS:
        cfg = CLIPConfig.from_name(name)
        assert CLIPConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert CLIPConfig.from_name("clip-vit-b-32").vision.pre_norm
    assert CLIPConfig().text == CLIPTextConfig()
    with pytest.raises(ValueError, match="num_classes"):
        CLIPConfig(vision={"num_classes": 3})
    with pytest.raises(ValueError, match="pooling"):
        CLIPTextConfig(pooling="mean")
    with pytest.raises(ValueError, match="eos_token_id"):
        CLIPTextConfig(vocab_size=10, eos_token_id=10)
    m = model()
    m.save_pretrained(tmp_path)
    back = CLIP.from_pretrained(tmp_path)
    assert back.config == m.config and back.logit_scale.shape == (1,)
    px, (ids, mask) = torch.randn(2, 3, 32, 32), texts()
    with torch.no_grad():
        assert torch.equal(back(px, ids, mask).logits_per_image,
                           m(px, ids, mask).logits_per_image)


# --- zero-shot and retrieval --------------------------------------------------------------
def test_zero_shot_weights_formula():
    m = model()
    prompts: list[list[str]] = []

    def tokenize(batch):
        prompts.append(batch)
        ids = torch.tensor([[len(s) % EOS, EOS] for s in batch])
        return ids, torch.ones_like(ids)

    w = zero_shot_weights(m, tokenize, ["red", "blue", "green"], ["a {}.", "the {} one"],
                          batch_size=4)
    assert [len(b) for b in prompts] == [4, 2]
    flat = [p for b in prompts for p in b]
    assert flat[:2] == ["a red.", "the red one"]
    with torch.no_grad():
        ids, mask = tokenize(flat)
        e = F.normalize(m.encode_text(ids, mask), dim=-1).view(3, 2, -1)
    torch.testing.assert_close(w, F.normalize(e.mean(1), dim=-1))
    with pytest.raises(ValueError, match="templates"):
        zero_shot_weights(m, tokenize, ["red"], ["no slot"])


def test_classify_topk_and_recall():
    img = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.2]])
    cls = torch.tensor([[0.0, 1.0], [1.0, 0.1], [1.0, 0.9]])
    scores = zero_shot_classify(img, cls)
    # cosines: image 2 (0.640, 0.768) scores 0.768, 0.713, 0.990 -> class 2, then 0
    assert scores.argmax(1).tolist() == [1, 0, 2]
    acc = topk_accuracy(scores, torch.tensor([1, 0, 0]), ks=(1, 2, 5))
    assert acc == {1: pytest.approx(2 / 3), 2: 1.0, 5: 1.0}
    txt = torch.tensor([[1.0, 0.05], [1.0, 0.0], [0.0, 1.0]])
    r = retrieval_recall(img, txt, ks=(1, 2))
    # texts nearest each image: 0 -> 1, 0 (hit at 2); 1 -> 2, 0 (miss); 2 -> 2 (hit at 1)
    assert r["image_to_text@1"] == pytest.approx(1 / 3)
    assert r["image_to_text@2"] == pytest.approx(2 / 3)
    # images nearest each text: 0 -> 0 (hit); 1 -> 0, 2 (miss); 2 -> 1, 2 (hit at 2)
    assert r["text_to_image@1"] == pytest.approx(1 / 3)
    assert r["text_to_image@2"] == pytest.approx(2 / 3)
    many = retrieval_recall(img, torch.cat([img, img]), torch.tensor([0, 1, 2, 0, 1, 2]),
                            ks=(1,))
    assert many == {"image_to_text@1": 1.0, "text_to_image@1": 1.0}
    with pytest.raises(ValueError, match="text_to_image"):
        retrieval_recall(img, txt[:2])


# --- preprocessing ------------------------------------------------------------------------
def test_preprocess_matches_hf_clip_image_processor():
    transformers = pytest.importorskip("transformers")
    from PIL import Image

    proc = transformers.CLIPImageProcessorPil(size={"shortest_edge": 32},
                                              crop_size={"height": 32, "width": 32})
    g = torch.Generator().manual_seed(0)
    images = [Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g,
                                            dtype=torch.uint8).numpy())
              for h, w in ((45, 70), (64, 33), (32, 32), (17, 40))]
    images.append(images[0].convert("L"))  # grey -> RGB
    want = proc(images, return_tensors="pt")["pixel_values"]
    got = preprocess_images(images, 32)
    assert got.shape == want.shape == (5, 3, 32, 32) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1.01 / 255 / min(CLIP_STD), rtol=0)


def test_preprocess_tensor_inputs_and_errors():
    x = torch.rand(3, 40, 64)
    a = preprocess_image(x, 32)
    b = preprocess_image((x * 255).round().to(torch.uint8), 32)
    assert a.shape == (3, 32, 32)
    torch.testing.assert_close(a, b, atol=1 / 255 / min(CLIP_STD), rtol=0)
    square = torch.rand(3, 32, 32)  # no resize: the exact normalised pixels
    mean, std = torch.tensor(CLIP_MEAN)[:, None, None], torch.tensor(CLIP_STD)[:, None, None]
    torch.testing.assert_close(preprocess_image(square, 32), (square - mean) / std)
    for bad, err, msg in [(torch.rand(40, 64, 3), ValueError, r"\(3, H, W\)"),
                          (torch.rand(1, 3, 8, 8), ValueError, r"\(3, H, W\)"),
                          (torch.zeros(3, 8, 8, dtype=torch.int32), TypeError, "uint8"),
                          ("a.png", TypeError, "PIL.Image")]:
        with pytest.raises(err, match=msg):
            preprocess_image(bad, 32)
    with pytest.raises(ValueError, match="size"):
        preprocess_image(square, 0)
