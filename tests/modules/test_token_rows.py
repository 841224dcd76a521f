"""``EncoderLayer.forward(h, rows=...)`` (the real tokens of a padded batch packed into (T, C)
rows) computes the padded call's math: against an fp64 oracle written apart, against the
padded ``forward`` and against each row run alone unpadded; ``at=`` (the layer at one row per
sequence) with a non-empty cache and RoPE against the padded forward; and the
encoder-decoder's token-rows encoder (eval, padded source) against its padded path.

Shapes: B batch, N length, T real tokens, C width, H heads, Hkv kv heads, D head dim.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.masks import Padding
from qkv.models.transformer import Transformer, TransformerConfig
from qkv.modules.layers import EncoderLayer, TokenRows
from qkv.modules.positions import RoPE, positions_from_mask

F64 = dict(atol=1e-10, rtol=1e-10)  # same math, fp64, different op order
C, H = 16, 4


def _layer(*, norm_first: bool, num_kv_heads: int | None = None, rope: bool = False,
           seed: int = 0) -> EncoderLayer:
    torch.manual_seed(seed)
    layer = EncoderLayer.build(C, H, ffn_hidden=24, activation="gelu", norm_first=norm_first,
                               num_kv_heads=num_kv_heads, dtype=torch.float64,
                               rope=RoPE(C // H) if rope else None)
    with torch.no_grad():  # non-trivial norms
        for norm in (layer.norm1, layer.norm2):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.normal_()
    return layer.eval()


def _oracle(layer: EncoderLayer, x: torch.Tensor, causal: bool) -> torch.Tensor:
    """The layer on one unpadded row x (L, C), fp64, from its parameters: torch's layer_norm
    and gelu, attention as explicit per-head softmax (GQA: head h reads kv head h // g)."""
    a, f = layer.attn, layer.ffn
    d, hkv = C // H, a.num_kv_heads

    def ln(m, t):
        return F.layer_norm(t, (C,), m.weight, m.bias, m.eps)

    def attend(t):
        p = t @ a.in_proj.weight.T + a.in_proj.bias  # (L, (H + 2·Hkv)·D)
        q, k, v = p.split([H * d, hkv * d, hkv * d], dim=-1)
        out = []
        for h in range(H):
            kh = h // (H // hkv)
            s = q[:, h * d:(h + 1) * d] @ k[:, kh * d:(kh + 1) * d].T / math.sqrt(d)
            if causal:
                s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), -math.inf)
            out.append(torch.softmax(s, dim=-1) @ v[:, kh * d:(kh + 1) * d])
        return torch.cat(out, dim=-1) @ a.out_proj.weight.T + a.out_proj.bias

    def ffn(t):
        return F.gelu(t @ f.fc_in.weight.T + f.fc_in.bias) @ f.fc_out.weight.T + f.fc_out.bias

    if layer.norm_first:
        x = x + attend(ln(layer.norm1, x))
        return x + ffn(ln(layer.norm2, x))
    x = ln(layer.norm1, x + attend(x))
    return ln(layer.norm2, x + ffn(x))


def _batch(keep: torch.Tensor, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*keep.shape, C, generator=g, dtype=torch.float64)  # (B, N, C)


