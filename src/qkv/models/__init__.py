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
- ``from_pretrained(dir)``: the one door: any directory qkv can load (a qkv model, quantized
  or not; an HF GPT-2, Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Phi-3 (all as a
  ``GPT``), BERT-family, ViT or CLIP directory; a Flamingo; a ``qkv train`` run),
  by the one table of model types (``qkv.models.registry``); ``from_hf(dir)``: an HF
  directory only. The HF config fields each architecture reads, ignores or refuses are
  listed in ``qkv.models.hf_config`` (``GPT2_FIELDS``, ``BERT_FIELDS``, ``VIT_FIELDS``,
  ``CLIP_FIELDS``; the Llama-style families' tables: ``qkv.models.hf_decoder``);
  ``to_hf(model, dir)`` / ``hf_config_for(config)``: a GPT or BERT written back as an HF
  directory transformers loads (``qkv.models.hf_export``).

Every model has ``save_pretrained(dir)`` and ``from_pretrained(dir)`` (config.json +
model.safetensors) and configs with named presets (``GPTConfig.from_name("gpt2")``).
"""

from __future__ import annotations

from .bert import BERT, BERTConfig, BERTOutput, mean_pool
from .clip import CLIP, CLIPConfig, CLIPOutput, CLIPTextConfig
from .clip_loss import clip_loss
from .flamingo import Flamingo, FlamingoConfig
from .gpt import GPT, GPTConfig, GPTOutput
from .hf_export import hf_config_for, to_hf
from .hub import CheckpointError, load_tokenizer, read_json
from .registry import from_hf, from_pretrained, register_directory_reader
from .transformer import Transformer, TransformerConfig, TransformerOutput
from .vit import ViT, ViTConfig, ViTOutput
from .zero_shot import retrieval_recall, topk_accuracy, zero_shot_classify, zero_shot_weights

__all__ = ["BERT", "CLIP", "GPT", "BERTConfig", "BERTOutput", "CLIPConfig", "CLIPOutput",
           "CLIPTextConfig", "CheckpointError", "GPTConfig", "GPTOutput", "Transformer",
           "TransformerConfig", "TransformerOutput", "ViT", "ViTConfig", "ViTOutput",
           "clip_loss", "from_hf", "from_pretrained", "load_tokenizer", "mean_pool",
           "read_json", "register_directory_reader", "retrieval_recall", "topk_accuracy",
           "zero_shot_classify", "zero_shot_weights"]
__all__ += ["Flamingo", "FlamingoConfig", "hf_config_for", "to_hf"]
