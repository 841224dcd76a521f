"""LoRA on qkv's projections, from the outside: the models are unchanged and do not know.

Shapes: B batch, N length, In input features, Out output features of a projection, r rank,
S row segments updated in one projection (1 to 3), Rows output rows of one segment.

``add_lora`` gives every targeted projection (a ``nn.Linear`` named ``in_proj`` / ``q_proj`` /
``kv_proj`` / ``out_proj`` of an attention module, ``fc_in`` / ``fc_out`` of a feed-forward) a
``lora`` submodule: a ``LoraState`` holding one ``LoraUpdate`` per named adapter. A role of the
fused QKV projection is a row segment: ``"q"`` updates rows [0, H·D), ``"k"`` the next Hkv·D,
``"v"`` the last Hkv·D, each with its own A (r, In) and B (Rows, r); ``"qkv"`` one segment over
all rows. A gated FFN's (``SwiGLU``) fused ``fc_in`` likewise: ``"gate"`` rows [0, F),
``"up"`` rows [F, 2F), ``"ffn_in"`` all 2F. "all-linear" picks the finest roles each
projection has (``qkv.peft.config.expand_targets``). The S segments of one projection are
computed as one product: x A_catᵀ (B, N, S·r) times a block-diagonal (Out, S·r) matrix of
the Bs — the base GEMM plus two thin ones.

While an adapter is engaged (active, not merged, not disabled; or named by a row of
``adapter_rows``) the linear is a ``LoraLinear`` sharing the base ``weight`` and ``bias``
Parameters; otherwise it is a plain ``nn.Linear`` that carries the same ``lora`` submodule.
The wrappers step aside: merged or disabled inference runs the base model's exact code (its
fast paths check ``type(m) is nn.Linear``), and the state-dict keys never change
(``...in_proj.weight``, ``...in_proj.lora.<adapter>.A_q``).

A fused projection used by rows (cross-attention with ``kv_dim == dim`` projects the queries
from rows [0, H·D) and keys/values from the rest) calls ``project_rows(x, start, stop)``, which
``LoraLinear`` implements with the update restricted to those rows
(``qkv.modules.attention.project_rows``).

Speed: a ``LoraLinear`` with one engaged adapter is one autograd Function (``LoraLinearFunction``):
the base GEMM through ``qkv.ops.fast_linear`` (oneDNN where that pays), each segment's rank-r
update added in place into its own columns of the output (no block-diagonal zeros, no copy
of the (M, Out) output), and a backward that computes the base input gradient through
oneDNN too, adds the low-rank part in place, and the weight gradient only when the base
weight trains (in LoRA it is frozen). Under ``qkv.ops.onednn_linear(False)``, autocast,
functorch transforms, tensor subclasses (DTensor) or mixed-adapter rows the update is the
composed form (differentiable torch ops: double backward works there).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from ..modules.attention import MultiHeadAttention
from ..modules.feedforward import FeedForward, SwiGLU
from ..modules.linear_attention import LinearAttention
from ..modules.quantized import QuantizedLinear
from .config import ALL_LINEAR, LoraConfig, expand_targets
from .lora_layers import LoraLinear, LoraState, LoraUpdate
from .saving import refresh_save_guard

__all__ = ["LoraLinear", "LoraSite", "LoraState", "LoraUpdate", "active_adapter",
           "adapter_names", "adapter_rows", "add_lora", "disable_adapters", "lora_sites",
           "lora_states", "merge", "planned_shapes", "set_adapter", "unload", "unmerge"]

BASE = "base"  # the row name of ``adapter_rows`` for "no adapter"
_NAME = re.compile(r"[A-Za-z0-9_\-]+")


# --- finding the projections ----------------------------------------------------------------
@dataclasses.dataclass
class LoraSite:
    """A projection a LoRA target can name: ``parent.<attr>`` is the linear (or the
    ``LoraLinear`` around it) at module path ``path``."""

    parent: nn.Module
    attr: str
    path: str  # module path of the linear, e.g. "layers.0.attn.in_proj"
    roles: dict[str, tuple[int, int]]  # role ("q", "k", "v", "qkv", "out"...) -> output rows

    @property
    def linear(self) -> nn.Module:
        """The module at the site now (a plain linear or a ``LoraLinear``)."""
        return getattr(self.parent, self.attr)

    @property
    def state(self) -> LoraState | None:
        """The site's LoRA adapters, or None when it has none."""
        s = getattr(self.linear, "lora", None)
        return s if isinstance(s, LoraState) else None


