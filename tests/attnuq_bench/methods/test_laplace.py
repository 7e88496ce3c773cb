"""Closed-form last-layer Laplace against a brute-force GGN built with torch.func.jacrev."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

from attnuq_bench.methods import LastLayerLaplace, Task
from attnuq_bench.methods.laplace import laplace_log_marglik


def _net(k: int) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, k))
    if k == 1:
        net.append(nn.Flatten(0))
    return net.double().eval()


def _brute(net: nn.Module, x: torch.Tensor, y: torch.Tensor, xq: torch.Tensor, alpha: float):
    """GGN of the last layer from Jacobians of the flattened outputs; predictive variance."""
    last = net[2]
    names = ["2.weight", "2.bias"]
    theta = {n: p.detach() for n, p in net.named_parameters() if n in names}
    others = {n: p.detach() for n, p in net.named_parameters() if n not in names}

    def f(th: dict[str, torch.Tensor], inp: torch.Tensor) -> torch.Tensor:
        return functional_call(net, {**others, **th}, (inp,)).reshape(-1)

    def jac(inp: torch.Tensor) -> torch.Tensor:
        j = jacrev(f)(theta, inp)
        return torch.cat([j[n].reshape(j[n].shape[0], -1) for n in names], 1)  # (N*K, P)

    with torch.no_grad():
        r = net(x) - y
    s2 = float((r**2).mean())
    j = jac(x)
    p = j.shape[1]
    h = j.T @ j / s2 + alpha * torch.eye(p, dtype=j.dtype)
    jq = jac(xq)
    var = (jq @ torch.linalg.inv(h) * jq).sum(1) + s2
    theta_sq = float(sum((t**2).sum() for t in theta.values()))
    n = r.numel()
    lml = (-0.5 * n * math.log(2 * math.pi * s2) - float((r**2).sum()) / (2 * s2)
           - 0.5 * alpha * theta_sq + 0.5 * p * math.log(alpha)
           - 0.5 * float(torch.linalg.slogdet(h / 1.0)[1]))
    assert last.out_features * 7 == p
    return var, s2, lml


@pytest.mark.parametrize("k", [1, 2])
def test_predictive_variance_matches_brute_force_ggn(k: int) -> None:
    net = _net(k)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 3, generator=g, dtype=torch.float64)
    y = torch.randn(40, k, generator=g, dtype=torch.float64).squeeze(-1) if k == 1 else \
        torch.randn(40, k, generator=g, dtype=torch.float64)
    xq = torch.randn(7, 3, generator=g, dtype=torch.float64)
    alpha = 0.7
    task = Task(model=net, train=(x, y), val=(x, y), cal=(x, y), batch_size=16)
    la = LastLayerLaplace(prior_precision=alpha).fit(task)
    pred = la.predict(xq)
    var_bf, s2, _ = _brute(net, x, y, xq, alpha)
    assert la.s2 == pytest.approx(s2, rel=1e-12)
    torch.testing.assert_close(pred.std.reshape(-1) ** 2, var_bf, rtol=1e-9, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(pred.mean, net(xq))


def test_log_marglik_matches_brute_force_and_is_maximised() -> None:
    net = _net(2)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(30, 3, generator=g, dtype=torch.float64)
    y = torch.randn(30, 2, generator=g, dtype=torch.float64)
    task = Task(model=net, train=(x, y), val=(x, y), cal=(x, y))
    la = LastLayerLaplace(prior="marglik").fit(task)
    phi = torch.cat([torch.tanh(net[0](x)), torch.ones(30, 1, dtype=torch.float64)], 1).detach()
    eig = torch.linalg.eigvalsh(phi.T @ phi)
    theta_sq = float((net[2].weight.detach() ** 2).sum() + (net[2].bias.detach() ** 2).sum())
    alphas = torch.tensor([0.01, 0.3, 5.0], dtype=torch.float64)
    ours = laplace_log_marglik(eig, alphas, s2=la.s2, rss=la.rss, n=la.n_elements, k=2,
                               theta_sq=theta_sq)
    for a, v in zip(alphas.tolist(), ours.tolist(), strict=True):
        assert v == pytest.approx(_brute(net, x, y, x, a)[2], rel=1e-9)
    # the chosen alpha beats its grid neighbours under the brute-force objective
    best = _brute(net, x, y, x, la.alpha)[2]
    for f in (10 ** -0.05, 10 ** 0.05):
        assert best >= _brute(net, x, y, x, la.alpha * f)[2] - 1e-9


def test_validation_prior_and_errors() -> None:
    net = _net(1)
    x = torch.randn(30, 3, dtype=torch.float64)
    y = torch.randn(30, dtype=torch.float64)
    task = Task(model=net, train=(x, y), val=(x[:10], y[:10]), cal=(x, y))
    la = LastLayerLaplace(prior="val").fit(task)
    assert 1e-6 <= la.alpha <= 1e6
    with pytest.raises(ValueError, match="prior='bad'"):
        LastLayerLaplace(prior="bad")
    with pytest.raises(ValueError, match=r"no nn\.Linear named"):
        LastLayerLaplace(layer="nope").fit(task)
    scaled = nn.Sequential(net, nn.Identity())
    scaled.forward = lambda inp: 2.0 * net(inp)  # type: ignore[method-assign]
    with pytest.raises(NotImplementedError, match="last linear layer's output"):
        LastLayerLaplace().fit(Task(model=scaled, train=(x, y), val=(x, y), cal=(x, y)))
