"""``qkv bench attention`` (qkv.bench, qkv.cli.bench): the quick run prints both tables with
a row per method and writes the PNG; one case measured in its own process; the table maths;
bad arguments are one-line usage errors. Timings are never asserted."""

from __future__ import annotations

import pytest

from qkv import bench
from qkv.cli import main


def test_quick_run_prints_tables_and_writes_png(tmp_path, capsys):
    out = tmp_path / "sub" / "bench.png"
    out.parent.mkdir()
    assert main(["bench", "attention", "--quick", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    seconds, memory = text.split("peak MiB above the inputs:")
    for table in (seconds, memory):
        assert "| method | N=128 | N=256 |" in table
        for key, label in bench.METHODS.items():
            row = next(line for line in table.splitlines() if line.startswith(f"| {label}"))
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert len(cells) == (5 if table is seconds else 3), row
            assert all(float(c) >= 0 for c in cells[1:3]), (key, row)
    assert "sliding window 32" in seconds  # --quick's window
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in out.parent.iterdir() if p.name != "bench.png"]  # no temp left


def test_case_in_its_own_process():
    m = bench.measure_isolated("linear", 64, repeat=1, timeout=120)
    assert m.method == "linear" and m.n == 64 and m.seconds > 0 and m.peak_mib >= 0


def test_exponent_and_table_from_known_figures():
    assert bench.fit_exponent([1024, 2048, 4096], [1.0, 4.0, 16.0]) == pytest.approx(2.0)
    rows = [bench.Measurement("dense", n, n * n * 1e-8, 10.0) for n in (1000, 2000)]
    rows += [bench.Measurement("linear", n, n * 1e-6, n / 100) for n in (1000, 2000)]
    table = bench.format_table(rows, window=512)
    assert "| dense causal SDPA | 0.0100 | 0.0400 | 2.00 | 1.00× |" in table
    assert "| causal linear (elu) | 0.0010 | 0.0020 | 1.00 | 20.00× |" in table
    assert "| causal linear (elu) | 10 | 20 |" in table


@pytest.mark.parametrize("args,match", [
    (["--lengths", "0,128"], "--lengths must be positive"),
    (["--lengths", "a,b"], "--lengths must be comma-separated integers"),
    (["--methods", "dense,flash"], "--methods: unknown"),
    (["--repeat", "0"], "argument --repeat: must be an integer >= 1, got '0'"),
    (["--window", "0"], "argument --window: must be an integer >= 1, got '0'"),
])
def test_bad_arguments_are_one_line_errors(args, match, capsys):
    try:
        code = main(["bench", "attention", "--quick", *args])
    except SystemExit as exc:  # argparse refused a value
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qkv bench: error: ") and match in err and "\n" not in err