def plain_path(path: str) -> str:
    """A module path as the unwrapped model spells it: the ``.base`` segments that bottleneck
    adapter and prefix wrappers insert are removed (``layers.0.attn.base.in_proj`` ->
    ``layers.0.attn.in_proj``), so LoRA files fit a model with or without those wrappers."""
    while ".base." in f".{path}.":
        path = f".{path}.".replace(".base.", ".", 1).strip(".")
    return path


def _fused_roles(splits: tuple[int, int, int]) -> dict[str, tuple[int, int]]:
    q, k, v = splits
    return {"q": (0, q), "k": (q, q + k), "v": (q + k, q + k + v), "qkv": (0, q + k + v)}


def lora_sites(model: nn.Module, fn: str = "qkv.peft") -> list[LoraSite]:
    """Every projection a LoRA target can name, in module order (``fn``: the caller, for
    errors)."""
    sites = []
    for path, mod in model.named_modules():
        pre = f"{path}." if path else ""
        found: list[tuple[str, dict[str, tuple[int, int]]]] = []
        if isinstance(mod, (MultiHeadAttention, LinearAttention)):
            if getattr(mod, "in_proj", None) is not None:
                found.append(("in_proj", _fused_roles(mod._splits)))
            else:
                q, kv = mod._splits[0], mod._splits[1]
                found.append(("q_proj", {"q": (0, q), "qkv": (0, q)}))
                found.append(("kv_proj", {"k": (0, kv), "v": (kv, 2 * kv), "qkv": (0, 2 * kv)}))
            found.append(("out_proj", {"out": (0, mod.out_proj.out_features)}))
        elif isinstance(mod, SwiGLU):  # fc_in's rows: [gate (F); up (F)]
            f = mod.fc_out.in_features
            found.append(("fc_in", {"ffn_in": (0, 2 * f), "gate": (0, f), "up": (f, 2 * f)}))
            found.append(("fc_out", {"ffn_out": (0, mod.fc_out.out_features)}))
        elif isinstance(mod, FeedForward):
            found.append(("fc_in", {"ffn_in": (0, mod.fc_in.out_features)}))
            found.append(("fc_out", {"ffn_out": (0, mod.fc_out.out_features)}))
        for attr, roles in found:
            lin = getattr(mod, attr)
            if isinstance(lin, QuantizedLinear):
                raise ValueError(f"{fn}: the model is quantized to int8 ({pre}{attr} is a "
                                 f"QuantizedLinear, made by qkv.quantize); LoRA adapters live "
                                 f"on float weights: add, merge or unmerge them before "
                                 f"quantizing (a merged adapter is part of the int8 weights "
                                 f"and cannot be taken out), or reload the float model")
            if type(lin) is not nn.Linear and not isinstance(lin, LoraLinear):
                raise TypeError(f"qkv.peft: {pre}{attr} is a {type(lin).__name__}, not an "
                                f"nn.Linear; LoRA wraps plain linear projections")
            sites.append(LoraSite(mod, attr, pre + attr, roles))
    return sites


def lora_states(model: nn.Module, fn: str = "qkv.peft") -> list[tuple[LoraSite, LoraState]]:
    """(site, its ``LoraState``) of every projection that holds LoRA adapters, in module
    order (``fn``: the caller, for errors)."""
    return [(s, s.state) for s in lora_sites(model, fn) if s.state is not None]


