"""Files on disk, for every package: the names of a model directory's files, ``atomic_write``
(a reader never sees half a file), ``read_json`` (a JSON object or a ``CheckpointError`` naming
the file) and ``CheckpointError`` itself. It imports nothing of qkv, so any module may use it
(docs/ARCHITECTURE.md: Files).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from pathlib import Path

__all__ = ["ADAPTER_MARK", "CHECKPOINT_DIR", "CONFIG_NAME", "FSDP_MARK", "INDEX_NAME",
           "PICKLE_NAME", "QUANT_NAME", "WEIGHTS_NAME", "CheckpointError", "atomic_write",
           "fsync_path", "is_regular_file", "read_json", "refuse_adapter_directory"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
PICKLE_NAME = "pytorch_model.bin"
QUANT_NAME = "quantization.json"  # beside config.json for a model quantized with qkv.quantize
INDEX_NAME = "model.safetensors.index.json"  # a sharded HF checkpoint: tensor -> shard file
FSDP_MARK = "sharded.json"  # a `qkv train --fsdp` checkpoint (DCP shards, not a model file)
ADAPTER_MARK = "adapter_config.json"  # an adapter run's checkpoint (no whole model)
CHECKPOINT_DIR = "checkpoint"  # the latest checkpoint of a `qkv train` run: RUN/checkpoint/


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded: missing files, mismatched keys/shapes, bad format.

    ``shape_pairs`` (set by ``check_and_load`` and ``hf_state.map_hf_state`` when tensors are
    mis-shaped): the (checkpoint shape, model shape) of each, read by
    ``check_against_header`` to name the config fields that give the model's sizes."""

    shape_pairs: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()


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
    fsync_path(path.parent)  # the rename itself on disk


def fsync_path(path: Path) -> None:
    """Flush ``path`` (a file, or a directory: the names in it) to disk; nothing where it
    cannot be opened or synced (some platforms cannot sync a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_json(path: Path) -> dict:
    """Read a JSON object, with a clear error naming the file. A config.json missing from an
    adapter run's checkpoint (adapter_config.json beside it) says what the directory is."""
    path = Path(path)
    if path.name == CONFIG_NAME and not path.exists():
        refuse_adapter_directory(path.parent)
    if path.exists() and not is_regular_file(path):  # a FIFO would block the read
        raise CheckpointError(f"{path}: not a regular file")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {path}: {err}") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def refuse_adapter_directory(directory: Path) -> None:
    """Raise the CheckpointError for an adapter checkpoint given where a model is needed."""
    if not (directory / ADAPTER_MARK).is_file():
        return
    base = ""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        base = str(json.loads((directory / "base.json").read_text()).get("path") or "")
    where = f" ({base})" if base else ""
    raise CheckpointError(f"{directory} holds an adapter ({ADAPTER_MARK}), not a whole model: "
                          f"it is an adapter run's checkpoint; pass its base{where} instead, "
                          f"or merge it first (`qkv peft merge RUN --out DIR`) and pass DIR")



def is_regular_file(path: Path) -> bool:
    """A regular file (after symlinks: the HF cache links snapshots to blobs), not a FIFO,
    device, directory or dangling link."""
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return False
