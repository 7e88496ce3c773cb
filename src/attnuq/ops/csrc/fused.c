/*
 * attnuq: fused CPU attention kernels (float32): the dense and the key-blocked sampler of
 * attnuq.ops.sampled_attention, and attnuq.ops.attention_moments, each computing its scores
 * tile by tile so that no score matrix larger than a tile of query rows ever exists.
 *
 * Work unit: one group g (a key/value head with the query rows that read it) and one tile of
 * MR query rows; each thread takes a contiguous range of (group, tile) units (no barriers). Per
 * group (and thread) the keys are packed once into panels of NR keys, feature-major
 * (Kp[p][d][c] = k[p NR + c][d], zero past Lk), so that a register-blocked micro-GEMM computes
 * an MR x NR block of scores with 2 MR vector accumulators: for every feature d, two vector
 * loads of the panel, MR broadcasts of the (pre-scaled) query entries and 2 MR fused
 * multiply-adds. With AVX-512 (VW = 16 lanes) MR = 8, NR = 32: 16 of the 32 registers hold
 * accumulators; on the portable path (VW = 8, e.g. AVX2) MR = 4, NR = 16: 8 of 16 registers.
 * The tile's scores (MR rows x the keys they may see) then stay in L1/L2 for the rest:
 *
 *   s_ij = (scale q_i) . k_j + bias_ij   (log2 units; bias from attn_mask, -inf = excluded)
 *
 * and query i of a causal call only sees keys j <= i mod Lq (its row is treated as having
 * that many keys). The scale (SDPA scale times log2 e) multiplies q before the products, so the
 * scores differ from torch's GEMM (alpha after the sum) in rounding only; everything after is
 * exact on the scores as computed.
 *
 * Dense sampler: per row the maximum m, e_j = 2^(s_j - m), the blocked CDF of cdf.h and one
 * inverse-CDF lookup per uniform (the layout and lookup of the row kernel in sample_rows.c:
 * exact draws from the softmax of the scores, keys of zero weight never drawn), then the mean of
 * the nu drawn value rows (summed in draw order, times 1/nu) into the output.
 *
 * Key-blocked sampler: the same per key block of `block` keys (its own micro-GEMM tile) with
 * the running choice of sample_rows.c's block kernel (coin u < p, p the block's share of the
 * mass of the blocks so far, then the lookup of u / p in the block's CDF; see block_row()); one
 * uniform per (row, block, draw).
 *
 * Moments: per row m, e_j, l = sum_j e_j, then a second micro-GEMM e (MR x keys) times the
 * packed values [vc, vc^2] (vc = v - vbar, vbar the unweighted mean of the group's values, as in
 * attnuq.ops.sampled._moments) gives a1 = sum_j e_j vc_j and a2 = sum_j e_j vc_j^2; then
 * mean = a1 / l + vbar and var = max(a2 / l - (a1 / l)^2, 0). The row's maximum is exact (the
 * whole row of scores is in the tile), so no online rescaling is needed.
 *
 * The bias, the causal limit (-inf past it) and the row maximum are applied as each panel of
 * scores leaves the registers; 2^(s - m) and the in-block prefix of the CDF are one pass.
 *
 * Uniforms: none are passed in. The caller draws one seed from its generator; the uniforms of
 * query row i of group g are a SplitMix64 stream keyed by (seed, g M + i) (uniform() below), so
 * the draws depend on the seed and the row only, not on chunks or threads.
 *
 * Rows whose every key is excluded are flagged empty (indices 0, zero output rows).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cdf.h"
#include "simd.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#ifndef MR
#ifdef __AVX512F__
#define MR 8
#else
#define MR 4
#endif
#endif
#define NR (2 * VW)

/*
 * The arguments, passed as one int64 array in this field order (pointers as integers; strides
 * in elements). Group g is (n, h) = (g / hk, g % hk) and its query row i is (r, l) = (i / lq,
 * i % lq), read from query head h R + r: any 4-D layout (N, H, L, D) of q, k, v and the output
 * with a unit feature stride is read in place (e.g. Hugging Face's transposed (B, L, H, D)
 * memory), without copying it into groups.
 */
struct fused_args {
    int64_t q, q_sn, q_sh, q_sl;     /* const float *: row (g, i) at q + n q_sn + (h R + r) q_sh
                                        + l q_sl, unit feature stride */
    int64_t k, k_sn, k_sh, k_sl;     /* key j of group g at k + n k_sn + h k_sh + j k_sl */
    int64_t G, M, Lk, D, hk, R, lq;
    int64_t bias, b_sn, b_sh, b_sr, b_sl; /* const float *: bias of row (g, i) at bias +
                                        n b_sn + h b_sh + r b_sr + l b_sl (unit key stride) */
    int64_t causal, clq;             /* row i sees keys j <= i mod clq */
    int64_t g0, g1, i0, i1;          /* the chunk: rows i0:i1 of groups g0:g1 */
    int64_t seed, nu, block;         /* uniforms' seed (see uniform()); block 0: dense */
    int64_t v, v_sn, v_sh, v_sl, offs, Dv; /* value j of group g at v + base + j v_sl, base =
                                        offs[g] v_sn (offs int64 *, when not 0) or n v_sn +
                                        h v_sh */
    int64_t out, o_sn, o_sh, o_sl;   /* float: output row (g, i) at out + n o_sn + (h R + r)
                                        o_sh + l o_sl (unit last stride), or 0 */
    int64_t var;                     /* float, the output's strides (moments) */
    int64_t idx, idx64;              /* chunk (g, rows, nu) int32 / int64 (idx64) keys, or 0 */
    int64_t empty;                   /* uint8 (G, M): 1 = no admissible key */
    int64_t bnat;                    /* 1: the bias holds an additive float mask in natural
                                        units (read in place; see nat_bias), 0: log2 units */
    int64_t nthreads;
};

