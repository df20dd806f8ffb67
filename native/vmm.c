/*
 * Host virtual-memory primitives for the KV cache.
 *
 * A Reservation is a range of virtual addresses with no memory behind it
 * (PROT_NONE), or behind it only the kernel's shared zero page (read-only),
 * when it is zero-backed.  A PhysicalFile is a memfd: the pool of physical
 * pages.  map_pages() maps pages of the file at addresses of the reservation
 * (MAP_SHARED|MAP_FIXED), read-write or read-only; unmap_pages() puts the
 * reservation's own backing back.  Mapping one file page at two addresses is
 * real page sharing.
 *
 * Batched calls validate everything first, release the GIL, merge runs of
 * pages that are contiguous in both the reservation and the file into one
 * syscall, and undo what they did if a syscall fails, so a failed call leaves
 * nothing half-mapped (at vm.max_map_count, see map_pages, a page may stay
 * showing that no record reaches).
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common.h"
#include "vmm.h"

static PyObject *MapLimitError;

static long os_page(void) { return sysconf(_SC_PAGESIZE); }

static long max_map_count(void) {
    long value = -1;
    FILE *f = fopen("/proc/sys/vm/max_map_count", "r");
    if (f) {
        if (fscanf(f, "%ld", &value) != 1) value = -1;
        fclose(f);
    }
    return value;
}

/* Whether the process holds about vm.max_map_count mappings (the lines of /proc/self/maps; within a
 * few, as other threads map and unmap meanwhile). */
static int near_map_limit(void) {
    long limit = max_map_count(), lines = 0;
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) return 0;
    for (int c; (c = getc(f)) != EOF;) lines += c == '\n';
    fclose(f);
    return limit >= 0 && lines >= limit - 8;
}

/* Raise OSError(err, message); message: a new reference, or NULL with an error set. */
static PyObject *raise_oserror(int err, PyObject *message) {
    PyObject *exc = message ? PyObject_CallFunction(PyExc_OSError, "iN", err, message) : NULL;
    if (exc) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return NULL;
}

static PyObject *raise_errno(const char *what, int err) {
    return raise_oserror(err, PyUnicode_FromFormat("%s failed: %s", what, strerror(err)));
}

/* Raise for a failed mmap over our own reservation: it takes no new address space or memory, so
 * ENOMEM there is the process out of mapping entries (MapLimitError); else OSError. */
static PyObject *raise_map_errno(const char *what, int err) {
    if (err == ENOMEM) {
        PyErr_Format(MapLimitError,
                     "%s failed: %s: the process has likely reached the OS limit of "
                     "vm.max_map_count=%ld mapping entries (raise it with sysctl, or use "
                     "larger pages)",
                     what, strerror(err), max_map_count());
        return NULL;
    }
    return raise_errno(what, err);
}

/* ---------------------------------------------------------------- Reservation */

typedef struct {
    PyObject_HEAD
    char *addr;
    Py_ssize_t nbytes;
    int zero_backed;
} Reservation;

/* One mapping entry held in reserve: a page of its own memfd, so that it
 * merges with no neighbour and unmapping it always gives its entry back. */
static char *spare_entry;
static pthread_mutex_t spare_lock = PTHREAD_MUTEX_INITIALIZER;

static void take_spare_entry(void) {
    int fd = memfd_create("vattn-spare-entry", MFD_CLOEXEC);
    if (fd < 0) return;
    if (ftruncate(fd, os_page()) == 0) {
        void *p = mmap(NULL, os_page(), PROT_NONE, MAP_SHARED, fd, 0);
        spare_entry = p == MAP_FAILED ? NULL : p;
    }
    close(fd);
}

/* Put the reservation's own backing (PROT_NONE, or the zero page) over
 * [addr, addr+len), replacing what is there in one mmap.  At vm.max_map_count
 * that is refused (the process may even be one entry over, which the kernel
 * lets an unmap leave); the spare entry is then given up and the mmap tried
 * again.  The range is never unmapped first: for as long as the hole lasted,
 * another thread's mmap could be placed in it, and a later map here would
 * overwrite that memory.  Where it still fails, what was there stays. */
