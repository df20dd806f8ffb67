#pragma once
#include <Python.h>

/* map_pages, unmap_pages, punch_pages, page_out, trim_heap, raw_map_loop, os_page_size: see vmm.c */
extern PyMethodDef VMM_METHODS[];
/* Reservation, PhysicalFile and MapLimitError added to the module; -1 with an error set where not. */
int vmm_add_types(PyObject *module);
