"""Every benchmark script runs in --quick mode, so that none of them rots.

Only that it runs and prints its table, with the CPU it ran on in its header, is checked:
timings are never asserted.

A script gets this test's torch thread count as ``OMP_NUM_THREADS`` (one under xdist, where
tests/conftest.py gives each worker one thread): with torch's default of one thread per core,
its OpenMP threads spin waiting for one another while the other worker holds a core, which
cost bench_quantize --quick 45 CPU-seconds under load instead of 6. A script that sets its
own thread counts (``--threads``) still does.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_bounded

ROOT = Path(__file__).resolve().parents[1]
#: scripts whose --quick run has a test of its own below (checking what it printed)
OWN_TESTS = {"bench_llama_decode", "bench_llama_lora"}
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("bench_*.py")
                 if p.stem not in OWN_TESTS)


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_quick_mode_runs(script):
    if script == "bench_ctranslate2" and importlib.util.find_spec("ctranslate2") is None:
        pytest.skip("ctranslate2 (the benchmark-only 'bench' extra) is not installed")
    # under the test's 300-s limit, so that a hang shows the script's own stacks
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    result = run_bounded([sys.executable, "-m", f"benchmarks.{script}", "--quick"], cwd=ROOT,
                         timeout=270, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "|" in result.stdout  # printed a table
    # and the CPU it ran on, model name and vector extensions (benchmarks/_harness.cpu_line)
    header = result.stdout.split("|", 1)[0]
    assert any(line.startswith("cpu: ") and "(" in line for line in header.splitlines()), \
        header[-2000:]


def _run_quick(script: str) -> str:
    """``python -m benchmarks.<script> --quick`` as the test above runs it; its stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    result = run_bounded([sys.executable, "-m", f"benchmarks.{script}", "--quick"], cwd=ROOT,
                         timeout=270, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def _table_rows(out: str, title_start: str) -> list[list[str]]:
    """The cells of the rows of the markdown table whose ``### `` title starts so."""
    section = out.split(f"### {title_start}", 1)[1].split("\n### ", 1)[0]
    lines = [s for s in section.splitlines() if s.startswith("| ")][1:]  # header dropped
    return [[c.strip() for c in s.strip("|").split("|")] for s in lines]


@pytest.mark.slow
def test_llama_decode_quick_qkv_fp32_decodes_hf_tokens_on_a_plan():
    # The oracle is HF LlamaForCausalLM.generate on the same saved random weights, in the same
    # run: qkv fp32 must give its tokens exactly, at every batch size (docs/ARCHITECTURE.md,
    # the decode engine); and the Llama checkpoint must decode on a plan, not on "modules".
    out = _run_quick("bench_llama_decode")
    agree = _table_rows(out, "greedy agreement with HF fp32")
    fp32 = [r for r in agree if r[2] == "qkv fp32"]
    assert [r[0] for r in fp32] == ["1", "4"], agree
    for b, _, _, rows_same, _, frac in fp32:
        assert rows_same == f"{b} / {b}" and frac == "1.0000", fp32
    backends = _table_rows(out, "qkv decode backend")
    assert len(backends) == 4 and not any(r[3].startswith("modules") for r in backends), \
        backends
    ct2 = importlib.util.find_spec("ctranslate2") is not None
    assert any(r[2].startswith("CT2") for r in agree) == ct2, agree
    assert ("CTranslate2 contenders skipped" in out) != ct2
    goals = _table_rows(out, "ratios of tokens/s")
    assert len(goals) == (6 if ct2 else 2), goals


@pytest.mark.slow
def test_llama_lora_quick_starts_both_sides_from_the_same_loss():
    # qkv.peft on from_pretrained(dir) vs HF PEFT on LlamaForCausalLM.from_pretrained(dir):
    # the adapters start at B = 0, so every contender's first-step loss is the base model's;
    # fp32 over 2 layers and 64 positions: equal to 1e-5 (absolute, on a loss of ~8.3).
    out = _run_quick("bench_llama_lora")
    line = next(s for s in out.splitlines() if s.startswith("first-step losses: "))
    losses = {k.rsplit(" ", 1)[0]: float(k.rsplit(" ", 1)[1])
              for k in line.split(": ", 1)[1].split(", ")}
    assert set(losses) == {"hf-peft q,v", "qkv q,v", "hf-peft all-linear", "qkv all-linear"}
    assert max(losses.values()) - min(losses.values()) < 1e-5, losses
    rows = _table_rows(out, "LoRA training step")
    counts = {r[0]: r[1] for r in rows}
    assert counts["qkv q,v"] == counts["hf-peft q,v"] == "30,720", counts
    assert counts["qkv all-linear"] == counts["hf-peft all-linear"] == "162,816", counts
