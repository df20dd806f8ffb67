/*
 * decoder_layers(): every decoder layer of a step's forward in one call, the
 * engine's fused forward (vattn/engine/forward.py) in C.  Per layer:
 *
 *   qkv = x W_qkv^T (+ b); rotate Q and K; store K, V in the cache and attend;
 *   o = attention W_o^T; residual += o, o = rms_norm(residual);
 *   down = (silu(gate) * up)(o W_gate_up^T) W_down^T (gated: one call, where the
 *   GEMM takes the MLP's width);
 *   residual += down, x = rms_norm(residual) with the next layer's weight.
 *
 * The same kernels as the engine's single calls (linear.c, ops.c,
 * attention.c) in the same order, so the logits are the same bit for bit;
 * what is gone is Python between them: some 270 calls a step and their
 * argument checks, each paying for its code and data again after a GEMM has
 * streamed its weights through the caches.  Past the last layer's
 * attention only the sampled rows go on (the others' K/V are all the cache
 * needs of them).
 *
 * In float32 or bfloat16: the step's rows, the weights and the cache in one
 * dtype, rounded where the single calls round.
 *
 * Every argument of every layer is checked before anything is written: a bad
 * call raises ValueError and leaves the buffers and the cache as they were.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "attention.h"
#include "common.h"
#include "decoder.h"
#include "ops.h"

/* One layer's weights and cache: what decoder_layers() takes of it. */
typedef struct {
    Rows qkv, o, gate_up, down;            /* packed weights */
    Rows qkv_b, o_b, gate_up_b, down_b;    /* their biases: rows 0 for none */
    Rows input_norm, post_norm;
    double input_eps, post_eps, scale;
    long long window;
    View k, v;
} Layer;

/* The step's rows: the residual stream, each call's output, and the rotary rows. */
typedef struct {
    Rows residual, x, qkv, attention, o, gate_up, act, down, cos, sin;
} Step;

static const Rows *bias(const Rows *b) { return b->rows ? b : NULL; }

static int parse_bias(PyObject *arg, const char *name, Rows *b) {
    if (arg == Py_None) {
        memset(b, 0, sizeof(*b));
        return 0;
    }
    return parse_rows(arg, name, b);
}

static int parse_layer(PyObject *arg, Layer *l) {
    PyObject *w[4], *b[4], *in, *post, *k, *v;
    if (!PyTuple_Check(arg) ||
        !PyArg_ParseTuple(arg, "OOOOOOOOOdOdOOdL", &w[0], &b[0], &w[1], &b[1], &w[2], &b[2], &w[3], &b[3], &in,
                          &l->input_eps, &post, &l->post_eps, &k, &v, &l->scale, &l->window)) {
        PyErr_SetString(PyExc_TypeError, "a layer is (qkv, its bias, o, bias, gate_up, bias, down, bias, input norm, "
                                         "eps, post norm, eps, k, v, scale, window)");
        return -1;
    }
    return parse_rows(w[0], "qkv", &l->qkv) || parse_bias(b[0], "qkv bias", &l->qkv_b) ||
           parse_rows(w[1], "o", &l->o) || parse_bias(b[1], "o bias", &l->o_b) ||
           parse_rows(w[2], "gate_up", &l->gate_up) || parse_bias(b[2], "gate_up bias", &l->gate_up_b) ||
           parse_rows(w[3], "down", &l->down) || parse_bias(b[3], "down bias", &l->down_b) ||
           parse_rows(in, "input norm", &l->input_norm) || parse_rows(post, "post norm", &l->post_norm) ||
           parse_view(k, "k", 4, &l->k) || parse_view(v, "v", 4, &l->v);
}

static int64_t esize(const Rows *r) { return r->dtype == BF16 ? 2 : 4; }

/* The first `rows` rows of r. */
static Rows head(Rows r, int64_t rows) {
    r.rows = rows;
    return r;
}

/* Columns [c0, c0 + n) of r. */
static Rows columns(Rows r, int64_t c0, int64_t n) {
    r.ptr += c0 * esize(&r);
    r.cols = n;
    return r;
}

/* Rows r as attention's [rows, heads, dim] (heads side by side in a row), from column c0 on. */
static View heads_of(const Rows *r, int64_t c0, int64_t heads, int64_t dim) {
    return (View){.ptr = r->ptr + c0 * esize(r), .dtype = r->dtype, .shape = {r->rows, heads, dim},
                  .stride = {r->stride, dim, 1}};
}

/* Whether the MLP runs as one gated GEMM (linear.c): gate and up panels paired. */
static int gated(const Step *s) { return s->act.cols % LINEAR_PANEL == 0; }

