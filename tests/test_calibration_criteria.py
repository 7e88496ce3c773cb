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
    assert CRITERIA == ("paper", "scale", "crps", "coverage")
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
    # the calibration bench reads it too
    bench = build_parser("calibration")
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
    if name == "scale":
        return abs(math.log(r.mean() / z.mean()))
    if name == "crps":  # ensemble f + d_m, target y = f + e; per example mean over elements
        per = crps_samples(torch.as_tensor(d), torch.as_tensor(e), reduction="none")
        return float(per.mean(-1).mean())
    half = student_t.ppf(0.5 + level / 2, m - 1) * math.sqrt(1 + 1 / m)
    inside = np.abs(e - d.mean(0)) <= half * d.std(0, ddof=1)
    return abs(float(inside.mean(-1).mean()) - level)


@pytest.mark.parametrize("name", ["paper", "scale", "crps", "coverage"])
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


@pytest.mark.parametrize("name", ["paper", "crps", "coverage"])
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
    if name == "paper":  # a quadratic in k: the brute-force minimiser is within one step
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
