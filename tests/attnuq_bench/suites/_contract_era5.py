"""Contract case of ``attnuq bench era5`` (tests/attnuq_bench/suites/test_suite_contract.py): every
method on a tiny synthetic NetCDF field (11 days of hourly 6 x 8 grids; 3 cal days, so that
``conformal``'s per-grid-point factor has the 19 scores it needs at 95 %), a one-layer ViT
trained for one epoch (shared by the two runs through ``--model-dir``), an ensemble of two, a
few samples. The run is interrupted at the second run record it saves (after ``sa-paper``:
``sa-conformal`` then fits its own calibration on resume instead of sharing sa-paper's) and
resumed with ``--resume`` (part of both argvs: a fresh folder has nothing to resume)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from attnuq_bench.suites.era5 import ALL_METHODS

SUITE = "era5"
METHODS = list(ALL_METHODS)
VOLATILE = ("fit s", "predict s")
INTERRUPT = "attnuq_bench.suites._runner.RunStore.save"


def _nc(path: Path, days: int = 11) -> Path:
    import xarray as xr

    if not path.is_file():
        n = 24 * days
        t = np.arange("2019-03-01", n, dtype="datetime64[h]").astype("datetime64[ns]")
        lat, lon = np.linspace(58, 50, 6), np.linspace(-10, 2, 8)
        hour = np.arange(n) % 24
        v = (5 + 3 * np.sin(2 * np.pi * hour / 24)[:, None, None] + 0.5 * lat[None, :, None] / 58
             + 0.3 * np.random.default_rng(0).normal(size=(n, 6, 8)))
        xr.Dataset({"t2m": (("time", "latitude", "longitude"), v)},
                   coords={"time": t, "latitude": lat, "longitude": lon}).to_netcdf(
            path, engine="scipy")
    return path


def argv(tmp: Path) -> list[str]:
    tmp.parent.mkdir(parents=True, exist_ok=True)
    nc = _nc(tmp.parent / "tiny_era5.nc")
    return ["bench", "era5", "--file", str(nc), "--out", str(tmp), "--split", "4,2,3,-1",
            "--model-dir", str(tmp.parent / "era5_backbone"), "--patch", "2", "--hidden", "8",
            "--layers", "1", "--heads", "2", "--mlp", "8", "--epochs", "1", "--ensemble", "2",
            "--n-samples", "3", "--n-passes", "2", "--nu-max", "16", "--no-progress",
            "--resume"]


def page(tmp: Path) -> Path:
    return tmp / "era5.md"
