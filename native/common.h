/*
 * What every part of the C core shares:
 *
 * - errors: FAIL(...) raises ValueError and gives -1, for the argument checks;
 * - arithmetic on the counts, sizes, offsets and strides that come from
 *   Python, none of which can overflow: a bound is checked as at > n - len
 *   (never at + len > n), sums and products of counts saturate, and thread
 *   counts are clamped to the machine's;
 * - instruction sets: each kernel is compiled for those it serves (the
 *   AVX512 and AVX2 target attributes, and the baseline: `PER_ISA`) and keeps
 *   its code in a table indexed by `Isa`, running the entry of the best this
 *   CPU has (`isa_best`), or the one `isa()` forces (`kernel_isa`); the
 *   attention kernel and the GEMM's bfloat16 blocks have code of their own
 *   for AVX-512 with bfloat16 dot products (`avx512_bf16`), the attention
 *   kernel for AMX too (`amx`, which has those too): elsewhere they run the
 *   AVX-512 code;
 * - dtypes: float32 and bfloat16 (code 0 and 1), and the conversions
 *   between them;
 * - threads: `split` shares a range among OpenMP threads, the part of each
 *   `part_start` says.
 */
#pragma once
#include <Python.h>

#include <omp.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define FAIL(...) (PyErr_Format(PyExc_ValueError, __VA_ARGS__), -1)

/* ------------------------------------------------------------ instruction sets */

typedef enum { ISA_AMX, ISA_AVX512_BF16, ISA_AVX512, ISA_AVX2, ISA_BASELINE, NUM_ISAS } Isa;  /* best first */
static const char *const ISA_NAMES[NUM_ISAS] = {"amx", "avx512_bf16", "avx512", "avx2", "baseline"};

/* Whether this process may use AMX's tile data, which Linux grants a process that asks (arch_prctl). */
static inline int amx_permitted(void) {
    enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))
#define AVX2 __attribute__((target("avx2,fma")))

static inline int isa_supported(Isa isa) {
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const int avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl");
    switch (isa) {
    case ISA_AMX:
        return avx512 && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("amx-tile") &&
               __builtin_cpu_supports("amx-bf16") && amx_permitted();
    case ISA_AVX512_BF16:
        return avx512 && __builtin_cpu_supports("avx512bf16");
    case ISA_AVX512:
        return avx512;
    case ISA_AVX2:
        return avx2;
    default:
        return 1;
    }
}

/* The best instruction set this CPU runs (the baseline at worst), asked of the CPU once: the kernels ask
 * on every call. */
static inline Isa isa_best(void) {
    static int best = -1;  /* one per file that asks; each finds the same */
    if (best < 0) {
        int isa = 0;
        while (!isa_supported(isa)) isa++;
        best = isa;
    }
    return best;
}

/* The instruction set the attention and elementwise kernels run: isa_best() unless `isa(name)` (module.c)
 * forced another the CPU has. */
extern Isa kernel_isa;

/* static void name_avx512/_avx2/_baseline(const void *, int64_t lo, int64_t hi): `name` (an inline
 * function of those arguments) compiled for each instruction set, and their table `name_isa` (the AVX-512
 * code for avx512_bf16). */
#define PER_ISA(name, ...)                                                                                  \
    AVX512 __VA_ARGS__ static void name##_avx512(const void *a, int64_t lo, int64_t hi) { name(a, lo, hi); } \
    AVX2 __VA_ARGS__ static void name##_avx2(const void *a, int64_t lo, int64_t hi) { name(a, lo, hi); }     \
    __VA_ARGS__ static void name##_baseline(const void *a, int64_t lo, int64_t hi) { name(a, lo, hi); }      \
    static void (*const name##_isa[NUM_ISAS])(const void *, int64_t, int64_t) = {                            \
        name##_avx512, name##_avx512, name##_avx512, name##_avx2, name##_baseline}

/* ------------------------------------------------------------ dtypes */

enum { F32 = 0, BF16 = 1 };  /* dtype codes, as vattn/binding.py sends them */

static inline float bf16_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
}

/* f rounded to the nearest bfloat16, ties to even, a NaN to the quiet NaN: as torch rounds. */
static inline uint16_t float_bf16(float f) {
    uint32_t bits;
    __builtin_memcpy(&bits, &f, 4);
    return (bits & 0x7fffffff) > 0x7f800000 ? 0x7fc0 : (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

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

/* ------------------------------------------------------------ threads */

/* Where part t of nt parts of n things starts: n * t / nt, for 0 <= t <= nt (a thread count). */
static inline int64_t part_start(int64_t n, int64_t t, int64_t nt) { return n / nt * t + n % nt * t / nt; }

/* fn(arg, lo, hi) over [0, n): on this thread where `threads` < 2, else each of `threads` OpenMP threads
 * (torch's own: the one runtime of the process) its part. */
static inline void split(void (*fn)(const void *, int64_t, int64_t), const void *arg, int64_t n, int threads) {
    if (threads < 2) {
        fn(arg, 0, n);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        fn(arg, part_start(n, t, nt), part_start(n, t + 1, nt));
    }
}

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
