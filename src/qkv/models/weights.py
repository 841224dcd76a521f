"""The weights of a checkpoint directory and the checks run before and while loading them.

``CheckpointWeights`` describes a directory's tensors from the files' headers (one
model.safetensors, the shards of a sharded HF checkpoint, or — only when allowed — a pickle)
and loads them on demand; ``check_layer_counts`` and ``check_against_header`` compare a config
with those headers before anything is built (a meta-device probe of the real build);
``check_and_load`` loads a state only when every key, shape and dtype fits. Every loader of
``qkv.models`` (``loading``, ``hf_load``) runs these.

Shapes: the tensors' own; nothing is reshaped here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..files import (
    CONFIG_NAME,
    FSDP_MARK,
    INDEX_NAME,
    PICKLE_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    is_regular_file,
    read_json,
    refuse_adapter_directory,
)

__all__ = ["CheckpointWeights", "check_against_header", "check_and_load", "check_layer_counts",
           "check_tied_head", "load_state_dict_file", "non_float", "same_values"]


#: safetensors dtype names -> torch dtypes (those torch has)
_ST_DTYPES = {name: getattr(torch, attr) for name, attr in (
    ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"),
    ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("I64", "int64"),
    ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U64", "uint64"), ("U32", "uint32"),
    ("U16", "uint16"), ("U8", "uint8"), ("BOOL", "bool")) if hasattr(torch, attr)}


def _read_header(path: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor of a safetensors file, from its header (the
    library checks the header against the file's size); no tensor data is read."""
    if not is_regular_file(path):
        raise CheckpointError(f"{path}: not a regular file")
    try:
        found = {}
        with safe_open(str(path), framework="pt") as f:
            names = f.keys()
            for name in names:
                part = f.get_slice(name)
                found[name] = (part.get_dtype(), tuple(part.get_shape()))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"{path}: not a valid safetensors file ({err})") from err
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for name, (dtype, shape) in found.items():
        if dtype not in _ST_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {dtype}, which this "
                                  f"torch cannot hold")
        out[name] = (_ST_DTYPES[dtype], shape)
    return out


