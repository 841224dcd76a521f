"""``TokenKind``: what the three token kinds (transformer, gpt, bert-mlm) share — data from
an embedded text task or a ``--data`` file (``qkv.train.setup``), a token cross-entropy
loss (``qkv.train.loss``), evaluation by ``qkv.train.evaluate.evaluate_tokens``, and
fine-tuning from a base (``qkv.train.finetune``).

Shapes: B batch, N sequence length, V vocabulary.

A subclass says whether a ``--data`` file holds pairs (``reads_pairs_file``), how many
tokens a pair needs with its special tokens (``pair_tokens``), how the model is built and
run (``build_model``, ``logits_and_target``) and what its batch is (``make_batch``).
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

from torch import Tensor, nn

from .base import ModelKind

__all__ = ["TokenKind"]


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

    # --- the protocol -----------------------------------------------------------------
    def prepare_data(self, config: Any) -> tuple[Any, Any, int, int]:
        from ..setup import prepare_token_data

        return prepare_token_data(config, self)

    def load_data(self, config: Any, tokenizer: Any, max_len: int) -> Any:
        from ..setup import load_token_data

        return load_token_data(config, self, tokenizer, max_len)

    def check_model(self, model_config: Any, tokenizer: Any, max_len: int) -> None:
        from ..setup import check_model_fits_data

        check_model_fits_data(model_config, tokenizer, max_len)

    def loss(self, model: nn.Module, batch: dict[str, Tensor], *,
             label_smoothing: float = 0.0) -> tuple[Tensor, Tensor]:
        """The token cross-entropy summed over the predicted tokens, and their number."""
        from ..loss import token_cross_entropy

        logits, target = self.logits_and_target(model, batch)
        return token_cross_entropy(logits, target, label_smoothing=label_smoothing)

    def loss_count(self, batch: dict[str, Tensor]) -> Tensor:
        """The predicted tokens of ``batch``: the targets (``target_key``) that are not -100."""
        from ..data import IGNORE

        return (batch[self.target_key] != IGNORE).sum()

    def evaluate(self, model: nn.Module, tokenizer: Any, data: Any,
                 count: int) -> dict[str, float]:
        from ..evaluate import evaluate_tokens

        decoder = None if type(self).decode is TokenKind.decode else self.decode
        return evaluate_tokens(self.name, model, tokenizer, data, count,
                               masked_accuracy=self.masked_accuracy, decode=decoder)

    def prepare_base_data(self, config: Any, tokenizer: Any,
                          base_max_len: int | None) -> tuple[Any, int, int]:
        from ..finetune import prepare_token_base_data

        return prepare_token_base_data(config, self, tokenizer, base_max_len)
