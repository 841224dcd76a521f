"""``LoraConfig``: what a LoRA adapter adds to a model (rank, scale, dropout, target roles).

Targets name *roles*, not module paths, so one config fits every qkv model:

- ``"q"``, ``"k"``, ``"v"``: each a separate low-rank update on its own rows of the fused
  QKV projection (``in_proj``, rows q, k, v), or on ``q_proj`` / the key or value rows of
  ``kv_proj`` in a cross-attention whose context width differs from the model width;
- ``"qkv"``: one update over the whole fused projection (as HF PEFT on GPT-2's ``c_attn``
  or Phi-3's ``qkv_proj``; with separate ``q_proj`` / ``kv_proj``, one update on each);
- ``"out"``: the attention output projection ``out_proj``;
- ``"ffn_in"``, ``"ffn_out"``: the feed-forward ``fc_in`` (C -> F; a gated FFN's fused
  gate/up C -> 2F as one update, as HF PEFT on Phi-3's ``gate_up_proj``) and ``fc_out``
  (F -> C);
- ``"gate"``, ``"up"``: each a separate update on its own rows of a gated FFN's (``SwiGLU``,
  any gate activation) fused ``fc_in``: gate rows [0, F), up rows [F, 2F) (HF's
  ``gate_proj`` / ``up_proj``). A model with no gated FFN refuses them; in a model with both
  kinds (Flamingo's plain cross-attention FFNs beside a Llama-style LM) they adapt the gated
  ones only;
- ``"down"``: HF's name of the FFN output projection (``down_proj``): another name of
  ``"ffn_out"``, stored as ``"ffn_out"`` (``ALIASES``);
- ``"all-linear"``: every projection of every layer but the LM head, as HF PEFT's
  ``"all-linear"``: q, k, v and out on attention, gate, up and ffn_out on a gated FFN,
  ffn_in and ffn_out on a plain one (``expand_targets``); given alone.

``"qkv"`` and ``"q"``/``"k"``/``"v"`` cover the same rows and cannot be combined; nor can
``"ffn_in"`` and ``"gate"``/``"up"``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["ALIASES", "ALL_LINEAR", "MAX_SCALE", "ROLES", "TARGETS", "LoraConfig",
           "expand_targets"]

#: the roles of the projections' row blocks, in the order updates are laid out (the
#: parameter names ``A_<role>`` / ``B_<role>``)
ROLES = ("q", "k", "v", "qkv", "out", "ffn_in", "gate", "up", "ffn_out")

#: other names of a role, normalised by ``LoraConfig`` (HF's ``down_proj`` is ``fc_out``)
ALIASES = {"down": "ffn_out"}

#: the target that stands for every projection of every layer (HF PEFT's "all-linear")
ALL_LINEAR = "all-linear"

#: every name ``LoraConfig.targets`` accepts: the roles, their aliases and "all-linear"
TARGETS = (*ROLES, *ALIASES, ALL_LINEAR)

#: the roles "all-linear" picks on a projection, finest first: a projection holding none of
#: them (a plain FFN's fc_in, whose only role is "ffn_in") takes its whole-projection role
_FINE = ("q", "k", "v", "out", "gate", "up", "ffn_out")
_WHOLE = ("qkv", "ffn_in")


def expand_targets(targets: tuple[str, ...], site_roles: dict[str, tuple[int, int]] | tuple
                   ) -> tuple[str, ...]:
    """The roles of ``targets`` (a ``LoraConfig.targets``) one projection takes, given the
    roles it has (``site_roles``: role -> output rows, or just the role names), in
    ``ROLES`` order. "all-linear" takes the finest roles the projection has: q/k/v (not
    "qkv") on attention, gate/up (not "ffn_in") on a gated FFN's fc_in, "ffn_in" on a plain
    FFN's."""
    if ALL_LINEAR in targets:
        fine = tuple(r for r in _FINE if r in site_roles)
        return tuple(r for r in ROLES
                     if r in (fine or tuple(w for w in _WHOLE if w in site_roles)))
    return tuple(r for r in targets if r in site_roles)

