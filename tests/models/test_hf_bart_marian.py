"""HF BART and Marian checkpoints -> ``qkv.models.Transformer`` (``hf_bart.BART``,
``hf_marian.MARIAN`` through ``hf_load.load_hf``), against transformers itself: tiny models
with random weights (tests/models/_hf_bart_marian.py), saved and loaded back by both.

- encoder outputs (real positions) and decoder logits on right-padded sources, every variant;
- cached decoding == the full forward;
- greedy and 4-beam ``qkv.generate`` tokens == HF ``generate`` (batch 3, padded sources);
- cross-attention weights == HF's ``output_attentions`` (each layer, each head);
- Marian's stored sinusoid tables: the [sin | cos] one loads, another layout is refused;
- every BartConfig / MarianConfig field (5.x, 4.x, 3.x names) is classified; refused
  fields, unequal head counts or FFN widths and differing tied tables raise one-line
  CheckpointErrors.

Shapes: B = 3 batch, S = 9 source length, N = 6 target length, V vocab (61; 47 for the
separate target vocabulary). Tolerances: fp32 against transformers fp32 (the same math,
other kernels): |ours - HF| <= 1e-5 · max|HF| on logits and encoder outputs; 5e-5
absolute on attention weights (in [0, 1]; PyTorch's fp32 SDPA bar); cache vs full:
1e-5 · max|logits|; tokens exactly.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from _hf_bart_marian import VARIANTS, marian_table, reload_hf, save_hf, saved_variant, transformers

import qkv
from qkv.models import CheckpointError, Transformer
from qkv.models.hf_bart import BART, BART_FIELDS
from qkv.models.hf_load import load_hf
from qkv.models.hf_marian import MARIAN, MARIAN_FIELDS

REL = 1e-5
ATTN_ATOL = 5e-5  # PyTorch's fp32 bar for SDPA (tests/conftest.py TOL)


def _mapping(name: str):
    return BART if name.startswith("bart") else MARIAN


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> dict:
    """name -> (HF model as transformers loads it, qkv Transformer), built once."""
    out = {}
    for name in VARIANTS:
        directory = saved_variant(name, tmp_path_factory.mktemp(name))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no unknown field, no training-only doubt
            ours = load_hf(_mapping(name), Transformer, directory)
        out[name] = (reload_hf(name, directory), ours)
    return out


def _batch(model: Transformer, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded sources (B=3, S=9) of lengths 9, 6, 3 (no special ids inside) and their
    (B, S) bool mask."""
    g = torch.Generator().manual_seed(seed)
    c = model.config
    src = torch.randint(3, min(c.src_vocab_size, c.tgt_vocab_size) - 1, (3, 9), generator=g)
    src[src == c.pad_id] = 5
    mask = torch.arange(9)[None, :] < torch.tensor([9, 6, 3])[:, None]
    return src.masked_fill(~mask, c.pad_id), mask


def _close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = float((ours - ref).abs().max())
    assert err <= REL * float(ref.abs().max()), f"{what}: max |diff| {err:.3g}"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_config_reads_the_variant(name, loaded):
    hf, ours = loaded[name]
    c, h = ours.config, hf.config
    assert (c.pad_id, c.eos_id, c.bos_id) == (h.pad_token_id, h.eos_token_id,
                                              h.decoder_start_token_id)
    assert c.head_bias == (name != "marian-no-bias")
    assert c.share_embeddings == (name in ("bart", "marian", "marian-no-bias"))
    assert c.tie_output == (not name.endswith("untied"))
    assert c.tgt_vocab_size == (47 if name == "marian-separate" else 61)
    assert (c.positions, c.embed_norm) == (("learned", True) if name.startswith("bart")
                                           else ("sinusoidal", False))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_encoder_and_logits_match_hf(name, loaded):
    hf, ours = loaded[name]
    src, mask = _batch(ours)
    g = torch.Generator().manual_seed(2)
    tgt = torch.randint(3, ours.config.tgt_vocab_size, (3, 6), generator=g)
    tgt[:, 0] = ours.config.bos_id
    with torch.no_grad():
        ref = hf(input_ids=src, attention_mask=mask.long(), decoder_input_ids=tgt)
        memory, _ = ours.encode(src, src_mask=mask)
        logits = ours(src, tgt, src_mask=mask)
    enc = ref.encoder_last_hidden_state
    _close(memory[mask], enc[mask], "encoder outputs at real positions")
    _close(logits, ref.logits, "decoder logits")


