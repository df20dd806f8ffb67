/*
 * attend(): attention of query tokens over strided K/V views, each request
 * reading its own rows [start, length) and nothing else, so it is safe over a
 * reservation with no pages (and no zero page) past a request's length.
 *
 * A request's num_q queries are its last tokens, at positions
 * length - num_q .. length - 1 (decode: one; a prefill chunk with history:
 * several), each attending causally (bottom-right) to the rows
 * [max(start, pos + 1 - window), pos] (window 0: no window).  Grouped-query
 * attention: query head h reads K/V head h / (H / H_kv), and one tile holds
 * the queries of a K/V head, so each K and V row is read from memory once for
 * all of them.  K/V in float32 or bfloat16, everything summed in float32,
 * softmax online (streaming) in blocks of BLOCK rows.  A decode tile (a
 * token's few query heads) scores up to three queries at a time with the head
 * dimension in vector lanes, each K value loaded once for them, and asks for
 * the next block's rows while it reads this block's V (the rows come from
 * memory, not the caches, and the hardware's own prefetching falls short of
 * the memory's bandwidth); a prefill tile (up to TILE queries of several tokens) holds
 * its queries in the lanes instead and broadcasts each K value against them,
 * a small matrix product with no horizontal sums, and each V value against
 * their probabilities, its output held by dimension (`acct`).
 *
 * Work: tiles (request, K/V head, up to TILE query vectors) are cut along the
 * rows into splits when there are too few for the threads; splits run on
 * OpenMP threads with the GIL released, a K/V head's together, and a tile's splits
 * are merged (flash-decoding).  Inner loops use GCC vector types: the body
 * (attention_kernel.h) is compiled at 16 lanes for AVX-512 and at 8 for AVX2/FMA
 * and for the baseline ISA, and the CPU's features pick one at run time; over
 * bfloat16 K/V, with AVX512-BF16 a tile computes QK and PV on vdpbf16ps
 * (`paired`), reading K as stored and V two rows at a time, and with AMX a
 * decode tile its scores and a prefill tile everything on AMX tiles (`tiles`).
 *
 * With new_k and new_v ([T, H_kv, D], a row per query token), each request's
 * new tokens' K/V are first stored at their rows of its slot, so one call
 * appends and attends (the caller has checked those rows are mapped).
 *
 * Every argument is checked before anything is written: a bad call raises
 * ValueError and leaves the output and the K/V as they were.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "common.h"
#include "vector_math.h"

/* the vector helpers are all inlined: no vector crosses a call */
#pragma GCC diagnostic ignored "-Wpsabi"

enum { BLOCK = 32, TILE = 32, MAX_HEAD_DIM = 256, MIN_SPLIT = 128, SERIAL_ROWS = 1024 };
enum { ACROSS = TILE / 2 };  /* tiles of more queries than this take them in lanes (probs_across) */
enum { REQ_SLOT, REQ_START, REQ_LENGTH, REQ_Q_FIRST, REQ_NUM_Q, REQ_FIELDS };
_Static_assert((int)REQ_FIELDS == (int)ATTEND_FIELDS, "the request table's fields");

/* ------------------------------------------------------------ vector helpers */

INLINE float scalar(const void *row, int64_t d, int bf16) {
    return bf16 ? bf16_float(((const uint16_t *)row)[d]) : ((const float *)row)[d];
}

INLINE void store(void *row, int64_t d, float f, int bf16) {
    if (bf16)
        ((uint16_t *)row)[d] = float_bf16(f);
    else
        ((float *)row)[d] = f;
}

INLINE void prefetch_row(const char *row, int64_t nbytes) {
    for (int64_t at = 0; at < nbytes; at += 64) __builtin_prefetch(row + at, 0, 2);
}

/* Rows to prefetch while a block is read: row t of K and of V at k + t·krow and v + t·vrow, t < rows. */
typedef struct {
    const char *k, *v;
    int64_t krow, vrow, bytes;
    int rows;
} Ahead;

