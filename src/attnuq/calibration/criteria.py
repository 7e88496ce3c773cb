r"""The calibration criteria: one registry of what :func:`attnuq.calibrate` can minimise.

Notation (METHODS.md, SA section): frozen output ``f(x)``, a stochastic pass ``f_nu(x)``,
perturbation size ``R_nu(x) = |f_nu(x) - f(x)|_2`` and residual ``Z(x, y) = |y - f(x)|_2``
(norms over all non-batch dimensions of one example); ``M = n_passes`` stochastic passes per
example give ``r(x) = mean_m R``, ``v(x) = var_m R`` (unbiased) and the M-member ensemble
``f_nu^{(1..M)}(x)``. The mean perturbation scale is ``s(nu) = E_cal[r]`` and the residual scale
``s_0 = E_cal[Z]``.

Criteria (the objective is minimised; each evaluation also reports the standard error):

* ``"paper"``: ``L_SA(nu) = E_cal[v(x) + (r(x) - Z)^2]`` (the paper's eq. 9, M passes per x).
* ``"paper-debiased"``: ``L_deb(nu) = E_cal[(r(x) - Z)^2 - v(x)/M]``, an unbiased estimate of
  ``E_cal[(E[R | x] - Z)^2] = E[(R - Z)(R' - Z)]`` (``R, R'`` two independent passes): the
  paper's ``L_SA`` without its ``Var(R)`` term, whose minimiser over a rescaling of the
  perturbations is the ``L_SA`` minimiser divided by the norm ratio ``rho`` estimated from the
  passes' own norms (see the note on the output's dimension below).
* ``"auto"``: ``"paper"`` when the output has ``d`` elements per example with
  ``rho_{d,M} >= 0.98`` (:func:`norm_ratio`; ``d >= 28`` at ``M = 10``), else
  ``"paper-debiased"`` (:func:`resolve_criterion`); decided by ``d`` and ``M`` alone, so the
  same at every ``nu``.
* ``"scale"``: ``|ln(s(nu) / s_0)|`` -- mean perturbation scale equals residual scale.
* ``"crps"``: mean fair CRPS (:func:`attnuq.metrics.crps_samples`) of the M-pass ensemble,
  averaged over the elements of each example, then over examples.
* ``"coverage"``: ``|cov(nu) - level|`` where ``cov`` is the fraction of elements inside the
  Student-t prediction interval of the M-member ensemble,
  ``mean_m f_nu ± t_{M-1, (1+level)/2} sd_m(f_nu) sqrt(1 + 1/M)``, which has coverage exactly
  ``level`` when the target and the M draws are i.i.d. normal (for any ``M``). An
  empirical-quantile interval of only ``M`` draws would under-cover even for a calibrated
  ensemble, and a randomised-PIT band cannot resolve ``level`` with ``M + 1`` rank bins.

Every criterion also names a *target scale* ``s_*``: the perturbation scale at which it would be
optimal, estimated from the passes at one ``nu``; the Bayesian optimisation of
:mod:`attnuq.calibration.search` steers ``s(nu)`` towards it:

* ``"scale"``: ``s_* = s_0``.
* ``"paper-debiased"``: ``t_* = E[rZ] / E[r^2 - v/M]`` (the same quadratic without the
  ``Var(R)`` term; ``r^2 - v/M = sum_{i != j} R_i R_j / (M (M - 1)) >= 0``), ``s_* = t_* s(nu)``.
* ``"paper"``: rescaling all perturbations by ``t`` turns the estimator into the quadratic
  ``t^2 E[v + r^2] - 2t E[r Z] + E[Z^2]`` (exact algebra), minimised at
  ``t_* = E[rZ] / E[v + r^2]``; so ``s_* = t_* s(nu)``.
* ``"crps"`` / ``"coverage"``: ``s_* = k_* s(nu)`` with ``k_*`` the factor that, applied to the
  perturbations ``f_nu - f`` of the evaluated passes about ``f``, minimises the criterion
  (searched over ``k`` in ``[2^-6, 2^6]`` on a log grid of step ``2^{1/4}``, refined with step
  ``2^{1/64}`` around the minimum; plateaus resolve to their geometric middle; no forward passes).

NOTE(paper): the paper gives the surrogate and the scale matching for ``L_SA``; the mapping of
``L_SA``, CRPS and coverage to a target scale by rescaling perturbations is ours.

NOTE(paper): the criterion and the output's dimension (ours: the paper uses ``L_SA`` for every
output). Model: at ``x`` the perturbation is ``f_nu - f = s xi`` and the residual ``y - f =
sigma eps`` with ``xi, eps`` i.i.d. of one law in ``R^d`` (the perturbation has the residual's
shape and ``s = sigma`` is the scale match), ``R = s|xi|``, ``Z = sigma|eps|`` independent. Then
``L(s) = E[(R - Z)^2] = s^2 E|xi|^2 - 2 s sigma (E|xi|)^2 + sigma^2 E|xi|^2`` is a quadratic in
``s`` with minimiser ``s* = rho sigma``, ``rho = (E|xi|)^2 / E|xi|^2 <= 1`` (Jensen). For
standard Gaussian ``xi`` in ``R^d`` the norm is ``chi_d``: ``E|xi| = sqrt(2) Gamma((d+1)/2) /
Gamma(d/2)``, ``E|xi|^2 = d``, so ``rho_d = 2 Gamma((d+1)/2)^2 / (d Gamma(d/2)^2)``: ``rho_1 =
2/pi = 0.637``, ``rho_10 = 0.951``, ``rho_d = 1 - 1/(2d) + O(d^-2)`` (norm concentration). The
estimator with ``M`` passes, ``E[v + (r - Z)^2]``, has ``E[v + r^2 | x] = s^2 (E|xi|^2 + Var|xi|
/ M)``, so its minimiser is ``rho_{d,M} sigma`` with ``rho_{d,M} = mu_1^2 / (mu_2 + (mu_2 -
mu_1^2)/M)`` (``mu_k = E|xi|^k``; ``0.614`` for ``d = 1, M = 10``). An interval ``f +- z_{0.975}
s*`` then covers ``2 Phi(1.96 rho) - 1``: ``78.8 %`` at a nominal 95 % for a scalar Gaussian
output (``77.1 %`` with ``M = 10``), ``94.5 %`` at ``rho = 0.98``. ``"paper-debiased"`` drops
``Var(R)``: ``E[(E[R | x] - Z)^2]`` has the minimiser ``E[mZ] / E[m^2] = sigma`` (``m = E[R | x]
= s mu_1``) for every ``d`` and ``M``, heteroscedastic ``sigma(x)`` included where ``s(x)`` is
proportional to it; in closed form ``t_deb = t_paper / rho_hat`` with ``rho_hat = E[r^2 - v/M] /
E[v + r^2]`` estimated from the passes' own norms. ``"auto"`` keeps the paper's criterion where
``rho_{d,M} >= 0.98`` and debiases below; with correlated output elements the effective
dimension is smaller than ``d`` and ``"paper-debiased"`` (whose ``rho_hat`` measures it) can be
chosen explicitly.

Classification criteria (:data:`CLASSIFICATION_CRITERIA`; the passes' ``dev`` are then logit
deviations ``(M, N, C)`` of ``N`` labelled rows -- examples, or tokens of a language model --,
``resid = onehot(y) - softmax(f)``, and :class:`PassStats` also holds the frozen logits and the
labels):

* ``"nll"``: the mean negative log-likelihood of the Monte Carlo mean probability
  ``p_bar = mean_m softmax(f_nu^{(m)})`` at the true class, ``-mean_i ln p_bar_{i, y_i}``
  (a proper score; METHODS.md section 3).
* ``"nll-temperature"``: the same NLL at the temperature ``T`` that minimises it on these passes
  (:func:`attnuq.categorical.fit_temperature`), i.e. the NLL profiled over ``T``: ``nu`` is then
  compared at each ``nu``'s best temperature, so SA is chosen over the frozen model only where
  its spread lowers the NLL beyond what one temperature does.

Their target scale: ``s_* = k_* s(nu)``, ``k_*`` the factor on the logit deviations
``f + k (f_nu - f)`` that minimises the criterion (bounded Brent over ``ln k`` in
``[-6 ln 2, 6 ln 2]``; for ``"nll-temperature"`` with ``T`` refitted at every ``k``). The
scale ``s(nu)`` and the search are those of regression.

NOTE(paper): the paper has no classification criterion ("needs a dedicated residual
functional"); both are ours.

:data:`CRITERIA` (the regression names, in registry order) is the one list every caller reads: the
``criterion=`` check of :func:`attnuq.calibrate`, ``attnuq calibrate --criterion`` and ``attnuq
bench calibration --criteria``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

import numpy as np
import torch

__all__ = [
    "AUTO_RHO",
    "CLASSIFICATION_CRITERIA",
    "CRITERIA",
    "CalibrationCriterion",
    "CriterionValue",
    "PassStats",
    "Summary",
    "get_criterion",
    "norm_ratio",
    "resolve_criterion",
    "summarise",
]

#: the ``criterion=`` values, for type checkers (tests check it equals :data:`CRITERIA`)
Criterion = Literal["paper", "scale", "crps", "coverage", "paper-debiased", "auto"]
#: the classification ``criterion=`` values
ClassificationCriterion = Literal["nll", "nll-temperature"]

#: ``"auto"`` keeps the paper's criterion where its bias ``rho_{d,M}`` is at least this
AUTO_RHO = 0.98

_K_COARSE = 2.0 ** torch.linspace(-6, 6, 49, dtype=torch.float64)  # perturbation rescaling


@dataclass
class PassStats:
    """Per-example statistics of the ``M`` stochastic passes at one ``nu`` (float64, CPU).

    Attributes
    ----------
    r_mean, r_var
        ``(N,)``: ``r(x) = mean_m R`` and ``v(x) = var_m R`` (unbiased), examples concatenated.
    z
        ``(N,)``: ``Z(x, y) = |y - f(x)|_2``.
    dev
        Per batch ``(M, B, P)``: ``f_nu - f`` flattened over the non-batch dimensions.
    resid
        Per batch ``(B, P)``: ``y - f``.
    pairs
        Per batch ``(B, P)``: ``sum_{i,j} |d_i - d_j|`` over the ``M`` deviations.
    calls
        Model calls the passes took.
    max_change
        Largest ``|f_nu - f|`` seen (``0``: the output did not change under sampling).

    Examples
    --------
    >>> import torch
    >>> d = torch.tensor([[[1.0]], [[-1.0]]], dtype=torch.float64)  # (M=2, B=1, P=1)
    >>> st = PassStats.from_deviations([d], [torch.ones(1, 1, dtype=torch.float64)])
    >>> st.r_mean.tolist(), st.r_var.tolist(), st.z.tolist(), st.scale
    ([1.0], [0.0], [1.0], 1.0)
    """

    r_mean: torch.Tensor  # (N,)
    r_var: torch.Tensor  # (N,)
    z: torch.Tensor  # (N,)
    dev: list[torch.Tensor]  # per batch (M, B, P): f_nu - f
    resid: list[torch.Tensor]  # per batch (B, P): y - f
    pairs: list[torch.Tensor]  # per batch (B, P): sum_{i,j} |d_i - d_j|
    calls: int = 0
    max_change: float = 0.0
    logits: list[torch.Tensor] | None = None  # classification: per batch (N, C) frozen logits
    labels: list[torch.Tensor] | None = None  # classification: per batch (N,) class ids

    @classmethod
    def from_deviations(
        cls, dev: list[torch.Tensor], resid: list[torch.Tensor], *, calls: int = 0,
        logits: list[torch.Tensor] | None = None, labels: list[torch.Tensor] | None = None,
    ) -> PassStats:
        """Statistics from per-batch deviations ``f_nu - f`` ``(M, B, P)`` and residuals
        ``y - f`` ``(B, P)`` (float64); ``M >= 2``. A classifier's passes also give the frozen
        logits ``(B, C)`` and labels ``(B,)`` per batch (``P = C``; the residual is then
        ``onehot(y) - softmax(f)``)."""
        if not dev or len(dev) != len(resid):
            raise ValueError(
                f"dev and resid must be equally long, non-empty lists, got {len(dev)=} and "
                f"{len(resid)=}"
            )
        r_mean, r_var, zs, pairs = [], [], [], []
        max_change = 0.0
        for d, e in zip(dev, resid, strict=True):
            if d.dim() != 3 or d.shape[0] < 2 or e.shape != d.shape[1:]:
                raise ValueError(
                    "each dev must be (M, B, P) with M >= 2 and its resid (B, P), got "
                    f"dev.shape={tuple(d.shape)} and resid.shape={tuple(e.shape)}"
                )
            m = d.shape[0]
            max_change = max(max_change, float(d.abs().max()))
            rr = d.norm(dim=-1)  # (M, B)
            r_mean.append(rr.mean(0))
            r_var.append(rr.var(0, unbiased=True))
            zs.append(e.norm(dim=-1))
            ds = torch.sort(d, dim=0).values
            i = torch.arange(1, m + 1, dtype=torch.float64)[:, None, None]
            pairs.append(2.0 * ((2 * i - m - 1) * ds).sum(0))
        return cls(
            r_mean=torch.cat(r_mean), r_var=torch.cat(r_var), z=torch.cat(zs), dev=list(dev),
            resid=list(resid), pairs=pairs, calls=calls, max_change=max_change,
            logits=None if logits is None else list(logits),
            labels=None if labels is None else list(labels),
        )

    @property
    def scale(self) -> float:
        """``s(nu) = E_cal[r]``."""
        return float(self.r_mean.mean())

    @property
    def n_passes(self) -> int:
        """``M``."""
        return int(self.dev[0].shape[0])


def _k_chunks(k: torch.Tensor, d: torch.Tensor) -> list[torch.Tensor]:
    """Split the ``k`` values so that one chunk times ``d`` stays under ~4M elements."""
    step = max(1, (1 << 22) // max(1, d.numel()))
    return list(torch.split(k, step))


def crps_rescaled(st: PassStats, k: torch.Tensor) -> torch.Tensor:
    """Per-example fair CRPS of ``f + k (f_nu - f)`` for each ``k``: ``(K, N)``.

    The draws ``f + k d_m`` of one element share ``f`` and are ordered like ``d_m`` for
    ``k > 0``, so the pair term is ``k`` times that of ``d``.
    """
    m = st.n_passes
    out = []
    for d, e, ps in zip(st.dev, st.resid, st.pairs, strict=True):
        per_k = []
        for kc in _k_chunks(k, d):
            t1 = (kc[:, None, None, None] * d[None] - e[None, None]).abs().mean(1)  # (K, B, P)
            crps = t1 - kc[:, None, None] * ps[None] / (2.0 * m * (m - 1))
            per_k.append(crps.mean(-1))
        out.append(torch.cat(per_k, 0))
    return torch.cat(out, 1)


def coverage_rescaled(st: PassStats, k: torch.Tensor, level: float) -> torch.Tensor:
    """Per-example fraction of elements inside the Student-t prediction interval of the
    ensemble ``f + k (f_nu - f)``: ``|e - k mean(d)| <= k t sd(d) sqrt(1 + 1/M)``; ``(K, N)``."""
    from scipy.stats import t as student_t

    m = st.n_passes
    half = float(student_t.ppf(0.5 + level / 2, m - 1)) * math.sqrt(1.0 + 1.0 / m)
    out = []
    for d, e in zip(st.dev, st.resid, strict=True):
        mu, sd = d.mean(0), d.std(0, unbiased=True)  # (B, P)
        inside = (e[None] - k[:, None, None] * mu[None]).abs() <= k[:, None, None] * half * sd[None]
        out.append(inside.to(torch.float64).mean(-1))
    return torch.cat(out, 1)


def _argmin_k(fn: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """Minimiser of ``fn`` over ``k`` in ``[2^-6, 2^6]``: coarse log grid (step ``2^{1/4}``),
    then a fine one (step ``2^{1/64}``) over the coarse minimisers +- one step; ties (plateaus)
    resolve to the geometric middle of the minimisers."""

    def minimisers(k: torch.Tensor) -> tuple[float, float]:
        v = fn(k)
        idx = torch.nonzero(v <= v.min() + 1e-12).reshape(-1)
        return float(k[idx[0]]), float(k[idx[-1]])

    lo, hi = minimisers(_K_COARSE)
    step = 2.0**0.25
    a, b = math.log2(lo / step), math.log2(hi * step)
    fine = 2.0 ** torch.linspace(a, b, max(2, round((b - a) * 64) + 1), dtype=torch.float64)
    lo, hi = minimisers(fine)
    return math.sqrt(lo * hi)


_ONE = torch.ones(1, dtype=torch.float64)


@dataclass(frozen=True)
class CriterionValue:
    """A criterion at one ``nu``: ``objective = mean(influence)`` up to the criterion's outer
    map, the per-example ``influence`` ``(N,)`` whose standard error is the objective's, and the
    target scale ``s_*``.

    Examples
    --------
    >>> import torch
    >>> CriterionValue(0.5, torch.tensor([0.4, 0.6]), 1.2).objective
    0.5
    """

    objective: float
    influence: torch.Tensor  # (N,)
    target_scale: float


def _paper(st: PassStats, level: float, s0: float) -> CriterionValue:
    s = st.scale
    g = st.r_var + (st.r_mean - st.z) ** 2
    t_star = float((st.r_mean * st.z).sum() / (st.r_var + st.r_mean**2).sum())
    return CriterionValue(float(g.mean()), g, t_star * s)


def _debiased(st: PassStats, level: float, s0: float) -> CriterionValue:
    m = st.n_passes
    g = (st.r_mean - st.z) ** 2 - st.r_var / m
    denom = float((st.r_mean**2 - st.r_var / m).sum())
    t_star = float((st.r_mean * st.z).sum()) / denom if denom > 0 else float("nan")
    return CriterionValue(float(g.mean()), g, t_star * st.scale)


def norm_ratio(d: int, n_passes: int | None = None) -> float:
    r"""``rho_{d,M}``: the paper criterion's minimiser over the scale match for a ``d``-element
    output with i.i.d. standard Gaussian perturbations and residuals.

    ``rho_d = mu_1^2 / mu_2 = 2 Gamma((d+1)/2)^2 / (d Gamma(d/2)^2)`` (``mu_k`` the ``k``-th
    moment of ``chi_d``); with ``M = n_passes`` passes per example the estimator's minimiser is
    ``rho_{d,M} = mu_1^2 / (mu_2 + (mu_2 - mu_1^2) / M)``; ``n_passes=None`` is ``M = inf``.

    Examples
    --------
    >>> round(norm_ratio(1), 4), round(norm_ratio(1, 10), 4), round(norm_ratio(100), 4)
    (0.6366, 0.6143, 0.995)
    """
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise ValueError(f"d must be a positive int, got {d=!r}")
    if n_passes is not None and (
        isinstance(n_passes, bool) or not isinstance(n_passes, int) or n_passes < 1
    ):
        raise ValueError(f"n_passes must be a positive int or None, got {n_passes=!r}")
    mu1sq = 2.0 * math.exp(2.0 * (math.lgamma((d + 1) / 2) - math.lgamma(d / 2)))
    extra = 0.0 if n_passes is None else (d - mu1sq) / n_passes
    return mu1sq / (d + extra)


def resolve_criterion(name: str, d: int, n_passes: int) -> Criterion | ClassificationCriterion:
    """The criterion ``name`` stands for on a ``d``-element output with ``M = n_passes``:
    ``"auto"`` is ``"paper"`` where ``norm_ratio(d, M) >= AUTO_RHO`` and ``"paper-debiased"``
    below; every other name is itself.

    Examples
    --------
    >>> resolve_criterion("auto", 1, 10), resolve_criterion("auto", 96 * 7, 10)
    ('paper-debiased', 'paper')
    >>> resolve_criterion("crps", 1, 10)
    'crps'
    """
    crit = get_criterion(name).name
    if crit != "auto":
        return crit
    return "paper" if norm_ratio(d, n_passes) >= AUTO_RHO else "paper-debiased"


def _auto(st: PassStats, level: float, s0: float) -> CriterionValue:
    d = int(st.dev[0].shape[-1])
    return get_criterion(resolve_criterion("auto", d, st.n_passes)).objective(st, level, s0)


def _scale(st: PassStats, level: float, s0: float) -> CriterionValue:
    s = st.scale
    lr = math.log(s / s0)
    g = (1.0 if lr >= 0 else -1.0) * (st.r_mean / s - st.z / s0)
    return CriterionValue(abs(lr), g, s0)


def _crps(st: PassStats, level: float, s0: float) -> CriterionValue:
    g = crps_rescaled(st, _ONE)[0]
    target = _argmin_k(lambda k: crps_rescaled(st, k).mean(1)) * st.scale
    return CriterionValue(float(g.mean()), g, target)


def _coverage(st: PassStats, level: float, s0: float) -> CriterionValue:
    cov1 = coverage_rescaled(st, _ONE, level)[0]
    c = float(cov1.mean())
    g = (1.0 if c >= level else -1.0) * cov1
    target = _argmin_k(lambda k: (coverage_rescaled(st, k, level).mean(1) - level).abs())
    return CriterionValue(abs(c - level), g, target * st.scale)


def _class_parts(st: PassStats) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(f (N, C), d (M, N, C), y (N,))`` of a classifier's passes, batches concatenated."""
    if st.logits is None or st.labels is None:
        raise ValueError(
            "a classification criterion needs the passes of a classifier (frozen logits and "
            "labels); these statistics come from a regression pass"
        )
    return torch.cat(st.logits, 0), torch.cat(st.dev, 1), torch.cat(st.labels, 0)