/* Every call of every layer checked as the single calls check them. */
static int check(const Layer *layers, int64_t L, const Step *s, const int64_t *sampled, int64_t R,
                 const int64_t *table, int64_t n, long long H) {
    const int64_t T = s->residual.rows, G = layers[0].k.shape[2], D = layers[0].k.shape[3];
    if (T < 1) return FAIL("the step has no rows");
    const int64_t heads = add_sat(add_sat(H, G), G);  /* a qkv row's: Q's, K's and V's */
    if (H < 1 || G < 1 || heads == INT64_MAX) return FAIL("%lld query heads, %lld K/V heads", H, (long long)G);
    const Rows *all[] = {&s->x, &s->qkv, &s->attention, &s->o, &s->gate_up, &s->act, &s->down, &s->cos, &s->sin};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        if (all[i]->rows != T) return FAIL("the step's buffers have %lld rows; the residual has %lld",
                                           all[i]->rows, (long long)T);
    if (s->x.cols != s->residual.cols) return FAIL("x has %lld columns; the residual %lld", s->x.cols,
                                                   s->residual.cols);
    if (s->qkv.cols != mul_sat(heads, D) || s->attention.cols != mul_sat(H, D))
        return FAIL("qkv and attention have %lld and %lld columns; %lld query heads and %lld K/V heads of %lld take "
                    "%lld and %lld", s->qkv.cols, s->attention.cols, H, (long long)G, (long long)D,
                    (long long)mul_sat(heads, D), (long long)mul_sat(H, D));
    for (int64_t i = 0; i < R; i++)
        if (sampled[i] < 0 || (i && sampled[i] <= sampled[i - 1]) || sampled[i] >= T)
            return FAIL("sampled rows must rise, each below the step's %lld rows; row %lld is %lld", (long long)T,
                        (long long)i, (long long)sampled[i]);
    const Rows qk = columns(s->qkv, 0, (H + G) * D);
    if (norm_check(&s->x, NULL, &layers[0].input_norm) || rotate_check(&qk, H + G, &s->cos, &s->sin) ||
        silu_mul_check(&s->act, &s->gate_up))
        return -1;
    const View q = heads_of(&s->qkv, 0, H, D), nk = heads_of(&s->qkv, H * D, G, D),
               nv = heads_of(&s->qkv, (H + G) * D, G, D), out = heads_of(&s->attention, 0, H, D);
    for (int64_t l = 0; l < L; l++) {
        const Layer *y = &layers[l];
        if (y->k.dtype != s->residual.dtype || y->k.shape[2] != G || y->k.shape[3] != D)
            return FAIL("layer %lld: its cache is not [slots, rows, %lld, %lld] of the residual's dtype (code %d)",
                        (long long)l, (long long)G, (long long)D, s->residual.dtype);
        if (linear_check(&s->qkv, l ? &s->down : &s->x, &y->qkv, bias(&y->qkv_b)) ||
            attend_check(&q, &out, &y->k, &y->v, &nk, &nv, table, n, y->window) ||
            linear_check(&s->o, &s->attention, &y->o, bias(&y->o_b)) ||
            norm_check(&s->o, &s->residual, &y->post_norm) ||
            (gated(s) ? linear_silu_mul_check(&s->act, &s->o, &y->gate_up, bias(&y->gate_up_b))
                      : linear_check(&s->gate_up, &s->o, &y->gate_up, bias(&y->gate_up_b))) ||
            linear_check(&s->down, &s->act, &y->down, bias(&y->down_b)) ||
            (l + 1 < L && norm_check(&s->down, &s->residual, &layers[l + 1].input_norm))) {
            PyObject *type, *value, *trace;
            PyErr_Fetch(&type, &value, &trace);
            PyErr_Format(type, "layer %lld: %S", (long long)l, value ? value : Py_None);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(trace);
            return -1;
        }
    }
    return 0;
}

/* Rows sampled[i] of r moved to row i: sampled rises, so no row is read after it is written. */
static void gather(const Rows *r, const int64_t *sampled, int64_t R) {
    char *base = (char *)(uintptr_t)r->ptr;
    const int64_t row = r->stride * esize(r);
    for (int64_t i = 0; i < R; i++)
        if (sampled[i] != i) memcpy(base + i * row, base + sampled[i] * row, r->cols * esize(r));
}

/* y += x, rows of one dtype (bfloat16: each sum rounded, as torch's add) */
static void add_rows(const Rows *y, const Rows *x) {
    for (int64_t i = 0; i < y->rows; i++)
        for (int64_t j = 0; j < y->cols; j++)
            if (y->dtype == BF16) {
                uint16_t *a = (uint16_t *)(uintptr_t)y->ptr + i * y->stride;
                const uint16_t *b = (const uint16_t *)(uintptr_t)x->ptr + i * x->stride;
                a[j] = float_bf16(bf16_float(a[j]) + bf16_float(b[j]));
            } else {
                ((float *)(uintptr_t)y->ptr)[i * y->stride + j] += ((const float *)(uintptr_t)x->ptr)[i * x->stride + j];
            }
}

