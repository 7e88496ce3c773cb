"""SARegressor: fit / predict / save / load, coverage at any level, the form's choice, every
refusal. Tiny untrained or briefly trained encoders keep it fast."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import attnuq
from attnuq.calibration import EdgeWarning, calibrate
from attnuq.estimators._common import EstimatorWarning, read_pairs, spearman
from attnuq.estimators._regressor import (
    MAX_SCORES,
    SAPredictive,
    SARegressor,
    _crps_atoms,
    _Part,
    _table,
)


class Net(nn.Module):
    """(B, L, 4) -> (B,): an encoder layer, mean pooling and a linear head."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(4, d)
        layer = nn.TransformerEncoderLayer(d, 2, 2 * d, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.embed(x)).mean(1)).squeeze(-1)


def _data(net: nn.Module, n: int, gen: torch.Generator, noise: float = 0.3
          ) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 5, 4, generator=gen)
    with torch.no_grad():
        y = net(x) + noise * torch.randn(n, generator=gen)
    return x, y


def _batches(x: torch.Tensor, y: torch.Tensor, size: int = 100) -> list:
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(y), size)]


@pytest.fixture(scope="module")
def fitted() -> tuple[SARegressor, Net, torch.Generator]:
    torch.manual_seed(0)
    net = Net().eval()
    g = torch.Generator().manual_seed(1)
    val = _data(net, 200, g)
    cal = _data(net, 400, g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EstimatorWarning)
        sa = SARegressor(net, nu_range=(1, 64), progress=False).fit(_batches(*val),
                                                                   _batches(*cal))
    return sa, net, g


def test_predict_shapes_and_diagnostics(fitted: tuple) -> None:
    sa, net, _ = fitted
    x = torch.randn(7, 5, 4)
    pred = sa.predict(x)
    assert isinstance(pred, SAPredictive)
    assert pred.samples.shape == (sa.n_samples, 7) and pred.mean.shape == (7,)
    with torch.no_grad():
        assert torch.equal(pred.mean, net(x))  # recentred: the frozen output
    lo, hi = pred.interval(0.9)
    assert bool((lo <= pred.mean).all() and (pred.mean <= hi).all())
    qs = pred.quantile(torch.tensor([0.1, 0.3, 0.5, 0.7, 0.9]))
    assert qs.shape == (5, 7) and bool((qs[1:] >= qs[:-1]).all())
    assert torch.equal(pred.quantile(0.05), lo) and torch.equal(pred.quantile(0.95), hi)
    d = sa.diagnostics
    for key in ("nu", "nu_at_edge", "criterion_resolved", "spearman_spread_abs_error",
                "floor_beta", "form", "raw_val_coverage", "val_crps_by_beta", "forward_passes"):
        assert key in d, key
    assert d["criterion_resolved"] == "paper-debiased"  # a scalar output
    assert d["form"] in ("sa-normalised", "sa-floor", "conformal", "gaussian")
    assert set(d["raw_val_coverage"]) == {"0.5", "0.9", "0.95"}
    # the chosen beta has the lowest cross-fitted CRPS of the grid
    crps = d["val_crps_by_beta"]
    key = ("gaussian" if d["form"] == "gaussian" else repr(d["floor_beta_units"])
           if math.isfinite(d["floor_beta_units"]) else "inf")
    assert crps[key] == min(crps.values()) and "gaussian" in crps


def test_coverage_at_any_level() -> None:
    """Split-conformal coverage at several levels, none of them 'fitted'.

    Conditional on the calibration set, the coverage of a level L is Beta-distributed with
    mean ~L and sd sqrt(L (1 - L) / n_cal); the test's m elements add sd sqrt(L (1 - L) / m).
    The tolerance is 4 combined sds plus 1/(n_cal + 1) (the finite-sample excess): each level
    fails falsely with probability < 7e-5, the three together < 2e-4 (fixed seeds: this run
    either always passes or always fails).
    """
    torch.manual_seed(3)
    net = Net().eval()
    g = torch.Generator().manual_seed(4)
    n_cal, m = 400, 2000
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EstimatorWarning)
        # gaussian=False: every form split-conformal (the Gaussian one has no such guarantee)
        sa = SARegressor(net, nu=4, gaussian=False, progress=False).fit(
            _batches(*_data(net, 200, g)), _batches(*_data(net, n_cal, g)))
    x, y = _data(net, m, g)
    pred = sa.predict(x)
    for level in (0.5, 0.8, 0.93):
        lo, hi = pred.interval(level)
        cov = float(((lo <= y) & (y <= hi)).double().mean())
        sd = math.sqrt(level * (1 - level) * (1 / n_cal + 1 / m))
        assert abs(cov - level) <= 4 * sd + 1 / (n_cal + 1), (level, cov)


