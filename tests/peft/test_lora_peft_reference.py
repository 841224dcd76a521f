"""qkv.peft against HF PEFT (test-only reference): LoRA adapters built by PEFT on HF GPT-2
and BERT models with random weights and ``init_lora_weights=False`` (so B != 0), saved with
``save_pretrained`` beside the base, loaded by ``qkv.models.from_hf`` + ``load_adapter``,
give PEFT's own outputs (1e-5); trainable-parameter counts equal PEFT's for the same
targets; PEFT files that do not fit are one clear error that loads nothing."""

from __future__ import annotations

import json

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from qkv.models import BERT, GPT, CheckpointError, GPTConfig, from_hf  # noqa: E402
from qkv.peft import (  # noqa: E402
    LoraConfig,
    active_adapter,
    adapter_names,
    add_lora,
    count_parameters,
    disable_adapters,
    load_adapter,
    merge,
    save_adapter,
)

V = 61


def hf_gpt2(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.save_pretrained(tmp_path / "base")
    return model


def hf_bert(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64,
                                  max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    model = transformers.BertModel(cfg, add_pooling_layer=False).eval()
    model.save_pretrained(tmp_path / "base")
    return model


def peft_model(hf, targets, **kw):
    cfg = peft.LoraConfig(r=4, lora_alpha=12, target_modules=targets, init_lora_weights=False,
                          **kw)
    return peft.get_peft_model(hf, cfg).eval()


@pytest.mark.parametrize("targets, rslora", [(["c_attn"], False),
                                             (["c_attn", "c_proj", "c_fc"], True)])
def test_gpt2_peft_adapter_gives_peft_outputs(tmp_path, targets, rslora):
    pm = peft_model(hf_gpt2(tmp_path), targets, fan_in_fan_out=True, use_rslora=rslora)
    lora_b = [p for n, p in pm.named_parameters() if "lora_B" in n]
    assert lora_b and all(torch.count_nonzero(p) for p in lora_b)
    pm.save_pretrained(tmp_path / "adapter")
    ids = torch.randint(0, V, (2, 11))
    with torch.no_grad():
        want = pm(ids).logits
        with pm.disable_adapter():
            base = pm(ids).logits
    model = from_hf(tmp_path / "base")
    assert isinstance(model, GPT)
    assert load_adapter(model, tmp_path / "adapter") == "default"
    with torch.no_grad():
        torch.testing.assert_close(model(ids), want, atol=1e-5, rtol=1e-5)
        with disable_adapters(model):
            torch.testing.assert_close(model(ids), base, atol=1e-5, rtol=1e-5)
        merge(model)
        torch.testing.assert_close(model(ids), want, atol=1e-5, rtol=1e-5)
    roles = {"c_attn": "qkv", "c_proj": "out", "c_fc": "ffn_in"}
    # PEFT's "c_proj" matches attn.c_proj and mlp.c_proj
    want_roles = {roles[t] for t in targets} | ({"ffn_out"} if "c_proj" in targets else set())
    conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA"
    upd = model.layers[0].attn.in_proj.lora["default"]
    assert upd.scale == pytest.approx(12 / 2 if rslora else 12 / 4)
    assert {r for s in model.modules() if hasattr(s, "segments")
            for r, _, _ in s.segments} == want_roles


@pytest.mark.parametrize("targets", [["query", "value"],
                                     ["query", "key", "value", "dense"]])
def test_bert_peft_adapter_gives_peft_outputs(tmp_path, targets):
    pm = peft_model(hf_bert(tmp_path), targets)
    pm.save_pretrained(tmp_path / "adapter")
    ids = torch.randint(0, V, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    with torch.no_grad():
        want = pm(input_ids=ids, attention_mask=mask).last_hidden_state
    model = from_hf(tmp_path / "base")
    assert isinstance(model, BERT)
    load_adapter(model, tmp_path / "adapter", name="peft")
    assert active_adapter(model) == "peft"
    with torch.no_grad():
        got = model(ids, mask).last_hidden_state
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=1e-5)
    # a qkv round trip of the imported adapter
    save_adapter(model, tmp_path / "qkv")
    again = from_hf(tmp_path / "base")
    load_adapter(again, tmp_path / "qkv")
    with torch.no_grad():
        assert torch.equal(again(ids, mask).last_hidden_state, got)


@pytest.mark.parametrize("family, peft_targets, qkv_targets", [
    ("gpt2", ["c_attn"], ("qkv",)),
    ("gpt2", ["c_attn", "c_proj", "c_fc"], ("qkv", "out", "ffn_in", "ffn_out")),
    ("bert", ["query", "value"], ("q", "v")),
    ("bert", ["query", "key", "value", "dense"], ("q", "k", "v", "out", "ffn_in", "ffn_out")),
])
def test_trainable_parameter_counts_equal_peft(tmp_path, family, peft_targets, qkv_targets):
    hf = hf_gpt2(tmp_path) if family == "gpt2" else hf_bert(tmp_path)
    model = from_hf(tmp_path / "base")
    kw = {"fan_in_fan_out": True} if family == "gpt2" else {}
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=peft_targets,
                                                 **kw))
    add_lora(model, LoraConfig(r=4, alpha=8, targets=qkv_targets))
    trainable, total = pm.get_nb_trainable_parameters()
    assert count_parameters(model) == (trainable, total)


def test_mismatched_peft_adapters_give_one_error_and_load_nothing(tmp_path):
    pm = peft_model(hf_gpt2(tmp_path), ["c_attn"], fan_in_fan_out=True)
    pm.save_pretrained(tmp_path / "gpt_adapter")
    other = GPT(GPTConfig(vocab_size=V, max_len=32, dim=48, num_layers=2, num_heads=4))
    with pytest.raises(CheckpointError, match="do not fit"):
        load_adapter(other, tmp_path / "gpt_adapter")
    assert adapter_names(other) == [] and all(p.requires_grad for p in other.parameters())

    bert_dir = tmp_path / "b"
    bert_dir.mkdir()
    hf_bert(bert_dir)
    bert = from_hf(bert_dir / "base")
    with pytest.raises(CheckpointError, match="do not map"):
        load_adapter(bert, tmp_path / "gpt_adapter")
    assert adapter_names(bert) == []

    # a PEFT module qkv.peft does not adapt (the pooler's dense), and a subset of layers
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64,
                                  max_position_embeddings=32)
    pooled = transformers.BertModel(cfg)
    pooled.save_pretrained(tmp_path / "pooled")
    peft_model(pooled, ["query", "dense"]).save_pretrained(tmp_path / "pooler_adapter")
    model = from_hf(tmp_path / "pooled")
    with pytest.raises(CheckpointError, match="pooler"):
        load_adapter(model, tmp_path / "pooler_adapter")
    pooled = transformers.BertModel(cfg)
    peft_model(pooled, ["query"], layers_to_transform=[0]).save_pretrained(tmp_path / "l0")
    with pytest.raises(CheckpointError, match="layers_to_transform"):
        load_adapter(model, tmp_path / "l0")
    pooled = transformers.BertModel(cfg)
    peft_model(pooled, ["query"], use_dora=True).save_pretrained(tmp_path / "dora")
    with pytest.raises(CheckpointError, match="use_dora"):
        load_adapter(model, tmp_path / "dora")
    assert adapter_names(model) == [] and not any(".lora." in k for k in model.state_dict())
