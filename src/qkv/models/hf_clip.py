"""HuggingFace CLIP checkpoints -> ``qkv.models.clip.CLIP``: the ``CLIP_HF`` mapping (config
fields, key map, state conversion); ``hf_load.load_hf`` runs it, this module never imports
the model.

Shapes: Cv / Ct tower widths, E projection width, T = 1 + G·G image positions.
HF's separate q/k/v projections fuse into qkv's ``in_proj`` (rows q, k, v); the vision
tower's class_embedding (Cv,) and position_embedding (T, Cv) become ``vision.cls_token`` and
``vision.pos_embed``; its ``post_layernorm`` (on the pooled token) is qkv's final ``norm``
(on every token: the pooled row is the same). The 0-dim ``logit_scale`` becomes (1,).
Config fields are classified in ``qkv.models.hf_config`` (``CLIP_FIELDS``,
``CLIP_TEXT_FIELDS``, ``CLIP_VISION_FIELDS``).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..files import CheckpointError
from .hf_config import (
    CLIP_ACTIVATIONS,
    CLIP_FIELDS,
    CLIP_TEXT_FIELDS,
    CLIP_VISION_FIELDS,
    audit_hf_config,
)
from .hf_load import HFMapping
from .hf_state import KeyMap, layer_field
from .hf_vit import layer_key_map, square

__all__ = ["CLIP_HF", "TEXT_LAYER_KEY", "VISION_LAYER_KEY", "clip_key_map", "config_from_hf"]

#: the layer index in the names of HF CLIP's tower tensors (each tower's num_hidden_layers)
TEXT_LAYER_KEY = r"text_model\.encoder\.layers\.(\d+)\."
VISION_LAYER_KEY = r"vision_model\.encoder\.layers\.(\d+)\."

#: transformers 5.x CLIPTextConfig / CLIPVisionConfig defaults for fields left out
_TEXT_DEFAULTS = {"vocab_size": 49408, "hidden_size": 512, "intermediate_size": 2048,
                  "num_hidden_layers": 12, "num_attention_heads": 8,
                  "max_position_embeddings": 77, "hidden_act": "quick_gelu",
                  "layer_norm_eps": 1e-5, "attention_dropout": 0.0, "eos_token_id": 49407}
_VISION_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                    "num_attention_heads": 12, "num_channels": 3, "image_size": 224,
                    "patch_size": 32, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5,
                    "attention_dropout": 0.0}

_CLIP_LAYER = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
               "out": "self_attn.out_proj", "norm1": "layer_norm1", "norm2": "layer_norm2",
               "fc_in": "mlp.fc1", "fc_out": "mlp.fc2"}


def _tower(hf: dict[str, Any], name: str, source: str) -> dict[str, Any]:
    sub = hf.get(name) or {}
    extra = hf.get(f"{name}_dict")  # old configs: merged over text_config, as transformers
    if not isinstance(sub, dict) or (extra is not None and not isinstance(extra, dict)):
        raise CheckpointError(f"{source}: config.json {name} must be a JSON object, "
                              f"got {type(sub).__name__}")
    return {**sub, **(extra or {})}


def config_from_hf(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """``CLIPConfig`` fields (vision / text as dicts) from an HF CLIP config.json. Every
    field is classified in ``CLIP_FIELDS`` / ``CLIP_TEXT_FIELDS`` / ``CLIP_VISION_FIELDS``:
    refused options raise a CheckpointError naming them (``text_config.<field>``...),
    unknown fields warn; a field left out takes transformers' default."""
    if hf.get("model_type") != "clip":
        raise CheckpointError(f"{source}: config.json model_type {hf.get('model_type')!r}; "
                              f"CLIP.from_hf reads 'clip' checkpoints")
    audit_hf_config(hf, CLIP_FIELDS, source)
    text = _tower(hf, "text_config", source)
    vision = _tower(hf, "vision_config", source)
    audit_hf_config({"model_type": "clip_text_model", **text}, CLIP_TEXT_FIELDS,
                    f"{source} text_config")
    audit_hf_config({"model_type": "clip_vision_model", **vision}, CLIP_VISION_FIELDS,
                    f"{source} vision_config")
    t = {**_TEXT_DEFAULTS, **text}
    v = {**_VISION_DEFAULTS, **vision}
    eos = t["eos_token_id"]
    if not isinstance(eos, int) or isinstance(eos, bool):
        raise CheckpointError(f"{source}: text_config eos_token_id={eos!r}: a single int is "
                              f"needed to pool the text")
    return {
        "vision": {"image_size": square(v["image_size"]), "patch_size": square(v["patch_size"]),
                   "dim": v["hidden_size"], "num_layers": v["num_hidden_layers"],
                   "num_heads": v["num_attention_heads"], "ffn_hidden": v["intermediate_size"],
                   "num_channels": v["num_channels"],
                   "activation": CLIP_ACTIVATIONS[v["hidden_act"]],
                   "norm_eps": v["layer_norm_eps"], "attn_dropout": v["attention_dropout"],
                   "pooling": "cls", "pre_norm": True, "patch_bias": False},
        "text": {"vocab_size": t["vocab_size"], "max_len": t["max_position_embeddings"],
                 "dim": t["hidden_size"], "num_layers": t["num_hidden_layers"],
                 "num_heads": t["num_attention_heads"], "ffn_hidden": t["intermediate_size"],
                 "activation": CLIP_ACTIVATIONS[t["hidden_act"]],
                 "norm_eps": t["layer_norm_eps"], "attn_dropout": t["attention_dropout"],
                 # transformers: eos_token_id 2 (configs before 4.31) pools at the highest id
                 "eos_token_id": eos, "pooling": "argmax" if eos == 2 else "eos"},
        "embed_dim": hf.get("projection_dim", 512),
    }


