/*
 * attnuq: 256-bit vector helpers shared by the CPU kernels (GCC/Clang vector extensions; with
 * -march=native they compile to AVX2/FMA where the CPU has them, else to narrower SIMD).
 */
#ifndef ATTNUQ_SIMD_H
#define ATTNUQ_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef double v4d __attribute__((vector_size(32)));
typedef int64_t v4l __attribute__((vector_size(32)));

/*
 * For a vector type VT of scalars T (with VI the integer vector of a comparison): unaligned load
 * LD, store ST, broadcast SPLAT, lane-wise SEL(m, a, b) = m ? a : b (m all ones or all zeros per
 * lane, as from a vector comparison) and MAX(a, b) (no NaN expected).
 */
#define DEFINE_VEC_OPS(VT, VI, T, LD, ST, SPLAT, SEL, MAX)                                    \
    static inline VT LD(const T *p) {                                                           \
        VT x;                                                                                   \
        memcpy(&x, p, sizeof x);                                                                \
        return x;                                                                               \
    }                                                                                           \
    static inline void ST(T *p, VT x) { memcpy(p, &x, sizeof x); }                              \
    static inline VT SPLAT(T a) {                                                               \
        VT x;                                                                                   \
        for (size_t l = 0; l < sizeof(VT) / sizeof(T); l++) x[l] = a;                           \
        return x;                                                                               \
    }                                                                                           \
    static inline VT SEL(VI m, VT a, VT b) {                                                    \
        VI ai, bi, ri;                                                                          \
        VT r;                                                                                   \
        memcpy(&ai, &a, sizeof a);                                                              \
        memcpy(&bi, &b, sizeof b);                                                              \
        ri = (m & ai) | (~m & bi);                                                              \
        memcpy(&r, &ri, sizeof r);                                                              \
        return r;                                                                               \
    }                                                                                           \
    static inline VT MAX(VT a, VT b) { return SEL(a > b, a, b); }

DEFINE_VEC_OPS(v8f, v8i, float, ld8, st8, splat8, sel8, max8)
DEFINE_VEC_OPS(v4d, v4l, double, ld4d, st4d, splat4d, sel4d, max4d)

/* 2^x lane-wise for x <= 0 (x may be -inf); exactly 0 below -126. */
static inline v8f exp2_nonpos8(v8f x) {
    const v8f lo = splat8(-126.0f);
    const v8f magic = splat8(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    v8i small = x < lo;
    v8f xc = sel8(small, lo, x);
    v8f fn = (xc + magic) - magic; /* nearest integer, |xc - fn| <= 1/2 */
    v8f f = xc - fn;
    v8f p = f * 1.535336188319500e-4f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    v8i n = __builtin_convertvector(fn, v8i);
    v8i bits = (n + 127) << 23; /* 2^n, n in [-126, 0]: a normal float */
    v8f sc;
    memcpy(&sc, &bits, sizeof sc);
    return sel8(small, splat8(0.0f), p * sc);
}

/* 2^x lane-wise for x <= 0 (x may be -inf), by libm's exp2 per lane. */
static inline v4d exp2_nonpos4d(v4d x) {
    v4d r;
    for (int l = 0; l < 4; l++) r[l] = exp2(x[l]);
    return r;
}

#endif
