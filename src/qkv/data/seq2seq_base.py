"""What the tokenizers of ``qkv.data.seq2seq_tokenizer`` share: ``Seq2SeqTokenizer`` (the API:
``encode`` / ``encode_target`` / ``decode``, special ids, ``save``), ``check_embedding_rows``,
and the readers of a directory's tokenizer_config.json / special_tokens_map.json and of added
tokens in a text, as transformers reads them.

Shapes: N ids of one text.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from ..files import CheckpointError, atomic_write, read_json

__all__ = ["DEFAULT_SPECIALS", "SPECIAL_NAMES", "SPECIAL_TOKENS_MAP", "TOKENIZER_CONFIG",
           "Seq2SeqTokenizer", "added_token_pattern", "check_embedding_rows", "read_cleanup",
           "read_config", "read_specials", "split_at_added"]

TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
#: The named special tokens whose ids a ``Seq2SeqTokenizer`` carries.
SPECIAL_NAMES = ("eos_token", "pad_token", "unk_token", "bos_token")
#: transformers' SPECIAL_TOKENS_ATTRIBUTES: it makes every one an added special token.
_ALL_NAMES = (*SPECIAL_NAMES, "sep_token", "cls_token", "mask_token")
#: The defaults of transformers' T5 / BART / Marian classes (none has a default bos).
DEFAULT_SPECIALS = {"eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}


class Seq2SeqTokenizer:
    """The tokenizer of an encoder-decoder model directory (``qkv.data.seq2seq_tokenizer``'s
    docstring: which files, which special tokens). Build one with
    ``qkv.data.seq2seq_tokenizer.load_seq2seq_tokenizer``; the subclasses
    (``JsonSeq2SeqTokenizer``, ``MarianSpmTokenizer``, ``T5SpmTokenizer``) implement
    ``_encode`` / ``_decode``.

    Attributes:
        kind: "marian", "tokenizers" (tokenizer.json) or "t5" (spiece.model).
        eos_id, pad_id: ids; unk_id, bos_id: ids or None (T5 and Marian have no bos).
        vocab_size: number of ids (transformers' ``len(tokenizer)``; Marian: vocab.json's
            size; T5 from spiece.model: its pieces + ``extra_ids``).
        target_vocab_size: ids of the target side (Marian with ``separate_vocabs``: the size
            of target_vocab.json; else ``vocab_size``).
        exact_rows: whether a model's embedding must have exactly ``vocab_size`` rows
            (Marian: vocab.json is the embedding) or may have more (T5 pads its embedding to
            a multiple of 128).
        directory: where it was read from; files: the names ``save`` copies;
        vocab_file, target_vocab_file: the files whose sizes ``vocab_size`` and
            ``target_vocab_size`` are (vocab.json, target_vocab.json, tokenizer.json,
            spiece.model), named by ``check_embedding_rows``.
    """

    kind = ""
    exact_rows = False

    def __init__(self, directory: Path, files: Sequence[str], *, vocab_file: str, eos_id: int,
                 pad_id: int, unk_id: int | None, bos_id: int | None, vocab_size: int,
                 target_vocab_size: int | None = None, target_vocab_file: str | None = None,
                 cleanup: bool = False) -> None:
        self.directory, self.files, self.vocab_file = directory, tuple(files), vocab_file
        self.target_vocab_file = target_vocab_file or vocab_file
        self.eos_id, self.pad_id, self.unk_id, self.bos_id = eos_id, pad_id, unk_id, bos_id
        self.vocab_size = vocab_size
        self.target_vocab_size = vocab_size if target_vocab_size is None else target_vocab_size
        self._cleanup = cleanup  # transformers' clean_up_tokenization_spaces

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str) -> list[int]:
        """Ids (N,) of a source text, framing included: transformers'
        ``tokenizer(text)["input_ids"]`` (T5 / Marian ``text </s>``, BART ``<s> text </s>``).

        Raises:
            TypeError: ``text`` not a str."""
        return self._encode(_text(text), target=False)

    def encode_target(self, text: str) -> list[int]:
        """Ids (N,) of a target text (the decoder's labels): transformers'
        ``tokenizer(text_target=text)["input_ids"]`` (Marian: through target.spm).

        Raises:
            TypeError: ``text`` not a str."""
        return self._encode(_text(text), target=True)

    def decode(self, ids: Sequence[int] | Tensor, *, skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (1-D: a list or an (N,) tensor), as transformers'
        ``decode(ids, skip_special_tokens=...)``: special tokens dropped unless
        ``skip_special_tokens=False``. T5 / tokenizer.json: an id beyond the vocabulary
        decodes to nothing (T5's embedding has more rows than ids).

        Raises:
            TypeError / ValueError: ids not 1-D ints >= 0 (Marian: < ``vocab_size``)."""
        return self._decode(_ids(ids), skip_special_tokens)

    def save(self, directory: str | os.PathLike) -> None:
        """Copy the tokenizer's files (``files``) into ``directory`` (made if missing), each
        atomically, so that ``load_seq2seq_tokenizer(directory)`` reads the same tokenizer
        and transformers' ``AutoTokenizer`` reads it too."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        for name in self.files:
            source = self.directory / name
            atomic_write(out / name, lambda tmp, s=source: shutil.copyfile(s, tmp))

    def _clean(self, text: str) -> str:
        """transformers' ``clean_up_tokenization`` when the config asks for it."""
        if not self._cleanup:
            return text
        for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                              (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                              (" 're", "'re")):
            text = text.replace(before, after)
        return text

    def _encode(self, text: str, *, target: bool) -> list[int]:  # pragma: no cover
        raise NotImplementedError

    def _decode(self, ids: list[int], skip: bool) -> str:  # pragma: no cover
        raise NotImplementedError

    def __repr__(self) -> str:
        return (f"Seq2SeqTokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, "
                f"eos_id={self.eos_id}, pad_id={self.pad_id}, directory={str(self.directory)!r})")


def check_embedding_rows(tokenizer: Seq2SeqTokenizer, rows: int, source: str, *,
                         target: bool = False) -> None:
    """Refuse a model whose embedding of ``rows`` rows does not fit ``tokenizer``: fewer rows
    than ids, or (Marian, ``exact_rows``) a vocab.json of another size. ``source`` names
    where ``rows`` comes from (a file and field), for the message; ``target``: check the
    decoder side (``target_vocab_size``).

    Raises:
        CheckpointError: one line naming both sizes; TypeError / ValueError: bad arguments."""
    if not isinstance(tokenizer, Seq2SeqTokenizer):
        raise TypeError(f"check_embedding_rows: tokenizer must be a Seq2SeqTokenizer, got "
                        f"{type(tokenizer).__name__}")
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        raise ValueError(f"check_embedding_rows: rows must be an int >= 1, got {rows!r}")
    size = tokenizer.target_vocab_size if target else tokenizer.vocab_size
    name = tokenizer.target_vocab_file if target else tokenizer.vocab_file
    what = f"{tokenizer.directory / name} has {size} tokens"
    if tokenizer.exact_rows and rows != size:
        raise CheckpointError(f"{source}: the embedding has {rows} rows but {what}; the "
                              f"vocabulary belongs to another model")
    if rows < size:
        raise CheckpointError(f"{source}: the embedding has {rows} rows but {what}; ids "
                              f">= {rows} would index past it")


# ----------------------------------------------------------------------- directory files

def read_config(path: Path) -> dict:
    """The JSON object in ``path`` ({} when there is no such file).

    Raises:
        CheckpointError: a file that is not a JSON object."""
    return read_json(path) if path.exists() else {}


def _token_text(value: Any, where: Path, key: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise CheckpointError(f"{where}: {key} must be a string, {{\"content\": str}} or null, "
                          f"got {value!r:.80}")


def read_specials(directory: Path, config: dict) -> tuple[dict[str, str], list[str] | None]:
    """(named special tokens, additional special tokens or None when none are listed):
    tokenizer_config.json, and special_tokens_map.json over it where the config has no
    ``added_tokens_decoder`` (transformers' order)."""
    sources = [(directory / TOKENIZER_CONFIG, config)]
    legacy = read_config(directory / SPECIAL_TOKENS_MAP)
    if legacy and "added_tokens_decoder" not in config:
        sources.append((directory / SPECIAL_TOKENS_MAP, legacy))
    named: dict[str, str] = {}
    extra: list[str] | None = None
    for where, data in sources:
        for key in _ALL_NAMES:
            if key in data:
                text = _token_text(data[key], where, key)
                if text is None:
                    named.pop(key, None)
                else:
                    named[key] = text
        for key in ("additional_special_tokens", "extra_special_tokens"):
            value = data.get(key)
            if isinstance(value, dict):  # v5: named extra tokens {"image_token": ...}
                value = list(value.values())
            if value is not None:
                if not isinstance(value, list):
                    raise CheckpointError(f"{where}: {key} must be a list, got {value!r:.80}")
                extra = [t for t in (_token_text(v, where, key) for v in value) if t]
    return named, extra


def read_cleanup(directory: Path, config: dict) -> bool:
    """tokenizer_config.json's ``clean_up_tokenization_spaces`` (``config``; default False).

    Raises:
        CheckpointError: not a bool."""
    value = config.get("clean_up_tokenization_spaces", False)
    if not isinstance(value, bool):
        raise CheckpointError(f"{directory / TOKENIZER_CONFIG}: clean_up_tokenization_spaces "
                              f"must be true or false, got {value!r}")
    return value


def added_token_pattern(tokens: Sequence[str]) -> re.Pattern | None:
    """A pattern splitting a text at these tokens, leftmost then longest first (how
    transformers finds added tokens in a text), or None for no tokens."""
    tokens = sorted(set(tokens), key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, tokens)) + ")") if tokens else None


def split_at_added(pattern: re.Pattern | None, text: str) -> list[tuple[str, bool]]:
    """``text`` as (piece, is_added_token) in order, empty pieces dropped."""
    if pattern is None:
        return [(text, False)] if text else []
    parts = pattern.split(text)
    return [(p, i % 2 == 1) for i, p in enumerate(parts) if p]


# ---------------------------------------------------------------------------- arguments

def _text(text: Any) -> str:
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return text


def _ids(ids: Any) -> list[int]:
    if isinstance(ids, Tensor):
        if ids.dim() != 1:
            raise ValueError(f"decode: ids must be 1-D, got shape {tuple(ids.shape)}")
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise TypeError(f"decode: ids must be a sequence of ints or a 1-D tensor, got "
                        f"{type(ids).__name__}")
    out = []
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool):
            raise TypeError(f"decode: ids must be ints, got {i!r}")
        if i < 0:
            raise ValueError(f"decode: ids must be >= 0, got {i}")
        out.append(i)
    return out