def clip_key_map(num_vision_layers: int, num_text_layers: int) -> KeyMap:
    """qkv ``CLIP`` keys -> HF ``CLIPModel`` keys (fused in_proj -> the (q, k, v) triple)."""
    vm, tm = "vision_model.", "text_model."
    m: KeyMap = {
        "vision.cls_token": f"{vm}embeddings.class_embedding",
        "vision.pos_embed": f"{vm}embeddings.position_embedding.weight",
        "vision.patch_embed.weight": f"{vm}embeddings.patch_embedding.weight",
        "text.token_embed.weight": f"{tm}embeddings.token_embedding.weight",
        "text.position.weight": f"{tm}embeddings.position_embedding.weight",
        "visual_projection.weight": "visual_projection.weight",
        "text_projection.weight": "text_projection.weight",
        "logit_scale": "logit_scale",
    }
    for p in ("weight", "bias"):
        m[f"vision.norm_pre.{p}"] = f"{vm}pre_layrnorm.{p}"
        m[f"vision.norm.{p}"] = f"{vm}post_layernorm.{p}"
        m[f"text.norm.{p}"] = f"{tm}final_layer_norm.{p}"
    m.update(layer_key_map(num_vision_layers, "vision.layers.", f"{vm}encoder.layers.",
                           _CLIP_LAYER))
    m.update(layer_key_map(num_text_layers, "text.layers.", f"{tm}encoder.layers.",
                           _CLIP_LAYER))
    return m


def _convert(state: dict[str, Tensor], hf: dict[str, Any], source: str) -> dict[str, Tensor]:
    out = {k: t for k, t in state.items() if not k.endswith("embeddings.position_ids")}
    scale = out.get("logit_scale")
    if scale is not None and scale.dim() == 0:
        out["logit_scale"] = scale.reshape(1)  # qkv: (1,), FSDP2 refuses 0-dim parameters
    return out


def _towers(hf: dict[str, Any], source: str) -> dict[str, dict[str, Any]]:
    return {name: _tower(hf, name, source) for name in ("text_config", "vision_config")}


def _layer_counts(hf: dict[str, Any], fields: dict[str, Any], source: str) -> list:
    towers = _towers(hf, source)
    return [(f"text_config.{layer_field(towers['text_config'], 'num_hidden_layers')}",
             fields["text"]["num_layers"], TEXT_LAYER_KEY),
            (f"vision_config.{layer_field(towers['vision_config'], 'num_hidden_layers')}",
             fields["vision"]["num_layers"], VISION_LAYER_KEY)]


def _key_map(config: Any) -> KeyMap:
    return clip_key_map(config.vision.num_layers, config.text.num_layers)


def _size_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return {**hf, **_towers(hf, source)}  # the towers' sizes named text_config.hidden_size...


#: HF CLIP (``CLIPModel``) -> ``CLIP``
CLIP_HF = HFMapping(model_type="clip", name="CLIP", config_fields=config_from_hf,
                    layer_counts=_layer_counts, key_map=_key_map, normalise=_convert,
                    size_fields=_size_fields)
