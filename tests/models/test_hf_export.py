"""``to_hf``: qkv GPT / BERT models written as HuggingFace directories that transformers loads
with the same outputs (docs/ARCHITECTURE.md: The model registry, for the loaders inverted).

Oracles: transformers' own classes (AutoModelForCausalLM, BertModel, BertForMaskedLM) loading
the written directory, against the HF model the qkv model was read from (tests/models/
_hf_decoders.py: tiny random configs) or the qkv model itself. Tolerances: logits within
1e-5 of the logits' largest magnitude (the issue's "relative to the logits' scale"); the
HF -> qkv -> HF state dict exactly equal (same keys, ``torch.equal``), and transformers'
loading info empty (no missing, unexpected or mis-shaped key).
"""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from _hf_decoders import FAMILIES, hf_logits, hf_model, left_padded, save_hf, transformers
from safetensors import safe_open
from torch import nn

from qkv.models import BERT, GPT, BERTConfig, GPTConfig, ViT, ViTConfig, from_pretrained
from qkv.models.hf_export import choose_model_type, hf_config_for, hf_state_dict, to_hf

#: the family each HF fixture exports as when the config alone decides (Phi-3's layout is
#: Mistral's computation with fused tensors; model_type="phi3" keeps its layout)
DEFAULT_TYPE = {"llama": "llama", "llama-bias-tied": "llama", "llama3-scaled": "llama",
                "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma",
                "gemma2": "gemma2", "phi3": "mistral"}


def _close(ours: torch.Tensor, theirs: torch.Tensor, rel: float = 1e-5) -> None:
    scale = theirs.abs().max().item()
    err = (ours - theirs).abs().max().item()
    assert err <= rel * scale, f"max error {err:.3g} > {rel:g} x logits scale {scale:.3g}"


def _load_causal(directory):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), info  # no missing / unexpected / mismatched keys
    return model.eval()


def _reload_quietly(directory):
    """qkv reads the export back without a warning (no field unknown to its audit)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return from_pretrained(directory)


def _file_keys(directory) -> set[str]:
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_hf_to_qkv_to_hf_is_the_same_model(name, tmp_path):
    hf = hf_model(name)
    ours = from_pretrained(save_hf(hf, tmp_path / "src"))
    ids, mask = left_padded()
    keep = mask.bool()
    want = hf_logits(hf, ids, mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = to_hf(ours, tmp_path / "auto")
    assert json.loads((out / "config.json").read_text())["model_type"] == DEFAULT_TYPE[name]
    _close(hf_logits(_load_causal(out), ids, mask)[keep], want[keep])
    again = _reload_quietly(out)
    with torch.no_grad():
        _close(again(ids, attention_mask=mask)[keep], want[keep])

    same = to_hf(ours, tmp_path / "same", model_type=hf.config.model_type)
    back = _load_causal(same)
    theirs, mine = hf.state_dict(), back.state_dict()
    assert mine.keys() == theirs.keys()
    for k in theirs:
        assert torch.equal(mine[k], theirs[k]), k
    assert _file_keys(same) == _file_keys(tmp_path / "src")  # a tied head not written


def _randomise(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every parameter N(0, 0.3²); norm weights 1 + N(0, 0.1²) (Gemma's (1 + w): N(0, 0.1²)),
    so that biases, norms and the head all matter."""
    g = torch.Generator().manual_seed(seed)
    plus_one = getattr(model.config, "norm", "") == "rmsnorm_plus_one"
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name and name.endswith("weight"):
                p.copy_((0.0 if plus_one else 1.0) + 0.1 * noise)
            else:
                p.copy_(0.3 * noise)
    return model.eval()


_BASE = dict(vocab_size=97, max_len=64, dim=32, num_layers=2, num_heads=4)
_LLAMA_LIKE = dict(_BASE, positions="rope", norm="rmsnorm", activation="swiglu", bias=False)

