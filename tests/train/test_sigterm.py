"""SIGTERM (what ``kill``, a job scheduler or torchrun send) stops ``qkv train`` as Ctrl-C does:
a one-line message naming the step and the last checkpoint, the run directory's lock released,
exit status 128 + 15, and the run resumes from that checkpoint.

Oracles: a real ``python -m qkv.cli train`` process, signalled once its first checkpoint is
logged on its stdout (``[eval]``, printed after the save); the files in the run directory
(``.lock``, the checkpoint's step in metrics.jsonl) and the process's own exit status; the
handler of the process that runs a Trainer in-process, read back with ``signal.getsignal``.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

TINY = ["--task", "copy", "--model", "gpt", "--preset", "gpt-tiny", "--set", "dim=32", "--set",
        "num_heads=2", "--batch-size", "8", "--warmup", "1", "--eval-every", "2",
        "--eval-examples", "8", "--no-progress", "--device", "cpu"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _wait_for_line(proc: subprocess.Popen, marker: str, timeout: float) -> list[str]:
    """The stdout lines of ``proc`` up to the first one holding ``marker`` (bounded)."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                continue
            line = proc.stdout.readline()
            if not line:  # the process ended first
                break
            lines.append(line)
            if marker in line:
                return lines
    proc.kill()
    _, err = proc.communicate(timeout=30)
    raise AssertionError(f"no {marker!r} line within {timeout} s; stdout {lines!r}, "
                         f"stderr {err[-3000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_mid_run_names_the_checkpoint_releases_the_lock_and_resumes(tmp_path, sig):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "qkv.cli", "train", *TINY, "--steps", "100000", "--out",
         str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        _wait_for_line(proc, "[eval]", timeout=120)
        assert (run / ".lock").exists()  # held while it trains
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig, (proc.returncode, err[-3000:])
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err[-3000:]  # one line, no traceback
    saved = [json.loads(r)["step"] for r in (run / "metrics.jsonl").read_text().splitlines()
             if "eval_loss" in r]
    assert saved and saved[-1] >= 2
    name = signal.Signals(sig).name
    assert lines[0].startswith(f"qkv train: interrupted by {name} at step "), lines[0]
    assert f"the last checkpoint is {run / 'checkpoint'} (step {saved[-1]})" in lines[0]
    assert f"qkv train --resume {run}" in lines[0]
    assert not (run / ".lock").exists()
    more = saved[-1] + 2
    done = subprocess.run([sys.executable, "-m", "qkv.cli", "train", "--resume", str(run),
                           "--steps", str(more), "--no-progress", "--device", "cpu"],
                          capture_output=True, text=True, timeout=120, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"steps {saved[-1]} -> {more}" in done.stdout
    assert not (run / ".lock").exists()


def test_the_handler_is_installed_only_while_the_trainer_runs_and_then_restored(tmp_path):
    """In-process: during ``run()`` SIGTERM has a handler of the Trainer's (the default
    before and after); a caller's own handler is left in place."""
    from qkv.train import TrainConfig, Trainer

    config = TrainConfig(model="gpt", task="copy", preset="gpt-tiny", steps=2, batch_size=8,
                         warmup=1, eval_every=2, eval_examples=8,
                         overrides={"dim": 32, "num_heads": 2})
    seen = []

    def log(line: str) -> None:
        seen.append(signal.getsignal(signal.SIGTERM))

    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    Trainer(config, tmp_path / "a", progress=False, log=log).run()
    assert seen and all(callable(h) for h in seen)  # the Trainer's, while it ran
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    def mine(signum, frame):  # pragma: no cover - never sent
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        seen.clear()
        Trainer(config, tmp_path / "b", progress=False, log=log).run()
        assert seen == [mine]
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_trainer_outside_the_main_thread_leaves_signals_alone(tmp_path):
    from qkv.train import TrainConfig, Trainer

    config = TrainConfig(model="gpt", task="copy", preset="gpt-tiny", steps=2, batch_size=8,
                         warmup=1, eval_every=2, eval_examples=8,
                         overrides={"dim": 32, "num_heads": 2})
    errors: list[BaseException] = []

    def train() -> None:
        try:
            Trainer(config, tmp_path / "t", progress=False, log=lambda line: None).run()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=train)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive() and errors == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert (Path(tmp_path / "t") / "checkpoint").is_dir()
