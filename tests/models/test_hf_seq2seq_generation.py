"""A checkpoint's generation_config.json decodes as HF decodes it: BART-cnn-like (4 beams,
length_penalty 2, no_repeat_ngram_size 3, min_length, early_stopping, forced bos/eos),
Marian-like (4 beams, bad_words_ids [[pad]] so that pad is never generated,
renormalize_logits, forced eos) and Flan-T5-like (beams, no_repeat_ngram_size) settings,
read by ``qkv.generation.read_generation_settings`` and passed to ``qkv.generate``, against
HF's ``generate`` reading the same file (its model's ``generation_config``).

Tiny random-weight models (tests/models/_hf_bart_marian.py, _hf_t5.py), batch 3 with
right-padded sources; tokens compared exactly (HF pads finished T5 beams with eos where
pad_token_id is 0: those positions are set to pad before comparing)."""

from __future__ import annotations

import json

import pytest
import torch
from _hf_bart_marian import reload_hf, saved_variant
from _hf_t5 import hf_t5, padded_sources
from _hf_t5 import save_hf as save_t5

import qkv
from qkv.generation import read_generation_settings
from qkv.models import from_pretrained

SETTINGS = {
    "bart": {"num_beams": 4, "length_penalty": 2.0, "no_repeat_ngram_size": 3,
             "min_length": 6, "max_length": 12, "early_stopping": True,
             "forced_bos_token_id": 0, "forced_eos_token_id": 2},
    "marian": {"num_beams": 4, "max_length": 12, "bad_words_ids": [[46]],
               "renormalize_logits": True, "forced_eos_token_id": 0},
    "marian-greedy": {"num_beams": 1, "max_length": 10, "bad_words_ids": [[46]],
                      "no_repeat_ngram_size": 2},
}


def _write(directory, settings: dict, ids: dict) -> None:
    (directory / "generation_config.json").write_text(json.dumps({**ids, **settings}))


def _sources(model, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    c = model.config
    src = torch.randint(3, min(c.src_vocab_size, c.tgt_vocab_size) - 1, (3, 9), generator=g)
    src[src == c.pad_id] = 5
    mask = torch.arange(9)[None, :] < torch.tensor([9, 6, 3])[:, None]
    return src.masked_fill(~mask, c.pad_id), mask


@pytest.mark.parametrize("name", list(SETTINGS))
def test_bart_marian_generation_config_equals_hf(name, tmp_path):
    family = name.split("-")[0]
    directory = saved_variant(family, tmp_path / family)
    ours = from_pretrained(directory)
    c = ours.config
    _write(directory, SETTINGS[name], {"decoder_start_token_id": c.bos_id,
                                       "eos_token_id": c.eos_id, "pad_token_id": c.pad_id})
    ours = from_pretrained(directory)  # it carries the file written now
    hf = reload_hf(family, directory)
    src, mask = _sources(ours)
    kwargs = read_generation_settings(directory).generate_kwargs(encoder_decoder=True)
    got = qkv.generate(ours, src, attention_mask=mask, **kwargs)
    with torch.no_grad():
        ref = hf.generate(input_ids=src, attention_mask=mask.long())
    assert got.tolist() == ref.tolist()
    plain = {k: kwargs[k] for k in ("max_new_tokens", "decoder_start_token_id",
                                    "eos_token_id", "pad_token_id") if k in kwargs}
    assert got.tolist() != qkv.generate(ours, src, attention_mask=mask, settings=None,
                                        **plain).tolist(), \
        "the settings must change these outputs, or the test shows nothing"
    new = got[:, 1:]
    if "bad_words_ids" in SETTINGS[name]:  # pad only fills rows after their eos
        for row in new.tolist():
            end = row.index(c.eos_id) + 1 if c.eos_id in row else len(row)
            assert c.pad_id not in row[:end]
    if "forced_bos_token_id" in SETTINGS[name]:
        assert (new[:, 0] == 0).all()


def test_t5_generation_config_equals_hf(tmp_path):
    hf = hf_t5("flan-t5")
    directory = save_t5(hf, tmp_path / "t5")
    ours = from_pretrained(directory)
    c = ours.config
    _write(directory, {"num_beams": 4, "no_repeat_ngram_size": 2, "length_penalty": 0.6,
                       "max_length": 9},
           {"decoder_start_token_id": c.bos_id, "eos_token_id": c.eos_id,
            "pad_token_id": c.pad_id})
    ours = from_pretrained(directory)  # it carries the file written now
    src, mask = padded_sources()
    mask = mask.bool()
    kwargs = read_generation_settings(directory).generate_kwargs(encoder_decoder=True)
    got = qkv.generate(ours, src, attention_mask=mask, **kwargs)
    from transformers import T5ForConditionalGeneration

    ref_model = T5ForConditionalGeneration.from_pretrained(directory,
                                                           attn_implementation="eager").eval()
    with torch.no_grad():
        ref = ref_model.generate(input_ids=src, attention_mask=mask.long(),
                                 use_cache=False)  # transformers 5.24's T5 cache is sized
        # by num_layers, wrong for num_decoder_layers != num_layers (tests/models/_hf_t5.py)
    # HF fills finished beams with eos when pad_token_id is 0 (`pad or eos`): as pad here
    ref = ref.clone()
    for row in ref:
        hits = (row[1:] == c.eos_id).nonzero()
        if len(hits):
            row[2 + int(hits[0]):] = c.pad_id
    assert got.tolist() == ref.tolist()
    plain = {k: kwargs[k] for k in ("max_new_tokens", "decoder_start_token_id",
                                    "eos_token_id", "pad_token_id") if k in kwargs}
    assert got.tolist() != qkv.generate(ours, src, attention_mask=mask, settings=None,
                                        **plain).tolist()