def _swap(site: LoraSite, state: LoraState) -> None:
    """Put a ``LoraLinear`` or a plain ``nn.Linear`` (carrying ``state``) in place, as
    ``state.engaged()`` asks; both share the same weight and bias Parameters."""
    lin = site.linear
    if state.engaged() == isinstance(lin, LoraLinear):
        return
    if state.engaged():
        new = LoraLinear(lin.weight, lin.bias, state)
    else:
        new = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None,
                        device="meta")  # no allocation: the Parameters are the old ones
        new.weight = lin.weight
        new.bias = lin.bias
        new.lora = state
    new.train(lin.training)
    setattr(site.parent, site.attr, new)


def _sync(states: list[tuple[LoraSite, LoraState]]) -> None:
    for site, state in states:
        _swap(site, state)


def _require(model: nn.Module, fn: str) -> list[tuple[LoraSite, LoraState]]:
    states = lora_states(model, fn)
    if not states:
        raise ValueError(f"{fn}: the model has no LoRA adapter (add_lora / load_adapter)")
    return states


def adapter_names(model: nn.Module) -> list[str]:
    """The LoRA adapter names of ``model``, in the order they were added."""
    names: dict[str, None] = {}
    for _, state in lora_states(model):
        names.update(dict.fromkeys(state.keys()))
    return list(names)


def active_adapter(model: nn.Module) -> str | None:
    """The active adapter's name (None when the model has no adapter)."""
    states = lora_states(model)
    return states[0][1].active if states else None


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name == BASE \
            or hasattr(LoraState({}, 0), name):
        raise ValueError(f"qkv.peft: adapter name must be letters, digits, '_' or '-' and not "
                         f"{BASE!r} or a ModuleDict attribute, got {name!r}")
    return name


def _check_unmerged(states: list[tuple[LoraSite, LoraState]], fn: str) -> None:
    merged = {state.merged for _, state in states} - {None}
    if merged:
        raise ValueError(f"{fn}: adapter {sorted(merged)[0]!r} is merged into the weights; "
                         f"call qkv.peft.unmerge(model) first")


# --- building adapters ----------------------------------------------------------------------
def _plan_segments(model: nn.Module, config: LoraConfig, name: str,
                   roles_by_site: dict[str, tuple[str, ...]] | None
                   ) -> list[tuple[LoraSite, list[tuple[str, int, int]]]]:
    """(site, its (role, lo, hi) segments) of every projection adapter ``name`` would
    update; every check of ``plan_updates``, nothing allocated."""
    if not isinstance(config, LoraConfig):
        raise TypeError(f"qkv.peft: config must be a LoraConfig, got {type(config).__name__}")
    _check_name(name)
    sites = lora_sites(model, "add_lora")
    states = [(s, s.state) for s in sites if s.state is not None]
    _check_unmerged(states, "add_lora")
    if any(state.disabled or state.rows is not None for _, state in states):
        raise ValueError("add_lora: not inside disable_adapters() or adapter_rows()")
    if name in adapter_names(model):
        raise ValueError(f"add_lora: the model already has an adapter named {name!r}")
    plan, used = [], set()
    for site in sites:
        roles = (config.targets if roles_by_site is None
                 else roles_by_site.get(plain_path(site.path), ()))
        segs = [(role, *site.roles[role]) for role in expand_targets(roles, site.roles)]
        if not segs:
            continue
        used.update(role for role, _, _ in segs)
        plan.append((site, segs))
    if used and ALL_LINEAR in config.targets:
        used.add(ALL_LINEAR)
    missing = [t for t in config.targets if t not in used]
    plain_ffn = [s for s in sites if isinstance(s.parent, FeedForward) and s.attr == "fc_in"]
    if set(missing) & {"gate", "up"} and plain_ffn:
        ffn = plain_ffn[0]
        raise ValueError(f"add_lora: targets {config.targets}: 'gate' and 'up' are the row "
                         f"blocks of a gated FFN's fused fc_in (SwiGLU: gate rows [0, F), up "
                         f"[F, 2F)); {type(model).__name__} has no gated FFN "
                         f"({plain_path(ffn.path)} is a plain FeedForward's C -> F "
                         f"projection): target 'ffn_in' (or 'all-linear') instead")
    if missing:
        raise ValueError(f"add_lora: targets {missing} match no projection of "
                         f"{type(model).__name__} (targets {config.targets})")
    return plan


