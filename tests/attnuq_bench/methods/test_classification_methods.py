"""The classification methods (attnuq_bench.methods.classification) on tiny models: the Task kind
contract, every registered method's output, and agreement with the maintained libraries."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from attnuq_bench.methods import Task, make_method
from attnuq_bench.methods.classification import (
    ClassPredictive,
    _two_logit_copy,
    fit_temperature_nll,
    probs_from_logits,
)

CLS_METHODS = ["softmax", "temperature", "mc-dropout-cls", "ensemble-cls", "laplace-cls",
               "conformal-cls"]


def _net(k: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, k)).eval()


def _task(k: int = 3, n: int = 90) -> Task:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=g)
    y = (x[:, 0] > 0).long() if k == 1 else torch.randint(0, k, (n,), generator=g)

    def train_fn(model: nn.Module, train: object, val: object, seed: int) -> None:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(3):
            for xb, yb in train:  # type: ignore[attr-defined]
                opt.zero_grad()
                z = model(xb)
                loss = (nn.functional.binary_cross_entropy_with_logits(z[:, 0], yb.float())
                        if k == 1 else nn.functional.cross_entropy(z, yb))
                loss.backward()
                opt.step()
        model.eval()

    return Task(model=_net(k), train=(x, y), val=(x, y), cal=(x, y), batch_size=32,
                make_model=lambda s: _net(k, s), train_fn=train_fn, kind="classification")


@pytest.mark.parametrize("name", CLS_METHODS)
@pytest.mark.parametrize("k", [1, 3])
def test_every_classification_method_gives_probabilities(name: str, k: int) -> None:
    task = _task(k)
    kw = {"n_members": 2} if name == "ensemble-cls" else (
        {"n_samples": 4} if name == "mc-dropout-cls" else {})
    m = make_method(name, **kw).fit(task)
    x = torch.randn(5, 3)
    pred = m.predict(x)
    assert isinstance(pred, ClassPredictive)
    c = max(k, 2)
    assert pred.probs.shape == (5, c)
    torch.testing.assert_close(pred.probs.sum(1), torch.ones(5, dtype=pred.probs.dtype))
    assert bool((pred.probs >= 0).all())
    if pred.samples is not None:
        assert pred.samples.shape[1:] == (5, c)
        assert bool((pred.mutual_information >= 0).all())
    assert m.cost.predict_forward_per_input >= 1


def test_a_regression_method_refuses_a_classification_task_and_back() -> None:
    task = _task(3)
    with pytest.raises(ValueError, match="serves \\['regression'\\] tasks, got a task of "
                                         "kind='classification'"):
        make_method("gaussian").fit(task)
    x, y = torch.randn(10, 3), torch.randn(10)
    reg = Task(model=nn.Linear(3, 1), train=(x, y), val=(x, y), cal=(x, y))
    with pytest.raises(ValueError, match="kind='regression'"):
        make_method("temperature").fit(reg)
    with pytest.raises(ValueError, match="kind='ordinal'"):
        Task(model=nn.Linear(3, 1), train=(x, y), val=(x, y), cal=(x, y), kind="ordinal")


def test_targets_outside_the_classes_are_refused_naming_the_value() -> None:
    x = torch.randn(20, 3)
    y = torch.full((20,), 7)
    task = Task(model=_net(3), train=(x, y), val=(x, y), cal=(x, y), kind="classification")
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 3\), got 7"):
        make_method("temperature").fit(task)


def test_temperature_agrees_with_torch_uncertainty() -> None:
    """Our golden-section T against torch-uncertainty's TemperatureScaler (L-BFGS on the same
    validation NLL) on a deliberately over-confident model: both minimise one convex function
    of 1/T, so they agree to the optimisers' tolerance (1 %)."""
    tu = pytest.importorskip("torch_uncertainty.post_processing")
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2000, 3, generator=g)
    w = torch.randn(3, 4, generator=g)
    y = torch.multinomial(torch.softmax(x @ w, 1), 1, generator=g)[:, 0]
    lin = nn.Linear(3, 4, bias=False)
    with torch.no_grad():
        lin.weight.copy_(3.0 * w.T)  # logits 3x too sharp
    ours = fit_temperature_nll((x @ (3.0 * w)).double(), y)
    scaler = tu.TemperatureScaler(model=lin, init_temperature=1.0, lr=0.1, max_iter=200)
    scaler.fit(DataLoader(TensorDataset(x, y), batch_size=500), progress=False)
    theirs = float(scaler.temperature[0].detach())
    assert abs(ours - theirs) / theirs < 0.01, (ours, theirs)
    assert 2.5 < ours < 3.5


