/*
 * attnuq: the training-path loops of levy_train.c, one precision (a template: levy_train.c
 * includes this file once per precision with T, the scalar type, and SFX, the name suffix).
 */

#define LTFN(name) CAT(name, SFX)

#ifdef _OPENMP
#define LT_PARFOR _Pragma("omp parallel for num_threads(nthreads) if(nthreads > 1) schedule(static)")
#define LT_SIMD _Pragma("omp simd")
#define LT_SIMD_SUM(x) _Pragma(LT_STR(omp simd reduction(+ : x)))
#define LT_STR(x) #x
#else
#define LT_PARFOR
#define LT_SIMD
#define LT_SIMD_SUM(x)
#endif

/* One series of prep (rows n, h of batch element b); always inlined into the callers below
 * with constant E and dv where those are common, so that the short row loops become
 * straight-line vector code (a loop of 16 with a run-time bound costs more than its work). */
static inline __attribute__((always_inline)) void LTFN(lt_prep_series_)(
    const struct lt_prep_args *a, int64_t b, const int64_t E, const int64_t dv) {
    const int64_t N = a->dims[1], H = a->dims[2];
    const int64_t ws = a->dims[5], W = a->dims[6], per_dim = a->dims[7];
    const int64_t v0 = E + 2, c = dv + ws, wj = a->wss[3];
    for (int64_t n = 0; n < N; n++) {
        for (int64_t h = 0; h < H; h++) {
            const T *restrict k = (const T *)a->k + b * a->ks[0] + n * a->ks[1] + h * a->ks[2];
            const T *restrict vb =
                (const T *)a->vbar + b * a->vs[0] + n * a->vs[1] + h * a->vs[2];
            const T *restrict rf = (const T *)a->ref + b * a->rs[0] + h * a->rs[1];
            const T *restrict wt =
                a->within ? (const T *)a->within + b * a->wss[0] + n * a->wss[1] + h * a->wss[2]
                          : NULL;
            T *restrict row = (T *)a->buf + ((b * N + n) * H + h) * W;
            T ss = 0;
            LT_SIMD_SUM(ss)
            for (int64_t e = 0; e < E; e++) ss += k[e] * k[e];
            T nr = (T)sqrt((double)ss);
            nr = nr < (T)1e-12 ? (T)1e-12 : nr;
            ((T *)a->nrm)[(b * N + n) * H + h] = nr;
            LT_SIMD
            for (int64_t e = 0; e < E; e++) row[e] = k[e] / nr;
            T *restrict vc = row + v0, *restrict sq = row + v0 + dv;
            LT_SIMD
            for (int64_t j = 0; j < dv; j++) vc[j] = vb[j] - rf[j];
            T tr = 0;
            if (per_dim) {
                if (wt && wj == 1) {
                    LT_SIMD_SUM(tr)
                    for (int64_t j = 0; j < dv; j++) {
                        sq[j] = wt[j] + vc[j] * vc[j];
                        tr += sq[j];
                    }
                } else if (wt) {
                    LT_SIMD_SUM(tr)
                    for (int64_t j = 0; j < dv; j++) {
                        sq[j] = wt[j * wj] + vc[j] * vc[j];
                        tr += sq[j];
                    }
                } else {
                    LT_SIMD_SUM(tr)
                    for (int64_t j = 0; j < dv; j++) {
                        sq[j] = vc[j] * vc[j];
                        tr += sq[j];
                    }
                }
            } else {
                LT_SIMD_SUM(tr)
                for (int64_t j = 0; j < dv; j++) tr += vc[j] * vc[j];
                if (wt) tr += wt[0];
                sq[0] = tr;
            }
            row[E] = tr;
            row[E + 1] = 0;
            for (int64_t j = v0 + c; j < W; j++) row[j] = 0;
        }
    }
}

/* the widths specialised: (E, dv) = (w, w) and (w, 1) for w = 8, 16, 32, 64 */
#define LT_WIDTHS(CALL, E, dv)                                                                  \
    if (E == 16 && dv == 16) CALL(16, 16);                                                      \
    else if (E == 32 && dv == 32) CALL(32, 32);                                                 \
    else if (E == 8 && dv == 8) CALL(8, 8);                                                     \
    else if (E == 64 && dv == 64) CALL(64, 64);                                                 \
    else if (E == 16 && dv == 1) CALL(16, 1);                                                   \
    else if (E == 32 && dv == 1) CALL(32, 1);                                                   \
    else if (E == 8 && dv == 1) CALL(8, 1);                                                     \
    else CALL(E, dv)