INLINE void fetch_row(const Ahead *a, int t) {
    prefetch_row(a->k + t * a->krow, a->bytes);
    prefetch_row(a->v + t * a->vrow, a->bytes);
}

/* Lane i of the result: the sum of x[i]'s lanes. */
INLINE v8f reduce8(const v8f x[8]) {
#define PAIRS(a, b) (__builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14) + \
                     __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15))
#define QUADS(a, b) (__builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) + \
                     __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15))
    v8f u0 = QUADS(PAIRS(x[0], x[1]), PAIRS(x[2], x[3]));
    v8f u1 = QUADS(PAIRS(x[4], x[5]), PAIRS(x[6], x[7]));
#undef PAIRS
#undef QUADS
    return __builtin_shufflevector(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
}

INLINE float hmax(v8f x) {
    v8f y = __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3);
    x = blend(x > y, x, y);
    y = __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5);
    x = blend(x > y, x, y);
    y = __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6);
    x = blend(x > y, x, y);
    return x[0];
}

INLINE float hsum(v8f x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

/* ------------------------------------------------------------ the call */

typedef struct {
    int64_t req;      /* its request */
    int64_t head;     /* its K/V head */
    int64_t j0;       /* its queries: j0 .. j0 + nq - 1 of the request's G·num_q, token-major */
    int nq;
    int64_t lo, hi;   /* the rows its queries read, together */
    int64_t lead;     /* the rows the longest tile of its request's K/V head reads */
    int64_t splits;   /* > 1: its partial results go to `partial`, merged after */
    float *partial;   /* splits × (max[nq], sum[nq], acc[nq][D]) */
} Tile;

typedef struct {
    Tile *tile;
    int64_t split;
    int64_t lo, hi;   /* the rows this split reads */
} Item;

typedef struct {
    const char *q, *k, *v;
    char *out;
    int bf16;
    int64_t D, Hkv, G;
    int64_t q_token, q_head, out_token, out_head;       /* strides, elements */
    int64_t k_slot, k_row, k_head;                      /* K's */
    int64_t v_slot, v_row, v_head;                      /* V's */
    const int64_t *reqs;
    int64_t num_reqs, window;
    float scale;
    Item *items;
    int64_t num_items;
    atomic_long next;
} Call;

/* A split while it runs: its queries (scaled; by query, and by dimension for probs_across), the
 * rows each reads, and the online softmax's running max, sum and output. */
typedef struct {
    union {
        float qs[TILE][MAX_HEAD_DIM] __attribute__((aligned(64)));
        uint16_t qb[TILE][MAX_HEAD_DIM] __attribute__((aligned(64)));  /* paired and AMX: as given, bfloat16 */
    };
    union {
        float qt[MAX_HEAD_DIM][TILE] __attribute__((aligned(64)));
        uint32_t qk[2][MAX_HEAD_DIM / 32][16][16] __attribute__((aligned(64)));  /* AMX: query tiles */
        uint16_t qp[MAX_HEAD_DIM / 2][2 * TILE] __attribute__((aligned(64)));  /* paired prefill: by dimension pair */
    };
    union {
        float acc[TILE][MAX_HEAD_DIM] __attribute__((aligned(64)));
        float acct[MAX_HEAD_DIM][TILE] __attribute__((aligned(64)));  /* probs_across without AMX: by dimension */
    };
    float m[TILE] __attribute__((aligned(64))), l[TILE] __attribute__((aligned(64)));
    int64_t qlo[TILE], qhi[TILE];
    int64_t lo_max, hi_min;  /* the rows every query reads: [lo_max, hi_min) */
    float scale;             /* paired and AMX: of the scores (else folded into qs and qt) */
} Online;

/* Query j of a tile: its token and head within the request, and its rows. */
INLINE void query_rows(const Call *c, const int64_t *r, int64_t j, int64_t *lo, int64_t *hi) {
    int64_t pos = r[REQ_LENGTH] - r[REQ_NUM_Q] + j / c->G;
    int64_t first = c->window ? pos + 1 - c->window : 0;
    *lo = first > r[REQ_START] ? first : r[REQ_START];
    *hi = pos + 1;
}

/* Query i's output so far at dimension d (`transposed`: held in acct). */
INLINE float output(const Online *o, int i, int64_t d, int transposed) {
    return transposed ? o->acct[d][i] : o->acc[i][d];
}

/* What each query has summed so far times its factor corr[i] (the online softmax's, for a new maximum). */
INLINE void rescale(Online *o, int nq, const float *corr, int64_t D) {
    for (int i = 0; i < nq; i++)
        if (corr[i] != 1.0f)
            for (int64_t d = 0; d < D; d++) o->acc[i][d] *= corr[i];
}

/* The kernel at two vector widths: 16 lanes for AVX-512, 8 for AVX2 and the baseline. */
#define W 16
#include "attention_kernel.h"
#undef W
#define W 8
#include "attention_kernel.h"
#undef W

AVX512 static void run_items_amx(Call *c) { run_items_w16(c, 1, 1); }
AVX512 static void run_items_avx512_bf16(Call *c) { run_items_w16(c, 1, 0); }
AVX512 static void run_items_avx512(Call *c) { run_items_w16(c, 0, 0); }
AVX2 static void run_items_avx2(Call *c) { run_items_w8(c, 0, 0); }
static void run_items_baseline(Call *c) { run_items_w8(c, 0, 0); }
static void (*const RUN_ITEMS[NUM_ISAS])(Call *) = {run_items_amx, run_items_avx512_bf16, run_items_avx512,
                                                    run_items_avx2, run_items_baseline};

#define run_items_isa RUN_ITEMS[kernel_isa]

/* The tile's splits, merged into its output rows. */
static void merge(const Call *c, const Tile *tile) {
    const int64_t *r = c->reqs + tile->req * REQ_FIELDS;
    const int64_t D = c->D, G = c->G, esize = c->bf16 ? 2 : 4;
    const int nq = tile->nq;
    for (int i = 0; i < nq; i++) {
        float best = -__builtin_inff(), sum = 0, acc[MAX_HEAD_DIM] = {0};
        for (int64_t s = 0; s < tile->splits; s++) {
            const float *part = tile->partial + s * nq * (D + 2);
            best = part[i] > best ? part[i] : best;
        }
        for (int64_t s = 0; s < tile->splits; s++) {
            const float *part = tile->partial + s * nq * (D + 2);
            if (part[nq + i] == 0) continue;  /* a split none of whose rows this query reads */
            float w = vexp((v8f){} + (part[i] - best))[0];
            sum += part[nq + i] * w;
            for (int64_t d = 0; d < D; d++) acc[d] += part[2 * nq + i * D + d] * w;
        }
        int64_t j = tile->j0 + i, token = r[REQ_Q_FIRST] + j / G, head = tile->head * G + j % G;
        char *row = c->out + (token * c->out_token + head * c->out_head) * esize;
        for (int64_t d = 0; d < D; d++) store(row, d, acc[d] / sum, c->bf16);
    }
}

/* ------------------------------------------------------------ threads */

/* OpenMP: the one runtime of the process (torch's libgomp, loaded first), so
 * the kernel runs on torch's own intra-op threads, which are still spinning
 * from the operator before, and never competes with them for the cores. */
static void run_parallel(Call *c, int threads) {
#pragma omp parallel num_threads(threads)
    run_items_isa(c);
}

/* ------------------------------------------------------------ checking and planning */

int parse_view(PyObject *arg, const char *name, int ndim, View *v) {
    const char *format = ndim == 3 ? "KiLLLLLL" : "KiLLLLLLLL";
    int ok = ndim == 3 ? PyArg_ParseTuple(arg, format, &v->ptr, &v->dtype, &v->shape[0], &v->shape[1],
                                          &v->shape[2], &v->stride[0], &v->stride[1], &v->stride[2])
                       : PyArg_ParseTuple(arg, format, &v->ptr, &v->dtype, &v->shape[0], &v->shape[1],
                                          &v->shape[2], &v->shape[3], &v->stride[0], &v->stride[1],
                                          &v->stride[2], &v->stride[3]);
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s: expected (address, dtype, %d sizes, %d strides)", name, ndim, ndim);
        return -1;
    }
    if (v->dtype != F32 && v->dtype != BF16) {
        PyErr_Format(PyExc_ValueError, "%s: the kernel reads float32 or bfloat16, not dtype code %d", name, v->dtype);
        return -1;
    }
    for (int i = 0; i < ndim; i++)
        if (v->shape[i] < 0 || v->stride[i] < 0) {
            PyErr_Format(PyExc_ValueError, "%s: negative size or stride in dimension %d", name, i);
            return -1;
        }
    if (v->stride[ndim - 1] != 1 && v->shape[ndim - 1] > 1) {
        PyErr_Format(PyExc_ValueError, "%s: its last dimension is not contiguous (stride %lld)", name,
                     v->stride[ndim - 1]);
        return -1;
    }
    if (!spans(v->ptr, ndim, v->shape, v->stride, v->dtype == BF16 ? 2 : 4)) {
        PyErr_Format(PyExc_ValueError, "%s: its sizes and strides reach past the address space", name);
        return -1;
    }
    return 0;
}


