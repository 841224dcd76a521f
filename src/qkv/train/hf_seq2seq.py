"""Fine-tuning an HF encoder-decoder (T5 / Flan-T5, BART, Marian, loaded into a qkv
``Transformer`` by ``qkv.models.from_pretrained``) on source/target pairs with the
directory's own tokenizer (``qkv.data.seq2seq_tokenizer.Seq2SeqTokenizer``), as
transformers trains it: what the ``transformer`` model kind (``kinds/transformer.py``) calls
when its tokenizer is such a one.

Shapes: B batch, S source length, N target length, V vocabulary.

**Batch** (``seq2seq_batch``): ``src`` (B, S) = ``tokenizer.encode(source)`` (the framing is
the tokenizer's: T5 / Marian ``text </s>``, BART ``<s> text </s>``), right-padded with the
pad id, and ``src_mask`` (B, S) bool, True = real token (transformers' ``attention_mask``);
``tgt_out`` (B, N) = ``tokenizer.encode_target(target)`` (eos included; Marian through its
target.spm), -100 on padding: transformers' ``labels``. The decoder's input is built from the
labels by the model's own start id (``seq2seq_logits``): ``shift_right(tgt_out,
start=config.bos_id, pad=config.pad_id)``, transformers' ``shift_tokens_right`` (T5's
``_shift_right``) with ``decoder_start_token_id`` = ``config.bos_id``. The loss is the token
cross-entropy on the labels only: with no label smoothing, transformers'
``model(input_ids, attention_mask, labels=...).loss``.

**Data** (``seq2seq_data``): a ``--data`` TSV of pairs. Every text must encode without the
tokenizer's unknown id (fine-tuning keeps the base's vocabulary), and with absolute
positions (BART, Marian) every source and label sequence must fit the model's ``max_len``.

**Tokenizer files** (``seq2seq_tokenizer_of`` / ``save_run_tokenizer``): a run's checkpoint
holds the tokenizer's own files (``Seq2SeqTokenizer.save``: tokenizer.json, spiece.model or
source.spm + target.spm + vocab.json, and tokenizer_config.json), and is read back as one
whenever the directory's model is an encoder-decoder — config.json's ``model_type`` (an HF
one, or qkv's own ``qkv-transformer`` after full fine-tuning) or, for an adapter checkpoint,
its base's — and its tokenizer.json, if any, is not one of qkv's own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..data.seq2seq_tokenizer import Seq2SeqTokenizer, check_embedding_rows
from ..files import CheckpointError, read_json
from .data import IGNORE, PairData, pad_rows

__all__ = ["check_seq2seq_base", "is_seq2seq_tokenizer", "save_run_tokenizer", "seq2seq_batch",
           "seq2seq_data", "seq2seq_logits", "seq2seq_tokenizer_of", "shift_right"]


def is_seq2seq_tokenizer(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` is an HF encoder-decoder directory's (a ``Seq2SeqTokenizer``)."""
    return isinstance(tokenizer, Seq2SeqTokenizer)


# --------------------------------------------------------------------------- tokenizer files

def _json_field(path: Path, key: str) -> Any:
    """``key`` of the JSON object in ``path`` (None when it is missing or unreadable)."""
    try:
        data = read_json(path) if path.is_file() else None
    except CheckpointError:
        return None
    return data.get(key) if isinstance(data, dict) else None


def _model_type(directory: Path) -> Any:
    """config.json's ``model_type`` of a model directory, else that of the base an adapter
    checkpoint's base.json names (None when neither is readable)."""
    if (directory / "config.json").is_file():
        return _json_field(directory / "config.json", "model_type")
    base = _json_field(directory / "base.json", "path")
    return _json_field(Path(base) / "config.json", "model_type") if isinstance(base, str) else None


def _encoder_decoder(directory: Path) -> str | None:
    """The ``model_type`` (``_model_type``) of a directory whose model is an
    encoder-decoder (``Transformer``), else None."""
    from ..models import Transformer, registry

    model_type = _model_type(directory)
    if (isinstance(model_type, str) and model_type in registry.known_model_types()
            and issubclass(registry.model_class(model_type), Transformer)):
        return model_type
    return None


#: the files of a ``Seq2SeqTokenizer`` besides tokenizer.json (Marian's, T5's)
_SPM_FILES = ("source.spm", "target.spm", "spiece.model")


def seq2seq_tokenizer_of(directory: str | os.PathLike) -> Seq2SeqTokenizer | None:
    """The ``Seq2SeqTokenizer`` of a directory whose model is an encoder-decoder (an HF T5 /
    BART / Marian directory, a checkpoint of a run fine-tuning one, a model merged from such
    a run), read by ``load_seq2seq_tokenizer``; None when the model is not an
    encoder-decoder, when its tokenizer.json is one of qkv's own (``qkv.data``'s, of a
    ``qkv train`` Transformer), or when a directory of qkv's own model type has no
    tokenizer files at all (its reader names what is missing).

    Raises:
        CheckpointError: an HF encoder-decoder directory without tokenizer files it reads
        (naming the files looked for)."""
    from ..data.seq2seq_tokenizer import load_seq2seq_tokenizer
    from ..models import registry
    from ..models.hub import tokenizer_file_kind

    directory = Path(directory)
    model_type = _encoder_decoder(directory)
    if model_type is None:
        return None
    json_file = directory / "tokenizer.json"
    if json_file.is_file():
        if tokenizer_file_kind(json_file) in (None, "qkv"):
            return None  # qkv's own (unreadable: qkv's reader names why)
    elif (model_type not in registry.known_hf_model_types()
          and not any((directory / n).is_file() for n in _SPM_FILES)):
        return None
    return load_seq2seq_tokenizer(directory)


