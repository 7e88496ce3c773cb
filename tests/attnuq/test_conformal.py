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


def _floor_part(g: torch.Generator, n: int, base: float = 0.3
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A spread that misses a constant noise part: truth sd ``base + sigma``, reported sigma."""
    f = torch.randn(n, generator=g, dtype=D)
    sigma = torch.rand(n, generator=g, dtype=D)
    return f, sigma, f + (base + sigma) * torch.randn(n, generator=g, dtype=D)


def test_floor_limits_are_plain_and_normalised_conformal() -> None:
    """``beta = inf`` is plain conformal on |y - f| (and a huge finite beta tends to it);
    ``beta = 0`` is conformal_scale on N(f, sigma^2) (the SA-normalised interval)."""
    from attnuq.conformal import fit_floor, floor_scores

    g = torch.Generator().manual_seed(3)
    val, cal, test = (_floor_part(g, 399) for _ in range(3))
    alpha = 0.1
    plain = fit_floor(val, cal, alpha=alpha, grid=(math.inf,))
    q = conformal_quantile((cal[2] - cal[0]).abs(), alpha)
    assert plain.factor == float(q) and math.isinf(plain.beta)
    lo, hi = plain.interval(test[0], test[1])
    torch.testing.assert_close(hi - test[0], torch.full_like(hi, float(q)), rtol=1e-15, atol=0)
    torch.testing.assert_close(test[0] - lo, hi - test[0], rtol=1e-15, atol=1e-15)
    big = fit_floor(val, cal, alpha=alpha, grid=(1e7,))
    _, bhi = big.interval(test[0], test[1])
    torch.testing.assert_close(bhi, hi, rtol=1e-9, atol=1e-9)
    zero = fit_floor(val, cal, alpha=alpha, grid=(0.0,))
    cs = conformal_scale(GaussianPredictive(cal[0], cal[1]), cal[2], alpha=alpha)
    zlo, zhi = zero.interval(test[0], test[1])
    clo, chi = cs.interval(GaussianPredictive(test[0], test[1]))
    torch.testing.assert_close(zlo, clo, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(zhi, chi, rtol=1e-12, atol=1e-12)
    # the Gaussian form has the floor's interval at the fitted level
    _, ghi = zero.predictive(test[0], test[1]).interval(1 - alpha)
    torch.testing.assert_close(ghi, zhi, rtol=1e-12, atol=1e-12)
    # a score is membership of the interval: r <= q iff y inside
    r = floor_scores(test[0], test[1], test[2], zero.beta)
    inside = (test[2] >= zlo) & (test[2] <= zhi)
    assert torch.equal(inside, r <= zero.factor)


def test_floor_coverage_and_width_on_exchangeable_data() -> None:
    """R = 100 independent (val, cal, test) draws, n = 199 each, alpha = 0.1: the mean coverage
    lies in [1 - a, 1 - a + 1/(n+1)] up to 5 se (per split sd <= sqrt(a(1-a)/n_test +
    a(1-a)/(n_cal+2)) ~ 0.030, se over R = 0.0030; normal approximation: false failure <
    1e-6); the floor chosen is interior (truth sd 0.3 + sigma) and narrower on test than both
    limits on average."""
    from attnuq.conformal import fit_floor

    g = torch.Generator().manual_seed(4)
    alpha, n, reps = 0.1, 199, 100
    covs, w_floor, w_plain, w_norm, units = [], [], [], [], []
    for _ in range(reps):
        val, cal, test = (_floor_part(g, n) for _ in range(3))
        fc = fit_floor(val, cal, alpha=alpha)
        lo, hi = fc.interval(test[0], test[1])
        covs.append(float(((test[2] >= lo) & (test[2] <= hi)).to(D).mean()))
        w_floor.append(float((hi - lo).mean()))
        units.append(fc.beta_units)
        for grid, acc in (((math.inf,), w_plain), ((0.0,), w_norm)):
            f = fit_floor(val, cal, alpha=alpha, grid=grid)
            a, b = f.interval(test[0], test[1])
            acc.append(float((b - a).mean()))
    per_sd = math.sqrt(alpha * (1 - alpha) / n + alpha * (1 - alpha) / (n + 2))
    tol = 5 * per_sd / math.sqrt(reps)
    cov = sum(covs) / reps
    assert 1 - alpha - tol <= cov <= 1 - alpha + 1 / (n + 1) + tol
    assert sorted(units)[reps // 2] not in (0.0, math.inf)  # the median choice is interior
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    assert mean(w_floor) < min(mean(w_plain), mean(w_norm))


def test_floor_errors_name_the_bad_value() -> None:
    from attnuq.conformal import fit_floor, floor_scores

    z = torch.zeros(5, dtype=D)
    o = torch.ones(5, dtype=D)
    with pytest.raises(ValueError, match=r"got beta=-1\.0"):
        floor_scores(z, o, o, -1.0)
    with pytest.raises(ValueError, match=r"sigma.shape=\(4,\)"):
        floor_scores(z, o[:4], o, 1.0)
    with pytest.raises(ValueError, match="sigma must be non-negative"):
        floor_scores(z, -o, o, 1.0)
    with pytest.raises(ValueError, match="val must be a"):
        fit_floor((z, o), (z, o, o))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="grid must be"):
        fit_floor((z, o, o), (z, o, o), grid=())
    with pytest.raises(ValueError, match="residual scale is 0"):
        fit_floor((z, o, z), (z, o, o))
    with pytest.raises(ValueError, match="too few calibration scores"):
        fit_floor((z, o, o), (z, o, o), alpha=0.05)
    with pytest.raises(ValueError, match="factor is infinite"):
        part = (torch.zeros(99, dtype=D),) * 2 + (torch.ones(99, dtype=D),)  # sigma = 0
        fit_floor(part, part, grid=(0.0,), alpha=0.1)
