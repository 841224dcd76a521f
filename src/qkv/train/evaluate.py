"""Held-out evaluation during training: loss, and the metric a user reads — exact match of
greedy outputs for pair tasks (Transformer, GPT; decoded with ``qkv.generation.translate`` /
``complete``), masked-token accuracy for BERT. ``evaluate`` runs in eval mode under
``torch.no_grad`` and restores the training flag.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .data import IGNORE, PairData, TextData, make_batch
from .loss import token_loss

__all__ = ["evaluate", "exact_match"]

DECODE_BATCH = 250


def exact_match(predictions: list[str], targets: list[str]) -> float:
    """Fraction of predictions equal to their target (0.0 for empty lists)."""
    if len(predictions) != len(targets):
        raise ValueError(f"{len(predictions)} predictions for {len(targets)} targets")
    return sum(p == t for p, t in zip(predictions, targets, strict=True)) / max(len(targets), 1)


def evaluate(kind: str, model: nn.Module, tokenizer: Any, data: PairData | TextData,
             count: int) -> dict[str, float]:
    """Metrics on ``count`` held-out examples: ``eval_loss`` (mean token cross-entropy, no
    label smoothing), plus ``exact_match`` (pairs; Transformer/GPT) or ``masked_accuracy``
    (BERT)."""
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
                if kind == "bert-mlm":
                    sel = target != IGNORE
                    correct += int((logits.argmax(-1)[sel] == target[sel]).sum())
            result = {"eval_loss": total / max(n, 1)}
            if kind == "bert-mlm":
                result["masked_accuracy"] = correct / max(n, 1)
            elif isinstance(data, PairData):
                from ..generation import complete, translate

                sources, targets = [s for s, _ in items], [t for _, t in items]
                if kind == "transformer":
                    preds = translate(model, tokenizer, sources, batch_size=DECODE_BATCH)
                else:
                    preds = complete(model, tokenizer, sources, batch_size=DECODE_BATCH)
                result["exact_match"] = exact_match(preds, targets)
    finally:
        model.train(was_training)
    return result
