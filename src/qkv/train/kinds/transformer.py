"""Model kind "transformer": the encoder-decoder (``qkv.models.Transformer``) on
source/target pairs — an embedded task or a TSV file — built new, or from a base
(``init_from``): a qkv run, or a HuggingFace T5 / Flan-T5, BART or Marian directory
(``qkv.models.registry.entry_for("qkv-transformer").hf_model_types``).

Shapes: B batch, S source length, N target length, V vocabulary.

Batch with a ``qkv.data`` tokenizer: ``src`` (B, S) = source + eos, right-padded;
``tgt_in`` (B, N) = bos + target; ``tgt_out`` (B, N) = target + eos, padding = -100
(ignored by the loss). One vocabulary (shared embeddings) for both sides.

With an HF directory's tokenizer (``qkv.data.seq2seq_tokenizer.Seq2SeqTokenizer``, read from
the base and kept in every checkpoint) the batch is transformers' (``qkv.train.hf_seq2seq``):
``src`` framed by the tokenizer with ``src_mask``, ``tgt_out`` the labels
(``encode_target``, eos included), the decoder's input the labels shifted right after the
model's ``config.bos_id`` (its ``decoder_start_token_id``).

Evaluation: token loss and exact match of greedy translations
(``qkv.generation.translate``, which frames either tokenizer as it trains).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ...models import Transformer, TransformerConfig, registry
from ..data import IGNORE, PairData, TextData, pad_rows
from ..hf_seq2seq import (
    check_seq2seq_base,
    is_seq2seq_tokenizer,
    seq2seq_batch,
    seq2seq_data,
    seq2seq_logits,
)
from .text import TokenKind

__all__ = ["TransformerKind"]


class TransformerKind(TokenKind):
    """The encoder-decoder kind (see the module docstring)."""

    name = "transformer"
    default_preset = "transformer-tiny"
    model_class = Transformer
    model_types = (registry.entry_for("qkv-transformer").model_type,
                   *registry.entry_for("qkv-transformer").hf_model_types)
    target_key = "tgt_out"
    reads_pairs_file = True
    data_what = "a TSV file of source<TAB>target pairs"

    def pair_tokens(self, source: int, target: int) -> int:
        return max(source, target) + 2  # source + eos; bos + target (+ eos)

    def build_model(self, config: Any, tokenizer: Any, max_len: int) -> nn.Module:
        base = dict(src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size,
                    max_len=max_len, share_embeddings=True, pad_id=tokenizer.pad_id)
        return Transformer(TransformerConfig.from_name(config.model_preset,
                                                       **{**base, **config.overrides}))

    # --- a base's own tokenizer (HF encoder-decoders) ---------------------------------
    def check_base_tokenizer(self, model: nn.Module, tokenizer: Any, init_from: Any) -> None:
        """An HF directory's tokenizer must fit the base's embeddings, pad and eos ids
        (``qkv.train.hf_seq2seq.check_seq2seq_base``; CheckpointError)."""
        if is_seq2seq_tokenizer(tokenizer):
            check_seq2seq_base(model, tokenizer, init_from)

    def prepare_base_data(self, config: Any, tokenizer: Any, base_max_len: int | None
                          ) -> tuple[PairData | TextData, int, int]:
        """As ``TokenKind.prepare_base_data``; with an HF directory's tokenizer the pairs of
        ``--data`` read by it (``qkv.train.hf_seq2seq.seq2seq_data``; ValueError as
        there)."""
        if not is_seq2seq_tokenizer(tokenizer):
            return super().prepare_base_data(config, tokenizer, base_max_len)
        data, need = seq2seq_data(config, tokenizer, base_max_len,
                                  absolute=self._absolute(config))
        return data, base_max_len if base_max_len is not None else need, need

    def load_data(self, config: Any, tokenizer: Any, max_len: int) -> PairData | TextData:
        """As ``TokenKind.load_data``; with an HF directory's tokenizer ``seq2seq_data``
        (a changed file whose examples no longer fit ``max_len`` is refused)."""
        if not is_seq2seq_tokenizer(tokenizer):
            return super().load_data(config, tokenizer, max_len)
        return seq2seq_data(config, tokenizer, max_len, absolute=self._absolute(config))[0]

    @staticmethod
    def _absolute(config: Any) -> bool:
        """Whether the base of ``config`` (``init_from``) has absolute positions, which
        bound the lengths by its ``max_len`` (read from its config, nothing loaded)."""
        from ...models import from_pretrained

        base = from_pretrained(config.init_from, device="meta") if config.init_from else None
        return base is None or bool(base.config.absolute_positions)

    # --- one step -------------------------------------------------------------------------
    def make_batch(self, items: Any, tokenizer: Any, *, step: int = 0,
                   seed: int = 0) -> dict[str, Tensor]:
        if is_seq2seq_tokenizer(tokenizer):
            return seq2seq_batch(items, tokenizer)
        pad, bos, eos = tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id
        src = [[*tokenizer.encode(s), eos] for s, _ in items]
        tgt = [tokenizer.encode(t) for _, t in items]
        return {"src": pad_rows(src, pad), "tgt_in": pad_rows([[bos, *t] for t in tgt], pad),
                "tgt_out": pad_rows([[*t, eos] for t in tgt], IGNORE)}

    def logits_and_target(self, model: nn.Module, batch: dict[str, Tensor]
                          ) -> tuple[Tensor, Tensor]:
        if "tgt_in" not in batch:  # an HF tokenizer's batch: labels only
            return seq2seq_logits(model, batch)
        return model(batch["src"], batch["tgt_in"]), batch["tgt_out"]  # (B, N, V), (B, N)

    def batch_tokens(self, batch: dict[str, Tensor], tokenizer: Any) -> int:
        """The real source tokens and the decoder's tokens (one per label) of a batch."""
        if "tgt_in" not in batch:
            return int(batch["src_mask"].sum()) + int((batch["tgt_out"] != IGNORE).sum())
        return super().batch_tokens(batch, tokenizer)

    def decode(self, model: nn.Module, tokenizer: Any, sources: list[str], *,
               batch_size: int) -> list[str]:
        from ...generation import translate

        return translate(model, tokenizer, sources, batch_size=batch_size)
