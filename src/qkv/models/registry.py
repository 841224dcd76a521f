"""The one table of qkv's model types, and the one door that loads any directory qkv can load.

Each ``ModelEntry`` names the ``model_type`` qkv writes into config.json, the config class,
the model class, the HuggingFace ``model_type`` values it reads, and whether
``qkv.quantize`` handles it. Every other place that needs a class for a ``model_type`` asks
here (docs/ARCHITECTURE.md: The model registry).

``from_pretrained(directory)`` reads a qkv model directory (quantized or not), an HF
directory of a supported architecture, a Flamingo directory, or a ``qkv train`` run
directory (its ``checkpoint/``). Checkpoints that need code from a higher package (a
``--fsdp`` checkpoint, an adapter run) are read by the reader that package registers with
``register_directory_reader`` (``qkv.train`` registers both).

Adding a model family is one line here (plus its config, model and HF mapping files).
This module sits at the top of ``qkv.models``: it imports every model; no model imports it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..files import ADAPTER_MARK, CHECKPOINT_DIR, CONFIG_NAME, FSDP_MARK, CheckpointError, read_json
from .bert import BERT, BERTConfig
from .clip import CLIP, CLIPConfig
from .flamingo import CONFIG_NAME as FLAMINGO_CONFIG_NAME
from .flamingo import Flamingo, FlamingoConfig
from .gpt import GPT, GPTConfig
from .hf_load import load_hf, mapping_for, mappings_of
from .loading import load_qkv_directory, place
from .quantized import is_quantizable
from .transformer import Transformer, TransformerConfig
from .vit import ViT, ViTConfig

__all__ = ["ENTRIES", "ModelEntry", "directory_readers", "entry_for", "from_hf",
           "from_pretrained", "known_hf_model_types", "known_model_types", "model_class",
           "register_directory_reader"]


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """One model type.

    Attributes:
        model_type: the ``model_type`` qkv writes into config.json ("qkv-gpt").
        config_class: its config (a ``ModelConfig``; ``config_class.MODEL_TYPE == model_type``).
        model_class: the ``nn.Module`` built from that config.
        hf_model_types: the HuggingFace config.json ``model_type`` values the model class
            reads (``model_class.from_hf``, by its ``hf_mapping``); () when it reads none.
        quantizable: ``qkv.quantize`` turns its linear layers to int8 (and such a saved
            directory loads back quantized); the model class says the same
            (``quantizable = True``).
        config_name: the file of a saved directory that names the ``model_type``:
            config.json, or a model family's own (Flamingo's flamingo_config.json; such a
            class loads its directory with its own ``from_pretrained``).

    Raises:
        ValueError (on construction): an entry that disagrees with its classes (another
            ``MODEL_TYPE``, other HF types than the class's ``hf_mapping``, another
            ``quantizable``).
    """

    model_type: str
    config_class: type
    model_class: type[nn.Module]
    hf_model_types: tuple[str, ...] = ()
    quantizable: bool = False
    config_name: str = CONFIG_NAME

    def __post_init__(self) -> None:
        name = self.model_class.__name__
        if getattr(self.config_class, "MODEL_TYPE", None) != self.model_type:
            raise ValueError(f"ModelEntry {self.model_type!r}: {self.config_class.__name__}"
                             f".MODEL_TYPE is {getattr(self.config_class, 'MODEL_TYPE', None)!r}")
        reads = tuple(m.model_type for m in mappings_of(self.model_class))
        if tuple(self.hf_model_types) != reads:
            raise ValueError(f"ModelEntry {self.model_type!r}: hf_model_types "
                             f"{self.hf_model_types!r}, but {name}.hf_mapping reads {reads!r}")
        if self.quantizable != is_quantizable(self.model_class):
            raise ValueError(f"ModelEntry {self.model_type!r}: quantizable={self.quantizable}, "
                             f"but {name}.quantizable is {is_quantizable(self.model_class)}")


ENTRIES: tuple[ModelEntry, ...] = (
    ModelEntry("qkv-transformer", TransformerConfig, Transformer, ("t5", "bart", "marian"),
               quantizable=True),
    ModelEntry("qkv-gpt", GPTConfig, GPT, ("gpt2", "llama", "mistral", "qwen2", "qwen3",
                                           "gemma", "gemma2", "phi3"), quantizable=True),
    ModelEntry("qkv-bert", BERTConfig, BERT, ("bert",), quantizable=True),
    ModelEntry("qkv-vit", ViTConfig, ViT, ("vit",)),
    ModelEntry("qkv-clip", CLIPConfig, CLIP, ("clip",)),
    ModelEntry("qkv-flamingo", FlamingoConfig, Flamingo, config_name=FLAMINGO_CONFIG_NAME),
)

_BY_TYPE: dict[str, ModelEntry] = {e.model_type: e for e in ENTRIES}
_BY_TYPE.update({hf: e for e in ENTRIES for hf in e.hf_model_types})


def known_model_types() -> list[str]:
    """Every ``model_type`` qkv loads, its own ("qkv-gpt") and HuggingFace's ("gpt2")."""
    return sorted(_BY_TYPE)


