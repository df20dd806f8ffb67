#pragma once
#include <Python.h>

/* rms_norm(x, residual, weight, eps, threads), silu_mul(out, gate_up, threads),
 * rotate(x, heads, cos, sin, threads): see ops.c; each matrix is
 * (address, dtype code, rows, columns, row stride) of float32 or bfloat16 */
extern PyMethodDef OPS_METHODS[];

/* linear(out, x, panels, bias, threads): out <- x W^T + bias over W packed in panels of LINEAR_PANEL
 * columns; linear_serves(): whether float32 weights are its to run here (AVX-512).  See linear.c. */
extern const int LINEAR_PANEL;
extern PyMethodDef LINEAR_METHODS[];

/* (address, dtype code, rows, values a row, row stride) of a float32 (F32) or bfloat16 (BF16) matrix, from
 * Python */
typedef struct {
    unsigned long long ptr;
    int dtype;
    long long rows, cols, stride;
} Rows;

/* Rows from its tuple; -1 with a Python error set where it is not one */
int parse_rows(PyObject *arg, const char *name, Rows *r);

/* Each call above as its check (-1 with a ValueError set; needs the GIL) and its work (none: runs with
 * the GIL released; threads: clamped to the machine's, clamp_threads; the GEMM's -1: out of memory).  A
 * residual or bias of NULL: none. */
int norm_check(const Rows *x, const Rows *residual, const Rows *w);
void norm_run(const Rows *x, const Rows *residual, const Rows *w, float eps, int threads);
int silu_mul_check(const Rows *out, const Rows *gate_up);
void silu_mul_run(const Rows *out, const Rows *gate_up, int threads);
int rotate_check(const Rows *x, long long heads, const Rows *cos, const Rows *sin);
void rotate_run(const Rows *x, long long heads, const Rows *cos, const Rows *sin, int threads);
int linear_check(const Rows *y, const Rows *x, const Rows *w, const Rows *b);
int linear_run(const Rows *y, const Rows *x, const Rows *w, const Rows *b, int threads);
/* y <- silu(gate) * up, [gate | up] = x W^T + b (W packed as for linear_run), y's columns a
 * multiple of LINEAR_PANEL: silu_mul's result, bit for bit, with no [gate | up] rows written. */
int linear_silu_mul_check(const Rows *y, const Rows *x, const Rows *w, const Rows *b);
int linear_silu_mul_run(const Rows *y, const Rows *x, const Rows *w, const Rows *b, int threads);
