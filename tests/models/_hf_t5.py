"""Tiny HF T5 models with random weights, saved as HF directories, for
tests/models/test_hf_t5.py: T5 v1.0 (ReLU FFN, tied and scaled head) and T5 v1.1 / Flan-T5
(gated-gelu FFN, separate unscaled head, H·D != C), each with relative buckets that saturate
within the test sequences (max_distance 8-10 < 20 positions).

Shapes: V = 61 vocab, C = 16 width, H heads (4 of 4, or 3 of 8: H·D = 24 != C), F = 32 FFN
width, 2 encoder and 3 decoder layers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

transformers = __import__("pytest").importorskip("transformers")

VOCAB, PAD, EOS, START = 61, 0, 1, 0

_BASE = {"vocab_size": VOCAB, "d_model": 16, "d_ff": 32, "num_layers": 2,
         "num_decoder_layers": 3, "dropout_rate": 0.0, "layer_norm_epsilon": 1e-6,
         "pad_token_id": PAD, "eos_token_id": EOS, "decoder_start_token_id": START}

#: name -> T5Config kwargs
VARIANTS: dict[str, dict[str, Any]] = {
    "t5-v1.0": {**_BASE, "num_heads": 4, "d_kv": 4, "feed_forward_proj": "relu",
                "tie_word_embeddings": True, "relative_attention_num_buckets": 16,
                "relative_attention_max_distance": 10},
    "flan-t5": {**_BASE, "num_heads": 3, "d_kv": 8, "feed_forward_proj": "gated-gelu",
                "tie_word_embeddings": False, "relative_attention_num_buckets": 8,
                "relative_attention_max_distance": 8},
}


def hf_t5(name: str, seed: int = 0) -> torch.nn.Module:
    """The HF ``T5ForConditionalGeneration`` of variant ``name`` (``VARIANTS``), eager
    attention, eval mode, every weight drawn anew: projections N(0, 0.3²), norms
    1 + N(0, 0.1²), relative biases and the token table N(0, 1) (peaked logits, max |logit|
    ~3 and ~10: no near-ties in search, and outputs that are not one token repeated); the
    untied variant gets its own ``lm_head`` N(0, 1)."""
    kw = VARIANTS[name]
    config = transformers.T5Config(**kw)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "layer_norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "relative_attention_bias" in pname or pname == "shared.weight":
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.3)
        if not kw["tie_word_embeddings"]:  # transformers 5 ties every T5 head on build
            model.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, kw["d_model"]))
    return model


def save_hf(model: torch.nn.Module, directory: Path, *, legacy: bool = False) -> Path:
    """``model.save_pretrained(directory)`` (safetensors). ``legacy``: config.json rewritten
    as transformers 4.x wrote T5 checkpoints on the Hub (``tie_word_embeddings`` says the
    head's kind, no ``scale_decoder_outputs``, Flan-T5's ``n_positions`` / ``output_past`` /
    ``task_specific_params``)."""
    model.save_pretrained(directory, safe_serialization=True)
    if legacy:
        path = directory / "config.json"
        data = json.loads(path.read_text())
        data["tie_word_embeddings"] = bool(data.pop("scale_decoder_outputs"))
        data.update(n_positions=512, output_past=True, torch_dtype="float32",
                    transformers_version="4.23.1",
                    task_specific_params={"summarization": {"num_beams": 4,
                                                            "prefix": "summarize: "}})
        data.pop("dtype", None)
        path.write_text(json.dumps(data, indent=2))
    return directory


def padded_sources(batch: int = 3, length: int = 20, seed: int = 1
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, S) right-padded with PAD, mask (B, S) int64 1 = real): row r keeps
    S - 7r tokens (20, 13, 6 for the defaults), ids in [2, V) so no real token is PAD or
    EOS."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for r in range(batch):
        mask[r, length - 7 * r:] = 0
    return ids.masked_fill(mask == 0, PAD), mask