static int backing(Reservation *r, char *addr, size_t len) {
    int prot = r->zero_backed ? PROT_READ : PROT_NONE;
    int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED;
    if (mmap(addr, len, prot, flags, -1, 0) != MAP_FAILED) return 0;
    if (errno != ENOMEM) return errno;
    pthread_mutex_lock(&spare_lock);
    int err = ENOMEM;
    if (spare_entry && munmap(spare_entry, os_page()) == 0) {
        spare_entry = NULL;
        err = mmap(addr, len, prot, flags, -1, 0) == MAP_FAILED ? errno : 0;
    }
    if (!spare_entry) take_spare_entry();
    pthread_mutex_unlock(&spare_lock);
    return err;
}

static int Reservation_init(Reservation *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"nbytes", "zero_backed", NULL};
    Py_ssize_t nbytes;
    int zero_backed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n|p", kwlist, &nbytes, &zero_backed)) return -1;
    if (self->addr) {
        PyErr_SetString(PyExc_RuntimeError, "Reservation is already initialised");
        return -1;
    }
    if (nbytes <= 0 || nbytes % os_page()) {
        PyErr_Format(PyExc_ValueError,
                     "reservation size must be a positive multiple of the OS page size (%ld), got %zd",
                     os_page(), nbytes);
        return -1;
    }
    int prot = zero_backed ? PROT_READ : PROT_NONE;
    void *p = mmap(NULL, nbytes, prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        int err = errno;
        if (err == ENOMEM && !near_map_limit()) /* a new range: out of address space, not of mappings */
            raise_oserror(err, PyUnicode_FromFormat("could not reserve %zd bytes of address space: %s", nbytes,
                                                    strerror(err)));
        else
            raise_map_errno("mmap (reserve)", err);
        return -1;
    }
    self->addr = p;
    self->nbytes = nbytes;
    self->zero_backed = zero_backed;
    return 0;
}

static void Reservation_dealloc(Reservation *self) {
    if (self->addr) munmap(self->addr, self->nbytes);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The buffer protocol keeps the reservation alive for as long as any tensor
 * made over it, so its addresses are never released under a live view. */
static int Reservation_getbuffer(Reservation *self, Py_buffer *view, int flags) {
    if (!self->addr) {
        PyErr_SetString(PyExc_ValueError, "Reservation is not initialised");
        return -1;
    }
    return PyBuffer_FillInfo(view, (PyObject *)self, self->addr, self->nbytes, 0, flags);
}

static PyBufferProcs Reservation_as_buffer = {(getbufferproc)Reservation_getbuffer, NULL};

static PyObject *Reservation_get_addr(Reservation *self, void *closure) {
    return PyLong_FromVoidPtr(self->addr);
}

static PyGetSetDef Reservation_getset[] = {
    {"addr", (getter)Reservation_get_addr, NULL, "first address of the range", NULL},
    {NULL},
};

static PyMemberDef Reservation_members[] = {
    {"nbytes", T_PYSSIZET, offsetof(Reservation, nbytes), READONLY, "size in bytes"},
    {"zero_backed", T_BOOL, offsetof(Reservation, zero_backed), READONLY,
     "unmapped pages read as zeros instead of faulting"},
    {NULL},
};

static PyTypeObject ReservationType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "vattn._native.Reservation",
    .tp_doc = "Reservation(nbytes, zero_backed=False): a range of virtual addresses.",
    .tp_basicsize = sizeof(Reservation),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Reservation_init,
    .tp_dealloc = (destructor)Reservation_dealloc,
    .tp_as_buffer = &Reservation_as_buffer,
    .tp_getset = Reservation_getset,
    .tp_members = Reservation_members,
};

/* ---------------------------------------------------------------- PhysicalFile */

typedef struct {
    PyObject_HEAD
    int fd;
    Py_ssize_t nbytes;
} PhysicalFile;

static int PhysicalFile_init(PhysicalFile *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"nbytes", NULL};
    Py_ssize_t nbytes;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n", kwlist, &nbytes)) return -1;
    if (self->nbytes) {
        PyErr_SetString(PyExc_RuntimeError, "PhysicalFile is already initialised");
        return -1;
    }
    if (nbytes <= 0 || nbytes % os_page()) {
        PyErr_Format(PyExc_ValueError,
                     "physical pool size must be a positive multiple of the OS page size (%ld), got %zd",
                     os_page(), nbytes);
        return -1;
    }
    int fd = memfd_create("vattn-pages", MFD_CLOEXEC);
    if (fd < 0) {
        raise_errno("memfd_create", errno);
        return -1;
    }
    if (ftruncate(fd, nbytes) != 0) {
        int err = errno;
        close(fd);
        raise_errno("ftruncate (pool size)", err);
        return -1;
    }
    self->fd = fd;
    self->nbytes = nbytes;
    return 0;
}

