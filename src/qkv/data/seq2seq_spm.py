"""The SentencePiece tokenizers of ``qkv.data.seq2seq_tokenizer``: ``MarianSpmTokenizer``
(source.spm + target.spm + vocab.json, as transformers' MarianTokenizer) and
``T5SpmTokenizer`` (spiece.model + ``extra_ids`` sentinels, as transformers' T5Tokenizer).
Both frame a text as ``text </s>``.

Shapes: N ids of one text.
"""

from __future__ import annotations

from pathlib import Path

from ..files import CheckpointError, read_json
from .seq2seq_base import (
    DEFAULT_SPECIALS,
    SPECIAL_TOKENS_MAP,
    TOKENIZER_CONFIG,
    Seq2SeqTokenizer,
    added_token_pattern,
    read_cleanup,
    read_specials,
    split_at_added,
)

__all__ = ["MarianSpmTokenizer", "T5SpmTokenizer"]

_SPIECE = "spiece.model"
_SOURCE_SPM, _TARGET_SPM = "source.spm", "target.spm"
_VOCAB, _TARGET_VOCAB = "vocab.json", "target_vocab.json"
#: Below this share of an .spm's pieces in vocab.json, the vocabulary is another model's.
_MIN_COVERAGE = 0.5
_SPIECE_UNDERLINE = "▁"


def _load_spm(path: Path):
    """The ``sentencepiece.SentencePieceProcessor`` of the model file ``path``.

    Raises:
        CheckpointError: no such file, or not a SentencePiece model."""
    import sentencepiece

    if not path.is_file():
        raise CheckpointError(f"{path} is missing (a SentencePiece model of the tokenizer)")
    try:
        return sentencepiece.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: not a SentencePiece model "
                              f"({str(exc).splitlines()[0]})") from None


def _refuse_added_tokens(directory: Path) -> None:
    """transformers would add added_tokens.json's tokens to the vocabulary: refused."""
    if (directory / "added_tokens.json").exists():
        raise CheckpointError(f"{directory / 'added_tokens.json'}: tokens added beside a "
                              f"SentencePiece vocabulary are not supported")


# -------------------------------------------------------------------------------- Marian

