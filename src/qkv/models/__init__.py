"""Transformer models built on the qkv core.

- ``Transformer`` / ``TransformerConfig``: the encoder-decoder of Vaswani et al. (the seeds'
  system);
- ``GPT`` / ``GPTConfig``: decoder-only language model;
- ``BERT`` / ``BERTConfig``: encoder-only model;
- ``ViT`` / ``ViTConfig``: the Vision Transformer (image classification, CLIP's image tower);
- ``CLIP`` / ``CLIPConfig``: image and text towers in one embedding space; ``clip_loss``
  (symmetric InfoNCE, gathering over processes under torch.distributed); zero-shot
  classification and retrieval (``zero_shot_weights``, ``zero_shot_classify``,
  ``topk_accuracy``, ``retrieval_recall``);
- ``Flamingo``: a frozen GPT and a frozen vision tower joined by a Perceiver resampler and
  tanh-gated cross-attention (``bind_images`` for ``qkv.generate``);
- ``from_hf(dir)``: load a local HuggingFace GPT-2, BERT-family, ViT or CLIP checkpoint
  directory.

Every model has ``save_pretrained(dir)`` and ``from_pretrained(dir)`` (config.json +
model.safetensors) and configs with named presets (``GPTConfig.from_name("gpt2")``).
"""

from __future__ import annotations

import os
from pathlib import Path

from .bert import BERT, BERTConfig, BERTOutput, mean_pool
from .clip import CLIP, CLIPConfig, CLIPOutput, CLIPTextConfig
from .clip_loss import clip_loss
from .flamingo import Flamingo, FlamingoConfig
from .gpt import GPT, GPTConfig, GPTOutput
from .hub import CheckpointError, load_tokenizer, read_json
from .transformer import Transformer, TransformerConfig, TransformerOutput
from .vit import ViT, ViTConfig, ViTOutput
from .zero_shot import retrieval_recall, topk_accuracy, zero_shot_classify, zero_shot_weights

__all__ = ["BERT", "CLIP", "GPT", "BERTConfig", "BERTOutput", "CLIPConfig", "CLIPOutput",
           "CLIPTextConfig", "CheckpointError", "GPTConfig", "GPTOutput", "Transformer",
           "TransformerConfig", "TransformerOutput", "ViT", "ViTConfig", "ViTOutput",
           "clip_loss", "from_hf", "load_tokenizer", "mean_pool", "retrieval_recall",
           "topk_accuracy", "zero_shot_classify", "zero_shot_weights"]
__all__ += ["Flamingo", "FlamingoConfig"]

_HF_ARCHITECTURES = {"gpt2": GPT, "bert": BERT, "vit": ViT, "clip": CLIP}


def from_hf(directory: str | os.PathLike, *, allow_pickle: bool = False):
    """Load a local HuggingFace checkpoint directory (config.json + model.safetensors) into
    the matching qkv model: ``model_type`` "gpt2" -> ``GPT``, "bert" -> ``BERT``, "vit"
    -> ``ViT`` (``ViTModel`` / ``ViTForImageClassification``), "clip" -> ``CLIP``
    (``CLIPModel``).

    The weights may be sharded (model.safetensors.index.json and the shards it names, as
    ``save_pretrained(max_shard_size=...)`` writes them). ``pytorch_model.bin`` (a pickle) is
    refused unless ``allow_pickle=True``, and even then read only with
    ``torch.load(weights_only=True)``. The tokenizer, if any, comes from
    ``load_tokenizer(directory)``.

    Before any model is built, config.json is checked against the weights' headers (layer
    counts, then every name, shape and dtype on a meta-device probe): a config that does not
    fit its weights is a ``CheckpointError`` naming the field; int or bool weights where the
    model holds floats are refused, never cast.

    Every config.json field is used, ignored (it cannot change the outputs) or checked, as
    ``qkv.models.hf_config.GPT2_FIELDS`` / ``BERT_FIELDS`` / ``VIT_FIELDS`` /
    ``CLIP_FIELDS`` list: an option qkv does not
    compute (BERT ``is_decoder: true``, cross-attention, relative positions...) raises
    ``CheckpointError`` naming the field and its value; an unknown field warns.
    """
    directory = Path(directory)
    model_type = read_json(directory / "config.json").get("model_type")
    if model_type not in _HF_ARCHITECTURES:
        raise CheckpointError(f"{directory}: model_type {model_type!r} is not supported; "
                              f"supported: {sorted(_HF_ARCHITECTURES)}")
    return _HF_ARCHITECTURES[model_type].from_hf(directory, allow_pickle=allow_pickle)
