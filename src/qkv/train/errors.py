"""``ConfigError``: a training setting that cannot be trained, naming its field. Raised by
``TrainConfig`` and by the model kinds' ``check_config`` (``qkv.train.kinds``); it lives on
the ground floor of ``qkv.train`` so that both may raise it without importing each other.

Shapes: none.
"""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A training setting out of range or of the wrong type; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
