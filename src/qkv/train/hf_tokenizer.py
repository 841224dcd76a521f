"""The tokenizer of a HuggingFace model directory as ``qkv train`` uses it: ``HFTokenizer``, a
``tokenizers.Tokenizer`` with the directory's own special ids (Llama's ``<s>`` / ``</s>``,
Qwen's ``<|im_end|>``, ...) instead of qkv's fixed ``<pad> <bos> <eos> <unk>`` = 0..3, and its
chat template; and the readers of a base's and a checkpoint's tokenizer
(``base_tokenizer``, ``read_run_tokenizer``).

Shapes: N ids of one text.

**Special ids** (from the directory, as ``qkv.generation.chat`` reads its files):
``eos_id`` the id of tokenizer_config.json's ``eos_token``, else the first of the stop ids;
``stop_ids`` the ids generation stops at (``qkv.generation.chat.stop_token_ids``:
generation_config.json's ``eos_token_id``, else config.json's, else ``eos_token``; with
``eos_id`` among them); ``bos_id`` the ``bos_token`` (else generation_config.json's
``bos_token_id``, else None: Qwen has none); ``pad_id`` the ``pad_token`` (else
generation_config.json's ``pad_token_id``, else ``eos_id``: padding is never a target);
``unk_id`` the ``unk_token`` (else None: byte-level vocabularies have none).

**Saving** (``save(path)``) writes the HuggingFace layout, so that a checkpoint or a merged
model directory is a model directory ``qkv generate DIR --chat`` and transformers'
``AutoTokenizer`` read: ``path`` (tokenizer.json, the ``tokenizers`` file as it is) and
beside it tokenizer_config.json (the base's, with the special tokens as resolved and the
chat template written in) and generation_config.json (``eos_token_id`` = the stop ids,
``bos_token_id``, ``pad_token_id``). ``HFTokenizer.from_directory`` reads them back to the
same tokenizer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from ..data.tokenizer_base import SPECIALS, TokenizerBase
from ..files import CheckpointError, atomic_write, read_json

__all__ = ["HFTokenizer", "base_tokenizer", "read_run_tokenizer"]

_TOKENIZER_CONFIG = "tokenizer_config.json"
_GENERATION_CONFIG = "generation_config.json"


class HFTokenizer(TokenizerBase):
    """A HuggingFace tokenizer with its directory's special ids and chat template (see the
    module docstring). Build one with ``from_directory``.

    Args:
        tokenizer: the ``tokenizers.Tokenizer`` (tokenizer.json).
        eos_id: the end-of-sequence id; stop_ids: the ids generation stops at (eos_id among
            them); bos_id, unk_id: None when the vocabulary has none; pad_id: the id
            padding is written with.
        chat_template: the Jinja text of the chat template, or None.
        special_tokens: the named special tokens as text (``{"eos_token": "</s>", ...}``,
            what a chat template sees).
        config: the base's tokenizer_config.json (written back by ``save``).

    Raises:
        TypeError: ``tokenizer`` is not a ``tokenizers.Tokenizer``; ValueError: an id
        outside the vocabulary.
    """

    kind = "hf"

    def __init__(self, tokenizer: Any, *, eos_id: int, stop_ids: Sequence[int],
                 bos_id: int | None = None, pad_id: int | None = None,
                 unk_id: int | None = None, chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None,
                 config: dict[str, Any] | None = None) -> None:
        from tokenizers import Tokenizer

        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"HFTokenizer: tokenizer must be a tokenizers.Tokenizer, got "
                            f"{type(tokenizer).__name__}")
        self.hf = tokenizer
        size = self.vocab_size
        stops = tuple(dict.fromkeys([*stop_ids, eos_id]))
        for name, value in (("eos_id", eos_id), ("bos_id", bos_id), ("pad_id", pad_id),
                            ("unk_id", unk_id), *(("stop_ids", s) for s in stops)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 <= value < size):
                raise ValueError(f"HFTokenizer: {name} must be an id in [0, {size}), got "
                                 f"{value!r}")
        self.eos_id, self.stop_ids = eos_id, stops
        self.bos_id, self.unk_id = bos_id, unk_id
        self.pad_id = eos_id if pad_id is None else pad_id
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self.config = dict(config or {})

    @classmethod
    def from_directory(cls, directory: str | os.PathLike) -> HFTokenizer:
        """The tokenizer of a HuggingFace model directory (tokenizer.json and, beside it,
        tokenizer_config.json / generation_config.json / config.json for the special ids
        and the chat template; see the module docstring).

        Raises:
            CheckpointError: no tokenizer.json, a malformed file, a special token that is
            not in the vocabulary, or no eos token named by any of the files.
        """
        from ..generation.chat import (
            read_chat_template,
            read_generation_config,
            read_special_tokens,
            special_token_id,
            stop_token_ids,
        )
        from ..models.hub import load_tokenizer

        directory = Path(directory)
        try:
            hf = load_tokenizer(directory)
        except Exception as exc:  # tokenizers raises bare Exceptions
            raise CheckpointError(f"{directory / 'tokenizer.json'}: not a HuggingFace "
                                  f"tokenizer ({exc})") from None
        if hf is None:
            raise CheckpointError(f"{directory}: tokenizer.json is missing")
        specials = read_special_tokens(directory)
        generation = read_generation_config(directory)
        stops = stop_token_ids(directory, hf) or ()

        def id_of(name: str) -> int | None:
            return special_token_id(directory, name, hf)

        eos = id_of("eos_token")
        eos = stops[0] if eos is None and stops else eos
        if eos is None:
            raise CheckpointError(
                f"{directory}: the tokenizer names no eos token (no eos_token in "
                f"{_TOKENIZER_CONFIG}, no eos_token_id in {_GENERATION_CONFIG} or config.json); "
                f"qkv train needs one to end pairs and answers")
        bos = id_of("bos_token")
        bos = generation.bos_token_id if bos is None else bos
        pad = id_of("pad_token")
        pad = generation.pad_token_id if pad is None else pad
        try:
            template = read_chat_template(directory)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
        config_path = directory / _TOKENIZER_CONFIG
        config = read_json(config_path) if config_path.is_file() else {}
        try:
            return cls(hf, eos_id=eos, stop_ids=stops, bos_id=bos, pad_id=pad,
                       unk_id=id_of("unk_token"), chat_template=template,
                       special_tokens=specials, config=config)
        except ValueError as exc:
            raise CheckpointError(f"{directory}: {exc}") from None

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids (N,) of ``text`` without the post-processor's special tokens (a special
        token written in the text, e.g. ``<|im_end|>``, is that token, as transformers reads
        it), optionally framed by ``bos_id`` / ``eos_id``.

        Raises:
            TypeError: ``text`` not a str; ValueError: ``add_bos`` with no bos token."""
        if add_bos and self.bos_id is None:
            raise ValueError("HFTokenizer.encode: add_bos=True, but this tokenizer has no bos "
                             "token")
        return super().encode(text, add_bos=add_bos, add_eos=add_eos)

    def _encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def _model_ids(self, ids: Sequence[int] | Tensor) -> list[int]:
        """``ids`` (1-D) as ints >= 0; ids beyond the vocabulary are allowed (a model's
        embedding often has more rows than its tokenizer has tokens: Qwen's 151936 for
        151665), and decode to nothing, as transformers decodes them."""
        if isinstance(ids, Tensor):
            if ids.dim() != 1:
                raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
            ids = ids.tolist()
        ids = [int(i) for i in ids]
        bad = [i for i in ids if i < 0]
        if bad:
            raise ValueError(f"ids must be >= 0, got {bad[0]}")
        return ids

    def decode(self, ids: Sequence[int] | Tensor, *, skip_special: bool = True) -> str:
        """Text of ``ids`` (1-D); special tokens dropped unless ``skip_special=False``; ids
        beyond the vocabulary decode to nothing."""
        return self.hf.decode(self._model_ids(ids), skip_special_tokens=skip_special)

    def tokens(self, ids: Sequence[int] | Tensor) -> list[str]:
        """One display string per id (1-D): the vocabulary's token strings ("" for an id
        beyond the vocabulary)."""
        return [self.hf.id_to_token(i) or "" for i in self._model_ids(ids)]

    def save(self, path: str | os.PathLike) -> None:
        """Write ``path`` (tokenizer.json) and, beside it, tokenizer_config.json and
        generation_config.json (the module docstring), each atomically."""
        path = Path(path)
        config = {**self.config, **self.special_tokens}
        if self.chat_template is not None and not isinstance(config.get("chat_template"),
                                                             (str, list)):
            config["chat_template"] = self.chat_template
        generation = {"eos_token_id": list(self.stop_ids), "bos_token_id": self.bos_id,
                      "pad_token_id": self.pad_id}
        text = self.hf.to_str()
        atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
        for name, content in ((_TOKENIZER_CONFIG, config), (_GENERATION_CONFIG, generation)):
            body = json.dumps(content, indent=2, ensure_ascii=False)
            atomic_write(path.parent / name,
                         lambda tmp, b=body: Path(tmp).write_text(b, encoding="utf-8"))

    def __repr__(self) -> str:
        return (f"HFTokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}, "
                f"bos_id={self.bos_id}, chat_template={self.chat_template is not None})")


