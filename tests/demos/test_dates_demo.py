"""``qkv demo`` (dates): the quick run end to end; the full demo reaches its bar (slow; its run
is shared with tests/demos/test_lora_demo.py's full test, see tests/shared_runs.py)."""

from __future__ import annotations

import json
import re

import pytest

from qkv.cli import main
from qkv.train import load_run

pytest_plugins = ["shared_runs"]  # full_dates_demo, shared_runs: tests/shared_runs.py


def run_demo(tmp_path, capsys, *extra: str) -> tuple[str, dict]:
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), *extra]) == 0
    printed = capsys.readouterr().out
    return printed, json.loads((out / "demo.json").read_text())


def test_quick_demo_end_to_end(tmp_path, capsys):
    printed, summary = run_demo(tmp_path, capsys, "--quick")
    match = re.search(r"exact match: (\d+\.\d)% on (\d+) held-out dates", printed)
    assert match and float(match.group(1)) == pytest.approx(100 * summary["exact_match"], abs=0.05)
    out = tmp_path / "demo"
    png = (out / "cross_attention.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert (out / "metrics.jsonl").read_text().count('"exact_match"') == 1
    model, tokenizer = load_run(out)
    assert type(model).__name__ == "Transformer" and tokenizer.vocab_size > 70


@pytest.mark.slow
@pytest.mark.timeout(900)  # a full demo: minutes on 2 idle cores, several times that loaded
def test_full_demo_reaches_95_percent(full_dates_demo):
    """The issue's bar: >= 95 % exact match on 1,000 held-out dates. (Its 3-minute budget is
    a benchmark, recorded in BENCHMARKS.md, not asserted here.) The run, ``qkv demo --out
    DIR`` as written, is built once per session (tests/shared_runs.py): the LoRA demo's
    full test adapts it."""
    run = full_dates_demo()
    printed = run.printed
    summary = json.loads((run.path / "demo.json").read_text())
    assert summary["test_examples"] == 1000
    assert summary["exact_match"] >= 0.95, printed[-2000:]
