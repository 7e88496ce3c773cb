"""Our baselines against the maintained libraries that implement the same method (float64).

* last-layer Laplace vs laplace-torch's ``Laplace(model, "regression",
  subset_of_weights="last_layer", hessian_structure="full")`` (``FullLLLaplace``): predictive
  mean and variance at the same prior precision and noise, the log marginal likelihood, and the
  fitted prior precision;
* SWAG vs torch-uncertainty's ``SWAG``: the moments and deviation matrix from the same
  snapshots, the same weight draws from the same normal draws, and the one place they differ
  (torch-uncertainty draws the low-rank part per parameter tensor);
* MC dropout vs torch-uncertainty's ``mc_dropout``: the same draws from the same seed.

The libraries are the ``laplace`` and ``uncertainty`` extras, which ``scripts/setup.sh``
installs; they are imported inside the tests (each import takes 10-20 s, hence ``slow``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.utils.data import DataLoader, TensorDataset

from attnuq_bench.methods import LastLayerLaplace, MCDropout, SWAGCollector, Task
from attnuq_bench.methods.laplace import laplace_log_marglik

D = torch.float64

pytestmark = pytest.mark.slow


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch-uncertainty's SWAG draws ``torch.randn`` in the default dtype: float64 here."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


# ----------------------------------------------------------------------------- Laplace
def _laplace_problem(k: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, k)).to(D).eval()
    g = torch.Generator().manual_seed(10 + k)
    x = torch.randn(40, 3, generator=g, dtype=D)
    with torch.no_grad():  # targets near the net's outputs: a realistic residual scale
        y = net(x) + 0.3 * torch.randn(40, k, generator=g, dtype=D)
    xq = torch.randn(7, 3, generator=g, dtype=D)
    return net, x, y, xq


def _their_laplace(net: nn.Module, x: torch.Tensor, y: torch.Tensor, *, alpha: float,
                   sigma: float):  # type: ignore[no-untyped-def]
    from laplace import Laplace

    la = Laplace(net, "regression", subset_of_weights="last_layer", hessian_structure="full",
                 sigma_noise=sigma, prior_precision=alpha, last_layer_name="2")
    la.fit(DataLoader(TensorDataset(x, y), batch_size=16))
    return la


@pytest.mark.parametrize("k", [1, 2])
def test_laplace_predictive_matches_laplace_torch(k: int) -> None:
    """Same model, data, prior precision and noise -> same GLM predictive (1e-6 relative)."""
    net, x, y, xq = _laplace_problem(k)
    ours = LastLayerLaplace(prior="marglik").fit(
        Task(model=net, train=(x, y), val=(x, y), cal=(x, y), batch_size=16))
    la = _their_laplace(net, x, y, alpha=ours.alpha, sigma=math.sqrt(ours.s2))
    assert type(la).__name__ == "FullLLLaplace"
    f_mu, f_var = la(xq, pred_type="glm")  # (B, K), (B, K, K): epistemic part only
    pred = ours.predict(xq)
    torch.testing.assert_close(pred.mean, f_mu, rtol=1e-12, atol=1e-12)
    # the K outputs are independent a posteriori (H = I_K (x) A) in both
    off = f_var - torch.diag_embed(torch.diagonal(f_var, dim1=-2, dim2=-1))
    assert float(off.abs().max()) <= 1e-12
    var = torch.diagonal(f_var, dim1=-2, dim2=-1) + float(la.sigma_noise) ** 2
    torch.testing.assert_close(pred.std**2, var, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("k", [1, 2])
def test_laplace_marglik_and_prior_fit_match_laplace_torch(k: int) -> None:
    """The log marginal likelihood agrees (1e-6 relative) and both fits pick the same alpha.

    Ours maximises log Z over the grid 10^[-6, 6] (241 points, 0.05 decades apart);
    laplace-torch runs Adam on log alpha. Evaluated on our grid, laplace-torch's log Z has its
    maximum at our alpha, and its continuous optimum lies within half a grid step of it.
    """
    net, x, y, _ = _laplace_problem(k)
    ours = LastLayerLaplace(prior="marglik").fit(
        Task(model=net, train=(x, y), val=(x, y), cal=(x, y), batch_size=16))
    sigma = math.sqrt(ours.s2)
    la = _their_laplace(net, x, y, alpha=1.0, sigma=sigma)
    with torch.no_grad():
        phi = torch.cat([torch.tanh(net[0](x)), torch.ones(len(x), 1, dtype=D)], 1)
    eig = torch.linalg.eigvalsh(phi.T @ phi)
    theta_sq = float((net[2].weight.detach() ** 2).sum() + (net[2].bias.detach() ** 2).sum())
    grid = torch.logspace(-6, 6, 241, dtype=D)
    mine = laplace_log_marglik(eig, grid, s2=ours.s2, rss=ours.rss, n=ours.n_elements, k=k,
                               theta_sq=theta_sq)
    theirs = torch.stack([
        la.log_marginal_likelihood(prior_precision=a.reshape(1), sigma_noise=torch.tensor(sigma,
                                                                                         dtype=D))
        .detach().reshape(()) for a in grid
    ])
    # ours: eigenvalues of Phi~^T Phi~; theirs: a Cholesky log-determinant of the posterior
    # precision. Near-collinear tanh features put the worst rounding at ~2e-8 relative.
    torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=0.0)
    assert float(grid[int(theirs.argmax())]) == pytest.approx(ours.alpha, rel=1e-12)
    la.optimize_prior_precision(pred_type="glm", method="marglik", prior_structure="scalar",
                                n_steps=500, lr=0.1)
    alpha_lt = float(la.prior_precision.reshape(()))
    assert abs(math.log10(alpha_lt) - math.log10(ours.alpha)) <= 0.025 + 1e-6, (alpha_lt,
                                                                                 ours.alpha)


# ----------------------------------------------------------------------------- SWAG
def _tu_swag(net: nn.Module, max_rank: int):  # type: ignore[no-untyped-def]
    from torch_uncertainty.methods import SWAG as TuSWAG

    # one update per "epoch" from epoch 1 on; var_clamp as ours; one model drawn per update
    return TuSWAG(net, cycle_start=0, cycle_length=1, max_num_models=max_rank, var_clamp=1e-30,
                  num_estimators=1, scale=0.5)


def _feed(tu, ours: SWAGCollector, snapshots: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    params = list(tu.core_model.parameters())
    for epoch, w in enumerate(snapshots, start=1):
        vector_to_parameters(w, params)
        tu.update_wrapper(epoch)
        ours.collect(w)


def _stats(tu, key: str, net: nn.Module) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """torch-uncertainty's per-parameter statistic, flattened in ``parameters()`` order."""
    parts = [tu.swag_stats[f"{tu.prfx}{n}_{key}"] for n, _ in net.named_parameters()]
    if key == "covariance_sqrt":  # (K, numel) each -> (P, K)
        return torch.cat(parts, dim=1).T
    return torch.cat([p.reshape(-1) for p in parts])


