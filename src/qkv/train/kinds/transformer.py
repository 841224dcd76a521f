"""Model kind "transformer": the encoder-decoder (``qkv.models.Transformer``) on
source/target pairs — an embedded task or a TSV file.

Shapes: B batch, S source length, N target length, V vocabulary.

Batch: ``src`` (B, S) = source + eos, right-padded; ``tgt_in`` (B, N) = bos + target;
``tgt_out`` (B, N) = target + eos, padding = -100 (ignored by the loss). One vocabulary
(shared embeddings) for both sides. Evaluation: token loss and exact match of greedy
translations (``qkv.generation.translate``).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ...models import Transformer, TransformerConfig
from ..data import IGNORE, pad_rows
from .text import TokenKind

__all__ = ["TransformerKind"]


class TransformerKind(TokenKind):
    """The encoder-decoder kind (see the module docstring)."""

    name = "transformer"
    default_preset = "transformer-tiny"
    model_class = Transformer
    model_types = ("qkv-transformer",)
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

    def make_batch(self, items: Any, tokenizer: Any, *, step: int = 0,
                   seed: int = 0) -> dict[str, Tensor]:
        pad, bos, eos = tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id
        src = [[*tokenizer.encode(s), eos] for s, _ in items]
        tgt = [tokenizer.encode(t) for _, t in items]
        return {"src": pad_rows(src, pad), "tgt_in": pad_rows([[bos, *t] for t in tgt], pad),
                "tgt_out": pad_rows([[*t, eos] for t in tgt], IGNORE)}

    def logits_and_target(self, model: nn.Module, batch: dict[str, Tensor]
                          ) -> tuple[Tensor, Tensor]:
        return model(batch["src"], batch["tgt_in"]), batch["tgt_out"]  # (B, N, V), (B, N)

    def decode(self, model: nn.Module, tokenizer: Any, sources: list[str], *,
               batch_size: int) -> list[str]:
        from ...generation import translate

        return translate(model, tokenizer, sources, batch_size=batch_size)