def _is_qkv_file(path: Path) -> bool:
    """Whether ``path`` is a tokenizer qkv's ``read_tokenizer`` writes (a JSON object with a
    "kind"), not a HuggingFace tokenizers file."""
    from ..models.hub import tokenizer_file_kind

    return tokenizer_file_kind(path) in (None, "qkv")  # unreadable: qkv's reader names why


def read_run_tokenizer(directory: str | os.PathLike) -> Any:
    """The tokenizer of a checkpoint (or merged model) directory: qkv's own
    (``qkv.data.read_tokenizer``) when tokenizer.json is qkv's; an HF encoder-decoder's
    ``Seq2SeqTokenizer`` when the directory's model (or an adapter checkpoint's base) is an
    encoder-decoder (``qkv.train.hf_seq2seq.seq2seq_tokenizer_of``); else ``HFTokenizer``
    (saved by a run that started from a HuggingFace base).

    Raises:
        CheckpointError: tokenizer.json is missing; DataError / CheckpointError: a file
        that neither reader takes."""
    from ..data import read_tokenizer
    from .hf_seq2seq import seq2seq_tokenizer_of

    directory = Path(directory)
    seq2seq = seq2seq_tokenizer_of(directory)
    if seq2seq is not None:
        return seq2seq
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: tokenizer.json is missing")
    if _is_qkv_file(path):
        return read_tokenizer(path)
    return HFTokenizer.from_directory(directory)


