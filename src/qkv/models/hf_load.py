"""The one HuggingFace loader: an architecture is an ``HFMapping`` (its config mapping with
the field audit, its key map, and the few state conversions it needs), and ``load_hf`` runs
the same steps for every one of them:

1. read config.json, check its ``model_type``, audit and map its fields
   (``mapping.config_fields``: ``audit_hf_config`` refuses what qkv does not compute);
2. describe the weights from the files' headers and compare the layer counts;
3. probe the whole build on the meta device against the headers (nothing allocated);
4. build: normalise the HF state (prefixes, old names, transposes), complete the config
   from it (heads the checkpoint holds), build ``model_class(config)`` on the requested
   device and dtype, map the state to qkv's keys by the key map (``hf_state``) and load it
   with every key, shape and dtype checked; the model in eval mode.

The config class is ``model_class.config_class``, passed in: a mapping file (``hf_gpt2``,
``hf_bert``, ``hf_vit``, ``hf_clip``) never imports its model, so adding an architecture is
one mapping file plus one registry line (docs/ARCHITECTURE.md: The model registry).

Shapes: those of each architecture's tensors (see its mapping file).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from ..files import CONFIG_NAME, CheckpointError, read_json
from .generation_settings import settings_of_directory
from .hf_state import KeyMap, map_hf_state
from .weights import CheckpointWeights, check_against_header, check_and_load, check_layer_counts

__all__ = ["HFMapping", "load_hf", "make_config", "mapping_for", "mappings_of"]

#: (field as config.json names it, its value, a regex whose group 1 is a layer index)
LayerCount = tuple[str, Any, str]


def _keep(state: dict[str, Tensor], hf: dict[str, Any], source: str) -> dict[str, Tensor]:
    return state


def _whole(hf: dict[str, Any], source: str) -> dict[str, Any]:
    return hf


@dataclasses.dataclass(frozen=True)
class HFMapping:
    """How one HuggingFace architecture maps onto a qkv model.

    Attributes:
        model_type: the HF config.json ``model_type`` it reads ("gpt2").
        name: the architecture in messages ("GPT-2").
        config_fields: ``(hf config dict, source) -> config fields`` (a dict of the qkv
            config's fields): refuses (``CheckpointError``) a config the mapping cannot read,
            after ``audit_hf_config``; a field left out takes transformers' default.
        layer_counts: ``(hf config dict, fields, source) -> [(field, value, regex)]`` for
            ``check_layer_counts`` (the regex's group 1 is the layer index of HF's names).
        key_map: ``config -> KeyMap`` (each qkv state-dict key -> its HF key, or the tuple of
            HF keys fused along dim 0).
        normalise: ``(HF state, hf config dict, source) -> HF state`` before the key map
            (prefixes stripped, old names renamed, transposes, tied copies checked and
            dropped); default: as it is.
        state_fields: ``normalised HF state -> config fields`` read from the checkpoint
            (the heads it holds); default none, and then the config is built before any
            weights are read.
        map_state: ``(own state dict, key map, HF state, source, name) -> qkv state``:
            ``hf_state.map_hf_state`` (errors in HF's names; the default) or
            ``hf_state.rename_hf_state`` (errors in qkv's, from ``check_and_load``).
        size_fields: ``(hf config dict, source) -> dict`` whose int fields a shape mismatch
            may blame (nested configs merged in); default the config.json dict.
    """

    model_type: str
    name: str
    config_fields: Callable[[dict[str, Any], str], dict[str, Any]]
    layer_counts: Callable[[dict[str, Any], dict[str, Any], str], list[LayerCount]]
    key_map: Callable[[Any], KeyMap]
    normalise: Callable[[dict[str, Tensor], dict[str, Any], str], dict[str, Tensor]] = _keep
    state_fields: Callable[[dict[str, Tensor]], dict[str, Any]] | None = None
    map_state: Callable[..., dict[str, Tensor]] = map_hf_state
    size_fields: Callable[[dict[str, Any], str], dict[str, Any]] = _whole


def mappings_of(model_class: type) -> tuple[HFMapping, ...]:
    """The HF mappings a model class reads: its ``hf_mappings``, else its ``hf_mapping``
    (or none)."""
    many = tuple(getattr(model_class, "hf_mappings", ()) or ())
    if many:
        return many
    one = getattr(model_class, "hf_mapping", None)
    return () if one is None else (one,)


def mapping_for(model_class: type, directory: str | os.PathLike) -> HFMapping:
    """The mapping of ``model_class`` that reads the HF directory's config.json
    ``model_type``.

    Raises:
        CheckpointError: a ``model_type`` none of its mappings reads, listing those it
            reads."""
    directory = Path(directory)
    model_type = read_json(directory / CONFIG_NAME).get("model_type")
    readers = mappings_of(model_class)
    for mapping in readers:
        if mapping.model_type == model_type:
            return mapping
    raise CheckpointError(f"{directory}: config.json model_type {model_type!r}; "
                          f"{model_class.__name__}.from_hf reads "
                          f"{', '.join(repr(m.model_type) for m in readers)} checkpoints")


def make_config(config_class: type, fields: dict[str, Any], source: str, name: str) -> Any:
    """``config_class(**fields)``, its ValueError/TypeError a ``CheckpointError`` naming the
    directory and the architecture."""
    try:
        return config_class(**fields)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{source}: config.json is not a valid {name} config: "
                              f"{err}") from err


def load_hf(mapping: HFMapping, model_class: type, directory: str | os.PathLike, *,
            allow_pickle: bool = False, **kwargs: Any) -> nn.Module:
    """A ``model_class`` with the weights of a local HuggingFace directory of ``mapping``'s
    architecture (config.json + model.safetensors, or its shards with
    model.safetensors.index.json; pytorch_model.bin only with ``allow_pickle=True``, read
    with ``torch.load(weights_only=True)``); the steps are in the module docstring.
    ``kwargs`` (``device``, ``dtype``) go to ``model_class(config, **kwargs)``. Returned in
    eval mode, like transformers, with the directory's generation settings as
    ``model.generation_settings`` (``generation_settings.settings_of_directory``: the
    defaults ``qkv.generate`` decodes with).

    Raises:
        CheckpointError: another ``model_type``; a config option qkv does not compute (named
            with its value); a layer count, key, shape or dtype that does not fit (nothing is
            loaded half-way); a pickle without ``allow_pickle``.
    """
    directory = Path(directory)
    source = str(directory)
    hf = read_json(directory / CONFIG_NAME)
    if hf.get("model_type") != mapping.model_type:
        raise CheckpointError(f"{source}: config.json model_type {hf.get('model_type')!r}; "
                              f"{model_class.__name__}.from_hf reads {mapping.model_type!r} "
                              f"checkpoints")
    fields = mapping.config_fields(hf, source)  # refuses unsupported options before reading
    config_class = model_class.config_class
    early = (make_config(config_class, fields, source, mapping.name)
             if mapping.state_fields is None else None)
    weights = CheckpointWeights(directory, allow_pickle=allow_pickle)
    check_layer_counts(weights, mapping.layer_counts(hf, fields, source),
                       f"{directory / CONFIG_NAME}")

    def build(state: dict[str, Tensor], **kw: Any) -> nn.Module:
        state = mapping.normalise(state, hf, source)
        config = early
        if config is None:
            config = make_config(config_class, {**fields, **mapping.state_fields(state)},
                                 source, mapping.name)
        model = model_class(config, **kw)
        mapped = mapping.map_state(model.state_dict(), mapping.key_map(config), state, source,
                                   mapping.name)
        check_and_load(model, mapped, f"HuggingFace {mapping.name} checkpoint {source} (keys "
                                      f"as mapped to qkv's)")
        return model

    check_against_header(build, weights, mapping.size_fields(hf, source), **kwargs)
    model = build(weights.load(), **kwargs).eval()
    model.generation_settings = settings_of_directory(directory)  # qkv.generate's defaults
    return model
