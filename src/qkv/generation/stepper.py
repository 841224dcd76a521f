"""The one stepper of the decode engine: a plan's model decoded by a backend's layer runner
(``TorchLayers`` or ``CLayers``) against ``KVCache``s.

Shapes: R rows, N prompt length, n tokens fed per row per call, t tokens cached, s = t + n,
C width, Hkv key/value heads, cap the caches' capacity (prompt + every token fed later),
V vocab size.

``prefill()`` runs the prompt through the model's modules (filling the caches) and returns
the logits (R, V) of the token after it; ``step(tokens (R,))`` -> (R, V);
``run(tokens (R, n))`` -> (R, n, V) feeds n tokens per row in one pass (prompt lookup and
speculative decoding verify drafts with it; n = 1 is ``step``); ``rewind(length)`` forgets
the positions from ``length`` on; ``reorder(idx (R,))`` makes row r continue from row
``idx[r]`` (beam search). The embedding and positions of new tokens, the key padding bias,
the cache bookkeeping and beam reordering are written here once for every backend.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..modules.cache import KVCache
from .plan import DecodePlan
from .prefill import prefill_rows

__all__ = ["PlanStepper", "padding_bias"]


def padding_bias(keep: Tensor | None, kv_heads: int, capacity: int, dtype: torch.dtype
                 ) -> Tensor | None:
    """The additive key bias (R·Hkv, 1, cap) of a left-padded batch: -inf at the padded
    prompt positions of ``keep`` (R, N) (True = real token), 0 elsewhere; None without
    padding."""
    if keep is None:
        return None
    rows, n = keep.shape
    bias = torch.zeros(rows, kv_heads, 1, capacity, dtype=dtype, device=keep.device)
    bias[:, :, 0, :n] = torch.zeros((), dtype=dtype, device=keep.device).masked_fill(
        ~keep[:, None, :], float("-inf"))  # (R, Hkv, N)
    return bias.view(rows * kv_heads, 1, capacity)


class PlanStepper:
    """Decode ``plan``'s model for the prompts ``ids`` (R, N) (left-padded; ``keep`` (R, N)
    bool, True = real token, or None) with caches of ``capacity`` positions.

    Args:
        plan: the model's ``DecodePlan``.
        backend: the name of the backend that built ``make_layers`` (``self.backend``).
        make_layers: (plan, caches, bias) -> the layer runner (``TorchLayers``/``CLayers``).
        prefill_on_rows: a padded prompt without gradients runs on its real tokens only
            (``prefill_rows``); else the model's ``hidden_states`` on the padded batch.
    """

    def __init__(self, plan: DecodePlan, backend: str, make_layers, ids: Tensor,
                 keep: Tensor | None, capacity: int, *, prefill_on_rows: bool = True) -> None:
        model = plan.model
        self.plan, self.backend, self.ids, self.keep = plan, backend, ids, keep
        rows, n = ids.shape
        if capacity < n:
            raise ValueError(f"PlanStepper: capacity {capacity} < the prompt's {n} positions")
        self.rows, self.length, self.prompt, self.capacity = rows, n, n, capacity
        window = model.config.attention_window
        if window is not None and capacity > window:
            raise ValueError(f"PlanStepper: capacity {capacity} > the model's window {window} "
                             f"(a plan computes full causal attention; decode_plan says so)")
        # plain caches on every layer (a window no cache outgrows keeps every key)
        self.cache = [layer.attn.new_cache(rows, capacity) for layer in model.layers]
        if not all(type(kc) is KVCache and kc.keys.is_contiguous() for kc in self.cache):
            raise TypeError("PlanStepper: GPT.new_cache did not return contiguous KVCaches")
        self.bias = padding_bias(keep, plan.kv_heads, capacity, plan.dtype)
        self.real = None if keep is None else keep.sum(dim=1)  # (R,) real prompt tokens
        self.prefill_on_rows = prefill_on_rows
        self.runner = make_layers(plan, self.cache, self.bias)

    def prefill(self) -> Tensor:
        """Run the prompt through the model's modules (filling the caches); logits (R, V)."""
        model = self.plan.model
        if self.keep is not None and self.prefill_on_rows and not torch.is_grad_enabled():
            h = prefill_rows(model, self.ids, self.keep, self.cache)  # (R, C)
        else:
            h, _ = model.hidden_states(self.ids, attention_mask=self.keep, cache=self.cache)
            h = h[:, -1]  # (R, C)
        return self.runner.head(h)

    def _embed(self, tokens: Tensor, t: int) -> tuple[Tensor, Tensor | None]:
        """The input rows (R·n, C) of tokens (R, n) at cache slots [t, t + n), and the RoPE
        positions ((n,) for every row, (R, n) for a padded batch; None without RoPE)."""
        plan = self.plan
        rows, n = tokens.shape
        x = plan.embed.index_select(0, tokens.reshape(-1))  # (R·n, C)
        if plan.embed_scale is not None:  # Gemma's √C, rounded to the dtype
            x = x * plan.embed_scale
        steps = torch.arange(t, t + n, device=tokens.device)  # (n,) cache slots
        if self.real is None:  # every row at position = slot
            pos = steps
            if plan.pos_table is not None:
                x = (x.view(rows, n, -1) + plan.pos_table[pos]).view(rows * n, -1)
        else:  # positions count from each row's first real token
            pos = self.real[:, None] + (steps - self.prompt)  # (R, n)
            if plan.pos_table is not None:
                x = x + plan.pos_table.index_select(0, pos.reshape(-1))
        return x, pos if plan.rope is not None else None

    def step(self, tokens: Tensor) -> Tensor:
        """Feed tokens (R,) at the next position; logits (R, V)."""
        return self.run(tokens[:, None])[:, 0]

    def run(self, tokens: Tensor) -> Tensor:
        """Feed tokens (R, n) at the next n positions; logits (R, n, V) of the position after
        each."""
        rows, n = tokens.shape
        t = self.length
        if t + n > self.capacity:
            raise IndexError(f"PlanStepper: the caches hold {self.capacity} positions; "
                             f"feeding {n} more after {t} is too many")
        runner = self.runner
        if runner.one_token_only and n > 1:  # n steps compute what one pass of n would
            return torch.stack([self.step(tokens[:, j]) for j in range(n)], dim=1)
        x, pos = self._embed(tokens, t)
        x = runner.layers(x, t, n, pos)  # (R·n, C)
        self.length = t + n
        return runner.head(self.plan.norm(x)).view(rows, n, -1)

    def rewind(self, length: int) -> None:
        """Forget the positions from ``length`` on (the next call writes there)."""
        if not self.prompt <= length <= self.length:
            raise ValueError(f"PlanStepper: rewind length must be in [{self.prompt}, "
                             f"{self.length}], got {length}")
        self.length = length

    def reorder(self, idx: Tensor) -> None:
        """Row r continues from row ``idx[r]`` (in place: the runners' views stay valid)."""
        n = self.length  # the runners write the buffers themselves: index their filled part
        for kc in self.cache:
            kc.keys[:, :, :n] = kc.keys[:, :, :n].index_select(0, idx)
            kc.values[:, :, :n] = kc.values[:, :, :n].index_select(0, idx)
        if self.bias is not None:
            bias = self.bias.view(self.rows, -1, self.capacity)  # (R, Hkv, cap)
            bias.copy_(bias.index_select(0, idx))
            self.real = self.real.index_select(0, idx)
