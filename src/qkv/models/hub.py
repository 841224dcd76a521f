"""Save and load models: config.json + model.safetensors (HF layout), never a pickle by
default; HuggingFace checkpoint directories dispatch to the model that reads them.

``PretrainedMixin`` gives every model ``save_pretrained`` / ``from_pretrained``; loading runs
``qkv.models.loading.load_qkv_directory`` (a qkv directory, quantized or not) or the model's
``from_hf`` (``qkv.models.hf_load.load_hf``), the same steps ``qkv.models.from_pretrained``
runs. The names that lived here before the split stay importable from this module: the
config base (``qkv.models.config``), the weights and their checks (``qkv.models.weights``)
and the file helpers (``qkv.files``).

Writes are atomic: files are written under a temporary name in the target directory and
renamed into place, so a process killed while saving leaves the previous files loadable.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, ClassVar

from safetensors.torch import save_file

from ..files import (
    CONFIG_NAME,
    QUANT_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    atomic_write,
    read_json,
)
from .config import NORM_EPS_RANGE, ModelConfig, check_norm_eps
from .loading import load_qkv_directory
from .weights import (
    CheckpointWeights,
    check_against_header,
    check_and_load,
    check_layer_counts,
    load_state_dict_file,
    non_float,
    same_values,
)

__all__ = ["NORM_EPS_RANGE", "CheckpointError", "CheckpointWeights", "ModelConfig",
           "PretrainedMixin", "atomic_write", "check_against_header", "check_and_load",
           "check_layer_counts", "check_norm_eps", "load_state_dict_file", "load_tokenizer",
           "non_float", "read_json", "same_values", "tokenizer_file_kind"]


class PretrainedMixin:
    """``save_pretrained(dir)`` / ``from_pretrained(dir)`` for models with a ``config``.

    Subclasses set ``config_class`` and may set ``tied_keys``: state-dict keys that are
    views of another parameter (a tied output embedding), not written to disk;
    ``hf_mapping``: the ``qkv.models.hf_load.HFMapping`` their ``from_hf`` reads (None: no
    HuggingFace architecture), or ``hf_mappings``: several (a ``GPT`` reads GPT-2 and the
    Llama-style families; ``hf_mapping`` is then the first); ``quantizable``:
    ``qkv.quantize`` handles them;
    ``tied_heads``: head attribute -> the module whose weight is its decoder (quantized as
    one head, ``qkv.models.quantized``).
    """

    config_class: ClassVar[type[ModelConfig]]
    tied_keys: ClassVar[tuple[str, ...]] = ()
    hf_mapping: ClassVar[Any] = None
    hf_mappings: ClassVar[tuple[Any, ...]] = ()
    quantizable: ClassVar[bool] = False
    tied_heads: ClassVar[dict[str, str]] = {}

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write config.json and model.safetensors into ``directory`` (created if needed).

        A model quantized with ``qkv.quantize`` also gets quantization.json (its
        ``model.quantization``; ``from_pretrained`` then rebuilds the int8 layers); saving an
        unquantized model removes a quantization.json left there by an earlier save."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        quant = getattr(self, "quantization", None)
        stale = directory / QUANT_NAME
        if quant is None and stale.exists():  # first: fp32 weights never sit beside it
            stale.unlink()
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()
                 if k not in self.tied_keys}
        atomic_write(directory / WEIGHTS_NAME,
                     lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
        text = json.dumps(self.config.to_dict(), indent=2, sort_keys=True)
        atomic_write(directory / CONFIG_NAME, lambda tmp: Path(tmp).write_text(text))
        if quant is not None:  # last: a save cut short leaves no marker on half the files
            quant_text = json.dumps(quant, indent=2, sort_keys=True)
            atomic_write(directory / QUANT_NAME, lambda tmp: Path(tmp).write_text(quant_text))
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, *, allow_pickle: bool = False,
                        **kwargs):
        """Load a directory written by ``save_pretrained`` — or a HuggingFace checkpoint
        directory of a supported architecture (dispatched to ``from_hf``). A directory with
        quantization.json (a model saved after ``qkv.quantize``) gives the quantized model.
        ``kwargs`` (``device``, ``dtype``) go to the constructor.

        The steps are ``qkv.models.loading.load_qkv_directory``'s (what
        ``qkv.models.from_pretrained`` runs too): the config is checked against the weights'
        headers before the model is built: its layer counts (``ModelConfig.LAYER_KEYS``),
        then every name, shape and dtype on a meta-device probe (``check_against_header``),
        so a config that does not fit its weights — however large the model it describes —
        is a ``CheckpointError`` naming the field, never a long build or an allocator error.
        The weights may be sharded (``model.safetensors.index.json``; see
        ``CheckpointWeights``). Non-float weights where the model holds floats are refused,
        not cast."""
        directory = Path(directory)
        data = read_json(directory / CONFIG_NAME)
        if "qkv_version" not in data and hasattr(cls, "from_hf"):
            return cls.from_hf(directory, allow_pickle=allow_pickle, **kwargs)
        return load_qkv_directory(cls, directory, allow_pickle=allow_pickle, **kwargs)


def tokenizer_file_kind(path: str | os.PathLike) -> str | None:
    """Who wrote the tokenizer.json at ``path``: "qkv" (qkv's own format, a JSON object with
    a "kind"), "hf" (HuggingFace ``tokenizers``: an object with a "model"), "other" (an
    object with neither), or None (no readable JSON object)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    return "qkv" if "kind" in data else "hf" if "model" in data else "other"


def load_tokenizer(directory: str | os.PathLike):
    """The ``tokenizers.Tokenizer`` saved as ``directory/tokenizer.json`` (HF layout), or None
    when the directory has none. ``tok.encode(text).ids`` is a list of ids; for a batch,
    ``tok.enable_padding()`` then ``tok.encode_batch(texts)`` (ids and ``attention_mask``)."""
    path = Path(directory) / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))