static inline const float *k_group(const struct fused_args *a, int64_t g) {
    return (const float *)a->k + (g / a->hk) * a->k_sn + (g % a->hk) * a->k_sh;
}

static inline int64_t v_base(const struct fused_args *a, int64_t g) {
    return a->offs ? ((const int64_t *)a->offs)[g] * a->v_sn
                   : (g / a->hk) * a->v_sn + (g % a->hk) * a->v_sh;
}

/* Element offsets of rows t .. t + MR - 1 of group g (rows past nr: row t) in q, the bias and
 * the output, and of the group's values: the integer divisions of the (n, h, r, l) addressing
 * once per tile (one division per tile instead of four per row and array). */
struct rows_at {
    int64_t q[MR], b[MR], o[MR], l[MR], vb;
};

static void place_rows(const struct fused_args *a, int64_t g, int64_t t, int64_t nr,
                       struct rows_at *p) {
    const int64_t gn = g / a->hk, gh = g - gn * a->hk;
    const int64_t qg = gn * a->q_sn + gh * a->R * a->q_sh;
    const int64_t bg = gn * a->b_sn + gh * a->b_sh;
    const int64_t og = gn * a->o_sn + gh * a->R * a->o_sh;
    int64_t rr = t / a->lq, ll = t - rr * a->lq;
    for (int r = 0; r < MR; r++) {
        if (r == nr) { /* rows past the tile's last: row t (never read but for the bias) */
            rr = t / a->lq;
            ll = t - rr * a->lq;
        }
        p->q[r] = qg + rr * a->q_sh + ll * a->q_sl;
        p->b[r] = bg + rr * a->b_sr + ll * a->b_sl;
        p->o[r] = og + rr * a->o_sh + ll * a->o_sl;
        p->l[r] = ll;
        if (r < nr && ++ll == a->lq) {
            ll = 0;
            rr++;
        }
    }
    p->vb = v_base(a, g);
}

int64_t attnuq_fused_args_words(void) { return (int64_t)(sizeof(struct fused_args) / 8); }

/* Lanes of the vectors the fused kernels use (16: the AVX-512 path, 8: the portable one). */
int64_t attnuq_fused_lanes(void) { return VW; }

#define BELOW_ONE_F (1.0f - 5.9604645e-08f)

