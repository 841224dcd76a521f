"""The stepper of the encoder-decoder decode engine: a ``Seq2SeqPlan``'s model decoded by a
weight form's ``Seq2SeqLayers`` (the decoder-only engine's ``PlanStepper`` counterpart).

Shapes: B sources, S source length, K beams, R = B·K rows (the K rows of a source
consecutive), n tokens fed per row per call, t tokens cached, cap = 1 + T the caches'
capacity (the start token + every token fed later), C width, V vocab size.

The encoder runs once, on the plan's encoder with the backend's weight form where the
backend has one (``qkv.generation.seq2seq_encoder``: the int8 backends), else through the
model's modules (``Transformer.encode``); the runner projects the memory's keys and values
once per source. ``prefill()`` feeds the start token (position 0) and returns the logits
(R, V) of the first new token; ``step(tokens (R,))`` -> (R, V); ``run(tokens (R, n))`` ->
(R, n, V) feeds n tokens per row in one pass (prompt lookup verifies drafts with it);
``rewind(length)`` forgets the positions from ``length`` on; ``reorder(idx (R,))`` makes row
r continue from row ``idx[r]`` (beam search: the self-attention caches are gathered into
spare buffers, one pass over their filled slots; the memory, shared by a source's beams,
does not move).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..modules.cache import KVCache
from .seq2seq_encoder import encode
from .seq2seq_layers import Seq2SeqLayers
from .seq2seq_plan import Seq2SeqPlan

__all__ = ["Seq2SeqPlanStepper"]


class Seq2SeqPlanStepper:
    """Decode ``plan``'s Transformer for the sources ``src`` (B, S).

    Args:
        plan: the model's ``Seq2SeqPlan``.
        backend: the name of the backend that chose ``make_linears`` (``self.backend``).
        make_linears: plan -> the weight form (``qkv.generation.linears``).
        src: (B, S) source ids; ``src_mask`` (B, S) bool (True = real token) or None
            (``src != pad_id``, as ``Transformer.encode``).
        start: the decoder's first token.
        beams: K.
        max_new_tokens: T.
        attention_kernel: the loaded C attention function for ``Seq2SeqLayers``, or None.
        encoder_linears: the weight form the encoder runs on (``plan.encoder``'s;
            ``qkv.generation.seq2seq_encoder``), or None: ``Transformer.encode``'s modules.
    """

    def __init__(self, plan: Seq2SeqPlan, backend: str, make_linears, src: Tensor,
                 src_mask: Tensor | None, start: int, beams: int, max_new_tokens: int, *,
                 attention_kernel=None, encoder_linears=None) -> None:
        model = plan.model
        self.plan, self.backend = plan, backend
        batch = src.shape[0]
        self.rows = rows = batch * beams
        self.capacity = cap = 1 + max_new_tokens
        if plan.pos_table is not None:  # positions 0 .. T - 1 are fed
            last = max_new_tokens - 1 + plan.position_offset
            if last >= plan.pos_table.shape[0]:
                raise ValueError(f"Seq2SeqPlanStepper: max_new_tokens={max_new_tokens} reads "
                                 f"position row {last}, beyond the table's "
                                 f"{plan.pos_table.shape[0]}")
        if encoder_linears is None:  # (B, S, C), (B, S)
            memory, keep = model.encode(src, src_mask=src_mask)
        else:
            memory, keep = encode(plan.encoder, encoder_linears, src, src_mask)
        self.encoder = "modules" if encoder_linears is None else "plan"
        self.cache = model.new_cache(rows, cap)
        if not all(type(kc) is KVCache and kc.keys.is_contiguous() for kc in self.cache):
            raise TypeError("Seq2SeqPlanStepper: Transformer.new_cache did not return "
                            "contiguous KVCaches")
        self.start = torch.full((rows, 1), start, dtype=torch.long, device=src.device)
        self.beams = beams
        self.identity = torch.arange(rows, device=src.device)  # (R,)
        self.source = self.identity // beams  # (R,) each row's source
        self.length = 0
        self.runner = Seq2SeqLayers(plan, make_linears(plan), self.cache, memory, keep, beams,
                                    attention_kernel)

    def _embed(self, tokens: Tensor, t: int) -> Tensor:
        """The input rows (R·n, C) of tokens (R, n) at positions [t, t + n): the token
        table · scale + the absolute positions, then the embedding norm."""
        plan = self.plan
        rows, n = tokens.shape
        x = plan.embed.index_select(0, tokens.reshape(-1))  # (R·n, C)
        if plan.embed_scale != 1.0:
            x = x * plan.embed_scale
        if plan.pos_table is not None:
            off = plan.position_offset
            pos = plan.pos_table[t + off:t + off + n].to(x.dtype)  # (n, C)
            x = (x.view(rows, n, -1) + pos).view(rows * n, -1)
        if plan.embed_norm is not None:
            x = plan.embed_norm(x)
        return x

    def prefill(self) -> Tensor:
        """Feed the start token; logits (R, V) of the first new token."""
        return self.run(self.start)[:, 0]

    def step(self, tokens: Tensor) -> Tensor:
        """Feed tokens (R,) at the next position; logits (R, V)."""
        return self.run(tokens[:, None])[:, 0]

    def run(self, tokens: Tensor) -> Tensor:
        """Feed tokens (R, n) at the next n positions; logits (R, n, V) of the position after
        each."""
        rows, n = tokens.shape
        t = self.length
        if t + n > self.capacity:
            raise IndexError(f"Seq2SeqPlanStepper: the caches hold {self.capacity} positions; "
                             f"feeding {n} more after {t} is too many")
        x = self.runner.layers(self._embed(tokens, t), t, n)  # (R·n, C)
        self.length = t + n
        return self.runner.head(x).view(rows, n, -1)

    def rewind(self, length: int) -> None:
        """Forget the positions from ``length`` on (the next call writes there); the start
        token's position stays."""
        if not 1 <= length <= self.length:
            raise ValueError(f"Seq2SeqPlanStepper: rewind length must be in [1, "
                             f"{self.length}], got {length}")
        self.length = length

    def reorder(self, idx: Tensor) -> None:
        """Row r continues from row ``idx[r]`` (the runner gathers its caches); ``idx``
        keeps each row within its source (beam search), as the shared memory needs."""
        if not torch.equal(torch.div(idx, self.beams, rounding_mode="floor"), self.source):
            raise ValueError(f"Seq2SeqPlanStepper: reorder idx must keep each row among its "
                             f"source's {self.beams} beams, got {idx.tolist()}")
        if not torch.equal(idx, self.identity):  # else nothing moves
            self.runner.reorder(idx, self.length)
