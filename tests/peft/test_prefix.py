"""Prefix tuning (qkv.peft.prefix): an fp64 oracle for one attention call, cache == no
cache, padded row == row alone, counts (also against HF PEFT's), frozen base, clear errors.

Shapes: B batch, N length, S key length, P prefix length, C width, H heads, Hkv kv heads,
D head dim, V vocab.
Tolerances: fp32 vs the fp64 oracle: atol 5e-5, rtol 5e-6 (docs/ARCHITECTURE.md: Tolerances);
cached vs uncached and padded vs alone logits: atol 1e-5 (fp32, the brief's bar), greedy
tokens exact.
"""

from __future__ import annotations

import copy

import pytest
import torch

import qkv
from conftest import oracle_attention
from qkv.models import BERT, GPT, BERTConfig, GPTConfig, Transformer, TransformerConfig
from qkv.modules.attention import MultiHeadAttention
from qkv.modules.cache import KVCache
from qkv.ops.masks import Causal, Padding
from qkv.peft.prefix import (
    PrefixAttention,
    PrefixConfig,
    PrefixKVCache,
    add_prefix,
    prefix_mask,
)
from qkv.peft.summary import count_parameters
from qkv.positions import RoPE

P = 3


def _randomise(model, gen: torch.Generator, std: float = 1.0) -> None:
    """Prefixes large enough to matter (the 0.02 init barely moves the outputs)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, PrefixAttention):
                for p in m.prefixes.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * std)


def _gpt(**overrides) -> GPT:
    model = GPT(GPTConfig.from_name("gpt-tiny", **overrides)).eval()
    return model


# ------------------------------------------------------------------ one attention call


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("kv_heads", [3, 1])
def test_attention_call_matches_oracle(rope, kv_heads, gen):
    """Left-padded causal self-attention with a prefix vs the formula: keys/values of the
    prefix concatenated by hand, a keep-matrix in which every query sees all P prefix keys,
    fp64 softmax; RoPE rotates the real tokens only, at positions 0..N-1."""
    c, h, n, b = 24, 3, 6, 2
    d = c // h
    mha = MultiHeadAttention(c, h, num_kv_heads=kv_heads, rope=RoPE(d) if rope else None)
    attn = PrefixAttention(mha)
    from qkv.peft.prefix import PrefixKV
    attn.prefixes["x"] = PrefixKV(kv_heads, P, d)
    attn.set_active("x")
    _randomise(attn, gen)
    x = torch.randn(b, n, c, generator=gen)
    keep = torch.ones(b, n, dtype=torch.bool)
    keep[0, :2] = False
    got = attn(x, mask=Padding(keep=keep), causal=True)

    xd = x.double()
    proj = xd @ mha.in_proj.weight.double().T + mha.in_proj.bias.double()
    q, k, v = proj.split((h * d, kv_heads * d, kv_heads * d), dim=-1)
    q = q.reshape(b, n, h, d).transpose(1, 2)  # (B, H, N, D)
    k = k.reshape(b, n, kv_heads, d).transpose(1, 2)  # (B, Hkv, N, D)
    v = v.reshape(b, n, kv_heads, d).transpose(1, 2)
    if rope:
        pos = torch.arange(n)
        q, k = mha.rope.rotate(q, pos), mha.rope.rotate(k, pos)
    pk, pv = (t.double()[None].expand(b, -1, -1, -1) for t in attn.prefixes["x"]())
    k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)  # (B, Hkv, P + N, D)
    causal = torch.ones(n, n, dtype=torch.bool).tril()  # (N, N)
    real = causal[None] & keep[:, None, :]  # (B, N, N)
    allowed = torch.cat([torch.ones(b, n, P, dtype=torch.bool), real], dim=2)  # (B, N, P+N)
    out = oracle_attention(q, k, v, keep=allowed[:, None])  # (B, H, N, D)
    out = out.transpose(1, 2).reshape(b, n, c)
    want = out @ mha.out_proj.weight.double().T + mha.out_proj.bias.double()
    torch.testing.assert_close(got.double(), want, atol=5e-5, rtol=5e-6)


def test_prefix_mask_generic_path_matches_dense():
    """Masks without a direct rule (top-left causal, a key-broadcast bool tensor) go through
    the shifted block view; its dense form == the hand-built one."""
    n, s = 4, 6
    tl = Causal("top_left")
    want = torch.cat([torch.ones(1, 1, n, P, dtype=torch.bool), tl.dense(n, s)], dim=-1)
    assert torch.equal(prefix_mask(tl, P).dense(n, s + P), want)
    rows = torch.tensor([True, False, True, False])[None, None, :, None]  # (1, 1, N, 1)
    want = torch.cat([torch.ones(1, 1, n, P, dtype=torch.bool),
                      rows.expand(1, 1, n, s)], dim=-1)
    got = prefix_mask(rows, P)
    assert torch.equal(got.dense(n, s + P).expand(1, 1, n, s + P), want)
    for j0, j1 in ((0, 2), (1, 5), (3, 9), (2, 9)):  # blocks on both sides of P
        blk = got.block(0, n, j0, j1, n, s + P, torch.device("cpu"))
        blk = torch.full((1, 1, n, j1 - j0), blk) if isinstance(blk, bool) else blk
        assert torch.equal(blk.expand(1, 1, n, j1 - j0), want[..., j0:j1])
    lengths = prefix_mask(Padding(torch.tensor([2, 6])), P)
    assert torch.equal(lengths.dense(n, s + P)[:, 0, 0], torch.arange(s + P)[None] <
                       torch.tensor([[P + 2], [P + 6]]))


# ------------------------------------------------------------------ cache, padding


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_cache_equals_no_cache(positions, gen):
    model = _gpt(positions=positions, num_kv_heads=2)
    add_prefix(model, PrefixConfig(num_tokens=P))
    _randomise(model, gen)
    ids = torch.randint(0, 256, (2, 7), generator=gen)
    with torch.no_grad():
        full = model(ids)  # (B, N, V)
        cache = model.new_cache(2, 16)
        assert all(isinstance(c, PrefixKVCache) and c.length == 0 for c in cache)
        steps = [model(ids[:, :4], cache=cache)]
        steps += [model(ids[:, i:i + 1], cache=cache) for i in range(4, 7)]
        assert cache[0].length == 7 and cache[0].get()[0].shape[2] == P + 7
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
    cached = qkv.generate(model, ids, max_new_tokens=6)
    assert torch.equal(cached, qkv.generate(model, ids, max_new_tokens=6, use_cache=False))
    beams = qkv.generate(model, ids, max_new_tokens=4, num_beams=3)
    assert torch.equal(beams, qkv.generate(model, ids, max_new_tokens=4, num_beams=3,
                                           use_cache=False))


def test_prefix_changes_outputs_and_generation(gen):
    """The equalities above are not vacuous: the prefix moves logits and tokens."""
    model = _gpt()
    ids = torch.randint(0, 256, (2, 7), generator=gen)
    base, base_gen = model(ids), qkv.generate(model, ids, max_new_tokens=6)
    add_prefix(model, PrefixConfig(num_tokens=P))
    _randomise(model, gen, std=3.0)
    assert not torch.allclose(model(ids), base, atol=1e-2)
    assert not torch.equal(qkv.generate(model, ids, max_new_tokens=6), base_gen)


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_left_padded_row_equals_row_alone(positions, gen):
    model = _gpt(positions=positions)
    add_prefix(model, PrefixConfig(num_tokens=P))
    _randomise(model, gen)
    ids = torch.randint(1, 256, (3, 8), generator=gen)
    keep = torch.ones(3, 8, dtype=torch.bool)
    keep[0, :3] = False
    keep[2, :] = False  # a fully padded row: finite, and no effect on the others
    with torch.no_grad():
        batch = model(ids, attention_mask=keep)
        alone = model(ids[:1, 3:])
        other = model(ids[1:2])
    assert torch.isfinite(batch).all()
    torch.testing.assert_close(batch[0, 3:], alone[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(batch[1], other[0], atol=1e-5, rtol=0)
    out = qkv.generate(model, ids[:2], attention_mask=keep[:2], max_new_tokens=5)
    assert torch.equal(out[0, 3:], qkv.generate(model, ids[:1, 3:], max_new_tokens=5)[0])


def test_bert_padded_row_equals_row_alone(gen):
    model = BERT(BERTConfig.from_name("bert-tiny")).eval()
    add_prefix(model, PrefixConfig(num_tokens=P))
    _randomise(model, gen)
    ids = torch.randint(1, 1000, (2, 9), generator=gen)
    keep = torch.ones(2, 9, dtype=torch.long)
    keep[0, 5:] = 0
    with torch.no_grad():
        batch = model(ids, attention_mask=keep).last_hidden_state
        alone = model(ids[:1, :5]).last_hidden_state
    torch.testing.assert_close(batch[0, :5], alone[0], atol=1e-5, rtol=0)


def test_transformer_prefix_generate_and_count(gen):
    model = Transformer(TransformerConfig.from_name("transformer-tiny")).eval()
    add_prefix(model, PrefixConfig(num_tokens=P))
    _randomise(model, gen)
    trainable, _ = count_parameters(model)
    assert trainable == (2 + 2) * 2 * P * 32  # encoder + decoder self-attentions
    assert not isinstance(model.decoder_layers[0].cross_attn, PrefixAttention)
    src = torch.randint(1, 32, (2, 7), generator=gen)
    kw = {"max_new_tokens": 6, "decoder_start_token_id": 1}
    cached = qkv.generate(model, src, **kw)
    assert torch.equal(cached, qkv.generate(model, src, use_cache=False, **kw))


# ------------------------------------------------------------------ counts, training


def test_trainable_count_gpt_and_gqa():
    model = _gpt()
    _, total0 = count_parameters(model)
    add_prefix(model, PrefixConfig(num_tokens=5))
    trainable, total = count_parameters(model)
    assert trainable == 2 * 2 * 5 * 128  # layers x 2 x N x C
    assert total == total0 + trainable
    gqa = _gpt(num_kv_heads=2)
    add_prefix(gqa, PrefixConfig(num_tokens=5))
    assert count_parameters(gqa)[0] == 2 * 2 * 5 * (2 * 32)  # layers x 2 x N x Hkv·D


def test_trainable_count_equals_hf_peft():
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=64, n_layer=3, n_head=4, vocab_size=100, n_positions=32))
    theirs = peft.get_peft_model(hf, peft.PrefixTuningConfig(task_type="CAUSAL_LM",
                                                              num_virtual_tokens=7))
    want = sum(p.numel() for p in theirs.parameters() if p.requires_grad)
    ours = GPT(GPTConfig(vocab_size=100, max_len=32, dim=64, num_layers=3, num_heads=4))
    add_prefix(ours, PrefixConfig(num_tokens=7))
    assert count_parameters(ours)[0] == want


def test_frozen_base_trains_prefix_only(gen):
    model = _gpt()
    add_prefix(model, PrefixConfig(num_tokens=P))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    ids = torch.randint(0, 256, (2, 8), generator=gen)
    model.train()
    opt.zero_grad()
    model.loss(ids[:, :-1], ids[:, 1:]).backward()
    opt.step()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == (".prefixes." in name), name
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]) != (".prefixes." in k), k


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize("kwargs, match", [
    ({"num_tokens": 0}, "num_tokens"),
    ({"num_tokens": -1}, "num_tokens"),
    ({"num_tokens": 2.0}, "num_tokens"),
    ({"num_tokens": True}, "num_tokens"),
    ({"init_std": 0}, "init_std"),
    ({"init_std": 1e300}, "init_std"),  # overflowed fp32: the prefix was all inf
    ({"init_std": 10.5}, "init_std"),
    ({"init_std": float("nan")}, "init_std"),
])
def test_bad_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrefixConfig(**kwargs)


def test_init_std_bound_is_inclusive():
    assert PrefixConfig(init_std=10.0).init_std == 10.0


def test_bad_calls(gen):
    with pytest.raises(TypeError, match="PrefixConfig"):
        add_prefix(_gpt(), 4)
    with pytest.raises(ValueError, match="attention_window=4"):
        add_prefix(_gpt(attention_window=4), PrefixConfig(num_tokens=2))
    with pytest.raises(ValueError, match="LinearAttention"):
        add_prefix(_gpt(attention="linear"), PrefixConfig(num_tokens=2))
    with pytest.raises(ValueError, match="no qkv EncoderLayer"):
        add_prefix(torch.nn.Linear(2, 2), PrefixConfig(num_tokens=2))
    t5 = Transformer(TransformerConfig.from_name("transformer-tiny", positions="t5"))
    with pytest.raises(ValueError, match="encoder_bias"):
        add_prefix(t5, PrefixConfig(num_tokens=2))
    model = _gpt()
    add_prefix(model, PrefixConfig(num_tokens=2))
    with pytest.raises(ValueError, match="already has a prefix named 'default'"):
        add_prefix(model, PrefixConfig(num_tokens=2))
    ids = torch.randint(0, 256, (1, 4), generator=gen)
    plain = [KVCache(1, 4, 8, 32) for _ in range(2)]
    with torch.no_grad(), pytest.raises(ValueError, match="PrefixKVCache"):
        model(ids, cache=plain)
    attn = model.layers[0].attn
    with pytest.raises(ValueError, match="relative-position bias"):
        attn(torch.randn(1, 4, 128), bias=torch.zeros(1, 4, 4, 4))


def test_prefix_with_adapters_generate(gen):
    """Prefix + bottleneck adapters on one model: cached generation == uncached."""
    from qkv.peft.adapters import AdaptedSublayer, AdapterConfig, add_adapters

    model = _gpt(positions="rope")
    add_adapters(model, AdapterConfig(reduction_factor=8))
    add_prefix(model, PrefixConfig(num_tokens=P))
    _randomise(model, gen)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, AdaptedSublayer):
                for p in m.adapters.parameters():
                    p.normal_(0.0, 0.3, generator=gen)
    assert isinstance(model.layers[0].attn.base, PrefixAttention)
    ids = torch.randint(0, 256, (2, 6), generator=gen)
    cached = qkv.generate(model, ids, max_new_tokens=6)
    assert torch.equal(cached, qkv.generate(model, ids, max_new_tokens=6, use_cache=False))
    twin = copy.deepcopy(model)  # the wrappers survive a deep copy
    assert torch.equal(twin(ids), model(ids))
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names and all(".prefixes." in n for n in names)  # the last added trains
