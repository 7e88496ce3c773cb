"""ETT loader: borders, context overlap, train-only scaling, errors naming the bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from attnuq_bench.data.ett import (
    ETT_CHANNELS,
    ett_borders,
    load_ett,
    resolve_ett_path,
    seasonal_naive,
)

REAL = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "ett" / "ETTh1.csv"


def _write(tmp_path: Path, n: int = 300, name: str = "tiny.csv") -> Path:
    rng = np.random.default_rng(0)
    t = pd.date_range("2020-01-01", periods=n, freq="h")
    df = pd.DataFrame({"date": t})
    for i, c in enumerate(ETT_CHANNELS):
        df[c] = rng.normal(loc=i, scale=1 + i, size=n)
    p = tmp_path / name
    df.to_csv(p, index=False)
    return p


def test_borders_standard_hourly() -> None:
    b, rule = ett_borders(17420, 336)
    assert b == {"train": (0, 8640), "val": (8640 - 336, 11520), "test": (11520 - 336, 14400)}
    assert "standard" in rule
    bm, _ = ett_borders(69680, 96, freq="15min")
    assert bm["test"] == (4 * 11520 - 96, 4 * 14400)


def test_short_file_fallback_and_windows(tmp_path: Path) -> None:
    p = _write(tmp_path, n=300)
    d = load_ett(p, context=24)
    assert d.borders == {"train": (0, 180), "val": (156, 240), "test": (216, 300)}
    assert "60/20/20" in d.split_rule
    x, y = d.windows("test", horizon=8)
    # every window: context then horizon, contiguous rows; first forecast starts at the border
    assert x.shape == (300 - 216 - 24 - 8 + 1, 24, 7) and y.shape[1:] == (8, 7)
    raw = torch.as_tensor(pd.read_csv(p)[list(ETT_CHANNELS)].to_numpy(), dtype=torch.float64)
    back = d.inverse_transform(y[0].double())
    torch.testing.assert_close(back, raw[240:248], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(d.inverse_transform(x[-1].double()), raw[-32:-8],
                               rtol=1e-5, atol=1e-4)
    xs, _ = d.windows("test", horizon=8, stride=5)
    torch.testing.assert_close(xs[1], x[5])


def test_scaler_fitted_on_train_only(tmp_path: Path) -> None:
    p = _write(tmp_path, n=300)
    d = load_ett(p, context=24)
    tr = d.values[:180].double()
    torch.testing.assert_close(tr.mean(0), torch.zeros(7, dtype=torch.float64), atol=1e-5, rtol=0)
    torch.testing.assert_close(tr.std(0, unbiased=False), torch.ones(7, dtype=torch.float64),
                               atol=1e-5, rtol=0)
    # the test part was not used to fit: its mean is not forced to zero
    raw = pd.read_csv(p)[list(ETT_CHANNELS)].to_numpy()
    np.testing.assert_allclose(d.mean, raw[:180].mean(0))


def test_errors_name_the_problem(tmp_path: Path) -> None:
    p = _write(tmp_path, n=300)
    df = pd.read_csv(p)
    df.drop(columns=["OT", "HULL"]).to_csv(tmp_path / "miss.csv", index=False)
    with pytest.raises(ValueError, match=r"lacks columns \['HULL', 'OT'\]"):
        load_ett(tmp_path / "miss.csv", context=24)
    df2 = df.copy()
    df2.loc[[3, 7], "MUFL"] = np.nan
    df2.to_csv(tmp_path / "nan.csv", index=False)
    with pytest.raises(ValueError, match=r"'MUFL': 2"):
        load_ett(tmp_path / "nan.csv", context=24)
    with pytest.raises(FileNotFoundError, match=r"nope\.csv"):
        load_ett(tmp_path / "nope.csv")
    with pytest.raises(ValueError, match="context"):
        load_ett(p, context=500)
    with pytest.raises(ValueError, match="split"):
        load_ett(p, context=24).windows("calib", horizon=4)  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match=r"ETTx9\.csv"):
        resolve_ett_path("ETTx9.csv", tmp_path)


def test_resolve_via_data_dir(tmp_path: Path) -> None:
    (tmp_path / "ett").mkdir()
    _write(tmp_path / "ett", n=300, name="ETTh9.csv")
    assert resolve_ett_path("ETTh9.csv", tmp_path).name == "ETTh9.csv"


def test_seasonal_naive() -> None:
    x = torch.arange(2 * 48 * 3, dtype=torch.float64).reshape(2, 48, 3)
    f = seasonal_naive(x, 30, season=24)
    torch.testing.assert_close(f[:, :24], x[:, 24:])
    torch.testing.assert_close(f[:, 24:], x[:, 24:30])
    with pytest.raises(ValueError, match="season"):
        seasonal_naive(x[:, :10], 4, season=24)


@pytest.mark.skipif(not REAL.is_file(), reason=f"real ETTh1 not present at {REAL}")
def test_real_etth1_window_counts() -> None:
    d = load_ett(REAL, context=336)
    assert d.values.shape == (17420, 7)
    # 2785 test windows for horizon 96: the count every PatchTST/Informer table uses
    assert d.windows("test", horizon=96)[0].shape[0] == 2785
    assert d.windows("val", horizon=96)[0].shape[0] == 2785
    assert d.windows("train", horizon=96)[0].shape[0] == 8640 - 336 - 96 + 1
