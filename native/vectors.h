/*
 * Vectors of W floats (16: AVX-512; 8: AVX2 and the baseline) and their
 * loads and stores from float32 or bfloat16 values: a kernel header includes
 * it for the width it is compiled at, once per width.  Names carry the width
 * (NAME(x) is x_w16 or x_w8); the macros, the same at each width, expand W
 * where they are used.
 */
#define GLUE(a, b) a##b
#define WIDE(a, b) GLUE(a, b)
#define NAME(x) WIDE(x, WIDE(_w, W))
#define vec NAME(vec)
#define vecu NAME(vecu)
#define vec_u NAME(vec_u)
#define half_u NAME(half_u)

typedef float vec __attribute__((vector_size(4 * W)));
typedef uint32_t vecu __attribute__((vector_size(4 * W)));
typedef float vec_u __attribute__((vector_size(4 * W), aligned(1)));       /* at any address */
typedef uint16_t half_u __attribute__((vector_size(2 * W), aligned(1)));

/* W values from element d of float32 (bf16 0) or bfloat16 (1) values at p, as floats */
INLINE vec NAME(load)(const void *p, int64_t d, int bf16) {
    if (!bf16) return *(const vec_u *)((const float *)p + d);
    return (vec)(__builtin_convertvector(*(const half_u *)((const uint16_t *)p + d), vecu) << 16);
}

/* x's lanes rounded to bfloat16 as float_bf16 (common.h) rounds, nearest even: the bits in each lane's low half */
INLINE vecu NAME(bf16_bits)(vec x) {
    const vecu bits = (vecu)x, nan = (bits & 0x7fffffff) > 0x7f800000;
    return ((((bits + 0x7fff + ((bits >> 16) & 1)) & 0xffff0000) & ~nan) | (0x7fc00000 & nan)) >> 16;
}

/* x at element d of float32 (bf16 0) or bfloat16 (1) values at p, rounded to nearest even */
INLINE void NAME(put)(void *p, int64_t d, vec x, int bf16) {
    if (!bf16)
        *(vec_u *)((float *)p + d) = x;
    else
        *(half_u *)((uint16_t *)p + d) = __builtin_convertvector(NAME(bf16_bits)(x), half_u);
}