#: the largest LoRA scale (alpha / r, or alpha / √r) a config accepts. Published settings
#: sit between 0.25 (QLoRA: alpha 16, r 64) and ~16 (alpha 2r with rsLoRA at r = 64); a
#: scale of 1000 already multiplies the learned update a thousandfold. Beyond it the update
#: dominates the base outputs and overflows soon after (alpha = 1e300 gives inf in the
#: first forward), so such a value is a typo or a corrupt file, not a setting.
MAX_SCALE = 1000.0


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """A LoRA adapter (Hu et al. 2021): W x + (alpha / r) · B A dropout(x).

    Shapes: per targeted row block of Rows output rows and In input features, A is (r, In)
    (Kaiming-uniform, a = √5, as HF PEFT) and B is (Rows, r) (zeros, so the model is
    unchanged until trained).

    Args:
        r: the rank, a positive int.
        alpha: the scale numerator, a positive finite number: scale = alpha / r, or
            alpha / √r with ``rslora`` (Kalajdzievski 2023); the scale must be at most
            ``MAX_SCALE`` (1000).
        dropout: dropout probability on the LoRA input only (the base path sees x), applied
            in training mode only; in [0, 1).
        targets: a non-empty tuple of names from ``TARGETS`` (see the module docstring); a
            list is accepted and stored as a tuple, in ``ROLES`` order with aliases
            normalised ("down" -> "ffn_out"); "all-linear" alone.
        rslora: use the rank-stabilised scale alpha / √r.

    Raises:
        ValueError naming the field and its value.
    """

    r: int = 8
    alpha: float = 16
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "v")
    rslora: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r <= 0:
            raise ValueError(f"LoraConfig: r must be a positive int, got {self.r!r}")
        if (not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool)
                or not math.isfinite(self.alpha) or self.alpha <= 0):
            raise ValueError(f"LoraConfig: alpha must be a positive number, got {self.alpha!r}")
        if (not isinstance(self.dropout, (int, float)) or isinstance(self.dropout, bool)
                or not 0.0 <= self.dropout < 1.0):
            raise ValueError(f"LoraConfig: dropout must be in [0, 1), got {self.dropout!r}")
        if not isinstance(self.rslora, bool):
            raise ValueError(f"LoraConfig: rslora must be a bool, got {self.rslora!r}")
        targets = self.targets
        if isinstance(targets, str) or not isinstance(targets, (tuple, list)):
            raise ValueError(f"LoraConfig: targets must be a tuple of roles from {TARGETS}, "
                             f"got {targets!r}")
        given = tuple(targets)
        bad = [t for t in given if not isinstance(t, str) or t not in TARGETS]
        if not given or bad:
            raise ValueError(f"LoraConfig: targets must be a non-empty tuple of roles from "
                             f"{TARGETS}, got {given!r}")
        if ALL_LINEAR in given and len(given) > 1:
            raise ValueError(f"LoraConfig: targets {given!r}: {ALL_LINEAR!r} already names "
                             f"every projection; give it alone")
        targets = tuple(ALIASES.get(t, t) for t in given)
        if len(set(targets)) != len(targets):
            alias = [f"{a!r} is {r!r}" for a, r in ALIASES.items() if a in given]
            also = f" ({', '.join(alias)})" if alias else ""
            raise ValueError(f"LoraConfig: targets has duplicates: {given!r}{also}")
        for whole, parts, what in (("qkv", ("q", "k", "v"), "fused QKV projection"),
                                   ("ffn_in", ("gate", "up"), "gated FFN's fused fc_in")):
            if whole in targets and set(targets) & set(parts):
                names = "/".join(repr(p) for p in parts)
                raise ValueError(f"LoraConfig: targets {given!r}: {whole!r} (one update on the "
                                 f"whole {what}) and {names} (one per row block) cover the "
                                 f"same rows; pick one")
        object.__setattr__(self, "targets",
                           tuple(t for t in (*ROLES, ALL_LINEAR) if t in targets))
        if not self.scale <= MAX_SCALE:
            how = "alpha / sqrt(r)" if self.rslora else "alpha / r"
            raise ValueError(f"LoraConfig: alpha={self.alpha!r} with r={self.r} gives scale "
                             f"{how} = {self.scale:.3g}, beyond {MAX_SCALE:g}: the update "
                             f"would swamp the base outputs (usual scales are 0.25 to 16); "
                             f"lower alpha")

    @property
    def scale(self) -> float:
        """alpha / r, or alpha / √r with ``rslora``."""
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (targets as a list)."""
        d = dataclasses.asdict(self)
        d["targets"] = list(self.targets)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoraConfig:
        """Build from ``to_dict``'s output; unknown keys are a ValueError."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"LoraConfig: unknown fields {unknown}; known: {sorted(names)}")
        return cls(**{k: (tuple(v) if k == "targets" and isinstance(v, list) else v)
                      for k, v in data.items()})
