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

One fp32 row on one thread (the common case: a single prompt) goes further: each layer is one
call of a C kernel (``row_step_kernel``: layer norms, RoPE, cache write, attention,
activation and residuals in C around ``gemv_kernel``'s products) and the LM head one call of
``gemv_kernel``, which streams the (in, out) weights faster than torch's GEMM here (~16 vs
~12 GB/s). Measured here, 1 thread, the 6-layer, 384-wide GPT of ``bench_generate``: ~4.2-4.4
vs ~5.3-6.1 ms a token on the torch ops, the same tokens. ``QKV_ROW_KERNEL=0`` or
``QKV_GEMV_KERNEL=0`` keeps the torch ops.

From ``qkv.ops.fast_linear.MIN_ROWS`` (4) rows on (fp32 on CPU, layers of at least
``PACKED_MIN_WEIGHTS`` weights on average) the step multiplies through oneDNN's matmul
(``torch.ops.mkldnn._linear_pointwise``, the op ``fast_linear`` uses) on weights packed once
for it (``_reorder_linear_weight``), with fc_in's activation (relu, gelu, gelu_tanh, silu)
and the residual adds of out_proj and fc_out fused into the call: measured here at 16 rows,
1 thread, the 25 matrices of a 6-layer, 384-wide GPT with an 8192-token head take ~6.8 ms
per step that way against ~10.5 ms through ``addmm`` by (in, out) copies (MKL's small-M GEMM
is slow on this AMD CPU; oneDNN's packed kernels are not); at 1 row ``addmm`` is faster
(~4.3 vs ~5.0 ms), so one row keeps the (in, out) copies. In fp32 on one thread the
attention of each layer is one call of a small C kernel (``attention_kernel``: it skips the
padded keys and reads each cached key and value once), where the torch path is baddbmm ->
softmax -> bmm over R·Hkv tiny batches (~0.3 vs ~0.45 ms a layer at 16 rows, ~18 vs ~29 µs
at 1 row, 72 keys); other thread counts, dtypes or a missing compiler keep the torch ops.

The transposed or packed copies (each as large as the model's linear weights, LM head
included) are made afresh by every ``generate`` call, from the weights as they are then, and
dropped when it returns: nothing is kept with the model, so no copy can go stale, whatever
changed the weights in between (an in-place edit through ``.data`` or numpy bumps no version
counter; a model built under ``inference_mode`` has none). A copy kept across calls and
checked by pointer, version and a sample of entries missed such edits. The copies cost per
call (measured here, 1 thread): ~30 ms for the 52 MB of the 6-layer, 384-wide GPT above
(packing ~30 ms), ~0.3 s for the 471 MB of a GPT-2-small-sized one (12 layers, 768 wide,
50257-token head; packing ~0.25 s), under 1 ms for a 2-layer, 32-wide one — about 7-8 tokens
of one-row decoding at either size (~4.3 and ~38 ms a token): 6-10 % of a 128-token
generation, 25-35 % of a 32-token one, ~10 % of 32 tokens for 16 rows.

The prompt is prefilled by the model's own parts with its ``KVCache``s: a left-padded batch
without gradients on its real tokens only (``prefill_rows``: the layers'
``EncoderLayer.forward_rows`` on packed (T, C) token rows, the last layer at each row's last
token; measured here at 16 rows of 16 with 136 real tokens, 6 layers of width 384, 1 thread:
~43-50 vs ~80 ms through all 256 padded positions), anything else through
``GPT.hidden_states``. ``eligible`` says when this step computes exactly what
``GPT.forward`` would (plain GPT parts, plain ``nn.Linear`` projections, fp32/fp64, no
active dropout); anything else goes through the generic stepper. A model with an engaged
(unmerged) ``qkv.peft`` LoRA adapter therefore decodes on the generic path; a merged or
disabled one has plain ``nn.Linear`` projections again and decodes here (the next call copies
the merged weights).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..models.gpt import GPT, GPTConfig
from ..models.inputs import check_token_ids
from ..modules.attention import MultiHeadAttention
from ..modules.cache import KVCache
from ..modules.feedforward import ACTIVATIONS, FeedForward
from ..modules.layers import EncoderLayer, TokenRows
from ..modules.linear_call import apply_linear, has_hooks
from ..modules.norms import LayerNorm
from ..modules.positions import positions_from_mask
from ..ops import attention
from ..ops import fast_linear as _fast_linear
from . import attention_kernel, gemv_kernel
from .row_step_kernel import RowLayers

__all__ = ["PACKED_MIN_WEIGHTS", "FastGPTStepper", "eligible", "linear_layers", "packed_weights",
           "packing_works", "plain_gpt", "prefill_rows", "transposed_weights", "use_packed"]

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
    exactly type ``linear``, and no hooks on any of its modules (nor global ones: a lean step
    calls no module, so a hook would silently not run) — what a lean decode step (this
    module's, ``fast_int8``'s) may reproduce instead of calling the modules."""
    if type(model) is not GPT or any(has_hooks(m) for m in model.modules()):
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


def linear_layers(model: GPT) -> list[nn.Module]:
    """The projections of every layer in the order the lean steps keep them: in_proj,
    out_proj, fc_in, fc_out per layer (4·L modules; the LM head not included)."""
    return [m for layer in model.layers
            for m in (layer.attn.in_proj, layer.attn.out_proj, layer.ffn.fc_in,
                      layer.ffn.fc_out)]


def _linear_weights(model: GPT) -> list[Tensor]:
    """The (out, in) weights of every linear layer, in order, then the LM head's (V, C)."""
    return [m.weight for m in linear_layers(model)] + [model.lm_head.weight]


def transposed_weights(model: GPT) -> list[Tensor]:
    """(in, out) contiguous copies of ``_linear_weights(model)``: 4 per layer (in_proj,
    out_proj, fc_in, fc_out) and the LM head (C, V). Fresh copies on every call, of the
    weights as they are now: the caller (one ``generate`` call's stepper) holds them and
    they go with it, so no copy outlives the call that an in-place edit could leave stale."""
    return [w.detach().t().contiguous() for w in _linear_weights(model)]  # (out, in) -> (in, out)


def packed_weights(model: GPT) -> list[Tensor]:
    """oneDNN-packed (opaque ``mkldnn`` tensor) copies of ``_linear_weights(model)`` for
    ``torch.ops.mkldnn._linear_pointwise``, in the order of ``transposed_weights``; fresh on
    every call, as ``transposed_weights``. Needs ``packing_works()``."""
    reorder = torch.ops.mkldnn._reorder_linear_weight
    return [reorder(w.detach(), _PACK_ROWS) for w in _linear_weights(model)]


PACKED_MIN_WEIGHTS = 1 << 17
"""Fewest weights per linear layer (the mean over the layers and the LM head) for which a
step of ``MIN_ROWS`` or more rows goes through oneDNN with packed weights: each call costs
~15 µs more than ``addmm``, which small layers do not earn back (measured here, 1 thread:
a 2-layer GPT of width 128 is slower packed, width 192 and up faster)."""
_PACK_ROWS = 16  # the batch-size hint the weights are packed for (any row count works)
_PACKING: dict[str, bool] = {}


def packing_works() -> bool:
    """True when this torch build packs linear weights for oneDNN and the packed matmul
    agrees with ``F.linear`` on a small input (checked once per process), and
    ``qkv.ops.fast_linear.onednn_linear(False)`` is not in force."""
    if "ok" not in _PACKING:
        _PACKING["ok"] = False
        op = _fast_linear.onednn_op()
        if op is not None:
            try:
                g = torch.Generator().manual_seed(0)
                x = torch.randn(5, 16, generator=g)
                w = torch.randn(24, 16, generator=g)
                b = torch.randn(24, generator=g)
                with torch.no_grad():
                    got = op(x, torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS), b,
                             "none", [], "")
                _PACKING["ok"] = bool(got.shape == (5, 24) and torch.allclose(
                    got, F.linear(x, w, b), rtol=1e-5, atol=1e-5))
            except (AttributeError, RuntimeError):  # no such op in this build
                pass
    return _PACKING["ok"] and _fast_linear.onednn_linear_active()