def known_hf_model_types() -> list[str]:
    """The HuggingFace config.json ``model_type`` values qkv reads ("bert", "gpt2"...)."""
    return sorted(hf for e in ENTRIES for hf in e.hf_model_types)


def entry_for(model_type: Any, *, source: str = "config.json",
              architectures: Any = None) -> ModelEntry:
    """The entry owning a config.json ``model_type`` (qkv's own or an HF one).

    ``architectures``: the config.json's ``architectures`` (HF), named in the error.

    Raises:
        CheckpointError: an unknown (or missing) ``model_type``, listing the known ones.
    """
    found = _BY_TYPE.get(model_type) if isinstance(model_type, str) else None
    if found is None:
        arch = f" (architectures {architectures!r})" if architectures else ""
        raise CheckpointError(f"{source}: model_type {model_type!r}{arch} is not a model qkv "
                              f"loads; known: {', '.join(known_model_types())}")
    return found


def model_class(model_type: Any, *, source: str = "config.json") -> type[nn.Module]:
    """The model class of a config.json ``model_type`` (``entry_for(model_type).model_class``)."""
    return entry_for(model_type, source=source).model_class


# --- the door ---------------------------------------------------------------------------------
#: what a directory holding each mark file is, and what to call for it (when no reader of it
#: is registered)
_MARKS: dict[str, str] = {
    FSDP_MARK: "a sharded checkpoint of a `qkv train --fsdp` run (DCP shards, no "
               "model.safetensors)",
    ADAPTER_MARK: "an adapter run's checkpoint (an adapter and base.json, not a whole model)",
}
_CALLS: dict[str, str] = {
    FSDP_MARK: "qkv.train.load_run(RUN) reads it as it is, or `qkv export RUN --out DIR` "
               "gathers it into a plain model directory to load",
    ADAPTER_MARK: "qkv.train.load_run(RUN) gives the base with the adapter attached, or merge "
                  "it first (`qkv peft merge RUN --out DIR`) and load DIR",
}
_READERS: dict[str, Callable[..., nn.Module]] = {}


def register_directory_reader(mark_file_name: str, reader: Callable[..., nn.Module]) -> None:
    """Make ``from_pretrained`` read a directory holding the file ``mark_file_name`` with
    ``reader(directory, device=None, dtype=None) -> model`` (checked before config.json; a
    later registration of the same mark replaces the earlier one). For checkpoints whose
    reading needs a higher package: ``qkv.train`` registers "sharded.json" (``--fsdp``) and
    "adapter_config.json" (an adapter run).

    Raises:
        ValueError: a mark that is not a plain file name, or the names of a model
            directory's own files; TypeError: a reader that is not callable.
    """
    if (not isinstance(mark_file_name, str) or mark_file_name in ("", ".", "..")
            or "/" in mark_file_name or "\\" in mark_file_name
            or mark_file_name in (CONFIG_NAME, FLAMINGO_CONFIG_NAME)):
        raise ValueError(f"register_directory_reader: mark_file_name must be a plain file name "
                         f"other than {CONFIG_NAME} / {FLAMINGO_CONFIG_NAME}, got "
                         f"{mark_file_name!r}")
    if not callable(reader):
        raise TypeError(f"register_directory_reader: reader must be callable, got "
                        f"{type(reader).__name__}")
    _READERS[mark_file_name] = reader


def directory_readers() -> dict[str, Callable[..., nn.Module]]:
    """The registered readers: mark file name -> reader (a copy)."""
    return dict(_READERS)


def _marks() -> list[str]:
    """The mark files, known (``_MARKS``) and registered, in the order they are checked."""
    return [*_MARKS, *(m for m in _READERS if m not in _MARKS)]


def _config_names() -> list[str]:
    """config.json, then the model families' own config files (flamingo_config.json)."""
    return list(dict.fromkeys([CONFIG_NAME, *(e.config_name for e in ENTRIES)]))


def _checkpoint_of(directory: Path) -> Path:
    """``directory`` itself when it holds a mark or a config file, else its ``checkpoint/``
    (a ``qkv train`` run directory) when there is one."""
    if any((directory / name).is_file() for name in (*_marks(), *_config_names())):
        return directory
    if (directory / CHECKPOINT_DIR).is_dir():
        return directory / CHECKPOINT_DIR
    return directory


