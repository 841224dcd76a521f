"""The token objective shared by the token kinds (transformer, gpt, bert-mlm) in the
training step and evaluation: the summed token cross-entropy of a batch and the number of
predicted tokens, so that a mean over several batches (or processes) is exact. Each kind's
``loss`` is in its own file (``qkv.train.kinds``); ``token_loss`` asks the kind for the
logits and targets of a batch."""

from __future__ import annotations

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


def token_loss(kind: str, model: nn.Module, batch: dict[str, Tensor], *,
               label_smoothing: float = 0.0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Run ``model`` on a ``make_batch`` batch of token model kind ``kind``.

    Returns:
        ``(loss_sum, count, logits, target)``: the cross-entropy summed over the predicted
        tokens (a scalar, fp32), their number (an int64 scalar), the logits (B, N, V) and
        the targets (B, N) with -100 where nothing is predicted.

    Raises:
        ValueError: an unknown kind, or one without a token objective (clip).
    """
    from .kinds import get_kind

    spec = get_kind(kind)
    if not hasattr(spec, "logits_and_target"):
        raise ValueError(f"token_loss: model kind {kind!r} has no token objective; use "
                         f"qkv.train.kinds.get_kind({kind!r}).loss")
    logits, target = spec.logits_and_target(model, batch)
    loss, count = token_cross_entropy(logits, target, label_smoothing=label_smoothing)
    return loss, count, logits, target