def test_two_logit_copy_is_the_sigmoid_and_leaves_the_model_alone() -> None:
    net = _net(1)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    two = _two_logit_copy(net)
    x = torch.randn(7, 3)
    torch.testing.assert_close(torch.softmax(two(x), -1)[:, 1], torch.sigmoid(net(x)[:, 0]))
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_levy_probit_is_the_probit_approximation() -> None:
    from attnuq_bench.models.classifiers import LevyClassifier

    torch.manual_seed(0)
    model = LevyClassifier(num_channels=3, value_features=2, d_model=8, num_heads=2).eval()
    t = torch.rand(6, 5) * 48
    c = torch.randint(0, 3, (6, 5))
    f = torch.randn(6, 5, 2)
    mask = torch.ones(6, 5, dtype=torch.bool)
    y = torch.randint(0, 2, (6,))

    class Inp:
        def __init__(self) -> None:
            self.times, self.channels, self.features, self.mask = t, c, f, mask

    inp = Inp()
    task = Task(model=model, train=[(inp, y)], val=[(inp, y)], cal=[(inp, y)],
                forward_fn=lambda m, x: m.forward_inputs(x), kind="classification")
    pred = make_method("levy").fit(task).predict(inp)
    out = model.forward_inputs(inp)
    p = torch.sigmoid(out.mean.double() / torch.sqrt(1 + math.pi * out.sigma.double() ** 2 / 8))
    torch.testing.assert_close(pred.probs[:, 1], p)
    # the frozen row of the same backbone reads the mean logit alone
    frozen = make_method("softmax").fit(task).predict(inp)
    torch.testing.assert_close(frozen.probs, probs_from_logits(out.mean.detach()[:, None]))


