"""``qkv.modules.GatedCrossAttentionBlock``: the identity at init (bit for bit), the media mask
against an fp64 oracle that builds each token's allowed keys by a Python loop over the token
ids (latest image only / every earlier image, padded slots never), zero output and finite
gradients before the first image, precomputed keys/values, errors.

Shapes: B batch, N text length, C width, T images, L latents, Cm latent width.
Tolerances: fp64 module vs fp64 oracle atol 1e-10 (the same math, other summation order);
precomputed kv == media path: exact (the same ops).
"""

from __future__ import annotations

import math

import pytest
import torch

from qkv.modules import GatedCrossAttentionBlock, MediaKV
from qkv.modules.gated_cross_attention import cross_attention_mask, text_time_from_ids

IMG = 9


def _ln(x, mod):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + mod.eps) * mod.weight + mod.bias


def allowed_keys(ids, media_mask, num_latents, immediate):
    """(B, N) lists of allowed key indices, by a loop over the ids (no cumsum)."""
    out = []
    for b, row in enumerate(ids.tolist()):
        seen, keys = 0, []
        for tok in row:
            if tok == IMG:
                seen += 1
            images = [seen] if immediate else list(range(1, seen + 1))
            ks = [(i - 1) * num_latents + j for i in images if i >= 1
                  and bool(media_mask[b, i - 1]) for j in range(num_latents)]
            keys.append(ks)
        out.append(keys)
    return out


def oracle_block(block, x, media, ids, media_mask, immediate):
    """fp64: x + tanh(g_a)·attn + then the gated FFN, attention per token over its keys."""
    attn = block.attn
    h, d = attn.num_heads, attn.head_dim
    b, n, c = x.shape
    _, t, lat, cm = media.shape
    mem = media.reshape(b, t * lat, cm)
    wq = attn.q_proj.weight
    wk, wv = attn.kv_proj.weight.split(h * d)
    allowed = allowed_keys(ids, media_mask, lat, immediate)
    a = torch.zeros(b, n, c, dtype=torch.float64)
    for bi in range(b):
        q = (_ln(x[bi], block.norm_attn) @ wq.T).view(n, h, d)  # (N, H, D)
        k = (mem[bi] @ wk.T).view(-1, h, d)  # (S, H, D)
        v = (mem[bi] @ wv.T).view(-1, h, d)
        for i in range(n):
            ks = allowed[bi][i]
            if not ks:
                continue  # nothing to attend: zero
            s = torch.einsum("hd,shd->hs", q[i], k[ks]) / math.sqrt(d)
            o = torch.einsum("hs,shd->hd", torch.softmax(s, -1), v[ks]).reshape(h * d)
            a[bi, i] = o @ attn.out_proj.weight.T
    y = x + torch.tanh(block.attn_gate) * a
    f = _ln(y, block.norm_ffn) @ block.ffn.fc_in.weight.T
    f = 0.5 * f * (1 + torch.erf(f / math.sqrt(2))) @ block.ffn.fc_out.weight.T
    return y + torch.tanh(block.ff_gate) * f, a


def _inputs(b=3, n=11, t=3, lat=2, cm=12, c=16):
    ids = torch.randint(0, 8, (b, n))
    ids[0, [2, 5, 6]] = IMG  # two images back to back, text before the first
    ids[1, 0] = IMG  # the first token is an image
    ids[1, 8] = IMG
    ids[2, 10] = IMG  # only the last token has an image
    media_mask = torch.tensor([[True, True, True], [True, True, False], [True, False, False]])
    x = torch.randn(b, n, c, dtype=torch.float64)
    media = torch.randn(b, t, lat, cm, dtype=torch.float64)
    return ids, media_mask, x, media


@pytest.mark.parametrize("immediate", [True, False])
def test_media_mask_against_fp64_oracle(immediate):
    block = GatedCrossAttentionBlock(16, num_heads=2, media_dim=12,
                                     only_attend_immediate_media=immediate).double()
    with torch.no_grad():
        block.attn_gate.fill_(0.7)
        block.ff_gate.fill_(-0.4)
    ids, media_mask, x, media = _inputs()
    tt = text_time_from_ids(ids, IMG)
    got = block(x, media, text_time=tt, media_mask=media_mask)
    want, want_a = oracle_block(block, x, media, ids, media_mask, immediate)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    a = block.cross_attend(x, media, text_time=tt, media_mask=media_mask)
    torch.testing.assert_close(a, want_a, atol=1e-10, rtol=0)


def test_identity_at_init_bit_for_bit():
    block = GatedCrossAttentionBlock(16, num_heads=2, media_dim=12)
    assert block.attn_gate.shape == (1,) and block.ff_gate.shape == (1,)  # not 0-dim (FSDP2)
    assert float(block.attn_gate.detach()) == 0.0 and float(block.ff_gate.detach()) == 0.0
    ids, media_mask, x, media = _inputs()
    x = x.float()
    out = block(x, media.float(), text_time=text_time_from_ids(ids, IMG),
                media_mask=media_mask)
    assert torch.equal(out, x)


