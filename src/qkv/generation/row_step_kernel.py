"""An optional C kernel for the one-row fp32 decode step (``fast_gpt``): a whole pre-norm GPT
layer in one call — layer norm, the fused q/k/v projection, the new key/value into the cache
slot, attention over the cache, out-projection + residual, layer norm, feed-forward with its
activation, + residual.

Shapes: C width, H heads, Hkv key/value heads, g = H / Hkv, D head dim, P = (H + 2·Hkv)·D,
F feed-forward width, cap the cache's capacity, S = t + 1 keys.

At one row the step's weight reads are one call of ``gemv_kernel`` each; what remained was
~13 layer norms, 12 cache copies, 6 activations and their Python dispatch, ~0.6 ms of a
~4.2 ms token here. This kernel runs them in C between the GEMVs (``gemv_kernel``'s source
and ``attention_kernel``'s, compiled together with it), so Python calls it once per layer.

The math is the modules': ``LayerNorm`` ((x - mean) / sqrt(var + eps) · w + b, biased
variance, two passes), ``addmm``'s products in ``gemv_kernel``'s order, attention as
``attention_kernel``, the activations by their formulas (``relu``; ``gelu``:
0.5·x·(1 + erf(x/√2)); ``gelu_tanh``: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))); ``silu``:
x / (1 + exp(-x))) — another rounding order than torch's vectorised ones, |diff| ~1e-7
relative (fp32). Compiled on first use (``cc -O3 -march=native``, cached; ``c_kernels``),
loaded with ``ctypes``; any failure leaves ``load()`` None and the step on its per-op path.
``QKV_ROW_KERNEL=0`` turns it off. fp32 only; single-threaded.
"""

from __future__ import annotations

import ctypes
import threading

import torch
from torch import Tensor

from ..models.gpt import GPT
from ..modules.cache import KVCache
from . import attention_kernel, gemv_kernel
from .c_kernels import env_off, load_function

__all__ = ["ACTIVATION_CODES", "RowLayers", "disabled", "load", "work_floats"]

ACTIVATION_CODES = {"relu": 0, "gelu": 1, "gelu_tanh": 2, "silu": 3, "quick_gelu": 4}
"""The feed-forward activations the kernel computes, by ``GPTConfig.activation`` name."""

_lock = threading.Lock()
_state: dict[str, object] = {}  # "fn": the loaded function or None once tried

_LAYER = r"""
static void layer_norm_row(const float *x, int64_t c, const float *w, const float *b,
                           float eps, float *y) {
    float mean = 0.0f, var = 0.0f;
    for (int64_t i = 0; i < c; i++) mean += x[i];
    mean /= (float)c;
    for (int64_t i = 0; i < c; i++) { float z = x[i] - mean; var += z * z; }
    float rstd = 1.0f / sqrtf(var / (float)c + eps);
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
        case 0: f[i] = x > 0.0f ? x : 0.0f; break;
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

/* One pre-norm GPT layer for one row, in place on x (c floats).
   keys/values: the layer's cache (hkv, cap, d); slot t gets the new key/value; attention
   over slots [0, t]. bias: (hkv, cap) additive key bias (-inf skips a key) or NULL.
   Weights are (in, out) row-major: w_in (c, p), w_out (h*d, c), w_fc (c, f), w_proj (f, c);
   any bias or norm weight may be NULL. cs/sn: RoPE's cosines and sines (d/2 floats each)
   of this position, or NULL without RoPE. work: c + p + h*d + f + g*cap floats. */
int qkv_decode_layer(float *x, int64_t c, const float *ln1_w, const float *ln1_b, float eps1,
                     const float *w_in, const float *b_in, float *keys, float *values,
                     int64_t cap, int64_t t, int64_t hkv, int64_t g, int64_t d,
                     const float *bias, float scale, const float *w_out, const float *b_out,
                     const float *ln2_w, const float *ln2_b, float eps2, const float *w_fc,
                     const float *b_fc, int64_t f, int act, const float *w_proj,
                     const float *b_proj, const float *cs, const float *sn, int interleaved,
                     float *work) {
    int64_t hd = hkv * g * d, p = hd + 2 * hkv * d;
    float *h = work, *proj = h + c, *a = proj + p, *ff = a + hd, *scratch = ff + f;
    layer_norm_row(x, c, ln1_w, ln1_b, eps1, h);
    qkv_gemv(h, w_in, b_in, NULL, proj, c, p);
    if (cs) rotate_heads(proj, hkv * g + hkv, d, cs, sn, interleaved); /* q heads, k heads */
    for (int64_t j = 0; j < hkv; j++)
        for (int64_t e = 0; e < d; e++) {
            keys[(j * cap + t) * d + e] = proj[hd + j * d + e];
            values[(j * cap + t) * d + e] = proj[hd + hkv * d + j * d + e];
        }
    int rc = qkv_decode_attention(proj, 0, keys, values, cap * d, hkv, hkv, g, t + 1, d,
                                  bias, cap, scale, a, scratch);
    if (rc) return rc;
    qkv_gemv(a, w_out, b_out, x, x, hd, c);
    layer_norm_row(x, c, ln2_w, ln2_b, eps2, h);
    qkv_gemv(h, w_fc, b_fc, NULL, ff, c, f);
    activate(ff, f, act);
    qkv_gemv(ff, w_proj, b_proj, x, x, f, c);
    return 0;
}
"""

