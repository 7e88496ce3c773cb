/*
 * attnuq: inverse-CDF draws from softmax rows (CPU kernel of the dense sampler).
 *
 * Compiled on first use by attnuq/ops/_native.py with the system C compiler and called through
 * ctypes; plain C99 plus GCC/Clang vector extensions and optional OpenMP, no Python or torch
 * headers.
 *
 * For each row of scores s (log2 units, -inf = excluded key) and each of its nu uniforms
 * u in [0, 1), return a key drawn from softmax(s ln 2) by inverse CDF: with the keys taken in a
 * fixed order pi and C_i = sum_{i' <= i} 2^(s_pi(i') - max s), the key pi(i) with
 * C_{i-1} <= u * C_L < C_i. Any fixed order gives exactly the softmax distribution; this one
 * makes the CDF cheap to build with SIMD:
 *
 *   nb = 8 * ceil(L / 128) blocks (a multiple of the 8 SIMD lanes) of bl = ceil(L / nb) <= 16
 *   entries; pad the row to Lp = nb * bl keys (weight 0) and view it as bl rows of nb keys: key
 *   j = l * nb + b is entry l of block b. The in-block prefix P[l][b] = sum_{l' <= l} e[l'][b]
 *   is bl - 1 vector adds over contiguous rows; block b's total is P[bl - 1][b] and cum[b] the
 *   prefix of the totals. A threshold t = u * cum[nb] lands in block b = max{b : cum[b] <= t}
 *   (counted with vector compares up to 64 blocks, else a branch-free binary search) at entry
 *   l = #{l : cum[b] + P[l][b] <= t} (bl branch-free compares).
 *
 * Keys of zero weight are never returned: their P equals the previous entry's, so they are
 * never the first entry past t; a rounding miss (l = bl, or t rounded up to the total) falls
 * back to the last key of positive weight at or before block b. Rows whose every score is -inf
 * are flagged empty (indices 0).
 *
 * float32: 2^x by the Cephes exp2f polynomial on [-1/2, 1/2] (relative error below 2e-7),
 * eight lanes at a time; weights below 2^-126 of the row maximum are 0 (they could not move a
 * float32 sum that holds the maximum's 1 anyway). float64: libm exp2.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cdf.h"

/* Row maximum; fills e[0:Lp] with 2^(s - max) (zero padded past L). Returns the maximum. */
static float weights_f32(const float *s, int64_t L, int64_t Lp, float *e) {
    v8f mv = splat8(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= L; j += 8) {
        v8f x = ld8(s + j);
        mv = sel8(x > mv, x, mv);
    }
    float m = -INFINITY;
    for (int l = 0; l < 8; l++) m = mv[l] > m ? mv[l] : m;
    for (; j < L; j++) m = s[j] > m ? s[j] : m;
    if (!(m > -INFINITY)) return m;
    v8f mb = splat8(m);
    for (j = 0; j + 8 <= L; j += 8) st8(e + j, exp2_nonpos8(ld8(s + j) - mb));
    if (j < L) {
        float tail[8];
        for (int l = 0; l < 8; l++) tail[l] = j + l < L ? s[j + l] - m : -INFINITY;
        st8(e + j, exp2_nonpos8(ld8(tail)));
        j += 8;
    }
    for (; j < Lp; j++) e[j] = 0.0f;
    return m;
}

static double weights_f64(const double *s, int64_t L, int64_t Lp, double *e) {
    double m = -INFINITY;
    for (int64_t j = 0; j < L; j++) m = s[j] > m ? s[j] : m;
    if (!(m > -INFINITY)) return m;
    for (int64_t j = 0; j < L; j++) e[j] = exp2(s[j] - m);
    for (int64_t j = L; j < Lp; j++) e[j] = 0.0;
    return m;
}

/* 1 when compiled with OpenMP (rows are then split over the calling process's OpenMP threads,
 * which for a torch process are torch's own intra-op threads). */
