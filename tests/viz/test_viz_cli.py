"""``qkv attention RUN``: PNGs and the HTML page from a run directory built here.

Shapes: S source length, T target length.

The run directory is what ``qkv train`` writes (config.json + model.safetensors,
tokenizer.json, run.json); the page must hold exactly the weights ``attention_maps`` gives
for the input framed as in training (source + eos; bos + target), at 4 decimals.
"""

from __future__ import annotations

import json
import re

import matplotlib.image
import pytest
import torch

from qkv.cli import main
from qkv.data import CharTokenizer
from qkv.models import GPT, GPTConfig, Transformer, TransformerConfig
from qkv.viz import attention_maps

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 -年月日"


def make_run(path, model, kind: str, tok: CharTokenizer, **info):
    model.save_pretrained(path)
    tok.save(path / "tokenizer.json")
    (path / "run.json").write_text(json.dumps({"model": kind, **info}))
    return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    torch.manual_seed(0)
    tok = CharTokenizer(ALPHABET)
    cfg = TransformerConfig.from_name("transformer-tiny", src_vocab_size=tok.vocab_size,
                                      tgt_vocab_size=tok.vocab_size)
    return make_run(tmp_path_factory.mktemp("run"), Transformer(cfg), "transformer", tok), tok


def page_data(path) -> dict:
    text = path.read_text(encoding="utf-8")
    payload = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', text,
                        re.S).group(1)
    return json.loads(payload)


def test_teacher_forced_run_writes_pngs_and_the_page(run_dir, tmp_path, capsys):
    run, tok = run_dir
    out = tmp_path / "viz"
    assert main(["attention", str(run), "--input", "march 5", "--target", "2024-03-05",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    names = ["attention_encoder.png", "attention_decoder.png", "attention_cross.png",
             "attention_alignment.png", "attention.html"]
    assert printed == [str(out / n) for n in names]
    for n in names[:-1]:
        assert matplotlib.image.imread(out / n).shape[2] == 4
    model = Transformer.from_pretrained(run)
    src = [*tok.encode("march 5"), tok.eos_id]
    tgt = [tok.bos_id, *tok.encode("2024-03-05")]
    maps = attention_maps(model, src, target_ids=tgt)
    data = page_data(out / "attention.html")
    for m in data["maps"]:
        torch.testing.assert_close(torch.tensor(m["w"], dtype=torch.float64),
                                   maps[m["name"]].double(), atol=0.5e-4 + 1e-9, rtol=0)
    cross = data["maps"][2]
    assert cross["keys"] == tok.tokens(src) and cross["queries"] == tok.tokens(tgt)


def test_generated_target_and_layer_head_selection(run_dir, tmp_path, capsys):
    run, _ = run_dir
    out = tmp_path / "gen"
    assert main(["attention", str(run), "--input", "2024年3月5日", "--max-new-tokens", "3",
                 "--layer", "-1", "--head", "1", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("generated target: ")
    data = page_data(out / "attention.html")
    assert data["initial"] == {"map": 0, "layer": 1, "head": 1}
    assert len(data["maps"][1]["queries"]) <= 4  # bos + at most 3 generated tokens
    assert [m["layers"] for m in data["maps"]] == [2, 2, 2]  # the page keeps every layer


def test_cached_greedy_decoding_equals_full_recomputation():
    from qkv.cli.attention import _generate

    class Tok:
        pad_id, bos_id, eos_id = 0, 1, 2

    torch.manual_seed(3)
    model = Transformer(TransformerConfig.from_name("transformer-tiny")).eval()
    src, out = [5, 9, 7, 12, 2], [1]
    with torch.no_grad():
        for _ in range(6):
            nxt = int(model(torch.tensor([src]), torch.tensor([out]))[0, -1].argmax())
            if nxt == 2:
                break
            out.append(nxt)
    assert _generate(model, src, Tok, 6, encoder_decoder=True) == out
    gpt = GPT(GPTConfig.from_name("gpt-tiny", vocab_size=32, max_len=32, dim=32)).eval()
    ids = [1, 7, 8, 9]
    with torch.no_grad():
        for _ in range(6):
            nxt = int(gpt(torch.tensor([ids]))[0, -1].argmax())
            if nxt == 2:
                break
            ids.append(nxt)
    assert _generate(gpt, [1, 7, 8, 9], Tok, 6, encoder_decoder=False) == ids


def test_gpt_run(tmp_path, capsys):
    tok = CharTokenizer(ALPHABET)
    model = GPT(GPTConfig.from_name("gpt-tiny", vocab_size=tok.vocab_size, max_len=32,
                                    dim=32))
    run = make_run(tmp_path / "gpt", model, "gpt", tok, task=None, data="corpus.txt")
    assert main(["attention", str(run), "--input", "the cat"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(run / "attention" / n)
                       for n in ("attention_decoder.png", "attention.html")]
    data = page_data(run / "attention" / "attention.html")
    assert data["maps"][0]["queries"] == tok.tokens(tok.encode("the cat"))  # plain text


@pytest.mark.parametrize(("args", "message"), [
    (["attention", "{missing}", "--input", "x"], "no such run directory"),
    (["attention", "{run}", "--input", "  "], "--input is empty"),
    (["attention", "{run}", "--input", "ab", "--layer", "7"], "--layer 7 is out of range"),
    (["attention", "{run}", "--input", "ab", "--head", "-9"], "--head -9 is out of range"),
])
def test_bad_arguments_are_one_line_errors(run_dir, tmp_path, capsys, args, message):
    run, _ = run_dir
    argv = [a.format(run=run, missing=tmp_path / "nope") for a in args]
    argv += ["--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv attention: error: ") and message in err
    assert len(err.strip().splitlines()) == 1


def test_help_has_examples(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["attention", "--help"])
    assert exc.value.code == 0
    assert "examples:" in capsys.readouterr().out
