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

/* 2^x lane-wise for x <= 0 (x may be -inf); exactly 0 below -126 (for float vectors VT of
 * integer vectors VI: the Cephes exp2f polynomial on [-1/2, 1/2], relative error below 2e-7). */
#define DEFINE_EXP2(NAME, VT, VI, SPLAT, SEL)                                                   \
    static inline VT NAME(VT x) {                                                               \
        const VT lo = SPLAT(-126.0f);                                                           \
        const VT magic = SPLAT(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */   \
        VI small = x < lo;                                                                      \
        VT xc = SEL(small, lo, x);                                                              \
        VT fn = (xc + magic) - magic; /* nearest integer, |xc - fn| <= 1/2 */                   \
        VT f = xc - fn;                                                                         \
        VT p = f * 1.535336188319500e-4f + 1.339887440266574e-3f;                               \
        p = p * f + 9.618437357674640e-3f;                                                      \
        p = p * f + 5.550332471162809e-2f;                                                      \
        p = p * f + 2.402264791363012e-1f;                                                      \
        p = p * f + 6.931472028550421e-1f;                                                      \
        p = p * f + 1.0f;                                                                       \
        VI n = __builtin_convertvector(fn, VI);                                                 \
        VI bits = (n + 127) << 23; /* 2^n, n in [-126, 0]: a normal float */                    \
        VT sc;                                                                                  \
        memcpy(&sc, &bits, sizeof sc);                                                          \
        return SEL(small, SPLAT(0.0f), p * sc);                                                 \
    }

DEFINE_EXP2(exp2_nonpos8, v8f, v8i, splat8, sel8)

/*
 * The widest float vector of the target: 16 lanes (one AVX-512 register) when the compiler
 * targets AVX-512F, else 8 (AVX2, or narrower SIMD that the compiler splits them into). The
 * fused kernels (fused.c) size their register tiles by it.
 */
#ifdef __AVX512F__
#define VW 16
typedef float vwf __attribute__((vector_size(64)));
typedef int32_t vwi __attribute__((vector_size(64)));
DEFINE_VEC_OPS(vwf, vwi, float, ldw, stw, splatw, selw, maxw)
DEFINE_EXP2(exp2_nonposw, vwf, vwi, splatw, selw)
#else
#define VW 8
typedef v8f vwf;
typedef v8i vwi;
static inline vwf ldw(const float *p) { return ld8(p); }
static inline void stw(float *p, vwf x) { st8(p, x); }
static inline vwf splatw(float a) { return splat8(a); }
static inline vwf maxw(vwf a, vwf b) { return max8(a, b); }
static inline vwf selw(vwi m, vwf a, vwf b) { return sel8(m, a, b); }
static inline vwf exp2_nonposw(vwf x) { return exp2_nonpos8(x); }
#endif

/* 2^x lane-wise for x <= 0 (x may be -inf), by libm's exp2 per lane. */
static inline v4d exp2_nonpos4d(v4d x) {
    v4d r;
    for (int l = 0; l < 4; l++) r[l] = exp2(x[l]);
    return r;
}

#endif
