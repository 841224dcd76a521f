"""HF T5 / T5 v1.1 / Flan-T5 -> ``qkv.models.Transformer`` (``qkv.models.hf_t5.T5``), against
transformers' own ``T5ForConditionalGeneration`` built from tiny configs with random weights
(tests/models/_hf_t5.py), eager attention, fp32, saved with ``save_pretrained`` and loaded with
``load_hf(T5, Transformer, dir)``.

Tolerances: logits within 1e-5 of the logits' scale (max |logit|), encoder outputs within
1e-5 of theirs, attention probabilities within 1e-5 absolute (fp32, the same math in another
order); tokens of greedy and beam search exactly equal (peaked random weights: no ties).
The sources are right-padded (20, 13 and 6 real tokens) and longer than
relative_attention_max_distance (8 and 10), so the saturated buckets are exercised.
"""

from __future__ import annotations

import json
import warnings
from collections import Counter

import pytest
import torch
from _hf_t5 import EOS, PAD, START, VARIANTS, hf_t5, padded_sources, save_hf

import qkv
from qkv.files import CheckpointError
from qkv.models import Transformer
from qkv.models.hf_load import load_hf
from qkv.models.hf_t5 import T5, T5_FIELDS, t5_ffn, t5_key_map

transformers = pytest.importorskip("transformers")

NAMES = tuple(VARIANTS)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """name -> (HF model, the qkv Transformer loaded from its saved directory, the dir)."""
    out = {}
    for name in NAMES:
        hf = hf_t5(name)
        d = save_hf(hf, tmp_path_factory.mktemp(name))
        out[name] = (hf, load_hf(T5, Transformer, d), d)
    return out


def _target(batch: int = 3, length: int = 12, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tgt = torch.randint(2, VARIANTS["t5-v1.0"]["vocab_size"], (batch, length), generator=g)
    tgt[:, 0] = START
    return tgt


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= rel * scale, f"max error {err:.3g} > {rel:g} x scale {scale:.3g}"


def test_config_of_each_variant(pairs):
    v10, flan = pairs["t5-v1.0"][1].config, pairs["flan-t5"][1].config
    assert (v10.tie_output, v10.head_scale, v10.activation, v10.attention_head_dim) == (
        True, 16 ** -0.5, "relu", None)
    assert (flan.tie_output, flan.head_scale, flan.activation, flan.attention_head_dim) == (
        False, 1.0, "geglu_tanh", 8)
    for c in (v10, flan):
        assert (c.norm, c.norm_first, c.final_norm, c.bias, c.scale_embeddings,
                c.share_embeddings, c.positions, c.attention_scale) == (
            "rmsnorm", True, True, False, False, True, "t5", 1.0)
        assert (c.pad_id, c.eos_id, c.bos_id, c.max_len) == (PAD, EOS, START, 512)
        assert (c.num_encoder_layers, c.num_decoder_layers) == (2, 3)


@pytest.mark.parametrize("name", NAMES)
def test_logits_and_encoder_equal_hf_on_padded_sources(pairs, name):
    hf, model, _ = pairs[name]
    src, mask = padded_sources()
    tgt = _target()
    with torch.no_grad():
        want = hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt)
        got = model(src, tgt, src_mask=mask.bool())
        memory, keep = model.encode(src, src_mask=mask.bool())
    _close(got, want.logits)
    real = mask.bool()
    assert torch.equal(keep, real)
    _close(memory[real], want.encoder_last_hidden_state[real])


