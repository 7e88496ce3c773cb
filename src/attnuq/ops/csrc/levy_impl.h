/*
 * attnuq: the fused Levy-attention forward, one precision (a template: levy.c includes this file
 * once per precision with these macros defined).
 *
 *   T          scalar type (float or double)
 *   VT         its 32-byte vector type, LANES lanes
 *   LD, ST     unaligned vector load / store
 *   SPLAT      scalar -> vector
 *   VMAX       lane-wise maximum
 *   SQRT       scalar square root
 *   EXP2V      lane-wise 2^x for x <= 0 (x may be -inf; gives exactly 0 there)
 *   SFX        name suffix (f32 / f64)
 *
 * See levy.c for the math and the memory layout.
 */

#define FN(name) CAT(name, SFX)

/* The sum of the lanes of x, pairwise (a fixed order, log2(LANES) dependent adds). */
static inline T FN(hsum)(VT x) {
    T t[LANES];
    memcpy(t, &x, sizeof t);
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) t[l] += t[l + w];
    return t[0];
}

/* sum_e x[e]^2 with LANES partial sums (a fixed order; a sequential sum is a chain of E
 * dependent adds). */
static inline T FN(sumsq)(const T *x, int64_t E) {
    VT acc = SPLAT(0);
    int64_t e = 0;
    for (; e + LANES <= E; e += LANES) {
        VT v = LD(x + e);
        acc += v * v;
    }
    T ss = FN(hsum)(acc);
    for (; e < E; e++) ss += x[e] * x[e];
    return ss;
}

/* out[i][c0 + 0 .. nv LANES) of four rows i..i+3 (+)= sum_p W[p][c0 ..] F[p][i]. */
static inline __attribute__((always_inline)) void FN(rowgemm4)(
    const T *F, int64_t ldf, int64_t i, int64_t P, const T *W, int64_t ldw, int64_t c0,
    T *out, int64_t ldo, int acc, const int nv) {
    VT a[4][2];
    for (int r = 0; r < 4; r++)
        for (int t = 0; t < nv; t++)
            a[r][t] = acc ? LD(out + (i + r) * ldo + c0 + t * LANES) : SPLAT(0);
    for (int64_t p = 0; p < P; p++) {
        const T *w = W + p * ldw + c0;
        const T *f = F + p * ldf + i;
        VT w0 = LD(w), w1 = nv > 1 ? LD(w + LANES) : SPLAT(0);
        for (int r = 0; r < 4; r++) {
            VT fr = SPLAT(f[r]);
            a[r][0] += fr * w0;
            if (nv > 1) a[r][1] += fr * w1;
        }
    }
    for (int r = 0; r < 4; r++)
        for (int t = 0; t < nv; t++) ST(out + (i + r) * ldo + c0 + t * LANES, a[r][t]);
}

/*
 * out[i][0 .. ncol) (+)= sum_p W[p][0 .. ncol) F[p][i] for i in [0, np): F (P, np) with row
 * stride ldf, W (P, ncol) with row stride ldw, out rows of stride ldo; np a multiple of 4,
 * ncol of LANES. acc = 0 overwrites out, 1 adds to it.
 */
static void FN(rowgemm)(const T *F, int64_t ldf, int64_t np, int64_t P, const T *W, int64_t ldw,
                        int64_t ncol, T *out, int64_t ldo, int acc) {
    for (int64_t c0 = 0; c0 < ncol; c0 += 2 * LANES) {
        int two = c0 + 2 * LANES <= ncol;
        for (int64_t i = 0; i < np; i += 4) {
            if (two)
                FN(rowgemm4)(F, ldf, i, P, W, ldw, c0, out, ldo, acc, 2);
            else
                FN(rowgemm4)(F, ldf, i, P, W, ldw, c0, out, ldo, acc, 1);
        }
    }
}

/*
 * S[r][i] = sum_e qs[r][e] kt[e][i] + bias[i] for rows r in [0, nr) (nr a multiple of 4) and
 * keys i in [0, np) (np a multiple of 2 LANES); mx[r] = max_i S[r][i].
 */
