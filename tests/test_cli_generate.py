"""``qkv generate`` / ``qkv translate``: outputs equal qkv.generate on the same run, prompts
framed as in training, one-line errors. Run directories are built here (save_pretrained +
tokenizer.json + run.json), as ``qkv train`` writes them."""

from __future__ import annotations

import json

import pytest
import torch

import qkv
from qkv.cli import main
from qkv.data import CharTokenizer
from qkv.models import GPT, GPTConfig, Transformer, TransformerConfig

ALPHABET = "abcdefgh "


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _spread(model):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5)
    return model.eval()


def _run_dir(path, model, info):
    path.mkdir()
    model.save_pretrained(path)
    CharTokenizer(ALPHABET).save(path / "tokenizer.json")
    (path / "run.json").write_text(json.dumps(info))
    return str(path)


@pytest.fixture(scope="module")
def tok():
    return CharTokenizer(ALPHABET)


@pytest.fixture(scope="module")
def gpt(tok):
    torch.manual_seed(0)
    return _spread(GPT(GPTConfig(vocab_size=tok.vocab_size, max_len=32, dim=32, num_layers=2,
                                 num_heads=4)))


@pytest.fixture(scope="module")
def seq2seq(tok):
    torch.manual_seed(0)
    cfg = TransformerConfig(src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size,
                            dim=32, num_encoder_layers=2, num_decoder_layers=2, num_heads=4,
                            ffn_hidden=64, dropout=0.0, max_len=32, norm_first=True,
                            scale_embeddings=False)
    return _spread(Transformer(cfg))


def _cut(ids, eos):
    return ids[:ids.index(eos)] if eos in ids else ids