class MarianSpmTokenizer(Seq2SeqTokenizer):
    """Marian's two SentencePiece models and vocab.json, as transformers' MarianTokenizer
    (``qkv.data.seq2seq_tokenizer``'s docstring). Build one with ``load``.

    Args (beyond ``Seq2SeqTokenizer``'s):
        spm_source, spm_target: the ``sentencepiece.SentencePieceProcessor`` of source.spm
            and target.spm.
        vocab, target_vocab: piece -> id (vocab.json; target_vocab.json with
            ``separate_vocabs``, else vocab.json again).
        specials: the added tokens, text -> id (the named special tokens and the listed
            additional ones, ids from vocab.json: transformers' added tokens).
        separate: ``separate_vocabs``: decode through target.spm and target_vocab.json
            (else, as transformers, through source.spm and vocab.json).
    """

    kind = "marian"
    exact_rows = True
    #: either of them makes a directory a Marian one
    model_files = (_SOURCE_SPM, _TARGET_SPM)

    def __init__(self, directory: Path, files, *, spm_source, spm_target,
                 vocab: dict[str, int], target_vocab: dict[str, int],
                 specials: dict[str, int], separate: bool, named: dict[str, str],
                 cleanup: bool) -> None:
        super().__init__(directory, files, vocab_file=_VOCAB,
                         target_vocab_file=_TARGET_VOCAB if separate else _VOCAB,
                         eos_id=vocab[named["eos_token"]], pad_id=vocab[named["pad_token"]],
                         unk_id=vocab[named["unk_token"]],
                         bos_id=vocab.get(named.get("bos_token", "")),
                         vocab_size=len(vocab), target_vocab_size=len(target_vocab),
                         cleanup=cleanup)
        self.spm_source, self.spm_target = spm_source, spm_target
        self.vocab, self.target_vocab = vocab, target_vocab
        self.specials, self.special_ids = specials, set(specials.values())
        self.separate = separate
        self._by_id = {i: t for t, i in target_vocab.items()}
        self._by_id.update({i: t for t, i in specials.items()})
        self._pattern = added_token_pattern(list(specials))

    @classmethod
    def load(cls, directory: Path, config: dict) -> MarianSpmTokenizer:
        """The Marian tokenizer of ``directory`` (``config``: its tokenizer_config.json).

        Raises:
            CheckpointError: a missing or unreadable file (named), a vocab.json whose ids
            are not 0..N-1, one that covers under half of an .spm's pieces, or a special
            token it lacks."""
        _refuse_added_tokens(directory)
        separate = config.get("separate_vocabs", False)
        if not isinstance(separate, bool):
            raise CheckpointError(f"{directory / TOKENIZER_CONFIG}: separate_vocabs must be "
                                  f"true or false, got {separate!r}")
        needed = (_SOURCE_SPM, _TARGET_SPM, _VOCAB, *((_TARGET_VOCAB,) if separate else ()))
        for name in needed:
            if not (directory / name).is_file():
                raise CheckpointError(f"{directory / name} is missing (a Marian tokenizer "
                                      f"needs {', '.join(needed)})")
        spm_source = _load_spm(directory / _SOURCE_SPM)
        spm_target = _load_spm(directory / _TARGET_SPM)
        vocab = _read_vocab(directory / _VOCAB)
        target_vocab = _read_vocab(directory / _TARGET_VOCAB) if separate else vocab
        _check_coverage(directory / _VOCAB, vocab, directory / _SOURCE_SPM, spm_source)
        _check_coverage(directory / (_TARGET_VOCAB if separate else _VOCAB), target_vocab,
                        directory / _TARGET_SPM, spm_target)
        named, extra = read_specials(directory, config)
        named = {**DEFAULT_SPECIALS, **named}
        specials = {}
        for text in (*named.values(), *(extra or ())):
            if text not in vocab:
                raise CheckpointError(f"{directory / _VOCAB}: the special token {text!r} is "
                                      f"not in it")
            specials[text] = vocab[text]
        files = [n for n in (*needed, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP)
                 if (directory / n).is_file()]
        return cls(directory, files, spm_source=spm_source, spm_target=spm_target,
                   vocab=vocab, target_vocab=target_vocab, specials=specials,
                   separate=separate, named=named, cleanup=read_cleanup(directory, config))

    def _encode(self, text: str, *, target: bool) -> list[int]:
        spm = self.spm_target if target else self.spm_source
        vocab = self.target_vocab if target else self.vocab
        ids = []
        for piece, added in split_at_added(self._pattern, text):
            if added:
                ids.append(self.specials[piece])
                continue
            pieces = []
            if piece.startswith(">>") and (end := piece.find("<<")) != -1:
                pieces.append(piece[:end + 2])  # a language code: one token
                piece = piece[end + 2:]
            pieces += spm.encode(piece, out_type=str)
            ids += [vocab.get(p, self.unk_id) for p in pieces]
        return [*ids, self.eos_id]

    def _decode(self, ids: list[int], skip: bool) -> str:
        spm = self.spm_target if self.separate else self.spm_source
        tokens = []
        for i in ids:
            if skip and i in self.special_ids:
                continue
            if i in self._by_id:
                tokens.append(self._by_id[i])
            elif i < spm.get_piece_size():
                tokens.append(spm.id_to_piece(i))
            else:
                raise ValueError(f"decode: id {i} is beyond the vocabulary "
                                 f"({self.target_vocab_size} ids)")
        out, run = "", []
        for token in tokens:  # transformers' convert_tokens_to_string
            if token in self.specials:
                out += spm.decode_pieces(run) + token + " "
                run = []
            else:
                run.append(token)
        out += spm.decode_pieces(run)
        return self._clean(out.replace(_SPIECE_UNDERLINE, " ").strip())


