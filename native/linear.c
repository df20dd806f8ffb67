/*
 * The engine's float32 GEMM on the host, y = x W^T (+ b), over a weight
 * packed once into panels of PANEL output columns: panel p holds, for each
 * of the K inputs in turn, the weights of columns p*PANEL.. side by side
 * (zeros past the last column).  A block of up to MAX_ROWS rows of x times
 * one panel is 24 AVX-512 accumulators, each step over K one broadcast of an
 * x value against three vectors of weights; the panel, read from memory for
 * the first block, stays in L2 for the others.  The threads share the
 * panels, so each weight is read once a call at any number of rows.
 *
 * Gated (`linear_silu_mul_run`, the MLP's gate and up projections packed as
 * one weight [gate; up]): each gate panel's outputs are stored, and the
 * matching up panel, computed next by the same thread, turns them into
 * silu(gate) * up as ops.c's silu_mul does, bit for bit.  The [gate | up]
 * rows are never written, nor read again.
 *
 * Loads are unaligned, so any address serves.  On the CPUs measured
 * (benchmarks/README.md, `vattn bench linears`) oneDNN's packed inner product
 * and vLLM's linear stream the weights slower at the few rows of a decode
 * step, which is why the engine carries its own.  AVX-512 only: elsewhere the
 * engine packs for oneDNN instead (`linear_serves()` says which).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <omp.h>
#include <stdint.h>
#include <string.h>

#pragma GCC diagnostic ignored "-Wpsabi"

#include "common.h"
#include "ops.h"
#include "vector_math.h"

enum {
    VECTORS = 3,           /* vectors of 16 floats across a panel */
    PANEL = 16 * VECTORS,  /* output columns a panel */
    MAX_ROWS = 8,          /* rows of x a block: MAX_ROWS * VECTORS accumulators */
    CHUNK = 192,           /* rows of x the threads take through every panel at once */
    PARALLEL_MACS = 1 << 18,  /* below that many multiply-adds a call, one thread */
};

const int LINEAR_PANEL = PANEL;

typedef float v16u __attribute__((vector_size(64), aligned(4)));

typedef struct {
    const float *x, *panels, *bias;
    float *y;
    int64_t rows, n, k, x_stride, y_stride;
    int64_t up;  /* gated: the first up panel (the gate's panels come before it); 0: not gated */
} Gemm;

/* Lines of the next panel a block asks for ahead, `per` at each step over K. */
typedef struct {
    const char *at, *end;
    int per;
} Ahead;

/* y rows [0, R) from panel `w` (its outputs [col, col + cols)) and x rows [0, R): R a constant per
 * copy.  `up`: the panel is a gated GEMM's up panel, and y holds its gate panel's outputs. */
#define BLOCK(R)                                                                                            \
    AVX512 static void block##R(const Gemm *g, const float *x, const float *w, float *y, int64_t col,       \
                                int64_t cols, Ahead ahead, int up) {                                        \
        v16f acc[R][VECTORS];                                                                               \
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++)                                                 \
            _Pragma("GCC unroll 3") for (int j = 0; j < VECTORS; j++) acc[i][j] = (v16f){};                 \
        for (int64_t d = 0; d < g->k; d++, w += PANEL) {                                                    \
            for (int u = 0; u < ahead.per && ahead.at < ahead.end; u++, ahead.at += 64)                     \
                __builtin_prefetch(ahead.at, 0, 2);                                                         \
            v16f wv[VECTORS];                                                                               \
            _Pragma("GCC unroll 3") for (int j = 0; j < VECTORS; j++) wv[j] = *(const v16u *)(w + 16 * j); \
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                           \
                const float xv = x[i * g->x_stride + d];                                                    \
                _Pragma("GCC unroll 3") for (int j = 0; j < VECTORS; j++) acc[i][j] += xv * wv[j];          \
            }                                                                                               \
        }                                                                                                   \
        for (int i = 0; i < R; i++) {                                                                       \
            float *row = y + i * g->y_stride;                                                               \
            if (up) { /* silu(gate) * up, as silu_mul_row computes it */                                    \
                _Pragma("GCC unroll 3") for (int j = 0; j < VECTORS; j++) {                                 \
                    const v16f gate = *(const v16u *)(row + 16 * j);                                        \
                    *(v16u *)(row + 16 * j) = gate / (1.0f + vexp(-gate)) *                                 \
                        (g->bias ? acc[i][j] + *(const v16u *)(g->bias + col + 16 * j) : acc[i][j]);        \
                }                                                                                           \
            } else if (cols == PANEL) {                                                                     \
                _Pragma("GCC unroll 3") for (int j = 0; j < VECTORS; j++) *(v16u *)(row + 16 * j) =         \
                    g->bias ? acc[i][j] + *(const v16u *)(g->bias + col + 16 * j) : acc[i][j];              \
            } else { /* the last panel's columns */                                                         \
                float out[PANEL];                                                                           \
                for (int j = 0; j < VECTORS; j++) *(v16u *)(out + 16 * j) = acc[i][j];                      \
                for (int64_t c = 0; c < cols; c++) row[c] = out[c] + (g->bias ? g->bias[col + c] : 0.0f);   \
            }                                                                                               \
        }                                                                                                   \
    }
BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4) BLOCK(5) BLOCK(6) BLOCK(7) BLOCK(8)

typedef void (*block_fn)(const Gemm *, const float *, const float *, float *, int64_t, int64_t, Ahead, int);
static const block_fn BLOCKS[MAX_ROWS + 1] = {NULL, block1, block2, block3, block4, block5, block6, block7, block8};

/* The panel at step s of the walk over the panels: panel s; gated, gate panel s / 2 and then its up panel. */
static int64_t panel_at(const Gemm *g, int64_t s) { return g->up ? s / 2 + (s % 2) * g->up : s; }

/* Steps [s0, s1) of the walk over the panels for every row, CHUNK rows at a time, each chunk in
 * blocks of equal size.  The first block reads a panel from memory, the others from L2; so that no
 * block waits on memory while the others leave it idle, every block of a step's panel asks for its
 * share of the next step's. */
static void panels(const Gemm *g, int64_t s0, int64_t s1) {
    const int64_t lines = mul_sat(g->k, PANEL * sizeof(float) / 64);  /* a panel's cache lines */
    for (int64_t c = 0; c < g->rows; c += CHUNK) {
        const int64_t rows = g->rows - c < CHUNK ? g->rows - c : CHUNK;
        const int64_t blocks = (rows + MAX_ROWS - 1) / MAX_ROWS, size = (rows + blocks - 1) / blocks;
        const int64_t share = ceil_div(lines, blocks);  /* lines a block asks for */
        const int per = blocks > 1 ? (int)ceil_div(share, g->k) : 0;
        for (int64_t s = s0; s < s1; s++) {
            const int64_t p = panel_at(g, s), col = p * PANEL, cols = g->n - col < PANEL ? g->n - col : PANEL;
            const int64_t ycol = g->up ? s / 2 * PANEL : col;  /* gated: both write the gate's columns */
            for (int64_t r = c, b = 0; r < c + rows; r += size, b++) {
                const int64_t R = c + rows - r < size ? c + rows - r : size;
                Ahead ahead = {0};  /* none past the thread's last panel */
                if (s + 1 < s1) {
                    const char *next = (const char *)(g->panels + panel_at(g, s + 1) * g->k * PANEL);
                    const int64_t from = b * share < lines ? b * share : lines;
                    ahead = (Ahead){next + 64 * from, next + 64 * (from + share < lines ? from + share : lines), per};
                }
                BLOCKS[R](g, g->x + r * g->x_stride, g->panels + p * g->k * PANEL, g->y + r * g->y_stride + ycol,
                          col, cols, ahead, g->up && s % 2);
            }
        }
    }
}

/* ------------------------------------------------------------ the call */

#define FLOATS(r) ((float *)(uintptr_t)(r)->ptr)

/* Built for AVX-512 alone: elsewhere the engine packs for oneDNN. */
static int serves(void) { return isa_best() == ISA_AVX512; }

static PyObject *linear_serves(PyObject *mod, PyObject *noargs) { return PyBool_FromLong(serves()); }

