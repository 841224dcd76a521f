"""HuggingFace Gemma 1 and Gemma 2 checkpoints -> ``qkv.models.gpt.GPT``: one ``Family`` each
over the shared Llama-style mapping (``hf_decoder``).

Shapes: as ``hf_decoder`` (Gemma's D = ``head_dim``, 256, so H·D may differ from C). What
differs from Llama:

- both: RMSNorm scaled by (1 + w) (``norm="rmsnorm_plus_one"``), the token embeddings
  multiplied by √C rounded to the weight dtype (``embed_scale``), a GeGLU FFN with the tanh
  GELU, tied embeddings;
- Gemma 2: four norms per layer (``post_norms``: ``post_attention_layernorm`` is the
  attention output's norm, ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm``
  the FFN's), attention logits soft-capped by ``attn_logit_softcapping`` and the LM head's
  by ``final_logit_softcapping``, the q·k scale ``query_pre_attn_scalar^-0.5``, and local
  (``sliding_window``) layers alternating with global ones (even layers local, or as
  ``layer_types`` says).
"""

from __future__ import annotations

from typing import Any

from ..files import CheckpointError
from .hf_config import Check, only
from .hf_decoder import (
    LAYER_TYPES_FIELD,
    Family,
    decoder_mapping,
    gated_activation,
    windowed_layers,
)

__all__ = ["GEMMA", "GEMMA2", "GEMMA2_FAMILY", "GEMMA_FAMILY"]


def _positive(value: Any, _data: dict[str, Any]) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                             and value > 0)


_POSITIVE = Check(_positive, "a positive number or null", used=True)
_BIDIRECTIONAL = only(None, False, why="qkv's GPT is causal (bidirectional attention is "
                                       "for Gemma's embedding variants)")


def _gemma_activation(hf: dict[str, Any], source: str) -> str:
    """Gemma 1 reads ``hidden_act``, whose legacy "gelu" transformers takes as the tanh
    GELU; a 4.x ``hidden_activation`` must agree with it."""
    act = hf.get("hidden_act", "gelu_pytorch_tanh")
    act = "gelu_pytorch_tanh" if act == "gelu" else act
    other = hf.get("hidden_activation")
    if other is not None and other != act:
        raise CheckpointError(f"{source}: config.json hidden_activation={other!r} differs "
                              f"from hidden_act={hf.get('hidden_act')!r}, which transformers "
                              f"computes; qkv will not guess")
    return gated_activation(act, source)


def _gemma(hf: dict[str, Any], source: str) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    return {"norm": "rmsnorm_plus_one", "embed_scale": True, "qkv_bias": bias,
            "out_bias": bias, "ffn_bias": False,
            "activation": _gemma_activation(hf, source)}


def _gemma2(hf: dict[str, Any], source: str) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    out = {"norm": "rmsnorm_plus_one", "embed_scale": True, "qkv_bias": bias,
           "out_bias": bias, "ffn_bias": False, "post_norms": True,
           "activation": gated_activation(hf.get("hidden_activation", "gelu_pytorch_tanh"),
                                          source, "hidden_activation"),
           "attention_scale": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
           "attn_softcap": hf.get("attn_logit_softcapping"),
           "logit_softcap": hf.get("final_logit_softcapping")}
    window = hf.get("sliding_window")
    if window is not None:
        layers = windowed_layers(hf, int(hf["num_hidden_layers"]), source,
                                 lambda i: i % 2 == 0)
        if layers != ():
            out.update(attention_window=int(window), windowed_layers=layers)
    return out


_GEMMA_DEFAULTS = {"vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576,
                   "num_hidden_layers": 28, "num_attention_heads": 16, "head_dim": 256,
                   "hidden_act": "gelu_pytorch_tanh", "max_position_embeddings": 8192,
                   "rms_norm_eps": 1e-6, "tie_word_embeddings": True}

GEMMA_FAMILY = Family(
    model_type="gemma", name="Gemma",
    fields={"attention_bias": "used", "hidden_activation": "used",
            "hidden_act": "used", "use_bidirectional_attention": _BIDIRECTIONAL},
    defaults=_GEMMA_DEFAULTS, extra=_gemma)
GEMMA2_FAMILY = Family(
    model_type="gemma2", name="Gemma 2",
    fields={"attention_bias": "used", "hidden_activation": "used",
            "hidden_act": "ignored: Gemma 2 computes hidden_activation",
            "query_pre_attn_scalar": _POSITIVE, "sliding_window": _POSITIVE,
            "layer_types": LAYER_TYPES_FIELD,
            "attn_logit_softcapping": _POSITIVE, "final_logit_softcapping": _POSITIVE,
            "cache_implementation": "ignored: which cache class transformers uses",
            "use_bidirectional_attention": _BIDIRECTIONAL},
    defaults={**_GEMMA_DEFAULTS, "hidden_size": 2304, "intermediate_size": 9216,
              "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
              "query_pre_attn_scalar": 256, "sliding_window": 4096,
              "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
              "hidden_activation": "gelu_pytorch_tanh"},
    extra=_gemma2, sandwich_norms=True)

GEMMA = decoder_mapping(GEMMA_FAMILY)
GEMMA2 = decoder_mapping(GEMMA2_FAMILY)
