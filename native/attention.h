#pragma once
#include <Python.h>

#include <stdint.h>

/* attend(q, out, k, v, requests, scale, window, threads[, new_k, new_v]): see attention.c */
extern PyMethodDef ATTENTION_METHODS[];

/* What the kernel reads of a tensor: address, dtype code (0 float32, 1 bfloat16), sizes, strides in elements */
typedef struct {
    unsigned long long ptr;
    int dtype;
    long long shape[4], stride[4];
} View;

enum { ATTEND_FIELDS = 5 };  /* int64s a request of the table: slot, start, length, q_first, num_q */

/* A View of ndim (3 or 4) from its tuple; -1 with a Python error set where it is not one */
int parse_view(PyObject *arg, const char *name, int ndim, View *v);
/* The number of requests in a request table, or -1 with a ValueError set */
int attend_table(const Py_buffer *table, int64_t *n);
/* attend() as its check (-1 with a ValueError set) and its work (GIL released; -1: out of memory).
 * new_k and new_v: NULL for none; threads: clamped to the machine's (clamp_threads). */
int attend_check(const View *q, const View *out, const View *k, const View *v, const View *nk, const View *nv,
                 const int64_t *reqs, int64_t n, long long window);
int attend_run(const View *q, const View *out, const View *k, const View *v, const View *nk, const View *nv,
               const int64_t *reqs, int64_t n, double scale, long long window, int threads);
