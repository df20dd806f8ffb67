#pragma once
#include <Python.h>

/* dlpack(owner, address, nbytes, device_type, device_id) -> "dltensor" capsule */
extern PyMethodDef DLPACK_METHODS[];
