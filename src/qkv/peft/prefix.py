"""Prefix tuning (Li & Liang 2021): learned per-layer key/value prefixes that every query of
a self-attention may attend, fed through the attention core's key/value path.

Shapes: B batch, N query length, S key length (cached + new real tokens), P prefix length
(``num_tokens``), C model width, H heads, Hkv key/value heads, D head dim.

``add_prefix`` wraps each layer's self-attention (``EncoderLayer.attn``,
``DecoderLayer.self_attn``; cross-attention keeps its memory) in a ``PrefixAttention`` that
holds the prefix keys and values, (Hkv, P, D) each, and hands ``MultiHeadAttention`` a
``prefix`` callable that puts them before the layer's keys/values:

- the keys become (B, Hkv, P + S, D); the mask gains P leading "may attend" columns
  (``Padding`` lengths + P / keep padded with True, bool tensors padded with True, a
  bottom-right ``Causal`` needs nothing: its alignment already lets the last N queries see
  the P prefix keys), so every query sees the whole prefix, padded batches included;
- the prefix carries no position: RoPE rotates only the real tokens, at their own
  positions, and learned absolute positions are unchanged — the model computes positions
  from its real tokens, the cache ``length`` counts real tokens only;
- with a cache: ``new_cache`` returns a ``PrefixKVCache`` that holds the prefix once, in
  front of the real positions, so decoding appends real tokens only;
- attention weights (``need_weights``) are (B, H, N, P + S), prefix columns first.

Trainable parameters: 2 · P · Hkv · D per prefixed self-attention (= layers x 2 x P x C for
GPT and BERT, encoder + decoder layers for the Transformer). The keys/values are learned
directly (no reparameterising MLP); they start at N(0, ``init_std``).
Refused (ValueError): relative-position biases (no position for the prefix), linear or
sliding-window attention, a cache not made by the prefixed model's ``new_cache``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..files import CheckpointError
from ..modules.attention import MultiHeadAttention
from ..modules.cache import KVCache
from ..modules.layers import DecoderLayer, EncoderLayer
from ..ops.masks import And, Causal, DenseMask, Mask, Padding, as_mask
from .adapters import AdaptedSublayer, train_only
from .checks import check_float_model
from .kind_files import fit_or_roll_back, read_kind_files, write_kind_files
from .saving import refresh_save_guard

__all__ = ["MAX_INIT_STD", "PrefixAttention", "PrefixConfig", "PrefixKVCache", "add_prefix",
           "load_prefix", "planned_shapes", "prefix_mask", "prefix_names", "remove_prefix",
           "save_prefix"]

KIND = "prefix"
#: the largest accepted ``PrefixConfig.init_std``: prefix keys are dotted with queries of
#: unit scale, so a std of 10 already saturates the softmax; 1e300 overflowed fp32 to inf
MAX_INIT_STD = 10.0


@dataclasses.dataclass(frozen=True)
class PrefixConfig:
    """Prefix tuning's configuration (frozen).

    Args:
        num_tokens: P >= 1, prefix positions per self-attention layer.
        init_std: the prefix keys/values start at N(0, init_std²); in (0, ``MAX_INIT_STD``].
    """

    num_tokens: int = 16
    init_std: float = 0.02

    def __post_init__(self) -> None:
        p = self.num_tokens
        if not isinstance(p, int) or isinstance(p, bool) or p < 1:
            raise ValueError(f"PrefixConfig: num_tokens must be a positive int, got {p!r}")
        s = self.init_std
        if (not isinstance(s, (int, float)) or isinstance(s, bool)
                or not 0 < s <= MAX_INIT_STD):
            raise ValueError(f"PrefixConfig: init_std must be a number in (0, "
                             f"{MAX_INIT_STD:g}], got {s!r}")

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return dataclasses.asdict(self)


class _Shifted(Mask):
    """``inner`` (a mask of the real (N, S - P) problem) with P leading keys every query
    may attend."""

    def __init__(self, inner: Mask, p: int) -> None:
        self.inner, self.p = inner, p

    def validate(self, batch, heads, n, s):
        self.inner.validate(batch, heads, n, s - self.p)

    def key_range(self, i0, i1, n, s):
        return 0, self.p + self.inner.key_range(i0, i1, n, s - self.p)[1]

    def block(self, i0, i1, j0, j1, n, s, device):
        p = self.p
        if j1 <= p:
            return True
        inner = self.inner.block(i0, i1, max(j0, p) - p, j1 - p, n, s - p, device)
        if j0 >= p or inner is True:
            return inner
        rows, width = i1 - i0, j1 - p
        if inner is False:
            right = torch.zeros(1, 1, rows, width, dtype=torch.bool, device=device)
        else:
            right = inner.expand(*inner.shape[:2], rows, width)  # (B|1, H|1, rows, width)
        left = torch.ones(*right.shape[:2], rows, p - j0, dtype=torch.bool, device=device)
        return torch.cat([left, right], dim=-1)  # (B|1, H|1, rows, j1 - j0)

    def describe(self) -> str:
        return f"Prefix({self.p}) + {self.inner.describe()}"


def _extend(m: Mask, p: int) -> Mask:
    if isinstance(m, Padding):
        if m.keep is not None:
            ones = torch.ones(m.keep.shape[0], p, dtype=torch.bool, device=m.keep.device)
            return Padding(keep=torch.cat([ones, m.keep], dim=1))  # (B, P + S)
        return Padding(m.lengths + p)
    if isinstance(m, DenseMask) and m.tensor.shape[3] != 1:
        t = m.tensor  # (B|1, H|1, N|1, S)
        ones = torch.ones(*t.shape[:3], p, dtype=torch.bool, device=t.device)
        return DenseMask(torch.cat([ones, t], dim=3))  # (B|1, H|1, N|1, P + S)
    if isinstance(m, Causal) and m.alignment == "bottom_right":
        return m
    return _Shifted(m, p)


def prefix_mask(mask: Mask | Tensor | None, p: int) -> Mask | None:
    """The mask of a (B, H, N, P + S) attention whose first P keys are a prefix every query
    may attend, from ``mask`` for the (B, H, N, S) real keys (True = may attend; a
    ``qkv.masks.Mask`` or a bool tensor). None stays None (and ``causal=True``, bottom-right
    aligned, already lets every query see the prefix)."""
    m = as_mask(mask)
    if m is None:
        return None
    parts = m.parts if isinstance(m, And) else (m,)
    new = tuple(_extend(x, p) for x in parts)
    return new[0] if len(new) == 1 else And(new)


class PrefixKV(nn.Module):
    """One self-attention's learned prefix: ``keys``, ``values`` (Hkv, P, D) parameters."""

    def __init__(self, num_kv_heads: int, num_tokens: int, head_dim: int, *,
                 init_std: float = 0.02, device=None, dtype=None) -> None:
        super().__init__()
        shape = (num_kv_heads, num_tokens, head_dim)
        self.keys = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.values = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        nn.init.normal_(self.keys, std=init_std)
        nn.init.normal_(self.values, std=init_std)

    @property
    def num_tokens(self) -> int:
        """P."""
        return self.keys.shape[1]

    def forward(self) -> tuple[Tensor, Tensor]:
        """``(keys, values)``, (Hkv, P, D) each."""
        return self.keys, self.values


