"""The criteria registry of attnuq.calibration: one list read by every caller, and each
criterion's objective and target scale checked against a direct computation on synthetic
deviations (float64, no model)."""

from __future__ import annotations

import argparse
import math
from typing import get_args

import numpy as np
import pytest
import torch
from scipy.stats import t as student_t

from attnuq.calibration import CRITERIA, SEARCHES, get_criterion
from attnuq.calibration.criteria import Criterion, PassStats, summarise
from attnuq.calibration.search import Search
from attnuq.metrics import crps_samples

LEVEL = 0.8


def _choices(parser: argparse.ArgumentParser, *path: str, option: str) -> list[str]:
    """The ``choices`` of ``option`` in the (sub)parser reached by the command ``path``."""
    p = parser
    for name in path:
        sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        p = sub.choices[name]
    action = next(a for a in p._actions if option in a.option_strings)
    return list(action.choices or [])


def test_registry_is_the_single_list() -> None:
    assert CRITERIA == ("paper", "scale", "crps", "coverage", "paper-debiased", "auto")
    assert tuple(get_criterion(n).name for n in CRITERIA) == CRITERIA
    assert all(get_criterion(n).description for n in CRITERIA)
    # the type checkers' literals say the same
    assert get_args(Criterion) == CRITERIA
    assert set(get_args(Search)) == set(SEARCHES) == {"bo", "grid"}
    # the CLI reads the registry
    from attnuq.cli import build_parser

    parser = build_parser()
    assert _choices(parser, "calibrate", option="--criterion") == list(CRITERIA)
    assert _choices(parser, "calibrate", option="--search") == list(SEARCHES)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    crit = next(a for a in sub.choices["calibrate"]._actions if "--criterion" in a.option_strings)
    for name in CRITERIA:  # the help lists every criterion with its registry description
        assert f"{name}: {get_criterion(name).description}" in (crit.help or "")
    # the calibration bench (the harness's nu_search suite) reads it too
    pytest.importorskip("attnuq_bench.cli", reason="needs the harness attnuq-bench")
    bench = build_parser(["bench", "calibration"])
    assert _choices(bench, "bench", "calibration", option="--criteria") == list(CRITERIA)


def test_get_criterion_names_the_bad_value() -> None:
    with pytest.raises(ValueError, match=r"one of \('paper', .*got criterion='nll'"):
        get_criterion("nll")
    with pytest.raises(ValueError, match="got criterion=3"):
        get_criterion(3)  # type: ignore[arg-type]


def _stats(seed: int = 0, m: int = 6, scale: float = 1.0) -> tuple[PassStats, list, list]:
    """Two batches of deviations d ``(M, B, P)`` and residuals e ``(B, P)``."""
    g = torch.Generator().manual_seed(seed)
    dev = [scale * torch.randn(m, b, 3, generator=g, dtype=torch.float64) for b in (5, 7)]
    resid = [torch.randn(b, 3, generator=g, dtype=torch.float64) for b in (5, 7)]
    return PassStats.from_deviations(dev, resid), dev, resid


def _direct(name: str, dev: list, resid: list, level: float) -> float:
    """The criterion's objective written out from its definition (module docstring)."""
    d = torch.cat(dev, 1).numpy()  # (M, N, P)
    e = torch.cat(resid, 0).numpy()  # (N, P)
    m = d.shape[0]
    big_r = np.linalg.norm(d, axis=-1)  # (M, N)
    r, v, z = big_r.mean(0), big_r.var(0, ddof=1), np.linalg.norm(e, axis=-1)
    if name == "paper":
        return float(np.mean(v + (r - z) ** 2))
    if name in ("paper-debiased", "auto"):  # P = 3 elements: auto is the debiased criterion
        return float(np.mean((r - z) ** 2 - v / m))
    if name == "scale":
        return abs(math.log(r.mean() / z.mean()))
    if name == "crps":  # ensemble f + d_m, target y = f + e; per example mean over elements
        per = crps_samples(torch.as_tensor(d), torch.as_tensor(e), reduction="none")
        return float(per.mean(-1).mean())
    half = student_t.ppf(0.5 + level / 2, m - 1) * math.sqrt(1 + 1 / m)
    inside = np.abs(e - d.mean(0)) <= half * d.std(0, ddof=1)
    return abs(float(inside.mean(-1).mean()) - level)