_LOG_K = (-6 * math.log(2.0), 6 * math.log(2.0))


def _nll(st: PassStats, level: float, s0: float) -> CriterionValue:
    from scipy.optimize import minimize_scalar

    from attnuq.categorical import mc_nll

    f, d, y = _class_parts(st)
    g = mc_nll(f + d, y)

    def at(log_k: float) -> float:
        return float(mc_nll(f + math.exp(log_k) * d, y).mean())

    k = math.exp(minimize_scalar(at, bounds=_LOG_K, method="bounded",
                                 options={"xatol": 1e-3}).x)
    return CriterionValue(float(g.mean()), g, k * st.scale)


def _nll_temperature(st: PassStats, level: float, s0: float) -> CriterionValue:
    from scipy.optimize import minimize_scalar

    from attnuq.categorical import fit_temperature, mc_nll

    f, d, y = _class_parts(st)
    t = fit_temperature(f + d, y)
    g = mc_nll(f + d, y, t)

    def at(log_k: float) -> float:  # the NLL at ln k, profiled over T
        z = f + math.exp(log_k) * d
        return float(mc_nll(z, y, fit_temperature(z, y, xatol=1e-3)).mean())

    k = math.exp(minimize_scalar(at, bounds=_LOG_K, method="bounded",
                                 options={"xatol": 1e-2}).x)
    return CriterionValue(float(g.mean()), g, k * st.scale)


