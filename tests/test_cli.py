"""The ``qkv`` command line: the demo runs and reports backends agreeing with fp64."""

from __future__ import annotations

import re

import pytest

from qkv.cli import main


def test_demo_runs_and_backends_agree(capsys):
    assert main(["demo", "tour", "--length", "300"]) == 0
    out = capsys.readouterr().out
    errors = [float(e) for e in re.findall(r"max \|error\| vs fp64 reference = (\S+)", out)]
    assert len(errors) == 3 and max(errors) < 5e-5  # fp32 vs fp64 bar
    assert out.count("output finite: True") == 3


def test_bad_argument_is_one_line_not_a_traceback(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "tour", "--length", "0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --length: must be an integer >= 1, got '0'" in err
    assert len(err.strip().splitlines()) == 1


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["no-such-command"])
    assert exc.value.code == 2


def test_demo_help_states_the_demos_real_step_budgets(capsys):
    """`qkv demo --help` quotes the step budgets the demos use (it once said 1300 for clip
    after the budget became 800)."""
    from qkv.demos import clip as clip_demo
    from qkv.demos import flamingo as flamingo_demo

    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"coloured shapes ({clip_demo.DEMO_TRAINING['steps']} steps)" in text
    assert f"clip: default {clip_demo.DEMO_TRAINING['steps']};" in text
    assert f"its Flamingo steps, default {flamingo_demo.STEPS};" in text
    assert f"train one first, {flamingo_demo.VISION_STEPS} steps" in text
