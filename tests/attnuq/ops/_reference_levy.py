"""Slow, independent references for Levy attention (float64 numpy / mpmath, explicit loops).

* :func:`ref_phi` -- ``E[1/N | N >= 1]`` for ``N ~ Poisson(L)`` from mpmath's ``Ei`` at 50 digits,
  and :func:`ref_phi_poisson_sum` -- the defining sum ``sum_k (1/k) P(N = k) / P(N >= 1)``.
* :func:`ref_levy` -- mean and full value covariance ``Sigma_V(q)`` from the definitions:
  weights ``alpha exp(beta (cos - 1))`` per pair, and the first two moments of
  ``V_i(t) = a_i + D g(t)`` under ``t ~ N(t_i, h^2)`` by Gauss-Hermite quadrature (it does not use
  the closed-form ``E[g g^T]`` of the implementation, so it checks that formula too).
* :func:`ref_cosine_softmax` -- ``softmax(beta cos(q, k))`` attention over observed keys.
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import torch


def ref_phi(lam: float, dps: int = 50) -> float:
    """``phi(L) = e^{-L} (Ei(L) - ln L - gamma) / (1 - e^{-L})`` with mpmath at ``dps`` digits."""
    with mpmath.workdps(dps):
        L = mpmath.mpf(lam)
        val = mpmath.exp(-L) * (mpmath.ei(L) - mpmath.log(L) - mpmath.euler) / (-mpmath.expm1(-L))
        return float(val)


def ref_dphi(lam: float, dps: int = 60) -> float:
    """``dphi/dL = 1/L - phi e^L / (e^L - 1)`` with mpmath (enough digits for the cancellation)."""
    with mpmath.workdps(dps):
        L = mpmath.mpf(lam)
        phi = mpmath.exp(-L) * (mpmath.ei(L) - mpmath.log(L) - mpmath.euler) / (-mpmath.expm1(-L))
        return float(1 / L - phi * mpmath.exp(L) / mpmath.expm1(L))


def ref_phi_poisson_sum(lam: float) -> float:
    """Direct sum ``sum_{k>=1} (1/k) e^{-L} L^k / k! / (1 - e^{-L})`` (float64, log-space)."""
    kmax = int(lam + 40 * math.sqrt(lam) + 60)
    k = np.arange(1, kmax + 1, dtype=np.float64)
    from scipy.special import gammaln

    logp = -lam + k * math.log(lam) - gammaln(k + 1)
    terms = np.exp(logp) / k
    return float(np.sum(terms[::-1]) / -math.expm1(-lam))


def _np(x: torch.Tensor | float) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def ref_levy(
    q: torch.Tensor,
    k: torch.Tensor,
    a: torch.Tensor,
    times: torch.Tensor,
    mask: torch.Tensor,
    *,
    alpha: torch.Tensor | float,
    beta: torch.Tensor | float,
    h: torch.Tensor | float,
    omega: torch.Tensor | None = None,
    phase: torch.Tensor | None = None,
    D: torch.Tensor | None = None,
    n_quad: int = 80,
) -> dict[str, np.ndarray]:
    """Loop reference. Returns ``mean (B,H,Q,Dv)``, ``cov (B,H,Q,Dv,Dv)``, ``evidence (B,H,Q)``."""
    qn, kn, an, tn, mn = _np(q), _np(k), _np(a), _np(times), mask.cpu().numpy()
    B, H, Q, _ = qn.shape
    N, Dv = an.shape[2], an.shape[3]
    al = np.broadcast_to(_np(alpha), (H,))
    be = np.broadcast_to(_np(beta), (H,))
    hh = np.broadcast_to(_np(h), (H,))
    xs, ws = np.polynomial.hermite_e.hermegauss(n_quad)  # probabilists': weight exp(-x^2/2)
    ws = ws / ws.sum()
    mean = np.zeros((B, H, Q, Dv))
    cov = np.zeros((B, H, Q, Dv, Dv))
    evidence = np.zeros((B, H, Q))
    for b in range(B):
        for hd in range(H):
            # per observation: first and second moments of V_i(t) under the mollifier
            ev = np.zeros((N, Dv))
            evv = np.zeros((N, Dv, Dv))
            for i in range(N):
                if not mn[b, i]:
                    continue
                if D is None:
                    vals = np.broadcast_to(an[b, hd, i], (n_quad, Dv))
                else:
                    om = np.broadcast_to(_np(omega), (H, _np(omega).shape[-1]))[hd]
                    ph = np.broadcast_to(_np(phase), (H, om.shape[0]))[hd]
                    dd = np.broadcast_to(_np(D), (H, Dv, om.shape[0]))[hd]
                    t = tn[b, i] + hh[hd] * xs  # (n_quad,)
                    g = np.cos(t[:, None] * om[None, :] + ph[None, :])  # (n_quad, K)
                    vals = an[b, hd, i][None, :] + g @ dd.T
                ev[i] = ws @ vals
                evv[i] = np.einsum("n,nj,nl->jl", ws, vals, vals)
            for qq in range(Q):
                w = np.zeros(N)
                for i in range(N):
                    if mn[b, i]:
                        c = qn[b, hd, qq] @ kn[b, hd, i]
                        c /= max(np.linalg.norm(qn[b, hd, qq]), 1e-12)
                        c /= max(np.linalg.norm(kn[b, hd, i]), 1e-12)
                        w[i] = al[hd] * math.exp(be[hd] * (c - 1))
                lam = w.sum()
                evidence[b, hd, qq] = lam
                if lam == 0:
                    continue
                p = w / lam
                mu = p @ ev
                mean[b, hd, qq] = mu
                cov[b, hd, qq] = np.einsum("i,ijl->jl", p, evv) - np.outer(mu, mu)
    return {"mean": mean, "cov": cov, "evidence": evidence}


def ref_cosine_softmax(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, beta: float
) -> torch.Tensor:
    """``softmax_i(beta cos(q, k_i)) v_i`` over observed keys; ``(B, H, Q, Dv)``."""
    qn = q / q.norm(dim=-1, keepdim=True)
    kn = k / k.norm(dim=-1, keepdim=True)
    s = beta * (qn @ kn.transpose(-1, -2))
    s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    return torch.softmax(s, dim=-1) @ v
