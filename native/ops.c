/*
 * The engine forward's elementwise work between its GEMMs, one pass each,
 * over float32 or bfloat16 rows (each row contiguous, the rows any stride
 * apart; every argument of a call in one dtype):
 *
 *   rms_norm     x <- w * (h * rsqrt(mean(h^2) + eps)), h = x, or with a
 *                residual h = residual + x, stored back into the residual;
 *   silu_mul     out <- silu(gate) * up, gate and up the halves of a row;
 *   rotate       rows of heads <- x * cos + [x2, x1] * signed_sin in place
 *                (rotary embedding, sin's first half negated).
 *
 * Each is one call where transformers' modules take two to eight operators
 * (a cost paid again after every GEMM, whose weights push the operators'
 * code and data out of the caches).  Sums and products are float32; in
 * bfloat16 a value is rounded where transformers' operators round it (the
 * residual sum, the normalized row before the weight, silu before the
 * product, each rotary product), so the results are theirs but for the
 * float32 sum's order and exp's last place.  rotate rounds as transformers
 * does (each product, then their sum: no fused multiply-add); rms_norm's
 * sum and silu's exp are vattn's own, equal to within a few units in the
 * last place.  Rows are shared among OpenMP threads once there are enough
 * of them; the GIL is released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>

#include "common.h"
#include "ops.h"
#include "vector_math.h"

#pragma GCC diagnostic ignored "-Wpsabi"

enum { W = 16, PARALLEL_FLOATS = 1 << 16 };  /* below that many values, one thread */

typedef v16f vec;
typedef uint32_t vecu __attribute__((vector_size(4 * W)));
typedef float vec_u __attribute__((vector_size(4 * W), aligned(4)));
typedef uint16_t half_u __attribute__((vector_size(2 * W), aligned(2)));

/* W values from element d of a row of float32 (bf16 0) or bfloat16 (1) */
INLINE vec load(const void *row, int64_t d, int bf16) {
    if (!bf16) return *(const vec_u *)((const float *)row + d);
    return (vec)(__builtin_convertvector(*(const half_u *)((const uint16_t *)row + d), vecu) << 16);
}

/* x's bfloat16 bits (float_bf16, lane by lane) in the high halves */
INLINE vecu rounded(vec x) {
    const vecu bits = (vecu)x, nan = ((bits & 0x7fffffff) > 0x7f800000);
    return (((bits + 0x7fff + ((bits >> 16) & 1)) & 0xffff0000) & ~nan) | (0x7fc00000 & nan);
}

/* x rounded to bfloat16 where bf16, as a float32 */
INLINE vec round_to(vec x, int bf16) { return bf16 ? (vec)rounded(x) : x; }

INLINE void put(void *row, int64_t d, vec x, int bf16) {
    if (bf16)
        *(half_u *)((uint16_t *)row + d) = __builtin_convertvector(rounded(x) >> 16, half_u);
    else
        *(vec_u *)((float *)row + d) = x;
}

INLINE float get1(const void *row, int64_t d, int bf16) {
    return bf16 ? bf16_float(((const uint16_t *)row)[d]) : ((const float *)row)[d];
}

INLINE float round1(float f, int bf16) { return bf16 ? bf16_float(float_bf16(f)) : f; }

INLINE void put1(void *row, int64_t d, float f, int bf16) {
    if (bf16)
        ((uint16_t *)row)[d] = float_bf16(f);
    else
        ((float *)row)[d] = f;
}

/* ------------------------------------------------------------ the rows */

INLINE void norm_row(void *x, void *residual, const void *w, int64_t n, float eps, int bf16) {
    vec acc = {};
    int64_t d = 0;
    for (; d + W <= n; d += W) {
        vec h = load(x, d, bf16);
        if (residual) {
            h = round_to(h + load(residual, d, bf16), bf16);
            put(residual, d, h, bf16);
        }
        acc += h * h;
    }
    float ss = 0;
    for (int i = 0; i < W; i++) ss += acc[i];
    for (; d < n; d++) {
        float h = get1(x, d, bf16);
        if (residual) {
            h = round1(h + get1(residual, d, bf16), bf16);
            put1(residual, d, h, bf16);
        }
        ss += h * h;
    }
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    const void *h = residual ? residual : x;
    for (d = 0; d + W <= n; d += W) put(x, d, load(w, d, bf16) * round_to(load(h, d, bf16) * r, bf16), bf16);
    for (; d < n; d++) put1(x, d, get1(w, d, bf16) * round1(get1(h, d, bf16) * r, bf16), bf16);
}

