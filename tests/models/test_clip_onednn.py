"""CLIP with the oneDNN linear path (``qkv.ops.fast_linear``) forced on for small shapes:
logits, ``encode_image`` / ``encode_text`` (the lean pooled paths: class-token-only last
layer, no-grad buffers, quick_gelu folded into the projections) and the training loss with
its gradients, against the same model under ``onednn_linear(False)`` and against HF
``CLIPModel`` (code nobody here wrote) with the same weights.

Shapes: B batch, N text length, E projection width.
Tolerance: fp32, other kernels / summation orders: atol 1e-5, rtol 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from qkv.models import CLIP
from qkv.ops.fast_linear import onednn_linear, onednn_linear_active

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not onednn_linear_active(),
                                reason="this torch build has no working oneDNN linear")
TOL = {"atol": 1e-5, "rtol": 1e-5}
V = 60


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf-clip")
    text = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=40, vocab_size=V, max_position_embeddings=12,
                eos_token_id=V - 1, bos_token_id=0, pad_token_id=1)
    vision = dict(hidden_size=24, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=36, image_size=16, patch_size=4)
    cfg = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=20)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = transformers.CLIPModel(cfg)
    with torch.no_grad():  # non-trivial biases and norms
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
        hf.logit_scale.fill_(2.0)
    hf.save_pretrained(d)
    return hf.eval(), CLIP.from_hf(d).eval()


def _batch():
    """4 images (16 px) and 4 right-padded texts (lengths 12, 5, 9, 2), eos ending each."""
    g = torch.Generator().manual_seed(1)
    px = torch.randn(4, 3, 16, 16, generator=g)
    ids = torch.randint(2, V - 1, (4, 12), generator=g)
    mask = torch.zeros(4, 12, dtype=torch.long)
    for i, n in enumerate([12, 5, 9, 2]):
        ids[i, n - 1] = V - 1
        ids[i, n:] = 1
        mask[i, :n] = 1
    return px, ids, mask


def test_eval_outputs_forced_onednn_vs_f_linear_and_hf(pair, onednn_calls):
    hf, ours = pair
    px, ids, mask = _batch()

    def run():
        with torch.inference_mode():
            out = ours(px, ids, mask)
            return (out.logits_per_image, out.image_embeds, out.text_embeds,
                    ours.encode_image(px), ours.encode_text(ids, mask))

    got = run()
    assert onednn_calls  # the oneDNN path ran
    with onednn_linear(False):
        want = run()
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    with torch.no_grad():
        ref = hf(input_ids=ids, pixel_values=px, attention_mask=mask)
        ref_img = hf.get_image_features(pixel_values=px)
        ref_txt = hf.get_text_features(input_ids=ids, attention_mask=mask)
    ref_img = getattr(ref_img, "pooler_output", ref_img)
    ref_txt = getattr(ref_txt, "pooler_output", ref_txt)
    torch.testing.assert_close(got[0], ref.logits_per_image, **TOL)
    torch.testing.assert_close(got[3], ref_img, **TOL)
    torch.testing.assert_close(got[4], ref_txt, **TOL)


def test_training_loss_and_gradients_forced_onednn_vs_f_linear_and_hf(pair, onednn_calls):
    """The loss (CLIP.loss: lean pooled paths with gradients), the gradients of every
    parameter and of the pixels, oneDNN forced vs F.linear; loss, pixel and logit-scale
    gradients vs HF's ``return_loss=True``."""
    hf, ours = pair
    px, ids, mask = _batch()
    px = px.requires_grad_(True)
    params = list(ours.parameters())

    def run():
        loss = ours.loss(px, ids, mask)
        return (loss, *torch.autograd.grad(loss, [px, *params]))

    got = run()
    assert onednn_calls
    with onednn_linear(False):
        want = run()
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    hf_loss = hf(input_ids=ids, pixel_values=px, attention_mask=mask, return_loss=True).loss
    hf_px, hf_scale = torch.autograd.grad(hf_loss, [px, hf.logit_scale])
    torch.testing.assert_close(got[0], hf_loss, **TOL)
    torch.testing.assert_close(got[1], hf_px, **TOL)
    names = [n for n, _ in ours.named_parameters()]
    torch.testing.assert_close(got[2 + names.index("logit_scale")].reshape(()),
                               hf_scale.reshape(()), **TOL)
