"""One switchboard for every kind of adapter a model may hold: LoRA (``qkv.peft.lora``),
bottleneck adapters (``qkv.peft.adapters``) and prefixes (``qkv.peft.prefix``).

- ``adapter_names(model)``: every adapter's name (LoRA first, then bottleneck, then prefix);
- ``adapter_kinds(model)``: name -> the kinds holding it ("lora", "bottleneck", "prefix");
- ``active_adapter(model)``: the active one's name (None when none is);
- ``set_adapter(model, name)``: ``name`` becomes the active adapter and the only trainable
  one; adapters of the other kinds step aside (inactive, frozen); base parameters are left
  as they are;
- ``disable_adapters(model)``: a context manager within which the model computes its base
  outputs (every LoRA, bottleneck adapter and prefix steps aside).

A name held by several kinds (a LoRA "default" beside a bottleneck "default") switches them
together. The LoRA-only functions of ``qkv.peft.lora`` keep their behaviour; these are the
package-level ``qkv.peft.set_adapter`` / ``disable_adapters`` / ``adapter_names`` /
``active_adapter`` and equal them on a model with LoRA only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from . import lora
from .adapters import AdaptedSublayer
from .prefix import PrefixAttention

__all__ = ["KINDS", "active_adapter", "adapter_kinds", "adapter_names", "disable_adapters",
           "set_adapter"]

#: the adapter kinds, as ``adapter_config.json`` names them
KINDS = ("lora", "bottleneck", "prefix")


def _wrappers(model: nn.Module) -> list[tuple[str, nn.Module, nn.ModuleDict]]:
    """(kind, wrapper, its name -> module dict) of every bottleneck / prefix wrapper."""
    out = []
    for m in model.modules():
        if isinstance(m, AdaptedSublayer):
            out.append(("bottleneck", m, m.adapters))
        elif isinstance(m, PrefixAttention):
            out.append(("prefix", m, m.prefixes))
    return out


def adapter_kinds(model: nn.Module) -> dict[str, list[str]]:
    """Adapter name -> the kinds of ``KINDS`` that hold it, in ``adapter_names`` order."""
    kinds: dict[str, list[str]] = {}
    for name in lora.adapter_names(model):
        kinds.setdefault(name, []).append("lora")
    for kind in KINDS[1:]:
        for k, _, table in _wrappers(model):
            if k == kind:
                for name in table:
                    if kind not in kinds.setdefault(name, []):
                        kinds[name].append(kind)
    return kinds


def adapter_names(model: nn.Module) -> list[str]:
    """Every adapter name of ``model`` (LoRA, bottleneck, prefix), in the order they were
    added within each kind."""
    return list(adapter_kinds(model))


def active_adapter(model: nn.Module) -> str | None:
    """The active adapter's name: LoRA's when a LoRA adapter is active, else the active
    bottleneck adapter's, else the active prefix's; None when none is."""
    name = lora.active_adapter(model)
    if name is not None:
        return name
    for kind in KINDS[1:]:
        for k, wrapper, _ in _wrappers(model):
            if k == kind and wrapper.active is not None:
                return wrapper.active
    return None


def set_adapter(model: nn.Module, name: str) -> None:
    """Make adapter ``name`` (of any kind) the active one and the only trainable one;
    adapters of kinds that lack ``name`` become inactive and frozen.

    Raises:
        ValueError: no adapter ``name``; a LoRA adapter is merged (``unmerge`` first).
    """
    kinds = adapter_kinds(model)
    if name not in kinds:
        raise ValueError(f"set_adapter: no adapter named {name!r}; the model has "
                         f"{list(kinds)}")
    states = lora.lora_states(model)
    if states:
        if "lora" in kinds[name]:
            lora.set_adapter(model, name)
        else:
            lora._check_unmerged(states, "set_adapter")
            for _, state in states:
                state.active = None
                for p in state.parameters():
                    p.requires_grad_(False)
            lora._sync(states)
    for kind, wrapper, table in _wrappers(model):
        on = kind in kinds[name]
        wrapper.set_active(name if on else None)
        for n, module in table.items():
            for p in module.parameters():
                p.requires_grad_(on and n == name)


@contextlib.contextmanager
def disable_adapters(model: nn.Module) -> Iterator[None]:
    """Within the block the model computes its base outputs: LoRA wrappers, bottleneck
    adapters and prefixes all step aside; their previous state returns after it.

    Raises:
        ValueError: the model has no adapter; a LoRA adapter is merged (``unmerge`` first).
    """
    wrappers = _wrappers(model)
    has_lora = bool(lora.lora_states(model))
    if not has_lora and not wrappers:
        raise ValueError("disable_adapters: the model has no adapter (add_lora, add_adapters, "
                         "add_prefix or load_adapter)")
    with lora.disable_adapters(model) if has_lora else contextlib.nullcontext():
        before = [(w, w.active) for _, w, _ in wrappers]
        for w, _ in before:
            w.set_active(None)
        try:
            yield
        finally:
            for w, active in before:
                w.set_active(active)
