"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): every rank writes its own
shard of the model and optimizer state; a checkpoint written by N processes loads on M (2 -> 1,
1 -> 2, ...: DCP reads each rank's slice of every tensor), and ``export_sharded`` turns one
into the plain config.json + model.safetensors directory on a single process.

Shapes: none beyond the model's own; tensors are stored by their state-dict names (FQNs).

A sharded checkpoint directory (``RUN/checkpoint``, swapped in atomically as in
``qkv.train.checkpoint``: written into ``RUN/checkpoint.tmp``, renamed, previous one removed)::

    config.json                the model config (what export and resume build the model from)
    sharded/                   DCP: .metadata and one __R_0.distcp file per writing rank R,
                               keys "model.<fqn>" and "optimizer.state.<fqn>.<moment>"
    sharded.json               {"format": "qkv-dcp-1", "world_size": N}
    trainer_state.json         step, data position, the optimizer's param_groups (JSON)
    trainer_state.safetensors  rank 0's torch RNG state (and its CUDA one on CUDA)
    tokenizer.json, run.json   as in a plain checkpoint (when given)

The directory must be on a file system every rank sees (multi-node: a shared one). Each phase
(preparing, DCP's write, the small files, the renames) ends with every rank agreeing: an error
on one rank becomes a ``CheckpointError`` naming that rank on every rank, so no rank waits on
a collective that the failed one never reaches; a rank that dies or hangs makes the others
fail at the process group's timeout (``init_process_group(timeout=...)``).

DCP's own files are not safetensors: its .metadata file is a pickle (tensors are raw bytes).
It is read here with an unpickler that admits only DCP's metadata classes and torch's
size/dtype objects (``safe_reader``), so a crafted file cannot run code.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from ..files import FSDP_MARK, CheckpointError, atomic_write, fsync_path, read_json
from ..models import registry
from .hf_seq2seq import save_run_tokenizer
from .rundir import CHECKPOINT_DIR, OLD_DIR, TMP_DIR, find_checkpoint

__all__ = ["SHARDED_DIR", "build_checkpoint_model", "export_sharded", "is_sharded_checkpoint",
           "load_sharded_checkpoint", "load_sharded_model", "read_sharded_checkpoint",
           "safe_reader", "save_sharded_checkpoint"]

SHARDED_DIR, SHARDED_JSON = "sharded", FSDP_MARK
STATE_JSON, STATE_TENSORS = "trainer_state.json", "trainer_state.safetensors"
FORMAT = "qkv-dcp-1"
#: files of a sharded checkpoint that are not part of an exported model directory
_OWN_FILES = frozenset({"config.json", SHARDED_JSON, STATE_JSON, STATE_TENSORS})


def _dcp_errors() -> tuple[type[BaseException], ...]:
    """What a DCP call raises (its CheckpointException is a BaseException). Imported when a
    sharded checkpoint is read or written, not with qkv: torch.distributed.checkpoint takes
    0.7 s to import, which every ``qkv`` command and test subprocess paid."""
    try:
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:  # pragma: no cover - torch without distributed
        return (Exception,)
    return (Exception, CheckpointException)


# --- every rank together -------------------------------------------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _together(what: str, fn: Any) -> Any:
    """Run ``fn()`` on every rank, then agree: if it raised anywhere, every rank raises
    ``CheckpointError`` naming the first failed rank and its error."""
    error: BaseException | None = None
    result = None
    try:
        result = fn()
    except Exception as exc:  # reported to every rank below
        error = exc
    if not _distributed():
        if error is not None:
            raise _as_checkpoint_error(what, 0, error) from error
        return result
    text = None if error is None else f"{type(error).__name__}: {error}"
    texts: list[str | None] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(texts, text)
    except Exception as exc:  # a rank died or hung: the collective fails (or times out)
        raise CheckpointError(f"{what}: another rank did not answer (it died, or hung past "
                              f"the process group's timeout): {_describe(exc)}") from exc
    for rank, t in enumerate(texts):
        if t is not None:
            raise CheckpointError(f"{what}: rank {rank} failed: {_first_line(t)}") from error
    return result


def _first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else text


def _as_checkpoint_error(what: str, rank: int, exc: BaseException) -> CheckpointError:
    if isinstance(exc, CheckpointError):
        return exc
    return CheckpointError(f"{what}: rank {rank} failed: "
                           f"{_first_line(f'{type(exc).__name__}: {exc}')}")


@contextmanager
def _quiet() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _describe(exc: BaseException) -> str:
    """One line for an error of a DCP call: each failed rank and its exception (DCP's
    CheckpointException carries them in ``failures``), else the first line."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, failure in sorted(failures.items()):
            err = failure[0] if isinstance(failure, tuple) else failure
            parts.append(f"rank {rank} failed: {type(err).__name__}: {_first_line(str(err))}")
        return "; ".join(parts)
    return _first_line(f"{type(exc).__name__}: {exc}")


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


# --- DCP's metadata, unpickled safely ------------------------------------------------------------
_TORCH_GLOBALS = {"Size", "device", "strided", "sparse_coo", "contiguous_format",
                  "channels_last", "preserve_format", *(
                      name for name in dir(torch) if isinstance(getattr(torch, name, None),
                                                                torch.dtype))}
_BUILTINS = {"set", "frozenset", "list", "dict", "tuple", "slice", "bytes", "bytearray"}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata dataclasses, torch's Size/dtype/layout objects and plain
    containers; anything else (os.system, builtins.eval...) raises."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = ((module == "torch.distributed.checkpoint.metadata")  # its classes only
                   or (module == "torch.distributed.checkpoint.filesystem"
                       and name == "_StorageInfo")
                   or (module == "torch" and name in _TORCH_GLOBALS)
                   or (module == "torch.serialization" and name == "_get_layout")
                   or (module == "pathlib" and name in ("PosixPath", "PurePosixPath",
                                                        "WindowsPath", "PureWindowsPath"))
                   or (module == "builtins" and name in _BUILTINS)
                   or (module == "collections" and name == "OrderedDict"))
        if allowed:
            value = super().find_class(module, name)
            if module.startswith("torch.distributed.") and not isinstance(value, type):
                allowed = False
        if not allowed:
            raise pickle.UnpicklingError(
                f"DCP metadata refers to {module}.{name}, which a qkv checkpoint never holds")
        return value


def _load_metadata(stream: Any) -> Any:
    data = stream.read()
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError,
            ValueError) as exc:
        raise CheckpointError(f"unreadable or unsafe DCP metadata: {exc}") from exc


def _reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        """``FileSystemReader`` whose ``.metadata`` is read by a restricted unpickler."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as stream:
                metadata = _load_metadata(stream)
            if not isinstance(metadata, Metadata):
                raise CheckpointError(f"{path}: not DCP metadata ({type(metadata).__name__})")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader


def safe_reader(path: str | os.PathLike) -> Any:
    """A DCP ``FileSystemReader`` on ``path`` whose pickled .metadata file is read with an
    unpickler restricted to DCP's metadata classes (see the module docstring)."""
    return _reader_class()(path)


# --- save / load ---------------------------------------------------------------------------------
def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` (a checkpoint directory) holds a DCP sharded checkpoint."""
    return (Path(path) / SHARDED_JSON).is_file()


def _states(model: nn.Module, optimizer: torch.optim.Optimizer | None
            ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return get_model_state_dict(model), None
    return get_state_dict(model, optimizer)


def save_sharded_checkpoint(run_dir: str | os.PathLike, *, model: nn.Module,
                            optimizer: torch.optim.Optimizer, step: int,
                            data_position: int = 0, tokenizer: Any = None,
                            run_info: dict[str, Any] | None = None,
                            extra_files: dict[str, Any] | None = None) -> Path:
    """Write a sharded checkpoint of ``model`` (FSDP2-sharded, DDP-wrapped or plain) and
    ``optimizer`` at optimizer step ``step`` into ``run_dir/checkpoint``, atomically. A
    collective: every rank calls it (rank 0 writes the small files and does the renames).
    ``tokenizer`` (``.save(path)``), ``run_info`` (run.json) and ``extra_files`` (JSON files,
    name -> content: a model kind's own, e.g. preprocessor_config.json) as for
    ``qkv.train.checkpoint.save_checkpoint``. Returns the checkpoint directory.

    Raises:
        CheckpointError: on every rank, when any rank failed (naming it); the previous
            checkpoint is then left as it was.
    """
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    run_dir = Path(run_dir)
    tmp, final, old = run_dir / TMP_DIR, run_dir / CHECKPOINT_DIR, run_dir / OLD_DIR
    main = _rank() == 0
    world = dist.get_world_size() if _distributed() else 1
    inner = getattr(model, "module", model)  # a DDP wrapper saves its module
    config = getattr(inner, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise TypeError(f"model must be a qkv model with a config, got {type(inner).__name__}")

    def prepare() -> None:
        if main:
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / SHARDED_DIR).mkdir(parents=True)

    _together("sharded checkpoint (preparing)", prepare)
    msd, osd = _together("sharded checkpoint (state dicts)", lambda: _states(inner, optimizer))
    assert osd is not None
    state = {"model": msd, "optimizer": {"state": osd["state"]}}
    try:  # DCP gathers every rank's write errors and raises them on all ranks
        with _quiet():
            dcp_save(state, storage_writer=FileSystemWriter(tmp / SHARDED_DIR),
                     no_dist=not _distributed())
    except _dcp_errors() as exc:
        raise CheckpointError(f"sharded checkpoint (writing {tmp / SHARDED_DIR}): "
                              f"{_describe(exc)}") from exc

    def small_files() -> None:
        if not main:
            return
        text = json.dumps(config.to_dict(), indent=2, sort_keys=True)
        atomic_write(tmp / "config.json", lambda p: Path(p).write_text(text))
        _write_json(tmp / STATE_JSON, {"step": step, "data_position": data_position,
                                       "param_groups": osd["param_groups"]})
        rng = {"rng.torch": torch.get_rng_state()}
        device = next(inner.parameters()).device
        if device.type == "cuda":  # dropout on CUDA draws from the device's generator
            rng["rng.cuda"] = torch.cuda.get_rng_state(device)
        atomic_write(tmp / STATE_TENSORS, lambda p: save_file(rng, p))
        if tokenizer is not None:
            save_run_tokenizer(tokenizer, tmp)
        if run_info is not None:
            _write_json(tmp / "run.json", run_info)
        for name, content in (extra_files or {}).items():
            if name in _OWN_FILES:
                raise ValueError(f"extra_files: {name!r} is a file of the checkpoint itself")
            _write_json(tmp / name, content)
        _write_json(tmp / SHARDED_JSON, {"format": FORMAT, "world_size": world})
        for path in sorted((tmp / SHARDED_DIR).iterdir()):
            fsync_path(path)
        fsync_path(tmp / SHARDED_DIR)
        fsync_path(tmp)

    _together("sharded checkpoint (trainer state)", small_files)

    def swap() -> None:
        if not main:
            return
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_path(run_dir)
        if old.exists():
            shutil.rmtree(old)

    _together("sharded checkpoint (renaming)", swap)
    return final


def _write_json(path: Path, data: Any) -> None:
    text = json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False)
    atomic_write(path, lambda p: Path(p).write_text(text, encoding="utf-8"))


def load_sharded_checkpoint(checkpoint: str | os.PathLike, *, model: nn.Module,
                            optimizer: torch.optim.Optimizer | None = None,
                            restore_rng: bool = True) -> dict[str, Any]:
    """Load a sharded checkpoint (a checkpoint or run directory; written by any number of
    processes) into ``model`` (built from its config.json, then FSDP2-sharded, DDP-wrapped
    or plain, on this world) and
    ``optimizer`` (built on the model's parameters; its param_groups' hyper-parameters come
    from the checkpoint). A collective when a process group is joined. Restores the torch
    RNG (rank 0's state at the save) unless ``restore_rng=False``. Returns ``{"step",
    "data_position"}``.

    Raises:
        CheckpointError: not a sharded checkpoint, or its contents do not fit the model /
            optimizer (on every rank).
    """
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    ckpt = find_checkpoint(checkpoint)
    if not is_sharded_checkpoint(ckpt):
        raise CheckpointError(f"{ckpt}: not a sharded checkpoint (no {SHARDED_JSON})")
    inner = getattr(model, "module", model)

    def read_meta() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return read_json(ckpt / STATE_JSON), load_file(str(ckpt / STATE_TENSORS))

    meta, tensors = _together(f"{ckpt}: reading the trainer state", read_meta)
    msd, osd = _together(f"{ckpt}: state dicts", lambda: _states(inner, optimizer))
    state: dict[str, Any] = {"model": msd}
    if osd is not None:
        state["optimizer"] = {"state": osd["state"]}
    try:
        with _quiet():
            dcp_load(state, storage_reader=safe_reader(ckpt / SHARDED_DIR),
                     no_dist=not _distributed())
    except _dcp_errors() as exc:
        raise CheckpointError(f"{ckpt}: the sharded state does not fit this model/optimizer: "
                              f"{_describe(exc)}") from exc

    def apply() -> None:
        if optimizer is None:
            set_model_state_dict(inner, state["model"])
            return
        if len(meta["param_groups"]) != len(optimizer.param_groups):
            raise CheckpointError(f"{ckpt}: {len(meta['param_groups'])} optimizer param "
                                  f"groups saved, this optimizer has "
                                  f"{len(optimizer.param_groups)}")
        groups = [{k: tuple(v) if isinstance(v, list) and isinstance(now.get(k), tuple)
                   else v for k, v in saved.items()}  # JSON made the betas a list
                  for saved, now in zip(meta["param_groups"], optimizer.param_groups,
                                        strict=True)]
        set_state_dict(inner, optimizer, model_state_dict=state["model"],
                       optim_state_dict={"state": state["optimizer"]["state"],
                                         "param_groups": groups})

    _together(f"{ckpt}: loading the state", apply)
    if restore_rng:
        torch.set_rng_state(tensors["rng.torch"])
        device = next(inner.parameters()).device
        if "rng.cuda" in tensors and device.type == "cuda":
            torch.cuda.set_rng_state(tensors["rng.cuda"], device)
    return {"step": int(meta["step"]), "data_position": int(meta.get("data_position", 0))}


# --- export --------------------------------------------------------------------------------------
def build_checkpoint_model(checkpoint: str | os.PathLike) -> nn.Module:
    """A new model of the config.json of ``checkpoint`` (random weights, on the CPU, in
    training mode), built without touching torch's global RNG: what a resume shards and then
    fills with ``load_sharded_checkpoint``."""
    path = Path(checkpoint) / "config.json"
    data = read_json(path)
    entry = registry.entry_for(data.get("model_type"), source=str(path))
    if entry.model_type != data.get("model_type"):  # HF's name: not a config qkv wrote
        raise CheckpointError(f"{path}: model_type {data.get('model_type')!r} is "
                              f"HuggingFace's, not the {entry.model_type!r} a qkv checkpoint "
                              f"holds")
    with torch.random.fork_rng(devices=[]):
        return entry.model_class(entry.config_class.from_dict(data))


def load_sharded_model(checkpoint: str | os.PathLike) -> nn.Module:
    """The whole model of a sharded checkpoint, on this process's CPU, in eval mode — read
    without a process group (DCP's ``no_dist``), whatever world size wrote it."""
    from torch.distributed.checkpoint import load as dcp_load

    ckpt = Path(checkpoint)
    if not is_sharded_checkpoint(ckpt):
        raise CheckpointError(f"{ckpt}: not a sharded checkpoint (no {SHARDED_JSON})")
    model = build_checkpoint_model(ckpt)
    state = model.state_dict()  # views of the parameters: DCP copies into them
    try:
        with _quiet():
            dcp_load({"model": state}, storage_reader=safe_reader(ckpt / SHARDED_DIR),
                     no_dist=True)
    except _dcp_errors() as exc:
        raise CheckpointError(f"{ckpt}: cannot read the sharded model: "
                              f"{_describe(exc)}") from exc
    return model.eval()


def read_sharded_checkpoint(checkpoint: str | os.PathLike, *, device: Any = None,
                            dtype: Any = None) -> nn.Module:
    """``qkv.models.from_pretrained``'s reader of a directory holding sharded.json
    (registered by ``qkv.train``): ``load_sharded_model``'s model, which it then places on
    ``device`` / ``dtype`` (so they are not used here)."""
    return load_sharded_model(checkpoint)


def export_sharded(run_or_ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the plain model directory of a run's sharded checkpoint into ``out_dir``
    (existing, empty: ``qkv.outputs.new_output_dir``): config.json + model.safetensors
    (``Model.from_pretrained(out_dir)``), plus the checkpoint's other JSON files
    (tokenizer.json, run.json, a model kind's own: ``qkv.train.load_run(out_dir)``) and an
    encoder-decoder tokenizer's SentencePiece models (``*.spm``, ``*.model``: Marian's,
    T5's). One process, no process group.

    Raises:
        CheckpointError: no checkpoint, or not a sharded one.
    """
    ckpt = find_checkpoint(run_or_ckpt_dir)
    model = load_sharded_model(ckpt)
    out = Path(out_dir)
    model.save_pretrained(out)  # type: ignore[operator]
    files = [*ckpt.glob("*.json"), *ckpt.glob("*.spm"), *ckpt.glob("*.model")]
    for src in sorted(files):  # tokenizer.json, run.json, a kind's own files, spm models
        if src.name not in _OWN_FILES:
            atomic_write(out / src.name, lambda p, s=src: shutil.copyfile(s, p))
    return out