@dataclass(frozen=True)
class CalibrationCriterion:
    """One registered criterion: its name, a one-line description and the function
    ``objective(stats, level, s0) -> CriterionValue`` (``stats.scale > 0``).

    Examples
    --------
    >>> c = get_criterion("scale")
    >>> c.name, c.description
    ('scale', 'mean perturbation scale equals residual scale: |ln(s(nu) / s_0)|')
    """

    name: Criterion | ClassificationCriterion
    description: str
    objective: Callable[[PassStats, float, float], CriterionValue]
    task: Literal["regression", "classification"] = "regression"


_REGISTRY: Mapping[str, CalibrationCriterion] = MappingProxyType({
    c.name: c
    for c in (
        CalibrationCriterion(
            "paper", "the paper's L_SA = E[v + (r - Z)^2] (eq. 9, M passes per example)", _paper
        ),
        CalibrationCriterion(
            "scale", "mean perturbation scale equals residual scale: |ln(s(nu) / s_0)|", _scale
        ),
        CalibrationCriterion("crps", "mean fair CRPS of the M-pass ensemble", _crps),
        CalibrationCriterion(
            "coverage", "|coverage - level| of the ensemble's Student-t prediction interval",
            _coverage,
        ),
        CalibrationCriterion(
            "paper-debiased",
            "L_SA without its Var(R) term: E[(r - Z)^2 - v/M], minimised at the scale match",
            _debiased,
        ),
        CalibrationCriterion(
            "auto", "paper where the output's dimension makes its bias below 2 in 100, else "
            "paper-debiased", _auto,
        ),
        CalibrationCriterion(
            "nll", "classification: NLL of the Monte Carlo mean probability at T = 1", _nll,
            "classification",
        ),
        CalibrationCriterion(
            "nll-temperature", "classification: NLL of the Monte Carlo mean probability at its "
            "best temperature (profiled over T)", _nll_temperature, "classification",
        ),
    )
})

