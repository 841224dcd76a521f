/* qkv_gemv: the one-row fp32 product y = res + b + x @ W of the decode steps (gemv_kernel.py
   says what it is for and what it measured). Shapes: K input features, N output features. */
#include "qkv_kernels.h"

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