static void FN(scores)(const T *qs, int64_t E, int64_t nr, const T *kt, const T *bias,
                       int64_t np, T *S, T *mx) {
    for (int64_t r = 0; r < nr; r += 4) {
        const T *q0 = qs + r * E;
        VT m[4];
        for (int u = 0; u < 4; u++) m[u] = SPLAT(-INFINITY);
        for (int64_t i = 0; i < np; i += 2 * LANES) {
            VT c[4][2];
            for (int u = 0; u < 4; u++) c[u][0] = c[u][1] = SPLAT(0);
            for (int64_t e = 0; e < E; e++) {
                VT k0 = LD(kt + e * np + i), k1 = LD(kt + e * np + i + LANES);
                for (int u = 0; u < 4; u++) {
                    VT qv = SPLAT(q0[u * E + e]);
                    c[u][0] += qv * k0;
                    c[u][1] += qv * k1;
                }
            }
            VT b0 = LD(bias + i), b1 = LD(bias + i + LANES);
            for (int u = 0; u < 4; u++) {
                VT s0 = c[u][0] + b0, s1 = c[u][1] + b1;
                m[u] = VMAX(m[u], VMAX(s0, s1));
                ST(S + (r + u) * np + i, s0);
                ST(S + (r + u) * np + i + LANES, s1);
            }
        }
        for (int u = 0; u < 4; u++) {
            T mu = -INFINITY;
            for (int l = 0; l < LANES; l++) mu = m[u][l] > mu ? m[u][l] : mu;
            mx[r + u] = mu;
        }
    }
}

/* In place: s[0 .. np) -> 2^(s - m) given the row maximum m (-inf: every key excluded, s is then
 * set to 0); returns the sum of the weights (lane sums in a fixed order). */
static T FN(softmax_row)(T *s, int64_t np, T m) {
    if (!(m > -INFINITY)) {
        memset(s, 0, (size_t)np * sizeof(T));
        return 0;
    }
    VT mb = SPLAT(m), zv = SPLAT(0);
    for (int64_t i = 0; i < np; i += LANES) {
        VT e = EXP2V(LD(s + i) - mb);
        ST(s + i, e);
        zv += e;
    }
    return FN(hsum)(zv);
}

/* O[r][c0 .. c0 + nv LANES) (+)= sum_{i in [i0, i1)} e[r][i] v[i][c0 ..] for rows r, r + 1
 * (acc = 0 starts from zero). */
static inline __attribute__((always_inline)) void FN(pv2)(const T *e0, const T *e1,
                                                          const T *v, int64_t i0, int64_t i1,
                                                          int64_t wp, int64_t c0, T *o0, T *o1,
                                                          int acc, const int nv) {
    VT a0[4], a1[4];
    for (int t = 0; t < nv; t++) {
        a0[t] = acc ? LD(o0 + c0 + t * LANES) : SPLAT(0);
        a1[t] = acc ? LD(o1 + c0 + t * LANES) : SPLAT(0);
    }
    for (int64_t i = i0; i < i1; i++) {
        const T *vi = v + i * wp + c0;
        VT x0 = SPLAT(e0[i]), x1 = SPLAT(e1[i]);
        for (int t = 0; t < nv; t++) {
            VT vv = LD(vi + t * LANES);
            a0[t] += x0 * vv;
            a1[t] += x1 * vv;
        }
    }
    for (int t = 0; t < nv; t++) {
        ST(o0 + c0 + t * LANES, a0[t]);
        ST(o1 + c0 + t * LANES, a1[t]);
    }
}

#define PV_BLOCK 64 /* observations whose value rows stay in L1 while every row pair uses them */

/*
 * O[r][0 .. wp) = sum_i e[r][i] v[i][0 .. wp) for rows r in [0, nr) (nr even). The observations
 * run in blocks of PV_BLOCK for all rows before the next block; each output still sums its terms
 * in index order on one accumulator, so the blocking changes no bit.
 */
