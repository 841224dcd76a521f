"""Checks every adapter kind shares: an adapter file's tensors against what its config
implies, read from the safetensors header before anything is allocated; finite values after
reading; a float (not int8-quantized) model to adapt.

A safetensors file opens with an 8-byte length and a JSON header naming every tensor's dtype
and shape; ``read_header`` reads only that (``safetensors.safe_open``, which also checks that
the offsets fit the file), so an ``adapter_config.json`` saying ``r=2000000`` beside a 17 KB
weights file is refused at once instead of allocating the adapter the config describes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from ..files import CheckpointError
from ..modules.quantized import QuantizedLinear

__all__ = ["check_finite", "check_float_model", "check_header", "read_header"]

#: safetensors dtype names of floating-point tensors
_FLOATS = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


def read_header(file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype name, e.g. "F32") of every tensor in ``file``, from
    its header only (no tensor is read).

    Raises:
        CheckpointError: no such file, or not a readable safetensors file.
    """
    file = Path(file)
    if not file.is_file():
        raise CheckpointError(f"{file}: no such adapter weights file")
    try:
        with safe_open(str(file), framework="pt") as f:
            out = {}
            for key in f.keys():  # noqa: SIM118 (safe_open has keys(), no iteration)
                view = f.get_slice(key)
                out[key] = (tuple(int(d) for d in view.get_shape()), str(view.get_dtype()))
            return out
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{file}: cannot read safetensors: {err}") from err


def _few(items: list[str], n: int = 4) -> str:
    more = f" (+{len(items) - n} more)" if len(items) > n else ""
    return f"{items[:n]}{more}" if items else "none"


def check_header(file: Path, header: dict[str, tuple[tuple[int, ...], str]],
                 want: dict[str, tuple[int, ...]], *, model: nn.Module, fields: str) -> None:
    """Refuse a file whose tensors (``header``, from ``read_header``) are not exactly the
    ones the adapter's config implies for ``model`` (``want``: name -> shape), or not
    floats: one ``CheckpointError`` naming the config's fields (``fields``, e.g. "r=4,
    targets ('q', 'v')"), the tensors and both shapes."""
    missing = sorted(set(want) - set(header))
    unknown = sorted(set(header) - set(want))
    bad = [f"{k}: file {header[k][0]}, model {tuple(want[k])}" for k in sorted(want)
           if k in header and header[k][0] != tuple(want[k])]
    bad += [f"{k}: dtype {header[k][1]} (adapter weights are floats)" for k in sorted(header)
            if header[k][1] not in _FLOATS]
    if missing or unknown:
        bad.insert(0, f"missing {_few(missing)}, unknown {_few(unknown)}")
    if bad:
        raise CheckpointError(f"{file}: tensors do not fit this {type(model).__name__} with "
                              f"{fields} (as adapter_config.json says): {_few(bad)}")


def check_finite(file: Path, tensors: dict[str, Tensor]) -> None:
    """Refuse adapter tensors holding NaN or inf (a corrupt or diverged file): one
    ``CheckpointError`` naming the tensors and how many such values each has."""
    bad = []
    for key in sorted(tensors):
        t = tensors[key]
        n = int(t.numel() - torch.isfinite(t).sum())
        if n:
            bad.append(f"{key}: {n} of {t.numel()}")
    if bad:
        raise CheckpointError(f"{file}: non-finite values (NaN or inf) in {_few(bad)}; the "
                              f"adapter is corrupt or its training diverged; nothing was "
                              f"loaded")


def check_float_model(model: nn.Module, who: str) -> None:
    """Refuse a model quantized to int8 (``qkv.quantize``): adapters need float weights
    (int8 layers have no gradient, and their inputs' gradients are not computed)."""
    for path, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            raise ValueError(f"{who}: the model is quantized to int8 ({path} is a "
                             f"QuantizedLinear, made by qkv.quantize); adapters need the "
                             f"float model: add them before quantizing, or reload it")
