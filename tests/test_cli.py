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
