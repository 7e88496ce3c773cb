"""The differentiable CPU path of Levy attention: torch's flash-attention kernel and its
log-sum-exp inside a custom autograd function with a hand-derived backward
(:class:`_FlashBlock`), and the outputs from the moments with their backward in one compiled
pass each (:class:`_Tail`, :class:`_PhiNative`).
"""

from __future__ import annotations

from typing import Any

import torch

from attnuq.ops import _native
from attnuq.ops.levy import _common
from attnuq.ops.levy._common import _centered_values, _ordered_sum, _unit
from attnuq.ops.levy._types import _Inputs
from attnuq.ops.phi import poisson_phi


class _FlashBlock(torch.autograd.Function):
    r"""One block of the differentiable CPU path: key normalisation, centred values, one flash
    attention call with its log-sum-exp, and a hand-derived backward around ONE flash backward.

    Inputs: ``qa`` ``(B, H, Q, E)`` (``beta qn``), ``k`` ``(B, H, N, E)`` (raw keys),
    ``vbar`` ``(B, H, N, dv)``, ``within`` ``(B, H, N, ws)`` or ``None``, ``ref``
    ``(B, H, 1, dv)``, ``bias`` ``(B, 1, 1, N)`` (additive mask, no gradient), ``per_dim``.
    Forward, with ``kn = k / max(|k|, eps)``, ``vc = vbar - ref``, ``sq = vc^2 + s`` (per
    dimension) or ``|vc|^2 + tr s`` (``ws = 1``), scores ``s_qi = qa_q . kn_i + bias_i``:

    .. math::

        lse_q = \log \sum_i e^{s_{qi}},\quad p_{qi} = e^{s_{qi} - lse_q},\quad
        out_q = \sum_i p_{qi} v_i,\quad v_i = [vc_i, sq_i, 0, \dots].

    Backward (``g = dL/d out``, ``g^{lse} = dL/d lse``):

    .. math::

        \frac{\partial L}{\partial s_{qi}} = p_{qi}\big(g_q\cdot(v_i - out_q) + g^{lse}_q\big),
        \quad
        \bar{vc}_i = \bar v_{i,vc} + 2\, vc_i \odot \bar v_{i,sq},\quad
        \bar k_i = \frac{\bar{kn}_i - [|k_i| > eps]\, kn_i (kn_i \cdot \bar{kn}_i)}
                        {\max(|k_i|, eps)},

    ``bar vbar = bar vc``, ``bar ref = -sum_i bar vc_i``, ``bar s = bar v_{sq}``. The kernel
    needs equal head dims: ONE buffer ``[kn | T | Z | vc | sq | 0]`` per observation and head
    holds keys (its first columns; their padding is met by the queries' zeros) and values
    (``[vc | sq]`` in the forward, ``[vc | sq | 0]`` in the backward). A value column that is
    identically 0 has a free output gradient: the backward sets its ``g = 1`` and hands the
    kernel ``out = -g^{lse}`` there; the kernel's ``rowsum(g * out)`` becomes
    ``g . out - g^{lse}`` and its ``p (g . v_i - rowsum)`` is exactly the line above, so one
    flash backward gives every gradient (no sentinel key, no normaliser column). Masked keys
    have ``p = 0`` exactly, so their gradients are exact zeros. When the incoming gradient is
    the same on every ``sq`` column (a loss that reads the second moments only through their
    sum, e.g. through ``sigma``), the backward runs on ``[vc, tr sq]`` alone: the same
    gradients (``g . v_i = g_vc . vc_i + g_tr tr sq_i``) from a kernel of width ``dv + 2``
    instead of ``2 dv + 1``, on the values ``[T | Z | vc]`` (``T = tr sq`` written into the
    buffer then, ``Z = 0`` the zero column). Returns ``out`` ``(B, H, Q, max(E, dv + ws))``
    and ``lse`` ``(B, H, Q)``; both backward paths verified by ``torch.autograd.gradcheck``
    in float64 (tests/attnuq/ops/test_levy.py).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, beta: torch.Tensor, k: torch.Tensor, vbar: torch.Tensor,
        within: torch.Tensor | None, ref: torch.Tensor | None, bias: torch.Tensor,
        per_dim: bool, obs: torch.Tensor | None = None, count: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        B, H, Q, E = q.shape
        N, dv = k.shape[2], vbar.shape[-1]
        ctx.own_ref = ref is None
        if ref is None:
            # the reference formed here (the caller's GEMM, so the same bits) and returned
            assert obs is not None and count is not None
            ref_flat = torch.bmm(obs, vbar.transpose(1, 2).reshape(B, N, H * dv)) / count
            ref = ref_flat.view(B, 1, H, dv).transpose(1, 2)
            ctx.obs = (obs, count)
        ws = dv if per_dim else 1
        c = dv + ws
        dp = max(E, c + 1, dv + 2)  # the widest view the kernel gets (forward and backward)
        pad = max(E - c, 1)
        v0 = E + 2  # first value column: [kn | T | Z | vc | sq | 0 ...] (module docstring)
        # everything below is indexed (B, L, H, .), the memory order of the buffers, of the
        # kernel's outputs and of the module's projections (one common order is several times
        # faster than mixed ones); the kernel gets (B, H, L, .) views
        ctx.native = _native.train_loops_available(k.dtype, k.device)
        if ctx.native:  # [beta q / |q| | 0] and |q| in one compiled pass
            qp, qnrm = _native.lt_queries(_unit(q), beta, dp)
        else:
            qnrm = torch.linalg.vector_norm(q, dim=-1, keepdim=True).clamp_min_(1e-12)
            qp = q.new_empty(B, Q, H, dp)
            torch.mul(q / qnrm, beta[:, None, None], out=qp[..., :E].transpose(1, 2))
            qp[..., E:] = 0.0
            qnrm = qnrm.transpose(1, 2)[..., 0]  # (B, Q, H)
        buf = k.new_empty(B, N, H, v0 + c + pad)
        kt = k.transpose(1, 2)
        wt = None if within is None else within.transpose(1, 2)
        if ctx.native:
            # one compiled pass per row (csrc/levy_train.c, prep): kn, nrm, T = tr sq, vc, sq
            nrm = k.new_empty(B, N, H)
            _native.lt_prep(_unit(kt), _unit(vbar.transpose(1, 2)),
                            None if wt is None else _unit(wt, broadcast_ok=True),
                            _unit(ref[:, :, 0]), buf, nrm, per_dim)
            nrm = nrm[..., None]
        else:
            nrm = torch.linalg.vector_norm(kt, dim=-1, keepdim=True).clamp_min_(1e-12)
            torch.div(kt, nrm, out=buf[..., :E])
            buf[..., E:v0] = 0.0  # T (the trace column of the narrow backward) and Z
            _centered_values(vbar.transpose(1, 2), wt, ref.transpose(1, 2), per_dim,
                             out=(buf[..., v0 : v0 + dv], buf[..., v0 + dv : v0 + c]))
            buf[..., v0 + c :] = 0.0
        dpf = max(E, c)
        assert _common._FLASH is not None
        out, lse = _common._FLASH(qp[..., :dpf].transpose(1, 2), buf[..., :dpf].transpose(1, 2),
                          buf[..., v0 : v0 + dpf].transpose(1, 2), 0.0, False, attn_mask=bias,
                          scale=1.0)
        ctx.save_for_backward(out, lse, bias)
        # intermediates, kept on ctx (the narrow backward writes its T column into buf)
        ctx.bufs = (qp, buf, nrm, qnrm, beta)
        ctx.dims = (E, dv, ws, within is not None)
        if ctx.own_ref:
            return out, lse, ref
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, g_out: torch.Tensor, g_lse: torch.Tensor, *g_ref_out: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        grads = _FlashBlock._backward_block(ctx, g_out, g_lse)
        if not ctx.own_ref:
            return (*grads, None, None)
        # ref = (obs @ vbar) / count formed in the forward: its total gradient (the block's,
        # -sum_i bar vc_i, plus the caller's) reaches vbar as obs_i * bar ref / count
        obs, count = ctx.obs
        g_vc, g_ref = grads[3], grads[5]
        assert g_vc is not None and g_ref is not None
        if g_ref_out[0] is not None:
            g_ref = g_ref + g_ref_out[0]
        B, N = obs.shape[0], obs.shape[2]
        g_vbar = torch.addcmul(g_vc.transpose(1, 2), obs.view(B, N, 1, 1),
                               g_ref.transpose(1, 2) / count[..., None])
        return (*grads[:3], g_vbar.transpose(1, 2), grads[4], None, *grads[6:], None, None)

    @staticmethod
    def _backward_block(
        ctx: Any, g_out: torch.Tensor, g_lse: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        """The gradients of the eight inputs of :meth:`forward` (``ref`` as an input)."""
        out, lse, bias = ctx.saved_tensors
        qp, buf, nrm, qnrm, beta = ctx.bufs
        E, dv, ws, has_within = ctx.dims
        c = dv + ws
        v0 = E + 2
        g_sq_in = g_out[..., dv:c]
        # a loss that reads the second moments only through their sum over dimensions (sigma;
        # the per-dimension var and sigma_dim unused) sends the same gradient to every sq
        # column: then the backward needs only [T = tr sq, Z, vc] (width dv + 2, exactly the
        # same gradients: g . v_i = g_vc . vc_i + g_tr tr sq_i), about 60 % of the full cost
        B, H, Q = out.shape[:3]
        if ctx.native:
            return _FlashBlock._backward_native(ctx, g_out, g_lse)
        narrow = ws > 1 and bool((g_sq_in == g_sq_in[..., :1]).all())
        if narrow:
            # values [T | Z | vc | ...] start at column E; the kernel's value columns beyond
            # dv + 2 (if E > dv + 2) get gradient 0 and are ignored
            dp, first, zc = max(E, dv + 2), E, 1
            torch.sum(buf[..., v0 + dv : v0 + c], -1, out=buf[..., E])
        else:
            # values [vc | sq | 0 ...] start at column v0; column c is the zero column
            dp, first, zc = max(E, c + 1), v0, c
        # gradient and output rows in out's (B, Q, H, .) memory order, width dp
        gt = out.new_zeros(B, Q, H, dp).transpose(1, 2)
        ot = out.new_zeros(B, Q, H, dp).transpose(1, 2)
        if narrow:
            gt[..., 0] = g_sq_in[..., 0]
            ot[..., 0] = out[..., dv:c].sum(-1)
            gt[..., 2 : 2 + dv] = g_out[..., :dv]
            ot[..., 2 : 2 + dv] = out[..., :dv]
        else:
            gt[..., :c] = g_out[..., :c]
            ot[..., :c] = out[..., :c]
        gt[..., zc] = 1.0
        ot[..., zc] = -g_lse
        flash_bwd = _common._FLASH_BWD
        assert flash_bwd is not None
        gq, gkn, gv = flash_bwd(gt, qp[..., :dp].transpose(1, 2), buf[..., :dp].transpose(1, 2),
                                buf[..., first : first + dp].transpose(1, 2), ot, lse, 0.0,
                                False, attn_mask=bias, scale=1.0)
        # (B, N, H, .) views of the kernel's gradients (its memory order)
        gkn, gv = gkn.transpose(1, 2)[..., :E], gv.transpose(1, 2)
        if narrow:
            g_vv, g_sq = gv[..., 2 : 2 + dv], gv[..., :1]
        else:
            g_vv, g_sq = gv[..., :dv], gv[..., dv:c]
        kn, vc = buf[..., :E], buf[..., v0 : v0 + dv]
        # F.normalize's backward: (g - kn (kn . g)) / max(|k|, eps); the clamp (|k| <= eps)
        # passes no radial part
        radial = torch.linalg.vecdot(kn, gkn)[..., None]
        if bool((nrm <= 1e-12).any()):
            radial = radial * (nrm > 1e-12)
        g_k = torch.addcmul(gkn, kn, radial, value=-1.0).div_(nrm)
        g_vc = torch.addcmul(g_vv, vc, g_sq, value=2.0)  # g_sq broadcasts if 1 wide
        g_ref = -g_vc.sum(1, keepdim=True)
        g_within = None
        if has_within:
            g_within = (g_sq.expand(-1, -1, -1, ws) if narrow else g_sq).transpose(1, 2)
        # queries qa = beta qn, qn = q / max(|q|, eps): the same backward as for the keys
        qn = qp[..., :E].transpose(1, 2) / beta[:, None, None]
        gqa = gq[..., :E]
        g_beta = torch.linalg.vecdot(qn, gqa).sum((0, 2))
        g_qn = gqa * beta[:, None, None]
        rad_q = torch.linalg.vecdot(qn, g_qn)[..., None] * (qnrm.transpose(1, 2) > 1e-12)[..., None]
        g_q = torch.addcmul(g_qn, qn, rad_q, value=-1.0) / qnrm.transpose(1, 2)[..., None]
        return (g_q, g_beta, g_k.transpose(1, 2), g_vc.transpose(1, 2), g_within,
                g_ref.transpose(1, 2), None, None)

    @staticmethod
    def _backward_native(
        ctx: Any, g_out: torch.Tensor, g_lse: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        """:meth:`backward` with the row loops compiled (csrc/levy_train.c: rows, post); the
        same flash backward call, the same formulas."""
        out, lse, bias = ctx.saved_tensors
        qp, buf, nrm, qnrm, beta = ctx.bufs
        E, dv, ws, has_within = ctx.dims
        c = dv + ws
        v0 = E + 2
        g_out, g_lse = _unit(g_out), g_lse
        narrow = ws > 1 and _native.lt_uniform(g_out, out, g_lse, dv, ws)
        if narrow:  # values [T | Z | vc | ...] (T = tr sq, written by the forward's loop)
            dp, first, cols = max(E, dv + 2), E, (2, 0)
        else:  # values [vc | sq | 0 ...]
            dp, first, cols = max(E, c + 1), v0, (0, dv)
        gt, ot = _native.lt_rows(g_out, out, g_lse, dv, ws, dp, narrow)
        flash_bwd = _common._FLASH_BWD
        assert flash_bwd is not None
        gq, gkn, gv = flash_bwd(gt, qp[..., :dp].transpose(1, 2), buf[..., :dp].transpose(1, 2),
                                buf[..., first : first + dp].transpose(1, 2), ot, lse, 0.0,
                                False, attn_mask=bias, scale=1.0)
        wsq = 1 if (narrow or ws == 1) else ws
        g_k, g_vc, g_sq, g_ref = _native.lt_post(
            _unit(gkn.transpose(1, 2)), _unit(gv.transpose(1, 2)), buf, nrm[..., 0], E, dv, wsq,
            cols)
        g_within = None
        if has_within:
            g_within = (g_sq.expand(-1, -1, -1, ws) if wsq < ws else g_sq).transpose(1, 2)
        g_q, g_beta = _native.lt_queries_grad(gq, beta, qp, qnrm, E)
        return (g_q.transpose(1, 2), g_beta, g_k.transpose(1, 2), g_vc.transpose(1, 2),
                g_within, g_ref[:, :, None], None, None)


def _accumulate_flash_grad(
    q: torch.Tensor,
    blocks: list[_Inputs],
    mom_b: list[tuple[torch.Tensor, torch.Tensor | None]],
    ref: torch.Tensor | None,
    beta: torch.Tensor,
    per_dim: bool,
    count: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``z = sum_i e^{beta cos_i}`` ``(B, H, Q)``, the moments ``sum_i p_i v_i``
    ``(B, H, Q, W)`` (0 where ``z = 0``) and the reference ``(B, H, 1, Dv)``, differentiable:
    the autograd path on CPU.

    One :class:`_FlashBlock` call per block (CPU flash forward with its log-sum-exp; one flash
    backward call in the backward pass), combined as in :func:`_accumulate_lse`,
    ``sum_b (z_b / z) out_b`` (with one block the weight is 1, or 0 for an empty series).
    ``ref=None`` (one block only): the block forms the reference, ``obs @ vbar / count``
    (``count`` ``(B, 1, 1)``, observed entries per series, at least 1), and returns it.
    """
    dv = mom_b[0][0].shape[-1]
    w_cols = dv + (dv if per_dim else 1)
    z_parts, t_parts = [], []
    for blk, (vbar, within) in zip(blocks, mom_b, strict=True):
        bias = torch.where(blk.mask, 0.0, -1e4).to(q.dtype)[:, None, None, :]
        if ref is None:
            assert len(blocks) == 1
            out, lse, ref = _FlashBlock.apply(q, beta, blk.k, vbar, within, None, bias, per_dim,
                                              blk.mask.to(q.dtype)[:, None, :], count)
        else:
            out, lse = _FlashBlock.apply(q, beta, blk.k, vbar, within, ref, bias, per_dim)
        z_parts.append(torch.exp(lse))
        t_parts.append(out[..., :w_cols])
    assert ref is not None
    z = _ordered_sum(z_parts)
    if len(z_parts) == 1:
        if bool((z > 0).all()):  # no empty series: the weight is exactly 1
            return z, t_parts[0], ref
        return z, t_parts[0] * (z > 0)[..., None].to(q.dtype), ref
    zs = torch.where(z > 0, z, torch.ones_like(z))
    return z, _ordered_sum([(zb / zs)[..., None] * ob for zb, ob in zip(z_parts, t_parts,
                                                                        strict=True)]), ref