def _shard_files(index: Path) -> dict[str, list[str]]:
    """shard file name -> the tensor names the index's weight_map puts in it (checked: plain
    file names of the index's directory, ending in .safetensors)."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: no weight_map (a JSON object tensor name -> shard "
                              f"file)")
    shards: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        if (not isinstance(file, str) or file in ("", ".", "..") or "/" in file or "\\" in file
                or "\0" in file or not file.endswith(".safetensors")):
            raise CheckpointError(f"{index}: weight_map puts {name!r} in {file!r}; a shard must "
                                  f"be a .safetensors file name in the same directory (no '/', "
                                  f"no '..')")
        shards.setdefault(file, []).append(name)
    return shards


class CheckpointWeights:
    """The weights of a checkpoint directory, described from the files' headers before
    anything is read, then loaded on demand.

    The directory holds one of (first found wins): ``model.safetensors``; a sharded HF
    checkpoint, ``model.safetensors.index.json`` whose ``weight_map`` names each tensor's
    shard (``model-00001-of-0000N.safetensors``: plain file names of the directory; every
    shard must be a regular file holding exactly the tensors the index gives it); or, only
    with ``allow_pickle=True``, ``pytorch_model.bin``, read with
    ``torch.load(weights_only=True)`` (a pickle has no header: it is read here, whole).

    Attributes:
        directory: the checkpoint directory. source: the file (or index) named in messages.
        tensors: tensor name -> (dtype, shape), from the headers.

    Raises:
        CheckpointError: none of those files; a pickle without ``allow_pickle``; a qkv
            ``--fsdp`` checkpoint (DCP shards: ``qkv export`` it first) or an adapter run's
            checkpoint; an invalid header, index or shard.
    """

    def __init__(self, directory: str | os.PathLike, *, allow_pickle: bool = False) -> None:
        self.directory = directory = Path(directory)
        self._shards: dict[Path, list[str]] = {}
        self._state: dict[str, Tensor] | None = None
        self.tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        single, index, pickle = (directory / WEIGHTS_NAME, directory / INDEX_NAME,
                                 directory / PICKLE_NAME)
        if single.exists() or single.is_symlink():
            self.source = single
            self.tensors = _read_header(single)
            self._shards = {single: list(self.tensors)}
        elif index.exists():
            self.source = index
            self._read_index(index)
        elif pickle.exists():
            self.source = pickle
            self._state = _load_pickle(directory, allow_pickle)
            self.tensors = {k: (v.dtype, tuple(v.shape)) for k, v in self._state.items()}
        else:
            if (directory / FSDP_MARK).is_file():
                raise CheckpointError(
                    f"{directory} is a sharded checkpoint of a `qkv train --fsdp` run (DCP "
                    f"shards, no {WEIGHTS_NAME}): `qkv export RUN --out DIR` gathers it into a "
                    f"plain model directory; load DIR (qkv.train.load_run reads the run as "
                    f"it is)")
            refuse_adapter_directory(directory)
            raise CheckpointError(f"{directory}: no {WEIGHTS_NAME}, {INDEX_NAME} (or "
                                  f"{PICKLE_NAME}) found")

    def _read_index(self, index: Path) -> None:
        for file, names in _shard_files(index).items():
            path = self.directory / file
            if not is_regular_file(path):
                raise CheckpointError(f"{index}: shard {file} is missing (or not a regular "
                                      f"file)")
            header = _read_header(path)
            absent = sorted(set(names) - set(header))
            unlisted = sorted(set(header) - set(names))
            if absent or unlisted:
                raise CheckpointError(
                    f"{index}: shard {file} does not hold what the index says: "
                    + "; ".join(part for part in (
                        absent and f"missing {_few(absent)}",
                        unlisted and f"holds tensors the index puts elsewhere or does not "
                                     f"list {_few(unlisted)}") if part))
            self._shards[path] = names
            self.tensors.update({name: header[name] for name in names})

    def meta(self) -> dict[str, Tensor]:
        """Meta tensors (no storage) of the files' names, dtypes and shapes."""
        return {k: torch.empty(shape, dtype=dtype, device="meta")
                for k, (dtype, shape) in self.tensors.items()}

    def load(self) -> dict[str, Tensor]:
        """The tensors, read from the files (CPU)."""
        if self._state is not None:
            return dict(self._state)
        state: dict[str, Tensor] = {}
        for path, names in self._shards.items():
            try:
                part = load_file(path)
            except (SafetensorError, OSError, ValueError) as err:
                raise CheckpointError(f"{path}: not a valid safetensors file ({err})") from err
            if sorted(part) != sorted(names):  # changed since the header was read
                raise CheckpointError(f"{path}: its tensors changed while loading")
            state.update(part)
        return state


def _few(names: list[str], n: int = 10) -> str:
    return f"{names[:n]}{' ...' if len(names) > n else ''}"


def _load_pickle(directory: Path, allow_pickle: bool) -> dict[str, Tensor]:
    pickle = directory / PICKLE_NAME
    if not allow_pickle:
        raise CheckpointError(
            f"{directory} holds only {PICKLE_NAME}, a pickle that can run code when "
            f"loaded; convert it to {WEIGHTS_NAME}, or pass allow_pickle=True to load it "
            f"with torch.load(weights_only=True)")
    if not is_regular_file(pickle):
        raise CheckpointError(f"{pickle}: not a regular file")
    try:
        state = torch.load(pickle, map_location="cpu", weights_only=True)
    except Exception as err:  # weights_only refuses anything but tensors and containers
        raise CheckpointError(f"{pickle}: refused by torch.load(weights_only=True): "
                              f"{err}") from err
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(f"{pickle}: expected a state dict of tensors, got "
                              f"{type(state).__name__}")
    return state


def load_state_dict_file(directory: Path, *, allow_pickle: bool = False) -> dict[str, Tensor]:
    """Tensors of ``model.safetensors`` in ``directory`` — or of the shards of a sharded HF
    checkpoint (``model.safetensors.index.json``); see ``CheckpointWeights``.

    Only when there is neither and ``allow_pickle=True`` is a ``pytorch_model.bin`` read, and
    then with ``torch.load(weights_only=True)``.
    """
    return CheckpointWeights(directory, allow_pickle=allow_pickle).load()