static int check(const View *q, const View *out, const View *k, const View *v, const int64_t *reqs,
                 int64_t n, long long window) {
    if (q->dtype != out->dtype || q->dtype != k->dtype || q->dtype != v->dtype)
        return FAIL("q, out, k and v must have one dtype (codes %d, %d, %d, %d)", q->dtype, out->dtype, k->dtype,
                    v->dtype);
    for (int i = 0; i < 4; i++)
        if (k->shape[i] != v->shape[i])
            return FAIL("k and v differ in size %d: %lld and %lld", i, k->shape[i], v->shape[i]);
    long long D = q->shape[2], H = q->shape[1], Hkv = k->shape[2];
    if (k->shape[3] != D) return FAIL("q has head_dim %lld; k and v have %lld", D, k->shape[3]);
    if (D % 16 || D < 16 || D > MAX_HEAD_DIM)
        return FAIL("head_dim %lld: the kernel takes multiples of 16 up to %d", D, MAX_HEAD_DIM);
    if (Hkv < 1 || H % Hkv) return FAIL("%lld query heads do not divide into %lld K/V heads", H, Hkv);
    if (window < 0) return FAIL("window %lld is negative (0: none)", window);
    for (int i = 0; i < 3; i++)
        if (q->shape[i] != out->shape[i])
            return FAIL("out is [%lld, %lld, %lld]; q is [%lld, %lld, %lld]", out->shape[0], out->shape[1],
                        out->shape[2], q->shape[0], q->shape[1], q->shape[2]);

    for (int64_t i = 0; i < n; i++) {
        const int64_t *r = reqs + i * REQ_FIELDS;
        if (r[REQ_SLOT] < 0 || r[REQ_SLOT] >= k->shape[0])
            return FAIL("request %lld: slot %lld is outside the view's %lld slots", (long long)i,
                        (long long)r[REQ_SLOT], k->shape[0]);
        if (r[REQ_NUM_Q] < 0 || r[REQ_LENGTH] < 0 || r[REQ_START] < 0)
            return FAIL("request %lld: negative start, length or query count (%lld, %lld, %lld)", (long long)i,
                        (long long)r[REQ_START], (long long)r[REQ_LENGTH], (long long)r[REQ_NUM_Q]);
        if (r[REQ_LENGTH] > k->shape[1])
            return FAIL("request %lld: length %lld is past the view's %lld rows", (long long)i,
                        (long long)r[REQ_LENGTH], k->shape[1]);
        if (r[REQ_NUM_Q] > r[REQ_LENGTH])
            return FAIL("request %lld: %lld queries in %lld tokens (its queries are its last tokens)",
                        (long long)i, (long long)r[REQ_NUM_Q], (long long)r[REQ_LENGTH]);
        if (r[REQ_NUM_Q] && r[REQ_START] > r[REQ_LENGTH] - r[REQ_NUM_Q])
            return FAIL("request %lld: start %lld is past its first query's position %lld", (long long)i,
                        (long long)r[REQ_START], (long long)(r[REQ_LENGTH] - r[REQ_NUM_Q]));
        if (!inside(r[REQ_Q_FIRST], r[REQ_NUM_Q], q->shape[0]))
            return FAIL("request %lld: %lld query rows from row %lld are outside q's %lld tokens", (long long)i,
                        (long long)r[REQ_NUM_Q], (long long)r[REQ_Q_FIRST], q->shape[0]);
    }
    return 0;
}

