"""Rescaling a predictive distribution's central interval to a target coverage.

For a central ``level`` interval ``[l, u]`` around the predictive mean ``m``, scaling the spread
about ``m`` by ``c > 0`` gives ``[m - c (m - l), m + c (u - m)]`` (exact for both
:class:`~attnuq.predictive.Predictive` -- quantiles of ``m + c (x - m)`` -- and
:class:`~attnuq.predictive.GaussianPredictive`). Each held-out pair ``(x_i, y_i)`` needs

    c_i = (y_i - m_i) / (u_i - m_i)  if y_i >= m_i,   else  (m_i - y_i) / (m_i - l_i)

to be covered. The split-conformal factor is the ``ceil((n + 1) level)``-th smallest ``c_i``;
then a new exchangeable point is covered with probability ``>= level`` (finite-sample guarantee of
split conformal prediction with the normalised score ``c_i``).

This is used twice: as the "+ conformal" step of SA (on the ``cal`` part) and as the benchmark's
unified coverage calibration that puts every method on the same coverage before comparing widths.

Examples
--------
>>> import torch
>>> from attnuq.predictive import GaussianPredictive
>>> g = GaussianPredictive(mean=torch.zeros(200), std=torch.full((200,), 0.5))
>>> y = torch.randn(200, generator=torch.Generator().manual_seed(0))
>>> 1.5 < coverage_scale(g, y, level=0.95) < 2.8
True
"""

from __future__ import annotations

import torch

from attnuq.baselines._base import PredictiveLike, conformal_quantile
from attnuq.predictive import GaussianPredictive, check_level

__all__ = ["coverage_scale", "needed_scales", "predictive_center"]


def predictive_center(pred: PredictiveLike) -> torch.Tensor:
    """``(B, ...)`` the point about which :meth:`scaled` scales: the mean."""
    return pred.mean


def needed_scales(pred: PredictiveLike, targets: torch.Tensor, level: float = 0.95) -> torch.Tensor:
    """Per-element scale ``c_i`` that puts ``targets`` on the edge of the scaled interval.

    Returns ``(N,)`` (all elements flattened), ``inf`` where the interval has zero width on the
    side of the target.
    """
    level = check_level(level)
    lo, hi = pred.interval(level)
    m = predictive_center(pred)
    if targets.shape != m.shape:
        raise ValueError(
            f"targets must have the predictive's shape {tuple(m.shape)}, got {tuple(targets.shape)}"
        )
    if not bool(torch.isfinite(targets).all()):
        raise ValueError("targets contain non-finite values")
    y, m, lo, hi = (t.double().reshape(-1) for t in (targets, m, lo, hi))
    up = y >= m
    num = torch.where(up, y - m, m - y)
    den = torch.where(up, hi - m, m - lo).clamp_min(0)
    c = torch.where(den > 0, num / den.clamp_min(1e-300), torch.where(num > 0, torch.inf, 0.0))
    return c


def coverage_scale(pred: PredictiveLike, targets: torch.Tensor, level: float = 0.95) -> float:
    """Split-conformal scale factor so that ``pred.scaled(c).interval(level)`` covers ``level``."""
    c = needed_scales(pred, targets, level)
    if bool(torch.isinf(c).any()):
        n_inf = int(torch.isinf(c).sum())
        if isinstance(pred, GaussianPredictive):
            raise ValueError(f"{n_inf} held-out targets fall where the predictive std is zero")
        c = torch.where(torch.isinf(c), torch.finfo(torch.float64).max, c)
    return conformal_quantile(c, alpha=1.0 - level)