#: the regression criterion names, in registry order: the one list every caller reads
CRITERIA: tuple[Criterion, ...] = tuple(
    c.name for c in _REGISTRY.values() if c.task == "regression"  # type: ignore[misc]
)
#: the classification criterion names (integer labels; :class:`attnuq.SAClassifier`)
CLASSIFICATION_CRITERIA: tuple[ClassificationCriterion, ...] = tuple(
    c.name for c in _REGISTRY.values() if c.task == "classification"  # type: ignore[misc]
)


def get_criterion(name: str) -> CalibrationCriterion:
    """The registered criterion ``name`` (one of :data:`CRITERIA` or
    :data:`CLASSIFICATION_CRITERIA`); its ``.name`` is typed as the ``criterion=`` literal, so
    ``calibrate(..., criterion=get_criterion(s).name)`` checks.

    Examples
    --------
    >>> get_criterion("paper").name, get_criterion("nll").task
    ('paper', 'classification')
    >>> get_criterion("mse")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: criterion must be one of ('paper', ...) or ('nll', ...), got criterion='mse'
    """
    crit = _REGISTRY.get(name) if isinstance(name, str) else None
    if crit is None:
        raise ValueError(
            f"criterion must be one of {CRITERIA} or {CLASSIFICATION_CRITERIA}, got "
            f"criterion={name!r}"
        )
    return crit


