"""Held-out evaluation during training: ``evaluate`` asks the run's model kind
(``qkv.train.kinds``). The token kinds share ``evaluate_tokens``: loss, and the metric a
user reads — exact match of greedy outputs for pair tasks (Transformer, GPT; decoded with
``qkv.generation.translate`` / ``complete``), masked-token accuracy for BERT. Evaluation
runs in eval mode under ``torch.no_grad`` and restores the training flag.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .data import IGNORE, PairData, TextData, make_batch
from .loss import token_loss

__all__ = ["evaluate", "evaluate_tokens", "exact_match"]

DECODE_BATCH = 250


def exact_match(predictions: list[str], targets: list[str]) -> float:
    """Fraction of predictions equal to their target (0.0 for empty lists)."""
    if len(predictions) != len(targets):
        raise ValueError(f"{len(predictions)} predictions for {len(targets)} targets")
    return sum(p == t for p, t in zip(predictions, targets, strict=True)) / max(len(targets), 1)


def evaluate(kind: str, model: nn.Module, tokenizer: Any, data: Any,
             count: int) -> dict[str, float]:
    """Metrics of model kind ``kind`` on ``count`` held-out examples (``eval_loss`` and the
    kind's own: ``get_kind(kind).evaluate``)."""
    from .kinds import get_kind

    return get_kind(kind).evaluate(model, tokenizer, data, count)


def evaluate_tokens(kind: str, model: nn.Module, tokenizer: Any, data: PairData | TextData,
                    count: int, *, masked_accuracy: bool = False,
                    decode: Callable[..., list[str]] | None = None) -> dict[str, float]:
    """A token kind's metrics on ``count`` held-out examples: ``eval_loss`` (mean token
    cross-entropy, no label smoothing), plus ``masked_accuracy`` (argmax == label over the
    predicted tokens) when asked, or ``exact_match`` of ``decode(model, tokenizer, sources,
    batch_size=...)`` against the targets when ``data`` holds pairs and ``decode`` is given.
    """
    was_training = model.training
    device = next(model.parameters()).device
    model.eval()
    try:
        with torch.no_grad():
            items = data.heldout(count)
            total, n, correct = 0.0, 0, 0
            step = DECODE_BATCH
            for i in range(0, len(items), step):
                batch = {k: t.to(device) for k, t in make_batch(
                    kind, items[i:i + step], tokenizer, step=-1 - i).items()}
                loss, k, logits, target = token_loss(kind, model, batch)
                total, n = total + loss.item(), n + int(k)
                if masked_accuracy:
                    sel = target != IGNORE
                    correct += int((logits.argmax(-1)[sel] == target[sel]).sum())
            result = {"eval_loss": total / max(n, 1)}
            if masked_accuracy:
                result["masked_accuracy"] = correct / max(n, 1)
            elif decode is not None and isinstance(data, PairData):
                sources, targets = [s for s, _ in items], [t for _, t in items]
                preds = decode(model, tokenizer, sources, batch_size=DECODE_BATCH)
                result["exact_match"] = exact_match(preds, targets)
    finally:
        model.train(was_training)
    return result
