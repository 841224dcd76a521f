"""The base of every model config: ``ModelConfig`` (frozen dataclass, named presets, the
config.json round trip, the layer counts checked against a weights file) and
``check_norm_eps``, the range check every config applies to a norm's epsilon.

No tensors here (no shapes).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, TypeVar

from ..version import __version__

__all__ = ["NORM_EPS_RANGE", "ModelConfig", "check_norm_eps", "check_positive_int_or_none"]

C = TypeVar("C", bound="ModelConfig")

#: the accepted range of a norm's epsilon: positive, finite, not lost in fp32 (its smallest
#: normal is 1.2e-38), and at most 1 (a larger one swamps the variance it is added to)
NORM_EPS_RANGE = (1e-38, 1.0)


def check_positive_int_or_none(owner: str, name: str, value: Any) -> None:
    """ValueError naming ``owner: name`` unless ``value`` is None or a positive int (not a
    bool)."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or value < 1):
        raise ValueError(f"{owner}: {name} must be a positive int or None, got {value!r}")


def check_norm_eps(owner: str, value: Any, name: str = "norm_eps") -> None:
    """ValueError naming ``owner.name`` unless ``value`` is a real number (not a bool) in
    ``NORM_EPS_RANGE`` = [1e-38, 1] (so not NaN, inf, negative or zero)."""
    lo, hi = NORM_EPS_RANGE
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or not lo <= value <= hi):
        raise ValueError(f"{owner}: {name} must be a finite number in [{lo:g}, {hi:g}], "
                         f"got {value!r}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Base of frozen model configs: named presets, JSON round trip.

    ``LAYER_KEYS``: each config field that counts the layers of a stack (dotted for a field
    of a nested config: "vision.num_layers") -> a regex whose group 1 is the layer index in
    that stack's state-dict keys. ``from_pretrained`` compares them with the weights file's
    header before building anything (``check_layer_counts``)."""

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}
    MODEL_TYPE: ClassVar[str] = ""
    LAYER_KEYS: ClassVar[dict[str, str]] = {}

    @classmethod
    def from_name(cls: type[C], name: str, **overrides: Any) -> C:
        """A named preset (``cls.PRESETS``), optionally with fields overridden."""
        if name not in cls.PRESETS:
            raise ValueError(f"{cls.__name__}: unknown preset {name!r}; "
                             f"known: {sorted(cls.PRESETS)}")
        return cls.from_dict({**cls.PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls: type[C], data: dict[str, Any]) -> C:
        """Build from a dict; unknown keys are an error (a typo never passes silently)."""
        data = {k: v for k, v in data.items() if k not in ("model_type", "qkv_version")}
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown config fields {unknown}; "
                             f"known: {sorted(names)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict with ``model_type`` (what config.json holds)."""
        return {"model_type": self.MODEL_TYPE, "qkv_version": __version__,
                **dataclasses.asdict(self)}

    def layer_counts(self) -> list[tuple[str, Any, str]]:
        """(field, value, key regex) of each ``LAYER_KEYS`` field, for ``check_layer_counts``."""
        out = []
        for field, pattern in self.LAYER_KEYS.items():
            value: Any = self
            for part in field.split("."):
                value = getattr(value, part)
            out.append((field, value, pattern))
        return out
