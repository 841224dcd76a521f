"""The model-kind seam (``qkv.train.kinds``): every registered kind round-trips through the
registry (name, config.json model types, model class, default preset), the old public
entry points dispatch to the kind, and a kind registered from outside trains through the
unchanged Trainer — the trainer asks the kind object, never which kind it is."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from qkv.models import BERT, CLIP, GPT, Transformer
from qkv.train import TrainConfig, Trainer, load_run
from qkv.train.checkpoint import MODEL_CLASSES, trained_on_pairs
from qkv.train.config import DEFAULT_PRESETS, ConfigError
from qkv.train.finetune import model_kind
from qkv.train.kinds import (
    KINDS,
    MODEL_KINDS,
    ModelKind,
    get_kind,
    kind_of_model,
    kind_of_model_type,
    model_classes,
    register,
)
from qkv.train.kinds.gpt import GPTKind
from qkv.train.loss import token_loss

CLASSES = {"transformer": Transformer, "gpt": GPT, "bert-mlm": BERT, "clip": CLIP}


def test_the_registry_holds_the_four_kinds_in_order():
    assert MODEL_KINDS == ("transformer", "gpt", "bert-mlm", "clip")
    assert tuple(KINDS) == MODEL_KINDS
    assert DEFAULT_PRESETS == {"transformer": "transformer-tiny", "gpt": "gpt-tiny",
                               "bert-mlm": "bert-tiny", "clip": "clip-shapes"}


@pytest.mark.parametrize("name", ["transformer", "gpt", "bert-mlm", "clip"])
def test_every_kind_round_trips_through_the_registry(name):
    kind = get_kind(name)
    assert isinstance(kind, ModelKind) and kind.name == name and KINDS[name] is kind
    assert kind.model_class is CLASSES[name]
    for model_type in kind.model_types:
        assert kind_of_model_type(model_type) is kind
    assert model_classes()[kind.model_types[0]] is kind.model_class
    assert MODEL_CLASSES[kind.model_types[0]] is kind.model_class
    config_class = kind.model_class.config_class
    assert kind.default_preset in config_class.PRESETS
    with torch.device("meta"):
        model = kind.model_class(config_class.from_name(kind.default_preset))
    assert kind_of_model(model) is kind and model_kind(model) == name
    task = (kind.tasks or ("copy",))[0]
    assert TrainConfig(model=name, task=task).model_preset == kind.default_preset


def test_unknown_kinds_and_models_are_named():
    with pytest.raises(ValueError, match=r"model kind must be one of \('transformer', 'gpt', "
                                         r"'bert-mlm', 'clip'\), got 't5'"):
        get_kind("t5")
    with pytest.raises(ValueError, match=r"not a model qkv trains .*: Linear"):
        kind_of_model(nn.Linear(2, 2))
    assert kind_of_model_type("whisper") is None
    assert kind_of_model_type("t5") is get_kind("transformer")  # T5/BART/Marian fine-tune
    with pytest.raises(ValueError, match="already registered"):
        register(GPTKind())
    with pytest.raises(ValueError, match="no token objective"):
        token_loss(get_kind("clip"), nn.Linear(2, 2), {})


def test_trained_on_pairs_asks_the_kind():
    assert trained_on_pairs({"model": "gpt", "task": "copy"})
    assert trained_on_pairs({"model": "transformer", "task": None})  # a TSV
    assert not trained_on_pairs({"model": "gpt", "task": None})  # plain text
    assert not trained_on_pairs({})  # no run.json
    assert not trained_on_pairs({"model": "a kind from a newer qkv", "task": None})


def test_make_batch_is_the_kinds_own():
    from qkv.data import CharTokenizer

    tok = CharTokenizer("abc")
    pairs = [("ab", "ba"), ("c", "c")]
    for name in ("transformer", "gpt", "bert-mlm"):  # a pure function of items, step, seed
        got = get_kind(name).make_batch(pairs, tok, step=3, seed=1)
        want = get_kind(name).make_batch(pairs, tok, step=3, seed=1)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    # the transformer layout, spelled out: src = source + eos, tgt_in = bos + target,
    # tgt_out = target + eos with -100 padding
    b = get_kind("transformer").make_batch(pairs, tok)
    a, bb, c = (tok.encode(x)[0] for x in "abc")
    assert b["src"].tolist() == [[a, bb, 2], [c, 2, 0]]
    assert b["tgt_in"].tolist() == [[1, bb, a], [1, c, 0]]
    assert b["tgt_out"].tolist() == [[bb, a, 2], [c, 2, -100]]


class _CountingKind(GPTKind):
    """A kind registered from outside qkv: GPT, counting the hooks the trainer calls."""

    name = "counting-gpt"

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def _count(self, hook: str) -> None:
        self.calls[hook] = self.calls.get(hook, 0) + 1

    def after_optimizer_step(self, model: nn.Module) -> None:
        self._count("after_optimizer_step")

    def evaluate(self, model, tokenizer, data, count):
        self._count("evaluate")
        return {**super().evaluate(model, tokenizer, data, count), "counted": 1.0}

    def checkpoint_files(self, model):
        return {"counting.json": {"steps_seen": self.calls.get("after_optimizer_step", 0)}}


def test_a_kind_registered_from_outside_trains_through_the_trainer(tmp_path):
    kind = register(_CountingKind())
    try:
        cfg = TrainConfig(model="counting-gpt", task="copy", preset="gpt-tiny",
                          overrides=dict(dim=32, num_heads=2, num_layers=1), steps=3,
                          batch_size=4, eval_every=2, eval_examples=4)
        result = Trainer(cfg, tmp_path / "run", progress=False, log=lambda line: None).run()
        assert result["counted"] == 1.0 and "exact_match" in result
        assert kind.calls == {"after_optimizer_step": 3, "evaluate": 2}
        saved = json.loads((tmp_path / "run/checkpoint/counting.json").read_text())
        assert saved == {"steps_seen": 3}
        model, _ = load_run(tmp_path / "run")
        assert isinstance(model, GPT)
    finally:
        del KINDS[kind.name]
    with pytest.raises(ConfigError, match="model must be one of"):
        TrainConfig(model="counting-gpt", task="copy")
