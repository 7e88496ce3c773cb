"""The value field ``V_i(t) = a_i + D g(t)`` at the observations: its mean ``vbar`` and the
within-atom variance, closed-form under the Gaussian mollifier (see the package docstring).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from attnuq.ops import _native
from attnuq.ops.levy._types import _Inputs


def _gcov_pairs(
    wk: torch.Tensor, wl: torch.Tensor, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M1_kl, M2_kl)`` for frequency pairs ``wk``, ``wl`` ``(H, P)``, bandwidths ``h`` ``(H,)``:
    ``Cov(g)_kl = M1_kl c_k c_l + M2_kl s_k s_l``.

    ``M1 = e (cosh u - 1)``, ``M2 = e sinh u`` with ``e_kl = exp(-(w_k^2 + w_l^2) h^2 / 2)`` and
    ``u_kl = w_k w_l h^2``. For ``|u| < 1`` they are formed from ``sinh`` (no cancellation), else
    from ``e cosh u = (e^{-(w_k - w_l)^2 h^2/2} + e^{-(w_k + w_l)^2 h^2/2}) / 2`` (no overflow).
    """
    h2 = (h * h)[:, None]  # (H, 1)
    u = wk * wl * h2
    e = torch.exp(-(wk * wk + wl * wl) * h2 / 2)
    if bool((u.detach().abs() < 1).all()):  # the usual case: only the sinh branch (fewer ops)
        return e * 2 * torch.sinh(u / 2) ** 2, e * torch.sinh(u)
    em = torch.exp(-((wk - wl) ** 2) * h2 / 2)
    ep = torch.exp(-((wk + wl) ** 2) * h2 / 2)
    small = u.abs() < 1
    us = torch.where(small, u, torch.zeros_like(u))
    m1 = torch.where(small, e * 2 * torch.sinh(us / 2) ** 2, (em + ep) / 2 - e)
    m2 = torch.where(small, e * torch.sinh(us), (em - ep) / 2)
    return m1, m2


class _Field(NamedTuple):
    """Per-call constants of the value field.

    ``wm``: mean loading ``damp_k D_jk``; ``ws``: within-atom variance weights on the
    ``2 P`` pair products (``P = K (K + 1) / 2``), per value dimension (``dw = Dv``) or summed
    over it (``dw = 1``, trace only). Shared time features (``Hw = 1``): ``wm`` ``(K, H * Dv)``,
    ``ws`` ``(2 P, H * dw)``; per-head features: ``(H, K, Dv)`` and ``(H, 2 P, dw)``.
    """

    wm: torch.Tensor
    ws: torch.Tensor


_PAIR_CACHE: dict[tuple[int, torch.dtype, torch.device], tuple[torch.Tensor, ...]] = {}


