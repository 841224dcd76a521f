"""A model loaded from a directory decodes with the directory's generation settings by
default, as transformers' ``generate`` does: ``qkv.generate(model, ids, **only what the
test passes)`` equals HF's ``model.generate`` with the same arguments on the same
directory, for every family (GPT-2, the Llama-style decoders, T5 v1.0 / Flan-T5, BART,
Marian); an argument passed overrides the file; ``settings=None`` turns the file off;
``explain`` names what came from the file.

Oracles: transformers' own classes loading the directory (eager attention, fp32), with
generation_config.json (or, without one, config.json's generation fields) as HF reads it.
Tokens compared exactly (HF fills finished T5 beams with eos where pad_token_id is 0:
those positions are set to pad before comparing, as in test_hf_seq2seq_generation.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _hf_bart_marian import reload_hf, saved_variant
from _hf_decoders import FAMILIES, hf_model, left_padded, save_hf, transformers
from _hf_t5 import hf_t5, padded_sources
from _hf_t5 import save_hf as save_t5

import qkv
from qkv.models import from_pretrained

DECODERS = ["gpt2", *sorted(FAMILIES)]
SEQ2SEQ = ["t5-v1.0", "flan-t5", "bart", "marian"]

#: Decoder settings that change the tokens: beams with a length penalty and an n-gram ban;
#: greedy with max_length (HF counts the prompt's width), a banned word, a forced last
#: token and two stop ids.
DECODER_SETTINGS = {
    "beams": {"num_beams": 3, "max_new_tokens": 6, "no_repeat_ngram_size": 2,
              "length_penalty": 0.5, "early_stopping": True},
    "greedy": {"max_length": 16, "min_new_tokens": 2, "bad_words_ids": [[5]],
               "forced_eos_token_id": 7, "eos_token_id": [2, 9]},
}
SEQ2SEQ_SETTINGS = {"num_beams": 3, "max_length": 8, "no_repeat_ngram_size": 2,
                    "length_penalty": 0.7}


def _update_json(path: Path, **fields) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**data, **fields}))


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2,
                                     n_head=4, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln_" not in name:
                p.copy_(0.3 * torch.randn_like(p))
    return model


def _decoder_dir(name: str, directory: Path, settings: dict) -> Path:
    hf = _gpt2() if name == "gpt2" else hf_model(name)
    save_hf(hf, directory)
    _update_json(directory / "generation_config.json", **settings)
    return directory


def _hf_decoder(directory: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="eager").eval()


@pytest.mark.parametrize("kind", sorted(DECODER_SETTINGS))
@pytest.mark.parametrize("name", DECODERS)
def test_decoder_directory_settings_are_generates_defaults(name, kind, tmp_path):
    directory = _decoder_dir(name, tmp_path / name, DECODER_SETTINGS[kind])
    ours, hf = from_pretrained(directory), _hf_decoder(directory)
    ids, mask = left_padded()
    got = qkv.generate(ours, ids, attention_mask=mask)  # only what HF is given below
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=mask)
    assert got.tolist() == want.tolist()
    off = qkv.generate(ours, ids, attention_mask=mask, settings=None,
                       max_new_tokens=got.shape[1] - ids.shape[1])
    assert off.tolist() != got.tolist(), "the file must change these tokens"
    # an argument passed overrides the file, on both sides alike
    got = qkv.generate(ours, ids, attention_mask=mask, num_beams=1, max_new_tokens=4)
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=mask, num_beams=1, max_new_tokens=4)
    assert got.tolist() == want.tolist()


def _seq2seq_dir(name: str, directory: Path) -> tuple[Path, torch.nn.Module | None]:
    if name.startswith("t5") or name.startswith("flan"):
        save_t5(hf_t5(name), directory)
    else:
        saved_variant(name, directory)
    _update_json(directory / "generation_config.json", **SEQ2SEQ_SETTINGS)
    return directory


def _hf_seq2seq(name: str, directory: Path):
    if name in ("bart", "marian"):
        return reload_hf(name, directory)
    return transformers.T5ForConditionalGeneration.from_pretrained(
        directory, attn_implementation="eager").eval()


def _hf_tokens(name: str, hf, src, mask, **kw) -> list[list[int]]:
    with torch.no_grad():
        # T5: transformers' cache is sized by num_layers, wrong for num_decoder_layers !=
        # num_layers (tests/models/_hf_t5.py), hence no cache
        out = hf.generate(input_ids=src, attention_mask=mask.long(),
                          **({"use_cache": False} if "t5" in name else {}), **kw).clone()
    c = hf.config
    if c.pad_token_id == 0:  # HF fills finished beams with eos when pad is 0: as pad here
        for row in out:
            hits = (row[1:] == c.eos_token_id).nonzero()
            if len(hits):
                row[2 + int(hits[0]):] = c.pad_token_id
    return out.tolist()


def _sources(model) -> tuple[torch.Tensor, torch.Tensor]:
    if model.config.pad_id == 0:  # the T5 fixtures
        src, mask = padded_sources()
        return src, mask.bool()
    g = torch.Generator().manual_seed(1)
    c = model.config
    src = torch.randint(3, min(c.src_vocab_size, c.tgt_vocab_size) - 1, (3, 9), generator=g)
    src[src == c.pad_id] = 5
    mask = torch.arange(9)[None, :] < torch.tensor([9, 6, 3])[:, None]
    return src.masked_fill(~mask, c.pad_id), mask


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_seq2seq_directory_settings_are_generates_defaults(name, tmp_path):
    directory = _seq2seq_dir(name, tmp_path / name)
    ours, hf = from_pretrained(directory), _hf_seq2seq(name, directory)
    src, mask = _sources(ours)
    got = qkv.generate(ours, src, attention_mask=mask)
    assert got.tolist() == _hf_tokens(name, hf, src, mask)
    off = qkv.generate(ours, src, attention_mask=mask, settings=None,
                       max_new_tokens=got.shape[1] - 1)
    assert off.tolist() != got.tolist(), "the file must change these tokens"
    got = qkv.generate(ours, src, attention_mask=mask, num_beams=1, max_new_tokens=5)
    assert got.tolist() == _hf_tokens(name, hf, src, mask, num_beams=1, max_new_tokens=5)


def test_config_json_generation_fields_are_the_defaults_without_generation_config(tmp_path):
    """An older checkpoint (opus-mt, BART-large-CNN) holds its generation fields at the top
    of config.json and has no generation_config.json: HF's generate applies them, and so
    does qkv's."""
    directory = saved_variant("marian", tmp_path / "marian")
    (directory / "generation_config.json").unlink()
    _update_json(directory / "config.json", num_beams=3, max_length=7, bad_words_ids=[[46]],
                 no_repeat_ngram_size=2)
    ours, hf = from_pretrained(directory), reload_hf("marian", directory)
    assert ours.generation_settings.source == directory / "config.json"
    src, mask = _sources(ours)
    got = qkv.generate(ours, src, attention_mask=mask)
    assert got.tolist() == _hf_tokens("marian", hf, src, mask)
    assert got.shape[1] <= 7 and got.tolist() != qkv.generate(
        ours, src, attention_mask=mask, settings=None, max_new_tokens=6).tolist()