/* SplitMix64's output function (a bijective 64-bit mixer). */
static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* The uniforms of query row i of group g: its key rk = mix64(seed + (g M + i + 1) c2) starts a
 * SplitMix64 stream, whose n-th output mix64(rk + (n + 1) c1) gives the n-th uniform of the row
 * from its top 24 bits (a float32 in [0, 1), as torch.rand's). Draw k of key block b uses
 * n = b nu + k. The draws therefore depend on the seed and the row only, not on how the rows
 * are split into chunks or over threads. */
static inline uint64_t row_key(const struct fused_args *a, int64_t g, int64_t i) {
    return mix64((uint64_t)a->seed + (uint64_t)(g * a->M + i + 1) * 0xd1b54a32d192ed03ULL);
}

static inline float uniform(uint64_t rk, int64_t n) {
    uint64_t x = mix64(rk + (uint64_t)(n + 1) * 0x9e3779b97f4a7c15ULL);
    return (float)(x >> 40) * 5.9604645e-08f; /* 2^-24 */
}

static void *alloc64(size_t bytes) {
    size_t n = (bytes + 63) / 64 * 64;
    return aligned_alloc(64, n ? n : 64);
}

#ifdef __AVX512F__
/* dst[d ldo + c] = src[c ld + d] for c, d < 16 (a 16 x 16 transpose in registers); returns
 * whether all 256 entries are finite. */
static inline int transpose16(const float *src, int64_t ld, float *dst, int64_t ldo) {
    __m512 r[16], t[16];
    const __m512 big = _mm512_set1_ps(3.40282347e+38f);
    __mmask16 ok = 0xffff;
    for (int i = 0; i < 16; i++) {
        r[i] = _mm512_loadu_ps(src + i * ld);
        ok &= _mm512_cmp_ps_mask(_mm512_abs_ps(r[i]), big, _CMP_LE_OQ);
    }
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
    for (int i = 0; i < 16; i++) _mm512_storeu_ps(dst + i * ldo, r[i]);
    return ok == 0xffff;
}
#endif

/* Kp[p][d][c] = k[p NR + c][d] for the panels p < np (zero past Lk); returns whether every
 * entry of k read is finite. */
static int pack_k(const float *k, int64_t sl, int64_t Lk, int64_t D, int64_t np, float *Kp) {
    int fin = 1; /* every packed entry finite (|x| <= FLT_MAX: false for inf and NaN) */
    for (int64_t p = 0; p < np; p++) {
        float *dst = Kp + p * D * NR;
#ifdef __AVX512F__
        if ((p + 1) * NR <= Lk && D % 16 == 0) { /* a full panel: 16 x 16 transposes */
            for (int64_t d0 = 0; d0 < D; d0 += 16)
                for (int c0 = 0; c0 < NR; c0 += 16)
                    fin &= transpose16(k + (p * NR + c0) * sl + d0, sl, dst + d0 * NR + c0, NR);
            continue;
        }
#endif
        /* a partial panel (the last keys; on the portable path any panel): zeros, then the nc
         * keys column by column (whole 16-key blocks by transposes where D allows) */
        const int64_t left = Lk - p * NR, nc = left < 0 ? 0 : left < NR ? left : NR;
        memset(dst, 0, (size_t)(D * NR) * sizeof(float));
        int64_t c = 0;
#ifdef __AVX512F__
        if (D % 16 == 0)
            for (; c + 16 <= nc; c += 16)
                for (int64_t d0 = 0; d0 < D; d0 += 16)
                    fin &= transpose16(k + (p * NR + c) * sl + d0, sl, dst + d0 * NR + c, NR);
#endif
        for (; c < nc; c++) {
            const float *src = k + (p * NR + c) * sl;
            for (int64_t d = 0; d < D; d++) {
                dst[d * NR + c] = src[d];
                fin &= fabsf(src[d]) <= 3.40282347e+38f;
            }
        }
    }
    return fin;
}

/* {0, 1, ..., VW - 1} */
static inline vwi lane_iota(void) {
    vwi x;
    for (int l = 0; l < VW; l++) x[l] = l;
    return x;
}

/*
 * An additive float mask in natural units as the log2 bias: b log2(e) in float32 (one rounding,
 * as torch's `mask * LOG2E`), except that a finite b whose product overflows to -inf becomes
 * -FLT_MAX, an ordinary (very low) score as SDPA weights it; -inf stays -inf (key excluded).
 * NaN and +inf never reach the kernel (the caller refuses such masks).
 */
static inline vwf nat_bias(vwf b) {
    const vwf ninf = splatw(-INFINITY);
    const vwf t = b * splatw(1.44269504088896340736f);
    return selw((t == ninf) & (b != ninf), splatw(-3.40282347e+38f), t);
}

/*
 * S[r][j] (row stride ld, j = p NR + c < np NR) = qs[r] . k[j] + bias[r][j] for j < lim[r] and
 * -inf for lim[r] <= j (bias[r] NULL: no bias; bias NULL: none for any row), for r < MR and the
 * panels p < np; mx[r] = max_j S[r][j] (-inf when lim[r] = 0). The bias and the limit are
 * applied as each panel leaves the registers, so no pass over the scores is needed for them.
 * nat: the bias rows hold an additive mask in natural units, converted by nat_bias as read.
 */
static void score_tile(const float *restrict qs, const float *restrict Kp, int64_t D, int64_t np,
                       float *restrict S, int64_t ld, const float *const *bias, int nat,
                       const int64_t *lim, float *mx) {
    vwf mv[MR];
#pragma GCC unroll 16
    for (int r = 0; r < MR; r++) mv[r] = splatw(-INFINITY);
    for (int64_t p = 0; p < np; p++) {
        const float *kp = Kp + p * D * NR;
        const int64_t j0 = p * NR;
        vwf acc[MR][2];
#pragma GCC unroll 16
        for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = splatw(0.0f);
        for (int64_t d = 0; d < D; d++) {
            vwf k0 = ldw(kp + d * NR), k1 = ldw(kp + d * NR + VW);
#pragma GCC unroll 16
            for (int r = 0; r < MR; r++) {
                float b = qs[r * D + d]; /* scalar * vector: a broadcast */
                acc[r][0] += b * k0;
                acc[r][1] += b * k1;
            }
        }
#pragma GCC unroll 16
        for (int r = 0; r < MR; r++) {
            float *dst = S + r * ld + j0;
            const float *br = bias != NULL ? bias[r] : NULL;
            if (j0 + NR <= lim[r]) { /* a full panel of admissible keys */
                vwf s0 = acc[r][0], s1 = acc[r][1];
                if (br != NULL) {
                    vwf b0 = ldw(br + j0), b1 = ldw(br + j0 + VW);
                    if (nat) {
                        b0 = nat_bias(b0);
                        b1 = nat_bias(b1);
                    }
                    s0 += b0;
                    s1 += b1;
                }
                mv[r] = maxw(mv[r], maxw(s0, s1));
                stw(dst, s0);
                stw(dst + VW, s1);
            } else { /* the row's last nv keys, or none: lanes past them become -inf */
                const int64_t nv = lim[r] - j0 < 0 ? 0 : lim[r] - j0; /* < NR */
                vwf s0 = acc[r][0], s1 = acc[r][1];
                if (br != NULL && nv > 0) { /* the bias of the nv keys (none read past them) */
                    float tb[NR];
                    for (int c = 0; c < NR; c++) tb[c] = c < nv ? br[j0 + c] : 0.0f;
                    vwf b0 = ldw(tb), b1 = ldw(tb + VW);
                    if (nat) {
                        b0 = nat_bias(b0);
                        b1 = nat_bias(b1);
                    }
                    s0 += b0;
                    s1 += b1;
                }
                const vwi n0 = lane_iota() * 0 + (int32_t)nv;
                const vwf ninf = splatw(-INFINITY);
                s0 = selw(lane_iota() < n0, s0, ninf);
                s1 = selw(lane_iota() + VW < n0, s1, ninf);
                mv[r] = maxw(mv[r], maxw(s0, s1));
                stw(dst, s0);
                stw(dst + VW, s1);
            }
        }
    }
    for (int r = 0; r < MR; r++) {
        float m = -INFINITY;
        for (int l = 0; l < VW; l++) m = mv[r][l] > m ? mv[r][l] : m;
        mx[r] = m;
    }
}

/* A[r][c] (row stride lda, columns c0 .. c0 + NR) = sum_{j < nk} E[r][j] VV[j][c]. */
static void pv_tile(const float *restrict E, int64_t ld, int64_t nk, const float *restrict VV,
                    int64_t W, int64_t c0, float *restrict A, int64_t lda) {
    vwf acc[MR][2];
#pragma GCC unroll 16
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = splatw(0.0f);
    for (int64_t j = 0; j < nk; j++) {
        vwf v0 = ldw(VV + j * W + c0), v1 = ldw(VV + j * W + c0 + VW);
#pragma GCC unroll 16
        for (int r = 0; r < MR; r++) {
            float b = E[r * ld + j];
            acc[r][0] += b * v0;
            acc[r][1] += b * v1;
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; r++) {
        stw(A + r * lda + c0, acc[r][0]);
        stw(A + r * lda + c0 + VW, acc[r][1]);
    }
}

#ifdef __AVX512F__
/* exp2_nonposw with the AVX-512 rounding and scaling instructions: the same nearest integer n,
 * the same polynomial and the same correctly rounded p 2^n, so bit for bit the same weights. */
static inline vwf exp2_fast(vwf x) {
    __m512 xv;
    memcpy(&xv, &x, sizeof xv);
    __mmask16 keep = _mm512_cmp_ps_mask(xv, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
    __m512 fnv = _mm512_roundscale_ps(_mm512_max_ps(xv, _mm512_set1_ps(-126.0f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vwf fn, xc;
    memcpy(&fn, &fnv, sizeof fn);
    __m512 xcv = _mm512_max_ps(xv, _mm512_set1_ps(-126.0f));
    memcpy(&xc, &xcv, sizeof xc);
    vwf f = xc - fn;
    vwf p = f * 1.535336188319500e-4f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    __m512 pv;
    memcpy(&pv, &p, sizeof pv);
    __m512 r = _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(pv, fnv));
    vwf out;
    memcpy(&out, &r, sizeof out);
    return out;
}

/* find_float (cdf.h) with vector compares: the same counts, so the same key. */
static inline int64_t find_fast(const float *P, const float *cum, int64_t nb, int64_t bl,
                                float t) {
    if (nb > 64) return find_float(P, cum, nb, bl, t);
    const __m512 tv = _mm512_set1_ps(t);
    int64_t b = 0;
    for (int64_t i = 1; i < nb; i += 16) {
        __mmask16 m = nb - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (nb - i)) - 1u);
        __m512 c = _mm512_maskz_loadu_ps(m, cum + i);
        b += __builtin_popcount(_mm512_mask_cmp_ps_mask(m, c, tv, _CMP_LE_OQ));
    }
    if (bl <= 4) { /* few entries per block (short rows): scalar compares beat a gather */
        const float base = cum[b];
        int64_t l = 0;
        for (int64_t i = 0; i < bl; i++) l += (base + P[i * nb + b] <= t);
        if (l < bl) return l * nb + b;
        return find_float(P, cum, nb, bl, t); /* a rounding miss: the scalar fallback */
    }
    const __mmask16 lm = (__mmask16)((1u << bl) - 1u); /* bl <= 16 */
    const __m512i vi = _mm512_add_epi32(
        _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,
                                             15), _mm512_set1_epi32((int)nb)),
        _mm512_set1_epi32((int)b));
    __m512 pv = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), lm, vi, P, 4);
    __m512 x = _mm512_add_ps(_mm512_set1_ps(cum[b]), pv);
    int64_t l = __builtin_popcount(_mm512_mask_cmp_ps_mask(lm, x, tv, _CMP_LE_OQ));
    if (l < bl) return l * nb + b;
    return find_float(P, cum, nb, bl, t); /* a rounding miss: the scalar fallback */
}
#define EXP2_ROW exp2_fast
#define FIND find_fast
#else
#define EXP2_ROW exp2_nonposw
#define FIND find_float
#endif

