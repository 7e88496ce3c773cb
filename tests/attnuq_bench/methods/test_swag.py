"""SWAG: moment bookkeeping against a direct computation, sampling covariance, method wiring."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from attnuq_bench.methods import SWAG, SWAGCollector, Task


def test_running_moments_and_deviation_matrix_match_direct_computation() -> None:
    g = torch.Generator().manual_seed(0)
    ws = torch.randn(7, 4, generator=g, dtype=torch.float64) * torch.tensor([1.0, 2.0, 0.1, 3.0],
                                                                            dtype=torch.float64)
    c = SWAGCollector(n_params=4, max_rank=5)
    for w in ws:
        c.collect(w)
    torch.testing.assert_close(c.mean, ws.mean(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(c.sq_mean, (ws**2).mean(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(c.variance, ws.var(0, unbiased=False), rtol=1e-10, atol=1e-12)
    # columns: w_i minus the running mean after adding w_i, for the last K = 5 snapshots
    expected = torch.stack([ws[i] - ws[: i + 1].mean(0) for i in range(2, 7)], dim=1)
    torch.testing.assert_close(c.deviation_matrix, expected, rtol=1e-12, atol=1e-12)
    assert c.n == 7 and c.deviation_matrix.shape == (4, 5)


def test_samples_have_the_swag_mean_and_covariance() -> None:
    g = torch.Generator().manual_seed(1)
    c = SWAGCollector(n_params=3, max_rank=4)
    for _ in range(6):
        c.collect(torch.randn(3, generator=g, dtype=torch.float64))
    cov = c.covariance()
    d = c.deviation_matrix
    torch.testing.assert_close(cov, (torch.diag(c.variance) + d @ d.T / 3) / 2)
    n = 20000
    draws = torch.stack([c.sample(g) for _ in range(n)])  # (n, P)
    emp_mean, emp_cov = draws.mean(0), torch.cov(draws.T)
    # z = 5 standard errors per entry: false-failure probability < 3 * 6e-7 + 9 * 6e-7 ~ 7e-6
    se_mean = (torch.diag(cov) / n).sqrt()
    assert bool(((emp_mean - c.mean).abs() <= 5 * se_mean).all())
    var = torch.diag(cov)
    se_cov = ((var[:, None] * var[None, :] + cov**2) / n).sqrt()
    assert bool(((emp_cov - cov).abs() <= 5 * se_cov).all()), (emp_cov, cov)


def test_collector_errors() -> None:
    c = SWAGCollector(n_params=2)
    with pytest.raises(RuntimeError, match="n=0"):
        c.sample()
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        c.collect(torch.zeros(3))
    with pytest.raises(ValueError, match="non-finite"):
        c.collect(torch.tensor([0.0, math.nan]))
    with pytest.raises(ValueError, match="max_rank"):
        SWAGCollector(n_params=2, max_rank=0)


def test_swag_method_leaves_the_frozen_model_untouched_and_samples_vary() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1), nn.Flatten(0)).eval()
    x, y = torch.randn(64, 3), torch.randn(64)
    for p in net.parameters():  # a frozen model: SWAG trains a copy with gradients on
        p.requires_grad_(False)
    before = [p.detach().clone() for p in net.parameters()]
    task = Task(model=net, train=(x, y), val=(x, y), cal=(x, y), batch_size=16)
    m = SWAG(n_samples=6, epochs=2, snapshots_per_epoch=2, lr=1e-2, progress=False).fit(task)
    pred = m.predict(x[:5])
    assert pred.samples.shape == (6, 5)
    assert float(pred.samples.std(0).min()) > 0
    assert m.cost.predict_forward_per_input == 6 and m.cost.fit_forward == 2 * 64
    for a, b in zip(before, net.parameters(), strict=True):
        assert torch.equal(a, b)
    # calling predict twice gives the same draws (seeded) and leaves the SWAG copy at its mean
    torch.testing.assert_close(m.predict(x[:5]).samples, pred.samples)
