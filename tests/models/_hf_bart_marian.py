"""Tiny HF BART and Marian models with random weights, saved as HF directories, for
tests/models/test_hf_bart_marian.py: one config per variant (shared / separate vocabularies,
tied / untied heads, with and without ``final_logits_bias``, positions stored or not), every
parameter drawn anew so that norms, biases, positions and the head all matter.

Shapes: V = 61 vocab (V_tgt = 47 for separate vocabularies), C = 32 width, H = 4 heads,
F = 48 FFN width, P = 40 positions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

transformers = __import__("pytest").importorskip("transformers")

_BASE = {"vocab_size": 61, "d_model": 32, "encoder_layers": 2, "decoder_layers": 2,
         "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 48,
         "decoder_ffn_dim": 48, "max_position_embeddings": 40, "dropout": 0.0,
         "activation_dropout": 0.0, "attention_dropout": 0.0}
_MARIAN = {**_BASE, "pad_token_id": 46, "decoder_start_token_id": 46, "eos_token_id": 0,
           "activation_function": "swish", "scale_embedding": True}

#: name -> (HF config class, its seq2seq LM class, config kwargs, keys dropped from the file)
VARIANTS: dict[str, tuple[str, str, dict[str, Any], tuple[str, ...]]] = {
    "bart": ("BartConfig", "BartForConditionalGeneration",
             {**_BASE, "scale_embedding": True}, ()),
    "bart-untied": ("BartConfig", "BartForConditionalGeneration",
                    {**_BASE, "scale_embedding": True, "tie_word_embeddings": False}, ()),
    "marian": ("MarianConfig", "MarianMTModel", _MARIAN, ()),
    "marian-no-bias": ("MarianConfig", "MarianMTModel", _MARIAN, ("final_logits_bias",)),
    "marian-separate": ("MarianConfig", "MarianMTModel",
                        {**_MARIAN, "share_encoder_decoder_embeddings": False,
                         "decoder_vocab_size": 47}, ()),
    "marian-untied": ("MarianConfig", "MarianMTModel",
                      {**_MARIAN, "tie_word_embeddings": False}, ()),
}


def _randomise(model: torch.nn.Module) -> None:
    """Token tables and heads N(0, 0.2²), the layers' matrices and biases N(0, 0.3²)
    (fp32 well-conditioned: HF's and qkv's fp32 logits each lie within ~1e-6 · their scale
    of the fp64 ones), LayerNorm weights 1 + N(0, 0.1²) and biases N(0, 0.1²),
    ``final_logits_bias`` N(0, 0.3²); Marian's sinusoid tables are left as transformers
    computes them."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embed_positions.weight") and not p.requires_grad:
                continue  # Marian's fixed table
            if "layer_norm" in name or "layernorm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in name or "shared" in name or "lm_head" in name:
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
        model.final_logits_bias.copy_(0.3 * torch.randn_like(model.final_logits_bias))


def hf_model(name: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The HF seq2seq LM of variant ``name`` (``VARIANTS``; ``overrides`` change its config),
    eager attention, eval mode, random weights (``_randomise``)."""
    config_cls, model_cls, kw, _ = VARIANTS[name]
    config = getattr(transformers, config_cls)(**{**kw, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    _randomise(model)
    return model


def save_hf(model: torch.nn.Module, directory: Path, *, drop: tuple[str, ...] = (),
            add: dict[str, torch.Tensor] | None = None,
            config: dict[str, Any] | None = None) -> Path:
    """``model.save_pretrained(directory)`` (safetensors), then the file without ``drop``'s
    keys and with ``add``'s tensors, and config.json updated by ``config``."""
    model.save_pretrained(directory, safe_serialization=True)
    if drop or add:
        path = directory / "model.safetensors"
        state = {k: v for k, v in load_file(path).items() if k not in drop}
        state.update({k: v.clone().contiguous() for k, v in (add or {}).items()})
        save_file(state, path, metadata={"format": "pt"})
    if config:
        path = directory / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return directory


def saved_variant(name: str, directory: Path, seed: int = 0) -> Path:
    """Variant ``name`` saved to ``directory`` (its ``VARIANTS`` keys dropped)."""
    return save_hf(hf_model(name, seed), directory, drop=VARIANTS[name][3])


def reload_hf(name: str, directory: Path) -> torch.nn.Module:
    """What transformers loads from ``directory`` (eager attention, eval mode): the oracle."""
    cls = getattr(transformers, VARIANTS[name][1])
    return cls.from_pretrained(directory, attn_implementation="eager").eval()


def marian_table(rows: int, dim: int, interleaved: bool = False) -> torch.Tensor:
    """transformers' Marian sinusoid table (P, C) ([sin | cos]); ``interleaved``: the
    paper's layout instead (sin, cos alternating), which Marian does not use."""
    table = transformers.models.marian.modeling_marian.MarianSinusoidalPositionalEmbedding(
        rows, dim).create_weight()
    if interleaved:
        half = dim // 2
        table = torch.stack((table[:, :half], table[:, half:]), dim=-1).flatten(-2)
    return table
