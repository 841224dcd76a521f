"""``to_hf`` of a qkv ``Transformer``: HuggingFace T5 / BART / Marian directories that
transformers loads with the same logits (qkv.models.hf_export_seq2seq).

Oracles: transformers' ``AutoModelForSeq2SeqLM`` loading the written directory, against the
HF model the qkv model was read from (tests/models/_hf_t5.py, _hf_bart_marian.py: tiny random
configs) or the qkv model itself; qkv's loaders reading it back. Tolerances: HF -> qkv -> HF
logits within 1e-6 of the logits' largest magnitude (the same weights through the same
code) and every tensor of the source's state dict exactly equal; qkv -> HF logits within
1e-5 of the scale (fp32, the same math in another order); qkv -> HF -> qkv the same config
and tensors exactly (where the module docstring of hf_export_seq2seq names a change of
form: a zero logits bias, BART's offset 2, Marian's [sin | cos] channel order, the logits
within 1e-5 instead). Sources are right-padded (11, 8 and 4 real tokens).
"""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch
from _hf_bart_marian import VARIANTS as BM_VARIANTS
from _hf_bart_marian import reload_hf, saved_variant
from _hf_t5 import VARIANTS as T5_VARIANTS
from _hf_t5 import hf_t5
from _hf_t5 import save_hf as save_t5
from safetensors import safe_open

from qkv import quantize
from qkv.models import Transformer, TransformerConfig, from_pretrained
from qkv.models.hf_export import choose_model_type, hf_config_for, hf_state_dict, to_hf

transformers = pytest.importorskip("transformers")


def _close(ours: torch.Tensor, theirs: torch.Tensor, rel: float) -> None:
    scale = theirs.abs().max().item()
    err = (ours - theirs).abs().max().item()
    assert err <= rel * scale, f"max error {err:.3g} > {rel:g} x logits scale {scale:.3g}"


def _batch(bos: int, pad: int, vocab: int = 40) -> tuple[torch.Tensor, ...]:
    """(src (3, 11) right-padded with pad, its mask (int64, 1 = real), tgt (3, 7) from bos);
    real ids in [3, vocab) (no special token)."""
    g = torch.Generator().manual_seed(3)
    src = torch.randint(3, vocab, (3, 11), generator=g)
    mask = torch.ones_like(src)
    mask[1, 8:] = 0
    mask[2, 4:] = 0
    tgt = torch.randint(3, vocab, (3, 7), generator=g)
    tgt[:, 0] = bos
    return src.masked_fill(mask == 0, pad), mask, tgt


def _hf_logits(model, src, mask, tgt) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits


def _qkv_logits(model, src, mask, tgt) -> torch.Tensor:
    with torch.no_grad():
        return model(src, tgt, src_mask=mask.bool())


def _load_hf(directory):
    model, info = transformers.AutoModelForSeq2SeqLM.from_pretrained(
        directory, attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), info  # no missing / unexpected / mismatched key
    return model.eval()