INLINE void silu_mul_row(void *out, const void *gate_up, int64_t n, int bf16) {
    const int64_t esize = bf16 ? 2 : 4;
    const void *up = (const char *)gate_up + n * esize;
    int64_t d = 0;
    for (; d + W <= n; d += W) {
        vec g = load(gate_up, d, bf16);
        put(out, d, round_to(g / (1.0f + vexp(-g)), bf16) * load(up, d, bf16), bf16);
    }
    for (; d < n; d++) {
        float g = get1(gate_up, d, bf16);
        put1(out, d, round1(g / (1.0f + expf(-g)), bf16) * get1(up, d, bf16), bf16);
    }
}

/* each product rounds, then their sum (no fused multiply-add), as transformers' operators do */
INLINE void rotate_row(void *x, const void *cos, const void *sin, int64_t heads, int64_t dim, int bf16) {
    const int64_t half = dim / 2, esize = bf16 ? 2 : 4;
    for (int64_t h = 0; h < heads; h++, x = (char *)x + dim * esize) {
        float first[128];  /* x1, read before the second half overwrites it */
        for (int64_t d = 0; d < half; d++) first[d] = get1(x, d, bf16);
        for (int64_t d = 0; d < half; d++) {
            float a = round1(first[d] * get1(cos, d, bf16), bf16),
                  b = round1(get1(x, half + d, bf16) * get1(sin, d, bf16), bf16);
            put1(x, d, a + b, bf16);
        }
        for (int64_t d = 0; d < half; d++) {
            float a = round1(get1(x, half + d, bf16) * get1(cos, half + d, bf16), bf16),
                  b = round1(first[d] * get1(sin, half + d, bf16), bf16);
            put1(x, half + d, a + b, bf16);
        }
    }
}

typedef struct {
    char *x;        /* the rows an op writes */
    char *y;        /* its other rows: rms_norm's residual, silu_mul's gate_up */
    const char *w, *cos, *sin;
    int64_t x_stride, y_stride, cos_stride, sin_stride, cols, heads;  /* strides in bytes */
    float eps;
    int bf16;
} Args;

/* Rows [lo, hi) of each op, each dtype its own copy, compiled for each instruction set (`PER_ISA`). */
#define EACH_DTYPE(call) \
    if (a->bf16)         \
        call(1);         \
    else                 \
        call(0)

INLINE void norm_rows(const void *args, int64_t lo, int64_t hi) {
    const Args *a = args;
#define NORM(bf16)                                                                                          \
    for (int64_t i = lo; i < hi; i++)                                                                      \
    norm_row(a->x + i * a->x_stride, a->y ? a->y + i * a->y_stride : NULL, a->w, a->cols, a->eps, bf16)
    EACH_DTYPE(NORM);
#undef NORM
}
PER_ISA(norm_rows);

INLINE void silu_mul_rows(const void *args, int64_t lo, int64_t hi) {
    const Args *a = args;
#define SILU_MUL(bf16) \
    for (int64_t i = lo; i < hi; i++) silu_mul_row(a->x + i * a->x_stride, a->y + i * a->y_stride, a->cols, bf16)
    EACH_DTYPE(SILU_MUL);
#undef SILU_MUL
}
PER_ISA(silu_mul_rows);

INLINE void rotate_rows(const void *args, int64_t lo, int64_t hi) {
    const Args *a = args;
#define ROTATE(bf16)                                                                                            \
    for (int64_t i = lo; i < hi; i++)                                                                          \
    rotate_row(a->x + i * a->x_stride, a->cos + i * a->cos_stride, a->sin + i * a->sin_stride, a->heads,       \
               a->cols / a->heads, bf16)
    EACH_DTYPE(ROTATE);
#undef ROTATE
}
PER_ISA(rotate_rows, __attribute__((optimize("fp-contract=off"))));

/* The op's rows for the kernels' instruction set, shared among `threads` when they hold `values` or more. */
static void for_rows(void (*const op[NUM_ISAS])(const void *, int64_t, int64_t), const Args *a, int64_t n,
                     int64_t values, int threads) {
    split(op[kernel_isa], a, n, values < PARALLEL_FLOATS ? 1 : threads);
}

/* ------------------------------------------------------------ the calls */

