"""The per-stay, per-channel GP baseline (attnuq_bench.models.gp_irregular) against dense
references."""

from __future__ import annotations

import numpy as np
import torch

from attnuq_bench.models.gp_irregular import ChannelGP, fit_channel_gps, predict_channel_gps


def test_gp_padded_batch_matches_dense_reference() -> None:
    gp = ChannelGP(lengthscale=3.0, outputscale=0.2, noise=0.01)
    g = torch.Generator().manual_seed(0)
    t = torch.sort(torch.rand(2, 5, generator=g, dtype=torch.float64) * 24, dim=1).values
    y = torch.rand(2, 5, generator=g, dtype=torch.float64)
    m = torch.ones(2, 5, dtype=torch.bool)
    m[1, 3:] = False
    lml = gp.log_marginal(t, y, m)
    ref = 0.0
    for i in range(2):
        ti, yi = t[i][m[i]], y[i][m[i]]
        K = gp.kernel(ti[:, None], ti[:, None]).to_dense() + gp.noise * torch.eye(len(ti))
        mvn = torch.distributions.MultivariateNormal(gp.mean.expand(len(ti)), K)
        ref = ref + mvn.log_prob(yi)
    torch.testing.assert_close(lml, ref.detach() if hasattr(ref, "detach") else ref)
    tq = torch.tensor([[30.0, 40.0], [26.0, 47.0]], dtype=torch.float64)
    mu, var = gp.predict(t, y, m, tq)
    i = 1
    ti, yi = t[i][m[i]], y[i][m[i]]
    with torch.no_grad():
        K = gp.kernel(ti[:, None], ti[:, None]).to_dense() + gp.noise * torch.eye(len(ti))
        Ks = gp.kernel(tq[i][:, None], ti[:, None]).to_dense()
        Kss = gp.kernel(tq[i][:, None], tq[i][:, None]).to_dense()
        mu_ref = gp.mean + Ks @ torch.linalg.solve(K, yi - gp.mean)
        var_ref = torch.diagonal(Kss - Ks @ torch.linalg.solve(K, Ks.T)) + gp.noise
    torch.testing.assert_close(mu[i], mu_ref)
    torch.testing.assert_close(var[i], var_ref)
    # an empty series predicts the prior
    mu0, var0 = gp.predict(t, y, torch.zeros_like(m), tq)
    torch.testing.assert_close(mu0, gp.mean.detach().expand_as(mu0))
    torch.testing.assert_close(var0, (gp.kernel.outputscale + gp.noise).detach().expand_as(var0))



def test_gp_fit_and_batch_prediction() -> None:
    rng = np.random.default_rng(0)
    ts = [np.sort(rng.uniform(0, 48, 15)) for _ in range(8)]
    ys = [0.5 + 0.1 * np.sin(t / 4) + 0.01 * rng.standard_normal(t.size) for t in ts]
    gps = fit_channel_gps({0: (ts, ys)}, 2, iters=20)
    assert abs(float(gps[0].mean) - 0.5) < 0.1
    ot = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    oc = torch.tensor([[0, 0, 1, 0]])
    ov = torch.tensor([[0.5, 0.6, 0.2, 0.0]])
    om = torch.tensor([[True, True, True, False]])
    qt = torch.tensor([[30.0, 31.0, 32.0]])
    qc = torch.tensor([[0, 1, 0]])
    qm = torch.tensor([[True, True, False]])
    mean, std = predict_channel_gps(gps, ot, oc, ov, om, qt, qc, qm)
    mu0, var0 = gps[0].predict(torch.tensor([[1.0, 2.0]]), torch.tensor([[0.5, 0.6]]),
                               torch.ones(1, 2, dtype=torch.bool), torch.tensor([[30.0]]))
    torch.testing.assert_close(mean[0, 0], mu0[0, 0])
    torch.testing.assert_close(std[0, 0], var0[0, 0].sqrt())
    assert float(std[0, 2]) == 1.0  # padded query