int64_t attnuq_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/*
 * s: rows x L scores (row r at s + r * s_stride); u: rows x nu uniforms (contiguous);
 * out32 or out64 (the other NULL): rows x nu key indices; empty: rows flags (1 = no key);
 * nthreads: OpenMP threads to split the rows over (ignored without OpenMP).
 * Returns 0, or -1 when the scratch rows could not be allocated.
 */
#define DEFINE_SAMPLE(T, SUF)                                                                   \
    static int64_t rows_##SUF(const T *s, int64_t r0, int64_t r1, int64_t L, int64_t s_stride,  \
                              const T *u, int64_t nu, int32_t *out32, int64_t *out64,           \
                              uint8_t *empty) {                                                 \
        int64_t nb, bl;                                                                         \
        layout(L, &nb, &bl);                                                                    \
        int64_t Lp = nb * bl;                                                                   \
        T *e = (T *)malloc((size_t)(Lp + 8) * sizeof(T));                                       \
        T *cum = (T *)malloc((size_t)(nb + 1) * sizeof(T));                                     \
        if (e == NULL || cum == NULL) {                                                         \
            free(e);                                                                            \
            free(cum);                                                                          \
            return -1;                                                                          \
        }                                                                                       \
        for (int64_t r = r0; r < r1; r++) {                                                     \
            const T *ur = u + r * nu;                                                           \
            T m = weights_##SUF(s + r * s_stride, L, Lp, e);                                    \
            int ok = m > -INFINITY;                                                             \
            empty[r] = (uint8_t)!ok;                                                            \
            T total = ok ? cdf_##T(e, nb, bl, cum) : 0;                                         \
            for (int64_t k = 0; k < nu; k++) {                                                  \
                int64_t j = ok ? find_##T(e, cum, nb, bl, ur[k] * total) : 0;                   \
                if (out32 != NULL)                                                              \
                    out32[r * nu + k] = (int32_t)j;                                             \
                else                                                                            \
                    out64[r * nu + k] = j;                                                      \
            }                                                                                   \
        }                                                                                       \
        free(e);                                                                                \
        free(cum);                                                                              \
        return 0;                                                                               \
    }                                                                                           \
    int64_t attnuq_sample_rows_##SUF(const T *s, int64_t rows, int64_t L, int64_t s_stride,     \
                                     const T *u, int64_t nu, int32_t *out32, int64_t *out64,    \
                                     uint8_t *empty, int64_t nthreads) {                        \
        int64_t err = 0;                                                                        \
        (void)nthreads;                                                                         \
        _Pragma("omp parallel num_threads(nthreads) if(nthreads > 1) reduction(| : err)")       \
        {                                                                                       \
            int64_t tid = 0, nt = 1;                                                            \
            PARALLEL_IDS(tid, nt);                                                              \
            int64_t r0 = rows * tid / nt, r1 = rows * (tid + 1) / nt;                           \
            err |= rows_##SUF(s, r0, r1, L, s_stride, u, nu, out32, out64, empty);              \
        }                                                                                       \
        return err;                                                                             \
    }

#ifdef _OPENMP
#define PARALLEL_IDS(tid, nt) (tid = omp_get_thread_num(), nt = omp_get_num_threads())
#else
#define PARALLEL_IDS(tid, nt) ((void)0)
#endif

DEFINE_SAMPLE(float, f32)
DEFINE_SAMPLE(double, f64)

/*
 * One key block of the key-blocked sampler (attnuq.ops.sampled._sample_blocked), in place.
 *
 * Row r keeps the log2-mass run[r] of the keys seen so far (-inf before the first) and nu running
 * choices. With the block's log2-mass lb = log2(sum_j 2^s_j) and run' = logaddexp2(run, lb),
 * choice k is replaced, with probability p = 2^(lb - run'), by a draw from the block: the uniform
 * u of (row, k, block) decides (u < p) and, given replacement, u / p (uniform on [0, 1), capped
 * below 1) is the inverse-CDF threshold within the block (the same CDF layout and lookup as the
 * dense kernel above). By induction the choice after the last block is an exact draw from the
 * softmax over all keys. A block whose every score is -inf changes nothing (p = 0).
 *
 * s: rows x L block scores (row r at s + r * s_stride); u: rows x nu uniforms; run: rows;
 * choice32 or choice64 (the other NULL): rows x nu keys (j0 + position in the block).
 */
