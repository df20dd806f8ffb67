/*
 * vattn._native, the C core: each part's functions (its METHODS table) and
 * types gathered into one module.  Python reaches it through
 * vattn/binding.py alone.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "attention.h"
#include "decoder.h"
#include "dlpack.h"
#include "ops.h"
#include "vmm.h"

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "vattn._native",
                                    "Host virtual-memory primitives (mmap + memfd), DLPack capsules over raw memory, "
                                    "CPU attention over strided K/V, the engine forward's elementwise operators, "
                                    "its float32 GEMM, and its decoder layers in one call.",
                                    -1, NULL};

PyMODINIT_FUNC PyInit__native(void) {
    attention_init();
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyMethodDef *parts[] = {VMM_METHODS, DLPACK_METHODS, ATTENTION_METHODS, OPS_METHODS, LINEAR_METHODS,
                            DECODER_METHODS};
    for (size_t i = 0; i < sizeof(parts) / sizeof(parts[0]); i++)
        if (PyModule_AddFunctions(m, parts[i]) < 0) goto fail;
    if (vmm_add_types(m) < 0 || PyModule_AddIntConstant(m, "LINEAR_PANEL", LINEAR_PANEL) < 0) goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
