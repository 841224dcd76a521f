"""``qkv train --init-from --lora/--adapters/--prefix`` and ``qkv peft merge``: adapter runs
from the command line, bad KEY=VALUE lists as one line, a merged directory whose outputs
equal the adapted model's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qkv.cli import main
from qkv.models import GPT
from qkv.train import load_run

SMALL = ["--steps", "3", "--batch-size", "8", "--eval-every", "3", "--eval-examples", "4",
         "--warmup", "1", "--no-progress", "--device", "cpu"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "base"
    assert main(["train", "--model", "gpt", "--task", "copy", "--set", "dim=32",
                 "--set", "num_layers=1", "--set", "num_heads=2", "--out", str(out),
                 *SMALL]) == 0
    return out


@pytest.fixture(scope="module")
def lora_run(base) -> Path:
    out = base.parent / "lora"
    assert main(["train", "--task", "reverse", "--init-from", str(base), "--lora",
                 "r=4,alpha=8,targets=q+v+ffn_in", "--lr", "0.05", "--out", str(out),
                 *SMALL]) == 0
    return out


def test_train_with_lora_prints_the_trainable_summary_and_names_the_base(base, tmp_path,
                                                                         capsys):
    out = tmp_path / "run"
    assert main(["train", "--task", "reverse", "--init-from", str(base), "--lora",
                 "r=2,targets=q+v", "--out", str(out), *SMALL]) == 0
    text = capsys.readouterr().out
    model, _ = load_run(out)
    n = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == 2 * 2 * (2 * 32)  # q and v: A (2, 32) + B (32, 2), one layer
    assert f"trainable params: {trainable:,} || all params: {n:,}" in text
    assert "gpt + LoRA adapter (" in text  # --model came from the base
    peft = json.loads((out / "run.json").read_text())["peft"]
    assert peft == {"kind": "lora", "r": 2, "alpha": 16, "dropout": 0.0,
                    "targets": ["q", "v"], "rslora": False}


@pytest.mark.parametrize("flag,value,kind", [("--adapters", "reduction_factor=8,"
                                              "placement=pfeiffer", "bottleneck"),
                                             ("--prefix", "2", "prefix")])
def test_train_with_adapters_or_a_prefix(base, tmp_path, flag, value, kind):
    out = tmp_path / "run"
    assert main(["train", "--task", "reverse", "--init-from", str(base), flag, value,
                 "--out", str(out), *SMALL]) == 0
    meta = json.loads((out / "checkpoint/adapter_config.json").read_text())
    assert meta["kind"] == kind
    assert main(["generate", str(out), "--prompt", "abc", "--max-new-tokens", "3"]) == 0
    # attention maps: drawn with bottleneck adapters; a prefix's extra key columns refused
    code = main(["attention", str(out), "--input", "abc", "--out", str(tmp_path / "a")])
    assert code == (2 if kind == "prefix" else 0)
    assert main(["peft", "merge", str(out), "--out", str(tmp_path / "m")]) == 2
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("value,says", [
    ("r=x", "argument --lora: r=x: must be an integer"),
    ("rank=4", "argument --lora: unknown key 'rank' (known: r, alpha, dropout, targets, "
               "rslora)"),
    ("r8", "argument --lora: expects KEY=VALUE pairs"),
    ("targets=q+w", "argument --lora: targets=q+w: must be roles joined by '+'"),
    ("targets=qkv+q", "argument --lora: peft kind 'lora'"),
    ("r=0", "argument --lora: r=0: must be an integer >= 1"),
    ("alpha=nan", "argument --lora: alpha=nan: must be a finite number"),
    ("rslora=perhaps", "argument --lora: rslora=perhaps: must be true or false"),
    ("r=2,r=3", "argument --lora: key 'r' given twice"),
])
def test_a_bad_lora_string_is_one_line_naming_the_flag_and_key(value, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--task", "copy", "--init-from", "x", "--lora", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


@pytest.mark.parametrize("args,says", [
    (["--lora", "r=2"], "--lora needs --init-from"),
    (["--init-from", "BASE", "--set", "dim=8"], "leave out --set"),
    (["--init-from", "BASE", "--preset", "gpt-small"], "leave out --preset"),
    (["--init-from", "BASE", "--model", "transformer"], "--model transformer does not match"),
    (["--init-from", "BASE", "--adapters", "placement=houlsby", "--prefix", "2"],
     "not allowed with argument"),
])
def test_refusals_are_one_line(base, tmp_path, capsys, args, says):
    args = [str(base) if a == "BASE" else a for a in args]
    try:
        code = main(["train", "--task", "copy", "--out", str(tmp_path / "x"), *args, *SMALL])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "x").exists()


def test_resume_takes_no_adapter_flags(lora_run, capsys):
    assert main(["train", "--resume", str(lora_run), "--prefix", "2"]) == 2
    assert "only --steps" in capsys.readouterr().err


def test_merge_writes_a_plain_model_with_the_adapted_outputs(lora_run, tmp_path, capsys):
    adapted, tok = load_run(lora_run)
    out = tmp_path / "merged"
    assert main(["peft", "merge", str(lora_run), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors",
                                                      "run.json", "tokenizer.json"]
    plain = GPT.from_pretrained(out)
    again, _ = load_run(out)
    ids = torch.tensor([tok.encode("hello world"), tok.encode("abcdefghijk")])
    with torch.no_grad():
        want = adapted(ids)
        assert not torch.equal(want, load_run(lora_run.parent / "base")[0](ids))  # it trained
        torch.testing.assert_close(plain(ids), want, atol=1e-5, rtol=0)
        torch.testing.assert_close(again(ids), want, atol=1e-5, rtol=0)
    assert not any(".lora." in k for k in plain.state_dict())
    # generate frames the prompt as the adapter run did (a pair task)
    capsys.readouterr()
    assert main(["generate", str(lora_run), "--prompt", "abc", "--max-new-tokens", "4"]) == 0
    a = capsys.readouterr().out
    assert main(["generate", str(out), "--prompt", "abc", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out == a
    # --out follows qkv.outputs.new_output_dir: a non-empty directory is refused
    assert main(["peft", "merge", str(lora_run), "--out", str(out)]) == 2
    assert "is not empty" in capsys.readouterr().err


def test_merge_refuses_a_whole_model_run(base, tmp_path, capsys):
    assert main(["peft", "merge", str(base), "--out", str(tmp_path / "m")]) == 2
    assert "nothing to merge" in capsys.readouterr().err