@pytest.mark.parametrize("name", NAMES)
def test_legacy_config_loads_the_same_model(pairs, tmp_path, name):
    """A transformers 4.x config.json (tie_word_embeddings saying the head's kind, Flan-T5's
    old fields) loads the model the 5.x one does, without warnings."""
    hf, model, _ = pairs[name]
    d = save_hf(hf, tmp_path / "legacy", legacy=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        legacy = load_hf(T5, Transformer, d)
    assert legacy.config == model.config
    own = model.state_dict()
    for key, t in legacy.state_dict().items():
        assert torch.equal(t, own[key]), key


@pytest.mark.parametrize("name", NAMES)
def test_cached_decoding_equals_full_forward(pairs, name):
    _, model, _ = pairs[name]
    src, mask = padded_sources()
    tgt = _target(length=14)
    with torch.no_grad():
        full = model(src, tgt, src_mask=mask.bool())
        memory, keep = model.encode(src, src_mask=mask.bool())
        kv = model.precompute_memory_kv(memory)
        cache = model.new_cache(3, 16)
        steps = [model.decode(tgt[:, i:i + 1], memory_kv=kv, memory_mask=keep, cache=cache)
                 for i in range(tgt.shape[1])]
    _close(torch.cat(steps, dim=1), full)


@pytest.mark.parametrize("name", NAMES)
def test_cross_and_self_attentions_equal_hf(pairs, name):
    hf, model, _ = pairs[name]
    src, mask = padded_sources()
    tgt = _target()
    with torch.no_grad():
        want = hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt,
                  output_attentions=True)
        got = model(src, tgt, src_mask=mask.bool(), output_attentions=True)
    heads = VARIANTS[name]["num_heads"]
    assert len(got.cross_attentions) == len(want.cross_attentions) == 3
    for ours, theirs in zip(got.cross_attentions, want.cross_attentions, strict=True):
        assert ours.shape == theirs.shape == (3, heads, 12, 20)
        assert (ours - theirs).abs().max().item() <= 1e-5
    for ours, theirs in zip(got.decoder_self_attentions, want.decoder_attentions,
                            strict=True):
        assert (ours - theirs).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_relative_bias_equals_hf_past_max_distance(pairs, name):
    """The encoder's bidirectional and the decoder's causal buckets, over 20 positions
    (beyond relative_attention_max_distance), and a block of later query rows (a decoding
    step's)."""
    hf, model, _ = pairs[name]
    n = 20
    assert n > VARIANTS[name]["relative_attention_max_distance"]
    pos = torch.arange(n)
    for ours, stack in ((model.encoder_bias, hf.encoder), (model.decoder_bias, hf.decoder)):
        with torch.no_grad():
            want = stack.block[0].layer[0].SelfAttention.compute_bias(n, n)  # (1, H, n, n)
            got = ours.score_bias(pos, pos)
            late = ours.score_bias(pos[5:], pos)
        assert torch.equal(got, want)
        assert torch.equal(late, want[:, :, 5:])
    # the two directions differ: the decoder's future is one bucket, the encoder's is not
    assert model.encoder_bias.bidirectional and not model.decoder_bias.bidirectional


def _hf_generate(hf, src, mask, **kw):
    with torch.no_grad():  # HF without its cache: transformers 5.24 sizes T5's generation
        # cache by num_layers, not num_decoder_layers (an IndexError at 2 vs 3 layers)
        return hf.generate(input_ids=src, attention_mask=mask, do_sample=False,
                           use_cache=False, decoder_start_token_id=START, pad_token_id=PAD,
                           **kw)


def _pad_after_eos(ids: torch.Tensor, eos: int) -> torch.Tensor:
    """(B, 1 + T) ids with every token after a row's first ``eos`` (past the start token)
    set to PAD: transformers 5.24's beam search fills finished rows with eos when
    pad_token_id is 0 (``pad_token_id or eos_token_id[0]``), T5's pad id."""
    ended = (ids[:, 1:] == eos).long().cumsum(dim=1) > 0  # (B, T) at or after the first eos
    after = torch.cat((torch.zeros_like(ended[:, :2]), ended[:, :-1]), dim=1)  # (B, 1 + T)
    return ids.masked_fill(after, PAD)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("beams, penalty", [(1, 1.0), (4, 1.0), (4, 0.5)])
def test_generate_equals_hf(pairs, name, beams, penalty):
    """Greedy and 4-beam search tokens == HF ``generate`` on right-padded sources, with a
    stop token the search really meets (rows finish at different steps)."""
    hf, model, _ = pairs[name]
    src, mask = padded_sources()
    kw = dict(num_beams=beams, max_new_tokens=10, length_penalty=penalty)
    free = _hf_generate(hf, src, mask, eos_token_id=EOS, **kw)
    # of the tokens a run without a stop generates, by frequency, the first with which HF
    # finishes a row before max_new_tokens
    for stop, _ in Counter(free[:, 1:].flatten().tolist()).most_common():
        want = _hf_generate(hf, src, mask, eos_token_id=stop, **kw)
        if stop != PAD and (want[:, 1:-1] == stop).any():
            break
    else:
        pytest.fail("no generated token ends a hypothesis early")
    want = _pad_after_eos(want, stop)
    got = qkv.generate(model, src, attention_mask=mask, decoder_start_token_id=START,
                       pad_token_id=PAD, eos_token_id=stop, **kw)
    assert got.shape == want.shape and torch.equal(got, want), (got.tolist(), want.tolist())
    assert torch.equal(_pad_after_eos(got, stop), got)  # qkv pads after eos itself


