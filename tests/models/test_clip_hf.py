"""HF ``CLIPModel`` / ``ViTModel`` / ``ViTForImageClassification`` (code nobody here wrote),
built from small configs with random weights, saved, loaded by ``qkv.models.from_hf``:
embeddings, logits and hidden states equal; padded text; both eos-pooling rules; position
interpolation vs HF ``interpolate_pos_encoding=True``; every config field classified.

Shapes: B batch, N text length, T image tokens, C width, E projection width.
Tolerance: fp32 vs transformers fp32 (the same math, other kernels): atol 1e-5, rtol 1e-5.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import qkv.models
from qkv.models import CLIP, ViT
from qkv.models.hf_config import (
    CLIP_FIELDS,
    CLIP_TEXT_FIELDS,
    CLIP_VISION_FIELDS,
    VIT_FIELDS,
)
from qkv.models.hub import CheckpointError

transformers = pytest.importorskip("transformers")
TOL = {"atol": 1e-5, "rtol": 1e-5}
V = 60


def clip_config(eos: int = V - 1, **top):
    text = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
                vocab_size=V, max_position_embeddings=12, eos_token_id=eos, bos_token_id=0,
                pad_token_id=1)
    vision = dict(hidden_size=24, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=36, image_size=16, patch_size=4)
    return transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=20,
                                   **top)


def randomise(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def clip_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf-clip")
    torch.manual_seed(0)
    hf = randomise(transformers.CLIPModel(clip_config()))
    with torch.no_grad():
        hf.logit_scale.fill_(3.1)
    hf.save_pretrained(d)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every field of transformers' config is classified
        ours = qkv.models.from_hf(d)
    return hf, ours, d


def text_batch(eos: int = V - 1):
    """Right-padded ids (pad 1), the eos token ending each text (lengths 12, 5, 9, 2); the
    other ids are below eos, so both pooling rules find the same position."""
    torch.manual_seed(1)
    ids = torch.randint(2, eos, (4, 12))
    lengths = [12, 5, 9, 2]
    mask = torch.zeros(4, 12, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, n - 1] = eos
        ids[i, n:] = 1
        mask[i, :n] = 1
    return ids, mask


def test_clip_logits_embeds_hidden_states(clip_pair):
    hf, ours, _ = clip_pair
    assert isinstance(ours, CLIP) and not ours.training
    assert ours.logit_scale.shape == (1,)
    assert ours.config.text.pooling == "eos"
    px = torch.randn(3, 3, 16, 16)
    ids, mask = text_batch()
    with torch.no_grad():
        a = hf(input_ids=ids, pixel_values=px, attention_mask=mask, output_hidden_states=True)
        b = ours(px, ids, mask, output_hidden_states=True)
        torch.testing.assert_close(ours.encode_image(px),
                                   hf.get_image_features(pixel_values=px).pooler_output, **TOL)
        torch.testing.assert_close(
            ours.encode_text(ids, mask),
            hf.get_text_features(input_ids=ids, attention_mask=mask).pooler_output, **TOL)
        post = hf.vision_model.post_layernorm(a.vision_model_output.last_hidden_state)
    assert b.logits_per_image.shape == (3, 4) and b.logits_per_text.shape == (4, 3)
    torch.testing.assert_close(b.logits_per_image, a.logits_per_image, **TOL)
    torch.testing.assert_close(b.logits_per_text, a.logits_per_text, **TOL)
    torch.testing.assert_close(b.image_embeds, a.image_embeds, **TOL)
    torch.testing.assert_close(b.text_embeds, a.text_embeds, **TOL)
    torch.testing.assert_close(b.text_output.last_hidden_state,
                               a.text_model_output.last_hidden_state, **TOL)
    torch.testing.assert_close(b.vision_output.last_hidden_state, post, **TOL)
    for x, y in ((b.vision_output.hidden_states, a.vision_model_output.hidden_states),
                 (b.text_output.hidden_states, a.text_model_output.hidden_states)):
        assert len(x) == len(y) == 3
        for p, q in zip(x, y, strict=True):
            torch.testing.assert_close(p, q, **TOL)


def test_clip_padded_text_equals_unpadded(clip_pair):
    _, ours, _ = clip_pair
    ids, mask = text_batch()
    with torch.no_grad():
        full = ours.encode_text(ids, mask)
        for i, n in enumerate(mask.sum(1).tolist()):
            torch.testing.assert_close(full[i], ours.encode_text(ids[i:i + 1, :n])[0], **TOL)


def test_clip_argmax_pooling_for_eos_2(tmp_path):
    """Old configs (eos_token_id 2): transformers pools at the highest id, not at id 2."""
    torch.manual_seed(0)
    hf = randomise(transformers.CLIPModel(clip_config(eos=2)))
    hf.save_pretrained(tmp_path)
    ours = CLIP.from_pretrained(tmp_path)
    assert ours.config.text.pooling == "argmax"
    ids, mask = text_batch()
    ids[:, 0] = 2  # an id-2 token first: the eos rule would pool here, argmax elsewhere
    ids[ids == V - 1] = V - 2
    ids[0, 6] = V - 1
    with torch.no_grad():
        a = hf.get_text_features(input_ids=ids, attention_mask=mask).pooler_output
        torch.testing.assert_close(ours.encode_text(ids, mask), a, **TOL)


@pytest.mark.parametrize("hw", [(24, 24), (8, 12), (20, 16)])
def test_clip_position_interpolation_vs_hf(clip_pair, hw):
    hf, ours, _ = clip_pair
    px = torch.randn(2, 3, *hw)
    with torch.no_grad():
        a = hf.get_image_features(pixel_values=px, interpolate_pos_encoding=True).pooler_output
        torch.testing.assert_close(ours.encode_image(px), a, **TOL)


def test_clip_round_trip_and_dispatch(clip_pair, tmp_path):
    _, ours, d = clip_pair
    assert isinstance(CLIP.from_pretrained(d), CLIP)  # HF dirs dispatch to from_hf
    ours.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["model_type"] == "qkv-clip" and data["vision"]["pre_norm"] is True
    back = CLIP.from_pretrained(tmp_path)
    assert back.config == ours.config
    for k, v in ours.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    px, (ids, mask) = torch.randn(2, 3, 16, 16), text_batch()
    with torch.no_grad():
        assert torch.equal(ours(px, ids, mask).logits_per_image,
                           back(px, ids, mask).logits_per_image)


# --- ViT ----------------------------------------------------------------------------------
def vit_config(**kw):
    return transformers.ViTConfig(hidden_size=24, num_hidden_layers=2, num_attention_heads=3,
                                  intermediate_size=40, image_size=16, patch_size=4, **kw)


@pytest.mark.parametrize("kind", ["model", "classifier", "no-qkv-bias"])
def test_vit_outputs_equal_hf(tmp_path, kind):
    torch.manual_seed(0)
    if kind == "classifier":
        hf = transformers.ViTForImageClassification(vit_config(num_labels=7))
    else:
        hf = transformers.ViTModel(vit_config(qkv_bias=kind != "no-qkv-bias"))
    hf = randomise(hf)
    hf.save_pretrained(tmp_path)
    ours = qkv.models.from_hf(tmp_path)
    assert isinstance(ours, ViT)
    px = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        b = ours(px, output_hidden_states=True)
        if kind == "classifier":
            a = hf(px, output_hidden_states=True)
            assert ours.config.num_classes == 7
            torch.testing.assert_close(b.logits, a.logits, **TOL)
        else:
            a = hf(px, output_hidden_states=True)
            torch.testing.assert_close(b.last_hidden_state, a.last_hidden_state, **TOL)
            torch.testing.assert_close(b.pooler_output, a.pooler_output, **TOL)
        for p, q in zip(b.hidden_states, a.hidden_states, strict=True):
            torch.testing.assert_close(p, q, **TOL)
        px2 = torch.randn(2, 3, 28, 12)  # another size: bicubic positions, as HF's
        a2 = hf(px2, interpolate_pos_encoding=True)
        b2 = ours(px2)
        if kind == "classifier":
            torch.testing.assert_close(b2.logits, a2.logits, **TOL)
        else:
            torch.testing.assert_close(b2.last_hidden_state, a2.last_hidden_state, **TOL)


# --- config audit -------------------------------------------------------------------------
def test_every_field_is_classified():
    clip = transformers.CLIPConfig()
    for cfg, table in ((transformers.ViTConfig(), VIT_FIELDS), (clip, CLIP_FIELDS),
                       (clip.text_config, CLIP_TEXT_FIELDS),
                       (clip.vision_config, CLIP_VISION_FIELDS)):
        missing = sorted(set(cfg.to_dict()) - set(table))
        assert not missing, f"{type(cfg).__name__}: unclassified fields {missing}"


@pytest.mark.parametrize("where, field, value", [
    ("vision_config", "hidden_act", "gelu_10"), ("text_config", "hidden_act", "tanh"),
    ("vision_config", "image_size", [16, 24]), ("text_config", "eos_token_id", [2, 3]),
    ("vision_config", "model_type", "siglip_vision_model"),
])
def test_clip_refused_fields(clip_pair, tmp_path, where, field, value):
    _, _, d = clip_pair
    data = json.loads((d / "config.json").read_text())
    data[where][field] = value
    (tmp_path / "config.json").write_text(json.dumps(data))
    (tmp_path / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match=field):
        CLIP.from_hf(tmp_path)


@pytest.mark.parametrize("field, value", [("pooler_act", "relu"), ("hidden_act", "quick_gelu"),
                                          ("patch_size", [4, 2]),
                                          ("pooler_output_size", 8)])
def test_vit_refused_fields(tmp_path, field, value):
    transformers.ViTModel(vit_config()).save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data[field] = value
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=field):
        ViT.from_hf(tmp_path)


def test_unknown_field_warns_and_mismatched_weights_refused(clip_pair, tmp_path):
    _, _, d = clip_pair
    data = json.loads((d / "config.json").read_text())
    data["text_config"]["brand_new_option"] = 1
    (tmp_path / "config.json").write_text(json.dumps(data))
    (tmp_path / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    with pytest.warns(UserWarning, match="brand_new_option"):
        CLIP.from_hf(tmp_path)
    data["text_config"]["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.warns(UserWarning), pytest.raises(CheckpointError,
                                                  match=r"num_hidden_layers=3.*holds 2"):
        CLIP.from_hf(tmp_path)
