"""A short, readable reference of Levy attention: the formulas of ``docs/methods.md`` (section 2)
in plain torch, for tests (in float64) against the fast strategies, values and gradients.

No blocks, no max shift, no fused kernel, no layout tricks: weights from their definition, the
value field's first two moments per observation from ``E[g]`` and ``E[g g^T]``, then weighted
sums. It materialises ``(B, H, N, K, K)`` and ``(B, H, Q, N)`` tensors and underflows for very
large ``beta`` (``alpha e^{beta (cos - 1)}`` with ``cos = -1``): a test oracle, not a path to
run models on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnuq.ops.levy._common import _safe_sqrt
from attnuq.ops.levy._types import LevyResult, _Args
from attnuq.ops.levy._validate import _per_head, _validate
from attnuq.ops.phi import poisson_phi

__all__ = ["levy_attention_reference"]


def levy_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    a: torch.Tensor,
    times: torch.Tensor,
    mask: torch.Tensor,
    *,
    alpha: float | torch.Tensor,
    beta: float | torch.Tensor,
    h: float | torch.Tensor,
    omega: torch.Tensor | None = None,
    phase: torch.Tensor | None = None,
    D: torch.Tensor | None = None,
) -> LevyResult:
    r"""Levy attention from its definition (arguments and result as
    :func:`attnuq.ops.levy_attention`, checked by the same validation; the formulas below then
    use the arguments as given).

    .. math::

        w_{qi} = \alpha e^{\beta(\cos(q, k_i) - 1)} [i\ \text{observed}],\quad
        \Lambda_q = \sum_i w_{qi},\quad p_{qi} = w_{qi} / \Lambda_q,

        m_{ik} = E g_k = e^{-\omega_k^2 h^2/2} \cos(\omega_k t_i + b_k),\quad
        E[g_k g_l] = \tfrac12\big[e^{-(\omega_k - \omega_l)^2 h^2/2}\cos(z_k - z_l)
                     + e^{-(\omega_k + \omega_l)^2 h^2/2}\cos(z_k + z_l)\big],

        \bar v_i = a_i + D m_i,\quad s_{ij} = D_j (E[g g^\top] - m_i m_i^\top) D_j^\top,

        \mu_q = \sum_i p_{qi} \bar v_i,\quad
        \Sigma_{V,jj}(q) = \sum_i p_{qi} (\bar v_{ij}^2 + s_{ij}) - \mu_{qj}^2,\quad
        \sigma_q = \sqrt{\operatorname{tr}\Sigma_V(q)\, \phi(\Lambda_q)},

    with ``z_k = omega_k t_i + b_k``. An empty series (``Lambda = 0``) gets ``mean = var = 0``,
    ``phi = 1``, as the fast strategies give; the square roots have gradient 0 at 0, as theirs.

    Examples
    --------
    >>> import torch
    >>> from attnuq.ops import levy_attention
    >>> from attnuq.ops.levy import levy_attention_reference
    >>> g = torch.Generator().manual_seed(0)
    >>> q, k = torch.randn(1, 2, 3, 4, generator=g), torch.randn(1, 2, 5, 4, generator=g)
    >>> a, t = torch.randn(1, 2, 5, 3, generator=g), torch.rand(1, 5, generator=g)
    >>> m = torch.ones(1, 5, dtype=torch.bool)
    >>> kw = dict(alpha=1.0, beta=2.0, h=0.3, omega=torch.rand(4, generator=g),
    ...           phase=torch.rand(4, generator=g), D=torch.randn(3, 4, generator=g))
    >>> ref = levy_attention_reference(*(x.double() for x in (q, k, a, t)), m,
    ...                                **{n: v.double() if torch.is_tensor(v) else v
    ...                                   for n, v in kw.items()})
    >>> fast = levy_attention(q, k, a, t, m, **kw)
    >>> torch.allclose(fast.sigma.double(), ref.sigma, atol=1e-5)
    True
    """
    _validate(_Args(q, k, a, times, mask, alpha, beta, h, omega, phase, D))
    # the field in q's dtype, as levy_attention takes it
    omega, phase, D = (None if x is None else x.to(q.dtype) for x in (omega, phase, D))
    H, Dv = q.shape[1], a.shape[-1]
    al, be, hh = (_per_head(x, H, q)[:, None, None] for x in (alpha, beta, h))  # (H, 1, 1)
    observed = mask[:, None, None, :]  # (B, 1, 1, N)
    k = torch.where(mask[:, None, :, None], k, 0.0)  # masked rows may hold anything
    cos = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2)  # (B, H, Q, N)
    w = torch.where(observed, al * torch.exp(be * (cos - 1)), 0.0)  # (B, H, Q, N)
    evidence = w.sum(-1)  # (B, H, Q)
    p = w / torch.where(evidence > 0, evidence, 1.0)[..., None]

    t = torch.where(mask, times, 0.0)[:, None, :, None]  # (B, 1, N, 1)
    if D is None or omega is None or phase is None:
        vbar = torch.where(mask[:, None, :, None], a, 0.0)  # (B, H, N, Dv)
        within = torch.zeros_like(vbar)
    else:
        K = omega.shape[-1]
        om = omega.expand(H, K)[None, :, None, :]  # (1, H, 1, K)
        dd = D.expand(H, Dv, K)  # (H, Dv, K)
        h2 = hh[None] ** 2  # (1, H, 1, 1)
        z = om * t + phase.expand(H, K)[None, :, None, :]  # (B, H, N, K)
        m = torch.exp(-(om**2) * h2 / 2) * torch.cos(z)  # E g, (B, H, N, K)
        om_k, om_l = om[..., :, None], om[..., None, :]  # (1, H, 1, K, 1), (1, H, 1, 1, K)
        z_k, z_l = z[..., :, None], z[..., None, :]
        h2_ = h2[..., None]
        egg = 0.5 * (torch.exp(-((om_k - om_l) ** 2) * h2_ / 2) * torch.cos(z_k - z_l)
                     + torch.exp(-((om_k + om_l) ** 2) * h2_ / 2) * torch.cos(z_k + z_l))
        cov_g = egg - m[..., :, None] * m[..., None, :]  # (B, H, N, K, K)
        a0 = torch.where(mask[:, None, :, None], a, 0.0)
        vbar = a0 + torch.einsum("bhnk,hdk->bhnd", m, dd)
        within = torch.einsum("hdk,bhnkl,hdl->bhnd", dd, cov_g, dd)  # diag of D Cov(g) D^T

    mean = p @ vbar  # (B, H, Q, Dv)
    var = torch.clamp_min(p @ (vbar * vbar + within) - mean * mean, 0.0)
    phi = poisson_phi(evidence)
    return LevyResult(
        mean=mean, var=var, evidence=evidence, p_empty=torch.exp(-evidence), phi=phi,
        sigma=_safe_sqrt(var.sum(-1) * phi), sigma_dim=_safe_sqrt(var * phi[..., None]),
    )
