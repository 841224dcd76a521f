"""The training loop: overfitting, bit-identical resume after an interruption, atomic
checkpoints, the NaN stop, the three model kinds on tasks and files."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from qkv.models import CheckpointError
from qkv.train import TrainConfig, Trainer, TrainingError, find_checkpoint, load_run
from qkv.train import checkpoint as ckpt_module
from qkv.train.kinds import get_kind

TINY = dict(dim=32, num_heads=2, ffn_hidden=64, dropout=0.1)


def config(**kw) -> TrainConfig:
    base = dict(model="transformer", task="copy", preset="transformer-tiny",
                overrides=dict(TINY, num_encoder_layers=1, num_decoder_layers=1),
                steps=8, batch_size=8, lr=3e-3, warmup=2, eval_every=3, eval_examples=8)
    return TrainConfig(**{**base, **kw})


def losses(run: Path) -> list[tuple[int, float, float, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in rows if "loss" in r]


def weights(run: Path) -> dict[str, torch.Tensor]:
    model, _ = load_run(run)
    return model.state_dict()


def quiet(**kw) -> dict:
    return dict(progress=False, log=lambda line: None, **kw)


def test_resume_after_an_interruption_is_bit_identical(tmp_path, monkeypatch):
    """Kill the run during step 5 (after the step-3 checkpoint): the resumed run redoes steps
    4..8 and matches an uninterrupted run exactly — losses, lr, grad norms, weights (dropout
    on, so the RNG state must be restored too)."""
    Trainer(config(), tmp_path / "whole", **quiet()).run()

    real_step = Trainer.train_step

    def crash_at_5(self):
        if self.step == 4:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(Trainer, "train_step", crash_at_5)
    with pytest.raises(KeyboardInterrupt):
        Trainer(config(), tmp_path / "cut", **quiet()).run()
    monkeypatch.setattr(Trainer, "train_step", real_step)
    assert json.loads((tmp_path / "cut/checkpoint/trainer_state.json").read_text())["step"] == 3
    resumed = Trainer.resume(tmp_path / "cut", **quiet())
    assert resumed.step == 3
    resumed.run()

    assert losses(tmp_path / "cut") == losses(tmp_path / "whole")
    assert len(losses(tmp_path / "whole")) == 8
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_extends_a_finished_run_to_more_steps(tmp_path):
    """``--steps`` counts the whole run: 4 steps then resume to 8 == 8 steps (inverse-sqrt
    does not depend on the total)."""
    Trainer(config(eval_every=4), tmp_path / "whole", **quiet()).run()
    Trainer(config(eval_every=4, steps=4), tmp_path / "two", **quiet()).run()
    Trainer.resume(tmp_path / "two", steps=8, **quiet()).run()
    assert losses(tmp_path / "two") == losses(tmp_path / "whole")
    assert json.loads((tmp_path / "two/run.json").read_text())["steps"] == 8  # the new total
    assert json.loads((tmp_path / "two/checkpoint/run.json").read_text())["steps"] == 8
    with pytest.raises(ValueError, match="already at step 8; give --steps greater than 8"):
        Trainer.resume(tmp_path / "two", **quiet())


def test_a_save_that_fails_midway_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    run = tmp_path / "run"
    Trainer(config(steps=3), run, **quiet()).run()
    before = weights(run)

    def broken_save(tensors, path, *args, **kwargs):
        Path(path).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_module, "save_file", broken_save)
    with pytest.raises(OSError, match="disk full"):
        Trainer.resume(run, steps=6, **quiet()).run()
    after = weights(run)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert json.loads((run / "checkpoint/trainer_state.json").read_text())["step"] == 3


def test_a_kill_between_the_two_renames_falls_back_to_the_old_checkpoint(tmp_path,
                                                                          monkeypatch):
    run = tmp_path / "run"
    Trainer(config(steps=3), run, **quiet()).run()
    real_replace = os.replace

    def stop_after_first(src, dst):
        real_replace(src, dst)
        if str(dst).endswith("checkpoint.old"):
            raise KeyboardInterrupt

    monkeypatch.setattr(ckpt_module.os, "replace", stop_after_first)
    with pytest.raises(KeyboardInterrupt):
        Trainer.resume(run, steps=6, **quiet()).run()
    monkeypatch.setattr(ckpt_module.os, "replace", real_replace)
    assert not (run / "checkpoint").exists()
    assert find_checkpoint(run) == run / "checkpoint.old"
    model, tok = load_run(run)
    assert tok.vocab_size == model.config.src_vocab_size
    resumed = Trainer.resume(run, steps=6, **quiet())
    assert resumed.step == 3
    resumed.run()
    assert (run / "checkpoint").exists() and not (run / "checkpoint.old").exists()


def test_a_stale_checkpoint_tmp_is_cleared_before_a_save(tmp_path):
    """A save killed midway leaves RUN/checkpoint.tmp behind: the next save must start from
    an empty directory, so the checkpoint holds exactly what a clean save writes (no stale
    file — a pickle among them — rides along) and loads."""
    Trainer(config(steps=1, eval_every=1), tmp_path / "clean", **quiet()).run()
    Trainer.resume(tmp_path / "clean", steps=2, **quiet()).run()
    expected = sorted(p.name for p in (tmp_path / "clean/checkpoint").iterdir())

    run = tmp_path / "run"
    Trainer(config(steps=1, eval_every=1), run, **quiet()).run()
    stale = run / "checkpoint.tmp"
    (stale / "nested").mkdir(parents=True)
    for name in ("pytorch_model.bin", "adapter_model.safetensors", "model.safetensors",
                 "trainer_state.json", "nested/junk.txt"):
        (stale / name).write_bytes(b"stale bytes from a killed save")
    Trainer.resume(run, steps=2, **quiet()).run()

    assert not stale.exists()
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == expected
    assert json.loads((run / "checkpoint/trainer_state.json").read_text())["step"] == 2
    a, b = weights(tmp_path / "clean"), weights(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    resumed = Trainer.resume(run, steps=3, **quiet())
    assert resumed.step == 2
    resumed.run()


def test_a_nan_loss_stops_training_naming_the_step(tmp_path, monkeypatch):
    run = tmp_path / "run"
    trainer = Trainer(config(), run, **quiet())
    real_forward = type(trainer.objective).forward

    def nan_at_5(self, batch):
        loss, count = real_forward(self, batch)
        return (loss * float("nan"), count) if trainer.step == 4 else (loss, count)

    monkeypatch.setattr(type(trainer.objective), "forward", nan_at_5)
    with pytest.raises(TrainingError, match=r"step 5: loss is nan.*step 3"):
        trainer.run()
    assert json.loads((run / "checkpoint/trainer_state.json").read_text())["step"] == 3
    load_run(run)  # the last good checkpoint is intact


def test_a_tiny_transformer_overfits_a_tiny_batch(tmp_path, monkeypatch):
    """The same 8 reversal examples every step: the loss must fall far."""
    cfg = config(task="reverse", steps=150, eval_every=150, lr=1e-2, warmup=10,
                 label_smoothing=0.0, overrides=dict(TINY, dropout=0.0))
    trainer = Trainer(cfg, tmp_path / "run", **quiet())
    fixed = trainer.data.train(0, 8)
    monkeypatch.setattr(trainer.data, "train", lambda start, count: fixed)
    trainer.run()
    rows = losses(tmp_path / "run")
    assert rows[0][1] > 2.0 and rows[-1][1] < 0.05, (rows[0], rows[-1])


@pytest.mark.parametrize("kind", ["gpt", "bert-mlm"])
def test_gpt_and_bert_train_on_a_task(tmp_path, kind):
    preset = {"gpt": "gpt-tiny", "bert-mlm": "bert-tiny"}[kind]
    cfg = config(model=kind, preset=preset, overrides=dict(dim=32, num_heads=2), steps=4)
    result = Trainer(cfg, tmp_path / "run", **quiet()).run()
    assert result["step"] == 4 and result["eval_loss"] > 0
    assert ("exact_match" in result) == (kind == "gpt")
    assert ("masked_accuracy" in result) == (kind == "bert-mlm")
    model, _ = load_run(tmp_path / "run")
    assert type(model).__name__ == {"gpt": "GPT", "bert-mlm": "BERT"}[kind]


def test_files_tsv_and_text_with_bpe(tmp_path):
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text("".join(f"{w}\t{w[::-1]}\n" for w in ["abc", "hello", "qkv", "猫坐在垫子上",
                                                         "attention", "它很累"] * 4))
    result = Trainer(config(task=None, data=str(tsv), steps=2, eval_every=2), tmp_path / "s2s",
                     **quiet()).run()
    assert 0 <= result["exact_match"] <= 1
    text = tmp_path / "corpus.txt"
    text.write_text("the cat sat on the mat because it was tired. " * 200)
    cfg = config(model="gpt", preset="gpt-tiny", task=None, data=str(text), tokenizer="bpe",
                 bpe_vocab_size=300, max_len=16, overrides=dict(dim=32, num_heads=2), steps=2,
                 eval_every=2)
    result = Trainer(cfg, tmp_path / "lm", **quiet()).run()
    assert "exact_match" not in result and result["eval_loss"] > 0


def test_refuses_to_overwrite_a_run_and_resume_needs_one(tmp_path):
    Trainer(config(steps=1, eval_every=1), tmp_path / "run", **quiet()).run()
    with pytest.raises(ValueError, match="already holds a run"):
        Trainer(config(steps=1), tmp_path / "run", **quiet())
    with pytest.raises(CheckpointError, match="cannot resume"):
        Trainer.resume(tmp_path / "nothing-here", **quiet())


@pytest.mark.parametrize(("kw", "match"), [
    (dict(model="t5"), "model must be"), (dict(task=None), "exactly one"),
    (dict(data="x.tsv"), "exactly one"), (dict(tokenizer="wordpiece"), "tokenizer"),
    (dict(steps=0), "steps"), (dict(lr=0.0), "lr"), (dict(label_smoothing=1.0), "smoothing"),
])
def test_bad_settings_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        config(**kw)


def test_bert_mlm_on_a_text_file(tmp_path, monkeypatch):
    """Text windows are W + 1 tokens (the GPT shift); BERT reads W = its max_len. The
    evaluation's masked accuracy and loss are recomputed from the saved model's own logits on
    the batches evaluation built, and those batches must be held-out windows: W consecutive
    tokens of the text's tail, corrupted only where a label is set."""
    rng = random.Random(0)  # random letters: a window of 16 occurs once in the whole text
    text = "".join(rng.choice("abcdefghij ") for _ in range(3000))
    (tmp_path / "corpus.txt").write_text(text)
    kind = get_kind("bert-mlm")  # evaluation builds its batches with the kind's make_batch
    built: list[dict[str, torch.Tensor]] = []
    real_make_batch = kind.make_batch

    def spy(*args, **kwargs):
        batch = real_make_batch(*args, **kwargs)
        if not torch.is_grad_enabled():  # evaluation's (under no_grad), not a step's
            built.append(batch)
        return batch

    monkeypatch.setattr(kind, "make_batch", spy)
    cfg = config(model="bert-mlm", preset="bert-tiny", task=None,
                 data=str(tmp_path / "corpus.txt"), max_len=16,
                 overrides=dict(dim=32, num_heads=2), steps=2, eval_every=2, batch_size=4,
                 eval_examples=32)
    result = Trainer(cfg, tmp_path / "mlm", **quiet()).run()

    model, tok = load_run(tmp_path / "mlm")
    stream = tok.encode(text)
    tail = stream[-max(len(stream) // 20, 17):]  # the held-out part: well under 20 % of it
    head = stream[:len(stream) - len(stream) // 5]
    correct, total, loss = 0, 0, 0.0
    assert built
    for batch in built:
        labels, ids = batch["labels"], batch["ids"]
        assert ids.shape[1] == 16 and batch["attention_mask"].all()
        original = torch.where(labels != -100, labels, ids)
        for row in original.tolist():
            assert _contains(tail, row) and not _contains(head, row), row
        assert ((labels != -100).sum(dim=1) >= 1).all()
        with torch.no_grad():
            logits = model.masked_lm(ids, batch["attention_mask"])  # (B, W, V)
        sel = labels != -100
        correct += int((logits.argmax(-1)[sel] == labels[sel]).sum())
        total += int(sel.sum())
        loss += float(torch.nn.functional.cross_entropy(logits[sel].double(), labels[sel],
                                                        reduction="sum"))
    assert total >= 10 and 0 < correct < total  # so that equality below says something
    assert result["masked_accuracy"] == correct / total  # the same argmaxes, counted apart
    assert result["eval_loss"] == pytest.approx(loss / total, rel=1e-5)


def _contains(stream: list[int], row: list[int]) -> bool:
    n = len(row)
    return any(stream[i:i + n] == row for i in range(len(stream) - n + 1))


def test_a_corrupt_trainer_state_is_a_checkpoint_error(tmp_path):
    run = tmp_path / "run"
    Trainer(config(steps=3), run, **quiet()).run()
    state = run / "checkpoint" / "trainer_state.safetensors"
    state.write_bytes(state.read_bytes()[:50])
    with pytest.raises(CheckpointError, match="cannot read the trainer state"):
        Trainer.resume(run, steps=6, **quiet())


def test_a_run_killed_before_its_first_checkpoint_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(Trainer, "train_step", lambda self: (_ for _ in ()).throw(
        KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        Trainer(config(), tmp_path / "run", **quiet()).run()
    with pytest.raises(CheckpointError, match="no checkpoint yet"):
        Trainer.resume(tmp_path / "run", **quiet())


def test_a_data_file_run_resumes_from_another_directory(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "pairs.tsv").write_text("".join(f"{w}\t{w[::-1]}\n" for w in
                                                      ["abc", "hello", "qkv", "cat"] * 3))
    monkeypatch.chdir(tmp_path / "a")
    Trainer(config(task=None, data="pairs.tsv", steps=2, eval_every=2), tmp_path / "run",
            **quiet()).run()
    monkeypatch.chdir(tmp_path)
    Trainer.resume(tmp_path / "run", steps=3, **quiet()).run()
    assert json.loads((tmp_path / "run/run.json").read_text())["data"] == str(
        tmp_path / "a" / "pairs.tsv")


def test_checkpoint_files_get_ordinary_permissions(tmp_path):
    """Atomic writes go through a private temporary file; the result must still be readable
    as a plain open(path, "w") file would be (0666 less the umask)."""
    umask = os.umask(0o022)
    os.umask(umask)
    run = tmp_path / "run"
    Trainer(config(steps=1, eval_every=1), run, **quiet()).run()
    for path in [run / "run.json", *(run / "checkpoint").iterdir()]:
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path


def test_a_partial_metrics_line_from_a_kill_does_not_block_resume(tmp_path):
    run = tmp_path / "run"
    Trainer(config(steps=3), run, **quiet()).run()
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "loss": 1.2')  # the process died mid-line
    Trainer.resume(run, steps=4, **quiet()).run()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]


def test_max_len_shorter_than_the_data_is_named(tmp_path):
    with pytest.raises(ValueError, match="max_len=8 is shorter than the longest example"):
        Trainer(config(max_len=8), tmp_path / "run", **quiet())
