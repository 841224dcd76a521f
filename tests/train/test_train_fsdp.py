"""``qkv train --fsdp / --grad-accum / --activation-checkpointing / --precision``.

Oracles: the plain one-process trainer (tested elsewhere against fp64 and torch.nn) on the
same global batch — its losses (metrics.jsonl) and final weights. FSDP, micro-batches and
checkpointed layers only change the order of float sums: tolerances rel 1e-5 (FSDP across
processes: reduce-scatter vs one process), rel 1e-6 (micro-batches in one process).
A dead rank makes the other stop with an error (never a hang); bf16 on a CPU without native
bf16 is refused in one line before anything is written; ``qkv export`` of a sharded run ==
``load_run``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from _spawn import assert_weights_match, spawn

from conftest import run_bounded
from qkv.cli import main
from qkv.models import CheckpointError
from qkv.train import TrainConfig, Trainer, TrainingError, load_run
from qkv.train.config import ConfigError
from qkv.train.distributed import dist_timeout
from qkv.train.sharded_checkpoint import is_sharded_checkpoint

GPT = dict(model="gpt", task="copy", preset="gpt-tiny",
           overrides=dict(dim=32, num_heads=2, ffn_hidden=64, dropout=0.0), steps=4,
           batch_size=8, lr=1e-2, warmup=1, eval_every=2, eval_examples=8)
CLI = ["--task", "copy", "--set", "dim=32", "--set", "num_heads=2", "--set", "dropout=0.0",
       "--batch-size", "8", "--lr", "1e-2", "--warmup", "1", "--eval-every", "2",
       "--eval-examples", "8", "--no-progress", "--device", "cpu"]
MODELS = {"gpt": ["--model", "gpt", "--preset", "gpt-tiny"],
          "bert-mlm": ["--model", "bert-mlm", "--preset", "bert-tiny", "--set",
                       "attn_dropout=0.0"],
          "transformer": ["--preset", "transformer-tiny"]}


def quiet(**kw) -> dict:
    return dict(progress=False, log=lambda line: None, **kw)


def losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def weights(run: Path) -> dict[str, torch.Tensor]:
    model, _ = load_run(run)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _without_key_bias(name: str, t: torch.Tensor) -> torch.Tensor:
    """The attention's key bias (the middle third of in_proj.bias) has a gradient that is 0
    up to rounding (softmax is invariant to adding a constant to a query's scores), which
    Adam's normalisation turns into steps of ~lr in either direction: a different summation
    order moves it by up to steps x lr, so it is compared apart. Elsewhere an entry whose
    gradient crosses ~0 at some step can move by a few 1e-6 the same way: hence an absolute
    tolerance of ``rel`` too (weights are ~0.02..1)."""
    if not name.endswith("attn.in_proj.bias"):
        return t
    c = t.shape[0] // 3
    return torch.cat([t[:c], t[2 * c:]])


def assert_weights_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                         rel: float, lr: float = GPT["lr"], steps: int = 4) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert_weights_match(_without_key_bias(k, got[k]), _without_key_bias(k, want[k]),
                             rtol=rel, atol=rel, lr=lr, steps=steps, what=k)
        if k.endswith("attn.in_proj.bias"):
            assert (got[k] - want[k]).abs().max() <= 2 * lr * steps, k


def train(tmp: Path, name: str, **kw) -> Path:
    Trainer(TrainConfig(**{**GPT, **kw}), tmp / name, **quiet()).run()
    return tmp / name


# --- one process -------------------------------------------------------------------------------
def test_grad_accum_and_checkpointing_equal_the_whole_batch(tmp_path):
    """K=2 and K=4 micro-batches, and checkpointed layers, give the whole batch's losses
    (rel 1e-6) and final weights (rel 1e-5) in one process."""
    whole = train(tmp_path, "whole")
    for name, kw in (("k2", dict(grad_accum=2)), ("k4", dict(grad_accum=4)),
                     ("ckpt", dict(activation_checkpointing=True))):
        run = train(tmp_path, name, **kw)
        assert losses(run) == pytest.approx(losses(whole), rel=1e-6), name
        assert_weights_close(weights(run), weights(whole), rel=1e-5)
    # the run.json records the settings
    info = json.loads((tmp_path / "k4" / "run.json").read_text())
    assert info["grad_accum"] == 4 and info["fsdp"] is False and info["precision"] == "fp32"


def test_fsdp_one_process_equals_plain_and_export(tmp_path, capsys):
    """--fsdp in one process (its own process group): the plain run's losses and weights;
    a sharded checkpoint; resumed 2 -> 4 it matches the uninterrupted run; `qkv export`
    writes load_run's model."""
    plain = train(tmp_path, "plain")
    run = train(tmp_path, "fsdp", fsdp=True)
    assert is_sharded_checkpoint(run / "checkpoint")
    assert not (run / "checkpoint" / "model.safetensors").exists()
    assert losses(run) == pytest.approx(losses(plain), rel=1e-6)
    assert_weights_close(weights(run), weights(plain), rel=1e-5)
    assert not torch.distributed.is_initialized()  # the run left its own group
    half = train(tmp_path, "half", fsdp=True, steps=2)
    Trainer.resume(half, steps=4, **quiet()).run()
    assert losses(half) == losses(run)  # bit-identical on one process
    w_half, w_run = weights(half), weights(run)
    assert all(torch.equal(w_half[k], w_run[k]) for k in w_run)
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(tmp_path / "exported")]) == 0
    from qkv.models import GPT as GPTModel

    exported = GPTModel.from_pretrained(tmp_path / "exported").state_dict()
    ref = weights(run)
    assert sorted(exported) == sorted(ref)
    for k in ref:
        assert torch.equal(exported[k], ref[k]), k


