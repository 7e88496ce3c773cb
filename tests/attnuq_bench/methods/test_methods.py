"""Contract tests shared by every registered method, plus per-method checks that can fail."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from attnuq.estimators._regressor import SAPredictive
from attnuq.predictive import GaussianPredictive, Predictive
from attnuq_bench.methods import (
    HSA,
    DeepEnsemble,
    HomoscedasticGaussian,
    MCDropout,
    Method,
    SplitConformal,
    Task,
    available_methods,
    gumbel_attention,
    make_method,
    method_implementation,
)
from attnuq_bench.methods.sa import StochasticAttention
from attnuq_bench.methods.simple import dropout_active
from attnuq_bench.models.ft import make_ft_transformer
from attnuq_bench.training import fit


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x[:, 0] - 0.5 * x[:, 1] ** 2 + 0.3 * torch.randn(n, generator=g)
    return x, y


def _tiny(seed: int) -> nn.Module:
    return make_ft_transformer(4, n_blocks=1, seed=seed, d_block=8, attention_n_heads=2)


def _train(model: nn.Module, train: Any, val: Any, seed: int) -> Any:
    return fit(model, train, val, max_epochs=1, patience=1, seed=seed, progress=False)


@pytest.fixture(scope="module")
def task() -> Task:
    torch.manual_seed(0)
    xt, yt = _data(48, 0)
    xv, yv = _data(24, 1)
    xc, yc = _data(24, 2)
    model = _tiny(0)
    _train(model, (xt, yt), (xv, yv), 0)
    return Task(model=model.eval(), train=(xt, yt), val=(xv, yv), cal=(xc, yc),
                make_model=_tiny, train_fn=_train, batch_size=16)


_CHEAP_KW: dict[str, dict[str, Any]] = {
    "sa-paper": {"n_samples": 8, "n_passes": 3, "progress": False},
    "sa-scale": {"n_samples": 8, "n_passes": 3, "progress": False},
    "sa-crps": {"n_samples": 8, "n_passes": 3, "progress": False},
    "sa-coverage": {"n_samples": 8, "n_passes": 3, "progress": False},
    "sa-conformal": {"n_samples": 8, "n_passes": 3, "progress": False},
    "sa": {"n_samples": 8, "n_passes": 3, "progress": False},
    "sa-centre": {"n_samples": 8, "n_passes": 3, "progress": False},
    "sa-debiased": {"n_samples": 8, "n_passes": 3, "progress": False},
    "sa-recentred": {"n_samples": 8, "n_passes": 3, "progress": False},
    "sa-floor": {"n_samples": 8, "n_passes": 3, "progress": False},
    "sa-layer": {"n_samples": 8, "n_passes": 3, "progress": False},
    "mc-dropout": {"n_samples": 8},
    "ensemble": {"n_members": 2},
    "swag": {"n_samples": 4, "epochs": 1, "progress": False},
    "multiswag": {"n_members": 2, "n_samples": 4, "epochs": 1, "progress": False},
    "ivon": {"n_samples": 4, "max_epochs": 1, "progress": False},
    "hsa": {"n_samples": 4},
}


# the regression contract; the classification methods have theirs in test_classification_methods
REGRESSION = [n for n in available_methods() if "regression" in make_method(n).task_kinds]


@pytest.mark.parametrize("name", REGRESSION)
def test_every_method_fits_and_predicts_the_target_shape(name: str, task: Task) -> None:
    before = {k: v.clone() for k, v in task.model.state_dict().items()}
    m = make_method(name, **_CHEAP_KW.get(name, {}))
    assert m.name == name
    x = _data(6, 3)[0]
    pred = m.fit(task).predict(x)
    assert isinstance(pred, (Predictive, GaussianPredictive, SAPredictive))
    assert pred.mean.shape == (6,)
    lo, hi = pred.interval(0.9)
    assert bool((hi >= lo).all()) and bool(torch.isfinite(hi - lo).all())
    assert float((hi - lo).max()) > 0, f"{name} predicts zero-width intervals"
    assert m.cost.fit_seconds >= 0 and m.cost.predict_forward_per_input >= 1
    # post-hoc and retraining methods alike leave the frozen model's weights unchanged
    for k, v in task.model.state_dict().items():
        assert torch.equal(before[k], v), f"{name} changed {k}"


@pytest.mark.parametrize("name", available_methods())
def test_every_method_states_its_implementation(name: str) -> None:
    """Results pages print this per row: each registered class says which code it runs."""
    text = method_implementation(name)
    assert text == make_method(name).implementation
    assert text != Method.implementation, f"{name} keeps the base class's implementation text"
    if "agree" in text:  # a stated library agreement names the test file that checks it
        files = re.findall(r"tests/[\w/]+\.py", text)
        root = Path(__file__).resolve().parents[3]
        assert files and all((root / f).is_file() for f in files), (name, text)


def test_make_method_errors_name_the_bad_value() -> None:
    with pytest.raises(ValueError, match="'nope'"):
        make_method("nope")
    with pytest.raises(ValueError, match="criterion='bad'"):
        make_method("sa-paper", criterion="bad")
    with pytest.raises(ValueError, match="n_members=1"):
        DeepEnsemble(n_members=1)
    with pytest.raises(ValueError, match="tau=0"):
        HSA(tau=0)


def test_retraining_methods_need_make_model(task: Task) -> None:
    bare = Task(model=task.model, train=task.train, val=task.val, cal=task.cal)
    for name in ("ensemble", "ivon", "hsa", "multiswag"):
        with pytest.raises(ValueError, match="make_model"):
            make_method(name, **_CHEAP_KW.get(name, {})).fit(bare)


def test_gaussian_sigma_is_validation_rms(task: Task) -> None:
    m = HomoscedasticGaussian().fit(task)
    with torch.no_grad():
        xs, ys = zip(*task.val, strict=True)
        r = task.model(torch.cat(xs)) - torch.cat(ys)
    assert m.sigma == pytest.approx(float(r.pow(2).mean().sqrt()), rel=1e-5)


def test_split_conformal_quantile_and_interval(task: Task) -> None:
    m = SplitConformal(alpha=0.1).fit(task)
    with torch.no_grad():
        xs, ys = zip(*task.cal, strict=True)
        r = (task.model(torch.cat(xs)) - torch.cat(ys)).abs().sort().values
    k = math.ceil(25 * 0.9)  # n = 24 calibration points
    assert m.q == pytest.approx(float(r[k - 1]), rel=1e-6)
    pred = m.predict(_data(5, 4)[0])
    lo, hi = pred.interval(0.9)
    # the residual distribution was spread so that its central 90 % interval spans 2q
    torch.testing.assert_close(hi - lo, torch.full((5,), 2 * m.q), rtol=1e-4, atol=1e-5)


def test_ensemble_member_cache_and_spread(task: Task, tmp_path: Path) -> None:
    t = Task(model=task.model, train=task.train, val=task.val, cal=task.cal,
             make_model=_tiny, train_fn=_train, member_dir=tmp_path)
    ens = DeepEnsemble(n_members=3).fit(t)
    assert (tmp_path / "member1.pt").is_file() and (tmp_path / "member2.json").is_file()
    x = _data(5, 5)[0]
    pred = ens.predict(x)
    with torch.no_grad():
        outs = torch.stack([m(x) for m in ens._models])
    torch.testing.assert_close(pred.std, outs.std(0))
    # a new task over the same folder reloads the members instead of retraining
    t2 = Task(model=task.model, train=task.train, val=task.val, cal=task.cal,
              make_model=_tiny, train_fn=lambda *a: pytest.fail("retrained"), member_dir=tmp_path)
    ens2 = DeepEnsemble(n_members=3).fit(t2)
    torch.testing.assert_close(ens2.predict(x).std, pred.std)
    assert ens2.cost.fit_forward == ens.cost.fit_forward > 0


def test_mc_dropout_only_switches_dropout_and_restores(task: Task) -> None:
    model = task.model.eval()
    with dropout_active(model) as n:
        assert n >= 1
        for m in model.modules():
            active = isinstance(m, nn.Dropout) and m.p > 0
            assert m.training == active, m
    assert not any(m.training for m in model.modules())
    plain = nn.Sequential(nn.Linear(4, 1), nn.Flatten(0))
    with pytest.raises(ValueError, match="dropout"):
        MCDropout().fit(Task(model=plain, train=task.train, val=task.val, cal=task.cal))


def test_gumbel_attention_is_stochastic_and_restored(task: Task) -> None:
    model = _tiny(3).eval()
    x = _data(4, 6)[0]
    with torch.no_grad():
        ref = model(x)
        with gumbel_attention(model, tau=1.0):
            a, b = model(x), model(x)
        after = model(x)
    assert not torch.equal(a, b)
    torch.testing.assert_close(after, ref, rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="Sequential"), gumbel_attention(
        nn.Sequential(nn.Linear(2, 2))
    ):
        pass


@pytest.mark.parametrize("cached", [False, True])
def test_member_training_is_booked_once(monkeypatch, tmp_path, cached) -> None:  # type: ignore[no-untyped-def]
    """A deep ensemble that trains its members inside ``fit`` books their training time once
    (not as elapsed time *and* as the members' recorded cost); read from the member cache, the
    recorded cost is booked instead. A fake clock that advances only while a member trains makes
    the expected total exact: 2 retrained members x 10 s."""
    import attnuq_bench.methods._base as base
    from attnuq_bench.methods import DeepEnsemble, Task

    clock = [0.0]
    monkeypatch.setattr(base.time, "perf_counter", lambda: clock[0])

    def make_model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(2, 1), nn.Flatten(0))

    def train_fn(model, train, val, seed):  # type: ignore[no-untyped-def]
        clock[0] += 10.0

    x, y = torch.randn(16, 2), torch.randn(16)

    def task() -> Task:
        return Task(model=make_model(0).eval(), train=(x, y), val=(x, y), cal=(x, y),
                    make_model=make_model, train_fn=train_fn, member_dir=tmp_path)

    if cached:  # a first fit fills the cache
        DeepEnsemble(n_members=3).fit(task())
    clock_before = clock[0]
    ens = DeepEnsemble(n_members=3).fit(task())
    assert ens.cost.fit_seconds == pytest.approx(20.0)
    assert clock[0] - clock_before == (0.0 if cached else 20.0)


@pytest.mark.parametrize("name", [n for n in REGRESSION if n.startswith("sa-")
                                  and n != "sa-centre"])  # sa-centre: an SARegressor, as "sa"
def test_sa_methods_calibrate_nu_on_the_validation_part(name: str, task: Task) -> None:
    """Replaces a find_spec skip that could never fire: each SA method really runs the
    calibration search on ``val`` (its evaluations are recorded, the chosen nu is one of them,
    the passes are booked) and predicts with that nu."""
    m = make_method(name, **_CHEAP_KW[name], max_evals=3, nu_range=(1, 32))
    m.fit(task)
    info = m.info()
    assert info["nu"] in info["evaluated_nu"] and 1 <= info["nu"] <= 32
    assert len(info["evaluated_nu"]) >= 1 and info["calibration_passes"] > 0
    n_val = sum(len(t) for _, t in task.val)
    assert m.cost.fit_forward >= info["calibration_passes"] * n_val
    assert m.report.n_examples == n_val
    assert (m.scale != 1.0) == name.endswith("conformal")
    assert (m.floor_fit is not None) == name.endswith("floor")
    # per-layer nu: one nu per patchable site, in find_attention order, and the draws use it
    if name == "sa-layer":
        import attnuq

        sites = [s.name for s in attnuq.find_attention(task.model) if s.patchable]
        assert list(info["nu_map"]) == sites and m.report.nu_map == info["nu_map"]
        assert m.report.forward_passes <= 2 * m.report.per_layer["shared_forward_passes"]
    else:
        assert "nu_map" not in info


def test_sa_conformal_shares_the_base_draws_and_nu(task: Task) -> None:
    kw = _CHEAP_KW["sa-paper"] | {"max_evals": 2, "nu_range": (1, 16)}
    base = make_method("sa-paper", **kw).fit(task)
    sc = make_method("sa-conformal", base=base).fit(task)
    assert sc.nu == base.nu and sc.report is base.report and sc.derived_from == "sa-paper"
    assert sc.info()["nu_from"] == "sa-paper" and sc.scale > 0 and sc.scale != 1.0
    # no second search: only the conformal step's passes over cal are booked
    n_cal = sum(len(t) for _, t in task.cal)
    assert sc.cost.fit_forward == sc.n_samples * n_cal
    x = _data(5, 7)[0]
    derived, direct = sc.derive(base.predict(x)), sc.predict(x)
    assert torch.equal(derived.samples, direct.samples)
    assert torch.equal(derived.frozen, direct.frozen)
    assert make_method("sa-paper").derived_from is None
    with pytest.raises(ValueError, match="fitted StochasticAttention"):
        make_method("sa-conformal", base=make_method("sa-paper"))
    with pytest.raises(ValueError, match="criterion 'paper'"):
        make_method("sa-conformal", base=sc)
    other = Task(model=task.model, train=task.train, val=task.val, cal=task.cal)
    with pytest.raises(ValueError, match="another Task"):
        make_method("sa-conformal", base=base).fit(other)
    with pytest.raises(NotImplementedError, match="derives from no"):
        make_method("gaussian").derive(base.predict(x))
    assert isinstance(sc, StochasticAttention)


def test_sa_recommended_configuration(task: Task) -> None:
    """``sa`` is a thin wrapper over ``attnuq.SARegressor``: the auto criterion resolves to the
    debiased L_SA on this scalar output, the prediction is the estimator's own (centred on the
    frozen output, intervals from the calibration order statistics), its fit's passes are
    booked; the ablations share ``sa-paper``'s nu and draws (``base=``) and ``derive`` equals
    ``predict`` bit for bit."""
    from attnuq import SARegressor
    from attnuq.predictive import recentre
    from attnuq_bench.methods.sa import RecommendedSA

    kw = _CHEAP_KW["sa"] | {"max_evals": 2, "nu_range": (1, 16)}
    sa = make_method("sa", **kw).fit(task)
    assert isinstance(sa, RecommendedSA) and isinstance(sa.estimator, SARegressor)
    info = sa.info()
    assert info["criterion_resolved"] == "paper-debiased" and info["recentre"] == "mean"
    assert sa.estimator.report.criterion == "auto" and sa.estimator.n_samples == 8
    assert info["form"] in ("sa-normalised", "sa-floor", "conformal", "gaussian")
    assert 0 <= info["floor_beta_units"]
    x = _data(5, 7)[0]
    g = sa.predict(x)
    assert isinstance(g, SAPredictive)
    frozen = task.model(x).detach()
    assert torch.equal(g.mean, frozen)
    same = sa.estimator.predict(x)
    for a, b in zip(g.interval(0.95), same.interval(0.95), strict=True):
        assert torch.equal(a, b)
    assert sa.cost.fit_forward == sa.estimator.diagnostics["forward_passes"] > 0
    # sa-centre: the same search and passes, the centre chosen on validation too
    sc = make_method("sa-centre", **kw).fit(task)
    ci = sc.info()
    assert sc.estimator.recentre == "auto" and ci["recentre"] == "auto"
    assert ci["nu"] == info["nu"] and ci["centre"] in ("frozen", "mean")
    assert ci[f"val_crps_{ci['centre']}"] == min(ci["val_crps_frozen"], ci["val_crps_mean"])
    assert "centre" not in info
    with pytest.raises(TypeError, match="sa-centre fixes recentre='auto'"):
        make_method("sa-centre", recentre=True)
    base = make_method("sa-paper", **kw).fit(task)
    for name in ("sa-recentred", "sa-floor"):
        m = make_method(name, base=base).fit(task)
        assert m.nu == base.nu and m.derived_from == "sa-paper"
        bp = base.predict(x)
        d, p = m.derive(bp), m.predict(x)
        assert type(d) is type(p)
        if name == "sa-recentred":
            assert isinstance(p, Predictive) and p.frozen is not None
            assert torch.equal(d.samples, p.samples)  # type: ignore[union-attr]
            assert torch.equal(p.samples, recentre(bp.samples, bp.frozen, "mean"))
            torch.testing.assert_close(p.mean, p.frozen, rtol=0, atol=1e-6)
        else:
            assert torch.equal(d.mean, p.mean) and torch.equal(d.std, p.std)
    with pytest.raises(ValueError, match="choose one"):
        make_method("sa-floor", conformal=True)
    with pytest.raises(ValueError, match="got recentre='mode'"):
        make_method("sa-paper", recentre="mode")
    with pytest.raises(ValueError, match="raw SA"):
        make_method("sa-floor", base=make_method("sa-recentred", base=base).fit(task))


def test_conformal_is_per_output_coordinate() -> None:
    """ETT/ERA5's multi-output case: q per (step, channel) is the finite-sample rank of
    |residual| over the calibration rows, and the predictive interval is exactly f +- q."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(1), nn.Linear(6, 8), nn.Unflatten(1, (4, 2))).eval()
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, 3, 2, generator=g) for n in (60, 39)]
    noise = torch.tensor([0.05, 2.0])  # channel 1 is 40x noisier
    with torch.no_grad():
        ys = [net(x) + torch.randn(len(x), 4, 2, generator=g) * noise for x in xs]
    task = Task(model=net, train=(xs[0], ys[0]), val=(xs[0], ys[0]), cal=(xs[1], ys[1]),
                batch_size=16)
    m = make_method("conformal", alpha=0.1, n_quantiles=30).fit(task)
    with torch.no_grad():
        r = (ys[1] - net(xs[1])).abs().sort(dim=0).values  # (39, 4, 2)
    k = math.ceil(40 * 0.9)  # n = 39: the 36th smallest
    assert m.q_per_output is not None and m.q_per_output.shape == (4, 2)
    torch.testing.assert_close(m.q_per_output, r[k - 1].double(), rtol=0, atol=0)
    assert m.q == pytest.approx(float(r[k - 1].double().mean()))
    assert bool((m.q_per_output[:, 1] > 10 * m.q_per_output[:, 0]).all())
    pred = m.predict(xs[1][:5])
    assert pred.samples.shape == (30, 5, 4, 2)
    lo, hi = pred.interval(0.9)
    with torch.no_grad():
        f = net(xs[1][:5])
    torch.testing.assert_close(hi - f, m.q_per_output.float().expand(5, 4, 2), rtol=1e-5,
                               atol=1e-6)
    torch.testing.assert_close(f - lo, m.q_per_output.float().expand(5, 4, 2), rtol=1e-5,
                               atol=1e-6)
    assert m.info()["q_max"] > m.info()["q_min"]


