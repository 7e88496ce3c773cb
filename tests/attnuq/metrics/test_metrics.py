"""Every metric against a closed form or a brute-force definition (float64)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tests.attnuq.metrics._reference_metrics import (
    crps_fair_loop,
    crps_normal_integral,
    interval_score_loop,
    lat_acc_loop,
    lat_rmse_loop,
    w1_uniform_numeric,
)

from attnuq import metrics as M

D = torch.float64


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def dkw_eps(n: int, p_fail: float = 1e-6) -> float:
    """DKW: P(sup|F_n - F| > eps) <= 2 exp(-2 n eps^2) = p_fail; W1 <= sup|F_n - F|."""
    return math.sqrt(math.log(2 / p_fail) / (2 * n))


# ----------------------------------------------------------------------------- CRPS
def test_crps_samples_matches_scoringrules_fair() -> None:
    import scoringrules as sr  # the 'bench' extra; not skipped: this is the agreement test

    g = gen(1)
    x = torch.randn(7, 5, 3, generator=g, dtype=D)
    y = torch.randn(5, 3, generator=g, dtype=D)
    ours = M.crps_samples(x, y, reduction="none").numpy()
    ref = sr.crps_ensemble(y.numpy(), x.numpy(), m_axis=0, estimator="fair", backend="numpy")
    np.testing.assert_allclose(ours, ref, rtol=1e-12, atol=1e-12)


def test_normal_scores_and_interval_score_match_scoringrules() -> None:
    """crps_normal, nll_normal and interval_score against scoringrules on random inputs.

    Float64, targets out to ~|z| = 15 and spreads from 0.05 to 2; the formulas are the same
    (scoringrules' numpy backend), so the tolerance is rounding: 1e-12 relative.
    """
    import scoringrules as sr

    g = gen(11)
    n = 2000
    mu = 3 * torch.randn(n, generator=g, dtype=D)
    sd = 0.05 + 2 * torch.rand(n, generator=g, dtype=D)
    y = mu + 4 * sd * torch.randn(n, generator=g, dtype=D)
    yn, mn, sn = y.numpy(), mu.numpy(), sd.numpy()
    tol = {"rtol": 1e-12, "atol": 1e-14}
    np.testing.assert_allclose(M.crps_normal(mu, sd, y, reduction="none").numpy(),
                               sr.crps_normal(yn, mn, sn, backend="numpy"), **tol)
    np.testing.assert_allclose(M.nll_normal(mu, sd, y, reduction="none").numpy(),
                               sr.logs_normal(yn, mn, sn, backend="numpy"), **tol)
    for level in (0.5, 0.9, 0.95):
        half = sd * (0.5 + torch.rand(n, generator=g, dtype=D))
        lo, hi = mu - half, mu + half  # a mix of covered and missed targets
        ours = M.interval_score(lo, hi, y, level=level, reduction="none").numpy()
        ref = sr.interval_score(yn, lo.numpy(), hi.numpy(), 1.0 - level, backend="numpy")
        np.testing.assert_allclose(ours, ref, **tol)


def test_crps_samples_matches_loop_with_ties() -> None:
    g = gen(2)
    x = torch.randint(0, 3, (6, 4), generator=g).to(D)  # many ties
    y = torch.tensor([0.0, 1.0, 2.5, -1.0], dtype=D)
    ours = M.crps_samples(x, y, reduction="none")
    for b in range(4):
        ref = crps_fair_loop(x[:, b].numpy(), y[b].item())
        assert ours[b].item() == pytest.approx(ref, abs=1e-12)


def test_crps_normal_matches_integral_and_fair_estimator_is_unbiased() -> None:
    for mu, sd, y in [(0.0, 1.0, 0.0), (1.5, 0.3, -0.2), (-2.0, 4.0, 3.0)]:
        t = lambda v: torch.tensor([v], dtype=D)  # noqa: E731
        closed = M.crps_normal(t(mu), t(sd), t(y)).item()
        assert closed == pytest.approx(crps_normal_integral(mu, sd, y), abs=1e-6)
    # Fair CRPS of S normal draws is unbiased for the closed form. Mean difference over B
    # independent elements vs 5 standard errors (empirical): false failure ~ 6e-7.
    g = gen(3)
    b, s = 4000, 20
    mu = torch.randn(b, generator=g, dtype=D)
    sd = torch.rand(b, generator=g, dtype=D) + 0.5
    y = torch.randn(b, generator=g, dtype=D) * 1.5
    x = mu + sd * torch.randn(s, b, generator=g, dtype=D)
    diff = M.crps_samples(x, y, reduction="none") - M.crps_normal(mu, sd, y, reduction="none")
    se = diff.std() / math.sqrt(b)
    assert abs(diff.mean().item()) < 5 * se.item()


def test_nll_normal_matches_torch_distribution() -> None:
    g = gen(4)
    mu, y = torch.randn(10, generator=g, dtype=D), torch.randn(10, generator=g, dtype=D)
    sd = torch.rand(10, generator=g, dtype=D) + 0.1
    ref = -torch.distributions.Normal(mu, sd).log_prob(y)
    torch.testing.assert_close(M.nll_normal(mu, sd, y, reduction="none"), ref)
    with pytest.raises(ValueError, match="std must be strictly positive"):
        M.nll_normal(mu, torch.zeros(10, dtype=D), y)


# ----------------------------------------------------------------------------- PIT and W1
def test_pit_w1_exact_cases() -> None:
    n = 257
    grid = (torch.arange(n, dtype=D) + 0.5) / n
    assert M.pit_w1(grid).item() == pytest.approx(1 / (4 * n), rel=1e-12)
    assert M.pit_w1(torch.zeros(10, dtype=D)).item() == pytest.approx(0.5)
    assert M.pit_w1(torch.ones(10, dtype=D)).item() == pytest.approx(0.5)
    assert M.pit_w1(torch.full((3,), 0.5, dtype=D)).item() == pytest.approx(0.25)
    u = torch.rand(50, generator=gen(5), dtype=D) ** 2
    # grid trapezoid error on a step function: <= 2 * n_jumps / n_grid
    assert M.pit_w1(u).item() == pytest.approx(w1_uniform_numeric(u.numpy()), abs=1e-4)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        M.pit_w1(torch.tensor([0.5, 1.5]))


def test_pit_samples_matches_counting_definition() -> None:
    x = torch.tensor([[0.0, 1.0], [1.0, 1.0], [2.0, 1.0]], dtype=D)  # (S=3, B=2)
    y = torch.tensor([1.0, 1.0], dtype=D)
    u = M.pit_samples(x, y, generator=gen(6))
    w = torch.rand(2, generator=gen(6), dtype=D)
    # column 0: one below, one tie; column 1: three ties
    expected = torch.stack([(1 + w[0] * 2) / 4, (0 + w[1] * 4) / 4])
    torch.testing.assert_close(u, expected)


@pytest.mark.parametrize("discrete", [False, True])
def test_pit_of_calibrated_ensemble_is_uniform(discrete: bool) -> None:
    # targets and draws exchangeable -> randomised PIT exactly U(0,1) (ties included);
    # DKW bound with false-failure probability 1e-6.
    g = gen(7)
    n, s = 20000, 9
    if discrete:
        rate = torch.full((s + 1, n), 2.0, dtype=D)
        allv = torch.poisson(rate, generator=g)
    else:
        allv = torch.randn(s + 1, n, generator=g, dtype=D)
    u = M.pit_samples(allv[1:], allv[0], generator=g)
    assert M.pit_w1(u).item() < dkw_eps(n)
    # and a 2x over-dispersed ensemble is far from uniform
    u_bad = M.pit_samples(2 * allv[1:] - allv[1:].mean(), allv[0], generator=g)
    assert M.pit_w1(u_bad).item() > 3 * dkw_eps(n) or discrete


def test_scaled_w1_removes_dispersion_error_only() -> None:
    g = gen(8)
    n, s, k_true = 20000, 30, 3.0
    y = torch.randn(n, generator=g, dtype=D)
    x = torch.randn(s, n, generator=g, dtype=D) / k_true  # 3x under-dispersed, right shape
    k = M.dispersion_factor(x, y).item()
    # relative se of k ~ sqrt(1/(2n)) (chi-square of n terms); 5 se plus the sampling of var
    assert k == pytest.approx(k_true, rel=5 * math.sqrt(1 / (2 * n)) + 5 * math.sqrt(1 / (n * s)))
    assert M.pit_w1(M.pit_samples(x, y, generator=g)).item() > 0.1
    # DKW eps plus the effect of k's relative error (< 1 %) on PIT values (< 0.01)
    assert M.pit_w1_scaled(x, y, generator=g).item() < dkw_eps(n) + 0.01
    # a skewed (wrong-shape) ensemble stays far from uniform after rescaling
    xe = torch.distributions.Exponential(torch.tensor(1.0, dtype=D)).sample((s, n)) - 1.0
    assert M.pit_w1_scaled(xe, y, generator=g).item() > 3 * dkw_eps(n)


# ----------------------------------------------------------------------------- intervals
def test_coverage_of_exact_quantiles_equals_level() -> None:
    # y ~ N(0,1), exact central 90 % interval: coverage is Binomial(n, .9)/n; 5 sigma -> 6e-7
    n, level = 40000, 0.9
    y = torch.randn(n, generator=gen(9), dtype=D)
    z = math.sqrt(2) * torch.erfinv(torch.tensor(level, dtype=D))
    lo, hi = torch.full((n,), -z.item(), dtype=D), torch.full((n,), z.item(), dtype=D)
    cov = M.coverage(lo, hi, y).item()
    assert abs(cov - level) < 5 * math.sqrt(level * (1 - level) / n)


def test_interval_width_and_score_vs_loop() -> None:
    g = gen(10)
    lo = torch.randn(200, generator=g, dtype=D)
    hi = lo + torch.rand(200, generator=g, dtype=D)
    y = torch.randn(200, generator=g, dtype=D)
    ref = interval_score_loop(lo.numpy(), hi.numpy(), y.numpy(), alpha=0.2)
    np.testing.assert_allclose(M.interval_score(lo, hi, y, level=0.8, reduction="none"), ref)
    assert M.interval_width(lo, hi).item() == pytest.approx((hi - lo).mean().item())
    inside = ((y >= lo) & (y <= hi)).to(D)
    torch.testing.assert_close(M.coverage(lo, hi, y, reduction="none"), inside)
    with pytest.raises(ValueError, match="lower must not exceed upper"):
        M.interval_width(hi, lo)


# ----------------------------------------------------------------------------- fields
def test_rmse_and_lat_weighted_scores_vs_loops() -> None:
    g = gen(11)
    f = torch.randn(3, 5, 4, generator=g, dtype=D)
    o = torch.randn(3, 5, 4, generator=g, dtype=D)
    clim = torch.randn(5, 4, generator=g, dtype=D)
    lat = torch.linspace(-80, 80, 5, dtype=D)
    assert M.rmse(f, o).item() == pytest.approx(math.sqrt(((f - o) ** 2).mean().item()))
    torch.testing.assert_close(M.rmse(f, o, reduction="none"), ((f - o) ** 2).mean((1, 2)).sqrt())
    assert M.lat_weighted_rmse(f, o, lat).item() == pytest.approx(
        lat_rmse_loop(f.numpy(), o.numpy(), lat.numpy()), rel=1e-12
    )
    assert M.lat_weighted_acc(f, o, clim, lat).item() == pytest.approx(
        lat_acc_loop(f.numpy(), o.numpy(), clim.numpy(), lat.numpy()), rel=1e-12
    )
    assert M.lat_weighted_acc(f, f, clim, lat).item() == pytest.approx(1.0, abs=1e-12)
    per = M.lat_weighted_acc(f, f, clim, lat, reduction="none")
    torch.testing.assert_close(per, torch.ones(3, dtype=D))
    neg = 2 * clim - f  # anomalies of opposite sign
    assert M.lat_weighted_acc(f, neg, clim, lat, reduction="mean").item() == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="one entry per grid row"):
        M.lat_weighted_rmse(f, o, lat[:4])


def test_spearman_matches_scipy_with_ties() -> None:
    stats = pytest.importorskip("scipy.stats")
    g = gen(12)
    spread = torch.randint(0, 5, (300,), generator=g).to(D)
    center = torch.zeros(300, dtype=D)
    y = spread * torch.randn(300, generator=g, dtype=D)
    ours = M.spearman_spread_error(spread, center, y).item()
    ref = stats.spearmanr(spread.numpy(), y.abs().numpy()).statistic
    assert ours == pytest.approx(ref, abs=1e-12)


# ----------------------------------------------------------------------------- validation
X = torch.randn(4, 3, dtype=D)  # (S, B)
Y = torch.randn(3, dtype=D)
LAT = torch.tensor([0.0, 10.0], dtype=D)
F = torch.randn(2, 2, 3, dtype=D)

CALLS = {
    "pit_samples": lambda x, y: M.pit_samples(x, y),
    "crps_samples": lambda x, y: M.crps_samples(x, y),
    "pit_w1_scaled": lambda x, y: M.pit_w1_scaled(x, y),
    "dispersion_factor": lambda x, y: M.dispersion_factor(x, y),
    "coverage": lambda x, y: M.coverage(x[0], x[0] + 1, y),
    "interval_score": lambda x, y: M.interval_score(x[0], x[0] + 1, y, level=0.9),
    "crps_normal": lambda x, y: M.crps_normal(x[0], x[0].abs() + 1, y),
    "nll_normal": lambda x, y: M.nll_normal(x[0], x[0].abs() + 1, y),
    "rmse": lambda x, y: M.rmse(x[0], y),
    "spearman_spread_error": lambda x, y: M.spearman_spread_error(x[0].abs(), x[1], y),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_every_metric_validates_inputs(name: str) -> None:
    fn = CALLS[name]
    fn(X, Y)  # valid call works
    bad = Y.clone()
    bad[1] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        fn(X, bad)
    with pytest.raises(ValueError, match=r"\(4,\)|\(3,\)") as info:
        fn(X, torch.randn(4, dtype=D))
    msg = str(info.value)  # names both shapes: targets (4,) and predictions (3,) or (4, 3)
    assert "(4,)" in msg and ("(3,)" in msg or "(4, 3)" in msg)
    with pytest.raises(ValueError, match=r"empty|shape"):
        fn(torch.empty(4, 0, dtype=D), torch.empty(0, dtype=D))


def test_field_metrics_and_w1_validate_inputs() -> None:
    with pytest.raises(ValueError, match="empty"):
        M.pit_w1(torch.empty(0))
    with pytest.raises(ValueError, match="non-finite"):
        M.pit_w1(torch.tensor([0.1, float("nan")]))
    with pytest.raises(ValueError, match=r"\(2, 2, 3\).*\(2, 2, 2\)"):
        M.lat_weighted_rmse(F, F[..., :2], LAT)
    with pytest.raises(ValueError, match="climatology"):
        M.lat_weighted_acc(F, F, torch.zeros(5), LAT)
    with pytest.raises(ValueError, match="reduction"):
        M.crps_samples(X, Y, reduction="sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least 2 draws"):
        M.crps_samples(X[:1], Y)


def test_predictive_convenience_methods_call_the_metrics() -> None:
    from attnuq.predictive import GaussianPredictive, Predictive

    g = gen(13)
    x, y = torch.randn(20, 7, generator=g, dtype=D), torch.randn(7, generator=g, dtype=D)
    p = Predictive(samples=x)
    torch.testing.assert_close(p.crps(y, reduction="none"), M.crps_samples(x, y, reduction="none"))
    torch.testing.assert_close(p.pit(y, generator=gen(1)), M.pit_samples(x, y, generator=gen(1)))
    gp = GaussianPredictive(torch.zeros(7, dtype=D), torch.ones(7, dtype=D))
    torch.testing.assert_close(gp.crps(y), M.crps_normal(gp.mean, gp.std, y))
    torch.testing.assert_close(gp.nll(y), M.nll_normal(gp.mean, gp.std, y))