static void PhysicalFile_dealloc(PhysicalFile *self) {
    if (self->nbytes) close(self->fd);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *PhysicalFile_committed(PhysicalFile *self, PyObject *unused) {
    struct stat st;
    if (fstat(self->fd, &st) != 0) return raise_errno("fstat", errno);
    return PyLong_FromLongLong((long long)st.st_blocks * 512);
}

static PyMemberDef PhysicalFile_members[] = {
    {"fd", T_INT, offsetof(PhysicalFile, fd), READONLY, "the memfd"},
    {"nbytes", T_PYSSIZET, offsetof(PhysicalFile, nbytes), READONLY, "size in bytes"},
    {NULL},
};

static PyMethodDef PhysicalFile_methods[] = {
    {"committed", (PyCFunction)PhysicalFile_committed, METH_NOARGS,
     "Bytes of physical memory the file holds now (pages that were touched)."},
    {NULL},
};

static PyTypeObject PhysicalFileType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "vattn._native.PhysicalFile",
    .tp_doc = "PhysicalFile(nbytes): a memfd holding the physical pages.",
    .tp_basicsize = sizeof(PhysicalFile),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)PhysicalFile_init,
    .tp_dealloc = (destructor)PhysicalFile_dealloc,
    .tp_members = PhysicalFile_members,
    .tp_methods = PhysicalFile_methods,
};

/* ---------------------------------------------------------------- batches */

/* Read a sequence of offsets, each aligned to the OS page and with a page of
 * page_size bytes fitting below limit.  Returns a malloc'ed array or NULL. */
static int64_t *read_offsets(PyObject *seq, Py_ssize_t *n, Py_ssize_t page_size, Py_ssize_t limit,
                             const char *what) {
    PyObject *fast = PySequence_Fast(seq, "offsets must be a sequence of ints");
    if (!fast) return NULL;
    *n = PySequence_Fast_GET_SIZE(fast);
    int64_t *out = PyMem_New(int64_t, *n ? *n : 1);
    if (!out) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    long page = os_page();
    for (Py_ssize_t i = 0; i < *n; i++) {
        int past_int64;
        long long v = PyLong_AsLongLongAndOverflow(items[i], &past_int64);
        if (v == -1 && PyErr_Occurred()) goto fail;
        if (past_int64 || v % page || !inside(v, page_size, limit)) {
            PyErr_Format(PyExc_ValueError,
                         "%s offset %R is not an OS-page-aligned offset with a %zd-byte page "
                         "inside %zd bytes",
                         what, items[i], page_size, limit);
            goto fail;
        }
        out[i] = v;
    }
    Py_DECREF(fast);
    return out;
fail:
    Py_DECREF(fast);
    PyMem_Free(out);
    return NULL;
}

static int check_page_size(Py_ssize_t page_size) {
    if (page_size <= 0 || page_size % os_page()) {
        PyErr_Format(PyExc_ValueError, "page size must be a positive multiple of the OS page size (%ld), got %zd",
                     os_page(), page_size);
        return -1;
    }
    return 0;
}

/* Length of the run starting at i whose pages are contiguous in the
 * reservation and (when file offsets are given) in the file. */
static Py_ssize_t run_length(const int64_t *virt, const int64_t *file, Py_ssize_t i, Py_ssize_t n,
                             Py_ssize_t page_size) {
    Py_ssize_t j = i + 1;
    while (j < n && virt[j] == virt[j - 1] + page_size && (!file || file[j] == file[j - 1] + page_size)) j++;
    return j - i;
}

/* A batch of pages to map: (reservation, file, page_size, virt_offsets,
 * file_offsets[, read_only]), read and checked.  Returns 0, or -1 with an
 * exception set. */
typedef struct {
    Reservation *res;
    PhysicalFile *file;
    Py_ssize_t page_size, n;
    int64_t *virt, *foff;
    int read_only;
} MapBatch;

static void free_batch(MapBatch *b) {
    PyMem_Free(b->virt);
    PyMem_Free(b->foff);
}