def test_swag_moments_match_torch_uncertainty_on_the_same_snapshots() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    n_params = sum(p.numel() for p in net.parameters())
    g = torch.Generator().manual_seed(3)
    snaps = torch.randn(9, n_params, generator=g, dtype=D) * 0.1 + torch.randn(n_params,
                                                                                generator=g,
                                                                                dtype=D)
    with _default_dtype(D):
        tu = _tu_swag(copy.deepcopy(net), max_rank=5)
        ours = SWAGCollector(n_params, max_rank=5)
        _feed(tu, ours, snaps)
    assert int(tu.num_avgd_models) == ours.n == 9
    tight = {"rtol": 1e-12, "atol": 1e-14}
    torch.testing.assert_close(_stats(tu, "mean", net), ours.mean, **tight)
    torch.testing.assert_close(_stats(tu, "sq_mean", net), ours.sq_mean, **tight)
    torch.testing.assert_close(_stats(tu, "covariance_sqrt", net), ours.deviation_matrix,
                               rtol=1e-10, atol=1e-13)


def test_swag_draws_match_torch_uncertainty_given_the_same_normal_draws() -> None:
    """A model with one parameter tensor: both draw ``z1 ~ N(0, I_P)`` then ``z2 ~ N(0, I_K)``.

    With a full deviation matrix (``n >= K``) torch-uncertainty's ``sample(scale=0.5, seed=s)``
    is the SWAG formula ``mean + (Sigma_diag^(1/2) z1 + D z2 / sqrt(K - 1)) / sqrt(2)``, ours
    with a generator seeded ``s``; the drawn weights and the predictions agree to rounding.
    """
    net = nn.Sequential(nn.Linear(5, 1, bias=False), nn.Flatten(0)).to(D)
    g = torch.Generator().manual_seed(4)
    snaps = torch.randn(7, 5, generator=g, dtype=D) * torch.tensor([0.1, 1.0, 0.3, 2.0, 0.5],
                                                                     dtype=D)
    x = torch.randn(6, 5, generator=g, dtype=D)
    with _default_dtype(D):
        tu = _tu_swag(copy.deepcopy(net), max_rank=4)
        ours = SWAGCollector(5, max_rank=4)
        _feed(tu, ours, snaps)
        for seed in (0, 1, 123):
            model = tu.sample(0.5, seed=seed)
            w_tu = parameters_to_vector(model.parameters())
            w_ours = ours.sample(torch.Generator().manual_seed(seed))
            torch.testing.assert_close(w_tu, w_ours, rtol=1e-12, atol=1e-14)
            swag_net = copy.deepcopy(net)
            vector_to_parameters(w_ours, list(swag_net.parameters()))
            with torch.no_grad():
                torch.testing.assert_close(model(x), swag_net(x), rtol=1e-12, atol=1e-14)


