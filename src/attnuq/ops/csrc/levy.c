/*
 * attnuq: fused CPU forward of Levy attention (inference: no autograd), float32 and float64.
 *
 * Compiled on first use by attnuq/ops/_native.py together with sample_rows.c and called through
 * ctypes (plain C99 plus GCC/Clang vector extensions and optional OpenMP).
 *
 * For each batch element b (batch elements are split over the OpenMP threads), head h and query
 * q, with w_qi = alpha exp(beta (cos(q, k_i) - 1)) over the observed i:
 *
 *   vbar_i = a_i + sum_k damp_k D_jk cos z_ik   (z_ik = omega_k t_i + phase_k,
 *                                                damp_k = exp(-omega_k^2 h^2 / 2))
 *   s_ij   = sum_p ws[p][j] f_p(i)              (f: the K (K + 1) pair products c_k c_l, then
 *            s_k s_l, k <= l, ordered by l - k then k; ws from D, omega and h as in
 *            attnuq.ops.levy._field, computed here per call in double)
 *   ref    = mean of vbar_i over observed i;  vc_i = vbar_i - ref
 *   sq_ij  = vc_ij^2 + s_ij (per dimension) or |vc_i|^2 + s_i (trace, one column)
 *   z_q    = sum_i 2^(S_qi - M_q),  S_qi = beta log2(e) cos(q, k_i),  M_q = max_i S_qi
 *   mu_q   = sum_i 2^(S_qi - M_q) vc_i / z_q,  m2_q likewise with sq_i
 *   mean   = mu_q + ref,  var = max(m2_q - mu_q^2, 0),  Lambda = alpha 2^(M_q - beta log2 e) z_q,
 *   phi    = phi(Lambda) (the same series and tables as attnuq.ops.phi, in double),
 *   sigma  = sqrt(tr var phi),  sigma_dim = sqrt(var phi)  (p_empty = exp(-Lambda) is left to
 *   the caller, so that it is torch.exp of the returned evidence exactly).
 *
 * Memory (scratch per thread): for the current series, the keys of every head normalised and
 * transposed (H, E, np) and one row [vc | sq] per observation and head (H, np, wp), filled in
 * one pass over the observations in memory order; per head, the scores of a tile of queries
 * (qt, np), turned into weights in place, then one pass of weights times rows. The observation
 * axis is padded to np (a multiple of 2 LANES) with excluded entries. Every sum over
 * observations runs in index order (vector lanes over consecutive observations for z, one
 * observation after the other for the weighted rows and ref), and excluded observations
 * contribute exact zeros: appending masked observations leaves every output bit-identical.
 *
 * Input check: an observed row of k or a, or a row of q, whose sum of squares is not finite
 * (NaN/inf, or overflow) sets LEVY_NONFINITE in the return code; the caller then runs its own
 * detailed checks (excluded rows are never read and may hold anything).
 *
 * float32: 2^x by the Cephes polynomial of simd.h; float64: libm exp2 per lane.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"
#ifdef _OPENMP
#include <omp.h>
#define PARALLEL_IDS(tid, nt) (tid = omp_get_thread_num(), nt = omp_get_num_threads())
#else
#define PARALLEL_IDS(tid, nt) ((void)0)
#endif

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

/* Arguments: LEVY_ARGS_WORDS 8-byte words (pointers and int64), passed from Python as one int64
 * array in this order (attnuq/ops/_native.py, levy_forward; keep in sync). */
struct levy_args {
    const void *q, *k, *a;       /* (B, H, Q, E), (B, H, N, E), (B, H, N, Dv): unit last stride */
    int64_t qs[3], ks[3], as[3]; /* element strides of b, h and the row */
    const void *ct, *st;         /* (hw, K, *) cos and sin of omega_k t + phase_k (row stride
                                    ldc); series b at columns b N .. */
    int64_t ldc, hw;             /* hw: 1 (frequencies shared by the heads) or H */
    const uint8_t *mask;         /* (B, N) 1 = observed */
    int64_t dims[8];             /* B, H, Q, N, E, Dv, K, per_dim */
    const void *alpha, *beta, *h; /* (H,) */
    const void *omega, *D;       /* (hw, K) frequencies, (H, Dv, K) loadings (contiguous) */
    const double *phi_tab;       /* PHI_TAB_LEN numbers, see phi_eval */
    void *mean, *var, *sigma_dim; /* (B, H, Q, Dv) at strides os (unit last); var, sigma_dim
                                     NULL when per_dim = 0 */
    void *evidence, *phi, *sigma; /* (B, H, Q) at strides ss */
    int64_t os[3], ss[3];
};

#define LEVY_ARGS_WORDS 43
_Static_assert(sizeof(struct levy_args) == LEVY_ARGS_WORDS * sizeof(int64_t),
               "struct levy_args must be LEVY_ARGS_WORDS 8-byte words");

int64_t attnuq_levy_args_words(void) { return LEVY_ARGS_WORDS; }

/* return codes (or-ed over the threads) */
#define LEVY_NOMEM 1
#define LEVY_NONFINITE 2

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
static inline int64_t round_down(int64_t x, int64_t m) { return x / m * m; }

