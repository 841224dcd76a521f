"""Every training-setup error is caught before work starts, and a refusal writes nothing:
settings out of range (NaN included), a model config that does not fit the tokenizer or the
data, a run too big for memory, a data file changed since the run began, a run.json edited
against its checkpoint, and the wording of resume's errors. Also: checkpoints are fsynced."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from qkv.cli import main
from qkv.models import CheckpointError
from qkv.train import TrainConfig, Trainer, build_model
from qkv.train import memory as memory_module

TINY_MODEL = dict(dim=32, num_heads=2, ffn_hidden=64, num_encoder_layers=1,
                  num_decoder_layers=1)
TINY = ["--preset", "transformer-tiny", "--set", "dim=32", "--set", "num_heads=2", "--set",
        "num_encoder_layers=1", "--set", "num_decoder_layers=1", "--batch-size", "4",
        "--eval-examples", "4", "--no-progress", "--device", "cpu"]


def config(**kw) -> TrainConfig:
    base = dict(model="transformer", task="copy", preset="transformer-tiny",
                overrides=TINY_MODEL, steps=4, batch_size=4, lr=3e-3, warmup=2, eval_every=2,
                eval_examples=4)
    return TrainConfig(**{**base, **kw})


def quiet(**kw) -> dict:
    return dict(progress=False, log=lambda line: None, **kw)


def cli(capsys, *argv: str) -> tuple[int, str]:
    """Run ``qkv train ARGV``; returns (exit status, stderr)."""
    capsys.readouterr()
    code = main(["train", *argv])
    return code, capsys.readouterr().err.strip()


def one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert err.startswith("qkv train: error:") and len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err


def snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file()}


def pairs_file(path: Path, words: list[str]) -> Path:
    path.write_text("".join(f"{w}\t{w[::-1]}\n" for w in words))
    return path


# --- 5, 10: every numeric setting is checked; NaN never passes -------------------------------
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(("field", "value"), [
    ("clip_norm", NAN), ("clip_norm", INF), ("clip_norm", -1.0),
    ("weight_decay", -1.0), ("weight_decay", NAN), ("weight_decay", INF),
    ("lr", NAN), ("lr", INF), ("lr", -1e-3), ("lr", "0.001"),
    ("adam_eps", 0.0), ("adam_eps", NAN), ("adam_eps", -1e-8),
    ("label_smoothing", NAN), ("label_smoothing", -0.1), ("label_smoothing", 1.0),
    ("min_lr_ratio", NAN), ("min_lr_ratio", 1.5),
    ("betas", (1.0, 0.98)), ("betas", (0.9, NAN)), ("betas", (-0.1, 0.9)), ("betas", (0.9,)),
    ("warmup", -1), ("warmup", 1.5), ("steps", 0), ("steps", 2.0), ("steps", True),
    ("batch_size", 0), ("eval_every", 0), ("eval_examples", -1), ("max_len", 1),
    ("max_len", 2.5), ("bpe_vocab_size", 1), ("seed", -1), ("seed", 2**64), ("seed", 1.5),
])
def test_every_numeric_setting_is_checked(field, value):
    from qkv.train.config import ConfigError

    with pytest.raises(ConfigError, match=rf"^{field} must be .*got ") as exc:
        config(**{field: value})
    assert exc.value.field == field


def test_boundaries_that_are_allowed():
    cfg = config(clip_norm=0.0, weight_decay=0.0, min_lr_ratio=1.0, betas=[0.0, 0.999],
                 label_smoothing=0.0, warmup=0, seed=2**63 - 1, bpe_vocab_size=260)
    assert cfg.betas == (0.0, 0.999)


@pytest.mark.parametrize(("argv", "needles"), [
    (["--clip-norm", "nan"], ["--clip-norm", "nan"]),
    (["--clip-norm", "inf"], ["--clip-norm", "inf"]),
    (["--weight-decay", "-1"], ["--weight-decay", "-1"]),
    (["--lr", "inf"], ["--lr", "inf"]),
    (["--seed", str(10**23)], ["--seed", str(10**23)]),
    (["--seed", "-3"], ["--seed", "-3"]),
    (["--steps", "0"], ["--steps", "0"]),
    (["--bpe-vocab-size", "1"], ["--bpe-vocab-size", ">= 260"]),
    (["--accept-changed-data"], ["--accept-changed-data goes with --resume"]),
])
def test_bad_flags_are_one_line_naming_the_flag(tmp_path, capsys, argv, needles):
    out = tmp_path / "run"
    one_line_error(*cli(capsys, "--task", "copy", *TINY, "--out", str(out), *argv), *needles)
    assert not out.exists()


def test_a_large_seed_trains(tmp_path):
    """Seeds up to 2**63 - 1 are accepted, and every generator derived from them works (the
    per-epoch data order and the MLM corruption used to overflow torch's 64-bit seed)."""
    text = tmp_path / "corpus.txt"
    text.write_text("the cat sat on the mat because it was tired. " * 30)
    cfg = config(model="bert-mlm", preset="bert-tiny", task=None, data=str(text), max_len=16,
                 overrides=dict(dim=32, num_heads=2), steps=1, eval_every=1,
                 seed=2**63 - 1)
    assert "masked_accuracy" in Trainer(cfg, tmp_path / "run", **quiet()).run()


# --- 7: the model config against the tokenizer and the data, before the directory --------------
@pytest.mark.parametrize(("override", "needle"), [
    ("vocab_size=5", "vocab_size=5 is smaller than the tokenizer's"),
    ("max_len=4", "max_len=4 is shorter than the"),
])
@pytest.mark.parametrize("model", ["transformer", "gpt"])
def test_a_model_config_that_cannot_take_the_data_is_refused_up_front(tmp_path, capsys,
                                                                      override, needle, model):
    if model == "transformer" and override.startswith("vocab_size"):
        override, needle = "tgt_" + override, "tgt_" + needle  # src is the tokenizer's
    preset = ["--model", "gpt", "--preset", "gpt-tiny", "--set", "dim=32", "--set",
              "num_heads=2", "--batch-size", "4", "--eval-examples", "4", "--no-progress",
              "--device", "cpu"] if model == "gpt" else TINY
    out = tmp_path / "run"
    if model == "transformer":
        preset = [*preset, "--set", "share_embeddings=false", "--set", "tie_output=false"]
    code, err = cli(capsys, "--task", "copy", *preset, "--set", override, "--steps", "2",
                    "--out", str(out))
    one_line_error(code, err, needle)
    assert not out.exists()  # nothing left to block a rerun


def test_a_run_that_dies_before_its_first_checkpoint_can_be_rerun(tmp_path, monkeypatch):
    """A run that stopped before saving anything has nothing to resume: the same command
    starts it over (a run with a checkpoint is still refused)."""
    run = tmp_path / "run"

    def boom(self):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(Trainer, "train_step", boom)
    with pytest.raises(RuntimeError):
        Trainer(config(), run, **quiet()).run()
    assert (run / "run.json").exists() and not (run / "checkpoint").exists()
    monkeypatch.undo()
    lines: list[str] = []
    Trainer(config(), run, progress=False, log=lines.append).run()
    assert any("stopped before its first checkpoint; starting it over" in x for x in lines)
    with pytest.raises(ValueError, match="already holds a run"):
        Trainer(config(), run, **quiet())


def test_a_refused_setup_keeps_the_users_files(tmp_path, monkeypatch):
    """A failure while a new run writes its first files removes only what it wrote."""
    from qkv.train import rundir as trainer_module  # run.json is written there

    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")

    def no_space(path, write):
        raise OSError("No space left on device")

    monkeypatch.setattr(trainer_module, "atomic_write", no_space)
    with pytest.raises(OSError, match="No space"):
        Trainer(config(), run, **quiet())
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]
    monkeypatch.undo()
    with pytest.raises(OSError):  # a directory it made itself is removed again
        monkeypatch.setattr(trainer_module, "atomic_write", no_space)
        Trainer(config(), tmp_path / "new", **quiet())
    assert not (tmp_path / "new").exists()