int parse_rows(PyObject *arg, const char *name, Rows *r) {
    if (!PyArg_ParseTuple(arg, "KiLLL", &r->ptr, &r->dtype, &r->rows, &r->cols, &r->stride)) {
        PyErr_Format(PyExc_TypeError, "%s: expected (address, dtype, rows, columns, row stride)", name);
        return -1;
    }
    if (r->dtype != F32 && r->dtype != BF16) {
        PyErr_Format(PyExc_ValueError, "%s: rows are float32 or bfloat16, not dtype code %d", name, r->dtype);
        return -1;
    }
    const long long shape[2] = {r->rows, r->cols}, stride[2] = {r->stride, 1};
    if (r->rows < 0 || r->cols < 0 || r->stride < r->cols ||
        !spans(r->ptr, 2, shape, stride, r->dtype == BF16 ? 2 : 4)) {
        PyErr_Format(PyExc_ValueError, "%s: %lld rows of %lld values %lld apart", name, r->rows, r->cols, r->stride);
        return -1;
    }
    return 0;
}

/* Whether every one of n rows has the first's dtype (NULL: none given); a ValueError naming `what` where not. */
static int one_dtype(const char *what, int n, const Rows *const *rows) {
    for (int i = 1; i < n; i++)
        if (rows[i] && rows[i]->dtype != rows[0]->dtype)
            return FAIL("%s must have one dtype (codes %d and %d)", what, rows[0]->dtype, rows[i]->dtype);
    return 0;
}

#define BYTES(r) ((char *)(uintptr_t)(r)->ptr)
#define STRIDE(r) ((r)->stride * ((r)->dtype == BF16 ? 2 : 4))

int norm_check(const Rows *x, const Rows *residual, const Rows *w) {
    if (w->rows != 1 || w->cols != x->cols)
        return FAIL("weight is %lld x %lld; x's rows have %lld", w->rows, w->cols, x->cols);
    if (residual && (residual->rows != x->rows || residual->cols != x->cols))
        return FAIL("residual is %lld x %lld; x is %lld x %lld", residual->rows, residual->cols, x->rows, x->cols);
    return one_dtype("x, residual and weight", 3, (const Rows *[]){x, residual, w});
}

void norm_run(const Rows *x, const Rows *residual, const Rows *w, float eps, int threads) {
    Args a = {.x = BYTES(x), .y = residual ? BYTES(residual) : NULL, .w = BYTES(w), .x_stride = STRIDE(x),
              .y_stride = residual ? STRIDE(residual) : 0, .cols = x->cols, .eps = eps, .bf16 = x->dtype == BF16};
    for_rows(norm_rows_isa, &a, x->rows, x->rows * x->cols, threads);
}

int silu_mul_check(const Rows *out, const Rows *gate_up) {
    if (gate_up->rows != out->rows || gate_up->cols % 2 || gate_up->cols / 2 != out->cols)
        return FAIL("gate_up is %lld x %lld; out is %lld x %lld (half as wide)", gate_up->rows, gate_up->cols,
                    out->rows, out->cols);
    return one_dtype("out and gate_up", 2, (const Rows *[]){out, gate_up});
}

void silu_mul_run(const Rows *out, const Rows *gate_up, int threads) {
    Args a = {.x = BYTES(out), .y = BYTES(gate_up), .x_stride = STRIDE(out), .y_stride = STRIDE(gate_up),
              .cols = out->cols, .bf16 = out->dtype == BF16};
    for_rows(silu_mul_rows_isa, &a, out->rows, gate_up->rows * gate_up->cols, threads);
}

int rotate_check(const Rows *x, long long heads, const Rows *cos, const Rows *sin) {
    if (heads < 1 || x->cols % heads) return FAIL("%lld values a row do not split into %lld heads", x->cols, heads);
    const long long dim = x->cols / heads;
    if (dim % 2 || dim > 256) return FAIL("head dim %lld: rotate takes even ones up to 256", dim);
    if (cos->rows != x->rows || sin->rows != x->rows || cos->cols != dim || sin->cols != dim)
        return FAIL("cos and sin are %lld x %lld and %lld x %lld; x has %lld rows of heads of %lld", cos->rows,
                    cos->cols, sin->rows, sin->cols, x->rows, dim);
    return one_dtype("x, cos and sin", 3, (const Rows *[]){x, cos, sin});
}

void rotate_run(const Rows *x, long long heads, const Rows *cos, const Rows *sin, int threads) {
    Args a = {.x = BYTES(x), .cos = BYTES(cos), .sin = BYTES(sin), .x_stride = STRIDE(x),
              .cos_stride = STRIDE(cos), .sin_stride = STRIDE(sin), .cols = x->cols, .heads = heads,
              .bf16 = x->dtype == BF16};
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