RIGHT = torch.tensor([[1, 1, 1, 1, 1, 1, 1],
                      [1, 1, 1, 0, 0, 0, 0],
                      [0, 0, 0, 0, 0, 0, 0],  # no real token at all
                      [1, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
LEFT = torch.tensor([[1, 1, 1, 1, 1, 1, 1],
                     [0, 0, 0, 0, 1, 1, 1],
                     [0, 0, 0, 0, 0, 0, 1]], dtype=torch.bool)


@pytest.mark.parametrize("case", ["post-norm", "pre-norm-causal-gqa"])
def test_rows_equal_fp64_oracle_and_padded_forward(case):
    norm_first, causal, keep = {"post-norm": (False, False, RIGHT),
                                "pre-norm-causal-gqa": (True, True, LEFT)}[case]
    layer = _layer(norm_first=norm_first, num_kv_heads=2 if causal else None)
    x = _batch(keep)
    rows = TokenRows(keep)
    mask = Padding(keep=keep)
    with torch.no_grad():
        got = layer(rows.pack(x), rows=rows, mask=mask, causal=causal)  # (T, C)
        padded = layer(x, mask=mask, causal=causal)  # (B, N, C)
    assert got.shape == (int(keep.sum()), C)
    torch.testing.assert_close(got, rows.pack(padded), **F64)  # padded == token rows
    want = torch.cat([_oracle(layer, x[b][keep[b]], causal) for b in range(len(keep))])
    torch.testing.assert_close(got, want, **F64)
    unpacked = rows.unpack(got)  # (B, N, C): zeros at padded positions
    assert torch.equal(unpacked[~keep], torch.zeros_like(unpacked[~keep]))


def test_rows_with_rope_left_padding_equal_each_row_alone():
    """GPT's case: causal, RoPE at positions counted from each row's first real token."""
    layer = _layer(norm_first=True, rope=True)
    keep = LEFT
    x = _batch(keep)
    rows = TokenRows(keep)
    with torch.no_grad():
        got = rows.unpack(layer(rows.pack(x), rows=rows, mask=Padding(keep=keep),
                                causal=True, positions=positions_from_mask(keep)))
        for b in range(len(keep)):
            alone = layer(x[b:b + 1, keep[b]], causal=True)  # (1, L, C), positions 0..L-1
            torch.testing.assert_close(got[b, keep[b]], alone[0], **F64)


def test_rows_weights_and_gradients_equal_forward():
    layer = _layer(norm_first=False).train()  # dropout 0: train mode, gradients
    keep = RIGHT[[0, 1, 3]]
    x = _batch(keep)
    rows = TokenRows(keep)
    mask = Padding(keep=keep)
    got, w_rows = layer(rows.pack(x), rows=rows, mask=mask, need_weights=True)
    grads_rows = torch.autograd.grad(got.square().sum(), list(layer.parameters()))
    out, w = layer(x, mask=mask, need_weights=True)
    grads = torch.autograd.grad(rows.pack(out).square().sum(), list(layer.parameters()))
    torch.testing.assert_close(w_rows.transpose(1, 2)[keep], w.transpose(1, 2)[keep],
                               **F64)  # (T, H, S): the real queries
    for g_rows, g in zip(grads_rows, grads, strict=True):
        torch.testing.assert_close(g_rows, g, **F64)


def test_swapped_parts_fall_back_to_forward_and_buffers_are_reused_safely():
    """A swapped-in projection (another type: the rows path must not read .weight directly)
    makes the layer run on the padded batch: the wrapper sees (B, N, C), never (T, C)."""
    seen = []

    class Wrapped(nn.Linear):
        def forward(self, t):
            seen.append(tuple(t.shape))
            return super().forward(t) * 1.5

    layers = [_layer(norm_first=False, seed=s) for s in (0, 1)]
    wrapped = layers[1].attn.in_proj
    layers[1].attn.in_proj = Wrapped(C, 3 * C, dtype=torch.float64)
    layers[1].attn.in_proj.load_state_dict(wrapped.state_dict())
    keep = RIGHT
    x = _batch(keep)
    rows = TokenRows(keep)
    mask = Padding(keep=keep)
    with torch.no_grad():
        h, bufs = rows.pack(x), {}
        h2 = rows.pack(x)
        for layer in layers + layers[:1]:  # the shared buffers serve three layer calls
            h = layer(h, rows=rows, mask=mask, bufs=bufs)
            h2 = layer(h2, rows=rows, mask=mask)
        assert seen == [(*keep.shape, C)] * 2  # the padded batch, in both calls
        want = x
        for layer in layers + layers[:1]:
            want = layer(want, mask=mask)
    torch.testing.assert_close(h, h2, **F64)
    torch.testing.assert_close(h, rows.pack(want), **F64)


# --- at=: the layer at one row per sequence, with a cache and RoPE ----------------------
P, NOW = 3, 5  # cached positions before the chunk, the chunk's length
KEEP_AT = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1],
                        [0, 1, 1, 1, 1, 1, 1, 1],
                        [0, 0, 1, 1, 1, 1, 0, 0],  # padding inside the chunk too
                        [0, 0, 0, 0, 0, 1, 1, 1]], dtype=torch.bool)  # nothing cached
FP64_TABLE = dict(atol=1e-12, rtol=1e-10)  # tests/conftest.py TOL: fp64 vs fp64