static int read_batch(PyObject *args, MapBatch *b) {
    PyObject *virt_seq, *file_seq;
    Py_ssize_t m;
    memset(b, 0, sizeof *b);
    if (!PyArg_ParseTuple(args, "O!O!nOO|p", &ReservationType, &b->res, &PhysicalFileType, &b->file, &b->page_size,
                          &virt_seq, &file_seq, &b->read_only) ||
        check_page_size(b->page_size))
        return -1;
    if (!(b->virt = read_offsets(virt_seq, &b->n, b->page_size, b->res->nbytes, "virtual")) ||
        !(b->foff = read_offsets(file_seq, &m, b->page_size, b->file->nbytes, "physical"))) {
        free_batch(b);
        return -1;
    }
    if (b->n != m) {
        PyErr_Format(PyExc_ValueError, "%zd virtual offsets but %zd physical offsets", b->n, m);
        free_batch(b);
        return -1;
    }
    return 0;
}

static PyObject *map_pages(PyObject *mod, PyObject *args) {
    MapBatch b;
    if (read_batch(args, &b)) return NULL;
    int err = 0;
    int prot = b.read_only ? PROT_READ : PROT_READ | PROT_WRITE;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t i = 0;
    while (i < b.n) {
        Py_ssize_t run = run_length(b.virt, b.foff, i, b.n, b.page_size);
        void *p = mmap(b.res->addr + b.virt[i], run * b.page_size, prot, MAP_SHARED | MAP_FIXED, b.file->fd, b.foff[i]);
        if (p == MAP_FAILED) {
            err = errno;
            break;
        }
        i += run;
    }
    /* Undo every run mapped before the failure, a run at a time: a run is then
     * one whole mapping, which the backing replaces with no new entry even at
     * vm.max_map_count.  (Where it merged with a neighbour and the spare entry
     * is gone, the pool's page may still show there, reached through no
     * record.) */
    for (Py_ssize_t k = 0, run; err && k < i; k += run) {
        run = run_length(b.virt, b.foff, k, i, b.page_size);
        backing(b.res, b.res->addr + b.virt[k], run * b.page_size);
    }
    Py_END_ALLOW_THREADS
    free_batch(&b);
    if (err) return raise_map_errno("mmap (map page)", err);
    Py_RETURN_NONE;
}

static PyObject *unmap_pages(PyObject *mod, PyObject *args) {
    Reservation *res;
    Py_ssize_t page_size, n;
    PyObject *virt_seq;
    if (!PyArg_ParseTuple(args, "O!nO", &ReservationType, &res, &page_size, &virt_seq)) return NULL;
    if (check_page_size(page_size)) return NULL;
    int64_t *virt = read_offsets(virt_seq, &n, page_size, res->nbytes, "virtual");
    if (!virt) return NULL;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    /* Every run is tried, one that fails or not (at vm.max_map_count a run that splits a mapping fails
     * where one that is a whole mapping does not): the caller counts the whole batch let go. */
    for (Py_ssize_t i = 0, run; i < n; i += run) {
        run = run_length(virt, NULL, i, n, page_size);
        int e = backing(res, res->addr + virt[i], run * page_size);
        if (e && !err) err = e;
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(virt);
    if (err) return raise_map_errno("mmap (unmap page)", err);
    Py_RETURN_NONE;
}

static PyObject *punch_pages(PyObject *mod, PyObject *args) {
    PhysicalFile *file;
    Py_ssize_t page_size, n;
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "O!nO", &PhysicalFileType, &file, &page_size, &seq)) return NULL;
    if (check_page_size(page_size)) return NULL;
    int64_t *off = read_offsets(seq, &n, page_size, file->nbytes, "physical");
    if (!off) return NULL;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n;) {
        Py_ssize_t run = run_length(off, NULL, i, n, page_size);
        if (fallocate(file->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off[i], run * page_size)) {
            err = errno;
            break;
        }
        i += run;
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(off);
    if (err) return raise_errno("fallocate (punch hole)", err);
    Py_RETURN_NONE;
}

/* madvise(MADV_PAGEOUT) over the whole pages in [addr, addr + nbytes): the
 * resident ones no other process maps are reclaimed (a mapped file's clean
 * pages are read again if touched; no data is lost).  Returns the bytes
 * advised: 0 where the kernel does not take the advice. */
static PyObject *page_out(PyObject *mod, PyObject *args) {
    unsigned long long addr;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(args, "Kn", &addr, &nbytes)) return NULL;
    if (nbytes < 0) return PyErr_Format(PyExc_ValueError, "nbytes %zd is negative", nbytes);
    if (!in_address_space(addr, nbytes))
        return PyErr_Format(PyExc_ValueError, "%zd bytes at %p run past the end of the address space", nbytes,
                            (void *)(uintptr_t)addr);
    const uintptr_t page = os_page(), first = addr / page + (addr % page != 0), end = (addr + nbytes) / page;
    if (end <= first) return PyLong_FromLong(0);  /* no whole page */
    const size_t len = (end - first) * page;
