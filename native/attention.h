#pragma once
#include <Python.h>

/* attend(q, out, k, v, requests, scale, window, threads): see attention.c */
PyObject *attend(PyObject *mod, PyObject *args);
/* attention_isa([name]) -> the instruction set attend() runs ("avx2" or "baseline"), set to name first */
PyObject *attention_isa(PyObject *mod, PyObject *args);
/* Picks the instruction set from the CPU's features. */
void attention_init(void);
