/* qkv_decode_attention: the batched decode step's attention, one query position per (row,
   kv head) against the cache (attention_kernel.py says what it is for). Shapes: R rows,
   H heads, Hkv kv heads, g = H / Hkv, D head dim, S keys. */
#include "qkv_kernels.h"
#include <math.h>

/* Attention of one query position per (row, kv head) batch bh = r * hkv + h, bh < nbh.
   q: query i (< g) of bh at q + r * qr + (h * g + i) * d (d floats);
   k, v: key/value j (< s) of bh at k + bh * kb + j * d;
   bias: (bh, j) at bias + bh * bb + j, additive, or NULL; a -inf entry skips key j;
   out: (bh, i) at out + (bh * g + i) * d, i.e. (R, H * D) row-major;
   scratch: g * s floats. g <= QKV_MAX_GROUP. A query with every key skipped gets zeros. */
int qkv_decode_attention(const float *q, int64_t qr, const float *k, const float *v,
                         int64_t kb, int64_t nbh, int64_t hkv, int64_t g, int64_t s,
                         int64_t d, const float *bias, int64_t bb, float scale, float *out,
                         float *scratch) {
    if (g > QKV_MAX_GROUP) return 1;
    for (int64_t bh = 0; bh < nbh; bh++) {
        const float *kk = k + bh * kb, *vv = v + bh * kb;
        const float *bs = bias ? bias + bh * bb : NULL;
        const float *qh = q + (bh / hkv) * qr + (bh % hkv) * g * d;
        float *o = out + bh * g * d;
        float mx[QKV_MAX_GROUP];
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