@dataclass(frozen=True)
class Summary:
    """What :func:`summarise` reports for one ``nu`` (the fields of an
    :class:`attnuq.calibration.Evaluation` that come from the passes).

    Examples
    --------
    >>> import numpy as np
    >>> Summary(0.1, 0.01, np.zeros(2), 0.3, 0.02, 0.28, {"l_sa": 0.1}).scale
    0.3
    """

    objective: float
    se: float
    influence: np.ndarray  # (N,)
    scale: float
    scale_se: float
    target_scale: float
    values: dict[str, float]


def summarise(st: PassStats, criterion: str, level: float, s0: float) -> Summary:
    """Objective, standard error, target scale and every criterion's raw value at one ``nu``.

    ``values`` holds ``l_sa``, ``crps`` and ``coverage`` at the evaluated ``nu`` (no rescaling)
    and ``scale_ratio = s / s_0``. The standard errors are ``sd(g) / sqrt(N)`` of the per-example
    influence ``g`` (NaN for ``N = 1``). If no perturbation was measured (``s = 0``) the
    objective, its standard error and the target scale are NaN.

    Examples
    --------
    >>> import torch
    >>> d = torch.tensor([[[1.0], [2.0]], [[-1.0], [0.0]]], dtype=torch.float64)  # (2, 2, 1)
    >>> e = torch.tensor([[1.0], [1.0]], dtype=torch.float64)
    >>> out = summarise(PassStats.from_deviations([d], [e]), "paper", 0.9, s0=1.0)
    >>> out.objective, out.values["l_sa"], out.scale  # v = (0, 2), r = (1, 1), Z = (1, 1)
    (1.0, 1.0, 1.0)
    """
    crit = get_criterion(criterion)
    n = st.r_mean.numel()
    sqn = math.sqrt(n)

    def se(x: torch.Tensor) -> float:
        return float(x.std(unbiased=True)) / sqn if n > 1 else float("nan")

    s = st.scale
    s_se = se(st.r_mean)
    if st.labels is not None:
        return _summarise_classes(st, crit, level, s0, se)
    values = {
        "l_sa": float((st.r_var + (st.r_mean - st.z) ** 2).mean()),
        "crps": float(crps_rescaled(st, _ONE)[0].mean()),
        "coverage": float(coverage_rescaled(st, _ONE, level)[0].mean()),
        "scale_ratio": s / s0 if s0 > 0 else float("inf"),
    }
    if s <= 0:
        nan = float("nan")
        return Summary(nan, nan, np.zeros(n), s, s_se, nan, values)
    v = crit.objective(st, level, s0)
    return Summary(v.objective, se(v.influence), v.influence.numpy(), s, s_se, v.target_scale,
                   values)


