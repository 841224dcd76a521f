"""Fine-tuning from a trained base with ``TrainConfig(init_from=..., peft=...)``: only the
adapter trains (optimizer, base weights bit-identical), checkpoints hold the adapter and
base.json only, ``load_run`` rebuilds base + adapter, resume is bit-identical, a changed or
missing base is refused, and the settings the base fixes are checked up front."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qkv.models import CheckpointError
from qkv.peft import disable_adapters
from qkv.train import TrainConfig, Trainer, load_run
from qkv.train.memory import estimate_training_bytes

TINY = dict(dim=32, num_heads=2, ffn_hidden=64, dropout=0.1, num_encoder_layers=1,
            num_decoder_layers=1)
KINDS = {"lora": {"kind": "lora", "r": 4, "alpha": 8, "dropout": 0.1,
                  "targets": ["q", "k", "v", "out"]},
         "adapters": {"kind": "adapters", "reduction_factor": 4, "dropout": 0.1},
         "prefix": {"kind": "prefix", "num_tokens": 3}}
#: the state-dict names of adapter parameters, per kind
MARK = {"lora": ".lora.", "adapters": ".adapters.", "prefix": ".prefixes."}
#: ... and their names in adapter_model.safetensors
FILE_MARK = {"lora": r"_proj\.[AB]_(q|k|v|out)$", "adapters": r"\.adapters\.\*\.",
             "prefix": r"\.prefixes\.\*\."}


def quiet() -> dict:
    return dict(progress=False, log=lambda line: None)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny encoder-decoder trained for a few steps on "copy" (dropout on)."""
    out = tmp_path_factory.mktemp("base") / "run"
    cfg = TrainConfig(model="transformer", task="copy", preset="transformer-tiny",
                      overrides=TINY, steps=3, batch_size=8, lr=3e-3, warmup=1, eval_every=3,
                      eval_examples=4)
    Trainer(cfg, out, **quiet()).run()
    return out


def tune(base: Path, peft: dict | None, **kw) -> TrainConfig:
    settings = dict(model="transformer", task="reverse", steps=6, batch_size=8, lr=1e-2,
                    warmup=1, eval_every=3, eval_examples=4, init_from=str(base), peft=peft)
    return TrainConfig(**{**settings, **kw})


def losses(run: Path) -> list[tuple]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows if "loss" in r]


def base_keys(key: str) -> str:
    """A wrapped model's state-dict key as the base names it (wrappers insert '.base.')."""
    return key.replace(".base.", ".")


@pytest.mark.parametrize("kind", list(KINDS))
def test_only_the_adapter_trains_and_the_checkpoint_holds_only_it(base, tmp_path, kind):
    trainer = Trainer(tune(base, KINDS[kind]), tmp_path / kind, **quiet())
    model = trainer.model
    in_optimizer = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    adapter = {id(p) for n, p in model.named_parameters() if MARK[kind] in n}
    assert in_optimizer == trainable == adapter and adapter
    before = {n: p.detach().clone() for n, p in model.named_parameters() if MARK[kind] in n}
    trainer.run()

    # the base weights are bit-identical to the base run's
    base_state = load_file(str(base / "checkpoint/model.safetensors"))
    own = {base_keys(k): v for k, v in model.state_dict().items() if MARK[kind] not in k}
    assert own.keys() >= base_state.keys()
    for k, v in base_state.items():
        assert torch.equal(own[k], v), k
    # ... while the adapter trained
    after = dict(model.named_parameters())
    assert any(not torch.equal(after[n], v) for n, v in before.items())

    ckpt = tmp_path / kind / "checkpoint"
    assert not (ckpt / "model.safetensors").exists() and not (ckpt / "config.json").exists()
    saved = load_file(str(ckpt / "adapter_model.safetensors"))
    assert saved and all(re.search(FILE_MARK[kind], k) for k in saved)
    assert not {base_keys(k) for k in saved} & base_state.keys()
    assert sum(t.numel() for t in saved.values()) == sum(t.numel() for t in before.values())
    assert ((ckpt / "adapter_model.safetensors").stat().st_size
            < (base / "checkpoint/model.safetensors").stat().st_size / 2)
    info = json.loads((ckpt / "base.json").read_text())
    weights = base / "checkpoint/model.safetensors"
    config = json.loads((base / "checkpoint/config.json").read_text())
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert info == {"path": str((base / "checkpoint").resolve()),
                    "sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
                    "config_sha256": hashlib.sha256(canonical.encode()).hexdigest()}
    assert json.loads((tmp_path / kind / "run.json").read_text())["init_from"] == \
        str((base / "checkpoint").resolve())

    # load_run: the base + the adapter, active, eval mode; the same outputs as the trainer's
    loaded, tok = load_run(tmp_path / kind)
    assert not loaded.training and type(loaded) is type(model)
    src = torch.tensor([[5, 6, 7, tok.eos_id]])
    tgt = torch.tensor([[tok.bos_id, 7, 6]])
    model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(src, tgt), model(src, tgt))
        with disable_adapters(loaded):
            plain, _ = load_run(base)
            assert torch.equal(loaded(src, tgt), plain(src, tgt))


