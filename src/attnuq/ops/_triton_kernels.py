# mypy: ignore-errors
# (Triton's kernel language is not typed Python: tensors and constexprs are checked by its own
# compiler, not by mypy.)
r"""Triton kernels of sampled attention and its moments (private; imported by
:mod:`attnuq.ops._triton` only, so that ``import attnuq`` never imports triton).

Layout: the inputs of :func:`attnuq.ops._attn_common.prepare`, folded into groups: ``q``
``(G, M, D)``, ``k`` ``(G, Lk, D)``, ``v`` ``(G, Lk, Dv)`` with ``M = R * Lq`` (row ``i`` is query
position ``i % Lq`` of query head ``i // Lq`` of the group); the mask as its 5-D view
``(N, Hk, R|1, Lq|1, Lk)`` (strides of broadcast dims are 0). ``q``, ``k``, ``v`` come in their
own dtype (float16, bfloat16 or float32); scores, weights and sums are float32. Scores are in
log2 units (``scale`` includes ``log2(e)``), weights ``2^(s - max)``. ``UPCAST`` converts ``q``
and ``k`` to float32 before the score product: set under triton's interpreter, whose ``tl.dot``
of bfloat16 operands is wrong in triton 3.8 (errors of 1e10 seen on a 16 x 16 product); the
products of 16-bit values are exact in float32, so this is the same arithmetic.

Sampling (:func:`sample_kernel`): one program per block of ``BLOCK_M`` query rows of one group
and ``NU_B`` draws. It streams over key tiles of ``BLOCK_N`` keys with an online maximum ``m`` and
mass ``l = sum_j 2^(s_j - m)`` of the keys seen so far, and one running choice per draw. With tile
mass ``T`` (relative to the new maximum) the choice switches to a key of the tile with
probability ``p = T / l_new``, the key then drawn by inverse CDF within the tile. By induction the
choice after a tile is distributed as the softmax restricted to the tiles seen, so after the last
tile it is an exact draw from the softmax. One uniform per (row, draw, tile) serves the coin
(``u < p``) and the position (``u / p`` is then uniform on ``[0, 1)``): it is Philox
(``tl.philox``) of the counter ``(row, draw, tile, group)`` under a 64-bit key (the seed), so the
draws are a deterministic function of the seed, the shapes and the (fixed) tile size. No
``Lq x Lk`` tensor exists; the program holds ``(BLOCK_M, BLOCK_N)`` scores and a
``(BLOCK_M, NU_B, BLOCK_N)`` comparison for the inverse-CDF step.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _masked_scores(
    s,
    row_ok,
    col_ok,
    cols,
    qpos,
    rr,
    nb,
    hh,
    MASK,
    smn,
    smh,
    smr,
    sml,
    smk,
    HAS_MASK: tl.constexpr,
    MASK_BOOL: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """A tile's scores ``(BM, BN)`` with the mask (boolean, or an additive bias in natural
    units, added in log2 units) and causality applied: ``(s, valid)``, ``s = -inf`` where not
    valid."""
    valid = row_ok[:, None] & col_ok[None, :]
    if HAS_MASK:
        mp = (
            MASK
            + nb * smn
            + hh * smh
            + rr[:, None] * smr
            + qpos[:, None] * sml
            + cols[None, :] * smk
        )
        if MASK_BOOL:
            mv = tl.load(mp, mask=valid, other=0)
            valid = valid & (mv != 0)
        else:
            b = tl.load(mp, mask=valid, other=0.0).to(tl.float32)
            b2 = b * 1.4426950408889634
            # a finite bias stays finite (finfo.min * log2(e) would overflow to -inf)
            ovf = (b2 == float("-inf")) & (b != float("-inf"))
            b2 = tl.where(ovf, -3.4028234663852886e38, b2)
            valid = valid & (b != float("-inf"))
            s = s + tl.where(valid, b2, 0.0)
    if CAUSAL:
        valid = valid & (cols[None, :] <= qpos[:, None])
    s = tl.where(valid, s, float("-inf"))
    return s, valid


@triton.jit
def _online_step(s, valid, run_m):
    """One tile of an online softmax in log2 units: the new running maximum, the tile's weights
    ``2^(s - max)`` (0 where not valid) and the factor ``alpha`` rescaling what was summed so
    far (0 before the first valid key)."""
    new_m = tl.maximum(run_m, tl.max(s, axis=1))
    shift = tl.where(new_m == float("-inf"), 0.0, new_m)
    e = tl.where(valid, tl.exp2(s - shift[:, None]), 0.0)
    alpha = tl.where(run_m == float("-inf"), 0.0, tl.exp2(run_m - shift))
    return new_m, e, alpha


@triton.jit
def sample_kernel(
    Q,
    K,
    MASK,
    SEED,
    IDX,
    EMPTY,
    M,
    LQ,
    LK,
    D,
    HK,
    NU,
    scale,
    sqg,
    sqm,
    sqd,
    skg,
    skn,
    skd,
    smn,
    smh,
    smr,
    sml,
    smk,
    HAS_MASK: tl.constexpr,
    MASK_BOOL: tl.constexpr,
    CAUSAL: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NU_B: tl.constexpr,
):
    pid_m = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)  # group offsets can pass 2**31 elements
    pid_d = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    row_ok = rows < M
    qpos = rows % LQ
    rr = rows // LQ
    nb = g // HK
    hh = g % HK
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < D
    q = tl.load(
        Q + g * sqg + rows[:, None] * sqm + dd[None, :] * sqd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # (BM, BD)
    if UPCAST:
        q = q.to(tl.float32)
    draws = pid_d * NU_B + tl.arange(0, NU_B)  # (NU_B,)
    draw_ok = draws < NU
    seed = tl.load(SEED)  # int64
    zero2 = tl.zeros([BLOCK_M, NU_B], dtype=tl.int32)
    c_row = (rows[:, None] + zero2).to(tl.uint32)
    c_draw = (draws[None, :] + zero2).to(tl.uint32)
    c_grp = (g + zero2).to(tl.uint32)
    run_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    run_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    choice = tl.zeros([BLOCK_M, NU_B], dtype=tl.int32)
    hi = LK
    if CAUSAL:
        hi = tl.minimum(LK, tl.max(tl.where(row_ok, qpos, 0), axis=0) + 1)
    below_one = 0.99999994  # largest float32 below 1
    for start in range(0, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)  # (BN,)
        col_ok = cols < LK
        kt = tl.load(
            K + g * skg + cols[None, :] * skn + dd[:, None] * skd,
            mask=col_ok[None, :] & d_ok[:, None],
            other=0.0,
        )  # (BD, BN)
        if UPCAST:
            kt = kt.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PREC) * scale  # (BM, BN), log2 units
        s, valid = _masked_scores(
            s, row_ok, col_ok, cols, qpos, rr, nb, hh, MASK, smn, smh, smr, sml, smk,
            HAS_MASK, MASK_BOOL, CAUSAL,
        )  # fmt: skip
        new_m, e, alpha = _online_step(s, valid, run_m)  # e: (BM, BN)
        c = tl.cumsum(e, axis=1)
        t_mass = tl.max(c, axis=1)  # (BM,)
        new_l = run_l * alpha + t_mass
        p = tl.where(new_l > 0.0, t_mass / tl.where(new_l > 0.0, new_l, 1.0), 0.0)  # (BM,)
        tile = (start // BLOCK_N + zero2).to(tl.uint32)
        r0, _r1, _r2, _r3 = tl.philox(seed, c_row, c_draw, tile, c_grp)
        u = tl.random.uint_to_uniform_float(r0)  # (BM, NU_B) in [0, 1)
        take = u < p[:, None]
        x = tl.minimum(u / tl.where(p > 0.0, p, 1.0)[:, None], below_one) * t_mass[:, None]
        # first key of positive weight whose CDF exceeds x; the last such key if rounding left
        # none (never a key of zero weight, never past the tile)
        cand = (c[:, None, :] > x[:, :, None]) & (e[:, None, :] > 0.0)  # (BM, NU_B, BN)
        big = 2147483647
        pos = tl.min(tl.where(cand, cols[None, None, :], big), axis=2)  # (BM, NU_B)
        last = tl.max(tl.where(e > 0.0, cols[None, :], -1), axis=1)  # (BM,)
        pos = tl.where(pos == big, last[:, None], pos)
        choice = tl.where(take, pos, choice)
        run_m = new_m
        run_l = new_l
    tl.store(
        IDX + (g * M + rows[:, None]).to(tl.int64) * NU + draws[None, :],
        choice,
        mask=row_ok[:, None] & draw_ok[None, :],
    )
    if pid_d == 0:
        tl.store(EMPTY + g * M + rows, (run_l == 0.0).to(tl.int8), mask=row_ok)


@triton.jit
def gather_mean_kernel(
    V,
    IDX,
    OUT,
    M,
    NU,
    DV,
    svg,
    svn,
    svd,
    inv_nu,
    BLOCK_M: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """``OUT[g, i] = mean_r V[g, IDX[g, i, r]]`` for a block of rows (float32 sums)."""
    pid_m = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)  # group offsets can pass 2**31 elements
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < DV
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    base = (g * M + rows).to(tl.int64) * NU
    for r in range(0, NU):
        j = tl.load(IDX + base + r, mask=row_ok, other=0)
        acc += tl.load(
            V + g * svg + j[:, None] * svn + dv[None, :] * svd,
            mask=row_ok[:, None] & dv_ok[None, :],
            other=0.0,
        ).to(tl.float32)
    out = acc * inv_nu
    tl.store(
        OUT + (g * M + rows[:, None]).to(tl.int64) * DV + dv[None, :],
        out.to(OUT.dtype.element_ty),
        mask=row_ok[:, None] & dv_ok[None, :],
    )


@triton.jit
def moments_kernel(
    Q,
    K,
    V,
    VBAR,
    MASK,
    MEAN,
    VAR,
    EMPTY,
    M,
    LQ,
    LK,
    D,
    DV,
    HK,
    scale,
    sqg,
    sqm,
    sqd,
    skg,
    skn,
    skd,
    svg,
    svn,
    svd,
    smn,
    smh,
    smr,
    sml,
    smk,
    HAS_MASK: tl.constexpr,
    MASK_BOOL: tl.constexpr,
    CAUSAL: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Online softmax over key tiles accumulating ``sum e vc`` and ``sum e vc^2`` with values
    centred on their unweighted group mean ``VBAR`` (variance is shift-invariant; centring limits
    the cancellation in ``E[vc^2] - E[vc]^2``)."""
    pid_m = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)  # group offsets can pass 2**31 elements
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    qpos = rows % LQ
    rr = rows // LQ
    nb = g // HK
    hh = g % HK
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < D
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < DV
    q = tl.load(
        Q + g * sqg + rows[:, None] * sqm + dd[None, :] * sqd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    vbar = tl.load(VBAR + g * DV + dv, mask=dv_ok, other=0.0)  # (BDV,)
    run_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    run_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    hi = LK
    if CAUSAL:
        hi = tl.minimum(LK, tl.max(tl.where(row_ok, qpos, 0), axis=0) + 1)
    for start in range(0, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < LK
        kt = tl.load(
            K + g * skg + cols[None, :] * skn + dd[:, None] * skd,
            mask=col_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        if UPCAST:
            kt = kt.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PREC) * scale
        s, valid = _masked_scores(
            s, row_ok, col_ok, cols, qpos, rr, nb, hh, MASK, smn, smh, smr, sml, smk,
            HAS_MASK, MASK_BOOL, CAUSAL,
        )  # fmt: skip
        new_m, e, alpha = _online_step(s, valid, run_m)
        vt = tl.load(
            V + g * svg + cols[:, None] * svn + dv[None, :] * svd,
            mask=col_ok[:, None] & dv_ok[None, :],
            other=0.0,
        )  # (BN, BDV)
        vc = tl.where(col_ok[:, None] & dv_ok[None, :], vt.to(tl.float32) - vbar[None, :], 0.0)
        acc1 = acc1 * alpha[:, None] + tl.dot(e, vc, input_precision=PREC)
        acc2 = acc2 * alpha[:, None] + tl.dot(e, vc * vc, input_precision=PREC)
        run_l = run_l * alpha + tl.sum(e, axis=1)
        run_m = new_m
    emp = run_l == 0.0
    denom = tl.where(emp, 1.0, run_l)
    mc = acc1 / denom[:, None]
    var = tl.maximum(acc2 / denom[:, None] - mc * mc, 0.0)
    mean = tl.where(emp[:, None], 0.0, mc + vbar[None, :])
    var = tl.where(emp[:, None], 0.0, var)
    optr = (g * M + rows[:, None]).to(tl.int64) * DV + dv[None, :]
    omask = row_ok[:, None] & dv_ok[None, :]
    tl.store(MEAN + optr, mean.to(MEAN.dtype.element_ty), mask=omask)
    tl.store(VAR + optr, var.to(VAR.dtype.element_ty), mask=omask)
    tl.store(EMPTY + g * M + rows, emp.to(tl.int8), mask=row_ok)


@triton.jit
def flash_lse_kernel(
    Q,
    K,
    V,
    BIAS,
    OUT,
    LSE,
    H,
    LQ,
    LK,
    D,
    DV,
    sqb,
    sqh,
    sqm,
    sqd,
    skb,
    skh,
    skn,
    skd,
    svb,
    svh,
    svn,
    svd,
    sbb,
    sbn,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Softmax attention with a per-key additive bias ``(B, Lk)`` (scale 1, natural units):
    ``OUT = softmax(q k^T + bias) v`` ``(B, H, Lq, Dv)`` float32 and ``LSE = log sum_j
    exp(q k_j + bias_j)`` ``(B, H, Lq)`` (``-inf`` and a zero row when every key has
    ``-inf`` bias), online softmax over key tiles (float32, ``ieee`` products). The inference
    forward of Levy attention on CUDA (:func:`attnuq.ops._triton.flash_lse`)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < LQ
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < D
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < DV
    q = tl.load(
        Q + b * sqb + h * sqh + rows[:, None] * sqm + dd[None, :] * sqd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    run_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    run_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for start in range(0, LK, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < LK
        kt = tl.load(
            K + b * skb + h * skh + cols[None, :] * skn + dd[:, None] * skd,
            mask=col_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        if UPCAST:
            kt = kt.to(tl.float32)
        bias = tl.load(BIAS + b * sbb + cols * sbn, mask=col_ok, other=float("-inf"))
        bias = bias.to(tl.float32)
        s = (tl.dot(q, kt, input_precision="ieee") + bias[None, :]) * 1.4426950408889634
        valid = row_ok[:, None] & col_ok[None, :] & (bias[None, :] != float("-inf"))
        s = tl.where(valid, s, float("-inf"))
        new_m, e, alpha = _online_step(s, valid, run_m)
        vt = tl.load(
            V + b * svb + h * svh + cols[:, None] * svn + dv[None, :] * svd,
            mask=col_ok[:, None] & dv_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(e, vt, input_precision="ieee")
        run_l = run_l * alpha + tl.sum(e, axis=1)
        run_m = new_m
    emp = run_l == 0.0
    denom = tl.where(emp, 1.0, run_l)
    out = tl.where(emp[:, None], 0.0, acc / denom[:, None])
    lse = tl.where(emp, float("-inf"), (run_m + tl.log2(denom)) * 0.6931471805599453)
    optr = (bh * LQ + rows[:, None]) * DV + dv[None, :]
    tl.store(OUT + optr, out, mask=row_ok[:, None] & dv_ok[None, :])
    tl.store(LSE + bh * LQ + rows, lse, mask=row_ok)
