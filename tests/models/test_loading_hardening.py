"""Loading checkpoints an adversary (or an accident) wrote: a config that does not fit its
weights is refused from the files' headers before a model is built, however large the model
it describes; norm epsilons are checked; int/bool weights are never cast into float
parameters; a `qkv train --fsdp` checkpoint and an adapter run say what they are.

Oracles: the weights files themselves (their layer count and shapes are known from how the
test wrote them), and for the no-allocation claim a guard that fails as soon as a loader
builds more linear layers than the small model on disk has (a 100000-layer build would take
minutes and gigabytes).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import qkv.models
from qkv.models import (
    BERT,
    CLIP,
    GPT,
    BERTConfig,
    CheckpointError,
    CLIPConfig,
    CLIPTextConfig,
    GPTConfig,
    Transformer,
    TransformerConfig,
    ViT,
    ViTConfig,
)

transformers = pytest.importorskip("transformers")

#: a loader of these tiny models builds at most ~60 nn.Linear (a meta probe and the model);
#: more means it is building what the config says, not what the file holds
LINEAR_BUDGET = 200


@pytest.fixture
def linear_guard(monkeypatch):
    """Fail the test as soon as more than LINEAR_BUDGET nn.Linear are built."""
    built = []
    init = nn.Linear.__init__

    def counting(self, *args, **kwargs):
        built.append(1)
        if len(built) > LINEAR_BUDGET:
            raise AssertionError("the loader builds the model the config describes "
                                 "instead of refusing it from the weights' header")
        init(self, *args, **kwargs)

    monkeypatch.setattr(nn.Linear, "__init__", counting)
    return built


def _transformer_config() -> TransformerConfig:
    return TransformerConfig(src_vocab_size=40, tgt_vocab_size=40, dim=16, num_heads=2,
                             ffn_hidden=24, num_encoder_layers=2, num_decoder_layers=2,
                             max_len=32)


QKV_MODELS = {
    "gpt": (GPT, lambda: GPTConfig(vocab_size=50, max_len=16, dim=16, num_layers=2,
                                   num_heads=2)),
    "bert": (BERT, lambda: BERTConfig.from_name("bert-tiny", vocab_size=50, max_len=16,
                                                dim=16, num_heads=2, ffn_hidden=24)),
    "vit": (ViT, lambda: ViTConfig.from_name("vit-tiny", dim=16)),
    "clip": (CLIP, lambda: CLIPConfig.from_name("clip-tiny")),
    "transformer": (Transformer, _transformer_config),
}
#: (model, config.json field path, the value the file holds)
LAYER_FIELDS = [("gpt", "num_layers"), ("bert", "num_layers"), ("vit", "num_layers"),
                ("clip", "vision.num_layers"), ("clip", "text.num_layers"),
                ("transformer", "num_encoder_layers"), ("transformer", "num_decoder_layers")]


@pytest.fixture(scope="module")
def qkv_dirs(tmp_path_factory):
    out = {}
    for name, (cls, make) in QKV_MODELS.items():
        torch.manual_seed(0)
        d = tmp_path_factory.mktemp(name)
        cls(make()).save_pretrained(d)
        out[name] = d
    return out


def _copy_with_config(src: Path, dst: Path, edit) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).write_bytes(f.read_bytes())
    data = json.loads((src / "config.json").read_text())
    edit(data)
    (dst / "config.json").write_text(json.dumps(data))
    return dst


def _set(data: dict, path: str, value) -> None:
    *outer, last = path.split(".")
    for part in outer:
        data = data[part]
    data[last] = value


@pytest.mark.parametrize("model, field", LAYER_FIELDS)
def test_qkv_config_with_more_layers_than_the_file_is_refused_before_building(
        model, field, qkv_dirs, tmp_path, linear_guard):
    cls, _ = QKV_MODELS[model]
    d = _copy_with_config(qkv_dirs[model], tmp_path, lambda c: _set(c, field, 100000))
    with pytest.raises(CheckpointError, match=rf"{field}=100000, but .*holds 2 such layers"):
        cls.from_pretrained(d)
    assert not linear_guard  # refused from the header alone: not even a probe was built


@pytest.mark.parametrize("model, field", [("gpt", "num_layers"), ("clip", "text.num_layers")])
def test_qkv_config_with_fewer_layers_names_the_field(model, field, qkv_dirs, tmp_path):
    cls, _ = QKV_MODELS[model]
    d = _copy_with_config(qkv_dirs[model], tmp_path, lambda c: _set(c, field, 1))
    with pytest.raises(CheckpointError, match=rf"{field}=1, but .*holds 2 such layers"):
        cls.from_pretrained(d)


@pytest.mark.parametrize("model, field, value", [
    ("gpt", "vocab_size", 10**12), ("gpt", "dim", 2**36), ("bert", "ffn_hidden", 10**12),
    ("vit", "dim", 2**36), ("clip", "embed_dim", 10**12),
    ("transformer", "src_vocab_size", 10**12)])
def test_qkv_config_with_huge_sizes_is_refused_naming_the_field(model, field, value, qkv_dirs,
                                                                 tmp_path, linear_guard):
    """Terabyte-sized tensors the file does not hold: a CheckpointError naming the field,
    not torch's allocator error (what the real build raises)."""
    cls, _ = QKV_MODELS[model]

    def edit(c):
        _set(c, field, value)
        if model == "vit" and field == "dim":
            c["num_heads"] = 2
        if model == "transformer":
            c["tgt_vocab_size"] = value

    d = _copy_with_config(qkv_dirs[model], tmp_path, edit)
    with pytest.raises(CheckpointError, match=rf"config\.json: .*\b{field.split('.')[-1]}="
                                              rf"{value}\b.* not fit the weights \(.*shape "
                                              rf"mismatches|no machine can hold.*\b{field}="
                                              rf"{value}\b"):
        cls.from_pretrained(d)


