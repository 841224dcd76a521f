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
sources and ``attention_kernel``'s are compiled together with it), so Python calls it once
per layer. Each row is computed on its own (norms, int8 activation scale, attention): a row
gives the same numbers alone as in a batch.

The math is the modules': ``LayerNorm`` ((x - mean) / sqrt(var + eps) · w + b, biased
variance, two passes, double accumulators), the products in their kernels' order, attention
as ``attention_kernel``, RoPE's rotation (both pair layouts) with ``RoPE.cos_sin``'s angles,
the activations by their formulas (``relu``; ``gelu``: 0.5·x·(1 + erf(x/√2)); ``gelu_tanh``:
0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))); ``silu``: x / (1 + exp(-x)); ``quick_gelu``:
x / (1 + exp(-1.702·x))) — another rounding order than torch's vectorised ops, |diff| ~1e-7
relative (fp32). Compiled on first use (``cc -O3 -march=native``, cached; ``c_kernels``),
loaded with ``ctypes``; any failure leaves ``load()`` None and the steps on torch's ops.
``QKV_ROW_KERNEL=0`` turns it off. fp32 activations; single-threaded.
"""

from __future__ import annotations

import ctypes
import threading

import torch
from torch import Tensor

from ..models.gpt import GPT
from ..modules.cache import KVCache
from . import attention_kernel, gemv_kernel, int8_kernel
from .c_kernels import env_off, load_function

__all__ = ["ACTIVATION_CODES", "RowLayers", "disabled", "load"]

ACTIVATION_CODES = {"relu": 0, "gelu": 1, "gelu_tanh": 2, "silu": 3, "quick_gelu": 4}
"""The feed-forward activations the kernel computes, by ``GPTConfig.activation`` name."""

_lock = threading.Lock()
_state: dict[str, object] = {}  # "fn": the loaded function or None once tried

_LAYER = r"""
static void layer_norm_row(const float *x, int64_t c, const float *w, const float *b,
                           float eps, float *y) {
    double sum = 0.0, sq = 0.0;
    for (int64_t i = 0; i < c; i++) sum += x[i];
    float mean = (float)(sum / (double)c);
    for (int64_t i = 0; i < c; i++) { double z = (double)x[i] - mean; sq += z * z; }
    float rstd = (float)(1.0 / sqrt(sq / (double)c + (double)eps));
    for (int64_t i = 0; i < c; i++) {
        float z = (x[i] - mean) * rstd;
        if (w) z *= w[i];
        if (b) z += b[i];
        y[i] = z;
    }
}

static void activate(float *f, int64_t n, int act) {
    for (int64_t i = 0; i < n; i++) {
        float x = f[i];
        switch (act) {
        case 0: f[i] = (x > 0.0f || x != x) ? x : 0.0f; break; /* NaN stays NaN, as torch.relu */
        case 1: f[i] = 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); break;
        case 2: f[i] = 0.5f * x * (1.0f + tanhf(0.79788456080286536f
                                               * (x + 0.044715f * x * x * x))); break;
        case 3: f[i] = x / (1.0f + expf(-x)); break;
        default: f[i] = x * (1.0f / (1.0f + expf(-1.702f * x))); break;
        }
    }
}

/* RoPE on heads rows of d floats at x: pair i is (i, i + d/2), or (2i, 2i + 1) when
   interleaved, rotated by the angle with cosine cs[i] and sine sn[i]. */
static void rotate_heads(float *x, int64_t heads, int64_t d, const float *cs, const float *sn,
                         int interleaved) {
    int64_t half = d / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *v = x + h * d;
        for (int64_t i = 0; i < half; i++) {
            int64_t ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + half;
            float a = v[ia], b = v[ib];
            v[ia] = a * cs[i] - b * sn[i];
            v[ib] = interleaved ? a * sn[i] + b * cs[i] : b * cs[i] + a * sn[i];
        }
    }
}

/* The fixed arguments of one layer (built once per layer by RowLayers). Weights: fp32
   (in, out) row-major when quant is 0; int8 (out, in) row-major with s_* the per-output
   scale / 127 (qkv_int8_linear's math) when quant is 1. Any bias, norm weight or scale
   pointer may be NULL where the layer has none. */
