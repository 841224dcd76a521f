"""``qkv.quantize(model, "int8")`` and the files of a quantized model, under their
generation-side names.

The int8 layer and its math (``QuantizedLinear``, ``quantize_weight``, ``quantize_rows``,
``int8_linear``; shapes and the error bound) live in ``qkv.modules.quantized``; the model
conversion and the quantized directory format (``quantize``, ``QuantizedMLMHead``,
quantization.json) in ``qkv.models.quantized``, a step every ``from_pretrained`` runs
(``qkv.models.loading``), so that loading a quantized directory needs nothing from this
package. The names stay importable from here.

Shapes: M rows, K input features, N output features.

Files: ``save_quantized(model, dir)`` is ``model.save_pretrained(dir)`` for a quantized model
(config.json + model.safetensors with the int8 weights and their fp32 scales +
quantization.json); ``load_quantized(dir)`` is ``from_pretrained`` of the class config.json
names (``qkv.models.registry``), refusing a directory that is not quantized.
"""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from ..files import CONFIG_NAME, QUANT_NAME, CheckpointError, read_json
from ..models.quantized import QuantizedMLMHead, is_quantized, quantization_info, quantize
from ..models.registry import ENTRIES
from ..modules.quantized import (
    QuantizedLinear,
    int8_linear,
    quantize_rows,
    quantize_weight,
    scale127,
)

__all__ = ["QUANT_NAME", "QuantizedLinear", "QuantizedMLMHead", "int8_linear", "is_quantized",
           "load_quantized", "quantize", "quantize_rows", "quantize_weight", "save_quantized",
           "scale127"]


def save_quantized(model: nn.Module, directory: str | os.PathLike) -> Path:
    """Write a quantized model: its ``save_pretrained`` files (config.json, model.safetensors
    with the int8 weights ``*.weight_int8``, fp32 ``*.weight_scale`` and the fp32 rest) and
    ``quantization.json`` marking the directory quantized. Returns the directory."""
    if getattr(model, "quantization", None) is None:
        raise ValueError(f"save_quantized: this {type(model).__name__} is not quantized; "
                         f"call qkv.quantize(model, 'int8') first (or save_pretrained)")
    return Path(model.save_pretrained(directory))


def load_quantized(directory: str | os.PathLike, model_class: type | None = None) -> nn.Module:
    """The quantized model saved by ``save_quantized`` in ``directory`` (eval mode).

    ``model_class`` (GPT, Transformer, BERT) defaults to the one config.json's model_type
    names (a quantizable entry of ``qkv.models.registry``). Raises ``CheckpointError`` when
    ``quantization.json`` is missing or names another format, or when the weights do not
    match (names, shapes, or an int8 weight stored in another dtype)."""
    directory = Path(directory)
    if quantization_info(directory) is None:
        raise CheckpointError(f"{directory}: no {QUANT_NAME}; not a quantized model directory "
                              f"(load it with from_pretrained)")
    if model_class is None:
        model_type = read_json(directory / CONFIG_NAME).get("model_type")
        quantizable = {e.model_type: e.model_class for e in ENTRIES if e.quantizable}
        if model_type not in quantizable:
            raise CheckpointError(f"{directory}: config model_type {model_type!r} "
                                  f"is not one of {sorted(quantizable)}")
        model_class = quantizable[model_type]
    return model_class.from_pretrained(directory)
