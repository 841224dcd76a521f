"""Input checks shared by the models: token-id tensors.

Shapes: B batch, N length.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["check_token_ids"]

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_token_ids(owner: str, name: str, ids: Any, limit: int, limit_name: str, *,
                    shape: tuple[int, int] | None = None) -> Tensor:
    """Check a (B, N) integer tensor of ids in [0, limit) (one min/max, no per-element loop).

    Raises TypeError for a non-tensor or a non-integer dtype, ValueError for a wrong shape
    (or one other than ``shape``), an empty sequence, or an id out of range, naming
    ``owner``, ``name`` and the offending value. Returns ``ids``.
    """
    if not isinstance(ids, Tensor):
        raise TypeError(f"{owner}: {name} must be a torch.Tensor (B, N) of integer token ids, "
                        f"got {type(ids).__name__}")
    if ids.dtype not in _INT_DTYPES:
        raise TypeError(f"{owner}: {name} must be an integer tensor of token ids, got dtype "
                        f"{ids.dtype}")
    if ids.dim() != 2 or ids.shape[1] == 0 or (shape is not None and tuple(ids.shape) != shape):
        want = "(B, N) with N >= 1" if shape is None else f"(B, N) = {shape}"
        raise ValueError(f"{owner}: {name} must have shape {want}, got {tuple(ids.shape)}")
    if ids.numel():
        lo, hi = (int(x) for x in torch.aminmax(ids))
        if lo < 0 or hi >= limit:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{owner}: {name} holds token id {bad}, outside [0, {limit}) "
                             f"({limit_name}={limit})")
    return ids
