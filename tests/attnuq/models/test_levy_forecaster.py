"""Levy forecaster: exact per-channel sigma (vs explicit Poisson draws), invariances, control,
temperature and alpha fits. (Its training recipe is tested with the harness's loop in
tests/attnuq_bench/models/test_forecaster_training.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from attnuq.models.levy_forecaster import (
    LevyForecaster,
    SoftmaxForecaster,
    fit_temperature,
)

C = 3


def _inputs(B: int = 2, L: int = 6, Q: int = 4, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    ot = torch.rand(B, L, generator=g, dtype=dtype) * 24
    oc = torch.randint(0, C, (B, L), generator=g)
    ov = torch.rand(B, L, generator=g, dtype=dtype)
    om = torch.ones(B, L, dtype=torch.bool)
    if B > 1:
        om[1, -2:] = False
    qt = 24 + torch.rand(B, Q, generator=g, dtype=dtype) * 24
    qc = torch.randint(0, C, (B, Q), generator=g)
    return ot, oc, ov, om, qt, qc


def _model(**kw) -> LevyForecaster:
    torch.manual_seed(0)
    m = LevyForecaster(C, d=8, n_time_features=2, n_value_features=3, encoder_layers=1,
                       dropout=0.0, beta=2.0, h=2.0, **kw).double()
    with torch.no_grad():
        m.D.normal_(0, 0.5)  # exercise the Fourier value field too
    return m.eval()


def test_sigma_matches_explicit_poisson_draws() -> None:
    """mean and E|Y - mu|^2 | N >= 1 of the model's own sampler match mu and sigma^2.

    S = 8000 draws (alpha = 5 keeps P(N = 0) small); tolerance z = 5 standard errors of each
    Monte Carlo estimator (per query,
    16 checks in all): false-failure probability < 16 * 6e-7 = 1e-5.
    """
    m = _model(alpha=5.0)
    x = _inputs()
    out = m(*x)
    vals, ne = m.sample(*x, num_samples=8000, generator=torch.Generator().manual_seed(1))
    w = ne.double()  # condition on N_q >= 1, as the layer's moments are
    n = w.sum(0)
    assert bool((n > 4000).all())
    mu_hat = (vals * w).sum(0) / n
    sd_v = ((((vals - mu_hat) ** 2) * w).sum(0) / n).sqrt()
    assert bool(((mu_hat - out.mean).abs() <= 5 * sd_v / n.sqrt() + 1e-12).all())
    sq = (vals - out.mean) ** 2
    m_sq = (sq * w).sum(0) / n
    se_sq = ((((sq - m_sq) ** 2) * w).sum(0) / n).sqrt() / n.sqrt()
    assert bool(((m_sq - out.sigma**2).abs() <= 5 * se_sq + 1e-12).all())
    # sigma = sqrt(Sigma_V,cc * phi(Lambda)) and sigma_nophi = sqrt(Sigma_V,cc)
    from attnuq.ops.phi import poisson_phi

    torch.testing.assert_close(out.sigma, out.sigma_nophi * poisson_phi(out.evidence).sqrt())


def test_masked_padding_and_permutation_invariance() -> None:
    m = _model()
    ot, oc, ov, om, qt, qc = _inputs()
    ref = m(ot, oc, ov, om, qt, qc)
    pad = lambda x, v: torch.cat([x, torch.full_like(x[:, :3], v)], 1)  # noqa: E731
    out = m(pad(ot, 5.0), pad(oc, 1), pad(ov, 0.7), pad(om, False), qt, qc)
    torch.testing.assert_close(out.mean, ref.mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.sigma, ref.sigma, rtol=1e-12, atol=1e-12)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    out = m(ot[:, perm], oc[:, perm], ov[:, perm], om[:, perm], qt, qc)
    torch.testing.assert_close(out.mean, ref.mean, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.sigma, ref.sigma, rtol=1e-10, atol=1e-12)


def test_empty_stay_and_gradcheck() -> None:
    m = _model()
    ot, oc, ov, om, qt, qc = _inputs()
    om[0] = False
    out = m(ot, oc, ov, om, qt, qc)
    for t in (out.mean, out.sigma, out.evidence):
        assert bool(torch.isfinite(t).all())
    assert bool((out.evidence[0] == 0).all()) and bool((out.p_empty[0] == 1).all())
    ot, oc, ov, om, qt, qc = _inputs(B=1, L=4, Q=2)
    ov.requires_grad_(True)

    def f(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o = m(ot, oc, v, om, qt, qc)
        return o.mean, o.sigma

    assert torch.autograd.gradcheck(f, (ov,), eps=1e-6, atol=1e-6)


def test_softmax_control_shares_architecture() -> None:
    torch.manual_seed(0)
    lv = LevyForecaster(C, d=8, encoder_layers=1)
    sm = SoftmaxForecaster(C, d=8, encoder_layers=1)
    n_bb = lambda mod: sum(p.numel() for p in mod.backbone.parameters())  # noqa: E731
    assert n_bb(lv) == n_bb(sm)
    x = _inputs(dtype=torch.float32)
    out = sm.eval()(*x)
    assert out.mean.shape == (2, 4) and out.sigma is None
    ot, oc, ov, om, qt, qc = x
    om = om.clone()
    om[0] = False
    assert bool(torch.isfinite(sm(ot, oc, ov, om, qt, qc).mean).all())
    sm.train()
    a, b = sm(*x).mean, sm(*x).mean
    assert not torch.equal(a, b)  # dropout active in train mode (MC dropout)


def test_input_validation() -> None:
    m = _model()
    ot, oc, ov, om, qt, qc = _inputs()
    with pytest.raises(ValueError, match="obs_channels must lie in"):
        m(ot, oc + 5, ov, om, qt, qc)
    bad = ov.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="obs_values contains non-finite"):
        m(ot, oc, bad, om, qt, qc)
    with pytest.raises(ValueError, match="batch sizes differ"):
        m(ot, oc, ov, om, qt[:1], qc[:1])
    with pytest.raises(ValueError, match="beta must be"):
        LevyForecaster(C, beta=0.0)
    with pytest.raises(ValueError, match="dropout"):
        SoftmaxForecaster(C, dropout=1.5)


def test_fit_temperature_is_the_nll_minimiser() -> None:
    g = torch.Generator().manual_seed(0)
    mu, sd = torch.randn(500, generator=g), torch.rand(500, generator=g) + 0.1
    y = mu + 3.0 * sd * torch.randn(500, generator=g, dtype=torch.float32)
    T = fit_temperature(mu, sd, y)
    grid = torch.linspace(0.5 * T, 1.5 * T, 2001, dtype=torch.float64)[:, None]
    s2 = (grid * sd.double()) ** 2  # (2001, 500)
    nll = (0.5 * torch.log(s2) + (y - mu).double() ** 2 / (2 * s2)).sum(1)
    assert abs(float(grid[nll.argmin()]) - T) <= float(grid[1] - grid[0])
    with pytest.raises(ValueError, match="one length"):
        fit_temperature(mu, sd[:3], y)


def test_alpha_gets_no_gradient_from_mse_but_one_from_nll() -> None:
    """mu = sum p v with p = w / Lambda does not depend on alpha; sigma does (through phi)."""
    m = _model(alpha=1.5)
    x = _inputs()
    out = m(*x)
    (g_mse,) = torch.autograd.grad(out.mean.square().sum(), m.raw_alpha, retain_graph=True,
                                   allow_unused=True)
    (g_sig,) = torch.autograd.grad(out.sigma.sum(), m.raw_alpha)
    assert g_mse is None or abs(float(g_mse)) < 1e-10  # None: alpha is not even in mu's graph
    assert abs(float(g_sig)) > 1e-4
    mean0 = out.mean.detach()
    m.set_alpha(20.0)
    out2 = m(*x)
    assert abs(float(m.layer_params()["alpha"]) - 20.0) < 1e-9
    torch.testing.assert_close(out2.mean, mean0)
    assert bool((out2.evidence > out.evidence).all()) and bool((out2.sigma < out.sigma).all())
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="alpha must be"):
            m.set_alpha(bad)


def test_fit_alpha_temperature_recovers_alpha_and_minimises_nll() -> None:
    from attnuq.models.levy_forecaster import fit_alpha_temperature
    from attnuq.ops.phi import poisson_phi

    g = torch.Generator().manual_seed(3)
    n = 20000
    S = torch.rand(n, generator=g, dtype=torch.float64) * 10 + 0.05
    var = torch.rand(n, generator=g, dtype=torch.float64) * 0.02 + 0.01
    mu = torch.randn(n, generator=g, dtype=torch.float64)
    sd = 1.7 * (var * poisson_phi(0.4 * S)).sqrt()
    y = mu + sd * torch.randn(n, generator=g, dtype=torch.float64)
    a, T = fit_alpha_temperature(mu, var, S, y)
    assert 0.3 < a < 0.55 and 1.6 < T < 1.8

    def nll(alpha: float) -> float:
        s = (var * poisson_phi(alpha * S)).sqrt()
        t = fit_temperature(mu, s, y)
        return float((torch.log(t * s) + (y - mu) ** 2 / (2 * (t * s) ** 2)).mean())

    best = nll(a)
    for other in (a * 0.8, a * 1.25, 1e-4, 1.0, 1e3):
        assert best <= nll(other) + 1e-12
    with pytest.raises(ValueError, match="one length"):
        fit_alpha_temperature(mu, var[:5], S, y)
    with pytest.raises(ValueError, match=">= 0"):
        fit_alpha_temperature(mu, -var, S, y)
    with pytest.raises(ValueError, match="log_range"):
        fit_alpha_temperature(mu, var, S, y, log_range=(1.0, 1.0))


def test_sigma_total_matches_draws_with_a_prior_for_empty_measures() -> None:
    """sigma_total^2 = E|Y - mu|^2 when a draw without atoms takes N(mu, s0_c^2): the model's
    own sampler (alpha = 0.3: empty draws are common) with its empty draws replaced by prior
    draws, against the closed form; z = 5 standard errors per query (8 checks): false-failure
    probability < 8 * 6e-7 < 5e-6. All observations masked: sigma_total = s0_c exactly."""
    m = _model(alpha=0.3, prior_std=0.2)
    with torch.no_grad():
        m.raw_prior.copy_(torch.tensor([-1.0, -2.0, 0.5], dtype=torch.float64))
    x = _inputs()
    out = m(*x)
    gen = torch.Generator().manual_seed(2)
    vals, ne = m.sample(*x, num_samples=8000, generator=gen)
    s0 = m.prior_std[x[5]].detach()
    assert 0.02 < float((~ne).double().mean()) < 0.98
    prior = out.mean.detach() + s0 * torch.randn(vals.shape, generator=gen, dtype=vals.dtype)
    sq = (torch.where(ne, vals, prior) - out.mean.detach()) ** 2
    se = sq.std(0) / math.sqrt(sq.shape[0])
    assert bool(((sq.mean(0) - out.sigma_total.detach() ** 2).abs() <= 5 * se).all())
    ot, oc, ov, om, qt, qc = x
    empty = m(ot, oc, ov, torch.zeros_like(om), qt, qc)
    torch.testing.assert_close(empty.sigma_total, m.prior_std[qc], rtol=1e-12, atol=0)
    assert bool((empty.sigma == 0).all())


def test_forecast_loss_is_mse_plus_the_gaussian_score() -> None:
    """The score terms agree with attnuq.metrics (crps_normal, nll_normal; those agree with
    scoringrules); w = 0 is the masked MSE alone; the prior adds w kappa log^2 alpha."""
    from attnuq.metrics import crps_normal, nll_normal
    from attnuq.models.levy_forecaster import ForecastOutput, forecast_loss

    g = torch.Generator().manual_seed(0)
    mu, y = torch.randn(3, 5, generator=g, dtype=torch.float64), torch.randn(
        3, 5, generator=g, dtype=torch.float64)
    sig = torch.rand(3, 5, generator=g, dtype=torch.float64) + 0.1
    mask = torch.rand(3, 5, generator=g) < 0.7
    out = ForecastOutput(mean=mu, sigma_total=sig)
    mse = float(((y - mu)[mask] ** 2).mean())
    assert float(forecast_loss(out, y, mask, weight=0.0)) == pytest.approx(mse, rel=1e-12)
    T, eps = 1.7, 1e-3
    sd = ((T * sig) ** 2 + eps**2).sqrt()
    crps = float(crps_normal(mu[mask], sd[mask], y[mask]))
    nll = float(nll_normal(mu[mask], sd[mask], y[mask]))
    la = torch.tensor(0.8, dtype=torch.float64)
    got = forecast_loss(out, y, mask, weight=0.3, temperature=T, floor=eps, log_alpha=la,
                        alpha_prior=0.01)
    assert float(got) == pytest.approx(mse + 0.3 * (crps + 0.01 * 0.64), rel=1e-10)
    got = forecast_loss(out, y, mask, weight=0.3, score="nll", temperature=T, floor=eps)
    assert float(got) == pytest.approx(mse + 0.3 * nll, rel=1e-10)
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match=f"weight={bad}"):
            forecast_loss(out, y, mask, weight=bad)
    with pytest.raises(ValueError, match="score"):
        forecast_loss(out, y, mask, weight=1.0, score="mse")
    with pytest.raises(ValueError, match="alpha_prior"):
        forecast_loss(out, y, mask, weight=1.0, alpha_prior=-1.0)


def test_score_term_trains_alpha_temperature_and_prior() -> None:
    """With w > 0 the loss reaches alpha (through phi and p_empty), beta, T and the prior scale;
    with w = 0 none of alpha, T, s0 gets a gradient (the MSE-only recipe, unchanged)."""
    import torch.nn.functional as F

    from attnuq.models.levy_forecaster import forecast_loss

    m = _model()
    x = _inputs()
    y = torch.rand(2, 4, dtype=torch.float64)
    mask = torch.ones(2, 4, dtype=torch.bool)
    names = ("raw_alpha", "raw_beta", "log_temperature", "raw_prior")
    for w in (0.0, 0.5):
        m.zero_grad()
        loss = forecast_loss(m(*x), y, mask, weight=w, temperature=m.temperature,
                             log_alpha=torch.log(F.softplus(m.raw_alpha)))
        loss.backward()
        for n in names:
            g = getattr(m, n).grad
            if w == 0:
                assert n == "raw_beta" or g is None or float(g.abs().sum()) == 0, n
            else:
                assert g is not None and float(g.abs().sum()) > 0, n
