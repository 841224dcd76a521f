"""bf16 training on a CPU, decided by the CPU (``qkv.train.precision``).

The decision: with the CPU's report monkeypatched — native (bf16 instructions and a probe
finding bf16 matmuls faster) trains without a word; not native (no instructions, or a probe
finding them slow) is refused in one line holding both measured figures; forced trains with
a warning holding them. The CPU's own report is checked against /proc/cpuinfo read here.

A real run where this CPU is native (skipped elsewhere, with the reason): a 2-layer GPT, 3
bf16 steps without ``force_precision``. Oracles: the same run in fp32 — the first loss within
rel 2e-2 (bf16 keeps 8 mantissa bits: one rounding is 2^-8 ≈ 4e-3 relative, the loss of a
small model stays within a few of them) and not equal to it (bf16 really computed); master
weights, AdamW moments and the checkpoint all fp32; 2 steps + resume to 3 ==
3 steps straight (losses rel 1e-6: the same arithmetic in the same process).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qkv.cli import main
from qkv.train import TrainConfig, Trainer
from qkv.train import precision as precision_module
from qkv.train.precision import CPUBF16, MatmulProbe, check_precision_device
from qkv.train.sharding import precision_policy

NATIVE = CPUBF16("Fake CPU with AMX", ("avx512_bf16", "amx_bf16"),
                 MatmulProbe(512, bf16_gflops=740.0, fp32_gflops=180.0))
NO_ISA = CPUBF16("Fake CPU without bf16", (), MatmulProbe(512, bf16_gflops=1.5,
                                                           fp32_gflops=150.0))
SLOW_ISA = CPUBF16("Fake CPU, oneDNN off", ("avx512_bf16",),
                   MatmulProbe(512, bf16_gflops=2.5, fp32_gflops=160.0))

GPT = dict(model="gpt", task="copy", preset="gpt-tiny",
           overrides=dict(dim=32, num_heads=2, ffn_hidden=64, dropout=0.0), steps=3,
           batch_size=8, lr=1e-2, warmup=1, eval_every=2, eval_examples=8)
CLI = ["train", "--model", "gpt", "--preset", "gpt-tiny", "--task", "copy", "--set", "dim=32",
       "--set", "num_heads=2", "--set", "dropout=0.0", "--batch-size", "8", "--steps", "1",
       "--eval-examples", "8", "--no-progress", "--device", "cpu", "--precision", "bf16"]


def quiet(**kw) -> dict:
    return dict(progress=False, log=lambda line: None, **kw)


def losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def pretend(monkeypatch, cpu: CPUBF16) -> None:
    monkeypatch.setattr(precision_module, "cpu_bf16", lambda: cpu)


# --- the decision --------------------------------------------------------------------------------
def test_native_cpu_trains_bf16_without_a_word(monkeypatch):
    pretend(monkeypatch, NATIVE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        policy = precision_policy("bf16", "cpu")
        check_precision_device("bf16", "cpu", force=True)  # forcing what is allowed: silent
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)


@pytest.mark.parametrize("cpu", [NO_ISA, SLOW_ISA], ids=["no-isa", "slow-probe"])
def test_not_native_is_refused_with_both_figures(monkeypatch, cpu):
    pretend(monkeypatch, cpu)
    with pytest.raises(ValueError) as info:
        precision_policy("bf16", "cpu")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("precision 'bf16' on device 'cpu': bf16 is not native")
    assert f"{cpu.probe.bf16_gflops:.1f} GFLOP/s in bf16" in message
    assert f"{cpu.probe.fp32_gflops:.1f} GFLOP/s in fp32" in message
    slower = cpu.probe.fp32_gflops / cpu.probe.bf16_gflops
    assert f"bf16 {slower:.0f}x slower" in message
    assert cpu.cpu in message and "--force-precision" in message
    for isa in cpu.isa:  # what torch reported is named, so the user sees why it still failed
        assert isa in message
    if not cpu.isa:
        assert "no bf16 matmul instructions" in message


def test_forced_on_a_cpu_without_native_bf16_warns_with_the_figures(monkeypatch):
    pretend(monkeypatch, NO_ISA)
    with pytest.warns(UserWarning, match=r"forced") as record:
        policy = precision_policy("bf16", "cpu", force=True)
    assert policy.param_dtype == torch.bfloat16
    text = str(record[0].message)
    assert "1.5 GFLOP/s in bf16" in text and "150.0 GFLOP/s in fp32" in text


def test_fp16_on_a_cpu_and_cuda_do_not_depend_on_the_probe(monkeypatch):
    def no_probe() -> CPUBF16:
        raise AssertionError("probed")

    monkeypatch.setattr(precision_module, "cpu_bf16", no_probe)
    assert precision_policy("fp32", "cpu") is None
    assert precision_policy("bf16", "cuda").param_dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"precision 'fp16' on device 'cpu'.*force"):
        precision_policy("fp16", "cpu")


def test_cli_refusal_on_a_cpu_without_native_bf16(monkeypatch, tmp_path, capsys):
    pretend(monkeypatch, NO_ISA)
    out = tmp_path / "run"
    assert main([*CLI, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("qkv train: error:"), err
    assert "1.5 GFLOP/s in bf16" in err and "150.0 GFLOP/s in fp32" in err
    assert "--force-precision" in err and not out.exists()


# --- what this CPU reports -----------------------------------------------------------------------
def _proc_cpuinfo() -> tuple[str, set[str]]:
    """Model name and flags of the first processor, read independently of qkv."""
    text = Path("/proc/cpuinfo").read_text()
    name = next(line.split(":", 1)[1].strip() for line in text.splitlines()
                if line.startswith("model name"))
    flags = next(line.split(":", 1)[1].split() for line in text.splitlines()
                 if line.startswith("flags"))
    return name, set(flags)


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists()
                    or "model name" not in Path("/proc/cpuinfo").read_text(),
                    reason="no x86 /proc/cpuinfo to compare with")
def test_the_cpu_report_matches_proc_cpuinfo():
    name, flags = _proc_cpuinfo()
    text = precision_module.cpu_description()
    assert text.startswith(name)
    listed = set(text.rsplit(";", 1)[1].strip(" )").split())
    wanted = {f for f in flags if f.startswith(("avx", "amx")) or "vnni" in f or "bf16" in f}
    assert wanted <= listed
    assert not listed & {"sse2", "smep", "fpu", "ht"}  # only vector extensions
    isa = precision_module.cpu_bf16().isa
    assert ("avx512_bf16" in isa) == ("avx512_bf16" in flags)
    assert ("amx_bf16" in isa) == ("amx_bf16" in flags)


def test_the_probe_is_cached_and_leaves_the_rng_alone():
    state = torch.get_rng_state()
    probe = precision_module.probe_matmul(size=64, rounds=3)
    assert torch.equal(torch.get_rng_state(), state)
    assert probe.size == 64 and probe.bf16_gflops > 0 and probe.fp32_gflops > 0
    assert precision_module.cpu_bf16() is precision_module.cpu_bf16()


# --- a real run where this CPU is native ---------------------------------------------------------
def _native() -> CPUBF16:
    return precision_module.cpu_bf16()


needs_native = pytest.mark.skipif(
    not _native().native, reason=f"bf16 is not native on this CPU ({_native()})")


@needs_native
def test_bf16_trains_on_this_cpu_with_fp32_master_weights(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "forced" warning: nothing forced
        trainer = Trainer(TrainConfig(**{**GPT, "precision": "bf16"}), tmp_path / "bf16",
                          **quiet())
    trainer.run()
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    moments = [t for s in trainer.optimizer.state.values() for t in s.values()
               if torch.is_tensor(t) and t.numel() > 1]
    assert moments and all(t.dtype == torch.float32 for t in moments)
    ckpt = tmp_path / "bf16" / "checkpoint"
    for f in ("model.safetensors", "trainer_state.safetensors"):
        for key, t in load_file(str(ckpt / f)).items():
            assert t.dtype != torch.bfloat16, (f, key, t.dtype)

    Trainer(TrainConfig(**GPT), tmp_path / "fp32", **quiet()).run()
    got, want = losses(tmp_path / "bf16"), losses(tmp_path / "fp32")
    assert len(got) == 3 and all(torch.isfinite(torch.tensor(got)))
    assert got[0] == pytest.approx(want[0], rel=2e-2)
    assert got[0] != want[0]  # computed in bf16, not silently fp32

    Trainer(TrainConfig(**{**GPT, "precision": "bf16", "steps": 2}), tmp_path / "cut",
            **quiet()).run()
    resumed = Trainer.resume(tmp_path / "cut", steps=3, **quiet())
    assert resumed.step == 2
    resumed.run()
    assert losses(tmp_path / "cut") == pytest.approx(got, rel=1e-6)


@needs_native
def test_cli_trains_bf16_on_this_cpu_and_says_why(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*CLI, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "precision bf16" in text
    line = next(x for x in text.splitlines() if x.startswith("qkv train: bf16 on the CPU: "))
    assert "GFLOP/s in bf16" in line and "GFLOP/s in fp32" in line
    assert json.loads((out / "run.json").read_text())["precision"] == "bf16"
