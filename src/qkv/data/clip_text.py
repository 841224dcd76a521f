"""Texts as a CLIP text tower reads them (``qkv.models.CLIP.encode_text``), for training,
evaluation and inference alike.

Shapes: B texts, N the longest row (bos + text + eos).

``encode_texts(tokenizer, texts)`` -> ``(input_ids (B, N) int64, attention_mask (B, N)
bool)``: each row bos + the text's ids + eos, right-padded with the tokenizer's pad id; the
mask is True at real tokens (the mask convention, docs/ARCHITECTURE.md: Masks: True = "may
attend"). With "eos" pooling the tower reads the row at its eos.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["encode_texts"]


def encode_texts(tokenizer: Any, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
    """Texts as the CLIP text tower reads them: ``(input_ids (B, N), attention_mask (B,
    N))``, each row bos + text + eos right-padded with the pad id to the longest row N;
    the mask (bool) is True at real tokens.

    Args:
        tokenizer: a qkv tokenizer (``bos_id``, ``eos_id``, ``pad_id``, ``encode``).
        texts: B strings.

    Raises:
        TypeError naming ``texts`` when it is not a non-empty list of strings.
    """
    if isinstance(texts, str) or not isinstance(texts, Sequence) or not texts or not all(
            isinstance(t, str) for t in texts):
        raise TypeError(f"encode_texts: texts must be a non-empty list of strings, got "
                        f"{texts!r:.80}")
    rows = [[tokenizer.bos_id, *tokenizer.encode(t), tokenizer.eos_id] for t in texts]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_id, dtype=torch.long)  # (B, N)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)  # (B, N)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, :len(row)] = True
    return ids, mask