def test_resume_after_an_interruption_is_bit_identical(base, tmp_path, monkeypatch):
    """LoRA with dropout (base dropout on too): killed during step 5 after the step-3
    checkpoint, resumed, == the uninterrupted run in losses, grad norms and adapter."""
    cfg = tune(base, KINDS["lora"])
    Trainer(cfg, tmp_path / "whole", **quiet()).run()
    real_step = Trainer.train_step

    def crash_at_5(self):
        if self.step == 4:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(Trainer, "train_step", crash_at_5)
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg, tmp_path / "cut", **quiet()).run()
    monkeypatch.setattr(Trainer, "train_step", real_step)
    Trainer.resume(tmp_path / "cut", **quiet()).run()
    assert losses(tmp_path / "cut") == losses(tmp_path / "whole")
    a = load_file(str(tmp_path / "whole/checkpoint/adapter_model.safetensors"))
    b = load_file(str(tmp_path / "cut/checkpoint/adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_changed_or_missing_base_is_refused(base, tmp_path):
    copy = tmp_path / "base"
    shutil.copytree(base, copy)
    cfg = tune(copy, KINDS["adapters"], steps=3)
    Trainer(cfg, tmp_path / "run", **quiet()).run()
    load_run(tmp_path / "run")  # fine as it is

    weights = copy / "checkpoint/model.safetensors"
    state = load_file(str(weights))
    key = sorted(state)[0]
    state[key] = state[key] + 1e-3
    save_file(state, str(weights), metadata={"format": "pt"})
    where = str((copy / "checkpoint").resolve())
    with pytest.raises(CheckpointError, match="changed since") as err:
        load_run(tmp_path / "run")
    assert where in str(err.value)
    with pytest.raises(CheckpointError, match="changed since"):
        Trainer.resume(tmp_path / "run", steps=6, **quiet())

    shutil.rmtree(copy)
    with pytest.raises(CheckpointError, match="is missing") as err:
        load_run(tmp_path / "run")
    assert where in str(err.value)


def test_full_fine_tuning_keeps_the_base_tokenizer_and_trains_everything(base, tmp_path):
    trainer = Trainer(tune(base, None, steps=3), tmp_path / "full", **quiet())
    assert all(p.requires_grad for p in trainer.model.parameters())
    trainer.run()
    ckpt = tmp_path / "full/checkpoint"
    assert (ckpt / "model.safetensors").is_file() and not (ckpt / "base.json").exists()
    assert (ckpt / "tokenizer.json").read_text() == \
        (base / "checkpoint/tokenizer.json").read_text()


def test_what_the_base_fixes_is_checked_before_anything_is_written(base, tmp_path):
    out = tmp_path / "never"
    lora = KINDS["lora"]
    with pytest.raises(ValueError, match=r"46 character\(s\) the base.s tokenizer"):
        Trainer(tune(base, lora, task="dates"), out, **quiet())
    with pytest.raises(ValueError, match="--model gpt does not match"):
        Trainer(tune(base, lora, model="gpt"), out, **quiet())
    long = tmp_path / "long.tsv"
    long.write_text("a" * 40 + "\tb\n" + "c\td\n" * 3)
    with pytest.raises(ValueError, match="beyond the base's max_len"):
        Trainer(tune(base, lora, task=None, data=str(long)), out, **quiet())
    with pytest.raises(ValueError, match="beyond the base's max_len"):
        Trainer(tune(base, lora, max_len=1000), out, **quiet())
    with pytest.raises(CheckpointError, match="no such directory"):
        Trainer(tune(tmp_path / "nowhere", lora), out, **quiet())
    assert not out.exists()

    adapter_run = tmp_path / "adapter"
    Trainer(tune(base, KINDS["prefix"], steps=3), adapter_run, **quiet()).run()
    with pytest.raises(CheckpointError, match="itself an adapter run"):
        Trainer(tune(adapter_run, lora), out, **quiet())
    assert not out.exists()


def test_the_config_refuses_what_cannot_work():
    with pytest.raises(ValueError, match="peft needs init_from"):
        TrainConfig(task="copy", peft={"kind": "lora"})
    with pytest.raises(ValueError, match="fixes the architecture"):
        TrainConfig(task="copy", init_from="x", preset="transformer-small")
    with pytest.raises(ValueError, match="fixes the architecture"):
        TrainConfig(task="copy", init_from="x", overrides={"dim": 8})
    for bad, what in (({"kind": "dora"}, "kind 'dora'"), ({"r": 4}, "kind None"),
                      ({"kind": "lora", "rank": 4}, "unknown fields \\['rank'\\]"),
                      ({"kind": "adapters", "placement": "x"}, "placement"),
                      ({"kind": "prefix", "num_tokens": 0}, "num_tokens")):
        with pytest.raises(ValueError, match=what):
            TrainConfig(task="copy", init_from="x", peft=bad)
    cfg = TrainConfig(task="copy", init_from="x", peft={"kind": "lora", "targets": ["v", "q"]})
    assert cfg.peft == {"kind": "lora", "r": 8, "alpha": 16, "dropout": 0.0,
                        "targets": ["q", "v"], "rslora": False}
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_the_memory_estimate_counts_gradients_and_moments_of_trainable_parameters_only():
    from qkv.models import Transformer, TransformerConfig
    from qkv.peft import LoraConfig, add_lora

    model = Transformer(TransformerConfig.from_name("transformer-tiny"))
    total = sum(p.numel() for p in model.parameters())
    full = estimate_training_bytes(model, batch_size=2, seq_len=8)["parameters"]
    add_lora(model, LoraConfig(r=2))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    est = estimate_training_bytes(model, batch_size=2, seq_len=8)["parameters"]
    assert full == 16 * total + buffers
    assert est == 4 * (total + trainable) + 12 * trainable + buffers
