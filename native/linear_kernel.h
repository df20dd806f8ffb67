/*
 * linear.c's block at one vector width W (16 floats: AVX-512; 8: AVX2 and
 * the baseline): linear.c includes it once per width.  A panel's PANEL
 * columns go in passes of VECTORS vectors (one pass at 16 lanes, two at 8),
 * each pass R rows of x times those columns in R * VECTORS accumulators.
 */
#include "vectors.h"

/* Rows [0, R) of y from the accumulators of a pass over the panel's columns [c0, c0 + VECTORS * W) (its
 * outputs [col, col + cols)), with the bias; `up`: the panel is a gated GEMM's up panel, and y holds its
 * gate panel's outputs, which become silu(gate) * up. */
INLINE void NAME(finish)(const Gemm *g, vec (*acc)[VECTORS], char *y, int64_t col, int64_t cols, int c0, int up,
                         const int R, const int bf16) {
    for (int i = 0; i < R; i++) {
        char *row = y + i * g->y_stride * (bf16 ? 2 : 4);
        if (up) { /* silu(gate) * up, as silu_mul_row computes it */
#pragma GCC unroll 3
            for (int j = 0; j < VECTORS; j++) {
                const int64_t at = c0 + j * W;
                const vec gate = NAME(load)(row, at, bf16);
                vec u = g->bias ? acc[i][j] + NAME(load)(g->bias, col + at, bf16) : acc[i][j];
                vec s = gate / (1.0f + vexp(-gate));
                if (bf16) { /* up and silu(gate) rounded, as the separate calls round them */
                    NAME(put)(row, at, u, 1);
                    u = NAME(load)(row, at, 1);
                    NAME(put)(row, at, s, 1);
                    s = NAME(load)(row, at, 1);
                }
                NAME(put)(row, at, s * u, bf16);
            }
        } else if (cols == PANEL) {
#pragma GCC unroll 3
            for (int j = 0; j < VECTORS; j++) {
                const int64_t at = c0 + j * W;
                NAME(put)(row, at, g->bias ? acc[i][j] + NAME(load)(g->bias, col + at, bf16) : acc[i][j], bf16);
            }
        } else { /* the last panel's columns */
            float out[VECTORS * W];
            for (int j = 0; j < VECTORS; j++) *(vec_u *)(out + j * W) = acc[i][j];
            for (int64_t c = c0; c < cols && c < c0 + VECTORS * W; c++) {
                float b = !g->bias ? 0.0f : bf16 ? bf16_float(((const uint16_t *)g->bias)[col + c])
                                                 : ((const float *)g->bias)[col + c];
                float v = out[c - c0] + b;
                if (bf16)
                    ((uint16_t *)row)[c] = float_bf16(v);
                else
                    ((float *)row)[c] = v;
            }
        }
    }
}

/* Up to `per` lines of the next panel asked for. */
INLINE void NAME(prefetch)(Ahead *ahead) {
    for (int u = 0; u < ahead->per && ahead->at < ahead->end; u++, ahead->at += 64) __builtin_prefetch(ahead->at, 0, 2);
}

/* y rows [0, R) from panel `w` (its outputs [col, col + cols)) and x rows [0, R), float32 (bfloat16 rows
 * widened): R and bf16 constants.  A bfloat16 panel's pairs of inputs are widened as loaded, each pair's
 * products added in turn, so the sums are the float32 ones input by input. */
INLINE void NAME(block)(const Gemm *g, const char *xrows, const char *w, char *y, int64_t col, int64_t cols,
                        Ahead ahead, int up, const int R, const int bf16) {
    const float *x = (const float *)xrows;
    for (int c0 = 0; c0 < PANEL; c0 += VECTORS * W) { /* a pass over VECTORS * W of the panel's columns */
        vec acc[MAX_ROWS][VECTORS];
#pragma GCC unroll 8
        for (int i = 0; i < R; i++)
#pragma GCC unroll 3
            for (int j = 0; j < VECTORS; j++) acc[i][j] = (vec){};
        /* a step over K: a float32 weight of each column, or a bfloat16 pair of them; 4 bytes a column */
        const char *wd = w + c0 * 4;
        for (int64_t d = 0; d < g->k; d += 1 + bf16, wd += PANEL * 4) {
            NAME(prefetch)(&ahead);
            vec wv[2][VECTORS]; /* input d's weights, and a bfloat16 pair's input d + 1's */
#pragma GCC unroll 3
            for (int j = 0; j < VECTORS; j++) {
                const vecu bits = (vecu)(*(const vec_u *)(wd + j * W * 4));
                wv[0][j] = bf16 ? (vec)(bits << 16) : (vec)bits;
                wv[1][j] = (vec)(bits & 0xffff0000u);
            }
            for (int h = 0; h <= bf16 && d + h < g->k; h++)
#pragma GCC unroll 8
                for (int i = 0; i < R; i++) {
                    const float xv = x[i * g->x_stride + d + h];
#pragma GCC unroll 3
                    for (int j = 0; j < VECTORS; j++) acc[i][j] += xv * wv[h][j];
                }
        }
        ahead.per = 0; /* the first pass asked for the next panel */
        NAME(finish)(g, acc, y, col, cols, c0, up, R, bf16);
    }
}

#if W == 16
/* acc[i] += rows i's inputs 2p and 2p + 1 (`last`: 2p alone, paired with zero) times the weight pairs at wd. */
INLINE void paired_step(vec (*acc)[VECTORS], const char *wd, const uint16_t *x, int64_t x_stride, int64_t p,
                        const int last, const int R) {
    bf32 wv[VECTORS];
#pragma GCC unroll 3
    for (int j = 0; j < VECTORS; j++) wv[j] = *(const bf32_u *)(wd + j * 64);
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) {
        const uint16_t *at = x + i * x_stride + 2 * p;
        const bf32 xv = last ? (bf32)((v16i){} + (int32_t)*at) : broadcast_pair(at);
#pragma GCC unroll 3
        for (int j = 0; j < VECTORS; j++) acc[i][j] = dot2(acc[i][j], xv, wv[j]);
    }
}

/* The block over a bfloat16 panel on vdpbf16ps (AVX512-BF16): x's bfloat16 rows as given, each pair of
 * inputs broadcast against the panel's pairs of weights; the last input of an odd K paired with zero. */
INLINE void paired_block(const Gemm *g, const char *xrows, const char *w, char *y, int64_t col, int64_t cols,
                         Ahead ahead, int up, const int R) {
    const uint16_t *x = (const uint16_t *)xrows;
    vec acc[MAX_ROWS][VECTORS];
#pragma GCC unroll 8
    for (int i = 0; i < R; i++)
#pragma GCC unroll 3
        for (int j = 0; j < VECTORS; j++) acc[i][j] = (vec){};
    const int64_t pairs = g->k / 2;
    for (int64_t p = 0; p < pairs; p++) {
        NAME(prefetch)(&ahead);
        paired_step(acc, w + p * PANEL * 4, x, g->x_stride, p, 0, R);
    }
    if (g->k % 2) paired_step(acc, w + pairs * PANEL * 4, x, g->x_stride, pairs, 1, R);
    NAME(finish)(g, acc, y, col, cols, 0, up, R, 1);
}
#endif
