"""HuggingFace BERT checkpoints -> ``qkv.models.bert.BERT``: the ``BERT_HF`` mapping (config
fields, key map, state normalisation).

Shapes: V vocab size, C model width. HF keeps separate query/key/value projections (C, C)
and (C,); qkv's ``in_proj`` fuses them into (3C, C) / (3C,), rows q, k, v. Keys may carry
the "bert." prefix (``BertForMaskedLM``/``BertForPreTraining``) or not (``BertModel``).
The config fields are classified in ``qkv.models.hf_config.BERT_FIELDS``. ``BERT_HF`` is the
mapping ``hf_load.load_hf`` runs (``BERT.from_hf``); this module never imports the model.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ..files import CheckpointError
from .hf_config import BERT_FIELDS, HF_ACTIVATIONS, audit_hf_config
from .hf_load import HFMapping
from .hf_state import KeyMap, layer_field
from .hf_state import map_hf_state as map_state
from .weights import same_values

__all__ = ["BERT_HF", "LAYER_KEY", "bert_key_map", "config_from_hf", "map_hf_state",
           "normalise_hf_state"]

#: the layer index in the names of HF BERT's encoder tensors (num_hidden_layers counts them)
LAYER_KEY = r"(?:bert\.)?encoder\.layer\.(\d+)\."

#: BertConfig's defaults for the fields a config.json may leave out
_HF_DEFAULTS = {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12,
                "num_attention_heads": 12, "intermediate_size": 3072, "hidden_act": "gelu",
                "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
                "max_position_embeddings": 512, "type_vocab_size": 2, "layer_norm_eps": 1e-12,
                "pad_token_id": 0}


def config_from_hf(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """``BERTConfig`` fields (without with_pooler / with_mlm_head) from the dict of an HF
    BERT config.json. Every field is classified in ``qkv.models.hf_config.BERT_FIELDS``:
    refused options raise a CheckpointError naming them, unknown fields warn; a field left
    out takes BertConfig's default."""
    if hf.get("model_type") != "bert":
        raise CheckpointError(f"{source}: config.json model_type {hf.get('model_type')!r}; "
                              f"BERT.from_hf reads 'bert' checkpoints")
    audit_hf_config(hf, BERT_FIELDS, source)
    hf = {**_HF_DEFAULTS, **hf}
    act = hf["hidden_act"]
    return {"vocab_size": hf["vocab_size"], "max_len": hf["max_position_embeddings"],
            "type_vocab_size": hf["type_vocab_size"], "dim": hf["hidden_size"],
            "num_layers": hf["num_hidden_layers"], "num_heads": hf["num_attention_heads"],
            "ffn_hidden": hf["intermediate_size"], "activation": HF_ACTIVATIONS[act],
            "norm_eps": hf["layer_norm_eps"], "dropout": hf["hidden_dropout_prob"],
            "attn_dropout": hf["attention_probs_dropout_prob"],
            # None: HF's embedding has no padding row, which changes gradients only
            "pad_token_id": hf["pad_token_id"] or 0}


def normalise_hf_state(state: dict[str, Tensor], source: str,
                       tied: bool = True) -> dict[str, Tensor]:
    """Strip "bert.", rename gamma/beta, drop the keys we knowingly ignore. ``tied``: the
    config's tie_word_embeddings; with False the checkpoint's MLM decoder must be present and
    equal to the word embeddings (qkv's decoder is always tied)."""
    out: dict[str, Tensor] = {}
    for key, t in state.items():
        k = key.removeprefix("bert.")
        if k.endswith(".gamma"):
            k = k[:-len("gamma")] + "weight"
        elif k.endswith(".beta"):
            k = k[:-len("beta")] + "bias"
        if k in out:
            raise CheckpointError(f"{source}: key {key!r} appears twice (with and without "
                                  f"the 'bert.' prefix, or as gamma/beta and weight/bias)")
        out[k] = t
    out.pop("embeddings.position_ids", None)
    for k in [k for k in out if k.startswith("cls.seq_relationship.")]:
        del out[k]  # next-sentence prediction head: not part of this model
    dec_w = out.pop("cls.predictions.decoder.weight", None)
    if dec_w is not None:
        word = out.get("embeddings.word_embeddings.weight")
        if word is None or not same_values(word, dec_w):
            raise CheckpointError(f"{source}: cls.predictions.decoder.weight differs from the "
                                  f"word embeddings (config tie_word_embeddings={tied}); only "
                                  f"a tied MLM decoder is supported")
    elif not tied and any(k.startswith("cls.predictions.") for k in out):
        raise CheckpointError(f"{source}: config tie_word_embeddings=False but the checkpoint "
                              f"has no cls.predictions.decoder.weight: the MLM decoder is "
                              f"undefined (qkv supports only a decoder tied to the word "
                              f"embeddings)")
    dec_b = out.pop("cls.predictions.decoder.bias", None)
    if dec_b is not None:
        bias = out.setdefault("cls.predictions.bias", dec_b)
        if not same_values(bias, dec_b):
            raise CheckpointError(f"{source}: cls.predictions.decoder.bias differs from "
                                  f"cls.predictions.bias")
    return out


