/*
 * The engine forward's elementwise work between its GEMMs, one pass each,
 * over float32 rows (each row contiguous, the rows any stride apart):
 *
 *   rms_norm     x <- w * (h * rsqrt(mean(h^2) + eps)), h = x, or with a
 *                residual h = residual + x, stored back into the residual;
 *   silu_mul     out <- silu(gate) * up, gate and up the halves of a row;
 *   rotate       rows of heads <- x * cos + [x2, x1] * signed_sin in place
 *                (rotary embedding, sin's first half negated).
 *
 * Each is one call where transformers' modules take two to eight operators
 * (a cost paid again after every GEMM, whose weights push the operators'
 * code and data out of the caches).  rotate rounds as transformers does
 * (each product, then their sum: no fused multiply-add), so it is exact;
 * rms_norm's sum and silu's exp are vattn's own, equal to within a few
 * units in the last place.  Rows are shared among OpenMP threads once there
 * are enough of them; the GIL is released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>

#include "common.h"
#include "ops.h"
#include "vector_math.h"

#pragma GCC diagnostic ignored "-Wpsabi"

enum { W = 16, PARALLEL_FLOATS = 1 << 16 };  /* below that many floats, one thread */

typedef v16f vec;
typedef float vec_u __attribute__((vector_size(4 * W), aligned(4)));

INLINE vec load(const float *p) { return *(const vec_u *)p; }
INLINE void put(float *p, vec x) { *(vec_u *)p = x; }

/* ------------------------------------------------------------ the rows */

INLINE void norm_row(float *x, float *residual, const float *w, int64_t n, float eps) {
    vec acc = {};
    int64_t d = 0;
    for (; d + W <= n; d += W) {
        vec h = load(x + d);
        if (residual) {
            h += load(residual + d);
            put(residual + d, h);
        }
        acc += h * h;
    }
    float ss = 0;
    for (int i = 0; i < W; i++) ss += acc[i];
    for (; d < n; d++) {
        float h = x[d] + (residual ? residual[d] : 0.0f);
        if (residual) residual[d] = h;
        ss += h * h;
    }
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    const float *h = residual ? residual : x;
    for (d = 0; d + W <= n; d += W) put(x + d, load(w + d) * (load(h + d) * r));
    for (; d < n; d++) x[d] = w[d] * (h[d] * r);
}

INLINE void silu_mul_row(float *out, const float *gate_up, int64_t n) {
    int64_t d = 0;
    for (; d + W <= n; d += W) {
        vec g = load(gate_up + d);
        put(out + d, g / (1.0f + vexp(-g)) * load(gate_up + n + d));
    }
    for (; d < n; d++) out[d] = gate_up[d] / (1.0f + expf(-gate_up[d])) * gate_up[n + d];
}

/* each product rounds, then their sum (no fused multiply-add), as transformers' operators do */
INLINE void rotate_row(float *x, const float *cos, const float *sin, int64_t heads, int64_t dim) {
    const int64_t half = dim / 2;
    for (int64_t h = 0; h < heads; h++, x += dim) {
        float first[128];  /* x1, read before the second half overwrites it */
        for (int64_t d = 0; d < half; d++) first[d] = x[d];
        for (int64_t d = 0; d < half; d++) {
            float a = x[d] * cos[d], b = x[half + d] * sin[d];
            x[d] = a + b;
        }
        for (int64_t d = 0; d < half; d++) {
            float a = x[half + d] * cos[half + d], b = first[d] * sin[half + d];
            x[half + d] = a + b;
        }
    }
}

typedef struct {
    float *x;        /* the rows an op writes */
    float *y;        /* its other rows: rms_norm's residual, silu_mul's gate_up */
    const float *w, *cos, *sin;
    int64_t x_stride, y_stride, cos_stride, sin_stride, cols, heads;
    float eps;
} Args;

/* Rows [lo, hi) of each op, compiled for each instruction set (`PER_ISA`). */
INLINE void norm_rows(const void *args, int64_t lo, int64_t hi) {
    const Args *a = args;
    for (int64_t i = lo; i < hi; i++)
        norm_row(a->x + i * a->x_stride, a->y ? a->y + i * a->y_stride : NULL, a->w, a->cols, a->eps);
}
PER_ISA(norm_rows);

INLINE void silu_mul_rows(const void *args, int64_t lo, int64_t hi) {
    const Args *a = args;
    for (int64_t i = lo; i < hi; i++) silu_mul_row(a->x + i * a->x_stride, a->y + i * a->y_stride, a->cols);
}
PER_ISA(silu_mul_rows);

INLINE void rotate_rows(const void *args, int64_t lo, int64_t hi) {
    const Args *a = args;
    for (int64_t i = lo; i < hi; i++)
        rotate_row(a->x + i * a->x_stride, a->cos + i * a->cos_stride, a->sin + i * a->sin_stride, a->heads,
                   a->cols / a->heads);
}
PER_ISA(rotate_rows, __attribute__((optimize("fp-contract=off"))));

/* The op's rows for this CPU, shared among `threads` when they hold `floats` or more. */
static void for_rows(void (*const op[NUM_ISAS])(const void *, int64_t, int64_t), const Args *a, int64_t n,
                     int64_t floats, int threads) {
    split(op[isa_best()], a, n, floats < PARALLEL_FLOATS ? 1 : threads);
}

/* ------------------------------------------------------------ the calls */