#ifdef MADV_PAGEOUT
    if (!madvise((void *)(first * page), len, MADV_PAGEOUT)) return PyLong_FromSize_t(len);
    if (errno != EINVAL) return raise_errno("madvise (page out)", errno);
#endif
    return PyLong_FromLong(0);
}

/* The heap's free memory back to the OS, which both allocators keep after
 * large frees to serve later allocations: tcmalloc's, where the process runs
 * under it (vattn.allocator; found by name, so nothing links against it),
 * and glibc's (malloc_trim).  Returns whether tcmalloc was found. */
static PyObject *trim_heap(PyObject *mod, PyObject *unused) {
    void (*release)(void) = (void (*)(void))dlsym(RTLD_DEFAULT, "MallocExtension_ReleaseFreeMemory");
    if (release) release();
#ifdef __GLIBC__
    malloc_trim(0);
#endif
    return PyBool_FromLong(release != NULL);
}

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

/* The baseline for the map benchmark: the same syscalls as map_pages and
 * unmap_pages, one page each, in a plain C loop.  Returns total ns. */
static PyObject *raw_map_loop(PyObject *mod, PyObject *args) {
    MapBatch b;
    if (read_batch(args, &b)) return NULL;
    int err = 0;
    Py_ssize_t mapped = 0;
    double t0, t1, t2;
    Py_BEGIN_ALLOW_THREADS
    t0 = now_ns();
    for (; mapped < b.n; mapped++)
        if (mmap(b.res->addr + b.virt[mapped], b.page_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, b.file->fd,
                 b.foff[mapped]) == MAP_FAILED) {
            err = errno;
            break;
        }
    t1 = now_ns();
    for (Py_ssize_t i = 0; i < mapped; i++)
        if (backing(b.res, b.res->addr + b.virt[i], b.page_size)) err = errno;
    t2 = now_ns();
    Py_END_ALLOW_THREADS
    free_batch(&b);
    if (err) return raise_map_errno("mmap (raw loop)", err);
    return Py_BuildValue("dd", t1 - t0, t2 - t1);
}

static PyObject *os_page_size(PyObject *mod, PyObject *unused) { return PyLong_FromLong(os_page()); }

PyMethodDef VMM_METHODS[] = {
    {"map_pages", map_pages, METH_VARARGS,
     "map_pages(reservation, file, page_size, virt_offsets, file_offsets, read_only=False): map file pages at the "
     "offsets."},
    {"unmap_pages", unmap_pages, METH_VARARGS,
     "unmap_pages(reservation, page_size, virt_offsets): put the reservation's backing back."},
    {"punch_pages", punch_pages, METH_VARARGS,
     "punch_pages(file, page_size, file_offsets): return the pages' memory to the OS (they read as zeros)."},
    {"page_out", page_out, METH_VARARGS,
     "page_out(addr, nbytes): reclaim the resident whole pages of the range (madvise MADV_PAGEOUT); the bytes "
     "advised."},
    {"trim_heap", trim_heap, METH_NOARGS,
     "trim_heap(): the heap's free memory back to the OS (tcmalloc's, where it runs, and glibc's); whether tcmalloc "
     "was found."},
    {"raw_map_loop", raw_map_loop, METH_VARARGS,
     "raw_map_loop(reservation, file, page_size, virt_offsets, file_offsets) -> (map_ns, unmap_ns)."},
    {"os_page_size", os_page_size, METH_NOARGS,
     "The OS page size in bytes."},
    {NULL},
};

int vmm_add_types(PyObject *m) {
    take_spare_entry();
    if (PyType_Ready(&ReservationType) < 0 || PyType_Ready(&PhysicalFileType) < 0) return -1;
    MapLimitError = PyErr_NewExceptionWithDoc("vattn._native.MapLimitError",
                                              "The process ran out of virtual memory mapping entries.",
                                              PyExc_OSError, NULL);
    if (!MapLimitError) return -1;
    return PyModule_AddObjectRef(m, "MapLimitError", MapLimitError) < 0 ||
                   PyModule_AddObjectRef(m, "Reservation", (PyObject *)&ReservationType) < 0 ||
                   PyModule_AddObjectRef(m, "PhysicalFile", (PyObject *)&PhysicalFileType) < 0
               ? -1
               : 0;
}