/* phi(L) = E[1/N | N >= 1], N ~ Poisson(L), by the branches of attnuq/ops/phi.py with its
 * tables: tab[0 .. 24) Taylor coefficients about 0 (L <= 1); then 12 dyadic pieces [2^j, 2^j+1]
 * of 21 monomial coefficients in t = (2 L - 3 lo) / lo (1 < L <= 4096); then 0!, ..., 8! (the
 * asymptotic series, L > 4096). */
#define PHI_TAYLOR 24
#define PHI_PIECES 12
#define PHI_DEG1 21
#define PHI_NFACT 9
#define PHI_TAB_LEN (PHI_TAYLOR + PHI_PIECES * PHI_DEG1 + PHI_NFACT)

int64_t attnuq_phi_tab_len(void) { return PHI_TAB_LEN; }

/* 2^e as a double for an integer -1022 <= e <= 1023 (exact). */
static inline double pow2i(int64_t e) {
    uint64_t bits = (uint64_t)(e + 1023) << 52;
    double d;
    memcpy(&d, &bits, sizeof d);
    return d;
}

/* floor(log2 x) for a normal double x > 0 (its exponent field). */
static inline int64_t ilog2(double x) {
    uint64_t bits;
    memcpy(&bits, &x, sizeof bits);
    return (int64_t)((bits >> 52) & 0x7ff) - 1023;
}

static double phi_eval(double x, const double *tab) {
    if (x <= 1.0) {
        double p = tab[PHI_TAYLOR - 1];
        for (int j = PHI_TAYLOR - 2; j >= 0; j--) p = p * x + tab[j];
        return p;
    }
    if (x <= 4096.0) {
        int64_t piece = ilog2(x); /* x in [2^piece, 2^(piece + 1)) */
        piece = piece > PHI_PIECES - 1 ? PHI_PIECES - 1 : piece;
        const double lo = pow2i(piece);
        double t = (2.0 * x - 3.0 * lo) / lo;
        t = t < -1.0 ? -1.0 : (t > 1.0 ? 1.0 : t);
        const double *c = tab + PHI_TAYLOR + piece * PHI_DEG1;
        double p = c[PHI_DEG1 - 1];
        for (int j = PHI_DEG1 - 2; j >= 0; j--) p = p * t + c[j];
        return p;
    }
    const double *fact = tab + PHI_TAYLOR + PHI_PIECES * PHI_DEG1;
    double u = 1.0 / x, f = fact[PHI_NFACT - 1];
    for (int j = PHI_NFACT - 2; j >= 0; j--) f = f * u + fact[j];
    f *= u;
    double em = exp(-x), log_term = log(x) + 0.57721566490153286060651209008240243;
    return (f - em * log_term) / -expm1(-x);
}

/* phi at x[0..4): when all four lie in the Chebyshev range (the usual case) the four Horner
 * recurrences run interleaved, so that their latencies overlap; the same operations as
 * phi_eval, so the same values. */
static void phi_eval4(const double *x, const double *tab, double *out) {
    int cheb = 1;
    for (int l = 0; l < 4; l++) cheb &= x[l] > 1.0 && x[l] <= 4096.0;
    if (!cheb) {
        for (int l = 0; l < 4; l++) out[l] = phi_eval(x[l], tab);
        return;
    }
    const double *c[4];
    double t[4], p[4];
    for (int l = 0; l < 4; l++) {
        int64_t piece = ilog2(x[l]);
        piece = piece > PHI_PIECES - 1 ? PHI_PIECES - 1 : piece;
        const double lo = pow2i(piece);
        t[l] = (2.0 * x[l] - 3.0 * lo) / lo;
        t[l] = t[l] < -1.0 ? -1.0 : (t[l] > 1.0 ? 1.0 : t[l]);
        c[l] = tab + PHI_TAYLOR + piece * PHI_DEG1;
        p[l] = c[l][PHI_DEG1 - 1];
    }
    for (int j = PHI_DEG1 - 2; j >= 0; j--)
        for (int l = 0; l < 4; l++) p[l] = p[l] * t[l] + c[l][j];
    for (int l = 0; l < 4; l++) out[l] = p[l];
}

/* phi at n points (for tests of the kernel's phi against attnuq.ops.poisson_phi). */
void attnuq_phi_f64(const double *x, int64_t n, const double *tab, double *out) {
    for (int64_t i = 0; i < n; i++) out[i] = phi_eval(x[i], tab);
}

#define T float
#define VT v8f
#define LANES 8
#define LD ld8
#define ST st8
#define SPLAT splat8
#define VMAX max8
#define SQRT sqrtf
#define EXP2V exp2_nonpos8
#define SFX f32
#include "levy_impl.h"
#undef T
#undef VT
#undef LANES
#undef LD
#undef ST
#undef SPLAT
#undef VMAX
#undef SQRT
#undef EXP2V
#undef SFX

#define T double
#define VT v4d
#define LANES 4
#define LD ld4d
#define ST st4d
#define SPLAT splat4d
#define VMAX max4d
#define SQRT sqrt
#define EXP2V exp2_nonpos4d
#define SFX f64
#include "levy_impl.h"