def test_a_fitting_config_loads_equal_and_leaves_the_rng_as_a_plain_build(qkv_dirs):
    """The header probe changes neither what loads nor torch's RNG stream (a meta build
    draws nothing; the real build draws what it always drew)."""
    for name, (cls, make) in QKV_MODELS.items():
        torch.manual_seed(0)
        ref = cls(make())
        after_build = torch.rand(3)
        torch.manual_seed(0)
        loaded = cls.from_pretrained(qkv_dirs[name])
        assert torch.equal(torch.rand(3), after_build), name
        want = load_file(qkv_dirs[name] / "model.safetensors")
        got = loaded.state_dict()
        assert set(want) <= set(got), name
        for k, t in want.items():
            assert torch.equal(got[k], t), (name, k)
        assert set(got) - set(want) <= set(ref.tied_keys), name


# --- HF checkpoints ------------------------------------------------------------------------
def _hf_models():
    return {
        "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=61, n_positions=24, n_embd=32, n_layer=2, n_head=4)),
        "bert": lambda: transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=40, max_position_embeddings=24)),
        "vit": lambda: transformers.ViTModel(transformers.ViTConfig(
            hidden_size=24, num_hidden_layers=2, num_attention_heads=2, intermediate_size=36,
            image_size=16, patch_size=4), add_pooling_layer=False),
        "clip": lambda: transformers.CLIPModel(transformers.CLIPConfig(
            text_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=40, vocab_size=60, max_position_embeddings=12,
                             eos_token_id=59, bos_token_id=0, pad_token_id=1),
            vision_config=dict(hidden_size=24, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=36, image_size=16, patch_size=4),
            projection_dim=20)),
    }


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    out = {}
    for name, make in _hf_models().items():
        torch.manual_seed(0)
        d = tmp_path_factory.mktemp(f"hf-{name}")
        make().save_pretrained(d)
        out[name] = d
    return out


HF_LAYER_FIELDS = [("gpt2", "n_layer"), ("bert", "num_hidden_layers"),
                   ("vit", "num_hidden_layers"), ("clip", "text_config.num_hidden_layers"),
                   ("clip", "vision_config.num_hidden_layers")]