def test_fsdp_and_precision_are_fixed_grad_accum_may_change(tmp_path):
    run = train(tmp_path, "run", steps=2)
    with pytest.raises(ValueError, match=r"fsdp .*fixed for a run"):
        Trainer.resume(run, steps=4, fsdp=True, **quiet())
    with pytest.raises(ValueError, match=r"precision .*fixed for a run"):
        Trainer.resume(run, steps=4, precision="bf16", **quiet())
    Trainer.resume(run, steps=4, grad_accum=2, activation_checkpointing=True, **quiet()).run()
    info = json.loads((run / "run.json").read_text())
    assert info["grad_accum"] == 2 and info["activation_checkpointing"] is True
    assert losses(run) == pytest.approx(losses(train(tmp_path, "whole")), rel=1e-6)
    # a run.json edited to say fsdp over a plain checkpoint is refused
    info["fsdp"] = True
    (run / "run.json").write_text(json.dumps(info))
    with pytest.raises(CheckpointError, match="fsdp"):
        Trainer.resume(run, steps=6, **quiet())


def test_settings_checked():
    with pytest.raises(ConfigError, match="grad_accum must be a positive integer"):
        TrainConfig(**{**GPT, "grad_accum": 0})
    with pytest.raises(ConfigError, match="does not divide batch_size 8"):
        TrainConfig(**{**GPT, "grad_accum": 3})
    with pytest.raises(ConfigError, match="precision must be one of"):
        TrainConfig(**{**GPT, "precision": "fp8"})
    with pytest.raises(ConfigError, match="loss scaling"):
        TrainConfig(**{**GPT, "precision": "fp16"})
    with pytest.raises(ConfigError, match="fsdp must be true or false"):
        TrainConfig(**{**GPT, "fsdp": 1})
    with pytest.raises(ConfigError, match="cannot split") as exc:
        TrainConfig(model="clip", task="shapes", batch_size=8, grad_accum=2)
    assert exc.value.field == "grad_accum"
    # a run.json from before these settings loads with their defaults
    old = {k: v for k, v in TrainConfig(**GPT).to_dict().items()
           if k not in ("fsdp", "grad_accum", "activation_checkpointing", "precision")}
    c = TrainConfig.from_dict(old)
    assert (c.fsdp, c.grad_accum, c.activation_checkpointing, c.precision) == (
        False, 1, False, "fp32")