def test_save_load_round_trip_bit_for_bit(fitted: tuple, tmp_path: Path) -> None:
    sa, net, _ = fitted
    x = torch.randn(6, 5, 4)
    before = sa.predict(x)
    path = sa.save(tmp_path / "sa.json")
    doc = json.loads(path.read_text())  # strict JSON
    assert doc["format"] == "attnuq-estimator" and doc["estimator"] == "SARegressor"
    assert "weight" not in path.read_text()
    back = SARegressor.load(path, net, progress=False)
    after = back.predict(x)
    assert torch.equal(before.samples, after.samples)
    for level in (0.3, 0.9):
        for a, b in zip(before.interval(level), after.interval(level), strict=True):
            assert torch.equal(a, b)
    assert torch.equal(before.std, after.std)
    assert back.diagnostics["form"] == sa.diagnostics["form"]


def test_load_refuses_another_model_unless_not_strict(fitted: tuple, tmp_path: Path) -> None:
    sa, _net, _ = fitted
    path = sa.save(tmp_path / "sa.json")
    torch.manual_seed(123)
    other = Net().eval()
    with pytest.raises(ValueError, match=r"fitted on another model.*strict=False"):
        SARegressor.load(path, other)
    with pytest.warns(EstimatorWarning, match="loaded anyway") as record:
        SARegressor.load(path, other, strict=False)
    assert record[0].filename == __file__  # the warning names the caller's line


@pytest.mark.parametrize("text, match", [
    ('{"format": "attnuq-estimator", "format_ver', "not valid JSON"),
    ("\x00\xff garbage", "not valid JSON"),
    ('{"format": "something-else"}', "expected format='attnuq-estimator'"),
    ('[1, 2]', "format='list'"),
])
def test_load_refuses_torn_or_foreign_json(fitted: tuple, tmp_path: Path, text: str,
                                           match: str) -> None:
    _, net, _ = fitted
    p = tmp_path / "x.json"
    p.write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError, match=match):
        SARegressor.load(p, net)


