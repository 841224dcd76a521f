"""HuggingFace encoder-decoder directories (T5 / Flan-T5, BART, Marian opus-mt) for
``qkv translate DIR`` and ``qkv attention DIR``: telling one from a ``qkv train`` run, and
reading its model, tokenizer and generation settings, with one-line errors.

A directory is one when its config.json names an HF ``model_type`` that
``qkv.models.from_pretrained`` reads into a ``Transformer`` (t5, bart, marian). It needs,
besides config.json and the weights, the tokenizer files ``qkv.data.load_seq2seq_tokenizer``
reads (tokenizer.json, spiece.model, or source.spm + target.spm + vocab.json); its
generation_config.json (else config.json's generation fields) gives the decoding defaults.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

__all__ = ["Seq2SeqDirectory", "is_seq2seq_directory", "load_seq2seq_directory",
           "stop_token_ids", "token_strings", "warn_unknown_pieces"]


def is_seq2seq_directory(path: Path) -> bool:
    """Whether ``path`` holds a config.json of an HF encoder-decoder qkv reads (a
    ``model_type`` of the ``Transformer``'s HF mappings); a qkv run or model directory
    (``qkv-*`` types) or any unreadable config.json is not one."""
    from ..files import CheckpointError, read_json
    from ..models import Transformer
    from ..models.registry import entry_for

    config = path / "config.json"
    if not config.is_file():
        return False
    try:
        model_type = read_json(config).get("model_type")
        entry = entry_for(model_type)
    except (CheckpointError, AttributeError):
        return False
    return entry.model_class is Transformer and model_type in entry.hf_model_types


class Seq2SeqDirectory:
    """A loaded HF encoder-decoder directory.

    Attributes:
        path: the directory. model: its ``qkv.models.Transformer`` (eval mode; int8 weights
            with ``int8``). tokenizer: its ``Seq2SeqTokenizer``. settings: its
            ``GenerationSettings``.
    """

    def __init__(self, path: Path, model: Any, tokenizer: Any, settings: Any) -> None:
        self.path, self.model, self.tokenizer, self.settings = path, model, tokenizer, settings

    def decoding(self, **explicit: Any) -> dict[str, Any]:
        """``qkv.generate`` options: the settings' (``generate_kwargs``), then every
        ``explicit`` option that is not None over them."""
        kw = self.settings.generate_kwargs(encoder_decoder=True)
        kw.update({k: v for k, v in explicit.items() if v is not None})
        return kw

    def start_id(self) -> int:
        """The decoder's first token: the settings' ``decoder_start_token_id`` (else their
        ``bos_token_id``), else the model's ``bos_id`` (config.json's)."""
        return self.decoding().get("decoder_start_token_id", self.model.config.bos_id)


def load_seq2seq_directory(path: Path, *, int8: bool = False) -> Seq2SeqDirectory:
    """The model, tokenizer and generation settings of ``path``; ``int8``: the model's
    weights quantized to int8 in memory (``qkv.quantize``; the directory is unchanged).

    Raises:
        UserError / CheckpointError (one line): no tokenizer files (naming the files looked
        for), a tokenizer whose vocabulary does not fit the embedding, unreadable generation
        settings, a model int8 cannot hold."""
    from ..data.seq2seq_tokenizer import check_embedding_rows, load_seq2seq_tokenizer
    from ..files import CheckpointError
    from ..models import from_pretrained
    from ..models.generation_settings import read_generation_settings
    from . import UserError

    try:  # the tokenizer first: a directory without one fails before the weights are read
        tokenizer = load_seq2seq_tokenizer(path)
    except CheckpointError as exc:
        raise UserError(f"{exc}; qkv translate / attention need the tokenizer files beside "
                        f"config.json (as the Hub's repository has them)") from None
    settings = read_generation_settings(path)
    model = from_pretrained(path)
    c = model.config
    check_embedding_rows(tokenizer, c.src_vocab_size, f"{path / 'config.json'} vocab_size")
    check_embedding_rows(tokenizer, c.tgt_vocab_size, f"{path / 'config.json'} vocab_size",
                         target=True)
    if int8:
        from ..generation.quantize import quantize

        try:
            quantize(model.float().cpu(), "int8")
        except (TypeError, ValueError) as err:
            raise UserError(f"--int8: {err}") from None
    return Seq2SeqDirectory(path, model, tokenizer, settings)


def stop_token_ids(tokenizer: Any, stops: list[str]) -> list[int]:
    """The ids of ``--stop`` texts for an HF directory's tokenizer: each exactly one token of
    the target side (its framing — bos, the appended eos — left out).

    Raises:
        UserError: a text that is not one token."""
    from . import UserError

    frame = {tokenizer.eos_id, tokenizer.bos_id}
    ids = []
    for text in stops:
        enc = [i for i in tokenizer.encode_target(text) if i not in frame]
        if len(enc) != 1:
            shown = " ".join(repr(t) for t in token_strings(tokenizer, enc)) or "no token"
            raise UserError(f"--stop {text!r} is {len(enc)} tokens of this model's tokenizer "
                            f"({shown}); a stop token must be exactly one token")
        ids.append(enc[0])
    return ids


def token_strings(tokenizer: Any, ids: list[int]) -> list[str]:
    """A display string per id: its decoding alone, special tokens kept (``</s>``,
    ``<pad>``); a piece that decodes to nothing (a lone word-start mark) as ``▁``."""
    return [tokenizer.decode([i], skip_special_tokens=False) or "▁" for i in ids]


def warn_unknown_pieces(tokenizer: Any, texts: list[str]) -> None:
    """One line on stderr when the inputs hold text the tokenizer reads as its unknown token
    (the model sees unk in its place)."""
    unk = tokenizer.unk_id
    if unk is None:
        return
    count = sum(tokenizer.encode(t).count(unk) for t in texts)
    if count:
        print(f"qkv: warning: {count} piece(s) of the input are unknown to the model's "
              f"tokenizer (read as its unk token)", file=sys.stderr)
