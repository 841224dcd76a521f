"""The token objective of the token kinds (transformer, gpt, bert-mlm) in the training step
and evaluation: the summed token cross-entropy of a batch and the number of predicted
tokens, so that a mean over several batches (or processes) is exact. Each kind's ``loss``
is its own (``qkv.train.kinds``; gpt's never builds the (B, N, V) logits); ``token_loss``
runs a kind's model to its logits and scores them here.

Shapes: B batch, N sequence length, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from .data import IGNORE

__all__ = ["token_cross_entropy", "token_loss"]


def token_cross_entropy(logits: Tensor, target: Tensor, *, label_smoothing: float = 0.0
                        ) -> tuple[Tensor, Tensor]:
    """``(loss_sum, count)``: the cross-entropy of ``logits`` (B, N, V) against ``target``
    (B, N) summed over the predicted tokens (target != -100; fp32 scalar), and their number
    (an int64 scalar)."""
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1),
                           ignore_index=IGNORE, reduction="sum", label_smoothing=label_smoothing)
    return loss, (target != IGNORE).sum()


def token_loss(kind: Any, model: nn.Module, batch: dict[str, Tensor], *,
               label_smoothing: float = 0.0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Run ``model`` on a batch of token model kind ``kind`` (the kind object, a
    ``qkv.train.kinds.TokenKind``: ``kind.make_batch``'s batch) to its logits.

    Returns:
        ``(loss_sum, count, logits, target)``: the cross-entropy summed over the predicted
        tokens (a scalar, fp32), their number (an int64 scalar), the logits (B, N, V) and
        the targets (B, N) with -100 where nothing is predicted.

    Raises:
        ValueError: a kind without a token objective (clip).
    """
    if not hasattr(kind, "logits_and_target"):
        raise ValueError(f"token_loss: model kind {getattr(kind, 'name', kind)!r} has no "
                         f"token objective; use its own loss (ModelKind.loss)")
    logits, target = kind.logits_and_target(model, batch)
    loss, count = token_cross_entropy(logits, target, label_smoothing=label_smoothing)
    return loss, count, logits, target
