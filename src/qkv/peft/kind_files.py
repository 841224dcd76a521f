"""The files of the bottleneck-adapter and prefix kinds, written and read the same way:
``adapter_config.json`` (``{"kind", "name", "config", "base": {"class", "config"}}``) and
``adapter_model.safetensors`` (the kind's tensors only, keyed by model path with the
adapter's name as ``*``).

Reading checks everything before the model changes: the kind, the model class it was made
for, the config, the tensors' shapes from the file's header against the shapes the config
implies (nothing is allocated for a file that does not fit), finite values; and after the
kind is added, that the file's tensors are exactly the ones the model expects
(``fit_or_roll_back``), undoing the add otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ..files import CheckpointError, atomic_write, read_json
from .checks import check_finite, check_header, read_header

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "fit_or_roll_back", "read_kind_files",
           "write_kind_files"]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


def write_kind_files(model: nn.Module, path: str | Path, *, kind: str, name: str, config: Any,
                     state: dict[str, Tensor]) -> Path:
    """Write ``state`` (name -> tensor, CPU, contiguous) and the JSON naming ``kind``,
    ``name``, ``config.to_dict()`` and the base model's class and config into directory
    ``path`` (created if needed). Atomic per file. Returns the directory."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    base_config = getattr(model, "config", None)
    base = {"class": type(model).__name__,
            "config": base_config.to_dict() if hasattr(base_config, "to_dict") else None}
    meta = {"kind": kind, "name": name, "config": config.to_dict(), "base": base}
    text = json.dumps(meta, indent=2, sort_keys=True, default=str)
    atomic_write(path / WEIGHTS_NAME, lambda tmp: save_file(state, tmp, metadata={"kind": kind}))
    atomic_write(path / CONFIG_NAME, lambda tmp: Path(tmp).write_text(text))
    return path


def read_kind_files(model: nn.Module, path: str | Path, *, kind: str, label: str,
                    what: str, config_class: type, plan: Callable[..., dict],
                    fields: Callable[[Any], str],
                    name: str | None = None) -> tuple[Any, str, dict[str, Tensor]]:
    """Read and check directory ``path`` for adding a ``kind`` ("bottleneck", "prefix") to
    ``model``, which is left untouched.

    Args:
        label: the kind's name in words ("bottleneck adapter", "prefix").
        what: the kind in words for messages ("adapter", "prefix").
        config_class: the kind's config dataclass (``config_class(**saved["config"])``).
        plan: ``plan(model, config, name=name)`` -> the tensor shapes adding the kind would
            make (``planned_shapes`` of the kind's module); its ValueError is refused.
        fields: the config fields that size the tensors, in words, for a shape mismatch.
        name: the name to add it under (default: the saved one).

    Returns:
        ``(config, name, state)``: the config, the name, and the file's tensors.

    Raises:
        CheckpointError: another kind, a model of another class, an unreadable config, a
            header that does not fit the config, an unreadable or non-finite tensor.
    """
    path = Path(path)
    meta = read_json(path / CONFIG_NAME)
    if meta.get("kind") != kind or not isinstance(meta.get("config"), dict):
        raise CheckpointError(f"{path / CONFIG_NAME}: not a qkv {label} (kind "
                              f"{meta.get('kind')!r})")
    made_for = (meta.get("base") or {}).get("class")
    if made_for not in (None, type(model).__name__):
        raise CheckpointError(f"{path}: the {what} was made for a {made_for}, this model is "
                              f"a {type(model).__name__}")
    try:
        config = config_class(**meta["config"])
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{path / CONFIG_NAME}: cannot read the {what}: {err}") from err
    name = meta.get("name", "default") if name is None else name
    try:  # the file's shapes against the config's, before anything is allocated
        want = plan(model, config, name=name)
    except ValueError as err:
        raise CheckpointError(f"{path}: {err}") from err
    weights = path / WEIGHTS_NAME
    check_header(weights, read_header(weights), want, model=model, fields=fields(config))
    try:
        state = load_file(str(weights))
    except (OSError, SafetensorError) as err:
        raise CheckpointError(f"{weights}: cannot read the {what}: {err}") from err
    check_finite(weights, state)
    return config, name, state


def fit_or_roll_back(want: dict[str, Tensor], state: dict[str, Tensor], *, path: Any,
                     what: str, remove: Any, actives: dict, grads: dict[int, bool],
                     model: nn.Module) -> None:
    """Check that the file's tensors ``state`` are exactly the ones the model now expects
    (``want``: same keys, same shapes); otherwise undo the add (``remove()``, the earlier
    active flags and ``requires_grad``) and raise ``CheckpointError`` naming what differs —
    so a load that does not fit leaves the model as it was."""
    missing = sorted(set(want) - set(state))
    unknown = sorted(set(state) - set(want))
    shapes = [f"{k}: file {tuple(state[k].shape)}, model {tuple(want[k].shape)}"
              for k in sorted(set(want) & set(state)) if state[k].shape != want[k].shape]
    if not (missing or unknown or shapes):
        return
    remove()
    for m, a in actives.items():
        m.set_active(a)
    for p in model.parameters():
        p.requires_grad_(grads.get(id(p), p.requires_grad))
    parts = [f"missing {missing[:5]}" if missing else "",
             f"unknown {unknown[:5]}" if unknown else "", "; ".join(shapes[:5])]
    raise CheckpointError(f"{path}: the {what} does not fit this model: "
                          + "; ".join(p for p in parts if p))
