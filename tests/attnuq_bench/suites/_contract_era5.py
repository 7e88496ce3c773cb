"""Contract case of ``attnuq bench era5`` (tests/attnuq_bench/suites/test_suite_contract.py): every
method on a tiny synthetic NetCDF field (11 days of hourly 6 x 8 grids; 3 cal days, so that
``conformal``'s per-grid-point factor has the 19 scores it needs at 95 %), a one-layer ViT
trained for one epoch (shared by the two runs through ``--model-dir``), an ensemble of two, a
few samples. The run is interrupted at the second run record it saves (after ``sa-paper``:
``sa-conformal`` then fits its own calibration on resume instead of sharing sa-paper's) and
resumed with ``--resume`` (part of both argvs: a fresh folder has nothing to resume)."""

from __future__ import annotations

from pathlib import Path

from tests.attnuq_bench.suites._synthetic import tiny_era5_nc

from attnuq_bench.suites.era5 import ALL_METHODS

SUITE = "era5"
METHODS = list(ALL_METHODS)
VOLATILE = ("fit s", "predict s")
INTERRUPT = "attnuq_bench.suites._runner.RunStore.save"


def _nc(path: Path, days: int = 11) -> Path:
    return path if path.is_file() else tiny_era5_nc(path, days)


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