/* new_k/new_v: a row of [H_kv, D] per query token, in q's dtype. */
static int check_new(const View *nk, const View *nv, const View *q, const View *k) {
    const View *views[2] = {nk, nv};
    for (int i = 0; i < 2; i++) {
        const View *n = views[i];
        if (n->dtype != q->dtype) return FAIL("new_k and new_v must have q's dtype (codes %d, %d)", n->dtype, q->dtype);
        if (n->shape[0] != q->shape[0] || n->shape[1] != k->shape[2] || n->shape[2] != k->shape[3])
            return FAIL("new_k and new_v are [T, H_kv, D] = [%lld, %lld, %lld]; got [%lld, %lld, %lld]", q->shape[0],
                        k->shape[2], k->shape[3], n->shape[0], n->shape[1], n->shape[2]);
    }
    return 0;
}

/* Each request's new tokens' K/V into rows length - num_q .. length - 1 of its slot. */
static void append(const Call *c, const View *nk, const View *nv) {
    const int64_t esize = c->bf16 ? 2 : 4, row_bytes = c->D * esize;
    for (int64_t i = 0; i < c->num_reqs; i++) {
        const int64_t *r = c->reqs + i * REQ_FIELDS;
        for (int64_t t = 0; t < r[REQ_NUM_Q]; t++) {
            int64_t token = r[REQ_Q_FIRST] + t, row = r[REQ_LENGTH] - r[REQ_NUM_Q] + t;
            for (int64_t h = 0; h < c->Hkv; h++) {
                memcpy((char *)c->k + (r[REQ_SLOT] * c->k_slot + row * c->k_row + h * c->k_head) * esize,
                       (const char *)(uintptr_t)nk->ptr + (token * nk->stride[0] + h * nk->stride[1]) * esize,
                       row_bytes);
                memcpy((char *)c->v + (r[REQ_SLOT] * c->v_slot + row * c->v_row + h * c->v_head) * esize,
                       (const char *)(uintptr_t)nv->ptr + (token * nv->stride[0] + h * nv->stride[1]) * esize,
                       row_bytes);
            }
        }
    }
}