@pytest.mark.parametrize("norm_first", [True, False], ids=["pre-norm", "post-norm"])
@pytest.mark.parametrize("which", ["last", "inner"])
@pytest.mark.parametrize("path", ["direct", "hooked-attn"])
@pytest.mark.parametrize("positions", ["from-mask", "default"])
def test_at_rows_with_cache_and_rope_equal_padded_forward(norm_first, which, path, positions):
    """``layer(h, rows=rows, at=at, ...)`` after a cached prefix, with RoPE and GQA (the
    last layer of ``qkv.generation.prefill.prefill_rows``, cache empty there): its (B, C)
    rows, its weights (B, H, 1, S) and what it caches at the real positions equal the
    padded ``layer(x, ...)`` with a copy of the cache, the same Padding mask over the S
    cached + new keys, causal and positions, at each sequence's chosen row: its last real
    token (the prefill), or an inner one (causal then hides later keys). fp64 against the
    fp64 padded forward: atol 1e-12, rtol 1e-10 (docs/ARCHITECTURE.md: Tolerances). A hook
    on the attention makes the layer compute the padded batch inside (the same result)."""
    layer = _layer(norm_first=norm_first, num_kv_heads=2, rope=True, seed=3)
    if path == "hooked-attn":
        layer.attn.register_forward_hook(lambda m, i, o: None)
    b, s = KEEP_AT.shape
    x = _batch(KEEP_AT, seed=4)  # (B, P + NOW, C)
    pos = positions_from_mask(KEEP_AT)  # (B, S), as GPT
    cache, copy = (layer.attn.new_cache(b, s, dtype=torch.float64) for _ in range(2))
    with torch.no_grad():
        for c in (cache, copy):  # the cached prefix, padded, through the plain forward
            layer(x[:, :P], mask=Padding(keep=KEEP_AT[:, :P]), causal=True, cache=c,
                  positions=pos[:, :P] if positions == "from-mask" else None)
        now_pos = pos[:, P:] if positions == "from-mask" else None
        mask = Padding(keep=KEEP_AT)  # over the S = P + NOW keys
        want, want_w = layer(x[:, P:], mask=mask, causal=True, cache=copy,
                             positions=now_pos, need_weights=True)  # (B, NOW, C)
        rows = TokenRows(KEEP_AT[:, P:])
        flat = rows.index  # (T,) positions in B·NOW
        seq = flat // NOW
        pick = [int(flat[seq == i].max() if which == "last" else flat[seq == i].min())
                for i in range(b)]  # each sequence's chosen position in B·NOW
        at = torch.searchsorted(flat, torch.tensor(pick))  # (B,) rows of the (T, C) pack
        got, got_w = layer(rows.pack(x[:, P:]), rows=rows, at=at, mask=mask, causal=True,
                           cache=cache, positions=now_pos, need_weights=True, bufs={})
    assert got.shape == (b, C) and got_w.shape == (b, H, 1, s)
    cols = torch.tensor(pick) % NOW
    torch.testing.assert_close(got, want.reshape(b * NOW, C)[pick], **FP64_TABLE)
    torch.testing.assert_close(got_w[:, :, 0], want_w[torch.arange(b), :, cols],
                               **FP64_TABLE)
    assert cache.length == copy.length == s
    real = KEEP_AT[:, None, :, None].expand(b, 2, s, C // H)  # (B, Hkv, S, D)
    for got_kv, want_kv in ((cache.keys, copy.keys), (cache.values, copy.values)):
        torch.testing.assert_close(got_kv[:, :, :s][real], want_kv[:, :, :s][real],
                                   **FP64_TABLE)


def test_at_rows_refuse_bad_arguments():
    layer = _layer(norm_first=True)
    rows = TokenRows(LEFT)
    h = rows.pack(_batch(LEFT))
    with torch.no_grad():
        with pytest.raises(ValueError, match="a token of sequence b"):
            layer(h, rows=rows, at=torch.tensor([0, 1, 2]))  # rows 1, 2 are sequence 0's
        with pytest.raises(ValueError, match=r"at must be a \(B,\)"):
            layer(h, rows=rows, at=torch.tensor([6.0, 9.0, 10.0]))
        with pytest.raises(ValueError, match="rows in"):
            layer(h, rows=rows, at=torch.tensor([6, 9, 99]))
        with pytest.raises(ValueError, match="give rows="):
            layer(_batch(LEFT), at=torch.tensor([6, 9, 10]))
        with pytest.raises(ValueError, match=r"\(T, C\)"):
            layer(h[:-1], rows=rows)


def test_token_rows_rejects_a_bad_keep():
    with pytest.raises(ValueError, match="keep must be a"):
        TokenRows(torch.ones(2, 3))
    with pytest.raises(ValueError, match="batch and length"):
        TokenRows(None)


# --- the encoder-decoder's encoder ------------------------------------------------------
@pytest.mark.parametrize("overrides", [dict(), dict(norm_first=True, positions="t5")],
                         ids=["post-norm-sinusoidal", "pre-norm-t5"])
def test_seq2seq_token_rows_encoder_equals_padded_path(overrides):
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.from_name("transformer-tiny", dropout=0.0,
                                                    **overrides)).double()
    src = torch.randint(3, 32, (3, 9))
    src[1, 5:] = 0  # pad_id: right padding
    src[2, 2:] = 0
    tgt = torch.randint(3, 32, (3, 6))
    keep = src != 0
    with torch.no_grad():
        model.eval()  # token rows
        memory, _ = model.encode(src)
        logits = model(src, tgt)
        model.train()  # dropout 0: the padded path, same math
        memory_padded, _ = model.encode(src)
        logits_padded = model(src, tgt)
        model.eval()
        alone = [model(src[b:b + 1, keep[b]], tgt[b:b + 1]) for b in range(3)]
    torch.testing.assert_close(memory[keep], memory_padded[keep], **F64)
    torch.testing.assert_close(logits, logits_padded, **F64)
    for b in range(3):
        torch.testing.assert_close(logits[b], alone[b][0], **F64)
