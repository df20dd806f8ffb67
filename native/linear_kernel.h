/*
 * linear.c's block at one vector width W (16 floats: AVX-512; 8: AVX2 and
 * the baseline): linear.c includes it once per width.  A panel's PANEL
 * columns go in passes of VECTORS vectors (one pass at 16 lanes, two at 8),
 * each pass R rows of x times those columns in R * VECTORS accumulators.
 */
#include "vectors.h"

/* y rows [0, R) from panel `w` (its outputs [col, col + cols)) and x rows [0, R) (float32): R and bf16
 * constants.
 * `up`: the panel is a gated GEMM's up panel, and y holds its gate panel's outputs. */
INLINE void NAME(block)(const Gemm *g, const float *x, const char *w, char *y, int64_t col, int64_t cols,
                        Ahead ahead, int up, const int R, const int bf16) {
    const int64_t esize = bf16 ? 2 : 4;
    for (int c0 = 0; c0 < PANEL; c0 += VECTORS * W) { /* a pass over VECTORS * W of the panel's columns */
        vec acc[MAX_ROWS][VECTORS];
#pragma GCC unroll 8
        for (int i = 0; i < R; i++)
#pragma GCC unroll 3
            for (int j = 0; j < VECTORS; j++) acc[i][j] = (vec){};
        const char *wd = w + c0 * esize;
        for (int64_t d = 0; d < g->k; d++, wd += PANEL * esize) {
            for (int u = 0; u < ahead.per && ahead.at < ahead.end; u++, ahead.at += 64) __builtin_prefetch(ahead.at, 0, 2);
            vec wv[VECTORS];
#pragma GCC unroll 3
            for (int j = 0; j < VECTORS; j++) wv[j] = NAME(load)(wd, j * W, bf16);
#pragma GCC unroll 8
            for (int i = 0; i < R; i++) {
                const float xv = x[i * g->x_stride + d];
#pragma GCC unroll 3
                for (int j = 0; j < VECTORS; j++) acc[i][j] += xv * wv[j];
            }
        }
        ahead.per = 0; /* the first pass asked for the next panel */
        for (int i = 0; i < R; i++) {
            char *row = y + i * g->y_stride * esize;
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
}

