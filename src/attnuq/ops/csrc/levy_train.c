/*
 * attnuq: elementwise passes of the Levy-attention training path (autograd on CPU), float32 and
 * float64.
 *
 * Compiled on first use by attnuq/ops/_native.py together with the other kernels and called
 * through ctypes. The attention itself (scores, softmax, weighted rows and their backward) stays
 * in torch's CPU flash-attention kernels; these loops replace the chains of torch elementwise
 * operations around them (attnuq/ops/levy.py, _FlashBlock and _SharedField), each of which was a
 * separate pass over the (B, N, H, .) observation tensors:
 *
 *   prep   (forward of _FlashBlock), per observation row (b, n, h):
 *            nrm = max(|k|, 1e-12),  kn = k / nrm,  vc = vbar - ref,
 *            sq  = vc^2 + s (per dimension) or |vc|^2 + s (trace, one column),
 *            T   = sum_j sq_j,
 *          written as one row [kn | T | 0 | vc | sq | 0 ...] of the buffer the flash kernel
 *          reads (keys: its first columns; values: from column E + 2), and nrm.
 *   post   (backward of _FlashBlock), per row, from the flash backward's key and value
 *          gradients gkn, gv:
 *            g_k  = (gkn - [nrm > 1e-12] kn (kn . gkn)) / nrm       (F.normalize's backward)
 *            g_vc = gv_vc + 2 vc * g_sq,  g_ref[b, h] = -sum_n g_vc   (index order)
 *          (g_sq one column, broadcast, when the backward ran on the trace only).
 *   rows   (backward of _FlashBlock): the gradient / output rows [g | 1] and [out | -g_lse] the
 *          flash backward is handed (see _FlashBlock.backward), in (B, Q, H, dp) memory, and the
 *          test whether the incoming gradient is the same on every second-moment column.
 *   pairs  (_SharedField): the pair features f = [c_k c_l, s_k s_l]_{k <= l} (by diagonal
 *          d = l - k, then k) of the time features, and the backward of that map,
 *          g_x_k += g_f(k, k + d) x_{k + d},  g_x_{k + d} += g_f(k, k + d) x_k.
 *
 * Every loop is a plain C loop that the compiler vectorises; sums run in a fixed order, so a
 * call gives the same bits for the same inputs. Arguments: one int64 array per call (pointers
 * and integers, the struct's field order; attnuq/ops/_native.py builds it; keep in sync).
 */
#include <stdint.h>
#include <string.h>
#include <math.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

struct lt_prep_args {
    const void *k;          /* (b, n, h, e) at k + b ks[0] + n ks[1] + h ks[2] + e */
    int64_t ks[3];
    const void *vbar;       /* (b, n, h, j), unit last stride */
    int64_t vs[3];
    const void *within;     /* (b, n, h, j) or NULL; last stride wsj (0: broadcast) */
    int64_t wss[4];
    const void *ref;        /* (b, h, j), unit last stride */
    int64_t rs[2];
    void *buf;              /* (B, N, H, W) contiguous */
    void *nrm;              /* (B, N, H) contiguous */
    int64_t dims[8];        /* B, N, H, E, dv, ws, W, per_dim */
};
#define LT_PREP_WORDS 26
_Static_assert(sizeof(struct lt_prep_args) == LT_PREP_WORDS * 8, "lt_prep_args words");

struct lt_post_args {
    const void *gk;         /* flash grad of the keys, (b, n, h, c) strides, unit last */
    int64_t gks[3];
    const void *gv;         /* flash grad of the values */
    int64_t gvs[3];
    const void *buf, *nrm;  /* as written by prep */
    void *g_k;              /* (B, N, H, E) contiguous */
    void *g_vc;             /* (B, N, H, dv) contiguous */
    void *g_sq;             /* (B, N, H, wsq) contiguous */
    void *g_ref;            /* (B, H, dv) contiguous (overwritten) */
    int64_t dims[10];       /* B, N, H, E, dv, wsq, W, gv column of vc, of sq, v0 */
};
#define LT_POST_WORDS 24
_Static_assert(sizeof(struct lt_post_args) == LT_POST_WORDS * 8, "lt_post_args words");

struct lt_rows_args {
    const void *g_out;      /* (b, h, q, c) strides, unit last */
    int64_t gos[3];
    const void *out;
    int64_t os[3];
    const void *g_lse;      /* (b, h, q) strides */
    int64_t gls[3];
    void *gt, *ot;          /* (B, Q, H, dp) contiguous */
    int64_t dims[7];        /* B, H, Q, dv, ws, dp, narrow */
};
#define LT_ROWS_WORDS 21
_Static_assert(sizeof(struct lt_rows_args) == LT_ROWS_WORDS * 8, "lt_rows_args words");

struct lt_q_args {
    const void *q;          /* (b, h, q, e) strides, unit last */
    int64_t qs[3];
    const void *beta;       /* (H,) */
    void *qp;               /* (B, Q, H, dp) contiguous: [beta q / |q| | 0 ...] */
    void *qnrm;             /* (B, Q, H) max(|q|, 1e-12) */
    const void *gq;         /* flash grad of the queries, (b, h, q, c) strides, unit last */
    int64_t gqs[3];
    void *g_q;              /* (B, Q, H, E) contiguous */
    void *g_beta;           /* (B, H): per batch element sum_q qn . gq */
    int64_t dims[5];        /* B, H, Q, E, dp */
};
#define LT_Q_WORDS 18
_Static_assert(sizeof(struct lt_q_args) == LT_Q_WORDS * 8, "lt_q_args words");

int64_t attnuq_levy_train_words(int64_t which) {
    return which == 0 ? LT_PREP_WORDS
           : which == 1 ? LT_POST_WORDS
           : which == 2 ? LT_ROWS_WORDS
                        : LT_Q_WORDS;
}