# --- 4: sizes that cannot fit are refused before anything is allocated or written -------------
def test_the_estimate_counts_the_real_models_parameters():
    """The estimate builds the model on the meta device; its parameter count must be the real
    model's (counted here with torch directly), and the formula's parts what the docstring
    states (independent arithmetic)."""
    cfg = config(overrides=dict(TINY_MODEL))
    real = build_model(cfg, 40, 30, 0)
    with torch.device("meta"):
        meta = build_model(cfg, 40, 30, 0)
    est = memory_module.estimate_training_bytes(meta, batch_size=8, seq_len=20, eval_examples=10)
    n_params = sum(p.numel() for p in real.parameters())
    assert est["parameters"] == 16 * n_params
    c, f, h, layers, v, b, n = 32, 64, 2, 1 + 2 * 1, 40, 8, 20
    assert est["tables"] == 24 * 30 * c * 2 or est["tables"] == 24 * 30 * c  # src/tgt tables
    assert est["activations"] == 4 * layers * b * n * (10 * c + 2 * f)
    assert est["scores"] == 4 * b * h * n * n
    assert est["logits"] == 2 * 4 * b * n * v
    assert est["evaluation"] == 10 * (200 + 2 * n)


@pytest.mark.parametrize("kw", [
    dict(),  # transformer: a lazily built sinusoidal table of max_len x C (12 GiB)
    dict(model="gpt", preset="gpt-tiny", overrides=dict(dim=32, num_heads=2)),  # parameters
])
def test_a_huge_max_len_is_refused_with_the_numbers(tmp_path, monkeypatch, kw):
    """--max-len 100000000 on a machine with 8 GiB available: refused up front with the
    numbers, no run directory. (The Trainer is only built, never run: were the check gone,
    the test fails without allocating the table.)"""
    monkeypatch.setattr(memory_module, "available_bytes", lambda device=None: 8 * 2**30)
    with pytest.raises(ValueError) as exc:
        Trainer(config(max_len=100_000_000, **kw), tmp_path / "run", **quiet())
    message = str(exc.value)
    for needle in ("max_len=100000000", "needs at least", "GiB", "8.0 GiB available",
                   "batch_size=4"):
        assert needle in message, message
    assert len(message.splitlines()) == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("kw", [dict(max_len=10**12), dict(batch_size=10**9),
                                dict(eval_examples=10**12)])
