"""The tokenizer of a HuggingFace encoder-decoder model directory (T5 / Flan-T5, BART, Marian
opus-mt): ``load_seq2seq_tokenizer(directory) -> Seq2SeqTokenizer``, and
``check_embedding_rows`` (does a model's embedding fit the vocabulary).

Shapes: N ids of one text.

**Which files** (the first that applies):

- Marian: ``source.spm`` + ``target.spm`` + ``vocab.json`` (+ ``target_vocab.json`` when
  tokenizer_config.json sets ``separate_vocabs``), as transformers' ``MarianTokenizer``:
  the source text through source.spm, a target text through target.spm, each piece to its
  id through vocab.json (a piece it lacks is ``unk``), a leading ``>>xx<<`` language code
  one token, ``</s>`` appended. Taken when either .spm is there or tokenizer_config.json
  names ``MarianTokenizer`` (a tokenizer.json cannot hold two SentencePiece models).
- ``tokenizer.json`` (BART, T5 and Flan-T5 ship one): the ``tokenizers`` file as it is, as
  transformers' fast tokenizers read it, its post-processor framing the ids (BART
  ``<s> text </s>``, T5 ``text </s>``).
- T5: ``spiece.model``, as transformers' ``T5Tokenizer``: SentencePiece ids, ``extra_ids``
  sentinels ``<extra_id_0>`` .. appended to the vocabulary in reverse order
  (``<extra_id_0>`` the last id; tokenizer_config.json's ``extra_ids``, default 100),
  ``</s>`` appended.

**Special tokens** as transformers reads them: tokenizer_config.json's ``eos_token`` /
``pad_token`` / ``unk_token`` / ``bos_token`` (a legacy special_tokens_map.json over it
where the config has no ``added_tokens_decoder``; defaults ``</s>`` / ``<pad>`` /
``<unk>``, no bos), its ``additional_special_tokens`` (or v5's ``extra_special_tokens``)
and ``clean_up_tokenization_spaces``. A special token written in a text is that token;
``decode(skip_special_tokens=True)`` drops them.

transformers 5 rebuilds T5's and BART's pipelines from a tokenizer.json's vocabulary
instead of reading the file's normalizer / pre-tokenizer: for the files it writes (and
those of the hub's checkpoints) the two agree.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..files import CheckpointError
from .seq2seq_base import (
    DEFAULT_SPECIALS,
    SPECIAL_NAMES,
    SPECIAL_TOKENS_MAP,
    TOKENIZER_CONFIG,
    Seq2SeqTokenizer,
    check_embedding_rows,
    read_cleanup,
    read_config,
    read_specials,
)
from .seq2seq_spm import MarianSpmTokenizer, T5SpmTokenizer

__all__ = ["JsonSeq2SeqTokenizer", "MarianSpmTokenizer", "Seq2SeqTokenizer", "T5SpmTokenizer",
           "check_embedding_rows", "load_seq2seq_tokenizer"]

_JSON = "tokenizer.json"
#: transformers' files beside a tokenizer.json (copied by ``save``, not read)
_COMPANIONS = ("vocab.json", "merges.txt", "spiece.model")


# ------------------------------------------------------------------------------ loading

def load_seq2seq_tokenizer(directory: str | os.PathLike) -> Seq2SeqTokenizer:
    """The tokenizer of an HF encoder-decoder model directory (files and special tokens: the
    module docstring).

    Raises:
        CheckpointError: no tokenizer files, a missing .spm / vocab.json (named), a file
        that does not read, a vocab.json that does not cover its .spm, or a special token
        the vocabulary lacks."""
    directory = Path(directory)
    config = read_config(directory / TOKENIZER_CONFIG)
    marian = config.get("tokenizer_class") == "MarianTokenizer"
    if marian or any((directory / n).exists() for n in MarianSpmTokenizer.model_files):
        return MarianSpmTokenizer.load(directory, config)
    if (directory / _JSON).exists():
        return JsonSeq2SeqTokenizer.load(directory, config)
    if (directory / T5SpmTokenizer.model_file).exists():
        return T5SpmTokenizer.load(directory, config)
    raise CheckpointError(f"{directory}: no tokenizer files (tokenizer.json, spiece.model, or "
                          f"source.spm + target.spm + vocab.json)")


# ------------------------------------------------------------------------ tokenizer.json

class JsonSeq2SeqTokenizer(Seq2SeqTokenizer):
    """A tokenizer.json through the ``tokenizers`` package (BART; T5's and Flan-T5's fast
    tokenizer), as transformers' fast tokenizers. Build one with ``load``.

    Args (beyond ``Seq2SeqTokenizer``'s): hf: the ``tokenizers.Tokenizer``, with every
    special token the directory names added as a special token (as transformers adds them).
    """

    kind = "tokenizers"

    def __init__(self, directory: Path, files, *, hf, ids: dict[str, int | None],
                 cleanup: bool) -> None:
        super().__init__(directory, files, vocab_file=_JSON, eos_id=ids["eos_token"],
                         pad_id=ids["pad_token"], unk_id=ids["unk_token"],
                         bos_id=ids["bos_token"],
                         vocab_size=hf.get_vocab_size(with_added_tokens=True), cleanup=cleanup)
        self.hf = hf

    @classmethod
    def load(cls, directory: Path, config: dict) -> JsonSeq2SeqTokenizer:
        """The tokenizer.json of ``directory`` (``config``: its tokenizer_config.json). A
        special token the directory does not name is the default of transformers' T5 /
        BART classes (``</s>``, ``<pad>``, ``<unk>``) where the vocabulary has it.

        Raises:
            CheckpointError: an unreadable tokenizer.json, a named special token it lacks,
            or no eos / pad token."""
        from tokenizers import AddedToken, Tokenizer

        path = directory / _JSON
        try:
            hf = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises bare Exceptions
            raise CheckpointError(f"{path}: not a HuggingFace tokenizer ({exc})") from None
        named, extra = read_specials(directory, config)
        for key, default in DEFAULT_SPECIALS.items():
            if key not in named and hf.token_to_id(default) is not None:
                named[key] = default
        ids = {key: None if key not in named else hf.token_to_id(named[key])
               for key in SPECIAL_NAMES}
        for key, tid in ids.items():
            if key in named and tid is None:
                raise CheckpointError(f"{directory / TOKENIZER_CONFIG}: {key} {named[key]!r} "
                                      f"is not a token of {path}")
        for key in ("eos_token", "pad_token"):
            if ids[key] is None:
                raise CheckpointError(f"{directory}: the tokenizer names no {key} (not in "
                                      f"{TOKENIZER_CONFIG}, and {DEFAULT_SPECIALS[key]!r} is "
                                      f"not in {path})")
        present = {t.content for t in hf.get_added_tokens_decoder().values()}
        new = [t for t in (*named.values(), *(extra or ())) if t not in present]
        if new:
            hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in new])
        # transformers skips the clean-up for BPE models unless told twice
        cleanup = read_cleanup(directory, config) and (
            type(hf.model).__name__ != "BPE" or config.get(
                "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
            is True)
        files = [n for n in (_JSON, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, *_COMPANIONS)
                 if (directory / n).is_file()]
        return cls(directory, files, hf=hf, ids=ids, cleanup=cleanup)

    def _encode(self, text: str, *, target: bool) -> list[int]:
        return self.hf.encode(text).ids

    def _decode(self, ids: list[int], skip: bool) -> str:
        return self._clean(self.hf.decode(ids, skip_special_tokens=skip))