#: qkv configs -> the family they export as
GPT_CONFIGS = {
    "gpt2-tied": (dict(_BASE), "gpt2"),
    "gpt2-untied-gelu": (dict(_BASE, tie_embeddings=False, activation="gelu", ffn_hidden=48,
                              norm_eps=1e-6), "gpt2"),
    "gpt2-relu": (dict(_BASE, activation="relu"), "gpt2"),
    "llama-gqa-tied": (dict(_LLAMA_LIKE, num_kv_heads=2), "llama"),
    "llama-mqa-untied": (dict(_LLAMA_LIKE, num_kv_heads=1, tie_embeddings=False,
                              ffn_hidden=40, attention_head_dim=12,
                              rope_base=500000.0), "llama"),
    "llama-bias-yarn": (dict(_LLAMA_LIKE, bias=True, activation="geglu", rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}), "llama"),
    "llama-linear-rope": (dict(_LLAMA_LIKE, rope_scaling={"rope_type": "linear",
                                                          "factor": 2.0}), "llama"),
    "mistral-window": (dict(_LLAMA_LIKE, num_kv_heads=2, attention_window=4), "mistral"),
    "mistral-every-layer-named": (dict(_LLAMA_LIKE, attention_window=4,
                                       windowed_layers=(0, 1)), "mistral"),
    "qwen2-some-windows": (dict(_LLAMA_LIKE, num_layers=3, qkv_bias=True, attention_window=3,
                                windowed_layers=(0, 2)), "qwen2"),
    "qwen3-windows": (dict(_LLAMA_LIKE, qk_norm=True, attention_head_dim=16,
                           attention_window=5, windowed_layers=(1,)), "qwen3"),
    "gemma-geglu": (dict(_LLAMA_LIKE, norm="rmsnorm_plus_one", embed_scale=True,
                         activation="geglu", attention_head_dim=16), "gemma"),
    "gemma2-all-windows": (dict(_LLAMA_LIKE, norm="rmsnorm_plus_one", embed_scale=True,
                                post_norms=True, activation="geglu_tanh",
                                attention_scale=20 ** -0.5, attn_softcap=4.0,
                                logit_softcap=6.0, attention_window=3), "gemma2"),
    "gemma2-no-window": (dict(_LLAMA_LIKE, norm="rmsnorm_plus_one", embed_scale=True,
                              post_norms=True, activation="swiglu", attn_softcap=4.0,
                              logit_softcap=6.0, num_kv_heads=1), "gemma2"),
}


@pytest.mark.parametrize("name", sorted(GPT_CONFIGS))
def test_qkv_gpt_exports_with_its_logits(name, tmp_path):
    fields, family = GPT_CONFIGS[name]
    config = GPTConfig(**fields)
    assert choose_model_type(config) == family
    ours = _randomise(GPT(config))
    ids, mask = left_padded()  # 11 tokens: beyond every window above
    keep = mask.bool()
    with torch.no_grad():
        want = ours(ids, attention_mask=mask)
    out = to_hf(ours, tmp_path / "hf")
    hf = json.loads((out / "config.json").read_text())
    assert hf["model_type"] == family
    assert hf["tie_word_embeddings"] is config.tie_embeddings
    _close(hf_logits(_load_causal(out), ids, mask)[keep], want[keep])
    with torch.no_grad():
        _close(_reload_quietly(out)(ids, attention_mask=mask)[keep], want[keep])
    expect_head = not config.tie_embeddings
    assert ("lm_head.weight" in _file_keys(out)) is expect_head


def test_gemma2_without_soft_caps_reads_back_into_qkv(tmp_path):
    config = GPTConfig(**dict(_LLAMA_LIKE, norm="rmsnorm_plus_one", embed_scale=True,
                              post_norms=True, activation="geglu_tanh"))
    ours = _randomise(GPT(config))
    ids, mask = left_padded()
    keep = mask.bool()
    with torch.no_grad():
        want = ours(ids, attention_mask=mask)
    out = to_hf(ours, tmp_path / "hf")
    _close(hf_logits(_load_causal(out), ids, mask)[keep], want[keep])  # transformers agrees
    with torch.no_grad():
        _close(_reload_quietly(out)(ids, attention_mask=mask)[keep], want[keep])


