"""Held-out evaluation during training: loss, and the metric a user reads — exact match of
greedy outputs for pair tasks (Transformer, GPT), masked-token accuracy for BERT.

``translate`` / ``complete`` decode lists of strings with ``qkv.generate``; ``evaluate``
runs everything in eval mode under ``torch.no_grad`` and restores the training flag.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .data import IGNORE, PairData, TextData, gpt_prompts, make_batch

__all__ = ["complete", "evaluate", "exact_match", "translate"]

DECODE_BATCH = 250


def _cut(ids: list[int], eos: int) -> list[int]:
    return ids[:ids.index(eos)] if eos in ids else ids


def translate(model: nn.Module, tokenizer: Any, sources: list[str], *, max_new_tokens: int,
              num_beams: int = 1) -> list[str]:
    """Encoder-decoder outputs for source strings (greedy, or beam search with
    ``num_beams`` > 1), decoded to strings; batches of 250."""
    from ..generation import generate

    out: list[str] = []
    for i in range(0, len(sources), DECODE_BATCH):
        chunk = [(s, "") for s in sources[i:i + DECODE_BATCH]]
        src = make_batch("transformer", chunk, tokenizer)["src"]  # (B, S)
        ids = generate(model, src, max_new_tokens=max_new_tokens, num_beams=num_beams)
        out += [tokenizer.decode(_cut(row[1:], tokenizer.eos_id)) for row in ids.tolist()]
    return out


def complete(model: nn.Module, tokenizer: Any, sources: list[str], *, max_new_tokens: int,
             num_beams: int = 1) -> list[str]:
    """GPT answers to pair sources: prompts bos + source + eos, left-padded, continued until
    eos (or the model's ``max_len``); the new tokens decoded to strings."""
    from ..generation import generate

    out: list[str] = []
    for i in range(0, len(sources), DECODE_BATCH):
        prompts = gpt_prompts(sources[i:i + DECODE_BATCH], tokenizer)
        width = max(len(p) for p in prompts)
        budget = min(max_new_tokens, model.config.max_len - width + 1)
        ids = torch.tensor([[tokenizer.pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        res = generate(model, ids, attention_mask=mask, max_new_tokens=budget,
                       num_beams=num_beams, pad_token_id=tokenizer.pad_id,
                       eos_token_id=tokenizer.eos_id)
        out += [tokenizer.decode(_cut(row[width:], tokenizer.eos_id)) for row in res.tolist()]
    return out


def exact_match(predictions: list[str], targets: list[str]) -> float:
    """Fraction of predictions equal to their target (0.0 for empty lists)."""
    if len(predictions) != len(targets):
        raise ValueError(f"{len(predictions)} predictions for {len(targets)} targets")
    return sum(p == t for p, t in zip(predictions, targets, strict=True)) / max(len(targets), 1)


def _loss(kind: str, model: nn.Module, batch: dict[str, Tensor]) -> tuple[float, int, Tensor,
                                                                          Tensor]:
    if kind == "transformer":
        logits, target = model(batch["src"], batch["tgt_in"]), batch["tgt_out"]
    elif kind == "gpt":
        logits, target = model(batch["ids"]), batch["targets"]
    else:
        logits, target = model.masked_lm(batch["ids"], batch["attention_mask"]), batch["labels"]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")
    return loss.item(), int((target != IGNORE).sum()), logits, target


def evaluate(kind: str, model: nn.Module, tokenizer: Any, data: PairData | TextData,
             count: int, max_len: int) -> dict[str, float]:
    """Metrics on ``count`` held-out examples: ``eval_loss`` (mean token cross-entropy, no
    label smoothing), plus ``exact_match`` (pairs; Transformer/GPT) or ``masked_accuracy``
    (BERT)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            items = data.heldout(count)
            total, n, correct = 0.0, 0, 0
            step = DECODE_BATCH
            for i in range(0, len(items), step):
                batch = make_batch(kind, items[i:i + step], tokenizer, step=-1 - i)
                loss, k, logits, target = _loss(kind, model, batch)
                total, n = total + loss, n + k
                if kind == "bert-mlm":
                    sel = target != IGNORE
                    correct += int((logits.argmax(-1)[sel] == target[sel]).sum())
            result = {"eval_loss": total / max(n, 1)}
            if kind == "bert-mlm":
                result["masked_accuracy"] = correct / max(n, 1)
            elif isinstance(data, PairData):
                sources, targets = [s for s, _ in items], [t for _, t in items]
                decode = translate if kind == "transformer" else complete
                budget = max_len - 1 if kind == "transformer" else max_len
                preds = decode(model, tokenizer, sources, max_new_tokens=budget)
                result["exact_match"] = exact_match(preds, targets)
    finally:
        model.train(was_training)
    return result
