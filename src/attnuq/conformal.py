r"""Split-conformal rescaling of predictive intervals, normalised by the predictive spread.

Given a held-out calibration set with predictive distributions (SA samples or a Gaussian) and
targets, :func:`conformal_scale` finds one factor ``q`` such that, for a new exchangeable pair,
``pred.scaled(q).interval(1 - alpha)`` contains the target with probability at least
``1 - alpha`` (Vovk et al. 2005; Lei et al. 2018, "normalised" split conformal).

Score. With centre ``c`` (the predictive mean) and the *unscaled* central ``1 - alpha``
interval ``[l, u]`` of the predictive,

.. math:: r = \max\left(\frac{c - y}{c - l}, \frac{y - c}{u - c}\right)_+ ,

the smallest factor by which the interval must be stretched about ``c`` to reach ``y``.
:meth:`Predictive.scaled` and :meth:`GaussianPredictive.scaled` stretch about the mean, and
their quantiles move affinely, so ``y`` lies in ``pred.scaled(q).interval(1 - alpha)`` iff
``r <= q``. For a Gaussian, ``u - c = c - l = z_{1-alpha/2}\,\sigma`` and ``r`` is the familiar
``|y - \mu| / (z \sigma)``; for samples the spread is measured by the sample quantiles.

Factor. With ``n`` calibration scores, ``q`` is the ``k``-th smallest score,
``k = \lceil (n + 1)(1 - \alpha) \rceil`` (the finite-sample quantile); if ``k > n`` no finite
factor guarantees coverage and an error is raised. Then ``P(y_{new} \in C) \ge 1 - \alpha``
(and ``< 1 - \alpha + 1/(n+1)`` for continuous scores).

Elements: with ``per_element=False`` every element of ``(B, ...)`` is one score (coverage holds
for a random element when all elements are exchangeable); with ``per_element=True`` one factor
is computed per trailing position ``(...)`` from its ``B`` rows (coverage per output).

A floor under the spread (:func:`fit_floor`, :class:`FloorConformal`). A spread ``sigma`` that
collapses where the model is confident (SA with one dominant key; a Levy ``sigma_hat`` on dense
evidence) makes the normalised score ``|y - f| / sigma`` explode there. The score

.. math:: r_\beta = \frac{|y - f|}{\sqrt{\sigma^2 + \beta^2}}

interpolates between SA-normalised conformal (``beta = 0``) and plain conformal on absolute
residuals (``beta -> inf``: ``r_beta beta -> |y - f|``, the interval ``f +- q`` with ``q`` the
conformal quantile of ``|y - f|``). ``beta`` is chosen on the *validation* part over a grid in
units of the validation residual scale ``s = sqrt(mean (y - f)^2)`` (:data:`FLOOR_GRID`: ``0``,
``2^-4 .. 2^2`` in steps of ``2^{1/2}``, and ``inf``) by the smallest mean interval width
``2 q_val(beta) mean sqrt(sigma^2 + beta^2)`` at the target level, ``q_val`` the conformal
quantile of the validation scores (every candidate covers ``>= 1 - alpha`` there, so width is
the comparison; ties go to the first in grid order). The factor ``q`` is then the conformal
quantile (the ``ceil((n+1)(1-alpha))``-th smallest) of the *calibration* scores at that ``beta``.
``beta`` depends on the validation part only, so for a new pair exchangeable with the
calibration pairs ``P(|y - f| <= q sqrt(sigma^2 + beta^2)) >= 1 - alpha`` (finite-sample).

NOTE(paper): the floor is ours (#20); neither paper puts one under its spread. The Levy paper's
split-conformal wrapping is the ``beta = 0`` case on ``sigma_hat``; SA's paper has no conformal
step. ``beta`` is fitted on a part disjoint from the one that fixes the factor, so the
finite-sample guarantee of split conformal is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import torch

from attnuq._validation import check_finite
from attnuq.predictive import GaussianPredictive, Predictive, check_level

__all__ = [
    "FLOOR_GRID",
    "ConformalScale",
    "FloorConformal",
    "conformal_quantile",
    "conformal_scale",
    "conformal_scores",
    "fit_floor",
    "floor_scores",
]

#: candidate ``beta`` of :func:`fit_floor`, in units of the validation residual scale
FLOOR_GRID: tuple[float, ...] = (0.0, *(2.0 ** (k / 2) for k in range(-8, 5)), math.inf)

AnyPredictive = Predictive | GaussianPredictive


def _check_alpha(alpha: object) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
        raise ValueError(f"alpha must be a float in (0, 1), got {alpha=!r}")
    return float(alpha)


def _center(pred: AnyPredictive) -> torch.Tensor:
    return pred.mean


def conformal_scores(pred: AnyPredictive, targets: torch.Tensor, *, alpha: float) -> torch.Tensor:
    r"""Normalised scores ``r = max((c - y)/(c - l), (y - c)/(u - c))_+``, shape ``(B, ...)``.

    ``c`` is ``pred.mean``, ``[l, u] = pred.interval(1 - alpha)``. A zero half-width on the side
    of ``y`` gives ``r = inf`` when ``y`` is off-centre and ``0`` when ``y == c``.

    Examples
    --------
    >>> import torch
    >>> g = GaussianPredictive(torch.zeros(2), torch.ones(2))
    >>> [round(v, 3) for v in conformal_scores(g, torch.tensor([1.96, -0.98]), alpha=0.05).tolist()]
    [1.0, 0.5]
    """
    alpha = _check_alpha(alpha)
    if not isinstance(pred, (Predictive, GaussianPredictive)) and not (
        hasattr(pred, "interval") and hasattr(pred, "mean") and hasattr(pred, "scaled")
    ):
        raise TypeError(
            "pred must be a Predictive, GaussianPredictive or another predictive with mean, "
            f"interval and scaled (e.g. attnuq.SAPredictive), got {type(pred).__name__}"
        )
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a torch.Tensor, got {type(targets).__name__}")
    c = _center(pred)
    if targets.shape != c.shape:
        raise ValueError(
            "targets must have the predictive's shape (B, ...), got "
            f"targets.shape={tuple(targets.shape)} and prediction shape={tuple(c.shape)}"
        )
    if targets.numel() == 0:
        raise ValueError(f"targets is empty, got targets.shape={tuple(targets.shape)}")
    check_finite(targets, "targets")
    lo, hi = pred.interval(1.0 - alpha)
    y = targets.to(c.dtype)
    up = y - c
    down = c - y
    half_up = (hi - c).clamp_min(0)
    half_down = (c - lo).clamp_min(0)
    r_up = torch.where(up > 0, up / half_up, torch.zeros_like(up))
    r_down = torch.where(down > 0, down / half_down, torch.zeros_like(down))
    return torch.maximum(r_up, r_down)


def conformal_quantile(
    scores: torch.Tensor, alpha: float, *, dim: int | None = None
) -> torch.Tensor:
    r"""Finite-sample conformal quantile: the ``ceil((n + 1)(1 - alpha))``-th smallest score.

    Parameters
    ----------
    scores
        Calibration scores; pooled (``dim=None``) or along ``dim``.
    alpha
        Miscoverage in ``(0, 1)``.

    Raises
    ------
    ValueError
        If ``ceil((n + 1)(1 - alpha)) > n`` (too few scores for this ``alpha``) or any score is NaN.

    Examples
    --------
    >>> import torch
    >>> float(conformal_quantile(torch.arange(1.0, 20.0), 0.1))  # n=19: k = ceil(18) = 18
    18.0
    """
    alpha = _check_alpha(alpha)
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"scores must be a torch.Tensor, got {type(scores).__name__}")
    if bool(torch.isnan(scores).any()):
        raise ValueError("scores contain NaN")
    s = scores.reshape(-1) if dim is None else scores.movedim(dim, 0)
    n = s.shape[0]
    if n == 0:
        raise ValueError(f"scores is empty, got scores.shape={tuple(scores.shape)}")
    k = math.ceil((n + 1) * (1.0 - alpha))
    if k > n:
        raise ValueError(
            f"too few calibration scores for alpha={alpha}: need ceil((n+1)(1-alpha)) <= n, "
            f"got n={n} (k={k}); use at least {math.ceil(1.0 / alpha) - 1} scores"
        )
    return torch.sort(s, dim=0).values[k - 1]


@dataclass(frozen=True)
class ConformalScale:
    """A fitted split-conformal factor; apply it with :meth:`interval` or :meth:`apply`.

    Attributes
    ----------
    factor
        0-d tensor (pooled) or ``(...)`` per element.
    alpha
        Target miscoverage; intervals are central ``1 - alpha`` intervals.
    n
        Number of calibration scores per factor.

    Examples
    --------
    Fitted by :func:`conformal_scale` on targets twice as spread as the predictive:

    >>> import torch
    >>> from attnuq.predictive import GaussianPredictive
    >>> g = GaussianPredictive(mean=torch.zeros(99), std=torch.ones(99))
    >>> y = 2 * torch.randn(99, generator=torch.Generator().manual_seed(0))
    >>> cs = conformal_scale(g, y, alpha=0.1)
    >>> cs.n, cs.alpha, round(float(cs.factor), 2)
    (99, 0.1, 1.98)
    >>> test = GaussianPredictive(mean=torch.zeros(2), std=torch.ones(2))
    >>> cs.apply(test).std  # spread about the mean times the factor
    tensor([1.9811, 1.9811])
    >>> lo, hi = cs.interval(test)  # central 90 % interval: +- 1.645 * factor
    >>> bool(torch.allclose(hi, 1.6449 * cs.factor, atol=1e-3)), bool(torch.equal(lo, -hi))
    (True, True)
    """

    factor: torch.Tensor
    alpha: float
    n: int

    def apply(self, pred: AnyPredictive) -> AnyPredictive:
        """``pred`` with its spread about the mean multiplied by :attr:`factor`."""
        return pred.scaled(self.factor.to(pred.mean.dtype))

    def interval(self, pred: AnyPredictive) -> tuple[torch.Tensor, torch.Tensor]:
        """Conformal ``1 - alpha`` interval ``(lower, upper)`` for a test predictive."""
        return self.apply(pred).interval(1.0 - self.alpha)


def conformal_scale(
    pred: AnyPredictive,
    targets: torch.Tensor,
    *,
    alpha: float = 0.05,
    per_element: bool = False,
) -> ConformalScale:
    r"""Fit the split-conformal spread factor on a held-out calibration set.

    Parameters
    ----------
    pred
        Calibration predictive: :class:`Predictive` (samples ``(S, B, ...)``, e.g. SA) or
        :class:`GaussianPredictive` (``(B, ...)``).
    targets
        ``(B, ...)`` calibration targets.
    alpha
        Miscoverage; the returned intervals have coverage ``>= 1 - alpha``.
    per_element
        One factor per trailing position ``(...)`` (from the ``B`` rows) instead of one pooled
        factor.

    Returns
    -------
    ConformalScale
        ``.interval(test_pred)`` gives the conformal intervals.

    Examples
    --------
    >>> import torch
    >>> g = torch.Generator().manual_seed(0)
    >>> cal = GaussianPredictive(torch.zeros(500), 0.5 * torch.ones(500))
    >>> cs = conformal_scale(cal, torch.randn(500, generator=g), alpha=0.1)
    >>> abs(float(cs.factor) - 2.0) < 0.2  # the Gaussian was 2x too narrow
    True
    """
    alpha = _check_alpha(alpha)
    check_level(1.0 - alpha)
    r = conformal_scores(pred, targets, alpha=alpha)
    if per_element:
        q = conformal_quantile(r, alpha, dim=0)
        n = int(r.shape[0])
    else:
        q = conformal_quantile(r, alpha)
        n = int(r.numel())
    if bool(torch.isinf(q).any()):
        raise ValueError(
            "conformal factor is infinite: more than an alpha fraction of calibration targets "
            "lie off-centre where the predictive spread is zero"
        )
    return ConformalScale(factor=q, alpha=alpha, n=n)


def _floor_spread(sigma: torch.Tensor, beta: float) -> torch.Tensor:
    """``sqrt(sigma^2 + beta^2)``; ``1`` for ``beta = inf`` (the score is then ``|y - f|``)."""
    if math.isinf(beta):
        return torch.ones_like(sigma)
    return torch.sqrt(sigma * sigma + beta * beta)


def floor_scores(center: torch.Tensor, sigma: torch.Tensor, targets: torch.Tensor, beta: float
                 ) -> torch.Tensor:
    r"""Scores ``|y - f| / sqrt(sigma^2 + beta^2)`` ``(B, ...)``; ``beta = inf`` gives
    ``|y - f|`` (plain conformal; the limit of ``beta r_beta``).

    A zero denominator (``sigma = beta = 0``) gives ``inf`` where ``y != f`` and ``0`` where
    ``y == f``.

    Examples
    --------
    >>> import torch
    >>> f, s, y = torch.zeros(2), torch.tensor([3.0, 0.0]), torch.tensor([5.0, 2.0])
    >>> floor_scores(f, s, y, 4.0).tolist(), floor_scores(f, s, y, float("inf")).tolist()
    ([1.0, 0.5], [5.0, 2.0])
    """
    for name, t in (("center", center), ("sigma", sigma), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not center.shape == sigma.shape == targets.shape or targets.numel() == 0:
        raise ValueError(
            "center, sigma and targets must share one non-empty shape (B, ...), got "
            f"center.shape={tuple(center.shape)}, sigma.shape={tuple(sigma.shape)}, "
            f"targets.shape={tuple(targets.shape)}"
        )
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta >= 0:
        raise ValueError(f"beta must be a float >= 0 (inf allowed), got {beta=!r}")
    check_finite(targets, "targets")
    check_finite(center, "center")
    check_finite(sigma, "sigma")
    if bool((sigma < 0).any()):
        raise ValueError("sigma must be non-negative")
    err = (targets.to(center.dtype) - center).abs()
    den = _floor_spread(sigma.to(center.dtype), float(beta))
    return torch.where(err > 0, err / den, torch.zeros_like(err))


@dataclass(frozen=True)
class FloorConformal:
    """A fitted floor: intervals ``f +- factor * sqrt(sigma^2 + beta^2)`` (``f +- factor`` for
    ``beta = inf``) with coverage ``>= 1 - alpha``; see :func:`fit_floor`.

    Attributes
    ----------
    beta
        The floor (absolute units; ``0``: SA-normalised, ``inf``: plain conformal).
    beta_units
        ``beta`` over the validation residual scale (the grid value chosen).
    factor
        The conformal quantile of the calibration scores.
    alpha, n
        Miscoverage; number of calibration scores.
    residual_scale
        ``sqrt(mean (y - f)^2)`` on the validation part.
    val_widths
        Mean validation interval width of every grid value (``(grid value, width)`` pairs).

    Examples
    --------
    >>> import torch
    >>> fc = FloorConformal(beta=1.0, beta_units=0.5, factor=2.0, alpha=0.1, n=99,
    ...                     residual_scale=2.0, val_widths=())
    >>> lo, hi = fc.interval(torch.zeros(1), torch.zeros(1))  # +- 2 * sqrt(0 + 1)
    >>> float(lo), float(hi)
    (-2.0, 2.0)
    >>> round(float(fc.predictive(torch.zeros(1), torch.zeros(1)).interval(0.9)[1]), 4)
    2.0
    """

    beta: float
    beta_units: float
    factor: float
    alpha: float
    n: int
    residual_scale: float
    val_widths: tuple[tuple[float, float], ...]

    def half_width(self, sigma: torch.Tensor) -> torch.Tensor:
        """``(B, ...)``: ``factor * sqrt(sigma^2 + beta^2)`` (``factor`` for ``beta = inf``)."""
        return self.factor * _floor_spread(sigma, self.beta)

    def interval(self, center: torch.Tensor, sigma: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``1 - alpha`` interval ``(lower, upper)`` about ``center`` ``(B, ...)``."""
        h = self.half_width(sigma.to(center.dtype))
        return center - h, center + h

    def predictive(self, center: torch.Tensor, sigma: torch.Tensor) -> GaussianPredictive:
        """``N(center, (half_width / z_{1 - alpha/2})^2)``: its central ``1 - alpha`` interval
        is :meth:`interval` (other levels follow the Gaussian shape)."""
        z = NormalDist().inv_cdf(1.0 - self.alpha / 2.0)
        return GaussianPredictive(mean=center, std=self.half_width(sigma.to(center.dtype)) / z)