def test_load_refuses_other_kind_and_bad_fields(fitted: tuple, tmp_path: Path) -> None:
    sa, net, _ = fitted
    path = sa.save(tmp_path / "sa.json")
    doc = json.loads(path.read_text())
    doc["estimator"] = "SAClassifier"
    (tmp_path / "c.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="holds a fitted 'SAClassifier'"):
        SARegressor.load(tmp_path / "c.json", net)
    doc = json.loads(path.read_text())
    doc["fitted"]["scores"] = doc["fitted"]["scores"][::-1]
    (tmp_path / "s.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"malformed SARegressor file.*sorted"):
        SARegressor.load(tmp_path / "s.json", net)
    for centre in ("mean", "median"):  # recentre=True fixes the frozen centre
        doc = json.loads(path.read_text())
        doc["fitted"]["centre"] = centre
        (tmp_path / "m.json").write_text(json.dumps(doc))
        with pytest.raises(ValueError, match=rf"fitted.centre must be .*got '{centre}'"):
            SARegressor.load(tmp_path / "m.json", net)
    doc = json.loads(path.read_text())  # a file from before the centre was stored
    del doc["fitted"]["centre"]
    (tmp_path / "old.json").write_text(json.dumps(doc))
    x = torch.randn(3, 5, 4)
    assert torch.equal(SARegressor.load(tmp_path / "old.json", net).predict(x).mean,
                       sa.predict(x).mean)
    with pytest.raises(FileNotFoundError):
        SARegressor.load(tmp_path / "none.json", net)


def test_bad_inputs_name_the_value(fitted: tuple) -> None:
    sa, net, g = fitted
    x, y = _data(net, 20, g)
    est = SARegressor(net, nu=4, progress=False)
    with pytest.raises(ValueError, match="val_data is empty"):
        est.fit([], [(x, y)])
    with pytest.raises(ValueError, match="cal_data is empty"):
        est.fit([(x, y)], iter([]))
    bad = y.clone()
    bad[3] = float("nan")
    with pytest.raises(ValueError, match=r"val_data: targets of batch 0 hold 1 non-finite"):
        est.fit([(x, bad)], [(x, y)])
    y2 = y[:, None].expand(-1, 2)
    with pytest.raises(ValueError, match="val_data and cal_data targets must share one shape"):
        est.fit([(x, y)], [(x, y2)])
    with pytest.raises(ValueError, match=r"val_data: the prediction and the targets of batch 0"):
        est.fit([(x, y2)], [(x, y2)])
    with pytest.raises(ValueError, match=r"targets of batch 0 must have dim 0 = B = 20, got"):
        SARegressor(net, nu_range=(1, 8), progress=False).fit([(x, y[:10])], [(x, y)])
    with pytest.raises(TypeError, match="val_data must be an iterable"):
        est.fit(x, [(x, y)])
    with pytest.raises(ValueError, match="pairs, got item 0"):
        est.fit([(x, y, y)], [(x, y)])
    pred = sa.predict(x)
    for level in (0.0, 1.0, 1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match="level"):
            pred.interval(level)
    # past the largest level n / (n + 1) of this fit (n: 400 calibration scores, or the
    # Gaussian form's 1000 atoms)
    with pytest.raises(ValueError, match=rf"needs .* got n={pred.n}"):
        pred.interval((pred.n + 0.5) / (pred.n + 1))
    with pytest.raises(RuntimeError, match="not fitted"):
        SARegressor(net).predict(x)
    for kw, match in (({"seed": -1}, "seed"), ({"n_samples": 1}, "n_samples"),
                      ({"nu_range": (0, 4)}, "nu_range"), ({"criterion": "x"}, "criterion"),
                      ({"floor": "yes"}, "floor"), ({"nu": 0}, "nu"),
                      ({"max_rowz": 1}, r"unknown calibrate_kwargs \['max_rowz'\]"),
                      ({"max_evals": 0}, "max_evals=0"), ({"progress": "yes"}, "progress='yes'"),
                      ({"level": 0.5}, r"set \['level'\] as SARegressor arguments")):
        with pytest.raises((ValueError, TypeError), match=match):
            SARegressor(net, **kw)
    # the predictive's own arguments
    for bad_y in (torch.full_like(y, float("nan")), torch.full_like(y, float("inf"))):
        for method in (pred.pit, pred.crps, pred.nll):
            with pytest.raises(ValueError, match="targets contains non-finite values"):
                method(bad_y)
    for factor in (-1.0, float("nan"), float("inf")):
        msg = f"factor must be finite and >= 0, got factor={factor}"
        with pytest.raises(ValueError, match=msg):
            pred.scaled(factor)
    with pytest.raises(TypeError, match="factor must be a non-negative real"):
        pred.scaled(True)  # type: ignore[arg-type]
    for n in (0, -1, 2.5, True):
        with pytest.raises((ValueError, TypeError), match=rf"n must be a positive int, got n={n}"):
            pred.sample(n)  # type: ignore[arg-type]


def test_edge_warns_with_both_numbers() -> None:
    """Targets far noisier than any SA spread: nu sits at the lower edge; calibrate records
    it in the report and warns, and so does fit, naming s(1) and the target scale."""
    torch.manual_seed(5)
    net = Net().eval()
    g = torch.Generator().manual_seed(6)
    val = _data(net, 60, g, noise=50.0)
    cal = _data(net, 60, g, noise=50.0)
    with pytest.warns(EdgeWarning, match=r"lower edge.*s\(1\) = .* target scale"):
        rep = calibrate(net, [val], nu_range=(1, 64), n_passes=4, progress=False)
    assert rep.nu == 1 and rep.edge is not None and rep.edge["side"] == "lower"
    assert rep.edge["spread"] < rep.edge["target_scale"]
    assert "edge" in rep.to_dict()
    with pytest.warns(EstimatorWarning, match=r"lower edge.*largest spread s\(1\)"):
        sa = SARegressor(net, nu_range=(1, 64), progress=False).fit([val], [cal])
    assert sa.diagnostics["nu_at_edge"] == "lower"
    assert sa.diagnostics["edge_spread"] < sa.diagnostics["edge_target_scale"]
    assert any("lower edge" in w for w in sa.diagnostics["warnings"])


def test_plain_conformal_chosen_and_warned(monkeypatch: pytest.MonkeyPatch) -> None:
    """A spread unrelated to the errors (log-normal, sd of the log 2) with homoscedastic
    errors: the cross-fitted CRPS prefers constant width, and fit says so."""
    g = torch.Generator().manual_seed(7)

    def fake_part(self: SARegressor, pairs: list, nu: object, name: str
                  ) -> dict[str, _Part]:
        n = 3000
        sigma = torch.exp(2.0 * torch.randn(n, 1, generator=g, dtype=torch.float64))
        y = torch.randn(n, 1, generator=g, dtype=torch.float64)
        return {"frozen": _Part(torch.zeros(n, 1, dtype=torch.float64), sigma, y,
                               {"0.9": 0.0})}

    monkeypatch.setattr(SARegressor, "_part", fake_part)
    net = Net().eval()
    x = torch.randn(4, 5, 4)
    with pytest.warns(EstimatorWarning, match="plain split conformal"):
        sa = SARegressor(net, nu=2, gaussian=False, progress=False).fit(
            [(x, torch.zeros(4))], [(x, torch.zeros(4))])
    assert sa.diagnostics["form"] == "conformal" and math.isinf(sa.diagnostics["floor_beta"])
    assert abs(sa.diagnostics["spearman_spread_abs_error"]) < 0.1
    assert "gaussian" not in sa.diagnostics["val_crps_by_beta"]


def _homoscedastic(monkeypatch: pytest.MonkeyPatch, seed: int, noise: str) -> None:
    """Replace the parts by 3000 elements: a spread unrelated to the errors (log-normal) and
    homoscedastic errors, standard Gaussian or Student-t with 2.5 degrees of freedom (its RMS
    is dominated by rare large errors, so a Gaussian of that RMS is far too wide)."""
    g = torch.Generator().manual_seed(seed)

    def fake_part(self: SARegressor, pairs: list, nu: object, name: str
                  ) -> dict[str, _Part]:
        n = 3000
        sigma = torch.exp(2.0 * torch.randn(n, 1, generator=g, dtype=torch.float64))
        z = torch.randn(n, 1, generator=g, dtype=torch.float64)
        if noise == "t":
            chi2 = 2.0 * torch._standard_gamma(torch.full((n, 1), 1.25, dtype=torch.float64),
                                               generator=g)
            z = z / torch.sqrt(chi2 / 2.5)
        return {"frozen": _Part(torch.zeros(n, 1, dtype=torch.float64), sigma, z,
                               {"0.9": 0.0})}

    monkeypatch.setattr(SARegressor, "_part", fake_part)


def test_gaussian_form_chosen_on_gaussian_errors_and_exact(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    """Homoscedastic N(0, 1) errors, spread unrelated: the Gaussian form wins the cross-fitted
    CRPS (empirical forms pay for their sampling noise), fit says so, and the predictive is
    N(0, s^2) with s the calibration RMS: CRPS within 1e-4 relative of the closed form (the
    discretisation by 2000 midpoint quantiles), intervals f +- s z_{(1+L)/2} within 5e-3 (the
    rank ceil((K + 1) L) moves the level by at most 1.5 / K, z by at most 2.4e-3 at L = 0.5)."""
    from attnuq.metrics import crps_normal

    _homoscedastic(monkeypatch, 11, "gauss")
    net = Net().eval()
    x = torch.randn(4, 5, 4)
    with pytest.warns(EstimatorWarning, match="Gaussian residual model"):
        sa = SARegressor(net, nu=2, progress=False).fit([(x, torch.zeros(4))],
                                                        [(x, torch.zeros(4))])
    d = sa.diagnostics
    assert d["form"] == "gaussian" and math.isinf(d["floor_beta"]) and d["n_cal"] == 3000
    crps = d["val_crps_by_beta"]
    assert crps["gaussian"] == min(crps.values())
    fit = sa._fitted
    assert fit is not None
    s = float(fit["scores"][-1] / attnuq.estimators._regressor._gauss_abs_quantiles()[-1])
    pred = SAPredictive(mean=torch.zeros(500), spread=torch.ones(500, dtype=torch.float64),
                        scores=fit["scores"], ranks=fit["ranks"], n=fit["n_cal"],
                        samples=torch.zeros(2, 500), frozen=torch.zeros(500), form="gaussian")
    y = torch.linspace(-4, 4, 500, dtype=torch.float64)
    exact = crps_normal(torch.zeros(500, dtype=torch.float64),
                        torch.full((500,), s, dtype=torch.float64), y, reduction="none")
    assert torch.allclose(pred.crps(y, reduction="none"), exact, rtol=1e-4)
    for level, z in ((0.5, 0.6744897501960817), (0.9, 1.6448536269514722)):
        assert pred.interval(level)[1][0].item() == pytest.approx(s * z, rel=5e-3)
    # the file keeps the form: load gives the same predictive
    path = sa.save(tmp_path / "g.json")
    back = SARegressor.load(path, net, progress=False)
    assert back._fitted is not None and back._fitted["form"] == "gaussian"
    assert torch.equal(back._fitted["scores"], fit["scores"]) and back.gaussian


def test_empirical_form_beats_gaussian_on_heavy_tails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Student-t (2.5 df) errors: the Gaussian of their RMS is too wide, the empirical
    (conformal) form wins the cross-fitted CRPS."""
    _homoscedastic(monkeypatch, 12, "t")
    net = Net().eval()
    x = torch.randn(4, 5, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EstimatorWarning)
        sa = SARegressor(net, nu=2, progress=False).fit([(x, torch.zeros(4))],
                                                        [(x, torch.zeros(4))])
    crps = sa.diagnostics["val_crps_by_beta"]
    assert sa.diagnostics["form"] == "conformal" and crps["inf"] < crps["gaussian"]


def test_crossfit_gaussian_is_the_closed_form_of_the_halves() -> None:
    from attnuq.metrics import crps_normal

    g = torch.Generator().manual_seed(13)
    y = 2.0 * torch.randn(301, 2, generator=g, dtype=torch.float64)
    part = _Part(torch.zeros(301, 2, dtype=torch.float64), torch.ones(301, 2,
                 dtype=torch.float64), y, {})
    got = SARegressor._crossfit_gaussian(part)
    ev, od = y[0::2], y[1::2]
    want = 0.0
    for a, b in ((ev, od), (od, ev)):
        s = float(a.pow(2).mean().sqrt())
        want += float(crps_normal(torch.zeros_like(b), torch.full_like(b, s), b,
                                  reduction="none").sum())
    assert got == pytest.approx(want / y.numel(), rel=1e-4)
    zero = _Part(torch.zeros(4, 1, dtype=torch.float64), torch.ones(4, 1, dtype=torch.float64),
                 torch.zeros(4, 1, dtype=torch.float64), {})
    assert math.isinf(SARegressor._crossfit_gaussian(zero))


def test_sa_normalised_chosen_when_spread_is_the_error_scale(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """Errors exactly sigma * N(0, 1) with sigma spread over two decades: beta = 0 wins."""
    g = torch.Generator().manual_seed(8)

    def fake_part(self: SARegressor, pairs: list, nu: object, name: str
                  ) -> dict[str, _Part]:
        n = 3000
        sigma = torch.exp(1.5 * torch.randn(n, 1, generator=g, dtype=torch.float64))
        y = sigma * torch.randn(n, 1, generator=g, dtype=torch.float64)
        return {"frozen": _Part(torch.zeros(n, 1, dtype=torch.float64), sigma, y,
                               {"0.9": 0.0})}

    monkeypatch.setattr(SARegressor, "_part", fake_part)
    net = Net().eval()
    x = torch.randn(4, 5, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EstimatorWarning)  # no warning here
        sa = SARegressor(net, nu=2, progress=False).fit([(x, torch.zeros(4))],
                                                        [(x, torch.zeros(4))])
    assert sa.diagnostics["form"] in ("sa-normalised", "sa-floor")
    assert sa.diagnostics["floor_beta_units"] <= 0.25


def test_crps_atoms_matches_brute_force() -> None:
    g = torch.Generator().manual_seed(9)
    atoms = torch.sort(torch.randn(37, generator=g, dtype=torch.float64)).values
    u = torch.randn(50, generator=g, dtype=torch.float64) * 2
    brute = (atoms[None] - u[:, None]).abs().mean(1) - 0.5 * (
        atoms[None] - atoms[:, None]).abs().mean()
    torch.testing.assert_close(_crps_atoms(atoms, u), brute, rtol=1e-12, atol=1e-12)


def test_table_keeps_a_conservative_subset() -> None:
    n = MAX_SCORES * 3 + 5
    s = torch.rand(n, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    values, ranks = _table(s)
    assert values.numel() == MAX_SCORES and int(ranks[-1]) == n
    full = torch.sort(s).values
    f64 = torch.float64
    pred = SAPredictive(mean=torch.zeros(1, dtype=f64), spread=torch.ones(1, dtype=f64),
                        scores=values, ranks=ranks, n=n, samples=torch.zeros(2, 1),
                        frozen=torch.zeros(1), form="conformal")
    for level in (0.5, 0.9, 0.99):
        k = math.ceil((n + 1) * level)
        assert float(pred.interval(level)[1]) >= float(full[k - 1])  # never narrower


def test_common_helpers() -> None:
    assert read_pairs((torch.zeros(2, 3), torch.zeros(2)), "val_data")[0][1].shape == (2,)
    with pytest.raises(ValueError, match="targets of batch 1 have shape"):
        read_pairs([(torch.zeros(2), torch.zeros(2)), (torch.zeros(2), torch.zeros(2, 2))], "d")
    x = torch.randn(200, generator=torch.Generator().manual_seed(11))
    from scipy.stats import spearmanr

    y = x**3 + torch.randn(200, generator=torch.Generator().manual_seed(12))
    assert spearman(x, y) == pytest.approx(float(spearmanr(x.numpy(), y.numpy())[0]), abs=1e-12)
    assert math.isnan(spearman(torch.ones(3), torch.arange(3.0)))


def test_exported_lazily() -> None:
    assert attnuq.SARegressor is SARegressor and "SARegressor" in dir(attnuq)


def test_readme_example_runs() -> None:
    """examples/regression.py (the README's regression example) runs and prints coverage."""
    import contextlib
    import io
    import runpy

    path = Path(__file__).resolve().parents[3] / "examples" / "regression.py"
    out = io.StringIO()
    with contextlib.redirect_stdout(out), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runpy.run_path(str(path), run_name="__main__")
    text = out.getvalue()
    assert "level 0.90: coverage" in text and "CRPS" in text


def test_auto_centre_frozen_is_the_recentred_fit_bit_for_bit(fitted: tuple) -> None:
    """Targets = frozen output + noise: ``recentre="auto"`` keeps the frozen centre, and its fit
    and predictive are those of ``recentre=True`` exactly (same passes, same arithmetic)."""
    sa, net, _ = fitted
    g = torch.Generator().manual_seed(1)  # the fixture's data, drawn again
    val, cal = _data(net, 200, g), _data(net, 400, g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EstimatorWarning)
        auto = SARegressor(net, nu_range=(1, 64), recentre="auto", progress=False).fit(
            _batches(*val), _batches(*cal))
    d = auto.diagnostics
    assert d["centre"] == "frozen" and sa.diagnostics["centre"] == "frozen"
    assert set(d["val_crps_by_centre"]) == {"frozen", "mean"}
    assert d["val_crps_by_centre"]["frozen"] <= d["val_crps_by_centre"]["mean"]
    assert d["val_crps_by_beta"] == sa.diagnostics["val_crps_by_beta"]
    assert auto.to_dict()["fitted"] == sa.to_dict()["fitted"]
    x = torch.randn(9, 5, 4)
    a, b = auto.predict(x), sa.predict(x)
    assert torch.equal(a.mean, b.mean) and torch.equal(a.spread, b.spread)
    assert torch.equal(a.samples, b.samples)


def test_auto_centre_picks_the_draws_mean_where_it_predicts_better(tmp_path: Path) -> None:
    """Targets = SA's own expectation at nu = 2 (the mean of 256 draws): the frozen output is
    off by SA's bias, the draws' mean of 64 passes is not (its Monte Carlo error, sigma / 8, is
    smaller than the bias here), so ``"auto"`` takes the mean. The fit then equals
    ``recentre=False``'s up to rounding (sigma from the recentred draws, not the raw ones), and
    the file keeps the centre."""
    from attnuq.montecarlo import predict

    torch.manual_seed(0)
    net = Net().eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(500, 5, 4, generator=g)
    y = predict(net, x, nu=2, n_samples=256, seed=99, progress=False).samples.mean(0)
    val, cal, xt = _batches(x[:200], y[:200]), _batches(x[200:400], y[200:400]), x[400:]
    auto = SARegressor(net, nu=2, n_samples=64, recentre="auto", progress=False).fit(val, cal)
    raw = SARegressor(net, nu=2, n_samples=64, recentre=False, progress=False).fit(val, cal)
    d = auto.diagnostics
    assert d["centre"] == "mean", d["val_crps_by_centre"]
    assert d["val_crps_by_centre"]["mean"] < d["val_crps_by_centre"]["frozen"]
    assert d["form"] == raw.diagnostics["form"]
    a, b = auto.predict(xt), raw.predict(xt)
    assert torch.equal(a.samples, b.samples)  # the draws as drawn: not recentred
    assert torch.equal(a.mean, b.mean)
    torch.testing.assert_close(a.spread, b.spread, rtol=1e-9, atol=0.0)
    torch.testing.assert_close(a.crps(y[400:]), b.crps(y[400:]), rtol=1e-9, atol=1e-12)
    with torch.no_grad():
        assert not torch.equal(a.mean, net(xt))  # the point prediction moved
    back = SARegressor.load(auto.save(tmp_path / "auto.json"), net, progress=False)
    assert back.recentre == "auto"
    c = back.predict(xt)
    assert torch.equal(c.mean, a.mean) and torch.equal(c.spread, a.spread)


def test_auto_centre_choice_is_the_lowest_validation_crps(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """Parts made by hand: about the frozen centre the errors have sd 1, about the mean
    sd 0.5 (same sigma): auto takes the mean and reports both scores; swapped, the frozen
    centre. The load of a file whose fitted centre contradicts its setting is refused."""
    g = torch.Generator().manual_seed(11)
    n = 2000
    sigma = torch.exp(0.3 * torch.randn(n, 1, generator=g, dtype=torch.float64))
    z = torch.randn(n, 1, generator=g, dtype=torch.float64)
    near, far = 0.5 * z, torch.zeros_like(z)  # centres whose errors y - c are z / 2 and z

    def fake(frozen: torch.Tensor, mean: torch.Tensor) -> object:
        def fake_part(self: SARegressor, pairs: list, nu: object, name: str
                      ) -> dict[str, _Part]:
            parts = {"frozen": _Part(frozen, sigma, z, {"0.9": 0.0}),
                     "mean": _Part(mean, sigma, z, {"0.9": 0.0})}
            return {c: parts[c] for c in self._centres()}
        return fake_part

    net = Net().eval()
    xb = [(torch.randn(4, 5, 4), torch.zeros(4))]
    for frozen, mean, want in ((far, near, "mean"), (near, far, "frozen")):
        monkeypatch.setattr(SARegressor, "_part", fake(frozen, mean))
        with warnings.catch_warnings():  # sigma is unrelated to the errors: a form warning
            warnings.simplefilter("ignore", EstimatorWarning)
            sa = SARegressor(net, nu=2, recentre="auto", progress=False).fit(xb, xb)
            only = SARegressor(net, nu=2, recentre=want == "frozen", progress=False).fit(xb, xb)
        d = sa.diagnostics
        assert d["centre"] == want
        assert d["val_crps_by_centre"][want] == min(d["val_crps_by_centre"].values())
        assert min(d["val_crps_by_beta"].values()) == d["val_crps_by_centre"][want]
        # one centre only: no second score
        assert "val_crps_by_centre" not in only.diagnostics
        assert only.diagnostics["val_crps_by_beta"] == d["val_crps_by_beta"]
    with pytest.raises(TypeError, match=r"recentre must be a bool or 'auto', got recentre='yes'"):
        SARegressor(net, recentre="yes")  # type: ignore[arg-type]
