"""HuggingFace Llama 1/2/3.x, Mistral, Qwen2/2.5 and Qwen3 checkpoints -> ``qkv.models.gpt.GPT``:
one ``Family`` each over the shared Llama-style mapping (``hf_decoder``).

Shapes: as ``hf_decoder``. What differs:

- Llama: ``attention_bias`` (q, k, v and o), ``mlp_bias`` (gate, up, down), ``head_dim``,
  RoPE scaling ("linear", "dynamic", "llama3", "yarn": ``hf_rope``).
- Mistral: ``sliding_window`` W on every layer (decoded with ``WindowKVCache``s).
- Qwen2/2.5: biases on q/k/v only (none on o or the FFN); ``use_sliding_window`` with
  ``max_window_layers`` (or transformers 5's ``layer_types``) for windowed layers.
- Qwen3: an RMSNorm per head on q and k (``q_norm`` / ``k_norm``) before RoPE;
  ``attention_bias`` on q, k, v and o.
"""

from __future__ import annotations

from typing import Any

from .hf_config import only
from .hf_decoder import LAYER_TYPES_FIELD, WINDOW_FIELD, Family, decoder_mapping, windowed_layers

__all__ = ["LLAMA", "LLAMA_FAMILY", "MISTRAL", "MISTRAL_FAMILY", "QWEN2", "QWEN2_FAMILY",
           "QWEN3", "QWEN3_FAMILY"]

_TP = "ignored: HF computes the projections in pretraining_tp slices; the same math"


def _llama(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return {"qkv_bias": bool(hf.get("attention_bias", False)),
            "out_bias": bool(hf.get("attention_bias", False)),
            "ffn_bias": bool(hf.get("mlp_bias", False))}


def _mistral(hf: dict[str, Any], source: str) -> dict[str, Any]:
    window = hf.get("sliding_window")
    return {} if window is None else {"attention_window": int(window)}


def _qwen_window(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """Qwen2/3's windows: ``sliding_window`` only with ``use_sliding_window``, on the
    layers from ``max_window_layers`` on (or those ``layer_types`` names)."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    if window is None:
        return {}
    first = int(hf.get("max_window_layers", 28))
    layers = windowed_layers(hf, int(hf["num_hidden_layers"]), source, lambda i: i >= first)
    if layers == ():
        return {}
    return {"attention_window": int(window), "windowed_layers": layers}


def _qwen2(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return {"qkv_bias": True, "out_bias": False, "ffn_bias": False, **_qwen_window(hf, source)}


def _qwen3(hf: dict[str, Any], source: str) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    return {"qkv_bias": bias, "out_bias": bias, "ffn_bias": False, "qk_norm": True,
            **_qwen_window(hf, source)}


_QWEN_WINDOW_FIELDS = {"use_sliding_window": "used", "sliding_window": WINDOW_FIELD,
                       "max_window_layers": "used", "layer_types": LAYER_TYPES_FIELD}

LLAMA_FAMILY = Family(
    model_type="llama", name="Llama",
    fields={"attention_bias": "used", "mlp_bias": "used", "pretraining_tp": _TP},
    defaults={"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
              "num_hidden_layers": 32, "num_attention_heads": 32, "hidden_act": "silu",
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False},
    extra=_llama)
MISTRAL_FAMILY = Family(
    model_type="mistral", name="Mistral",
    fields={"sliding_window": WINDOW_FIELD,
            "layer_types": only(None, why="alternating layers are Ministral's, not Mistral's "
                                          "(transformers ignores them here too)")},
    defaults={"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False, "sliding_window": 4096},
    extra=_mistral)
QWEN2_FAMILY = Family(
    model_type="qwen2", name="Qwen2", fields=_QWEN_WINDOW_FIELDS,
    defaults={"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "hidden_act": "silu",
              "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False, "max_window_layers": 28, "sliding_window": 4096},
    extra=_qwen2)
QWEN3_FAMILY = Family(
    model_type="qwen3", name="Qwen3", fields={**_QWEN_WINDOW_FIELDS, "attention_bias": "used"},
    defaults={**QWEN2_FAMILY.defaults, "head_dim": 128}, extra=_qwen3)

LLAMA = decoder_mapping(LLAMA_FAMILY)
MISTRAL = decoder_mapping(MISTRAL_FAMILY)
QWEN2 = decoder_mapping(QWEN2_FAMILY)
QWEN3 = decoder_mapping(QWEN3_FAMILY)
