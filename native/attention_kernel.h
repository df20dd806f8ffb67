/*
 * The kernel body at one vector width W (8 or 16 floats): attention.c
 * includes it once per width, and compiles each for its instruction sets.
 * The head dimension goes W lanes at a time.
 */
#include "vectors.h"

/* lanes 0-7 plus lanes 8-15 */
INLINE v8f NAME(fold)(vec x) {
#if W == 8
    return x;
#else
    return __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
}

#if W == 16
/* Paired (AVX512-BF16, over bfloat16 K/V): QK and PV on vdpbf16ps (vector_math.h's dot2): the queries in
 * bfloat16 as given (the scale multiplies the scores), K rows as stored, V rows two at a time, interleaved,
 * against the probabilities rounded to bfloat16. */

/* Elements d .. d + 31 of a bfloat16 row of D (zeros past D; d + 16 <= D). */
INLINE bf32 pairs_at(const void *row, int64_t d, int64_t D) {
    const uint16_t *x = (const uint16_t *)row + d;
    if (d + 32 <= D) return *(const bf32_u *)x;
    return __builtin_shufflevector(*(const bf16v_u *)x, (bf16v_u){}, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,
                                   15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
}

/* Lane l: a[l] and b[l], a pair. */
INLINE bf32 interleave(bf16v_u a, bf16v_u b) {
    return __builtin_shufflevector(a, b, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26,
                                   11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
}

#endif

#define DV (W == 16 ? 4 : 2) /* V vectors a query holds in registers: 16 accumulators at four queries */
#define QG (W == 16 ? 3 : 1)  /* queries block_scores takes at once: 8 accumulators each, in 32 or 16 registers */

/* acc[i][d..] += Σ_t p_it · v_t[d..] for n queries and nv vectors of dims (constants, the
 * accumulators in registers); p_it is p[i * BLOCK + t].  With `ahead`, row t of the next block
 * is prefetched beside each V row read. */
INLINE void NAME(accumulate_at)(float (*acc)[MAX_HEAD_DIM], const float *p, const char *v, int64_t vrow, int nb,
                                int64_t d, const int n, const int nv, int bf16, const Ahead *ahead) {
    vec o[4][DV];
#pragma GCC unroll 4
    for (int i = 0; i < n; i++)
#pragma GCC unroll 4
        for (int k = 0; k < nv; k++) o[i][k] = *(vec *)&acc[i][d + k * W];
    for (int t = 0; t < nb; t++) {
        const char *row = v + t * vrow;
        if (ahead && t < ahead->rows) fetch_row(ahead, t);
        vec x[DV];
#pragma GCC unroll 4
        for (int k = 0; k < nv; k++) x[k] = NAME(load)(row, d + k * W, bf16);
#pragma GCC unroll 4
        for (int i = 0; i < n; i++)
#pragma GCC unroll 4
            for (int k = 0; k < nv; k++) o[i][k] += p[i * BLOCK + t] * x[k];
    }
#pragma GCC unroll 4
    for (int i = 0; i < n; i++)
#pragma GCC unroll 4
        for (int k = 0; k < nv; k++) *(vec *)&acc[i][d + k * W] = o[i][k];
}

/* acc[i] += Σ_t p_it · v_t for n (a constant) queries, DV·W dims at a time (the first pass
 * prefetching `ahead`). */
INLINE void NAME(accumulate)(float (*acc)[MAX_HEAD_DIM], const float *p, const char *v, int64_t vrow, int nb,
                             int64_t D, const int n, int bf16, const Ahead *ahead) {
    int64_t d = 0;
    for (; d + DV * W <= D; d += DV * W, ahead = NULL) NAME(accumulate_at)(acc, p, v, vrow, nb, d, n, DV, bf16, ahead);
    for (; d < D; d += W, ahead = NULL) NAME(accumulate_at)(acc, p, v, vrow, nb, d, n, 1, bf16, ahead);
}

#if W == 16
/* accumulate_at, paired: V rows t and t + 1 interleaved against the probabilities pb[i][t], pb[i][t + 1] (a
 * row past nb: zeros, never read). */
INLINE void accumulate_pairs_at(float (*acc)[MAX_HEAD_DIM], const uint16_t (*pb)[BLOCK], const char *v,
                                int64_t vrow, int nb, int64_t d, const int n, const int nv, const Ahead *ahead) {
    vec o[4][DV];
#pragma GCC unroll 4
    for (int i = 0; i < n; i++)
#pragma GCC unroll 4
        for (int k = 0; k < nv; k++) o[i][k] = *(vec *)&acc[i][d + k * W];
    for (int t = 0; t < nb; t += 2) {
        const uint16_t *a = (const uint16_t *)(v + t * vrow) + d, *b = (const uint16_t *)(v + (t + 1) * vrow) + d;
        if (ahead && t < ahead->rows) fetch_row(ahead, t);
        if (ahead && t + 1 < ahead->rows) fetch_row(ahead, t + 1);
        bf32 x[DV];
#pragma GCC unroll 4
        for (int k = 0; k < nv; k++)
            x[k] = interleave(*(const bf16v_u *)(a + k * W), t + 1 < nb ? *(const bf16v_u *)(b + k * W) : (bf16v_u){});
#pragma GCC unroll 4
        for (int i = 0; i < n; i++) {
            const bf32 p = broadcast_pair(&pb[i][t]);
#pragma GCC unroll 4
            for (int k = 0; k < nv; k++) o[i][k] = dot2(o[i][k], p, x[k]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < n; i++)
#pragma GCC unroll 4
        for (int k = 0; k < nv; k++) *(vec *)&acc[i][d + k * W] = o[i][k];
}

INLINE void accumulate_pairs(float (*acc)[MAX_HEAD_DIM], const uint16_t (*pb)[BLOCK], const char *v, int64_t vrow,
                             int nb, int64_t D, const int n, const Ahead *ahead) {
    int64_t d = 0;
    for (; d + DV * W <= D; d += DV * W, ahead = NULL) accumulate_pairs_at(acc, pb, v, vrow, nb, d, n, DV, ahead);
    for (; d < D; d += W, ahead = NULL) accumulate_pairs_at(acc, pb, v, vrow, nb, d, n, 1, ahead);
}
#endif

/* The tile's queries in lanes: QV vectors of W hold its TILE queries. */
#define QV (TILE / W)
#define ROWS (W == 16 ? 16 / QV : 8 / QV) /* K rows a call of scores() takes: 16 or 8 accumulators */

/* s[u] = K row u · each of the tile's queries (in lanes) for n (a constant) rows: each K value is
 * broadcast against the queries transposed, so no score needs a horizontal sum. */
INLINE void NAME(scores)(vec (*s)[QV], const float (*qt)[TILE], const char *k, int64_t krow, int64_t D,
                         const int n) {
    vec dot[ROWS][QV] = {};
    for (int64_t d = 0; d < D; d++) {
        vec q[QV];
        for (int v = 0; v < QV; v++) q[v] = *(const vec *)&qt[d][v * W];
#pragma GCC unroll 8
        for (int u = 0; u < n; u++) {
            const float x = ((const float *)(k + u * krow))[d];
            for (int v = 0; v < QV; v++) dot[u][v] += q[v] * x;
        }
    }
    for (int u = 0; u < n; u++)
        for (int v = 0; v < QV; v++) s[u][v] = dot[u][v];
}

/* A block's probabilities p[t][i] from its scores s[t] with the tile's queries in lanes (prefill chunks:
 * many queries a tile): scores masked to the rows each query reads, then the online softmax's max, sum
 * and rescale a vector of queries at a time.  Lanes past nq compute what they will: nothing reads them. */
INLINE void NAME(softmax_across)(Online *o, int nq, vec (*s)[QV], int64_t b0, int nb, float (*p)[TILE],
                                  float *corr) {
    int t;
    const vec none = (vec){} - __builtin_inff(), one = (vec){} + 1.0f;
    const int partial = b0 < o->lo_max || b0 + nb > o->hi_min;  /* some query reads only some rows */
    if (partial)
        for (int i = 0; i < nq; i++)
            for (t = 0; t < nb; t++)
                if (b0 + t < o->qlo[i] || b0 + t >= o->qhi[i]) s[t][i / W][i % W] = -__builtin_inff();
    for (int v = 0; v < QV; v++) {
        vec top = none;
        for (t = 0; t < nb; t++) top = blend(s[t][v] > top, s[t][v], top);
        vec m = *(vec *)&o->m[v * W], best = blend(top > m, top, m), sum = {};
        for (t = 0; t < nb; t++) {
            vec x = vexp(s[t][v] - best);
            if (partial) x = blend(s[t][v] > none, x, (vec){});
            *(vec *)&p[t][v * W] = x;
            sum += x;
        }
        vec c = blend(best > m, vexp(m - best), one);
        *(vec *)&o->m[v * W] = best;
        *(vec *)&o->l[v * W] = *(vec *)&o->l[v * W] * c + sum;
        *(vec *)&corr[v * W] = c;
    }
}

/* softmax_across of a block's scores, each K value broadcast against the queries. */
INLINE void NAME(probs_across)(Online *o, int nq, const char *kf, int64_t kfrow, int64_t b0, int nb, int64_t D,
                               float (*p)[TILE], float *corr) {
    vec s[BLOCK][QV];
    int t = 0;
    for (; t + ROWS <= nb; t += ROWS) NAME(scores)(s + t, o->qt, kf + t * kfrow, kfrow, D, ROWS);
    for (; t < nb; t++) NAME(scores)(s + t, o->qt, kf + t * kfrow, kfrow, D, 1);
    NAME(softmax_across)(o, nq, s, b0, nb, p, corr);
}

#define DT (W == 16 ? 8 : 2) /* dimensions accumulate_across holds in registers: 16 or 8 accumulators */

/* acct[d][i] = acct[d][i] · corr[i] + Σ_t p[t][i] · v_t[d] for the n (a constant) dimensions from d0, the tile's
 * queries in lanes: each V value broadcast against the queries' probabilities, as scores() does K's. */
INLINE void NAME(accumulate_across_at)(float (*acct)[TILE], const float (*p)[TILE], const float *corr, const char *v,
                                       int64_t vrow, int nb, int64_t d0, const int n, int bf16) {
    vec a[DT][QV];
    for (int k = 0; k < n; k++)
        for (int x = 0; x < QV; x++) a[k][x] = *(const vec *)&acct[d0 + k][x * W] * *(const vec *)&corr[x * W];
    for (int t = 0; t < nb; t++) {
        const char *row = v + t * vrow;
        vec pv[QV];
        for (int x = 0; x < QV; x++) pv[x] = *(const vec *)&p[t][x * W];
#pragma GCC unroll 8
        for (int k = 0; k < n; k++) {
            const float e = scalar(row, d0 + k, bf16);
            for (int x = 0; x < QV; x++) a[k][x] += e * pv[x];
        }
    }
    for (int k = 0; k < n; k++)
        for (int x = 0; x < QV; x++) *(vec *)&acct[d0 + k][x * W] = a[k][x];
}

/* The online softmax's step over a block for a prefill tile: its running output rescaled by corr and p · V added
 * (D: a multiple of 16). */
INLINE void NAME(accumulate_across)(float (*acct)[TILE], const float (*p)[TILE], const float *corr, const char *v,
                                    int64_t vrow, int nb, int64_t D, int bf16) {
    for (int64_t d = 0; d < D; d += DT) NAME(accumulate_across_at)(acct, p, corr, v, vrow, nb, d, DT, bf16);
}

#if W == 16
/* Paired prefill tiles (AVX512-BF16, over bfloat16 K/V; AMX CPUs where a tile's head dimension is no multiple of
 * 32): the queries in lanes as pairs of dimensions (qp), each K pair broadcast against them; then the
 * probabilities, rounded to bfloat16, paired along the rows against V's rows interleaved two by two, each pair of
 * V values broadcast.  Half the instructions of widening to float32, and K and V read as stored. */

/* s[u] = K row u · each of the tile's queries, times the scale, for n (a constant) rows. */
INLINE void scores_pairs(vec (*s)[QV], const Online *o, const char *k, int64_t krow, int64_t D, const int n) {
    vec dot[ROWS][QV] = {};
    for (int64_t e = 0; e < D / 2; e++) {
        bf32 q[QV];
        for (int v = 0; v < QV; v++) q[v] = *(const bf32 *)&o->qp[e][2 * v * W];
#pragma GCC unroll 8
        for (int u = 0; u < n; u++) {
            const uint16_t *pair = (const uint16_t *)(k + u * krow) + 2 * e;
            for (int v = 0; v < QV; v++) dot[u][v] = dot2_broadcast(dot[u][v], q[v], pair);
        }
    }
    for (int u = 0; u < n; u++)
        for (int v = 0; v < QV; v++) s[u][v] = dot[u][v] * o->scale;
}

/* pp[j][i]: query i's probabilities of rows 2j and 2j + 1 in bfloat16, a pair (zeros past nb). */
INLINE void probability_pairs(const float (*p)[TILE], int nb, uint32_t (*pp)[TILE]) {
    for (int j = 0; j < BLOCK / 2; j++)
        for (int x = 0; x < QV; x++) {
            const vec lo = 2 * j < nb ? *(const vec *)&p[2 * j][x * W] : (vec){},
                      hi = 2 * j + 1 < nb ? *(const vec *)&p[2 * j + 1][x * W] : (vec){};
            *(vecu *)&pp[j][x * W] = NAME(bf16_bits)(lo) | NAME(bf16_bits)(hi) << 16;
        }
}

/* vb[c][j]: dimensions 16c .. 16c + 15 of V rows 2j and 2j + 1, interleaved (zeros past nb). */
INLINE void row_pairs(const char *v, int64_t vrow, int nb, int64_t D, bf32 (*vb)[BLOCK / 2]) {
    for (int j = 0; j < BLOCK / 2; j++) {
        const uint16_t *a = (const uint16_t *)(v + 2 * j * vrow), *b = (const uint16_t *)(v + (2 * j + 1) * vrow);
        for (int64_t c = 0; c < D / 16; c++)
            vb[c][j] = interleave(2 * j < nb ? *(const bf16v_u *)(a + 16 * c) : (bf16v_u){},
                                  2 * j + 1 < nb ? *(const bf16v_u *)(b + 16 * c) : (bf16v_u){});
    }
}

/* acct[d][i] = acct[d][i] · corr[i] + Σ_j pp[j][i] · (V rows 2j and 2j + 1 at d) for the n (a constant) dimensions
 * from d0 (d0 a multiple of n, n of 16), over `pairs` pairs of rows (probability_pairs, row_pairs). */
INLINE void accumulate_pairs_across_at(float (*acct)[TILE], const uint32_t (*pp)[TILE], const float *corr,
                                       const bf32 (*vb)[BLOCK / 2], int pairs, int64_t d0, const int n) {
    vec a[DT][QV];
    for (int k = 0; k < n; k++)
        for (int x = 0; x < QV; x++) a[k][x] = *(const vec *)&acct[d0 + k][x * W] * *(const vec *)&corr[x * W];
    for (int j = 0; j < pairs; j++) {
        bf32 pv[QV];
        for (int x = 0; x < QV; x++) pv[x] = (bf32)*(const vecu *)&pp[j][x * W];
        const uint16_t *row = (const uint16_t *)&vb[d0 / 16][j] + 2 * (d0 % 16);
#pragma GCC unroll 8
        for (int k = 0; k < n; k++)
            for (int x = 0; x < QV; x++) a[k][x] = dot2_broadcast(a[k][x], pv[x], row + 2 * k);
    }
    for (int k = 0; k < n; k++)
        for (int x = 0; x < QV; x++) *(vec *)&acct[d0 + k][x * W] = a[k][x];
}

/* A prefill tile's step over a block of nb rows, paired: scores, the online softmax, and p · V. */
INLINE void block_pairs(Online *o, int nq, const char *k, int64_t krow, const char *v, int64_t vrow, int64_t b0,
                        int nb, int64_t D) {
    vec s[BLOCK][QV];
    int t = 0;
    for (; t + ROWS <= nb; t += ROWS) scores_pairs(s + t, o, k + t * krow, krow, D, ROWS);
    for (; t < nb; t++) scores_pairs(s + t, o, k + t * krow, krow, D, 1);
    float p[BLOCK][TILE] __attribute__((aligned(64))), corr[TILE] __attribute__((aligned(64)));
    NAME(softmax_across)(o, nq, s, b0, nb, p, corr);

    uint32_t pp[BLOCK / 2][TILE] __attribute__((aligned(64)));
    bf32 vb[MAX_HEAD_DIM / 16][BLOCK / 2];
    probability_pairs((const float (*)[TILE])p, nb, pp);
    row_pairs(v, vrow, nb, D, vb);
    for (int64_t d = 0; d < D; d += DT)
        accumulate_pairs_across_at(o->acct, (const uint32_t (*)[TILE])pp, corr, (const bf32 (*)[BLOCK / 2])vb,
                                   (nb + 1) / 2, d, DT);
}

/* AMX (`tiles`: over bfloat16 K/V, the head dimension a multiple of 32).  A prefill chunk's tile (over 16
 * queries), a block at a time: its scores as S^T = K·Q^T, K's rows loaded into tiles as stored against the
 * queries paired along the head dimension (qk, made once a tile), then acc += P·V, the probabilities paired
 * along the rows against V's rows interleaved two by two; a decode tile, its scores alone (scores_tiles).
 * Tile registers, each 16 rows of 64 bytes: 0-3 the scores (rows × queries, by halves) and then the output,
 * 4 K or V (and 7 V), 5 and 6 each half's queries or probabilities. */
#define TILE_LOAD(n, at, stride) \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #n ::"r"(at), "r"((int64_t)(stride)) : "memory")
#define TILE_STORE(n, at, stride) \
    __asm__ volatile("tilestored %%tmm" #n ", (%0,%1,1)" ::"r"(at), "r"((int64_t)(stride)) : "memory")
#define TILE_ZERO(n) __asm__ volatile("tilezero %%tmm" #n ::)
#define TILE_DOT(c, a, b) __asm__ volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

INLINE void tiles_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } config = {.palette = 1};
    for (int i = 0; i < 8; i++) {
        config.colsb[i] = 64;
        config.rows[i] = 16;
    }
    __asm__ volatile("ldtilecfg %0" ::"m"(config));
}

INLINE void tiles_release(void) { __asm__ volatile("tilerelease" ::: "memory"); }

/* qk[g][c][u][q]: query 16g + q's dimensions 32c + 2u and 32c + 2u + 1 (zeros past nq). */
INLINE void query_tiles(Online *o, int nq, int64_t D) {
    for (int g = 0; g < (nq > 16 ? 2 : 1); g++)
        for (int64_t c = 0; c < D / 32; c++)
            for (int u = 0; u < 16; u++)
                for (int q = 0, i = 16 * g; q < 16; q++, i++)
                    o->qk[g][c][u][q] =
                        i < nq ? o->qb[i][32 * c + 2 * u] | (uint32_t)o->qb[i][32 * c + 2 * u + 1] << 16 : 0;
}

/* s[t][q] = K row t · query q for a block of BLOCK rows at k (kstride bytes apart), the queries of `halves`
 * (1 or 2) of qk; the other half's columns zeros. */
INLINE void scores_transposed(const Online *o, const char *k, int64_t kstride, int64_t D, const int halves,
                              float (*s)[TILE]) {
    TILE_ZERO(0);
    TILE_ZERO(1);
    TILE_ZERO(2);
    TILE_ZERO(3);
    for (int64_t c = 0; c < D / 32; c++) {
        TILE_LOAD(5, o->qk[0][c], 64);
        if (halves == 2) TILE_LOAD(6, o->qk[1][c], 64);
        TILE_LOAD(4, k + c * 64, kstride);
        TILE_DOT(0, 4, 5);
        if (halves == 2) TILE_DOT(1, 4, 6);
        TILE_LOAD(4, k + 16 * kstride + c * 64, kstride);
        TILE_DOT(2, 4, 5);
        if (halves == 2) TILE_DOT(3, 4, 6);
    }
    TILE_STORE(0, &s[0][0], sizeof(s[0]));
    TILE_STORE(1, &s[0][16], sizeof(s[0]));
    TILE_STORE(2, &s[16][0], sizeof(s[0]));
    TILE_STORE(3, &s[16][16], sizeof(s[0]));
}

/* acc += softmax(scores) · V over a block of nb rows (staged: room for K's rows, zero-padded, where nb < BLOCK). */
INLINE void block_tiles(Online *o, int nq, const char *k0, int64_t krow, const char *v0, int64_t vrow, int64_t b0,
                        int nb, int64_t D, uint16_t (*staged)[MAX_HEAD_DIM]) {
    const char *k = k0;
    int64_t kstride = krow;
    if (nb < BLOCK) {  /* a tile reads 16 rows: none past nb */
        for (int t = 0; t < BLOCK; t++)
            if (t < nb)
                memcpy(staged[t], k0 + t * krow, D * 2);
            else
                memset(staged[t], 0, D * 2);
        k = (const char *)staged;
        kstride = sizeof(staged[0]);
    }
    float s[BLOCK][TILE] __attribute__((aligned(64)));
    scores_transposed(o, k, kstride, D, 2, s);
    vec(*scores)[QV] = (vec(*)[QV])s;
    for (int t = 0; t < nb; t++)
        for (int v = 0; v < QV; v++) scores[t][v] *= o->scale;
    float p[BLOCK][TILE] __attribute__((aligned(64))), corr[TILE] __attribute__((aligned(64)));
    NAME(softmax_across)(o, nq, scores, b0, nb, p, corr);
    rescale(o, nq, corr, D);

    /* pa[q][j]: query q's probabilities of rows 2j and 2j + 1 in bfloat16 (zeros past nb) */
    uint32_t pairs[BLOCK / 2][TILE] __attribute__((aligned(64))), pa[TILE][BLOCK / 2] __attribute__((aligned(64)));
    probability_pairs((const float (*)[TILE])p, nb, pairs);
    for (int q = 0; q < TILE; q++)
        for (int j = 0; j < BLOCK / 2; j++) pa[q][j] = pairs[j][q];
    bf32 vb[MAX_HEAD_DIM / 16][BLOCK / 2];
    row_pairs(v0, vrow, nb, D, vb);
    TILE_LOAD(5, pa[0], sizeof(pa[0]));
    TILE_LOAD(6, pa[16], sizeof(pa[0]));
    for (int64_t c = 0; c < D / 16; c += 2) {  /* two chunks of dimensions at once: four products in flight */
        float *a0 = &o->acc[0][16 * c], *a1 = &o->acc[16][16 * c];
        const int64_t stride = sizeof(o->acc[0]);
        TILE_LOAD(4, vb[c], 64);
        TILE_LOAD(7, vb[c + 1], 64);
        TILE_LOAD(0, a0, stride);
        TILE_LOAD(1, a1, stride);
        TILE_LOAD(2, a0 + 16, stride);
        TILE_LOAD(3, a1 + 16, stride);
        TILE_DOT(0, 5, 4);
        TILE_DOT(1, 6, 4);
        TILE_DOT(2, 5, 7);
        TILE_DOT(3, 6, 7);
        TILE_STORE(0, a0, stride);
        TILE_STORE(1, a1, stride);
        TILE_STORE(2, a0 + 16, stride);
        TILE_STORE(3, a1 + 16, stride);
    }
}
#endif

#if W == 16
/* block_scores of a decode tile's queries (16 at most) over a whole block, all at once on AMX tiles: S^T =
 * K·Q^T, then each query's column. */
INLINE void scores_tiles(const Online *o, int nq, const char *kf, int64_t kfrow, int64_t D, v8f (*s)[BLOCK / 8]) {
    float st[BLOCK][TILE] __attribute__((aligned(64)));
    scores_transposed(o, kf, kfrow, D, 1, st);
    for (int i = 0; i < nq; i++)
        for (int c = 0; c < BLOCK / 8; c++)
            for (int u = 0; u < 8; u++) s[i][c][u] = st[8 * c + u][i] * o->scale;
}
#endif

/* s[i][c] (lane u: the score of row 8c + u) for n (a constant, at most QG) queries from i0 over a
 * whole block, each K value loaded once for all of them. */
INLINE void NAME(block_scores)(const Online *o, int i0, const int n, const char *kf, int64_t kfrow, int64_t D,
                               v8f (*s)[BLOCK / 8], int paired) {
    for (int c = 0; c < BLOCK / 8; c++) {
        const char *rows = kf + 8 * c * kfrow;
        vec dot[QG][8] = {};
#if W == 16
        for (int64_t d = 0; paired && d < D; d += 2 * W) {
            bf32 qv[QG];
#pragma GCC unroll 3
            for (int i = 0; i < n; i++) qv[i] = *(const bf32 *)&o->qb[i0 + i][d];
#pragma GCC unroll 8
            for (int u = 0; u < 8; u++) {
                const bf32 x = pairs_at(rows + u * kfrow, d, D);
#pragma GCC unroll 3
                for (int i = 0; i < n; i++) dot[i][u] = dot2(dot[i][u], qv[i], x);
            }
        }
#endif
        for (int64_t d = 0; !paired && d < D; d += W) {
            vec qv[QG];
#pragma GCC unroll 3
            for (int i = 0; i < n; i++) qv[i] = *(const vec *)&o->qs[i0 + i][d];
#pragma GCC unroll 8
            for (int u = 0; u < 8; u++) {
                const vec x = NAME(load)(rows + u * kfrow, d, 0);
#pragma GCC unroll 3
                for (int i = 0; i < n; i++) dot[i][u] += qv[i] * x;
            }
        }
#pragma GCC unroll 3
        for (int i = 0; i < n; i++) {
            v8f folded[8];
#pragma GCC unroll 8
            for (int u = 0; u < 8; u++) folded[u] = NAME(fold)(dot[i][u]);
            s[i][c] = paired ? reduce8(folded) * o->scale : reduce8(folded);
        }
    }
}

/* A block's probabilities p[i][t] with the head dimension in lanes (decode: a tile holds only a
 * token's few query heads).  When every query reads the whole block they are scored QG at a time;
 * else each alone, the block's first or last rows row by row. */
INLINE void NAME(probs_each)(Online *o, int nq, const char *kf, int64_t kfrow, int64_t b0, int nb, int64_t D,
                             float (*p)[BLOCK], int paired, int tiles) {
    const v8i lanes = {0, 1, 2, 3, 4, 5, 6, 7};
    const v8f none = (v8f){} - __builtin_inff();
    enum { CHUNKS = BLOCK / 8 };
    v8f scores[ACROSS][CHUNKS];
    int whole = nb == BLOCK;  /* every query reads every row of the block */
    for (int i = 0; i < nq && whole; i++) whole = o->qlo[i] <= b0 && o->qhi[i] >= b0 + BLOCK;
#if W == 16
    if (whole && tiles) scores_tiles(o, nq, kf, kfrow, D, scores);
#endif
    if (whole && !tiles) {
        int i = 0;
        for (; i + QG <= nq; i += QG) NAME(block_scores)(o, i, QG, kf, kfrow, D, scores + i, paired);
        for (; i < nq; i++) NAME(block_scores)(o, i, 1, kf, kfrow, D, scores + i, paired);
    }
    for (int i = 0; i < nq; i++) {
        int a = o->qlo[i] > b0 ? (int)(o->qlo[i] - b0) : 0, e = o->qhi[i] - b0 < nb ? (int)(o->qhi[i] - b0) : nb;
        v8f *s = scores[i];
        if (a >= e) {
            for (int c = 0; c < CHUNKS; c++) *(v8f *)&p[i][8 * c] = (v8f){};
            continue;
        }
        if (!whole && a == 0 && e == BLOCK) {
            NAME(block_scores)(o, i, 1, kf, kfrow, D, scores + i, paired);
        } else if (!whole) { /* the block's first or last rows: one at a time, -inf for the rest */
            for (int c = 0; c < CHUNKS; c++) s[c] = none;
            for (int t = a; t < e; t++) {
                vec dot = {};
#if W == 16
                for (int64_t d = 0; paired && d < D; d += 2 * W)
                    dot = dot2(dot, *(const bf32 *)&o->qb[i][d], pairs_at(kf + t * kfrow, d, D));
#endif
                for (int64_t d = 0; !paired && d < D; d += W)
                    dot += *(const vec *)&o->qs[i][d] * NAME(load)(kf + t * kfrow, d, 0);
                s[t / 8][t % 8] = paired ? hsum(NAME(fold)(dot)) * o->scale : hsum(NAME(fold)(dot));
            }
        }
        v8f top = s[0];
        for (int c = 1; c < CHUNKS; c++) top = blend(s[c] > top, s[c], top);
        float best = hmax(top);
        if (best > o->m[i]) {
            float corr = vexp((v8f){} + (o->m[i] - best))[0];
            for (int64_t d = 0; d < D; d++) o->acc[i][d] *= corr;
            o->l[i] *= corr;
            o->m[i] = best;
        }
        v8f sum = {};
        for (int c = 0; c < CHUNKS; c++) {
            v8f x = vexp(s[c] - o->m[i]);
            if (a != 0 || e != BLOCK) {
                v8i at = lanes + 8 * c;
                x = blend((at >= (v8i){} + a) & (at < (v8i){} + e), x, (v8f){});
            }
            *(v8f *)&p[i][8 * c] = x;
            sum += x;
        }
        o->l[i] += hsum(sum);
    }
}

/* One split of a tile: online softmax over rows [item->lo, item->hi); with `paired` (bf16 too) on vdpbf16ps, and
 * with `amx` a decode split's scores of whole blocks and a prefill chunk's blocks on AMX tiles. */
INLINE void NAME(run_item)(const Call *c, const Item *item, int bf16, int paired, int amx) {
    const Tile *tile = item->tile;
    const int64_t *r = c->reqs + tile->req * REQ_FIELDS;
    const int64_t D = c->D, G = c->G, esize = bf16 ? 2 : 4;
    const int nq = tile->nq, across = nq > ACROSS, tiles = amx && D % 32 == 0;  /* AMX: whole blocks */
    const char *kbase = c->k + (r[REQ_SLOT] * c->k_slot + tile->head * c->k_head) * esize;
    const char *vbase = c->v + (r[REQ_SLOT] * c->v_slot + tile->head * c->v_head) * esize;
    const int64_t krow = c->k_row * esize, vrow = c->v_row * esize;

    Online o;
    float kblock[BLOCK][MAX_HEAD_DIM] __attribute__((aligned(64)));  /* bfloat16 K, converted */
    float p[TILE * BLOCK] __attribute__((aligned(64)));  /* across: [BLOCK][TILE], else [TILE][BLOCK] */
    uint16_t pb[TILE][BLOCK] __attribute__((aligned(64)));  /* paired: p in bfloat16 */
    for (int i = 0; i < TILE; i++) {  /* lanes past nq read no rows */
        o.m[i] = -__builtin_inff();
        o.l[i] = 0;
        o.qlo[i] = o.qhi[i] = 0;
    }
    for (int i = 0; i < nq; i++) {
        int64_t j = tile->j0 + i, token = r[REQ_Q_FIRST] + j / G, head = tile->head * G + j % G;
        const char *row = c->q + (token * c->q_token + head * c->q_head) * esize;
        if (paired || tiles) {  /* zeros past D to a multiple of 32, as pairs_at reads K (D: a multiple of 16) */
            memcpy(o.qb[i], row, D * esize);
            memset(o.qb[i] + D, 0, (D % 32) * esize);
        } else {
            for (int64_t d = 0; d < D; d++) o.qs[i][d] = scalar(row, d, bf16) * c->scale;
        }
        if (!across) memset(o.acc[i], 0, D * sizeof(float));
        query_rows(c, r, j, &o.qlo[i], &o.qhi[i]);
    }
    if (across && tiles) memset(o.acc, 0, TILE * sizeof(o.acc[0]));  /* tiles compute every row */
    if (across && !tiles) memset(o.acct, 0, D * sizeof(o.acct[0]));
    o.scale = c->scale;
    o.lo_max = 0;
    o.hi_min = INT64_MAX;
    for (int i = 0; i < nq; i++) {
        o.lo_max = o.qlo[i] > o.lo_max ? o.qlo[i] : o.lo_max;
        o.hi_min = o.qhi[i] < o.hi_min ? o.qhi[i] : o.hi_min;
    }
#if W == 16
    if (tiles) query_tiles(&o, nq, D);
#endif
    if (across && !tiles && !paired)
        for (int64_t d = 0; d < D; d++)
            for (int i = 0; i < TILE; i++) o.qt[d][i] = i < nq ? o.qs[i][d] : 0;
    if (across && !tiles && paired)
        for (int64_t e = 0; e < D / 2; e++)
            for (int i = 0; i < TILE; i++) {
                o.qp[e][2 * i] = i < nq ? o.qb[i][2 * e] : 0;
                o.qp[e][2 * i + 1] = i < nq ? o.qb[i][2 * e + 1] : 0;
            }

    if (!across) {  /* a decode split reads each row once: its first block is fetched now, each next one ahead */
        const Ahead first = {kbase + item->lo * krow, vbase + item->lo * vrow, krow, vrow, D * esize,
                             (int)(item->hi - item->lo < BLOCK ? item->hi - item->lo : BLOCK)};
        for (int t = 0; t < first.rows; t++) fetch_row(&first, t);
    }
    for (int64_t b0 = item->lo; b0 < item->hi; b0 += BLOCK) {
        const int nb = (int)(item->hi - b0 < BLOCK ? item->hi - b0 : BLOCK);
        const char *k0 = kbase + b0 * krow, *v0 = vbase + b0 * vrow;
#if W == 16
        if (tiles && across) {
            block_tiles(&o, nq, k0, krow, v0, vrow, b0, nb, D, (uint16_t (*)[MAX_HEAD_DIM])kblock);
            continue;
        }
        if (paired && across) {
            block_pairs(&o, nq, k0, krow, v0, vrow, b0, nb, D);
            continue;
        }
#endif
        /* the block's K rows as float32: bfloat16 ones converted once for all the queries */
        const char *kf = k0;
        int64_t kfrow = krow;
        if (bf16 && !paired) {
            for (int t = 0; t < nb; t++)
                for (int64_t d = 0; d < D; d += W) *(vec *)&kblock[t][d] = NAME(load)(k0 + t * krow, d, 1);
            kf = (const char *)kblock;
            kfrow = sizeof(kblock[0]);
        }
        if (across) {  /* no prefetching: the many tiles of a prefill chunk find its rows in the cache */
            float corr[TILE] __attribute__((aligned(64)));
            NAME(probs_across)(&o, nq, kf, kfrow, b0, nb, D, (float (*)[TILE])p, corr);
            NAME(accumulate_across)(o.acct, (const float (*)[TILE])p, corr, v0, vrow, nb, D, bf16);
            continue;
        }
        NAME(probs_each)(&o, nq, kf, kfrow, b0, nb, D, (float (*)[BLOCK])p, paired, tiles);
        const int64_t after = item->hi - b0 - nb;  /* rows past this block */
        const Ahead next = {k0 + nb * krow, v0 + nb * vrow, krow, vrow, D * esize,
                            (int)(after < BLOCK ? after : BLOCK)};
        const Ahead *fetch = next.rows > 0 ? &next : NULL;
#if W == 16
        if (paired) {  /* p in bfloat16: rows of BLOCK, zeros past nb (probs_each) */
            for (int i = 0; i < nq; i++)
                for (int t = 0; t < BLOCK; t += W) NAME(put)(pb[i], t, *(const vec *)&p[i * BLOCK + t], 1);
            int i0 = 0;
            for (; i0 + 4 <= nq; i0 += 4, fetch = NULL)
                accumulate_pairs(o.acc + i0, pb + i0, v0, vrow, nb, D, 4, fetch);
            switch (nq - i0) {
                case 3: accumulate_pairs(o.acc + i0, pb + i0, v0, vrow, nb, D, 3, fetch); break;
                case 2: accumulate_pairs(o.acc + i0, pb + i0, v0, vrow, nb, D, 2, fetch); break;
                case 1: accumulate_pairs(o.acc + i0, pb + i0, v0, vrow, nb, D, 1, fetch); break;
            }
            continue;
        }
#endif
        /* acc += p · V, four queries at a time */
        int i0 = 0;
        for (; i0 + 4 <= nq; i0 += 4, fetch = NULL)
            NAME(accumulate)(o.acc + i0, p + i0 * BLOCK, v0, vrow, nb, D, 4, bf16, fetch);
        switch (nq - i0) {
            case 3: NAME(accumulate)(o.acc + i0, p + i0 * BLOCK, v0, vrow, nb, D, 3, bf16, fetch); break;
            case 2: NAME(accumulate)(o.acc + i0, p + i0 * BLOCK, v0, vrow, nb, D, 2, bf16, fetch); break;
            case 1: NAME(accumulate)(o.acc + i0, p + i0 * BLOCK, v0, vrow, nb, D, 1, bf16, fetch); break;
        }
    }

    if (tile->splits > 1) {  /* max, sum, acc of this split, merged by merge() */
        float *part = tile->partial + item->split * nq * (D + 2);
        memcpy(part, o.m, nq * sizeof(float));
        memcpy(part + nq, o.l, nq * sizeof(float));
        for (int i = 0; i < nq; i++)
            for (int64_t d = 0; d < D; d++) part[2 * nq + i * D + d] = output(&o, i, d, across && !tiles);
        return;
    }
    for (int i = 0; i < nq; i++) {
        int64_t j = tile->j0 + i, token = r[REQ_Q_FIRST] + j / G, head = tile->head * G + j % G;
        char *row = c->out + (token * c->out_token + head * c->out_head) * esize;
        float inv = 1.0f / o.l[i];
        for (int64_t d = 0; d < D; d++) store(row, d, output(&o, i, d, across && !tiles) * inv, bf16);
    }
}

/* The items, taken in turn; `paired`: bfloat16 ones on vdpbf16ps, and with `amx` on AMX tiles where they fill. */
INLINE void NAME(run_items)(Call *c, const int paired, const int amx) {
    const int bf16 = c->bf16;
#if W == 16
    if (bf16 && amx) tiles_configure();
#endif
    for (long i; (i = atomic_fetch_add(&c->next, 1)) < c->num_items;) {
        if (bf16 && amx)
            NAME(run_item)(c, &c->items[i], 1, 1, 1);
        else if (bf16 && paired)
            NAME(run_item)(c, &c->items[i], 1, 1, 0);
        else if (bf16)
            NAME(run_item)(c, &c->items[i], 1, 0, 0);
        else
            NAME(run_item)(c, &c->items[i], 0, 0, 0);
    }
#if W == 16
    if (bf16 && amx) tiles_release();
#endif
}


#undef QV
#undef DT
#undef QG
#undef DV
#undef ROWS