#define DEFINE_BLOCK(T, SUF, LOG2, EXP2, BELOW_ONE)                                            \
    static int64_t block_rows_##SUF(const T *s, int64_t r0, int64_t r1, int64_t L,            \
                                    int64_t s_stride, const T *u, int64_t nu, T *run,          \
                                    int32_t *c32, int64_t *c64, int64_t j0) {                  \
        int64_t nb, bl;                                                                         \
        layout(L, &nb, &bl);                                                                    \
        int64_t Lp = nb * bl;                                                                   \
        T *e = (T *)malloc((size_t)(Lp + 8) * sizeof(T));                                       \
        T *cum = (T *)malloc((size_t)(nb + 1) * sizeof(T));                                     \
        if (e == NULL || cum == NULL) {                                                         \
            free(e);                                                                            \
            free(cum);                                                                          \
            return -1;                                                                          \
        }                                                                                       \
        for (int64_t r = r0; r < r1; r++) {                                                     \
            T m = weights_##SUF(s + r * s_stride, L, Lp, e);                                    \
            if (!(m > -INFINITY)) continue;                                                     \
            T total = cdf_##T(e, nb, bl, cum);                                                  \
            T lb = LOG2(total) + m;                                                             \
            T old = run[r];                                                                     \
            T upd;                                                                              \
            if (!(old > -INFINITY))                                                             \
                upd = lb;                                                                       \
            else if (old >= lb)                                                                 \
                upd = old + LOG2((T)1 + EXP2(lb - old));                                        \
            else                                                                                \
                upd = lb + LOG2((T)1 + EXP2(old - lb));                                         \
            T p = EXP2(lb - upd);                                                               \
            run[r] = upd;                                                                       \
            const T *ur = u + r * nu;                                                           \
            for (int64_t k = 0; k < nu; k++) {                                                  \
                T uk = ur[k];                                                                   \
                if (!(uk < p)) continue;                                                        \
                T x = uk / p;                                                                   \
                if (x > BELOW_ONE) x = BELOW_ONE;                                               \
                int64_t j = j0 + find_##T(e, cum, nb, bl, x * total);                           \
                if (c32 != NULL)                                                                \
                    c32[r * nu + k] = (int32_t)j;                                               \
                else                                                                            \
                    c64[r * nu + k] = j;                                                        \
            }                                                                                   \
        }                                                                                       \
        free(e);                                                                                \
        free(cum);                                                                              \
        return 0;                                                                               \
    }                                                                                           \
    int64_t attnuq_sample_block_##SUF(const T *s, int64_t rows, int64_t L, int64_t s_stride,    \
                                      const T *u, int64_t nu, T *run, int32_t *c32,             \
                                      int64_t *c64, int64_t j0, int64_t nthreads) {             \
        int64_t err = 0;                                                                        \
        (void)nthreads;                                                                         \
        _Pragma("omp parallel num_threads(nthreads) if(nthreads > 1) reduction(| : err)")       \
        {                                                                                       \
            int64_t tid = 0, nt = 1;                                                            \
            PARALLEL_IDS(tid, nt);                                                              \
            int64_t r0 = rows * tid / nt, r1 = rows * (tid + 1) / nt;                           \
            err |= block_rows_##SUF(s, r0, r1, L, s_stride, u, nu, run, c32, c64, j0);          \
        }                                                                                       \
        return err;                                                                             \
    }

DEFINE_BLOCK(float, f32, log2f, exp2f, (1.0f - 5.9604645e-08f))
DEFINE_BLOCK(double, f64, log2, exp2, (1.0 - 1.1102230246251565e-16))
