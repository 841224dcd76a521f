"""An optional C kernel for the decode engine's C layer backends (``c-layer-fp32`` at one
row, ``c-layer-int8`` at any number of rows; ``generation/c_layer.py``): a whole pre-norm
layer in one call — norm, the fused q/k/v projection, RoPE, the new key/value into the cache
slot, attention over the cache, out-projection + residual, norm, feed-forward (plain or
gated) with its activation, + residual.

Shapes: R rows, C width, H heads, Hkv key/value heads, g = H / Hkv, D head dim,
P = (H + 2·Hkv)·D, F feed-forward width, cap the cache's capacity, S = t + 1 keys.

At one row a decode step is bound by reading every weight once; this kernel runs everything
around the products in C (the products ``gemv_kernel``'s for fp32 weights, ``int8_kernel``'s
for int8 ones; their files and ``attention_kernel``'s are linked into one library with it),
so Python calls it once per layer (what that saves: BENCHMARKS.md, "Inference at the
machine's limit"). Each row is computed on its own (norms, int8 activation scale,
attention): a row gives the same numbers alone as in a batch.

The math is the modules': ``LayerNorm`` ((x - mean) / sqrt(var + eps) · w + b, biased
variance, two passes, double accumulators) or ``RMSNorm`` (x / sqrt(mean(x²) + eps) · w, a
double accumulator), the products in their kernels' order, attention as
``attention_kernel``, RoPE's rotation (both pair layouts) with ``RoPE.cos_sin``'s angles,
the activations by their formulas and codes in ``qkv.modules.activations`` (``relu``;
``gelu``: 0.5·x·(1 + erf(x/√2)); ``gelu_tanh``: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)));
``silu``: x / (1 + exp(-x)); ``quick_gelu``: x / (1 + exp(-1.702·x))), a gated FFN as
act(gate)·up — another rounding order than torch's vectorised ops, |diff| ~1e-7 relative
(fp32).

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

from ..modules.activations import ACTIVATION_TABLE
from ..modules.cache import KVCache
from . import attention_kernel, kernel_registry
from .plan import DecodePlan

__all__ = ["RowLayers", "disabled", "load"]

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
    def build(cls, plan: DecodePlan, linears: list[Linear], cache: list[KVCache],
              bias: Tensor | None, *, quant: bool | None = None) -> RowLayers | None:
        """The layers of ``plan`` (fp32 embeddings) on contiguous caches of R rows (fp32
        weights: R must be 1): LayerNorm or RMSNorm, the plain or gated (act(gate)·up)
        feed-forward, the plan's activation by its C code
        (``qkv.modules.activations.ACTIVATION_TABLE``).

        Args:
            linears: 4 per layer (qkv, out, ffn_in, ffn_out): fp32 (in, out) weights with no
                scale (``quant`` False), or int8 (out, in) weights with their scale / 127
                (``quant`` True; ``QuantizedLinear``'s).
            bias: the (R·Hkv, 1, cap) additive key bias (-inf at padded prompt positions),
                contiguous, or None.
            quant: the weights' form; default ``plan.int8``.

        Returns None when the activation has no C form or the kernel cannot be loaded.
        Raises ``TypeError`` (a wrong dtype, a tensor not on the CPU) or ``ValueError`` (a
        non-contiguous cache or key bias, a tensor with fewer elements than the layer
        needs, int8 weights without their scales), naming the layer and the field: every
        pointer is checked against ``kernel_registry.ROW_LAYER`` (read-only tensors are
        made contiguous copies first; the caches and the bias are written or read in place,
        never copied)."""
        quant = plan.int8 if quant is None else quant
        fn = load()
        rows = cache[0].keys.shape[0]
        code = ACTIVATION_TABLE[plan.activation].c_code
        if (fn is None or attention_kernel.disabled() or code is None
                or (rows != 1 and not quant) or plan.group > attention_kernel.MAX_GROUP):
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

        d, heads, kv_heads, width, ffn = (plan.head_dim, plan.heads, plan.kv_heads,
                                          plan.width, plan.ffn)
        fc_width = 2 * ffn if plan.gated else ffn
        cap = cache[0].keys.shape[2]
        work = written(torch.empty(_work_floats(rows, width, heads, kv_heads, d, fc_width, cap),
                                   dtype=torch.float32))
        widest = max(width, heads * d, fc_width, (heads + 2 * kv_heads) * d)
        xq = written(torch.empty(rows * widest, dtype=torch.int8))
        acc = written(torch.empty(rows * widest, dtype=torch.int32))
        amax = written(torch.empty(rows, dtype=torch.float32))
        layers = []
        for i, (lp, kc) in enumerate(zip(plan.layers, cache, strict=True)):
            (w_in, s_in, b_in), (w_out, s_out, b_out), (w_fc, s_fc, b_fc), (
                w_proj, s_proj, b_proj) = linears[4 * i:4 * i + 4]
            n1, n2 = lp.norm1, lp.norm2
            # every pointer checked against kernel_registry.ROW_LAYER: dtype, CPU,
            # contiguous, element count (TypeError / ValueError naming the layer and field)
            layers.append(kernel_registry.make_struct(
                kernel_registry.ROW_LAYER, f"RowLayers: layer {i}",
                rows=rows, c=width, hkv=kv_heads, g=plan.group, d=d, f=ffn, cap=cap,
                act=code, quant=int(quant),
                interleaved=int(plan.rope is not None and plan.rope.interleaved),
                norm=int(plan.norm_kind == "rmsnorm"), gated=int(plan.gated),
                eps1=float(n1.eps), eps2=float(n2.eps), scale=1.0 / d ** 0.5,
                ln1_w=read(n1.weight), ln1_b=read(n1.bias), ln2_w=read(n2.weight),
                ln2_b=read(n2.bias), w_in=read(w_in), w_out=read(w_out), w_fc=read(w_fc),
                w_proj=read(w_proj), s_in=read(s_in), s_out=read(s_out), s_fc=read(s_fc),
                s_proj=read(s_proj), b_in=read(b_in), b_out=read(b_out), b_fc=read(b_fc),
                b_proj=read(b_proj), keys=written(kc.keys), values=written(kc.values),
                bias=written(bias), work=work, xq=xq, acc=acc, amax=amax))
        return cls(fn, layers, rows, plan.rope, keep)

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
