"""RoPE frequency scaling for contexts past the pretraining length, as transformers computes it.

Shapes: D head dim; the D/2 frequencies ``inv_freq`` (D/2,) are θ_i = base^(-2i/D) before
scaling, i in [0, D/2); pair i of a head turns by ``pos · inv_freq[i]``.

``RopeScaling`` describes one scaling (the keys of ``to_dict`` are HuggingFace's names) and
``rope_frequencies(head_dim, base, scaling, seq_len=...)`` gives the scaled ``inv_freq``
(D/2,) and the attention factor that multiplies cos and sin (transformers'
``attention_scaling``), computed in fp64 with the formulas of transformers 5.24's
``modeling_rope_utils`` (ROPE_INIT_FUNCTIONS):

- ``"linear"`` (position interpolation): ``inv_freq / factor``.
- ``"dynamic"`` (dynamic NTK): for a sequence length ``L > O`` (O =
  ``original_max_position_embeddings``) the base becomes
  ``base · (factor·L/O − (factor − 1))^(D/(D−2))``; for ``L <= O`` nothing changes.
  transformers takes ``L = max(position_ids) + 1`` of each call and keeps the largest ``L``
  seen (resetting once a call is back under O); qkv computes it from the positions of each
  call alone (``RoPE.cos_sin``), with no state. The two agree whenever the calls' lengths only
  grow, as in generation (a prefill, then steps one position further each); they differ for a
  call shorter than an earlier one but still longer than O, where transformers keeps the
  earlier, larger base. The angles depend on the call's largest position, so a cos/sin table
  precomputed once for ``arange(cap)`` is not what transformers computes per call
  (``RopeScaling.position_dependent``). For dynamic, transformers' O is the config's
  ``max_position_embeddings``.
- ``"llama3"`` (Llama 3.1): frequencies of wavelength ``2π/inv_freq`` longer than
  ``O/low_freq_factor`` divided by ``factor``, shorter than ``O/high_freq_factor`` kept, and
  blended linearly in ``O/wavelength`` in between.
- ``"yarn"`` (Peng et al. 2023): a ramp over dims from extrapolated (``inv_freq``) to
  interpolated (``inv_freq / factor``) frequencies between the correction dims of
  ``beta_fast`` (default 32) and ``beta_slow`` (default 1) rotations in O positions
  (floored/ceiled when ``truncate``, default True; clipped to [0, D−1]), and an attention
  factor: ``attention_factor`` when given, else ``m(factor, mscale) / m(factor,
  mscale_all_dim)`` when both mscale and mscale_all_dim are non-zero, else ``m(factor, 1)``,
  with ``m(s, k) = 0.1·k·ln(s) + 1`` for s > 1 and 1 otherwise (transformers ignores a lone
  mscale).

Every type but yarn has attention factor 1. transformers' ``"default"`` is no scaling (None
here); its "longrope" is not computed (``qkv.models.hf_rope`` refuses it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["ROPE_TYPES", "RopeScaling", "rope_frequencies"]

#: the scaling types qkv computes (transformers' rope_type names)
ROPE_TYPES = ("linear", "dynamic", "llama3", "yarn")

#: the fields each type reads besides rope_type and factor (required ones first)
_REQUIRED = {
    "linear": (),
    "dynamic": ("original_max_position_embeddings",),
    "llama3": ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "yarn": ("original_max_position_embeddings",),
}
_OPTIONAL = {
    "linear": (), "dynamic": (), "llama3": (),
    "yarn": ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim",
             "truncate"),
}
_FLOATS = ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
           "attention_factor", "mscale", "mscale_all_dim")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """One RoPE scaling, fields named as transformers' ``rope_parameters`` keys.

    Attributes:
        rope_type: one of ``ROPE_TYPES``: "linear", "dynamic", "llama3", "yarn".
        factor: the context extension factor, a number >= 1 (every type).
        original_max_position_embeddings: O, the pretraining context length, a positive int
            (dynamic, llama3, yarn; not read by linear, so not allowed there).
        low_freq_factor, high_freq_factor: llama3 only, both required,
            0 < low_freq_factor < high_freq_factor.
        beta_fast, beta_slow: yarn only, optional (None = 32 and 1), > 0,
            beta_fast >= beta_slow.
        attention_factor: yarn only, optional (None = derived from factor and mscale), > 0.
        mscale, mscale_all_dim: yarn only, optional numbers (used only when both are
            non-zero).
        truncate: yarn only, optional bool (None = True).

    A field the type does not read must be None (a ``ValueError`` names it). Numbers are
    stored as float (O as int). ``from_dict`` / ``to_dict`` are the JSON form (None fields
    left out); ``RopeScaling.from_dict(s.to_dict()) == s``.
    """

    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None

    def __post_init__(self) -> None:
        kind = self.rope_type
        if kind not in ROPE_TYPES:
            extra = "; use None for unscaled RoPE" if kind in ("default", "none", None) else ""
            raise ValueError(f"RopeScaling: rope_type must be one of {list(ROPE_TYPES)}, "
                             f"got {kind!r}{extra}")
        if not _number(self.factor) or self.factor < 1:
            raise ValueError(f"RopeScaling: factor must be a finite number >= 1 "
                             f"(rope_type {kind!r}), got {self.factor!r}")
        reads = set(_REQUIRED[kind]) | set(_OPTIONAL[kind])
        for f in dataclasses.fields(self):
            if f.name in ("rope_type", "factor"):
                continue
            value = getattr(self, f.name)
            if value is None:
                if f.name in _REQUIRED[kind]:
                    raise ValueError(f"RopeScaling: rope_type {kind!r} needs {f.name}")
                continue
            if f.name not in reads:
                raise ValueError(f"RopeScaling: {f.name}={value!r} is not read by rope_type "
                                 f"{kind!r} (it reads factor"
                                 + "".join(f", {n}" for n in sorted(reads)) + ")")
            if f.name == "truncate":
                if not isinstance(value, bool):
                    raise ValueError(f"RopeScaling: truncate must be a bool, got {value!r}")
            elif f.name == "original_max_position_embeddings":
                if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                    raise ValueError("RopeScaling: original_max_position_embeddings must be a "
                                     f"positive int, got {value!r}")
            elif not _number(value):
                raise ValueError(f"RopeScaling: {f.name} must be a finite number, "
                                 f"got {value!r}")
        for name in _FLOATS:
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, float(value))
        if kind == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError("RopeScaling: llama3 needs 0 < low_freq_factor < high_freq_factor, "
                             f"got low_freq_factor={self.low_freq_factor}, "
                             f"high_freq_factor={self.high_freq_factor}")
        if kind == "yarn":
            for name in ("beta_fast", "beta_slow", "attention_factor"):
                value = getattr(self, name)
                if value is not None and value <= 0:
                    raise ValueError(f"RopeScaling: {name} must be > 0, got {value}")
            if self.fast_slow[0] < self.fast_slow[1]:
                raise ValueError("RopeScaling: yarn needs beta_fast >= beta_slow, got "
                                 f"beta_fast={self.fast_slow[0]}, beta_slow={self.fast_slow[1]}")

    @property
    def fast_slow(self) -> tuple[float, float]:
        """yarn's (beta_fast, beta_slow) with transformers' defaults (32, 1) for None."""
        return (32.0 if self.beta_fast is None else self.beta_fast,
                1.0 if self.beta_slow is None else self.beta_slow)

    @property
    def position_dependent(self) -> bool:
        """True for "dynamic": the frequencies depend on each call's largest position."""
        return self.rope_type == "dynamic"

    def resolved_attention_factor(self) -> float:
        """The factor transformers multiplies cos and sin by (``attention_scaling``): yarn's
        (see the module docstring), 1.0 for the other types."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor

        def m(scale: float, k: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(m(self.factor, self.mscale) / m(self.factor, self.mscale_all_dim))
        return m(self.factor)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RopeScaling:
        """From the ``to_dict`` form: ``{"rope_type": ..., "factor": ..., ...}``.

        Raises:
            TypeError: ``data`` is not a mapping.
            ValueError: a missing rope_type, an unknown key, or an invalid value (named).
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"RopeScaling.from_dict: expected a dict, got "
                            f"{type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names, key=str)
        if unknown:
            raise ValueError(f"RopeScaling: unknown keys {unknown}; the keys are "
                             f"{[f.name for f in dataclasses.fields(cls)]}")
        for key in ("rope_type", "factor"):
            if key not in data:
                raise ValueError(f"RopeScaling: the dict needs {key!r}, got {dict(data)!r}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: rope_type, factor and every field that is not None, HF's key names."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}


