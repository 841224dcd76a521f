"""``qkv train`` from the command line: a run, its resume, one-line errors."""

from __future__ import annotations

import json

import pytest

from qkv.cli import main

TINY = ["--task", "copy", "--preset", "transformer-tiny", "--set", "dim=32", "--set",
        "num_heads=2", "--batch-size", "8", "--eval-every", "2", "--eval-examples", "4",
        "--no-progress"]


def test_train_then_resume_to_more_steps(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "2", "--out", str(run)]) == 0
    assert "qkv train: done (step 2" in capsys.readouterr().out
    assert (run / "checkpoint" / "model.safetensors").is_file()
    assert (run / "checkpoint" / "config.json").is_file()
    assert main(["train", "--resume", str(run), "--steps", "4", "--no-progress"]) == 0
    state = json.loads((run / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 4
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text()
             .splitlines()]
    assert steps == [1, 2, 2, 3, 4, 4]  # four train steps, an evaluation at 2 and 4


@pytest.mark.parametrize(("argv", "message"), [
    (["--resume", "{run}", "--lr", "1"], "only --steps may be given"),
    (["--data", "{tmp}/missing.tsv"], "no such file"),
    (["--data", "{tmp}/bad.tsv"], "bad.tsv"),
    (["--task", "copy", "--data", "{tmp}/bad.tsv"], "exactly one of a task"),
    (["--set", "dim"], "KEY=VALUE"),
    (["--set", "no_such_field=3"], "unknown config fields"),
    (["--model", "t5"], "model must be one of"),
    (["--resume", "{tmp}/none"], "none"),
])
def test_bad_input_is_one_line(tmp_path, capsys, argv, message):
    run = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "1", "--out", str(run)]) == 0
    (tmp_path / "bad.tsv").write_bytes(b"no tab on this line\n\xff\xfe\n")
    capsys.readouterr()
    argv = [a.format(run=run, tmp=tmp_path) for a in argv]
    base = [] if "--resume" in argv else [*TINY, "--out", str(tmp_path / "other")]
    if "--data" in argv:
        base = base[2:]  # no --task
    assert main(["train", *base, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qkv train: error:") and message in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_help_has_examples(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    assert exc.value.code == 0
    assert "examples:" in capsys.readouterr().out