def _read_vocab(path: Path) -> dict[str, int]:
    """vocab.json: piece -> id, the ids 0..N-1 each once (Marian's embedding rows)."""
    vocab = read_json(path)
    ids = list(vocab.values())
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids) or (
            sorted(ids) != list(range(len(ids)))):
        raise CheckpointError(f"{path}: the ids must be 0 .. {len(ids) - 1}, each once")
    return vocab


def _check_coverage(vocab_path: Path, vocab: dict[str, int], spm_path: Path, spm) -> None:
    """Refuse a vocab.json holding under ``_MIN_COVERAGE`` of the .spm's pieces (control and
    unknown pieces aside): another model's. A few pieces missing are allowed (Marian builds
    vocab.json from its training data; transformers maps such a piece to unk)."""
    pieces = [spm.id_to_piece(i) for i in range(spm.get_piece_size())
              if not (spm.is_control(i) or spm.is_unknown(i))]
    found = sum(p in vocab for p in pieces)
    if found < _MIN_COVERAGE * len(pieces):
        raise CheckpointError(f"{vocab_path} covers {found} of the {len(pieces)} pieces of "
                              f"{spm_path}: it is another tokenizer's vocabulary")


# ------------------------------------------------------------------------------------ T5

def _sentinel_ids(pieces: int, extra_ids: int) -> dict[str, int]:
    """T5's sentinels after the model's ``pieces``, in reverse: ``<extra_id_0>`` the last id."""
    return {f"<extra_id_{k}>": pieces + extra_ids - 1 - k for k in range(extra_ids)}