/* e[0:L] = 2^(s - m) (e may be s), e[L:Lp] = 0; returns sum_j e_j when want_sum. */
static float exp_row(const float *s, int64_t L, float m, float *e, int64_t Lp, int want_sum) {
    vwf mb = splatw(m), acc = splatw(0.0f);
    int64_t j = 0;
    for (; j + VW <= L; j += VW) {
        vwf x = EXP2_ROW(ldw(s + j) - mb);
        acc += x;
        stw(e + j, x);
    }
    if (j < L) {
        float tail[VW];
        for (int l = 0; l < VW; l++) tail[l] = j + l < L ? s[j + l] - m : -INFINITY;
        vwf x = EXP2_ROW(ldw(tail));
        acc += x;
        stw(tail, x);
        memcpy(e + j, tail, (size_t)(L - j) * sizeof(float));
        j = L;
    }
    for (; j < Lp; j++) e[j] = 0.0f;
    float t = 0.0f;
    if (want_sum)
        for (int l = 0; l < VW; l++) t += acc[l];
    return t;
}

/*
 * In place: s[0:L] (scores, maximum m) -> the in-block prefix P of the weights e = 2^(s - m) in
 * the layout of cdf.h (nb blocks of bl entries, zero weights past L up to nb bl), and cum[0..nb]
 * the prefix of the block totals; returns the total. One pass instead of exp_row + cdf_float,
 * with the same sums in the same order (so the same P, cum and draws).
 */