def _check_head_dim(head_dim: object) -> int:
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0 \
            or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even int, got {head_dim!r}")
    return head_dim


def _plain(half: int, dim: int, base: float | Tensor, device: torch.device | str | None,
           dtype: torch.dtype) -> Tensor:
    """base^(-2i/dim), (half,); ``base`` a float or a 0-dim tensor."""
    exponent = torch.arange(0, half, device=device, dtype=dtype) * (2.0 / dim)  # (D/2,)
    if not isinstance(base, Tensor):
        base = torch.tensor(float(base), device=device, dtype=dtype)
    return torch.pow(base, -exponent)


def _dynamic_base(s: RopeScaling, base: float, dim: int, seq_len: int | Tensor | None,
                  device: torch.device | str | None, dtype: torch.dtype) -> float | Tensor:
    """The dynamic-NTK base for a call of length ``seq_len``: ``base`` for L <= O."""
    orig, factor = s.original_max_position_embeddings, s.factor
    power = dim / (dim - 2)
    if seq_len is None:
        return base
    if isinstance(seq_len, Tensor):  # 0-dim, possibly on an accelerator: no host sync
        length = seq_len.to(device=device, dtype=dtype).reshape(())
        scaled = base * (factor * length / orig - (factor - 1)) ** power
        return torch.where(length > orig, scaled, torch.full_like(scaled, base))
    if isinstance(seq_len, bool) or not isinstance(seq_len, int):
        raise TypeError(f"seq_len must be an int, a 0-dim tensor or None, got {seq_len!r}")
    if seq_len <= orig:
        return base
    return base * (factor * seq_len / orig - (factor - 1)) ** power