static void FN(pv)(const T *e, int64_t nr, int64_t np, const T *v, int64_t wp, T *O) {
    for (int64_t i0 = 0; i0 < np; i0 += PV_BLOCK) {
        const int64_t i1 = i0 + PV_BLOCK < np ? i0 + PV_BLOCK : np;
        const int acc = i0 > 0;
        for (int64_t r = 0; r < nr; r += 2) {
            const T *e0 = e + r * np, *e1 = e0 + np;
            T *o0 = O + r * wp, *o1 = o0 + wp;
            for (int64_t c0 = 0; c0 < wp; c0 += 4 * LANES) {
                switch ((wp - c0) / LANES) {
                case 1: FN(pv2)(e0, e1, v, i0, i1, wp, c0, o0, o1, acc, 1); break;
                case 2: FN(pv2)(e0, e1, v, i0, i1, wp, c0, o0, o1, acc, 2); break;
                case 3: FN(pv2)(e0, e1, v, i0, i1, wp, c0, o0, o1, acc, 3); break;
                default: FN(pv2)(e0, e1, v, i0, i1, wp, c0, o0, o1, acc, 4); break;
                }
            }
        }
    }
}

/*
 * Head h of series b, whose no observed entries come first (in their order) in the np rows of
 * the per-observation arrays: value field, centring, second moments, then the queries in tiles
 * of qt rows (scores, weights, weighted rows, outputs). v (np, wp) holds a_i in its first Dv
 * columns on entry (0 past row no).
 */
