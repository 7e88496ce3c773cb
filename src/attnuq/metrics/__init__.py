"""Scores for predictive distributions: pure functions, samples first.

Ensemble metrics take ``samples`` ``(S, B, ...)`` and ``targets`` ``(B, ...)``; interval
metrics take ``lower, upper, targets`` of one shape; normal metrics ``mean, std, targets``.
Classification scores take class probabilities ``probs`` ``(B, C)`` (or ``(B,)`` binary) and
integer ``targets`` ``(B,)``; selective-prediction scores an ``uncertainty`` ``(B,)`` and
``errors`` ``(B,)``; set scores boolean ``sets`` ``(B, C)``.
Every function checks its inputs (non-empty, finite, matching shapes, naming both shapes).

Examples
--------
>>> import torch
>>> from attnuq import metrics
>>> x, y = torch.randn(50, 100), torch.randn(100)
>>> metrics.crps_samples(x, y).shape
torch.Size([])
"""

from attnuq.metrics._classification import (
    CalibrationBins,
    auprc,
    aurc,
    auroc,
    auroc_error,
    brier_probs,
    calibration_bins,
    ece_probs,
    entropy_probs,
    mutual_information_samples,
    nll_probs,
    risk_coverage,
    set_coverage,
    set_size,
)
from attnuq.metrics._crps import crps_normal, crps_samples, nll_normal
from attnuq.metrics._fields import (
    lat_weighted_acc,
    lat_weighted_rmse,
    latitude_weights,
    rmse,
    spearman_spread_error,
)
from attnuq.metrics._intervals import coverage, interval_score, interval_width
from attnuq.metrics._pit import dispersion_factor, pit_samples, pit_w1, pit_w1_scaled

__all__ = [
    "CalibrationBins",
    "auprc",
    "aurc",
    "auroc",
    "auroc_error",
    "brier_probs",
    "calibration_bins",
    "coverage",
    "crps_normal",
    "crps_samples",
    "dispersion_factor",
    "ece_probs",
    "entropy_probs",
    "interval_score",
    "interval_width",
    "lat_weighted_acc",
    "lat_weighted_rmse",
    "latitude_weights",
    "mutual_information_samples",
    "nll_normal",
    "nll_probs",
    "pit_samples",
    "pit_w1",
    "pit_w1_scaled",
    "risk_coverage",
    "rmse",
    "set_coverage",
    "set_size",
    "spearman_spread_error",
]
