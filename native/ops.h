#pragma once
#include <Python.h>

/* rms_norm(x, residual, weight, eps, threads), silu_mul(out, gate_up, threads),
 * rotate(x, heads, cos, sin, threads): see ops.c; each matrix is
 * (address, rows, columns, row stride) of float32 */
PyObject *rms_norm(PyObject *mod, PyObject *args);
PyObject *silu_mul(PyObject *mod, PyObject *args);
PyObject *rotate(PyObject *mod, PyObject *args);
