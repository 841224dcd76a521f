"""Adapter runs from the command line, where they used to end in a raw traceback or a dead
end: a huge ``--lora r`` / ``--prefix N`` is one line with the memory estimate before anything
is allocated; an int8 base is refused up front; ``qkv export`` of a bottleneck / prefix run
writes the adapter with its base reference (``qkv peft merge`` says so); ``--int8`` on an
adapter run says what to do; the banner names the adapter kind once.

Oracles: parameter counts from the papers' formulas (LoRA: r·(In + Rows) per updated row
block; prefix: 2·P·C per layer; bottleneck: 2·C·M + M + C per adapter), the exported
directory's outputs against the run's own (``load_run``), bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qkv.cli import main
from qkv.generation.quantize import quantize
from qkv.peft import adapters as adapters_module
from qkv.peft import lora as lora_module
from qkv.peft import prefix as prefix_module
from qkv.train import load_run

SMALL = ["--steps", "1", "--batch-size", "4", "--eval-every", "1", "--eval-examples", "2",
         "--warmup", "1", "--no-progress", "--device", "cpu"]
C, LAYERS = 32, 1


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hardening") / "base"
    assert main(["train", "--model", "gpt", "--task", "copy", "--set", f"dim={C}",
                 "--set", f"num_layers={LAYERS}", "--set", "num_heads=2", "--out", str(out),
                 *SMALL]) == 0
    return out


@pytest.fixture(scope="module")
def runs(base) -> dict[str, Path]:
    out = {}
    for kind, flag, value in [("lora", "--lora", "r=2"),
                              ("bottleneck", "--adapters", "reduction_factor=8"),
                              ("prefix", "--prefix", "2")]:
        out[kind] = base.parent / kind
        assert main(["train", "--task", "reverse", "--init-from", str(base), flag, value,
                     "--out", str(out[kind]), *SMALL]) == 0
    return out


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") <= 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("flag,value,count,built", [
    ("--lora", "r=10000000", LAYERS * 2 * 10_000_000 * (C + C), (lora_module, "LoraUpdate")),
    ("--prefix", "100000000", LAYERS * 2 * 100_000_000 * C, (prefix_module, "PrefixKV")),
    ("--adapters", "reduction_factor=0.000001,placement=pfeiffer",
     LAYERS * (2 * C * int(C // 0.000001) + int(C // 0.000001) + C),
     (adapters_module, "Bottleneck")),
])
def test_a_huge_adapter_is_one_line_with_the_estimate_before_allocating(
        base, tmp_path, capsys, monkeypatch, flag, value, count, built):
    monkeypatch.setattr("qkv.train.memory.available_bytes", lambda device=None: 8 * 2**30)

    def refuse(*args, **kwargs):
        raise AssertionError("the adapter was built before the memory check")

    monkeypatch.setattr(*built, refuse)
    code = main(["train", "--task", "reverse", "--init-from", str(base), flag, value,
                 "--out", str(tmp_path / "x"), *SMALL])
    err = one_line_error(capsys)
    assert code == 2
    assert f"adds {count:,} parameters" in err and "16 bytes each" in err, err
    assert "8.0 GiB available" in err and f"lower {flag}" in err, err
    assert not (tmp_path / "x").exists()


def test_the_banner_names_each_adapter_kind_once(base, tmp_path, capsys):
    for flag, value, label in [("--adapters", "reduction_factor=8", "bottleneck adapters"),
                               ("--prefix", "2", "prefix"), ("--lora", "r=2", "LoRA adapter")]:
        capsys.readouterr()
        out = tmp_path / flag.strip("-")
        assert main(["train", "--task", "reverse", "--init-from", str(base), flag, value,
                     "--out", str(out), *SMALL]) == 0
        first = capsys.readouterr().out.splitlines()[0]
        assert f"qkv train: gpt + {label} (" in first, first
        assert first.split(" (")[0].count("adapter") <= 1, first  # not "adapters adapter"


def test_an_int8_base_is_refused_up_front(base, tmp_path, capsys):
    model, tok = load_run(base)
    quantize(model, "int8")
    q = tmp_path / "int8"
    model.save_pretrained(q)
    tok.save(q / "tokenizer.json")
    for extra in (["--lora", "r=2"], ["--prefix", "2"], ["--adapters", "reduction_factor=8"],
                  []):
        code = main(["train", "--task", "reverse", "--init-from", str(q), *extra,
                     "--out", str(tmp_path / "x"), *SMALL])
        err = one_line_error(capsys)
        assert code == 2 and "quantized to int8" in err and "float model" in err, err
        assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("kind", ["bottleneck", "prefix"])
def test_export_of_an_unmergeable_adapter_run_writes_the_adapter_and_its_base(
        runs, tmp_path, capsys, kind):
    run, out = runs[kind], tmp_path / "exported"
    assert main(["peft", "merge", str(run), "--out", str(tmp_path / "m")]) == 2
    err = one_line_error(capsys)
    assert f"qkv export {run} --out DIR" in err and "no plain model" in err, err
    assert main(["export", str(run), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "no plain model" in said and "qkv generate" in said, said
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "base.json", "run.json",
        "tokenizer.json"]
    (want_model, tok), (got_model, _) = load_run(run), load_run(out)
    ids = torch.tensor([tok.encode("hello abc")])
    with torch.no_grad():
        assert torch.equal(got_model(ids), want_model(ids))
    assert main(["generate", str(run), "--prompt", "abc", "--max-new-tokens", "4"]) == 0
    a = capsys.readouterr().out
    assert main(["generate", str(out), "--prompt", "abc", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out == a


def test_export_of_a_lora_run_points_to_merge(runs, tmp_path, capsys):
    assert main(["export", str(runs["lora"]), "--out", str(tmp_path / "e")]) == 2
    assert f"qkv peft merge {runs['lora']} --out DIR" in one_line_error(capsys)
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("kind,says", [("lora", "`qkv peft merge {run} --out DIR`"),
                                       ("bottleneck", "leave out --int8"),
                                       ("prefix", "leave out --int8")])
def test_int8_on_an_adapter_run_says_what_to_do(runs, capsys, kind, says):
    run = runs[kind]
    assert main(["generate", str(run), "--prompt", "abc", "--int8"]) == 2
    err = one_line_error(capsys)
    assert says.format(run=run) in err and "--int8" in err, err
