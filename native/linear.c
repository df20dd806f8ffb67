/*
 * The engine's GEMM on the host, y = x W^T (+ b), in float32 or bfloat16
 * (every matrix in one dtype; sums in float32, a bfloat16 output rounded
 * once), over a weight packed once into panels of PANEL output columns:
 * float32 panel p holds, for each of the K inputs in turn, the weights of
 * columns p*PANEL.. side by side; a bfloat16 one, for each pair of inputs in
 * turn, each column's two weights side by side (zeros past the last column,
 * and past an odd K's last input).  A block of up to MAX_ROWS rows of x
 * times one panel is 24 AVX-512 accumulators (AVX2: four rows, the panel in
 * two passes of 12), each step over K one broadcast of an x value against
 * three vectors of weights; bfloat16 panels, with AVX512-BF16 one broadcast
 * pair of x values against three vectors of weight pairs on vdpbf16ps, x
 * read as given ("paired"), else widened as loaded, x widened once a call.
 * The panel, read from memory for the first block, stays in L2 for the
 * others.  The threads share the panels, so each weight is read once a call
 * at any number of rows.
 *
 * Gated (`linear_silu_mul_run`, the MLP's gate and up projections packed as
 * one weight [gate; up]): each gate panel's outputs are stored, and the
 * matching up panel, computed next by the same thread, turns them into
 * silu(gate) * up as ops.c's silu_mul does, bit for bit (in bfloat16,
 * rounding gate, up and silu(gate) as the separate calls do).  The
 * [gate | up] rows are never written, nor read again.
 *
 * Loads are unaligned, so any address serves.  On the CPUs measured
 * (benchmarks/README.md, `vattn bench linears`) oneDNN's packed inner product
 * and vLLM's linear stream weights slower at the few rows of a decode step,
 * which is why the engine carries its own (`linear_serves()`): float32 where
 * the CPU has AVX-512; bfloat16 where it has AVX512-BF16 and no AMX, and
 * where oneDNN does not pack bfloat16 (CPUs without AVX-512: torch's own
 * bfloat16 linear there is several times slower).  It runs on the kernels'
 * instruction set (`kernel_isa`).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#pragma GCC diagnostic ignored "-Wpsabi"

#include "common.h"
#include "ops.h"
#include "vector_math.h"

enum {
    VECTORS = 3,           /* vectors a pass: of 16 floats, a panel; of 8, half a panel */
    PANEL = 16 * VECTORS,  /* output columns a panel */
    MAX_ROWS = 8,          /* rows of x a block: MAX_ROWS * VECTORS accumulators */
    CHUNK = 192,           /* rows of x the threads take through every panel at once */
    PARALLEL_MACS = 1 << 18,  /* below that many multiply-adds a call, one thread */
};

const int LINEAR_PANEL = PANEL;

typedef struct {
    const char *x;  /* float32 rows; bfloat16 ones widened once a call, unless `paired` */
    const char *panels, *bias;
    char *y;
    int bf16;      /* the weights, bias and y bfloat16 (else float32) */
    int paired;    /* bfloat16 x as given, on vdpbf16ps (the instruction set has it) */
    int max_rows;  /* rows of x a block at this instruction set's width */
    int64_t rows, n, k, x_stride, y_stride;  /* strides in elements */
    int64_t up;  /* gated: the first up panel (the gate's panels come before it); 0: not gated */
} Gemm;

/* Rows of a panel for K inputs: bfloat16 ones in pairs, an odd K's last paired with zeros. */
static int64_t depth(int64_t k, int bf16) { return bf16 ? k + k % 2 : k; }

/* Lines of the next panel a block asks for ahead, `per` at each step over K. */
typedef struct {
    const char *at, *end;
    int per;
} Ahead;

/* The block at 16 lanes (AVX-512) and at 8 (AVX2, the baseline). */
#define W 16
#include "linear_kernel.h"
#undef W
#define W 8
#include "linear_kernel.h"
#undef W

typedef void (*block_fn)(const Gemm *, const char *, const char *, char *, int64_t, int64_t, Ahead, int);
enum { ROWS_W8 = 4 };  /* rows a block at 8 lanes: 12 accumulators of 16 registers */

/* block_<isa>_<R>_<dtype>: the block for R rows, compiled for an instruction set */
#define BLOCK(isa, TARGET, width, R, dtype, bf16)                                                            \
    TARGET static void block_##isa##_##R##_##dtype(const Gemm *g, const char *x, const char *w, char *y,     \
                                                   int64_t col, int64_t cols, Ahead ahead, int up) {        \
        block_w##width(g, x, w, y, col, cols, ahead, up, R, bf16);                                          \
    }