def test_levy_temperature_divides_the_probit_argument_by_the_validation_temperature() -> None:
    """A fake Levy output whose probit argument is 3x too sharp: the fitted T is about 3
    (4,000 validation labels drawn from the true probabilities: the NLL's minimiser lies
    within 10 % of 3 with overwhelming probability; seeded, so the outcome is fixed), and
    the prediction is ``sigmoid(mu / (T sqrt(1 + pi sigma^2 / 8)))``."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(0)
    n = 4000
    mu = torch.randn(n, generator=g, dtype=torch.float64) * 2
    sigma = torch.rand(n, generator=g, dtype=torch.float64) * 2
    arg = mu / torch.sqrt(1 + math.pi * sigma**2 / 8)
    y = torch.bernoulli(torch.sigmoid(arg), generator=g).long()

    class _Fake(nn.Module):
        def forward(self, idx: torch.Tensor) -> SimpleNamespace:
            return SimpleNamespace(mean=3 * mu[idx], sigma=sigma[idx])

    idx = torch.arange(n)
    task = Task(model=_Fake(), train=[(idx, y)], val=[(idx, y)], cal=[(idx, y)],
                forward_fn=lambda m, x: m(x), kind="classification")
    meth = make_method("levy-temperature").fit(task)
    T = meth.info()["temperature"]
    assert 2.7 < T < 3.3, T
    pred = meth.predict(idx[:50])
    want = torch.sigmoid(3 * arg[:50] / T)
    torch.testing.assert_close(pred.probs[:, 1], want)
    assert meth.cost.fit_forward == n


def test_levy_sigma_recovers_the_sigma_scale_and_reports_whether_sigma_ranks_errors() -> None:
    """Labels drawn from ``sigmoid(mu / sqrt(1 + pi (4 sigma)^2 / 8))``: the sigma the model
    reports is 4x too small, so the validation NLL picks k = 4 from the grid, with T near 1,
    and the prediction is that formula. 16,000 labels; measured per-label NLL excess over
    k = 4 (mean, SE of the paired differences): k = 2 0.0035 (0.0006), k = 8 0.0040 (0.0008),
    k = 1 0.0084 (0.0010), so another k wins with probability below 1e-6 (>= 5.1 SE). With
    labels that ignore sigma, k <= 1 (k = 2 adds 0.0032, SE 0.0006: 5.7 SE) and sigma's
    error-AUROC is near 0.5 (2,487 wrong of 16,000: null sd 0.0063, and 0.47-0.53 is 4.8 sd).
    Seeded, so the outcome here is fixed."""
    from types import SimpleNamespace

    from attnuq_bench.methods.classification import SIGMA_SCALES

    g = torch.Generator().manual_seed(1)
    n = 16000
    mu = torch.randn(n, generator=g, dtype=torch.float64) * 3
    sigma = torch.rand(n, generator=g, dtype=torch.float64)
    idx = torch.arange(n)

    class _Fake(nn.Module):
        def forward(self, i: torch.Tensor) -> SimpleNamespace:
            return SimpleNamespace(mean=mu[i], sigma=sigma[i])

    def fitted(y: torch.Tensor) -> Any:
        task = Task(model=_Fake(), train=[(idx, y)], val=[(idx, y)], cal=[(idx, y)],
                    forward_fn=lambda m, x: m(x), kind="classification")
        return make_method("levy-sigma").fit(task)

    arg4 = mu / torch.sqrt(1 + math.pi * (4 * sigma) ** 2 / 8)
    meth = fitted(torch.bernoulli(torch.sigmoid(arg4), generator=g).long())
    info = meth.info()
    assert info["sigma_scale"] == 4.0, info
    assert 0.9 < info["temperature"] < 1.1, info
    assert set(info["nll_by_scale"]) == {f"{v:g}" for v in SIGMA_SCALES}
    # the choice is the grid's minimum, so never worse on validation than k = 1 (levy-temperature)
    assert min(info["nll_by_scale"].values()) == info["nll_by_scale"]["4"]
    torch.testing.assert_close(meth.predict(idx[:50]).probs[:, 1],
                               torch.sigmoid(arg4[:50] / info["temperature"]))
    assert info["error_auroc_sigma_val"] > 0.53  # a sigma that widens the noise flags errors
    plain = fitted(torch.bernoulli(torch.sigmoid(mu), generator=g).long()).info()
    assert plain["sigma_scale"] <= 1.0, plain
    assert 0.47 < plain["error_auroc_sigma_val"] < 0.53, plain
    assert plain["spearman_sigma_nobs_val"] is None  # these inputs carry no observation mask


def test_levy_sigma_relates_sigma_and_errors_to_the_observation_counts() -> None:
    """Inputs with an observation mask: sigma made to fall with the count (exactly monotone, so
    Spearman -1) and labels whose noise rises with it; both correlations come out with the
    signs the construction gives, and they equal a direct computation."""
    from types import SimpleNamespace

    from attnuq.estimators._common import spearman

    g = torch.Generator().manual_seed(2)
    n = 600
    n_obs = torch.randint(1, 40, (n,), generator=g)
    mask = torch.arange(40)[None, :] < n_obs[:, None]
    sigma = 1.0 / (1.0 + n_obs.double())
    mu = torch.randn(n, generator=g, dtype=torch.float64) * 4 / n_obs.double().sqrt()
    y = torch.bernoulli(torch.sigmoid(mu), generator=g).long()
    xs = SimpleNamespace(mask=mask, i=torch.arange(n))

    class _Fake(nn.Module):
        def forward(self, x: SimpleNamespace) -> SimpleNamespace:
            return SimpleNamespace(mean=mu[x.i], sigma=sigma[x.i])

    task = Task(model=_Fake(), train=[(xs, y)], val=[(xs, y)], cal=[(xs, y)],
                forward_fn=lambda m, x: m(x), kind="classification")
    info = make_method("levy-sigma").fit(task).info()
    assert info["spearman_sigma_nobs_val"] == pytest.approx(-1.0)
    p = torch.sigmoid(mu / torch.sqrt(1 + math.pi * sigma**2 / 8))
    want = spearman(n_obs.double(), (y.double() - p).abs())
    assert info["spearman_nobs_error_val"] == pytest.approx(want, abs=1e-12) and want > 0


def test_levy_classifier_queries_at_several_times_add_up() -> None:
    """Queries at (24, 48) give the logit mean and variance of the 24 h and 48 h classifiers
    summed (the same weights, unscaled; queries are independent in the layer's operator)."""
    from attnuq_bench.models.classifiers import LevyClassifier

    torch.manual_seed(0)
    both = LevyClassifier(num_channels=3, value_features=2, d_model=8, num_heads=2,
                          query_times=(24.0, 48.0), scale_logit=False).eval()
    one = {}
    for t in (24.0, 48.0):
        one[t] = LevyClassifier(num_channels=3, value_features=2, d_model=8, num_heads=2,
                                query_times=[t], scale_logit=False).eval()
        one[t].load_state_dict(both.state_dict())
    x = (torch.rand(4, 7) * 48, torch.randint(0, 3, (4, 7)), torch.randn(4, 7, 2),
         torch.rand(4, 7) < 0.8)
    with torch.no_grad():
        out = both(*x)
        a, b = one[24.0](*x), one[48.0](*x)
    torch.testing.assert_close(out.mean, a.mean + b.mean)
    torch.testing.assert_close(out.sigma**2, a.sigma**2 + b.sigma**2)
    assert not torch.allclose(a.mean, b.mean)  # the two times do see different things
    # scale_logit (the default) is the same logit divided by sqrt(J C) = sqrt(6), sigma alike
    scaled = LevyClassifier(num_channels=3, value_features=2, d_model=8, num_heads=2,
                            query_times=(24.0, 48.0)).eval()
    scaled.load_state_dict(both.state_dict())
    with torch.no_grad():
        sc = scaled(*x)
    torch.testing.assert_close(sc.mean, out.mean / 6**0.5)
    torch.testing.assert_close(sc.sigma, out.sigma / 6**0.5)
    for bad in ((), [float("nan")], 48.0, [True]):
        with pytest.raises(ValueError, match="query_times"):
            LevyClassifier(num_channels=3, value_features=2, query_times=bad)  # type: ignore[arg-type]