def test_generate_text_lm_continues_the_prompt(tmp_path, capsys, gpt, tok):
    run = _run_dir(tmp_path / "lm", gpt, {"model": "gpt", "task": None})
    assert main(["generate", run, "--prompt", "abc", "--prompt", "h", "--max-new-tokens",
                 "6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for prompt, line in zip(["abc", "h"], lines, strict=True):
        ids = torch.tensor([tok.encode(prompt)])
        want = qkv.generate(gpt, ids, max_new_tokens=6, eos_token_id=tok.eos_id)[0].tolist()
        assert line == tok.decode(tok.encode(prompt) + _cut(want[len(prompt):], tok.eos_id))
        assert line.startswith(prompt)


def test_generate_task_gpt_frames_prompt_and_prints_answer(tmp_path, capsys, gpt, tok):
    run = _run_dir(tmp_path / "task", gpt, {"model": "gpt", "task": "dates"})
    assert main(["generate", run, "--prompt", "abc", "--beams", "3", "--max-new-tokens",
                 "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    ids = torch.tensor([[tok.bos_id, *tok.encode("abc"), tok.eos_id]])
    want = qkv.generate(gpt, ids, max_new_tokens=5, num_beams=3, eos_token_id=tok.eos_id,
                        pad_token_id=tok.pad_id)[0, 5:].tolist()
    assert out == [tok.decode(_cut(want, tok.eos_id))]


def test_generate_sampling_is_seeded(tmp_path, capsys, gpt):
    run = _run_dir(tmp_path / "lm", gpt, {"model": "gpt"})
    args = ["generate", run, "--prompt", "ab", "--sample", "--top-p", "0.9", "--temperature",
            "1.5", "--max-new-tokens", "12"]
    outs = []
    for seed in ("1", "1", "2"):
        assert main([*args, "--seed", seed]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0] != outs[2]


def test_translate_inputs_and_files(tmp_path, capsys, seq2seq, tok):
    run = _run_dir(tmp_path / "mt", seq2seq, {"model": "transformer", "task": "dates"})
    texts = ["abc", "hg fe", "a"]
    src = [[*tok.encode(t), tok.eos_id] for t in texts]
    width = max(map(len, src))
    ids = torch.tensor([s + [tok.pad_id] * (width - len(s)) for s in src])
    want = [tok.decode(_cut(r[1:], tok.eos_id))
            for r in qkv.generate(seq2seq, ids, max_new_tokens=10).tolist()]
    assert main(["translate", run, *[a for t in texts for a in ("--input", t)],
                 "--max-new-tokens", "10"]) == 0
    assert capsys.readouterr().out.splitlines() == want
    tsv = tmp_path / "in.tsv"
    tsv.write_text("".join(f"{t}\tignored\n" for t in texts))
    txt = tmp_path / "in.txt"
    txt.write_text("\n".join(texts) + "\n\n")
    for f in (tsv, txt):
        assert main(["translate", run, "--file", str(f), "--max-new-tokens", "10"]) == 0
        assert capsys.readouterr().out.splitlines() == want


@pytest.mark.parametrize("args, message", [
    (["generate", "{missing}", "--prompt", "a"], "no such run directory"),
    (["translate", "{gpt}", "--input", "a"], "needs a Transformer run (use qkv generate)"),
    (["generate", "{mt}", "--prompt", "a"], "needs a GPT run (use qkv translate)"),
    (["generate", "{gpt}", "--prompt", "a", "--top-k", "3"], "--top-k applies only with --sample"),
    (["generate", "{gpt}", "--prompt", "a", "--beams", "0"], "--beams: must be an integer"),
    (["generate", "{gpt}", "--prompt", "a", "--sample", "--temperature", "0"], "temperature"),
    (["generate", "{gpt}", "--prompt", "a" * 40], "max_len"),
    (["translate", "{mt}", "--file", "{missing}"], "cannot read"),
])
def test_errors_are_one_line(tmp_path, capsys, gpt, seq2seq, args, message):
    dirs = {"gpt": _run_dir(tmp_path / "g", gpt, {"model": "gpt"}),
            "mt": _run_dir(tmp_path / "t", seq2seq, {"model": "transformer"}),
            "missing": str(tmp_path / "nope")}
    try:
        code = main([a.format(**dirs) for a in args])
    except SystemExit as exc:  # argparse refused a value
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_int8_decodes_with_the_quantized_model(tmp_path, capsys, monkeypatch, gpt, seq2seq,
                                               tok):
    """--int8: the decoding functions get the quantized model, the outputs are those of
    qkv.quantize(model) on the same run, and the run directory is left as it was."""
    import copy

    import qkv.generation
    from qkv.generation.quantize import is_quantized

    seen = []
    for name in ("complete", "translate"):
        real = getattr(qkv.generation, name)

        def spy(model, *args, _real=real, **kwargs):
            seen.append(is_quantized(model))
            return _real(model, *args, **kwargs)

        monkeypatch.setattr(qkv.generation, name, spy)

    run = _run_dir(tmp_path / "lm", gpt, {"model": "gpt", "task": None})
    q = qkv.quantize(copy.deepcopy(gpt), "int8")
    before = sorted(p.name for p in (tmp_path / "lm").iterdir())
    assert main(["generate", run, "--prompt", "abc", "--max-new-tokens", "8", "--int8"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    ids = torch.tensor([tok.encode("abc")])
    want = qkv.generate(q, ids, max_new_tokens=8, eos_token_id=tok.eos_id)[0, 3:].tolist()
    assert line == tok.decode(tok.encode("abc") + _cut(want, tok.eos_id))
    assert sorted(p.name for p in (tmp_path / "lm").iterdir()) == before

    mt = _run_dir(tmp_path / "mt", seq2seq, {"model": "transformer", "task": "dates"})
    qs = qkv.quantize(copy.deepcopy(seq2seq), "int8")
    texts = ["abc", "hg fe"]
    src = [[*tok.encode(t), tok.eos_id] for t in texts]
    width = max(map(len, src))
    ids = torch.tensor([s + [tok.pad_id] * (width - len(s)) for s in src])
    want = [tok.decode(_cut(r[1:], tok.eos_id))
            for r in qkv.generate(qs, ids, max_new_tokens=10, num_beams=2).tolist()]
    assert main(["translate", mt, *[a for t in texts for a in ("--input", t)],
                 "--max-new-tokens", "10", "--beams", "2", "--int8"]) == 0
    assert capsys.readouterr().out.splitlines() == want
    assert seen == [True, True]
