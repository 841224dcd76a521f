"""HuggingFace Phi-3 checkpoints -> ``qkv.models.gpt.GPT``: a ``Family`` over the shared
Llama-style mapping (``hf_decoder``).

Shapes: as ``hf_decoder``. Phi-3 holds q, k, v as one ``qkv_proj`` ((H + 2·Hkv)·D, C), rows
q, k, v, and the gated FFN as one ``gate_up_proj`` (2F, C), rows gate, up: qkv's
``in_proj`` and ``fc_in`` as they are. ``sliding_window`` applies to every layer. The
"longrope" scaling of the 128k models is refused in one line (``hf_rope``): transformers
switches between its short and long factors by the length of each call.
"""

from __future__ import annotations

from typing import Any

from .hf_decoder import WINDOW_FIELD, Family, decoder_mapping

__all__ = ["PHI3", "PHI3_FAMILY"]


def _phi3(hf: dict[str, Any], source: str) -> dict[str, Any]:
    window = hf.get("sliding_window")
    out: dict[str, Any] = {"dropout": float(hf.get("resid_pdrop", 0.0))}
    if window is not None:
        out["attention_window"] = int(window)
    return out


PHI3_FAMILY = Family(
    model_type="phi3", name="Phi-3",
    fields={"sliding_window": WINDOW_FIELD,
            "resid_pdrop": "used",
            "embd_pdrop": "ignored: transformers' Phi-3 does not apply it",
            "partial_rotary_factor": "used (qkv.models.hf_rope: only 1.0)",
            "original_max_position_embeddings": "used (qkv.models.hf_rope: the original "
                                                "context of llama3 / yarn scaling)"},
    defaults={"vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
              "num_hidden_layers": 32, "num_attention_heads": 32, "hidden_act": "silu",
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": False},
    extra=_phi3, fused_qkv=True, fused_gate_up=True)

PHI3 = decoder_mapping(PHI3_FAMILY)
