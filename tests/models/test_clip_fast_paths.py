"""The lean paths of CLIP / ViT: ``EncoderLayer.forward(h, rows=..., at=...)`` (a last layer at
one query row per sequence), ``ViT.pooled_features`` and ``CLIPTextTower.pooled_features`` (what
``encode_image`` / ``encode_text`` / ``loss`` run), and ``ViT.forward`` on token rows —
against the full layers' ``forward`` (the path HF parity is tested on) and an fp64 oracle,
values and gradients, with and without gradients, padded any way.

Shapes: B batch, N text length, T tokens, C width, H heads, E embedding width.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from qkv.models import CLIP, CLIPConfig
from qkv.modules.feedforward import quick_gelu
from qkv.modules.layers import EncoderLayer, TokenRows
from qkv.modules.positions import RoPE
from qkv.positions import ALiBi

F64 = dict(atol=1e-10, rtol=1e-10)  # same math in fp64, a different order of operations
C, H = 16, 4


def _clip(seed: int = 0, **text) -> CLIP:
    torch.manual_seed(seed)
    cfg = CLIPConfig.from_name("clip-tiny")
    if text:
        cfg = CLIPConfig.from_dict({**cfg.to_dict(), "text": {**cfg.to_dict()["text"], **text}})
    model = CLIP(cfg, dtype=torch.float64)
    with torch.no_grad():  # non-trivial biases and norms
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
    return model


def _texts(b: int = 4, n: int = 11, eos: int = 511, left: bool = False, seed: int = 1):
    """ids (B, N) and mask (B, N) with lengths 1..N (one full row), eos ending every text."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([3, n, 1, 7][:b])
    ids = torch.randint(1, eos, (b, n), generator=g)
    keep = torch.arange(n)[None] < lengths[:, None]  # (B, N) right padding
    ids[torch.arange(b), lengths - 1] = eos
    ids = ids * keep
    if left:
        ids, keep = ids.flip(1), keep.flip(1)
    return ids, keep.long()