typedef struct {
    int64_t rows, c, hkv, g, d, f, cap, act, quant, interleaved;
    float eps1, eps2, scale;
    const float *ln1_w, *ln1_b, *ln2_w, *ln2_b;
    const void *w_in, *w_out, *w_fc, *w_proj;
    const float *s_in, *s_out, *s_fc, *s_proj;
    const float *b_in, *b_out, *b_fc, *b_proj;
    float *keys, *values;  /* the layer's cache (rows, hkv, cap, d) */
    const float *bias;     /* (rows * hkv, cap) additive key bias (-inf skips a key) or NULL */
    float *work;           /* rows * (c + p + h*d + f) + g*cap floats */
    int8_t *xq;            /* int8 only: rows * max(c, h*d, f) bytes */
    int32_t *acc;          /* int8 only: rows * max(p, c, f) */
    float *amax;           /* int8 only: rows */
} qkv_row_layer;

/* y (m, n) = res + b + x (m, k) @ W, rows independent of each other */
static void row_linear(const qkv_row_layer *L, const float *x, int64_t m, const void *w,
                       const float *s, const float *b, const float *res, float *y, int64_t k,
                       int64_t n) {
    if (L->quant)
        qkv_int8_linear(x, m, k, (const int8_t *)w, n, s, b, res, y, L->xq, L->acc, L->amax);
    else
        qkv_gemv(x, (const float *)w, b, res, y, k, n);
}

/* One pre-norm GPT layer for m rows x (m, c), in place: slot t of each row's cache gets its
   new key/value, attention over slots [0, t] (the bias masks a row's padded prompt
   positions). cs/sn: RoPE's cosines and sines (m, d/2) of each row's position, or NULL
   without RoPE. fp32 weights: m must be 1 (products through qkv_gemv). */
