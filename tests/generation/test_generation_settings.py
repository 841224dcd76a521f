"""qkv.generation.read_generation_settings: a checkpoint's generation_config.json (else
config.json's generation fields) as qkv.generate's arguments, as transformers reads them.

Oracles: transformers' ``GenerationConfig.from_pretrained`` for the values read (config.json
fallback included), and HF's ``generate`` with no arguments but the prompts on a GPT-2 (random
weights, tiny config) whose directory holds the generation_config.json, against
``qkv.generate(model, ids, **settings.generate_kwargs(...))`` on the same directory: the same
tokens (beam search with processors, and sampling from the same seed).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import qkv
from qkv.files import CheckpointError
from qkv.generation import GenerationSettings, read_generation_settings
from qkv.models import GPT, Transformer, TransformerConfig

transformers = pytest.importorskip("transformers")

BART_CNN = {"bos_token_id": 0, "decoder_start_token_id": 2, "early_stopping": True,
            "eos_token_id": 2, "forced_bos_token_id": 0, "forced_eos_token_id": 2,
            "length_penalty": 2.0, "max_length": 142, "min_length": 56,
            "no_repeat_ngram_size": 3, "num_beams": 4, "pad_token_id": 1,
            "transformers_version": "4.27.0.dev0"}
MARIAN = {"bad_words_ids": [[58100]], "bos_token_id": 0, "decoder_start_token_id": 58100,
          "eos_token_id": 0, "forced_eos_token_id": 0, "max_length": 512, "num_beams": 4,
          "pad_token_id": 58100, "renormalize_logits": True, "transformers_version": "4.27"}
FLAN_T5 = {"decoder_start_token_id": 0, "eos_token_id": 1, "pad_token_id": 0,
           "transformers_version": "4.27.0.dev0"}


def _write(directory, data, name="generation_config.json"):
    (directory / name).write_text(json.dumps(data))
    return directory


def test_bart_marian_and_t5_files_become_generate_kwargs(tmp_path):
    bart = read_generation_settings(_write(tmp_path, BART_CNN))
    assert bart.source == tmp_path / "generation_config.json"
    assert bart.generate_kwargs(True) == {
        "max_new_tokens": 141, "num_beams": 4, "min_length": 56, "length_penalty": 2.0,
        "early_stopping": True, "no_repeat_ngram_size": 3, "forced_bos_token_id": 0,
        "pad_token_id": 1, "eos_token_id": [2], "forced_eos_token_id": [2],
        "decoder_start_token_id": 2}
    marian = read_generation_settings(_write(tmp_path, MARIAN))
    assert marian.bad_words_ids == ((58100,),) and marian.renormalize_logits is True
    kw = marian.generate_kwargs(True)
    assert kw["max_new_tokens"] == 511 and kw["bad_words_ids"] == [[58100]]
    assert kw["decoder_start_token_id"] == 58100 and kw["renormalize_logits"] is True
    t5 = read_generation_settings(_write(tmp_path, FLAN_T5))
    assert t5.generate_kwargs(True) == {"pad_token_id": 0, "eos_token_id": [1],
                                        "decoder_start_token_id": 0}
    # decoder-only: max_length counts the prompt, so it needs the prompt's width
    gpt = read_generation_settings(_write(tmp_path, {"max_length": 30, "bos_token_id": 5}))
    assert gpt.generate_kwargs(False) == {}
    assert gpt.generate_kwargs(False, prompt_length=7) == {"max_new_tokens": 23}
    with pytest.raises(ValueError, match="max_length=30 leaves no new token after a prompt"):
        gpt.generate_kwargs(False, prompt_length=30)
    # max_new_tokens wins over max_length (HF's precedence); bos is the start fallback
    both = read_generation_settings(_write(tmp_path, {"max_length": 30, "max_new_tokens": 4,
                                                      "bos_token_id": 5}))
    assert both.generate_kwargs(True) == {"max_new_tokens": 4, "decoder_start_token_id": 5}
    assert read_generation_settings(tmp_path / "nothing-here") == GenerationSettings()


def _hf_values(directory, config_file_name=None):
    kw = {} if config_file_name is None else {"config_file_name": config_file_name}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.GenerationConfig.from_pretrained(directory, **kw)


@pytest.mark.parametrize("data", [BART_CNN, MARIAN, FLAN_T5,
                                  {"do_sample": True, "temperature": 0.6, "top_p": 0.9,
                                   "eos_token_id": [128001, 128008], "top_k": 0}])
def test_values_equal_transformers_generation_config(tmp_path, data):
    ours = read_generation_settings(_write(tmp_path, data))
    theirs = _hf_values(tmp_path)
    for field in ("num_beams", "max_length", "min_length", "length_penalty", "early_stopping",
                  "no_repeat_ngram_size", "forced_bos_token_id", "renormalize_logits",
                  "pad_token_id", "bos_token_id", "decoder_start_token_id", "do_sample",
                  "temperature", "top_k", "top_p"):
        assert getattr(ours, field) == getattr(theirs, field), field
    for field in ("eos_token_id", "forced_eos_token_id"):
        want = getattr(theirs, field)
        assert getattr(ours, field) == (None if want is None else tuple(
            [want] if isinstance(want, int) else want)), field


def test_config_json_fallback_reads_its_generation_fields(tmp_path):
    """No generation_config.json: config.json's top-level generation fields (transformers
    5.x: ``GenerationConfig.from_pretrained(..., config_file_name="config.json")``), the
    model's own fields ignored without a warning."""
    config = {"model_type": "bart", "d_model": 1024, "encoder_layers": 12,
              "task_specific_params": {"summarization": {"num_beams": 9}},
              "use_cache": True, **{k: v for k, v in BART_CNN.items()
                                    if k != "transformers_version"}}
    _write(tmp_path, config, "config.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = read_generation_settings(tmp_path)
    theirs = _hf_values(tmp_path, "config.json")
    assert ours.source == tmp_path / "config.json"
    assert (ours.num_beams, ours.max_length, ours.min_length, ours.early_stopping) == (
        theirs.num_beams, theirs.max_length, theirs.min_length, theirs.early_stopping) == (
        4, 142, 56, True)
    assert ours.generate_kwargs(True)["max_new_tokens"] == 141
    # generation_config.json present: config.json is not read at all (as transformers)
    _write(tmp_path, FLAN_T5)
    assert read_generation_settings(tmp_path).num_beams is None


def test_unknown_field_warns_once_per_field_and_is_ignored(tmp_path):
    _write(tmp_path, {**FLAN_T5, "lang_to_id": {"en": 3}})
    with pytest.warns(UserWarning) as record:
        got = read_generation_settings(tmp_path)
    assert len(record) == 1
    message = str(record[0].message)
    assert "'lang_to_id'" in message and "generation_config.json" in message
    assert "\n" not in message
    assert got == read_generation_settings(_write(tmp_path, FLAN_T5))


@pytest.mark.parametrize("extra, ok", [
    ({"repetition_penalty": 1.2}, False), ({"repetition_penalty": 1.0}, True),
    ({"num_beam_groups": 2, "diversity_penalty": 0.5}, False),
    ({"num_beam_groups": 1, "diversity_penalty": 0.0}, True),
    ({"typical_p": 0.9, "do_sample": True}, False), ({"typical_p": 0.9}, True),
    ({"constraints": [[1, 2]]}, False), ({"constraints": None}, True),
    ({"encoder_no_repeat_ngram_size": 3}, False), ({"suppress_tokens": []}, True),
    ({"num_return_sequences": 2}, False), ({"use_cache": False, "output_scores": True}, True),
])
def test_unimplemented_fields_refused_unless_neutral(tmp_path, extra, ok):
    _write(tmp_path, {**FLAN_T5, **extra})
    if ok:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            read_generation_settings(tmp_path)
        return
    with pytest.raises(CheckpointError) as err:
        read_generation_settings(tmp_path)
    message = str(err.value)
    assert "generation_config.json" in message and "not supported" in message
    assert next(iter(extra)) in message and "\n" not in message


@pytest.mark.parametrize("field, value", [
    ("num_beams", 0), ("num_beams", "4"), ("max_length", True), ("min_length", -1),
    ("early_stopping", "sometimes"), ("length_penalty", "x"), ("eos_token_id", []),
    ("bad_words_ids", [[1, "a"]]), ("bad_words_ids", [5]), ("forced_eos_token_id", -2),
    ("renormalize_logits", 1), ("pad_token_id", 1.5),
])
def test_malformed_values_name_file_and_field(tmp_path, field, value):
    _write(tmp_path, {**FLAN_T5, field: value})
    with pytest.raises(CheckpointError) as err:
        read_generation_settings(tmp_path)
    message = str(err.value)
    assert "generation_config.json" in message and f"{field} must be" in message
    assert "\n" not in message


def test_beam_sampling_is_refused(tmp_path):
    _write(tmp_path, {"do_sample": True, "num_beams": 4})
    with pytest.raises(CheckpointError, match="beam sampling"):
        read_generation_settings(tmp_path)


def _gpt2_dir(tmp_path, vocab, generation):
    cfg = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=64,
                                  vocab_size=vocab, bos_token_id=1, eos_token_id=2,
                                  pad_token_id=3)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write(tmp_path, generation)
    return transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()