/* Items in runs of one request's K/V head, the run of the longest first and each run's longest first:
 * the threads take a head's tiles together, so its rows are read from memory once and then from the
 * shared cache, where longest first alone would take every head's tiles in turn, its rows long gone. */
static int by_head_and_rows_descending(const void *a, const void *b) {
    const Item *x = a, *y = b;
    int64_t lx = x->tile->lead, ly = y->tile->lead, rx = x->hi - x->lo, ry = y->hi - y->lo;
    if (lx != ly) return (lx < ly) - (lx > ly);
    if (x->tile->req != y->tile->req) return (x->tile->req > y->tile->req) - (x->tile->req < y->tile->req);
    if (x->tile->head != y->tile->head) return (x->tile->head > y->tile->head) - (x->tile->head < y->tile->head);
    return (rx < ry) - (rx > ry);
}

/* n things of `size` bytes, or NULL where they are more than memory holds. */
static void *alloc_array(int64_t n, size_t size) {
    size_t bytes;
    return n == INT64_MAX || __builtin_mul_overflow((size_t)(n ? n : 1), size, &bytes) ? NULL : malloc(bytes);
}

/* Tiles and their splits; on success *tiles_out and c->items are malloc'd.  Counts saturate: a
 * saturated one is more than memory holds, and its allocation fails. */
