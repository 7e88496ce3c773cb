"""calibrate(): recovers a known optimum with grid and BO; report, errors, input forms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tests.attnuq._reference_calibration import make_uniform_problem
from torch import nn

from attnuq.calibration import CalibrationReport, calibrate

C, SIGMA = 4.0, 1.0
# Gaussian limit (the multinomial mean of nu >= 16 Hadamard rows is close to it):
# R = (c/sqrt(nu)) chi_E, Z = sigma chi_E, kappa = E[chi^2]/E[chi]^2. scale/crps/coverage are
# optimal at c^2/nu = sigma^2. L_SA (M passes, plug-in estimator) is minimised where
# E R = E Z / (kappa + (kappa - 1)/M).
E_DIM, M = 8, 10
E_CHI = math.sqrt(2) * math.gamma((E_DIM + 1) / 2) / math.gamma(E_DIM / 2)
KAPPA = E_DIM / E_CHI**2
NU_STAR = {
    "scale": C**2 / SIGMA**2,
    "crps": C**2 / SIGMA**2,
    "coverage": C**2 / SIGMA**2,
    "paper": (C / SIGMA * (KAPPA + (KAPPA - 1) / M)) ** 2,
    # the debiased L_SA is optimal at the scale match; "auto" is it for E = 8 elements
    "paper-debiased": C**2 / SIGMA**2,
    "auto": C**2 / SIGMA**2,
}


@pytest.fixture(scope="module")
def problem() -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    model, v, y = make_uniform_problem(n=128, e=E_DIM, c=C, sigma=SIGMA)
    return model, [(v[i : i + 64], y[i : i + 64]) for i in range(0, 128, 64)]


# a smaller search than the defaults to keep the test fast: 15 grid points (ratio sqrt 2)
RANGE = (2, 256)
KW = {"nu_range": RANGE, "n_passes": M, "progress": False}


@pytest.mark.parametrize("criterion", ["scale", "paper", "crps", "coverage", "paper-debiased",
                                       "auto"])
def test_grid_and_bo_recover_known_optimum(problem, criterion: str) -> None:  # type: ignore[no-untyped-def]
    model, data = problem
    nu_star = NU_STAR[criterion]
    grid = calibrate(model, data, criterion=criterion, search="grid", grid_size=15, **KW)
    bo = calibrate(model, data, criterion=criterion, search="bo", max_evals=4, **KW)
    assert len(grid.evaluations) == 15
    assert grid.noise_band is not None and grid.nu in grid.noise_band
    # the analytic optimum lies inside the grid's noise band (between its extreme members)
    assert min(grid.noise_band) <= nu_star <= max(grid.noise_band)
    # BO lands in the band: its nu lies between the grid neighbours just outside the band ...
    step = math.sqrt(2.0)  # grid ratio (256/2)^(1/14)
    assert min(grid.noise_band) / step < bo.nu < max(grid.noise_band) * step
    # ... and its measured objective is within 5 paired standard errors of the grid minimum
    # (same examples; normal approximation -> false failure < 1e-6).
    gi, bi = grid.chosen.influence, bo.chosen.influence
    assert gi is not None and bi is not None
    se_d = float(np.std(bi - gi, ddof=1)) / math.sqrt(len(gi))
    assert bo.chosen.objective - grid.chosen.objective <= 5 * se_d + 1e-12
    # with at most a third of the grid's forward passes
    assert bo.forward_passes <= grid.forward_passes / 3
    # the surrogate recovers the exact exponent s(nu) ~ nu^(-1/2) (5 posterior sd)
    a_mean, a_sd = bo.surrogate["mean"][1], math.sqrt(bo.surrogate["cov"][1][1])  # type: ignore[index]
    assert abs(a_mean + 0.5) < 5 * a_sd + 0.02
    if criterion == "scale":
        # ln nu_hat = ln nu* + 2 (ln s0_hat - ln s0) + ...: 5 sd of that plus integer rounding
        tol = 2 * 5 * math.sqrt(2) * bo.chosen.se + math.log1p(1 / nu_star)
        assert abs(math.log(bo.nu / nu_star)) < tol


def test_report_roundtrip_and_contents(problem, tmp_path) -> None:  # type: ignore[no-untyped-def]
    model, data = problem
    rep = calibrate(model, data, criterion="paper", search="bo", **KW)
    assert rep.nu in [e.nu for e in rep.evaluations]
    assert rep.forward_passes == 1 + rep.n_passes * len(rep.evaluations)
    assert rep.n_examples == 128 and rep.wall_time > 0
    for e in rep.evaluations:
        assert e.se > 0 and math.isfinite(e.objective)
        assert set(e.values) == {"l_sa", "crps", "coverage", "scale_ratio"}
        assert e.values["l_sa"] == pytest.approx(e.objective)
    path = rep.save(tmp_path / "r.json")
    back = CalibrationReport.load(path)
    assert back.to_dict() == rep.to_dict()
    assert CalibrationReport.from_json(rep.to_json()).nu == rep.nu
    lo, hi = rep.nu_interval  # type: ignore[misc]
    assert RANGE[0] <= lo <= hi <= RANGE[1]
    with pytest.raises(KeyError, match="not evaluated"):
        rep.evaluation(999_999)


def test_same_seed_same_report_and_input_forms(problem) -> None:  # type: ignore[no-untyped-def]
    model, data = problem
    v, y = data[0]
    a = calibrate(model, [(v, y)], criterion="scale", search="bo", progress=False)
    b = calibrate(model, [((v,), y)], criterion="scale", search="bo", progress=False)
    c = calibrate(model, [({"v": v, "scale": 1.0}, y)], criterion="scale", progress=False)
    assert a.nu == b.nu == c.nu
    assert [e.objective for e in a.evaluations] == [e.objective for e in c.evaluations]
    # output_fn maps a structured output to the prediction
    wrapped = calibrate(
        _TupleOut(model).eval(), [(v, y)], criterion="scale", output_fn=lambda o: o["pred"],
        progress=False,
    )
    assert wrapped.nu == a.nu


class _TupleOut(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, v: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"pred": self.inner(v)}


class _Bypass(nn.Module):
    """Holds an attention module that the forward pass never reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.lin = nn.Linear(8, 8)

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return self.lin(v.mean(1))


