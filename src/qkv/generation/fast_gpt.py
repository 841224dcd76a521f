"""A lean single-token decode step for ``qkv.models.GPT``: the same math as ``GPT.forward``
with a cache, without its per-call validation and module dispatch.

Shapes: R rows, N prompt length, L tokens in the cache, C width, H heads, Hkv kv heads,
D head dim, F feed-forward width, V vocab size.

Decoding one token at batch 1 is ~30 MFLOP but streams every weight once: on a CPU the time
goes to Python/dispatch overhead and to memory bandwidth. This step calls the aten ops
directly (layer_norm, addmm, scaled_dot_product_attention on (R, H, 1, D) against the cached
keys, one mask slice only when the prompt was padded) and multiplies by the weights transposed
to (in, out): a row vector times an (in, out) matrix streams about twice as fast through
torch's CPU GEMM as times the transpose of an (out, in) one (~20 vs ~10 GB/s here).

The transposed copies (as large as the model's linear weights, LM head included) are made on
the first ``generate`` call and kept with the model — a weak reference, freed with it — so
later calls skip the copy (~20-90 ms for 58 MB on this machine, mostly page faults). A
parameter that was moved, replaced or changed in place (its pointer or version counter, or a
sample of its first and last rows, differs) invalidates them; ``release(model)`` frees them.

The prompt is prefilled by the model itself (``GPT.hidden_states`` with its ``KVCache``s);
``eligible`` says when this step computes exactly what ``GPT.forward`` would (plain GPT
parts, plain ``nn.Linear`` projections, fp32/fp64, no active dropout); anything else goes
through the generic stepper. A model with an engaged (unmerged) ``qkv.peft`` LoRA adapter
therefore decodes on the generic path; a merged or disabled one has plain ``nn.Linear``
projections again and decodes here (merging changes the weights in place, which invalidates
the transposed copies).
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..models.gpt import GPT, GPTConfig
from ..modules.attention import MultiHeadAttention
from ..modules.cache import KVCache
from ..modules.feedforward import ACTIVATIONS, FeedForward
from ..modules.layers import EncoderLayer
from ..modules.norms import LayerNorm

__all__ = ["FastGPTStepper", "eligible", "release", "transposed_weights"]

# GPTConfig fields this step implements (any value); another field with a non-default value
# (a variant added later) sends the model to the generic stepper.
_KNOWN = {"vocab_size", "max_len", "dim", "num_layers", "num_heads", "num_kv_heads",
          "ffn_hidden", "activation", "norm", "norm_eps", "positions", "dropout",
          "attn_dropout", "bias", "tie_embeddings"}


def eligible(model: object) -> bool:
    """True when ``model`` is a plain ``GPT`` whose decode step this module reproduces."""
    if type(model) is not GPT:
        return False
    c = model.config
    for f in dataclasses.fields(GPTConfig):
        if f.name not in _KNOWN and getattr(c, f.name) != f.default:
            return False
    if c.norm != "layernorm" or c.activation not in ACTIVATIONS:
        return False
    if model.training and (c.dropout or c.attn_dropout):
        return False
    dtype = model.embed.weight.dtype
    if dtype not in (torch.float32, torch.float64) or type(model.norm) is not LayerNorm:
        return False
    for layer in model.layers:
        attn = layer.attn
        if (type(layer) is not EncoderLayer or not layer.norm_first
                or type(attn) is not MultiHeadAttention or attn.in_proj is None
                or attn.backend not in ("auto", "sdpa") or type(layer.ffn) is not FeedForward
                or type(layer.norm1) is not LayerNorm or type(layer.norm2) is not LayerNorm):
            return False
        # a projection swapped for another module (an unmerged qkv.peft LoRA wrapper) computes
        # more than its weight: only the generic stepper, which calls the modules, is exact
        if not all(type(m) is nn.Linear for m in (attn.in_proj, attn.out_proj,
                                                  layer.ffn.fc_in, layer.ffn.fc_out)):
            return False
    return True


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (stamp, weights)


def _linear_weights(model: GPT) -> list[Tensor]:
    """The (out, in) weights of every linear layer, in order, then the LM head's (V, C)."""
    ws = []
    for layer in model.layers:
        ws += [layer.attn.in_proj.weight, layer.attn.out_proj.weight, layer.ffn.fc_in.weight,
               layer.ffn.fc_out.weight]
    return [*ws, model.lm_head.weight]


def _stamp(w: Tensor) -> tuple:
    return (w.data_ptr(), w._version, tuple(w.shape), w.dtype, w.device)


def transposed_weights(model: GPT) -> list[Tensor]:
    """(in, out) contiguous copies of ``_linear_weights(model)``: 4 per layer (in_proj,
    out_proj, fc_in, fc_out) and the LM head (C, V); reused while the weights are unchanged."""
    src = _linear_weights(model)
    stamp = tuple(_stamp(w) for w in src)
    hit = _PLANS.get(model)
    if hit is not None and hit[0] == stamp and all(  # samples catch edits through .data
            torch.equal(w[0, :8], t[:8, 0]) and torch.equal(w[-1, -8:], t[-8:, -1])
            for w, t in zip(src, hit[1], strict=True)):
        return hit[1]
    _PLANS.pop(model, None)  # free the stale copies before making new ones
    out = [w.detach().t().contiguous() for w in src]  # (out, in) -> (in, out)
    _PLANS[model] = (stamp, out)
    return out


