"""Per-stay, per-channel exact Gaussian process for irregular series (the classical reference).

For every channel ``c`` one GP prior ``f ~ GP(m_c, k_c)`` with a GPyTorch
``ScaleKernel(MaternKernel(nu=1.5))`` on time in hours and Gaussian observation noise
``s_c^2``. Hyperparameters ``(m_c, outputscale, lengthscale, s_c)`` are fitted once per channel by
maximising the summed exact log marginal likelihood of the channel's series over (a subset of)
the training stays; then, per stay and channel, the exact posterior given that stay's observed
points of the channel gives ``N(mu, var_f + s_c^2)`` at each query time. A channel with no
observed point in a stay predicts with the prior ``N(m_c, outputscale + s_c^2)``.

Batched exact GP on padded series: a padded point gets a unit diagonal, zero off-diagonal and a
zero residual, so it adds ``0`` to the quadratic form and ``log 1 = 0`` to the log determinant;
the likelihood and posterior of the real points are therefore exact.

NOTE(paper): the Levy paper does not specify its GP; kernel family (Matern-3/2) and per-channel
hyperparameters shared across stays are our choices.

Examples
--------
>>> import torch
>>> from attnuq_bench.models.gp_irregular import ChannelGP
>>> gp = ChannelGP()
>>> t = torch.tensor([[0.0, 1.0, 2.0]]); y = torch.tensor([[0.1, 0.2, 0.3]])
>>> m = torch.ones(1, 3, dtype=torch.bool)
>>> mu, var = gp.predict(t, y, m, torch.tensor([[3.0]]))
>>> mu.shape, bool((var > 0).all())
(torch.Size([1, 1]), True)
"""

from __future__ import annotations

import math

import gpytorch
import numpy as np
import torch
from torch import nn

from attnuq._validation import check_finite, check_positive_int

__all__ = ["ChannelGP", "fit_channel_gps", "predict_channel_gps"]