@pytest.mark.parametrize("name", ["paper", "scale", "crps", "coverage", "paper-debiased", "auto"])
def test_each_objective_matches_its_definition(name: str) -> None:
    st, dev, resid = _stats()
    s0 = float(st.z.mean())
    out = summarise(st, name, LEVEL, s0)
    assert out.objective == pytest.approx(_direct(name, dev, resid, LEVEL), rel=1e-12, abs=1e-12)
    # the raw values are every criterion's measure at this nu, whichever is minimised
    assert out.values["l_sa"] == pytest.approx(_direct("paper", dev, resid, LEVEL), rel=1e-12)
    assert out.values["crps"] == pytest.approx(_direct("crps", dev, resid, LEVEL), rel=1e-12)
    assert out.scale == pytest.approx(float(st.r_mean.mean()))
    assert out.values["scale_ratio"] == pytest.approx(out.scale / s0)
    # the standard error is that of the per-example influence
    assert out.influence.shape == (12,)
    assert out.se == pytest.approx(float(np.std(out.influence, ddof=1)) / math.sqrt(12))


@pytest.mark.parametrize("name", ["paper", "crps", "coverage", "paper-debiased"])
def test_target_scale_is_where_the_rescaled_criterion_is_optimal(name: str) -> None:
    """``s_* = k_* s``: rescaling the deviations by ``k_*`` minimises the criterion; checked by
    brute force over ``k`` (step ``2^(1/64)``, the criteria's own resolution)."""
    st, dev, resid = _stats(seed=1, m=8, scale=0.3)  # under-dispersed: k_* > 1
    s0 = float(st.z.mean())
    k_star = get_criterion(name).objective(st, LEVEL, s0).target_scale / st.scale
    ks = 2.0 ** np.arange(-2, 4, 1 / 64)
    objs = np.array([_direct(name, [k * d for d in dev], resid, LEVEL) for k in ks])
    at_star = _direct(name, [k_star * d for d in dev], resid, LEVEL)
    assert at_star <= objs.min() + 1e-9
    assert k_star > 1.5  # the deviations are about 3x too small
    if name in ("paper", "paper-debiased"):  # a quadratic in k: brute force within one step
        assert abs(math.log2(ks[int(np.argmin(objs))] / k_star)) <= 1 / 64


def test_scale_target_is_the_residual_scale_and_zero_perturbation_is_nan() -> None:
    st, _, _ = _stats()
    assert get_criterion("scale").objective(st, LEVEL, 2.5).target_scale == 2.5
    zero = [torch.zeros(3, 4, 2, dtype=torch.float64)]
    st0 = PassStats.from_deviations(zero, [torch.ones(4, 2, dtype=torch.float64)])
    assert st0.max_change == 0.0
    out = summarise(st0, "paper", LEVEL, 1.0)
    assert math.isnan(out.objective) and math.isnan(out.se) and math.isnan(out.target_scale)


def test_pass_stats_refuses_malformed_deviations() -> None:
    d = torch.zeros(3, 4, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="equally long, non-empty"):
        PassStats.from_deviations([], [])
    with pytest.raises(ValueError, match=r"M >= 2 .*dev.shape=\(1, 4, 2\)"):
        PassStats.from_deviations([d[:1]], [d[0]])
    with pytest.raises(ValueError, match=r"resid.shape=\(4, 3\)"):
        PassStats.from_deviations([d], [torch.zeros(4, 3, dtype=torch.float64)])


def test_norm_ratio_closed_forms_and_monte_carlo() -> None:
    """``rho_d`` in closed form (d = 1: 2/pi, d = 2: pi/4) and against 2e5 chi_d draws for
    d = 7 (relative sd of the estimate < 0.3 %; 6 sd: false failure < 1e-8)."""
    from attnuq.calibration.criteria import norm_ratio

    assert norm_ratio(1) == pytest.approx(2 / math.pi, rel=1e-13)
    assert norm_ratio(2) == pytest.approx(math.pi / 4, rel=1e-13)
    assert norm_ratio(1, 10) == pytest.approx((2 / math.pi) / (1 + (1 - 2 / math.pi) / 10))
    g = torch.Generator().manual_seed(0)
    chi = torch.randn(200_000, 7, generator=g, dtype=torch.float64).norm(dim=-1)
    mc = float(chi.mean() ** 2 / (chi**2).mean())
    assert abs(mc / norm_ratio(7) - 1) < 6 * 0.003
    assert [norm_ratio(d) for d in (1, 4, 16, 64, 256)] == sorted(
        norm_ratio(d) for d in (1, 4, 16, 64, 256))  # increases to 1
    assert 1 - norm_ratio(1000) < 1e-3
    with pytest.raises(ValueError, match="got d=0"):
        norm_ratio(0)
    with pytest.raises(ValueError, match="got n_passes=0"):
        norm_ratio(1, 0)