def plan_updates(model: nn.Module, config: LoraConfig, name: str,
                 roles_by_site: dict[str, tuple[str, ...]] | None = None
                 ) -> list[tuple[LoraSite, LoraUpdate]]:
    """New (site, ``LoraUpdate``) pairs for adapter ``name`` on ``model`` — nothing attached
    yet. ``roles_by_site`` (path -> roles) overrides ``config.targets`` per projection.

    Raises:
        ValueError when ``name`` exists, a target matches no projection, an adapter is
        merged, or the model is quantized; TypeError when a projection is not a plain linear
        layer.
    """
    plan = []
    for site, segs in _plan_segments(model, config, name, roles_by_site):
        w = site.linear.weight
        plan.append((site, LoraUpdate(config, segs, site.linear.in_features, device=w.device,
                                      dtype=w.dtype)))
    return plan


def planned_shapes(model: nn.Module, config: LoraConfig, *, name: str = "default",
                   roles_by_site: dict[str, tuple[str, ...]] | None = None
                   ) -> dict[str, tuple[int, ...]]:
    """The tensors ``add_lora(model, config, name=name)`` would add, keyed as
    ``save_adapter`` writes them (``layers.0.attn.in_proj.A_q``: (r, In), ``...B_q``:
    (Rows, r)), with nothing allocated: what a file's header is checked against before a
    load, and what a memory estimate counts. Raises as ``plan_updates``."""
    shapes: dict[str, tuple[int, ...]] = {}
    for site, segs in _plan_segments(model, config, name, roles_by_site):
        path = plain_path(site.path)
        for role, lo, hi in segs:
            shapes[f"{path}.A_{role}"] = (config.r, site.linear.in_features)
            shapes[f"{path}.B_{role}"] = (hi - lo, config.r)
    return shapes


def attach(model: nn.Module, plan: list[tuple[LoraSite, LoraUpdate]], name: str) -> None:
    """Attach a ``plan_updates`` plan as adapter ``name``: every other parameter is frozen,
    ``name`` becomes the active adapter."""
    for p in model.parameters():
        p.requires_grad_(False)
    for site, update in plan:
        state = site.state
        if state is None:
            state = LoraState(site.roles, site.linear.out_features)
            site.linear.lora = state
        state[name] = update
    set_adapter(model, name)
    refresh_save_guard(model)


def add_lora(model: nn.Module, config: LoraConfig, *, name: str = "default") -> nn.Module:
    """Add a LoRA adapter to every projection ``config.targets`` names; freeze everything
    else; make it the active (and only trainable) adapter. Returns ``model`` (changed in
    place).

    The model's outputs are unchanged until it trains (B = 0). Works on any model built from
    qkv's ``MultiHeadAttention`` (self- and cross-attention), ``LinearAttention``,
    ``FeedForward`` and ``SwiGLU``: ``GPT``, ``BERT``, ``Transformer``.

    Args:
        model: an nn.Module.
        config: a ``LoraConfig``.
        name: the adapter's name (letters, digits, '_' or '-'; not "base").

    Raises:
        ValueError: a name in use, a target no projection has, a merged adapter.

    Example::

        add_lora(model, LoraConfig(r=8, alpha=16, targets=("q", "k", "v")))
        opt = torch.optim.AdamW(p for p in model.parameters() if p.requires_grad)
    """
    attach(model, plan_updates(model, config, name), name)
    return model


def set_adapter(model: nn.Module, name: str) -> None:
    """Make adapter ``name`` the active one, its parameters trainable and the other
    adapters' frozen (base parameters are left as they are)."""
    states = _require(model, "set_adapter")
    names = adapter_names(model)
    if name not in names:
        raise ValueError(f"set_adapter: no adapter named {name!r}; the model has {names}")
    _check_unmerged(states, "set_adapter")
    for _, state in states:
        state.active = name
        for n, update in state.items():
            for p in update.parameters():
                p.requires_grad_(n == name)
    _sync(states)


