"""A lean single-token decode step for ``qkv.models.GPT``: the same math as ``GPT.forward``
with a cache, without its per-call validation and module dispatch.

Shapes: R rows, N prompt length, L tokens in the cache, C width, H heads, Hkv kv heads,
D head dim, F feed-forward width, V vocab size.

Decoding one token at batch 1 is ~30 MFLOP but streams every weight once: on a CPU the time
goes to memory bandwidth through torch's GEMM and to Python/dispatch overhead. This step calls
the aten ops directly and multiplies by the weights transposed to (in, out): a row vector
times an (in, out) matrix streams about twice as fast through torch's CPU GEMM as times the
transpose of an (out, in) one (``F.linear``, ``mv(W, x)``; ~20 vs ~10 GB/s here). Per layer
and token it dispatches ~17 ops and allocates no cache memory: the fused q/k/v projection
writes into a preallocated buffer whose q/k/v parts are views made once; the new key/value
go into the cache slot through views made once (``unbind``); attention for the one query is
``baddbmm`` (scores · scale + a padding bias, one op) -> ``softmax`` -> ``bmm`` on
(R·Hkv, H/Hkv, ·) batches of the cache (GQA needs no key/value expansion), which is ~2×
faster here than ``scaled_dot_product_attention``'s CPU kernel for one query (~20 vs
~35-55 µs a layer). ``benchmarks/bench_generate.py`` measures it against the weight-read
floor. ``torch.compile`` of the step was tried: with the cache length changing every step it
recompiles until its limit (minutes on this machine) and then ran slower than eager, so it is
not used.

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

__all__ = ["FastGPTStepper", "eligible", "plain_gpt", "release", "transposed_weights"]

# GPTConfig fields this step implements (any value); another field with a non-default value
# (a variant added later) sends the model to the generic stepper.
_KNOWN = {"vocab_size", "max_len", "dim", "num_layers", "num_heads", "num_kv_heads",
          "ffn_hidden", "activation", "norm", "norm_eps", "positions", "dropout",
          "attn_dropout", "bias", "tie_embeddings"}


def eligible(model: object) -> bool:
    """True when ``model`` is a plain ``GPT`` whose decode step this module reproduces."""
    return plain_gpt(model, linear=nn.Linear, dtypes=(torch.float32, torch.float64))


def plain_gpt(model: object, *, linear: type, dtypes: tuple[torch.dtype, ...]) -> bool:
    """True when ``model`` is a ``GPT`` of plain parts (pre-norm ``EncoderLayer``s, LayerNorm,
    a fused-QKV ``MultiHeadAttention`` on sdpa/auto, ``FeedForward``, no unknown config
    variant, no active dropout), embeddings of one of ``dtypes``, and every projection of
    exactly type ``linear`` — what a lean decode step (this module's, ``fast_int8``'s) may
    reproduce instead of calling the modules."""
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
    if model.embed.weight.dtype not in dtypes or type(model.norm) is not LayerNorm:
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
        if not all(type(m) is linear for m in (attn.in_proj, attn.out_proj,
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


# activations by name, as direct (in-place where torch has one) calls on a fresh buffer
_INPLACE = {"relu": torch.relu_,
            "gelu": lambda x: torch._C._nn.gelu_(x),
            "gelu_tanh": lambda x: torch._C._nn.gelu_(x, approximate="tanh"),
            "silu": lambda x: F.silu(x, inplace=True)}


class FastGPTStepper:
    """Prefill with the model, then decode one token per row per ``step``.

    Per layer and step: layer_norm, one addmm into a preallocated (R, (H + 2·Hkv)·D) buffer
    whose q/k/v parts are fixed views, two copies into the cache slot (views made once),
    attention for the one query as baddbmm (scores · scale + padding bias) -> softmax -> bmm
    on (R·Hkv, H/Hkv, ·) views (no SDPA dispatch, no key/value expansion for GQA),
    out-projection + residual, layer_norm, the feed-forward with an in-place activation.

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
        heads, kv_heads, d = c.num_heads, c.num_kv_heads or c.num_heads, c.head_dim
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d
        self.group = heads // kv_heads  # g query heads per kv head
        self.scale = 1.0 / d ** 0.5
        self.act = _INPLACE.get(c.activation) or ACTIVATIONS[c.activation]
        wt = transposed_weights(model)
        dtype, device = model.embed.weight.dtype, ids.device
        hd, kvd = heads * d, kv_heads * d
        capacity = n + max_new_tokens
        self.cache = model.new_cache(rows, capacity)
        if not all(type(kc) is KVCache for kc in self.cache):
            raise TypeError("FastGPTStepper: GPT.new_cache did not return KVCaches")
        self.layers = []
        for i, (layer, kc) in enumerate(zip(model.layers, self.cache, strict=True)):
            a, f = layer.attn, layer.ffn
            w_in, w_out, w_fc, w_proj = wt[4 * i:4 * i + 4]
            proj = torch.empty(rows, hd + 2 * kvd, dtype=dtype, device=device)  # (R, 3·)
            keys = kc.keys.view(rows * kv_heads, capacity, d)  # (R·Hkv, S, D)
            values = kc.values.view(rows * kv_heads, capacity, d)  # (R·Hkv, S, D)
            self.layers.append((
                layer.norm1.weight, layer.norm1.bias, layer.norm1.eps,
                w_in, a.in_proj.bias, w_out, a.out_proj.bias,
                layer.norm2.weight, layer.norm2.bias, layer.norm2.eps,
                w_fc, f.fc_in.bias, w_proj, f.fc_out.bias,
                proj,
                proj[:, :hd].view(rows, heads, 1, d),  # q (R, H, 1, D)
                proj[:, hd:hd + kvd].view(rows, kv_heads, 1, d),  # k (R, Hkv, 1, D)
                proj[:, hd:hd + kvd].view(rows, kv_heads, d),  # k (R, Hkv, D)
                proj[:, hd + kvd:].view(rows, kv_heads, d),  # v (R, Hkv, D)
                # q as (R·Hkv, g, D) batches: a view of the buffer for one row
                proj[:, :hd].view(kv_heads, self.group, d) if rows == 1 else None,
                kc.keys.unbind(2), kc.values.unbind(2),  # S slot views (R, Hkv, D)
                keys.transpose(1, 2), values))  # (R·Hkv, D, S), (R·Hkv, S, D)
        self.norm = (model.norm.weight, model.norm.bias, model.norm.eps)
        self.width = (c.dim,)
        self.embed = model.embed.weight  # (V, C)
        self.head = wt[-1]  # (C, V)
        self.pos_table = None if model.positions is None else model.positions.weight
        self.rope = model.rope
        # additive key bias (R·Hkv, 1, S): 0 = may attend, -inf = a padded prompt position;
        # a (1, 1, 1) zero ignored (beta=0) when nothing is padded
        self.bias = torch.zeros(1, 1, 1, dtype=dtype, device=device)
        self.beta = 0.0
        self.real = None  # (R,) real prompt tokens per row: the next position, padded batch
        if keep is not None:
            bias = torch.zeros(rows, kv_heads, 1, capacity, dtype=dtype, device=device)
            bias[:, :, 0, :n] = torch.zeros((), dtype=dtype, device=device).masked_fill(
                ~keep[:, None, :], float("-inf"))  # (R, Hkv, N)
            self.bias = bias.view(rows * kv_heads, 1, capacity)
            self.beta = 1.0
            self.real = keep.sum(dim=1)

    def prefill(self) -> Tensor:
        """Run the prompt through the model (filling the caches); logits (R, V)."""
        h, _ = self.model.hidden_states(self.ids, attention_mask=self.keep, cache=self.cache)
        return h[:, -1] @ self.head

    def step(self, tokens: Tensor) -> Tensor:
        """Feed tokens (R,) at the next position; logits (R, V)."""
        t = self.length  # cache slot of the new token
        self.length = s = t + 1
        rows, hk, g, d = self.rows, self.kv_heads, self.group, self.head_dim
        x = self.embed.index_select(0, tokens)  # (R, C)
        rope_pos = None
        if self.real is None:  # every row at position t (positions were checked by generate)
            if self.rope is not None:
                rope_pos = torch.tensor([t], device=tokens.device)
            if self.pos_table is not None:
                x += self.pos_table[t]
        else:
            pos = self.real + (t - self.ids.shape[1])  # (R,)
            rope_pos = pos[:, None] if self.rope is not None else None
            if self.pos_table is not None:
                x += self.pos_table.index_select(0, pos)
        bias = self.bias if self.beta == 0.0 else self.bias[:, :, :s]  # (R·Hkv, 1, S)
        width, beta, scale, act = self.width, self.beta, self.scale, self.act
        layer_norm, addmm, mm, baddbmm, bmm = (torch.layer_norm, torch.addmm, torch.mm,
                                               torch.baddbmm, torch.bmm)
        softmax = torch._softmax
        for (w1, b1, e1, w_in, b_in, w_out, b_out, w2, b2, e2, w_fc, b_fc, w_proj, b_proj,
             proj, q, k4, k, v, q3, kslots, vslots, keys_t, values) in self.layers:
            h = layer_norm(x, width, w1, b1, e1)
            if b_in is None:
                mm(h, w_in, out=proj)  # (R, (H + 2·Hkv)·D)
            else:
                addmm(b_in, h, w_in, out=proj)
            if rope_pos is not None:
                q3 = self.rope.rotate(q, rope_pos).reshape(rows * hk, g, d)  # (R·Hkv, g, D)
                k = self.rope.rotate(k4, rope_pos).view(rows, hk, d)  # (R, Hkv, D)
            elif q3 is None:
                q3 = q.reshape(rows * hk, g, d)  # (R·Hkv, g, D)
            kslots[t].copy_(k)
            vslots[t].copy_(v)
            scores = baddbmm(bias, q3, keys_t[:, :, :s], beta=beta,
                             alpha=scale)  # (R·Hkv, g, S)
            a = bmm(softmax(scores, -1, False), values[:, :s])  # (R·Hkv, g, D)
            a = a.view(rows, hk * g * d)  # (R, H·D)
            x = (mm(a, w_out) if b_out is None else addmm(b_out, a, w_out)).add_(x)
            h = layer_norm(x, width, w2, b2, e2)
            h = act(mm(h, w_fc) if b_fc is None else addmm(b_fc, h, w_fc))
            x = (mm(h, w_proj) if b_proj is None else addmm(b_proj, h, w_proj)).add_(x)
        return mm(layer_norm(x, width, *self.norm), self.head)  # (R, V)

    def reorder(self, idx: Tensor) -> None:
        """Row r continues from row ``idx[r]`` (in place: the step's views stay valid)."""
        n = self.length  # the step writes the buffers itself: index their filled part
        for kc in self.cache:
            kc.keys[:, :, :n] = kc.keys[:, :, :n].index_select(0, idx)
            kc.values[:, :, :n] = kc.values[:, :, :n].index_select(0, idx)
        if self.real is not None:
            rows, cap = self.rows, self.bias.shape[-1]
            bias = self.bias.view(rows, -1, cap)  # (R, Hkv, S)
            bias.copy_(bias.index_select(0, idx))
            self.real = self.real.index_select(0, idx)
