"""qkv.models.Transformer (the encoder-decoder of Vaswani et al. 2017).

Shapes: B batch, S source length, N target length, C width, H heads, V vocab.

Oracles and equivalences: torch.nn.Transformer with copied weights (code nobody here
wrote); cached token-by-token decoding == the full forward; a batch row == the same row
alone; padded == unpadded; save -> load == same; a tiny model learns to copy.
Tolerance: fp32 atol/rtol 1e-5 (the issue's bar); "exact" means bit-equal.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from qkv.models.transformer import Transformer, TransformerConfig, TransformerOutput
from qkv.models.transformer_config import POSITIONS

FP32 = {"atol": 1e-5, "rtol": 1e-5}
V = 32  # transformer-tiny's vocabulary; ids 0, 1, 2 are pad, bos, eos


def tiny(**overrides) -> Transformer:
    cfg = TransformerConfig.from_name("transformer-tiny", **{"dropout": 0.0, **overrides})
    return Transformer(cfg).eval()


def tokens(b: int, n: int) -> torch.Tensor:
    """Random non-special ids (B, N) in [3, V)."""
    return torch.randint(3, V, (b, n))


def right_pad(ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    out = ids.clone()
    for row, n in enumerate(lengths):
        out[row, n:] = 0  # pad_id
    return out


def cached_logits(model: Transformer, src: torch.Tensor, tgt: torch.Tensor, *,
                  prefill: int = 1) -> torch.Tensor:
    """Decode ``tgt`` with the self-attention cache: ``prefill`` tokens at once, then one at
    a time; cross-attention keys/values computed once."""
    with torch.no_grad():
        memory, memory_mask = model.encode(src)
        kv = model.precompute_memory_kv(memory)
        cache = model.new_cache(tgt.shape[0], tgt.shape[1])
        outs = [model.decode(tgt[:, :prefill], memory_kv=kv, memory_mask=memory_mask,
                             cache=cache)]
        for i in range(prefill, tgt.shape[1]):
            outs.append(model.decode(tgt[:, i:i + 1], memory_kv=kv, memory_mask=memory_mask,
                                     cache=cache))
    return torch.cat(outs, dim=1)


def greedy(model: Transformer, src: torch.Tensor, steps: int, state=None):
    """A tiny greedy loop over the cache. ``state`` (from a previous call) continues it.

    Returns (generated ids (B, 1 + steps so far) starting with bos, state)."""
    with torch.no_grad():
        if state is None:
            memory, mask = model.encode(src)
            kv = model.precompute_memory_kv(memory)
            cache = model.new_cache(src.shape[0], 32)
            ys = torch.full((src.shape[0], 1), model.config.bos_id)
            nxt = ys
        else:
            ys, kv, mask, cache, nxt = state
        for _ in range(steps):
            logits = model.decode(nxt, memory_kv=kv, memory_mask=mask, cache=cache)
            nxt = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
            ys = torch.cat([ys, nxt], dim=1)
    return ys, (ys, kv, mask, cache, nxt)


def greedy_no_cache(model: Transformer, src: torch.Tensor, steps: int) -> torch.Tensor:
    ys = torch.full((src.shape[0], 1), model.config.bos_id)
    with torch.no_grad():
        for _ in range(steps):
            ys = torch.cat([ys, model(src, ys)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ys


# ------------------------------------------------------------------ torch.nn.Transformer


def _torch_transformer(norm_first: bool, activation: str, bias: bool = True) -> nn.Transformer:
    m = nn.Transformer(d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=3,
                       dim_feedforward=48, dropout=0.0, activation=activation,
                       batch_first=True, norm_first=norm_first, bias=bias)
    with torch.no_grad():  # random values everywhere, norms included
        for name, p in m.named_parameters():
            centre = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            p.copy_(centre + 0.3 * torch.randn_like(p))
    return m.eval()


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True])
def test_from_torch_reproduces_nn_transformer(norm_first, activation):
    """With source/target/memory padding and the causal mask; torch runs its eval fast
    paths (nested tensors in the post-norm encoder) under no_grad."""
    m = _torch_transformer(norm_first, activation)
    ours = Transformer.from_torch(m, src_vocab_size=V, tgt_vocab_size=V)
    assert ours.config.final_norm and ours.config.norm_first == norm_first
    assert ours.config.activation == activation and not ours.training
    b, s, n = 3, 9, 6
    src, tgt = torch.randn(b, s, 32), torch.randn(b, n, 32)
    src_keep = torch.arange(s)[None] < torch.tensor([9, 5, 2])[:, None]
    tgt_keep = torch.arange(n)[None] < torch.tensor([6, 6, 3])[:, None]
    causal = torch.ones(n, n, dtype=torch.bool).triu(1)  # torch: True = may not attend
    with torch.no_grad():
        want = m(src, tgt, tgt_mask=causal, tgt_is_causal=True,
                 src_key_padding_mask=~src_keep, memory_key_padding_mask=~src_keep,
                 tgt_key_padding_mask=~tgt_keep)
        got = ours.forward_embeddings(src, tgt, src_mask=src_keep, tgt_mask=tgt_keep)
    torch.testing.assert_close(got, want, **FP32)


def test_from_torch_gradients_and_no_bias():
    """Slow path (grad enabled), bias=False layers: outputs and input gradients."""
    m = _torch_transformer(True, "gelu", bias=False)
    ours = Transformer.from_torch(m)
    assert not ours.config.bias and ours.config.src_vocab_size == 3
    src1, tgt1 = torch.randn(2, 7, 32, requires_grad=True), torch.randn(2, 4, 32,
                                                                       requires_grad=True)
    src2, tgt2 = (t.detach().clone().requires_grad_() for t in (src1, tgt1))
    keep = torch.tensor([[True] * 7, [True] * 3 + [False] * 4])
    want = m(src1, tgt1, tgt_mask=nn.Transformer.generate_square_subsequent_mask(4),
             src_key_padding_mask=~keep, memory_key_padding_mask=~keep)
    got = ours.forward_embeddings(src2, tgt2, src_mask=keep)
    torch.testing.assert_close(got, want, **FP32)
    g = torch.randn_like(want)
    want.backward(g)
    got.backward(g)
    torch.testing.assert_close(src2.grad, src1.grad, **FP32)
    torch.testing.assert_close(tgt2.grad, tgt1.grad, **FP32)


def test_from_torch_refuses_other_modules():
    with pytest.raises(TypeError, match=r"torch\.nn\.Transformer"):
        Transformer.from_torch(nn.Linear(2, 2))


def test_forward_is_the_paper_embedding_then_the_stacks():
    """forward == lm_head(stacks(embedding · sqrt(C) + PE)) with the paper's sinusoid
    PE[pos, 2i] = sin(pos / 10000^(2i/C)), PE[pos, 2i+1] = cos(...), written out here."""
    model = tiny()
    src, tgt = right_pad(tokens(2, 6), [6, 3]), tokens(2, 4)
    c = model.config.dim

    def pe(n):
        pos = torch.arange(n, dtype=torch.float64)[:, None]
        angle = pos / 10000 ** (torch.arange(0, c, 2, dtype=torch.float64) / c)
        return torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(1).float()  # (n, C)

    with torch.no_grad():
        src_emb = model.src_embed(src) * c ** 0.5 + pe(6)
        tgt_emb = model.tgt_embed(tgt) * c ** 0.5 + pe(4)
        want = model.lm_head(model.forward_embeddings(src_emb, tgt_emb, src_mask=src != 0))
        torch.testing.assert_close(model(src, tgt), want, **FP32)
    assert model.lm_head.weight is model.tgt_embed.weight  # tie_output (the paper)
    assert (model.src_embed.weight[0] == 0).all()  # the pad row


# ------------------------------------------------------------------ cache and positions


@pytest.mark.parametrize("positions", POSITIONS)
def test_every_position_scheme_trains_and_cache_decodes(positions):
    """forward + backward; cached decoding (prefill 3, then single steps) == the full
    forward at 1e-5 with a padded source. For the relative producers this checks that a
    decode step (N=1 query, L+1 keys) gets bottom-right relative distances."""
    model = tiny(positions=positions)
    src = right_pad(tokens(2, 9), [9, 6])
    tgt = tokens(2, 7)
    model.train()
    logits = model(src, tgt)
    logits.logsumexp(-1).sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    if positions in ("learned", "t5", "shaw"):
        extra = {"learned": lambda: model.tgt_positions.weight,
                 "t5": lambda: model.decoder_bias.embedding.weight,
                 "shaw": lambda: model.decoder_bias[0].key_embedding}[positions]()
        assert extra.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad():
        full = model(src, tgt)
    torch.testing.assert_close(cached_logits(model, src, tgt, prefill=3), full, **FP32)
    torch.testing.assert_close(cached_logits(model, src, tgt, prefill=1), full, **FP32)


@pytest.mark.parametrize("positions", ["alibi", "t5", "shaw"])
def test_cached_step_attention_equals_full_row(positions):
    """The decoder self-attention weights of cached step t (1 query, t+1 keys) equal row t
    of the full forward's weights: the relative distances agree."""
    model = tiny(positions=positions)
    src, tgt = tokens(2, 5), tokens(2, 6)
    with torch.no_grad():
        full = model(src, tgt, output_attentions=True)
        memory, mask = model.encode(src)
        cache = model.new_cache(2, 8)
        for t in range(tgt.shape[1]):
            step = model.decode(tgt[:, t:t + 1], memory, memory_mask=mask, cache=cache,
                                output_attentions=True)
            for w_step, w_full in zip(step.decoder_self_attentions,
                                      full.decoder_self_attentions, strict=True):
                assert w_step.shape == (2, 4, 1, t + 1)
                torch.testing.assert_close(w_step[:, :, 0], w_full[:, :, t, :t + 1], **FP32)