def release(model: GPT) -> None:
    """Free the transposed weight copies kept for ``model`` (no-op if there are none)."""
    _PLANS.pop(model, None)


def _affine(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """x (R, in) @ w (in, out) + b."""
    return x @ w if b is None else torch.addmm(b, x, w)


class FastGPTStepper:
    """Prefill with the model, then decode one token per row per ``step``.

    Args:
        model: an ``eligible`` GPT.
        ids: (R, N) left-padded prompts.
        keep: (R, N) bool, True = real token, or None when nothing is padded.
        max_new_tokens: T; the caches hold N + T positions.
    """

    def __init__(self, model: GPT, ids: Tensor, keep: Tensor | None,
                 max_new_tokens: int) -> None:
        c = model.config
        self.model, self.ids, self.keep = model, ids, keep
        rows, n = ids.shape
        self.rows, self.length = rows, n
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads or c.num_heads, \
            c.head_dim
        self.gqa = self.kv_heads != self.heads
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
        self.cache = model.new_cache(rows, n + max_new_tokens)
        if not all(type(kc) is KVCache for kc in self.cache):
            raise TypeError("FastGPTStepper: GPT.new_cache did not return KVCaches")
        self.mask = None
        self.real = None  # (R,) real prompt tokens per row: the next position, padded batch
        if keep is not None:
            self.mask = torch.ones(rows, 1, 1, n + max_new_tokens, dtype=torch.bool,
                                   device=ids.device)  # (R, 1, 1, S) for SDPA
            self.mask[:, 0, 0, :n] = keep
            self.real = keep.sum(dim=1)

    def prefill(self) -> Tensor:
        """Run the prompt through the model (filling the caches); logits (R, V)."""
        h, _ = self.model.hidden_states(self.ids, attention_mask=self.keep, cache=self.cache)
        return h[:, -1] @ self.head

    def step(self, tokens: Tensor) -> Tensor:
        """Feed tokens (R,) at the next position; logits (R, V)."""
        t = self.length  # cache slot of the new token
        self.length = s = t + 1
        rows, hd = self.rows, self.heads * self.head_dim
        kvd = self.kv_heads * self.head_dim
        x = self.embed.index_select(0, tokens)  # (R, C)
        if self.real is None:  # every row at position t (positions were checked by generate)
            rope_pos = torch.tensor([t], device=tokens.device) if self.rope is not None else None
            if self.pos_table is not None:
                x = x + self.pos_table[t]
        else:
            pos = self.real + (t - self.ids.shape[1])  # (R,)
            rope_pos = pos[:, None] if self.rope is not None else None
            if self.pos_table is not None:
                x = x + self.pos_table.index_select(0, pos)
        mask = None if self.mask is None else self.mask[..., :s]  # (R, 1, 1, S)
        width = (self.width,)
        for (w1, b1, e1, w_in, b_in, w_out, b_out, w2, b2, e2, w_fc, b_fc, w_proj, b_proj), cache \
                in zip(self.layers, self.cache, strict=True):
            h = F.layer_norm(x, width, w1, b1, e1)
            proj = _affine(h, w_in, b_in)  # (R, (H + 2·Hkv)·D)
            q = proj[:, :hd].view(rows, self.heads, 1, self.head_dim)  # (R, H, 1, D)
            k = proj[:, hd:hd + kvd].view(rows, self.kv_heads, 1, self.head_dim)
            v = proj[:, hd + kvd:].view(rows, self.kv_heads, 1, self.head_dim)
            if self.rope is not None:
                q, k = self.rope.rotate(q, rope_pos), self.rope.rotate(k, rope_pos)
            cache.keys[:, :, t:s] = k
            cache.values[:, :, t:s] = v
            a = F.scaled_dot_product_attention(
                q, cache.keys[:, :, :s], cache.values[:, :, :s], attn_mask=mask,
                enable_gqa=self.gqa)  # (R, H, 1, D)
            x = _affine(a.reshape(rows, hd), w_out, b_out).add_(x)
            h = F.layer_norm(x, width, w2, b2, e2)
            x = _affine(self.act(_affine(h, w_fc, b_fc)), w_proj, b_proj).add_(x)
        return F.layer_norm(x, width, *self.norm) @ self.head  # (R, V)

    def reorder(self, idx: Tensor) -> None:
        """Row r continues from row ``idx[r]``."""
        n = self.length  # the step writes the buffers itself: index their filled part
        for kc in self.cache:
            kc.keys[:, :, :n] = kc.keys[:, :, :n].index_select(0, idx)
            kc.values[:, :, :n] = kc.values[:, :, :n].index_select(0, idx)
        if self.mask is not None:
            self.mask = self.mask.index_select(0, idx)
            self.real = self.real.index_select(0, idx)
