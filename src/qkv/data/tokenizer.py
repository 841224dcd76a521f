"""Tokenizers with one interface: ``CharTokenizer`` (one id per character) and
``BPETokenizer`` (byte-level BPE trained with HF ``tokenizers``).

Shapes: B batch, N padded sequence length.

Both reserve the same special ids: ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2, ``<unk>`` = 3.
Text that merely spells a special (the five characters ``<pad>``) is encoded as ordinary
text, never as the special id. A tokenizer is saved as ONE JSON file with a ``"kind"``
field ("char" or "bpe"); ``read_tokenizer`` reads either (and ``WordTokenizer``'s "word").
Their shared base (special ids, batching, saving) is ``qkv.data.tokenizer_base``.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from torch import Tensor

from .files import DataError
from .tokenizer_base import FORMAT_VERSION, SPECIALS, TokenizerBase

__all__ = ["SPECIALS", "BPETokenizer", "CharTokenizer", "read_tokenizer"]

#: Whitespace shown visibly in ``tokens()`` (heatmap labels).
_VISIBLE = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}


def _visible(text: str) -> str:
    return "".join(_VISIBLE.get(c, c) for c in text)


class CharTokenizer(TokenizerBase):
    """One id per character of ``alphabet`` (after the 4 specials, in the alphabet's order;
    repeated characters are kept once). Characters outside it encode to ``unk_id``.

    >>> tok = CharTokenizer("abc")
    >>> tok.encode("cab", add_eos=True)
    [6, 4, 5, 2]
    """

    kind = "char"

    def __init__(self, alphabet: str) -> None:
        if not isinstance(alphabet, str):
            raise TypeError(f"alphabet must be a str, got {type(alphabet).__name__}")
        chars = list(dict.fromkeys(alphabet))
        if not chars:
            raise ValueError("alphabet must hold at least one character, got ''")
        self.alphabet = "".join(chars)
        self._itos = list(SPECIALS) + chars
        self._stoi = {c: i for i, c in enumerate(chars, start=len(SPECIALS))}

    @classmethod
    def from_texts(cls, texts: Iterable[str]) -> CharTokenizer:
        """A tokenizer whose alphabet is every character of ``texts``, sorted."""
        chars: set[str] = set()
        for t in texts:
            chars.update(t)
        return cls("".join(sorted(chars)))

    @property
    def vocab_size(self) -> int:
        """4 specials + the alphabet's characters."""
        return len(self._itos)

    def _encode(self, text: str) -> list[int]:
        get, unk = self._stoi.get, self.unk_id
        return [get(c, unk) for c in text]

    def decode(self, ids: Sequence[int] | Tensor, *, skip_special: bool = True) -> str:
        """Text of ``ids`` (1-D). Specials are dropped, or written as ``<pad>`` etc. when
        ``skip_special=False``; decoding never stops early at ``<eos>``."""
        ids = self._check_ids(ids)
        n = len(SPECIALS)
        return "".join(self._itos[i] for i in ids if i >= n or not skip_special)

    def tokens(self, ids: Sequence[int] | Tensor) -> list[str]:
        """One display string per id (1-D): specials as ``<bos>``, whitespace made visible
        (space ``␣``, newline ``↵``, tab ``⇥``). For axis labels of attention heatmaps."""
        return [_visible(self._itos[i]) if i >= len(SPECIALS) else self._itos[i]
                for i in self._check_ids(ids)]

    def _payload(self) -> dict:
        return {"alphabet": self.alphabet}

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable-character map used by byte-level BPE."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


class BPETokenizer(TokenizerBase):
    """Byte-level BPE (HF ``tokenizers``): any text, Chinese and emoji included, round-trips
    exactly, and no input is ever ``<unk>``. Build one with ``BPETokenizer.train``."""

    kind = "bpe"

    def __init__(self, tokenizer) -> None:
        from tokenizers import Tokenizer

        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"tokenizer must be a tokenizers.Tokenizer, got "
                            f"{type(tokenizer).__name__}")
        for i, name in enumerate(SPECIALS):
            if tokenizer.token_to_id(name) != i:
                raise ValueError(f"tokenizer must map {name} to id {i}, got "
                                 f"{tokenizer.token_to_id(name)}")
        tokenizer.encode_special_tokens = True  # "<pad>" in text is text, not a special
        self.hf = tokenizer

    @classmethod
    def train(cls, texts: Iterable[str], *, vocab_size: int) -> BPETokenizer:
        """Learn merges on ``texts`` up to ``vocab_size`` ids (at least 260: 4 specials and
        the 256 byte tokens). Fewer ids result when the texts offer fewer merges."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        minimum = len(SPECIALS) + 256
        if not isinstance(vocab_size, int) or vocab_size < minimum:
            raise ValueError(f"vocab_size must be an int >= {minimum} (specials + 256 bytes), "
                             f"got {vocab_size!r}")
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train_from_iterator(texts, trainer)
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        """Number of ids, specials included."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    def _encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int] | Tensor, *, skip_special: bool = True) -> str:
        """Text of ``ids`` (1-D). Specials are dropped, or written as ``<pad>`` etc. when
        ``skip_special=False``. Bytes of a character cut in half decode to U+FFFD."""
        ids = self._check_ids(ids)
        n = len(SPECIALS)
        out, run = [], []
        for i in ids:
            if i >= n:
                run.append(i)
                continue
            if run:
                out.append(self.hf.decode(run, skip_special_tokens=False))
                run = []
            if not skip_special:
                out.append(SPECIALS[i])
        if run:
            out.append(self.hf.decode(run, skip_special_tokens=False))
        return "".join(out)

    def tokens(self, ids: Sequence[int] | Tensor) -> list[str]:
        """One display string per id (1-D): the token's bytes as text, whitespace made visible
        (``␣`` ``↵`` ``⇥``); bytes that are part of a split character show as ``\\xNN``."""
        table = _byte_decoder()
        out = []
        for i in self._check_ids(ids):
            piece = self.hf.id_to_token(i)
            if i < len(SPECIALS):
                out.append(piece)
                continue
            raw = bytes(table[c] for c in piece)
            out.append(_visible(raw.decode("utf-8", errors="backslashreplace")))
        return out

    def _payload(self) -> dict:
        return {"tokenizer": self.hf.to_str()}

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size})"


def read_tokenizer(path: str | os.PathLike) -> CharTokenizer | BPETokenizer:
    """Load a tokenizer written by ``save``; a ``DataError`` (ValueError) names the file and
    what is wrong with it."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise DataError(f"cannot read tokenizer {path}: {err.strerror or err}") from err
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: not a qkv tokenizer (not JSON: {err})") from err
    if not isinstance(data, dict) or "kind" not in data:
        raise DataError(f"{path}: not a qkv tokenizer (no \"kind\" field)")
    kind = data["kind"]
    if data.get("version") != FORMAT_VERSION:
        raise DataError(f"{path}: unsupported tokenizer version {data.get('version')!r} "
                        f"(this qkv reads {FORMAT_VERSION})")
    try:
        if kind == "char":
            return CharTokenizer(data["alphabet"])
        if kind == "bpe":
            from tokenizers import Tokenizer

            return BPETokenizer(Tokenizer.from_str(data["tokenizer"]))
        if kind == "word":
            from .words import WordTokenizer

            return WordTokenizer(data["words"])
    except Exception as err:  # KeyError, TypeError; tokenizers raises a bare Exception
        raise DataError(f"{path}: broken {kind} tokenizer: {err!r}") from err
    raise DataError(f"{path}: unknown tokenizer kind {kind!r} (expected 'char', 'bpe' or 'word')")
