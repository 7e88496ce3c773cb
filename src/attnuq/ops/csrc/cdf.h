/*
 * attnuq: the blocked CDF of a row of weights and its inverse-CDF lookup, shared by the row
 * kernels (sample_rows.c) and the fused attention kernels (fused.c). The layout is described at
 * the top of sample_rows.c.
 */
#ifndef ATTNUQ_CDF_H
#define ATTNUQ_CDF_H

#include <stdint.h>

#define LANES 8  /* blocks come in multiples of this */
#define MAXBL 16 /* most entries per block */

/* Blocks nb (a multiple of LANES) and entries per block bl <= MAXBL for a row of L keys. */
static inline void layout(int64_t L, int64_t *nb, int64_t *bl) {
    int64_t n = LANES * ((L + LANES * MAXBL - 1) / (LANES * MAXBL));
    *nb = n < LANES ? LANES : n;
    *bl = (L + *nb - 1) / *nb;
    if (*bl < 1) *bl = 1;
}

/* In place: e (bl rows of nb) -> in-block prefix P; cum[0..nb] the prefix of block totals. */
#define DEFINE_CDF(T)                                                                           \
    static inline T cdf_##T(T *restrict e, int64_t nb, int64_t bl, T *restrict cum) {              \
        for (int64_t l = 1; l < bl; l++) {                                                      \
            T *restrict cur = e + l * nb;                                                       \
            const T *restrict prev = e + (l - 1) * nb;                                          \
            for (int64_t b = 0; b < nb; b++) cur[b] += prev[b];                                 \
        }                                                                                       \
        const T *last = e + (bl - 1) * nb;                                                      \
        cum[0] = 0;                                                                             \
        for (int64_t b = 0; b < nb; b++) cum[b + 1] = cum[b] + last[b];                         \
        return cum[nb];                                                                         \
    }

/* The key of threshold t (0 <= t, nominally < total) given P and cum (see the top). */
#define DEFINE_FIND(T)                                                                          \
    static inline int64_t find_##T(const T *P, const T *cum, int64_t nb, int64_t bl, T t) {        \
        int64_t b = 0;                                                                          \
        if (nb <= 64) { /* b = #{i >= 1 : cum[i] <= t}: compares the compiler vectorises */     \
            for (int64_t i = 1; i < nb; i++) b += (cum[i] <= t);                                \
        } else {                                                                                \
            int64_t n = nb;                                                                     \
            while (n > 1) { /* largest b with cum[b] <= t, branch-free */                       \
                int64_t half = n >> 1;                                                          \
                b += half & -(int64_t)(cum[b + half] <= t);                                     \
                n -= half;                                                                      \
            }                                                                                   \
        }                                                                                       \
        T base = cum[b];                                                                        \
        int64_t l = 0;                                                                          \
        for (int64_t i = 0; i < bl; i++) l += (base + P[i * nb + b] <= t);                      \
        if (l < bl) return l * nb + b;                                                          \
        for (int64_t bb = b; bb >= 0; bb--) /* rounding miss: last positive key */              \
            for (int64_t i = bl - 1; i >= 0; i--)                                               \
                if (P[i * nb + bb] > (i ? P[(i - 1) * nb + bb] : 0)) return i * nb + bb;        \
        return 0;                                                                               \
    }

DEFINE_CDF(float)
DEFINE_CDF(double)
DEFINE_FIND(float)
DEFINE_FIND(double)

#endif