@pytest.mark.parametrize("name", ["bart", "marian-separate"])
def test_cached_decoding_equals_full_forward(name, loaded):
    _, ours = loaded[name]
    src, mask = _batch(ours)
    tgt = torch.randint(3, ours.config.tgt_vocab_size, (3, 6),
                        generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = ours(src, tgt, src_mask=mask)
        memory, memory_mask = ours.encode(src, src_mask=mask)
        kv = ours.precompute_memory_kv(memory)
        cache = ours.new_cache(3, 8)
        steps = [ours.decode(tgt[:, i:i + 1], memory_kv=kv, memory_mask=memory_mask,
                             cache=cache) for i in range(tgt.shape[1])]
    _close(torch.cat(steps, dim=1), full, "cached decoding vs full forward")


@pytest.mark.parametrize(("stop", "num_beams", "length_penalty"), [
    ("config", 1, 1.0), ("config", 4, 1.0), ("row0", 1, 1.0), ("row0", 4, 1.0),
    ("row0", 4, 1.5)])
@pytest.mark.parametrize("name", ["bart", "marian", "marian-separate"])
def test_generate_matches_hf(name, stop, num_beams, length_penalty, loaded):
    """``stop="config"``: the config's eos (which these random models hardly produce: rows
    run to max_new_tokens); ``"row0"``: the last token of row 0's greedy output as the stop
    token, so that rows and beams finish at different steps."""
    hf, ours = loaded[name]
    src, mask = _batch(ours, seed=5)
    c = ours.config
    ids = dict(decoder_start_token_id=c.bos_id, eos_token_id=c.eos_id, pad_token_id=c.pad_id)
    if stop == "row0":
        greedy = qkv.generate(ours, src, attention_mask=mask, max_new_tokens=10,
                              settings=None, **ids)
        ids["eos_token_id"] = int(greedy[0, -1])
    # HF is given every processor's neutral value over its file: qkv decodes without it
    got = qkv.generate(ours, src, attention_mask=mask, num_beams=num_beams, max_new_tokens=10,
                       length_penalty=length_penalty, settings=None, **ids)
    with torch.no_grad():
        ref = hf.generate(input_ids=src, attention_mask=mask.long(), num_beams=num_beams,
                          max_new_tokens=10, length_penalty=length_penalty, do_sample=False,
                          early_stopping=False, num_return_sequences=1, min_length=0,
                          bad_words_ids=None, forced_bos_token_id=None,
                          forced_eos_token_id=None, no_repeat_ngram_size=0,
                          repetition_penalty=1.0, **ids)
    assert got.tolist() == ref.tolist()


@pytest.mark.parametrize("name", ["bart", "marian"])
def test_attention_weights_match_hf(name, loaded):
    hf, ours = loaded[name]
    src, mask = _batch(ours)
    tgt = torch.randint(3, ours.config.tgt_vocab_size, (3, 6),
                        generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(input_ids=src, attention_mask=mask.long(), decoder_input_ids=tgt,
                 output_attentions=True)
        out = ours(src, tgt, src_mask=mask, output_attentions=True)
    assert len(out.cross_attentions) == len(ref.cross_attentions) == 2
    for ours_w, ref_w in zip(out.cross_attentions, ref.cross_attentions, strict=True):
        assert ours_w.shape == ref_w.shape == (3, 4, 6, 9)  # (B, H, N, S)
        torch.testing.assert_close(ours_w, ref_w, atol=ATTN_ATOL, rtol=0)
    for ours_w, ref_w in zip(out.decoder_self_attentions, ref.decoder_attentions,
                             strict=True):
        torch.testing.assert_close(ours_w, ref_w, atol=ATTN_ATOL, rtol=0)
    for ours_w, ref_w in zip(out.encoder_attentions, ref.encoder_attentions, strict=True):
        rows = mask[:, None, :, None].expand_as(ref_w)  # real query rows
        torch.testing.assert_close(ours_w[rows], ref_w[rows], atol=ATTN_ATOL, rtol=0)


# --- Marian's stored sinusoid tables ------------------------------------------------------
def test_stored_marian_positions_are_checked_and_dropped(tmp_path, loaded):
    hf, ref = loaded["marian"]
    table = marian_table(40, 32)
    stored = {f"model.{s}.embed_positions.weight": table for s in ("encoder", "decoder")}
    ours = load_hf(MARIAN, Transformer, save_hf(hf, tmp_path / "ok", add=stored))
    src, mask = _batch(ours)
    with torch.no_grad():
        assert torch.equal(ours(src, src[:, :4], src_mask=mask),
                           ref(src, src[:, :4], src_mask=mask))
    other = {"model.decoder.embed_positions.weight": marian_table(40, 32, interleaved=True)}
    with pytest.raises(CheckpointError, match=r"decoder\.embed_positions\.weight is "
                                              r"not the sinusoidal") as err:
        load_hf(MARIAN, Transformer, save_hf(hf, tmp_path / "bad", add=other))
    assert "\n" not in str(err.value)
    short = {"model.encoder.embed_positions.weight": table[:20]}
    with pytest.raises(CheckpointError, match=r"shape \(20, 32\)"):
        load_hf(MARIAN, Transformer, save_hf(hf, tmp_path / "short", add=short))


# --- refusals -----------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "config", "match"), [
    ("bart", {"normalize_before": True}, r"normalize_before=True \(pre-norm"),
    ("bart", {"add_final_layer_norm": True}, "add_final_layer_norm=True"),
    ("bart", {"extra_pos_embeddings": 3}, "extra_pos_embeddings=3"),
    ("bart", {"activation_function": "quick_gelu"}, "activation_function='quick_gelu'"),
    ("marian", {"static_position_embeddings": False}, "static_position_embeddings=False"),
    ("marian", {"decoder_attention_heads": 2}, "encoder_attention_heads=4 but "
                                               "decoder_attention_heads=2"),
    ("bart", {"decoder_ffn_dim": 40}, "encoder_ffn_dim=48 but decoder_ffn_dim=40"),
    ("bart", {"hidden_size": 16}, "hidden_size=16 and d_model=32 disagree"),
])
def test_refused_configs_raise_one_line(name, config, match, tmp_path, loaded):
    directory = save_hf(loaded[name][0], tmp_path / "m", config=config)
    with pytest.raises(CheckpointError, match=match) as err:
        load_hf(_mapping(name), Transformer, directory)
    assert "\n" not in str(err.value)