def use_packed(model: GPT, rows: int) -> bool:
    """Whether a ``FastGPTStepper`` of ``rows`` rows multiplies through oneDNN's packed
    weights: fp32 on CPU, at least ``qkv.ops.fast_linear.MIN_ROWS`` rows, layers of at least
    ``PACKED_MIN_WEIGHTS`` weights on average, and ``packing_works()``."""
    src = _linear_weights(model)
    w = src[0]
    return (rows >= _fast_linear.MIN_ROWS and w.dtype is torch.float32
            and w.device.type == "cpu"
            and sum(t.numel() for t in src) >= PACKED_MIN_WEIGHTS * len(src)
            and packing_works())


def prefill_rows(model: GPT, ids: Tensor, keep: Tensor, cache: list[KVCache]) -> Tensor:
    """``GPT.hidden_states(ids, attention_mask=keep, cache=cache)[0][:, -1]`` of a left-padded
    batch, computed on its T real tokens only (no gradients): final-normed hidden states
    (R, C) of every row's last position.

    The layers run on the packed (T, C) token rows (``EncoderLayer.forward_rows``): norms,
    projections and feed-forwards see the T real tokens; attention alone runs in the padded
    (R, H, N, D) layout with ``hidden_states``' mask (key padding, causal). Positions count
    from each row's first real token (``positions_from_mask``), as ``hidden_states``. The
    caches (empty, from ``model.new_cache``) get the real tokens' keys/values and zeros at
    the padded positions, which every later step masks (``keep``). The final norm runs on the
    R last rows only.

    Args:
        model: an ``eligible`` GPT.
        ids: (R, N) token ids, left-padded.
        keep: (R, N) bool, True = real token; every row's last column is real.
        cache: the model's ``new_cache(R, capacity)``, empty; filled with N positions.

    Raises:
        ValueError when a row's last column is padding (not left-padded), a token id is
        outside [0, V), or a position exceeds the learned table.
    """
    check_token_ids("GPT", "input_ids", ids, model.config.vocab_size, "vocab_size")
    if not bool(keep[:, -1].all()):
        raise ValueError("prefill_rows: keep must be left-padded (every row's last column a "
                         f"real token), got last column {keep[:, -1].tolist()}")
    n = ids.shape[1]
    rows = TokenRows(keep)
    pos = positions_from_mask(keep)  # (R, N)
    x = model.embed(rows.pack(ids))  # (T, C)
    if model.positions is not None:
        x = x + model.positions.encoding(rows.pack(pos))  # (T, C)
    mask, causal = model._layer_mask(keep, cache, n)
    rope_pos = pos if model.rope is not None else None
    bufs: dict[str, Tensor] = {}
    last = keep.sum(dim=1).cumsum(dim=0) - 1  # (R,) each row's last real token in T
    *body, top = model.layers
    for layer, kc in zip(body, cache, strict=False):
        x = layer.forward_rows(x, rows, mask=mask, causal=causal, cache=kc,
                               positions=rope_pos, bufs=bufs)  # (T, C)
    if top.rows_are_direct(cache[-1]) and top.norm_first:
        x = _last_layer_at(top, x, rows, keep, last, cache[-1], rope_pos)  # (R, C)
    else:
        x = top.forward_rows(x, rows, mask=mask, causal=causal, cache=cache[-1],
                             positions=rope_pos, bufs=bufs).index_select(0, last)  # (R, C)
    return model.norm(x)  # (R, C)