def _summarise_classes(st: PassStats, crit: CalibrationCriterion, level: float, s0: float,
                       se: Callable[[torch.Tensor], float]) -> Summary:
    """:func:`summarise` for a classifier's passes: ``values`` holds ``nll`` (``T = 1``),
    ``nll_temperature`` and ``temperature`` (its best ``T``) and ``scale_ratio``."""
    from attnuq.categorical import fit_temperature, mc_nll

    if crit.task != "classification":
        raise ValueError(
            f"criterion={crit.name!r} is a regression criterion; a classifier's passes need one "
            f"of {CLASSIFICATION_CRITERIA}"
        )
    f, d, y = _class_parts(st)
    t = fit_temperature(f + d, y)
    s = st.scale
    values = {
        "nll": float(mc_nll(f + d, y).mean()),
        "nll_temperature": float(mc_nll(f + d, y, t).mean()),
        "temperature": t,
        "scale_ratio": s / s0 if s0 > 0 else float("inf"),
    }
    n = st.r_mean.numel()
    if s <= 0:
        nan = float("nan")
        return Summary(nan, nan, np.zeros(n), s, se(st.r_mean), nan, values)
    v = crit.objective(st, level, s0)
    return Summary(v.objective, se(v.influence), v.influence.numpy(), s, se(st.r_mean),
                   v.target_scale, values)