def test_differing_tied_tables_are_refused(tmp_path, loaded):
    hf = loaded["bart"][0]
    other = {"model.encoder.embed_tokens.weight": torch.randn(61, 32)}
    with pytest.raises(CheckpointError, match=r"encoder\.embed_tokens\.weight differs "
                                              r"from shared\.weight") as err:
        load_hf(BART, Transformer, save_hf(hf, tmp_path / "m", add=other))
    assert "\n" not in str(err.value)


def test_layer_counts_and_model_type_are_checked(tmp_path, loaded):
    hf = loaded["bart"][0]
    with pytest.raises(CheckpointError, match="decoder_layers=3"):
        load_hf(BART, Transformer, save_hf(hf, tmp_path / "a", config={"decoder_layers": 3}))
    with pytest.raises(CheckpointError, match="model_type 'bart'"):
        load_hf(MARIAN, Transformer, tmp_path / "a")


def test_training_only_differences_warn(tmp_path, loaded):
    directory = save_hf(loaded["marian"][0], tmp_path / "m",
                        config={"activation_dropout": 0.3, "encoder_layerdrop": 0.1})
    with pytest.warns(UserWarning, match="encoder_layerdrop=0.1") as record:
        ours = load_hf(MARIAN, Transformer, directory)
    assert not any("activation_dropout" in str(w.message) for w in record)
    # activation_dropout is the FFN's inner dropout (ffn_dropout), the rest is dropout
    assert ours.config.dropout == 0.0 and ours.config.ffn_dropout == 0.3
    assert ours.encoder_layers[0].ffn.dropout.p == 0.3