def bert_key_map(config: Any) -> KeyMap:
    """Each state-dict key of a ``BERT`` of ``config`` -> its HuggingFace ``BertModel`` /
    ``BertForMaskedLM`` key (without the "bert." prefix); fused projections map to the
    (query, key, value) triple. The pooler and MLM head as ``config.with_pooler`` /
    ``config.with_mlm_head`` say."""
    m: KeyMap = {
        "word_embeddings.weight": "embeddings.word_embeddings.weight",
        "position.weight": "embeddings.position_embeddings.weight",
        "token_type_embeddings.weight": "embeddings.token_type_embeddings.weight",
        "embed_norm.weight": "embeddings.LayerNorm.weight",
        "embed_norm.bias": "embeddings.LayerNorm.bias",
    }
    for i in range(config.num_layers):
        q, h = f"layers.{i}.", f"encoder.layer.{i}."
        for p in ("weight", "bias"):
            m[f"{q}attn.in_proj.{p}"] = tuple(
                f"{h}attention.self.{n}.{p}" for n in ("query", "key", "value"))
            m[f"{q}attn.out_proj.{p}"] = f"{h}attention.output.dense.{p}"
            m[f"{q}norm1.{p}"] = f"{h}attention.output.LayerNorm.{p}"
            m[f"{q}ffn.fc_in.{p}"] = f"{h}intermediate.dense.{p}"
            m[f"{q}ffn.fc_out.{p}"] = f"{h}output.dense.{p}"
            m[f"{q}norm2.{p}"] = f"{h}output.LayerNorm.{p}"
    for p in ("weight", "bias"):
        if config.with_pooler:
            m[f"pooler.{p}"] = f"pooler.dense.{p}"
        if config.with_mlm_head:
            m[f"mlm.dense.{p}"] = f"cls.predictions.transform.dense.{p}"
            m[f"mlm.norm.{p}"] = f"cls.predictions.transform.LayerNorm.{p}"
    if config.with_mlm_head:
        m["mlm.bias"] = "cls.predictions.bias"
    return m


def map_hf_state(model: nn.Module, state: dict[str, Tensor], source: str) -> dict[str, Tensor]:
    """HF keys -> the keys of ``model`` (a ``BERT``: ``bert_key_map(model.config)``), fusing
    q/k/v (each (C, ...) -> in_proj (3C, ...), rows q, k, v); errors in HF names."""
    return map_state(model.state_dict(), bert_key_map(model.config), state, source, "BERT")


def _layer_counts(hf: dict[str, Any], fields: dict[str, Any], source: str) -> list:
    return [(layer_field(hf, "num_hidden_layers"), fields["num_layers"], LAYER_KEY)]


def _normalise(state: dict[str, Tensor], hf: dict[str, Any], source: str):
    return normalise_hf_state(state, source, tied=hf.get("tie_word_embeddings", True) is not False)


def _heads(state: dict[str, Tensor]) -> dict[str, Any]:
    """The heads a checkpoint holds: the pooler and the masked-LM head are built when it does."""
    return {"with_pooler": "pooler.dense.weight" in state,
            "with_mlm_head": any(k.startswith("cls.predictions.") for k in state)}


#: HF BERT (``BertModel``, ``BertForMaskedLM``, ``BertForPreTraining``) -> ``BERT``
BERT_HF = HFMapping(model_type="bert", name="BERT", config_fields=config_from_hf,
                    layer_counts=_layer_counts, key_map=bert_key_map, normalise=_normalise,
                    state_fields=_heads)