void LTFN(attnuq_lt_prep_)(const struct lt_prep_args *a, int64_t b0, int64_t b1,
                           int64_t nthreads) {
    const int64_t E = a->dims[3], dv = a->dims[4];
    (void)nthreads;
    LT_PARFOR
    for (int64_t b = b0; b < b1; b++) {
#define LT_CALL(e, d) LTFN(lt_prep_series_)(a, b, e, d)
        LT_WIDTHS(LT_CALL, E, dv);
#undef LT_CALL
    }
}

static inline __attribute__((always_inline)) void LTFN(lt_post_series_)(
    const struct lt_post_args *a, int64_t b, const int64_t E, const int64_t dv) {
    const int64_t N = a->dims[1], H = a->dims[2];
    const int64_t wsq = a->dims[5], W = a->dims[6], cvv = a->dims[7], csq = a->dims[8];
    const int64_t v0 = a->dims[9];
    T *gref = (T *)a->g_ref + b * H * dv;
    for (int64_t i = 0; i < H * dv; i++) gref[i] = 0;
    for (int64_t n = 0; n < N; n++) {
        for (int64_t h = 0; h < H; h++) {
            const int64_t r = (b * N + n) * H + h;
            const T *restrict gkn =
                (const T *)a->gk + b * a->gks[0] + n * a->gks[1] + h * a->gks[2];
            const T *restrict gv = (const T *)a->gv + b * a->gvs[0] + n * a->gvs[1]
                                   + h * a->gvs[2];
            const T *restrict row = (const T *)a->buf + r * W;
            const T nr = ((const T *)a->nrm)[r];
            T rad = 0;
            LT_SIMD_SUM(rad)
            for (int64_t e = 0; e < E; e++) rad += row[e] * gkn[e];
            if (!(nr > (T)1e-12)) rad = 0; /* the clamp passes no radial part */
            T *restrict gk = (T *)a->g_k + r * E;
            LT_SIMD
            for (int64_t e = 0; e < E; e++) gk[e] = (gkn[e] - row[e] * rad) / nr;
            const T *restrict vc = row + v0, *restrict gvv = gv + cvv;
            const T *restrict gsq = gv + csq;
            T *restrict gvc = (T *)a->g_vc + r * dv, *restrict gs = (T *)a->g_sq + r * wsq;
            T *restrict gr = gref + h * dv;
            if (wsq == 1) {
                const T g0 = gsq[0];
                gs[0] = g0;
                LT_SIMD
                for (int64_t j = 0; j < dv; j++) {
                    gvc[j] = gvv[j] + 2 * vc[j] * g0;
                    gr[j] -= gvc[j];
                }
            } else {
                LT_SIMD
                for (int64_t j = 0; j < dv; j++) {
                    gs[j] = gsq[j];
                    gvc[j] = gvv[j] + 2 * vc[j] * gsq[j];
                    gr[j] -= gvc[j];
                }
            }
        }
    }
}

void LTFN(attnuq_lt_post_)(const struct lt_post_args *a, int64_t b0, int64_t b1,
                           int64_t nthreads) {
    const int64_t E = a->dims[3], dv = a->dims[4];
    (void)nthreads;
    LT_PARFOR
    for (int64_t b = b0; b < b1; b++) {
#define LT_CALL(e, d) LTFN(lt_post_series_)(a, b, e, d)
        LT_WIDTHS(LT_CALL, E, dv);
#undef LT_CALL
    }
}

/* Queries: qp rows [beta_h q / max(|q|, 1e-12) | 0 ...] and the norms (forward); from the
 * flash backward's query gradient gq: g_q = beta_h (gq - [|q| > 1e-12] qn (qn . gq)) / nrm and
 * the per-series sums g_beta[b, h] = sum_q qn . gq (backward). */
void LTFN(attnuq_lt_qprep_)(const struct lt_q_args *a) {
    const int64_t B = a->dims[0], H = a->dims[1], Q = a->dims[2], E = a->dims[3];
    const int64_t dp = a->dims[4];
    const T *beta = (const T *)a->beta;
    for (int64_t b = 0; b < B; b++)
        for (int64_t q = 0; q < Q; q++)
            for (int64_t h = 0; h < H; h++) {
                const T *restrict x = (const T *)a->q + b * a->qs[0] + h * a->qs[1]
                                      + q * a->qs[2];
                T *restrict row = (T *)a->qp + ((b * Q + q) * H + h) * dp;
                T ss = 0;
                LT_SIMD_SUM(ss)
                for (int64_t e = 0; e < E; e++) ss += x[e] * x[e];
                T nr = (T)sqrt((double)ss);
                nr = nr < (T)1e-12 ? (T)1e-12 : nr;
                ((T *)a->qnrm)[(b * Q + q) * H + h] = nr;
                const T bh = beta[h];
                LT_SIMD
                for (int64_t e = 0; e < E; e++) row[e] = x[e] / nr * bh;
                for (int64_t e = E; e < dp; e++) row[e] = 0;
            }
}

