/*
 * Vector types of 8 and 16 float32 lanes (GCC vector extensions) and what the
 * kernels compute over them: blend, and e^x (attention.c's softmax, ops.c's
 * SiLU), one body for both widths.
 */
#pragma once
#include <stdint.h>

#define INLINE static inline __attribute__((always_inline))

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

/* blend (lanes of a where mask is set, else of b) and e^x (Cephes' expf: Cody-Waite reduction,
 * degree-6 polynomial; ~1 ulp), for a float vector type F and its int vector type I. */
#define VECTOR_MATH(F, I, SUFFIX)                                                                       \
    INLINE F blend##SUFFIX(I mask, F a, F b) { return (F)(((I)a & mask) | ((I)b & ~mask)); }         \
    INLINE F vexp##SUFFIX(F x) {                                                                     \
        const F lo = (F){} - 87.33654f, hi = (F){} + 88.37626f, magic = (F){} + 12582912.0f;           \
        x = blend##SUFFIX(x < lo, lo, blend##SUFFIX(x > hi, hi, x));                                 \
        F t = x * 1.44269504088896341f + magic; /* round to nearest, as the float's low bits */       \
        F n = t - magic;                                                                             \
        I e = ((I)t - (I)magic + 127) << 23;                                                         \
        F r = x - n * 0.693359375f + n * 2.12194440e-4f;                                             \
        F y = (F){} + 1.9875691500e-4f;                                                              \
        y = y * r + 1.3981999507e-3f;                                                                \
        y = y * r + 8.3334519073e-3f;                                                                \
        y = y * r + 4.1665795894e-2f;                                                                \
        y = y * r + 1.6666665459e-1f;                                                                \
        y = y * r + 5.0000001201e-1f;                                                                \
        y = y * r * r + r + 1.0f;                                                                    \
        return y * (F)e;                                                                             \
    }
VECTOR_MATH(v8f, v8i, 8)
VECTOR_MATH(v16f, v16i, 16)
#define blend(mask, a, b) _Generic((a), v8f: blend8, v16f: blend16)(mask, a, b)
#define vexp(x) _Generic((x), v8f: vexp8, v16f: vexp16)(x)

/* bfloat16 pairs on AVX512-BF16's vdpbf16ps, which adds to each float32 lane the products of a pair of
 * bfloat16 values: in asm, as only the code for CPUs that have it runs it. */
typedef uint16_t bf32 __attribute__((vector_size(64)));                /* 32 bfloat16 */
typedef uint16_t bf32_u __attribute__((vector_size(64), aligned(1)));
typedef uint16_t bf16v_u __attribute__((vector_size(32), aligned(1)));  /* 16 bfloat16 at any address */

/* acc + in lane l a[2l]·b[2l] + a[2l+1]·b[2l+1] */
INLINE v16f dot2(v16f acc, bf32 a, bf32 b) {
    __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

/* dot2 against the pair at p in every lane (vdpbf16ps's own broadcast from memory) */
INLINE v16f dot2_broadcast(v16f acc, bf32 a, const uint16_t *p) {
    __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*(const uint16_t(*)[2])p));
    return acc;
}

/* The pair at p broadcast to every lane. */
INLINE bf32 broadcast_pair(const uint16_t *p) {
    uint32_t word;
    __builtin_memcpy(&word, p, 4);
    return (bf32)((v16i){} + (int32_t)word);
}
