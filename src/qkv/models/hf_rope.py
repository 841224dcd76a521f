"""The RoPE fields of a HuggingFace config.json <-> qkv's RoPE base and scaling.

No tensors here (no shapes). ``rope_from_hf`` reads the base (θ, ``rope_theta``) and the
scaling (``qkv.modules.rope_scaling.RopeScaling.to_dict()`` form, None for none) the way
transformers 5.24's ``RotaryEmbeddingConfigMixin`` standardizes them, from either spelling:

- transformers 4.x: top-level ``rope_theta`` and ``rope_scaling`` (None, or a dict with
  ``"type"`` or ``"rope_type"``);
- transformers 5.x: ``rope_parameters``, one flat dict with ``rope_theta`` and ``rope_type``.

transformers' priorities are kept: a ``rope_scaling`` dict wins over ``rope_parameters``; θ
inside the dict over the top-level ``rope_theta`` over 10000; ``rope_type`` over ``type``;
for llama3 and yarn a top-level ``original_max_position_embeddings`` (Phi-3 writes one) over
the dict's over ``max_position_embeddings``; for dynamic, O is ``max_position_embeddings``
(transformers reads nothing else). A key the type does not read is ignored with a warning.

``rope_to_hf`` writes the inverse: ``rope_parameters`` as transformers 5.24 writes it, and the
4.x ``rope_theta`` / ``rope_scaling`` for older readers.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from ..files import CheckpointError
from ..modules.rope_scaling import ROPE_TYPES, RopeScaling, rope_frequencies

__all__ = ["SUPPORTED_ROPE_TYPES", "rope_from_hf", "rope_to_hf"]

#: the rope_type values ``rope_from_hf`` accepts ("default" is no scaling)
SUPPORTED_ROPE_TYPES = ("default", *ROPE_TYPES)

#: transformers' θ when a config names none (``RotaryEmbeddingConfigMixin.default_theta``)
_DEFAULT_THETA = 10000.0

#: keys of the rope dict read whatever the type (the type itself, θ, partial rotation)
_ALWAYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}

#: keys each type reads (transformers 5.24's ROPE_INIT_FUNCTIONS)
_READS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "llama3": {"factor", "original_max_position_embeddings", "low_freq_factor",
               "high_freq_factor"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "attention_factor", "mscale", "mscale_all_dim", "truncate"},
}


def _rope_dict(hf: dict[str, Any], source: str) -> tuple[str, dict[str, Any]]:
    """(the field read, a copy of the rope dict) with transformers' priority."""
    for field in ("rope_scaling", "rope_parameters"):
        value = hf.get(field)
        if value is not None and not isinstance(value, dict):
            raise CheckpointError(f"{source}: config.json {field} must be a dict or null, "
                                  f"got {value!r}")
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = dict(hf.get(field) or {})
    nested = sorted(k for k, v in params.items() if isinstance(v, dict))
    if nested:
        raise CheckpointError(f"{source}: config.json {field} holds per-layer-type RoPE "
                              f"parameters {nested}; qkv reads one flat dict")
    return field, params