void LTFN(attnuq_lt_qpost_)(const struct lt_q_args *a) {
    const int64_t B = a->dims[0], H = a->dims[1], Q = a->dims[2], E = a->dims[3];
    const int64_t dp = a->dims[4];
    const T *beta = (const T *)a->beta;
    for (int64_t b = 0; b < B; b++) {
        T *gb = (T *)a->g_beta + b * H;
        for (int64_t h = 0; h < H; h++) gb[h] = 0;
        for (int64_t q = 0; q < Q; q++)
            for (int64_t h = 0; h < H; h++) {
                const int64_t r = (b * Q + q) * H + h;
                const T *restrict g = (const T *)a->gq + b * a->gqs[0] + h * a->gqs[1]
                                      + q * a->gqs[2];
                const T *restrict row = (const T *)a->qp + r * dp;
                const T nr = ((const T *)a->qnrm)[r], bh = beta[h];
                /* qn = row / beta (beta > 0) */
                T dot = 0;
                LT_SIMD_SUM(dot)
                for (int64_t e = 0; e < E; e++) dot += row[e] * g[e];
                dot /= bh;
                gb[h] += dot;
                const T rad = nr > (T)1e-12 ? dot : 0;
                T *restrict gq = (T *)a->g_q + r * E;
                LT_SIMD
                for (int64_t e = 0; e < E; e++) gq[e] = bh * (g[e] - row[e] / bh * rad) / nr;
            }
    }
}

/* 1 when every row's incoming gradient is the same on all ws second-moment columns. */
int64_t LTFN(attnuq_lt_uniform_)(const struct lt_rows_args *a) {
    const int64_t B = a->dims[0], H = a->dims[1], Q = a->dims[2], dv = a->dims[3];
    const int64_t ws = a->dims[4];
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t q = 0; q < Q; q++) {
                const T *g = (const T *)a->g_out + b * a->gos[0] + h * a->gos[1]
                             + q * a->gos[2] + dv;
                int same = 1;
                for (int64_t j = 1; j < ws; j++) same &= g[j] == g[0];
                if (!same) return 0;
            }
    return 1;
}

void LTFN(attnuq_lt_rows_)(const struct lt_rows_args *a) {
    const int64_t B = a->dims[0], H = a->dims[1], Q = a->dims[2], dv = a->dims[3];
    const int64_t ws = a->dims[4], dp = a->dims[5], narrow = a->dims[6];
    const int64_t c = dv + ws;
    for (int64_t b = 0; b < B; b++)
        for (int64_t q = 0; q < Q; q++)
            for (int64_t h = 0; h < H; h++) {
                const T *g = (const T *)a->g_out + b * a->gos[0] + h * a->gos[1] + q * a->gos[2];
                const T *o = (const T *)a->out + b * a->os[0] + h * a->os[1] + q * a->os[2];
                const T gl = ((const T *)a->g_lse)[b * a->gls[0] + h * a->gls[1]
                                                   + q * a->gls[2]];
                T *gt = (T *)a->gt + ((b * Q + q) * H + h) * dp;
                T *ot = (T *)a->ot + ((b * Q + q) * H + h) * dp;
                for (int64_t j = 0; j < dp; j++) gt[j] = ot[j] = 0;
                if (narrow) {
                    T tr = 0;
                    for (int64_t j = dv; j < c; j++) tr += o[j];
                    gt[0] = g[dv];
                    ot[0] = tr;
                    gt[1] = 1;
                    ot[1] = -gl;
                    for (int64_t j = 0; j < dv; j++) {
                        gt[2 + j] = g[j];
                        ot[2 + j] = o[j];
                    }
                } else {
                    for (int64_t j = 0; j < c; j++) {
                        gt[j] = g[j];
                        ot[j] = o[j];
                    }
                    gt[c] = 1;
                    ot[c] = -gl;
                }
            }
}

