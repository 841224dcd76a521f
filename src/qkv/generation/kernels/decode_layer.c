/* qkv_decode_layer: a whole pre-norm layer of the decode engine's C layer in one call
   (row_step_kernel.py says what it is for); linked with gemv.c, attention.c and int8.c,
   whose functions it calls. qkv_row_layer (qkv_kernels.h) holds its fixed arguments.
   Shapes: R rows, C width, H heads, Hkv key/value heads, g = H / Hkv, D head dim,
   P = (H + 2·Hkv)·D, F feed-forward width, cap the cache's capacity. */
#include "qkv_kernels.h"
#include <math.h>

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

/* RMSNorm: y = x / sqrt(mean(x²) + eps) · w, a double accumulator. */
static void rms_norm_row(const float *x, int64_t c, const float *w, float eps, float *y) {
    double sq = 0.0;
    for (int64_t i = 0; i < c; i++) sq += (double)x[i] * (double)x[i];
    float rstd = (float)(1.0 / sqrt(sq / (double)c + (double)eps));
    for (int64_t i = 0; i < c; i++) {
        float z = x[i] * rstd;
        if (w) z *= w[i];
        y[i] = z;
    }
}

static void norm_row(const qkv_row_layer *L, const float *x, const float *w, const float *b,
                     float eps, float *y) {
    if (L->norm)
        rms_norm_row(x, L->c, w, eps, y);
    else
        layer_norm_row(x, L->c, w, b, eps, y);
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
    int64_t fw = L->gated ? 2 * f : f;  /* fc_in's width */
    int64_t hd = hkv * L->g * d, p = hd + 2 * hkv * d;
    float *h = L->work, *proj = h + m * c, *a = proj + m * p, *ff = a + m * hd;
    float *scratch = ff + m * fw;
    if (t < 0 || t >= cap || m < 1 || m > L->rows || (!L->quant && m != 1)) return 2;
    for (int64_t r = 0; r < m; r++)
        norm_row(L, x + r * c, L->ln1_w, L->ln1_b, L->eps1, h + r * c);
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
        norm_row(L, x + r * c, L->ln2_w, L->ln2_b, L->eps2, h + r * c);
    row_linear(L, h, m, L->w_fc, L->s_fc, L->b_fc, NULL, ff, c, fw);
    if (L->gated) {  /* row r: act(gate) * up into ff[r*f .. r*f + f), reading ahead of it */
        for (int64_t r = 0; r < m; r++) {
            float *gate = ff + r * fw, *up = gate + f, *out = ff + r * f;
            activate(gate, f, (int)L->act);
            for (int64_t i = 0; i < f; i++) out[i] = gate[i] * up[i];
        }
    } else {
        activate(ff, m * f, (int)L->act);
    }
    row_linear(L, ff, m, L->w_proj, L->s_proj, L->b_proj, x, x, f, c);
    return 0;
}

int qkv_row_layer_layout(int64_t *out, int64_t n) {
    static const int64_t at[] = {
        offsetof(qkv_row_layer, rows), offsetof(qkv_row_layer, c),
        offsetof(qkv_row_layer, hkv), offsetof(qkv_row_layer, g),
        offsetof(qkv_row_layer, d), offsetof(qkv_row_layer, f),
        offsetof(qkv_row_layer, cap), offsetof(qkv_row_layer, act),
        offsetof(qkv_row_layer, quant), offsetof(qkv_row_layer, interleaved),
        offsetof(qkv_row_layer, norm), offsetof(qkv_row_layer, gated),
        offsetof(qkv_row_layer, eps1), offsetof(qkv_row_layer, eps2),
        offsetof(qkv_row_layer, scale),
        offsetof(qkv_row_layer, ln1_w), offsetof(qkv_row_layer, ln1_b),
        offsetof(qkv_row_layer, ln2_w), offsetof(qkv_row_layer, ln2_b),
        offsetof(qkv_row_layer, w_in), offsetof(qkv_row_layer, w_out),
        offsetof(qkv_row_layer, w_fc), offsetof(qkv_row_layer, w_proj),
        offsetof(qkv_row_layer, s_in), offsetof(qkv_row_layer, s_out),
        offsetof(qkv_row_layer, s_fc), offsetof(qkv_row_layer, s_proj),
        offsetof(qkv_row_layer, b_in), offsetof(qkv_row_layer, b_out),
        offsetof(qkv_row_layer, b_fc), offsetof(qkv_row_layer, b_proj),
        offsetof(qkv_row_layer, keys), offsetof(qkv_row_layer, values),
        offsetof(qkv_row_layer, bias), offsetof(qkv_row_layer, work),
        offsetof(qkv_row_layer, xq), offsetof(qkv_row_layer, acc),
        offsetof(qkv_row_layer, amax),
        sizeof(qkv_row_layer)};
    int64_t count = (int64_t)(sizeof at / sizeof at[0]);
    if (n < count) return -1;
    for (int64_t i = 0; i < count; i++) out[i] = at[i];
    return (int)count;
}