static float exp_cdf(float *s, int64_t L, float m, int64_t nb, int64_t bl, float *cum) {
    for (int64_t j = L; j < nb * bl; j++) s[j] = -INFINITY; /* 2^-inf = 0 */
    int64_t b = 0;
    const vwf mb = splatw(m);
    for (; b + VW <= nb; b += VW) {
        vwf run = EXP2_ROW(ldw(s + b) - mb);
        stw(s + b, run);
        for (int64_t l = 1; l < bl; l++) {
            float *p = s + l * nb + b;
            run = EXP2_ROW(ldw(p) - mb) + run;
            stw(p, run);
        }
    }
    if (b < nb) { /* the last 8 blocks (nb is a multiple of 8): 2^x at full width first */
        const int64_t Lp = nb * bl;
        int64_t j = 0;
        if (nb < VW) {
            for (; j + VW <= Lp; j += VW) stw(s + j, EXP2_ROW(ldw(s + j) - mb));
            for (; j < Lp; j += 8) st8(s + j, exp2_nonpos8(ld8(s + j) - splat8(m)));
            v8f run = ld8(s);
            for (int64_t l = 1; l < bl; l++) {
                run = ld8(s + l * nb) + run;
                st8(s + l * nb, run);
            }
        } else {
            const v8f m8 = splat8(m);
            v8f run = exp2_nonpos8(ld8(s + b) - m8);
            st8(s + b, run);
            for (int64_t l = 1; l < bl; l++) {
                float *p = s + l * nb + b;
                run = exp2_nonpos8(ld8(p) - m8) + run;
                st8(p, run);
            }
        }
    }
    const float *last = s + (bl - 1) * nb;
    cum[0] = 0;
    for (b = 0; b < nb; b++) cum[b + 1] = cum[b] + last[b];
    return cum[nb];
}

static inline void put_idx(const struct fused_args *a, int64_t pos, int64_t j) {
    if (a->idx64)
        ((int64_t *)a->idx)[pos] = j;
    else
        ((int32_t *)a->idx)[pos] = (int32_t)j;
}

/* Mean of the nu value rows chosen[0:nu] of group g into o[0:Dv]: per element the sum in draw
 * order times 1/nu (vector accumulators, 4 vectors of columns at a time). With stream (a large
 * output, AVX-512) whole cache lines go to memory by non-temporal stores: no read of the
 * output's lines before they are written (the output is not read back here). */
static void gather_mean(const struct fused_args *a, int64_t vb, const int64_t *chosen, float *o,
                        int stream) {
    (void)stream; /* used on the AVX-512 path only */
    const float *v = (const float *)a->v + vb;
    const int64_t Dv = a->Dv, nu = a->nu, sl = a->v_sl;
    const float inv = 1.0f / (float)nu;
    int64_t d = 0;
    for (; d + 4 * VW <= Dv; d += 4 * VW) {
        vwf a0 = splatw(0.0f), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t kk = 0; kk < nu; kk++) {
            const float *vr = v + chosen[kk] * sl + d;
            a0 += ldw(vr);
            a1 += ldw(vr + VW);
            a2 += ldw(vr + 2 * VW);
            a3 += ldw(vr + 3 * VW);
        }
#ifdef __AVX512F__
        if (stream && ((uintptr_t)(o + d) & 63) == 0) { /* whole lines: stream them out */
            vwf r[4] = {a0 * inv, a1 * inv, a2 * inv, a3 * inv};
            for (int l = 0; l < 4; l++) {
                __m512 x;
                memcpy(&x, &r[l], sizeof x);
                _mm512_stream_ps(o + d + l * VW, x);
            }
            continue;
        }
#endif
        stw(o + d, a0 * inv);
        stw(o + d + VW, a1 * inv);
        stw(o + d + 2 * VW, a2 * inv);
        stw(o + d + 3 * VW, a3 * inv);
    }
    for (; d + VW <= Dv; d += VW) {
        vwf a0 = splatw(0.0f);
        for (int64_t kk = 0; kk < nu; kk++) a0 += ldw(v + chosen[kk] * sl + d);
        stw(o + d, a0 * inv);
    }
#if VW > 8
    for (; d + 8 <= Dv; d += 8) { /* 8 columns left (e.g. Dv = 8): half a vector */
        v8f a0 = splat8(0.0f);
        for (int64_t kk = 0; kk < nu; kk++) a0 += ld8(v + chosen[kk] * sl + d);
        st8(o + d, a0 * inv);
    }
#endif
    for (; d < Dv; d++) {
        float t = 0.0f;
        for (int64_t kk = 0; kk < nu; kk++) t += v[chosen[kk] * sl + d];
        o[d] = t * inv;
    }
}

/* per-thread scratch */
struct scratch {
    float *qs, *S, *cum, *A;
    float *rmax, *rsum; /* key-blocked: per tile row, the running maximum and mass */
    int64_t *chosen;    /* MR x nu drawn keys */
    int64_t ld;
};

static void scratch_free(struct scratch *w) {
    free(w->qs);
    free(w->S);
    free(w->cum);
    free(w->A);
    free(w->rmax);
    free(w->rsum);
    free(w->chosen);
}