def _hf_load(d: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fields of newer transformers qkv has not classified
        return qkv.models.from_hf(d)


@pytest.mark.parametrize("model, field", HF_LAYER_FIELDS)
def test_hf_config_with_more_layers_than_the_file_is_refused_before_building(
        model, field, hf_dirs, tmp_path, linear_guard):
    d = _copy_with_config(hf_dirs[model], tmp_path, lambda c: _set(c, field, 100000))
    with pytest.raises(CheckpointError, match=rf"{field}=100000, but .*holds 2 such layers"):
        _hf_load(d)
    assert not linear_guard


def test_hf_layer_count_left_to_its_default_is_named_as_such(hf_dirs, tmp_path):
    d = _copy_with_config(hf_dirs["gpt2"], tmp_path, lambda c: c.pop("n_layer"))
    with pytest.raises(CheckpointError, match=r"n_layer \(not set: transformers' default\)=12"):
        GPT.from_hf(d)


@pytest.mark.parametrize("model, field, value", [
    ("gpt2", "vocab_size", 10**12), ("gpt2", "n_embd", 2**36),
    ("bert", "intermediate_size", 10**12), ("vit", "intermediate_size", 10**12),
    ("clip", "text_config.vocab_size", 10**12)])
def test_hf_config_with_huge_sizes_is_refused_naming_the_field(model, field, value, hf_dirs,
                                                                tmp_path, linear_guard):
    d = _copy_with_config(hf_dirs[model], tmp_path, lambda c: _set(c, field, value))
    with pytest.raises(CheckpointError, match=rf"config\.json: .*\b{field}={value}\b.* not "
                                              rf"fit the weights \(.*shape mismatches|no "
                                              rf"machine can hold.*: {field}={value}$"):
        _hf_load(d)


# --- dtypes --------------------------------------------------------------------------------
def _recast(d: Path, key: str, dtype: torch.dtype) -> None:
    path = d / "model.safetensors"
    state = load_file(path)
    assert key in state, sorted(state)
    t = state[key]
    state[key] = (t > 0) if dtype == torch.bool else (t * 10).to(dtype)
    save_file(state, path, metadata={"format": "pt"})


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.int8, torch.int64])
@pytest.mark.parametrize("model, key", [("gpt", "layers.0.attn.in_proj.weight"),
                                        ("transformer", "encoder_layers.1.norm1.weight"),
                                        ("clip", "logit_scale")])
def test_qkv_non_float_weights_are_refused_naming_tensor_and_dtype(model, key, dtype,
                                                                   qkv_dirs, tmp_path):
    cls, _ = QKV_MODELS[model]
    d = _copy_with_config(qkv_dirs[model], tmp_path, lambda c: None)
    _recast(d, key, dtype)
    with pytest.raises(CheckpointError, match=rf"non-float.*{key}: {dtype}"):
        cls.from_pretrained(d)


@pytest.mark.parametrize("model, key", [
    ("gpt2", "transformer.h.1.attn.c_attn.weight"),
    ("bert", "bert.encoder.layer.0.attention.self.key.weight"),
    ("vit", "encoder.layer.1.intermediate.dense.bias"),
    ("clip", "text_model.encoder.layers.0.self_attn.q_proj.weight")])
def test_hf_non_float_weights_are_refused_naming_tensor_and_dtype(model, key, hf_dirs, tmp_path):
    d = _copy_with_config(hf_dirs[model], tmp_path, lambda c: None)
    _recast(d, key, torch.int32)
    with pytest.raises(CheckpointError, match=r"non-float.*torch\.int32"):
        _hf_load(d)


def test_int8_quantized_directory_still_loads(tmp_path):
    torch.manual_seed(0)
    model = qkv.quantize(GPT(QKV_MODELS["gpt"][1]()).eval(), "int8")
    model.save_pretrained(tmp_path)
    loaded = GPT.from_pretrained(tmp_path)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


# --- norm epsilons -------------------------------------------------------------------------
BAD_EPS = [-1.0, 0.0, float("nan"), float("inf"), float("-inf"), "x", True, None, 2.0, 1e-300]


@pytest.mark.parametrize("eps", BAD_EPS)
@pytest.mark.parametrize("make", [
    lambda eps: GPTConfig.from_name("gpt-tiny", norm_eps=eps),
    lambda eps: BERTConfig.from_name("bert-tiny", norm_eps=eps),
    lambda eps: ViTConfig.from_name("vit-tiny", norm_eps=eps),
    lambda eps: CLIPTextConfig(norm_eps=eps),
    lambda eps: TransformerConfig(src_vocab_size=8, tgt_vocab_size=8, norm_eps=eps),
], ids=["gpt", "bert", "vit", "clip-text", "transformer"])
def test_config_norm_eps_must_be_a_finite_number_in_range(make, eps):
    with pytest.raises(ValueError, match=r"norm_eps must be a finite number in \[1e-38, 1\]"):
        make(eps)


@pytest.mark.parametrize("eps", [1e-38, 1e-12, 1e-5, 1, 1.0])
def test_config_norm_eps_in_range_is_accepted(eps):
    assert GPTConfig.from_name("gpt-tiny", norm_eps=eps).norm_eps == eps
    assert BERTConfig.from_name("bert-tiny", norm_eps=eps).norm_eps == eps