def test_key_map_covers_every_parameter(pairs):
    for name in NAMES:
        model = pairs[name][1]
        assert set(t5_key_map(model.config)) == set(model.state_dict())


def test_ffn_kinds():
    assert t5_ffn({}) == "relu"
    assert t5_ffn({"feed_forward_proj": "gated-gelu"}) == "geglu_tanh"  # gelu_new
    assert t5_ffn({"feed_forward_proj": "gated-silu"}) == "swiglu"
    assert t5_ffn({"feed_forward_proj": "gelu"}) == "gelu"  # erf, not gelu_new
    # dense_act_fn / is_gated_act override feed_forward_proj, as transformers reads them
    assert t5_ffn({"feed_forward_proj": "relu", "dense_act_fn": "gelu_new",
                   "is_gated_act": True}) == "geglu_tanh"
    for bad in ({"feed_forward_proj": "gated-relu"}, {"feed_forward_proj": "a-b-c"},
                {"feed_forward_proj": "quick_gelu"}, {"is_gated_act": "yes"}):
        assert t5_ffn(bad) is None, bad


def test_audit_classifies_every_t5config_field():
    fields = set(transformers.T5Config().to_dict())
    fields |= set(transformers.T5Config(feed_forward_proj="gated-gelu",
                                        tie_word_embeddings=False).to_dict())
    # transformers 4.x checkpoints on the Hub (t5-small, flan-t5-small, t5-v1_1-base)
    fields |= {"n_positions", "output_past", "task_specific_params", "torch_dtype",
               "gradient_checkpointing", "decoder_start_token_id", "is_encoder_decoder",
               "initializer_factor", "architectures", "relative_attention_max_distance"}
    assert sorted(fields - set(T5_FIELDS)) == []


def _edit(src, dst, **changes):
    """A copy of the HF directory ``src`` in ``dst`` with config.json fields changed
    (None removes one)."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    data = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    (dst / "config.json").write_text(json.dumps(data))
    return dst


@pytest.mark.parametrize("name, changes, needle", [
    ("flan-t5", {"feed_forward_proj": "gated-relu", "dense_act_fn": "relu"},
     "dense_act_fn='relu'"),
    ("t5-v1.0", {"dense_act_fn": "quick_gelu"}, "dense_act_fn='quick_gelu'"),
    ("t5-v1.0", {"num_decoder_layers": 5}, "num_decoder_layers=5"),
    ("t5-v1.0", {"num_layers": 1}, "num_layers=1"),
    ("t5-v1.0", {"relative_attention_max_distance": 8}, "relative_attention_max_distance=8"),
    ("t5-v1.0", {"tie_word_embeddings": False, "scale_decoder_outputs": None},
     "no lm_head.weight"),
    ("flan-t5", {"scale_decoder_outputs": None}, "lm_head.weight differs"),
    ("t5-v1.0", {"model_type": "bart"}, "model_type 'bart'"),
])
def test_bad_checkpoints_raise_one_line(pairs, tmp_path, name, changes, needle):
    d = _edit(pairs[name][2], tmp_path / "bad", **changes)
    with pytest.raises(CheckpointError) as info:
        load_hf(T5, Transformer, d)
    msg = str(info.value)
    assert needle in msg and "\n" not in msg, msg


def test_old_checkpoint_keys_load_the_same_model(pairs, tmp_path):
    """Tied copies (encoder/decoder.embed_tokens, an lm_head equal to shared) and the unused
    cross-attention relative bias of old checkpoints are checked and dropped; an embedding
    copy that differs from shared is refused."""
    from safetensors.torch import load_file, save_file

    _, model, d = pairs["t5-v1.0"]
    state = load_file(str(d / "model.safetensors"))
    shared = state["shared.weight"]
    extra = {"encoder.embed_tokens.weight": shared.clone(),
             "decoder.embed_tokens.weight": shared.clone(), "lm_head.weight": shared.clone(),
             "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight":
                 torch.randn(16, 4)}
    old = _edit(d, tmp_path / "old")
    save_file({**state, **extra}, str(old / "model.safetensors"), metadata={"format": "pt"})
    loaded = load_hf(T5, Transformer, old)
    assert loaded.config == model.config and loaded.lm_head.weight is loaded.src_embed.weight
    for key, t in loaded.state_dict().items():
        assert torch.equal(t, model.state_dict()[key]), key
    bad = _edit(d, tmp_path / "bad")
    save_file({**state, "decoder.embed_tokens.weight": shared + 1},
              str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"decoder\.embed_tokens\.weight differs"):
        load_hf(T5, Transformer, bad)
