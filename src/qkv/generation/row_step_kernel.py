"""An optional C kernel for the lean decode steps (``fast_gpt`` at one fp32 row, ``fast_int8``
at any number of rows): a whole pre-norm GPT layer in one call — layer norm, the fused q/k/v
projection, RoPE, the new key/value into the cache slot, attention over the cache,
out-projection + residual, layer norm, feed-forward with its activation, + residual.

Shapes: R rows, C width, H heads, Hkv key/value heads, g = H / Hkv, D head dim,
P = (H + 2·Hkv)·D, F feed-forward width, cap the cache's capacity, S = t + 1 keys.

At one row a decode step is bound by reading every weight once, and what torch's ops add
around the products (~13 layer norms, 12 cache copies, 6 activations and their Python
dispatch) was ~0.6 ms of a ~4.2 ms fp32 token here. This kernel runs all of it in C around
the products (``gemv_kernel``'s for fp32 weights, ``int8_kernel``'s for int8 ones; their
files and ``attention_kernel``'s are linked into one library with it), so Python calls it once
per layer. Each row is computed on its own (norms, int8 activation scale, attention): a row
gives the same numbers alone as in a batch.

The math is the modules': ``LayerNorm`` ((x - mean) / sqrt(var + eps) · w + b, biased
variance, two passes, double accumulators), the products in their kernels' order, attention
as ``attention_kernel``, RoPE's rotation (both pair layouts) with ``RoPE.cos_sin``'s angles,
the activations by their formulas (``relu``; ``gelu``: 0.5·x·(1 + erf(x/√2)); ``gelu_tanh``:
0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))); ``silu``: x / (1 + exp(-x)); ``quick_gelu``:
x / (1 + exp(-1.702·x))) — another rounding order than torch's vectorised ops, |diff| ~1e-7
relative (fp32).

The C code is ``kernels/decode_layer.c`` with the ``qkv_row_layer`` struct of
``kernels/qkv_kernels.h``, declared in ``kernel_registry`` (the ``"decode_layer"`` kernel and
``ROW_LAYER``, the struct's fields: dtype and element count of every pointer). ``RowLayers.build``
fills each layer's struct through ``kernel_registry.make_struct`` (every pointer checked once,
at build); the per-token ``RowLayers.__call__`` then calls the raw function (x checked
there). Compiled on first use (``cc -O3 -march=native -Wall -Werror``, cached;
``c_kernels``), loaded with ``ctypes``; any failure leaves ``load()`` None and the steps on
torch's ops. ``QKV_ROW_KERNEL=0`` turns it off. fp32 activations; single-threaded.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from ..models.gpt import GPT
from ..modules.cache import KVCache
from . import attention_kernel, kernel_registry

__all__ = ["ACTIVATION_CODES", "RowLayers", "disabled", "load"]

ACTIVATION_CODES = {"relu": 0, "gelu": 1, "gelu_tanh": 2, "silu": 3, "quick_gelu": 4}
"""The feed-forward activations the kernel computes, by ``GPTConfig.activation`` name."""

_Layer = kernel_registry.ROW_LAYER.ctype
"""``qkv_row_layer`` of ``kernels/qkv_kernels.h``, field for field (a ``ctypes.Structure``
made from ``kernel_registry.ROW_LAYER``)."""


def _work_floats(rows: int, width: int, heads: int, kv_heads: int, head_dim: int, ffn: int,
                capacity: int) -> int:
    """Floats of the ``work`` buffer ``qkv_decode_layer`` needs for ``rows`` rows."""
    hd = heads * head_dim
    return (rows * (width + hd + 2 * kv_heads * head_dim + hd + ffn)
            + (heads // kv_heads) * capacity)


def disabled() -> bool:
    """True when ``QKV_ROW_KERNEL=0`` (or "false"/"off"/"no") turns the kernel off."""
    return kernel_registry.disabled("decode_layer")


def load():
    """The raw C function ``qkv_decode_layer(layer, x, m, t, cos, sin)`` (ctypes; the layer a
    pointer to its ``qkv_row_layer``, int pointers, nothing checked; see
    ``kernels/decode_layer.c``), or None when the kernel is turned off or cannot be built or
    loaded here. Built once per process."""
    return kernel_registry.load("decode_layer")


Linear = tuple  # (weight, scale / 127 or None, bias or None) of one projection


class RowLayers:
    """The layers of a GPT for R rows (fp32 weights: one row; int8: any), each one call of
    ``qkv_decode_layer``: the fixed arguments (pointers into the weights, norms, caches and
    buffers, kept alive here) made once, the slot and RoPE angles per call. Every row is
    computed on its own (its own norms, int8 activation scale and attention): a row gives
    the same numbers alone as in a batch.

    Build with ``RowLayers.build``; call ``layers(x, t, rope_pos)`` with the embedded rows x
    (R, C) (updated in place: the residual stream after the last layer), the cache slot t
    and RoPE's positions ((1,) for every row, or (R, 1) int; None without RoPE).
    """

    def __init__(self, fn, layers: list[_Layer], rows: int, rope, keep: list[Tensor]) -> None:
        self.fn, self.layers, self.rows, self.rope, self._keep = fn, layers, rows, rope, keep
        self._addresses = [ctypes.addressof(la) for la in layers]

    @classmethod
    def build(cls, model: GPT, linears: list[Linear], cache: list[KVCache],
              bias: Tensor | None, *, quant: bool) -> RowLayers | None:
        """The layers of ``model`` (a ``fast_gpt.plain_gpt`` with fp32 embeddings) on
        contiguous caches of R rows (``quant=False``: R must be 1).

        Args:
            linears: 4 per layer (in_proj, out_proj, fc_in, fc_out): fp32 (in, out) weights
                with no scale (``quant=False``; ``fast_gpt.transposed_weights``), or int8
                (out, in) weights with their scale / 127 (``quant=True``; ``QuantizedLinear``).
            bias: the (R·Hkv, 1, cap) additive key bias (-inf at padded prompt positions),
                contiguous, or None.

        Returns None when the activation has no C form or the kernel cannot be loaded.
        Raises ``TypeError`` (a wrong dtype, a tensor not on the CPU) or ``ValueError`` (a
        non-contiguous cache or key bias, a tensor with fewer elements than the layer
        needs, int8 weights without their scales), naming the layer and the field: every
        pointer is checked against ``kernel_registry.ROW_LAYER`` (read-only tensors are
        made contiguous copies first; the caches and the bias are written or read in place,
        never copied)."""
        c = model.config
        fn = load()
        rows = cache[0].keys.shape[0]
        heads, kv_heads = c.num_heads, c.num_kv_heads or c.num_heads
        if (fn is None or attention_kernel.disabled() or c.activation not in ACTIVATION_CODES
                or (rows != 1 and not quant)
                or heads // kv_heads > attention_kernel.MAX_GROUP):
            return None
        keep: list[Tensor] = []

        def read(t: Tensor | None) -> Tensor | None:  # read by the kernel: a dense copy is fine
            if t is None:
                return None
            t = t.detach().contiguous()
            keep.append(t)
            return t

        def written(t: Tensor | None) -> Tensor | None:  # written by it: never a copy
            if t is not None:
                keep.append(t)
            return t

        d = c.head_dim
        cap = cache[0].keys.shape[2]
        ffn = model.layers[0].ffn.fc_in.out_features
        work = written(torch.empty(_work_floats(rows, c.dim, heads, kv_heads, d, ffn, cap),
                                   dtype=torch.float32))
        widest = max(c.dim, heads * d, ffn, (heads + 2 * kv_heads) * d)
        xq = written(torch.empty(rows * widest, dtype=torch.int8))
        acc = written(torch.empty(rows * widest, dtype=torch.int32))
        amax = written(torch.empty(rows, dtype=torch.float32))
        layers = []
        for i, (layer, kc) in enumerate(zip(model.layers, cache, strict=True)):
            (w_in, s_in, b_in), (w_out, s_out, b_out), (w_fc, s_fc, b_fc), (
                w_proj, s_proj, b_proj) = linears[4 * i:4 * i + 4]
            n1, n2 = layer.norm1, layer.norm2
            # every pointer checked against kernel_registry.ROW_LAYER: dtype, CPU,
            # contiguous, element count (TypeError / ValueError naming the layer and field)
            layers.append(kernel_registry.make_struct(
                kernel_registry.ROW_LAYER, f"RowLayers: layer {i}",
                rows=rows, c=c.dim, hkv=kv_heads, g=heads // kv_heads, d=d, f=ffn, cap=cap,
                act=ACTIVATION_CODES[c.activation], quant=int(quant),
                interleaved=int(model.rope is not None and model.rope.interleaved),
                eps1=float(n1.eps), eps2=float(n2.eps), scale=1.0 / d ** 0.5,
                ln1_w=read(n1.weight), ln1_b=read(n1.bias), ln2_w=read(n2.weight),
                ln2_b=read(n2.bias), w_in=read(w_in), w_out=read(w_out), w_fc=read(w_fc),
                w_proj=read(w_proj), s_in=read(s_in), s_out=read(s_out), s_fc=read(s_fc),
                s_proj=read(s_proj), b_in=read(b_in), b_out=read(b_out), b_fc=read(b_fc),
                b_proj=read(b_proj), keys=written(kc.keys), values=written(kc.values),
                bias=written(bias), work=work, xq=xq, acc=acc, amax=amax))
        return cls(fn, layers, rows, model.rope, keep)

    def __call__(self, x: Tensor, t: int, rope_pos: Tensor | None) -> None:
        """Run every layer on the rows x (R, C) fp32 contiguous, in place, writing cache slot
        t (< the caches' capacity)."""
        m = x.shape[0]
        if m != self.rows or not x.is_contiguous() or x.dtype != torch.float32:
            raise ValueError(f"RowLayers: x must be ({self.rows}, C) fp32 contiguous, got "
                             f"{tuple(x.shape)} {x.dtype}")
        cs = sn = None
        if rope_pos is not None:  # each row's cosines and sines (R, D/2), every layer
            pos = rope_pos.reshape(-1).expand(m)  # (R,)
            cos, sin = self.rope.cos_sin(pos, x.dtype)  # (R, D/2) each, contiguous
            cs, sn = cos.data_ptr(), sin.data_ptr()
        xp, fn = x.data_ptr(), self.fn
        for layer in self._addresses:
            if fn(layer, xp, m, t, cs, sn):
                raise RuntimeError(f"row_step_kernel: the layer call failed (slot {t})")