def _pair_index(
    K: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs ``(k, l)``, ``k <= l``, ordered by diagonal ``d = l - k`` then ``k`` (the order in
    which :func:`_pair_products` builds them), with multiplicity 1 on the diagonal, else 2:
    ``(iu, ju, mult)`` tensors of length ``P = K (K + 1) / 2`` (built once per K, dtype, device).
    """
    key = (K, dtype, device)
    if key not in _PAIR_CACHE:
        iu = [k for d in range(K) for k in range(K - d)]
        ju = [k + d for d in range(K) for k in range(K - d)]
        mult = [1.0 if d == 0 else 2.0 for d in range(K) for _ in range(K - d)]
        _PAIR_CACHE[key] = (torch.tensor(iu, device=device), torch.tensor(ju, device=device),
                            torch.tensor(mult, dtype=dtype, device=device))
    iu_t, ju_t, mu = _PAIR_CACHE[key]
    return iu_t, ju_t, mu


def _pair_products(c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``[c_k c_l, s_k s_l]`` for ``k <= l`` (order of :func:`_pair_index`): ``(..., K)`` ->
    ``(..., 2 P)``, one product per diagonal of the symmetric ``K x K`` outer products."""
    K = c.shape[-1]
    x = torch.stack([c, s], dim=-2)  # (..., 2, K)
    prods = torch.cat([x[..., : K - d] * x[..., d:] for d in range(K)], dim=-1)  # (..., 2, P)
    return prods.flatten(-2)


def _field(inp: _Inputs, per_dim: bool) -> _Field | None:
    r"""Constants of the value field (``None`` without one).

    Within-atom variance without the ``K^2`` products per observation: with ``c_k = cos z_k``,
    ``s_k = sin z_k`` (``z_k = omega_k t_i + b_k``) and the symmetric ``M1``, ``M2`` of
    :func:`_gcov_pairs`,

    .. math::

        s_{ij} = D_j \operatorname{Cov}(g) D_j^\top
               = \sum_{k \le l} \mu_{kl} D_{jk} D_{jl} (M1_{kl} c_k c_l + M2_{kl} s_k s_l),
        \qquad \mu_{kk} = 1,\ \mu_{k<l} = 2,

    because the summand is symmetric in ``(k, l)``: ``2 P = K (K + 1)`` features (72 for
    ``K = 8``) instead of ``2 K^2`` (128). For the trace only (``per_dim=False``) the weights are
    summed over ``j`` first, ``tr s_i = sum_{k<=l} (sum_j mu D_jk D_jl M1_kl) c_k c_l + ...``,
    so the per-observation cost is ``2 P H`` instead of ``2 P H Dv``.
    """
    if inp.omega is None or inp.phase is None or inp.D is None:
        return None
    H, _, K = inp.D.shape
    hw = inp.omega.shape[0]
    om_h = inp.omega.expand(H, -1)
    damp = torch.exp(-(om_h**2) * (inp.h**2)[:, None] / 2)  # (H, K)
    iu_t, ju_t, mu = _pair_index(K, inp.D.dtype, inp.D.device)
    m1, m2 = _gcov_pairs(om_h[:, iu_t], om_h[:, ju_t], inp.h)  # (H, P) each
    dd = inp.D[:, :, iu_t] * inp.D[:, :, ju_t] * mu  # (H, Dv, P)
    w = torch.cat([dd * m1[:, None], dd * m2[:, None]], dim=-1)
    if not per_dim:
        w = w.sum(1, keepdim=True)  # (H, 1, 2P)
    wm = damp[:, None, :] * inp.D  # (H, Dv, K)
    if hw == 1:
        return _Field(
            wm=wm.permute(2, 0, 1).reshape(K, -1), ws=w.permute(2, 0, 1).reshape(w.shape[-1], -1)
        )
    return _Field(wm=wm.transpose(-1, -2), ws=w.transpose(-1, -2))


class _SharedField(torch.autograd.Function):
    r"""The value field at the observations when all heads share the time features: ``vbar`` and
    the within-atom variance ``s`` with a hand-derived backward (no per-diagonal autograd nodes).

    Inputs: ``a`` ``(B, H, N, Dv)``, ``ct = cos z``, ``st = sin z`` ``(K, B N)``, ``wm``
    ``(K, H Dv)``, ``ws`` ``(2P, H dw)`` (:func:`_field`). With the pair features
    ``f = [c_k c_l, s_k s_l]_{k <= l}`` ``(2P, B N)`` (by diagonal ``d = l - k``):

    .. math::

        \bar v = a + (c^\top w_m),\qquad s = f^\top w_s,

    and the backward, with ``G_m = dL/d\bar v``, ``G_s = dL/ds`` as ``(B N, .)`` matrices:
    ``dL/da = G_m``, ``dL/dw_m = c G_m``, ``dL/dw_s = f G_s``, ``dL/df = w_s G_s^\top`` and,
    per diagonal, ``dL/dx_{k} += (dL/df_{k,k+d}) x_{k+d}``, ``dL/dx_{k+d} += (dL/df_{k,k+d})
    x_k`` for ``x = c, s``; ``dL/dc`` gains ``w_m G_m^\top``. Verified by gradcheck in float64;
    the backward is differentiable (gradgradcheck, for the explicit backend's double backward).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, a: torch.Tensor, ct: torch.Tensor, st: torch.Tensor, wm: torch.Tensor,
        ws: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        B, H, N, Dv = a.shape
        K = ct.shape[0]
        native = (_native.train_loops_available(ct.dtype, ct.device) and ct.is_contiguous()
                  and st.is_contiguous())
        if native:  # one compiled pass (csrc/levy_train.c, pairs)
            feats_t = _native.lt_pairs(ct, st)
        else:
            feats_t = torch.cat([x[: K - d] * x[d:] for x in (ct, st) for d in range(K)])
        ap = a.transpose(1, 2)  # (B, N, H, Dv): the embeddings' memory order
        if ap.is_contiguous():
            vbar = torch.addmm(ap.reshape(B * N, H * Dv), ct.t(), wm)
            vbar = vbar.view(B, N, H, Dv).transpose(1, 2)
        else:
            vbar = a + (ct.t() @ wm).view(B, N, H, Dv).transpose(1, 2)
        if ws.shape[1] < 32:
            # few outputs (the trace: one per head): (out x 2P) @ (2P x BN) is an order of
            # magnitude faster than (BN x 2P) @ (2P x out) with the transposed feature matrix
            s = (ws.t() @ feats_t).t().view(B, N, H, -1).transpose(1, 2)
        else:
            s = (feats_t.t() @ ws).view(B, N, H, -1).transpose(1, 2)
        ctx.save_for_backward(ct, st, wm, ws, feats_t)
        ctx.native = native
        return vbar, s

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, g_vbar: torch.Tensor, g_s: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        ct, st, wm, ws, feats_t = ctx.saved_tensors
        K, BN = ct.shape
        create_graph = torch.is_grad_enabled()
        if create_graph:
            # double backward (create_graph=True): the backward is made of differentiable ops;
            # the features are rebuilt from ct, st so that their dependence is on the graph
            feats_t = torch.cat([x[: K - d] * x[d:] for x in (ct, st) for d in range(K)])
        gm = g_vbar.transpose(1, 2).reshape(BN, -1)  # (BN, H Dv)
        g_wm = ct @ gm
        H, dw = g_s.shape[1], g_s.shape[3]
        if dw > 1 and g_s.stride(-1) == 0 and ctx.native and not create_graph:
            # as below, with the rank-H feature gradient and its products formed in one
            # compiled pass (csrc/levy_train.c, pairs_grad_heads; the features not re-read).
            # wm may have any strides (torch.mm reads them; _field's is the (1, K)-strided
            # view of a permuted (H, Dv, K) product)
            gT = g_s[..., 0].permute(1, 0, 2).reshape(H, BN).contiguous()  # (H, BN)
            g_x = torch.empty(2, K, BN, dtype=ct.dtype, device=ct.device)
            torch.mm(wm, gm.t(), out=g_x[0])
            g_x[1].zero_()
            wsum = ws.view(-1, H, dw).sum(-1).contiguous()  # (2P, H)
            g_wsh = _native.lt_pairs_grad_heads(wsum, gT, ct, st, g_x[0], g_x[1])
            g_ws = g_wsh[:, :, None].expand(-1, -1, dw).reshape(-1, H * dw)
            return g_vbar, g_x[0], g_x[1], g_wm, g_ws
        if dw > 1 and g_s.stride(-1) == 0:
            # the same gradient on every within column of a head (the training block's backward
            # on the trace, which expands one column): G_s = g 1^T per head, so
            # dL/dw_s = (f g) 1^T and dL/df = (w_s 1) g^T, products of width H, not H dw
            gtr = g_s[..., 0].transpose(1, 2).reshape(BN, H)  # (BN, H)
            g_ws = (feats_t @ gtr)[:, :, None].expand(-1, -1, dw).reshape(-1, H * dw)
            g_f = ws.view(-1, H, dw).sum(-1) @ gtr.t()  # (2P, BN)
        else:
            gs = g_s.transpose(1, 2).reshape(BN, -1)  # (BN, H dw)
            g_ws = feats_t @ gs
            g_f = ws @ gs.t()  # (2P, BN)
        if create_graph:
            g_x = torch.zeros(2, K, BN, dtype=ct.dtype, device=ct.device)
            g_x[0] = wm @ gm.t()
        else:
            g_x = torch.empty(2, K, BN, dtype=ct.dtype, device=ct.device)
            torch.mm(wm, gm.t(), out=g_x[0])
            g_x[1].zero_()
        if ctx.native and not create_graph and g_f.is_contiguous():
            _native.lt_pairs_grad(g_f, ct, st, g_x[0], g_x[1])
            return g_vbar, g_x[0], g_x[1], g_wm, g_ws
        off = 0
        for i, x in enumerate((ct, st)):
            for d in range(K):
                gd = g_f[off : off + K - d]
                g_x[i, : K - d].addcmul_(gd, x[d:])
                g_x[i, d:].addcmul_(gd, x[: K - d])
                off += K - d
        return g_vbar, g_x[0], g_x[1], g_wm, g_ws


def _value_moments(
    inp: _Inputs, fld: _Field | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``vbar`` ``(B, H, N, Dv)`` and within-atom variance ``s`` ``(B, H, N, dw)`` (or None).

    ``vbar = a + (damp * cos z) D^T`` and ``s`` (per dimension, ``dw = Dv``, or its sum over
    dimensions, ``dw = 1``) are one GEMM each over the time features, shared by all heads when
    the frequencies are (see :func:`_field`). Rows of masked entries are finite but meaningless
    (the callers weight them by exactly 0).
    """
    a = inp.a
    if fld is None or inp.omega is None or inp.phase is None:
        return a, None
    B, N = a.shape[0], a.shape[2]
    if inp.omega.shape[0] == 1:
        # shared time features, one GEMM each for all heads. Features are built transposed,
        # (K, B N) and (2P, B N), so that every product runs over B N contiguous numbers (a
        # (B N, K) layout has inner loops of K - d elements and costs several times more)
        zt = inp.omega[0][:, None] * inp.times.reshape(1, B * N) + inp.phase[0][:, None]
        vbar, s = _SharedField.apply(a, torch.cos(zt), torch.sin(zt), fld.wm, fld.ws)
        return vbar, s
    z = inp.times[:, None, :, None] * inp.omega[None, :, None, :] + inp.phase[None, :, None, :]
    c = torch.cos(z)  # (B, H, N, K)
    feats = _pair_products(c, torch.sin(z))  # (B, H, N, 2P)
    return a + c @ fld.wm, feats @ fld.ws
