"""``save_pretrained`` of a model that holds adapters.

``qkv.peft`` adds adapters from the outside, so a model's own ``save_pretrained`` would
write their tensors (``...in_proj.lora.default.A_q``, ``...attn.adapters.default.down...``,
``...attn.prefixes...``) beside the base's, and ``from_pretrained`` refuses such a directory
("unexpected keys"). So while a model holds an adapter, its ``save_pretrained`` is this
module's (an instance attribute the add functions set and the remove functions take away
again; the class's method is untouched):

- every LoRA adapter merged (``qkv.peft.merge``) and no other kind present: it writes the
  plain model — the merged weights under the base's own keys, no adapter tensors — which
  ``from_pretrained`` loads and which computes what the merged model computes (LoRA adapters
  that were not the merged one are left out: they are not part of what it computes);
- an unmerged LoRA adapter, a bottleneck adapter or a prefix: refused with one ValueError,
  naming ``qkv.peft.save_adapter`` (the adapter alone, loaded back onto the base with
  ``load_adapter``) and, for LoRA, ``merge``. Bottleneck adapters and prefixes add
  computation of their own and cannot become plain weights.

The adapter containers say what they are with a class attribute ``ADAPTER_KIND`` ("lora" on
``LoraState``, "bottleneck" on ``AdaptedSublayer``, "prefix" on ``PrefixAttention``), so this
module needs none of them.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from torch import nn

__all__ = ["refresh_save_guard", "save_pretrained"]

_TABLES = {"bottleneck": "adapters", "prefix": "prefixes"}


def _kind(module: nn.Module) -> str | None:
    return getattr(type(module), "ADAPTER_KIND", None)


def _names(module: nn.Module, kind: str) -> list[str]:
    table = module if kind == "lora" else getattr(module, _TABLES[kind])
    return list(table.keys())


def _holds_adapters(model: nn.Module) -> bool:
    return any(_kind(m) is not None and _names(m, _kind(m)) for m in model.modules())


def refresh_save_guard(model: nn.Module) -> None:
    """Put this module's ``save_pretrained`` in place on ``model`` while it holds an adapter
    (and the class has a ``save_pretrained``), and take it away when it holds none."""
    own = model.__dict__.get("save_pretrained")
    ours = isinstance(own, functools.partial) and own.func is save_pretrained
    if _holds_adapters(model):
        if own is None and callable(getattr(type(model), "save_pretrained", None)):
            # a partial (not a closure): deepcopy and pickle carry it to the copy
            object.__setattr__(model, "save_pretrained", functools.partial(save_pretrained,
                                                                           model))
    elif ours:
        object.__delattr__(model, "save_pretrained")


def save_pretrained(model: nn.Module, directory: str | os.PathLike, *args: Any,
                    **kwargs: Any) -> Path:
    """``type(model).save_pretrained(model, directory, ...)`` for a model holding adapters:
    the plain model with every LoRA adapter merged, else refused (module docstring).

    Raises:
        ValueError: an unmerged LoRA adapter, a bottleneck adapter or a prefix, naming
            ``qkv.peft.save_adapter`` and (LoRA) ``qkv.peft.merge``.
    """
    who = f"{type(model).__name__}.save_pretrained"
    found: dict[str, list[str]] = {}
    merged_lora: list[nn.Module] = []
    for m in model.modules():
        kind = _kind(m)
        if kind is None or not _names(m, kind):
            continue
        if kind == "lora" and m.merged is not None:
            merged_lora.append(m)
            continue
        names = found.setdefault(kind, [])
        names += [n for n in _names(m, kind) if n not in names]
    if found:
        what = "; ".join(f"{k} {v}" for k, v in found.items())
        fix = ("qkv.peft.merge(model) first (then save_pretrained writes the merged weights as "
               "a plain model)" if set(found) == {"lora"} else
               "remove them (qkv.peft.remove_adapters / remove_prefix) to save the base alone: "
               "bottleneck adapters and prefixes add layers of their own and cannot be "
               "merged into plain weights")
        raise ValueError(f"{who}: the model holds adapters not merged into its weights "
                         f"({what}), which a plain model directory cannot hold "
                         f"(from_pretrained would refuse their tensors); save the adapter "
                         f"alone with qkv.peft.save_adapter(model, DIR) (load_adapter puts it "
                         f"back on the base), or {fix}")
    owners = [(owner, owner._modules["lora"]) for owner in model.modules()
              if owner._modules.get("lora") is not None
              and any(owner._modules["lora"] is s for s in merged_lora)]
    try:  # merged: the weights are the adapted model's; save them under the base keys only
        for owner, _ in owners:
            del owner._modules["lora"]
        return type(model).save_pretrained(model, directory, *args, **kwargs)
    finally:
        for owner, state in owners:
            owner._modules["lora"] = state
