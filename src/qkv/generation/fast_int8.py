"""A lean single-token decode step for a ``qkv.models.GPT`` quantized with
``qkv.quantize(model, "int8")``: the int8 math of ``QuantizedLinear`` (``int8_linear``) and
the rest of ``GPT.forward`` with a cache, without per-call validation and module dispatch.

Shapes: R rows, N prompt length, L tokens in the cache, C width, H heads, Hkv kv heads,
D head dim, F feed-forward width, V vocab size.

At batch 1 a decode step streams every weight once; int8 weights are 4× fewer bytes and
``torch._int_mm`` reads them several times faster than fp32 GEMM reads fp32 ones, so what is
left is the per-op dispatch: each int8 layer is 5 kernels (row max, fused scale-and-round,
int8 copy, ``_int_mm``, fused dequantize + bias) and this step calls them directly. The
weights are used as stored (``weight_int8.t()`` is a view ``_int_mm`` reads as it is): no
copies are kept.

With the C kernels (the default where they build) each layer of a step is one call of
``row_step_kernel`` for all rows: the int8 products (``int8_kernel``), the layer norms, RoPE,
the cache writes and attention in C, ~1.3 ms a token here for the 6-layer, 384-wide GPT
against ~1.7 ms with one C call per int8 layer and torch's ops between. The norms and
attention round in another order than torch's, so the logits agree with the torch-ops step
to fp32 rounding — except where that moved an activation across an int8 rounding boundary
(one quantization step, rare). Every row is quantized and computed on its own, so each row
of a batch (beams, several prompts) decodes as it would alone; the tokens equal greedy
decoding with the quantized model's uncached forward. ``eligible`` says when this step
computes what ``GPT.forward`` would (plain GPT parts, every projection and the LM head a
``QuantizedLinear``, no active dropout).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..models.gpt import GPT
from ..modules.cache import KVCache
from ..modules.feedforward import ACTIVATIONS
from ..modules.quantized import QuantizedLinear, int8_linear, scale127
from . import int8_kernel
from .fast_gpt import linear_layers, plain_gpt
from .row_step_kernel import RowLayers

__all__ = ["Int8GPTStepper", "eligible"]

def eligible(model: object) -> bool:
    """True when ``model`` is a plain int8-quantized ``GPT`` whose step this module
    reproduces (``fast_gpt.plain_gpt`` with int8 projections and LM head)."""
    return (plain_gpt(model, linear=QuantizedLinear, dtypes=(torch.float32,))
            and type(model.lm_head) is QuantizedLinear)


def _parts(lin: QuantizedLinear) -> tuple[Tensor, Tensor, Tensor | None]:
    """(Wqᵀ (K, N) int8 view, s/127 (N,), bias (N,) or None) of an int8 layer."""
    return lin.weight_int8.t(), scale127(lin.weight_scale), lin.bias


class Int8GPTStepper:
    """Prefill with the model, then decode one token per row per ``step`` (int8 layers).

    Args:
        model: an ``eligible`` GPT.
        ids: (R, N) left-padded prompts.
        keep: (R, N) bool, True = real token, or None when nothing is padded.
        max_new_tokens: T; the caches hold N + T positions.
        kernel: the C kernels for ``step``: every layer one call of ``row_step_kernel``
            (its int8 products ``qkv.generation.int8_kernel``'s: quantize, int8 dot products
            and epilogue), the LM head one ``int8_kernel`` call: True (an error when they
            cannot be built here), False (the torch ops of ``int8_linear`` and the model's
            math), None (default: the kernels when they build and load, else the torch ops).
            True requires ``int8_kernel``; the layer kernel runs where it builds too (not
            under ``QKV_ROW_KERNEL=0`` or ``QKV_ATTN_KERNEL=0``, nor for more than
            ``attention_kernel.MAX_GROUP`` query heads per kv head), else each int8 layer is
            one ``int8_kernel`` call between torch's ops. The same math; the rounding of norms
            and attention differs (see above).
    """

    def __init__(self, model: GPT, ids: Tensor, keep: Tensor | None,
                 max_new_tokens: int, *, kernel: bool | None = None) -> None:
        if not eligible(model):
            raise TypeError("Int8GPTStepper: model must be a plain GPT quantized with "
                            "qkv.quantize(model, 'int8') (see fast_int8.eligible)")
        c = model.config
        self.model, self.ids, self.keep = model, ids, keep
        rows, n = ids.shape
        self.rows, self.length = rows, n
        self.heads, self.kv_heads = c.num_heads, c.num_kv_heads or c.num_heads
        self.head_dim = c.head_dim
        self.gqa = self.kv_heads != self.heads
        self.act = ACTIVATIONS[c.activation]
        self.layers = []
        for layer in model.layers:
            a, f = layer.attn, layer.ffn
            self.layers.append((
                layer.norm1.weight, layer.norm1.bias, layer.norm1.eps, *_parts(a.in_proj),
                *_parts(a.out_proj), layer.norm2.weight, layer.norm2.bias, layer.norm2.eps,
                *_parts(f.fc_in), *_parts(f.fc_out)))
        self.norm = (model.norm.weight, model.norm.bias, model.norm.eps)
        self.width = c.dim
        self.embed = model.embed.weight  # (V, C)
        self.head = _parts(model.lm_head)  # (C, V) int8 view, (V,), None
        self.pos_table = None if model.positions is None else model.positions.weight
        self.rope = model.rope
        self.cache = model.new_cache(rows, n + max_new_tokens)
        if not all(type(kc) is KVCache for kc in self.cache):
            raise TypeError("Int8GPTStepper: GPT.new_cache did not return KVCaches")
        self.mask = None
        self.real = None  # (R,) real prompt tokens per row: the next position, padded batch
        if keep is not None:
            self.mask = torch.ones(rows, 1, 1, n + max_new_tokens, dtype=torch.bool,
                                   device=ids.device)  # (R, 1, 1, S) for SDPA
            self.mask[:, 0, 0, :n] = keep
            self.real = keep.sum(dim=1)
        self.kernel = None
        if kernel is not False and ids.device.type == "cpu":
            self.kernel = int8_kernel.load()
        if kernel and self.kernel is None:
            raise RuntimeError("Int8GPTStepper: kernel=True but the fused int8 kernel cannot "
                               "be built or loaded here (a C compiler, Linux; QKV_INT8_KERNEL "
                               "not 0)")
        self.row_layers = self.row_bias = None
        if self.kernel is not None:
            # each layer one C call for all rows (``row_step_kernel``: int8 products, norms,
            # RoPE, cache writes and attention in C); else one int8_kernel call per layer
            self.row_layers = self._row_layers(model, keep, n + max_new_tokens)
            self._prepare_kernel(model, per_layer=self.row_layers is None)

    def _row_layers(self, model: GPT, keep: Tensor | None, capacity: int) -> RowLayers | None:
        """``RowLayers`` over the int8 weights as stored, with the additive key bias
        (R·Hkv, 1, S) of a padded batch (-inf at the pads) or None."""
        linears = [(lin.weight_int8, scale127(lin.weight_scale), lin.bias)
                   for lin in linear_layers(model)]
        self.row_bias = None
        if keep is not None:
            bias = torch.zeros(self.rows, self.kv_heads, 1, capacity,
                               dtype=torch.float32)  # (R, Hkv, 1, S)
            bias[:, :, 0, :keep.shape[1]] = torch.zeros((), dtype=torch.float32).masked_fill(
                ~keep[:, None, :], float("-inf"))
            self.row_bias = bias.view(self.rows * self.kv_heads, 1, capacity)
        return RowLayers.build(model, linears, self.cache, self.row_bias, quant=True)

    def _prepare_kernel(self, model: GPT, *, per_layer: bool) -> None:
        """Raw pointers of the LM head's tensors (and with ``per_layer`` every int8 layer's)
        and of preallocated outputs/scratch (the tensors are kept alive by this object)."""
        rows = self.rows
        self.keep_alive = []

        def ptr(t: Tensor | None) -> int | None:
            if t is None:
                return None
            t = t.contiguous()
            self.keep_alive.append(t)
            return t.data_ptr()

        def layer(lin: QuantizedLinear, out: Tensor | None) -> tuple:
            # (w, N, K, s/127, bias, out): out None = a new tensor each call
            return (ptr(lin.weight_int8), lin.out_features, lin.in_features,
                    ptr(scale127(lin.weight_scale)), ptr(lin.bias), out)

        widest_k = max(m.in_features for m in model.modules() if type(m) is QuantizedLinear)
        widest_n = max(m.out_features for m in model.modules() if type(m) is QuantizedLinear)
        self.xq = torch.empty(rows, widest_k, dtype=torch.int8)  # (R, K) scratch
        self.acc = torch.empty(rows, widest_n, dtype=torch.int32)  # (R, N) scratch
        self.amax = torch.empty(rows, dtype=torch.float32)  # (R,) scratch
        self.scratch = (self.xq.data_ptr(), self.acc.data_ptr(), self.amax.data_ptr())
        self.klayers = []
        for lyr in model.layers if per_layer else ():
            a, f = lyr.attn, lyr.ffn
            proj = torch.empty(rows, a.in_proj.out_features,
                               dtype=torch.float32)  # (R, (H + 2·Hkv)·D)
            hidden = torch.empty(rows, f.fc_in.out_features, dtype=torch.float32)  # (R, F)
            self.klayers.append((layer(a.in_proj, proj), layer(a.out_proj, None),
                                 layer(f.fc_in, hidden), layer(f.fc_out, None)))
        self.khead = layer(model.lm_head, None)

    def _linear(self, x: Tensor, spec: tuple, res: Tensor | None = None) -> Tensor:
        """One fused int8 layer: x (R, K) fp32 contiguous -> (R, N) (+ res, written in place
        into res when given)."""
        w, n, k, s, b, out = spec
        if res is not None:
            out = res  # the C loop reads res[j] before it writes y[j]: in place is exact
        elif out is None:
            out = torch.empty(x.shape[0], n, dtype=torch.float32)
        xq, acc, amax = self.scratch
        self.kernel(x.data_ptr(), x.shape[0], k, w, n, s, b,
                    None if res is None else res.data_ptr(), out.data_ptr(), xq, acc, amax)
        return out

    def prefill(self) -> Tensor:
        """Run the prompt through the model (filling the caches); logits (R, V)."""
        h, _ = self.model.hidden_states(self.ids, attention_mask=self.keep, cache=self.cache)
        return int8_linear(h[:, -1], *self.head)

    def step(self, tokens: Tensor) -> Tensor:
        """Feed tokens (R,) at the next position; logits (R, V)."""
        t = self.length  # cache slot of the new token
        self.length = s = t + 1
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
        if self.row_layers is not None:  # every layer one C call, in place on x
            x = x.contiguous()
            self.row_layers(x, t, rope_pos)
            return self._linear(F.layer_norm(x, width, *self.norm), self.khead)  # (1, V)
        if self.kernel is not None:
            return self._step_kernel(x.contiguous(), t, s, rope_pos, mask)
        for (w1, b1, e1, q_in, s_in, b_in, q_out, s_out, b_out, w2, b2, e2, q_fc, s_fc, b_fc,
             q_proj, s_proj, b_proj), cache in zip(self.layers, self.cache, strict=True):
            h = F.layer_norm(x, width, w1, b1, e1)
            proj = int8_linear(h, q_in, s_in, b_in)  # (R, (H + 2·Hkv)·D)
            a = self._attend(proj, cache, t, s, rope_pos, mask)  # (R, H·D)
            x = int8_linear(a, q_out, s_out, b_out).add_(x)  # (R, C)
            h = F.layer_norm(x, width, w2, b2, e2)
            f = self.act(int8_linear(h, q_fc, s_fc, b_fc))  # (R, F)
            x = int8_linear(f, q_proj, s_proj, b_proj).add_(x)  # (R, C)
        return int8_linear(F.layer_norm(x, width, *self.norm), *self.head)  # (R, V)

    def _attend(self, proj: Tensor, cache, t: int, s: int, rope_pos: Tensor | None,
                mask: Tensor | None) -> Tensor:
        """One query per row: split the fused projection proj (R, (H + 2·Hkv)·D), rotate,
        write the new key/value into cache slot t, attend over the first s slots; (R, H·D)."""
        rows, hd = self.rows, self.heads * self.head_dim
        kvd = self.kv_heads * self.head_dim
        q = proj[:, :hd].view(rows, self.heads, 1, self.head_dim)  # (R, H, 1, D)
        k = proj[:, hd:hd + kvd].view(rows, self.kv_heads, 1, self.head_dim)  # (R, Hkv, 1, D)
        v = proj[:, hd + kvd:].view(rows, self.kv_heads, 1, self.head_dim)  # (R, Hkv, 1, D)
        if self.rope is not None:
            q, k = self.rope.rotate(q, rope_pos), self.rope.rotate(k, rope_pos)
        cache.keys[:, :, t:s] = k
        cache.values[:, :, t:s] = v
        a = F.scaled_dot_product_attention(
            q, cache.keys[:, :, :s], cache.values[:, :, :s], attn_mask=mask,
            enable_gqa=self.gqa)  # (R, H, 1, D)
        return a.reshape(rows, hd)  # (R, H·D)

    def _step_kernel(self, x: Tensor, t: int, s: int, rope_pos: Tensor | None,
                     mask: Tensor | None) -> Tensor:
        """``step``'s layers with the fused int8 kernel; x (R, C) the embedded tokens."""
        width = (self.width,)
        for (w1, b1, e1, *_a, w2, b2, e2, _f1, _f2, _f3, _p1, _p2, _p3), specs, cache in zip(
                self.layers, self.klayers, self.cache, strict=True):
            k_in, k_out, k_fc, k_proj = specs
            proj = self._linear(F.layer_norm(x, width, w1, b1, e1), k_in)  # (R, (H+2Hkv)·D)
            a = self._attend(proj, cache, t, s, rope_pos, mask)  # (R, H·D)
            x = self._linear(a.contiguous(), k_out, res=x)  # (R, C)
            f = self.act(self._linear(F.layer_norm(x, width, w2, b2, e2), k_fc))  # (R, F)
            x = self._linear(f.contiguous(), k_proj, res=x)  # (R, C)
        return self._linear(F.layer_norm(x, width, *self.norm), self.khead)  # (R, V)

    def reorder(self, idx: Tensor) -> None:
        """Row r continues from row ``idx[r]``."""
        n = self.length  # the step writes the buffers itself: index their filled part
        for kc in self.cache:
            kc.keys[:, :, :n] = kc.keys[:, :, :n].index_select(0, idx)
            kc.values[:, :, :n] = kc.values[:, :, :n].index_select(0, idx)
        if self.mask is not None:
            self.mask = self.mask.index_select(0, idx)
            self.real = self.real.index_select(0, idx)
        if self.row_bias is not None:  # in place: the C layers hold its pointer
            bias = self.row_bias.view(self.rows, self.kv_heads, -1)  # (R, Hkv, S)
            bias.copy_(bias.index_select(0, idx))
