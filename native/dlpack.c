/*
 * dlpack(): a DLPack capsule over raw memory, so torch builds a tensor over a
 * reserved range on the device the caller names, with no copy and no query of
 * the pointer (a CUDA range whose first page is unmapped has no attributes to
 * query).  The capsule holds a reference to `owner` (the reservation) until
 * the last tensor over it is gone, so the range outlives every view.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>

#include "common.h"
#include "dlpack.h"

/* DLPack's unversioned ABI (dlpack.h, v0.8), the one every torch accepts. */
typedef struct {
    int32_t device_type;
    int32_t device_id;
} DLDevice;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

typedef struct {
    DLManagedTensor managed;
    int64_t shape[1];
    int64_t strides[1];
} Managed;

enum { kDLUInt = 1 };

static int finalizing(void) {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
}

/* Called by the consumer when its tensor dies, maybe on another thread and
 * without the GIL. */
static void managed_deleter(DLManagedTensor *m) {
    PyObject *owner = m->manager_ctx;
    if (owner && !finalizing()) {
        PyGILState_STATE gil = PyGILState_Ensure();
        Py_DECREF(owner);
        PyGILState_Release(gil);
    }
    free(m);
}

/* A capsule dropped unconsumed still owns its tensor; a consumer renames it. */
static void capsule_destructor(PyObject *capsule) {
    if (!PyCapsule_IsValid(capsule, "dltensor")) return;
    DLManagedTensor *m = PyCapsule_GetPointer(capsule, "dltensor");
    m->deleter(m);
}

static PyObject *dlpack(PyObject *mod, PyObject *args) {
    PyObject *owner;
    unsigned long long address;
    long long nbytes;
    int device_type, device_id;
    if (!PyArg_ParseTuple(args, "OKLii", &owner, &address, &nbytes, &device_type, &device_id)) return NULL;
    if (nbytes <= 0) return PyErr_Format(PyExc_ValueError, "dlpack needs a positive size, got %lld", nbytes);
    if (!in_address_space(address, nbytes))
        return PyErr_Format(PyExc_ValueError, "%lld bytes at %p run past the end of the address space", nbytes,
                            (void *)(uintptr_t)address);
    Managed *m = calloc(1, sizeof(Managed));
    if (!m) return PyErr_NoMemory();
    m->shape[0] = nbytes;
    m->strides[0] = 1;
    DLTensor *t = &m->managed.dl_tensor;
    t->data = (void *)(uintptr_t)address;
    t->device = (DLDevice){device_type, device_id};
    t->ndim = 1;
    t->dtype = (DLDataType){kDLUInt, 8, 1};
    t->shape = m->shape;
    t->strides = m->strides;
    m->managed.manager_ctx = owner;
    m->managed.deleter = managed_deleter;
    Py_INCREF(owner);
    PyObject *capsule = PyCapsule_New(&m->managed, "dltensor", capsule_destructor);
    if (!capsule) managed_deleter(&m->managed);
    return capsule;
}

PyMethodDef DLPACK_METHODS[] = {
    {"dlpack", dlpack, METH_VARARGS,
     "dlpack(owner, address, nbytes, device_type, device_id): a DLPack capsule of nbytes uint8 at address, "
     "keeping owner alive."},
    {NULL},
};
