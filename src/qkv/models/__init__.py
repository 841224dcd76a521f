"""Transformer models built on the qkv core.

- ``Transformer`` / ``TransformerConfig``: the encoder-decoder of Vaswani et al. (the seeds'
  system);
- ``GPT`` / ``GPTConfig``: decoder-only language model;
- ``BERT`` / ``BERTConfig``: encoder-only model;
- ``from_hf(dir)``: load a local HuggingFace GPT-2 or BERT-family checkpoint directory.

Every model has ``save_pretrained(dir)`` and ``from_pretrained(dir)`` (config.json +
model.safetensors) and configs with named presets (``GPTConfig.from_name("gpt2")``).
"""

from __future__ import annotations

import os
from pathlib import Path

from .bert import BERT, BERTConfig, BERTOutput, mean_pool
from .gpt import GPT, GPTConfig, GPTOutput
from .hub import CheckpointError, load_tokenizer, read_json
from .transformer import Transformer, TransformerConfig, TransformerOutput

__all__ = ["BERT", "GPT", "BERTConfig", "BERTOutput", "CheckpointError", "GPTConfig",
           "GPTOutput", "Transformer", "TransformerConfig", "TransformerOutput", "from_hf",
           "load_tokenizer", "mean_pool"]

_HF_ARCHITECTURES = {"gpt2": GPT, "bert": BERT}


def from_hf(directory: str | os.PathLike, *, allow_pickle: bool = False):
    """Load a local HuggingFace checkpoint directory (config.json + model.safetensors) into
    the matching qkv model: ``model_type`` "gpt2" -> ``GPT``, "bert" -> ``BERT``.

    ``pytorch_model.bin`` (a pickle) is refused unless ``allow_pickle=True``, and even then
    read only with ``torch.load(weights_only=True)``. The tokenizer, if any, comes from
    ``load_tokenizer(directory)``.

    Every config.json field is used, ignored (it cannot change the outputs) or checked, as
    ``qkv.models.hf_config.GPT2_FIELDS`` / ``BERT_FIELDS`` list: an option qkv does not
    compute (BERT ``is_decoder: true``, cross-attention, relative positions...) raises
    ``CheckpointError`` naming the field and its value; an unknown field warns.
    """
    directory = Path(directory)
    model_type = read_json(directory / "config.json").get("model_type")
    if model_type not in _HF_ARCHITECTURES:
        raise CheckpointError(f"{directory}: model_type {model_type!r} is not supported; "
                              f"supported: {sorted(_HF_ARCHITECTURES)}")
    return _HF_ARCHITECTURES[model_type].from_hf(directory, allow_pickle=allow_pickle)