def base_tokenizer(directory: str | os.PathLike) -> Any:
    """The tokenizer of a fine-tuning base: qkv's own; an HF encoder-decoder's (T5, BART,
    Marian, or a run fine-tuning one: its ``Seq2SeqTokenizer``, as ``read_run_tokenizer``); a
    HuggingFace tokenizers file whose ids 0..3 are qkv's ``<pad> <bos> <eos> <unk>`` (a
    ``qkv.data.BPETokenizer``); else the directory's tokenizer with its own special ids
    (``HFTokenizer``).

    Raises:
        CheckpointError: no tokenizer.json (an encoder-decoder: none of its tokenizer
        files), or one none of them takes (naming why)."""
    from tokenizers import Tokenizer

    from ..data import BPETokenizer
    from .hf_seq2seq import seq2seq_tokenizer_of

    directory = Path(directory)
    try:
        seq2seq = seq2seq_tokenizer_of(directory)
    except CheckpointError as exc:
        raise CheckpointError(f"--init-from {directory}: {exc}") from None
    if seq2seq is not None:
        return seq2seq
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"--init-from {directory}: tokenizer.json is missing; "
                              f"fine-tuning needs the base's tokenizer (qkv.data's, or a "
                              f"HuggingFace tokenizer.json, beside config.json)")
    if _is_qkv_file(path):
        return read_run_tokenizer(directory)
    try:
        hf = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises bare Exceptions
        raise CheckpointError(f"--init-from {directory}: {path} is not a tokenizer qkv can "
                              f"train with ({exc})") from None
    if all(hf.token_to_id(name) == i for i, name in enumerate(SPECIALS)):
        return BPETokenizer(hf)
    try:
        return HFTokenizer.from_directory(directory)
    except CheckpointError as exc:
        raise CheckpointError(f"--init-from {directory}: {exc}") from None
