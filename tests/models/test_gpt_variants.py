"""GPT attention variants: sliding-window attention (``attention_window``) and linear
attention (``attention="linear"``), training, cached generation, padding, save/load, config.

Shapes: B batch, N length, S key length, V vocab, C width, H heads, L layers, W window.

Oracles: the window model's full forward against the same layers run with the band as a
dense bool mask (an independent mask path: no SlidingWindow, no sparse backend); cached
decoding against the model's full forward; padded rows against the row run alone.
Tolerances: fp32 logits atol/rtol 1e-5 (logits O(1): weights are perturbed so that a
wrong key changes them by far more); save/load exact (torch.equal).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import qkv.ops.chunked as chunked
from qkv.models.gpt import GPT, GPTConfig
from qkv.modules.cache import KVCache, LinearCache, WindowKVCache
from qkv.modules.linear_attention import LinearAttention
from qkv.modules.positions import positions_from_mask

FP32 = {"atol": 1e-5, "rtol": 1e-5}
VOCAB = 61


def _tiny(**kw) -> GPT:
    cfg = GPTConfig(**{"vocab_size": VOCAB, "max_len": 64, "dim": 32, "num_layers": 2,
                       "num_heads": 4, **kw})
    model = GPT(cfg)
    with torch.no_grad():  # O(1) logits, sensitive to every attended key
        for p in model.parameters():
            p.add_(0.15 * torch.randn_like(p))
    return model.eval()


def _band(n: int, w: int) -> torch.Tensor:
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return (j <= i) & (i - j < w)  # (N, N)


def _band_forward(model: GPT, ids, keep=None):
    """The layers with a dense bool band mask (independent of SlidingWindow)."""
    n = ids.shape[1]
    pos = torch.arange(n) if keep is None else positions_from_mask(keep)
    x = model.embed(ids)
    if model.positions is not None:
        x = model.positions(x, pos)
    mask = _band(n, model.config.attention_window)[None, None]  # (1, 1, N, N)
    if keep is not None:
        mask = mask & keep[:, None, None, :]
    for layer in model.layers:
        x = layer(x, mask=mask, positions=pos if model.rope is not None else None)
    return model.lm_head(model.norm(x))


def _left_pad(rows):
    n = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, n - len(r):] = r
        mask[i, n - len(r):] = 1
    return ids, mask


def _decode(model, ids, chunks, mask=None, capacity=None):
    """Feed ``ids`` through a fresh cache in ``chunks``; the logits (B, N, V) and the cache."""
    cache = model.new_cache(ids.shape[0], capacity or ids.shape[1])
    outs, t = [], 0
    for c in chunks:
        am = None if mask is None else mask[:, :t + c]
        outs.append(model(ids[:, t:t + c], attention_mask=am, cache=cache))
        t += c
    assert t == ids.shape[1]
    return torch.cat(outs, dim=1), cache


# ------------------------------------------------------------------------- sliding window


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_window_forward_equals_dense_band_oracle(positions):
    model = _tiny(attention_window=5, positions=positions)
    rows = [torch.randint(0, VOCAB, (n,)) for n in (40, 29)]
    ids, mask = _left_pad(rows)
    with torch.no_grad():
        torch.testing.assert_close(model(ids[:1]), _band_forward(model, ids[:1]), **FP32)
        got = model(ids, attention_mask=mask)
        torch.testing.assert_close(got[1, 11:], _band_forward(model, ids, mask.bool())[1, 11:],
                                   **FP32)
        alone = model(rows[1][None])[0]  # padded row == row alone
        torch.testing.assert_close(got[1, 11:], alone, **FP32)
        full_causal = GPT(dataclasses.replace(model.config, attention_window=None))
        full_causal.load_state_dict(model.state_dict())
        full_causal.eval()
        assert torch.equal(full_causal(ids[:, :5]), model(ids[:, :5]))  # N <= W: no effect
        assert not torch.allclose(full_causal(ids), model(ids), atol=1e-2)  # N > W: a window


def test_window_long_sequence_uses_sparse_path_with_gradients(monkeypatch):
    calls = []
    real = chunked.window_attention
    monkeypatch.setattr(chunked, "window_attention",
                        lambda *a, **k: calls.append(k["window"].window) or real(*a, **k))
    model = _tiny(attention_window=64, positions="rope", num_layers=1).train()
    ids = torch.randint(0, VOCAB, (1, 1100))
    targets = torch.randint(0, VOCAB, (1, 1100))
    loss = model.loss(ids, targets)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    assert calls == [64]  # the band path served the layer
    want = torch.nn.functional.cross_entropy(_band_forward(model, ids)[0], targets[0])
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    torch.testing.assert_close(loss, want, **FP32)
    for g, w in zip(grads, want_grads, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("positions,n", [("learned", 40), ("rope", 60)])
@pytest.mark.parametrize("chunks", ["tokens", "mixed"])
def test_window_cached_generation_equals_full_forward(positions, n, chunks):
    model = _tiny(attention_window=4, positions=positions, num_kv_heads=2)
    ids = torch.randint(0, VOCAB, (2, n))
    sizes = [1] * n if chunks == "tokens" else [7, 1, 1, 13, 1, 2] + [1] * (n - 25)
    with torch.no_grad():
        full = model(ids)
        got, cache = _decode(model, ids, sizes, capacity=n + 10)
    torch.testing.assert_close(got, full, **FP32)
    assert all(isinstance(c, WindowKVCache) and c.length == n and c.kept == 3 for c in cache)


def test_window_left_padded_generation_equals_rows_alone():
    model = _tiny(attention_window=4, positions="rope")
    rows = [torch.randint(0, VOCAB, (n,)) for n in (9, 3)]
    ids, mask = _left_pad(rows)
    steps = 25
    with torch.no_grad():  # greedy, the way qkv's generation helper drives a model
        cache = model.new_cache(2, ids.shape[1] + steps)
        logits = model(ids, attention_mask=mask, cache=cache)
        seq, out = ids, [logits[:, -1]]
        for _ in range(steps):
            nxt = out[-1].argmax(-1, keepdim=True)  # (B, 1)
            seq = torch.cat([seq, nxt], dim=1)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            out.append(model(nxt, attention_mask=mask, cache=cache)[:, -1])
        for i, r in enumerate(rows):
            alone = model(seq[i, 9 - len(r):][None])[0, len(r) - 1:]  # (steps + 1, V)
            torch.testing.assert_close(torch.stack([o[i] for o in out]), alone, **FP32)


def test_window_cache_memory_stays_at_the_window():
    model = _tiny(attention_window=6, positions="rope", num_kv_heads=2)
    cache = model.new_cache(1, 500)  # capacity may exceed the window
    per_layer = 2 * 1 * 2 * 5 * 8 * 4  # k+v, B, Hkv, W-1, D, fp32 bytes
    with torch.no_grad():
        x = torch.randint(0, VOCAB, (1, 20))
        model(x, cache=cache)
        for _ in range(180):
            x = model(x[:, -1:], cache=cache)[:, -1:].argmax(-1)
            assert [c.nbytes for c in cache] == [per_layer] * 2
    assert cache[0].length == 200 and cache[0].keys.shape == (1, 2, 5, 8)


def test_window_attention_weights_are_banded():
    model = _tiny(attention_window=3)
    with torch.no_grad():
        out = model(torch.randint(0, VOCAB, (1, 9)), output_attentions=True)
    for w in out.attentions:
        assert torch.equal(w != 0, _band(9, 3).expand_as(w))


def test_cache_kind_must_match_the_config():
    window = _tiny(attention_window=4)
    plain = _tiny()
    ids = torch.randint(0, VOCAB, (1, 3))
    with torch.no_grad():
        # a plain KVCache keeps every key: a windowed model takes it (the window is then
        # its mask's) and computes what its window caches compute
        long_ids = torch.randint(0, VOCAB, (1, 7))
        full = window(long_ids)
        step_cache = plain.new_cache(1, 8)
        got = torch.cat([window(long_ids[:, :3], cache=step_cache)]
                        + [window(long_ids[:, t:t + 1], cache=step_cache) for t in range(3, 7)],
                        dim=1)
        torch.testing.assert_close(got, full, rtol=0, atol=1e-5 * full.abs().max().item())
        with pytest.raises(TypeError, match="KVCaches from new_cache"):
            plain(ids, cache=window.new_cache(1, 8))
        with pytest.raises(TypeError, match="WindowKVCaches"):
            window(ids, cache=_tiny(attention_window=5).new_cache(1, 8))
        with pytest.raises(TypeError, match="LinearCaches"):
            _tiny(attention="linear")(ids, cache=plain.new_cache(1, 8))
    assert type(plain.new_cache(1, 8)[0]) is KVCache


# ------------------------------------------------------------------------------- linear


@pytest.mark.parametrize("kw", [
    {"positions": "learned"},
    {"positions": "rope", "num_kv_heads": 2},
    {"positions": "rope", "feature_map": "favor", "num_features": 24},
])
def test_linear_cached_decode_equals_full_forward(kw):
    model = _tiny(attention="linear", **kw)
    ids = torch.randint(0, VOCAB, (2, 30))
    with torch.no_grad():
        full = model(ids)
        tokens, cache = _decode(model, ids, [1] * 30)
        mixed, _ = _decode(model, ids, [6, 1, 1, 15, 7])
    torch.testing.assert_close(tokens, full, **FP32)
    torch.testing.assert_close(mixed, full, **FP32)
    assert all(isinstance(c, LinearCache) and c.length == 30 for c in cache)
    assert all(isinstance(layer.attn, LinearAttention) for layer in model.layers)


@pytest.mark.parametrize("feature_map", ["elu", "favor"])
def test_linear_left_padded_generation_equals_rows_alone(feature_map):
    model = _tiny(attention="linear", feature_map=feature_map, positions="rope")
    rows = [torch.randint(0, VOCAB, (n,)) for n in (8, 3)]
    ids, mask = _left_pad(rows)
    nxt = torch.randint(0, VOCAB, (2, 4))
    with torch.no_grad():
        cache = model.new_cache(2, 12)
        first = model(ids, attention_mask=mask, cache=cache)
        steps = []
        for t in range(4):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
            steps.append(model(nxt[:, t:t + 1], attention_mask=mask, cache=cache))
        got = torch.cat([first, *steps], dim=1)
        for i, r in enumerate(rows):
            alone = model(torch.cat([r, nxt[i]])[None])[0]
            torch.testing.assert_close(got[i, 8 - len(r):], alone, **FP32)


def test_linear_cache_is_constant_size():
    model = _tiny(attention="linear", positions="rope")
    cache = model.new_cache(1, 300)
    with torch.no_grad():
        x = torch.randint(0, VOCAB, (1, 10))
        model(x, cache=cache)
        size = [c.nbytes for c in cache]
        for _ in range(100):
            x = model(x[:, -1:], cache=cache)[:, -1:].argmax(-1)
    assert [c.nbytes for c in cache] == size == [(4 * 8 * 8 + 4 * 8) * 4] * 2


def test_linear_gradients_finite_and_tiny_model_overfits():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=16, max_len=32, dim=32, num_layers=2, num_heads=4,
                          attention="linear")).train()
    ids = torch.randint(0, 16, (4, 17))
    x, y = ids[:, :-1], ids[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for step in range(60):
        loss = model.loss(x, y)
        opt.zero_grad()
        loss.backward()
        if step == 0:
            first = loss.item()
            for name, p in model.named_parameters():
                assert p.grad is not None and torch.isfinite(p.grad).all(), name
        opt.step()
    assert first > 2.5 and loss.item() < 0.15, (first, loss.item())  # measured 2.79 -> 0.055


@pytest.mark.parametrize("kw", [{"attention": "linear", "feature_map": "favor"},
                                {"attention_window": 7, "positions": "rope"}])
def test_save_load_keeps_the_variant(tmp_path, kw):
    model = _tiny(**kw)
    model.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    assert all(data[k] == v for k, v in kw.items())
    loaded = GPT.from_pretrained(tmp_path).eval()
    assert loaded.config == model.config
    ids = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_config_round_trip_and_overrides():
    cfg = GPTConfig.from_name("gpt-tiny", attention="linear", feature_map="favor",
                              num_features=32)
    assert GPTConfig.from_dict(cfg.to_dict()) == cfg
    win = dataclasses.replace(GPTConfig.from_name("gpt-tiny"), attention_window=16)
    assert GPTConfig.from_dict(json.loads(json.dumps(win.to_dict()))) == win
    assert GPTConfig.from_name("gpt-tiny").attention == "softmax"


@pytest.mark.parametrize("kw,match", [
    ({"attention": "flash"}, "attention must be 'softmax' or 'linear', got 'flash'"),
    ({"attention_window": 0}, "attention_window must be a positive int or None, got 0"),
    ({"attention_window": -3}, "attention_window must be a positive int"),
    ({"attention_window": True}, "attention_window must be a positive int"),
    ({"attention": "linear", "attention_window": 8}, "attention_window=8 is for softmax"),
    ({"attention": "linear", "feature_map": "relu"}, "feature_map must be 'elu' or 'favor'"),
    ({"attention": "linear", "num_features": 16}, "num_features=16 is for feature_map='favor'"),
    ({"attention": "linear", "num_features": 0}, "num_features must be a positive int"),
    ({"feature_map": "favor"}, "are for attention='linear'"),
    ({"attention": "linear", "attn_dropout": 0.1}, "attn_dropout=0.1"),
])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig.from_name("gpt-tiny", **kw)