def test_greedy_continue_equals_one_run():
    """greedy(n) == greedy(n-1) then one more step from the cache; == greedy without cache."""
    model = tiny(positions="sinusoidal")
    src = right_pad(tokens(3, 8), [8, 5, 3])
    n = 6
    whole, _ = greedy(model, src, n)
    part, state = greedy(model, src, n - 1)
    assert torch.equal(part, whole[:, :n])
    cont, _ = greedy(model, src, 1, state)
    assert torch.equal(cont, whole)
    assert torch.equal(greedy_no_cache(model, src, n), whole)


def test_cache_with_left_padded_target_prefix():
    """A left-padded target prefix (tgt_mask over every position so far) decodes like the
    unpadded one, with and without the cache."""
    model = tiny(positions="learned")
    src, tgt = tokens(1, 6), tokens(1, 5)
    padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), tgt], dim=1)  # 2 pads first
    keep = padded != 0
    with torch.no_grad():
        want = model(src, tgt)
        got = model(src, padded, tgt_mask=keep)[:, 2:]
        memory, mask = model.encode(src)
        cache = model.new_cache(1, 8)
        outs = [model.decode(padded[:, :4], memory, memory_mask=mask, cache=cache,
                             tgt_mask=keep[:, :4])]
        outs.append(model.decode(padded[:, 4:], memory, memory_mask=mask, cache=cache,
                                 tgt_mask=keep))
    torch.testing.assert_close(got, want, **FP32)
    torch.testing.assert_close(torch.cat(outs, dim=1)[:, 2:], want, **FP32)


