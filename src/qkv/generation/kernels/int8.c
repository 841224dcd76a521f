/* qkv_int8_linear: the fused int8 linear layer of the int8 decode step (int8_kernel.py
   says what it is for); qkv_int8_vnni: whether the VNNI branch was compiled.
   Shapes: M rows, K input features, N output features. */
#include "qkv_kernels.h"
#include <math.h>
#if !defined(QKV_PORTABLE) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VNNI__)
#include <immintrin.h>
#define QKV_VNNI 1
#endif

/* xq (M, K) int8 and a (M,) from x (M, K) fp32: a = max|x| (at least FLT_MIN),
   xq = round_half_even((127 * x) / a); a non-finite a gives a zero row. */
static void quantize_rows(const float *x, int64_t m, int64_t k, int8_t *xq, float *a) {
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * k;
        /* max |x| over the bit patterns: for |x| as uint32 the order is the float order,
           and a NaN is above +inf (an integer max, which vectorises) */
        uint32_t top = 0;
        for (int64_t i = 0; i < k; i++) {
            uint32_t u;
            __builtin_memcpy(&u, xr + i, sizeof u);
            u &= 0x7FFFFFFFu;
            top = u > top ? u : top;
        }
        float mx;
        __builtin_memcpy(&mx, &top, sizeof mx);
        if (top > 0x7F800000u) mx = NAN;
        if (mx < 1.17549435e-38f) mx = 1.17549435e-38f;
        a[r] = mx;
        int8_t *qr = xq + r * k;
        if (!isfinite(mx)) {
            for (int64_t i = 0; i < k; i++) qr[i] = 0;
            continue;
        }
        /* rintf: round half to even in the default mode, as lrintf (vectorises) */
        for (int64_t i = 0; i < k; i++) qr[i] = (int8_t)(int32_t)rintf((127.0f * xr[i]) / mx);
    }
}

#ifdef QKV_VNNI
static inline __m512i dot_step(__m512i acc, __m512i xv, __m512i wv) {
    __mmask64 neg = _mm512_movepi8_mask(xv);
    __m512i sw = _mm512_mask_sub_epi8(wv, neg, _mm512_setzero_si512(), wv);
    return _mm512_dpbusd_epi32(acc, _mm512_abs_epi8(xv), sw);
}
#endif

static void dots(const int8_t *xq0, int64_t m, const int8_t *w, int64_t k, int64_t n0,
                 int64_t n1, int32_t *out0) {
#ifdef QKV_VNNI
    int64_t full = k / 64 * 64;
    __mmask64 tail = k > full ? (~0ULL >> (64 - (k - full))) : 0;
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
        const int8_t *w0 = w + n * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
        for (int64_t r = 0; r < m; r++) {
        const int8_t *xq = xq0 + r * k;
        int32_t *out = out0 + r * n1;
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t i = 0; i < full; i += 64) {
            __m512i xv = _mm512_loadu_si512(xq + i);
            a0 = dot_step(a0, xv, _mm512_loadu_si512(w0 + i));
            a1 = dot_step(a1, xv, _mm512_loadu_si512(w1 + i));
            a2 = dot_step(a2, xv, _mm512_loadu_si512(w2 + i));
            a3 = dot_step(a3, xv, _mm512_loadu_si512(w3 + i));
        }
        if (tail) {
            __m512i xv = _mm512_maskz_loadu_epi8(tail, xq + full);
            a0 = dot_step(a0, xv, _mm512_maskz_loadu_epi8(tail, w0 + full));
            a1 = dot_step(a1, xv, _mm512_maskz_loadu_epi8(tail, w1 + full));
            a2 = dot_step(a2, xv, _mm512_maskz_loadu_epi8(tail, w2 + full));
            a3 = dot_step(a3, xv, _mm512_maskz_loadu_epi8(tail, w3 + full));
        }
        out[n] = _mm512_reduce_add_epi32(a0);
        out[n + 1] = _mm512_reduce_add_epi32(a1);
        out[n + 2] = _mm512_reduce_add_epi32(a2);
        out[n + 3] = _mm512_reduce_add_epi32(a3);
        }
    }
    for (; n < n1; n++) {
        const int8_t *w0 = w + n * k;
        for (int64_t r = 0; r < m; r++) {
        const int8_t *xq = xq0 + r * k;
        int32_t *out = out0 + r * n1;
        __m512i a0 = _mm512_setzero_si512();
        for (int64_t i = 0; i < full; i += 64)
            a0 = dot_step(a0, _mm512_loadu_si512(xq + i), _mm512_loadu_si512(w0 + i));
        if (tail)
            a0 = dot_step(a0, _mm512_maskz_loadu_epi8(tail, xq + full),
                          _mm512_maskz_loadu_epi8(tail, w0 + full));
        out[n] = _mm512_reduce_add_epi32(a0);
        }
    }
#else
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *wr = w + n * k;
        for (int64_t r = 0; r < m; r++) {
            const int8_t *xq = xq0 + r * k;
            int32_t acc = 0;
            for (int64_t i = 0; i < k; i++) acc += (int32_t)xq[i] * (int32_t)wr[i];
            out0[r * n1 + n] = acc;
        }
    }
#endif
}

/* y (M, N) = (xq @ wᵀ) * (a * s127) + bias (+ res): x (M, K) fp32 rows, w (N, K) int8
   row-major, s127 (N,), bias (N,) or NULL, res (M, N) or NULL (may alias y);
   scratch: xq (M, K) int8, acc (M, N) int32, a (M,) fp32. */
int qkv_int8_linear(const float *x, int64_t m, int64_t k, const int8_t *w, int64_t n,
                    const float *s127, const float *bias, const float *res, float *y,
                    int8_t *xq, int32_t *acc, float *a) {
    quantize_rows(x, m, k, xq, a);
    dots(xq, m, w, k, 0, n, acc);
    for (int64_t r = 0; r < m; r++) {
        const int32_t *ac = acc + r * n;
        float *yr = y + r * n;
        const float ar = a[r];
        for (int64_t j = 0; j < n; j++) {
            /* as torch's addcmul(bias, acc, a·s) and mul(acc, a·s) compute it */
            float v = bias ? fmaf((float)ac[j], ar * s127[j], bias[j])
                           : (float)ac[j] * (ar * s127[j]);
            if (res) v = v + res[r * n + j];
            yr[j] = v;
        }
    }
    return 0;
}

int qkv_int8_vnni(void) {
#ifdef QKV_VNNI
    return 1;
#else
    return 0;
#endif
}
