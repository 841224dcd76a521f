"""``qkv demo lora``: the quick run end to end (base trained, adapter trained and saved, the
lines printed, the base intact with the adapter disabled), reusing a base with ``--base``,
refusals of bases that are not a dates encoder-decoder run; the base it trains is ``qkv
demo``'s own run (the same TrainConfig); the full demo reaches its bar (slow), on the full
``qkv demo`` run of tests/demos/test_dates_demo.py given as ``--base`` (built once per
session: tests/shared_runs.py).

Oracles written here: the trainable-parameter count from the model's shapes (2·r·C per square
projection role, r·(C+F) per feed-forward linear), the adapter file's tensors counted with
safetensors, and the base's own outputs from ``load_run`` of the base run."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from qkv.cli import main
from qkv.data import get_task
from qkv.demos.dates import DEMO_MODEL, DEMO_TRAINING, run_dates_demo
from qkv.demos.lora import LORA, QUICK_EXAMPLES, run_lora_demo
from qkv.generation import translate
from qkv.peft import disable_adapters
from qkv.train import TrainConfig, Trainer, exact_match, load_run
from qkv.train.kinds import get_kind

pytest_plugins = ["shared_runs"]  # full_dates_demo, shared_runs: tests/shared_runs.py

LINES = {
    "exact": r"^exact match: (\d+\.\d)% on (\d+) held-out dates",
    "base": r"^base exact match: (\d+\.\d)% .*\(the base run: (\d+\.\d)%; (\d+)/(\d+) outputs",
    "params": r"^trainable parameters: ([\d,]+) of ([\d,]+) \((\d+\.\d+)%\)",
    "adapter": r"^adapter file: (\d+\.\d) KB",
}


def lora_params_oracle(config, lora: dict) -> int:
    """LoRA parameter count of the encoder-decoder from its shapes: each q/k/v/out role of a
    (self- or cross-) attention adds A (r, C) + B (C, r); ffn_in A (r, C) + B (F, r); ffn_out
    A (r, F) + B (C, r)."""
    r, c, f = lora["r"], config.dim, config.ffn_hidden
    assert config.dim % config.num_heads == 0  # H·D == C: every attention role is C x C
    attentions = config.num_encoder_layers + 2 * config.num_decoder_layers
    ffns = config.num_encoder_layers + config.num_decoder_layers
    roles = set(lora["targets"])
    per_attention = sum(2 * r * c for role in ("q", "k", "v", "out") if role in roles)
    per_ffn = r * (c + f) * (("ffn_in" in roles) + ("ffn_out" in roles))
    return attentions * per_attention + ffns * per_ffn


def parse(printed: str) -> dict[str, re.Match]:
    found = {k: re.search(v, printed, re.M) for k, v in LINES.items()}
    assert all(found.values()), (found, printed[-3000:])
    return found


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One quick demo for the tests below: (output dir, what it printed)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("lora") / "demo"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["demo", "lora", "--quick", "--out", str(out)]) == 0
    return out, buf.getvalue()


def test_quick_demo_prints_and_writes(quick_run):
    out, printed = quick_run
    found = parse(printed)
    summary = json.loads((out / "demo.json").read_text())
    assert int(found["exact"].group(2)) == summary["test_examples"] == QUICK_EXAMPLES
    assert float(found["exact"].group(1)) == pytest.approx(100 * summary["exact_match"],
                                                           abs=0.05)
    assert float(found["base"].group(1)) == pytest.approx(100 * summary["base_exact_match"],
                                                          abs=0.05)
    # the files: a base run, an adapter run whose checkpoint holds only the adapter
    base_ckpt, lora_ckpt = out / "base" / "checkpoint", out / "lora" / "checkpoint"
    assert (base_ckpt / "model.safetensors").is_file()
    assert (lora_ckpt / "adapter_config.json").is_file()
    adapter = lora_ckpt / "adapter_model.safetensors"
    assert not (lora_ckpt / "model.safetensors").exists()  # never the base weights
    in_file = sum(t.numel() for t in load_file(adapter).values())
    base_model, _ = load_run(out / "base")
    expected = lora_params_oracle(base_model.config, LORA)
    trainable = int(found["params"].group(1).replace(",", ""))
    total = int(found["params"].group(2).replace(",", ""))
    assert trainable == in_file == expected == summary["trainable_params"]
    assert total == expected + sum(p.numel() for p in base_model.parameters())
    assert float(found["params"].group(3)) == pytest.approx(100 * trainable / total, abs=0.005)
    size = adapter.stat().st_size
    assert float(found["adapter"].group(1)) == pytest.approx(size / 1024, abs=0.05)
    assert size < 4 * in_file + 16_384  # fp32 tensors and a small header: KBs
    assert size < (base_ckpt / "model.safetensors").stat().st_size / 4


def test_quick_demo_base_intact(quick_run):
    """With the adapter disabled the adapted model gives the base run's own outputs (string
    for string, and the same logits bit for bit), while the adapter does change them."""
    out, printed = quick_run
    found = parse(printed)
    iso = get_task("dates").examples("test", 0, QUICK_EXAMPLES)
    base_model, tok = load_run(out / "base")
    model, tok2 = load_run(out / "lora")
    assert tok2.vocab_size == tok.vocab_size
    with torch.no_grad():
        base_out = translate(base_model, tok, [s for s, _ in iso])
        with disable_adapters(model):
            off = translate(model, tok, [s for s, _ in iso])
    assert off == base_out
    base_score = exact_match(base_out, [t for _, t in iso])
    assert float(found["base"].group(1)) == pytest.approx(100 * base_score, abs=0.05)
    assert found["base"].group(1) == found["base"].group(2)
    assert found["base"].group(3) == found["base"].group(4) == str(QUICK_EXAMPLES)
    batch = get_kind("transformer").make_batch(get_task("dates-long").examples("test", 0, 16),
                                               tok)
    with torch.no_grad():
        ref = base_model(batch["src"], batch["tgt_in"])
        with disable_adapters(model):
            assert torch.equal(model(batch["src"], batch["tgt_in"]), ref)
        adapted = model(batch["src"], batch["tgt_in"])
    assert (adapted - ref).abs().max() > 1e-3  # the adapter trained: B moved off zero


def test_reuse_base_and_refusals(quick_run, tmp_path, capsys):
    out, printed = quick_run
    second = tmp_path / "again"
    assert main(["demo", "lora", "--quick", "--base", str(out / "base"),
                 "--out", str(second)]) == 0
    again = capsys.readouterr().out
    assert "(reused)" in again and not (second / "base").exists()
    assert (second / "lora" / "checkpoint" / "adapter_model.safetensors").is_file()
    # the same base, the same seed: the same figures as the run that trained the base
    assert parse(again)["exact"].group(0) == parse(printed)["exact"].group(0)
    assert parse(again)["base"].group(0) == parse(printed)["base"].group(0)

    def refused(*args: str) -> str:
        assert main(["demo", *args]) == 2
        return capsys.readouterr().err

    assert "is itself an adapter run" in refused("lora", "--quick", "--base", str(out / "lora"),
                                                 "--out", str(tmp_path / "x1"))
    assert "no such run directory" in refused("lora", "--base", str(tmp_path / "nope"),
                                              "--out", str(tmp_path / "x2"))
    copy_run = tmp_path / "copy"
    Trainer(TrainConfig(model="transformer", task="copy", preset="transformer-tiny", steps=1,
                        batch_size=2, eval_every=1, eval_examples=2,
                        overrides=dict(dim=16, num_heads=2, ffn_hidden=16,
                                       num_encoder_layers=1, num_decoder_layers=1)),
            copy_run, progress=False, log=lambda line: None).run()
    assert "trained on task 'copy', not the dates task" in refused(
        "lora", "--base", str(copy_run), "--out", str(tmp_path / "x3"))
    assert "only `qkv demo lora` takes --base" in refused("--base", str(out / "base"))
    assert "not empty" in refused("lora", "--quick", "--base", str(out / "base"),
                                  "--out", str(out))
    for name in ("x1", "x2", "x3"):  # refused before anything was written
        assert not (tmp_path / name).exists()


class _Built(Exception):
    """Raised by ``_RecordingTrainer`` once it has the config (nothing trains)."""


def test_the_base_is_the_dates_demo_run(tmp_path, monkeypatch):
    """Without ``--base`` the demo trains ``qkv demo``'s own run: the same TrainConfig (model,
    task, DEMO_MODEL, DEMO_TRAINING, seed), full and quick, for any seed. Hence the full test
    below may adapt the full ``qkv demo`` run instead of training the base again (two such
    trainings gave bit-identical model.safetensors)."""
    import qkv.train

    seen = []

    class _RecordingTrainer:
        def __init__(self, config, *args, **kwargs):
            seen.append(config)
            raise _Built

    monkeypatch.setattr(qkv.train, "Trainer", _RecordingTrainer)
    for n, (quick, seed) in enumerate([(False, 0), (True, 0), (False, 3)]):
        with pytest.raises(_Built):
            run_dates_demo(out=str(tmp_path / f"dates{n}"), quick=quick, seed=seed)
        with pytest.raises(_Built):
            run_lora_demo(out=str(tmp_path / f"lora{n}"), quick=quick, seed=seed)
    assert len(seen) == 6
    for n in range(3):
        assert seen[2 * n + 1] == seen[2 * n], n
    # the full run is also README.md's "Python in ten lines" run, written as there
    assert seen[0] == TrainConfig(task="dates", overrides=DEMO_MODEL, **DEMO_TRAINING)
    assert seen[4].seed == 3 and seen[2].steps != seen[0].steps


@pytest.mark.slow
@pytest.mark.timeout(900)  # a full demo: minutes on 2 idle cores, several times that loaded
def test_full_demo_reaches_its_bar(tmp_path, capsys, full_dates_demo):
    """The issue's bar: >= 95 % exact match on 1,000 held-out dates in the new format, and the
    base intact with the adapter disabled (>= 95 % on ISO, equal to the base run's own
    score). (The 4-minute budget is a benchmark, not asserted here.) The base: the session's
    full ``qkv demo`` run (``--base``), the run this demo would train itself
    (test_the_base_is_the_dates_demo_run)."""
    base = full_dates_demo()
    out = tmp_path / "demo"
    capsys.readouterr()
    assert main(["demo", "lora", "--base", str(base.path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "(reused)" in printed and not (out / "base").exists()
    summary = json.loads((out / "demo.json").read_text())
    found = parse(printed)
    assert summary["test_examples"] == 1000
    assert summary["exact_match"] >= 0.95, printed[-3000:]
    assert summary["base_exact_match"] >= 0.95, printed[-3000:]
    assert summary["base_exact_match"] == summary["base_exact_match_before"]
    assert summary["base_outputs_unchanged"] == 1000
    assert found["base"].group(1) == found["base"].group(2)
