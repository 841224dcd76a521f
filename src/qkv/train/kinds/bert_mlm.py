"""Model kind "bert-mlm": a masked language model (``qkv.models.BERT`` with its MLM head)
on pairs (bos + source + " " + target + eos) or a plain-text file (windows of ``max_len``
tokens).

Shapes: B batch, N sequence length, V vocabulary.

Batch: ``ids`` (B, N) corrupted, ``attention_mask`` (B, N) True at real tokens, ``labels``
(B, N) the original ids where a prediction is asked, -100 elsewhere. 15 % of the real
tokens are chosen (at least one per row), 80 % of them -> the mask token, 10 % random, 10 %
kept; the mask token is the tokenizer's ``mask_id`` when it has one, else ``<unk>`` (qkv's
char and BPE tokenizers have no separate mask token). The corruption is drawn from a
generator seeded by (seed, step), so a batch is a function of the step and N processes
corrupt their rows of the global batch as one process would. Evaluation: token loss and
masked-token accuracy.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn

from ...data.tokenizer import SPECIALS
from ...models import BERT, BERTConfig
from ..data import IGNORE, derived_seed, pad_rows
from .text import TokenKind

__all__ = ["MLM_FRACTION", "BertMLMKind"]

MLM_FRACTION = 0.15


class BertMLMKind(TokenKind):
    """The masked-language-model kind (see the module docstring)."""

    name = "bert-mlm"
    default_preset = "bert-tiny"
    model_class = BERT
    model_types = ("qkv-bert", "bert")
    target_key = "labels"
    masked_accuracy = True

    def pair_tokens(self, source: int, target: int) -> int:
        return source + target + 3  # bos source " " target eos

    def build_model(self, config: Any, tokenizer: Any, max_len: int) -> nn.Module:
        base = dict(vocab_size=tokenizer.vocab_size, max_len=max_len,
                    pad_token_id=tokenizer.pad_id, with_pooler=False)
        return BERT(BERTConfig.from_name(config.model_preset, **{**base, **config.overrides}))

    def check_base(self, model: nn.Module, init_from: Any) -> None:
        if not getattr(model.config, "with_mlm_head", True):
            raise ValueError(f"--init-from {init_from}: this BERT has no masked-LM head "
                             f"(with_mlm_head false), which bert-mlm training needs")

    def make_batch(self, items: Any, tokenizer: Any, *, step: int = 0,
                   seed: int = 0) -> dict[str, Tensor]:
        if isinstance(items, Tensor):  # text windows (B, W + 1): W tokens, its max_len
            rows = [r.tolist() for r in items[:, :-1]]
        else:
            bos, eos = tokenizer.bos_id, tokenizer.eos_id
            rows = [[bos, *tokenizer.encode(f"{s} {t}"), eos] for s, t in items]
        return mlm_batch(rows, tokenizer, step=step, seed=seed)

    def logits_and_target(self, model: nn.Module, batch: dict[str, Tensor]
                          ) -> tuple[Tensor, Tensor]:
        with warnings.catch_warnings():
            # FSDP2 (--fsdp) warns that the sharded BERT's forward returns a view tensor: its
            # last_hidden_state is TokenRows.unpack's (T, C) -> (B, N, C) view. That is only
            # harmful if an in-place op is applied to the view (it would skip the hook that
            # all-gathers for backward); masked_lm feeds it to the MLM head's out-of-place
            # ops only, so the gradients are right and the warning is noise.
            warnings.filterwarnings("ignore", category=UserWarning, message=(
                r"FSDP2-wrapped module \(FSDPBERT\) returned a view tensor"))
            logits = model.masked_lm(batch["ids"], batch["attention_mask"])
        return logits, batch["labels"]


def mlm_batch(rows: list[list[int]], tokenizer: Any, *, step: int, seed: int
              ) -> dict[str, Tensor]:
    """The MLM batch of token ``rows`` (see the module docstring)."""
    ids = pad_rows(rows, tokenizer.pad_id)  # (B, N)
    keep = ids != tokenizer.pad_id
    special = keep & ((ids == tokenizer.bos_id) | (ids == tokenizer.eos_id))
    g = torch.Generator().manual_seed(derived_seed(seed, step))
    chosen = (torch.rand(ids.shape, generator=g) < MLM_FRACTION) & keep & ~special
    # every row predicts at least one token (its first real non-special one if none chosen)
    candidates = keep & ~special
    none = ~chosen.any(dim=1) & candidates.any(dim=1)
    first = candidates.float().argmax(dim=1)
    chosen[none, first[none]] = True
    labels = torch.where(chosen, ids, torch.full_like(ids, IGNORE))
    roll = torch.rand(ids.shape, generator=g)
    random_ids = torch.randint(len(SPECIALS), tokenizer.vocab_size, ids.shape, generator=g)
    corrupted = torch.where(chosen & (roll < 0.8), torch.full_like(ids, _mask_id(tokenizer)), ids)
    corrupted = torch.where(chosen & (roll >= 0.8) & (roll < 0.9), random_ids, corrupted)
    return {"ids": corrupted, "attention_mask": keep, "labels": labels}


def _mask_id(tokenizer: Any) -> int:
    """The MLM mask token: the tokenizer's ``mask_id`` if it has one, else ``unk_id``."""
    return getattr(tokenizer, "mask_id", tokenizer.unk_id)
