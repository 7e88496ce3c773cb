"""Scores and maps of gridded forecasts (the ERA5 suite's fields ``(B, L, n_lat, n_lon)``).

* :func:`point_scores`: latitude-weighted RMSE and ACC (WeatherBench/ClimaX pooled definition,
  :func:`attnuq.metrics.lat_weighted_rmse` / :func:`~attnuq.metrics.lat_weighted_acc`) per lead
  of a point forecast;
* :func:`field_scores`: per lead, the streamed scores of the predictive distribution
  (:class:`~attnuq_bench.suites._scoring.StreamScores`), the point scores of its mean and the PIT W1
  after one pooled spread factor;
* :func:`error_maps` / :func:`load_maps` / :func:`maps_png`: maps of the mean error and of the
  mean predicted spread per method and lead, read back, and their figure.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnuq import metrics
from attnuq._io import CorruptFileWarning, atomic_savefig
from attnuq.predictive import GaussianPredictive, Predictive
from attnuq_bench.suites._scoring import StreamScores

__all__ = ["error_maps", "field_scores", "load_maps", "maps_png", "point_scores"]

AnyPred = Predictive | GaussianPredictive


def _lead_slice(pred: AnyPred, i: int) -> AnyPred:
    if isinstance(pred, GaussianPredictive):
        return GaussianPredictive(mean=pred.mean[:, i], std=pred.std[:, i])
    return Predictive(samples=pred.samples[:, :, i])


def _scaled_w1(pred: AnyPred, y: torch.Tensor, seed: int) -> float:
    """W1 of the PIT after one pooled spread factor (see :func:`attnuq.metrics.pit_w1_scaled`).

    For a Gaussian the factor is ``k^2 = mean (y - m)^2 / mean s^2`` and the PIT is exact,
    ``Phi((y - m) / (k s))``.
    """
    if isinstance(pred, GaussianPredictive):
        m, s = pred.mean.double(), pred.std.double().clamp_min(1e-12)
        k = math.sqrt(float(((y.double() - m) ** 2).mean() / (s**2).mean()))
        pit = 0.5 * (1 + torch.erf((y.double() - m) / (k * s) / math.sqrt(2.0)))
        return float(metrics.pit_w1(pit.reshape(-1)))
    if pred.samples.shape[0] < 2 or float(pred.samples.std(0).max()) == 0.0:
        return float("nan")
    g = torch.Generator().manual_seed(seed)
    return float(metrics.pit_w1_scaled(pred.samples.double(), y.double(), generator=g))


def point_scores(fc: torch.Tensor, y: torch.Tensor, clim: torch.Tensor, lat: torch.Tensor,
                  leads: tuple[int, ...]) -> dict[str, dict[str, float]]:
    """Latitude-weighted RMSE and ACC per lead of point forecasts ``(B, L, n_lat, n_lon)``; ACC
    is NaN when the forecast anomaly is identically zero (the climatology forecast itself)."""
    out = {}
    for i, ld in enumerate(leads):
        f, yi = fc[:, i].double(), y[:, i].double()
        try:
            acc = float(metrics.lat_weighted_acc(f, yi, clim[:, i].double(), lat))
        except ValueError:
            acc = float("nan")
        out[f"+{ld}h"] = {"rmse_lat": float(metrics.lat_weighted_rmse(f, yi, lat)), "acc": acc}
    return out


def field_scores(pred: AnyPred, y: torch.Tensor, *, lat: torch.Tensor, clim: torch.Tensor,
                 leads: tuple[int, ...], seed: int = 0) -> dict[str, dict[str, float]]:
    """Scores per lead of a predictive distribution of fields.

    Parameters
    ----------
    pred
        Samples ``(S, B, L, n_lat, n_lon)`` or a Gaussian with ``(B, L, n_lat, n_lon)`` moments.
    y
        ``(B, L, n_lat, n_lon)`` observed fields; ``L`` = number of leads.
    lat
        ``(n_lat,)`` degrees (for the latitude weights of RMSE and ACC).
    clim
        ``(B, L, n_lat, n_lon)`` climatology at each valid time (ACC reference).

    Returns
    -------
    ``{"+6h": {...}, "+24h": {...}}`` with ``rmse_lat``, ``acc``, ``mse``, ``mae``, ``coverage``,
    ``width`` (PI-95), ``pit_w1`` (native), ``pit_w1_scaled``, ``crps``, ``mean_std``
    (:class:`~attnuq_bench.suites._scoring.StreamScores` per lead, then the field scores).

    Examples
    --------
    >>> y = torch.zeros(3, 1, 2, 2)
    >>> pred = GaussianPredictive(mean=y + 0.5, std=torch.ones_like(y))
    >>> sc = field_scores(pred, y, lat=torch.tensor([50.0, 51.0]), clim=y + 1, leads=(6,))
    >>> round(sc["+6h"]["rmse_lat"], 6), sc["+6h"]["mse"], sc["+6h"]["coverage"]
    (0.5, 0.25, 1.0)
    """
    if y.dim() != 4 or y.shape[1] != len(leads):
        raise ValueError(f"y must be (B, {len(leads)}, n_lat, n_lon), got {tuple(y.shape)}")
    if clim.shape != y.shape:
        raise ValueError(f"clim must have y's shape {tuple(y.shape)}, got {tuple(clim.shape)}")
    out = point_scores(pred.mean, y, clim, lat, leads)
    for i, lead in enumerate(leads):
        p, yi = _lead_slice(pred, i), y[:, i].double()
        sc = StreamScores(seed=seed)
        sc.update(p, yi)
        out[f"+{lead}h"] = {**sc.result(), **out[f"+{lead}h"],
                            "pit_w1_scaled": _scaled_w1(p, yi, seed)}
    return out


def error_maps(pred: AnyPred, y: torch.Tensor) -> dict[str, np.ndarray]:
    """``{"error": mean over B of (mean - y), "spread": mean over B of the predictive std}``,
    each ``(L, n_lat, n_lon)``, for ``pred`` and targets ``y`` ``(B, L, n_lat, n_lon)``."""
    if pred.mean.shape != y.shape:
        raise ValueError(f"prediction {tuple(pred.mean.shape)} and targets {tuple(y.shape)} "
                         "differ in shape")
    return {"error": (pred.mean - y).mean(0).numpy(), "spread": pred.std.mean(0).numpy()}


def load_maps(path: Path) -> dict[str, np.ndarray] | None:
    """The ``"error"`` and ``"spread"`` maps stored at ``path`` (``.npz``); ``None`` when the
    file is missing or torn (with a :class:`~attnuq._io.CorruptFileWarning`)."""
    try:
        with np.load(path) as z:
            return {k: z[k] for k in ("error", "spread")}
    except FileNotFoundError:
        return None
    except Exception as exc:  # torn maps: the method they belong to is redone
        warnings.warn(f"corrupt maps {path} ({type(exc).__name__}: {exc}); redoing them",
                      CorruptFileWarning, stacklevel=2)
        return None


def maps_png(path: Path, maps: dict[str, dict[str, np.ndarray]], field: Any,
             leads: tuple[int, ...]) -> None:
    """One row per method: mean error per lead (shared diverging scale), then mean predicted std
    per lead; ``maps[name]`` holds ``"error"`` and ``"spread"`` ``(L, n_lat, n_lon)``, ``field``
    the grid (``lat``, ``lon``). Written atomically to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(maps)
    ext = (float(field.lon.min()), float(field.lon.max()), float(field.lat.min()),
           float(field.lat.max()))
    origin = "upper" if field.lat[0] > field.lat[-1] else "lower"
    ncol = 2 * len(leads)
    fig, axes = plt.subplots(len(names), ncol, figsize=(3.2 * ncol, 2.1 * len(names)),
                             squeeze=False, layout="constrained")
    emax = max(float(np.abs(maps[n]["error"]).max()) for n in names) or 1.0
    for r, n in enumerate(names):
        for i, ld in enumerate(leads):
            for col, kind, cmap in ((i, "error", "RdBu_r"), (len(leads) + i, "spread", "viridis")):
                ax, v = axes[r, col], maps[n][kind][i]
                lim = (-emax, emax) if kind == "error" else (0, float(v.max()) or 1.0)
                im = ax.imshow(v, extent=ext, origin=origin, cmap=cmap, vmin=lim[0], vmax=lim[1])
                ax.set_title(f"{n}: " + ("mean error" if kind == "error" else
                                         "mean predicted std") + f" +{ld}h (K)", fontsize=7)
                ax.tick_params(labelsize=5)
                fig.colorbar(im, ax=ax, shrink=0.8).ax.tick_params(labelsize=5)
    atomic_savefig(fig, path, dpi=100)
    plt.close(fig)