# ------------------------------------------------------------- batch, padding, determinism


@pytest.mark.parametrize("positions", ["sinusoidal", "t5"])
def test_batch_row_equals_single_run(positions):
    model = tiny(positions=positions)
    lengths = [9, 4, 7]
    src, tgt = right_pad(tokens(3, 9), lengths), tokens(3, 5)
    with torch.no_grad():
        batch = model(src, tgt)
        for row, n in enumerate(lengths):
            alone = model(src[row:row + 1, :n], tgt[row:row + 1])
            torch.testing.assert_close(batch[row:row + 1], alone, **FP32)


@pytest.mark.parametrize("positions", POSITIONS)
def test_padded_equals_unpadded(positions):
    """Right padding (derived from pad_id, or given as lengths/mask) and left padding (given
    as a mask; absolute positions count from the first real token) == the unpadded run."""
    model = tiny(positions=positions)
    src, tgt = tokens(1, 5), tokens(1, 4)
    right = torch.cat([src, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    left = torch.cat([torch.zeros(1, 3, dtype=torch.long), src], dim=1)
    with torch.no_grad():
        want = model(src, tgt)
        torch.testing.assert_close(model(right, tgt), want, **FP32)
        torch.testing.assert_close(model(right, tgt, src_lengths=torch.tensor([5])), want,
                                   **FP32)
        torch.testing.assert_close(model(left, tgt, src_mask=left != 0), want, **FP32)
        # target padding: right padding with lengths leaves the real positions unchanged
        tgt_right = torch.cat([tgt, torch.zeros(1, 2, dtype=torch.long)], dim=1)
        got = model(src, tgt_right, tgt_lengths=torch.tensor([4]))[:, :4]
        torch.testing.assert_close(got, want, **FP32)


def test_two_eval_forwards_identical_and_dropout_in_training():
    model = tiny(dropout=0.1)
    src, tgt = tokens(2, 6), tokens(2, 4)
    with torch.no_grad():
        assert torch.equal(model(src, tgt), model(src, tgt))
        model.train()
        assert not torch.equal(model(src, tgt), model(src, tgt))


def test_output_attentions():
    model = tiny()
    src, tgt = right_pad(tokens(2, 7), [7, 4]), tokens(2, 5)
    out = model(src, tgt, output_attentions=True)
    assert isinstance(out, TransformerOutput)
    torch.testing.assert_close(out.logits, model(src, tgt), atol=0, rtol=0)
    c = model.config
    assert len(out.encoder_attentions) == c.num_encoder_layers
    assert len(out.decoder_self_attentions) == len(out.cross_attentions) == c.num_decoder_layers
    for w in out.encoder_attentions:
        assert w.shape == (2, 4, 7, 7)
        assert (w[1, :, :, 4:] == 0).all()
    for w in out.decoder_self_attentions:
        assert w.shape == (2, 4, 5, 5) and (w.triu(1) == 0).all()
    for w in out.cross_attentions:
        assert w.shape == (2, 4, 5, 7) and (w[1, :, :, 4:] == 0).all()
    for w in out.encoder_attentions + out.decoder_self_attentions + out.cross_attentions:
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]), **FP32)