/* y's rows from x's through the weight of n outputs packed in w (with bias b). */
static int check(const Rows *y, const Rows *x, const Rows *w, const Rows *b, int64_t n) {
    if (!serves()) return FAIL("linear runs on CPUs with AVX-512; this one has none");
    const int64_t k = x->cols, panel_rows = mul_sat(ceil_div(n, PANEL), k);
    if (y->rows != x->rows) return FAIL("out has %lld rows; x has %lld", y->rows, x->rows);
    if (w->cols != PANEL || w->stride != PANEL || w->rows != panel_rows)
        return FAIL("panels are %lld x %lld (row stride %lld); %lld outputs of %lld inputs take %lld x %d", w->rows,
                    w->cols, w->stride, (long long)n, (long long)k, (long long)panel_rows, PANEL);
    if (b && (b->rows != 1 || b->cols != n))
        return FAIL("bias is %lld x %lld; the weight has %lld outputs", b->rows, b->cols, (long long)n);
    return 0;
}

int linear_check(const Rows *y, const Rows *x, const Rows *w, const Rows *b) { return check(y, x, w, b, y->cols); }

int linear_silu_mul_check(const Rows *y, const Rows *x, const Rows *w, const Rows *b) {
    if (y->cols % PANEL)
        return FAIL("gated, out's %lld columns must be a multiple of %d", y->cols, PANEL);
    return check(y, x, w, b, mul_sat(2, y->cols));
}

/* Units [u0, u1) of the walk: a panel each; gated, a gate panel and its up panel. */
static void units(const void *gemm, int64_t u0, int64_t u1) {
    const Gemm *g = gemm;
    const int64_t per_unit = g->up ? 2 : 1;
    panels(g, u0 * per_unit, u1 * per_unit);
}

/* The walk's units shared among the threads. */
static void run(const Gemm *g, int threads) {
    const int64_t steps = ceil_div(g->n, PANEL), per_unit = g->up ? 2 : 1, n = steps / per_unit;
    if (threads < 2 || n < 2 || mul_sat(mul_sat(g->rows, g->n), g->k) < PARALLEL_MACS) {
        panels(g, 0, steps);
        return;
    }
    split(units, g, n, threads);
}

static Gemm gemm_of(const Rows *y, const Rows *x, const Rows *w, const Rows *b, int64_t n) {
    return (Gemm){.x = FLOATS(x), .panels = FLOATS(w), .bias = b ? FLOATS(b) : NULL, .y = FLOATS(y),
                  .rows = x->rows, .n = n, .k = x->cols, .x_stride = x->stride, .y_stride = y->stride};
}

void linear_run(const Rows *y, const Rows *x, const Rows *w, const Rows *b, int threads) {
    const Gemm g = gemm_of(y, x, w, b, y->cols);
    run(&g, threads);
}

void linear_silu_mul_run(const Rows *y, const Rows *x, const Rows *w, const Rows *b, int threads) {
    Gemm g = gemm_of(y, x, w, b, mul_sat(2, y->cols));
    g.up = y->cols / PANEL;
    run(&g, threads);
}

static PyObject *linear(PyObject *mod, PyObject *args) {
    PyObject *ya, *xa, *pa, *ba;
    long long threads_arg;
    Rows y, x, w, bias;
    if (!PyArg_ParseTuple(args, "OOOOL", &ya, &xa, &pa, &ba, &threads_arg)) return NULL;
    const int threads = clamp_threads(threads_arg);
    const Rows *b = ba == Py_None ? NULL : &bias;
    if (parse_rows(ya, "out", &y) || parse_rows(xa, "x", &x) || parse_rows(pa, "panels", &w) ||
        (b && parse_rows(ba, "bias", &bias)) || linear_check(&y, &x, &w, b))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    linear_run(&y, &x, &w, b, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyMethodDef LINEAR_METHODS[] = {
    {"linear", linear, METH_VARARGS,
     "linear(out, x, panels, bias, threads): out <- x W^T + bias (None: no bias), W packed in panels of "
     "LINEAR_PANEL columns."},
    {"linear_serves", linear_serves, METH_NOARGS,
     "Whether this CPU runs linear() (it needs AVX-512)."},
    {NULL},
};
