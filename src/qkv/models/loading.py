"""Loading a qkv model directory (config.json with ``qkv_version`` + model.safetensors, as
``save_pretrained`` writes it): the one code path that ``Model.from_pretrained`` and
``qkv.models.from_pretrained`` run, step by step:

1. read config.json, check its ``model_type`` and build the config;
2. read quantization.json when there is one (a model saved after ``qkv.quantize``);
3. describe the weights from the files' headers and compare the config's layer counts;
4. probe the whole build on the meta device against the headers (nothing allocated);
5. build the model (on the requested device and dtype), run the quantization step
   (``quantized.prepare_quantized``: empty int8 layers where the file says), load the state
   (every key, shape and dtype checked), and return it in eval mode.

``place(model, device=, dtype=)`` moves a loaded model (the loaders that cannot build on a
device: a quantized model, a Flamingo, a registered directory reader).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..files import CONFIG_NAME, QUANT_NAME, CheckpointError, read_json
from .quantized import check_quantized_state, is_quantized, prepare_quantized, quantization_info
from .weights import CheckpointWeights, check_against_header, check_and_load, check_layer_counts

__all__ = ["load_qkv_directory", "place"]


def place(model: nn.Module, *, device: torch.device | str | None = None,
          dtype: torch.dtype | None = None) -> nn.Module:
    """``model`` moved to ``device`` and its floating tensors cast to ``dtype`` (each when
    given; ties between parameters are kept).

    Raises:
        CheckpointError: a ``dtype`` other than float32 for an int8 model (its scales,
            biases and activations are fp32 by construction).
    """
    if dtype is not None and dtype != torch.float32 and is_quantized(model):
        raise CheckpointError(f"dtype={dtype}: this {type(model).__name__} is quantized to "
                              f"int8 (quantization.json); its scales and activations are "
                              f"float32, so it cannot be cast; load it without dtype (or load "
                              f"the float model it was quantized from)")
    if device is None and dtype is None:
        return model
    return model.to(device=device, dtype=dtype)


def load_qkv_directory(model_class: type, directory: str | os.PathLike, *,
                       allow_pickle: bool = False, **kwargs: Any) -> nn.Module:
    """A ``model_class`` (a ``PretrainedMixin`` model) from a directory its
    ``save_pretrained`` wrote; see the module docstring for the steps.

    Args:
        model_class: the class config.json's ``model_type`` must name
            (``model_class.config_class.MODEL_TYPE``).
        directory: config.json + model.safetensors (or the shards of
            model.safetensors.index.json; pytorch_model.bin only with ``allow_pickle``),
            and quantization.json for a quantized model.
        kwargs: go to ``model_class(config, **kwargs)`` (``device``, ``dtype``). A quantized
            model is built on the CPU in fp32 and moved to ``device`` after loading; a
            ``dtype`` other than float32 is refused for it.

    Raises:
        CheckpointError: config.json of another ``model_type`` or with invalid fields; a
            layer count, name, shape or dtype that does not fit the weights; a quantized
            directory whose class cannot be quantized or whose int8 layers differ.
    """
    directory = Path(directory)
    data = read_json(directory / CONFIG_NAME)
    expected = model_class.config_class.MODEL_TYPE
    if data.get("model_type") != expected:
        raise CheckpointError(f"{directory}: config model_type {data.get('model_type')!r}, "
                              f"expected {expected!r}")
    try:
        config = model_class.config_class.from_dict(data)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{directory / CONFIG_NAME}: {err}") from err
    info = quantization_info(directory)
    weights = CheckpointWeights(directory, allow_pickle=allow_pickle)
    check_layer_counts(weights, config.layer_counts(), str(directory / CONFIG_NAME))
    device = None
    if info is not None:  # int8 layers are made on the CPU in fp32: build there, move after
        device, dtype = kwargs.pop("device", None), kwargs.pop("dtype", None)
        if dtype is not None and dtype != torch.float32:
            raise CheckpointError(f"{directory / QUANT_NAME}: the model is quantized to int8; "
                                  f"its scales and activations are float32, so dtype={dtype} "
                                  f"is refused (load it without dtype, or load the float "
                                  f"model it was quantized from)")

    def build(state: dict[str, Tensor], **kw: Any) -> nn.Module:
        model = model_class(config, **kw)
        if info is not None:
            prepare_quantized(model, info, directory)
        own = model.state_dict()
        for key in model.tied_keys:  # the instance's: ties may depend on the config
            if key in own:
                state.setdefault(key, own[key])
        if info is not None:
            check_quantized_state(model, state, directory)
        check_and_load(model, state, str(directory))
        return model

    check_against_header(build, weights, data, **kwargs)  # before any allocation
    model = build(weights.load(), **kwargs).eval()  # as from_hf: loaded models start in eval
    return place(model, device=device)
