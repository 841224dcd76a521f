"""HuggingFace state dicts -> qkv state dicts by a key map: the one place where HF's separate
query/key/value tensors are fused and where a checkpoint that does not match its config is
reported (missing, unknown and mis-shaped keys, in HF's names: ``map_hf_state``; or in qkv's,
by ``check_and_load`` after ``rename_hf_state``). Used by every HF mapping (``hf_load``).

Shapes: C model width; HF's q/k/v (C, ...) each -> qkv's fused ``in_proj`` (3C, ...), rows
q, k, v.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..files import CheckpointError

__all__ = ["Fused", "KeyMap", "fused_parts", "layer_field", "map_hf_state", "rename_hf_state"]


class Fused(NamedTuple):
    """HF tensors concatenated along dim 0 into one qkv tensor, with unequal row counts
    (grouped-query q, k, v: H·D, Hkv·D, Hkv·D rows; a plain tuple of names splits equally).

    Attributes:
        names: the HF keys, in row order.
        rows: each one's number of rows (dim 0).
    """

    names: tuple[str, ...]
    rows: tuple[int, ...]


KeyMap = dict[str, "str | tuple[str, ...] | Fused"]
"""qkv state-dict key -> an HF key, a tuple of HF keys concatenated along dim 0 in equal
parts, or a ``Fused`` (concatenated, with each part's row count)."""


def fused_parts(value: str | tuple[str, ...] | Fused, shape: tuple[int, ...]
                ) -> list[tuple[str, tuple[int, ...]]]:
    """The (HF key, its shape) parts of one key-map value for a qkv tensor of ``shape``:
    one key -> the whole shape; a tuple -> equal row blocks; a ``Fused`` -> its rows."""
    if isinstance(value, Fused):
        return [(n, (r, *shape[1:])) for n, r in zip(value.names, value.rows, strict=True)]
    names = value if isinstance(value, tuple) else (value,)
    return [(n, (shape[0] // len(names), *shape[1:])) for n in names]


def layer_field(data: dict[str, Any], *names: str) -> str:
    """How messages name a config.json field counting layers: the first of ``names`` (the
    field and its aliases) that ``data`` sets, else the first one, marked as the default."""
    for name in names:
        if name in data:
            return name
    return f"{names[0]} (not set: transformers' default)"


def map_hf_state(own: dict[str, Tensor], key_map: KeyMap, state: dict[str, Tensor],
                 source: str, what: str) -> dict[str, Tensor]:
    """HF tensors -> the keys of ``own`` (a model's state dict) by ``key_map`` (each qkv key
    -> an HF key, or a tuple of HF keys concatenated along dim 0: the fused q, k, v).

    Raises:
        CheckpointError (nothing loaded) naming missing, unknown and mis-shaped HF keys, and
        those stored as ints or bools where the model holds floats (refused, not cast);
        ``what`` names the checkpoint kind in the message.
    """
    mapped: dict[str, Tensor] = {}
    used: set[str] = set()
    missing: list[str] = []
    shapes: list[str] = []
    pairs: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    dtypes: list[str] = []
    for key, hf in key_map.items():
        parts = dict(fused_parts(hf, tuple(own[key].shape)))  # q/k/v each a row block
        names = tuple(parts)
        absent = [n for n in names if n not in state]
        missing.extend(absent)
        wrong = [n for n in names if n in state and tuple(state[n].shape) != parts[n]]
        shapes.extend(f"{n}: checkpoint {tuple(state[n].shape)} vs expected {parts[n]}"
                      for n in wrong)
        pairs.extend((tuple(state[n].shape), parts[n]) for n in wrong)
        ints = [n for n in names if n in state and own[key].is_floating_point()
                and not state[n].is_floating_point()]
        dtypes.extend(f"{n}: {state[n].dtype}" for n in ints)
        used.update(n for n in names if n in state)
        if not absent and not wrong and not ints:
            parts = [state[n] for n in names]
            mapped[key] = parts[0] if len(parts) == 1 else torch.cat(parts)  # rows q, k, v
    unknown = sorted(set(state) - used)
    if missing or unknown or shapes or dtypes:
        msg = []
        if missing:
            msg.append(f"missing keys {missing[:10]}{' ...' if len(missing) > 10 else ''}")
        if unknown:
            msg.append(f"unknown keys {unknown[:10]}{' ...' if len(unknown) > 10 else ''}")
        if shapes:
            msg.append("shape mismatches " + "; ".join(shapes[:10]))
        if dtypes:
            msg.append("weights stored as non-float dtypes where the model holds floats "
                       "(refused, not cast) " + "; ".join(dtypes[:10]))
        err = CheckpointError(f"{source}: HuggingFace {what} checkpoint does not match its "
                              f"config: " + "; ".join(msg))
        err.shape_pairs = tuple(pairs)
        raise err
    return mapped


def rename_hf_state(own: dict[str, Tensor] | None, key_map: KeyMap, state: dict[str, Tensor],
                    source: str = "", what: str = "") -> dict[str, Tensor]:
    """HF tensors -> qkv keys by ``key_map`` without checking (``check_and_load`` then reports
    what does not fit, in qkv's names): each qkv key whose HF keys are all present gets them
    (a tuple concatenated along dim 0, rows q, k, v); an HF key no entry uses keeps its name
    (reported as unexpected), a qkv key whose HF keys are absent is left out (reported as
    missing). ``own``, ``source`` and ``what`` are accepted for ``map_hf_state``'s signature
    and not used. Several qkv keys may read one HF key (a tied LM head)."""
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    for key, hf in key_map.items():
        names = hf.names if isinstance(hf, Fused) else hf if isinstance(hf, tuple) else (hf,)
        if all(n in state for n in names):
            parts = [state[n] for n in names]
            out[key] = parts[0] if len(parts) == 1 else torch.cat(parts)  # rows q, k, v
            used.update(names)
    for name, t in state.items():
        if name not in used:
            out.setdefault(name, t)
    return out
