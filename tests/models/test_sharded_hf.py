"""Sharded HuggingFace checkpoints (model.safetensors.index.json + model-0000k-of-0000N
shards, as ``save_pretrained(max_shard_size=...)`` writes them) load like the single file:
the same tensors, the same logits (oracle: the unsharded load, exactly, and transformers'
own forward, atol 1e-5); a broken index — a shard outside the directory, missing, not a
regular file, or not holding what the index says — is a CheckpointError naming it.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import qkv.models
from qkv.models import BERT, GPT, CheckpointError, GPTConfig
from qkv.models.hub import load_state_dict_file

transformers = pytest.importorskip("transformers")
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _perturbed(model):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # biases and norms away from 0 / 1
    return model.eval()


def _gpt2():
    return _perturbed(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=61, n_positions=24, n_embd=32, n_layer=2, n_head=4)))


def _bert():
    return _perturbed(transformers.BertModel(transformers.BertConfig(
        vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=40, max_position_embeddings=24)))


@pytest.fixture(scope="module", params=["gpt2", "bert"])
def pair(request, tmp_path_factory):
    """(transformers model, single-file dir, sharded dir)."""
    torch.manual_seed(0)
    hf = _gpt2() if request.param == "gpt2" else _bert()
    single, sharded = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("sharded")
    hf.save_pretrained(single)
    hf.save_pretrained(sharded, max_shard_size="20KB")
    assert not (sharded / "model.safetensors").exists()
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 2
    return request.param, hf, single, sharded


def _load(d: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fields of newer transformers qkv has not classified
        return qkv.models.from_hf(d)


def test_sharded_hf_checkpoint_loads_like_the_single_file(pair):
    name, hf, single, sharded = pair
    assert load_state_dict_file(sharded).keys() == load_state_dict_file(single).keys()
    one, many = _load(single), _load(sharded)
    for k, t in one.state_dict().items():
        assert torch.equal(t, many.state_dict()[k]), k
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5, 8, 9, 7, 9, 3]])
    with torch.no_grad():
        if name == "gpt2":
            ours, theirs = many(ids), hf(ids).logits
            assert torch.equal(ours, one(ids))
        else:
            ours = many(ids).last_hidden_state
            theirs = hf(ids).last_hidden_state
            assert torch.equal(ours, one(ids).last_hidden_state)
    torch.testing.assert_close(ours, theirs, **TOL)
    cls = GPT if name == "gpt2" else BERT
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = cls.from_pretrained(sharded)  # the other door: from_pretrained -> from_hf
    assert all(torch.equal(t, again.state_dict()[k]) for k, t in many.state_dict().items())


def test_a_qkv_directory_may_be_sharded_too(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("gpt-tiny", vocab_size=50, dim=32, num_heads=2))
    model.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({k: state[k] for k in part}, tmp_path / file)
    index = {"metadata": {}, "weight_map": {k: f for f, part in halves.items() for k in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = GPT.from_pretrained(tmp_path)
    for k, t in model.state_dict().items():
        assert torch.equal(t, loaded.state_dict()[k]), k


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_index(d: Path, edit) -> None:
    path = d / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    edit(index["weight_map"])
    path.write_text(json.dumps(index))


@pytest.mark.parametrize("bad", ["../outside.safetensors", "sub/model.safetensors",
                                 "/etc/passwd", "..", "model-00001.bin"])
def test_a_shard_named_outside_the_directory_is_refused(pair, tmp_path, bad):
    _, _, _, sharded = pair
    d = _copy(sharded, tmp_path / "d")
    (tmp_path / "outside.safetensors").write_bytes((d / next(iter(
        json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].values()
    ))).read_bytes())

    def edit(weight_map):
        first = next(iter(weight_map))
        weight_map[first] = bad

    _edit_index(d, edit)
    with pytest.raises(CheckpointError, match=r"a shard must be a \.safetensors file name in "
                                              r"the same directory"):
        _load(d)


def test_a_missing_or_special_shard_is_refused(pair, tmp_path):
    _, _, _, sharded = pair
    d = _copy(sharded, tmp_path / "missing")
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"shard {shard.name} is missing"):
        _load(d)
    if hasattr(os, "mkfifo"):
        os.mkfifo(shard)  # opening it would block: never opened
        with pytest.raises(CheckpointError, match=rf"shard {shard.name} is missing \(or not a "
                                                  rf"regular file\)"):
            _load(d)


def test_a_shard_that_does_not_hold_what_the_index_says_is_refused(pair, tmp_path):
    _, _, _, sharded = pair
    d = _copy(sharded, tmp_path / "moved")
    shards = sorted(d.glob("model-*.safetensors"))

    def edit(weight_map):  # a tensor of the first shard said to be in the second
        name = next(k for k, f in weight_map.items() if f == shards[0].name)
        weight_map[name] = shards[1].name

    _edit_index(d, edit)
    with pytest.raises(CheckpointError, match=r"does not hold what the index says"):
        _load(d)


def test_an_index_without_a_weight_map_is_refused(pair, tmp_path):
    _, _, _, sharded = pair
    d = _copy(sharded, tmp_path / "nomap")
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="no weight_map"):
        _load(d)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_an_index_that_is_not_a_regular_file_is_refused_without_reading_it(pair, tmp_path):
    _, _, _, sharded = pair
    d = _copy(sharded, tmp_path / "fifo")
    (d / "model.safetensors.index.json").unlink()
    os.mkfifo(d / "model.safetensors.index.json")  # reading it would block
    with pytest.raises(CheckpointError, match=r"index\.json: not a regular file"):
        _load(d)