# ---------------------------------------------------------------------- save / load


@pytest.mark.parametrize("shared", [True, False])
def test_save_load_round_trip(tmp_path, shared):
    model = tiny(positions="t5", share_embeddings=shared, tie_output=shared)
    with torch.no_grad():  # make the trained-looking weights differ from a fresh init
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qkv-transformer" and config["positions"] == "t5"
    assert ("lm_head.weight" in stored) != shared and ("tgt_embed.weight" in stored) != shared
    loaded = Transformer.from_pretrained(tmp_path).eval()
    assert loaded.config == model.config
    assert (loaded.lm_head.weight is loaded.tgt_embed.weight) == shared
    assert (loaded.src_embed is loaded.tgt_embed) == shared
    want, got = model.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    src, tgt = tokens(2, 6), tokens(2, 4)
    with torch.no_grad():
        assert torch.equal(loaded(src, tgt), model(src, tgt))


def test_load_refuses_mismatched_checkpoint(tmp_path):
    """A checkpoint whose tensors do not fit the config gives a clean CheckpointError
    naming the keys (Checklist 28); nothing is loaded."""
    from qkv.models.hub import CheckpointError

    tiny(positions="t5").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["positions"] = "sinusoidal"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"unexpected keys.*encoder_bias"):
        Transformer.from_pretrained(tmp_path)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_finite(dtype):
    """fp16/bf16 parameters: forward and cached decoding are finite and keep the dtype."""
    model = tiny(positions="alibi").to(dtype)
    src, tgt = right_pad(tokens(2, 6), [6, 4]), tokens(2, 5)
    with torch.no_grad():
        logits = model(src, tgt)
        steps = cached_logits(model, src, tgt)
    assert logits.dtype == dtype and torch.isfinite(logits).all()
    assert steps.dtype == dtype and torch.isfinite(steps).all()
    assert model.new_cache(2, 4)[0].dtype == dtype


# ---------------------------------------------------------------------------- training


