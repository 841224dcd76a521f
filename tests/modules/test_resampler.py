"""``qkv.modules.PerceiverResampler`` against an fp64 oracle written here from the paper's
equations (LayerNorm, softmax attention over [media; latents], GELU feed-forward by hand);
output shape independent of the number of patches P; padded media slots; errors.

Shapes: B batch, T images, P patches, Cm media width, C width, L latents, H heads.
Tolerances: fp64 module vs fp64 oracle atol 1e-10 (same math, other summation order);
fp32 module vs fp64 oracle atol 1e-4 (two blocks of fp32 rounding on O(1) values);
padded == unpadded rows: 1e-6 (another batch size may pick other kernels).
"""

from __future__ import annotations

import math

import pytest
import torch

from qkv.modules import PerceiverResampler


def _ln(x, mod):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + mod.eps) * mod.weight.double() + mod.bias.double()


def _gelu(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def oracle(rs: PerceiverResampler, media: torch.Tensor) -> torch.Tensor:
    """(B, T, P, Cm) -> (B, T, L, C) in fp64, one image at a time, from the equations."""
    b, t = media.shape[:2]
    out = torch.zeros(b, t, rs.num_latents, rs.dim, dtype=torch.float64)
    for bi in range(b):
        for ti in range(t):
            x = media[bi, ti].double()  # (P, Cm)
            if not isinstance(rs.media_proj, torch.nn.Identity):
                x = x @ rs.media_proj.weight.double().T  # (P, C)
            lat = rs.latents.double()  # (L, C)
            for layer in rs.layers:
                attn = layer.attn
                h, d = attn.num_heads, attn.head_dim
                wq, wk, wv = attn.in_proj.weight.double().split(rs.dim)
                ql = _ln(lat, layer.norm_latents)
                kv_in = torch.cat([_ln(x, layer.norm_media), ql])  # (P + L, C)
                q = (ql @ wq.T).view(-1, h, d).transpose(0, 1)  # (H, L, D)
                k = (kv_in @ wk.T).view(-1, h, d).transpose(0, 1)  # (H, P + L, D)
                v = (kv_in @ wv.T).view(-1, h, d).transpose(0, 1)
                w = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(d), dim=-1)
                o = (w @ v).transpose(0, 1).reshape(-1, h * d)  # (L, C)
                lat = lat + o @ attn.out_proj.weight.double().T
                f = _ln(lat, layer.norm_ffn) @ layer.ffn.fc_in.weight.double().T
                lat = lat + _gelu(f) @ layer.ffn.fc_out.weight.double().T
            out[bi, ti] = _ln(lat, rs.norm)
    return out


@pytest.mark.parametrize("media_dim", [None, 24])
def test_matches_fp64_oracle(media_dim):
    rs = PerceiverResampler(32, num_latents=5, depth=2, num_heads=4, media_dim=media_dim)
    media = torch.randn(2, 3, 7, media_dim or 32)
    want = oracle(rs, media)
    got64 = rs.double()(media.double())
    torch.testing.assert_close(got64, want, atol=1e-10, rtol=0)
    got32 = rs.float()(media)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("p", [1, 2, 17])
def test_output_shape_independent_of_patches(p):
    rs = PerceiverResampler(16, num_latents=3, depth=1, num_heads=2, media_dim=8)
    out = rs(torch.randn(2, 4, p, 8))
    assert out.shape == (2, 4, 3, 16)
    assert torch.isfinite(out).all()


def test_images_are_resampled_independently_and_padding_is_zero():
    rs = PerceiverResampler(16, num_latents=3, depth=2, num_heads=2)
    media = torch.randn(2, 3, 5, 16)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    full = rs(media, media_mask=mask)
    assert torch.equal(full[~mask], torch.zeros_like(full[~mask]))
    junk = media.clone()
    junk[~mask] = 1e4  # padded slots are never read
    torch.testing.assert_close(rs(junk, media_mask=mask), full, atol=0, rtol=0)
    alone = rs(media[1:, :1])  # row 1's only image, run alone
    torch.testing.assert_close(full[1:, :1], alone, atol=1e-6, rtol=0)
    # each image independent of the others in its row: a slot alone, and the order reversed
    torch.testing.assert_close(rs(media[:, 1:2]), rs(media)[:, 1:2], atol=1e-6, rtol=0)
    swapped = rs(media.flip(1)).flip(1)
    torch.testing.assert_close(swapped, rs(media), atol=1e-6, rtol=0)


def test_gradients_reach_latents_and_media():
    rs = PerceiverResampler(16, num_latents=3, depth=1, num_heads=2, media_dim=8)
    media = torch.randn(1, 2, 4, 8, requires_grad=True)
    rs(media).square().sum().backward()
    assert rs.latents.grad is not None and rs.latents.grad.abs().sum() > 0
    assert torch.isfinite(media.grad).all() and media.grad.abs().sum() > 0


def test_errors_name_the_argument():
    rs = PerceiverResampler(16, num_latents=3, depth=1, num_heads=2, media_dim=8)
    with pytest.raises(ValueError, match=r"media must have shape \(B, T, P, Cm=8\)"):
        rs(torch.randn(2, 4, 8))  # (B, P, Cm): the T axis missing
    with pytest.raises(ValueError, match="Cm=8"):
        rs(torch.randn(2, 1, 4, 16))
    with pytest.raises(TypeError, match="floating-point"):
        rs(torch.ones(2, 1, 4, 8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"media_mask must have shape \(B, T\) = \(2, 1\)"):
        rs(torch.randn(2, 1, 4, 8), media_mask=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(TypeError, match="media_mask must be a bool"):
        rs(torch.randn(2, 1, 4, 8), media_mask=torch.ones(2, 1))
    with pytest.raises(ValueError, match="not divisible"):
        PerceiverResampler(10, num_heads=3)
    with pytest.raises(ValueError, match="num_latents must be a positive int"):
        PerceiverResampler(16, num_heads=2, num_latents=0)
