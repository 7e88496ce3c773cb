"""ERA5 field loader (NetCDF on synthetic data, GRIB on the real file), day blocks, examples."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

xr = pytest.importorskip("xarray")
pytest.importorskip("scipy")  # the NetCDF3 engine available here

from attnuq_bench.data.era5 import (  # noqa: E402
    day_blocks,
    hourly_climatology,
    load_field,
    make_examples,
    resolve_era5_path,
)

REAL = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "era5"
GRIB = REAL / "era5-2mt-2019-03-uk.grib"


def _ds(n_hours: int = 72, names: tuple[str, str] = ("latitude", "longitude")) -> object:
    t = np.arange("2019-03-01", n_hours, dtype="datetime64[h]").astype("datetime64[ns]")
    rng = np.random.default_rng(0)
    v = 280 + rng.normal(size=(n_hours, 3, 4))
    return xr.Dataset(
        {"t2m": (("time", *names), v)},
        coords={"time": t, names[0]: [52.0, 51.0, 50.0], names[1]: [0.0, 1.0, 2.0, 3.0]},
    )


def test_netcdf_roundtrip_and_aliases(tmp_path: Path) -> None:
    ds = _ds()
    ds.to_netcdf(tmp_path / "a.nc", engine="scipy")
    f = load_field(tmp_path / "a.nc")
    assert f.values.shape == (72, 3, 4) and f.variable == "t2m"
    np.testing.assert_allclose(f.values.numpy(), ds["t2m"].values, rtol=1e-6)
    assert f.hours[:3].tolist() == [0, 1, 2] and f.hours[25] == 1
    # lat/lon spelled "lat"/"lon", extra singleton dim, dims in another order
    d2 = _ds(names=("lat", "lon")).expand_dims(number=[0]).transpose("lon", "number", "time", "lat")
    d2.to_netcdf(tmp_path / "b.nc", engine="scipy")
    f2 = load_field(tmp_path / "b.nc", "t2m")
    torch.testing.assert_close(f2.values, f.values)


def test_errors_name_the_problem(tmp_path: Path) -> None:
    ds = _ds()
    bad = ds.copy()
    bad["t2m"][5, 1, 1] = np.nan
    bad.to_netcdf(tmp_path / "nan.nc", engine="scipy")
    with pytest.raises(ValueError, match=r"1 NaN/inf values \(first at time index 5\)"):
        load_field(tmp_path / "nan.nc")
    ds.expand_dims(member=[0, 1]).to_netcdf(tmp_path / "ens.nc", engine="scipy")
    with pytest.raises(ValueError, match="non-singleton dimension 'member'"):
        load_field(tmp_path / "ens.nc")
    two = ds.assign(u10=ds["t2m"] * 0)
    two.to_netcdf(tmp_path / "two.nc", engine="scipy")
    with pytest.raises(ValueError, match=r"pass variable="):
        load_field(tmp_path / "two.nc")
    with pytest.raises(ValueError, match="unknown variable='z500'"):
        load_field(tmp_path / "two.nc", "z500")
    xr.Dataset({"t2m": (("time", "y", "x"), ds["t2m"].values)},
               coords={"time": ds.time}).to_netcdf(tmp_path / "xy.nc", engine="scipy")
    with pytest.raises(ValueError, match=r"dimension 'y'.*expected \(time, latitude, longitude\)"):
        load_field(tmp_path / "xy.nc")
    ds.isel(longitude=0, drop=True).to_netcdf(tmp_path / "nolon.nc", engine="scipy")
    with pytest.raises(ValueError, match=r"lacks dimensions \['longitude'\]"):
        load_field(tmp_path / "nolon.nc")
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(ValueError, match="unknown field file type"):
        load_field(tmp_path / "f.txt")
    with pytest.raises(FileNotFoundError, match="missing"):
        load_field(tmp_path / "missing.nc")
    with pytest.raises(FileNotFoundError, match="tried"):
        resolve_era5_path("nope.grib", tmp_path)


def test_blocks_examples_climatology(tmp_path: Path) -> None:
    _ds(n_hours=24 * 5).to_netcdf(tmp_path / "a.nc", engine="scipy")
    f = load_field(tmp_path / "a.nc")
    b = day_blocks(f.times, [("train", 2), ("val", 1), ("test", -1)])
    assert [len(v) for v in b.values()] == [48, 24, 48]
    assert b["val"][0] == 48 and b["test"][-1] == 119
    with pytest.raises(ValueError, match="cannot take 9 days"):
        day_blocks(f.times, [("train", 9)])
    ex = make_examples(f, b["test"], history=6, leads=(6, 24))
    assert len(ex) == 48 - 6 - 24
    t = ex.t_index
    assert t.min() - 6 >= b["test"][0] and t.max() + 24 <= b["test"][-1]
    v = f.values
    torch.testing.assert_close(ex.inputs[:, 0], v[t])
    torch.testing.assert_close(ex.inputs[:, 1], v[t - 6])
    torch.testing.assert_close(ex.targets[:, 0], v[t + 6])
    torch.testing.assert_close(ex.targets[:, 1], v[t + 24])
    assert (ex.hours == f.hours[t]).all()
    with pytest.raises(ValueError, match="too short"):
        make_examples(f, b["val"], history=6, leads=(24,))
    clim = hourly_climatology(f, b["train"])
    torch.testing.assert_close(clim[3], (v[3] + v[27]) / 2)
    with pytest.raises(ValueError, match="no data for hours of day"):
        hourly_climatology(f, b["train"][:20])


@pytest.mark.skipif(not GRIB.is_file(), reason=f"ERA5 GRIB not present at {GRIB}")
def test_real_grib() -> None:
    pytest.importorskip("cfgrib")
    f = load_field(GRIB)
    assert f.variable == "t2m" and f.values.shape == (744, 33, 49)
    assert f.lat.max() == 58.0 and f.lat.min() == 50.0 and f.lon.min() == -10.0
    assert 250.0 < float(f.values.min()) < float(f.values.max()) < 300.0  # kelvin, March UK
    b = day_blocks(f.times, [("train", 18), ("val", 5), ("cal", 4), ("test", -1)])
    assert [len(v) // 24 for v in b.values()] == [18, 5, 4, 4]