class _Tail(torch.autograd.Function):
    r"""The operator's outputs from the moments of the CPU training path, forward and backward
    each one compiled pass (``csrc/levy_train.c``, tail), the torch formulas of
    :func:`_torch_path` with ``Lambda = alpha e^{-beta} z``:

    .. math::

        \text{mean} = \mu + [z > 0]\,\text{ref},\quad
        \text{var}_j = \max(m_{2,j} - \mu_j^2, 0),\quad
        \sigma = \sqrt{\operatorname{tr}\text{var}\;\phi(\Lambda)},\quad
        \sigma_j = \sqrt{\text{var}_j\,\phi(\Lambda)},\quad p_\emptyset = e^{-\Lambda},

    (trace only: ``tr var = max(m2 - |mu|^2, 0)``), square roots with gradient 0 at 0 and the
    clamp passing its gradient where its argument is ``>= 0``, as ``torch.clamp_min``.
    Inputs: ``mom`` ``(B, H, Q, Dv + ws)``, ``z`` ``(B, H, Q)``, ``ref`` ``(B, H, 1, Dv)``,
    ``alpha``, ``beta`` ``(H,)``. Outputs are ``(B, H, Q, ...)`` views of ``(B, Q, H, ...)``
    memory (the heads of the module concatenate for free); ``var`` and ``sigma_dim`` are empty
    without ``per_dim``. Checked against the torch formulas (tests/attnuq/ops/test_levy.py).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, mom: torch.Tensor, z: torch.Tensor, ref: torch.Tensor, alpha: torch.Tensor,
        beta: torch.Tensor, per_dim: bool,
    ) -> tuple[torch.Tensor, ...]:
        args = (_unit(mom), z, _unit(ref[:, :, 0]), alpha.detach().contiguous(),
                beta.detach().contiguous(), per_dim)
        o = _native.lt_tail(*args)
        ctx.args, ctx.o = args, o
        ctx.set_materialize_grads(False)
        empty = mom.new_empty(0)

        def t(x: torch.Tensor | None) -> torch.Tensor:
            return empty if x is None else x.transpose(1, 2)

        return (t(o.mean), t(o.var), t(o.evidence), t(o.p_empty), t(o.phi), t(o.sigma),
                t(o.sigma_dim))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, *grads: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        per_dim = ctx.args[-1]
        g_mean, g_var, g_ev, g_pe, g_phi, g_sigma, g_sd = grads
        if not per_dim:
            g_var = g_sd = None

        def bqh(g: torch.Tensor | None) -> torch.Tensor | None:
            return None if g is None else g.transpose(1, 2).contiguous()

        mom, z, ref, alpha, beta, _ = ctx.args
        g_mom, g_z, g_ref, g_ab = _native.lt_tail_grad(
            mom, z, ref, alpha, beta, per_dim, ctx.o,
            [bqh(g) for g in (g_mean, g_var, g_sd, g_ev, g_pe, g_phi, g_sigma)])
        return g_mom.transpose(1, 2), g_z.transpose(1, 2), g_ref[:, :, None], g_ab[0], g_ab[1], None


class _PhiNative(torch.autograd.Function):
    """``phi(Lambda)`` with its derivative from one compiled pass (``csrc/levy_train.c``; the
    tables of :mod:`attnuq.ops.phi`, in float64 like :func:`attnuq.ops.poisson_phi`)."""

    @staticmethod
    def forward(ctx: Any, lam: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        phi64, dphi64 = _native.lt_phi(lam)
        ctx.save_for_backward(dphi64)
        return phi64.to(lam.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (dphi64,) = ctx.saved_tensors
        return (grad_out.to(torch.float64) * dphi64).to(grad_out.dtype)


def _phi_of_evidence(evidence: torch.Tensor) -> torch.Tensor:
    """``phi(Lambda)`` of the operator's evidence (finite and ``>= 0`` by construction): the
    compiled tables where they run, else :func:`attnuq.ops.poisson_phi` (the same tables)."""
    if _native.train_loops_available(evidence.dtype, evidence.device):
        out: torch.Tensor = _PhiNative.apply(evidence)
        return out
    return poisson_phi(evidence)