def _check_part(part: object, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not isinstance(part, (tuple, list)) or len(part) != 3:
        raise ValueError(f"{name} must be a (center, sigma, targets) triple, got {part!r:.80}")
    c, s, y = part
    floor_scores(c, s, y, 0.0)  # shapes, finiteness, sign: errors name the bad value
    return c, s, y


def fit_floor(
    val: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    cal: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    alpha: float = 0.05,
    grid: tuple[float, ...] = FLOOR_GRID,
) -> FloorConformal:
    r"""Normalised split conformal with a floor: ``beta`` on ``val``, the factor on ``cal``.

    Parameters
    ----------
    val, cal
        ``(center, sigma, targets)``, each ``(B, ...)`` (shapes may differ between the parts):
        the point prediction ``f``, the model's spread ``sigma >= 0`` and the targets. Every
        element is one score (pooled).
    alpha
        Miscoverage: intervals of level ``1 - alpha``.
    grid
        Candidate ``beta`` in units of the validation residual scale (``inf`` allowed).

    Returns
    -------
    FloorConformal

    Raises
    ------
    ValueError
        Bad shapes or values, an empty grid, a zero validation residual scale, too few
        calibration scores for ``alpha``, or an infinite factor (``beta = 0`` chosen and more
        than an ``alpha`` fraction of calibration targets off-centre where ``sigma = 0``).

    Examples
    --------
    The spread misses a constant noise part (true sd ``0.5 + sigma``): a floor is chosen.

    >>> import torch
    >>> g = torch.Generator().manual_seed(0)
    >>> def part(n):
    ...     s = torch.rand(n, generator=g)
    ...     return torch.zeros(n), s, (0.5 + s) * torch.randn(n, generator=g)
    >>> fc = fit_floor(part(2000), part(2000), alpha=0.1)
    >>> 0 < fc.beta_units < float("inf"), fc.n
    (True, 2000)
    """
    alpha = _check_alpha(alpha)
    vc, vs, vy = _check_part(val, "val")
    cc, cs, cy = _check_part(cal, "cal")
    if not isinstance(grid, (tuple, list)) or not grid or any(
        isinstance(b, bool) or not isinstance(b, (int, float)) or not b >= 0 for b in grid
    ):
        raise ValueError(f"grid must be a non-empty sequence of floats >= 0, got {grid=!r}")
    scale = float(((vy.to(vc.dtype) - vc) ** 2).mean().sqrt())
    if not scale > 0:
        raise ValueError("the validation residual scale is 0: every target equals its center")
    widths: list[tuple[float, float]] = []
    for b in grid:
        beta = float(b) * scale
        q = float(conformal_quantile(floor_scores(vc, vs, vy, beta), alpha))
        w = 2.0 * q * float(_floor_spread(vs.to(vc.dtype), beta).mean())
        widths.append((float(b), w if math.isfinite(q) else math.inf))
    best = min(range(len(widths)), key=lambda i: widths[i][1])
    units = widths[best][0]
    beta = units * scale
    q = float(conformal_quantile(floor_scores(cc, cs, cy, beta), alpha))
    if not math.isfinite(q):
        raise ValueError(
            "floor conformal factor is infinite: beta = 0 and more than an alpha fraction of "
            "calibration targets lie off-centre where sigma is zero"
        )
    return FloorConformal(beta=beta, beta_units=units, factor=q, alpha=alpha, n=int(cy.numel()),
                          residual_scale=scale, val_widths=tuple(widths))
