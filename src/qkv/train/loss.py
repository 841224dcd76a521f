"""The training objective of each model kind, shared by the training step and evaluation:
the summed token cross-entropy of a batch and the number of predicted tokens, so that a mean
over several batches (or processes) is exact."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from .data import IGNORE

__all__ = ["token_loss"]


def token_loss(kind: str, model: nn.Module, batch: dict[str, Tensor], *,
               label_smoothing: float = 0.0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Run ``model`` on a ``make_batch`` batch of model kind ``kind``.

    Returns:
        ``(loss_sum, count, logits, target)``: the cross-entropy summed over the predicted
        tokens (a scalar, fp32), their number (an int64 scalar), the logits (B, N, V) and
        the targets (B, N) with -100 where nothing is predicted.
    """
    if kind == "transformer":
        logits, target = model(batch["src"], batch["tgt_in"]), batch["tgt_out"]
    elif kind == "gpt":
        logits, target = model(batch["ids"]), batch["targets"]
    else:
        logits = model.masked_lm(batch["ids"], batch["attention_mask"])
        target = batch["labels"]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1),
                           ignore_index=IGNORE, reduction="sum", label_smoothing=label_smoothing)
    return loss, (target != IGNORE).sum(), logits, target