def test_sizes_no_machine_has_are_refused_on_this_one(tmp_path, kw):
    """No monkeypatching: 10**12 positions, a batch of 10**9 examples, 10**12 held-out
    examples need terabytes. (Only the Trainer is built: were the check gone, the test fails
    without running the step that would exhaust this machine's memory.)"""
    with pytest.raises(ValueError, match=r"needs at least .* available"):
        Trainer(config(**kw), tmp_path / "run", **quiet())
    assert not (tmp_path / "run").exists()


def test_reasonable_runs_pass_the_memory_check(monkeypatch, tmp_path):
    """The dates demo's settings and a GPT-2-sized text run fit in 8 GiB by the estimate."""
    from qkv.demos.dates import DEMO_MODEL, DEMO_TRAINING

    demo = TrainConfig(model="transformer", task="dates", overrides=DEMO_MODEL, **DEMO_TRAINING)
    with torch.device("meta"):
        model = build_model(demo, 100, 40, 0)
    est = memory_module.estimate_training_bytes(model, batch_size=demo.batch_size, seq_len=40,
                                                eval_examples=demo.eval_examples)
    assert est.total < 2**30
    with torch.device("meta"):
        gpt2 = build_model(TrainConfig(model="gpt", task="copy", preset="gpt2"), 50257, 1024, 0)
    assert memory_module.estimate_training_bytes(gpt2, batch_size=4, seq_len=1024).total < 8 * 2**30