def _yarn(s: RopeScaling, base: float, dim: int, device: torch.device | str | None,
          dtype: torch.dtype) -> Tensor:
    half = dim // 2
    orig, factor = s.original_max_position_embeddings, s.factor
    beta_fast, beta_slow = s.fast_slow
    truncate = True if s.truncate is None else s.truncate

    def correction_dim(rotations: float) -> float:  # the dim turning `rotations` times in O
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)  # transformers clips to dim - 1, not D/2 - 1
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    extrapolated = _plain(half, dim, base, device, dtype)  # (D/2,)
    interpolated = extrapolated / factor
    ramp = ((torch.arange(half, device=device, dtype=dtype) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # (D/2,) weight of the extrapolated frequency
    return interpolated * (1 - keep) + extrapolated * keep


def _llama3(s: RopeScaling, base: float, dim: int, device: torch.device | str | None,
            dtype: torch.dtype) -> Tensor:
    inv = _plain(dim // 2, dim, base, device, dtype)  # (D/2,)
    orig, factor = s.original_max_position_embeddings, s.factor
    low, high = s.low_freq_factor, s.high_freq_factor
    wavelen = 2 * math.pi / inv
    long = wavelen > orig / low
    out = torch.where(long, inv / factor, inv)
    smooth = (orig / wavelen - low) / (high - low)
    blended = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < orig / high) & ~long
    return torch.where(medium, blended, out)


def rope_frequencies(
    head_dim: int, base: float, scaling: RopeScaling | None = None, *,
    seq_len: int | Tensor | None = None, device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[Tensor, float]:
    """The scaled RoPE frequencies and attention factor for a head of ``head_dim`` dims.

    Args:
        head_dim: D, positive and even (> 2 for "dynamic", whose exponent is D/(D−2)).
        base: θ base (transformers' ``rope_theta``), a finite number > 1.
        scaling: a ``RopeScaling``, or None for plain RoPE (``base^(-2i/D)``, factor 1).
        seq_len: "dynamic" only: the call's length ``max(position) + 1`` (an int or a 0-dim
            integer tensor, read on its device without a host sync); None or <= O leaves the
            base as it is. Ignored by the other types.
        device, dtype: of the result (fp64 by default; fp32 where a device has no fp64).

    Returns:
        ``(inv_freq (D/2,), attention_factor)``: pair i turns by ``pos · inv_freq[i]``, and
        cos and sin are multiplied by ``attention_factor`` (a float).

    Raises:
        ValueError: a bad head_dim or base; TypeError: a scaling that is not a RopeScaling.
    """
    dim = _check_head_dim(head_dim)
    if isinstance(base, bool) or not isinstance(base, (int, float)) \
            or not math.isfinite(base) or base <= 1:
        raise ValueError(f"base must be a finite number > 1, got {base!r}")
    base = float(base)
    if scaling is None:
        return _plain(dim // 2, dim, base, device, dtype), 1.0
    if not isinstance(scaling, RopeScaling):
        raise TypeError(f"scaling must be a RopeScaling or None, got {type(scaling).__name__}")
    kind = scaling.rope_type
    if kind == "linear":
        inv = _plain(dim // 2, dim, base, device, dtype) / scaling.factor
    elif kind == "dynamic":
        if dim <= 2:
            raise ValueError(f"RopeScaling: dynamic needs head_dim > 2 (its exponent is "
                             f"D/(D-2)), got head_dim={dim}")
        inv = _plain(dim // 2, dim, _dynamic_base(scaling, base, dim, seq_len, device, dtype),
                     device, dtype)
    elif kind == "llama3":
        inv = _llama3(scaling, base, dim, device, dtype)
    else:
        inv = _yarn(scaling, base, dim, device, dtype)
    return inv, scaling.resolved_attention_factor()