@pytest.mark.parametrize("text", ["1e400", "-1", "NaN", '"x"'])
def test_qkv_config_json_with_bad_norm_eps_is_refused(text, qkv_dirs, tmp_path):
    d = _copy_with_config(qkv_dirs["gpt"], tmp_path, lambda c: None)
    raw = (d / "config.json").read_text()
    data = json.loads(raw)
    raw = raw.replace(f'"norm_eps": {json.dumps(data["norm_eps"])}', f'"norm_eps": {text}')
    assert text in raw
    (d / "config.json").write_text(raw)
    with pytest.raises(CheckpointError, match=r"config\.json: GPTConfig: norm_eps must be"):
        GPT.from_pretrained(d)


@pytest.mark.parametrize("model, field", [("gpt2", "layer_norm_epsilon"),
                                          ("bert", "layer_norm_eps"), ("vit", "layer_norm_eps"),
                                          ("clip", "text_config.layer_norm_eps"),
                                          ("clip", "vision_config.layer_norm_eps")])
@pytest.mark.parametrize("text", ["1e400", "-1", "NaN", '"x"'])
def test_hf_config_json_with_bad_norm_eps_is_refused(model, field, text, hf_dirs, tmp_path):
    marker = 0.123456789
    d = _copy_with_config(hf_dirs[model], tmp_path, lambda c: _set(c, field, marker))
    raw = (d / "config.json").read_text().replace(str(marker), text)
    (d / "config.json").write_text(raw)
    name = field.split(".")[-1]
    with pytest.raises(CheckpointError, match=rf"{name}=.*a finite number in \[1e-38, 1\]"):
        _hf_load(d)


# --- what a directory is -------------------------------------------------------------------
def test_fsdp_sharded_checkpoint_says_export_it_first(qkv_dirs, tmp_path):
    d = tmp_path / "run" / "checkpoint"
    d.mkdir(parents=True)
    (d / "config.json").write_bytes((qkv_dirs["gpt"] / "config.json").read_bytes())
    (d / "sharded.json").write_text(json.dumps({"format": "qkv-dcp-1", "world_size": 2}))
    (d / "sharded").mkdir()
    with pytest.raises(CheckpointError, match=r"sharded checkpoint of a `qkv train --fsdp` "
                                              r"run.*`qkv export RUN --out DIR`"):
        GPT.from_pretrained(d)


def _adapter_run(tmp_path: Path) -> Path:
    ckpt = tmp_path / "lora-run" / "checkpoint"
    ckpt.mkdir(parents=True)
    (ckpt / "adapter_config.json").write_text(json.dumps({"kind": "qkv-lora"}))
    (ckpt / "adapter_model.safetensors").write_bytes(b"")
    (ckpt / "base.json").write_text(json.dumps({"path": "/bases/gpt", "sha256": "0" * 64}))
    return ckpt


def test_adapter_run_given_as_a_model_says_what_it_is(tmp_path):
    ckpt = _adapter_run(tmp_path)
    with pytest.raises(CheckpointError, match=r"holds an adapter .*pass its base \(/bases/gpt\)"
                                              r".*qkv peft merge"):
        GPT.from_pretrained(ckpt)


def test_vision_run_that_is_an_adapter_run_says_what_it_is(tmp_path):
    """`qkv demo flamingo --vision RUN` with an adapter run: no "cannot read config.json"."""
    from qkv.demos.flamingo import check_vision_run

    ckpt = _adapter_run(tmp_path)
    with pytest.raises(ValueError, match=r"adapter run's checkpoint; pass its base"):
        check_vision_run(ckpt.parent)


# --- files that are not what they claim ----------------------------------------------------
def test_truncated_or_special_weights_file_is_a_checkpoint_error(qkv_dirs, tmp_path):
    d = _copy_with_config(qkv_dirs["gpt"], tmp_path / "cut", lambda c: None)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        GPT.from_pretrained(d)
    if hasattr(os, "mkfifo"):
        e = _copy_with_config(qkv_dirs["gpt"], tmp_path / "fifo", lambda c: None)
        (e / "model.safetensors").unlink()
        os.mkfifo(e / "model.safetensors")  # opening it would block: never opened
        with pytest.raises(CheckpointError, match="not a regular file"):
            GPT.from_pretrained(e)


def test_pickle_weights_are_checked_too(qkv_dirs, tmp_path):
    d = _copy_with_config(qkv_dirs["gpt"], tmp_path, lambda c: _set(c, "num_layers", 100000))
    state = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    torch.save(state, d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"num_layers=100000, but .*pytorch_model\.bin "
                                              r"holds 2"):
        GPT.from_pretrained(d, allow_pickle=True)