@contextlib.contextmanager
def disable_adapters(model: nn.Module) -> Iterator[None]:
    """Within the block the model computes its base outputs (every LoRA wrapper steps aside).

    Raises ValueError while an adapter is merged (``unmerge`` first)."""
    states = _require(model, "disable_adapters")
    _check_unmerged(states, "disable_adapters")
    before = [state.disabled for _, state in states]
    for _, state in states:
        state.disabled = True
    _sync(states)
    try:
        yield
    finally:
        for (_, state), was in zip(states, before, strict=True):
            state.disabled = was
        _sync(states)


@contextlib.contextmanager
def adapter_rows(model: nn.Module, names: Sequence[str]) -> Iterator[None]:
    """Mixed-adapter batches: within the block, row i of every forward's batch uses adapter
    ``names[i]`` ("base": none), whatever the active adapter; each row's output equals that
    row run alone with its adapter active. The models' signatures are unchanged: every
    projection checks that its input's batch (first) dimension is ``len(names)``.

    Raises ValueError for an unknown name, an empty list, or a merged adapter.

    Example::

        with adapter_rows(model, ["fr", "base", "de"]):
            logits = model(ids).logits        # ids (3, N)
    """
    states = _require(model, "adapter_rows")
    if isinstance(names, str) or not isinstance(names, Sequence) or not names:
        raise ValueError(f"adapter_rows: names must be a non-empty sequence of adapter names "
                         f"(one per batch row), got {names!r}")
    known = adapter_names(model)
    bad = sorted({n for n in names if n != BASE and n not in known}, key=str)
    if bad:
        raise ValueError(f"adapter_rows: unknown adapter names {bad}; the model has {known} "
                         f"(and {BASE!r} for no adapter)")
    _check_unmerged(states, "adapter_rows")
    rows = tuple(names)
    for _, state in states:
        state.set_rows(rows)
    _sync(states)
    try:
        yield
    finally:
        for _, state in states:
            state.set_rows(None)
        _sync(states)


# --- merging --------------------------------------------------------------------------------
@torch.no_grad()
def merge(model: nn.Module) -> None:
    """Fold the active adapter into the projection weights: W += scale · B A. The wrappers
    step aside, so inference costs exactly the base model's. ``unmerge`` undoes it.

    Raises ValueError with no adapter, an adapter already merged, or inside
    ``disable_adapters`` / ``adapter_rows``."""
    states = _require(model, "merge")
    _check_unmerged(states, "merge")
    if any(state.disabled or state.rows is not None for _, state in states):
        raise ValueError("merge: not inside disable_adapters() or adapter_rows()")
    for site, state in states:
        if state.active in state:
            w = site.linear.weight
            w.add_(state[state.active].delta_weight(w.shape[0]).to(w.dtype))
    for _, state in states:
        state.merged = state.active
    _sync(states)


@torch.no_grad()
def unmerge(model: nn.Module) -> None:
    """Restore the base weights after ``merge`` (W -= scale · B A; equal within rounding).

    Raises ValueError when nothing is merged."""
    states = _require(model, "unmerge")
    if all(state.merged is None for _, state in states):
        raise ValueError("unmerge: no adapter is merged")
    for site, state in states:
        if state.merged in state:
            w = site.linear.weight
            w.sub_(state[state.merged].delta_weight(w.shape[0]).to(w.dtype))
    for _, state in states:
        state.merged = None
    _sync(states)


def unload(model: nn.Module) -> nn.Module:
    """Remove every LoRA adapter, leaving plain ``nn.Linear`` projections: with the merged
    adapter folded in after ``merge`` (a plain fine-tuned model to ``save_pretrained``), the
    base weights otherwise. ``requires_grad`` flags are left as they are. Returns ``model``."""
    for site, _ in _require(model, "unload"):
        lin = site.linear
        new = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None,
                        device="meta")
        new.weight, new.bias = lin.weight, lin.bias
        setattr(site.parent, site.attr, new.train(lin.training))
    refresh_save_guard(model)
    return model
