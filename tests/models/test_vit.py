"""``qkv.models.ViT`` against independent oracles: torch's own Conv2d and
``nn.TransformerEncoderLayer`` (pre-norm, written by nobody here) in fp64; bicubic position
interpolation against ``F.interpolate`` on the grid; save/load; clear errors for bad images.

Shapes: B batch, Cin channels, Hi/Wi pixels, P patch, T tokens, C width, K classes.
Tolerances: fp64 paths atol 1e-10; fp32 vs fp64 reference atol 5e-5, rtol 5e-6
(docs/ARCHITECTURE.md: Tolerances).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.models import ViT, ViTConfig
from qkv.models.vit import interpolate_positions

CFG = ViTConfig(image_size=16, patch_size=4, dim=24, num_layers=2, num_heads=3, ffn_hidden=40,
                num_channels=3, activation="gelu", norm_eps=1e-6, num_classes=5)


def model(cfg: ViTConfig = CFG, seed: int = 0) -> ViT:
    torch.manual_seed(seed)
    m = ViT(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a swapped part shows
        for name, p in m.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return m


def reference(m: ViT, px: torch.Tensor) -> dict[str, torch.Tensor]:
    """The ViT computed with torch's Conv2d and TransformerEncoderLayer (pre-norm), fp64."""
    c = m.config
    m = m.double()
    px = px.double()
    x = F.conv2d(px, m.patch_embed.weight, m.patch_embed.bias, stride=c.patch_size)
    x = x.flatten(2).transpose(1, 2)  # (B, Gh·Gw, C)
    gh, gw = px.shape[2] // c.patch_size, px.shape[3] // c.patch_size
    g = c.image_size // c.patch_size
    cls_pos, grid = m.pos_embed[:1], m.pos_embed[1:]
    if (gh, gw) != (g, g):
        img = grid.T.reshape(1, c.dim, g, g)
        grid = F.interpolate(img, size=(gh, gw), mode="bicubic", align_corners=False)
        grid = grid.reshape(c.dim, gh * gw).T
    x = torch.cat([m.cls_token.expand(x.shape[0], 1, -1), x], 1) + torch.cat([cls_pos, grid])
    if m.norm_pre is not None:
        x = F.layer_norm(x, (c.dim,), m.norm_pre.weight, m.norm_pre.bias, c.norm_eps)
    for layer in m.layers:
        t = nn.TransformerEncoderLayer(c.dim, c.num_heads, c.ffn_hidden, dropout=0.0,
                                       activation="gelu", layer_norm_eps=c.norm_eps,
                                       batch_first=True, norm_first=True).double().eval()
        with torch.no_grad():
            t.self_attn.in_proj_weight.copy_(layer.attn.in_proj.weight)
            t.self_attn.in_proj_bias.copy_(layer.attn.in_proj.bias)
            t.self_attn.out_proj.weight.copy_(layer.attn.out_proj.weight)
            t.self_attn.out_proj.bias.copy_(layer.attn.out_proj.bias)
            t.linear1.load_state_dict(layer.ffn.fc_in.state_dict())
            t.linear2.load_state_dict(layer.ffn.fc_out.state_dict())
            t.norm1.load_state_dict(layer.norm1.state_dict())
            t.norm2.load_state_dict(layer.norm2.state_dict())
        x = t(x)
    x = F.layer_norm(x, (c.dim,), m.norm.weight, m.norm.bias, c.norm_eps)
    pooled = x[:, 1:].mean(1) if c.pooling == "mean" else x[:, 0]
    return {"last": x, "pooled": pooled,
            "logits": None if m.head is None else F.linear(pooled, m.head.weight, m.head.bias)}