def save_run_tokenizer(tokenizer: Any, directory: str | os.PathLike) -> None:
    """Write a run's tokenizer into a checkpoint (or merged model) ``directory``: a
    ``Seq2SeqTokenizer``'s own files (``save(directory)``), else ``tokenizer.json`` (and the
    files a tokenizer writes beside it: ``save(directory / "tokenizer.json")``)."""
    directory = Path(directory)
    if is_seq2seq_tokenizer(tokenizer):
        tokenizer.save(directory)
    else:
        tokenizer.save(directory / "tokenizer.json")


def check_seq2seq_base(model: nn.Module, tokenizer: Seq2SeqTokenizer, init_from: Any) -> None:
    """Refuse a base whose tokenizer does not fit it: embedding rows (``check_embedding_rows``
    on both sides) and the pad and eos ids, which the batches are written with.

    Raises:
        CheckpointError: one line naming the sizes or ids."""
    c = model.config
    where = f"--init-from {init_from}"
    check_embedding_rows(tokenizer, c.src_vocab_size, f"{where}: src_vocab_size")
    check_embedding_rows(tokenizer, c.tgt_vocab_size, f"{where}: tgt_vocab_size", target=True)
    for name, ours, theirs in (("pad", tokenizer.pad_id, c.pad_id),
                               ("eos", tokenizer.eos_id, c.eos_id)):
        if ours != theirs:
            raise CheckpointError(f"{where}: the tokenizer's {name} id is {ours} but the "
                                  f"model's config.json says {theirs}; the tokenizer belongs "
                                  f"to another model")


# ------------------------------------------------------------------------------------ data

def seq2seq_data(config: Any, tokenizer: Seq2SeqTokenizer, max_len: int | None, *,
                 absolute: bool) -> tuple[PairData, int]:
    """``(data, seq_len)`` of a ``--data`` pairs file for ``tokenizer``: the file's pairs
    split into training and held-out ones, and the longest source or label sequence
    (tokens, framing and eos included). ``max_len``: the model's context length, a bound
    only with ``absolute`` positions (BART / Marian; T5's relative positions bound none).

    Raises:
        ValueError: an embedded task (the pairs come from --data), a text the tokenizer
            reads as unknown, a sequence beyond ``max_len`` or beyond ``config.max_len``."""
    from ..data import read_pairs

    base = config.init_from
    if config.task is not None or config.data is None:
        raise ValueError(f"--init-from {base}: an HuggingFace encoder-decoder trains on "
                         f"--data (a TSV of source<TAB>target pairs, read with its own "
                         f"tokenizer), got task {config.task!r}")
    pairs = read_pairs(config.data)
    need = 0
    for source, target in pairs:
        for text, ids in ((source, tokenizer.encode(source)),
                          (target, tokenizer.encode_target(target))):
            if tokenizer.unk_id is not None and tokenizer.unk_id in ids:
                raise ValueError(f"--data {config.data}: the base's tokenizer ({base}) reads "
                                 f"part of {text[:40]!r} as unknown; fine-tuning keeps the "
                                 f"base's vocabulary")
            need = max(need, len(ids))
    limit = max_len if absolute else None
    if limit is not None and need > limit:
        raise ValueError(f"--data {config.data}: the longest example needs {need} tokens with "
                         f"its special tokens, beyond the base's max_len={limit} ({base})")
    if config.max_len is not None and config.max_len < need:
        raise ValueError(f"max_len={config.max_len} is shorter than the longest example "
                         f"({need} tokens with its special tokens); raise --max-len or leave "
                         f"it out")
    if config.max_len is not None and limit is not None and config.max_len > limit:
        raise ValueError(f"max_len={config.max_len} is beyond the base's max_len={limit} "
                         f"({base}); the base fixes the context length")
    return PairData.from_file(pairs, seed=config.seed), need


# ----------------------------------------------------------------------------------- batch

def seq2seq_batch(items: list[tuple[str, str]], tokenizer: Seq2SeqTokenizer
                  ) -> dict[str, Tensor]:
    """``{"src" (B, S), "src_mask" (B, S) bool, "tgt_out" (B, N)}`` of source/target pairs:
    the tokenizer's framing, right-padded (the module docstring)."""
    src = [tokenizer.encode(s) for s, _ in items]
    labels = [tokenizer.encode_target(t) for _, t in items]
    ids = pad_rows(src, tokenizer.pad_id)  # (B, S)
    width = ids.shape[1]
    keep = torch.tensor([[True] * len(r) + [False] * (width - len(r)) for r in src])
    return {"src": ids, "src_mask": keep, "tgt_out": pad_rows(labels, IGNORE)}


def shift_right(labels: Tensor, *, start: int, pad: int) -> Tensor:
    """The decoder's input (B, N) for ``labels`` (B, N, -100 where nothing is predicted):
    ``start`` then the labels moved one position right, -100 replaced by ``pad``
    (transformers' ``shift_tokens_right``)."""
    out = labels.new_full(labels.shape, start)
    out[:, 1:] = labels[:, :-1]
    return out.masked_fill(out == IGNORE, pad)


def seq2seq_logits(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Logits (B, N, V) of ``model`` (a ``Transformer``, possibly wrapped by DDP) on a
    ``seq2seq_batch``, its decoder started at ``config.bos_id``, and the labels (B, N)."""
    config = getattr(model, "module", model).config
    labels = batch["tgt_out"]
    tgt_in = shift_right(labels, start=config.bos_id, pad=config.pad_id)
    return model(batch["src"], tgt_in, src_mask=batch["src_mask"]), labels
