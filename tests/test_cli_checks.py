"""Every command but ``qkv train`` catches user errors up front, the same way.

- Every numeric flag: a bad value (NaN, infinity, out of range, too large for the model or
  for this machine's memory) ends the command with exit status 2 and one line on stderr
  naming the flag and the value — no traceback, nothing written.
- Every command that writes a directory refuses a non-empty one (``qkv.outputs``); ``qkv
  attention`` may replace only its own files, and never writes inside a checkpoint.
- ``qkv bench``: a length that cannot fit the memory is refused before anything runs; a
  case that fails later is a row saying why, after the finished cases' tables and plot.
- ``qkv generate`` shows the prompt as typed, even with characters the tokenizer drops.

Run directories are built here (save_pretrained + tokenizer.json + run.json), as ``qkv
train`` writes them; models are tiny and untrained.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import qkv
from qkv import bench
from qkv.cli import main
from qkv.data import CharTokenizer
from qkv.models import GPT, GPTConfig, Transformer, TransformerConfig

ALPHABET = "abcdefgh "
HUGE = str(10**13)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def cli(argv: list[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``qkv ARGV``; argparse's own errors raise
    SystemExit, as the console script exits."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as done:
            code = done.code
    return code, out.getvalue(), err.getvalue()


def one_line_error(code: int, err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2, (code, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("qkv ") and ": error: " in lines[0], err
    for needle in needles:
        assert needle in lines[0], (needle, err)


def make_run(path, model, info, *, checkpoint: bool = False):
    """A run directory as ``qkv train`` writes it (``checkpoint``: the model in
    RUN/checkpoint beside RUN/run.json) or a bare model directory."""
    where = path / "checkpoint" if checkpoint else path
    where.mkdir(parents=True)
    model.save_pretrained(where)
    CharTokenizer(ALPHABET).save(where / "tokenizer.json")
    (path / "run.json").write_text(json.dumps(info))
    return path


@pytest.fixture(scope="module")
def tok():
    return CharTokenizer(ALPHABET)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tok):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("runs")
    gpt = GPT(GPTConfig(vocab_size=tok.vocab_size, max_len=32, dim=32, num_layers=2,
                        num_heads=4)).eval()
    small = dict(src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size, dim=32,
                 num_encoder_layers=2, num_decoder_layers=2, num_heads=4, ffn_hidden=64,
                 dropout=0.0, max_len=32)
    mt = Transformer(TransformerConfig(**small)).eval()
    rel = Transformer(TransformerConfig(**small, positions="t5")).eval()
    return {"gpt": str(make_run(root / "gpt", gpt, {"model": "gpt", "task": None},
                                checkpoint=True)),
            "mt": str(make_run(root / "mt", mt, {"model": "transformer"}, checkpoint=True)),
            "rel": str(make_run(root / "rel", rel, {"model": "transformer"})),
            "gpt_model": gpt}


# -- every numeric flag ------------------------------------------------------------------

GEN = ["generate", "{gpt}", "--prompt", "abc"]
SAMPLE = [*GEN, "--sample"]
TRANSLATE = ["translate", "{mt}", "--input", "abc"]
ATTENTION = ["attention", "{mt}", "--input", "abc", "--target", "ab", "--out", "{tmp}/o"]

BAD_VALUES = [
    # qkv demo (dates / coref / tour)
    (["demo", "--quick", "--seed", "1e23"], "--seed", "1e23"),
    (["demo", "--quick", "--seed", str(10**23)], "--seed", str(10**23)),
    (["demo", "coref", "--quick", "--seed", "-1"], "--seed", "-1"),
    (["demo", "tour", "--seed", str(2**64)], "--seed", "0..9223372036854775807"),
    (["demo", "tour", "--length", "0"], "--length", "'0'"),
    (["demo", "tour", "--length", "-5"], "--length", "'-5'"),
    (["demo", "tour", "--length", "nan"], "--length", "'nan'"),
    (["demo", "tour", "--length", HUGE], "--length", HUGE),  # memory
    (["demo", "coref", "--length", "64"], "--length", "tour"),
    # qkv generate
    ([*SAMPLE, "--temperature", "nan"], "--temperature", "nan"),
    ([*SAMPLE, "--temperature", "-1"], "--temperature", "-1"),
    ([*SAMPLE, "--temperature", "0"], "--temperature", "'0'"),
    ([*SAMPLE, "--temperature", "inf"], "--temperature", "inf"),
    ([*SAMPLE, "--top-p", "2"], "--top-p", "'2'"),
    ([*SAMPLE, "--top-p", "0"], "--top-p", "'0'"),
    ([*SAMPLE, "--top-p", "nan"], "--top-p", "nan"),
    ([*SAMPLE, "--top-k", "-1"], "--top-k", "-1"),
    ([*SAMPLE, "--top-k", "0"], "--top-k", "'0'"),
    ([*SAMPLE, "--seed", "-3"], "--seed", "-3"),
    ([*GEN, "--max-new-tokens", "0"], "--max-new-tokens", "'0'"),
    ([*GEN, "--max-new-tokens", HUGE], "--max-new-tokens", HUGE),  # max_len
    ([*GEN, "--beams", "0"], "--beams", "'0'"),
    ([*GEN, "--beams", HUGE], "--beams", HUGE),  # memory
    ([*GEN, "--length-penalty", "nan"], "--length-penalty", "nan"),
    ([*GEN, "--length-penalty=-inf"], "--length-penalty", "-inf"),
    # qkv translate
    ([*TRANSLATE, "--max-new-tokens", "-2"], "--max-new-tokens", "-2"),
    ([*TRANSLATE, "--max-new-tokens", "40"], "--max-new-tokens", "max_len=32"),
    (["translate", "{rel}", "--input", "abc", "--max-new-tokens", HUGE], "--max-new-tokens",
     HUGE),  # relative positions: memory
    ([*TRANSLATE, "--beams", "-1"], "--beams", "-1"),
    ([*TRANSLATE, "--length-penalty", "inf"], "--length-penalty", "inf"),
    # qkv attention
    ([*ATTENTION, "--layer", "2"], "--layer", "2"),
    ([*ATTENTION, "--layer", "-3"], "--layer", "-3"),
    ([*ATTENTION, "--head", "4"], "--head", "4"),
    ([*ATTENTION, "--head", "x"], "--head", "'x'"),
    ([*ATTENTION, "--max-new-tokens", "0"], "--max-new-tokens", "'0'"),
    (["attention", "{rel}", "--input", "abc", "--max-new-tokens", HUGE, "--out", "{tmp}/o"],
     "--max-new-tokens", HUGE),  # relative positions: memory
    # qkv bench attention
    (["bench", "attention", "--quick", "--threads", "0"], "--threads", "'0'"),
    (["bench", "attention", "--quick", "--threads", "100000"], "--threads", "100000"),
    (["bench", "attention", "--quick", "--repeat", "0"], "--repeat", "'0'"),
    (["bench", "attention", "--quick", "--window", "-1"], "--window", "-1"),
    (["bench", "attention", "--quick", "--lengths", "0,128"], "--lengths", "0,128"),
    (["bench", "attention", "--quick", "--lengths", HUGE], "--lengths", HUGE),  # memory
]


@pytest.mark.parametrize(("argv", "flag", "value"), BAD_VALUES,
                         ids=[" ".join(a[:2] + a[-2:]) for a, _, _ in BAD_VALUES])
def test_bad_numeric_value_is_one_line_naming_the_flag(runs, tmp_path, argv, flag, value):
    argv = [a.format(**runs, tmp=tmp_path) for a in argv]
    code, out, err = cli(argv)
    one_line_error(code, err, flag, value)
    assert not out and not (tmp_path / "o").exists()


def test_memory_refusals_give_the_numbers(runs):
    code, _, err = cli(["bench", "attention", "--quick", "--lengths", HUGE])
    one_line_error(code, err, "needs at least", "GiB", "available")
    # 4 tensors of 1×8×N×64 fp32: 8192·N bytes
    assert f"{4 * 8 * 10**13 * 64 * 4 / 2**30:,.1f} GiB" in err


def test_the_seed_range_is_what_torch_accepts():
    from qkv.cli.checks import SEED_MAX, seed

    assert seed(str(SEED_MAX)) == SEED_MAX and seed("0") == 0
    torch.manual_seed(SEED_MAX)
    torch.Generator().manual_seed(SEED_MAX)


# -- --stop ------------------------------------------------------------------------------

@pytest.mark.parametrize(("stop", "message"), [
    ("☃", "'☃' is not in this run's vocabulary"),
    ("ab", "'ab' is 2 tokens of this run's tokenizer ('a' 'b')"),
    ("", "'' is empty"),
])
def test_stop_errors_say_what_is_wrong(runs, stop, message):
    code, _, err = cli(["generate", runs["gpt"], "--prompt", "abc", "--stop", stop])
    one_line_error(code, err, "--stop", message)
    assert "1 tokens" not in err


# -- the echoed prompt -------------------------------------------------------------------

def test_generate_echoes_the_prompt_as_typed(runs, tok):
    prompt = "Once upon"  # 'O', 'n', 'u', 'p' are not in the alphabet
    code, out, err = cli(["generate", runs["gpt"], "--prompt", prompt, "--max-new-tokens",
                          "5"])
    assert code == 0, err
    assert "character(s) unknown to the run's tokenizer" in err  # the warning stays
    ids = tok.encode(prompt)
    want = qkv.generate(runs["gpt_model"], torch.tensor([ids]), max_new_tokens=5,
                        eos_token_id=tok.eos_id)[0, len(ids):].tolist()
    want = want[:want.index(tok.eos_id)] if tok.eos_id in want else want
    assert out.rstrip("\n") == prompt + tok.decode(want)


# -- output directories ------------------------------------------------------------------

def _user_dir(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"mine": true}')
    return path


@pytest.mark.parametrize("which", ["dates", "coref"])
def test_demos_refuse_a_non_empty_out(tmp_path, which):
    out = _user_dir(tmp_path / "mine")
    code, printed, err = cli(["demo", which, "--quick", "--out", str(out)])
    one_line_error(code, err, "--out", str(out), "not empty", "config.json")
    assert not printed  # refused before any training
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    assert (out / "config.json").read_text() == '{"mine": true}'


def test_coref_demo_refuses_a_training_run(runs, tmp_path):
    code, _, err = cli(["demo", "coref", "--quick", "--out", runs["mt"]])
    one_line_error(code, err, "not empty")
    code, _, err = cli(["demo", "coref", "--quick", "--out", runs["mt"] + "/checkpoint/x"])
    one_line_error(code, err, "inside the training checkpoint directory")


def test_tour_refuses_out(tmp_path):
    code, _, err = cli(["demo", "tour", "--length", "64", "--out", str(tmp_path / "t")])
    one_line_error(code, err, "--out", "writes no files")


def test_attention_out_rules(runs, tmp_path):
    base = ["attention", runs["mt"], "--input", "abc", "--target", "ab"]
    out = _user_dir(tmp_path / "mine")
    code, _, err = cli([*base, "--out", str(out)])
    one_line_error(code, err, "--out", "not empty", "config.json")
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    # inside the run's checkpoint: refused, even as a new folder
    code, _, err = cli([*base, "--out", runs["mt"] + "/checkpoint/viz"])
    one_line_error(code, err, "inside the training checkpoint directory")
    # its own earlier files may be replaced: a second run into the same new directory
    fresh = tmp_path / "viz"
    for _ in range(2):
        code, _, err = cli([*base, "--out", str(fresh)])
        assert code == 0, err
    # given RUN/checkpoint, the default is RUN/attention, outside the checkpoint
    code, printed, err = cli(["attention", runs["mt"] + "/checkpoint", "--input", "abc",
                              "--target", "ab"])
    assert code == 0, err
    paths = printed.split()
    assert paths and all(p.startswith(runs["mt"] + "/attention/") for p in paths), paths
    assert not (Path(runs["mt"]) / "checkpoint" / "attention").exists()


def test_output_dir_helper(tmp_path):
    from qkv.outputs import new_output_dir

    assert new_output_dir(tmp_path / "a" / "b").is_dir()  # created with its parents
    assert new_output_dir(tmp_path / "a" / "b") == tmp_path / "a" / "b"  # empty: fine
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        new_output_dir(tmp_path / "f")
    keep = tmp_path / "k"
    keep.mkdir()
    (keep / "attention.html").write_text("old")
    assert new_output_dir(keep, replaceable=["attention.html"]) == keep
    with pytest.raises(ValueError, match=r"--out .* not empty \(holds attention.html\)"):
        new_output_dir(keep)


@pytest.mark.parametrize(("name", "message"), [("plot.txt", "must end in .png"),
                                               ("dir.png", "is a directory")])
def test_bench_out_is_checked_before_measuring(tmp_path, name, message):
    (tmp_path / "dir.png").mkdir()
    code, out, err = cli(["bench", "attention", "--quick", "--out", str(tmp_path / name)])
    one_line_error(code, err, "--out", message)
    assert not out  # nothing measured


# -- bench: refuse up front, keep what was measured ---------------------------------------

def test_bench_refuses_a_length_beyond_the_available_memory(monkeypatch):
    import qkv.cli.checks as checks

    monkeypatch.setattr(checks, "available_memory", lambda: 2**20)  # 1 MiB
    # N=128: 4 × 8·128·64·4 bytes = exactly 1 MiB, fits; N=256 needs 2 MiB
    assert bench.min_bytes("dense", 128) == 2**20
    code, out, err = cli(["bench", "attention", "--quick", "--lengths", "64,256"])
    one_line_error(code, err, "--lengths 256", "needs at least 2 MiB", "1 MiB available")
    assert not out


def test_a_failing_case_is_a_row_and_the_rest_is_kept(tmp_path, monkeypatch):
    real = bench.measure

    def measure(method, n, **kw):
        if (method, n) == ("dense", 128):
            raise RuntimeError("DefaultCPUAllocator: not enough memory: you tried to "
                               "allocate 204800000000 bytes")
        return real(method, n, **kw)

    monkeypatch.setattr(bench, "measure", measure)
    png = tmp_path / "b.png"
    code, out, err = cli(["bench", "attention", "--quick", "--methods", "dense,linear",
                          "--out", str(png)])
    assert code == 1, err
    assert "1 of 4 cases failed" in err and "Traceback" not in err
    seconds = out.split("peak MiB above the inputs:")[0]
    dense = next(line for line in seconds.splitlines() if line.startswith("| dense"))
    assert dense.split("|")[2].strip() == "failed"  # N=128
    assert float(dense.split("|")[3]) > 0  # N=256 measured after the failure
    linear = next(line for line in seconds.splitlines() if line.startswith("| causal linear"))
    assert all(float(c) > 0 for c in linear.split("|")[2:4])
    assert "| dense causal SDPA | 128 | DefaultCPUAllocator: not enough memory" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ctrl_c_keeps_the_finished_cases(tmp_path, monkeypatch):
    real = bench.measure

    def measure(method, n, **kw):
        if n == 256:
            raise KeyboardInterrupt
        return real(method, n, **kw)

    monkeypatch.setattr(bench, "measure", measure)
    code, out, err = cli(["bench", "attention", "--quick", "--methods", "linear",
                          "--out", str(tmp_path / "b.png")])
    assert code == 130, err
    assert "| causal linear (elu) | 256 | interrupted |" in out
    row = next(line for line in out.splitlines() if line.startswith("| causal linear"))
    assert float(row.split("|")[2]) > 0  # N=128 kept
    assert (tmp_path / "b.png").is_file()
