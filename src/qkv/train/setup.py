"""From a ``TrainConfig`` to data and a tokenizer: the embedded task or the user's file, a
character or BPE tokenizer fitted to it, and the context length the model needs.

``prepare_data`` / ``load_data`` ask the run's model kind (``qkv.train.kinds``); the token
kinds (transformer, gpt, bert-mlm) call the shared ``prepare_token_data`` /
``load_token_data`` here with themselves as ``kind``: what differs between them is whether
a ``--data`` file holds pairs (``kind.reads_pairs_file``) and how many tokens a pair needs
with its special tokens (``kind.pair_tokens(source, target)``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from .data import PairData, TextData

if TYPE_CHECKING:
    from .config import TrainConfig

__all__ = ["DEFAULT_TEXT_WINDOW", "check_model_fits_data", "load_data", "load_token_data",
           "prepare_data", "prepare_token_data", "trains_on_pairs"]

#: tokens per training window of a plain-text file when ``max_len`` is not given
DEFAULT_TEXT_WINDOW = 128


def trains_on_pairs(config: TrainConfig, kind: Any) -> bool:
    """Whether a token kind's run trains on source/target pairs: an embedded task, or a
    ``--data`` file of a kind that reads pairs files (else the file is plain text)."""
    return config.task is not None or bool(kind.reads_pairs_file)


def _read(config: TrainConfig, kind: Any) -> tuple[Any, list[str]]:
    """The raw source (a Task, a list of pairs or a text) and texts to fit a tokenizer on."""
    from ..data import get_task, read_pairs, read_text

    if config.task is not None:
        task = get_task(config.task, seed=config.seed)
        return task, []
    if kind.reads_pairs_file:
        pairs = read_pairs(config.data)
        return pairs, [t for pair in pairs for t in pair]
    text = read_text(config.data)
    return text, [text]


def prepare_data(config: TrainConfig) -> tuple[Any, Any, int, int]:
    """Data, a new tokenizer fitted to it, the context length (tokens) of the model, and the
    longest sequence a training step holds — of ``config.model``'s kind."""
    from .kinds import get_kind

    return get_kind(config.model).prepare_data(config)


def load_data(config: TrainConfig, tokenizer: Any, max_len: int) -> Any:
    """The data of a run being resumed (``config.model``'s kind), with its saved tokenizer
    and context length."""
    from .kinds import get_kind

    return get_kind(config.model).load_data(config, tokenizer, max_len)


def prepare_token_data(config: TrainConfig, kind: Any
                       ) -> tuple[PairData | TextData, Any, int, int]:
    """A token kind's new run: data, a new tokenizer fitted to it, the context length
    (tokens) of the model, and the longest sequence a training step holds (tokens; at most
    the context length)."""
    from ..data import BPETokenizer, CharTokenizer

    raw, texts = _read(config, kind)
    if config.task is not None:
        texts = PairData(task=raw).texts() if config.tokenizer == "bpe" else []
    if config.tokenizer == "char":
        tokenizer = (CharTokenizer(raw.alphabet()) if config.task is not None
                     else CharTokenizer.from_texts(texts))
    else:
        tokenizer = BPETokenizer.train(texts, vocab_size=config.bpe_vocab_size)
    need, max_len = _max_len(config, kind, raw, tokenizer)
    return _data(config, kind, raw, tokenizer, None), tokenizer, max_len, need


def load_token_data(config: TrainConfig, kind: Any, tokenizer: Any, max_len: int
                    ) -> PairData | TextData:
    """A token kind's data of a run being resumed, with its saved tokenizer and context
    length.

    Raises:
        ValueError: a pairs file whose longest example no longer fits ``max_len`` (the file
            changed since the run began).
    """
    raw, _ = _read(config, kind)
    if config.task is None and trains_on_pairs(config, kind):
        need, _ = _max_len(dataclasses.replace(config, max_len=None), kind, raw, tokenizer)
        if need > max_len:
            raise ValueError(f"--data {config.data}: its longest example needs {need} tokens "
                             f"with its special tokens, beyond the model's max_len={max_len} "
                             f"(the file changed since the run began); restore the file or "
                             f"start a new run on it")
    return _data(config, kind, raw, tokenizer, max_len)


def _max_len(config: TrainConfig, kind: Any, raw: Any, tokenizer: Any) -> tuple[int, int]:
    """(tokens the longest example needs, the model's context length)."""
    if not trains_on_pairs(config, kind):
        window = config.max_len or DEFAULT_TEXT_WINDOW
        return window, window
    if config.task is not None:  # characters bound tokens from above (char or BPE)
        src, tgt = raw.max_source_len, raw.max_target_len
    else:
        src = max(len(tokenizer.encode(s)) for s, _ in raw)
        tgt = max(len(tokenizer.encode(t)) for _, t in raw)
    need = kind.pair_tokens(src, tgt)  # with the kind's special tokens
    if config.max_len is not None and config.max_len < need:
        raise ValueError(f"max_len={config.max_len} is shorter than the longest example "
                         f"({need} tokens with its special tokens); raise --max-len or leave "
                         f"it out")
    return need, config.max_len or need


def check_model_fits_data(model_config: Any, tokenizer: Any, max_len: int) -> None:
    """Refuse a model config (after the user's ``--set`` overrides) whose vocabulary is
    smaller than the tokenizer's or whose ``max_len`` is shorter than the data needs — errors
    that would otherwise surface only at the first step.

    Raises:
        ValueError: naming the ``--set`` field, its value and what the data needs.
    """
    for field in ("vocab_size", "src_vocab_size", "tgt_vocab_size"):
        size = getattr(model_config, field, None)
        if size is not None and size < tokenizer.vocab_size:
            raise ValueError(f"{field}={size} is smaller than the tokenizer's "
                             f"{tokenizer.vocab_size} ids: leave --set {field} out (qkv sets "
                             f"it from the data) or raise it to at least {tokenizer.vocab_size}")
    limit = getattr(model_config, "max_len", None)
    if limit is not None and limit < max_len:
        raise ValueError(f"max_len={limit} is shorter than the {max_len} tokens of the data's "
                         f"sequences: leave --set max_len out, or give --max-len (text "
                         f"windows) instead")


def _data(config: TrainConfig, kind: Any, raw: Any, tokenizer: Any, max_len: int | None
          ) -> PairData | TextData:
    if config.task is not None:
        return PairData(task=raw, seed=config.seed)
    if kind.reads_pairs_file:
        return PairData.from_file(raw, seed=config.seed)
    window = max_len or config.max_len or DEFAULT_TEXT_WINDOW
    return TextData.from_ids(tokenizer.encode(raw), window=window, seed=config.seed)
