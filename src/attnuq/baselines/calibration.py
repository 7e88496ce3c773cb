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

from attnuq.baselines._base import PredictiveLike
from attnuq.conformal import conformal_scale, conformal_scores
from attnuq.predictive import check_level

__all__ = ["coverage_scale", "needed_scales"]


def needed_scales(pred: PredictiveLike, targets: torch.Tensor, level: float = 0.95) -> torch.Tensor:
    """``(B, ...)`` scale each target needs to lie on the edge of the scaled ``level`` interval."""
    level = check_level(level)
    return conformal_scores(pred, targets, alpha=1.0 - level)


def coverage_scale(pred: PredictiveLike, targets: torch.Tensor, level: float = 0.95) -> float:
    """Split-conformal factor ``c`` so that ``pred.scaled(c).interval(level)`` covers ``level``."""
    level = check_level(level)
    return float(conformal_scale(pred, targets, alpha=1.0 - level).factor)
