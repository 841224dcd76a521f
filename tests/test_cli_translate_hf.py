"""``qkv.generation.translate`` and ``qkv translate DIR`` on an HF encoder-decoder directory
(``qkv.demos.tiny_marian``: random weights, SentencePiece tokenizers), against transformers:
``MarianMTModel.generate(**MarianTokenizer(texts, padding=True))`` +
``batch_decode(skip_special_tokens=True)``, the strings compared exactly.

- the directory's generation_config.json applied by default (opus-mt's: 4 beams,
  bad_words_ids [[pad]], forced_eos_token_id, renormalize_logits, max_length 24); explicit
  options override it (greedy, other beams, no_repeat_ngram_size, length_penalty,
  early_stopping, max_new_tokens); another file's settings (no_repeat_ngram_size, min_length,
  length_penalty) read as HF reads them;
- pad never generated: with pad's logit raised by 8, qkv without the settings' bad words
  differs from HF, with them it is HF's output;
- the CLI: --input / --file / --beams / --max-new-tokens print HF's outputs, one per line;
  --int8 prints what ``translate`` gives on the int8 model; one-line errors for missing
  tokenizer files, a missing vocab.json, an unsupported generation field, a --stop text of
  several tokens.

Shapes: B = 5 sources (right-padded, lengths 3 .. 22), V ~ 300 vocab.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from qkv.cli import main
from qkv.data.seq2seq_tokenizer import load_seq2seq_tokenizer
from qkv.demos.tiny_marian import make_tiny_marian
from qkv.generation import translate
from qkv.models import from_pretrained
from qkv.models.generation_settings import read_generation_settings

transformers = pytest.importorskip("transformers")

TEXTS = ["Attention lets every token look at every other token.", "Where is the bookshop?",
         "x", "The train to Shanghai leaves at noon, and we will meet at the station.",
         "unseen: zebra!"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_marian(tmp_path_factory.mktemp("tiny") / "tiny-marian")


def _hf(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MarianTokenizer: "Recommended: pip install sacremoses"
        tok = transformers.MarianTokenizer.from_pretrained(path)
    model = transformers.MarianMTModel.from_pretrained(path, attn_implementation="eager")
    return model.eval(), tok


def hf_translate(path, texts, **kwargs) -> list[str]:
    """transformers' outputs for ``texts``: ``generate`` on the padded batch (its
    generation_config.json, ``kwargs`` over it), ``batch_decode(skip_special_tokens=True)``."""
    model, tok = _hf(path)
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Both max_new_tokens and max_length seem set"
        out = model.generate(**batch, **kwargs)
    return tok.batch_decode(out, skip_special_tokens=True)


def _copy(tiny, where, generation: dict | None = None):
    out = where / "copy"
    shutil.copytree(tiny, out)
    if generation is not None:
        path = out / "generation_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **generation}))
    return out


def test_the_directory_settings_are_the_defaults(tiny):
    model, tok = from_pretrained(tiny), load_seq2seq_tokenizer(tiny)
    want = hf_translate(tiny, TEXTS)
    assert translate(model, tok, TEXTS, settings=tiny) == want
    assert translate(model, tok, TEXTS, settings=read_generation_settings(tiny),
                     batch_size=2) == want  # batches of 2: the same outputs
    # the model from_pretrained loaded carries them: they are translate's default too
    assert model.generation_settings == read_generation_settings(tiny)
    assert translate(model, tok, TEXTS) == want
    assert translate(model, tok, TEXTS, settings=None) != want  # greedy, up to 63 tokens


@pytest.mark.parametrize("options", [
    {"num_beams": 1},
    {"num_beams": 3, "no_repeat_ngram_size": 2, "length_penalty": 0.5},
    {"num_beams": 2, "early_stopping": True, "length_penalty": 2.0},
    {"num_beams": 1, "no_repeat_ngram_size": 1, "max_new_tokens": 7},
], ids=["greedy", "beams3-ngram2", "beams2-early", "greedy-ngram1-7"])
def test_explicit_options_override_the_settings(tiny, options):
    model, tok = from_pretrained(tiny), load_seq2seq_tokenizer(tiny)
    assert translate(model, tok, TEXTS, settings=tiny, **options) == hf_translate(
        tiny, TEXTS, **options)


def test_another_files_settings(tiny, tmp_path):
    path = _copy(tiny, tmp_path, {"num_beams": 3, "no_repeat_ngram_size": 2, "min_length": 12,
                                  "length_penalty": 0.7, "max_length": 16})
    model, tok = from_pretrained(path), load_seq2seq_tokenizer(path)
    got = translate(model, tok, TEXTS, settings=path)
    assert got == hf_translate(path, TEXTS)
    assert got != translate(model, tok, TEXTS, settings=tiny, max_new_tokens=15)


def test_pad_is_never_generated(tiny, tmp_path):
    path = _copy(tiny, tmp_path)
    weights = path / "model.safetensors"
    state = load_file(weights)
    pad = load_seq2seq_tokenizer(path).pad_id
    state["final_logits_bias"][0, pad] += 8.0  # pad the likeliest token almost everywhere
    save_file(state, weights, metadata={"format": "pt"})
    model, tok = from_pretrained(path), load_seq2seq_tokenizer(path)
    want = hf_translate(path, TEXTS)
    assert all(want)  # HF generated tokens other than pad
    assert translate(model, tok, TEXTS, settings=path) == want
    unbanned = read_generation_settings(path).generate_kwargs(encoder_decoder=True)
    del unbanned["bad_words_ids"]
    assert translate(model, tok, TEXTS, settings=None, **unbanned) != want


def _cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["translate", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_prints_hfs_outputs(tiny, tmp_path, capsys):
    args = [a for t in TEXTS[:3] for a in ("--input", t)]
    rc, out, _ = _cli(capsys, tiny, *args)
    assert rc == 0 and out.splitlines() == hf_translate(tiny, TEXTS[:3])
    lines = tmp_path / "inputs.txt"
    lines.write_text("\n".join(TEXTS) + "\n\n", encoding="utf-8")
    rc, out, _ = _cli(capsys, tiny, "--file", lines, "--beams", "1", "--max-new-tokens", "5")
    assert rc == 0
    assert out.splitlines() == hf_translate(tiny, TEXTS, num_beams=1, max_new_tokens=5)


def test_cli_int8(tiny, capsys):
    from qkv.generation.quantize import quantize

    rc, out, _ = _cli(capsys, tiny, "--input", TEXTS[0], "--input", TEXTS[1], "--int8")
    model = quantize(from_pretrained(tiny), "int8")
    assert rc == 0
    assert out.splitlines() == translate(model, load_seq2seq_tokenizer(tiny), TEXTS[:2],
                                         settings=tiny)


@pytest.mark.parametrize("case", ["no-tokenizer", "no-vocab", "repetition-penalty", "stop"])
def test_cli_one_line_errors(tiny, tmp_path, capsys, case):
    path = _copy(tiny, tmp_path)
    extra = []
    if case == "no-tokenizer":
        for name in ("source.spm", "target.spm", "vocab.json", "tokenizer_config.json"):
            (path / name).unlink()
        want = "no tokenizer files (tokenizer.json, spiece.model, or source.spm"
    elif case == "no-vocab":
        (path / "vocab.json").unlink()
        want = "vocab.json is missing"
    elif case == "repetition-penalty":
        gen = path / "generation_config.json"
        gen.write_text(json.dumps({**json.loads(gen.read_text()), "repetition_penalty": 1.2}))
        want = "repetition_penalty=1.2 is not supported by qkv"
    else:
        extra, want = ["--stop", "bookshop"], "--stop 'bookshop' is 2 tokens"
    rc, out, err = _cli(capsys, path, "--input", "hello", *extra)
    assert rc == 2 and not out
    assert len(err.strip().splitlines()) == 1 and want in err, err