#define DTYPES(isa, TARGET, width, R) BLOCK(isa, TARGET, width, R, f32, 0) BLOCK(isa, TARGET, width, R, bf16, 1)
#define FOUR(isa, TARGET, width) \
    DTYPES(isa, TARGET, width, 1) DTYPES(isa, TARGET, width, 2) DTYPES(isa, TARGET, width, 3) DTYPES(isa, TARGET, width, 4)
FOUR(avx512, AVX512, 16)
DTYPES(avx512, AVX512, 16, 5) DTYPES(avx512, AVX512, 16, 6) DTYPES(avx512, AVX512, 16, 7) DTYPES(avx512, AVX512, 16, 8)
FOUR(avx2, AVX2, 8)
FOUR(baseline, , 8)

#define PAIRED(R)                                                                                           \
    AVX512 static void block_paired_##R(const Gemm *g, const char *x, const char *w, char *y, int64_t col,  \
                                        int64_t cols, Ahead ahead, int up) {                                \
        paired_block(g, x, w, y, col, cols, ahead, up, R);                                                  \
    }
PAIRED(1) PAIRED(2) PAIRED(3) PAIRED(4) PAIRED(5) PAIRED(6) PAIRED(7) PAIRED(8)

#define ROW(isa, dtype, R) block_##isa##_##R##_##dtype
#define UP_TO_4(isa, dtype) NULL, ROW(isa, dtype, 1), ROW(isa, dtype, 2), ROW(isa, dtype, 3), ROW(isa, dtype, 4)
#define AVX512_F32 {UP_TO_4(avx512, f32), ROW(avx512, f32, 5), ROW(avx512, f32, 6), ROW(avx512, f32, 7), ROW(avx512, f32, 8)}
#define PAIRED_BF16                                                                                            \
    {NULL, block_paired_1, block_paired_2, block_paired_3, block_paired_4, block_paired_5, block_paired_6, \
     block_paired_7, block_paired_8}
/* BLOCKS[isa][bf16][R] */
static const block_fn BLOCKS[NUM_ISAS][2][MAX_ROWS + 1] = {
    {AVX512_F32, PAIRED_BF16},  /* amx */
    {AVX512_F32, PAIRED_BF16},  /* avx512_bf16 */
    {AVX512_F32, {UP_TO_4(avx512, bf16), ROW(avx512, bf16, 5), ROW(avx512, bf16, 6), ROW(avx512, bf16, 7),
                  ROW(avx512, bf16, 8)}},
    {{UP_TO_4(avx2, f32)}, {UP_TO_4(avx2, bf16)}},
    {{UP_TO_4(baseline, f32)}, {UP_TO_4(baseline, bf16)}},
};

/* The panel at step s of the walk over the panels: panel s; gated, gate panel s / 2 and then its up panel. */
static int64_t panel_at(const Gemm *g, int64_t s) { return g->up ? s / 2 + (s % 2) * g->up : s; }

/* Steps [s0, s1) of the walk over the panels for every row, CHUNK rows at a time, each chunk in
 * blocks of equal size.  The first block reads a panel from memory, the others from L2; so that no
 * block waits on memory while the others leave it idle, every block of a step's panel asks for its
 * share of the next step's. */
static void panels(const Gemm *g, int64_t s0, int64_t s1) {
    const int64_t esize = g->bf16 ? 2 : 4, panel_bytes = mul_sat(depth(g->k, g->bf16), PANEL * esize);
    const int64_t lines = panel_bytes / 64;  /* a panel's cache lines (PANEL * esize: a multiple of 32 bytes) */
    const int64_t steps = g->bf16 ? ceil_div(g->k, 2) : g->k;  /* a block's steps over K */
    const int64_t x_row = g->x_stride * (g->paired ? 2 : 4);  /* bytes */
    const block_fn *block = BLOCKS[kernel_isa][g->bf16];
    for (int64_t c = 0; c < g->rows; c += CHUNK) {
        const int64_t rows = g->rows - c < CHUNK ? g->rows - c : CHUNK;
        const int64_t blocks = ceil_div(rows, g->max_rows), size = ceil_div(rows, blocks);
        const int64_t share = ceil_div(lines, blocks);  /* lines a block asks for */
        const int per = blocks > 1 ? (int)ceil_div(share, steps) : 0;
        for (int64_t s = s0; s < s1; s++) {
            const int64_t p = panel_at(g, s), col = p * PANEL, cols = g->n - col < PANEL ? g->n - col : PANEL;
            const int64_t ycol = g->up ? s / 2 * PANEL : col;  /* gated: both write the gate's columns */
            for (int64_t r = c, b = 0; r < c + rows; r += size, b++) {
                const int64_t R = c + rows - r < size ? c + rows - r : size;
                Ahead ahead = {0};  /* none past the thread's last panel */
                if (s + 1 < s1) {
                    const char *next = g->panels + panel_at(g, s + 1) * panel_bytes;
                    const int64_t from = b * share < lines ? b * share : lines;
                    ahead = (Ahead){next + 64 * from, next + 64 * (from + share < lines ? from + share : lines), per};
                }
                block[R](g, g->x + r * x_row, g->panels + p * panel_bytes,
                         g->y + (r * g->y_stride + ycol) * esize, col, cols, ahead, g->up && s % 2);
            }
        }
    }
}