def from_pretrained(directory: str | os.PathLike, *, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None, allow_pickle: bool = False) -> nn.Module:
    """The model saved in ``directory``, in eval mode — whatever qkv can load:

    - a qkv model directory (config.json with ``qkv_version`` + model.safetensors, as
      ``save_pretrained`` writes it), quantized when quantization.json is beside it;
    - a HuggingFace directory of a supported architecture (config.json ``model_type``
      "gpt2", "bert", "vit", "clip"; safetensors, sharded or not; a pickle only with
      ``allow_pickle=True``, read with ``torch.load(weights_only=True)``); the model keeps
      the directory's generation settings as ``model.generation_settings``
      (``qkv.models.hf_load.load_hf``), which ``qkv.generate`` takes as its defaults;
    - a Flamingo directory (flamingo_config.json; its bases from their recorded paths);
    - a ``qkv train`` run directory (its checkpoint, ``RUN/checkpoint/``), or a checkpoint
      with a mark file some package registered a reader for (``register_directory_reader``:
      a ``--fsdp`` checkpoint, an adapter run).

    The same steps as the class methods (``GPT.from_pretrained``, ``BERT.from_hf``...):
    ``qkv.models.loading.load_qkv_directory`` and ``qkv.models.hf_load.load_hf``.

    Args:
        device, dtype: where the model's parameters live and their floating dtype (built
            there, or moved after loading where a loader cannot build there); an int8
            model refuses a dtype other than float32.

    Raises:
        CheckpointError: a directory of none of those kinds; an unknown ``model_type`` (one
            error listing the known ones); a mark without a registered reader (saying what
            the directory is and what to call); whatever the loader refuses (missing files,
            mismatched keys/shapes, an HF option qkv does not compute...).
    """
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such directory")
    path = _checkpoint_of(path)
    for mark in _marks():
        if (path / mark).is_file():
            reader = _READERS.get(mark)
            if reader is None:
                raise CheckpointError(f"{path} is {_MARKS[mark]} ({mark}), and no reader for "
                                      f"it is registered (import qkv.train registers it): "
                                      f"{_CALLS[mark]}")
            model = reader(path, device=device, dtype=dtype)
            return place(model, device=device, dtype=dtype).eval()
    if not (path / CONFIG_NAME).is_file():
        for entry in ENTRIES:  # a family with its own directory format
            if entry.config_name != CONFIG_NAME and (path / entry.config_name).is_file():
                model = entry.model_class.from_pretrained(path)
                return place(model, device=device, dtype=dtype).eval()
        raise CheckpointError(
            f"{path}: not a directory qkv loads: no {CONFIG_NAME} (a qkv or HuggingFace "
            f"model), {' / '.join(_config_names()[1:])} (a model family's "
            f"own format), {' / '.join(_MARKS)} (a `qkv train` checkpoint) nor "
            f"{CHECKPOINT_DIR}/ (a `qkv train` run directory)")
    data = read_json(path / CONFIG_NAME)
    model_type = data.get("model_type")
    entry = entry_for(model_type, source=str(path / CONFIG_NAME),
                      architectures=data.get("architectures"))
    kwargs = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
    if model_type in entry.hf_model_types:
        return load_hf(mapping_for(entry.model_class, path), entry.model_class, path,
                       allow_pickle=allow_pickle, **kwargs)
    if entry.config_name != CONFIG_NAME:
        raise CheckpointError(f"{path / CONFIG_NAME}: model_type {model_type!r} is saved as "
                              f"{entry.config_name}, not {CONFIG_NAME}")
    return load_qkv_directory(entry.model_class, path, allow_pickle=allow_pickle, **kwargs)


def from_hf(directory: str | os.PathLike, *, allow_pickle: bool = False) -> nn.Module:
    """Load a local HuggingFace checkpoint directory (config.json + model.safetensors) into
    the matching qkv model: ``model_type`` "gpt2" -> ``GPT``, "bert" -> ``BERT``, "vit"
    -> ``ViT`` (``ViTModel`` / ``ViTForImageClassification``), "clip" -> ``CLIP``
    (``CLIPModel``); the steps are ``qkv.models.hf_load.load_hf``'s (as ``from_pretrained``
    and each class's ``from_hf``).

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
    ``CLIP_FIELDS`` list: an option qkv does not compute (BERT ``is_decoder: true``,
    cross-attention, relative positions...) raises ``CheckpointError`` naming the field and
    its value; an unknown field warns. Another ``model_type`` raises ``CheckpointError``
    listing the HF architectures qkv reads.
    """
    directory = Path(directory)
    data = read_json(directory / CONFIG_NAME)
    model_type = data.get("model_type")
    if model_type not in known_hf_model_types():
        arch = data.get("architectures")
        arch = f" (architectures {arch!r})" if arch else ""
        raise CheckpointError(f"{directory}: model_type {model_type!r}{arch} is not supported; "
                              f"supported: {known_hf_model_types()}")
    cls = entry_for(model_type).model_class
    return load_hf(mapping_for(cls, directory), cls, directory, allow_pickle=allow_pickle)
