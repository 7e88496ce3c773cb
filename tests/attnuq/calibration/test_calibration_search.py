"""The searches of attnuq.calibration.search on synthetic ``evaluate(nu)`` callables (no model).

Each synthetic problem has a known answer: the grid's minimum and noise band follow from a
closed-form objective and influence, and the BO's target is the root of an exact power law
``s(nu) = c nu^-a`` at ``s_* = sigma``, i.e. ``nu* = (c / sigma)^(1/a)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from attnuq.calibration import Evaluation, SearchResult, bo_search, grid_search, log_grid

Z = np.linspace(-1.0, 1.0, 41)  # fixed per-example pattern, mean exactly 0
Z = Z - Z.mean()


def convex_problem(nu_star: float, sigma: float) -> Callable[[int], Evaluation]:
    """Objective ``(x - x*)^2`` with ``x = ln nu``; per-example influence
    ``obj + sigma z_i (x - x*)``, whose mean is the objective (``mean z = 0``)."""
    x_star = math.log(nu_star)

    def evaluate(nu: int) -> Evaluation:
        x = math.log(nu)
        obj = (x - x_star) ** 2
        infl = obj + sigma * Z * (x - x_star)
        return Evaluation(nu=nu, objective=obj, se=float(np.std(infl, ddof=1) / math.sqrt(Z.size)),
                          scale=3.0 / math.sqrt(nu), scale_se=0.01, target_scale=0.5, values={},
                          passes=2, model_calls=1, seconds=0.0, influence=infl)

    return evaluate


def power_law(c: float, a: float, sigma: float, rel_se: float = 0.01
              ) -> tuple[Callable[[int], Evaluation], list[int]]:
    """``s(nu) = c nu^-a`` measured with relative standard error ``rel_se``; target ``sigma``;
    objective ``|ln(s / sigma)|``. Returns ``evaluate`` and the list of evaluated ``nu``."""
    calls: list[int] = []

    def evaluate(nu: int) -> Evaluation:
        calls.append(nu)
        s = c * nu ** (-a)
        obj = abs(math.log(s / sigma))
        return Evaluation(nu=nu, objective=obj, se=rel_se, scale=s, scale_se=rel_se * s,
                          target_scale=sigma, values={}, passes=2, model_calls=1, seconds=0.0,
                          influence=obj + rel_se * Z)

    return evaluate, calls


@pytest.mark.parametrize("sigma", [0.0, 0.5, 2.0])
def test_grid_search_recovers_the_minimum_and_its_noise_band(sigma: float) -> None:
    nu_star, rng = 37.0, (1, 1024)
    res = grid_search(convex_problem(nu_star, sigma), rng, grid_size=21, progress=False)
    grid = log_grid(rng, 21)
    assert isinstance(res, SearchResult)
    assert [e.nu for e in res.evaluations] == grid  # every grid point, in order
    x = np.log(np.array(grid, dtype=float)) - math.log(nu_star)
    best = int(np.argmin(x**2))
    assert res.nu == grid[best]
    # band, in closed form: paired difference (x_e^2 - x_b^2) + sigma z (x_e - x_b) has
    # se = sigma sd(z) |x_e - x_b| / sqrt(n); in band iff the mean is <= 2 se
    sd_z = float(np.std(Z, ddof=1))
    se_d = sigma * sd_z * np.abs(x - x[best]) / math.sqrt(Z.size)
    expected = [g for g, xe, s in zip(grid, x, se_d, strict=True) if xe**2 - x[best] ** 2 <= 2 * s
                + 1e-12]
    assert res.noise_band == expected
    assert res.nu in expected
    if sigma == 0.0:
        assert expected == [res.nu]
    if sigma == 2.0:  # the noise widens the band on both sides of the optimum
        assert min(expected) < nu_star < max(expected) and len(expected) >= 2
    assert res.nu_interval is None
    assert res.surrogate["target_log_scale"] == pytest.approx(math.log(0.5))


@pytest.mark.parametrize("a", [0.5, 0.35, 0.8])
def test_bo_search_recovers_the_root_of_a_power_law(a: float) -> None:
    c, sigma = 8.0, 0.5
    nu_star = (c / sigma) ** (1 / a)  # 256, ~2775, ~32
    rng = (1, 4096)
    evaluate, calls = power_law(c, a, sigma)
    res = bo_search(evaluate, rng, max_evals=6, progress=False)
    assert calls[0] == round(math.sqrt(rng[0] * rng[1]))  # starts at the geometric middle
    assert len(calls) <= 6 and len(set(calls)) == len(calls)  # budget kept, no nu twice
    assert [e.nu for e in res.evaluations] == calls
    # an exact power law: the surrogate finds the root to within integer rounding,
    # and the chosen nu is the evaluated one closest to it
    assert abs(math.log(res.nu / nu_star)) < 0.02
    assert res.nu == min(calls, key=lambda n: abs(math.log(n / nu_star)))
    lo, hi = res.nu_interval  # type: ignore[misc]
    assert lo <= nu_star <= hi
    assert res.surrogate["mean"][1] == pytest.approx(-a, abs=0.02)
    assert res.noise_band is None


def test_bo_search_stops_once_it_proposes_an_evaluated_nu() -> None:
    evaluate, calls = power_law(8.0, 0.5, 0.5, rel_se=1e-4)
    res = bo_search(evaluate, (1, 1024), max_evals=50, progress=False)
    assert len(calls) < 50  # converged: the next proposal repeated an evaluated nu
    # nu* = 256; the broad prior on ln b shrinks the root by well under one integer step
    assert abs(res.nu - 256) <= 1


def test_bo_search_choice_is_the_best_measured_objective_inside_the_interval() -> None:
    """Two evaluated nu inside the posterior interval: the measured objective decides."""
    base, _ = power_law(8.0, 0.5, 0.5, rel_se=0.3)  # wide interval

    def evaluate(nu: int) -> Evaluation:
        ev = base(nu)
        ev.objective = 1.0 / nu  # measured objective prefers the largest nu
        return ev

    res = bo_search(evaluate, (1, 1024), max_evals=4, progress=False)
    lo, hi = res.nu_interval  # type: ignore[misc]
    inside = [e for e in res.evaluations if lo <= e.nu <= hi]
    assert inside, res.nu_interval
    assert res.nu == max(e.nu for e in inside)


def test_searches_refuse_bad_settings_and_bad_evaluations() -> None:
    ev = convex_problem(16, 0.1)
    with pytest.raises(ValueError, match="nu_range must be two ints"):
        grid_search(ev, (0, 10), progress=False)
    with pytest.raises(ValueError, match="nu_range must be two ints"):
        bo_search(ev, (10, 10), progress=False)
    with pytest.raises(ValueError, match="grid_size must be >= 2"):
        grid_search(ev, (1, 64), grid_size=1, progress=False)
    with pytest.raises(TypeError, match="max_evals must be a positive int"):
        bo_search(ev, (1, 64), max_evals=2.5, progress=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_evals must be a positive int, got max_evals=0"):
        bo_search(ev, (1, 64), max_evals=0, progress=False)
    with pytest.raises(ValueError, match="surrogate_noise must be >= 0"):
        bo_search(ev, (1, 64), surrogate_noise=-0.1, progress=False)
    with pytest.raises(TypeError, match="evaluate must be callable"):
        grid_search(3, (1, 64), progress=False)  # type: ignore[arg-type]

    def wrong_nu(nu: int) -> Evaluation:
        e = ev(nu)
        e.nu = nu + 1
        return e

    with pytest.raises(ValueError, match=r"evaluate\(8\) must return an Evaluation of nu=8"):
        bo_search(wrong_nu, (1, 64), progress=False)

    def no_influence(nu: int) -> Evaluation:
        e = ev(nu)
        e.influence = None
        return e

    with pytest.raises(ValueError, match="noise band needs the per-example influence"):
        grid_search(no_influence, (1, 64), grid_size=3, progress=False)

    def nan_objective(nu: int) -> Evaluation:
        e = ev(nu)
        e.objective = float("nan")
        return e

    with pytest.raises(ValueError, match="every objective on the grid"):
        grid_search(nan_objective, (1, 64), grid_size=3, progress=False)

    def no_scale(nu: int) -> Evaluation:
        e = ev(nu)
        e.scale = 0.0
        return e

    with pytest.raises(ValueError, match="no evaluation measured a perturbation"):
        bo_search(no_scale, (1, 64), progress=False)