def test_torch_uncertainty_swag_covariance_is_block_diagonal_over_parameter_tensors() -> None:
    """The one difference: torch-uncertainty draws ``z2`` anew for each parameter tensor.

    Its weight covariance is therefore ``diag/2 + blockdiag_t(D_t D_t^T) / (2 (K - 1))``;
    ours (and Maddox et al.) share one ``z2``, so the low-rank part also correlates the weight
    with the bias. Empirical covariance of n = 6000 of its draws against both: every entry
    within 5 standard errors of the block-diagonal form (15 distinct entries, normal
    approximation: false failure < 15 * 6e-7 ~ 1e-5), and the weight-bias entries at least
    10 standard errors away from ours (the snapshots are built with a strong weight-bias
    correlation, so this cannot hold by chance).
    """
    net = nn.Linear(4, 1).to(D)  # weight (1, 4), bias (1,): P = 5
    g = torch.Generator().manual_seed(5)
    common = torch.randn(8, 1, generator=g, dtype=D)
    snaps = common * torch.ones(1, 5, dtype=D) + 0.05 * torch.randn(8, 5, generator=g, dtype=D)
    n = 6000
    with _default_dtype(D):
        tu = _tu_swag(copy.deepcopy(net), max_rank=6)
        ours = SWAGCollector(5, max_rank=6)
        _feed(tu, ours, snaps)
        torch.manual_seed(6)
        draws = torch.stack([parameters_to_vector(tu.sample(0.5).parameters()) for _ in range(n)])
    cov_ours = ours.covariance()
    blocks = torch.zeros(5, 5, dtype=torch.bool)
    blocks[:4, :4] = True
    blocks[4, 4] = True
    cov_block = torch.where(blocks, cov_ours, torch.diag(torch.diag(cov_ours)))
    emp = torch.cov(draws.T)
    var = torch.diag(cov_block)
    se = ((var[:, None] * var[None, :] + cov_block**2) / n).sqrt()
    assert bool(((emp - cov_block).abs() <= 5 * se).all()), (emp, cov_block)
    cross = ~blocks
    assert bool(((emp - cov_ours).abs()[cross] >= 10 * se[cross]).all()), (emp, cov_ours)


# ----------------------------------------------------------------------------- MC dropout
def test_mc_dropout_draws_equal_torch_uncertainty_mc_dropout() -> None:
    """Same model, inputs and seed: the passes of ``MCDropout`` are torch-uncertainty's.

    ``mc_dropout(..., on_batch=False)`` runs the passes in a Python loop with only the dropout
    modules in training mode, as ours does; the same kernels run on the same inputs with the
    same generator state, so the draws are equal bit for bit.
    """
    from torch_uncertainty.methods import mc_dropout

    torch.manual_seed(0)
    # BatchNorm: a pass with the whole model in training mode would differ (batch statistics)
    net = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 16),
                        nn.BatchNorm1d(16), nn.Dropout(0.1), nn.Linear(16, 1), nn.Flatten(0))
    net = net.to(D)
    net[4].running_mean.uniform_(-1, 1)  # non-trivial running statistics
    net[4].running_var.uniform_(0.5, 2)
    net.eval()
    x = torch.randn(9, 3, dtype=D)
    y = torch.randn(9, dtype=D)
    s = 12
    ours = MCDropout(n_samples=s, seed=7).fit(Task(model=net, train=(x, y), val=(x, y),
                                                   cal=(x, y)))
    samples = ours.predict(x).samples  # (S, B)
    wrapper = mc_dropout(copy.deepcopy(net), num_estimators=s, on_batch=False,
                         task="regression", probabilistic=False)
    wrapper.eval()  # everything in eval mode except the dropout modules
    torch.manual_seed(7)
    with torch.no_grad():
        theirs = wrapper(x).reshape(s, len(x))  # (S * B,) -> (S, B)
    assert torch.equal(samples, theirs)
    assert float(samples.std(0).min()) > 0