# --- the audit tables ---------------------------------------------------------------------
#: fields of 4.x / 3.x BartConfig and MarianConfig (and their PretrainedConfig) that
#: transformers 5 no longer writes but Hub config.json files still carry
OLD_FIELDS = ("extra_pos_embeddings", "normalize_before", "add_final_layer_norm",
              "do_blenderbot_90_layernorm", "normalize_embedding", "static_position_embeddings",
              "add_bias_logits", "force_bos_token_to_be_generated", "output_past",
              "num_hidden_layers", "classif_dropout", "_num_labels", "gradient_checkpointing",
              "forced_bos_token_id", "torch_dtype", "bad_words_ids", "num_beams", "max_length",
              "add_cross_attention", "tie_encoder_decoder", "classifier_dropout")


@pytest.mark.parametrize(("config_cls", "table"), [("BartConfig", BART_FIELDS),
                                                   ("MarianConfig", MARIAN_FIELDS)])
def test_every_field_is_classified(config_cls, table):
    config = getattr(transformers, config_cls)()
    fields = set(config.to_dict()) | set(OLD_FIELDS) | set(config.attribute_map)
    assert sorted(fields - set(table)) == []


def test_bart_model_without_head_loads(tmp_path, loaded):
    """``BartModel`` (no "model." prefix, no head, no final_logits_bias): the encoder and
    the decoder's hidden states are HF's; the head is the tied table."""
    hf = loaded["bart"][0]
    base = transformers.BartModel(hf.config)
    base.load_state_dict(hf.model.state_dict())
    directory = tmp_path / "base"
    base.save_pretrained(directory, safe_serialization=True)
    ours = load_hf(BART, Transformer, directory)
    assert not ours.config.head_bias
    src, mask = _batch(ours)
    with torch.no_grad():
        ref = base.eval()(input_ids=src, attention_mask=mask.long(),
                          decoder_input_ids=src[:, :5]).last_hidden_state
        logits = ours(src, src[:, :5], src_mask=mask)
        tied = ref @ hf.model.shared.weight.T  # (B, N, V)
    _close(logits, tied, "BartModel hidden states through the "
                                                   "tied table")



@pytest.mark.parametrize(("name", "config"), [
    ("bart", {"extra_pos_embeddings": 2, "normalize_embedding": True,
              "static_position_embeddings": False, "add_bias_logits": False,
              "add_final_layer_norm": False, "normalize_before": False,
              "do_blenderbot_90_layernorm": False, "force_bos_token_to_be_generated": True,
              "output_past": False, "num_hidden_layers": 2, "_num_labels": 3,
              "classif_dropout": 0.0, "forced_bos_token_id": 0, "gradient_checkpointing": False,
              "no_repeat_ngram_size": 3, "num_beams": 4}),
    ("marian", {"extra_pos_embeddings": 62, "normalize_embedding": False,
                "static_position_embeddings": True, "add_bias_logits": False,
                "add_final_layer_norm": False, "normalize_before": False,
                "num_hidden_layers": 2, "bad_words_ids": [[46]], "max_length": 512,
                "classif_dropout": 0.0, "gradient_checkpointing": False}),
])
def test_hub_style_config_loads_quietly(name, config, tmp_path, loaded):
    """config.json files written by transformers 3.x / 4.x (facebook/bart-*, opus-mt-*) carry
    fields transformers 5 no longer writes: they load with no warning and the same model."""
    hf, ref = loaded[name]
    directory = save_hf(hf, tmp_path / "m", config=config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = load_hf(_mapping(name), Transformer, directory)
    assert ours.config == ref.config
