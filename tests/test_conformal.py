"""Split-conformal scaling: finite-sample coverage on exchangeable synthetic data."""

from __future__ import annotations

import math

import pytest
import torch

from attnuq.conformal import conformal_quantile, conformal_scale, conformal_scores
from attnuq.predictive import GaussianPredictive, Predictive

D = torch.float64


def _data(g: torch.Generator, n: int, reps: int, s: int) -> tuple[Predictive, torch.Tensor]:
    """Heteroscedastic truth y ~ N(mu, sigma^2); SA-like samples 2x too narrow, (S, n, reps)."""
    mu = torch.randn(n, reps, generator=g, dtype=D)
    sigma = 0.2 + torch.rand(n, reps, generator=g, dtype=D)
    y = mu + sigma * torch.randn(n, reps, generator=g, dtype=D)
    x = mu + 0.5 * sigma * torch.randn(s, n, reps, generator=g, dtype=D)
    return Predictive(samples=x), y


@pytest.mark.parametrize("kind", ["samples", "gaussian"])
def test_finite_sample_coverage_over_repetitions(kind: str) -> None:
    # R independent calibration/test splits run side by side as columns (per_element=True gives
    # one factor per column). Conformal theory: E[coverage] in [1-a, 1-a + 1/(n+1)].
    # Per split, coverage has sd <= sqrt(a(1-a)/n_test + a(1-a)/(n_cal+2)) ~ 0.022; averaged
    # over R=400 the se is <= 0.0011; tolerance 5 se -> false failure < 1e-6.
    g = torch.Generator().manual_seed(0)
    alpha, n_cal, n_test, reps, s = 0.1, 199, 200, 400, 40
    cal, y_cal = _data(g, n_cal, reps, s)
    test, y_test = _data(g, n_test, reps, s)
    if kind == "gaussian":
        cal = GaussianPredictive(cal.mean, cal.std)  # type: ignore[assignment]
        test = GaussianPredictive(test.mean, test.std)  # type: ignore[assignment]
    cs = conformal_scale(cal, y_cal, alpha=alpha, per_element=True)
    assert cs.factor.shape == (reps,)
    assert cs.n == n_cal
    lo, hi = cs.interval(test)
    cov = ((y_test >= lo) & (y_test <= hi)).to(D).mean(0)  # (reps,)
    per_sd = math.sqrt(alpha * (1 - alpha) / n_test + alpha * (1 - alpha) / (n_cal + 2))
    tol = 5 * per_sd / math.sqrt(reps)
    assert cov.mean().item() >= 1 - alpha - tol
    assert cov.mean().item() <= 1 - alpha + 1 / (n_cal + 1) + tol
    # raw intervals (2x too narrow) undercover by far; the factor repairs them
    raw_lo, raw_hi = test.interval(1 - alpha)
    raw = ((y_test >= raw_lo) & (y_test <= raw_hi)).to(D).mean()
    assert raw.item() < 1 - alpha - 0.2
    assert cs.factor.median().item() > 1.5


def test_score_is_exact_membership_of_scaled_interval() -> None:
    g = torch.Generator().manual_seed(1)
    pred, y = _data(g, 300, 1, 25)
    y = y[:, 0]
    pred = Predictive(samples=pred.samples[..., 0])
    r = conformal_scores(pred, y, alpha=0.2)
    for q in (0.5, 1.0, 1.7):
        lo, hi = pred.scaled(q).interval(0.8)
        inside = (y >= lo - 1e-12) & (y <= hi + 1e-12)
        assert torch.equal(inside, r <= q)


def test_quantile_index_and_errors() -> None:
    s = torch.arange(1.0, 11.0)  # n=10
    assert conformal_quantile(s, 0.2).item() == 9.0  # ceil(11 * 0.8) = 9
    with pytest.raises(ValueError, match="too few calibration scores"):
        conformal_quantile(s, 0.05)  # ceil(11 * .95) = 11 > 10
    with pytest.raises(ValueError, match="alpha"):
        conformal_quantile(s, 1.5)
    g = GaussianPredictive(torch.zeros(3), torch.ones(3))
    with pytest.raises(ValueError, match=r"\(4,\).*\(3,\)"):
        conformal_scale(g, torch.zeros(4), alpha=0.5)
    with pytest.raises(ValueError, match="non-finite"):
        conformal_scale(g, torch.tensor([0.0, float("nan"), 1.0]), alpha=0.5)
    with pytest.raises(ValueError, match="infinite"):
        flat = GaussianPredictive(torch.zeros(3), torch.zeros(3))
        conformal_scale(flat, torch.ones(3), alpha=0.5)
