"""A lean decode step for ``qkv.models.GPT`` that feeds several tokens per row at once and
can roll back: the verification forward of prompt-lookup decoding
(``qkv.generation.prompt_lookup``) for GPTs that ``qkv.generation.fast_gpt`` serves.

Shapes: R rows, N prompt length, n tokens fed per row per call, t tokens already cached,
s = t + n, C width, H heads, Hkv kv heads, g = H / Hkv, D head dim, V vocab size.

The math is ``GPT.forward`` with a cache, written as ``qkv.generation.fast_gpt``'s
single-token step (whose ``eligible`` decides when it applies; its (in, out) weight copies
made afresh by each stepper, i.e. each ``generate`` call) but for n tokens per row: a causal
(bottom-right) and padding mask over the cached + new keys, positions per row.

The stepper writes the caches' buffers itself (``KVCache.keys[:, :, t:s]``) and keeps its own
``length``; ``rewind(length)`` drops positions (prompt lookup's rejected draft tokens) — the
next call overwrites them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..models.gpt import GPT
from ..modules.cache import KVCache
from ..modules.feedforward import ACTIVATIONS
from .fast_gpt import transposed_weights

__all__ = ["MultiTokenGPTStepper"]


def _affine(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """x (M, in) @ w (in, out) + b."""
    return x @ w if b is None else torch.addmm(b, x, w)


class MultiTokenGPTStepper:
    """Prefill with the model, then feed n tokens per row per ``run`` (``step``: n = 1).

    Args:
        model: a GPT that ``qkv.generation.fast_gpt.eligible`` accepts.
        ids: (R, N) left-padded prompts.
        keep: (R, N) bool, True = real token, or None when nothing is padded.
        capacity: positions the caches hold (prompt + every token fed later).
    """

    def __init__(self, model: GPT, ids: Tensor, keep: Tensor | None, capacity: int) -> None:
        c = model.config
        self.model, self.ids, self.keep = model, ids, keep
        rows, n = ids.shape
        self.rows, self.length, self.prompt = rows, n, n
        self.heads = c.num_heads
        self.kv_heads = c.num_kv_heads or c.num_heads
        self.head_dim = c.head_dim
        self.act = ACTIVATIONS[c.activation]
        wt = transposed_weights(model)
        self.layers = []
        for i, layer in enumerate(model.layers):
            a, f = layer.attn, layer.ffn
            w_in, w_out, w_fc, w_proj = wt[4 * i:4 * i + 4]
            self.layers.append((
                layer.norm1.weight, layer.norm1.bias, layer.norm1.eps,
                w_in, a.in_proj.bias, w_out, a.out_proj.bias,
                layer.norm2.weight, layer.norm2.bias, layer.norm2.eps,
                w_fc, f.fc_in.bias, w_proj, f.fc_out.bias))
        self.norm = (model.norm.weight, model.norm.bias, model.norm.eps)
        self.width = c.dim
        self.embed = model.embed.weight  # (V, C)
        self.head = wt[-1]  # (C, V)
        self.pos_table = None if model.positions is None else model.positions.weight
        self.rope = model.rope
        self.cache = model.new_cache(rows, capacity)
        if not all(type(kc) is KVCache for kc in self.cache):
            raise TypeError("MultiTokenGPTStepper: GPT.new_cache did not return KVCaches")
        self.mask = None  # (R, capacity) bool, True = real token
        self.real = None  # (R,) real prompt tokens per row
        if keep is not None:
            self.mask = torch.ones(rows, capacity, dtype=torch.bool, device=ids.device)
            self.mask[:, :n] = keep
            self.real = keep.sum(dim=1)

    def prefill(self) -> Tensor:
        """Run the prompt through the model (filling the caches); logits (R, V) of the token
        after it."""
        h, _ = self.model.hidden_states(self.ids, attention_mask=self.keep, cache=self.cache)
        return h[:, -1] @ self.head

    def rewind(self, length: int) -> None:
        """Forget the positions from ``length`` on (the next ``run`` writes there)."""
        if not self.prompt <= length <= self.length:
            raise ValueError(f"MultiTokenGPTStepper: rewind length must be in [{self.prompt}, "
                             f"{self.length}], got {length}")
        self.length = length

    def _mask(self, t: int, n: int, dtype: torch.dtype) -> Tensor | None:
        """The attention mask over the s keys: the real keys and, for n > 1, no key after its
        query (causal, bottom-right aligned); None when nothing is masked. One token: bool
        (R, 1, 1, s), True = may attend. Several: additive (R or 1, 1, n, s), 0 or -inf, made
        once per call (a bool mask would be converted by every layer's attention)."""
        s = t + n
        allowed = None if self.mask is None else self.mask[:, None, None, :s]  # (R, 1, 1, s)
        if n == 1:
            return allowed
        causal = torch.ones(n, s, dtype=torch.bool, device=self.embed.device).tril(t)
        allowed = causal[None, None] if allowed is None else allowed & causal
        zero = torch.zeros((), dtype=dtype, device=self.embed.device)
        return zero.masked_fill(~allowed, float("-inf"))  # (R|1, 1, n, s)

    def run(self, tokens: Tensor) -> Tensor:
        """Feed tokens (R, n) at the next n positions; logits (R, n, V) of the positions
        after each."""
        rows, n = tokens.shape
        t = self.length  # first cache slot written
        s = t + n
        heads, kvh, d = self.heads, self.kv_heads, self.head_dim
        g = heads // kvh
        x = self.embed.index_select(0, tokens.reshape(-1))  # (R·n, C)
        steps = torch.arange(t - self.prompt, s - self.prompt, device=tokens.device)  # (n,)
        if self.real is None:
            pos = steps + self.prompt  # (n,), every row alike
            if self.pos_table is not None:
                x = (x.view(rows, n, -1) + self.pos_table[pos]).view(rows * n, -1)
        else:
            pos = self.real[:, None] + steps  # (R, n)
            if self.pos_table is not None:
                x = x + self.pos_table.index_select(0, pos.reshape(-1))
        mask = self._mask(t, n, x.dtype)
        width = (self.width,)
        for (w1, b1, e1, w_in, b_in, w_out, b_out, w2, b2, e2, w_fc, b_fc, w_proj, b_proj), cache \
                in zip(self.layers, self.cache, strict=True):
            h = F.layer_norm(x, width, w1, b1, e1)
            proj = _affine(h, w_in, b_in).view(rows, n, heads + 2 * kvh, d)  # (R, n, ·, D)
            q = proj[:, :, :heads].transpose(1, 2)  # (R, H, n, D)
            k = proj[:, :, heads:heads + kvh].transpose(1, 2)  # (R, Hkv, n, D)
            v = proj[:, :, heads + kvh:].transpose(1, 2)  # (R, Hkv, n, D)
            if self.rope is not None:
                q, k = self.rope.rotate(q, pos), self.rope.rotate(k, pos)
            cache.keys[:, :, t:s] = k
            cache.values[:, :, t:s] = v
            a = F.scaled_dot_product_attention(
                q, cache.keys[:, :, :s], cache.values[:, :, :s], attn_mask=mask,
                enable_gqa=g > 1)  # (R, H, n, D)
            a = a.transpose(1, 2).reshape(rows * n, heads * d)
            x = _affine(a, w_out, b_out).add_(x)  # (R·n, C)
            h = F.layer_norm(x, width, w2, b2, e2)
            x = _affine(self.act(_affine(h, w_fc, b_fc)), w_proj, b_proj).add_(x)
        self.length = s
        logits = F.layer_norm(x, width, *self.norm) @ self.head  # (R·n, V)
        return logits.view(rows, n, -1)

    def step(self, tokens: Tensor) -> Tensor:
        """Feed tokens (R,) at the next position; logits (R, V)."""
        return self.run(tokens[:, None])[:, 0]

    def reorder(self, idx: Tensor) -> None:
        """Row r continues from row ``idx[r]`` (beam search)."""
        n = self.length
        for kc in self.cache:
            kc.keys[:, :, :n] = kc.keys[:, :, :n].index_select(0, idx)
            kc.values[:, :, :n] = kc.values[:, :, :n].index_select(0, idx)
        if self.mask is not None:
            self.mask = self.mask.index_select(0, idx)
            self.real = self.real.index_select(0, idx)