def test_batch_must_divide_by_processes_times_k(tmp_path, monkeypatch):
    """In one process the TrainConfig check speaks; the world check is the trainer's."""
    from qkv.train import trainer as trainer_module
    from qkv.train.distributed import World

    monkeypatch.setattr(trainer_module, "setup_world", lambda device, group=False: World(0, 2))
    with pytest.raises(ValueError, match="2 processes x grad_accum 8"):
        Trainer(TrainConfig(**{**GPT, "grad_accum": 8}), tmp_path / "r", **quiet())
    assert not (tmp_path / "r").exists()


def without_native_bf16(monkeypatch) -> None:
    """Pretend a CPU without native bf16 (native ones train bf16: test_bf16_cpu.py)."""
    from qkv.train.precision import CPUBF16, MatmulProbe

    monkeypatch.setattr("qkv.train.precision.cpu_bf16", lambda: CPUBF16(
        "no bf16", (), MatmulProbe(512, bf16_gflops=1.0, fp32_gflops=100.0)))


def test_bf16_on_cpu_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch):
    without_native_bf16(monkeypatch)
    out = tmp_path / "run"
    assert main(["train", *CLI, *MODELS["gpt"], "--steps", "1", "--precision", "bf16",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qkv train: error:") and "bf16" in err and "force" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()
    assert main(["train", *CLI, *MODELS["gpt"], "--steps", "1", "--precision", "fp16",
                 "--out", str(out)]) == 2
    assert "loss scaling" in capsys.readouterr().err
    assert not out.exists()


def test_bf16_forced_on_cpu_trains(tmp_path, monkeypatch):
    without_native_bf16(monkeypatch)
    with pytest.warns(UserWarning, match="forced"):
        trainer = Trainer(TrainConfig(**{**GPT, "precision": "bf16", "steps": 2}),
                          tmp_path / "run", force_precision=True, **quiet())
    trainer.run()
    a = losses(tmp_path / "run")
    b = losses(train(tmp_path, "fp32", steps=2))
    assert a != b and a == pytest.approx(b, rel=2e-2)  # bf16 compute: close, not equal


def test_help_lists_the_scale_flags(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for flag in ("--fsdp", "--grad-accum", "--activation-checkpointing", "--precision",
                 "--force-precision", "--nnodes", "QKV_DIST_TIMEOUT"):
        assert flag in text, flag


def test_dist_timeout(monkeypatch):
    monkeypatch.delenv("QKV_DIST_TIMEOUT", raising=False)
    assert dist_timeout().total_seconds() == 600
    monkeypatch.setenv("QKV_DIST_TIMEOUT", "12.5")
    assert dist_timeout().total_seconds() == 12.5
    for bad in ("0", "-3", "soon", "inf", "nan"):
        monkeypatch.setenv("QKV_DIST_TIMEOUT", bad)
        with pytest.raises(ValueError, match="QKV_DIST_TIMEOUT"):
            dist_timeout()


def test_memory_estimate_scales_with_shards_and_checkpointing():
    """Against the formulas written out by hand for a 2-layer GPT on the meta device."""
    from qkv.models import GPT as GPTModel
    from qkv.models import GPTConfig
    from qkv.train.memory import estimate_training_bytes, scale_estimate

    with torch.device("meta"):
        model = GPTModel(GPTConfig.from_name("gpt-tiny", vocab_size=50, max_len=16, dim=32,
                                             num_heads=2, ffn_hidden=64, num_layers=2))
    est = estimate_training_bytes(model, batch_size=4, seq_len=16)
    p = sum(x.numel() for x in model.parameters())
    layer = sum(x.numel() for x in model.layers[0].parameters())
    root = p - 2 * layer
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    sharded = scale_estimate(est, model, shards=8)
    assert sharded["parameters"] == 16 * p // 8 + buffers + 4 * (root + 2 * layer)
    assert sharded["activations"] == est["activations"]
    ckpt = scale_estimate(est, model, checkpointing=True)
    assert ckpt["parameters"] == est["parameters"]
    assert ckpt["activations"] == int(est["activations"] * (1 / (10 + 2 * 64 / 32) + 1 / 2))
    assert est["activations"] == 4 * 2 * 4 * 16 * (10 * 32 + 2 * 64)


# --- two processes -------------------------------------------------------------------------------
def _killed_worker(rank: int, world: int, out: str) -> None:
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank))
    trainer = Trainer(TrainConfig(**{**GPT, "fsdp": True, "steps": 6, "eval_every": 6}),
                      Path(out), **quiet())
    real = trainer.train_step

    def step() -> dict:
        if rank == 1 and trainer.step == 2:
            os._exit(3)  # killed: no error, no goodbye
        return real()

    trainer.train_step = step  # type: ignore[method-assign]
    started = time.monotonic()
    try:
        trainer.run()
    except TrainingError as exc:
        Path(out, "error.txt").write_text(f"{time.monotonic() - started:.1f}\n{exc}")
        raise


@pytest.mark.slow
def test_a_killed_rank_stops_the_other_with_an_error(tmp_path):
    errors = spawn(_killed_worker, 2, tmp_path, str(tmp_path / "run"), timeout=120)
    assert errors[0] and errors[0] != "TIMEOUT", errors  # no hang
    assert "TrainingError" in errors[0] and "lost the other processes" in errors[0], errors[0]
    assert errors[1].startswith("exit code 3"), errors[1]
    _, message = (tmp_path / "run" / "error.txt").read_text().split("\n", 1)
    assert "step 2" in message and "QKV_DIST_TIMEOUT" in message


def _torchrun(args: list[str], out: Path, nproc: int) -> None:
    from test_distributed import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "QKV_DIST_TIMEOUT": "60"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), "-m", "qkv.cli", *args]
    if nproc == 1:
        cmd = [sys.executable, "-m", "qkv.cli", *args]
    done = run_bounded(cmd, env=env, timeout=240)
    # a finished run exits 0 on every rank (no gloo abort at shutdown: test_shutdown.py)
    assert done.returncode == 0, done.stderr[-3000:]
    if "--resume" not in args:
        assert done.stdout.count("qkv train: done") == 1


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt", "bert-mlm"])
@pytest.mark.timeout(900)  # its subprocesses' own limits, with room
def test_fsdp_two_processes_equal_one(tmp_path, model):
    """2 gloo processes with --fsdp == 1 plain process (losses, final weights, rel 1e-5);
    with --grad-accum 2 == K=1 (rel 1e-6); a 2-process run stopped at step 2 resumes on
    1 process and a 1-process run on 2, both giving the uninterrupted run's losses."""
    base = [*CLI, *MODELS[model], "--steps", "4"]
    _torchrun(["train", *base, "--out", str(tmp_path / "one")], tmp_path / "one", 1)
    _torchrun(["train", *base, "--fsdp", "--out", str(tmp_path / "two")], tmp_path / "two", 2)
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(one) == 4 and two == pytest.approx(one, rel=1e-5)
    assert_weights_close(weights(tmp_path / "two"), weights(tmp_path / "one"), rel=1e-5)
    if model != "gpt":
        return
    _torchrun(["train", *base, "--fsdp", "--grad-accum", "2", "--out", str(tmp_path / "k2")],
              tmp_path / "k2", 2)
    assert losses(tmp_path / "k2") == pytest.approx(two, rel=1e-6)
    for name, first, then in (("2to1", 2, 1), ("1to2", 1, 2)):
        run = tmp_path / name
        half = [*CLI, *MODELS[model], "--steps", "2", "--fsdp", "--out", str(run)]
        _torchrun(["train", *half], run, first)
        _torchrun(["train", "--resume", str(run), "--steps", "4", "--no-progress", "--device",
                   "cpu"], run, then)
        assert json.loads((run / "checkpoint" / "sharded.json").read_text())[
            "world_size"] == then
        assert losses(run) == pytest.approx(two, rel=1e-5), name
        assert_weights_close(weights(run), weights(tmp_path / "two"), rel=1e-5)