# --- 3: the data file's fingerprint ------------------------------------------------------------
def test_resume_refuses_a_changed_data_file_unless_accepted(tmp_path, capsys):
    data = pairs_file(tmp_path / "pairs.tsv", ["abc", "hello", "qkv", "cat", "dog"] * 3)
    run = tmp_path / "run"
    assert cli(capsys, "--data", str(data), *TINY, "--steps", "2", "--eval-every", "2",
               "--out", str(run))[0] == 0
    info = json.loads((run / "run.json").read_text())
    assert info["data_fingerprint"]["size"] == data.stat().st_size
    import hashlib
    assert info["data_fingerprint"]["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()

    pairs_file(data, ["abc", "hello", "qkv", "cat", "dgo"] * 3)  # same size, new content
    before = snapshot(run)
    code, err = cli(capsys, "--resume", str(run), "--steps", "3", "--no-progress")
    one_line_error(code, err, f"--data {data} changed since the run", "--accept-changed-data")
    assert snapshot(run) == before  # nothing written
    pairs_file(data, ["abc", "hello", "qkv", "cat", "a much longer line than before"] * 3)
    code, err = cli(capsys, "--resume", str(run), "--steps", "3", "--no-progress",
                    "--accept-changed-data")  # accepted, but it no longer fits the model
    one_line_error(code, err, f"--data {data}: its longest example needs", "max_len=7")
    assert snapshot(run) == before
    pairs_file(data, ["abc", "hello", "qkv", "cat", "dog", "bird"] * 3)
    code, err = cli(capsys, "--resume", str(run), "--steps", "3", "--no-progress",
                    "--accept-changed-data")
    assert code == 0, err
    info = json.loads((run / "run.json").read_text())
    assert info["data_fingerprint"]["size"] == data.stat().st_size  # the new file recorded
    assert cli(capsys, "--resume", str(run), "--steps", "4", "--no-progress")[0] == 0


def test_an_old_run_json_without_a_fingerprint_still_resumes(tmp_path, capsys):
    data = pairs_file(tmp_path / "pairs.tsv", ["abc", "hello", "qkv", "cat"] * 3)
    run = tmp_path / "run"
    Trainer(config(task=None, data=str(data), steps=2), run, **quiet()).run()
    for path in (run / "run.json", run / "checkpoint" / "run.json"):  # as older qkv wrote it
        info = json.loads(path.read_text())
        del info["data_fingerprint"]
        path.write_text(json.dumps(info))
    lines: list[str] = []
    Trainer.resume(run, steps=3, progress=False, log=lines.append).run()
    assert any("holds no fingerprint of" in x for x in lines), lines
    assert json.loads((run / "run.json").read_text())["data_fingerprint"] is not None


def test_resume_names_a_missing_data_file(tmp_path):
    data = pairs_file(tmp_path / "pairs.tsv", ["abc", "hello", "qkv", "cat"] * 3)
    run = tmp_path / "run"
    Trainer(config(task=None, data=str(data), steps=2), run, **quiet()).run()
    data.unlink()
    with pytest.raises(CheckpointError, match=f"data file {data} is missing"):
        Trainer.resume(run, steps=3, **quiet())


# --- 6: run.json against checkpoint/run.json ---------------------------------------------------
def test_an_edited_run_json_is_refused_before_anything_is_written(tmp_path, capsys):
    run = tmp_path / "run"
    Trainer(config(steps=2), run, **quiet()).run()
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "model": "gpt", "preset": "gpt-tiny"}))
    before = snapshot(run)
    code, err = cli(capsys, "--resume", str(run), "--steps", "3", "--no-progress")
    one_line_error(code, err, "run.json disagrees with", "model: 'gpt' vs 'transformer'",
                   "restore run.json")
    assert snapshot(run) == before
    # only steps may differ (resume --steps M rewrote it before a crash)
    (run / "run.json").write_text(json.dumps({**info, "steps": 3}))
    Trainer.resume(run, **quiet()).run()