@pytest.mark.parametrize("generation", [
    {"num_beams": 4, "max_length": 14, "no_repeat_ngram_size": 2, "length_penalty": 1.5,
     "early_stopping": "never", "bad_words_ids": [[11], [6, 19]], "min_new_tokens": 3,
     "eos_token_id": [2, 19], "pad_token_id": 3, "renormalize_logits": True},
    {"max_new_tokens": 9, "forced_eos_token_id": 2, "eos_token_id": 2, "pad_token_id": 3,
     "no_repeat_ngram_size": 3},
    {"do_sample": True, "temperature": 0.8, "max_length": 15, "bad_words_ids": [[7]],
     "eos_token_id": 2, "pad_token_id": 3},
])
def test_generate_with_the_settings_equals_hf_generate(tmp_path, generation):
    """HF ``generate(ids, attention_mask=mask)`` with the directory's generation_config.json
    == ``qkv.generate(..., **generate_kwargs(False, prompt_length=N))``. Vocabulary 64: HF's
    default top_k=50 filters when sampling."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hf = _gpt2_dir(tmp_path, 64, generation)
        model = GPT.from_hf(tmp_path).eval()
        ids = torch.randint(4, 64, (3, 5), generator=torch.Generator().manual_seed(2))
        mask = torch.ones_like(ids)
        mask[1, :2] = mask[2, :4] = 0
        ids = ids.masked_fill(mask == 0, 3)
        kw = read_generation_settings(tmp_path).generate_kwargs(False, prompt_length=5)
        if generation.get("do_sample"):
            assert kw["top_k"] == 50
            kw["generator"] = torch.Generator().manual_seed(99)
        torch.manual_seed(99)
        with torch.no_grad():
            want = hf.generate(ids, attention_mask=mask)
        got = qkv.generate(model, ids, attention_mask=mask, **kw)
        assert torch.equal(got, want), (got.tolist(), want.tolist())
    finally:
        torch.set_num_threads(threads)


def test_marian_like_settings_drive_a_transformer(tmp_path):
    """Marian's file on a qkv Transformer: the kwargs are accepted, the pad token (a bad
    word) is never generated, the output ends with the forced eos."""
    torch.manual_seed(0)
    cfg = TransformerConfig(src_vocab_size=20, tgt_vocab_size=20, dim=16, num_heads=2,
                            num_encoder_layers=1, num_decoder_layers=1, ffn_hidden=32,
                            max_len=16, pad_id=19, bos_id=1, eos_id=0)
    model = Transformer(cfg).eval()
    _write(tmp_path, {**MARIAN, "bad_words_ids": [[19]], "decoder_start_token_id": 19,
                      "pad_token_id": 19, "max_length": 9})
    kw = read_generation_settings(tmp_path).generate_kwargs(True)
    out = qkv.generate(model, torch.tensor([[5, 6, 7], [8, 9, 19]]), **kw)
    for row in out[:, 1:].tolist():
        end = row.index(0) + 1 if 0 in row else len(row)
        assert 19 not in row[:end] and end <= 8 and row[end - 1] == 0, row