def _layer(norm_first: bool, rope: bool = False) -> EncoderLayer:
    torch.manual_seed(5)
    layer = EncoderLayer.build(C, H, ffn_hidden=24, activation="quick_gelu",
                               norm_first=norm_first, dtype=torch.float64,
                               rope=RoPE(C // H) if rope else None)
    with torch.no_grad():
        for norm in (layer.norm1, layer.norm2):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.normal_()
    return layer.eval()


def _oracle_row(layer: EncoderLayer, x: torch.Tensor, i: int, keys: torch.Tensor):
    """Layer output at row i of one sequence x (N, C) attending to ``keys`` (N,) bool, fp64,
    from the parameters (explicit per-head softmax)."""
    a, f = layer.attn, layer.ffn
    d = C // H

    def ln(m, t):
        return F.layer_norm(t, (C,), m.weight, m.bias, m.eps)

    def ffn(t):
        return quick_gelu(t @ f.fc_in.weight.T + f.fc_in.bias) @ f.fc_out.weight.T + f.fc_out.bias

    t = ln(layer.norm1, x) if layer.norm_first else x
    p = t @ a.in_proj.weight.T + a.in_proj.bias  # (N, 3C)
    q, k, v = p.split([C, C, C], dim=-1)
    heads = []
    for h in range(H):
        s = q[i, h * d:(h + 1) * d] @ k[:, h * d:(h + 1) * d].T / math.sqrt(d)  # (N,)
        s = s.masked_fill(~keys, -math.inf)
        heads.append(torch.softmax(s, dim=-1) @ v[:, h * d:(h + 1) * d])
    att = torch.cat(heads) @ a.out_proj.weight.T + a.out_proj.bias  # (C,)
    if layer.norm_first:
        y = x[i] + att
        return y + ffn(ln(layer.norm2, y))
    y = ln(layer.norm1, x[i] + att)
    return ln(layer.norm2, y + ffn(y))


# --- EncoderLayer.forward(h, rows=..., at=...) -------------------------------------------
@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("grad", [False, True])
def test_at_rows_match_oracle_and_all_rows(norm_first, grad):
    """``at=`` with the N queries' mask and causal (each chosen query's own row of them), or
    with a mask that is already the chosen queries' (no causal): the oracle's row, and the
    row of the all-rows call."""
    layer = _layer(norm_first)
    b, n = 3, 9
    torch.manual_seed(2)
    x = torch.randn(b, n, C, dtype=torch.float64)
    keep = torch.arange(n)[None] < torch.tensor([[4], [9], [1]])  # (B, N) right padding
    rows = TokenRows(keep)
    h = rows.pack(x)  # (T, C)
    pos = torch.tensor([3, 5, 0])  # each sequence's query position
    at = torch.searchsorted(rows.index, torch.arange(b) * n + pos)  # (B,) rows of h
    keys = keep & (torch.arange(n)[None] <= pos[:, None])  # (B, N)
    with torch.set_grad_enabled(grad):
        got = layer(h, rows=rows, at=at, mask=keep[:, None, None, :], causal=True,
                    bufs=None if grad else {})
        own = layer(h, rows=rows, at=at, mask=keys[:, None, None, :],
                    bufs=None if grad else {})
        full = layer(h, rows=rows, mask=keep[:, None, None, :], causal=True)
    for i in range(b):
        want = _oracle_row(layer, x[i], int(pos[i]), keys[i])
        torch.testing.assert_close(got[i], want, **F64)
        torch.testing.assert_close(own[i], want, **F64)
        torch.testing.assert_close(got[i], full[int(at[i])], **F64)


def test_at_rows_unpadded_no_mask_gradients():
    layer = _layer(True).train()
    torch.manual_seed(3)
    x = torch.randn(2, 6, C, dtype=torch.float64, requires_grad=True)
    rows = TokenRows(None, batch=2, length=6)
    at = torch.tensor([0, 6])  # the first token of each sequence
    got = layer(rows.pack(x), rows=rows, at=at)
    got.square().sum().backward()
    g_at = {k: p.grad.clone() for k, p in layer.named_parameters()}
    gx = x.grad.clone()
    layer.zero_grad()
    x.grad = None
    layer(x)[:, 0].square().sum().backward()
    for k, p in layer.named_parameters():
        torch.testing.assert_close(g_at[k], p.grad, **F64, msg=k)
    torch.testing.assert_close(gx, x.grad, **F64)


def test_at_rows_run_through_the_layer_call_and_refuse_a_bias_producer():
    """``at=`` is an argument of the layer's call, so what wraps the call runs: a forward
    hook sees the (B, C) output, an instance ``forward`` wrapper (what activation
    checkpointing sets) gets ``at``; with RoPE too. A bias producer (positions by the
    queries' count, not their columns) is refused."""
    layer = _layer(True, rope=True)
    rows = TokenRows(None, batch=2, length=3)
    h = torch.randn(6, C, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    at = torch.tensor([2, 3])
    seen, calls = [], []
    handle = layer.register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    with torch.no_grad():
        want = layer(h, rows=rows, at=at)
        assert seen == [(2, C)]
        handle.remove()
        plain = layer.forward

        def wrapped(*args, **kwargs):
            calls.append(kwargs.get("at"))
            return plain(*args, **kwargs)

        layer.forward = wrapped
        got = layer(h, rows=rows, at=at)
        assert len(calls) == 1 and torch.equal(calls[0], at) and torch.equal(got, want)
        all_rows = layer(h, rows=rows, causal=False)  # (T, C): RoPE positions 0..2 each
        torch.testing.assert_close(got, all_rows[at], **F64)
        with pytest.raises(ValueError, match="bias producer"):
            layer(h, rows=rows, at=at, bias=ALiBi(H))


# --- ViT ------------------------------------------------------------------------------------
def _vit_oracle(vit, px):
    """The ViT through each layer's full forward (the path tested against HF)."""
    x = vit.embed(px)
    hidden = [x]
    for layer in vit.layers:
        x = layer(x)
        hidden.append(x)
    return vit.norm(x), hidden


@pytest.mark.parametrize("train", [False, True])
def test_vit_forward_and_pooled_features_match_layer_forward(train):
    model = _clip()
    vit = model.vision.train(train)
    torch.manual_seed(4)
    px = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        want, want_hidden = _vit_oracle(vit, px)
        out = vit(px, output_hidden_states=True)
        torch.testing.assert_close(out.last_hidden_state, want, **F64)
        for a, b in zip(out.hidden_states, want_hidden, strict=True):
            torch.testing.assert_close(a, b, **F64)
        torch.testing.assert_close(vit.pooled_features(px), want[:, 0], **F64)
        torch.testing.assert_close(model.encode_image(px),
                                   want[:, 0] @ model.visual_projection.weight.T, **F64)
    # other image size (interpolated positions) and mean pooling (the last layer in full)
    px2 = torch.randn(2, 3, 48, 40, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(vit.pooled_features(px2), _vit_oracle(vit, px2)[0][:, 0],
                                   **F64)
        object.__setattr__(vit.config, "pooling", "mean")
        torch.testing.assert_close(vit.pooled_features(px),
                                   _vit_oracle(vit, px)[0][:, 1:].mean(1), **F64)


def test_vit_pooled_features_gradients():
    model = _clip().train()
    vit = model.vision
    torch.manual_seed(5)
    px = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    vit.pooled_features(px).sin().sum().backward()
    got = {k: p.grad.clone() for k, p in vit.named_parameters()}
    vit.zero_grad()
    _vit_oracle(vit, px)[0][:, 0].sin().sum().backward()
    for k, p in vit.named_parameters():
        torch.testing.assert_close(got[k], p.grad, **F64, msg=k)


def test_vit_wrapped_last_layer_is_called_at_the_class_tokens():
    """An instance ``forward`` wrapper on the last layer (as activation checkpointing sets)
    is called, once, with every B·T row and ``at`` the class tokens; same pooled features."""
    vit = _clip().vision.eval()
    px = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    last = vit.layers[-1]
    calls = []
    plain = last.forward

    def wrapped(*args, **kwargs):  # as activation checkpointing wraps it, on the instance
        at = kwargs.get("at")
        calls.append((tuple(args[0].shape), None if at is None else at.tolist()))
        return plain(*args, **kwargs)

    last.forward = wrapped
    with torch.no_grad():
        got = vit.pooled_features(px)
        calls_pooled = list(calls)
        want = _vit_oracle(vit, px)[0][:, 0]
    torch.testing.assert_close(got, want, **F64)
    assert calls_pooled == [((2 * 17, 64), [0, 17])]  # all B·T rows in, the class tokens out


# --- the text tower -------------------------------------------------------------------------
CASES = {
    "right": dict(left=False, mask=True),
    "left": dict(left=True, mask=True),
    "no-mask": dict(left=False, mask=False),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("train", [False, True])
def test_text_pooled_features_match_forward(case, train):
    model = _clip().train(train)
    ids, mask = _texts(left=CASES[case]["left"])
    mask = mask if CASES[case]["mask"] else None
    with torch.no_grad():
        want = model.text(ids, mask).pooled
        torch.testing.assert_close(model.text.pooled_features(ids, mask), want, **F64)
        torch.testing.assert_close(model.encode_text(ids, mask),
                                   want @ model.text_projection.weight.T, **F64)


def test_text_pooled_features_gradients_and_loss():
    model = _clip().train()
    ids, mask = _texts()
    px = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    model.loss(px, ids, mask).backward()
    got = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    from qkv.models import clip_loss
    out = model(px, ids, mask)  # the full towers
    img = model.visual_projection(out.vision_output.pooled)
    txt = model.text_projection(out.text_output.pooled)
    clip_loss(img, txt, model.logit_scale.exp()).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(got[k], p.grad, **F64, msg=k)


def test_text_padding_inside_and_a_padded_pooled_token():
    """Not a prefix of real tokens (a hole in the mask) and a row whose end-of-text token
    itself is masked: the masked path of pooled_features, equal to forward."""
    model = _clip().eval()
    ids, mask = _texts()
    mask[1, 2] = 0  # a hole in the full row
    mask[0, 2] = 0  # row 0's eos (position 2) is padding
    with torch.no_grad():
        torch.testing.assert_close(model.text.pooled_features(ids, mask),
                                   model.text(ids, mask).pooled, **F64)


def test_text_argmax_pooling_int32_ids_and_errors():
    model = _clip(eos_token_id=2, pooling="argmax").eval()
    ids, mask = _texts(eos=511)  # the highest id ends each text
    with torch.no_grad():
        torch.testing.assert_close(model.text.pooled_features(ids.int(), mask),
                                   model.text(ids, mask).pooled, **F64)
    eos_model = _clip().eval()
    with pytest.raises(ValueError, match="end-of-text"):
        eos_model.text.pooled_features(torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask"):
        eos_model.text.pooled_features(ids, mask[:, :3])
