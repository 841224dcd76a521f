"""``qkv`` reads its arguments and writes its output as UTF-8 whatever the locale: under a true
ASCII locale (``LC_ALL=C`` with Python's UTF-8 mode and locale coercion off) a CJK argument is
the text typed, not undecodable bytes, and CJK output is printed, not a UnicodeEncodeError.

Oracles: the same command run under a UTF-8 locale (``LC_ALL=C.UTF-8``) prints the same bytes;
the run's character tokenizer knows every character of the input (so the "unknown to the run's
tokenizer" warning is a sign the argument was misread); the prompt itself, typed here, heads
a text GPT's output; a file whose name is not ASCII, created here, is still found.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from qkv.cli import main

pytestmark = pytest.mark.slow  # each test starts python -m qkv.cli (torch's import) twice

ASCII = {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0",
         "PYTHONIOENCODING": ""}
UTF8 = {"LC_ALL": "C.UTF-8", "LANG": "C.UTF-8", "PYTHONUTF8": "1"}
SMALL = ["--batch-size", "8", "--warmup", "1", "--eval-every", "2", "--eval-examples", "8",
         "--steps", "2", "--no-progress", "--device", "cpu"]
TEXT = "日本語の文章です。東京と京都の天気は晴れです。" * 8


def qkv(args: list[str], env: dict[str, str], cwd=None) -> subprocess.CompletedProcess:
    """``python -m qkv.cli ARGS`` under ``env``; bytes out, bounded."""
    full = {k: v for k, v in os.environ.items() if k not in ASCII}
    full.update({k: v for k, v in env.items() if v}, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "qkv.cli", *args], capture_output=True,
                          timeout=120, env=full, cwd=cwd)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("utf8")
    corpus = root / "corpus.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    assert main(["train", "--task", "dates", "--preset", "transformer-tiny", *SMALL, "--out",
                 str(root / "mt")]) == 0
    assert main(["train", "--model", "gpt", "--preset", "gpt-tiny", "--data", str(corpus),
                 "--max-len", "32", *SMALL, "--out", str(root / "lm")]) == 0
    return root


def test_a_cjk_argument_is_read_as_typed_under_an_ascii_locale(runs):
    args = ["translate", str(runs / "mt"), "--input", "2021年3月3日", "--max-new-tokens", "12"]
    ascii_run, utf8_run = qkv(args, ASCII), qkv(args, UTF8)
    assert utf8_run.returncode == 0, utf8_run.stderr.decode()[-2000:]
    assert ascii_run.returncode == 0, ascii_run.stderr.decode()[-2000:]
    assert b"unknown to the run's tokenizer" not in ascii_run.stderr, ascii_run.stderr
    assert ascii_run.stdout == utf8_run.stdout


def test_cjk_output_is_printed_as_utf8_under_an_ascii_locale(runs):
    args = ["generate", str(runs / "lm"), "--prompt", "日本語", "--max-new-tokens", "6"]
    ascii_run, utf8_run = qkv(args, ASCII), qkv(args, UTF8)
    assert utf8_run.returncode == 0, utf8_run.stderr.decode()[-2000:]
    assert ascii_run.returncode == 0, ascii_run.stderr.decode()[-2000:]
    assert ascii_run.stdout.decode("utf-8").startswith("日本語")
    assert ascii_run.stdout == utf8_run.stdout


def test_a_non_ascii_file_name_still_works_under_an_ascii_locale(runs, tmp_path):
    """A path argument is kept as given (its bytes), so an existing non-ASCII file opens;
    its contents are UTF-8 and are read as such."""
    inputs = tmp_path / "données.txt"
    inputs.write_text("2021年3月3日\n", encoding="utf-8")
    ascii_run = qkv(["translate", str(runs / "mt"), "--file", str(inputs),
                     "--max-new-tokens", "12"], ASCII)
    by_input = qkv(["translate", str(runs / "mt"), "--input", "2021年3月3日",
                    "--max-new-tokens", "12"], UTF8)
    assert ascii_run.returncode == 0, ascii_run.stderr.decode()[-2000:]
    assert ascii_run.stdout == by_input.stdout


def test_errors_naming_a_cjk_argument_are_printed_under_an_ascii_locale(tmp_path):
    """stderr too: the one-line error names the argument as typed (bytes, not escapes)."""
    missing = "不存在的运行"
    done = qkv(["generate", missing, "--prompt", "x"], ASCII, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    line = done.stderr.decode("utf-8").strip()
    assert missing in line and "\\u" not in line and "\\x" not in line, line
