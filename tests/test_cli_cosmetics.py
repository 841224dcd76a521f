"""Small things a new user sees: ``qkv --version`` and ``python -m qkv``, the tour's sizes,
the demos' columns after Chinese inputs, the wording of ``generate``'s sampling refusal.

Oracles are written apart from the code: the version from pyproject.toml, sizes and
display widths counted by hand (年, 月, 日, 〇 and the Chinese numerals are East Asian wide:
two terminal columns each).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qkv
from qkv.cli import main
from qkv.cli.tour import format_size
from qkv.demos.dates import display_ljust
from qkv.models import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
#: [project] version of pyproject.toml (a regex: tomllib is Python >= 3.11)
VERSION = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(),
                    re.M).group(1)


# ------------------------------------------------------------------------------ --version


def test_version_flag_prints_the_projects_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"qkv {VERSION}\n"
    assert qkv.__version__ == VERSION


def test_version_without_an_install_is_the_packages(monkeypatch):
    from importlib import metadata

    from qkv.cli import version

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert version() == VERSION


def test_python_dash_m_qkv_is_the_qkv_command():
    """One subprocess (~2 s of CPU: it imports torch)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-m", "qkv", "--version"], capture_output=True,
                          text=True, timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"qkv {VERSION}\n", done.stderr


# ---------------------------------------------------------------------------- tour sizes


@pytest.mark.parametrize(("n_bytes", "shown"), [
    (0, "0 B"), (32, "32 B"), (1023, "1,023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
    (32 * 2**20, "32.0 MiB"), (2**30, "1.0 GiB"), (8 * 8192**2 * 4, "2.0 GiB"),
    (5000 * 2**30, "5,000.0 GiB"),
])
def test_format_size(n_bytes, shown):
    assert format_size(n_bytes) == shown


def test_tour_names_a_32_mib_bias_in_mib(capsys):
    """N = 1024: the N×S fp32 bias of 8 heads is 8·1024²·4 B = 32 MiB (it printed 0.0 GiB)."""
    assert main(["demo", "tour", "--length", "1024"]) == 0
    out = capsys.readouterr().out
    assert out.count("an N×S fp32 bias alone would take 32.0 MiB") == 3, out


# ------------------------------------------------------------------- columns after Chinese

#: (text, its width in terminal columns, counted by hand)
WIDTHS = [("'Sat, 3 March 2021'", 19), ("'2021年3月3日'", 14), ("'二〇二一年三月三日'", 20),
          ("", 0), ("ＡＢ", 4)]  # fullwidth Latin letters: "F", two columns


@pytest.mark.parametrize(("text", "width"), WIDTHS)
def test_display_ljust_pads_to_columns(text, width):
    assert display_ljust(text, 32) == text + " " * (32 - width)
    assert display_ljust(text, width) == text
    assert display_ljust(text, max(width - 1, 0)) == text  # too wide already: as is


def _arrow_lines(printed: str, header: str) -> list[str]:
    block = printed.split(header, 1)[1].split("\n\n", 1)[0]
    return [line for line in block.splitlines() if " -> " in line and "miss:" not in line]


def _assert_aligned_after_chinese(lines: list[str], column: int) -> None:
    """Every line's source (quoted) is followed by exactly the spaces that bring it to
    ``column`` columns: hand-counted widths, so 年/月/日/〇... count two each."""
    widths = dict(WIDTHS)
    seen = 0
    for line in lines:
        source = re.match(r"  ('[^']*')( *) -> ", line)
        assert source, line
        if source.group(1) in widths:
            assert len(source.group(2)) == column - widths[source.group(1)], line
            seen += 1
    assert seen == 3, lines  # the showcase's English, numeric-Chinese and all-Chinese lines


def test_dates_demo_examples_line_up_after_chinese(tmp_path, capsys):
    assert main(["demo", "--quick", "--out", str(tmp_path / "demo")]) == 0
    lines = _arrow_lines(capsys.readouterr().out, "\nExamples:\n")
    _assert_aligned_after_chinese(lines, 32)


@pytest.mark.slow
def test_lora_demo_examples_line_up_after_chinese(tmp_path, capsys):
    """The LoRA demo prints the same showcase (two columns); ~8 s on one thread."""
    assert main(["demo", "lora", "--quick", "--out", str(tmp_path / "lora")]) == 0
    lines = _arrow_lines(capsys.readouterr().out, "(with the adapter | adapter disabled):\n")
    _assert_aligned_after_chinese(lines, 32)


# ------------------------------------------------------------------- generate's refusal


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(temperature=0.5), "temperature=0.5 applies only when sampling"),
    (dict(temperature=0.5, top_k=3), "temperature=0.5 and top_k=3 apply only when sampling"),
    (dict(top_k=3, top_p=0.9, temperature=2.0),
     "temperature=2.0, top_k=3 and top_p=0.9 apply only when sampling"),
])
def test_sampling_settings_without_sampling_are_refused_in_good_english(kwargs, message):
    gpt = GPT(GPTConfig.from_name("gpt-tiny", vocab_size=16, max_len=16)).eval()
    with pytest.raises(ValueError, match=re.escape(f"generate: {message}; pass do_sample=True")):
        qkv.generate(gpt, torch.zeros(1, 2, dtype=torch.long), max_new_tokens=2, **kwargs)