class T5SpmTokenizer(Seq2SeqTokenizer):
    """spiece.model with ``extra_ids`` sentinels, as transformers' T5Tokenizer
    (``qkv.data.seq2seq_tokenizer``'s docstring). Build one with ``load``.

    Args (beyond ``Seq2SeqTokenizer``'s):
        spm: the ``sentencepiece.SentencePieceProcessor`` of spiece.model.
        extra_ids: the number of sentinels; ``<extra_id_k>`` is id
            ``pieces + extra_ids - 1 - k``.
        specials: the added special tokens, text -> id (dropped by ``decode``). The
            model's user-defined pieces are not among them: SentencePiece matches those
            inside the text itself (``_encode``).
    """

    kind = "t5"
    model_file = _SPIECE

    def __init__(self, directory: Path, files, *, spm, extra_ids: int,
                 specials: dict[str, int], named: dict[str, str], cleanup: bool) -> None:
        self.spm, self.pieces = spm, spm.get_piece_size()
        super().__init__(directory, files, vocab_file=_SPIECE,
                         eos_id=specials[named["eos_token"]],
                         pad_id=specials[named["pad_token"]],
                         unk_id=specials[named["unk_token"]],
                         bos_id=specials.get(named.get("bos_token", "")),
                         vocab_size=self.pieces + extra_ids, cleanup=cleanup)
        self.extra_ids = extra_ids
        self.specials, self.special_ids = specials, set(specials.values())
        self._sentinels = {i: t for t, i in _sentinel_ids(self.pieces, extra_ids).items()}
        self._pattern = added_token_pattern(list(specials))
        byte_ids = (spm.piece_to_id(f"<0x{b:02X}>") for b in range(256))
        self._byte_ids = {i for i in byte_ids if spm.is_byte(i)}

    @classmethod
    def load(cls, directory: Path, config: dict) -> T5SpmTokenizer:
        """The T5 tokenizer of ``directory`` (``config``: its tokenizer_config.json).
        The added tokens, as transformers: the named special tokens, and either the listed
        ``additional_special_tokens`` (the sentinels added when none is listed) or, with no
        list, the sentinels and the model's control pieces. With a list, a text spelling
        one of the model's other control pieces is not split as transformers' Unigram model
        would split it. The model's user-defined pieces are no added tokens: SentencePiece
        matches them in the text (``_encode``).

        Raises:
            CheckpointError: a missing or unreadable spiece.model, a bad ``extra_ids``, a
            list of sentinels other than ``extra_ids`` of them, or a special token that is
            no piece."""
        _refuse_added_tokens(directory)
        spm = _load_spm(directory / _SPIECE)
        n = spm.get_piece_size()
        extra_ids = config.get("extra_ids", 100)
        if not isinstance(extra_ids, int) or isinstance(extra_ids, bool) or extra_ids < 0:
            raise CheckpointError(f"{directory / TOKENIZER_CONFIG}: extra_ids must be an int "
                                  f">= 0, got {extra_ids!r}")
        sentinels = _sentinel_ids(n, extra_ids)
        named, extra = read_specials(directory, config)
        named = {**DEFAULT_SPECIALS, **named}

        def piece_id(text: str) -> int:
            tid = sentinels.get(text, spm.piece_to_id(text))
            if tid < n and spm.id_to_piece(tid) != text:
                raise CheckpointError(f"{directory / TOKENIZER_CONFIG}: the special token "
                                      f"{text!r} is not a piece of {directory / _SPIECE}")
            return tid

        specials = {t: piece_id(t) for t in named.values()}
        if extra is None:
            specials.update((spm.id_to_piece(i), i) for i in range(n) if spm.is_control(i))
            specials.update(sentinels)
        else:
            listed = [t for t in extra if t.startswith("<extra_id_")]
            if not listed:
                extra = [*extra, *sentinels]
            elif len(listed) != extra_ids:
                raise CheckpointError(f"{directory / TOKENIZER_CONFIG}: "
                                      f"additional_special_tokens lists {len(listed)} "
                                      f"<extra_id_N> tokens but extra_ids is {extra_ids}")
            specials.update((t, piece_id(t)) for t in extra)
        files = [nm for nm in (_SPIECE, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP)
                 if (directory / nm).is_file()]
        return cls(directory, files, spm=spm, extra_ids=extra_ids, specials=specials,
                   named=named, cleanup=read_cleanup(directory, config))

    def _encode(self, text: str, *, target: bool) -> list[int]:
        """The text split at the added (special) tokens, each other part through
        SentencePiece, which matches the model's user-defined pieces inside it with no
        "▁" after one (``a<sep>b`` is ``▁a <sep> b``), as SentencePiece itself and the
        ``tokenizers`` Unigram model transformers (>= 5.25) converts spiece.model to do;
        transformers 5.24 and before split them out as added tokens and began the rest
        with a "▁"."""
        ids: list[int] = []
        for piece, added in split_at_added(self._pattern, text):
            if added:
                ids.append(self.specials[piece])
                continue
            after_byte = False
            for i in self.spm.encode(piece):
                is_byte = i in self._byte_ids  # transformers' T5 has no byte fallback:
                if not (is_byte and after_byte):  # a run of unknown characters is one unk
                    ids.append(self.unk_id if is_byte else i)
                after_byte = is_byte
        return [*ids, self.eos_id]

    def _decode(self, ids: list[int], skip: bool) -> str:
        tokens = []
        for i in ids:
            if skip and i in self.special_ids:
                continue
            if i < self.pieces:
                tokens.append(self.spm.id_to_piece(i))
            elif i in self._sentinels:  # beyond the vocabulary: nothing, as tokenizers
                tokens.append(self._sentinels[i])
        # the tokenizers Metaspace decoder: "▁" a space, and none in the first token
        text = "".join(t.replace(_SPIECE_UNDERLINE, "" if k == 0 else " ")
                       for k, t in enumerate(tokens))
        return self._clean(text)
