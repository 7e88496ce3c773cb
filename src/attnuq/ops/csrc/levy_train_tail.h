/*
 * attnuq: the outputs of the Levy operator from its moments and their backward, one precision
 * (a template: levy_train.c includes it once per precision with T and SFX defined).
 */

#define TFN(name) CAT(name, SFX)
#ifdef _OPENMP
#define LT_SIMD _Pragma("omp simd")
#define LT_SIMD_SUM(x) _Pragma(LT_STR(omp simd reduction(+ : x)))
#define LT_STR(x) #x
#else
#define LT_SIMD
#define LT_SIMD_SUM(x)
#endif
#define LT_SQRT(x) ((T)sqrt((double)(x)))

static inline __attribute__((always_inline)) void TFN(lt_tail_fwd_b_)(
    const struct lt_tail_args *a, int64_t b, const int64_t dv, const T *eb) {
    const int64_t H = a->dims[1], Q = a->dims[2], per_dim = a->dims[4];
    const T *alpha = (const T *)a->alpha;
    for (int64_t q = 0; q < Q; q++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t r = (b * Q + q) * H + h;
            const T *restrict mu = (const T *)a->mom + b * a->ms[0] + h * a->ms[1] + q * a->ms[2];
            const T *restrict m2 = mu + dv;
            const T *restrict rf = (const T *)a->ref + b * a->rs[0] + h * a->rs[1];
            const T zz = ((const T *)a->z)[b * a->zs[0] + h * a->zs[1] + q * a->zs[2]];
            const T nzf = zz > 0 ? (T)1 : (T)0;
            T *restrict mean = (T *)a->mean + r * dv;
            LT_SIMD
            for (int64_t j = 0; j < dv; j++) mean[j] = mu[j] + rf[j] * nzf;
            T tr = 0;
            if (per_dim) {
                T *restrict var = (T *)a->var + r * dv;
                LT_SIMD_SUM(tr)
                for (int64_t j = 0; j < dv; j++) {
                    const T x = m2[j] - mu[j] * mu[j];
                    var[j] = x < 0 ? 0 : x;
                    tr += var[j];
                }
            } else {
                T s2 = 0;
                LT_SIMD_SUM(s2)
                for (int64_t j = 0; j < dv; j++) s2 += mu[j] * mu[j];
                const T x = m2[0] - s2;
                tr = x < 0 ? 0 : x;
            }
            const T ev = alpha[h] * eb[h] * zz;
            double ph, dph;
            lt_phi1((double)ev, a->tab_val, a->tab_der, &ph, &dph);
            const T phi = (T)ph;
            ((T *)a->ev)[r] = ev;
            ((T *)a->pe)[r] = (T)exp(-(double)ev);
            ((T *)a->phi)[r] = phi;
            a->dphi[r] = dph;
            const T tp = tr * phi;
            ((T *)a->sigma)[r] = tp > 0 ? LT_SQRT(tp) : 0;
            if (per_dim) {
                const T *restrict var = (const T *)a->var + r * dv;
                T *restrict sd = (T *)a->sd + r * dv;
                LT_SIMD
                for (int64_t j = 0; j < dv; j++) {
                    const T vp = var[j] * phi;
                    sd[j] = vp > 0 ? LT_SQRT(vp) : 0;
                }
            }
        }
}

void TFN(attnuq_lt_tail_fwd_)(const struct lt_tail_args *a) {
    const int64_t B = a->dims[0], H = a->dims[1], dv = a->dims[3];
    const T *beta = (const T *)a->beta;
    T eb[H > 0 ? H : 1];
    for (int64_t h = 0; h < H; h++) eb[h] = (T)exp(-(double)beta[h]);
    for (int64_t b = 0; b < B; b++) {
        if (dv == 16) TFN(lt_tail_fwd_b_)(a, b, 16, eb);
        else if (dv == 32) TFN(lt_tail_fwd_b_)(a, b, 32, eb);
        else if (dv == 8) TFN(lt_tail_fwd_b_)(a, b, 8, eb);
        else TFN(lt_tail_fwd_b_)(a, b, dv, eb);
    }
}