static int plan(Call *c, int threads, Tile **tiles_out, float **partials_out) {
    int64_t num_tiles = 0, rows = 0;
    for (int64_t i = 0; i < c->num_reqs; i++)  /* G·num_q <= q's elements: no overflow */
        num_tiles = add_sat(num_tiles, mul_sat(c->Hkv, ceil_div(c->G * c->reqs[i * REQ_FIELDS + REQ_NUM_Q], TILE)));
    Tile *tiles = alloc_array(num_tiles, sizeof(Tile));
    if (!tiles) return -1;
    int64_t t = 0;
    for (int64_t i = 0; i < c->num_reqs; i++) {
        const int64_t *r = c->reqs + i * REQ_FIELDS;
        if (!r[REQ_NUM_Q]) continue;  /* no tiles, however many heads */
        for (int64_t h = 0; h < c->Hkv; h++) {
            const int64_t first = t;
            int64_t lead = 0;
            for (int64_t j0 = 0; j0 < c->G * r[REQ_NUM_Q]; j0 += TILE, t++) {
                Tile *tile = &tiles[t];
                int64_t nq = c->G * r[REQ_NUM_Q] - j0, unused;
                tile->req = i;
                tile->head = h;
                tile->j0 = j0;
                tile->nq = (int)(nq < TILE ? nq : TILE);
                tile->partial = NULL;
                query_rows(c, r, j0, &tile->lo, &unused);
                query_rows(c, r, j0 + tile->nq - 1, &unused, &tile->hi);
                rows = add_sat(rows, tile->hi - tile->lo);
                lead = tile->hi - tile->lo > lead ? tile->hi - tile->lo : lead;
            }
            for (int64_t u = first; u < t; u++) tiles[u].lead = lead;
        }
    }
    /* splits of at least MIN_SPLIT rows, about four items per thread */
    int64_t chunk = threads > 1 ? rows / (4 * (int64_t)threads) : rows;
    chunk = chunk < MIN_SPLIT ? MIN_SPLIT : mul_sat(ceil_div(chunk, BLOCK), BLOCK);
    int64_t num_items = 0, partial = 0;
    for (t = 0; t < num_tiles; t++) {
        tiles[t].splits = ceil_div(tiles[t].hi - tiles[t].lo, chunk);
        num_items = add_sat(num_items, tiles[t].splits);
        if (tiles[t].splits > 1) partial = add_sat(partial, mul_sat(tiles[t].splits, tiles[t].nq * (c->D + 2)));
    }
    Item *items = alloc_array(num_items, sizeof(Item));
    float *partials = alloc_array(partial, sizeof(float));
    if (!items || !partials) {
        free(tiles);
        free(items);
        free(partials);
        return -1;
    }
    int64_t n = 0;
    float *next_partial = partials;
    for (t = 0; t < num_tiles; t++) {
        Tile *tile = &tiles[t];
        if (tile->splits > 1) {
            tile->partial = next_partial;
            next_partial += tile->splits * tile->nq * (c->D + 2);
        }
        const int64_t len = tile->hi - tile->lo, per = mul_sat(ceil_div(ceil_div(len, tile->splits), BLOCK), BLOCK);
        for (int64_t s = 0; s < tile->splits; s++, n++) {  /* s * per < len: per <= chunk */
            items[n].tile = tile;
            items[n].split = s;
            items[n].lo = tile->lo + s * per;
            items[n].hi = len > mul_sat(s + 1, per) ? tile->lo + (s + 1) * per : tile->hi;
        }
    }
    qsort(items, num_items, sizeof(Item), by_head_and_rows_descending);
    c->items = items;
    c->num_items = num_items;
    *tiles_out = tiles;
    *partials_out = partials;
    return (int)(rows >= SERIAL_ROWS);  /* worth the other threads */
}

int attend_table(const Py_buffer *table, int64_t *n) {
    if (table->len % (REQ_FIELDS * sizeof(int64_t)))
        return FAIL("requests: %d int64 fields each (slot, start, length, q_first, num_q)", REQ_FIELDS);
    *n = table->len / (REQ_FIELDS * sizeof(int64_t));
    return 0;
}

