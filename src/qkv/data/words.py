"""``WordTokenizer``: one id per word of a fixed word list (English words, Chinese words).

Shapes: B batch, N padded sequence length.

Same interface and special ids as ``CharTokenizer`` / ``BPETokenizer`` (``<pad>`` 0, ``<bos>``
1, ``<eos>`` 2, ``<unk>`` 3); saved as one JSON file with ``"kind": "word"``, which
``read_tokenizer`` reads.

Encoding: the text is split on whitespace; a chunk that is a word of the list is one id;
any other chunk is segmented by greedy longest match against the list (the way Chinese text,
written without spaces, is cut into words), and a character that starts no word becomes
``<unk>``. Decoding joins words with a space, except between two words that meet at
non-ASCII characters (``"猫" "坐在"`` -> ``"猫坐在"``), so text made by ``decode`` that way
encodes back to the same ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import Tensor

from .tokenizer_base import SPECIALS, TokenizerBase

__all__ = ["WordTokenizer"]


class WordTokenizer(TokenizerBase):
    """One id per word of ``words`` (after the 4 specials, in the list's order; repeated
    words are kept once). Words hold no whitespace.

    >>> tok = WordTokenizer(["the", "cat", "猫", "坐在"])
    >>> tok.encode("the cat", add_bos=True)
    [1, 4, 5]
    >>> tok.encode("猫坐在")
    [6, 7]
    >>> tok.decode([6, 7, 5])
    '猫坐在 cat'
    """

    kind = "word"

    def __init__(self, words: Iterable[str]) -> None:
        if isinstance(words, str):
            raise TypeError("words must be a sequence of str, got a single str")
        words = list(dict.fromkeys(words))
        for w in words:
            if not isinstance(w, str) or not w or any(c.isspace() for c in w):
                raise ValueError(f"words must be non-empty strings without whitespace, got "
                                 f"{w!r}")
            if w in SPECIALS:
                raise ValueError(f"words must not repeat a special token, got {w!r}")
        if not words:
            raise ValueError("words must hold at least one word, got none")
        self.words = words
        self._itos = list(SPECIALS) + words
        self._stoi = {w: i for i, w in enumerate(words, start=len(SPECIALS))}
        self._longest = max(len(w) for w in words)

    @property
    def vocab_size(self) -> int:
        """4 specials + the words."""
        return len(self._itos)

    def _encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for chunk in text.split():
            whole = self._stoi.get(chunk)
            if whole is not None:
                ids.append(whole)
                continue
            i = 0
            while i < len(chunk):
                for size in range(min(self._longest, len(chunk) - i), 0, -1):
                    hit = self._stoi.get(chunk[i:i + size])
                    if hit is not None:
                        ids.append(hit)
                        i += size
                        break
                else:
                    ids.append(self.unk_id)
                    i += 1
        return ids

    def decode(self, ids: Sequence[int] | Tensor, *, skip_special: bool = True) -> str:
        """Text of ``ids`` (1-D): words joined by a space, without one between two words
        that meet at non-ASCII characters. Specials are dropped, or written as ``<pad>``
        etc. when ``skip_special=False``."""
        out = ""
        for i in self._check_ids(ids):
            if i < len(SPECIALS) and skip_special:
                continue
            word = self._itos[i]
            if out and (out[-1].isascii() or word[0].isascii()):
                out += " "
            out += word
        return out

    def tokens(self, ids: Sequence[int] | Tensor) -> list[str]:
        """One display string per id (1-D): the word, or a special's name (``<bos>``)."""
        return [self._itos[i] for i in self._check_ids(ids)]

    def _payload(self) -> dict:
        return {"words": self.words}

    def __repr__(self) -> str:
        return f"WordTokenizer(vocab_size={self.vocab_size})"
