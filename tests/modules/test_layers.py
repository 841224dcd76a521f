"""qkv.modules.layers (EncoderLayer, DecoderLayer) against torch.nn.TransformerEncoderLayer /
TransformerDecoderLayer with copied weights: code nobody here wrote.

Shapes: B batch, N target (query) length, S source/memory length, C width, H heads.

Mapping: torch ``self_attn``/``multihead_attn`` -> ``MultiHeadAttention.from_torch``;
``linear1``/``linear2`` -> ``ffn.fc_in``/``ffn.fc_out``; ``norm1..3`` -> ``norm1..3``.
torch's ``*_key_padding_mask`` is True = ignore; qkv's ``Padding(keep=...)`` is True = real.
Tolerance: fp32 atol/rtol 1e-5 (the issue's bar; eval mode, dropout 0). Every parameter,
norms included, gets random values so that no mapping error hides behind an identity.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qkv.masks import Padding
from qkv.modules.attention import MultiHeadAttention
from qkv.modules.layers import DecoderLayer, EncoderLayer
from qkv.modules.norms import LayerNorm

FP32 = {"atol": 1e-5, "rtol": 1e-5}
B, S, N, C, H, F = 3, 7, 5, 32, 4, 48


def _randomize(module: nn.Module) -> nn.Module:
    """Random values everywhere (norm weights around 1, everything else around 0)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            centre = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            p.copy_(centre + 0.3 * torch.randn_like(p))
    return module


def _copy(ours: nn.Module, theirs: nn.Module) -> None:
    ours.load_state_dict(theirs.state_dict())


def _encoder_pair(norm_first: bool, activation: str):
    torch_layer = nn.TransformerEncoderLayer(C, H, F, dropout=0.0, activation=activation,
                                             batch_first=True, norm_first=norm_first)
    _randomize(torch_layer).eval()
    ours = EncoderLayer.build(C, H, ffn_hidden=F, activation=activation, norm_first=norm_first)
    with torch.no_grad():
        _copy(ours.attn, MultiHeadAttention.from_torch(torch_layer.self_attn))
        _copy(ours.ffn.fc_in, torch_layer.linear1)
        _copy(ours.ffn.fc_out, torch_layer.linear2)
        _copy(ours.norm1, torch_layer.norm1)
        _copy(ours.norm2, torch_layer.norm2)
    return torch_layer, ours.eval()


def _decoder_pair(norm_first: bool, activation: str):
    torch_layer = nn.TransformerDecoderLayer(C, H, F, dropout=0.0, activation=activation,
                                             batch_first=True, norm_first=norm_first)
    _randomize(torch_layer).eval()
    ours = DecoderLayer.build(C, H, ffn_hidden=F, activation=activation, norm_first=norm_first)
    with torch.no_grad():
        _copy(ours.self_attn, MultiHeadAttention.from_torch(torch_layer.self_attn))
        _copy(ours.cross_attn, MultiHeadAttention.from_torch(torch_layer.multihead_attn))
        _copy(ours.ffn.fc_in, torch_layer.linear1)
        _copy(ours.ffn.fc_out, torch_layer.linear2)
        for k in (1, 2, 3):
            _copy(getattr(ours, f"norm{k}"), getattr(torch_layer, f"norm{k}"))
    return torch_layer, ours.eval()


def _torch_causal(n: int) -> torch.Tensor:
    """torch's bool attn_mask for causal attention: True = may NOT attend (above diagonal)."""
    return torch.ones(n, n, dtype=torch.bool).triu(1)