def check_layer_counts(weights: CheckpointWeights, layers: Iterable[tuple[str, Any, str]],
                       source: str) -> None:
    """Compare each config field counting the layers of a stack with the layers the weights
    hold — before a model is built, so a config claiming 100000 layers beside 2-layer weights
    costs nothing.

    Args:
        weights: the checkpoint's ``CheckpointWeights`` (names from the headers).
        layers: (field as config.json names it, its value, a regex whose group 1 is the
            layer index of that stack's tensor names), e.g. ``("n_layer", 12,
            r"(?:transformer\\.)?h\\.(\\d+)\\.")``.
        source: the config's name in messages.

    Raises:
        CheckpointError naming the field, its value and the layers the file holds.
    """
    for field, value, pattern in layers:
        rx = re.compile(pattern)
        found = {int(m.group(1)) for name in weights.tensors if (m := rx.match(name))}
        held = max(found) + 1 if found else 0
        if value != held:
            names = re.sub(r"\(\?:([^)]*)\)\?", r"[\1]", pattern)  # (?:bert\.)? -> [bert.]
            names = names.replace(r"(\d+)", "N").replace("\\", "")
            raise CheckpointError(
                f"{source}: {field}={value!r}, but {weights.source} holds {held} such "
                f"layers ({names}*); set {field} to {held}, or use the weights saved with "
                f"this config")


