/*
 * vattn._native, the C core: each part's functions (its METHODS table) and
 * types gathered into one module.  Python reaches it through
 * vattn/binding.py alone.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

#include "attention.h"
#include "common.h"
#include "decoder.h"
#include "dlpack.h"
#include "ops.h"
#include "vmm.h"

Isa kernel_isa = ISA_BASELINE;

/* isa([name]): the instruction set the attention and elementwise kernels run, after forcing `name` (one this
 * CPU has: the tests run every path). */
static PyObject *isa(PyObject *mod, PyObject *args) {
    const char *want = NULL;
    if (!PyArg_ParseTuple(args, "|z", &want)) return NULL;
    if (!want) return PyUnicode_FromString(ISA_NAMES[kernel_isa]);
    for (int i = 0; i < NUM_ISAS; i++)
        if (!strcmp(want, ISA_NAMES[i]) && isa_supported(i)) {
            kernel_isa = i;
            return PyUnicode_FromString(ISA_NAMES[i]);
        }
    PyObject *names = PyList_New(0);
    for (int i = 0; names && i < NUM_ISAS; i++)
        if (isa_supported(i)) {
            PyObject *name = PyUnicode_FromString(ISA_NAMES[i]);
            if (!name || PyList_Append(names, name)) Py_CLEAR(names);
            Py_XDECREF(name);
        }
    if (names) PyErr_Format(PyExc_ValueError, "instruction set %R: this CPU runs %R", PyTuple_GET_ITEM(args, 0), names);
    Py_XDECREF(names);
    return NULL;
}

static PyMethodDef MODULE_METHODS[] = {
    {"isa", isa, METH_VARARGS,
     "isa([name]): the instruction set the attention and elementwise kernels run, after forcing name "
     "('amx', 'avx512_bf16', 'avx512', 'avx2', 'baseline': one this CPU has)."},
    {NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "vattn._native",
                                    "Host virtual-memory primitives (mmap + memfd), DLPack capsules over raw memory, "
                                    "CPU attention over strided K/V, the engine forward's elementwise operators (float32 and bfloat16), "
                                    "its float32 GEMM, and its decoder layers in one call.",
                                    -1, NULL};

PyMODINIT_FUNC PyInit__native(void) {
    kernel_isa = isa_best();
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyMethodDef *parts[] = {MODULE_METHODS, VMM_METHODS, DLPACK_METHODS, ATTENTION_METHODS, OPS_METHODS, LINEAR_METHODS,
                            DECODER_METHODS};
    for (size_t i = 0; i < sizeof(parts) / sizeof(parts[0]); i++)
        if (PyModule_AddFunctions(m, parts[i]) < 0) goto fail;
    if (vmm_add_types(m) < 0 || PyModule_AddIntConstant(m, "LINEAR_PANEL", LINEAR_PANEL) < 0) goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