def test_a_broken_run_json_is_named(tmp_path, capsys):
    run = tmp_path / "run"
    Trainer(config(steps=2), run, **quiet()).run()
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "clip_norm": "nan"}))
    one_line_error(*cli(capsys, "--resume", str(run), "--steps", "3", "--no-progress"),
                   f"{run / 'run.json'}: cannot resume: clip_norm must be")


# --- 10 and siblings: resume's wording --------------------------------------------------------
def test_resume_tells_a_deleted_checkpoint_from_one_never_written(tmp_path, monkeypatch):
    run = tmp_path / "run"
    Trainer(config(steps=2), run, **quiet()).run()
    shutil.rmtree(run / "checkpoint")
    with pytest.raises(CheckpointError) as exc:
        Trainer.resume(run, steps=3, **quiet())
    assert "records one saved at step 2" in str(exc.value)
    assert "deleted or moved" in str(exc.value) and "before its first save" not in str(exc.value)
    with pytest.raises(ValueError, match="already holds a run"):  # not mistaken for a dead run
        Trainer(config(steps=2), run, **quiet())

    monkeypatch.setattr(Trainer, "train_step", lambda self: (_ for _ in ()).throw(
        KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        Trainer(config(), tmp_path / "early", **quiet()).run()
    with pytest.raises(CheckpointError, match="stopped before its first save"):
        Trainer.resume(tmp_path / "early", **quiet())


def test_resume_of_a_directory_that_does_not_exist(tmp_path, capsys):
    one_line_error(*cli(capsys, "--resume", str(tmp_path / "nope"), "--no-progress"),
                   f"{tmp_path / 'nope'}: cannot resume: no such run directory")
    assert not (tmp_path / "nope").exists()


def test_eval_every_beyond_steps_still_evaluates_and_saves_at_the_end(tmp_path):
    run = tmp_path / "run"
    result = Trainer(config(steps=3, eval_every=1000), run, **quiet()).run()
    assert result["step"] == 3
    assert json.loads((run / "checkpoint/trainer_state.json").read_text())["step"] == 3


# --- fsync: a power cut cannot lose the last checkpoint ---------------------------------------
def test_checkpoint_files_and_directories_are_fsynced_before_the_swap(tmp_path, monkeypatch):
    from qkv.train import checkpoint as ckpt_module

    trainer = Trainer(config(steps=1, eval_every=1), tmp_path / "run", **quiet())
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(ckpt_module.os, "replace", replace)
    trainer.run()
    run = str((tmp_path / "run").resolve())
    swap = events.index(("replace", f"{run}/checkpoint"))
    synced_before = {p for kind, p in events[:swap] if kind == "fsync"}
    for name in ("model.safetensors", "config.json", "tokenizer.json", "run.json",
                 "trainer_state.json", "trainer_state.safetensors"):
        assert f"{run}/checkpoint.tmp/{name}" in synced_before, name
    assert f"{run}/checkpoint.tmp" in synced_before
    assert ("fsync", run) in events[swap:]  # the rename itself made durable


def test_atomic_write_fsyncs_the_file_then_its_directory(tmp_path, monkeypatch):
    from qkv.models.hub import atomic_write

    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    target = tmp_path / "x.json"
    atomic_write(target, lambda tmp: Path(tmp).write_text("{}"))
    assert len(synced) == 2
    assert synced[0].startswith(str(tmp_path / ".x.json."))  # the temporary file, before
    assert synced[1] == str(tmp_path)  # the directory, after the rename
    assert target.read_text() == "{}"