#define T float
#define SFX f32
#include "levy_train_impl.h"
#undef T
#undef SFX

#define T double
#define SFX f64
#include "levy_train_impl.h"
#undef T
#undef SFX

/* phi(L) = E[1/N | N >= 1] (N ~ Poisson(L)) and its derivative at n points, in double, by the
 * branches and tables of attnuq/ops/phi.py (the layout of phi_eval in levy.c): val holds the
 * Taylor coefficients about 0 (24), 12 dyadic pieces of 21 monomial coefficients, 0!, ..., 8!;
 * der the same for phi' (its 23 Taylor coefficients padded with a 0) and 0!, ..., 9!. dphi may
 * be NULL. */
#define LT_TAYLOR 24
#define LT_PIECES 12
#define LT_DEG1 21
#define LT_GAMMA 0.57721566490153286060651209008240243

static inline double lt_horner(const double *c, int m, double x) {
    double p = c[m - 1];
    for (int j = m - 2; j >= 0; j--) p = p * x + c[j];
    return p;
}

static void lt_phi1(double L, const double *val, const double *der, double *phi,
                    double *dphi) {
    {
        const int64_t i = 0;
        if (L <= 1.0) {
            phi[i] = lt_horner(val, LT_TAYLOR, L);
            if (dphi) dphi[i] = lt_horner(der, LT_TAYLOR, L);
        } else if (L <= 4096.0) {
            /* floor(log2 L) from the exponent field (L is a normal double in (1, 4096]) */
            uint64_t bits;
            memcpy(&bits, &L, sizeof bits);
            int64_t piece = (int64_t)((bits >> 52) & 0x7ff) - 1023;
            piece = piece < 0 ? 0 : (piece > LT_PIECES - 1 ? LT_PIECES - 1 : piece);
            const uint64_t lob = (uint64_t)(piece + 1023) << 52;
            double lo;
            memcpy(&lo, &lob, sizeof lo);
            double t = (2.0 * L - 3.0 * lo) / lo;
            t = t < -1.0 ? -1.0 : (t > 1.0 ? 1.0 : t);
            phi[i] = lt_horner(val + LT_TAYLOR + piece * LT_DEG1, LT_DEG1, t);
            if (dphi) dphi[i] = lt_horner(der + LT_TAYLOR + piece * LT_DEG1, LT_DEG1, t);
        } else {
            const double *fv = val + LT_TAYLOR + LT_PIECES * LT_DEG1;
            const double *fd = der + LT_TAYLOR + LT_PIECES * LT_DEG1;
            const double u = 1.0 / L;
            const double f = lt_horner(fv, 9, u) * u;
            const double em = exp(-L), log_term = log(L) + LT_GAMMA;
            const double r = f - em * log_term, one_m = -expm1(-L);
            phi[i] = r / one_m;
            if (dphi) {
                const double fprime = -lt_horner(fd + 1, 9, u) * u * u;
                const double rprime = fprime + em * log_term - em * u;
                dphi[i] = rprime / one_m - r * em / (one_m * one_m);
            }
        }
    }
}

void attnuq_lt_phi_f64(const double *x, int64_t n, const double *val, const double *der,
                       double *phi, double *dphi) {
    for (int64_t i = 0; i < n; i++) lt_phi1(x[i], val, der, phi + i, dphi ? dphi + i : NULL);
}

/* The outputs of the operator from the moments (forward) and their backward (tail):
 *   mean = mu + [z > 0] ref,  var_j = max(m2_j - mu_j^2, 0),  tr = sum_j var_j
 *   (trace only: tr = max(m2 - |mu|^2, 0)),  Lambda = alpha e^{-beta} z,  phi = phi(Lambda),
 *   p_empty = e^{-Lambda},  sigma = sqrt(tr phi),  sigma_dim = sqrt(var phi)
 * with the square roots' gradient 0 where their argument is 0 and the clamp's passed where its
 * argument is >= 0 (as torch.clamp_min). Outputs and incoming gradients are (B, Q, H, .)
 * contiguous; a NULL gradient is 0. */
struct lt_tail_args {
    const void *mom;        /* (b, h, q, [mu | m2]) strides, unit last */
    int64_t ms[3];
    const void *z;          /* (b, h, q) strides */
    int64_t zs[3];
    const void *ref;        /* (b, h, j) strides, unit last */
    int64_t rs[2];
    const void *alpha, *beta; /* (H,) */
    const double *tab_val, *tab_der;
    void *mean, *var, *sd, *ev, *pe, *phi, *sigma; /* outputs (var, sd NULL without per_dim) */
    double *dphi;           /* (B, Q, H) phi'(Lambda), written by the forward */
    const void *g_mean, *g_var, *g_sd, *g_ev, *g_pe, *g_phi, *g_sigma; /* backward inputs */
    void *g_mom;            /* (B, Q, H, dv + ws) */
    void *g_z;              /* (B, Q, H) */
    void *g_ref;            /* (B, H, dv), sums over q */
    void *g_ab;             /* (B, 2, H): sums over q of dL/dalpha, dL/dbeta */
    int64_t dims[5];        /* B, H, Q, dv, per_dim */
};
#define LT_TAIL_WORDS 39
_Static_assert(sizeof(struct lt_tail_args) == LT_TAIL_WORDS * 8, "lt_tail_args words");
int64_t attnuq_lt_tail_words(void) { return LT_TAIL_WORDS; }

#define T float
#define SFX f32
#include "levy_train_tail.h"
#undef T
#undef SFX

#define T double
#define SFX f64
#include "levy_train_tail.h"
#undef T
#undef SFX
