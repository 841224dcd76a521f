"""Model kind "gpt": a decoder-only language model (``qkv.models.GPT``) on pairs (an
embedded task: bos + source + eos + target + eos, the loss on the target and its eos), on
a plain-text file (contiguous windows of ``max_len`` + 1 tokens), or — fine-tuning a base
with a chat template (``TrainConfig.chat``) — on chat-formatted pairs of a ``--data`` file
(``qkv.train.chat_data``: the base's template renders each prompt, the loss counts the
answer and its end-of-turn token).

It owns every ``model_type`` the model registry loads into ``GPT``: qkv's own and the
HuggingFace ones (``qkv.models.registry.entry_for("qkv-gpt").hf_model_types``: gpt2 and the
Llama-style llama, mistral, qwen2, qwen3, gemma, gemma2, phi3), so ``--init-from`` takes any
of their directories.

Shapes: B batch, N sequence length, W text window, V vocabulary.

Batch: ``ids`` (B, N) the inputs, ``targets`` (B, N) the next tokens, -100 where nothing is
predicted (the prompt bos + source + eos of a pair, a chat prompt, padding). Loss:
``GPT.loss``, the LM head fused with the cross-entropy over chunks of rows, so that a step
never holds the (B, N, V) logits (with a 50k vocabulary they are most of a step's memory).
Evaluation: token loss (the same way), and for pairs exact match of greedy completions
(``qkv.generation.complete``; chat pairs: ``qkv.train.chat_data.chat_decode``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ...models import GPT, GPTConfig, registry
from ..chat_data import ChatPair, Conversation, chat_batch, chat_data, chat_decode
from ..data import IGNORE, PairData, TextData, gpt_prompts, pad_rows
from ..errors import ConfigError
from .text import TokenKind

__all__ = ["GPTKind"]


class GPTKind(TokenKind):
    """The language-model kind (see the module docstring)."""

    name = "gpt"
    default_preset = "gpt-tiny"
    model_class = GPT
    model_types = (registry.entry_for("qkv-gpt").model_type,
                   *registry.entry_for("qkv-gpt").hf_model_types)
    target_key = "targets"
    reads_chat = True

    def check_config(self, config: Any) -> None:
        """The base class's checks; ``chat`` needs a base (``init_from``: its chat template)
        and a ``--data`` file of conversations (ConfigError naming ``chat``)."""
        super().check_config(config)
        if not config.chat:
            return
        if config.init_from is None:
            raise ConfigError("chat", "chat-formatted pairs are rendered with the chat template "
                                      "of the base: give --init-from a chat model's directory")
        if config.task is not None:
            raise ConfigError("chat", f"chat-formatted pairs come from --data (a TSV of "
                                      f"input<TAB>output lines or a JSONL of {{\"messages\": "
                                      f"[...]}}), got task {config.task!r}")

    def trains_on_pairs(self, config: Any) -> bool:
        """An embedded task, or chat-formatted pairs (else the file is plain text)."""
        return super().trains_on_pairs(config) or bool(config.chat)

    def prepare_base_data(self, config: Any, tokenizer: Any, base_max_len: int | None
                          ) -> tuple[PairData | TextData, int, int]:
        """As ``TokenKind.prepare_base_data``; chat pairs: ``chat_data`` (the base's chat
        template; every example within the base's max_len).

        Raises:
            ValueError: as ``TokenKind``'s and ``chat_data``; pairs framed by bos with a
                tokenizer that has no bos token (Qwen's: train them with ``--chat``)."""
        if config.chat:
            if config.max_len is not None and base_max_len is not None and (
                    config.max_len > base_max_len):
                raise ValueError(f"max_len={config.max_len} is beyond the base's max_len="
                                 f"{base_max_len} ({config.init_from}); the base fixes the "
                                 f"context length")
            data, need = chat_data(config, tokenizer, base_max_len)
            return data, base_max_len if base_max_len is not None else need, need
        if self.trains_on_pairs(config) and tokenizer.bos_id is None:
            raise ValueError(f"--init-from {config.init_from}: the base's tokenizer has no bos "
                             f"token, which qkv's framing of pairs (bos + source + eos + "
                             f"target + eos) needs; give the pairs as --data with --chat (the "
                             f"base's chat template frames them)")
        return super().prepare_base_data(config, tokenizer, base_max_len)

    def load_data(self, config: Any, tokenizer: Any, max_len: int) -> PairData | TextData:
        """As ``TokenKind.load_data``; chat pairs: ``chat_data`` with the run's tokenizer."""
        if config.chat:
            return chat_data(config, tokenizer, max_len)[0]
        return super().load_data(config, tokenizer, max_len)

    def pair_tokens(self, source: int, target: int) -> int:
        return source + target + 3  # bos source eos target eos

    def build_model(self, config: Any, tokenizer: Any, max_len: int) -> nn.Module:
        base = dict(vocab_size=tokenizer.vocab_size, max_len=max_len)
        return GPT(GPTConfig.from_name(config.model_preset, **{**base, **config.overrides}))

    def make_batch(self, items: Any, tokenizer: Any, *, step: int = 0,
                   seed: int = 0) -> dict[str, Tensor]:
        if isinstance(items, Tensor):  # text windows (B, W + 1)
            return {"ids": items[:, :-1].contiguous(), "targets": items[:, 1:].contiguous()}
        if items and isinstance(items[0], ChatPair):  # rendered with the chat template
            return chat_batch(items, tokenizer)
        pad, eos = tokenizer.pad_id, tokenizer.eos_id
        prompts = gpt_prompts([s for s, _ in items], tokenizer)
        answers = [[*tokenizer.encode(t), eos] for _, t in items]
        seqs = [p + a for p, a in zip(prompts, answers, strict=True)]
        targets = [[IGNORE] * (len(p) - 1) + a + [IGNORE]
                   for p, a in zip(prompts, answers, strict=True)]
        return {"ids": pad_rows([s[:-1] for s in seqs], pad),
                "targets": pad_rows([t[:-1] for t in targets], IGNORE)}

    def batch_tokens(self, batch: dict[str, Tensor], tokenizer: Any) -> int:
        """The real input tokens of a batch: each row's positions up to its last predicted
        one (every gpt row ends with a predicted token and padding follows it), so the
        count holds whatever the pad id is (a HuggingFace base pads with its eos id, which
        a chat prompt also holds)."""
        targets = batch["targets"]  # (B, N)
        where = torch.arange(targets.shape[1], device=targets.device)  # (N,)
        last = torch.where(targets != IGNORE, where, -1).amax(dim=1)  # (B,)
        return int((last + 1).sum())

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
        """Greedy answers: framed pairs (``qkv.generation.complete``), or chat prompts
        (``Conversation`` sources: ``chat_decode``)."""
        if sources and isinstance(sources[0], Conversation):
            return chat_decode(model, tokenizer, sources, batch_size=batch_size)
        from ...generation import complete

        return complete(model, tokenizer, sources, batch_size=batch_size)