@pytest.mark.parametrize("hw", [(16, 16), (8, 8), (12, 20), (4, 32)])
@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_matches_torch_layers_fp64(hw, pooling):
    cfg = dataclasses.replace(CFG, pooling=pooling, pre_norm=pooling == "mean")
    m = model(cfg).double()
    px = torch.randn(3, 3, *hw, dtype=torch.float64)
    ref = reference(m, px)
    with torch.no_grad():
        out = m(px)
    t = 1 + (hw[0] // 4) * (hw[1] // 4)
    assert out.last_hidden_state.shape == (3, t, 24)
    torch.testing.assert_close(out.last_hidden_state, ref["last"], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(out.pooled, ref["pooled"], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(out.logits, ref["logits"], atol=1e-10, rtol=1e-10)


def test_fp32_vs_fp64_and_batch_rows():
    m = model()
    px = torch.randn(4, 3, 16, 16)
    ref = reference(model(), px)
    with torch.no_grad():
        out = m(px)
        alone = m(px[2:3])
    torch.testing.assert_close(out.logits.double(), ref["logits"], atol=5e-5, rtol=5e-6)
    torch.testing.assert_close(alone.logits[0], out.logits[2], atol=1e-6, rtol=1e-6)
    with torch.no_grad():  # two eval forwards are identical
        assert torch.equal(m(px).logits, out.logits)


def test_interpolate_positions():
    pos = torch.randn(1 + 9, 6, dtype=torch.float64)
    assert interpolate_positions(pos, 3, 3, 3) is pos
    out = interpolate_positions(pos, 3, 2, 5)
    assert out.shape == (1 + 10, 6)
    assert torch.equal(out[0], pos[0])  # the class token's position is kept
    grid = pos[1:].reshape(3, 3, 6).permute(2, 0, 1)[None]  # (1, C, G, G)
    want = F.interpolate(grid, size=(2, 5), mode="bicubic", align_corners=False)
    torch.testing.assert_close(out[1:], want[0].permute(1, 2, 0).reshape(10, 6))


def test_outputs_hidden_states_attentions_pooler():
    cfg = dataclasses.replace(CFG, with_pooler=True, num_classes=0)
    m = model(cfg)
    px = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        out = m(px, output_hidden_states=True, output_attentions=True)
    assert out.logits is None
    assert len(out.hidden_states) == 3 and len(out.attentions) == 2
    assert out.attentions[0].shape == (2, 3, 17, 17)
    torch.testing.assert_close(out.attentions[0].sum(-1), torch.ones(2, 3, 17))
    torch.testing.assert_close(m.norm(out.hidden_states[-1]), out.last_hidden_state)
    torch.testing.assert_close(out.pooler_output,
                               torch.tanh(m.pooler(out.last_hidden_state[:, 0])))


def test_save_load_round_trip(tmp_path):
    m = model(dataclasses.replace(CFG, pooling="mean", with_pooler=True))
    m.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["model_type"] == "qkv-vit" and data["pooling"] == "mean"
    back = ViT.from_pretrained(tmp_path)
    assert back.config == m.config
    for k, v in m.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    px = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(m(px).logits, back(px).logits)


def test_presets_and_config_errors():
    assert ViTConfig.from_name("vit-b-16").grid == 14
    assert ViTConfig.from_name("vit-b-32").patch_size == 32
    assert ViTConfig.from_name("vit-s-16").dim == 384
    tiny = ViT(ViTConfig.from_name("vit-tiny"))
    assert tiny(torch.randn(1, 3, 32, 32)).pooled.shape == (1, 64)
    for kw, msg in [({"image_size": 30, "patch_size": 8}, "not a multiple"),
                    ({"dim": 25}, "not divisible"), ({"pooling": "max"}, "pooling"),
                    ({"activation": "tanh"}, "activation"), ({"num_classes": -1}, "num_classes"),
                    ({"dropout": 1.0}, "dropout"), ({"patch_size": 0}, "patch_size")]:
        with pytest.raises(ValueError, match=msg):
            dataclasses.replace(CFG, **kw)
    with pytest.raises(ValueError, match="unknown config fields"):
        ViTConfig.from_dict({"image_sise": 3})


@pytest.mark.parametrize("px, err, msg", [
    (torch.randn(2, 1, 16, 16), ValueError, "1 channels.*num_channels=3"),
    (torch.randn(2, 16, 16, 3), ValueError, "16 channels"),
    (torch.randn(2, 3, 18, 16), ValueError, "multiples of patch_size=4"),
    (torch.randn(2, 3, 0, 16), ValueError, "multiples of patch_size=4"),
    (torch.randn(3, 16, 16), ValueError, r"\(B, Cin, H, W\).*\(3, 16, 16\)"),
    (torch.zeros(2, 3, 16, 16, dtype=torch.uint8), TypeError, "floating-point.*uint8"),
    (torch.zeros(2, 3, 16, 16, dtype=torch.int64), TypeError, "floating-point.*int64"),
    ([[0.0]], TypeError, "torch.Tensor.*list"),
])
def test_bad_images_name_pixel_values(px, err, msg):
    with pytest.raises(err, match=msg) as info:
        model()(px)
    assert "pixel_values" in str(info.value)


def test_training_step_reduces_loss():
    """A tiny ViT overfits a tiny labelled batch (the gradients reach every part)."""
    torch.manual_seed(0)
    m = ViT(dataclasses.replace(CFG, num_classes=4)).train()
    px, labels = torch.randn(8, 3, 16, 16), torch.arange(8) % 4
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    first = None
    for _ in range(50):
        loss = F.cross_entropy(m(px).logits, labels)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(p.grad is not None for p in m.parameters())
    assert loss.item() < 0.05 * first
