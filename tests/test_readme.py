"""Every ```python block of README.md and README.zh-CN.md runs as written, each on its own
(a fresh namespace, in a temporary working directory).

Two blocks need something from outside: the Models block loads a local HuggingFace
directory (``from_hf("path/to/local/hf-bert-or-gpt2")``), built here from a tiny random
transformers GPT-2; and "Python in ten lines" trains the full dates demo (~1.5 min on 2
cores): it runs as written in a slow test, and with the demo's ``QUICK_TRAINING`` settings
(seconds) in the fast one. Shell blocks are not run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
READMES = ("README.md", "README.zh-CN.md")
HF_DIR = "path/to/local/hf-bert-or-gpt2"
TRAINS = "DEMO_TRAINING"  # the marker of the block that trains the full demo


def python_blocks() -> list[tuple[str, int, str]]:
    """(readme, line of the opening fence, code) of every ```python block."""
    out = []
    for name in READMES:
        text = (ROOT / name).read_text(encoding="utf-8")
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            out.append((name, text.count("\n", 0, m.start()) + 1, m.group(1)))
    return out


BLOCKS = python_blocks()


def test_the_blocks_are_found():
    assert len(BLOCKS) >= 10
    for name in READMES:
        assert sum(b[0] == name for b in BLOCKS) >= 5
        assert any(TRAINS in code and b == name for b, _, code in BLOCKS)


def _hf_gpt2(path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2,
                                  n_head=2)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path, safe_serialization=True)


def _run(code: str, where: Path, monkeypatch) -> dict:
    monkeypatch.chdir(where)
    if "from_hf(" in code:
        _hf_gpt2(where / HF_DIR)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        scope: dict = {"__name__": "__readme__"}
        exec(compile(code, "<readme>", "exec"), scope)  # our own README, run as written
        return scope
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(("readme", "line", "code"),
                         [b for b in BLOCKS if TRAINS not in b[2]],
                         ids=[f"{b[0]}:{b[1]}" for b in BLOCKS if TRAINS not in b[2]])
def test_block_runs_as_written(readme, line, code, tmp_path, monkeypatch):
    scope = _run(code, tmp_path, monkeypatch)
    assert len(scope) > 1


@pytest.mark.parametrize(("readme", "line", "code"),
                         [b for b in BLOCKS if TRAINS in b[2]],
                         ids=[f"{b[0]}:{b[1]}" for b in BLOCKS if TRAINS in b[2]])
def test_training_block_runs_with_quick_settings(readme, line, code, tmp_path, monkeypatch):
    quick = code.replace(TRAINS, "QUICK_TRAINING")
    scope = _run(quick, tmp_path, monkeypatch)
    src, ids, maps = scope["src"], scope["ids"], scope["maps"]
    assert src.dim() == 2 and src.shape[0] == 1 and ids.shape[0] == 1  # (B, S), (B, 1 + T)
    assert maps["cross"].shape[-2:] == (ids.shape[1], src.shape[1])  # (L, H, T, S)


@pytest.mark.slow
@pytest.mark.parametrize(("readme", "line", "code"),
                         [b for b in BLOCKS if TRAINS in b[2]][:1],
                         ids=[f"{b[0]}:{b[1]}" for b in BLOCKS if TRAINS in b[2]][:1])
def test_training_block_runs_as_written(readme, line, code, tmp_path, monkeypatch, capsys):
    """README.md's block (README.zh-CN.md's differs only in its comments): one full run."""
    _run(code, tmp_path, monkeypatch)
    assert "['1976-07-04']" in capsys.readouterr().out


def test_the_demo_time_is_stated_alike_everywhere():
    """README.md, README.zh-CN.md and ``qkv demo --help`` state one duration for the demo
    (BENCHMARKS.md measured 86 s on 2 cores: ~1.5 min)."""
    from qkv.cli.demo import EXAMPLES
    from qkv.demos import dates

    stated = {
        "README.md": re.search(r"trains the demo model \(~([\d.]+) min\)",
                               (ROOT / "README.md").read_text(encoding="utf-8")),
        "README.zh-CN.md": re.search(r"训练演示模型（约 ([\d.]+) 分钟）",
                                     (ROOT / "README.zh-CN.md").read_text(encoding="utf-8")),
        "qkv demo --help": re.search(r"train on dates \(~([\d.]+) min", EXAMPLES),
        "qkv.demos.dates": re.search(r"takes about ([\d.]+) minutes", dates.__doc__),
    }
    assert all(stated.values()), stated
    assert {k: float(m.group(1)) for k, m in stated.items()} == dict.fromkeys(stated, 1.5)