static void FN(head)(const struct levy_args *A, int64_t b, int64_t h, int64_t no, int64_t np,
                     int64_t qt,
                     const T *cs, const T *f, const T *wm, const T *ws, const T *kt, T *v,
                     const T *bias, T inv_cnt, T *ref, T *qs, T *S, T *O, T *mx, T *zz,
                     double *lam, double *phv, int64_t *status) {
    const int64_t Q = A->dims[2];
    const int64_t E = A->dims[4], Dv = A->dims[5], K = A->dims[6], per_dim = A->dims[7];
    const int64_t dvp = round_up(Dv, LANES), dwp = per_dim ? dvp : LANES;
    const int64_t wp = dvp + dwp, P2 = K * (K + 1);
    const T *q = (const T *)A->q;
    const T alpha = ((const T *)A->alpha)[h];
    const T bl2 = ((const T *)A->beta)[h] * (T)1.4426950408889634; /* beta log2 e */
    T *mean = (T *)A->mean, *var = (T *)A->var, *evid = (T *)A->evidence;
    T *phi = (T *)A->phi, *sig = (T *)A->sigma, *sdim = (T *)A->sigma_dim;
    const int64_t *os = A->os, *ss3 = A->ss;

    /* vbar = a + sum_k wm[k] cos z_k (the mean of the value field) */
    if (K > 0) FN(rowgemm)(cs, np, np, K, wm, dvp, dvp, v, wp, 1);
    /* ref: plain mean of vbar over observed entries */
    for (int64_t j = 0; j < dvp; j++) ref[j] = 0;
    for (int64_t i = 0; i < no; i++)
        for (int64_t j = 0; j < dvp; j++) ref[j] += v[i * wp + j];
    for (int64_t j = 0; j < dvp; j++) ref[j] *= inv_cnt;
    /* within-atom variance of the value field into the second-moment columns */
    if (K > 0) FN(rowgemm)(f, np, np, P2, ws, dwp, dwp, v + dvp, wp, 0);
    /* centre; second moment vc^2 + s (per dimension) or |vc|^2 + s (trace) */
    for (int64_t i = 0; i < np; i++) {
        T *restrict vi = v + i * wp;
        T *restrict si = vi + dvp;
        if (i >= no) {
            memset(vi, 0, (size_t)wp * sizeof(T));
            continue;
        }
        if (K == 0)
            for (int64_t j = 0; j < dwp; j++) si[j] = 0;
        for (int64_t j = 0; j < dvp; j++) vi[j] -= ref[j];
        if (per_dim) {
            for (int64_t j = 0; j < dvp; j++) si[j] += vi[j] * vi[j];
        } else {
            si[0] += FN(sumsq)(vi, dvp);
        }
    }
    /* queries in tiles of qt rows */
    const T *qb = q + b * A->qs[0] + h * A->qs[1];
    for (int64_t q0 = 0; q0 < Q; q0 += qt) {
        const int64_t nr = Q - q0 < qt ? Q - q0 : qt;
        const int64_t nr4 = round_up(nr, 4);
        for (int64_t rr = 0; rr < nr4; rr++) {
            T *qd = qs + rr * E;
            if (rr >= nr) {
                for (int64_t e = 0; e < E; e++) qd[e] = 0;
                continue;
            }
            const T *qr = qb + (q0 + rr) * A->qs[2];
            if (q0 + rr + 8 < Q) __builtin_prefetch(qb + (q0 + rr + 8) * A->qs[2]);
            const T ssq = FN(sumsq)(qr, E);
            if (!isfinite(ssq)) *status |= LEVY_NONFINITE;
            const T nrm = SQRT(ssq);
            const T sc = bl2 / (nrm > (T)1e-12 ? nrm : (T)1e-12);
            for (int64_t e = 0; e < E; e++) qd[e] = qr[e] * sc;
        }
        FN(scores)(qs, E, nr4, kt, bias, np, S, mx);
        for (int64_t rr = 0; rr < nr4; rr++) zz[rr] = FN(softmax_row)(S + rr * np, np, mx[rr]);
        FN(pv)(S, nr4, np, v, wp, O);
        /* Lambda = alpha sum_i e^{beta (cos_i - 1)} = alpha 2^(max - beta log2 e) z, then phi
         * for four rows at a time (independent evaluations overlap) */
        for (int64_t rr = 0; rr < nr4; rr++)
            lam[rr] = mx[rr] > -INFINITY
                          ? (double)alpha * exp2((double)mx[rr] - (double)bl2) * (double)zz[rr]
                          : 0.0;
        for (int64_t rr = 0; rr < nr4; rr += 4) phi_eval4(lam + rr, A->phi_tab, phv + rr);
        for (int64_t rr = 0; rr < nr; rr++) {
            const int64_t qi = q0 + rr;
            const T *orow = O + rr * wp;
            T *mo = mean + b * os[0] + h * os[1] + qi * os[2];
            const int64_t o = b * ss3[0] + h * ss3[1] + qi * ss3[2];
            const int empty = !(mx[rr] > -INFINITY); /* no observation: the documented convention */
            const T iz = empty ? (T)0 : (T)1 / zz[rr], ph = empty ? (T)1 : (T)phv[rr];
            for (int64_t j = 0; j < Dv; j++) mo[j] = empty ? (T)0 : orow[j] * iz + ref[j];
            T tr;
            if (per_dim) {
                T *restrict vo = var + b * os[0] + h * os[1] + qi * os[2];
                T *restrict so = sdim + b * os[0] + h * os[1] + qi * os[2];
                tr = 0;
                for (int64_t j = 0; j < Dv; j++) {
                    T mu = orow[j] * iz;
                    T vj = orow[dvp + j] * iz - mu * mu;
                    vj = vj > 0 ? vj : 0;
                    vo[j] = vj;
                    so[j] = SQRT(vj * ph);
                    tr += vj;
                }
            } else {
                T musq = 0;
                for (int64_t j = 0; j < Dv; j++) musq += (orow[j] * iz) * (orow[j] * iz);
                tr = orow[dvp] * iz - musq;
                tr = tr > 0 ? tr : 0;
            }
            evid[o] = (T)lam[rr];
            phi[o] = ph;
            sig[o] = SQRT(tr * ph);
        }
    }
}

/*
 * Time features of series b for frequency row `row` (0 when the heads share them): cs (2K, nb) the
 * cosines then sines of omega_k t_i + phase_k at the no observed entries idx (in order; rows
 * past no are 0) and f (K (K + 1), nb) the pair products c_k c_l, then s_k s_l, k <= l, ordered
 * by l - k then k (as attnuq.ops.levy._pair_index).
 */
