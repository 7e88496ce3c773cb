"""Prediction-interval metrics: coverage, width and the interval (Winkler) score."""

from __future__ import annotations

import torch

from attnuq.metrics._checks import (
    Reduction,
    check_level,
    check_pair,
    check_reduction,
    reduce,
)


def _check_interval(lower: torch.Tensor, upper: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lo, hi = check_pair(lower, upper, ("lower", "upper"))
    if bool((lo > hi).any()):
        idx = int(torch.nonzero((lo > hi).reshape(-1))[0])
        lo_v, hi_v = lo.reshape(-1)[idx].item(), hi.reshape(-1)[idx].item()
        raise ValueError(
            f"lower must not exceed upper, got lower={lo_v!r} > upper={hi_v!r} at flat index {idx}"
        )
    return lo, hi


def coverage(
    lower: torch.Tensor,
    upper: torch.Tensor,
    targets: torch.Tensor,
    *,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    r"""Fraction of ``targets`` inside the closed intervals ``[lower, upper]``.

    .. math:: \mathrm{cov} = \frac1n \sum_i \mathbf 1\{l_i \le y_i \le u_i\}.

    Parameters
    ----------
    lower, upper, targets
        Same shape ``(B, ...)``, e.g. from ``Predictive.interval(level)``.
    reduction
        ``"mean"`` (0-d) or ``"none"`` (``(B, ...)`` indicators as floats).

    Examples
    --------
    >>> import torch
    >>> float(coverage(torch.zeros(4), torch.ones(4), torch.tensor([0.5, 1.0, 2.0, -1.0])))
    0.5
    """
    check_reduction(reduction)
    lo, hi = _check_interval(lower, upper)
    lo, y = check_pair(lo, targets, ("lower", "targets"))
    inside = ((y >= lo) & (y <= hi.to(lo.dtype))).to(lo.dtype)
    return reduce(inside, reduction)


def interval_width(
    lower: torch.Tensor, upper: torch.Tensor, *, reduction: Reduction = "mean"
) -> torch.Tensor:
    """Width ``upper - lower`` of prediction intervals (mean by default).

    Examples
    --------
    >>> import torch
    >>> float(interval_width(torch.zeros(2), torch.tensor([1.0, 3.0])))
    2.0
    """
    check_reduction(reduction)
    lo, hi = _check_interval(lower, upper)
    return reduce(hi - lo, reduction)


def interval_score(
    lower: torch.Tensor,
    upper: torch.Tensor,
    targets: torch.Tensor,
    *,
    level: float,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    r"""Interval (Winkler) score of central ``level`` intervals; lower is better.

    With ``alpha = 1 - level`` (Gneiting & Raftery 2007, eq. 43):

    .. math:: S = (u - l) + \frac{2}{\alpha}(l - y)\mathbf 1\{y < l\}
              + \frac{2}{\alpha}(y - u)\mathbf 1\{y > u\}.

    It is proper for the ``alpha/2`` and ``1 - alpha/2`` quantiles.

    Examples
    --------
    >>> import torch
    >>> float(interval_score(torch.zeros(1), torch.ones(1), torch.tensor([2.0]), level=0.9))
    21.0
    """
    check_reduction(reduction)
    level = check_level(level)
    alpha = 1.0 - level
    lo, hi = _check_interval(lower, upper)
    lo, y = check_pair(lo, targets, ("lower", "targets"))
    hi = hi.to(lo.dtype)
    score = (hi - lo) + (2.0 / alpha) * ((lo - y).clamp_min(0) + (y - hi).clamp_min(0))
    return reduce(score, reduction)