class _FB:
    """A ForecastBatch stand-in: the batch itself is the input, ``targets`` (B, Q)."""

    def __init__(self, seed: int, B: int = 3, L: int = 6, Q: int = 4) -> None:
        g = torch.Generator().manual_seed(seed)
        self.obs_times = torch.rand(B, L, generator=g) * 24
        self.obs_channels = torch.randint(0, 3, (B, L), generator=g)
        self.obs_values = torch.rand(B, L, generator=g)
        self.obs_mask = torch.ones(B, L, dtype=torch.bool)
        self.query_times = 24 + torch.rand(B, Q, generator=g) * 24
        self.query_channels = torch.randint(0, 3, (B, Q), generator=g)
        self.targets = torch.rand(B, Q, generator=g)
        self.query_mask = torch.ones(B, Q, dtype=torch.bool)


def test_mc_dropout_runs_on_the_physionet_forecasters() -> None:
    """The registered mc-dropout on a model whose forward takes ForecastBatch inputs and returns
    a ForecastOutput (PhysioNet's softmax control): samples of the output's mean, the deterministic
    mean as frozen, seeded draws, only dropout switched on."""
    from attnuq.models.levy_forecaster import SoftmaxForecaster, forward_batch

    torch.manual_seed(1)
    model = SoftmaxForecaster(3, d=16, encoder_layers=1, dropout=0.3).eval()
    batches = [_FB(s) for s in range(3)]
    task = Task(model=model, train=batches[:2], val=batches[2:], cal=batches[2:],
                forward_fn=forward_batch)
    assert task.n_train == 6
    mc = make_method("mc-dropout", n_samples=7, seed=4).fit(task)
    b = batches[2]
    pred = mc.predict(b)
    assert pred.samples.shape == (7, 3, 4)
    with torch.no_grad():
        torch.testing.assert_close(pred.frozen, forward_batch(model, b).mean, rtol=0, atol=0)
        torch.manual_seed(4)
        with dropout_active(model):
            ref = torch.stack([forward_batch(model, b).mean for _ in range(7)])
    assert torch.equal(pred.samples, ref) and float(pred.samples.std(0).mean()) > 0
    assert not model.training and torch.equal(mc.predict(b).samples, pred.samples)
