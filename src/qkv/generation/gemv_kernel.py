"""An optional C kernel for the one-row fp32 decode step (``fast_gpt``): a row vector times a
weight stored as (in, out), plus bias and an optional residual, in one call.

Shapes: K input features, N output features.

At one row a decode step is bound by reading every weight once. torch's CPU GEMM reads a
(K, N) weight for one row at ~11-13 GB/s here, while a plain ``sum`` over the same weights
reads ~17-18 GB/s. This kernel streams whole rows of the (in, out) weight, eight at a time,
into an output row that stays in L1 cache: ``y = res + b + x @ W``. Measured here, 1 thread,
the 25 matrices of a 6-layer, 384-wide GPT with an 8192-token head: ~3.8-4.5 ms a token
against ~5.0-5.3 ms through ``torch.mm`` (``benchmarks/bench_generate.py`` measures the
decode it gives against the torch-GEMM floor).

The math is ``addmm``'s in another summation order (the output starts at b + res, then adds
the rows of x·W in order of the inputs; |diff| ~1e-7 relative, fp32). Compiled on first use
(``cc -O3 -march=native``, cached; ``c_kernels``), loaded with ``ctypes``; 16-float vectors
through the GCC/clang vector extension (AVX-512 here, narrower registers elsewhere). Any
failure leaves ``load()`` returning None and the caller on ``addmm``. ``QKV_GEMV_KERNEL=0``
turns it off. fp32 only; single-threaded (the caller uses it when torch runs on one thread).
"""

from __future__ import annotations

import ctypes
import threading

from .c_kernels import env_off, load_function

__all__ = ["disabled", "load"]

_lock = threading.Lock()
_state: dict[str, object] = {}  # "fn": the loaded function or None once tried

SOURCE = r"""
#include <stdint.h>
#include <stddef.h>

typedef float vf16 __attribute__((vector_size(64)));

static inline vf16 load16(const float *p) { vf16 x; __builtin_memcpy(&x, p, sizeof x); return x; }
static inline void store16(float *p, vf16 x) { __builtin_memcpy(p, &x, sizeof x); }

#define ROWS 8 /* weight rows streamed together */

/* y (n) = res + b + x (k) @ w (k, n), w row-major (in, out). b and res may be NULL; res may
   be y itself (an in-place residual); x must not overlap y. */
int qkv_gemv(const float *x, const float *w, const float *b, const float *res, float *y,
             int64_t k, int64_t n) {
    int64_t nv = n - n % 16;
    for (int64_t o = 0; o < n; o++)
        y[o] = (b ? b[o] : 0.0f) + (res ? res[o] : 0.0f);
    int64_t i = 0;
    for (; i + ROWS <= k; i += ROWS) {
        const float *wi = w + i * n;
        float xs[ROWS];
        for (int r = 0; r < ROWS; r++) xs[r] = x[i + r];
        const float *ahead = i + 2 * ROWS <= k ? wi + ROWS * n : NULL; /* the next rows */
        for (int64_t o = 0; o < nv; o += 16) {
            if (ahead)
                for (int r = 0; r < ROWS; r++) __builtin_prefetch(ahead + r * n + o);
            vf16 acc = load16(y + o);
            for (int r = 0; r < ROWS; r++) acc += xs[r] * load16(wi + r * n + o);
            store16(y + o, acc);
        }
        for (int64_t o = nv; o < n; o++) {
            float acc = y[o];
            for (int r = 0; r < ROWS; r++) acc += xs[r] * wi[r * n + o];
            y[o] = acc;
        }
    }
    for (; i < k; i++) {
        const float *wi = w + i * n;
        float xi = x[i];
        for (int64_t o = 0; o < nv; o += 16) store16(y + o, load16(y + o) + xi * load16(wi + o));
        for (int64_t o = nv; o < n; o++) y[o] += xi * wi[o];
    }
    return 0;
}
"""


def disabled() -> bool:
    """True when ``QKV_GEMV_KERNEL=0`` (or "false"/"off"/"no") turns the kernel off."""
    return env_off("QKV_GEMV_KERNEL")


def load():
    """The C function ``qkv_gemv(x, w, b, res, y, k, n)`` (ctypes; pointers to fp32 data, b
    and res may be None), or None when the kernel is turned off or cannot be built or loaded
    here. Built once per process."""
    if disabled():
        return None
    with _lock:
        if "fn" not in _state:
            p, i = ctypes.c_void_p, ctypes.c_int64
            _state["fn"] = load_function(SOURCE, "gemv", "qkv_gemv", [p, p, p, p, p, i, i])
        return _state["fn"]
