"""Tiny HF Llama-style decoders with random weights, saved as HF directories, for the family
tests (tests/models/test_hf_decoders.py and the PEFT / export tests): one config per family
(and per variant), every parameter drawn anew so that norms, biases and the head all matter.

Shapes: V = 97 vocab, C = 32 width, H = 4 heads, Hkv = 2 kv heads, F = 48 FFN width.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

transformers = __import__("pytest").importorskip("transformers")

VOCAB = 97

_BASE = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "pad_token_id": None,
         "bos_token_id": 1, "eos_token_id": 2}

#: name -> (HF config class, its CausalLM class, config kwargs)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              {**_BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}),
    "llama-bias-tied": ("LlamaConfig", "LlamaForCausalLM",
                        {**_BASE, "attention_bias": True, "mlp_bias": True,
                         "tie_word_embeddings": True, "head_dim": 16}),
    "llama3-scaled": ("LlamaConfig", "LlamaForCausalLM",
                      {**_BASE, "max_position_embeddings": 64, "rope_parameters": {
                          "rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8}}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**_BASE, "sliding_window": 5}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {**_BASE, "tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**_BASE, "head_dim": 16}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {**_BASE, "head_dim": 16}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               {**_BASE, "num_hidden_layers": 3, "head_dim": 16, "sliding_window": 4,
                "query_pre_attn_scalar": 12, "attn_logit_softcapping": 5.0,
                "final_logit_softcapping": 3.0}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {**_BASE, "pad_token_id": None,
                                               "eos_token_id": 2, "sliding_window": 6}),
}


def hf_model(name: str, seed: int = 0) -> torch.nn.Module:
    """The HF CausalLM of family ``name`` (``FAMILIES``), eager attention, eval mode, every
    parameter N(0, 0.3²) (norm weights 1 + N(0, 0.1²) for Llama-style norms, N(0, 0.1²) for
    Gemma's 1 + w ones)."""
    config_cls, model_cls, kw = FAMILIES[name]
    config = getattr(transformers, config_cls)(**kw)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    gemma = name.startswith("gemma")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_((0.0 if gemma else 1.0) + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    return model


def save_hf(model: torch.nn.Module, directory: Path, *, legacy_rope: bool = False) -> Path:
    """``model.save_pretrained(directory)`` (safetensors); with ``legacy_rope`` config.json
    rewritten in transformers 4.x's spelling (top-level ``rope_theta``, ``rope_scaling``
    with ``"type"``)."""
    model.save_pretrained(directory, safe_serialization=True)
    if legacy_rope:
        path = directory / "config.json"
        data = json.loads(path.read_text())
        params = dict(data.pop("rope_parameters", None) or {})
        data["rope_theta"] = params.pop("rope_theta", 10000.0)
        kind = params.pop("rope_type", "default")
        params.pop("partial_rotary_factor", None)
        data["rope_scaling"] = None if kind == "default" else {"type": kind, **params}
        path.write_text(json.dumps(data))
    return directory


def left_padded(seed: int = 1, lengths: tuple[int, ...] = (11, 7)) -> tuple[torch.Tensor,
                                                                           torch.Tensor]:
    """A left-padded batch: ids (B, N) and its mask (B, N) (1 = real), pads id 0."""
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.zeros(len(lengths), n, dtype=torch.long)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for b, length in enumerate(lengths):
        ids[b, n - length:] = torch.randint(3, VOCAB, (length,), generator=g)
        mask[b, n - length:] = 1
    return ids, mask


def hf_logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None
              ) -> torch.Tensor:
    """HF's logits (B, N, V), positions counted from each row's first real token (as
    ``generate`` does; a plain forward would count from the padding)."""
    kw: dict[str, Any] = {}
    if mask is not None:
        kw = {"attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    with torch.no_grad():
        return model(ids, **kw).logits