def rope_from_hf(hf: dict[str, Any], source: str, head_dim: int) -> tuple[float, dict | None]:
    """RoPE base and scaling from an HF config dict (config.json), either spelling.

    Args:
        hf: the config.json dict (its ``max_position_embeddings`` is read for dynamic, and
            for llama3/yarn when no ``original_max_position_embeddings`` is given).
        source: the checkpoint's name, for error messages.
        head_dim: D of the attention heads (the scaling is checked against it).

    Returns:
        ``(base, scaling)``: θ as a float, and ``RopeScaling.to_dict()`` of the scaling or
        None (no ``rope_scaling`` / ``rope_parameters``, or rope_type "default"). Pass them
        as ``RoPE(head_dim, base=base, scaling=scaling)``.

    Raises:
        CheckpointError: ``partial_rotary_factor`` other than 1.0; rope_type "longrope" or
            one qkv does not know (one line naming it and ``SUPPORTED_ROPE_TYPES``); a
            missing or invalid value (named).

    Warns:
        UserWarning: keys of the rope dict that transformers does not read for its type.
    """
    field, p = _rope_dict(hf, source)
    base = p.get("rope_theta")
    if base is None:
        base = hf.get("rope_theta")
    if base is None:
        base = _DEFAULT_THETA
    if isinstance(base, bool) or not isinstance(base, (int, float)) \
            or not math.isfinite(base) or base <= 1:
        raise CheckpointError(f"{source}: config.json rope_theta must be a finite number > 1, "
                              f"got {base!r}")
    partial = p.get("partial_rotary_factor")
    if partial is None:
        partial = hf.get("partial_rotary_factor")
    if partial is not None and partial != 1.0:
        raise CheckpointError(f"{source}: config.json partial_rotary_factor={partial!r}: qkv's "
                              "RoPE rotates the whole head (only 1.0)")
    kind = p.get("rope_type") or p.get("type") or "default"
    if kind == "longrope":
        raise CheckpointError(f"{source}: config.json {field} rope_type 'longrope': qkv does "
                              "not compute longrope (transformers switches between its short "
                              "and long factors by the length of each call)")
    if kind not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(f"{source}: config.json {field} rope_type {kind!r} is not "
                              f"supported; qkv computes {list(SUPPORTED_ROPE_TYPES)}")
    ignored = sorted(set(p) - _ALWAYS - _READS[kind])
    if ignored:
        warnings.warn(f"{source}: config.json {field} keys {ignored} ignored: transformers "
                      f"does not read them for rope_type {kind!r}", UserWarning, stacklevel=2)
    if kind == "default":
        return float(base), None
    d: dict[str, Any] = {"rope_type": kind}
    try:
        if "factor" not in p:
            raise ValueError(f"rope_type {kind!r} needs factor")
        d["factor"] = p["factor"]
        max_pos = hf.get("max_position_embeddings")
        if kind == "dynamic":
            d["original_max_position_embeddings"] = max_pos
        elif kind in ("llama3", "yarn"):
            orig = hf.get("original_max_position_embeddings")
            if orig is None:
                orig = p.get("original_max_position_embeddings")
            d["original_max_position_embeddings"] = max_pos if orig is None else orig
        if kind != "linear" and d["original_max_position_embeddings"] is None:
            raise ValueError("original_max_position_embeddings or max_position_embeddings "
                             "is needed")
        if kind == "llama3":
            d["low_freq_factor"] = p.get("low_freq_factor")
            d["high_freq_factor"] = p.get("high_freq_factor")
        if kind == "yarn":
            if d["factor"] is None and isinstance(max_pos, (int, float)):
                # transformers: the ratio of the two context lengths (DeepSeek-V3)
                d["factor"] = max_pos / d["original_max_position_embeddings"]
            for name in ("beta_fast", "beta_slow"):
                if p.get(name):  # transformers: `get(name) or default`, so 0 is the default
                    d[name] = p[name]
            for name in ("attention_factor", "mscale", "mscale_all_dim"):
                if p.get(name) is not None:
                    d[name] = p[name]
            if "truncate" in p:  # transformers: `get("truncate", True)`, so null is False
                d["truncate"] = False if p["truncate"] is None else p["truncate"]
        scaling = RopeScaling.from_dict(d)
        rope_frequencies(head_dim, float(base), scaling)  # e.g. dynamic with D = 2
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{source}: config.json {field} ({kind}): {err}") from err
    return float(base), scaling.to_dict()


def rope_to_hf(base: float, scaling: RopeScaling | dict | None) -> dict[str, Any]:
    """The config.json RoPE fields for ``RoPE(D, base=base, scaling=scaling)``.

    Returns ``{"rope_parameters": {"rope_type", "rope_theta", ...}, "rope_theta": base,
    "rope_scaling": {"type", "rope_type", ...} or None}``: ``rope_parameters`` as
    transformers 5.24's ``LlamaConfig`` writes it (5.x reads it; a 5.x ``rope_scaling`` of
    the same content wins over it and agrees), ``rope_theta`` / ``rope_scaling`` for
    transformers 4.x (both "type" and "rope_type", θ left out of the dict). For "dynamic"
    transformers reads O from ``max_position_embeddings``, so the dict also carries
    ``"max_position_embeddings": O``: update the config.json dict with this one last.
    ``rope_from_hf`` of the result gives back ``(base, scaling.to_dict())``.

    Raises:
        ValueError / TypeError: a bad base or scaling (as ``RopeScaling.from_dict``).
    """
    if isinstance(base, bool) or not isinstance(base, (int, float)) \
            or not math.isfinite(base) or base <= 1:
        raise ValueError(f"rope_to_hf: base must be a finite number > 1, got {base!r}")
    base = float(base)
    if scaling is None:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": base},
                "rope_theta": base, "rope_scaling": None}
    if not isinstance(scaling, RopeScaling):
        scaling = RopeScaling.from_dict(scaling)
    fields = scaling.to_dict()
    kind = fields.pop("rope_type")
    out: dict[str, Any] = {}
    if kind == "dynamic":  # transformers warns of it in the dict and reads max_position_...
        out["max_position_embeddings"] = fields.pop("original_max_position_embeddings")
    out["rope_parameters"] = {"rope_type": kind, "rope_theta": base, **fields}
    out["rope_theta"] = base
    out["rope_scaling"] = {"type": kind, "rope_type": kind, **fields}
    return out