def _reload_quietly(directory) -> Transformer:
    """qkv reads the export back without a warning (no field unknown to its audit)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return from_pretrained(directory)


def _file_keys(directory) -> set[str]:
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return set(f.keys())


# --- HF -> qkv -> HF ------------------------------------------------------------------------
def _hf_source(name: str, directory):
    if name in T5_VARIANTS:
        hf = hf_t5(name)
        return hf, save_t5(hf, directory)
    path = saved_variant(name, directory)
    return reload_hf(name, path), path  # as transformers reads the file (dropped keys)


#: the source's tensors the export may hold differently: the untied BART's model.shared,
#: which neither stack reads (qkv keeps the stacks' tables; the export writes the encoder's)
_UNREAD = {"bart-untied": {"model.shared.weight"}}


@pytest.mark.parametrize("name", [*T5_VARIANTS, *BM_VARIANTS])
def test_hf_to_qkv_to_hf_is_the_same_model(name, tmp_path):
    hf, src_dir = _hf_source(name, tmp_path / "src")
    ours = from_pretrained(src_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = to_hf(ours, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == hf.config.model_type
    back = _load_hf(out)
    assert type(back) is type(hf)
    src, mask, tgt = _batch(ours.config.bos_id, ours.config.pad_id)
    want = _hf_logits(hf, src, mask, tgt)
    _close(_hf_logits(back, src, mask, tgt), want, 1e-6)
    theirs, mine = hf.state_dict(), back.state_dict()
    for key in sorted(set(theirs) & set(mine) - _UNREAD.get(name, set())):
        assert torch.equal(mine[key], theirs[key]), key
    if name != "marian-untied":  # its tables load apart: exported unshared, no model.shared
        assert set(mine) == set(theirs)
        bias = set() if name in T5_VARIANTS else {"final_logits_bias"}  # zeros if dropped
        assert _file_keys(out) == _file_keys(src_dir) | bias
    again = _reload_quietly(out)
    zero_bias = not ours.config.head_bias and name not in T5_VARIANTS
    assert again.config == dataclasses.replace(ours.config, head_bias=ours.config.head_bias
                                               or zero_bias)  # a zero bias: the next test
    _close(_qkv_logits(again, src, mask, tgt), want, 1e-5)


def test_missing_logits_bias_is_written_as_zeros(tmp_path):
    ours = from_pretrained(saved_variant("marian-no-bias", tmp_path / "src"))
    assert not ours.config.head_bias
    state = hf_state_dict(ours)
    assert torch.equal(state["final_logits_bias"], torch.zeros(1, ours.config.tgt_vocab_size))
    again = _reload_quietly(to_hf(ours, tmp_path / "out"))
    assert again.config == dataclasses.replace(ours.config, head_bias=True)
    assert torch.equal(again.lm_head.bias, torch.zeros(ours.config.tgt_vocab_size))


# --- qkv -> HF -> qkv -----------------------------------------------------------------------
_COMMON = dict(src_vocab_size=53, tgt_vocab_size=53, dim=32, num_encoder_layers=2,
               num_decoder_layers=2, num_heads=4, ffn_hidden=48, dropout=0.0, max_len=24,
               pad_id=0, bos_id=1, eos_id=2)
_T5 = dict(_COMMON, positions="t5", norm="rmsnorm", norm_first=True, bias=False,
           scale_embeddings=False, share_embeddings=True, attention_scale=1.0,
           relative_num_buckets=16, relative_max_distance=10, norm_eps=1e-6)
_BART = dict(_COMMON, positions="learned", position_offset=2, embed_norm=True,
             head_bias=True, share_embeddings=True, activation="gelu")
_MARIAN = dict(_COMMON, positions="sinusoidal", sinusoidal_layout="halves", head_bias=True,
               share_embeddings=True, activation="silu", pad_id=52, bos_id=52, eos_id=0)

#: name -> (TransformerConfig kwargs, the HF model_type chosen)
NATIVE = {
    "t5-tied-scaled": (dict(_T5, head_scale=32 ** -0.5), "t5"),
    "t5-untied-geglu-wide-heads": (dict(_T5, activation="geglu", tie_output=False,
                                        attention_head_dim=12), "t5"),
    "t5-tied-unscaled-swiglu": (dict(_T5, activation="swiglu"), "t5"),
    "t5-untied-scaled-gelu-tanh": (dict(_T5, activation="gelu_tanh", tie_output=False,
                                        head_scale=32 ** -0.5), "t5"),
    "bart": (_BART, "bart"),
    "bart-offset0-untied-no-bias": (dict(_BART, position_offset=0, head_bias=False,
                                         share_embeddings=False, tie_output=False,
                                         activation="relu", scale_embeddings=False), "bart"),
    "marian": (_MARIAN, "marian"),
    "marian-separate": (dict(_MARIAN, share_embeddings=False, tgt_vocab_size=41, pad_id=40,
                             bos_id=40), "marian"),
    "marian-shared-untied": (dict(_MARIAN, tie_output=False), "marian"),
    # the paper's Transformer: interleaved sinusoids, two tables, no logits bias
    "paper": (dict(_COMMON, tgt_vocab_size=47), "marian"),
}


def _randomise(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter N(0, 0.3²) (token tables N(0, 1) without an embedding scale), norm
    weights 1 + N(0, 0.1²): biases, norms, positions and the head all matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif "embed." in name and not model.config.scale_embeddings:
                p.copy_(noise)
            else:
                p.copy_(0.3 * noise)
    return model.eval()


def _expected(c: TransformerConfig) -> TransformerConfig:
    """The config qkv reads back (hf_export_seq2seq's module docstring); the pad row is
    trained in T5 and frozen in BART / Marian, as in transformers."""
    if c.positions == "t5":
        return dataclasses.replace(c, freeze_pad_row=False)
    changes = dict(freeze_pad_row=True, head_bias=True,
                   share_embeddings=c.share_embeddings and c.tie_output,
                   ffn_dropout=c.dropout if c.ffn_dropout is None else c.ffn_dropout)
    if c.positions == "learned":
        changes["position_offset"] = 2
    else:
        changes["sinusoidal_layout"] = "halves"
    return dataclasses.replace(c, **changes)


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_qkv_to_hf_to_qkv(name, tmp_path):
    kwargs, model_type = NATIVE[name]
    config = TransformerConfig(**kwargs)
    ours = _randomise(Transformer(config))
    assert choose_model_type(config) == model_type
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = to_hf(ours, tmp_path / "out")
    src, mask, tgt = _batch(config.bos_id, config.pad_id)
    want = _qkv_logits(ours, src, mask, tgt)
    hf = _load_hf(out)
    assert hf.config.model_type == model_type
    _close(_hf_logits(hf, src, mask, tgt), want, 1e-5)
    again = _reload_quietly(out)
    assert again.config == _expected(config)
    got = _qkv_logits(again, src, mask, tgt)
    # the same tensors when nothing changes form (the pad row's training flag is no form)
    if dataclasses.replace(_expected(config), freeze_pad_row=config.freeze_pad_row) == config:
        assert torch.equal(got, want)
        mine, theirs = again.state_dict(), ours.state_dict()
        assert mine.keys() == theirs.keys()
        for key in theirs:
            assert torch.equal(mine[key], theirs[key]), key
    else:
        _close(got, want, 1e-5)
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["decoder_start_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (
        config.bos_id, config.eos_id, config.pad_id)


def test_bart_positions_at_another_offset_are_reindexed(tmp_path):
    config = TransformerConfig(**NATIVE["bart-offset0-untied-no-bias"][0])
    ours = _randomise(Transformer(config))
    state = hf_state_dict(ours)
    table = state["model.encoder.embed_positions.weight"]  # (P + 2, C), read at p + 2
    assert table.shape == (config.max_len + 2, config.dim)
    assert torch.equal(table[2:], ours.src_positions.weight.detach())
    assert not table[:2].any()
    assert torch.equal(state["model.shared.weight"], state["model.encoder.embed_tokens.weight"])


def test_marian_generation_config_bans_pad_and_forces_eos(tmp_path):
    config = TransformerConfig(**NATIVE["marian"][0])
    out = to_hf(_randomise(Transformer(config)), tmp_path / "out",
                token_ids={"bos_token_id": 7, "eos_token_id": [0, 5]})
    gen = transformers.GenerationConfig.from_pretrained(out)
    assert (gen.decoder_start_token_id, gen.pad_token_id, gen.bos_token_id) == (52, 52, 7)
    assert (gen.eos_token_id, gen.forced_eos_token_id, gen.bad_words_ids) == ([0, 5], 0, [[52]])
    hf = json.loads((out / "config.json").read_text())
    assert (hf["share_encoder_decoder_embeddings"], hf["decoder_vocab_size"]) == (True, 53)
    t5 = hf_config_for(TransformerConfig(**NATIVE["t5-tied-scaled"][0]))
    assert (t5["tie_word_embeddings"], t5["scale_decoder_outputs"], t5["feed_forward_proj"],
            t5["decoder_start_token_id"], t5["bos_token_id"]) == (True, True, "relu", 1, None)
    with pytest.warns(UserWarning, match=r"attn_dropout=0\.2 dropped: T5's one dropout_rate"):
        t5 = hf_config_for(TransformerConfig(**NATIVE["t5-tied-scaled"][0], attn_dropout=0.2))
    assert t5["dropout_rate"] == 0.0


# --- refusals -------------------------------------------------------------------------------
REFUSED = {
    "alibi": (dict(_COMMON, positions="alibi"), None,
              "positions='alibi': no HF encoder-decoder computes ALiBi"),
    "shaw": (dict(_COMMON, positions="shaw"), None,
             "positions='shaw': no HF encoder-decoder computes Shaw"),
    "t5-scaled-scores": (dict(_T5, attention_scale=None), None,
                         "attention_scale=None: T5 does not scale q·k"),
    "t5-bias-layernorm": (dict(_T5, bias=True, norm="layernorm"), None,
                          "bias=True: T5 has no biases; norm='layernorm': T5 uses RMSNorm"),
    "t5-head-scale": (dict(_T5, head_scale=0.5), None, "head_scale=0.5: T5 multiplies"),
    "bart-gated": (dict(_BART, activation="swiglu"), None,
                   "activation='swiglu': BART's FFN computes one of"),
    "bart-eps": (dict(_BART, norm_eps=1e-6), None, "norm_eps=1e-06: BART's LayerNorms"),
    "bart-two-vocabs": (dict(_BART, share_embeddings=False, tgt_vocab_size=41), None,
                        "BART has one vocabulary"),
    "bart-no-embed-norm": (dict(_BART, embed_norm=False), None, "embed_norm=False: BART"),
    "marian-pre-norm": (dict(_MARIAN, norm_first=True), None,
                        "norm_first=True: Marian's layers are post-norm; final_norm=True"),
    "marian-scores": (dict(_MARIAN, attention_scale=0.5), None,
                      "attention_scale=0.5: Marian scales q·k by 1/√D"),
    "asked-t5-for-marian": (_MARIAN, "t5", "as HF T5 (model_type 't5', asked for): "
                                           "positions='sinusoidal'"),
    "not-a-seq2seq-type": (_MARIAN, "gpt2", "model_type='gpt2': a TransformerConfig exports "
                                            "as one of ['t5', 'bart', 'marian']"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refusals_are_one_line_and_write_nothing(name, tmp_path):
    kwargs, model_type, message = REFUSED[name]
    model = Transformer(TransformerConfig(**kwargs))
    out = tmp_path / "out"
    with pytest.raises(ValueError) as err:
        to_hf(model, out, model_type=model_type)
    text = str(err.value)
    assert message in text and "\n" not in text, text
    assert not out.exists()


def test_quantized_and_bad_token_ids_are_refused(tmp_path):
    config = TransformerConfig(**NATIVE["marian"][0])
    with pytest.raises(ValueError, match="token_ids\\['pad_token_id'\\]=3 differs from the "
                                         "TransformerConfig's pad_id=52"):
        to_hf(Transformer(config), tmp_path / "a", token_ids={"pad_token_id": 3})
    with pytest.raises(ValueError, match="token_ids must be a dict with keys among"):
        hf_config_for(config, token_ids={"sep_token_id": 3})
    model = quantize(Transformer(config).eval())
    with pytest.raises(ValueError, match=r"quantized with qkv\.quantize"):
        to_hf(model, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
