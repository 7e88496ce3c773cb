r"""Searches for ``nu``: plain functions of an ``evaluate(nu) -> Evaluation`` callable.

A search knows nothing of models: it calls ``evaluate`` at the integers it chooses, in order,
and returns a :class:`SearchResult` (the choice, every evaluation, the surrogate fit). It reads
an :class:`~attnuq.calibration.Evaluation`'s ``nu``, ``objective``, ``scale`` (``s(nu)``),
``scale_se``, ``target_scale`` (``s_*``, see :mod:`attnuq.calibration.criteria`) and, for the
grid's noise band, ``influence``. :func:`attnuq.calibrate` builds ``evaluate`` from a model and
held-out data; a test can pass a synthetic one with a known optimum.

Search ``"grid"`` (:func:`grid_search`): every integer of a log-spaced grid over ``nu_range``;
the choice is the minimum of the measured objective, and the *noise band* is every grid ``nu``
whose objective exceeds the minimum by at most ``2`` standard errors of the paired difference
(same examples, so the example-to-example variation cancels).

Search ``"bo"`` (:func:`bo_search`): the paper's 1-D Bayesian optimisation with the log-linear
surrogate

.. math:: \ln s(\nu) = a \ln \nu + \ln b + \varepsilon,

a Bayesian linear regression in ``x = ln nu`` (prior ``a ~ N(-1/2, 1/2^2)`` -- one SA layer has
``Cov ∝ 1/nu`` -- and a broad ``ln b ~ N(0, 10^2)``; observation variance = the squared standard
error of ``ln s`` plus a misfit ``tau^2``), steered to the target scale ``s_*``.

This assumes that changing ``nu`` mainly rescales the perturbation (exact for a single SA layer
in the Gaussian limit); ``s_*`` is re-estimated after every evaluation and the estimate from the
evaluated ``nu`` closest to it (smallest ``|ln k_*|``) is used, so the assumption is only needed
locally. The first ``nu`` is the geometric middle ``round(sqrt(lo * hi))`` of the range; each
next ``nu`` minimises the posterior expected loss
``E[(ln s(nu) - ln s_*)^2] = (m(nu) - ln s_*)^2 + var(nu)`` over the integers in ``nu_range``;
the search stops when that ``nu`` was already evaluated or after ``max_evals`` evaluations. The
choice: among the evaluated ``nu`` inside the 95 % posterior interval of the surrogate's root
(:attr:`SearchResult.nu_interval`), the one with the smallest measured objective (as on the
grid); if none is inside, the evaluated ``nu`` with the smallest posterior expected loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from attnuq._validation import check_positive_int
from attnuq.calibration.report import Evaluation

__all__ = ["SEARCHES", "SearchResult", "bo_search", "grid_search", "log_grid"]

#: the ``search=`` values, for type checkers (tests check it equals :data:`SEARCHES`)
Search = Literal["bo", "grid"]

#: the search names: the one list ``attnuq.calibrate`` and ``attnuq calibrate --search`` read
SEARCHES: tuple[Search, ...] = ("bo", "grid")

Evaluate = Callable[[int], Evaluation]


@dataclass
class SearchResult:
    """What a search returns.

    Attributes
    ----------
    nu
        The chosen ``nu`` (one of the evaluated).
    evaluations
        Every :class:`~attnuq.calibration.Evaluation`, in evaluation order.
    target_log_scale
        ``ln s_*`` from the evaluation closest to its own target (see the module docstring).
    surrogate
        The log-linear surrogate's posterior (``mean``, ``cov``, ``x_center``, ``tau``,
        ``target_log_scale``, ``prior_mean``, ``prior_cov``); for the grid, for display only.
    nu_interval
        BO: 95 % posterior interval of the surrogate's root; grid: ``None``.
    noise_band
        Grid: every grid ``nu`` within 2 paired standard errors of the minimum; BO: ``None``.

    Examples
    --------
    >>> res = grid_search(_demo_evaluate, (1, 64), grid_size=7, progress=False)
    >>> res.nu, [e.nu for e in res.evaluations], res.nu_interval
    (16, [1, 2, 4, 8, 16, 32, 64], None)
    """

    nu: int
    evaluations: list[Evaluation]
    target_log_scale: float
    surrogate: dict[str, Any]
    nu_interval: tuple[float, float] | None
    noise_band: list[int] | None


class _LogLinear:
    """Bayesian linear regression of ``y = ln s`` on ``(1, ln nu - x_center)``."""

    def __init__(self, x_center: float, tau: float) -> None:
        self.x_center = x_center
        self.tau = tau
        self.m0 = np.array([0.0, -0.5])
        self.v0 = np.diag([10.0**2, 0.5**2])
        self.mean = self.m0.copy()
        self.cov = self.v0.copy()

    def phi(self, nu: np.ndarray) -> np.ndarray:
        x = np.log(np.asarray(nu, dtype=float)) - self.x_center
        return np.stack([np.ones_like(x), x], -1)

    def fit(self, nus: list[int], y: list[float], var: list[float]) -> None:
        phi = self.phi(np.array(nus))
        prec = 1.0 / (np.asarray(var) + self.tau**2)
        p0 = np.linalg.inv(self.v0)
        post_prec = p0 + phi.T @ (prec[:, None] * phi)
        self.cov = np.linalg.inv(post_prec)
        self.mean = self.cov @ (p0 @ self.m0 + phi.T @ (prec * np.asarray(y)))

    def predict(self, nu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        phi = self.phi(nu)
        return phi @ self.mean, np.einsum("...i,ij,...j->...", phi, self.cov, phi)

    def root_interval(self, target: float, lo: int, hi: int, seed: int) -> tuple[float, float]:
        rng = np.random.default_rng(seed)
        w = rng.multivariate_normal(self.mean, self.cov, size=4000)
        a = np.minimum(w[:, 1], -1e-6)  # scale decreases with nu
        x = (target - w[:, 0]) / a + self.x_center
        nu = np.clip(np.exp(np.clip(x, -50, 50)), lo, hi)
        q = np.quantile(nu, [0.025, 0.975])
        return float(q[0]), float(q[1])

    def as_dict(self, target: float) -> dict[str, Any]:
        return {
            "mean": self.mean.tolist(),
            "cov": self.cov.tolist(),
            "x_center": self.x_center,
            "tau": self.tau,
            "target_log_scale": target,
            "prior_mean": self.m0.tolist(),
            "prior_cov": self.v0.tolist(),
        }


def check_nu_range(nu_range: object) -> tuple[int, int]:
    """``(lo, hi)`` as ints, or ``ValueError``: two ints ``1 <= lo < hi <= MAX_NU``.

    Examples
    --------
    >>> check_nu_range((1, 1024))
    (1, 1024)
    """
    if (
        not isinstance(nu_range, (tuple, list))
        or len(nu_range) != 2
        or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in nu_range)
        or not 1 <= nu_range[0] < nu_range[1]
    ):
        raise ValueError(f"nu_range must be two ints 1 <= lo < hi, got {nu_range=!r}")
    from attnuq.ops.sampled import MAX_NU

    if nu_range[1] > MAX_NU:  # each call is also checked against the memory budget
        raise ValueError(
            f"nu_range must end at most at MAX_NU = 2**31 - 1 (one query's draws are summed by "
            f"one embedding_bag call), got {nu_range=!r}"
        )
    return int(nu_range[0]), int(nu_range[1])


def check_grid_size(grid_size: object) -> int:
    """``grid_size`` as an int ``>= 2``, or ``TypeError`` / ``ValueError`` naming it."""
    size = check_positive_int(grid_size, "grid_size")
    if size < 2:
        raise ValueError(f"grid_size must be >= 2, got {grid_size=!r}")
    return size


def check_surrogate_noise(surrogate_noise: float) -> float:
    """``tau >= 0`` as a float, or ``ValueError`` naming it."""
    if not surrogate_noise >= 0:
        raise ValueError(f"surrogate_noise must be >= 0, got {surrogate_noise=}")
    return float(surrogate_noise)


def log_grid(nu_range: tuple[int, int], size: int) -> list[int]:
    """Unique integers of ``size`` log-spaced points over ``nu_range`` (both ends included).

    For ``size >= 2`` the points are ``round(lo * (hi / lo)^(i / (size - 1)))``,
    ``i = 0 .. size - 1``, sorted, duplicates dropped (so the list can be shorter than ``size``).

    Examples
    --------
    >>> log_grid((1, 1024), 11)
    [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    >>> log_grid((1, 4), 8)
    [1, 2, 3, 4]
    """
    lo, hi = check_nu_range(nu_range)
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 2:
        raise ValueError(f"size must be an int >= 2, got {size=!r}")
    return sorted({round(v) for v in np.geomspace(lo, hi, size)})


def _candidates(lo: int, hi: int) -> np.ndarray:
    if hi - lo <= 20000:
        return np.arange(lo, hi + 1)
    return np.unique(np.round(np.geomspace(lo, hi, 20000)).astype(np.int64))


class _Recorder:
    """Calls ``evaluate`` and keeps the evaluations in order; checks what comes back."""

    def __init__(self, evaluate: Evaluate) -> None:
        if not callable(evaluate):
            raise TypeError(f"evaluate must be callable, got {type(evaluate).__name__}")
        self.evaluate = evaluate
        self.evals: list[Evaluation] = []

    def __call__(self, nu: int) -> Evaluation:
        ev = self.evaluate(nu)
        got = getattr(ev, "nu", None)
        if got != nu:
            raise ValueError(
                f"evaluate({nu}) must return an Evaluation of nu={nu}, got "
                f"{type(ev).__name__} with nu={got!r}"
            )
        self.evals.append(ev)
        return ev

    def fit(self, surrogate: _LogLinear) -> float:
        """Fit the surrogate to every evaluation with ``s > 0``; returns ``ln s_*``."""
        ok = [e for e in self.evals if e.scale > 0]
        if not ok:
            raise ValueError(
                "no evaluation measured a perturbation (every scale s(nu) <= 0): nothing to fit"
            )
        ys = [math.log(e.scale) for e in ok]
        var = [(e.scale_se / e.scale) ** 2 if math.isfinite(e.scale_se) else 0.0 for e in ok]
        surrogate.fit([e.nu for e in ok], ys, var)
        best = min(ok, key=lambda e: abs(math.log(e.target_scale / e.scale)))
        return math.log(best.target_scale)


def _bar(progress: bool | None, desc: str, total: int) -> Any:
    from tqdm.auto import tqdm

    disable = None if progress is None else not progress
    return tqdm(total=total, desc=desc, disable=disable, leave=False)


def grid_search(
    evaluate: Evaluate,
    nu_range: tuple[int, int],
    *,
    grid_size: int = 21,
    surrogate_noise: float = 0.05,
    progress: bool | None = None,
    desc: str = "calibrate grid",
) -> SearchResult:
    """Evaluate every ``nu`` of :func:`log_grid` ``(nu_range, grid_size)``; choose the minimum.

    The noise band holds every grid ``nu`` whose objective exceeds the minimum by at most
    ``2`` standard errors of the paired difference of the per-example ``influence`` (so every
    finite evaluation needs one). The log-linear surrogate is fitted to the grid for display.

    Parameters
    ----------
    evaluate
        ``evaluate(nu) -> Evaluation`` (its ``nu`` must be the one asked for).
    nu_range
        ``(lo, hi)``, ints, ``1 <= lo < hi``.
    grid_size
        Log-spaced points (``>= 2``; duplicates after rounding dropped).
    surrogate_noise
        ``tau`` of the surrogate (in ``ln s``).
    progress, desc
        tqdm bar over the grid (``None``: only on a terminal) and its label.

    Examples
    --------
    A synthetic objective ``(ln nu - ln 16)^2``:

    >>> res = grid_search(_demo_evaluate, (1, 256), grid_size=9, progress=False)
    >>> res.nu, res.noise_band
    (16, [16])
    """
    lo, hi = check_nu_range(nu_range)
    grid = log_grid((lo, hi), check_grid_size(grid_size))
    surrogate = _LogLinear(x_center=0.5 * (math.log(lo) + math.log(hi)),
                           tau=check_surrogate_noise(surrogate_noise))
    rec = _Recorder(evaluate)
    with _bar(progress, desc, len(grid)) as bar:
        for nu in grid:
            ev = rec(int(nu))
            bar.update(1)
            bar.set_postfix(nu=nu, objective=f"{ev.objective:.4g}")
    finite = [e for e in rec.evals if math.isfinite(e.objective)]
    if not finite:
        raise ValueError(f"every objective on the grid {grid} is NaN or infinite")
    best = min(finite, key=lambda e: e.objective)
    noise_band = []
    for e in finite:
        if e.influence is None or best.influence is None:
            raise ValueError(
                f"the grid's noise band needs the per-example influence of every evaluation; "
                f"the evaluation of nu={e.nu if e.influence is None else best.nu} has none"
            )
        diff = e.influence - best.influence
        se_d = float(np.std(diff, ddof=1)) / math.sqrt(len(diff)) if len(diff) > 1 else 0.0
        if e.objective - best.objective <= 2.0 * se_d + 1e-12:
            noise_band.append(e.nu)
    target_log = rec.fit(surrogate)
    return SearchResult(
        nu=best.nu, evaluations=rec.evals, target_log_scale=target_log,
        surrogate=surrogate.as_dict(target_log), nu_interval=None, noise_band=noise_band,
    )


def bo_search(
    evaluate: Evaluate,
    nu_range: tuple[int, int],
    *,
    max_evals: int = 6,
    surrogate_noise: float = 0.05,
    seed: int | None = 0,
    progress: bool | None = None,
    desc: str = "calibrate bo",
    nu_tol: float = 0.0,
) -> SearchResult:
    """Bayesian optimisation of ``nu`` with the log-linear surrogate (module docstring).

    Parameters
    ----------
    evaluate
        ``evaluate(nu) -> Evaluation`` (its ``nu`` must be the one asked for).
    nu_range
        ``(lo, hi)``, ints, ``1 <= lo < hi``.
    max_evals
        Budget of evaluations (``>= 1``); the search stops earlier when the next ``nu`` was
        already evaluated.
    surrogate_noise
        ``tau``, the misfit sd of the surrogate (in ``ln s``).
    seed
        Seeds the Monte Carlo draws of the root's posterior interval (``None``: 0).
    progress, desc
        tqdm bar over the evaluations (``None``: only on a terminal) and its label.
    nu_tol
        Stopping rule: stop also when the next ``nu`` lies within a factor ``1 + nu_tol`` of an
        evaluated one (``|ln nu_next - ln nu_e| <= ln(1 + nu_tol)``); ``0`` stops only on an
        exact repeat. A positive ``nu_tol`` saves the evaluations that would refine ``nu`` by
        less than the criterion's noise band usually spans.

    Examples
    --------
    A synthetic ``s(nu) = 4 / sqrt(nu)`` with target ``s_* = 1``, so ``nu* = 16``:

    >>> res = bo_search(_demo_evaluate, (1, 1024), max_evals=4, progress=False)
    >>> res.nu, [e.nu for e in res.evaluations][0]
    (16, 32)
    """
    lo, hi = check_nu_range(nu_range)
    budget = check_positive_int(max_evals, "max_evals")
    if isinstance(nu_tol, bool) or not isinstance(nu_tol, (int, float)) or not nu_tol >= 0:
        raise ValueError(f"nu_tol must be a float >= 0, got {nu_tol=!r}")
    surrogate = _LogLinear(x_center=0.5 * (math.log(lo) + math.log(hi)),
                           tau=check_surrogate_noise(surrogate_noise))
    rec = _Recorder(evaluate)
    cands = _candidates(lo, hi)
    nu = round(math.sqrt(lo * hi))
    with _bar(progress, desc, budget) as bar:
        while True:
            ev = rec(int(nu))
            bar.update(1)
            bar.set_postfix(nu=nu, objective=f"{ev.objective:.4g}")
            target_log = rec.fit(surrogate)
            mean, var = surrogate.predict(cands)
            loss = (mean - target_log) ** 2 + var
            nxt = int(cands[int(np.argmin(loss))])
            near = any(abs(math.log(nxt / e.nu)) <= math.log1p(nu_tol) for e in rec.evals)
            if near or len(rec.evals) >= budget:
                break
            nu = nxt
    done = np.array([e.nu for e in rec.evals])
    mean, var = surrogate.predict(done)
    chosen = int(done[int(np.argmin((mean - target_log) ** 2 + var))])
    nu_interval = surrogate.root_interval(target_log, lo, hi, 0 if seed is None else seed)
    # among the evaluated nu that the surrogate finds plausible (inside the 95 % interval of
    # its root), the measured objective decides -- as on the grid
    plausible = [
        e for e in rec.evals
        if nu_interval[0] <= e.nu <= nu_interval[1] and math.isfinite(e.objective)
    ]
    if plausible:
        chosen = min(plausible, key=lambda e: e.objective).nu
    return SearchResult(
        nu=chosen, evaluations=rec.evals, target_log_scale=target_log,
        surrogate=surrogate.as_dict(target_log), nu_interval=nu_interval, noise_band=None,
    )


def _demo_evaluate(nu: int) -> Evaluation:
    """Synthetic evaluation for the examples: ``s(nu) = 4 / sqrt(nu)``, ``s_* = 1``,
    objective ``(ln nu - ln 16)^2`` (minimum at ``nu* = 16``)."""
    obj = (math.log(nu) - math.log(16)) ** 2
    return Evaluation(
        nu=nu, objective=obj, se=0.01, scale=4 / math.sqrt(nu), scale_se=0.0, target_scale=1.0,
        values={}, passes=2, model_calls=1, seconds=0.0,
        influence=obj + 0.01 * np.array([-1.0, 1.0, -1.0, 1.0]),
    )
