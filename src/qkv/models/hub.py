"""Save and load models: config.json + model.safetensors (HF layout), never a pickle by
default; HuggingFace checkpoint directories dispatch to the model that reads them.

Writes are atomic: files are written under a temporary name in the target directory and
renamed into place, so a process killed while saving leaves the previous files loadable.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

__all__ = ["CheckpointError", "ModelConfig", "PretrainedMixin", "atomic_write",
           "load_state_dict_file", "load_tokenizer", "read_json"]

C = TypeVar("C", bound="ModelConfig")
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
PICKLE_NAME = "pytorch_model.bin"
QUANT_NAME = "quantization.json"  # beside config.json for a model quantized with qkv.quantize


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded: missing files, mismatched keys/shapes, bad format."""


def _process_umask() -> int:
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


#: read once at import (changing the umask is process-wide; doing it per call would race)
_FILE_MODE = 0o666 & ~_process_umask()


def atomic_write(path: Path, write) -> None:
    """Call ``write(tmp_path)`` then rename the temporary file onto ``path``: a reader (or a
    process killed mid-write) sees the old file or the new one, never half of one. The file
    gets the permissions a plain ``open(path, "w")`` would (0666 less the umask), not the
    temporary file's private 0600. The file is fsynced before the rename and its directory
    after it, so a power cut leaves the old file or the complete new one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, _FILE_MODE)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # the data on disk before the name points at it
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:  # the rename itself on disk; some platforms cannot sync a directory
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_json(path: Path) -> dict:
    """Read a JSON object, with a clear error naming the file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {path}: {err}") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Base of frozen model configs: named presets, JSON round trip."""

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}
    MODEL_TYPE: ClassVar[str] = ""

    @classmethod
    def from_name(cls: type[C], name: str, **overrides: Any) -> C:
        """A named preset (``cls.PRESETS``), optionally with fields overridden."""
        if name not in cls.PRESETS:
            raise ValueError(f"{cls.__name__}: unknown preset {name!r}; "
                             f"known: {sorted(cls.PRESETS)}")
        return cls.from_dict({**cls.PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls: type[C], data: dict[str, Any]) -> C:
        """Build from a dict; unknown keys are an error (a typo never passes silently)."""
        data = {k: v for k, v in data.items() if k not in ("model_type", "qkv_version")}
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown config fields {unknown}; "
                             f"known: {sorted(names)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict with ``model_type`` (what config.json holds)."""
        from .. import __version__

        return {"model_type": self.MODEL_TYPE, "qkv_version": __version__,
                **dataclasses.asdict(self)}


def load_state_dict_file(directory: Path, *, allow_pickle: bool = False) -> dict[str, Tensor]:
    """Tensors of ``model.safetensors`` in ``directory``.

    Only when there is no safetensors file and ``allow_pickle=True`` is a
    ``pytorch_model.bin`` read, and then with ``torch.load(weights_only=True)``.
    """
    directory = Path(directory)
    st = directory / WEIGHTS_NAME
    if st.exists():
        try:
            return load_file(st)
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(f"{st}: not a valid safetensors file ({err})") from err
    pickle = directory / PICKLE_NAME
    if pickle.exists():
        if not allow_pickle:
            raise CheckpointError(
                f"{directory} holds only {PICKLE_NAME}, a pickle that can run code when "
                f"loaded; convert it to {WEIGHTS_NAME}, or pass allow_pickle=True to load it "
                f"with torch.load(weights_only=True)")
        try:
            state = torch.load(pickle, map_location="cpu", weights_only=True)
        except Exception as err:  # weights_only refuses anything but tensors and containers
            raise CheckpointError(f"{pickle}: refused by torch.load(weights_only=True): "
                                  f"{err}") from err
        if not isinstance(state, dict):
            raise CheckpointError(f"{pickle}: expected a state dict, got {type(state).__name__}")
        return state
    raise CheckpointError(f"{directory}: no {WEIGHTS_NAME} (or {PICKLE_NAME}) found")


def check_and_load(model: nn.Module, state: dict[str, Tensor], source: str) -> None:
    """Load ``state`` into ``model`` only if keys and shapes match exactly; else raise a
    CheckpointError listing what is missing, unexpected or mis-shaped (nothing is loaded)."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
              for k in sorted(set(own) & set(state)) if state[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing keys {missing[:10]}{' ...' if len(missing) > 10 else ''}")
        if unexpected:
            parts.append(f"unexpected keys {unexpected[:10]}"
                         f"{' ...' if len(unexpected) > 10 else ''}")
        if shapes:
            parts.append("shape mismatches " + "; ".join(shapes[:10]))
        raise CheckpointError(f"{source} does not match the model: " + "; ".join(parts))
    model.load_state_dict(state, strict=True)


class PretrainedMixin:
    """``save_pretrained(dir)`` / ``from_pretrained(dir)`` for models with a ``config``.

    Subclasses set ``config_class`` and may set ``tied_keys``: state-dict keys that are
    views of another parameter (a tied output embedding), not written to disk.
    """

    config_class: ClassVar[type[ModelConfig]]
    tied_keys: ClassVar[tuple[str, ...]] = ()

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
        quantization.json (a model saved after ``qkv.quantize``) gives the quantized model."""
        directory = Path(directory)
        data = read_json(directory / CONFIG_NAME)
        if "qkv_version" not in data and hasattr(cls, "from_hf"):
            return cls.from_hf(directory, allow_pickle=allow_pickle, **kwargs)
        if data.get("model_type") != cls.config_class.MODEL_TYPE:
            raise CheckpointError(f"{directory}: config model_type {data.get('model_type')!r}, "
                                  f"expected {cls.config_class.MODEL_TYPE!r}")
        config = cls.config_class.from_dict(data)
        from .quantized import load_quantized_directory, quantization_info  # models/ imports hub

        info = quantization_info(directory)
        if info is not None:
            return load_quantized_directory(cls, directory, config, info, **kwargs)
        model = cls(config, **kwargs)
        state = load_state_dict_file(directory, allow_pickle=allow_pickle)
        for key in model.tied_keys:  # the instance's: ties may depend on the config
            state.setdefault(key, model.state_dict()[key])
        check_and_load(model, state, str(directory))
        return model.eval()  # as from_hf and transformers: loaded models start in eval mode


def load_tokenizer(directory: str | os.PathLike):
    """The ``tokenizers.Tokenizer`` saved as ``directory/tokenizer.json`` (HF layout), or None
    when the directory has none. ``tok.encode(text).ids`` is a list of ids; for a batch,
    ``tok.enable_padding()`` then ``tok.encode_batch(texts)`` (ids and ``attention_mask``)."""
    path = Path(directory) / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))