def test_phi3_layout_on_request(tmp_path):
    """A Llama-style config without biases, windowed on every layer, as Phi-3 (fused
    qkv_proj and gate_up_proj) when asked, with its residual dropout as resid_pdrop."""
    config = GPTConfig(**_LLAMA_LIKE, num_kv_heads=2, attention_window=4, dropout=0.1)
    ours = _randomise(GPT(config))
    ids, mask = left_padded()
    keep = mask.bool()
    with torch.no_grad():
        want = ours(ids, attention_mask=mask)
    out = to_hf(ours, tmp_path / "phi3", model_type="phi3")
    hf = json.loads((out / "config.json").read_text())
    assert (hf["model_type"], hf["resid_pdrop"], hf["sliding_window"]) == ("phi3", 0.1, 4)
    assert "model.layers.0.self_attn.qkv_proj.weight" in _file_keys(out)
    _close(hf_logits(_load_causal(out), ids, mask)[keep], want[keep])


def _bert(with_pooler: bool = True, with_mlm_head: bool = True, **kw) -> BERT:
    config = BERTConfig(vocab_size=97, max_len=32, dim=32, num_layers=2, num_heads=4,
                        ffn_hidden=48, with_pooler=with_pooler, with_mlm_head=with_mlm_head,
                        **kw)
    return _randomise(BERT(config))


def _bert_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids (B, N), a right-padded mask (B, N) and token types (B, N)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 97, (2, 9), generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    types = torch.zeros(2, 9, dtype=torch.long)
    types[:, 4:] = 1
    return ids, mask, types


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_qkv_bert_exports_with_its_outputs(activation, tmp_path):
    ours = _bert(activation=activation)
    ids, mask, types = _bert_batch()
    keep = mask.bool()
    with torch.no_grad():
        out = ours(ids, mask, types)
        logits = ours.mlm_logits(out.last_hidden_state)
    d = to_hf(ours, tmp_path / "bert")
    with torch.no_grad():
        base = transformers.BertModel.from_pretrained(d, attn_implementation="eager").eval()
        got = base(input_ids=ids, attention_mask=mask, token_type_ids=types)
        mlm, info = transformers.BertForMaskedLM.from_pretrained(
            d, attn_implementation="eager", output_loading_info=True)
        got_logits = mlm.eval()(input_ids=ids, attention_mask=mask,
                                token_type_ids=types).logits
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    _close(got.last_hidden_state[keep], out.last_hidden_state[keep])
    _close(got.pooler_output, out.pooler_output)
    _close(got_logits[keep], logits[keep])


@pytest.mark.parametrize("cls", ["BertForMaskedLM", "BertModel"])
def test_hf_bert_to_qkv_to_hf_is_the_same_model(cls, tmp_path):
    config = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=48,
                                     max_position_embeddings=32, hidden_act="gelu_new")
    torch.manual_seed(0)
    hf = getattr(transformers, cls)(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "src")
    ours = from_pretrained(tmp_path / "src")
    out = to_hf(ours, tmp_path / "out")
    back, info = getattr(transformers, cls).from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    theirs, mine = hf.state_dict(), back.state_dict()
    assert mine.keys() == theirs.keys()
    for k in theirs:
        assert torch.equal(mine[k], theirs[k]), k
    assert _file_keys(out) == _file_keys(tmp_path / "src")
    assert json.loads((out / "config.json").read_text())["architectures"] == [cls]


