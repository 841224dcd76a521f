"""What a held-out evaluation reports beside its loss: ``exact_match`` of greedy outputs
(each model kind evaluates itself, ``ModelKind.evaluate``; the token kinds' evaluation is
``qkv.train.kinds.TokenKind.evaluate``), and the batch size it decodes and scores with.

Shapes: none (strings).
"""

from __future__ import annotations

__all__ = ["DECODE_BATCH", "exact_match"]

#: held-out examples scored (and decoded) at a time
DECODE_BATCH = 250


def exact_match(predictions: list[str], targets: list[str]) -> float:
    """Fraction of predictions equal to their target (0.0 for empty lists)."""
    if len(predictions) != len(targets):
        raise ValueError(f"{len(predictions)} predictions for {len(targets)} targets")
    return sum(p == t for p, t in zip(predictions, targets, strict=True)) / max(len(targets), 1)