def _last_layer_at(layer: EncoderLayer, h: Tensor, rows: TokenRows, keep: Tensor,
                   last: Tensor, cache: KVCache, pos: Tensor | None) -> Tensor:
    """A pre-norm ``layer.forward_rows(h, rows, ...)`` at each row's last token only (the
    prefill's last layer: nobody reads its other rows): every token's key/value is projected
    (and cached, zeros at the padded positions), the query, attention, output projection,
    norm and feed-forward run for the R last tokens. h (T, C) -> (R, C).

    Args:
        keep: (R, N) bool, True = real token; the last query sees every real key.
        last: (R,) the row of h that is each sequence's last (query) token.
        pos: (R, N) RoPE positions, or None without RoPE.
    """
    attn = layer.attn
    b, hd = rows.batch, attn._splits[0]
    proj = apply_linear(attn.in_proj, layer.norm1(h))  # (T, (H + 2·Hkv)·D)
    q = proj.index_select(0, last)[:, :hd].reshape(b, 1, attn.num_heads, attn.head_dim)
    q = q.transpose(1, 2)  # (R, H, 1, D)
    k, v = rows.unpack(proj[:, hd:]).split(attn._splits[1:], dim=-1)  # (R, N, Hkv·D) x2
    k = attn._heads(k, attn.num_kv_heads)  # (R, Hkv, N, D), zeros at padded positions
    v = attn._heads(v, attn.num_kv_heads)  # (R, Hkv, N, D)
    if pos is not None:
        q, k = attn.rope.rotate(q, pos[:, -1:]), attn.rope.rotate(k, pos)
    k, v = cache.append(k, v)  # (R, Hkv, N, D)
    out = attention(q, k, v, mask=keep[:, None, None, :], backend=attn.backend)  # (R, H, 1, D)
    x = apply_linear(attn.out_proj, out.transpose(1, 2).reshape(b, hd))  # (R, C)
    x = x.add_(h.index_select(0, last))
    return layer._ffn_rows(layer.norm2(x), {}).add_(x)  # (R, C)