# --- refusals -------------------------------------------------------------------------------
REFUSED = {
    "linear attention": (dict(_BASE, attention="linear"), None, "attention='linear'"),
    "window on some layers of a Llama": (
        dict(_LLAMA_LIKE, attention_window=4, windowed_layers=(1,)), None,
        "Llama has no sliding window"),
    "Mistral with biases": (dict(_LLAMA_LIKE, bias=True, attention_window=4), None,
                            "Mistral has no biases"),
    "Mistral asked for, window on one layer": (
        dict(_LLAMA_LIKE, attention_window=4, windowed_layers=(0,)), "mistral",
        "Mistral windows every layer or none"),
    "LayerNorm with RoPE": (dict(_BASE, positions="rope"), None, "norm='layernorm'"),
    "gated GPT-2": (dict(_BASE, activation="swiglu"), None, "GPT-2's MLP computes"),
    "Phi-3 with rope scaling": (dict(_LLAMA_LIKE, rope_scaling={"rope_type": "linear",
                                                                "factor": 2.0}), "phi3",
                                "rope_type 'default' or 'longrope'"),
    "Gemma 2 with a non-int query scalar": (
        dict(_LLAMA_LIKE, norm="rmsnorm_plus_one", embed_scale=True, post_norms=True,
             activation="geglu_tanh", attention_scale=0.3), None, "query_pre_attn_scalar"),
    "soft cap on a Llama": (dict(_LLAMA_LIKE, logit_softcap=5.0), None,
                            "logit_softcap=5.0: Llama has no soft-capping"),
    "a BERT family for a GPT": (dict(_LLAMA_LIKE), "bert", "exports as one of"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_with_the_reason_and_nothing_written(case, tmp_path):
    fields, model_type, reason = REFUSED[case]
    model = GPT(GPTConfig(**fields))
    with pytest.raises(ValueError) as err:
        hf_config_for(model.config, model_type=model_type)
    message = str(err.value)
    assert reason in message and "\n" not in message, message
    with pytest.raises(ValueError, match=re.escape(reason)):
        to_hf(model, tmp_path / "out", model_type=model_type)
    assert not (tmp_path / "out").exists()


def test_refuses_interleaved_rope_quantized_and_added_modules(tmp_path):
    import qkv

    model = GPT(GPTConfig(**_LLAMA_LIKE))
    model.rope.interleaved = True  # the shared RoPE of every layer: GPT-J's pairs
    with pytest.raises(ValueError, match="interleaved=True"):
        to_hf(model, tmp_path / "a")
    model = GPT(GPTConfig(**_LLAMA_LIKE))
    model.extra = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"keys with no HF place \['extra.bias', 'extra.weight'"):
        hf_state_dict(model)
    model = qkv.quantize(GPT(GPTConfig(**_BASE)))
    with pytest.raises(ValueError, match="quantized"):
        to_hf(model, tmp_path / "b")
    with pytest.raises(TypeError, match="GPT or BERT, got ViT"):
        to_hf(ViT(ViTConfig.from_name("vit-tiny")), tmp_path / "c")
    with pytest.raises(ValueError, match="BERTConfig cannot be exported"):
        hf_config_for(BERTConfig(vocab_size=97, max_len=32, dim=32, num_layers=1,
                                 num_heads=4, ffn_hidden=48, activation="quick_gelu"))
    assert not any(tmp_path.iterdir())


def test_dropout_dropped_with_a_warning_and_token_ids(tmp_path):
    model = GPT(GPTConfig(**_LLAMA_LIKE, dropout=0.1))
    with pytest.warns(UserWarning, match="dropout=0.1 dropped"):
        out = to_hf(model, tmp_path / "out", token_ids={"bos_token_id": 1, "eos_token_id": [2, 3]})
    hf = json.loads((out / "config.json").read_text())
    assert (hf["bos_token_id"], hf["eos_token_id"], hf["pad_token_id"]) == (1, [2, 3], None)
    assert json.loads((out / "generation_config.json").read_text()) == {
        "bos_token_id": 1, "eos_token_id": [2, 3]}
    with pytest.raises(ValueError, match="token_ids must be a dict with keys among"):
        hf_config_for(model.config, token_ids={"unk_token_id": 3})
    with pytest.raises(ValueError, match=r"token_ids\['bos_token_id'\] must be"):
        hf_config_for(model.config, token_ids={"bos_token_id": -1})
    quiet = GPT(GPTConfig(**_LLAMA_LIKE))
    assert not (to_hf(quiet, tmp_path / "quiet") / "generation_config.json").exists()