static inline int64_t chunk_row(const struct fused_args *a, int64_t g, int64_t i) {
    return (g - a->g0) * (a->i1 - a->i0) + (i - a->i0);
}

/* Dense draws of row i from its scores s[0:L] (maximum m; overwritten by the CDF) into
 * ch[0:nu]; returns whether the row has a key of positive weight. */
static int dense_row(const struct fused_args *a, struct scratch *w, int64_t g, int64_t i,
                     float *s, int64_t L, float m, int64_t *ch) {
    const int64_t nu = a->nu;
    const uint64_t rk = row_key(a, g, i);
    if (!(L > 0 && m > -INFINITY)) return 0;
    int64_t nb, bl;
    layout(L, &nb, &bl);
    float total = exp_cdf(s, L, m, nb, bl, w->cum);
    for (int64_t kk = 0; kk < nu; kk++) ch[kk] = FIND(s, w->cum, nb, bl, uniform(rk, kk) * total);
    return 1;
}

/*
 * Key block blk (keys jb .. jb + L - 1, scores s[0:L], maximum m) of row i: with m_b = m
 * and mass t_b = sum 2^(s - m_b), the row's running maximum M and mass R (relative to M) become
 * those of all blocks so far, and each draw is replaced with probability p = t_b 2^(m_b - M') /
 * R' (the block's share of the mass so far) by the inverse-CDF key of u / p within the block.
 * The same coin and lookup as sample_rows.c's block kernel; the mass is kept linearly (one
 * exp2f per block instead of two log2f and two exp2f).
 */
static void block_row(const struct fused_args *a, struct scratch *w, int64_t g, int64_t i,
                      int64_t r, float *s, int64_t L, float m, int64_t jb, int64_t blk) {
    const int64_t nu = a->nu;
    if (!(m > -INFINITY)) return;
    int64_t nb, bl;
    layout(L, &nb, &bl);
    float total = exp_cdf(s, L, m, nb, bl, w->cum); /* in place: the tile holds this block */
    float M = w->rmax[r], R = w->rsum[r], share, p;
    if (!(M > -INFINITY)) {
        M = m;
        R = total;
        p = 1.0f;
    } else if (m <= M) {
        share = total * exp2f(m - M);
        R += share;
        p = share / R;
    } else {
        R = R * exp2f(M - m) + total;
        M = m;
        p = total / R;
    }
    w->rmax[r] = M;
    w->rsum[r] = R;
    const uint64_t rk = row_key(a, g, i);
    int64_t *ch = w->chosen + r * nu;
    for (int64_t k0 = 0; k0 < nu; k0 += 64) { /* the coins of 64 draws, then the lookups */
        const int n = nu - k0 < 64 ? (int)(nu - k0) : 64;
        float ub[64];
        uint64_t take = 0;
        for (int c = 0; c < n; c++) {
            ub[c] = uniform(rk, blk * nu + k0 + c);
            take |= (uint64_t)(ub[c] < p) << c;
        }
        while (take) { /* no branch per coin: one pass over the replaced draws */
            const int c = __builtin_ctzll(take);
            take &= take - 1;
            float x = ub[c] / p;
            if (x > BELOW_ONE_F) x = BELOW_ONE_F;
            ch[k0 + c] = jb + FIND(s, w->cum, nb, bl, x * total);
        }
    }
}

/* Row i's flag, keys and mean drawn value row (zeros for an empty row). */
static void finish_row(const struct fused_args *a, int64_t g, int64_t i, int64_t ooff,
                       int64_t vb, int ok, int64_t *ch) {
    const int64_t nu = a->nu;
    ((uint8_t *)a->empty)[g * a->M + i] = (uint8_t)!ok;
    if (!ok)
        for (int64_t kk = 0; kk < nu; kk++) ch[kk] = 0;
    if (a->idx) {
        const int64_t base = chunk_row(a, g, i) * nu;
        for (int64_t kk = 0; kk < nu; kk++) put_idx(a, base + kk, ch[kk]);
    }
    if (a->out) {
        float *o = (float *)a->out + ooff;
        if (ok)
            gather_mean(a, vb, ch, o, a->G * a->M * a->Dv >= (1 << 20));
        else
            for (int64_t d = 0; d < a->Dv; d++) o[d] = 0.0f;
    }
}

/* Row pointers of the bias of rows t .. t + MR - 1 at key j0 (rows past nr: unused). */
static const float *const *bias_rows(const struct fused_args *a, const struct rows_at *p,
                                     int64_t j0, const float **rows) {
    if (a->bias == 0) return NULL;
    for (int64_t r = 0; r < MR; r++) rows[r] = (const float *)a->bias + p->b[r] + j0;
    return rows;
}

/*
 * One tile: rows t .. t + nr - 1 of group g. Scores by the micro-GEMM (per key block for the
 * key-blocked sampler, whose panels Kp start at each block: ppb panels per block), the bias and
 * the causal limit, then per row the sampler or the moments. Returns whether the tile's query
 * entries are finite.
 */