# activations by name as oneDNN post-ops (attr, algorithm) of _linear_pointwise
_ONEDNN_ACT = {"relu": ("relu", ""), "gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"),
               "silu": ("swish", "")}

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
    From ``MIN_ROWS`` rows the products go through oneDNN on packed weights; one fp32 row on
    one thread runs each layer as one C call (``row_step_kernel``) instead.

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
        # R >= MIN_ROWS rows (fp32, large enough layers): oneDNN matmuls on packed weights,
        # the activation fused into fc_in where oneDNN has it, residuals fused into out_proj
        # and fc_out; fewer rows: addmm/mm on (in, out) copies
        self.packed = use_packed(model, rows)
        self.fused_act = _ONEDNN_ACT.get(c.activation, ("none", "")) if self.packed else None
        wt = packed_weights(model) if self.packed else transposed_weights(model)
        # fp32 on one thread: attention through the C kernel (one call per layer)
        self.attn_kernel = (attention_kernel.load() if model.embed.weight.dtype is torch.float32
                            and ids.device.type == "cpu" and torch.get_num_threads() == 1
                            and self.group <= attention_kernel.MAX_GROUP else None)
        dtype, device = model.embed.weight.dtype, ids.device
        hd, kvd = heads * d, kv_heads * d
        self.capacity = capacity = n + max_new_tokens
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
        if self.attn_kernel is not None:
            self.attn_out = torch.empty(rows, hd, dtype=dtype, device=device)  # (R, H·D)
            self.attn_scratch = torch.empty(self.group * capacity, dtype=dtype, device=device)
            if not all(kc.keys.is_contiguous() and kc.values.is_contiguous()
                       for kc in self.cache):
                self.attn_kernel = None
        # one row, fp32 on one thread: each layer one C call, the LM head one C GEMV
        self.row_layers = self.row_gemv = None
        if rows == 1 and self.attn_kernel is not None and not self.packed:
            self.row_gemv = gemv_kernel.load()
            if self.row_gemv is not None:
                linears = [(w, None, m.bias)
                           for w, m in zip(wt[:-1], linear_layers(model), strict=True)]
                self.row_layers = RowLayers.build(model, linears, self.cache,
                                                  self.bias if self.beta else None, quant=False)

    def prefill(self) -> Tensor:
        """Run the prompt through the model (filling the caches); logits (R, V).

        A padded batch without gradients runs its real tokens only (``prefill_rows``); else
        (or when a layer has hooks, which calling ``forward_rows`` would bypass)
        ``GPT.hidden_states`` on the whole (R, N) batch."""
        if (self.keep is not None and not torch.is_grad_enabled()
                and not any(has_hooks(layer) for layer in self.model.layers)):
            h = prefill_rows(self.model, self.ids, self.keep, self.cache)  # (R, C)
        else:
            h, _ = self.model.hidden_states(self.ids, attention_mask=self.keep,
                                            cache=self.cache)
            h = h[:, -1]  # (R, C)
        if self.packed:
            return _fast_linear.onednn_op()(h.contiguous(), self.head, None, "none", [], "")
        return h @ self.head

    def step(self, tokens: Tensor) -> Tensor:
        """Feed tokens (R,) at the next position; logits (R, V)."""
        if self.packed:
            return self._step_packed(tokens)
        if self.row_layers is not None:
            return self._step_row(tokens)
        t = self.length  # cache slot of the new token
        self.length = s = t + 1
        rows, hk, g, d = self.rows, self.kv_heads, self.group, self.head_dim
        x, rope_pos = self._embed(tokens, t)  # (R, C)
        bias = self.bias if self.beta == 0.0 else self.bias[:, :, :s]  # (R·Hkv, 1, S)
        width, beta, scale, act = self.width, self.beta, self.scale, self.act
        layer_norm, addmm, mm, baddbmm, bmm = (torch.layer_norm, torch.addmm, torch.mm,
                                               torch.baddbmm, torch.bmm)
        softmax = torch._softmax
        kernel = self.attn_kernel
        if kernel is not None:
            a, scratch, cap = self.attn_out, self.attn_scratch.data_ptr(), self.capacity
            bias_ptr = self.bias.data_ptr() if beta else None
        for (w1, b1, e1, w_in, b_in, w_out, b_out, w2, b2, e2, w_fc, b_fc, w_proj, b_proj,
             proj, q, k4, k, v, q3, kslots, vslots, keys_t, values) in self.layers:
            h = layer_norm(x, width, w1, b1, e1)
            if b_in is None:
                mm(h, w_in, out=proj)  # (R, (H + 2·Hkv)·D)
            else:
                addmm(b_in, h, w_in, out=proj)
            if rope_pos is not None:
                q3 = self.rope.rotate(q, rope_pos).reshape(
                    rows * hk, g, d).contiguous()  # (R·Hkv, g, D)
                k = self.rope.rotate(k4, rope_pos).view(rows, hk, d)  # (R, Hkv, D)
            elif q3 is None:
                q3 = q.reshape(rows * hk, g, d)  # (R·Hkv, g, D)
            kslots[t].copy_(k)
            vslots[t].copy_(v)
            if kernel is not None:  # q rows in proj, or rotated (R·Hkv, g, D) contiguous
                kernel(q3.data_ptr() if rope_pos is not None else proj.data_ptr(),
                       hk * g * d if rope_pos is not None else proj.stride(0),
                       keys_t.data_ptr(), values.data_ptr(), cap * d, rows * hk, hk, g, s, d,
                       bias_ptr, cap, scale, a.data_ptr(), scratch)  # a: (R, H·D)
            else:
                scores = baddbmm(bias, q3, keys_t[:, :, :s], beta=beta,
                                 alpha=scale)  # (R·Hkv, g, S)
                a = bmm(softmax(scores, -1, False), values[:, :s])  # (R·Hkv, g, D)
                a = a.view(rows, hk * g * d)  # (R, H·D)
            x = (mm(a, w_out) if b_out is None else addmm(b_out, a, w_out)).add_(x)
            h = layer_norm(x, width, w2, b2, e2)
            h = act(mm(h, w_fc) if b_fc is None else addmm(b_fc, h, w_fc))
            x = (mm(h, w_proj) if b_proj is None else addmm(b_proj, h, w_proj)).add_(x)
        return mm(layer_norm(x, width, *self.norm), self.head)  # (R, V)

    def _embed(self, tokens: Tensor, t: int) -> tuple[Tensor, Tensor | None]:
        """The input rows x (R, C) of tokens (R,) at cache slot t, and the RoPE positions
        ((1,) or (R, 1); None without RoPE)."""
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
        return x, rope_pos

    def _step_row(self, tokens: Tensor) -> Tensor:
        """``step`` for one fp32 row on one thread: each layer one call of the C layer kernel
        (``RowLayers``: the same math, in place on the residual row), then the final norm and
        the LM head (``gemv_kernel``); logits (1, V)."""
        t = self.length  # cache slot of the new token
        if t >= self.capacity:  # the C kernel would write past the cache
            raise IndexError(f"FastGPTStepper: the caches hold {self.capacity} positions "
                             f"(prompt + max_new_tokens); step {t + 1} is one too many")
        self.length = t + 1
        x, rope_pos = self._embed(tokens, t)  # (1, C), a fresh row: updated in place
        self.row_layers(x, t, rope_pos)
        h = torch.layer_norm(x, self.width, *self.norm)  # (1, C)
        logits = torch.empty(1, self.head.shape[1], dtype=x.dtype, device=x.device)  # (1, V)
        self.row_gemv(h.data_ptr(), self.head.data_ptr(), None, None, logits.data_ptr(),
                      *self.head.shape)
        return logits

    def _step_packed(self, tokens: Tensor) -> Tensor:
        """``step`` for R >= MIN_ROWS rows: the same math, the linear layers through oneDNN's
        matmul on packed weights (``_linear_pointwise``: bias, activation and residual add
        fused); logits (R, V)."""
        t = self.length  # cache slot of the new token
        self.length = s = t + 1
        rows, hk, g, d, h_all = self.rows, self.kv_heads, self.group, self.head_dim, self.heads
        x, rope_pos = self._embed(tokens, t)
        bias = self.bias if self.beta == 0.0 else self.bias[:, :, :s]  # (R·Hkv, 1, S)
        width, beta, scale = self.width, self.beta, self.scale
        hd, kvd = h_all * d, hk * d
        attr, algo = self.fused_act
        act = None if attr != "none" else self.act
        linear, linear_add = _fast_linear.onednn_op(), torch.ops.mkldnn._linear_pointwise.binary
        kernel = self.attn_kernel
        if kernel is not None:
            a, scratch, cap = self.attn_out, self.attn_scratch.data_ptr(), self.capacity
            bias_ptr = self.bias.data_ptr() if beta else None
        layer_norm, baddbmm, bmm, softmax = (torch.layer_norm, torch.baddbmm, torch.bmm,
                                             torch._softmax)
        for (w1, b1, e1, w_in, b_in, w_out, b_out, w2, b2, e2, w_fc, b_fc, w_proj, b_proj,
             _, _, _, _, _, _, kslots, vslots, keys_t, values) in self.layers:
            proj = linear(layer_norm(x, width, w1, b1, e1), w_in, b_in, "none", [],
                          "")  # (R, (H + 2·Hkv)·D)
            if rope_pos is not None:
                q = self.rope.rotate(proj[:, :hd].view(rows, h_all, 1, d),
                                     rope_pos).contiguous()  # (R, H, 1, D)
                k = self.rope.rotate(proj[:, hd:hd + kvd].view(rows, hk, 1, d),
                                     rope_pos).view(rows, hk, d)  # (R, Hkv, D)
            else:
                q = proj[:, :hd]
                k = proj[:, hd:hd + kvd].view(rows, hk, d)  # (R, Hkv, D)
            kslots[t].copy_(k)
            vslots[t].copy_(proj[:, hd + kvd:].view(rows, hk, d))
            if kernel is not None:  # q (R, ·) rows: in proj, or rotated (R, H, 1, D)
                kernel(q.data_ptr(), q.stride(0), keys_t.data_ptr(), values.data_ptr(),
                       cap * d, rows * hk, hk, g, s, d, bias_ptr, cap, scale, a.data_ptr(),
                       scratch)  # a: (R, H·D)
            else:
                scores = baddbmm(bias, q.reshape(rows * hk, g, d), keys_t[:, :, :s],
                                 beta=beta, alpha=scale)  # (R·Hkv, g, S)
                a = bmm(softmax(scores, -1, False), values[:, :s])  # (R·Hkv, g, D)
            x = linear_add(a.view(rows, hd), x, w_out, b_out, "add")  # (R, C)
            h = linear(layer_norm(x, width, w2, b2, e2), w_fc, b_fc, attr, [], algo)  # (R, F)
            if act is not None:
                h = act(h)
            x = linear_add(h, x, w_proj, b_proj, "add")  # (R, C)
        return linear(layer_norm(x, width, *self.norm), self.head, None, "none", [],
                      "")  # (R, V)

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