/* The layers; -1 where the attention or a GEMM ran out of memory. */
static int run(const Layer *layers, int64_t L, const Step *s, const int64_t *sampled, int64_t R,
               const int64_t *table, int64_t n, long long H, int threads) {
    const int64_t G = layers[0].k.shape[2], D = layers[0].k.shape[3];
    int64_t T = s->residual.rows;
    for (int64_t i = 0; i < T; i++)
        memcpy((char *)(uintptr_t)s->x.ptr + i * s->x.stride * esize(&s->x),
               (const char *)(uintptr_t)s->residual.ptr + i * s->residual.stride * esize(&s->residual),
               s->x.cols * esize(&s->x));
    norm_run(&s->x, NULL, &layers[0].input_norm, (float)layers[0].input_eps, threads);
    const Rows qk = columns(s->qkv, 0, (H + G) * D);
    const View q = heads_of(&s->qkv, 0, H, D), nk = heads_of(&s->qkv, H * D, G, D),
               nv = heads_of(&s->qkv, (H + G) * D, G, D), out = heads_of(&s->attention, 0, H, D);
    for (int64_t l = 0; l < L; l++) {
        const Layer *y = &layers[l];
        if (linear_run(&s->qkv, l ? &s->down : &s->x, &y->qkv, bias(&y->qkv_b), threads)) return -1;
        rotate_run(&qk, H + G, &s->cos, &s->sin, threads);
        if (attend_run(&q, &out, &y->k, &y->v, &nk, &nv, table, n, y->scale, y->window, threads)) return -1;
        if (l + 1 == L) {
            gather(&s->attention, sampled, R);
            gather(&s->residual, sampled, R);
            T = R;
        }
        const Rows attention = head(s->attention, T), residual = head(s->residual, T), o = head(s->o, T),
                   gate_up = head(s->gate_up, T), act = head(s->act, T), down = head(s->down, T);
        if (linear_run(&o, &attention, &y->o, bias(&y->o_b), threads)) return -1;
        norm_run(&o, &residual, &y->post_norm, (float)y->post_eps, threads);
        if (gated(s)) {
            if (linear_silu_mul_run(&act, &o, &y->gate_up, bias(&y->gate_up_b), threads)) return -1;
        } else {
            if (linear_run(&gate_up, &o, &y->gate_up, bias(&y->gate_up_b), threads)) return -1;
            silu_mul_run(&act, &gate_up, threads);
        }
        if (linear_run(&down, &act, &y->down, bias(&y->down_b), threads)) return -1;
        if (l + 1 < L)
            norm_run(&down, &residual, &layers[l + 1].input_norm, (float)layers[l + 1].input_eps, threads);
        else
            add_rows(&residual, &down);
    }
    return 0;
}

static PyObject *decoder_layers(PyObject *mod, PyObject *args) {
    PyObject *layers_arg, *rows[10];
    static const char *names[10] = {"residual", "x", "qkv", "attention", "o", "gate_up", "act", "down", "cos", "sin"};
    Py_buffer table, sampled;
    long long H, threads_arg;
    int failed;
    if (!PyArg_ParseTuple(args, "O!OOOOOOOOOOy*y*LL", &PyTuple_Type, &layers_arg, &rows[0], &rows[1], &rows[2],
                          &rows[3], &rows[4], &rows[5], &rows[6], &rows[7], &rows[8], &rows[9], &table, &sampled, &H,
                          &threads_arg))
        return NULL;
    const int threads = clamp_threads(threads_arg);
    PyObject *result = NULL;
    Step s;
    Rows *step_rows[10] = {&s.residual, &s.x, &s.qkv, &s.attention, &s.o, &s.gate_up, &s.act, &s.down, &s.cos, &s.sin};
    const int64_t L = PyTuple_GET_SIZE(layers_arg);
    Layer *layers = PyMem_Calloc(L ? L : 1, sizeof(Layer));
    int64_t n, R = sampled.len / (int64_t)sizeof(int64_t);
    if (!layers) {
        PyErr_NoMemory();
        goto done;
    }
    if (L < 1) {
        PyErr_SetString(PyExc_ValueError, "no layers");
        goto done;
    }
    if (sampled.len % sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "sampled rows: int64 each");
        goto done;
    }
    for (int i = 0; i < 10; i++)
        if (parse_rows(rows[i], names[i], step_rows[i])) goto done;
    for (int64_t l = 0; l < L; l++)
        if (parse_layer(PyTuple_GET_ITEM(layers_arg, l), &layers[l])) goto done;
    if (attend_table(&table, &n) || check(layers, L, &s, sampled.buf, R, table.buf, n, H)) goto done;
    Py_BEGIN_ALLOW_THREADS
    failed = run(layers, L, &s, sampled.buf, R, table.buf, n, H, threads);
    Py_END_ALLOW_THREADS
    result = failed ? PyErr_NoMemory() : Py_NewRef(Py_None);
done:
    PyMem_Free(layers);
    PyBuffer_Release(&table);
    PyBuffer_Release(&sampled);
    return result;
}

PyMethodDef DECODER_METHODS[] = {
    {"decoder_layers", decoder_layers, METH_VARARGS,
     "decoder_layers(layers, residual, x, qkv, attention, o, gate_up, act, down, cos, sin, requests, sampled, heads, "
     "threads): every decoder layer of a step, the calls above in turn; the sampled rows' residual stream left in "
     "the residual's first rows."},
    {NULL},
};