def _flat_fields(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The int fields of a config.json dict that can be sizes (token ids are not), nested
    ones dotted: {"text_config.hidden_size": 512, ...}."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flat_fields(value, f"{prefix}{key}."))
        elif (isinstance(value, int) and not isinstance(value, bool)
              and not str(key).endswith("_id")):
            out[f"{prefix}{key}"] = value
    return out


def _size_fields(pairs: Iterable[tuple[tuple[int, ...], tuple[int, ...]]],
                 fields: dict[str, Any]) -> list[str]:
    """The int fields of a config equal to a size the model has and the file has not."""
    sizes = {m for file, model in pairs if len(file) == len(model)
             for f, m in zip(file, model, strict=True) if f != m}
    flat = _flat_fields(fields)
    return sorted(f"{k}={v}" for k, v in flat.items() if v in sizes)


#: in-place initialisers a meta tensor skips in ``_MetaProbe`` (shapes stay; on meta some
#: of them, normal_ first, would import torch's decompositions: seconds, once per process)
_META_NOOPS = frozenset({
    "normal_", "uniform_", "fill_", "zero_", "copy_", "constant_", "ones_", "zeros_", "eye_",
    "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
    "trunc_normal_", "orthogonal_", "erfinv_", "exponential_", "bernoulli_", "random_"})
#: torch factories whose tensors ``_MetaProbe`` puts on the meta device (parameter storage);
#: data a constructor computes with (arange, tensor...) stays where it was made
_META_FACTORIES = frozenset({"empty", "zeros", "ones", "full", "empty_strided", "randn",
                             "rand", "randint", "randperm", "normal"})


class _MetaProbe(TorchFunctionMode):
    """Build a model without storage: torch's factories with no device give meta tensors,
    and initialisers on meta tensors are skipped (random fills of meta tensors draw
    nothing)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if name in _META_NOOPS:
            target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(target, Tensor) and target.is_meta:
                return target
        if (name in _META_FACTORIES and func is getattr(torch, name, None)
                and kwargs.get("device") is None):
            if name in ("randn", "rand"):  # the values are never read
                return torch.empty(*args, dtype=kwargs.get("dtype"), device="meta")
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


def check_against_header(build: Callable[..., Any], weights: CheckpointWeights,
                         fields: dict[str, Any], **kwargs: Any) -> None:
    """Run a loader's ``build(state, **kwargs)`` (build the model, convert ``state``, check
    and load it: the same function the real load then runs) on the meta device, with meta
    tensors of the weights' names, dtypes and shapes: every missing, unexpected, mis-shaped
    or non-float tensor is reported before any memory is allocated, however large the sizes
    the config asks for. torch's RNG is left as it was (a meta build draws nothing).

    ``fields``: the config.json dict; a shape mismatch names its int fields equal to a size
    the model has and the file lacks (``vocab_size=1000000``). ``kwargs`` go to ``build``
    (a ``device`` is dropped: the probe lives on the meta device).

    Raises:
        CheckpointError: what ``build`` raises on the probe, with the fields named.
    """
    kwargs = {k: v for k, v in kwargs.items() if k != "device"}
    try:
        with torch.random.fork_rng(devices=[]), _MetaProbe():
            build(weights.meta(), **kwargs)
    except CheckpointError as err:
        suspects = _size_fields(err.shape_pairs, fields)
        if not suspects:
            raise
        raise CheckpointError(f"{weights.directory / CONFIG_NAME}: {', '.join(suspects)} "
                              f"{'does' if len(suspects) == 1 else 'do'} not fit the weights "
                              f"({err})") from None
    except NotImplementedError:  # an op without a meta kernel: the real load still checks
        return
    except (RuntimeError, OverflowError) as err:  # sizes past what a tensor can have
        if isinstance(err, RuntimeError) and "overflow" not in str(err).lower():
            return  # not a size: the real load raises what it raises
        largest = max((d for _, shape in weights.tensors.values() for d in shape), default=0)
        big = sorted(f"{k}={v}" for k, v in _flat_fields(fields).items() if v > largest)
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise CheckpointError(
            f"{weights.directory / CONFIG_NAME}: describes tensors no machine can hold ({first}); "
            f"config fields larger than any size in {weights.source.name}: "
            f"{', '.join(big) or 'none'}") from None


def check_tied_head(state: dict[str, Tensor], head: Tensor, embed_key: str, prefix: str,
                    where: str) -> None:
    """With ``tie_word_embeddings``, a stored head (V, C) must equal the embedding it is tied
    to (``state[prefix + embed_key]`` or ``state[embed_key]``; transformers 5 would keep a
    differing one apart, and qkv would silently use the embedding).

    Raises:
        CheckpointError naming ``where`` and the embedding, and what to set instead."""
    embed = state.get(prefix + embed_key, state.get(embed_key))
    if embed is not None and not same_values(embed, head):
        raise CheckpointError(f"{where}: lm_head.weight differs from {embed_key} but config "
                              f"tie_word_embeddings=True; set tie_word_embeddings to false "
                              f"in config.json to load the separate head")


def same_values(a: Tensor, b: Tensor) -> bool:
    """``torch.equal`` of two tensors of the same shape; meta tensors (the header check of
    ``check_against_header``) compare by shape only: their values are checked on the real
    load."""
    if a.shape != b.shape:
        return False
    if a.is_meta or b.is_meta:
        return True
    return torch.equal(a, b)


def non_float(own: dict[str, Tensor], state: dict[str, Tensor]) -> list[str]:
    """"name: dtype" of each tensor of ``state`` that is not a float where ``own`` (a model's
    state dict) holds a float: loading would cast it silently."""
    return [f"{k}: {state[k].dtype}" for k in sorted(set(own) & set(state))
            if own[k].is_floating_point() and not state[k].is_floating_point()]


def check_and_load(model: nn.Module, state: dict[str, Tensor], source: str) -> None:
    """Load ``state`` into ``model`` only if keys and shapes match exactly and no float
    tensor of the model would get an int or bool one (cast silently otherwise); else raise a
    CheckpointError listing what is missing, unexpected, mis-shaped or of a non-float dtype
    (nothing is loaded). A model on the meta device (``check_against_header``) is only
    checked."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    pairs = [(k, tuple(state[k].shape), tuple(own[k].shape))
             for k in sorted(set(own) & set(state)) if state[k].shape != own[k].shape]
    shapes = [f"{k}: checkpoint {file} vs model {ours}" for k, file, ours in pairs]
    dtypes = non_float(own, state)
    if missing or unexpected or shapes or dtypes:
        parts = []
        if missing:
            parts.append(f"missing keys {missing[:10]}{' ...' if len(missing) > 10 else ''}")
        if unexpected:
            parts.append(f"unexpected keys {unexpected[:10]}"
                         f"{' ...' if len(unexpected) > 10 else ''}")
        if shapes:
            parts.append("shape mismatches " + "; ".join(shapes[:10]))
        if dtypes:
            parts.append("weights stored as non-float dtypes where the model holds floats "
                         "(refused, not cast) " + "; ".join(dtypes[:10]))
        err = CheckpointError(f"{source} does not match the model: " + "; ".join(parts))
        err.shape_pairs = tuple((file, ours) for _, file, ours in pairs)
        raise err
    if any(t.is_meta for t in own.values()):
        return
    model.load_state_dict(state, strict=True)
