"""``TokenKind``: what the three token kinds (transformer, gpt, bert-mlm) share, owned here
as its own methods — data from an embedded text task or a ``--data`` file with a character
or BPE tokenizer fitted to it and the context length the model needs, the same for a run
that starts from a base (``init_from``: the base's tokenizer and context length), a token
cross-entropy loss (``qkv.train.loss``) and the evaluation (loss, and exact match of greedy
outputs or masked-token accuracy).

Shapes: B batch, N sequence length, V vocabulary.

A subclass says whether a ``--data`` file holds pairs (``reads_pairs_file``), how many
tokens a pair needs with its special tokens (``pair_tokens``), how the model is built and
run (``build_model``, ``logits_and_target``) and what its batch is (``make_batch``); it may
compute its loss without the (B, N, V) logits (``loss``: gpt does).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ..data import IGNORE, PairData, TextData
from ..evaluate import DECODE_BATCH, exact_match
from ..loss import token_cross_entropy
from .base import ModelKind

__all__ = ["DEFAULT_TEXT_WINDOW", "TokenKind"]

#: tokens per training window of a plain-text file when ``max_len`` is not given
DEFAULT_TEXT_WINDOW = 128


class TokenKind(ModelKind):
    """A model kind trained with a token cross-entropy (see the module docstring).

    Attributes:
        reads_pairs_file: a ``--data`` file is a TSV of source/target pairs (else plain
            text cut into windows).
        masked_accuracy: evaluation reports ``masked_accuracy`` (else ``exact_match`` of
            greedy decoding on pair data, with ``decode``).
        target_key: the batch's targets tensor (B, N), -100 where nothing is predicted:
            the loss counts its other entries (``loss_count``).
    """

    reads_pairs_file: ClassVar[bool] = False
    masked_accuracy: ClassVar[bool] = False
    #: the batch tensor of the targets (B, N), -100 where nothing is predicted
    target_key: ClassVar[str]
    data_what = "a text file"

    @abc.abstractmethod
    def pair_tokens(self, source: int, target: int) -> int:
        """Tokens one example of a ``source``-token source and a ``target``-token target
        needs with this kind's special tokens (the longest decides the context length)."""

    @abc.abstractmethod
    def logits_and_target(self, model: nn.Module, batch: dict[str, Tensor]
                          ) -> tuple[Tensor, Tensor]:
        """The model's logits (B, N, V) on a batch and the targets (B, N), -100 where
        nothing is predicted."""

    def decode(self, model: nn.Module, tokenizer: Any, sources: list[str], *,
               batch_size: int) -> list[str]:
        """Greedy outputs for ``sources`` (pair evaluation's exact match); the base class has
        none (evaluation then reports no exact match)."""
        raise NotImplementedError

    def trains_on_pairs(self, config: Any) -> bool:
        """Whether a run trains on source/target pairs: an embedded task, or a ``--data``
        file of a kind that reads pairs files (else the file is plain text)."""
        return config.task is not None or bool(self.reads_pairs_file)

    # --- data -------------------------------------------------------------------------
    def prepare_data(self, config: Any) -> tuple[PairData | TextData, Any, int, int]:
        """A new run: data, a new tokenizer fitted to it, the context length (tokens) of
        the model, and the longest sequence a training step holds (tokens; at most the
        context length)."""
        from ...data import BPETokenizer, CharTokenizer

        raw, texts = self._read(config)
        if config.task is not None:
            texts = PairData(task=raw).texts() if config.tokenizer == "bpe" else []
        if config.tokenizer == "char":
            tokenizer = (CharTokenizer(raw.alphabet()) if config.task is not None
                         else CharTokenizer.from_texts(texts))
        else:
            tokenizer = BPETokenizer.train(texts, vocab_size=config.bpe_vocab_size)
        need, max_len = self._max_len(config, raw, tokenizer)
        return self._data(config, raw, tokenizer, None), tokenizer, max_len, need

    def load_data(self, config: Any, tokenizer: Any, max_len: int) -> PairData | TextData:
        """The data of a run being resumed, with its saved tokenizer and context length.

        Raises:
            ValueError: a pairs file whose longest example no longer fits ``max_len`` (the
                file changed since the run began).
        """
        raw, _ = self._read(config)
        if config.task is None and self.trains_on_pairs(config):
            need, _ = self._max_len(dataclasses.replace(config, max_len=None), raw, tokenizer)
            if need > max_len:
                raise ValueError(f"--data {config.data}: its longest example needs {need} "
                                 f"tokens with its special tokens, beyond the model's "
                                 f"max_len={max_len} (the file changed since the run began); "
                                 f"restore the file or start a new run on it")
        return self._data(config, raw, tokenizer, max_len)

    def prepare_base_data(self, config: Any, tokenizer: Any, base_max_len: int | None
                          ) -> tuple[PairData | TextData, int, int]:
        """A run from a base with ``tokenizer`` and context length ``base_max_len``.

        ``config.max_len``, when given, must be at most the base's: for plain text it is
        the window (default: the base's max_len, at most ``DEFAULT_TEXT_WINDOW``), for pairs
        a bound the data must fit.

        Raises:
            ValueError: a character/token the tokenizer does not know, an example longer
                than the base's max_len, ``max_len`` beyond the base's.
        """
        base = config.init_from
        limit = base_max_len if base_max_len is not None else 10**9
        if config.max_len is not None and config.max_len > limit:
            raise ValueError(f"max_len={config.max_len} is beyond the base's max_len={limit} "
                             f"({base}); the base fixes the context length")
        raw, _ = self._read(config)
        self._check_encodable(config, raw, tokenizer)
        if self.trains_on_pairs(config):
            need, _ = self._max_len(dataclasses.replace(config, max_len=None), raw, tokenizer)
            if need > limit:
                what = f"--task {config.task}" if config.task else f"--data {config.data}"
                raise ValueError(f"{what}: the longest example needs {need} tokens with its "
                                 f"special tokens, beyond the base's max_len={limit} ({base})")
            self._max_len(config, raw, tokenizer)  # a given max_len must hold the data too
            return self._data(config, raw, tokenizer, None), limit, need
        window = config.max_len or min(DEFAULT_TEXT_WINDOW, limit)
        return self._data(config, raw, tokenizer, window), limit, window

    def _read(self, config: Any) -> tuple[Any, list[str]]:
        """The raw source (a Task, a list of pairs or a text) and texts to fit a tokenizer
        on."""
        from ...data import get_task, read_pairs, read_text

        if config.task is not None:
            return get_task(config.task, seed=config.seed), []
        if self.reads_pairs_file:
            pairs = read_pairs(config.data)
            return pairs, [t for pair in pairs for t in pair]
        text = read_text(config.data)
        return text, [text]

    def _max_len(self, config: Any, raw: Any, tokenizer: Any) -> tuple[int, int]:
        """(tokens the longest example needs, the model's context length)."""
        if not self.trains_on_pairs(config):
            window = config.max_len or DEFAULT_TEXT_WINDOW
            return window, window
        if config.task is not None:  # characters bound tokens from above (char or BPE)
            src, tgt = raw.max_source_len, raw.max_target_len
        else:
            src = max(len(tokenizer.encode(s)) for s, _ in raw)
            tgt = max(len(tokenizer.encode(t)) for _, t in raw)
        need = self.pair_tokens(src, tgt)  # with the kind's special tokens
        if config.max_len is not None and config.max_len < need:
            raise ValueError(f"max_len={config.max_len} is shorter than the longest example "
                             f"({need} tokens with its special tokens); raise --max-len or "
                             f"leave it out")
        return need, config.max_len or need

    def _data(self, config: Any, raw: Any, tokenizer: Any, max_len: int | None
              ) -> PairData | TextData:
        if config.task is not None:
            return PairData(task=raw, seed=config.seed)
        if self.reads_pairs_file:
            return PairData.from_file(raw, seed=config.seed)
        window = max_len or config.max_len or DEFAULT_TEXT_WINDOW
        return TextData.from_ids(tokenizer.encode(raw), window=window, seed=config.seed)

    @staticmethod
    def _check_encodable(config: Any, raw: Any, tokenizer: Any) -> None:
        """Refuse data holding text the base's tokenizer reads as <unk>."""
        from ...data import CharTokenizer

        base = config.init_from
        what = f"--task {config.task}" if config.task is not None else f"--data {config.data}"

        def texts() -> list[str]:
            if config.task is not None:
                return PairData(task=raw).texts(limit=2000)
            return [raw] if isinstance(raw, str) else [t for pair in raw for t in pair]

        if isinstance(tokenizer, CharTokenizer):
            chars = set(raw.alphabet()) if config.task is not None else {
                c for t in texts() for c in t}
            unknown = sorted(c for c in chars if tokenizer.encode(c) == [tokenizer.unk_id])
            if unknown:
                shown = "".join(unknown[:20]) + ("..." if len(unknown) > 20 else "")
                raise ValueError(f"{what} holds {len(unknown)} character(s) the base's "
                                 f"tokenizer ({base}) does not know: {shown!r}; fine-tuning "
                                 f"keeps the base's vocabulary, so its data must use only the "
                                 f"base's characters")
            return
        for text in texts():
            if tokenizer.unk_id in tokenizer.encode(text):
                raise ValueError(f"{what}: the base's tokenizer ({base}) reads part of "
                                 f"{text[:40]!r} as <unk>; fine-tuning keeps the base's "
                                 f"vocabulary")

    # --- model ------------------------------------------------------------------------
    def check_model(self, model_config: Any, tokenizer: Any, max_len: int) -> None:
        """Refuse a model config (after the user's ``--set`` overrides) whose vocabulary is
        smaller than the tokenizer's or whose ``max_len`` is shorter than the data needs —
        errors that would otherwise surface only at the first step.

        Raises:
            ValueError: naming the ``--set`` field, its value and what the data needs.
        """
        for field in ("vocab_size", "src_vocab_size", "tgt_vocab_size"):
            size = getattr(model_config, field, None)
            if size is not None and size < tokenizer.vocab_size:
                raise ValueError(f"{field}={size} is smaller than the tokenizer's "
                                 f"{tokenizer.vocab_size} ids: leave --set {field} out (qkv "
                                 f"sets it from the data) or raise it to at least "
                                 f"{tokenizer.vocab_size}")
        limit = getattr(model_config, "max_len", None)
        if limit is not None and limit < max_len:
            raise ValueError(f"max_len={limit} is shorter than the {max_len} tokens of the "
                             f"data's sequences: leave --set max_len out, or give --max-len "
                             f"(text windows) instead")

    # --- one step ---------------------------------------------------------------------
    def loss(self, model: nn.Module, batch: dict[str, Tensor], *,
             label_smoothing: float = 0.0) -> tuple[Tensor, Tensor]:
        """The token cross-entropy summed over the predicted tokens, and their number."""
        logits, target = self.logits_and_target(model, batch)
        return token_cross_entropy(logits, target, label_smoothing=label_smoothing)

    def loss_count(self, batch: dict[str, Tensor]) -> Tensor:
        """The predicted tokens of ``batch``: the targets (``target_key``) that are not -100."""
        return (batch[self.target_key] != IGNORE).sum()

    # --- evaluation -------------------------------------------------------------------
    def evaluate(self, model: nn.Module, tokenizer: Any, data: PairData | TextData,
                 count: int) -> dict[str, float]:
        """Metrics on ``count`` held-out examples: ``eval_loss`` (mean token cross-entropy,
        no label smoothing, ``loss``), plus ``masked_accuracy`` (argmax == label over the
        predicted tokens, from the logits) when ``masked_accuracy``, or ``exact_match`` of
        ``decode`` against the targets when ``data`` holds pairs and the kind decodes."""
        was_training = model.training
        device = next(model.parameters()).device
        decodes = type(self).decode is not TokenKind.decode
        model.eval()
        try:
            with torch.no_grad():
                items = data.heldout(count)
                total, n, correct = 0.0, 0, 0
                for i in range(0, len(items), DECODE_BATCH):
                    batch = {k: t.to(device) for k, t in self.make_batch(
                        items[i:i + DECODE_BATCH], tokenizer, step=-1 - i).items()}
                    if self.masked_accuracy:
                        logits, target = self.logits_and_target(model, batch)
                        loss, k = token_cross_entropy(logits, target)
                        sel = target != IGNORE
                        correct += int((logits.argmax(-1)[sel] == target[sel]).sum())
                    else:
                        loss, k = self.loss(model, batch)
                    total, n = total + loss.item(), n + int(k)
                result = {"eval_loss": total / max(n, 1)}
                if self.masked_accuracy:
                    result["masked_accuracy"] = correct / max(n, 1)
                elif decodes and isinstance(data, PairData):
                    sources, targets = [s for s, _ in items], [t for _, t in items]
                    preds = self.decode(model, tokenizer, sources, batch_size=DECODE_BATCH)
                    result["exact_match"] = exact_match(preds, targets)
        finally:
            model.train(was_training)
        return result