void TFN(attnuq_lt_tail_bwd_)(const struct lt_tail_args *a) {
    const int64_t B = a->dims[0], H = a->dims[1], Q = a->dims[2], dv = a->dims[3];
    const int64_t per_dim = a->dims[4], w = dv + (per_dim ? dv : 1);
    const T *alpha = (const T *)a->alpha, *beta = (const T *)a->beta;
    const T *gmean = (const T *)a->g_mean, *gvar = (const T *)a->g_var;
    const T *gsd = (const T *)a->g_sd, *gev = (const T *)a->g_ev, *gpe = (const T *)a->g_pe;
    const T *gphi = (const T *)a->g_phi, *gsig = (const T *)a->g_sigma;
    T eb[H > 0 ? H : 1];
    for (int64_t h = 0; h < H; h++) eb[h] = (T)exp(-(double)beta[h]);
    for (int64_t b = 0; b < B; b++) {
        T *gref = (T *)a->g_ref + b * H * dv, *gab = (T *)a->g_ab + b * 2 * H;
        for (int64_t i = 0; i < H * dv; i++) gref[i] = 0;
        for (int64_t i = 0; i < 2 * H; i++) gab[i] = 0;
        for (int64_t q = 0; q < Q; q++)
            for (int64_t h = 0; h < H; h++) {
                const int64_t r = (b * Q + q) * H + h;
                const T *mu = (const T *)a->mom + b * a->ms[0] + h * a->ms[1] + q * a->ms[2];
                const T *m2 = mu + dv;
                const T zz = ((const T *)a->z)[b * a->zs[0] + h * a->zs[1] + q * a->zs[2]];
                const int nz = zz > 0;
                const T phi = ((const T *)a->phi)[r], sig = ((const T *)a->sigma)[r];
                const T ev = ((const T *)a->ev)[r], pe = ((const T *)a->pe)[r];
                T *gm = (T *)a->g_mom + r * w;
                T tr = 0;
                if (per_dim) {
                    const T *var = (const T *)a->var + r * dv;
                    for (int64_t j = 0; j < dv; j++) tr += var[j];
                } else {
                    T s2 = 0;
                    for (int64_t j = 0; j < dv; j++) s2 += mu[j] * mu[j];
                    const T x = m2[0] - s2;
                    tr = x < 0 ? 0 : x;
                }
                T g_tr = 0, g_phi = gphi ? gphi[r] : 0;
                const T gs = gsig ? gsig[r] : 0;
                if (sig > 0) {
                    g_tr = gs * phi / (2 * sig);
                    g_phi += gs * tr / (2 * sig);
                }
                if (per_dim) {
                    const T *var = (const T *)a->var + r * dv, *sd = (const T *)a->sd + r * dv;
                    for (int64_t j = 0; j < dv; j++) {
                        T gv = (gvar ? gvar[r * dv + j] : 0) + g_tr;
                        if (sd[j] > 0 && gsd) {
                            const T g = gsd[r * dv + j];
                            gv += g * phi / (2 * sd[j]);
                            g_phi += g * var[j] / (2 * sd[j]);
                        }
                        const int pass = m2[j] - mu[j] * mu[j] >= 0;
                        const T gmj = gmean ? gmean[r * dv + j] : 0;
                        gm[dv + j] = pass ? gv : 0;
                        gm[j] = pass ? gmj - 2 * mu[j] * gv : gmj;
                    }
                } else {
                    T s2 = 0;
                    for (int64_t j = 0; j < dv; j++) s2 += mu[j] * mu[j];
                    const int pass = m2[0] - s2 >= 0;
                    gm[dv] = pass ? g_tr : 0;
                    for (int64_t j = 0; j < dv; j++) {
                        const T gmj = gmean ? gmean[r * dv + j] : 0;
                        gm[j] = pass ? gmj - 2 * mu[j] * g_tr : gmj;
                    }
                }
                if (nz && gmean)
                    for (int64_t j = 0; j < dv; j++) gref[h * dv + j] += gmean[r * dv + j];
                const T g_ev = (gev ? gev[r] : 0) - (gpe ? gpe[r] : 0) * pe
                               + (T)((double)g_phi * a->dphi[r]);
                const T ebh = eb[h];
                ((T *)a->g_z)[r] = g_ev * alpha[h] * ebh;
                gab[h] += g_ev * ebh * zz;
                gab[H + h] -= g_ev * ev;
            }
    }
}

#undef TFN
#undef LT_SIMD
#undef LT_SIMD_SUM
#undef LT_STR
#undef LT_SQRT
