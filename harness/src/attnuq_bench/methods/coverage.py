"""Unified coverage calibration: every method's interval scaled to the same held-out coverage.

A thin layer over :mod:`attnuq.conformal` (normalised split conformal): for a central ``level``
interval ``[l, u]`` around the predictive mean ``m``, scaling the spread about ``m`` by ``c``
gives ``[m - c (m - l), m + c (u - m)]``; each held-out pair needs the score
``c_i = max((m - y)/(m - l), (y - m)/(u - m))_+`` (:func:`needed_scales`), and the factor is the
``ceil((n + 1) level)``-th smallest score (:func:`coverage_scale`), which gives coverage
``>= level`` for a new exchangeable point.

Used twice: as the "+ conformal" step of SA (on the ``cal`` part) and as the benchmark's unified
coverage calibration that puts every method on the same coverage before widths are compared.

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

from attnuq.conformal import conformal_scale, conformal_scores
from attnuq.predictive import check_level
from attnuq_bench.methods._base import PredictiveLike

__all__ = ["coverage_scale", "needed_scales"]


def needed_scales(pred: PredictiveLike, targets: torch.Tensor, level: float = 0.95) -> torch.Tensor:
    """``(B, ...)`` scale each target needs to lie on the edge of the scaled ``level`` interval.

    With the predictive mean ``m`` and the unscaled central ``level`` interval ``[l, u]``,

        c_i = max((m - y)/(m - l), (y - m)/(u - m))_+ ;

    ``y`` lies in ``pred.scaled(c).interval(level)`` iff ``c_i <= c``. ``pred`` is a
    :class:`~attnuq.predictive.Predictive` (samples ``(S, B, ...)``) or a
    :class:`~attnuq.predictive.GaussianPredictive` (``(B, ...)``); ``targets`` is ``(B, ...)``.

    Examples
    --------
    For ``N(0, 1)`` and ``level=0.95`` the interval is ``+-1.96``:

    >>> import torch
    >>> from attnuq.predictive import GaussianPredictive
    >>> g = GaussianPredictive(mean=torch.zeros(3), std=torch.ones(3))
    >>> needed_scales(g, torch.tensor([0.0, 1.96, -3.92]), level=0.95).round(decimals=2)
    tensor([0., 1., 2.])
    """
    level = check_level(level)
    return conformal_scores(pred, targets, alpha=1.0 - level)


def coverage_scale(pred: PredictiveLike, targets: torch.Tensor, level: float = 0.95) -> float:
    """Split-conformal factor ``c`` so that ``pred.scaled(c).interval(level)`` covers ``level``.

    ``c`` is the ``ceil((n + 1) level)``-th smallest of the ``n`` scores of
    :func:`needed_scales` (all elements of ``targets`` ``(B, ...)`` pooled), which gives coverage
    ``>= level`` for a new exchangeable pair.

    Examples
    --------
    Targets twice as spread as the predictive need a factor near 2:

    >>> import torch
    >>> from attnuq.predictive import GaussianPredictive
    >>> g = GaussianPredictive(mean=torch.zeros(99), std=torch.ones(99))
    >>> y = 2 * torch.randn(99, generator=torch.Generator().manual_seed(0))
    >>> c = coverage_scale(g, y, level=0.9)
    >>> round(c, 2)
    1.98
    >>> lo, hi = g.scaled(c).interval(0.9)
    >>> round(float(((lo <= y) & (y <= hi)).float().mean()), 3)  # 90 of 99 scores
    0.909
    """
    level = check_level(level)
    return float(conformal_scale(pred, targets, alpha=1.0 - level).factor)