class PrefixKVCache(KVCache):
    """A ``KVCache`` whose buffers start with P prefix positions, written once.

    ``length``, ``capacity``, ``key_length`` and ``write``'s ``start`` count real positions
    only (so a model's positions and masks are those of its real tokens); ``get``/``append``
    return the prefix followed by the real positions, (B, Hkv, P + length, D|Dv). ``reset``
    forgets the real positions and keeps the prefix.

    Args:
        batch, num_kv_heads, capacity, head_dim: as ``KVCache`` (capacity: real positions).
        prefix_keys, prefix_values: (Hkv, P, D) / (Hkv, P, Dv), copied (detached) into every
            batch row.
        dtype, device: of the buffers.
    """

    def __init__(self, batch: int, num_kv_heads: int, capacity: int, head_dim: int, *,
                 prefix_keys: Tensor, prefix_values: Tensor, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        p = prefix_keys.shape[1]
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
            raise ValueError(f"PrefixKVCache: capacity must be a positive int, got {capacity!r}")
        super().__init__(batch, num_kv_heads, capacity + p, head_dim,
                         value_dim=prefix_values.shape[2], dtype=dtype, device=device)
        self._prefix = p
        with torch.no_grad():
            self.keys[:, :, :p] = prefix_keys.detach().to(self.dtype)  # (B, Hkv, P, D)
            self.values[:, :, :p] = prefix_values.detach().to(self.dtype)  # (B, Hkv, P, Dv)

    @property
    def prefix_length(self) -> int:
        """P."""
        return self._prefix

    @property
    def capacity(self) -> int:
        """The most real positions the cache can hold."""
        return self.keys.shape[2] - self._prefix

    def write(self, k: Tensor, v: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """Write (B, Hkv, n, D|Dv) keys/values at real positions ``[start, start + n)``;
        returns prefix + real positions, (B, Hkv, P + start + n, D|Dv)."""
        end = self._check(k, v, start)
        p = self._prefix
        self.keys[:, :, p + start:p + end] = k
        self.values[:, :, p + start:p + end] = v
        self._length = end
        return self.get()

    def get(self) -> tuple[Tensor, Tensor]:
        """Prefix then real positions: (B, Hkv, P + length, D), (B, Hkv, P + length, Dv)."""
        n = self._prefix + self._length
        return self.keys[:, :, :n], self.values[:, :, :n]

    def reorder(self, idx: Tensor) -> None:
        """Make batch row r hold what row ``idx[r]`` held (beam search); ``idx`` (B,) int."""
        n = self._prefix + self._length
        self.keys[:, :, :n] = self.keys[:, :, :n].index_select(0, idx)
        self.values[:, :, :n] = self.values[:, :, :n].index_select(0, idx)

    def __repr__(self) -> str:
        return (f"PrefixKVCache(batch={self.batch}, num_kv_heads={self.num_kv_heads}, "
                f"prefix_length={self._prefix}, length={self.length}, "
                f"capacity={self.capacity}, head_dim={self.head_dim}, dtype={self.dtype})")


class PrefixAttention(nn.Module):
    """A self-attention ``MultiHeadAttention`` with named learned prefixes; one is active.

    ``forward`` takes ``MultiHeadAttention``'s self-attention arguments (x (B, N, C), mask,
    causal, need_weights, cache, positions) and returns its outputs, (B, N, C) (weights
    (B, H, N, P + S)); the active prefix's keys/values go first in the key/value path
    (see the module docstring). ``new_cache`` makes a ``PrefixKVCache`` holding the prefix.
    Reading an attribute it lacks reads ``base``'s.

    Attributes:
        base: the ``MultiHeadAttention``. prefixes: name -> ``PrefixKV``.
        active: the active prefix's name, or None (then exactly ``base``).
    """

    ADAPTER_KIND = "prefix"  # what ``qkv.peft.saving`` reads

    def __init__(self, base: MultiHeadAttention) -> None:
        super().__init__()
        self.base = base
        self.prefixes = nn.ModuleDict()
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
        """Make ``name`` the active prefix (None, or a name it lacks: no prefix)."""
        self.active = name

    def _prefix(self) -> PrefixKV | None:
        if self.active not in self.prefixes:
            return None
        return self.prefixes[self.active]

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Any = None,
                causal: bool = False, bias: Any = None, need_weights: bool = False,
                cache: KVCache | None = None, kv: Any = None,
                positions: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """x (B, N, C) -> (B, N, C) (and weights (B, H, N, P + S) with need_weights)."""
        prefix = self._prefix()
        args = {"mask": mask, "causal": causal, "bias": bias, "need_weights": need_weights,
                "cache": cache, "positions": positions}
        if prefix is None:
            return self.base(x, context, kv=kv, **args)
        if context is not None or kv is not None:
            raise ValueError("PrefixAttention: prefix tuning applies to self-attention; "
                             "got context/kv")
        if bias is not None:
            raise ValueError(f"PrefixAttention: a relative-position bias ({type(bias).__name__})"
                             f" cannot place the prefix keys; prefix tuning needs a model "
                             f"without relative positions")
        p = prefix.num_tokens
        if cache is not None and not (isinstance(cache, PrefixKVCache)
                                      and cache.prefix_length == p):
            raise ValueError(f"PrefixAttention: cache must come from the prefixed model's "
                             f"new_cache (a PrefixKVCache holding the {p} prefix positions), "
                             f"got {cache!r}")

        def prepend(k: Tensor, v: Tensor, mask: Any, cache: Any) -> tuple[Tensor, Tensor, Any]:
            if cache is None:  # the cache already holds the prefix
                pk, pv = prefix()  # (Hkv, P, D)
                b = k.shape[0]
                k = torch.cat([pk.to(k.dtype)[None].expand(b, -1, -1, -1), k], dim=2)
                v = torch.cat([pv.to(v.dtype)[None].expand(b, -1, -1, -1), v], dim=2)
            return k, v, prefix_mask(mask, p)  # (B, Hkv, P + S, D)

        return self.base(x, prefix=prepend, **args)

    def new_cache(self, batch: int, capacity: int, *, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> KVCache:
        """With an active prefix a ``PrefixKVCache`` (capacity real positions + the
        prefix, (B, Hkv, P + capacity, D) buffers), else the base module's ``KVCache``."""
        prefix = self._prefix()
        if prefix is None:
            return self.base.new_cache(batch, capacity, dtype=dtype, device=device)
        w = self.base.out_proj.weight
        pk, pv = prefix()
        return PrefixKVCache(batch, self.base.num_kv_heads, capacity, self.base.head_dim,
                             prefix_keys=pk, prefix_values=pv,
                             dtype=w.dtype if dtype is None else dtype,
                             device=w.device if device is None else device)


def _site(layer: nn.Module) -> tuple[nn.Module, str]:
    """(owner, attribute) of the layer's self-attention module, under adapter wrappers."""
    owner, attr = layer, "attn" if isinstance(layer, EncoderLayer) else "self_attn"
    while isinstance(getattr(owner, attr), AdaptedSublayer):
        owner, attr = getattr(owner, attr), "base"
    return owner, attr


def add_prefix(model: nn.Module, config: PrefixConfig, *, name: str = "default") -> nn.Module:
    """Give every self-attention of ``model`` a learned prefix named ``name``, make it active
    and freeze everything else (only the prefixes train). In place; returns ``model``.

    Args:
        model: a module whose layers are qkv ``EncoderLayer``s / ``DecoderLayer``s with
            softmax ``MultiHeadAttention`` (GPT, BERT, Transformer).
        config: a ``PrefixConfig``: P = ``num_tokens``.
        name: the prefix's name (several may coexist; the new one becomes active).

    Trainable parameters added: 2 · P · Hkv · D per self-attention (layers x 2 x P x C
    without grouped-query heads).

    Raises:
        TypeError for a wrong ``config``; ValueError for a bad/used name, a model without
        qkv layers, a model quantized to int8, linear or sliding-window attention,
        relative-position biases.
    """
    sites = _plan(model, config, name, "add_prefix")
    new: list[nn.Parameter] = []
    for owner, attr in sites:
        attn = getattr(owner, attr)
        if not isinstance(attn, PrefixAttention):
            attn = PrefixAttention(attn)
            setattr(owner, attr, attn)
        w = attn.base.out_proj.weight
        prefix = PrefixKV(attn.base.num_kv_heads, config.num_tokens, attn.base.head_dim,
                          init_std=config.init_std, device=w.device, dtype=w.dtype)
        attn.prefixes[name] = prefix
        new.extend(prefix.parameters())
    for m in model.modules():
        if isinstance(m, PrefixAttention):
            m.set_active(name)
    model._qkv_prefix_configs = {**getattr(model, "_qkv_prefix_configs", {}), name: config}
    train_only(model, new)
    refresh_save_guard(model)
    return model


def _plan(model: nn.Module, config: PrefixConfig, name: str, who: str
          ) -> list[tuple[nn.Module, str]]:
    """(owner, attribute) of every self-attention ``add_prefix`` would give a prefix, after
    its checks; nothing allocated."""
    if not isinstance(config, PrefixConfig):
        raise TypeError(f"{who}: config must be a PrefixConfig, got {type(config).__name__}")
    if not isinstance(name, str) or not name or "." in name:
        raise ValueError(f"{who}: name must be a non-empty str without '.', got {name!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"{who}: model must be an nn.Module, got {type(model).__name__}")
    window = getattr(getattr(model, "config", None), "attention_window", None)
    if window is not None:
        raise ValueError(f"{who}: sliding-window attention (attention_window={window}) "
                         f"is not supported with prefix tuning")
    for attr in ("encoder_bias", "decoder_bias"):  # Transformer's relative positions
        if getattr(model, attr, None) is not None:
            raise ValueError(f"{who}: the model's {attr} (relative positions, "
                             f"{type(getattr(model, attr)).__name__}) cannot place prefix keys")
    layers = [m for m in model.modules() if isinstance(m, (EncoderLayer, DecoderLayer))]
    if not layers:
        raise ValueError(f"{who}: {type(model).__name__} has no qkv "
                         f"EncoderLayer/DecoderLayer")
    check_float_model(model, who)
    sites = [_site(layer) for layer in layers]
    for owner, attr in sites:
        attn = getattr(owner, attr)
        base = attn.base if isinstance(attn, PrefixAttention) else attn
        if type(base) is not MultiHeadAttention:
            raise ValueError(f"{who}: prefix tuning needs softmax MultiHeadAttention "
                             f"self-attention, got {type(base).__name__}")
        if isinstance(attn, PrefixAttention) and name in attn.prefixes:
            raise ValueError(f"{who}: model already has a prefix named {name!r}")
    return sites


def planned_shapes(model: nn.Module, config: PrefixConfig, *, name: str = "default"
                   ) -> dict[str, tuple[int, ...]]:
    """The tensors ``add_prefix(model, config, name=name)`` would add, keyed as
    ``save_prefix`` writes them (``layers.0.attn.prefixes.*.keys`` / ``.values``, (Hkv, P,
    D) each), with nothing allocated. Raises as ``add_prefix``."""
    paths = {id(m): p for p, m in model.named_modules()}
    shapes: dict[str, tuple[int, ...]] = {}
    for owner, attr in _plan(model, config, name, "add_prefix"):
        attn = getattr(owner, attr)
        base = attn.base if isinstance(attn, PrefixAttention) else attn
        pre = f"{paths[id(owner)]}.{attr}" if paths[id(owner)] else attr
        shape = (base.num_kv_heads, config.num_tokens, base.head_dim)
        shapes[f"{pre}.prefixes.*.keys"] = shape
        shapes[f"{pre}.prefixes.*.values"] = shape
    return shapes


def prefix_names(model: nn.Module) -> list[str]:
    """Names of the prefixes in ``model``, in the order they were added."""
    names: dict[str, None] = {}
    for m in model.modules():
        if isinstance(m, PrefixAttention):
            names.update(dict.fromkeys(m.prefixes))
    return list(names)


def remove_prefix(model: nn.Module, name: str) -> nn.Module:
    """Delete the prefix ``name``; a self-attention left without prefixes is unwrapped (its
    module and state-dict keys are the original ones again). In place; returns ``model``.

    Raises ValueError when there is no prefix ``name``."""
    if name not in prefix_names(model):
        raise ValueError(f"remove_prefix: no prefix named {name!r} (have "
                         f"{prefix_names(model)})")
    for layer in [m for m in model.modules() if isinstance(m, (EncoderLayer, DecoderLayer))]:
        owner, attr = _site(layer)
        attn = getattr(owner, attr)
        if isinstance(attn, PrefixAttention) and name in attn.prefixes:
            del attn.prefixes[name]
            if attn.active == name:
                attn.set_active(None)
            if not len(attn.prefixes):
                setattr(owner, attr, attn.base)
    configs = dict(getattr(model, "_qkv_prefix_configs", {}))
    configs.pop(name, None)
    model._qkv_prefix_configs = configs
    refresh_save_guard(model)
    return model


def _prefix_state(model: nn.Module, name: str) -> dict[str, Tensor]:
    """The prefix's tensors keyed by model path, ``prefixes.<name>`` written ``prefixes.*``
    (so a file loads under any name)."""
    tag = f".prefixes.{name}."
    return {k.replace(tag, ".prefixes.*."): v for k, v in model.state_dict().items()
            if tag in k}


def save_prefix(model: nn.Module, path: str | Path, *, name: str | None = None) -> Path:
    """Write prefix ``name`` (default: the active one) to directory ``path``:
    ``adapter_config.json`` ({"kind": "prefix", "name", "config", "base": {"class",
    "config"}}) and ``adapter_model.safetensors`` (its (Hkv, P, D) keys/values only, never
    the base weights). Atomic per file. Returns the directory.

    Raises ValueError when the model has no such prefix."""
    configs = getattr(model, "_qkv_prefix_configs", {})
    if name is None:
        actives = {m.active for m in model.modules() if isinstance(m, PrefixAttention)}
        name = next(iter(actives)) if len(actives) == 1 else None
    if name not in configs:
        raise ValueError(f"save_prefix: no prefix named {name!r} (have {sorted(configs)})")
    state = {k: v.detach().contiguous().cpu() for k, v in _prefix_state(model, name).items()}
    return write_kind_files(model, path, kind=KIND, name=name, config=configs[name],
                            state=state)


def load_prefix(model: nn.Module, path: str | Path, *, name: str | None = None) -> str:
    """Add the prefix saved in directory ``path`` (by ``save_prefix``) to ``model`` as
    ``name`` (default: its saved name) and make it active; everything else is frozen. A
    mismatch (another model class, other shapes or layers) raises one ``CheckpointError``
    and leaves the model as it was. Returns the prefix's name."""
    config, name, state = read_kind_files(
        model, path, kind=KIND, label="prefix", what="prefix", config_class=PrefixConfig,
        plan=planned_shapes, name=name, fields=lambda c: f"num_tokens={c.num_tokens!r}")
    grads = {id(p): p.requires_grad for p in model.parameters()}
    actives = {m: m.active for m in model.modules() if isinstance(m, PrefixAttention)}
    try:
        add_prefix(model, config, name=name)
    except ValueError as err:
        raise CheckpointError(f"{path}: {err}") from err
    want = _prefix_state(model, name)
    fit_or_roll_back(want, state, path=path, what="prefix",
                     remove=lambda: remove_prefix(model, name), actives=actives,
                     grads=grads, model=model)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for k in want:
            params[k.replace(".prefixes.*.", f".prefixes.{name}.")].copy_(state[k])
    return name
