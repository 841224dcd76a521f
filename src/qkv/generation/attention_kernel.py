"""An optional C kernel for the batched decode step's attention (``fast_gpt``, R >= 4 rows):
one query per row and head against the cache, in one call per layer, where the torch path is
baddbmm -> softmax -> bmm over R·Hkv tiny batched products.

Shapes: R rows, H query heads, Hkv key/value heads, g = H / Hkv, D head dim, S keys (the
cache's filled part), cap the cache's capacity.

At R = 16 the keys and values of a step (R·Hkv·S·D floats each, ~1.2 MB per layer at S = 48
for a 6-head, 64-dim model) come from memory, not cache (the weights streamed in between
evict them); MKL's batched product for one query row per batch reads them at ~6-8 GB/s here.
This kernel walks each (row, kv head) block once for the scores and once for the values,
computes the g queries of a kv head together (GQA reads each key once), and skips the key
positions whose padding bias is -inf (a left-padded prompt's pads: never read). The math is
torch's — scores = q·k · scale + bias, softmax as exp(x - max) / sum, then p @ v — in another
summation order (|diff| ~1e-7 relative, fp32).

Compiled on first use like ``int8_kernel`` (``cc -O3 -march=native``, cached per source,
compiler and CPU flags; ``c_kernels``), loaded with ``ctypes``. Any failure
leaves ``load()`` returning None and the caller on the torch ops. ``QKV_ATTN_KERNEL=0`` turns
it off. fp32 only; single-threaded (the caller uses it when torch runs on one thread).
"""

from __future__ import annotations

import ctypes
import threading

from .c_kernels import env_off, load_function

__all__ = ["MAX_GROUP", "disabled", "load"]

MAX_GROUP = 64
"""The most query heads per key/value head (g) the kernel takes."""

_lock = threading.Lock()
_state: dict[str, object] = {}  # "fn": the loaded function or None once tried

SOURCE = r"""
#include <stdint.h>
#include <math.h>
#include <stddef.h>

/* Attention of one query position per (row, kv head) batch bh = r * hkv + h, bh < nbh.
   q: query i (< g) of bh at q + r * qr + (h * g + i) * d (d floats);
   k, v: key/value j (< s) of bh at k + bh * kb + j * d;
   bias: (bh, j) at bias + bh * bb + j, additive, or NULL; a -inf entry skips key j;
   out: (bh, i) at out + (bh * g + i) * d, i.e. (R, H * D) row-major;
   scratch: g * s floats. g <= 64. A query with every key skipped gets zeros. */
int qkv_decode_attention(const float *q, int64_t qr, const float *k, const float *v,
                         int64_t kb, int64_t nbh, int64_t hkv, int64_t g, int64_t s,
                         int64_t d, const float *bias, int64_t bb, float scale, float *out,
                         float *scratch) {
    if (g > 64) return 1;
    for (int64_t bh = 0; bh < nbh; bh++) {
        const float *kk = k + bh * kb, *vv = v + bh * kb;
        const float *bs = bias ? bias + bh * bb : NULL;
        const float *qh = q + (bh / hkv) * qr + (bh % hkv) * g * d;
        float *o = out + bh * g * d;
        float mx[64];
        for (int64_t i = 0; i < g; i++) mx[i] = -INFINITY;
        for (int64_t j = 0; j < s; j++) {
            const float *kj = kk + j * d;
            if (j + 2 < s)
                for (int64_t e = 0; e < d; e += 16) __builtin_prefetch(kj + 2 * d + e);
            if (bs && bs[j] == -INFINITY) {
                for (int64_t i = 0; i < g; i++) scratch[i * s + j] = -INFINITY;
                continue;
            }
            for (int64_t i = 0; i < g; i++) {
                const float *qi = qh + i * d;
                float acc[16] = {0};
                int64_t e = 0;
                for (; e + 16 <= d; e += 16)
                    for (int t = 0; t < 16; t++) acc[t] += qi[e + t] * kj[e + t];
                float dot = 0.0f;
                for (; e < d; e++) dot += qi[e] * kj[e];
                for (int t = 0; t < 16; t++) dot += acc[t];
                float x = dot * scale + (bs ? bs[j] : 0.0f);
                scratch[i * s + j] = x;
                if (x > mx[i]) mx[i] = x;
            }
        }
        for (int64_t i = 0; i < g; i++) {
            float *sc = scratch + i * s, sum = 0.0f;
            for (int64_t e = 0; e < d; e++) o[i * d + e] = 0.0f;
            if (mx[i] == -INFINITY) {
                for (int64_t j = 0; j < s; j++) sc[j] = 0.0f;
                continue;
            }
            for (int64_t j = 0; j < s; j++) {
                float p = sc[j] == -INFINITY ? 0.0f : expf(sc[j] - mx[i]);
                sc[j] = p;
                sum += p;
            }
            for (int64_t j = 0; j < s; j++) sc[j] = sc[j] / sum;
        }
        for (int64_t j = 0; j < s; j++) {
            const float *vj = vv + j * d;
            if (j + 2 < s)
                for (int64_t e = 0; e < d; e += 16) __builtin_prefetch(vj + 2 * d + e);
            if (bs && bs[j] == -INFINITY) continue;
            for (int64_t i = 0; i < g; i++) {
                float p = scratch[i * s + j];
                float *oi = o + i * d;
                for (int64_t e = 0; e < d; e++) oi[e] += p * vj[e];
            }
        }
    }
    return 0;
}
"""


def disabled() -> bool:
    """True when ``QKV_ATTN_KERNEL=0`` (or "false"/"off"/"no") turns the kernel off."""
    return env_off("QKV_ATTN_KERNEL")


def load():
    """The C function ``qkv_decode_attention`` (ctypes; arguments in the source), or None
    when the kernel is turned off or cannot be built or loaded here. Built once per
    process."""
    if disabled():
        return None
    with _lock:
        if "fn" not in _state:
            p, i = ctypes.c_void_p, ctypes.c_int64
            _state["fn"] = load_function(
                SOURCE, "decode-attention", "qkv_decode_attention",
                [p, i, p, p, i, i, i, i, i, i, p, i, ctypes.c_float, p, p])
        return _state["fn"]
