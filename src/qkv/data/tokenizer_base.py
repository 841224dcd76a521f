"""What every qkv tokenizer shares: the special tokens ``SPECIALS`` and ``TokenizerBase``
(special ids, ``encode`` / ``encode_batch``, id checks, saving as one JSON file).

Shapes: B batch, N padded sequence length.

Every tokenizer reserves the same special ids: ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2,
``<unk>`` = 3. A saved tokenizer is ONE JSON file ``{"kind": ..., "version":
FORMAT_VERSION, ...payload}``; ``qkv.data.tokenizer.read_tokenizer`` reads every kind. The
tokenizers themselves live in ``tokenizer.py`` (char, BPE) and ``words.py`` (word), both
above this module.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["FORMAT_VERSION", "SPECIALS", "TokenizerBase"]

#: Special tokens, in id order.
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
#: The ``"version"`` of a saved tokenizer's JSON file.
FORMAT_VERSION = 1


class TokenizerBase:
    """What every qkv tokenizer shares: special ids, batching, saving (``CharTokenizer``,
    ``BPETokenizer``, ``WordTokenizer``). A subclass sets ``kind`` and implements
    ``vocab_size``, ``_encode`` and ``_payload``."""

    pad_id = 0
    bos_id = 1
    eos_id = 2
    unk_id = 3
    kind = ""

    @property
    def vocab_size(self) -> int:  # pragma: no cover - overridden
        raise NotImplementedError

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of ``text``, optionally framed by ``<bos>`` / ``<eos>``."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = self._encode(text)
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def _encode(self, text: str) -> list[int]:  # pragma: no cover - overridden
        raise NotImplementedError

    def _check_ids(self, ids: Sequence[int] | Tensor) -> list[int]:
        if isinstance(ids, Tensor):
            if ids.dim() != 1:
                raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
            ids = ids.tolist()
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"ids must be in [0, {self.vocab_size}), got {bad[0]}")
        return ids

    def encode_batch(self, texts: Sequence[str], *, add_bos: bool = False,
                     add_eos: bool = False) -> tuple[Tensor, Tensor]:
        """Encode several texts, right-padded with ``pad_id``.

        Returns ``(ids, lengths)``: ids LongTensor (B, N) with N the longest encoding (0 for
        an empty batch), lengths LongTensor (B,) counting the non-pad ids of each row.
        """
        if isinstance(texts, str):
            raise TypeError("texts must be a sequence of str, got a single str")
        rows = [self.encode(t, add_bos=add_bos, add_eos=add_eos) for t in texts]
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)  # (B,)
        n = max((len(r) for r in rows), default=0)
        ids = torch.full((len(rows), n), self.pad_id, dtype=torch.long)  # (B, N)
        for b, row in enumerate(rows):
            ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        return ids, lengths

    def _payload(self) -> dict:  # pragma: no cover - overridden
        raise NotImplementedError

    def save(self, path: str | os.PathLike) -> None:
        """Write the tokenizer as one JSON file, atomically (temp file + rename)."""
        from qkv.files import atomic_write

        text = json.dumps({"kind": self.kind, "version": FORMAT_VERSION, **self._payload()},
                          ensure_ascii=False)
        atomic_write(Path(path), lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