static void FN(features)(const struct levy_args *A, int64_t b, int64_t row, const int64_t *idx,
                         int64_t no, int64_t nb, T *cs, T *f) {
    const int64_t N = A->dims[3], K = A->dims[6], Pk = K * (K + 1) / 2;
    const T *ct = (const T *)A->ct, *st = (const T *)A->st;
    for (int64_t kk = 0; kk < K; kk++) {
        const int64_t at = (row * K + kk) * A->ldc + b * N;
        const T *cb = ct + at, *sb = st + at;
        T *c = cs + kk * nb, *s = cs + (K + kk) * nb;
        for (int64_t i = 0; i < no; i++) {
            c[i] = cb[idx[i]];
            s[i] = sb[idx[i]];
        }
        for (int64_t i = no; i < nb; i++) c[i] = s[i] = 0;
    }
    int64_t p = 0;
    for (int64_t d = 0; d < K; d++)
        for (int64_t kk = 0; kk + d < K; kk++, p++) {
            const T *c0 = cs + kk * nb, *c1 = cs + (kk + d) * nb;
            const T *s0 = cs + (K + kk) * nb, *s1 = cs + (K + kk + d) * nb;
            T *fc = f + p * nb, *fs = f + (Pk + p) * nb;
            for (int64_t i = 0; i < nb; i++) {
                fc[i] = c0[i] * c1[i];
                fs[i] = s0[i] * s1[i];
            }
        }
}

/*
 * Field weights of head h (double arithmetic): wm (K, dvp) the mean loadings damp_k D_jk and ws
 * (K (K + 1), dwp) the within-atom variance weights on the pair products, zero padded:
 *   per dimension  ws[p][j] = mult_kl D_jk D_jl M_kl,   trace  ws[p][0] = sum_j of that,
 * with M = M1 (cos pairs) or M2 (sin pairs) of attnuq.ops.levy._gcov_pairs and mult 1 on the
 * diagonal, 2 off it.
 */
static void FN(field_weights)(const struct levy_args *A, int64_t h, T *wm, T *ws) {
    const int64_t Dv = A->dims[5], K = A->dims[6], per_dim = A->dims[7];
    const int64_t dvp = round_up(Dv, LANES), dwp = per_dim ? dvp : LANES;
    const int64_t Pk = K * (K + 1) / 2;
    const T *om = (const T *)A->omega + (A->hw > 1 ? h * K : 0);
    const T *Dm = (const T *)A->D + h * Dv * K;
    const double hh = (double)((const T *)A->h)[h], h2 = hh * hh;
    memset(wm, 0, (size_t)(K * dvp) * sizeof(T));
    memset(ws, 0, (size_t)(2 * Pk * dwp) * sizeof(T));
    for (int64_t kk = 0; kk < K; kk++) {
        double damp = exp(-(double)om[kk] * (double)om[kk] * h2 / 2);
        for (int64_t j = 0; j < Dv; j++) wm[kk * dvp + j] = (T)(damp * (double)Dm[j * K + kk]);
    }
    int64_t p = 0;
    for (int64_t d = 0; d < K; d++)
        for (int64_t kk = 0; kk + d < K; kk++, p++) {
            const int64_t ll = kk + d;
            const double wk = om[kk], wl = om[ll], u = wk * wl * h2;
            const double e = exp(-(wk * wk + wl * wl) * h2 / 2);
            double m1, m2;
            if (fabs(u) < 1) { /* no cancellation: cosh u - 1 = 2 sinh^2(u / 2) */
                double sh = sinh(u / 2);
                m1 = e * 2 * sh * sh;
                m2 = e * sinh(u);
            } else { /* e cosh u, e sinh u without overflow */
                double em = exp(-(wk - wl) * (wk - wl) * h2 / 2);
                double ep = exp(-(wk + wl) * (wk + wl) * h2 / 2);
                m1 = (em + ep) / 2 - e;
                m2 = (em - ep) / 2;
            }
            const double mult = d == 0 ? 1.0 : 2.0;
            double t1 = 0, t2 = 0;
            for (int64_t j = 0; j < Dv; j++) {
                double dd = mult * (double)Dm[j * K + kk] * (double)Dm[j * K + ll];
                if (per_dim) {
                    ws[p * dwp + j] = (T)(dd * m1);
                    ws[(Pk + p) * dwp + j] = (T)(dd * m2);
                } else {
                    t1 += dd * m1;
                    t2 += dd * m2;
                }
            }
            if (!per_dim) {
                ws[p * dwp] = (T)t1;
                ws[(Pk + p) * dwp] = (T)t2;
            }
        }
}

