/*
 * The kernel body at one vector width W (8 or 16 floats): attention.c
 * includes it once per width, and compiles each for its instruction sets.
 * The head dimension goes W lanes at a time.
 */
#define GLUE(a, b) a##b
#define WIDE(a, b) GLUE(a, b)
#define NAME(x) WIDE(x, WIDE(_w, W))
#define vec NAME(vec)
#define veci NAME(veci)
#define vec_u NAME(vec_u)
#define vech_u NAME(vech_u)

typedef float vec __attribute__((vector_size(4 * W)));
typedef int32_t veci __attribute__((vector_size(4 * W)));
typedef float vec_u __attribute__((vector_size(4 * W), aligned(1)));
typedef uint16_t vech_u __attribute__((vector_size(2 * W), aligned(1)));

INLINE vec NAME(load)(const void *row, int64_t d, int bf16) {
    if (!bf16) return *(const vec_u *)((const float *)row + d);
    veci wide = __builtin_convertvector(*(const vech_u *)((const uint16_t *)row + d), veci) << 16;
    return (vec)wide;
}

/* lanes 0-7 plus lanes 8-15 */
INLINE v8f NAME(fold)(vec x) {
#if W == 8
    return x;
#else
    return __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
}

/* acc[i] += Σ_t p[i][t] · v_t for n (a constant) queries, 2W dims at a time in registers. */
INLINE void NAME(accumulate)(float (*acc)[MAX_HEAD_DIM], const float (*p)[BLOCK], const char *v, int64_t vrow,
                             int nb, int64_t D, const int n, int bf16) {
    for (int64_t d = 0; d < D; d += 2 * W) {
        const int two = d + 2 * W <= D;
        vec o[4][2];
#pragma GCC unroll 4
        for (int i = 0; i < n; i++) {
            o[i][0] = *(vec *)&acc[i][d];
            o[i][1] = two ? *(vec *)&acc[i][d + W] : (vec){};
        }
        for (int t = 0; t < nb; t++) {
            const char *row = v + t * vrow;
            vec x0 = NAME(load)(row, d, bf16), x1 = two ? NAME(load)(row, d + W, bf16) : (vec){};
#pragma GCC unroll 4
            for (int i = 0; i < n; i++) {
                o[i][0] += p[i][t] * x0;
                o[i][1] += p[i][t] * x1;
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < n; i++) {
            *(vec *)&acc[i][d] = o[i][0];
            if (two) *(vec *)&acc[i][d + W] = o[i][1];
        }
    }
}

/* One split of a tile: online softmax over rows [item->lo, item->hi). */
INLINE void NAME(run_item)(const Call *c, const Item *item, int bf16) {
    const Tile *tile = item->tile;
    const int64_t *r = c->reqs + tile->req * REQ_FIELDS;
    const int64_t D = c->D, G = c->G, esize = bf16 ? 2 : 4;
    const int nq = tile->nq;
    const char *kbase = c->k + (r[REQ_SLOT] * c->k_slot + tile->head * c->k_head) * esize;
    const char *vbase = c->v + (r[REQ_SLOT] * c->v_slot + tile->head * c->v_head) * esize;
    const int64_t krow = c->k_row * esize, vrow = c->v_row * esize;

    float qs[TILE][MAX_HEAD_DIM] __attribute__((aligned(64)));
    float acc[TILE][MAX_HEAD_DIM] __attribute__((aligned(64)));
    float kblock[BLOCK][MAX_HEAD_DIM] __attribute__((aligned(64)));  /* bfloat16 K, converted */
    float p[TILE][BLOCK] __attribute__((aligned(32)));
    float m[TILE], l[TILE];
    int64_t qlo[TILE], qhi[TILE];
    for (int i = 0; i < nq; i++) {
        int64_t j = tile->j0 + i, token = r[REQ_Q_FIRST] + j / G, head = tile->head * G + j % G;
        const char *row = c->q + (token * c->q_token + head * c->q_head) * esize;
        for (int64_t d = 0; d < D; d++) qs[i][d] = scalar(row, d, bf16) * c->scale;
        memset(acc[i], 0, D * sizeof(float));
        m[i] = -__builtin_inff();
        l[i] = 0;
        query_rows(c, r, j, &qlo[i], &qhi[i]);
    }

    const v8i lanes = {0, 1, 2, 3, 4, 5, 6, 7};
    const v8f none = (v8f){} - __builtin_inff();
    enum { CHUNKS = BLOCK / 8 };
    for (int64_t b0 = item->lo; b0 < item->hi; b0 += BLOCK) {
        const int nb = (int)(item->hi - b0 < BLOCK ? item->hi - b0 : BLOCK);
        const char *k0 = kbase + b0 * krow, *v0 = vbase + b0 * vrow;
        /* the block's K rows as float32: bfloat16 ones converted once for all the queries */
        const char *kf = k0;
        int64_t kfrow = krow;
        if (bf16) {
            for (int t = 0; t < nb; t++)
                for (int64_t d = 0; d < D; d += W) *(vec *)&kblock[t][d] = NAME(load)(k0 + t * krow, d, 1);
            kf = (const char *)kblock;
            kfrow = sizeof(kblock[0]);
        }
        const int ahead = b0 + 2 * BLOCK <= item->hi;  /* prefetch the next block's K rows */
        for (int t = 0; t < nb; t++) prefetch_row(v0 + t * vrow, D * esize);
        /* scores, then probabilities, of the rows each query may read, eight at a time */
        for (int i = 0; i < nq; i++) {
            int a = qlo[i] > b0 ? (int)(qlo[i] - b0) : 0, e = qhi[i] - b0 < nb ? (int)(qhi[i] - b0) : nb;
            v8f s[CHUNKS];
            if (a >= e) {
                for (int c = 0; c < CHUNKS; c++) *(v8f *)&p[i][8 * c] = (v8f){};
                continue;
            }
            if (a == 0 && e == BLOCK) {
                for (int c = 0; c < CHUNKS; c++) {
                    const char *rows = kf + 8 * c * kfrow;
                    vec dot[8] = {};
                    for (int64_t d = 0; d < D; d += W) {
                        vec qv = *(const vec *)&qs[i][d];
#pragma GCC unroll 8
                        for (int u = 0; u < 8; u++) dot[u] += qv * NAME(load)(rows + u * kfrow, d, 0);
                        if (i == 0 && ahead && !((d * esize) & 63))
                            for (int u = 0; u < 8; u++)
                                __builtin_prefetch(k0 + (8 * c + BLOCK + u) * krow + d * esize, 0, 2);
                    }
                    v8f folded[8];
#pragma GCC unroll 8
                    for (int u = 0; u < 8; u++) folded[u] = NAME(fold)(dot[u]);
                    s[c] = reduce8(folded);
                }
            } else {  /* the block's first or last rows: one at a time, -inf for the rest */
                for (int c = 0; c < CHUNKS; c++) s[c] = none;
                for (int t = a; t < e; t++) {
                    vec dot = {};
                    for (int64_t d = 0; d < D; d += W)
                        dot += *(const vec *)&qs[i][d] * NAME(load)(kf + t * kfrow, d, 0);
                    s[t / 8][t % 8] = hsum(NAME(fold)(dot));
                }
            }
            v8f top = s[0];
            for (int c = 1; c < CHUNKS; c++) top = blend(s[c] > top, s[c], top);
            float best = hmax(top);
            if (best > m[i]) {
                float corr = vexp((v8f){} + (m[i] - best))[0];
                for (int64_t d = 0; d < D; d++) acc[i][d] *= corr;
                l[i] *= corr;
                m[i] = best;
            }
            v8f sum = {};
            for (int c = 0; c < CHUNKS; c++) {
                v8f x = vexp(s[c] - m[i]);
                if (a != 0 || e != BLOCK) {
                    v8i at = lanes + 8 * c;
                    x = blend((at >= (v8i){} + a) & (at < (v8i){} + e), x, (v8f){});
                }
                *(v8f *)&p[i][8 * c] = x;
                sum += x;
            }
            l[i] += hsum(sum);
        }
        /* acc += p · V, four queries at a time */
        int i0 = 0;
        for (; i0 + 4 <= nq; i0 += 4) NAME(accumulate)(acc + i0, p + i0, vbase + b0 * vrow, vrow, nb, D, 4, bf16);
        switch (nq - i0) {
            case 3: NAME(accumulate)(acc + i0, p + i0, vbase + b0 * vrow, vrow, nb, D, 3, bf16); break;
            case 2: NAME(accumulate)(acc + i0, p + i0, vbase + b0 * vrow, vrow, nb, D, 2, bf16); break;
            case 1: NAME(accumulate)(acc + i0, p + i0, vbase + b0 * vrow, vrow, nb, D, 1, bf16); break;
        }
    }

    if (tile->splits > 1) {  /* max, sum, acc of this split, merged by merge() */
        float *part = tile->partial + item->split * nq * (D + 2);
        memcpy(part, m, nq * sizeof(float));
        memcpy(part + nq, l, nq * sizeof(float));
        for (int i = 0; i < nq; i++) memcpy(part + 2 * nq + i * D, acc[i], D * sizeof(float));
        return;
    }
    for (int i = 0; i < nq; i++) {
        int64_t j = tile->j0 + i, token = r[REQ_Q_FIRST] + j / G, head = tile->head * G + j % G;
        char *row = c->out + (token * c->out_token + head * c->out_head) * esize;
        float inv = 1.0f / l[i];
        for (int64_t d = 0; d < D; d++) store(row, d, acc[i][d] * inv, bf16);
    }
}

INLINE void NAME(run_items)(Call *c) {
    const int bf16 = c->bf16;
    for (long i; (i = atomic_fetch_add(&c->next, 1)) < c->num_items;) {
        if (bf16)
            NAME(run_item)(c, &c->items[i], 1);
        else
            NAME(run_item)(c, &c->items[i], 0);
    }
}


#undef vec
#undef veci
#undef vec_u
#undef vech_u
#undef NAME
#undef WIDE
#undef GLUE