int qkv_decode_layer(const qkv_row_layer *L, float *x, int64_t m, int64_t t, const float *cs,
                     const float *sn) {
    int64_t c = L->c, hkv = L->hkv, d = L->d, cap = L->cap, f = L->f;
    int64_t hd = hkv * L->g * d, p = hd + 2 * hkv * d;
    float *h = L->work, *proj = h + m * c, *a = proj + m * p, *ff = a + m * hd;
    float *scratch = ff + m * f;
    if (t < 0 || t >= cap || m < 1 || m > L->rows || (!L->quant && m != 1)) return 2;
    for (int64_t r = 0; r < m; r++)
        layer_norm_row(x + r * c, c, L->ln1_w, L->ln1_b, L->eps1, h + r * c);
    row_linear(L, h, m, L->w_in, L->s_in, L->b_in, NULL, proj, c, p);
    for (int64_t r = 0; r < m; r++) {
        float *pr = proj + r * p;
        if (cs)  /* q heads, then k heads */
            rotate_heads(pr, hkv * L->g + hkv, d, cs + r * (d / 2), sn + r * (d / 2),
                         (int)L->interleaved);
        for (int64_t j = 0; j < hkv; j++)
            for (int64_t e = 0; e < d; e++) {
                int64_t at = ((r * hkv + j) * cap + t) * d + e;
                L->keys[at] = pr[hd + j * d + e];
                L->values[at] = pr[hd + hkv * d + j * d + e];
            }
    }
    int rc = qkv_decode_attention(proj, p, L->keys, L->values, cap * d, m * hkv, hkv, L->g,
                                  t + 1, d, L->bias, cap, L->scale, a, scratch);
    if (rc) return rc;
    row_linear(L, a, m, L->w_out, L->s_out, L->b_out, x, x, hd, c);
    for (int64_t r = 0; r < m; r++)
        layer_norm_row(x + r * c, c, L->ln2_w, L->ln2_b, L->eps2, h + r * c);
    row_linear(L, h, m, L->w_fc, L->s_fc, L->b_fc, NULL, ff, c, f);
    activate(ff, m * f, (int)L->act);
    row_linear(L, ff, m, L->w_proj, L->s_proj, L->b_proj, x, x, f, c);
    return 0;
}
"""

SOURCE = gemv_kernel.SOURCE + attention_kernel.SOURCE + int8_kernel.SOURCE + _LAYER


class _Layer(ctypes.Structure):
    """``qkv_row_layer`` of the C source, field for field."""

    _fields_ = ([(n, ctypes.c_int64) for n in
                 ("rows", "c", "hkv", "g", "d", "f", "cap", "act", "quant", "interleaved")]
                + [(n, ctypes.c_float) for n in ("eps1", "eps2", "scale")]
                + [(n, ctypes.c_void_p) for n in
                   ("ln1_w", "ln1_b", "ln2_w", "ln2_b", "w_in", "w_out", "w_fc", "w_proj",
                    "s_in", "s_out", "s_fc", "s_proj", "b_in", "b_out", "b_fc", "b_proj",
                    "keys", "values", "bias", "work", "xq", "acc", "amax")])


def _work_floats(rows: int, width: int, heads: int, kv_heads: int, head_dim: int, ffn: int,
                capacity: int) -> int:
    """Floats of the ``work`` buffer ``qkv_decode_layer`` needs for ``rows`` rows."""
    hd = heads * head_dim
    return (rows * (width + hd + 2 * kv_heads * head_dim + hd + ffn)
            + (heads // kv_heads) * capacity)


def disabled() -> bool:
    """True when ``QKV_ROW_KERNEL=0`` (or "false"/"off"/"no") turns the kernel off."""
    return env_off("QKV_ROW_KERNEL")


def load():
    """The C function ``qkv_decode_layer(layer, x, m, t, cos, sin)`` (ctypes; the layer a
    pointer to its fixed arguments, see the source), or None when the kernel is turned off or
    cannot be built or loaded here. Built once per process."""
    if disabled():
        return None
    with _lock:
        if "fn" not in _state:
            p = ctypes.c_void_p
            _state["fn"] = load_function(SOURCE, "decode-layer", "qkv_decode_layer",
                                         [p, p, ctypes.c_int64, ctypes.c_int64, p, p])
        return _state["fn"]


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

        Returns None when the activation has no C form or the kernel cannot be loaded."""
        c = model.config
        fn = load()
        rows = cache[0].keys.shape[0]
        heads, kv_heads = c.num_heads, c.num_kv_heads or c.num_heads
        if (fn is None or attention_kernel.disabled() or c.activation not in ACTIVATION_CODES
                or (rows != 1 and not quant)
                or heads // kv_heads > attention_kernel.MAX_GROUP):
            return None
        keep: list[Tensor] = []
        weight_dtype = torch.int8 if quant else torch.float32

        def ptr(t: Tensor | None, dtype: torch.dtype = torch.float32) -> int | None:
            if t is None:
                return None
            if t.dtype != dtype or t.device.type != "cpu":  # the C code reads raw memory
                raise TypeError(f"RowLayers: expected a {dtype} CPU tensor, got {t.dtype} on "
                                f"{t.device}")
            t = t.detach().contiguous()
            keep.append(t)
            return t.data_ptr()

        def buffer(t: Tensor | None) -> int | None:  # written by the kernel: never a copy
            if t is not None and not t.is_contiguous():
                raise ValueError("RowLayers: caches and the key bias must be contiguous")
            return ptr(t)

        d = c.head_dim
        cap = cache[0].keys.shape[2]
        ffn = model.layers[0].ffn.fc_in.out_features
        work = torch.empty(_work_floats(rows, c.dim, heads, kv_heads, d, ffn, cap),
                           dtype=torch.float32)
        widest = max(c.dim, heads * d, ffn, (heads + 2 * kv_heads) * d)
        xq = torch.empty(rows * widest, dtype=torch.int8)
        acc = torch.empty(rows * widest, dtype=torch.int32)
        amax = torch.empty(rows, dtype=torch.float32)
        layers = []
        for i, (layer, kc) in enumerate(zip(model.layers, cache, strict=True)):
            (w_in, s_in, b_in), (w_out, s_out, b_out), (w_fc, s_fc, b_fc), (
                w_proj, s_proj, b_proj) = linears[4 * i:4 * i + 4]
            n1, n2 = layer.norm1, layer.norm2
            layers.append(_Layer(
                rows=rows, c=c.dim, hkv=kv_heads, g=heads // kv_heads, d=d, f=ffn, cap=cap,
                act=ACTIVATION_CODES[c.activation], quant=int(quant),
                interleaved=int(model.rope is not None and model.rope.interleaved),
                eps1=n1.eps, eps2=n2.eps, scale=1.0 / d ** 0.5,
                ln1_w=ptr(n1.weight), ln1_b=ptr(n1.bias), ln2_w=ptr(n2.weight),
                ln2_b=ptr(n2.bias), w_in=ptr(w_in, weight_dtype),
                w_out=ptr(w_out, weight_dtype), w_fc=ptr(w_fc, weight_dtype),
                w_proj=ptr(w_proj, weight_dtype), s_in=ptr(s_in), s_out=ptr(s_out), s_fc=ptr(s_fc),
                s_proj=ptr(s_proj), b_in=ptr(b_in), b_out=ptr(b_out), b_fc=ptr(b_fc),
                b_proj=ptr(b_proj), keys=buffer(kc.keys), values=buffer(kc.values),
                bias=buffer(bias), work=ptr(work), xq=ptr(xq, torch.int8),
                acc=ptr(acc, torch.int32), amax=ptr(amax)))
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
