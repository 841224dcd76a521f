"""Training data for ``qkv train``: where examples of the token kinds come from, the
helpers their batches are built with (``pad_rows``, ``gpt_prompts``, ``IGNORE``), and the
fingerprint of a data file (``file_fingerprint``). A batch is built by its model kind:
``qkv.train.kinds.get_kind(name).make_batch(items, tokenizer, step=..., seed=...)``.

Sources: an embedded generated task (``qkv.data.get_task``: dates, copy, reverse, sort,
addition), a TSV file of source/target pairs, or a plain-text file (language models).
Every batch is a pure function of the optimizer step (tasks are counter-based; files are
shuffled per epoch with a generator seeded by (seed, epoch)), so the data position of a
resumed run is its step.

Batch layouts (B batch, S source length, N target/sequence length), each built in its kind's
file (``qkv/train/kinds/transformer.py``, ``gpt.py``, ``bert_mlm.py``; clip's image-caption
batches in ``kinds/clip.py``):
- transformer: ``src`` (B, S) = source + eos, right-padded; ``tgt_in`` (B, N) = bos + target;
  ``tgt_out`` (B, N) = target + eos, padding = -100 (ignored by the loss).
- gpt: one sequence per pair, bos + source + eos + target + eos, right-padded; the loss
  covers the target and its eos only (``prompt`` = bos + source + eos is what generation
  starts from). Plain text: contiguous windows of ``max_len`` + 1 tokens. Chat-formatted
  pairs (``TrainConfig.chat``): the base's chat-template prompt + answer + end-of-turn
  token, the loss on the answer and its end (``qkv.train.chat_data``).
- bert-mlm: bos + source + " " + target + eos per pair (or a text window), with 15 % of the
  real tokens chosen for prediction (80 % -> the mask token, 10 % random, 10 % kept); the
  mask token is the tokenizer's ``mask_id`` when it has one, else ``<unk>`` (qkv's char and
  BPE tokenizers have no separate mask token).
"""

from __future__ import annotations

import hashlib
import os
import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..data.order import derived_seed, epoch_indices  # re-exported: their home is data/

__all__ = ["IGNORE", "PairData", "TextData", "derived_seed", "epoch_indices",
           "file_fingerprint", "gpt_prompts", "pad_rows"]

IGNORE = -100


@dataclass
class PairData:
    """Source/target string pairs: a generated task or a TSV file.

    ``train(start, count)`` returns training pairs ``start .. start + count - 1`` of an endless
    stream; ``heldout(count)`` the first ``count`` held-out pairs (disjoint from training).
    """

    task: Any = None  # a qkv.data Task
    pairs: list[tuple[str, str]] | None = None  # TSV: training pairs
    held: list[tuple[str, str]] | None = None  # TSV: held-out pairs
    seed: int = 0

    @classmethod
    def from_file(cls, pairs: list[tuple[str, str]], *, seed: int,
                  heldout_fraction: float = 0.05, max_heldout: int = 1000) -> PairData:
        """Split a TSV file's pairs into training and held-out parts (seeded shuffle)."""
        if len(pairs) < 2:
            raise ValueError(f"a pairs file needs at least 2 pairs (one to train on, one to "
                             f"hold out), got {len(pairs)}")
        order = list(range(len(pairs)))
        random.Random(seed).shuffle(order)
        n_held = min(max(1, int(len(pairs) * heldout_fraction)), max_heldout, len(pairs) - 1)
        return cls(pairs=[pairs[i] for i in order[n_held:]],
                   held=[pairs[i] for i in order[:n_held]], seed=seed)

    def train(self, start: int, count: int) -> list[tuple[str, str]]:
        """Training pairs ``start .. start + count - 1`` (an endless, deterministic stream)."""
        if self.task is not None:
            return self.task.examples("train", start, count)
        return [self.pairs[i] for i in epoch_indices(len(self.pairs), start, count, self.seed)]

    def heldout(self, count: int) -> list[tuple[str, str]]:
        """The first ``count`` held-out pairs (fewer if a file holds fewer)."""
        if self.task is not None:
            return self.task.examples("valid", 0, count)
        return self.held[:count]

    def texts(self, limit: int = 20000) -> list[str]:
        """Sources and targets of up to ``limit`` training pairs (to train a BPE vocabulary)."""
        pairs = self.train(0, limit) if self.task is not None else self.pairs[:limit]
        return [t for pair in pairs for t in pair]


@dataclass
class TextData:
    """A token stream (plain text, tokenised once) cut into windows of ``window`` + 1 tokens;
    the last ~5 % of the stream is held out."""

    ids: Tensor  # (T,) int64, training part
    held: Tensor  # (T',) int64, held-out part
    window: int
    seed: int = 0

    @classmethod
    def from_ids(cls, ids: list[int], *, window: int, seed: int) -> TextData:
        """Split token ids into training and held-out streams."""
        ids_t = torch.tensor(ids, dtype=torch.long)
        n_held = max(window + 1, len(ids) // 20)
        if len(ids) < n_held + window + 1:
            raise ValueError(f"the text file has {len(ids)} tokens: too short for windows of "
                             f"{window} + 1 tokens plus a held-out part (need at least "
                             f"{n_held + window + 1}); lower --max-len or give more text")
        return cls(ids=ids_t[:-n_held], held=ids_t[-n_held:], window=window, seed=seed)

    def _windows(self, stream: Tensor, starts: list[int]) -> Tensor:
        return torch.stack([stream[s:s + self.window + 1] for s in starts])  # (B, W + 1)

    def train(self, start: int, count: int) -> Tensor:
        """Windows ``start .. start + count - 1``: (count, window + 1) token ids."""
        n_windows = (len(self.ids) - 1) // self.window
        idx = epoch_indices(n_windows, start, count, self.seed)
        return self._windows(self.ids, [i * self.window for i in idx])

    def heldout(self, count: int) -> Tensor:
        """Up to ``count`` held-out windows (count', window + 1)."""
        n = max(1, min(count, (len(self.held) - 1) // self.window))
        return self._windows(self.held, [i * self.window for i in range(n)])


def gpt_prompts(sources: list[str], tokenizer: Any) -> list[list[int]]:
    """GPT prompts of pairs: bos + source + eos (the model continues with target + eos)."""
    return [[tokenizer.bos_id, *tokenizer.encode(s), tokenizer.eos_id] for s in sources]


def pad_rows(rows: list[list[int]], value: int) -> Tensor:
    """Token rows right-padded with ``value`` to the longest: (B, N) int64."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)


def file_fingerprint(path: str | os.PathLike) -> dict[str, Any]:
    """``{"size": bytes, "sha256": hex digest}`` of a file (read in 1 MiB blocks): what
    run.json records of ``--data`` and base.json of a base's weights.

    Raises:
        OSError: ``path`` cannot be opened or read (``FileNotFoundError``: it is missing).
        DataError (``qkv.data.files``): ``path`` is not a regular file, checked before it is
            opened (a device such as ``/dev/zero`` would be read forever, a FIFO would
            block or be consumed).
    """
    from ..data.files import regular_file

    if os.path.exists(path):
        regular_file(path)
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
            size += len(block)
    return {"size": size, "sha256": digest.hexdigest()}