def test_sampling_settings_apply_only_to_a_call_that_samples(tmp_path):
    """A file that samples (as Llama 3's does: do_sample, temperature, top_p) samples by
    default, with HF's top_k 50 where it sets none; do_sample=False decodes greedily with
    its other settings; the draws are qkv's own (same generator, same tokens)."""
    directory = _decoder_dir("llama", tmp_path / "llama",
                             {"do_sample": True, "temperature": 0.7, "top_p": 0.9,
                              "max_new_tokens": 5})
    ours = from_pretrained(directory)
    ids, mask = left_padded()

    def run(**kw):
        return qkv.generate(ours, ids, attention_mask=mask,
                            generator=torch.Generator().manual_seed(3), **kw).tolist()

    plain = {"settings": None, "max_new_tokens": 5, "eos_token_id": 2}  # the file's eos
    assert run() == run(do_sample=True, temperature=0.7, top_p=0.9, top_k=50, **plain)
    assert run(do_sample=False) == run(**plain) != run()
    assert run(top_k=None) == run(do_sample=True, temperature=0.7, top_p=0.9, **plain)


def test_settings_argument_and_refusals(tmp_path):
    directory = _decoder_dir("qwen2", tmp_path / "qwen2", DECODER_SETTINGS["beams"])
    ours = from_pretrained(directory)
    ids, mask = left_padded()
    by_path = qkv.generate(ours, ids, attention_mask=mask, settings=directory)
    assert by_path.tolist() == qkv.generate(ours, ids, attention_mask=mask).tolist()
    with pytest.raises(TypeError, match="settings must be a GenerationSettings"):
        qkv.generate(ours, ids, settings={"num_beams": 2})
    with pytest.raises(ValueError, match=r"max_new_tokens is required$"):
        qkv.generate(ours, ids, settings=None)
    # a file with a field qkv does not implement: the model loads, generate refuses it
    # (naming the field) unless the call decodes without the file
    _update_json(directory / "generation_config.json", repetition_penalty=1.2)
    ours = from_pretrained(directory)
    with pytest.raises(ValueError, match=r"repetition_penalty=1\.2 is not supported"):
        qkv.generate(ours, ids, attention_mask=mask)
    qkv.generate(ours, ids, attention_mask=mask, settings=None, max_new_tokens=2)
    # a sampling filter the file's own do_sample leaves off: refused once a call samples
    _update_json(directory / "generation_config.json", repetition_penalty=None,
                 typical_p=0.5)
    ours = from_pretrained(directory)
    qkv.generate(ours, ids, attention_mask=mask, num_beams=1)
    with pytest.raises(ValueError, match="typical_p"):
        qkv.generate(ours, ids, attention_mask=mask, num_beams=1, do_sample=True)


def test_explain_says_which_arguments_come_from_the_file(tmp_path):
    directory = _decoder_dir("mistral", tmp_path / "mistral", DECODER_SETTINGS["beams"])
    text = qkv.generation.explain(from_pretrained(directory))
    line = text.splitlines()[-1]
    assert "generation_config.json" in line and "num_beams=3" in line
    assert "no_repeat_ngram_size=2" in line and "max_new_tokens=6" in line
    plain = qkv.generation.explain(qkv.models.GPT(qkv.models.GPTConfig(
        vocab_size=11, max_len=8, dim=8, num_layers=1, num_heads=2)))
    assert plain.splitlines()[-1].strip() == "settings: none (qkv's defaults)"