int parse_rows(PyObject *arg, const char *name, Rows *r) {
    if (!PyArg_ParseTuple(arg, "KLLL", &r->ptr, &r->rows, &r->cols, &r->stride)) {
        PyErr_Format(PyExc_TypeError, "%s: expected (address, rows, columns, row stride)", name);
        return -1;
    }
    const long long shape[2] = {r->rows, r->cols}, stride[2] = {r->stride, 1};
    if (r->rows < 0 || r->cols < 0 || r->stride < r->cols || !spans(r->ptr, 2, shape, stride, sizeof(float))) {
        PyErr_Format(PyExc_ValueError, "%s: %lld rows of %lld floats %lld apart", name, r->rows, r->cols, r->stride);
        return -1;
    }
    return 0;
}

#define FLOATS(r) ((float *)(uintptr_t)(r)->ptr)

int norm_check(const Rows *x, const Rows *residual, const Rows *w) {
    if (w->rows != 1 || w->cols != x->cols)
        return FAIL("weight is %lld x %lld; x's rows have %lld", w->rows, w->cols, x->cols);
    if (residual && (residual->rows != x->rows || residual->cols != x->cols))
        return FAIL("residual is %lld x %lld; x is %lld x %lld", residual->rows, residual->cols, x->rows, x->cols);
    return 0;
}

void norm_run(const Rows *x, const Rows *residual, const Rows *w, float eps, int threads) {
    Args a = {.x = FLOATS(x), .y = residual ? FLOATS(residual) : NULL, .w = FLOATS(w), .x_stride = x->stride,
              .y_stride = residual ? residual->stride : 0, .cols = x->cols, .eps = eps};
    for_rows(norm_rows_isa, &a, x->rows, x->rows * x->cols, threads);
}

int silu_mul_check(const Rows *out, const Rows *gate_up) {
    if (gate_up->rows != out->rows || gate_up->cols % 2 || gate_up->cols / 2 != out->cols)
        return FAIL("gate_up is %lld x %lld; out is %lld x %lld (half as wide)", gate_up->rows, gate_up->cols,
                    out->rows, out->cols);
    return 0;
}

void silu_mul_run(const Rows *out, const Rows *gate_up, int threads) {
    Args a = {.x = FLOATS(out), .y = FLOATS(gate_up), .x_stride = out->stride, .y_stride = gate_up->stride,
              .cols = out->cols};
    for_rows(silu_mul_rows_isa, &a, out->rows, gate_up->rows * gate_up->cols, threads);
}

int rotate_check(const Rows *x, long long heads, const Rows *cos, const Rows *sin) {
    if (heads < 1 || x->cols % heads) return FAIL("%lld floats a row do not split into %lld heads", x->cols, heads);
    const long long dim = x->cols / heads;
    if (dim % 2 || dim > 256) return FAIL("head dim %lld: rotate takes even ones up to 256", dim);
    if (cos->rows != x->rows || sin->rows != x->rows || cos->cols != dim || sin->cols != dim)
        return FAIL("cos and sin are %lld x %lld and %lld x %lld; x has %lld rows of heads of %lld", cos->rows,
                    cos->cols, sin->rows, sin->cols, x->rows, dim);
    return 0;
}

void rotate_run(const Rows *x, long long heads, const Rows *cos, const Rows *sin, int threads) {
    Args a = {.x = FLOATS(x), .cos = FLOATS(cos), .sin = FLOATS(sin), .x_stride = x->stride,
              .cos_stride = cos->stride, .sin_stride = sin->stride, .cols = x->cols, .heads = heads};
    for_rows(rotate_rows_isa, &a, x->rows, x->rows * x->cols, threads);
}

static PyObject *rms_norm(PyObject *mod, PyObject *args) {
    PyObject *xa, *ra, *wa;
    double eps;
    long long threads_arg;
    Rows x, res, w;
    if (!PyArg_ParseTuple(args, "OOOdL", &xa, &ra, &wa, &eps, &threads_arg)) return NULL;
    const int threads = clamp_threads(threads_arg);
    const Rows *residual = ra == Py_None ? NULL : &res;
    if (parse_rows(xa, "x", &x) || (residual && parse_rows(ra, "residual", &res)) || parse_rows(wa, "weight", &w) ||
        norm_check(&x, residual, &w))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    norm_run(&x, residual, &w, (float)eps, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *silu_mul(PyObject *mod, PyObject *args) {
    PyObject *oa, *ga;
    long long threads_arg;
    Rows out, gu;
    if (!PyArg_ParseTuple(args, "OOL", &oa, &ga, &threads_arg)) return NULL;
    const int threads = clamp_threads(threads_arg);
    if (parse_rows(oa, "out", &out) || parse_rows(ga, "gate_up", &gu) || silu_mul_check(&out, &gu)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    silu_mul_run(&out, &gu, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *rotate(PyObject *mod, PyObject *args) {
    PyObject *xa, *ca, *sa;
    long long heads, threads_arg;
    Rows x, cos, sin;
    if (!PyArg_ParseTuple(args, "OLOOL", &xa, &heads, &ca, &sa, &threads_arg)) return NULL;
    const int threads = clamp_threads(threads_arg);
    if (parse_rows(xa, "x", &x) || parse_rows(ca, "cos", &cos) || parse_rows(sa, "sin", &sin) ||
        rotate_check(&x, heads, &cos, &sin))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rotate_run(&x, heads, &cos, &sin, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyMethodDef OPS_METHODS[] = {
    {"rms_norm", rms_norm, METH_VARARGS,
     "rms_norm(x, residual, weight, eps, threads): x <- weight * RMS-normalized (residual + x), the sum kept in "
     "residual (None: x alone)."},
    {"silu_mul", silu_mul, METH_VARARGS,
     "silu_mul(out, gate_up, threads): out <- silu(gate) * up."},
    {"rotate", rotate, METH_VARARGS,
     "rotate(x, heads, cos, sin, threads): the rotary embedding of x's heads in place, sin's first half negated."},
    {NULL},
};
