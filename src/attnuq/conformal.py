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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnuq._validation import check_finite
from attnuq.predictive import GaussianPredictive, Predictive, check_level

__all__ = ["ConformalScale", "conformal_quantile", "conformal_scale", "conformal_scores"]

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
    if not isinstance(pred, (Predictive, GaussianPredictive)):
        raise TypeError(
            f"pred must be a Predictive or GaussianPredictive, got {type(pred).__name__}"
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
