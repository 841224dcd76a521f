"""Bottleneck adapters (Houlsby et al. 2019; Pfeiffer et al. 2021; He et al. 2022's
parallel adapter), added to a model's ``EncoderLayer`` / ``DecoderLayer`` stacks from the
outside: the models need no change.

Shapes: B batch, N length, C model width, M bottleneck width (C // reduction_factor).

An adapter ``A`` is down (C -> M), activation, dropout (training only), up (M -> C). ``up``
starts at zero (weight and bias), so a model with fresh adapters returns bit-identical
outputs to the base model (AdapterHub's default init changes them before any training).
The down projection has ``nn.Linear``'s default (Kaiming-uniform) init.

Placements, in every layer of GPT, BERT and both stacks of the encoder-decoder
``Transformer`` (``a`` is a sublayer's output before the layer's residual add and norm,
``x`` the FFN's input — the normed input in a pre-norm layer):

- ``"houlsby"`` (Houlsby et al. 2019, Fig. 2): ``a -> a + A(a)`` after the self-attention
  and after the FFN, before the residual add (post-norm: before the add & norm);
- ``"pfeiffer"`` (Pfeiffer et al. 2021): the FFN one only, ``f -> f + A(f)``;
- ``"parallel"`` (He et al. 2022): beside the FFN, ``FFN(x) + s · A(x)`` (``scaling`` s).

Cross-attention gets no adapter (AdapterHub's default). The adapter sits inside the
layer's residual dropout (which then acts on ``a + A(a)``); at eval this is the papers'
formula exactly.

Each adapted sublayer becomes an ``AdaptedSublayer`` around the original module (its
state-dict keys gain ``.base``; attribute reads fall through to it). Several named adapters
may live side by side; one is active (``AdaptedSublayer.set_active``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..modules.feedforward import ACTIVATIONS
from ..modules.layers import DecoderLayer, EncoderLayer
from .checks import check_float_model
from .config import MAX_SCALE
from .kind_files import (
    fit_or_roll_back,
    read_kind_files,
    write_kind_files,
)
from .saving import refresh_save_guard

__all__ = ["AdaptedSublayer", "AdapterConfig", "Bottleneck", "add_adapters", "load_adapters",
           "planned_shapes", "remove_adapters", "save_adapters"]

PLACEMENTS = ("houlsby", "pfeiffer", "parallel")
KIND = "bottleneck"


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    """Bottleneck adapters' configuration (frozen).

    Args:
        reduction_factor: r; the bottleneck width is M = C // r (C the model width), >= 1.
        placement: "houlsby" (after self-attention and after the FFN), "pfeiffer" (after
            the FFN) or "parallel" (beside the FFN, scaled).
        activation: one of ``qkv.modules.feedforward.ACTIVATIONS`` ("relu", "gelu",
            "gelu_tanh", "silu").
        dropout: on the (B, N, M) bottleneck activations, training only; in [0, 1).
        scaling: s, the parallel adapter's output scale (He et al. 2022 use 4); "parallel"
            only; finite, |s| at most ``qkv.peft.config.MAX_SCALE`` (1000: beyond it the
            adapter swamps the layer's output).
    """

    reduction_factor: float = 16
    placement: str = "houlsby"
    activation: str = "relu"
    dropout: float = 0.0
    scaling: float = 4.0

    def __post_init__(self) -> None:
        r = self.reduction_factor
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not r > 0 \
                or r != r or r == float("inf"):
            raise ValueError(f"AdapterConfig: reduction_factor must be a positive number, "
                             f"got {r!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"AdapterConfig: placement must be one of {PLACEMENTS}, "
                             f"got {self.placement!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"AdapterConfig: activation must be one of {sorted(ACTIVATIONS)}, "
                             f"got {self.activation!r}")
        d = self.dropout
        if not isinstance(d, (int, float)) or isinstance(d, bool) or not 0.0 <= d < 1.0:
            raise ValueError(f"AdapterConfig: dropout must be in [0, 1), got {d!r}")
        s = self.scaling
        if not isinstance(s, (int, float)) or isinstance(s, bool) or s != s \
                or abs(s) == float("inf"):
            raise ValueError(f"AdapterConfig: scaling must be a finite number, got {s!r}")
        if abs(s) > MAX_SCALE:
            raise ValueError(f"AdapterConfig: scaling={s!r} is beyond +-{MAX_SCALE:g}: the "
                             f"adapter would swamp the layer's output (He et al. use 4)")

    def width(self, dim: int) -> int:
        """M = dim // reduction_factor; ValueError when that is 0."""
        m = int(dim // self.reduction_factor)
        if m < 1:
            raise ValueError(f"AdapterConfig: reduction_factor={self.reduction_factor!r} leaves "
                             f"no bottleneck for model width C={dim} (C // r = {m})")
        return m

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return dataclasses.asdict(self)


class Bottleneck(nn.Module):
    """One adapter's update ``A(x) = up(dropout(act(down(x))))``, (B, N, C) -> (B, N, C).

    ``up`` (M -> C) is zero-initialised, weight and bias, so ``A(x) == 0`` exactly at init.
    The residual ``x + A(x)`` (or ``FFN(x) + s · A(x)`` when ``parallel``) is added by
    ``AdaptedSublayer``.

    Args:
        dim: C. hidden: M. activation: a key of ``ACTIVATIONS``. dropout: on (B, N, M).
        parallel: True for He et al.'s parallel adapter (input: the sublayer's input).
        scaling: s, the parallel adapter's output scale.
        device, dtype: of the parameters.
    """

    def __init__(self, dim: int, hidden: int, *, activation: str = "relu",
                 dropout: float = 0.0, parallel: bool = False, scaling: float = 1.0,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.activation = activation
        self.parallel = bool(parallel)
        self.scaling = float(scaling)
        self.down = nn.Linear(dim, hidden, device=device, dtype=dtype)
        self.up = nn.Linear(hidden, dim, device=device, dtype=dtype)
        self.dropout = nn.Dropout(dropout)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, x: Tensor) -> Tensor:
        """x (B, N, C) -> A(x) (B, N, C)."""
        h = ACTIVATIONS[self.activation](self.down(x))  # (B, N, M)
        return self.up(self.dropout(h))  # (B, N, C)

    def extra_repr(self) -> str:
        return (f"activation={self.activation!r}, parallel={self.parallel}, "
                f"scaling={self.scaling}")


class AdaptedSublayer(nn.Module):
    """A layer's sublayer (self-attention or FFN) with named bottleneck adapters around it.

    ``forward(*args, **kwargs)`` calls ``base`` with the same arguments; with an active
    adapter ``A`` its output ``a`` (B, N, C) becomes ``a + A(a)`` (sequential) or
    ``a + s · A(x)`` with ``x = args[0]`` the sublayer's (B, N, C) input (parallel). A
    tuple output (attention with ``need_weights``) keeps its other items. Reading an
    attribute it lacks reads ``base``'s (``layer.attn.num_heads``, ``new_cache``...).

    Attributes:
        base: the wrapped module. adapters: name -> ``Bottleneck``.
        active: the active adapter's name, or None (then exactly ``base``).
    """

    ADAPTER_KIND = "bottleneck"  # what ``qkv.peft.saving`` reads

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base
        self.adapters = nn.ModuleDict()
        self.active: str | None = None

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            base = self.__dict__.get("_modules", {}).get("base")
            if base is None:
                raise
            return getattr(base, name)

    def set_active(self, name: str | None) -> None:
        """Make ``name`` the active adapter (None, or a name this sublayer lacks: none)."""
        self.active = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Same arguments and outputs as ``base``; see the class docstring."""
        out = self.base(*args, **kwargs)
        if self.active not in self.adapters:
            return out
        adapter = self.adapters[self.active]
        y, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
        # parallel: beside the sublayer, on its input x = args[0]; else on its output y
        delta = adapter.scaling * adapter(args[0]) if adapter.parallel else adapter(y)
        y = y + delta  # (B, N, C)
        return y if rest is None else (y, *rest)


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not name or "." in name or name == "base":
        raise ValueError(f"adapter name must be a non-empty str without '.' and not 'base', "
                         f"got {name!r}")


def _layers(model: nn.Module, who: str) -> list[nn.Module]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{who}: model must be an nn.Module, got {type(model).__name__}")
    layers = [m for m in model.modules() if isinstance(m, (EncoderLayer, DecoderLayer))]
    if not layers:
        raise ValueError(f"{who}: {type(model).__name__} has no qkv EncoderLayer/DecoderLayer "
                         f"to adapt")
    return layers


def _factory(module: nn.Module) -> dict[str, Any]:
    p = next(module.parameters())
    return {"device": p.device, "dtype": p.dtype}


def train_only(model: nn.Module, params: list[nn.Parameter]) -> None:
    """Freeze every parameter of ``model`` except ``params`` (requires_grad)."""
    keep = {id(p) for p in params}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)


def named_adapter_names(model: nn.Module) -> set[str]:
    """Names of the bottleneck adapters in ``model``."""
    return {n for m in model.modules() if isinstance(m, AdaptedSublayer) for n in m.adapters}


def add_adapters(model: nn.Module, config: AdapterConfig, *, name: str = "default"
                 ) -> nn.Module:
    """Insert bottleneck adapters named ``name`` into every layer of ``model``, make them
    active and freeze everything else (only the new adapters train). In place.

    Args:
        model: any module whose layers are qkv ``EncoderLayer``s / ``DecoderLayer``s (GPT,
            BERT, Transformer). Width C is each layer's FFN input width.
        config: an ``AdapterConfig`` (placement, M = C // reduction_factor, ...).
        name: the adapter's name (several may coexist; the new one becomes active).

    Returns:
        ``model``. The new parameters per adapter: 2·C·M + M + C (down and up, with biases);
        Houlsby puts two per layer, Pfeiffer and parallel one.

    Raises:
        TypeError for a wrong ``config`` type; ValueError for a bad/used ``name``, a model
        without qkv layers, a model quantized to int8, or a reduction factor leaving no
        bottleneck.
    """
    plan = _plan(model, config, name, "add_adapters")
    parallel = config.placement == "parallel"
    new: list[nn.Parameter] = []
    for layer, _, site, dim, width in plan:
        sub = getattr(layer, site)
        if not isinstance(sub, AdaptedSublayer):
            sub = AdaptedSublayer(sub)
            setattr(layer, site, sub)
        adapter = Bottleneck(dim, width, activation=config.activation,
                             dropout=config.dropout, parallel=parallel,
                             scaling=config.scaling if parallel else 1.0,
                             **_factory(sub.base))
        sub.adapters[name] = adapter
        new.extend(adapter.parameters())
    for m in model.modules():
        if isinstance(m, AdaptedSublayer):
            m.set_active(name)
    model._qkv_adapter_configs = {**getattr(model, "_qkv_adapter_configs", {}), name: config}
    train_only(model, new)
    refresh_save_guard(model)
    return model


def _plan(model: nn.Module, config: AdapterConfig, name: str, who: str
          ) -> list[tuple[nn.Module, str, str, int, int]]:
    """(layer, its module path, sublayer attribute, C, M) of every adapter ``add_adapters``
    would insert, after its checks; nothing allocated."""
    if not isinstance(config, AdapterConfig):
        raise TypeError(f"{who}: config must be an AdapterConfig, got {type(config).__name__}")
    _check_name(name)
    layers = _layers(model, who)
    check_float_model(model, who)
    if name in named_adapter_names(model):
        raise ValueError(f"{who}: model already has an adapter named {name!r}")
    paths = {id(m): p for p, m in model.named_modules()}
    plan = []
    for layer in layers:
        attr = "attn" if isinstance(layer, EncoderLayer) else "self_attn"
        sites = (attr, "ffn") if config.placement == "houlsby" else ("ffn",)
        dim = layer.ffn.fc_in.in_features
        width = config.width(dim)
        plan += [(layer, paths[id(layer)], site, dim, width) for site in sites]
    return plan


def planned_shapes(model: nn.Module, config: AdapterConfig, *, name: str = "default"
                   ) -> dict[str, tuple[int, ...]]:
    """The tensors ``add_adapters(model, config, name=name)`` would add, keyed as
    ``save_adapters`` writes them (``layers.0.ffn.adapters.*.down.weight``: (M, C), its bias
    (M,), ``up.weight`` (C, M), its bias (C,)), with nothing allocated. Raises as
    ``add_adapters``."""
    shapes: dict[str, tuple[int, ...]] = {}
    for _, path, site, dim, width in _plan(model, config, name, "add_adapters"):
        pre = f"{path}.{site}" if path else site
        shapes.update({f"{pre}.adapters.*.down.weight": (width, dim),
                       f"{pre}.adapters.*.down.bias": (width,),
                       f"{pre}.adapters.*.up.weight": (dim, width),
                       f"{pre}.adapters.*.up.bias": (dim,)})
    return shapes


def remove_adapters(model: nn.Module, name: str) -> nn.Module:
    """Delete the bottleneck adapter ``name``; a sublayer left without adapters is unwrapped
    (its module and state-dict keys are the original ones again). In place; returns model.

    Raises ValueError when there is no adapter ``name``.
    """
    if name not in named_adapter_names(model):
        raise ValueError(f"remove_adapters: no adapter named {name!r} "
                         f"(have {sorted(named_adapter_names(model))})")
    for layer in _layers(model, "remove_adapters"):
        for site in ("attn", "self_attn", "ffn"):
            sub = getattr(layer, site, None)
            if isinstance(sub, AdaptedSublayer) and name in sub.adapters:
                del sub.adapters[name]
                if sub.active == name:
                    sub.set_active(None)
                if not len(sub.adapters):
                    setattr(layer, site, sub.base)
    configs = dict(getattr(model, "_qkv_adapter_configs", {}))
    configs.pop(name, None)
    model._qkv_adapter_configs = configs
    refresh_save_guard(model)
    return model


def _adapter_state(model: nn.Module, name: str) -> dict[str, Tensor]:
    """The adapter's tensors, keyed by their model path with ``adapters.<name>`` as
    ``adapters.*`` (so a file loads under any name)."""
    tag = f".adapters.{name}."
    return {k.replace(tag, ".adapters.*."): v for k, v in model.state_dict().items()
            if tag in k}


def save_adapters(model: nn.Module, path: str | Path, *, name: str | None = None) -> Path:
    """Write the bottleneck adapter ``name`` (default: the active one) to directory
    ``path``: ``adapter_config.json`` (kind, config, name) and ``adapter_model.safetensors``
    (its tensors only, never the base weights). Atomic per file. Returns the directory.

    Raises ValueError when the model has no such adapter.
    """
    configs = getattr(model, "_qkv_adapter_configs", {})
    if name is None:
        actives = {m.active for m in model.modules() if isinstance(m, AdaptedSublayer)}
        name = next(iter(actives)) if len(actives) == 1 else None
    if name not in configs:
        raise ValueError(f"save_adapters: no bottleneck adapter named {name!r} "
                         f"(have {sorted(configs)})")
    state = {k: v.detach().contiguous().cpu() for k, v in _adapter_state(model, name).items()}
    return write_kind_files(model, path, kind=KIND, name=name, config=configs[name],
                            state=state)


def load_adapters(model: nn.Module, path: str | Path, *, name: str | None = None) -> str:
    """Add the bottleneck adapter saved in directory ``path`` (by ``save_adapters``) to
    ``model`` as ``name`` (default: its saved name) and make it active; everything else is
    frozen. A mismatch (another model class, other shapes or layers) raises one
    ``CheckpointError`` and leaves the model as it was. Returns the adapter's name.
    """
    config, name, state = read_kind_files(
        model, path, kind=KIND, label="bottleneck adapter", what="adapter",
        config_class=AdapterConfig, plan=planned_shapes, name=name,
        fields=lambda c: f"reduction_factor={c.reduction_factor!r}, placement={c.placement!r}")
    grads = {id(p): p.requires_grad for p in model.parameters()}
    actives = {m: m.active for m in model.modules() if isinstance(m, AdaptedSublayer)}
    add_adapters(model, config, name=name)
    want = _adapter_state(model, name)
    fit_or_roll_back(want, state, path=path, what="adapter",
                     remove=lambda: remove_adapters(model, name), actives=actives,
                     grads=grads, model=model)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for k in want:
            params[k.replace(".adapters.*.", f".adapters.{name}.")].copy_(state[k])
    return name

