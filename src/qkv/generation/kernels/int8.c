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
/* vpdpbusd multiplies unsigned bytes by signed ones. xq is signed, so each 64-byte chunk of
   a row is offset to xq + 128 (an xor with 0x80: two's complement to offset binary, 0..255)
   and 128·Σw is taken off the sum: Σ (xq + 128)·w - 128·Σ w = Σ xq·w exactly in int32 while
   255·127·K < 2^31 (K < 66311; wider rows take the signed form below). 128·Σw of a block of
   weight rows is one vpdpbusd of 0x80 bytes per chunk, once per block for all M rows. Both
   forms give the same int32 sums. */
#define QKV_OFFSET_MAX_K 66000
/* From this many rows on: the sums cost one more pass over each weight block (in L1), which
   a few rows do not earn back (measured: benchmarks/bench_quantize.py, BENCHMARKS.md). */
#define QKV_OFFSET_MIN_M 4

static inline __m512i dot_step(__m512i acc, __m512i xv, __m512i wv) {
    __mmask64 neg = _mm512_movepi8_mask(xv);
    __m512i sw = _mm512_mask_sub_epi8(wv, neg, _mm512_setzero_si512(), wv);
    return _mm512_dpbusd_epi32(acc, _mm512_abs_epi8(xv), sw);
}

/* Output columns n0.. in blocks of four, in the offset form; returns the first column it
   did not compute (fewer than four remain). */
static int64_t dots_offset(const int8_t *xq0, int64_t m, const int8_t *w, int64_t k,
                           int64_t n0, int64_t n1, int32_t *out0) {
    int64_t full = k / 64 * 64;
    __mmask64 tail = k > full ? (~0ULL >> (64 - (k - full))) : 0;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
        const int8_t *w0 = w + n * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
        __m512i c0 = _mm512_setzero_si512(), c1 = c0, c2 = c0, c3 = c0;
        for (int64_t i = 0; i < full; i += 64) {  /* 128·Σw of the four rows */
            c0 = _mm512_dpbusd_epi32(c0, flip, _mm512_loadu_si512(w0 + i));
            c1 = _mm512_dpbusd_epi32(c1, flip, _mm512_loadu_si512(w1 + i));
            c2 = _mm512_dpbusd_epi32(c2, flip, _mm512_loadu_si512(w2 + i));
            c3 = _mm512_dpbusd_epi32(c3, flip, _mm512_loadu_si512(w3 + i));
        }
        if (tail) {
            __m512i f = _mm512_maskz_mov_epi8(tail, flip);
            c0 = _mm512_dpbusd_epi32(c0, f, _mm512_maskz_loadu_epi8(tail, w0 + full));
            c1 = _mm512_dpbusd_epi32(c1, f, _mm512_maskz_loadu_epi8(tail, w1 + full));
            c2 = _mm512_dpbusd_epi32(c2, f, _mm512_maskz_loadu_epi8(tail, w2 + full));
            c3 = _mm512_dpbusd_epi32(c3, f, _mm512_maskz_loadu_epi8(tail, w3 + full));
        }
        int32_t s0 = _mm512_reduce_add_epi32(c0), s1 = _mm512_reduce_add_epi32(c1);
        int32_t s2 = _mm512_reduce_add_epi32(c2), s3 = _mm512_reduce_add_epi32(c3);
        for (int64_t r = 0; r < m; r++) {
            const int8_t *xq = xq0 + r * k;
            int32_t *out = out0 + r * n1;
            __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t i = 0; i < full; i += 64) {
                __m512i xv = _mm512_xor_si512(_mm512_loadu_si512(xq + i), flip);
                a0 = _mm512_dpbusd_epi32(a0, xv, _mm512_loadu_si512(w0 + i));
                a1 = _mm512_dpbusd_epi32(a1, xv, _mm512_loadu_si512(w1 + i));
                a2 = _mm512_dpbusd_epi32(a2, xv, _mm512_loadu_si512(w2 + i));
                a3 = _mm512_dpbusd_epi32(a3, xv, _mm512_loadu_si512(w3 + i));
            }
            if (tail) {  /* masked-off bytes: x byte 0 and w byte 0 add nothing */
                __m512i xv = _mm512_maskz_mov_epi8(
                    tail, _mm512_xor_si512(_mm512_maskz_loadu_epi8(tail, xq + full), flip));
                a0 = _mm512_dpbusd_epi32(a0, xv, _mm512_maskz_loadu_epi8(tail, w0 + full));
                a1 = _mm512_dpbusd_epi32(a1, xv, _mm512_maskz_loadu_epi8(tail, w1 + full));
                a2 = _mm512_dpbusd_epi32(a2, xv, _mm512_maskz_loadu_epi8(tail, w2 + full));
                a3 = _mm512_dpbusd_epi32(a3, xv, _mm512_maskz_loadu_epi8(tail, w3 + full));
            }
            out[n] = _mm512_reduce_add_epi32(a0) - s0;
            out[n + 1] = _mm512_reduce_add_epi32(a1) - s1;
            out[n + 2] = _mm512_reduce_add_epi32(a2) - s2;
            out[n + 3] = _mm512_reduce_add_epi32(a3) - s3;
        }
    }
    return n;  /* the last N % 4 rows: the signed form (dots) */
}
#endif

static void dots(const int8_t *xq0, int64_t m, const int8_t *w, int64_t k, int64_t n0,
                 int64_t n1, int32_t *out0) {
#ifdef QKV_VNNI
    int64_t n = n0;
    if (m >= QKV_OFFSET_MIN_M && k < QKV_OFFSET_MAX_K)
        n = dots_offset(xq0, m, w, k, n0, n1, out0);
    int64_t full = k / 64 * 64;
    __mmask64 tail = k > full ? (~0ULL >> (64 - (k - full))) : 0;
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