/* ------------------------------------------------------------ the call */

#define BYTES(r) ((char *)(uintptr_t)(r)->ptr)

/* linear_serves(bf16): whether weights of that dtype are the engine's to run here, where it measured
 * faster than oneDNN: float32 with AVX-512; bfloat16 on vdpbf16ps without AMX (whose tiles serve oneDNN's
 * GEMM at a prefill's many rows).  Where oneDNN does not pack bfloat16, vattn/executor/gemm.py says. */
static PyObject *linear_serves(PyObject *mod, PyObject *bf16) {
    const int want = PyObject_IsTrue(bf16);
    if (want < 0) return NULL;
    return PyBool_FromLong(want ? isa_best() == ISA_AVX512_BF16 : isa_best() <= ISA_AVX512);
}

/* y's rows from x's through the weight of n outputs packed in w (with bias b). */
static int check(const Rows *y, const Rows *x, const Rows *w, const Rows *b, int64_t n) {
    if (y->dtype != x->dtype || w->dtype != x->dtype || (b && b->dtype != x->dtype))
        return FAIL("out, x, the panels and the bias must have one dtype (codes %d, %d, %d, %d)", y->dtype,
                    x->dtype, w->dtype, b ? b->dtype : x->dtype);
    const int64_t k = x->cols, panel_rows = mul_sat(ceil_div(n, PANEL), depth(k, x->dtype == BF16));
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

/* The GEMM of y, x, w, b for n outputs; bfloat16 x widened into *widened (malloc'd; NULL: float32 x).
 * -1: out of memory. */
static int gemm_of(Gemm *g, const Rows *y, const Rows *x, const Rows *w, const Rows *b, int64_t n, float **widened) {
    *g = (Gemm){.x = BYTES(x), .panels = BYTES(w), .bias = b ? BYTES(b) : NULL, .y = BYTES(y),
                .bf16 = x->dtype == BF16, .paired = x->dtype == BF16 && kernel_isa <= ISA_AVX512_BF16, .max_rows = kernel_isa <= ISA_AVX512 ? MAX_ROWS : ROWS_W8,
                .rows = x->rows, .n = n, .k = x->cols, .x_stride = x->stride, .y_stride = y->stride};
    *widened = NULL;
    if (!g->bf16 || g->paired) return 0;
    size_t bytes;
    if (__builtin_mul_overflow((size_t)(x->rows ? x->rows : 1), (size_t)x->cols * sizeof(float), &bytes) ||
        !(*widened = malloc(bytes ? bytes : 1)))
        return -1;
    for (int64_t i = 0; i < x->rows; i++)
        for (int64_t d = 0; d < x->cols; d++)
            (*widened)[i * x->cols + d] = bf16_float(((const uint16_t *)BYTES(x))[i * x->stride + d]);
    g->x = (const char *)*widened;
    g->x_stride = x->cols;
    return 0;
}

int linear_run(const Rows *y, const Rows *x, const Rows *w, const Rows *b, int threads) {
    Gemm g;
    float *widened;
    if (gemm_of(&g, y, x, w, b, y->cols, &widened)) return -1;
    run(&g, threads);
    free(widened);
    return 0;
}

int linear_silu_mul_run(const Rows *y, const Rows *x, const Rows *w, const Rows *b, int threads) {
    Gemm g;
    float *widened;
    if (gemm_of(&g, y, x, w, b, mul_sat(2, y->cols), &widened)) return -1;
    g.up = y->cols / PANEL;
    run(&g, threads);
    free(widened);
    return 0;
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
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = linear_run(&y, &x, &w, b, threads);
    Py_END_ALLOW_THREADS
    return failed ? PyErr_NoMemory() : Py_NewRef(Py_None);
}

PyMethodDef LINEAR_METHODS[] = {
    {"linear", linear, METH_VARARGS,
     "linear(out, x, panels, bias, threads): out <- x W^T + bias (None: no bias), W packed in panels of "
     "LINEAR_PANEL columns."},
    {"linear_serves", linear_serves, METH_O,
     "linear_serves(bf16): whether weights of that dtype (bfloat16, else float32) are linear()'s to run on this "
     "CPU: float32 with AVX-512, bfloat16 with AVX512-BF16 and no AMX."},
    {NULL},
};
