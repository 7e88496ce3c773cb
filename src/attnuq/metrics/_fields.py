"""Point-forecast errors (RMSE), gridded-field scores (latitude-weighted RMSE, ACC) and the
rank correlation between predicted spread and realised error."""

from __future__ import annotations

import math
from typing import Literal

import torch

from attnuq.metrics._checks import (
    Reduction,
    check_pair,
    check_reduction,
    check_tensor,
)


def rmse(
    predictions: torch.Tensor, targets: torch.Tensor, *, reduction: Reduction = "mean"
) -> torch.Tensor:
    r"""Root mean squared error.

    ``"mean"``: ``sqrt(mean((p - y)^2))`` over every element (0-d). ``"none"``: one RMSE per
    row, over all non-batch dimensions, shape ``(B,)``.

    Examples
    --------
    >>> import torch
    >>> float(rmse(torch.tensor([0.0, 0.0]), torch.tensor([3.0, 4.0])) ** 2)
    12.5
    """
    check_reduction(reduction)
    p, y = check_pair(predictions, targets, ("predictions", "targets"))
    se = (p - y) ** 2
    if reduction == "mean":
        return se.mean().sqrt()
    return se.reshape(se.shape[0], -1).mean(1).sqrt() if se.dim() > 0 else se.sqrt()


def latitude_weights(lat: torch.Tensor) -> torch.Tensor:
    r"""``w(lat) = cos(lat) / mean(cos(lat))`` for latitudes in degrees, shape ``(n_lat,)``.

    The WeatherBench / ClimaX weights: they average to one over the grid rows.

    Examples
    --------
    >>> import torch
    >>> latitude_weights(torch.tensor([-60.0, 0.0, 60.0])).tolist()
    [0.75, 1.5, 0.75]
    """
    la = check_tensor(lat, "lat", min_dim=1)
    if la.dim() != 1:
        raise ValueError(f"lat must be 1-D (n_lat,), got lat.shape={tuple(la.shape)}")
    if bool(((la < -90) | (la > 90)).any()):
        raise ValueError(f"lat must be in degrees within [-90, 90], got range "
                         f"[{la.min().item()}, {la.max().item()}]")
    lad = la.to(torch.float64)
    # cos(pi / 2) rounds to 6e-17, not 0: the poles get their exact weight
    w = torch.where(lad.abs() == 90, 0.0, torch.cos(lad * (math.pi / 180.0)))
    if float(w.mean()) <= 0:
        raise ValueError(f"lat: cos(lat) averages to zero (only the poles given), got "
                         f"lat={la.tolist() if la.numel() <= 8 else tuple(la.shape)}")
    return (w / w.mean()).to(la.dtype if la.is_floating_point() else torch.float64)


