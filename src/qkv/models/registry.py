"""The one table of qkv's model types: each entry names the ``model_type`` qkv writes into
config.json, the config class, the model class, the HuggingFace ``model_type`` values it
reads, and whether ``qkv.quantize`` handles it. Every other place that needs a class for a
``model_type`` asks here (docs/ARCHITECTURE.md: The model registry).

Adding a model family is one line here (plus its config, model and HF mapping files).
This module sits at the top of ``qkv.models``: it imports every model; no model imports it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from ..files import CheckpointError
from .bert import BERT, BERTConfig
from .clip import CLIP, CLIPConfig
from .flamingo import Flamingo, FlamingoConfig
from .gpt import GPT, GPTConfig
from .transformer import Transformer, TransformerConfig
from .vit import ViT, ViTConfig

__all__ = ["ENTRIES", "ModelEntry", "entry_for", "known_model_types", "model_class"]


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """One model type.

    Attributes:
        model_type: the ``model_type`` qkv writes into config.json ("qkv-gpt").
        config_class: its config (a ``ModelConfig``; ``config_class.MODEL_TYPE == model_type``).
        model_class: the ``nn.Module`` built from that config.
        hf_model_types: the HuggingFace config.json ``model_type`` values the model class
            reads (``model_class.from_hf``); () when it reads none.
        quantizable: ``qkv.quantize`` turns its linear layers to int8 (and such a saved
            directory loads back quantized).
    """

    model_type: str
    config_class: type
    model_class: type[nn.Module]
    hf_model_types: tuple[str, ...] = ()
    quantizable: bool = False


ENTRIES: tuple[ModelEntry, ...] = (
    ModelEntry("qkv-transformer", TransformerConfig, Transformer, quantizable=True),
    ModelEntry("qkv-gpt", GPTConfig, GPT, ("gpt2",), quantizable=True),
    ModelEntry("qkv-bert", BERTConfig, BERT, ("bert",), quantizable=True),
    ModelEntry("qkv-vit", ViTConfig, ViT, ("vit",)),
    ModelEntry("qkv-clip", CLIPConfig, CLIP, ("clip",)),
    ModelEntry("qkv-flamingo", FlamingoConfig, Flamingo),
)

_BY_TYPE: dict[str, ModelEntry] = {e.model_type: e for e in ENTRIES}
_BY_TYPE.update({hf: e for e in ENTRIES for hf in e.hf_model_types})


def known_model_types() -> list[str]:
    """Every ``model_type`` qkv loads, its own ("qkv-gpt") and HuggingFace's ("gpt2")."""
    return sorted(_BY_TYPE)


def entry_for(model_type: Any, *, source: str = "config.json") -> ModelEntry:
    """The entry owning a config.json ``model_type`` (qkv's own or an HF one).

    Raises:
        CheckpointError: an unknown (or missing) ``model_type``, listing the known ones.
    """
    found = _BY_TYPE.get(model_type) if isinstance(model_type, str) else None
    if found is None:
        raise CheckpointError(f"{source}: model_type {model_type!r} is not a model qkv loads; "
                              f"known: {', '.join(known_model_types())}")
    return found


def model_class(model_type: Any, *, source: str = "config.json") -> type[nn.Module]:
    """The model class of a config.json ``model_type`` (``entry_for(model_type).model_class``)."""
    return entry_for(model_type, source=source).model_class
