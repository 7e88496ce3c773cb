"""Tiny synthetic data files for the suites' tests: an ERA5-like NetCDF field and an ETT-like
CSV."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def tiny_era5_nc(path: Path, days: int) -> Path:
    """``days`` days of hourly 2 m temperature ``t2m`` on a 6 x 8 grid from 2019-03-01 (a daily
    cycle, a latitude gradient and seeded noise), as NetCDF (scipy engine)."""
    import xarray as xr

    n = 24 * days
    t = np.arange("2019-03-01", n, dtype="datetime64[h]").astype("datetime64[ns]")
    lat, lon = np.linspace(58, 50, 6), np.linspace(-10, 2, 8)
    hour = np.arange(n) % 24
    # degC-like magnitudes: a 1-epoch tiny model's SA spread is far below float32's resolution
    # at ~280 K (ulp 3e-5), which would leave some elements with exactly zero spread
    v = (5 + 3 * np.sin(2 * np.pi * hour / 24)[:, None, None] + 0.5 * lat[None, :, None] / 58
         + 0.3 * np.random.default_rng(0).normal(size=(n, 6, 8)))
    xr.Dataset({"t2m": (("time", "latitude", "longitude"), v)},
               coords={"time": t, "latitude": lat, "longitude": lon}).to_netcdf(
        path, engine="scipy")
    return path


def tiny_ett_csv(path: Path, n: int = 520) -> Path:
    """``n`` hourly rows from 2021-01-01 of the ETT channels: daily sines and seeded noise."""
    import pandas as pd

    from attnuq_bench.data.ett import ETT_CHANNELS

    rng = np.random.default_rng(0)
    df = pd.DataFrame({"date": pd.date_range("2021-01-01", periods=n, freq="h")})
    for i, c in enumerate(ETT_CHANNELS):
        df[c] = np.sin(2 * np.pi * np.arange(n) / 24 + i) + 0.3 * rng.normal(size=n)
    df.to_csv(path, index=False)
    return path