/*
 * Batch elements [b0, b1), every head: see levy.c for the arguments. Returns 0, LEVY_NOMEM when
 * the scratch could not be allocated, LEVY_NONFINITE when an observed row of k or a, or a row
 * of q, holds NaN/inf (or its squares overflow).
 */
static int64_t FN(levy_batches)(const struct levy_args *A, int64_t b0, int64_t b1) {
    const int64_t H = A->dims[1], N = A->dims[3];
    const int64_t E = A->dims[4], Dv = A->dims[5], K = A->dims[6], per_dim = A->dims[7];
    const int64_t np = round_up(N > 0 ? N : 1, 2 * LANES); /* capacity of the rows */
    const int64_t dvp = round_up(Dv, LANES), dwp = per_dim ? dvp : LANES;
    const int64_t wp = dvp + dwp, P2 = K * (K + 1);
    int64_t qt = round_down(16384 / np, 4);
    qt = qt < 4 ? 4 : (qt > 32 ? 32 : qt);
    const T *k = (const T *)A->k, *a = (const T *)A->a;
    int64_t status = 0;

    size_t n_scratch = (size_t)(H * K * dvp + H * P2 * dwp + 2 * K * np + P2 * np + H * E * np +
                                H * np * wp + np + dvp + qt * E + qt * np + qt * wp + 2 * qt);
    T *buf = (T *)malloc(n_scratch * sizeof(T));
    int64_t *idx = (int64_t *)malloc((size_t)(N > 0 ? N : 1) * sizeof(int64_t));
    double *lam = (double *)malloc((size_t)(2 * qt) * sizeof(double)), *phv = lam + qt;
    if (buf == NULL || idx == NULL || lam == NULL) {
        free(buf);
        free(idx);
        free(lam);
        return LEVY_NOMEM;
    }
    T *wm_all = buf;                   /* (H, K, dvp) mean loadings */
    T *ws_all = wm_all + H * K * dvp;  /* (H, 2P, dwp) within-atom variance weights */
    T *cs = ws_all + H * P2 * dwp;     /* (2K, np): cos then sin of omega_k t_i + phase_k */
    T *f = cs + 2 * K * np;            /* (2P, np): pair products c_k c_l, then s_k s_l */
    T *kt_all = f + P2 * np;           /* (H, E, np): normalised keys, transposed */
    T *v_all = kt_all + H * E * np;    /* (H, np, wp): [vbar - ref | second moment] rows */
    T *bias = v_all + H * np * wp;     /* (np,): 0 observed, -inf otherwise */
    T *ref = bias + np;                /* (dvp,) */
    T *qs = ref + dvp;                 /* (qt, E): scaled normalised queries */
    T *S = qs + qt * E;                /* (qt, np): scores, then weights */
    T *O = S + qt * np;                /* (qt, wp): weighted sums */
    T *mx = O + qt * wp;               /* (qt,): row maxima */
    T *zz = mx + qt;                   /* (qt,): row sums */
    if (K > 0)
        for (int64_t h = 0; h < H; h++)
            FN(field_weights)(A, h, wm_all + h * K * dvp, ws_all + h * P2 * dwp);

    for (int64_t b = b0; b < b1; b++) {
        /* the observed entries, in order, come first in every per-observation array */
        const uint8_t *mk = A->mask + b * N;
        int64_t no = 0;
        for (int64_t i = 0; i < N; i++)
            if (mk[i]) idx[no++] = i;
        const int64_t nb = round_up(no > 0 ? no : 1, 2 * LANES); /* rows in use */
        if (K > 0 && A->hw == 1) FN(features)(A, b, 0, idx, no, nb, cs, f);
        for (int64_t i = 0; i < nb; i++) bias[i] = i < no ? (T)0 : (T)-INFINITY;
        const T inv_cnt = (T)1 / (T)(no > 0 ? no : 1);
        /* Keys k / max(|k|, 1e-12) (F.normalize), transposed, and the value rows a_i, every head
         * per observation: in the (B, N, H, E) layout of the module's projections that reads
         * memory in order. Rows past no are 0. */
        const T *kb = k + b * A->ks[0], *ab = a + b * A->as[0];
        VT afin = SPLAT(0); /* squares of the observed a, summed: finite iff all are */
        T afin_s = 0;
        for (int64_t i = 0; i < nb; i++) {
            const int64_t src = i < no ? idx[i] : -1;
            if (i + 4 < no) /* the rows four observations ahead, every head */
                for (int64_t h = 0; h < H; h++) {
                    __builtin_prefetch(kb + h * A->ks[1] + idx[i + 4] * A->ks[2]);
                    __builtin_prefetch(ab + h * A->as[1] + idx[i + 4] * A->as[2]);
                }
            for (int64_t h = 0; h < H; h++) {
                T *kt = kt_all + h * E * nb;
                T *vi = v_all + (h * nb + i) * wp;
                int64_t j = 0;
                if (src >= 0) {
                    const T *kr = kb + h * A->ks[1] + src * A->ks[2];
                    const T *ai = ab + h * A->as[1] + src * A->as[2];
                    const T ssq = FN(sumsq)(kr, E);
                    if (!isfinite(ssq)) status |= LEVY_NONFINITE;
                    const T nrm = SQRT(ssq);
                    const T inv = (T)1 / (nrm > (T)1e-12 ? nrm : (T)1e-12);
                    for (int64_t e = 0; e < E; e++) kt[e * nb + i] = kr[e] * inv;
                    /* vector copies: a plain loop here would become a memcpy call */
                    for (; j + LANES <= Dv; j += LANES) {
                        VT x = LD(ai + j);
                        ST(vi + j, x);
                        afin += x * x;
                    }
                    for (; j < Dv; j++) {
                        vi[j] = ai[j];
                        afin_s += ai[j] * ai[j];
                    }
                } else {
                    for (int64_t e = 0; e < E; e++) kt[e * nb + i] = 0;
                }
                for (; j < dvp; j++) vi[j] = 0;
            }
        }
        if (!isfinite(FN(hsum)(afin) + afin_s)) status |= LEVY_NONFINITE;
        for (int64_t h = 0; h < H; h++) {
            const T *kt = kt_all + h * E * nb;
            T *v = v_all + h * nb * wp;
            if (K > 0 && A->hw > 1) FN(features)(A, b, h, idx, no, nb, cs, f);
            FN(head)(A, b, h, no, nb, qt, cs, f, wm_all + h * K * dvp, ws_all + h * P2 * dwp, kt,
                     v, bias, inv_cnt, ref, qs, S, O, mx, zz, lam, phv, &status);
        }
    }
    free(buf);
    free(idx);
    free(lam);
    return status;
}

int64_t CAT(attnuq_levy_, SFX)(const int64_t *raw, int64_t b0, int64_t b1, int64_t nthreads) {
    struct levy_args args;
    const struct levy_args *A = &args;
    memcpy(&args, raw, sizeof args);
    int64_t err = 0;
    (void)nthreads;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1) reduction(| : err)
    {
        int64_t tid = 0, nt = 1;
        PARALLEL_IDS(tid, nt);
        int64_t n = b1 - b0;
        err |= FN(levy_batches)(A, b0 + n * tid / nt, b0 + n * (tid + 1) / nt);
    }
    return err;
}

#undef FN
