"""HuggingFace ViT checkpoints -> ``qkv.models.vit.ViT``: the ``VIT_HF`` mapping (config
fields, key map, state conversion), and the HF-name mapping shared with ``hf_clip``.

Shapes: C model width, Cin channels, P patch size, T = 1 + G·G positions, K classes.
HF keeps separate query/key/value projections (C, C) and (C,); qkv's ``in_proj`` fuses
them into (3C, C) / (3C,), rows q, k, v. HF's cls_token (1, 1, C) and position_embeddings
(1, T, C) become qkv's (C,) and (T, C). Keys may carry the "vit." prefix
(``ViTForImageClassification``) or not (``ViTModel``). The config fields are classified in
``qkv.models.hf_config.VIT_FIELDS``. ``hf_load.load_hf`` runs the mapping
(``ViT.from_hf``); this module never imports the model.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..files import CheckpointError
from .hf_config import HF_ACTIVATIONS, VIT_FIELDS, audit_hf_config
from .hf_load import HFMapping
from .hf_state import KeyMap, layer_field

__all__ = ["LAYER_KEY", "VIT_HF", "config_from_hf", "convert_hf_state", "layer_key_map",
           "square", "vit_key_map"]

#: the layer index in the names of HF ViT's encoder tensors (num_hidden_layers counts them)
LAYER_KEY = r"(?:vit\.)?encoder\.layer\.(\d+)\."

#: transformers ViTConfig's defaults for the fields a config.json may leave out
_HF_DEFAULTS = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                "intermediate_size": 3072, "hidden_act": "gelu", "hidden_dropout_prob": 0.0,
                "attention_probs_dropout_prob": 0.0, "layer_norm_eps": 1e-12,
                "image_size": 224, "patch_size": 16, "num_channels": 3, "qkv_bias": True}



def square(value: Any) -> Any:
    """``n`` for ``n`` or ``[n, n]`` (HF image_size / patch_size), else the value itself."""
    if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == value[1]:
        return value[0]
    return value


def config_from_hf(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """``ViTConfig`` fields (without with_pooler / num_classes) from an HF ViT config.json.
    Every field is classified in ``qkv.models.hf_config.VIT_FIELDS``: refused options raise a
    CheckpointError naming them, unknown fields warn; a field left out takes transformers'
    default."""
    if hf.get("model_type") != "vit":
        raise CheckpointError(f"{source}: config.json model_type {hf.get('model_type')!r}; "
                              f"ViT.from_hf reads 'vit' checkpoints")
    audit_hf_config(hf, VIT_FIELDS, source)
    hf = {**_HF_DEFAULTS, **hf}
    return {"image_size": square(hf["image_size"]), "patch_size": square(hf["patch_size"]),
            "dim": hf["hidden_size"], "num_layers": hf["num_hidden_layers"],
            "num_heads": hf["num_attention_heads"], "ffn_hidden": hf["intermediate_size"],
            "num_channels": hf["num_channels"], "activation": HF_ACTIVATIONS[hf["hidden_act"]],
            "norm_eps": hf["layer_norm_eps"], "dropout": hf["hidden_dropout_prob"],
            "attn_dropout": hf["attention_probs_dropout_prob"], "pooling": "cls",
            "pre_norm": False, "patch_bias": True}


def layer_key_map(num_layers: int, ours: str, theirs: str, names: dict[str, str]) -> KeyMap:
    """State-dict keys of qkv's pre-norm ``EncoderLayer``s ``{ours}{i}.`` -> HF keys
    ``{theirs}{i}.``; ``names`` gives HF's sub-names for "q", "k", "v", "out", "norm1",
    "norm2", "fc_in", "fc_out". The fused ``attn.in_proj`` maps to the (q, k, v) triple."""
    m: KeyMap = {}
    for i in range(num_layers):
        q, h = f"{ours}{i}.", f"{theirs}{i}."
        for p in ("weight", "bias"):
            m[f"{q}attn.in_proj.{p}"] = tuple(f"{h}{names[n]}.{p}" for n in ("q", "k", "v"))
            for own, hf in (("attn.out_proj", "out"), ("norm1", "norm1"), ("norm2", "norm2"),
                            ("ffn.fc_in", "fc_in"), ("ffn.fc_out", "fc_out")):
                m[f"{q}{own}.{p}"] = f"{h}{names[hf]}.{p}"
    return m


_VIT_LAYER = {"q": "attention.attention.query", "k": "attention.attention.key",
              "v": "attention.attention.value", "out": "attention.output.dense",
              "norm1": "layernorm_before", "norm2": "layernorm_after",
              "fc_in": "intermediate.dense", "fc_out": "output.dense"}


def vit_key_map(num_layers: int, *, pooler: bool, head: bool) -> KeyMap:
    """qkv ``ViT`` keys -> HF ``ViTModel`` keys (without "vit."); the head -> "classifier"."""
    m: KeyMap = {"cls_token": "embeddings.cls_token",
                 "pos_embed": "embeddings.position_embeddings",
                 "patch_embed.weight": "embeddings.patch_embeddings.projection.weight",
                 "patch_embed.bias": "embeddings.patch_embeddings.projection.bias",
                 "norm.weight": "layernorm.weight", "norm.bias": "layernorm.bias"}
    m.update(layer_key_map(num_layers, "layers.", "encoder.layer.", _VIT_LAYER))
    for p in ("weight", "bias"):
        if pooler:
            m[f"pooler.{p}"] = f"pooler.dense.{p}"
        if head:
            m[f"head.{p}"] = f"classifier.{p}"
    return m


def convert_hf_state(state: dict[str, Tensor], num_layers: int, dim: int, source: str,
                     *, qkv_bias: bool = True) -> dict[str, Tensor]:
    """Strip "vit.", drop ``embeddings.position_ids``, reshape cls_token (1, 1, C) -> (C,)
    and position_embeddings (1, T, C) -> (T, C); without ``qkv_bias`` add zero q/k/v biases
    (C,) (an absent bias and a zero one give the same outputs)."""
    out: dict[str, Tensor] = {}
    for key, t in state.items():
        k = key.removeprefix("vit.")
        if k in out:
            raise CheckpointError(f"{source}: key {key!r} appears twice (with and without "
                                  f"the 'vit.' prefix)")
        out[k] = t
    out.pop("embeddings.position_ids", None)
    for k, shape in (("embeddings.cls_token", (dim,)), ("embeddings.position_embeddings", None)):
        t = out.get(k)
        if t is not None and t.dim() >= 2 and t.shape[0] == 1:
            out[k] = t.reshape(shape if shape is not None else t.shape[1:])
    if not qkv_bias:
        for i in range(num_layers):
            for n in ("query", "key", "value"):
                w = out.get(f"encoder.layer.{i}.attention.attention.{n}.weight")
                name = f"encoder.layer.{i}.attention.attention.{n}.bias"
                if w is not None and name not in out:
                    out[name] = w.new_zeros(w.shape[0])
    return out


def _layer_counts(hf: dict[str, Any], fields: dict[str, Any], source: str) -> list:
    return [(layer_field(hf, "num_hidden_layers"), fields["num_layers"], LAYER_KEY)]


def _normalise(state: dict[str, Tensor], hf: dict[str, Any], source: str):
    fields = {**_HF_DEFAULTS, **hf}
    return convert_hf_state(state, fields["num_hidden_layers"], fields["hidden_size"], source,
                            qkv_bias=hf.get("qkv_bias", True) is not False)


def _heads(state: dict[str, Tensor]) -> dict[str, Any]:
    """The heads a checkpoint holds: the pooler, and the classifier (its class count)."""
    head = state.get("classifier.weight")
    return {"with_pooler": "pooler.dense.weight" in state,
            "num_classes": 0 if head is None else int(head.shape[0])}


def _key_map(config: Any) -> KeyMap:
    return vit_key_map(config.num_layers, pooler=config.with_pooler,
                       head=config.num_classes > 0)


#: HF ViT (``ViTModel``, ``ViTForImageClassification``) -> ``ViT``
VIT_HF = HFMapping(model_type="vit", name="ViT", config_fields=config_from_hf,
                   layer_counts=_layer_counts, key_map=_key_map, normalise=_normalise,
                   state_fields=_heads)