int attend_check(const View *q, const View *out, const View *k, const View *v, const View *nk, const View *nv,
                 const int64_t *reqs, int64_t n, long long window) {
    if ((nk == NULL) != (nv == NULL)) return FAIL("new_k and new_v come together");
    if (nk && check_new(nk, nv, q, k)) return -1;
    return check(q, out, k, v, reqs, n, window);
}

int attend_run(const View *q, const View *out, const View *k, const View *v, const View *nk, const View *nv,
               const int64_t *reqs, int64_t n, double scale, long long window, int threads) {
    Call c = {
        .q = (const char *)(uintptr_t)q->ptr, .k = (const char *)(uintptr_t)k->ptr,
        .v = (const char *)(uintptr_t)v->ptr, .out = (char *)(uintptr_t)out->ptr, .bf16 = q->dtype == BF16,
        .D = q->shape[2], .Hkv = k->shape[2], .G = q->shape[1] / k->shape[2], .q_token = q->stride[0],
        .q_head = q->stride[1], .out_token = out->stride[0], .out_head = out->stride[1], .k_slot = k->stride[0],
        .k_row = k->stride[1], .k_head = k->stride[2], .v_slot = v->stride[0], .v_row = v->stride[1],
        .v_head = v->stride[2], .reqs = reqs, .num_reqs = n, .window = window, .scale = (float)scale,
    };
    atomic_init(&c.next, 0);
    Tile *tiles;
    float *partials;
    int parallel = plan(&c, threads, &tiles, &partials);
    if (parallel < 0) return -1;
    if (nk) append(&c, nk, nv);
    if (parallel && threads > 1)
        run_parallel(&c, threads);
    else
        run_items_isa(&c);
    for (int64_t i = 0; i < c.num_items; i++)
        if (c.items[i].split == 0 && c.items[i].tile->splits > 1) merge(&c, c.items[i].tile);
    free(tiles);
    free(partials);
    free(c.items);
    return 0;
}

static PyObject *attend(PyObject *mod, PyObject *args) {
    PyObject *qa, *outa, *ka, *va, *nka = Py_None, *nva = Py_None;
    Py_buffer reqs;
    double scale;
    long long window, threads_arg;
    int failed;
    if (!PyArg_ParseTuple(args, "OOOOy*dLL|OO", &qa, &outa, &ka, &va, &reqs, &scale, &window, &threads_arg, &nka,
                          &nva))
        return NULL;
    const int threads = clamp_threads(threads_arg);
    View q, out, k, v, new_k, new_v;
    const View *nk = nka == Py_None ? NULL : &new_k, *nv = nva == Py_None ? NULL : &new_v;
    PyObject *result = NULL;
    if (parse_view(qa, "q", 3, &q) || parse_view(outa, "out", 3, &out) || parse_view(ka, "k", 4, &k) ||
        parse_view(va, "v", 4, &v) || (nk && parse_view(nka, "new_k", 3, &new_k)) ||
        (nv && parse_view(nva, "new_v", 3, &new_v)))
        goto done;
    int64_t n;
    if (attend_table(&reqs, &n) || attend_check(&q, &out, &k, &v, nk, nv, reqs.buf, n, window)) goto done;
    Py_BEGIN_ALLOW_THREADS
    failed = attend_run(&q, &out, &k, &v, nk, nv, reqs.buf, n, scale, window, threads);
    Py_END_ALLOW_THREADS
    result = failed ? PyErr_NoMemory() : Py_NewRef(Py_None);
done:
    PyBuffer_Release(&reqs);
    return result;
}

PyMethodDef ATTENTION_METHODS[] = {
    {"attend", attend, METH_VARARGS,
     "attend(q, out, k, v, requests, scale, window, threads[, new_k, new_v]): attention of q's tokens over strided K/V "
     "rows into out, after storing each request's new K/V rows where given."},
    {NULL},
};