/* feats (2P, n), P = K (K + 1) / 2: rows [c_k c_{k+d}] by d then k, then the same for s. */
void LTFN(attnuq_lt_pairs_)(const T *ct, const T *st, int64_t K, int64_t n, T *feats) {
    const int64_t CH = 512;
    for (int64_t c0 = 0; c0 < n; c0 += CH) {
        const int64_t m = n - c0 < CH ? n - c0 : CH;
        int64_t p = 0;
        for (int x = 0; x < 2; x++) {
            const T *X = x ? st : ct;
            for (int64_t d = 0; d < K; d++)
                for (int64_t k = 0; k + d < K; k++, p++) {
                    const T *u = X + k * n + c0, *v = X + (k + d) * n + c0;
                    T *f = feats + p * n + c0;
                    for (int64_t i = 0; i < m; i++) f[i] = u[i] * v[i];
                }
        }
    }
}

/* gc, gs (K, n) += the backward of attnuq_lt_pairs_ for the feature gradient gf (2P, n). */
void LTFN(attnuq_lt_pairs_grad_)(const T *gf, const T *ct, const T *st, int64_t K, int64_t n,
                                 T *gc, T *gs) {
    const int64_t CH = 512;
    for (int64_t c0 = 0; c0 < n; c0 += CH) {
        const int64_t m = n - c0 < CH ? n - c0 : CH;
        int64_t p = 0;
        for (int x = 0; x < 2; x++) {
            const T *X = x ? st : ct;
            T *G = x ? gs : gc;
            for (int64_t d = 0; d < K; d++)
                for (int64_t k = 0; k + d < K; k++, p++) {
                    const T *u = X + k * n + c0, *v = X + (k + d) * n + c0;
                    const T *g = gf + p * n + c0;
                    T *gu = G + k * n + c0, *gv = G + (k + d) * n + c0;
                    if (d == 0) {
                        for (int64_t i = 0; i < m; i++) gu[i] += 2 * g[i] * u[i];
                    } else {
                        for (int64_t i = 0; i < m; i++) {
                            gu[i] += g[i] * v[i];
                            gv[i] += g[i] * u[i];
                        }
                    }
                }
        }
    }
}

/* The pair backward for a feature gradient of rank H, g_f(p, i) = sum_h wsum[p][h] gT[h][i]
 * (the within gradient one column per head), formed chunk by chunk (never stored):
 * gc, gs (K, n) += as attnuq_lt_pairs_grad_; gws (2P, H) = sum_i f(p, i) gT[h][i]. */
void LTFN(attnuq_lt_pairs_grad_heads_)(const T *wsum, const T *gT, int64_t H, const T *ct,
                                       const T *st, int64_t K, int64_t n, T *gc, T *gs,
                                       T *gws) {
    enum { CH = 256 };
    T gf[CH], fv[CH];
    const int64_t P2 = K * (K + 1);
    for (int64_t i = 0; i < P2 * H; i++) gws[i] = 0;
    for (int64_t c0 = 0; c0 < n; c0 += CH) {
        const int64_t m = n - c0 < CH ? n - c0 : CH;
        int64_t p = 0;
        for (int x = 0; x < 2; x++) {
            const T *X = x ? st : ct;
            T *G = x ? gs : gc;
            for (int64_t d = 0; d < K; d++)
                for (int64_t k = 0; k + d < K; k++, p++) {
                    const T *restrict u = X + k * n + c0, *restrict v = X + (k + d) * n + c0;
                    T *restrict gu = G + k * n + c0, *restrict gv = G + (k + d) * n + c0;
                    for (int64_t i = 0; i < m; i++) {
                        gf[i] = 0;
                        fv[i] = u[i] * v[i];
                    }
                    for (int64_t h = 0; h < H; h++) {
                        const T w = wsum[p * H + h];
                        const T *restrict g = gT + h * n + c0;
                        T acc = 0;
                        LT_SIMD_SUM(acc)
                        for (int64_t i = 0; i < m; i++) {
                            gf[i] += w * g[i];
                            acc += fv[i] * g[i];
                        }
                        gws[p * H + h] += acc;
                    }
                    if (d == 0) {
                        for (int64_t i = 0; i < m; i++) gu[i] += 2 * gf[i] * u[i];
                    } else {
                        for (int64_t i = 0; i < m; i++) {
                            gu[i] += gf[i] * v[i];
                            gv[i] += gf[i] * u[i];
                        }
                    }
                }
        }
    }
}

#undef LT_PARFOR
#undef LT_WIDTHS
#undef LT_SIMD
#undef LT_SIMD_SUM
#undef LT_STR
#undef LTFN
