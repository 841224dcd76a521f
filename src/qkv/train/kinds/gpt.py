"""Model kind "gpt": a decoder-only language model (``qkv.models.GPT``) on pairs (an
embedded task: bos + source + eos + target + eos, the loss on the target and its eos) or
on a plain-text file (contiguous windows of ``max_len`` + 1 tokens).

Shapes: B batch, N sequence length, W text window, V vocabulary.

Batch: ``ids`` (B, N) the inputs, ``targets`` (B, N) the next tokens, -100 where nothing is
predicted (the prompt bos + source + eos of a pair, padding). Loss: ``GPT.loss``, the LM head
fused with the cross-entropy over chunks of rows, so that a step never holds the (B, N, V)
logits (with a 50k vocabulary they are most of a step's memory). Evaluation: token loss
(the same way), and for pairs exact match of greedy completions
(``qkv.generation.complete``).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ...models import GPT, GPTConfig
from ..data import IGNORE, gpt_prompts, pad_rows
from .text import TokenKind

__all__ = ["GPTKind"]


class GPTKind(TokenKind):
    """The language-model kind (see the module docstring)."""

    name = "gpt"
    default_preset = "gpt-tiny"
    model_class = GPT
    model_types = ("qkv-gpt", "gpt2")
    target_key = "targets"

    def pair_tokens(self, source: int, target: int) -> int:
        return source + target + 3  # bos source eos target eos

    def build_model(self, config: Any, tokenizer: Any, max_len: int) -> nn.Module:
        base = dict(vocab_size=tokenizer.vocab_size, max_len=max_len)
        return GPT(GPTConfig.from_name(config.model_preset, **{**base, **config.overrides}))

    def make_batch(self, items: Any, tokenizer: Any, *, step: int = 0,
                   seed: int = 0) -> dict[str, Tensor]:
        if isinstance(items, Tensor):  # text windows (B, W + 1)
            return {"ids": items[:, :-1].contiguous(), "targets": items[:, 1:].contiguous()}
        pad, eos = tokenizer.pad_id, tokenizer.eos_id
        prompts = gpt_prompts([s for s, _ in items], tokenizer)
        answers = [[*tokenizer.encode(t), eos] for _, t in items]
        seqs = [p + a for p, a in zip(prompts, answers, strict=True)]
        targets = [[IGNORE] * (len(p) - 1) + a + [IGNORE]
                   for p, a in zip(prompts, answers, strict=True)]
        return {"ids": pad_rows([s[:-1] for s in seqs], pad),
                "targets": pad_rows([t[:-1] for t in targets], IGNORE)}

    def logits_and_target(self, model: nn.Module, batch: dict[str, Tensor]
                          ) -> tuple[Tensor, Tensor]:
        return model(batch["ids"]), batch["targets"]  # (B, N, V), (B, N)

    def loss(self, model: nn.Module, batch: dict[str, Tensor], *,
             label_smoothing: float = 0.0) -> tuple[Tensor, Tensor]:
        """The next-token cross-entropy summed over the predicted tokens (``GPT.loss``'s
        mean over them, times their number; fp32), and their number: ``ids`` (B, N) run
        through the model to its hidden states, the LM head and the (label-smoothed)
        cross-entropy fused over row chunks with an fp32 softmax (no (B, N, V) logits). A
        model under ``--fsdp`` runs it with its parameters gathered (``loss`` is one of the
        methods sharding hooks)."""
        ids, targets = batch["ids"], batch["targets"]  # (B, N), (B, N)
        count = (targets != IGNORE).sum()
        mean = model.loss(ids, targets, ignore_index=IGNORE, label_smoothing=label_smoothing)
        return mean.float() * count, count

    def decode(self, model: nn.Module, tokenizer: Any, sources: list[str], *,
               batch_size: int) -> list[str]:
        from ...generation import complete

        return complete(model, tokenizer, sources, batch_size=batch_size)