def _lengths_keep(b: int, length: int) -> torch.Tensor:
    """(B, L) keep mask, True = real: full, one short, one of length 1 (right padding)."""
    lengths = torch.tensor([length, length - 2, 1][:b])
    return torch.arange(length)[None, :] < lengths[:, None]


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_encoder_layer_matches_torch(norm_first, activation, padded):
    torch_layer, ours = _encoder_pair(norm_first, activation)
    x = torch.randn(B, S, C)
    keep = _lengths_keep(B, S) if padded else None
    with torch.no_grad():  # torch's fast path (eval, no grad) where it applies
        want = torch_layer(x, src_key_padding_mask=None if keep is None else ~keep)
        got = ours(x, mask=None if keep is None else Padding(keep=keep))
    torch.testing.assert_close(got, want, **FP32)


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_gradients_match_torch(norm_first):
    """Slow path (grad enabled): outputs and input gradients."""
    torch_layer, ours = _encoder_pair(norm_first, "relu")
    keep = _lengths_keep(B, S)
    x1 = torch.randn(B, S, C, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    want = torch_layer(x1, src_key_padding_mask=~keep)
    got = ours(x2, mask=Padding(keep=keep))
    torch.testing.assert_close(got, want, **FP32)
    g = torch.randn_like(want)
    want.backward(g)
    got.backward(g)
    torch.testing.assert_close(x2.grad, x1.grad, **FP32)


def test_encoder_layer_causal_matches_torch():
    """A decoder-only stack uses EncoderLayer(causal=True): torch's is_causal mask."""
    torch_layer, ours = _encoder_pair(True, "gelu")
    x = torch.randn(B, S, C)
    mask = _torch_causal(S)
    with torch.no_grad():
        want = torch_layer(x, src_mask=mask, is_causal=True)
        got = ours(x, causal=True)
    torch.testing.assert_close(got, want, **FP32)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_decoder_layer_matches_torch(norm_first, activation, padded):
    torch_layer, ours = _decoder_pair(norm_first, activation)
    x, memory = torch.randn(B, N, C), torch.randn(B, S, C)
    causal = _torch_causal(N)
    mem_keep = _lengths_keep(B, S) if padded else None
    tgt_keep = _lengths_keep(B, N) if padded else None
    with torch.no_grad():
        want = torch_layer(x, memory, tgt_mask=causal, tgt_is_causal=True,
                           tgt_key_padding_mask=None if tgt_keep is None else ~tgt_keep,
                           memory_key_padding_mask=None if mem_keep is None else ~mem_keep)
        got = ours(x, memory, causal=True,
                   self_mask=None if tgt_keep is None else Padding(keep=tgt_keep),
                   memory_mask=None if mem_keep is None else Padding(keep=mem_keep))
        # the precomputed cross-attention keys/values give the same result
        kv = ours.cross_attn.project_kv(memory)
        got_kv = ours(x, memory_kv=kv, causal=True,
                      self_mask=None if tgt_keep is None else Padding(keep=tgt_keep),
                      memory_mask=None if mem_keep is None else Padding(keep=mem_keep))
    torch.testing.assert_close(got, want, **FP32)
    torch.testing.assert_close(got_kv, got, atol=0, rtol=0)


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer_gradients_match_torch(norm_first):
    torch_layer, ours = _decoder_pair(norm_first, "gelu")
    mem_keep = _lengths_keep(B, S)
    causal = _torch_causal(N)
    x1, m1 = torch.randn(B, N, C, requires_grad=True), torch.randn(B, S, C, requires_grad=True)
    x2, m2 = (t.detach().clone().requires_grad_() for t in (x1, m1))
    want = torch_layer(x1, m1, tgt_mask=causal, memory_key_padding_mask=~mem_keep)
    got = ours(x2, m2, causal=True, memory_mask=Padding(keep=mem_keep))
    torch.testing.assert_close(got, want, **FP32)
    g = torch.randn_like(want)
    want.backward(g)
    got.backward(g)
    torch.testing.assert_close(x2.grad, x1.grad, **FP32)
    torch.testing.assert_close(m2.grad, m1.grad, **FP32)


def test_decoder_layer_cached_steps_match_full():
    """Token-by-token with the self-attention cache == the full causal pass (1e-5)."""
    _, ours = _decoder_pair(False, "relu")
    x, memory = torch.randn(B, N, C), torch.randn(B, S, C)
    with torch.no_grad():
        full = ours(x, memory, causal=True)
        cache = ours.self_attn.new_cache(B, N)
        kv = ours.cross_attn.project_kv(memory)
        steps = [ours(x[:, i:i + 1], memory_kv=kv, causal=True, cache=cache) for i in range(N)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **FP32)


def test_decoder_layer_weights_shapes():
    _, ours = _decoder_pair(True, "relu")
    x, memory = torch.randn(B, N, C), torch.randn(B, S, C)
    keep = _lengths_keep(B, S)
    out, (w_self, w_cross) = ours(x, memory, causal=True, memory_mask=Padding(keep=keep),
                                  need_weights=True)
    assert out.shape == (B, N, C)
    assert w_self.shape == (B, H, N, N) and w_cross.shape == (B, H, N, S)
    torch.testing.assert_close(w_cross.sum(-1), torch.ones(B, H, N), **FP32)
    assert (w_cross[~keep[:, None, None, :].expand_as(w_cross)] == 0).all()
    assert (w_self.triu(1) == 0).all()


def test_decoder_layer_needs_exactly_one_memory():
    _, ours = _decoder_pair(False, "relu")
    x, memory = torch.randn(B, N, C), torch.randn(B, S, C)
    with pytest.raises(ValueError, match="exactly one"):
        ours(x)
    with pytest.raises(ValueError, match="exactly one"):
        ours(x, memory, memory_kv=ours.cross_attn.project_kv(memory))


@pytest.mark.parametrize("norm_first", [False, True])
def test_rmsnorm_swiglu_variants_run_finite(norm_first):
    enc = EncoderLayer.build(C, H, activation="swiglu", norm="rmsnorm", norm_first=norm_first)
    dec = DecoderLayer.build(C, H, activation="swiglu", norm="rmsnorm", norm_first=norm_first)
    x, memory = torch.randn(B, N, C, requires_grad=True), torch.randn(B, S, C)
    y = dec(enc(x, causal=True), memory)
    assert y.shape == (B, N, C) and torch.isfinite(y).all()
    y.square().sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in enc.parameters())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_layernorm_constant_half_input_is_finite(dtype):
    """Checklist 13: a constant row has zero variance; eps >= 1e-5 and fp32 stats keep it
    finite (the output is the bias)."""
    norm = LayerNorm(C).to(dtype)
    with torch.no_grad():
        norm.bias.fill_(0.25)
    x = torch.full((2, 3, C), 1000.0, dtype=dtype)
    y = norm(x)
    assert y.dtype == dtype and torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), torch.full((2, 3, C), 0.25), atol=1e-3, rtol=0)
    assert norm.eps >= 1e-5
    layer = EncoderLayer.build(C, H, norm_first=True).to(dtype)
    assert torch.isfinite(layer(x)).all()
