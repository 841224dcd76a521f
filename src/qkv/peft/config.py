"""``LoraConfig``: what a LoRA adapter adds to a model (rank, scale, dropout, target roles).

Targets name *roles*, not module paths, so one config fits every qkv model:

- ``"q"``, ``"k"``, ``"v"``: each a separate low-rank update on its own rows of the fused
  QKV projection (``in_proj``, rows q, k, v), or on ``q_proj`` / the key or value rows of
  ``kv_proj`` in a cross-attention whose context width differs from the model width;
- ``"qkv"``: one update over the whole fused projection (as HF PEFT on GPT-2's ``c_attn``;
  with separate ``q_proj`` / ``kv_proj``, one update on each);
- ``"out"``: the attention output projection ``out_proj``;
- ``"ffn_in"``, ``"ffn_out"``: the feed-forward ``fc_in`` (C -> F, SwiGLU's fused gate/up
  C -> 2F) and ``fc_out`` (F -> C).

``"qkv"`` and ``"q"``/``"k"``/``"v"`` cover the same rows and cannot be combined.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["MAX_SCALE", "TARGETS", "LoraConfig"]

#: every LoRA target role, in the order updates are laid out
TARGETS = ("q", "k", "v", "qkv", "out", "ffn_in", "ffn_out")

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
        targets: a non-empty tuple of roles from ``TARGETS`` (see the module docstring); a
            list is accepted and stored as a tuple.
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
        targets = tuple(targets)
        bad = [t for t in targets if t not in TARGETS]
        if not targets or bad:
            raise ValueError(f"LoraConfig: targets must be a non-empty tuple of roles from "
                             f"{TARGETS}, got {targets!r}")
        if len(set(targets)) != len(targets):
            raise ValueError(f"LoraConfig: targets has duplicates: {targets!r}")
        if "qkv" in targets and set(targets) & {"q", "k", "v"}:
            raise ValueError(f"LoraConfig: targets {targets!r}: 'qkv' (one update on the whole "
                             f"fused projection) and 'q'/'k'/'v' (one per row block) cover the "
                             f"same rows; pick one")
        object.__setattr__(self, "targets", tuple(t for t in TARGETS if t in targets))
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