class _Ignored(_Bypass):
    """Calls its attention but returns a function of the input only."""

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        self.mha(v, v, v, need_weights=False)
        return self.lin(v.mean(1))


def test_clear_errors(problem) -> None:  # type: ignore[no-untyped-def]
    model, data = problem
    v, y = data[0]
    with pytest.raises(ValueError, match="data is empty"):
        calibrate(model, [], progress=False)
    bad = y.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"targets .*non-finite"):
        calibrate(model, [(v, bad)], progress=False)
    with pytest.raises(ValueError, match=r"prediction.shape=\(64, 8\) and targets.shape=\(64, 3\)"):
        calibrate(model, [(v, y[:, :3])], progress=False)
    with pytest.raises(RuntimeError, match=r"_Bypass never called .* sites \['mha'\]"):
        calibrate(_Bypass().eval(), [(v, y)], progress=False)
    with pytest.raises(RuntimeError, match="did not change under stochastic attention"):
        calibrate(_Ignored().eval(), [(v, y)], progress=False)
    with pytest.raises(ValueError, match="no attention site"):
        calibrate(nn.Sequential(nn.Flatten(), nn.Linear(256, 8)).eval(), [(v, y)], progress=False)
    with pytest.raises(ValueError, match="criterion"):
        calibrate(model, data, criterion="nll", progress=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="search"):
        calibrate(model, data, search="random", progress=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nu_range"):
        calibrate(model, data, nu_range=(0, 10), progress=False)
    with pytest.raises(ValueError, match="n_passes"):
        calibrate(model, data, n_passes=1, progress=False)
    with pytest.raises(TypeError, match="data must be an iterable"):
        calibrate(model, v, progress=False)  # type: ignore[arg-type]


def test_bench_suite_writes_table(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("matplotlib")
    from attnuq_bench.suites import get_suite

    suite = get_suite("calibration")
    import argparse

    p = argparse.ArgumentParser()
    suite.add_arguments(p)
    args = p.parse_args(["--models", "uniform-mha", "--criteria", "scale", "--seeds", "1",
                         "--nu-max", "64", "--grid-size", "7", "--max-evals", "2",
                         "--out", str(tmp_path / "cal")])
    out = suite.run(args)
    text = (tmp_path / "cal.md").read_text()
    assert "| uniform-mha | scale | 0 |" in text and "machine:" in text
    import json

    rows = json.loads((out / "results.json").read_text())["rows"]
    assert rows[0]["grid_passes"] == 1 + 10 * 7 and rows[0]["bo_passes"] <= 1 + 10 * 2
    assert (out / "uniform-mha_scale.png").exists()


def test_log_grid_validates() -> None:
    from attnuq.calibration import log_grid

    assert log_grid((2, 2048), 2) == [2, 2048]
    with pytest.raises(ValueError, match="size must be an int >= 2"):
        log_grid((1, 64), 1)
    with pytest.raises(ValueError, match="nu_range must be two ints"):
        log_grid((0, 64), 5)
    with pytest.raises(ValueError, match="nu_range must be two ints"):
        log_grid((8, 4), 5)


def test_sizes_are_refused_with_a_reason(problem, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Issue #23 item 8: a 1-example set would give NaN standard errors; ``nu_range`` past
    ``MAX_NU = 2**31 - 1`` cannot run (it planned a 351 TB request before); a call past the
    memory budget (``ATTNUQ_MAX_BYTES``) is refused with the bytes it needs."""
    model, data = problem
    v, y = data[0]
    with pytest.raises(ValueError, match=r"calibration data has 1 example"):
        calibrate(model, [(v[:1], y[:1])], **KW)
    with pytest.raises(ValueError, match=r"MAX_NU = 2\*\*31 - 1.*nu_range=\(1, 1099511627776\)"):
        calibrate(model, data, nu_range=(1, 2**40), progress=False)
    monkeypatch.setenv("ATTNUQ_MAX_BYTES", "4096")
    with pytest.raises(ValueError, match=r"needs about [\d,]+ bytes .*budget of 4,096 bytes"):
        calibrate(model, data, **KW)


def test_public_names_are_the_package_objects() -> None:
    """README's ``attnuq.calibrate(...)`` / ``attnuq.CalibrationReport`` are the calibration
    package's objects, and the package imports plotting only downward (plots never imports it)."""
    import ast
    import inspect

    import attnuq
    import attnuq.calibration as cal
    import attnuq.plots as plots
    from attnuq.calibration.report import CalibrationReport as Report
    from attnuq.calibration.search import bo_search, grid_search

    assert attnuq.calibrate is cal.calibrate is calibrate
    assert attnuq.CalibrationReport is cal.CalibrationReport is CalibrationReport is Report
    assert cal.grid_search is grid_search and cal.bo_search is bo_search
    tree = ast.parse(inspect.getsource(plots))
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m and m.startswith("attnuq.calibration")]


def test_scalar_output_paper_is_biased_debiased_is_not() -> None:
    """A scalar output (E = 1, 512 examples): the paper's L_SA optimum sits at
    ``nu = (c kappa_M / sigma)^2 = 42.4`` (perturbation 0.61 of the residual scale), the debiased
    criterion's and ``auto``'s at the scale match ``nu* = 16``; each lies in its grid's noise
    band (2 paired standard errors; the band rule of the grid search)."""
    model, v, y = make_uniform_problem(n=512, e=1, c=C, sigma=SIGMA, seed=1)
    data = [(v[i : i + 128], y[i : i + 128]) for i in range(0, 512, 128)]
    kappa = math.pi / 2  # E[chi_1^2] / E[chi_1]^2
    star = {"paper": (C / SIGMA * (kappa + (kappa - 1) / M)) ** 2, "paper-debiased": C**2,
            "auto": C**2}
    bands = {}
    for crit, nu_star in star.items():
        grid = calibrate(model, data, criterion=crit, search="grid", grid_size=15, **KW)
        assert grid.noise_band is not None
        assert min(grid.noise_band) <= nu_star <= max(grid.noise_band), (crit, grid.noise_band)
        bands[crit] = grid.noise_band
    assert bands["auto"] == bands["paper-debiased"]
    assert max(bands["paper-debiased"]) < star["paper"]  # the bias is resolved by the data


def test_cpu_passes_are_batched_within_the_activation_cap() -> None:
    """On the CPU calibrate caps the replicas per call as predict does: a model whose
    feed-forward output for one batch, (8, 6, 4096) = 196,608 elements, is above
    CPU_MAX_ACTIVATION runs one replica per call (no call sees more than the batch), a
    narrow one stacks every pass of an evaluation into one call; batch_replicas overrides."""
    from attnuq.montecarlo import CPU_MAX_ACTIVATION

    def run(ffn: int, **kw: object) -> set[int]:
        layer = torch.nn.TransformerEncoderLayer(8, 2, ffn, dropout=0.0, batch_first=True)
        model = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()
        sizes: list[int] = []
        model.register_forward_pre_hook(lambda _m, a: sizes.append(int(a[0].shape[0])))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(8, 6, 8, generator=g)
        y = torch.randn(8, 6, 8, generator=g)
        calibrate(model, [(x, y)], n_passes=4, search="grid", grid_size=2,
                  nu_range=(1, 4), progress=False, **kw)  # type: ignore[arg-type]
        return set(sizes)

    assert 8 * 6 * 4096 > CPU_MAX_ACTIVATION
    assert run(4096) == {8}
    assert run(16) == {8, 32}  # the frozen pass, then 4 replicas per call
    assert run(4096, batch_replicas=4) == {8, 32}