class ChannelGP(nn.Module):
    """One channel's GP: constant mean, scaled Matern-3/2 kernel, Gaussian noise (float64)."""

    def __init__(self, lengthscale: float = 4.0, outputscale: float = 0.01, noise: float = 1e-3):
        super().__init__()
        self.kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5))
        self.kernel.base_kernel.lengthscale = lengthscale
        self.kernel.outputscale = outputscale
        self.raw_noise = nn.Parameter(torch.tensor(math.log(math.expm1(noise))))
        self.mean = nn.Parameter(torch.tensor(0.0))
        self.double()

    @property
    def noise(self) -> torch.Tensor:
        return nn.functional.softplus(self.raw_noise) + 1e-6

    def _k(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        return self.kernel(x1[..., None], x2[..., None]).to_dense()

    def _chol(self, t: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        K = self._k(t, t) + self.noise * torch.eye(t.shape[-1], dtype=t.dtype)
        mm = m[..., :, None] & m[..., None, :]
        eye = torch.eye(t.shape[-1], dtype=t.dtype).expand_as(K)
        K = torch.where(mm, K, eye)
        return torch.linalg.cholesky(K)

    def log_marginal(self, t: torch.Tensor, y: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """Sum over series of the exact log marginal likelihood; ``(S, n)`` padded inputs."""
        t, y = t.double(), y.double()
        L = self._chol(t, m)
        r = torch.where(m, y - self.mean, 0)
        alpha = torch.cholesky_solve(r[..., None], L)[..., 0]
        quad = (r * alpha).sum(-1)
        logdet = 2 * torch.log(torch.diagonal(L, dim1=-2, dim2=-1)).sum(-1)
        n = m.sum(-1)
        return (-0.5 * quad - 0.5 * logdet - 0.5 * n * math.log(2 * math.pi)).sum()

    @torch.no_grad()
    def predict(
        self, t: torch.Tensor, y: torch.Tensor, m: torch.Tensor, tq: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Posterior predictive mean and variance (noise included) at ``tq`` ``(S, Q)``.

        ``t, y, m`` ``(S, n)``: observed times, values, mask (a row may be empty: prior).
        """
        if t.shape != y.shape or t.shape != m.shape or tq.shape[0] != t.shape[0]:
            raise ValueError(
                f"t, y, m must be (S, n) and tq (S, Q), got {tuple(t.shape)}, {tuple(y.shape)}, "
                f"{tuple(m.shape)}, {tuple(tq.shape)}"
            )
        t, y, tq = t.double(), y.double(), tq.double()
        L = self._chol(t, m)
        r = torch.where(m, y - self.mean, 0)
        Kq = self._k(tq, t) * m[..., None, :]  # (S, Q, n)
        alpha = torch.cholesky_solve(r[..., None], L)[..., 0]
        mu = self.mean + (Kq * alpha[..., None, :]).sum(-1)
        v = torch.linalg.solve_triangular(L, Kq.transpose(-1, -2), upper=False)  # (S, n, Q)
        prior = self.kernel.outputscale
        var = (prior - (v * v).sum(-2)).clamp_min(0) + self.noise
        return mu, var


def _channel_series(
    times: list[np.ndarray], values: list[np.ndarray], max_points: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = max(1, min(max_points, max((x.size for x in times), default=1)))
    S = len(times)
    t = torch.zeros(S, n, dtype=torch.float64)
    y = torch.zeros(S, n, dtype=torch.float64)
    m = torch.zeros(S, n, dtype=torch.bool)
    for i, (ti, yi) in enumerate(zip(times, values, strict=True)):
        if ti.size > n:  # keep an evenly spaced subset (fitting only; prediction never truncates)
            sel = np.linspace(0, ti.size - 1, n).round().astype(int)
            ti, yi = ti[sel], yi[sel]
        k = ti.size
        t[i, :k] = torch.as_tensor(ti)
        y[i, :k] = torch.as_tensor(yi)
        m[i, :k] = True
    return t, y, m


def fit_channel_gps(
    series: dict[int, tuple[list[np.ndarray], list[np.ndarray]]],
    n_channels: int,
    *,
    iters: int = 60,
    lr: float = 0.05,
    max_points: int = 64,
) -> list[ChannelGP]:
    """Fit one :class:`ChannelGP` per channel by Adam on the summed exact log marginal likelihood.

    Parameters
    ----------
    series
        ``channel -> (list of time arrays, list of value arrays)``, one pair per training stay
        (only stays where the channel has at least one point).
    max_points
        series longer than this are thinned evenly for fitting (exact GP cost is ``n^3``).
    """
    check_positive_int(n_channels, "n_channels")
    check_positive_int(iters, "iters")
    gps: list[ChannelGP] = []
    for c in range(n_channels):
        gp = ChannelGP()
        ts, ys = series.get(c, ([], []))
        if ts:
            t, y, m = _channel_series(ts, ys, max_points)
            check_finite(torch.where(m, y, 0), f"values of channel {c}")
            with torch.no_grad():
                obs = y[m]
                gp.mean.fill_(float(obs.mean()))
                var = float(obs.var()) if obs.numel() > 1 else 1e-2
                gp.kernel.outputscale = max(var, 1e-6)
            opt = torch.optim.Adam(gp.parameters(), lr=lr)
            n_pts = int(m.sum())
            for _ in range(iters):
                opt.zero_grad()
                loss = -gp.log_marginal(t, y, m) / n_pts
                loss.backward()
                opt.step()
        gp.eval()
        gps.append(gp)
    return gps


@torch.no_grad()
def predict_channel_gps(
    gps: list[ChannelGP],
    obs_times: torch.Tensor,
    obs_channels: torch.Tensor,
    obs_values: torch.Tensor,
    obs_mask: torch.Tensor,
    query_times: torch.Tensor,
    query_channels: torch.Tensor,
    query_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-stay, per-channel exact GP forecasts for a padded batch.

    Returns ``mean`` and ``std`` ``(B, Q)`` (float64; 0 / 1 at padded queries).
    """
    B, Q = query_times.shape
    mean = torch.zeros(B, Q, dtype=torch.float64)
    std = torch.ones(B, Q, dtype=torch.float64)
    for c in torch.unique(query_channels[query_mask]).tolist():
        qsel = query_mask & (query_channels == c)
        rows = torch.nonzero(qsel.any(1)).flatten()
        om = obs_mask[rows] & (obs_channels[rows] == c)
        n = max(1, int(om.sum(1).max()))
        nq = int(qsel[rows].sum(1).max())
        t = torch.zeros(len(rows), n, dtype=torch.float64)
        y = torch.zeros_like(t)
        m = torch.zeros(len(rows), n, dtype=torch.bool)
        tq = torch.zeros(len(rows), nq, dtype=torch.float64)
        for j, r in enumerate(rows.tolist()):
            sel = om[j]
            k = int(sel.sum())
            t[j, :k] = obs_times[r][sel].double()
            y[j, :k] = obs_values[r][sel].double()
            m[j, :k] = True
            qs = qsel[r]
            tq[j, : int(qs.sum())] = query_times[r][qs].double()
        mu, var = gps[c].predict(t, y, m, tq)
        for j, r in enumerate(rows.tolist()):
            qs = qsel[r]
            kq = int(qs.sum())
            mean[r, qs] = mu[j, :kq]
            std[r, qs] = var[j, :kq].sqrt()
    return mean, std