static int tile(const struct fused_args *a, float scale, int moments, const float *Kp,
                 int64_t ppb, const float *VV, const float *vbar, int64_t W, struct scratch *w,
                 int64_t g, int64_t t) {
    const int64_t D = a->D, Lk = a->Lk;
    const int64_t nr = a->i1 - t < MR ? a->i1 - t : MR;
    int64_t nk[MR], nkt = 0;
    int fin = 1; /* the tile's query entries finite */
    struct rows_at at;
    place_rows(a, g, t, nr, &at);
    for (int r = 0; r < MR; r++) {
        int64_t i = t + r;
        if (r < nr) {
            const float *qr = (const float *)a->q + at.q[r];
            for (int64_t d = 0; d < D; d++) {
                w->qs[r * D + d] = qr[d] * scale;
                fin &= fabsf(qr[d]) <= 3.40282347e+38f;
            }
            int64_t lim = !a->causal ? Lk : (a->clq == a->lq ? at.l[r] : i % a->clq) + 1;
            nk[r] = lim < Lk ? lim : Lk;
        } else {
            for (int64_t d = 0; d < D; d++) w->qs[r * D + d] = 0.0f;
            nk[r] = 0;
        }
        nkt = nk[r] > nkt ? nk[r] : nkt;
    }
    if (t + 2 * MR <= a->i1) { /* the next tile's query rows, while this one computes */
        struct rows_at nx;
        place_rows(a, g, t + MR, MR, &nx);
        for (int r = 0; r < MR; r++)
            for (int64_t d = 0; d < D; d += 16)
                __builtin_prefetch((const float *)a->q + nx.q[r] + d);
    }
    const float *brows[MR];
    float mx[MR];
    if (!moments && a->block > 0) { /* key-blocked sampler */
        const int64_t B = a->block;
        for (int64_t r = 0; r < nr; r++) {
            w->rmax[r] = -INFINITY;
            w->rsum[r] = 0.0f;
            for (int64_t kk = 0; kk < a->nu; kk++) w->chosen[r * a->nu + kk] = 0;
        }
        for (int64_t jb = 0, blk = 0; jb < nkt; jb += B, blk++) {
            const int64_t nkb = nkt - jb < B ? nkt - jb : B;
            int64_t lim[MR];
            for (int r = 0; r < MR; r++) {
                int64_t L = nk[r] - jb < B ? nk[r] - jb : B;
                lim[r] = L > 0 ? L : 0;
            }
            score_tile(w->qs, Kp + blk * ppb * D * NR, D, (nkb + NR - 1) / NR, w->S, w->ld,
                       bias_rows(a, &at, jb, brows), (int)a->bnat, lim, mx);
            for (int64_t r = 0; r < nr; r++)
                if (lim[r] > 0)
                    block_row(a, w, g, t + r, r, w->S + r * w->ld, lim[r], mx[r], jb, blk);
        }
        for (int64_t r = 0; r < nr; r++)
            finish_row(a, g, t + r, at.o[r], at.vb, w->rmax[r] > -INFINITY,
                       w->chosen + r * a->nu);
        return fin;
    }
    const int64_t np = (nkt + NR - 1) / NR;
    score_tile(w->qs, Kp, D, np, w->S, w->ld, bias_rows(a, &at, 0, brows), (int)a->bnat, nk,
               mx);
    if (!moments) {
        for (int64_t r = 0; r < nr; r++) {
            int ok = dense_row(a, w, g, t + r, w->S + r * w->ld, nk[r], mx[r], w->chosen);
            finish_row(a, g, t + r, at.o[r], at.vb, ok, w->chosen);
        }
        return fin;
    }
    /* moments: e in place (zero past each row's keys, up to the panels' end), row sums */
    float l[MR];
    const int64_t kend = np * NR;
    for (int64_t r = 0; r < MR; r++) {
        float *s = w->S + r * w->ld;
        float m = r < nr ? mx[r] : -INFINITY;
        if (m > -INFINITY) {
            l[r] = exp_row(s, nk[r], m, s, kend, 1);
        } else {
            l[r] = 0.0f;
            for (int64_t j = 0; j < kend; j++) s[j] = 0.0f;
        }
    }
    for (int64_t c0 = 0; c0 < W; c0 += NR) pv_tile(w->S, w->ld, nkt, VV, W, c0, w->A, W);
    const int64_t Dv = a->Dv;
    for (int64_t r = 0; r < nr; r++) {
        int64_t i = t + r;
        float *mo = (float *)a->out + at.o[r];
        float *vo = (float *)a->var + at.o[r];
        const float *ar = w->A + r * W;
        int ok = l[r] > 0.0f;
        ((uint8_t *)a->empty)[g * a->M + i] = (uint8_t)!ok;
        if (!ok) {
            for (int64_t d = 0; d < Dv; d++) mo[d] = vo[d] = 0.0f;
            continue;
        }
        float inv = 1.0f / l[r];
        for (int64_t d = 0; d < Dv; d++) {
            float mc = ar[d] * inv;
            float var = ar[Dv + d] * inv - mc * mc;
            mo[d] = mc + vbar[d];
            vo[d] = var > 0.0f ? var : 0.0f;
        }
    }
    return fin;
}