SOURCE = gemv_kernel.SOURCE + attention_kernel.SOURCE + _LAYER


def work_floats(width: int, heads: int, kv_heads: int, head_dim: int, ffn: int,
                capacity: int) -> int:
    """Floats of the ``work`` buffer ``qkv_decode_layer`` needs."""
    hd = heads * head_dim
    return width + hd + 2 * kv_heads * head_dim + hd + ffn + (heads // kv_heads) * capacity


def disabled() -> bool:
    """True when ``QKV_ROW_KERNEL=0`` (or "false"/"off"/"no") turns the kernel off."""
    return env_off("QKV_ROW_KERNEL")


def load():
    """The C function ``qkv_decode_layer`` (ctypes; arguments in the source), or None when
    the kernel is turned off or cannot be built or loaded here. Built once per process."""
    if disabled():
        return None
    with _lock:
        if "fn" not in _state:
            p, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
            _state["fn"] = load_function(
                SOURCE, "decode-layer", "qkv_decode_layer",
                [p, i, p, p, f, p, p, p, p, i, i, i, i, i, p, f, p, p, p, p, f, p, p, i,
                 ctypes.c_int, p, p, p, p, ctypes.c_int, p])
        return _state["fn"]


class RowLayers:
    """The layers of a GPT for one fp32 row, each one call of ``qkv_decode_layer``: the
    fixed arguments (pointers into the weights, norms and caches, which the caller keeps
    alive) made once, the slot and RoPE angles per call.

    Build with ``RowLayers.build``; call ``layers(x, t, rope_pos)`` with the embedded row x
    (1, C) (updated in place: the residual stream after the last layer), the cache slot t
    and RoPE's positions ((1,) or (1, 1) int; None without RoPE).
    """

    def __init__(self, fn, args: list[tuple], bias: int | None, rope, work: Tensor) -> None:
        self.fn, self.args, self.bias, self.rope, self.work = fn, args, bias, rope, work
        self.interleaved = int(rope is not None and rope.interleaved)

    @classmethod
    def build(cls, model: GPT, transposed: list[Tensor], cache: list[KVCache],
              bias: Tensor | None) -> RowLayers | None:
        """The layers of ``model`` (a ``fast_gpt.eligible`` fp32 GPT) over its (in, out)
        weight copies ``transposed`` (``fast_gpt.transposed_weights``: 4 per layer, then the
        head) and one-row, contiguous ``cache``s; ``bias`` the (Hkv, 1, cap) additive key
        bias (-inf at padded prompt positions) or None. None when the activation has no C
        form or the kernel cannot be loaded here."""
        c = model.config
        fn = load()
        if fn is None or c.activation not in ACTIVATION_CODES:
            return None

        def ptr(t: Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        heads, kv_heads, d = c.num_heads, c.num_kv_heads or c.num_heads, c.head_dim
        cap = cache[0].keys.shape[2]
        ffn = model.layers[0].ffn.fc_in.out_features
        work = torch.empty(work_floats(c.dim, heads, kv_heads, d, ffn, cap),
                           dtype=model.embed.weight.dtype)
        act = ACTIVATION_CODES[c.activation]
        args = []
        for i, (layer, kc) in enumerate(zip(model.layers, cache, strict=True)):
            w_in, w_out, w_fc, w_proj = transposed[4 * i:4 * i + 4]  # (in, out) copies
            n1, n2, a, f = layer.norm1, layer.norm2, layer.attn, layer.ffn
            args.append((
                (c.dim, ptr(n1.weight), ptr(n1.bias), n1.eps, ptr(w_in), ptr(a.in_proj.bias),
                 ptr(kc.keys), ptr(kc.values), cap),  # then the slot t
                (kv_heads, heads // kv_heads, d),  # then the key bias
                (1.0 / d ** 0.5, ptr(w_out), ptr(a.out_proj.bias), ptr(n2.weight), ptr(n2.bias),
                 n2.eps, ptr(w_fc), ptr(f.fc_in.bias), ffn, act, ptr(w_proj),
                 ptr(f.fc_out.bias))))  # then RoPE's cosines, sines, layout and the work
        return cls(fn, args, ptr(bias), model.rope, work)

    def __call__(self, x: Tensor, t: int, rope_pos: Tensor | None) -> None:
        """Run every layer on the row x (1, C) in place, writing cache slot t."""
        cs = sn = None
        if rope_pos is not None:  # this position's cosines and sines (D/2,), every layer
            cos, sin = self.rope.cos_sin(rope_pos.reshape(1), x.dtype)  # (1, D/2) each
            cs, sn = cos.data_ptr(), sin.data_ptr()
        xp, fn, bias, work, inter = (x.data_ptr(), self.fn, self.bias, self.work.data_ptr(),
                                     self.interleaved)
        for pre, mid, post in self.args:
            if fn(xp, *pre, t, *mid, bias, *post, cs, sn, inter, work):
                raise RuntimeError("row_step_kernel: the layer call failed")
