/* The C decode kernels of qkv (src/qkv/generation/kernels/): every exported function's
   prototype and the one struct Python fills (qkv_row_layer), included by each .c file here.
   qkv.generation.kernel_registry declares each function again for ctypes (argument names,
   types, the dtype and element count of each pointer): a change here is a change there
   (tests/generation/test_kernel_registry.py checks the struct's layout against it).

   Shapes: R rows, C width, H heads, Hkv key/value heads, g = H / Hkv, D head dim,
   P = (H + 2·Hkv)·D, F feed-forward width, cap the cache's capacity, K/N a product's
   input/output features, M rows of an int8 product. */
#ifndef QKV_KERNELS_H
#define QKV_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* The most query heads per key/value head qkv_decode_attention takes (g). */
#define QKV_MAX_GROUP 64

/* gemv.c: y (n) = res + b + x (k) @ w (k, n), w row-major (in, out). */
int qkv_gemv(const float *x, const float *w, const float *b, const float *res, float *y,
             int64_t k, int64_t n);

/* attention.c: one query position per (row, kv head) against the cache. */
int qkv_decode_attention(const float *q, int64_t qr, const float *k, const float *v,
                         int64_t kb, int64_t nbh, int64_t hkv, int64_t g, int64_t s,
                         int64_t d, const float *bias, int64_t bb, float scale, float *out,
                         float *scratch);

/* int8.c: y (M, N) = (quantized x @ wᵀ) * (a * s127) + bias (+ res). */
int qkv_int8_linear(const float *x, int64_t m, int64_t k, const int8_t *w, int64_t n,
                    const float *s127, const float *bias, const float *res, float *y,
                    int8_t *xq, int32_t *acc, float *a);
int qkv_int8_vnni(void);

/* The fixed arguments of one layer (built once per layer by RowLayers). Weights: fp32
   (in, out) row-major when quant is 0; int8 (out, in) row-major with s_* the per-output
   scale / 127 (qkv_int8_linear's math) when quant is 1. Any bias, norm weight or scale
   pointer may be NULL where the layer has none (a scale only when quant is 0). norm: 0
   LayerNorm, 1 RMSNorm. gated: fc_in is 2f wide (gate, then up) and act(gate) * up feeds
   fc_out (SwiGLU with act = silu). */
typedef struct {
    int64_t rows, c, hkv, g, d, f, cap, act, quant, interleaved, norm, gated;
    float eps1, eps2, scale;
    const float *ln1_w, *ln1_b, *ln2_w, *ln2_b;
    const void *w_in, *w_out, *w_fc, *w_proj;
    const float *s_in, *s_out, *s_fc, *s_proj;
    const float *b_in, *b_out, *b_fc, *b_proj;
    float *keys, *values;  /* the layer's cache (rows, hkv, cap, d) */
    const float *bias;     /* (rows * hkv, cap) additive key bias (-inf skips a key) or NULL */
    float *work;           /* rows * (c + p + h*d + f*(1+gated)) + g*cap floats */
    int8_t *xq;            /* int8 only: rows * max(c, h*d, f) bytes */
    int32_t *acc;          /* int8 only: rows * max(p, c, f*(1+gated)) */
    float *amax;           /* int8 only: rows */
} qkv_row_layer;

/* decode_layer.c: one pre-norm GPT layer for m rows, in place. */
int qkv_decode_layer(const qkv_row_layer *L, float *x, int64_t m, int64_t t, const float *cs,
                     const float *sn);

/* decode_layer.c: the byte offset of each qkv_row_layer field in declaration order, then
   sizeof(qkv_row_layer), into out (n entries); returns how many it wrote, -1 if n is too
   small. */
int qkv_row_layer_layout(int64_t *out, int64_t n);

#endif
