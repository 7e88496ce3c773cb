"""A tiny synthetic ERA5-like field for the era5 suite's tests: hourly 2 m temperature on a
6 x 8 grid from 2019-03-01, written as NetCDF (scipy engine)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def tiny_era5_nc(path: Path, days: int) -> Path:
    """``days`` days of ``t2m``: a daily cycle, a latitude gradient and seeded noise."""
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