def test_before_first_image_zero_output_and_finite_grads():
    block = GatedCrossAttentionBlock(16, num_heads=2, media_dim=12)
    with torch.no_grad():
        block.attn_gate.fill_(1.0)
    ids, media_mask, x, media = _inputs()
    x = x.float().requires_grad_()
    media = media.float().requires_grad_()
    tt = text_time_from_ids(ids, IMG)
    a = block.cross_attend(x, media, text_time=tt, media_mask=media_mask)
    before = tt == 0  # (B, N)
    assert before.any() and (~before).any()
    assert torch.equal(a[before], torch.zeros_like(a[before]))  # exactly zero, not NaN
    assert a[~before].abs().sum(-1).min() > 0
    block(x, media, text_time=tt, media_mask=media_mask).sum().backward()
    for g in (x.grad, media.grad, *(p.grad for p in block.parameters())):
        assert torch.isfinite(g).all()
    # the attention branch contributes no gradient to positions before the first image
    x2 = x.detach().clone().requires_grad_()
    block.cross_attend(x2, media.detach(), text_time=tt, media_mask=media_mask).sum().backward()
    assert torch.equal(x2.grad[before], torch.zeros_like(x2.grad[before]))


def test_padded_slots_never_attended():
    block = GatedCrossAttentionBlock(16, num_heads=2, media_dim=12,
                                     only_attend_immediate_media=False).double()
    ids, media_mask, x, media = _inputs()
    tt = text_time_from_ids(ids, IMG).clamp(max=1)  # only the first image referenced...
    junk = media.clone()
    junk[~media_mask] = 1e3  # ...and the padded slots hold junk
    a1 = block.cross_attend(x, media, text_time=tt, media_mask=media_mask)
    a2 = block.cross_attend(x, junk, text_time=tt, media_mask=media_mask)
    assert torch.equal(a1, a2)
    # a position whose latest image is padded attends nothing
    tt_pad = torch.full_like(tt, 3)  # row 1 and 2 have image 3 padded
    a = block.cross_attend(x, media, text_time=tt_pad, media_mask=media_mask)
    block.only_attend_immediate_media = True
    a_imm = block.cross_attend(x, media, text_time=tt_pad, media_mask=media_mask)
    assert torch.equal(a_imm[1:], torch.zeros_like(a_imm[1:]))
    assert a[1:].abs().sum(-1).min() > 0  # every earlier real image still seen


def test_mask_matrix_small_case():
    """T=2 images of L=1 latent, tokens: text, <image>, text, <image>, text."""
    tt = torch.tensor([[0, 1, 1, 2, 2]])
    m = cross_attention_mask(tt, 2, 1)[0, 0]
    assert m.tolist() == [[False, False], [True, False], [True, False], [False, True],
                          [False, True]]
    m_all = cross_attention_mask(tt, 2, 1, only_attend_immediate_media=False)[0, 0]
    assert m_all.tolist() == [[False, False], [True, False], [True, False], [True, True],
                              [True, True]]


def test_precomputed_kv_equals_media_path():
    block = GatedCrossAttentionBlock(16, num_heads=4, media_dim=12)
    with torch.no_grad():
        block.attn_gate.fill_(0.5)
        block.ff_gate.fill_(0.5)
    ids, media_mask, x, media = _inputs()
    x, media = x.float(), media.float()
    tt = text_time_from_ids(ids, IMG)
    kv = block.project_media(media)
    assert isinstance(kv, MediaKV) and (kv.num_media, kv.num_latents) == (3, 2)
    assert kv.k.shape == (3, 4, 6, 4)
    a = block(x, media, text_time=tt, media_mask=media_mask)
    b = block(x, media_kv=kv, text_time=tt, media_mask=media_mask)
    assert torch.equal(a, b)
    # a decode step (one token) with its text_time from the cumulative count
    step = block(x[:, -1:], media_kv=kv, text_time=tt[:, -1:], media_mask=media_mask)
    torch.testing.assert_close(step, a[:, -1:], atol=1e-6, rtol=0)


def test_no_images_gives_zero_branch():
    block = GatedCrossAttentionBlock(8, num_heads=2)
    with torch.no_grad():
        block.attn_gate.fill_(1.0)
    x = torch.randn(2, 4, 8)
    a = block.cross_attend(x, torch.zeros(2, 0, 3, 8), text_time=torch.zeros(2, 4,
                                                                              dtype=torch.long))
    assert torch.equal(a, torch.zeros_like(a))


def test_errors_name_the_argument():
    block = GatedCrossAttentionBlock(8, num_heads=2, media_dim=4)
    x, media = torch.randn(2, 5, 8), torch.randn(2, 2, 3, 4)
    tt = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="exactly one of media"):
        block(x, text_time=tt)
    with pytest.raises(ValueError, match="exactly one of media"):
        block(x, media, media_kv=block.project_media(media), text_time=tt)
    with pytest.raises(ValueError, match=r"text_time must be in \[0, T=2\]"):
        block(x, media, text_time=tt + 3)
    with pytest.raises(ValueError, match=r"text_time must be an integer tensor \(B, N\)"):
        block(x, media, text_time=tt[:, :3])
    with pytest.raises(ValueError, match=r"media must have shape \(B, T, L, Cm=4\)"):
        block(x, torch.randn(2, 3, 4), text_time=tt)
    with pytest.raises(ValueError, match="x must have shape"):
        block(torch.randn(2, 5, 6), media, text_time=tt)
    with pytest.raises(ValueError, match="batch"):
        block(x[:1], media, text_time=tt[:1])
    with pytest.raises(ValueError, match=r"media_mask must have shape \(B, T\)"):
        block(x, media, text_time=tt, media_mask=torch.ones(2, 3, dtype=torch.bool))