/* vbar = mean of the group's value rows; VV[j] = [vc_j, vc_j^2, 0 ...] (W columns). */
static void pack_values(const struct fused_args *a, int64_t g, int64_t W, float *VV,
                        float *vbar) {
    const float *v = (const float *)a->v + v_base(a, g);
    const int64_t Dv = a->Dv, Lk = a->Lk;
    double *acc = (double *)calloc((size_t)(Dv > 0 ? Dv : 1), sizeof(double));
    for (int64_t j = 0; j < Lk; j++) {
        const float *vr = v + j * a->v_sl;
        if (acc)
            for (int64_t d = 0; d < Dv; d++) acc[d] += vr[d];
    }
    for (int64_t d = 0; d < Dv; d++) vbar[d] = acc ? (float)(acc[d] / (double)Lk) : 0.0f;
    free(acc);
    for (int64_t j = 0; j < Lk; j++) {
        const float *vr = v + j * a->v_sl;
        float *dst = VV + j * W;
        for (int64_t d = 0; d < Dv; d++) {
            float c = vr[d] - vbar[d];
            dst[d] = c;
            dst[Dv + d] = c * c;
        }
        for (int64_t c = 2 * Dv; c < W; c++) dst[c] = 0.0f;
    }
}

/* Returns 0, or-ed with 1 when scratch could not be allocated and 2 when an entry of q or k
 * read is not finite (the caller then reports the input; the outputs are meaningless). */
static int64_t run(const struct fused_args *a, float scale, int moments) {
    const int64_t Lk = a->Lk, D = a->D;
    /* keys in blocks of Bk (the key-blocked sampler's block, else all keys), ppb panels each */
    const int64_t Bk = !moments && a->block > 0 && a->block < Lk ? a->block : Lk;
    const int64_t nblk = (Lk + Bk - 1) / Bk, ppb = (Bk + NR - 1) / NR;
    const int64_t W = moments ? (2 * a->Dv + NR - 1) / NR * NR : 0;
    /* a row of L keys pads to nb bl < L + nb(L) weights, nb(L) <= nb(Bk) */
    int64_t nbb, blb;
    layout(Bk, &nbb, &blb);
    const int64_t ld = (ppb * NR > Bk + nbb ? ppb * NR : Bk + nbb) + VW;
    int64_t err = 0;
    int64_t nth = a->nthreads;
    (void)nth;
    const int64_t ntile = (a->i1 - a->i0 + MR - 1) / MR;
    const int64_t items = (a->g1 - a->g0) * ntile; /* (group, tile) pairs, group-major */
    const int64_t nu1 = a->nu > 0 ? a->nu : 1;
    /*
     * Each thread takes one contiguous range of (group, tile) items and packs the keys (and,
     * for the moments, the values) of each group it enters into buffers of its own: no barrier
     * between threads (a thread descheduled on a loaded machine holds up no other), at the cost
     * of packing a group twice where a range boundary splits it.
     */
#pragma omp parallel num_threads(nth) if (nth > 1) reduction(| : err)
    {
        int64_t tid = 0, nt = 1;
#ifdef _OPENMP
        tid = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        const int64_t it0 = items * tid / nt, it1 = items * (tid + 1) / nt;
        struct scratch w = {0};
        w.ld = ld;
        w.qs = (float *)alloc64((size_t)(MR * (D > 0 ? D : 1)) * sizeof(float));
        w.S = (float *)alloc64((size_t)(MR * ld) * sizeof(float));
        w.cum = (float *)alloc64((size_t)(nbb + 1) * sizeof(float));
        w.A = moments ? (float *)alloc64((size_t)(MR * W) * sizeof(float)) : NULL;
        w.rmax = (float *)alloc64(MR * sizeof(float));
        w.rsum = (float *)alloc64(MR * sizeof(float));
        w.chosen = (int64_t *)malloc((size_t)(MR * nu1) * sizeof(int64_t));
        float *Kp = NULL, *VV = NULL, *vbar = NULL;
        if (it0 < it1) {
            Kp = (float *)alloc64((size_t)(nblk * ppb * D * NR) * sizeof(float));
            VV = moments ? (float *)alloc64((size_t)(Lk * W) * sizeof(float)) : NULL;
            vbar = moments ? (float *)alloc64((size_t)a->Dv * sizeof(float)) : NULL;
        }
        int mine = w.qs && w.S && w.cum && w.rmax && w.rsum && w.chosen &&
                   (!moments || w.A) && (it0 >= it1 || (Kp && (!moments || (VV && vbar))));
        if (!mine) err |= 1;
        int64_t packed = -1; /* the group whose keys Kp holds */
        for (int64_t it = it0; mine && it < it1; it++) {
            const int64_t g = a->g0 + it / ntile, tt = it % ntile;
            if (g != packed) {
                const float *kg = k_group(a, g);
                for (int64_t b = 0; b < nblk; b++) {
                    int64_t j0 = b * Bk, nkb = Lk - j0 < Bk ? Lk - j0 : Bk;
                    if (!pack_k(kg + j0 * a->k_sl, a->k_sl, nkb, D, ppb, Kp + b * ppb * D * NR))
                        err |= 2;
                }
                if (moments) pack_values(a, g, W, VV, vbar);
                packed = g;
            }
            if (!tile(a, scale, moments, Kp, ppb, VV, vbar, W, &w, g, a->i0 + tt * MR))
                err |= 2;
        }
#ifdef __AVX512F__
        _mm_sfence(); /* this thread's streamed output rows are written before it returns */
#endif
        scratch_free(&w);
        free(Kp);
        free(VV);
        free(vbar);
    }
    return err;
}

int64_t attnuq_fused_sample_f32(const int64_t *words, double scale) {
    return run((const struct fused_args *)words, (float)scale, 0);
}

int64_t attnuq_fused_moments_f32(const int64_t *words, double scale) {
    return run((const struct fused_args *)words, (float)scale, 1);
}
