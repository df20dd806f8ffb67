/*
 * Arithmetic on the counts, sizes, offsets and strides that come from Python,
 * none of which can overflow: a bound is checked as at > n - len (never
 * at + len > n), sums and products of counts saturate, and thread counts are
 * clamped to the machine's.
 */
#pragma once
#include <omp.h>
#include <stdint.h>

/* Whether [at, at + len) lies inside [0, n), for len, n >= 0. */
static inline int inside(int64_t at, int64_t len, int64_t n) { return at >= 0 && len <= n && at <= n - len; }

/* a + b and a * b of counts (>= 0), saturated at INT64_MAX: more than any memory holds. */
static inline int64_t add_sat(int64_t a, int64_t b) {
    int64_t r;
    return __builtin_add_overflow(a, b, &r) ? INT64_MAX : r;
}
static inline int64_t mul_sat(int64_t a, int64_t b) {
    int64_t r;
    return __builtin_mul_overflow(a, b, &r) ? INT64_MAX : r;
}

/* a / b rounded up, for a >= 0, b > 0. */
static inline int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }

/* Where part t of nt parts of n things starts: n * t / nt, for 0 <= t <= nt (a thread count). */
static inline int64_t part_start(int64_t n, int64_t t, int64_t nt) { return n / nt * t + n % nt * t / nt; }

/* Whether nbytes from addr stay inside the address space (do not wrap past its end). */
static inline int in_address_space(unsigned long long addr, unsigned long long nbytes) {
    return nbytes <= UINT64_MAX - addr;
}

/* Whether an array at ptr of these sizes and strides (>= 0, in elements of esize bytes) lies where an
 * address reaches: its number of elements and the bytes from ptr past its last element fit in int64,
 * and ptr plus those bytes does not wrap.  An array of no elements names no memory. */
static inline int spans(unsigned long long ptr, int ndim, const long long *shape, const long long *stride,
                        int64_t esize) {
    int64_t elements = 1, last = 0, step, bytes;
    for (int i = 0; i < ndim; i++)
        if (!shape[i]) return 1;
    for (int i = 0; i < ndim; i++)
        if (__builtin_mul_overflow(elements, shape[i], &elements) ||
            __builtin_mul_overflow(shape[i] - 1, stride[i], &step) || __builtin_add_overflow(last, step, &last))
            return 0;
    return !__builtin_add_overflow(last, 1, &bytes) && !__builtin_mul_overflow(bytes, esize, &bytes) &&
           in_address_space(ptr, bytes);
}

/* A thread count from Python, clamped to [1, the processors this process runs on]; called with the
 * GIL held, as the count is read once (omp_get_num_procs asks the OS each time). */
static inline int clamp_threads(long long threads) {
    static int procs;
    if (!procs) procs = omp_get_num_procs();
    return threads < 1 ? 1 : threads > procs ? procs : (int)threads;
}
