"""What trains: trainable / total parameter counts of a model, in one line."""

from __future__ import annotations

from torch import nn

__all__ = ["count_parameters", "trainable_summary"]


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter element counts of ``model``; a parameter shared by
    several modules (tied embeddings) counts once, as ``model.parameters()`` yields it."""
    trainable = total = 0
    for p in model.parameters():
        total += p.numel()
        if p.requires_grad:
            trainable += p.numel()
    return trainable, total


def trainable_summary(model: nn.Module) -> str:
    """One line: ``trainable params: 73,728 || all params: 124,513,536 || trainable%: 0.0592``
    (HF PEFT's ``print_trainable_parameters`` wording)."""
    trainable, total = count_parameters(model)
    pct = 100.0 * trainable / total if total else 0.0
    return f"trainable params: {trainable:,} || all params: {total:,} || trainable%: {pct:.4f}"