def test_tiny_model_learns_to_copy():
    """A tiny model overfits a tiny copy task: after 200 Adam steps greedy decoding
    reproduces every source sequence (then eos)."""
    torch.manual_seed(0)
    model = tiny(dim=32, num_heads=4, ffn_hidden=64, num_encoder_layers=1,
                 num_decoder_layers=1)
    model.train()
    src = torch.randint(3, 13, (16, 5))
    bos = torch.full((16, 1), 1)
    eos = torch.full((16, 1), 2)
    tgt_in, tgt_out = torch.cat([bos, src], 1), torch.cat([src, eos], 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    # Tiny ops: one intra-op thread is fastest, and immune to the 20-40x slowdown that a
    # 2-thread OpenMP pool shows when other processes load the CPUs.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(200):
            loss = nn.functional.cross_entropy(model(src, tgt_in).flatten(0, 1),
                                               tgt_out.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    model.eval()
    ys, _ = greedy(model, src, 6)
    assert torch.equal(ys[:, 1:], tgt_out), f"loss {loss.item():.3f}"


# ------------------------------------------------------------------------------ presets


def test_presets_match_the_paper():
    base = TransformerConfig.from_name("vaswani-base")
    big = TransformerConfig.from_name("vaswani-big")
    assert (base.dim, base.num_encoder_layers, base.num_decoder_layers, base.num_heads,
            base.ffn_hidden, base.dropout) == (512, 6, 6, 8, 2048, 0.1)
    assert (big.dim, big.num_heads, big.ffn_hidden, big.dropout) == (1024, 16, 4096, 0.3)
    assert not base.norm_first and not base.final_norm and base.positions == "sinusoidal"
    assert base.tie_output and base.share_embeddings and base.scale_embeddings

    def count(cfg):
        return sum(p.numel() for p in Transformer(cfg, device="meta").parameters())

    # The paper's Table 3: base 65M, big 213M parameters (shared 37k vocabulary).
    assert 60e6 < count(base) < 66e6
    assert 205e6 < count(big) < 215e6
    for name in ("transformer-tiny", "transformer-small"):
        cfg = TransformerConfig.from_name(name)
        assert TransformerConfig.from_dict(cfg.to_dict()) == cfg
    assert TransformerConfig.from_name("transformer-tiny", norm_first=True).final_norm


# --------------------------------------------------------------------------- bad input


def test_bad_inputs_raise_clear_errors():
    model = tiny(positions="sinusoidal")  # max_len 64
    src, tgt = tokens(2, 5), tokens(2, 4)
    with pytest.raises(ValueError, match=r"src holds token id 32, outside \[0, 32\)"):
        model(src.clone().fill_(32), tgt)
    with pytest.raises(ValueError, match="tgt holds token id -1"):
        model(src, tgt.clone().fill_(-1))
    with pytest.raises(TypeError, match="integer tensor"):
        model(src.float(), tgt)
    with pytest.raises(ValueError, match="batch sizes differ"):
        model(src, tokens(3, 4))
    with pytest.raises(ValueError, match="max_len=64"):
        model(tokens(1, 65), tokens(1, 4))
    with pytest.raises(ValueError, match="max_len=64"):
        model(tokens(1, 5), tokens(1, 65))
    with pytest.raises(ValueError, match="max_len=64"):
        tiny(positions="learned")(tokens(1, 65), tokens(1, 4))
    with pytest.raises(ValueError, match="src_lengths must be an integer tensor"):
        model(src, tgt, src_lengths=torch.tensor([5, 5, 5]))
    with pytest.raises(ValueError, match=r"src_lengths must lie in \[0, 5\]"):
        model(src, tgt, src_lengths=torch.tensor([6, 5]))
    with pytest.raises(ValueError, match="not both"):
        model(src, tgt, src_lengths=torch.tensor([5, 5]), src_mask=src != 0)
    with pytest.raises(ValueError, match="src_mask must be a bool tensor"):
        model(src, tgt, src_mask=torch.ones(2, 4, dtype=torch.bool))
    memory, _ = model.encode(src)
    with pytest.raises(ValueError, match="memory must be"):
        model.decode(tokens(3, 2), memory)
    with pytest.raises(ValueError, match="exactly one"):
        model.decode(tgt, memory, memory_kv=model.precompute_memory_kv(memory))
    with pytest.raises(ValueError, match="cache has batch"):
        model.decode(tgt, memory, cache=model.new_cache(3, 8))
    with torch.no_grad():  # a cache cannot take the decoder past max_len either
        cache = model.new_cache(1, 80)
        model.decode(tokens(1, 60), memory[:1], cache=cache)
        with pytest.raises(ValueError, match="max_len=64"):
            model.decode(tokens(1, 5), memory[:1], cache=cache)
    with torch.no_grad(), pytest.raises(ValueError, match="capacity"):
        cache = model.new_cache(2, 3)  # a write past the cache's capacity
        model.decode(tokens(2, 4), memory, cache=cache)
    with pytest.raises(ValueError, match="forward_embeddings: batch sizes differ"):
        model.forward_embeddings(torch.randn(2, 5, 32), torch.randn(3, 4, 32))


def test_bad_configs_raise_clear_errors():
    with pytest.raises(ValueError, match="share_embeddings needs equal vocabularies"):
        TransformerConfig(src_vocab_size=10, tgt_vocab_size=12, share_embeddings=True)
    with pytest.raises(ValueError, match="positions must be one of"):
        TransformerConfig(src_vocab_size=10, tgt_vocab_size=10, positions="rope")
    with pytest.raises(ValueError, match="pad_id"):
        TransformerConfig(src_vocab_size=10, tgt_vocab_size=10, pad_id=10)
    with pytest.raises(ValueError, match="divisible"):
        TransformerConfig(src_vocab_size=10, tgt_vocab_size=10, dim=30, num_heads=4)
    with pytest.raises(ValueError, match="unknown config fields"):
        TransformerConfig.from_name("transformer-tiny", d_model=3)
    with pytest.raises(TypeError, match="TransformerConfig"):
        Transformer({"src_vocab_size": 10})