def _gaussian_law(d: int, n: int = 4000, m: int = 10, c: float = 0.5, seed: int = 0
                  ) -> PassStats:
    """Known perturbation law: at example ``x`` the ``m`` deviations are ``c sigma(x) xi`` and
    the residual ``sigma(x) eps`` (``xi, eps ~ N(0, I_d)`` i.i.d., heteroscedastic
    ``sigma(x) = exp(u)``, ``u ~ U(-1, 1)``): the scale match is the rescaling ``1/c``."""
    g = torch.Generator().manual_seed(seed)
    sig = torch.exp(2 * torch.rand(n, 1, generator=g, dtype=torch.float64) - 1)  # (N, 1)
    dev = c * sig[None] * torch.randn(m, n, d, generator=g, dtype=torch.float64)
    resid = sig * torch.randn(n, d, generator=g, dtype=torch.float64)
    return PassStats.from_deviations([dev], [resid])


def _ratio_se(num: torch.Tensor, den: torch.Tensor) -> float:
    """Delta-method standard error of ``mean(num) / mean(den)``."""
    t = float(num.mean() / den.mean())
    return float((num - t * den).std(unbiased=True)) / (math.sqrt(num.numel()) * float(den.mean()))


@pytest.mark.parametrize("d", [1, 64])
def test_known_optimum_paper_biased_debiased_not(d: int) -> None:
    """On the known Gaussian law the paper criterion's rescaling is ``rho_{d,M} / c`` (below the
    scale match ``1/c``: 0.614 of it for d = 1, M = 10), the debiased one's ``1/c`` for every
    d, and ``auto`` picks the debiased criterion for d = 1 and the paper's for d = 64.
    Tolerance: 4 delta-method standard errors of each ratio estimate from the N examples
    (20000 for d = 1, 2000 for d = 64; normal approximation: false failure < 1e-4 per
    assertion)."""
    from attnuq.calibration.criteria import norm_ratio

    c, m = 0.5, 10
    st = _gaussian_law(d, n=20000 if d == 1 else 2000, m=m, c=c)
    s0 = float(st.z.mean())
    r, v, z = st.r_mean, st.r_var, st.z
    rho = norm_ratio(d, m)
    k_paper = get_criterion("paper").objective(st, LEVEL, s0).target_scale / st.scale
    k_deb = get_criterion("paper-debiased").objective(st, LEVEL, s0).target_scale / st.scale
    k_auto = get_criterion("auto").objective(st, LEVEL, s0).target_scale / st.scale
    se_paper = _ratio_se(r * z, v + r**2)
    se_deb = _ratio_se(r * z, r**2 - v / m)
    assert abs(k_paper - rho / c) <= 4 * se_paper
    assert abs(k_deb - 1 / c) <= 4 * se_deb
    assert 4 * se_deb < 0.05 / c  # the test resolves 5 % of the scale
    if d == 1:
        assert rho / c < 0.65 / c  # the paper's bias is far outside the tolerance
        assert abs(k_paper - 1 / c) > 8 * se_paper
        assert k_auto == k_deb
    else:
        assert rho > 0.98
        assert k_auto == k_paper
    # the closed form: debiased = paper / rho_hat with rho_hat from the passes' own norms
    rho_hat = float((r**2 - v / m).sum() / (v + r**2).sum())
    assert k_deb == pytest.approx(k_paper / rho_hat, rel=1e-12)


def test_auto_resolves_by_output_dimension() -> None:
    from attnuq.calibration.criteria import AUTO_RHO, norm_ratio, resolve_criterion

    cut = next(d for d in range(1, 200) if norm_ratio(d, 10) >= AUTO_RHO)
    assert cut == 28  # the docstring's number
    assert resolve_criterion("auto", cut - 1, 10) == "paper-debiased"
    assert resolve_criterion("auto", cut, 10) == "paper"
    assert resolve_criterion("scale", 1, 10) == "scale"
    with pytest.raises(ValueError, match="got criterion='nll'"):
        resolve_criterion("nll", 1, 10)