def _check_field(
    p: torch.Tensor, y: torch.Tensor, lat: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p, y = check_pair(p, y, ("predictions", "targets"))
    if p.dim() < 2:
        raise ValueError(
            f"fields must have shape (..., n_lat, n_lon), got predictions.shape={tuple(p.shape)}"
        )
    w = latitude_weights(lat).to(p.dtype).to(p.device)
    if w.shape[0] != p.shape[-2]:
        raise ValueError(
            f"lat must have one entry per grid row, got lat.shape={tuple(w.shape)} and "
            f"predictions.shape={tuple(p.shape)} (n_lat = dim -2)"
        )
    return p, y, w[:, None]  # (n_lat, 1)


def lat_weighted_rmse(
    predictions: torch.Tensor,
    targets: torch.Tensor,
    lat: torch.Tensor,
    *,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    r"""Latitude-weighted RMSE of gridded fields (WeatherBench, ClimaX ``lat_weighted_rmse``).

    For every field (all leading dimensions, e.g. time ``B``):

    .. math:: \mathrm{RMSE}_b = \sqrt{\frac{1}{N_{lat} N_{lon}} \sum_{i,j} w(lat_i)
              (f_{b,i,j} - o_{b,i,j})^2}, \qquad w = \cos(lat)/\overline{\cos(lat)},

    then the mean over fields (``"mean"``) or the ``(...,)`` per-field values (``"none"``).

    Parameters
    ----------
    predictions, targets
        ``(B, n_lat, n_lon)`` (any leading dimensions).
    lat
        ``(n_lat,)`` latitudes in degrees.

    Examples
    --------
    >>> import torch
    >>> f = torch.zeros(2, 3, 4); o = torch.ones(2, 3, 4)
    >>> round(float(lat_weighted_rmse(f, o, torch.tensor([-30.0, 0.0, 30.0]))), 6)  # float32 sums
    1.0
    """
    check_reduction(reduction)
    p, y, w = _check_field(predictions, targets, lat)
    per = (w * (p - y) ** 2).mean(dim=(-2, -1)).sqrt()
    return per.mean() if reduction == "mean" else per


def lat_weighted_acc(
    predictions: torch.Tensor,
    targets: torch.Tensor,
    climatology: torch.Tensor,
    lat: torch.Tensor,
    *,
    reduction: Literal["pooled", "mean", "none"] = "pooled",
) -> torch.Tensor:
    r"""Latitude-weighted anomaly correlation coefficient (ACC) of gridded fields.

    Anomalies ``f' = f - c``, ``o' = o - c`` about the climatology ``c``, each centred by its
    (unweighted) mean, then

    .. math:: \mathrm{ACC} = \frac{\sum w\, f' o'}{\sqrt{\sum w\, f'^2 \sum w\, o'^2}}.

    ``"pooled"`` (default) is the WeatherBench / ClimaX ``lat_weighted_acc`` definition: means
    and sums over all fields and grid points together. ``"none"`` computes one ACC per field
    (means and sums over ``(n_lat, n_lon)``), ``"mean"`` averages those.

    Parameters
    ----------
    predictions, targets
        ``(B, n_lat, n_lon)``.
    climatology
        Broadcastable to the fields, e.g. ``(n_lat, n_lon)``.
    lat
        ``(n_lat,)`` latitudes in degrees.

    Examples
    --------
    >>> import torch
    >>> g = torch.Generator().manual_seed(0)
    >>> f = torch.randn(2, 3, 4, generator=g)
    >>> round(float(lat_weighted_acc(f, f, torch.zeros(3, 4), torch.tensor([-30.0, 0, 30]))), 6)
    1.0
    """
    if reduction not in ("pooled", "mean", "none"):
        raise ValueError(f"reduction must be 'pooled', 'mean' or 'none', got {reduction=!r}")
    p, y, w = _check_field(predictions, targets, lat)
    c = check_tensor(climatology, "climatology").to(p.dtype).to(p.device)
    try:
        torch.broadcast_shapes(c.shape, p.shape)
    except RuntimeError as exc:
        raise ValueError(
            f"climatology must broadcast to the fields, got climatology.shape={tuple(c.shape)} "
            f"and predictions.shape={tuple(p.shape)}"
        ) from exc
    fa = p - c
    oa = y - c
    dims: tuple[int, ...] = tuple(range(p.dim())) if reduction == "pooled" else (-2, -1)
    fa = fa - fa.mean(dim=dims, keepdim=True)
    oa = oa - oa.mean(dim=dims, keepdim=True)
    num = (w * fa * oa).sum(dim=dims)
    den2 = (w * fa * fa).sum(dim=dims) * (w * oa * oa).sum(dim=dims)
    if bool((den2 <= 0).any()):
        raise ValueError(
            "lat_weighted_acc is undefined: a forecast or observed anomaly field is constant "
            f"(reduction={reduction!r})"
        )
    acc = num / den2.sqrt()
    return acc.mean() if reduction == "mean" else acc


def _rankdata(x: torch.Tensor) -> torch.Tensor:
    """Average ranks (1-based), ties sharing the mean of their positions."""
    xs, order = torch.sort(x)
    _, inv, counts = torch.unique_consecutive(xs, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).to(torch.float64)
    avg = ends - (counts.to(torch.float64) - 1.0) / 2.0
    r = torch.empty_like(x, dtype=torch.float64)
    r[order] = avg[inv]
    return r


def spearman_spread_error(
    spread: torch.Tensor, center: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    r"""Spearman rank correlation between predicted spread and absolute error ``|y - center|``.

    Pearson correlation of the average ranks (ties share their mean rank) of ``spread`` and of
    ``|targets - center|``, all elements pooled; in ``[-1, 1]``, larger means the predicted
    spread orders the errors better.

    Parameters
    ----------
    spread
        ``(B, ...)`` predicted spread, e.g. ``Predictive.std``.
    center
        ``(B, ...)`` point prediction, e.g. ``Predictive.mean`` or ``frozen``.
    targets
        ``(B, ...)``.

    Examples
    --------
    >>> import torch
    >>> s = torch.tensor([1.0, 2.0, 3.0, 4.0])
    >>> float(spearman_spread_error(s, torch.zeros(4), torch.tensor([0.1, -0.5, 2.0, -3.0])))
    1.0
    """
    s, c = check_pair(spread, center, ("spread", "center"))
    c, y = check_pair(c, targets, ("center", "targets"))
    err = (y - c).abs().reshape(-1)
    rs = _rankdata(s.reshape(-1).to(err.dtype))
    re = _rankdata(err)
    if err.numel() < 2:
        raise ValueError(f"spearman_spread_error needs at least 2 elements, got {err.numel()}")
    rs = rs - rs.mean()
    re = re - re.mean()
    den = (rs.square().sum() * re.square().sum()).sqrt()
    if float(den) == 0:
        raise ValueError("spearman_spread_error is undefined: spread or |error| is constant")
    return ((rs * re).sum() / den).to(err.dtype)
