/* qkv_gemv: the one-row fp32 product y = res + b + x @ W of the decode steps (gemv_kernel.py
   says what it is for and what it measured). Shapes: K input features, N output features. */
#include "qkv_kernels.h"

typedef float vf16 __attribute__((vector_size(64)));

/* 16 floats from / to unaligned memory. Macros, not functions: a 64-byte vector passed or
   returned by value has no fixed ABI below AVX-512 (GCC's -Wpsabi, an error with -Werror at
   x86-64-v1..v3), while as a value inside one function GCC splits it into the registers the
   target has (4 SSE, 2 AVX, 1 AVX-512, 4 NEON). */
#define load16(p) __extension__({ vf16 x_; __builtin_memcpy(&x_, (p), sizeof x_); x_; })
#define store16(p, v) do { vf16 v_ = (v); __builtin_memcpy((p), &v_, sizeof v_); } while (0)

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
