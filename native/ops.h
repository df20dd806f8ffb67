#pragma once
#include <Python.h>

/* rms_norm(x, residual, weight, eps, threads), silu_mul(out, gate_up, threads),
 * rotate(x, heads, cos, sin, threads): see ops.c; each matrix is
 * (address, rows, columns, row stride) of float32 */
PyObject *rms_norm(PyObject *mod, PyObject *args);
PyObject *silu_mul(PyObject *mod, PyObject *args);
PyObject *rotate(PyObject *mod, PyObject *args);

/* linear(out, x, panels, bias, threads): out <- x W^T + bias over W packed in panels of LINEAR_PANEL
 * columns; linear_serves(): whether this CPU runs it.  See linear.c. */
extern const int LINEAR_PANEL;
PyObject *linear(PyObject *mod, PyObject *args);
PyObject *linear_serves(PyObject *mod, PyObject *noargs);

/* (address, rows, floats a row, row stride) of a float32 matrix, from Python */
typedef struct {
    unsigned long long ptr;
    long long rows, cols, stride;
} Rows;

/* Rows from its tuple; -1 with a Python error set where it is not one */
int parse_rows(PyObject *arg, const char *name, Rows *r);
