"""Slow, loop-based reference definitions of the scores in ``attnuq.metrics``."""

from __future__ import annotations

import math

import numpy as np


def crps_fair_loop(x: np.ndarray, y: float) -> float:
    """Fair CRPS straight from the definition, O(S^2)."""
    s = len(x)
    t1 = sum(abs(xi - y) for xi in x) / s
    t2 = sum(abs(xi - xj) for xi in x for xj in x) / (2 * s * (s - 1))
    return t1 - t2


def crps_normal_integral(mu: float, sd: float, y: float, n: int = 200_001) -> float:
    """CRPS = int_{-inf}^y F^2 dx + int_y^inf (1 - F)^2 dx, trapezoidal rule on +-12 sd."""
    lo, hi = min(mu - 12 * sd, y - 1), max(mu + 12 * sd, y + 1)
    cdf = np.vectorize(lambda x: 0.5 * (1 + math.erf((x - mu) / (sd * math.sqrt(2)))))
    left = np.linspace(lo, y, n)
    right = np.linspace(y, hi, n)
    return float(np.trapezoid(cdf(left) ** 2, left) + np.trapezoid((1 - cdf(right)) ** 2, right))


def w1_uniform_numeric(u: np.ndarray, n_grid: int = 2_000_001) -> float:
    """int_0^1 |F_n(t) - t| dt on a fine grid (F_n right-continuous)."""
    t = np.linspace(0, 1, n_grid)
    fn = np.searchsorted(np.sort(u), t, side="right") / len(u)
    return float(np.trapezoid(np.abs(fn - t), t))


def interval_score_loop(lo: np.ndarray, hi: np.ndarray, y: np.ndarray, alpha: float) -> np.ndarray:
    out = np.empty(len(y))
    for i in range(len(y)):
        s = hi[i] - lo[i]
        if y[i] < lo[i]:
            s += 2 / alpha * (lo[i] - y[i])
        elif y[i] > hi[i]:
            s += 2 / alpha * (y[i] - hi[i])
        out[i] = s
    return out


def lat_rmse_loop(f: np.ndarray, o: np.ndarray, lat: np.ndarray) -> float:
    """ClimaX lat_weighted_rmse with explicit loops over time, lat and lon."""
    w = np.cos(np.deg2rad(lat))
    w = w / w.mean()
    per = []
    for b in range(f.shape[0]):
        acc = 0.0
        for i in range(f.shape[1]):
            for j in range(f.shape[2]):
                acc += w[i] * (f[b, i, j] - o[b, i, j]) ** 2
        per.append(math.sqrt(acc / (f.shape[1] * f.shape[2])))
    return float(np.mean(per))


def lat_acc_loop(f: np.ndarray, o: np.ndarray, clim: np.ndarray, lat: np.ndarray) -> float:
    """WeatherBench / ClimaX pooled ACC with explicit loops."""
    w = np.cos(np.deg2rad(lat))
    w = w / w.mean()
    fa = f - clim
    oa = o - clim
    fm, om = fa.mean(), oa.mean()
    num = sf = so = 0.0
    for b in range(f.shape[0]):
        for i in range(f.shape[1]):
            for j in range(f.shape[2]):
                a, c = fa[b, i, j] - fm, oa[b, i, j] - om
                num += w[i] * a * c
                sf += w[i] * a * a
                so += w[i] * c * c
    return num / math.sqrt(sf * so)
