"""From a ``TrainConfig`` to data and a tokenizer: the embedded task or the user's file, a
character or BPE tokenizer fitted to it, and the context length the model needs."""

from __future__ import annotations

from typing import Any

from .config import TrainConfig
from .data import PairData, TextData

__all__ = ["DEFAULT_TEXT_WINDOW", "load_data", "prepare_data"]

#: tokens per training window of a plain-text file when ``max_len`` is not given
DEFAULT_TEXT_WINDOW = 128


def _is_pairs(config: TrainConfig) -> bool:
    return config.task is not None or config.model == "transformer"


def _read(config: TrainConfig) -> tuple[Any, list[str]]:
    """The raw source (a Task, a list of pairs or a text) and texts to fit a tokenizer on."""
    from ..data import get_task, read_pairs, read_text

    if config.task is not None:
        task = get_task(config.task, seed=config.seed)
        return task, []
    if config.model == "transformer":
        pairs = read_pairs(config.data)
        return pairs, [t for pair in pairs for t in pair]
    text = read_text(config.data)
    return text, [text]


def prepare_data(config: TrainConfig) -> tuple[PairData | TextData, Any, int]:
    """Data, a new tokenizer fitted to it, and the context length (tokens) of the model."""
    from ..data import BPETokenizer, CharTokenizer

    raw, texts = _read(config)
    if config.task is not None:
        texts = PairData(task=raw).texts() if config.tokenizer == "bpe" else []
    if config.tokenizer == "char":
        tokenizer = (CharTokenizer(raw.alphabet()) if config.task is not None
                     else CharTokenizer.from_texts(texts))
    else:
        tokenizer = BPETokenizer.train(texts, vocab_size=config.bpe_vocab_size)
    return _data(config, raw, tokenizer, None), tokenizer, _max_len(config, raw, tokenizer)


def load_data(config: TrainConfig, tokenizer: Any, max_len: int) -> PairData | TextData:
    """The data of a run being resumed, with its saved tokenizer and context length."""
    raw, _ = _read(config)
    return _data(config, raw, tokenizer, max_len)


def _max_len(config: TrainConfig, raw: Any, tokenizer: Any) -> int:
    if not _is_pairs(config):
        return config.max_len or DEFAULT_TEXT_WINDOW
    if config.task is not None:  # characters bound tokens from above (char or BPE)
        src, tgt = raw.max_source_len, raw.max_target_len
    else:
        src = max(len(tokenizer.encode(s)) for s, _ in raw)
        tgt = max(len(tokenizer.encode(t)) for _, t in raw)
    # transformer: source + eos, bos + target; gpt: bos source eos target eos; bert: bos
    # source " " target eos
    need = max(src, tgt) + 2 if config.model == "transformer" else src + tgt + 3
    if config.max_len is not None and config.max_len < need:
        raise ValueError(f"max_len={config.max_len} is shorter than the longest example "
                         f"({need} tokens with its special tokens); raise --max-len or leave "
                         f"it out")
    return config.max_len or need


def _data(config: TrainConfig, raw: Any, tokenizer: Any, max_len: int | None
          ) -> PairData | TextData:
    if config.task is not None:
        return PairData(task=raw, seed=config.seed)
    if config.model == "transformer":
        return PairData.from_file(raw, seed=config.seed)
    window = max_len or config.max_len or DEFAULT_TEXT_WINDOW
    return TextData.from_ids(tokenizer.encode(raw), window=window, seed=config.seed)
