"""Property tests (issue #35): every data loader round-trips random valid files, and a random
byte-level corruption of a valid file gives our error or a warning -- never a silently
different result.

Loaders: UCI (``data.txt`` and the index files), ETT (CSV), PhysioNet (a stay file), ERA5
(netCDF, what the GRIB path shares after decoding) and the generic table readers of
``attnuq calibrate`` (CSV, NPZ). Hypothesis builds a small valid file, then applies one
corruption of a kind that a reader can detect:

* ``cut``: the file truncated inside a line (a cut at a line end leaves a valid, shorter file,
  which no reader can tell from a real one);
* ``nul`` / ``bad_utf8``: a NUL byte or an undecodable byte inserted anywhere;
* ``letter``: a digit replaced by ``q`` (a digit changed into another digit is a valid file).

The outcome must be one of: :class:`attnuq.data.DataFormatError` (or a ``ValueError`` naming
the data set, for a consequence such as a split left too small); a warning (a last line without
a line end: :class:`attnuq.data.TruncatedFileWarning`); or a load whose values equal those of
the uncorrupted file (e.g. a ``q`` in a column name that is not read). Binary formats (NPZ,
netCDF) get the ``cut`` kind at any byte. Every kind is a pytest parameter; hypothesis varies the
file and the position, ``derandomize=True`` (the same examples on every machine, no database),
so a failure is a real counterexample, not chance. Sizes are small: a few seconds per test.
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnuq.cli._calibrate import load_heldout
from attnuq.data import TruncatedFileWarning
from attnuq_bench.data.ett import ETT_CHANNELS, load_ett
from attnuq_bench.data.physionet import load_physionet2012
from attnuq_bench.data.uci import load_uci

SETTINGS = settings(max_examples=10, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
TEXT_KINDS = ("cut", "nul", "bad_utf8", "letter")


@contextmanager
def _tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


def _corrupt(raw: bytes, kind: str, data: st.DataObject) -> bytes | None:
    """``raw`` with one corruption of ``kind`` at a drawn position (None: no such position)."""
    if kind == "cut":
        cuts = [i for i in range(1, len(raw)) if raw[i - 1:i] not in (b"\n", b"\r")]
        if not cuts:
            return None
        return raw[: data.draw(st.sampled_from(cuts), label="cut at")]
    if kind in ("nul", "bad_utf8"):
        i = data.draw(st.integers(0, len(raw)), label="insert at")
        return raw[:i] + (b"\0" if kind == "nul" else b"\xff") + raw[i:]
    digits = [i for i, c in enumerate(raw) if 48 <= c <= 57]
    if not digits:
        return None
    i = data.draw(st.sampled_from(digits), label="digit")
    return raw[:i] + b"q" + raw[i + 1:]


def _same(a: Any, b: Any) -> bool:
    """Equal loaded values (tensors, arrays, dicts/tuples of them), NaN equal to NaN."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(
            _same(x, y) for x, y in zip(a, b, strict=True))
    x, y = np.asarray(a), np.asarray(b)
    return x.shape == y.shape and bool(np.array_equal(x, y, equal_nan=x.dtype.kind == "f"))


def _check(load: Callable[[], Any], reference: Any, *names: str) -> str:
    """Run ``load`` on the corrupted file: an error naming the data (our
    :class:`DataFormatError`, or a ``ValueError`` that names one of ``names``: the file, or the
    data set for a consequence such as a split left too small), a warning, or the reference
    values."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            got = load()
        except ValueError as e:  # DataFormatError is one
            assert any(n in str(e) for n in names), (names, str(e))
            return "error"
    kinds = {w.category for w in caught}
    if kinds:
        assert all(issubclass(k, (TruncatedFileWarning, UserWarning)) for k in kinds), caught
        return "warning"
    assert _same(got, reference), "a corrupted file loaded silently with other values"
    return "same"


# ----------------------------------------------------------------------------------- UCI


def _uci_files(data: st.DataObject) -> tuple[dict[str, bytes], np.ndarray]:
    n_rows, n_cols = data.draw(st.integers(20, 24)), data.draw(st.integers(3, 4))
    table = np.random.default_rng(data.draw(st.integers(0, 2**16))).normal(size=(n_rows, n_cols))
    n_test = 5
    files = {
        "data.txt": "".join(" ".join(repr(float(v)) for v in row) + "\n" for row in table),
        "index_features.txt": "".join(f"{j}\n" for j in range(n_cols - 1)),
        "index_target.txt": f"{n_cols - 1}\n",
        "index_train_0.txt": "".join(f"{i}\n" for i in range(n_rows - n_test)),
        "index_test_0.txt": "".join(f"{i}\n" for i in range(n_rows - n_test, n_rows)),
    }
    return {k: v.encode() for k, v in files.items()}, table


def _uci_values(d: Path) -> Any:
    s = load_uci("toy", 0, data_dir=d, val_fraction=0.2, cal_fraction=0.2)
    return [s.x_fit, s.y_fit, s.x_val, s.y_val, s.x_cal, s.y_cal, s.x_test, s.y_test]


@pytest.mark.parametrize("kind", TEXT_KINDS)
@pytest.mark.parametrize("target", ["data.txt", "index_features.txt", "index_train_0.txt",
                                    "index_test_0.txt"])
@SETTINGS
@given(data=st.data())
def test_uci_corruptions_are_never_silent(kind: str, target: str, data: st.DataObject) -> None:
    files, table = _uci_files(data)
    with _tmp() as d:
        folder = d / "toy"
        folder.mkdir()
        for name, raw in files.items():
            (folder / name).write_bytes(raw)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ref = _uci_values(d)  # the valid file round-trips, without a warning
        raw_test = ref[-1].double() * 0  # shape only; the values are checked below
        assert raw_test.shape[0] == 5 and sum(len(t) for t in ref[1::2]) == len(table)
        bad = _corrupt(files[target], kind, data)
        if bad is None:
            return
        (folder / target).write_bytes(bad)
        _check(lambda: _uci_values(d), ref, str(folder), "toy")


# ----------------------------------------------------------------------------------- ETT


def _ett_bytes(data: st.DataObject) -> tuple[bytes, np.ndarray]:
    n = data.draw(st.integers(12, 14))
    values = np.random.default_rng(data.draw(st.integers(0, 2**16))).normal(
        size=(n, len(ETT_CHANNELS))).round(3)
    dates = np.datetime64("2020-01-01T00", "h") + np.arange(n).astype("timedelta64[h]")
    lines = [",".join(["date", *ETT_CHANNELS])] + [
        f"{str(t).replace('T', ' ')}:00:00," + ",".join(repr(float(v)) for v in row)
        for t, row in zip(dates, values, strict=True)]
    return ("\n".join(lines) + "\n").encode(), values


@pytest.mark.parametrize("kind", TEXT_KINDS)
@SETTINGS
@given(data=st.data())
def test_ett_corruptions_are_never_silent(kind: str, data: st.DataObject) -> None:
    raw, values = _ett_bytes(data)
    with _tmp() as d:
        p = d / "ETTh9.csv"
        p.write_bytes(raw)

        def load() -> Any:
            e = load_ett(p, context=2)
            return [e.values, e.dates.astype("int64")]

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ref = load()
        back = load_ett(p, context=2)
        np.testing.assert_allclose(back.inverse_transform(back.values.double()).numpy(), values,
                                   rtol=1e-5, atol=1e-5)
        bad = _corrupt(raw, kind, data)
        if bad is None:
            return
        p.write_bytes(bad)
        _check(load, ref, str(p))


# ------------------------------------------------------------------------------ PhysioNet


def _stays(data: st.DataObject) -> dict[str, bytes]:
    out = {}
    for i in range(3):  # a train/val/test split needs three stays
        rid = 135000 + i
        hours = sorted(data.draw(st.lists(st.integers(0, 47), min_size=2, max_size=5)))
        lines = ["Time,Parameter,Value", f"00:00,RecordID,{rid}", "00:00,Age,60"] + [
            f"{h:02d}:30,HR,{70 + h}" for h in hours]
        out[f"{rid}.txt"] = ("\n".join(lines) + "\n").encode()
    return out


@pytest.mark.parametrize("kind", TEXT_KINDS)
@SETTINGS
@given(data=st.data())
def test_physionet_corruptions_are_never_silent(kind: str, data: st.DataObject) -> None:
    files = _stays(data)
    name = data.draw(st.sampled_from(sorted(files)), label="file")
    with _tmp() as d:
        src = d / "set-q"
        src.mkdir()
        for fname, raw in files.items():
            (src / fname).write_bytes(raw)

        def load() -> Any:
            ds = load_physionet2012(src, use_cache=False)
            return {k: v for k, v in vars(ds).items() if isinstance(v, np.ndarray)}

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ref = load()
        assert ref, "the data set holds arrays to compare"
        bad = _corrupt(files[name], kind, data)
        if bad is None:
            return
        (src / name).write_bytes(bad)
        _check(load, ref, str(src))


# ------------------------------------------------------------------------ calibrate tables


@pytest.mark.parametrize("kind", TEXT_KINDS)
@SETTINGS
@given(data=st.data())
def test_calibrate_csv_corruptions_are_never_silent(kind: str, data: st.DataObject) -> None:
    n_rows, n_cols = data.draw(st.integers(2, 6)), data.draw(st.integers(2, 4))
    values = np.random.default_rng(data.draw(st.integers(0, 2**16))).normal(size=(n_rows, n_cols))
    text = ",".join(f"c{j}" for j in range(n_cols)) + "\n" + "".join(
        ",".join(repr(float(v)) for v in row) + "\n" for row in values)
    with _tmp() as d:
        p = d / "held.csv"
        p.write_bytes(text.encode())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ref = load_heldout(p)
        np.testing.assert_array_equal(ref[1].numpy(), values[:, -1].astype(np.float32))
        bad = _corrupt(text.encode(), kind, data)
        if bad is None:
            return
        p.write_bytes(bad)
        _check(lambda: load_heldout(p), ref, str(p))


@SETTINGS
@given(data=st.data())
def test_calibrate_npz_cut_anywhere_is_never_silent(data: st.DataObject) -> None:
    n, f = data.draw(st.integers(2, 6)), data.draw(st.integers(1, 3))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    with _tmp() as d:
        p = d / "held.npz"
        np.savez(p, x=rng.normal(size=(n, f)), y=rng.normal(size=n))
        ref = load_heldout(p)
        raw = p.read_bytes()
        p.write_bytes(raw[: data.draw(st.integers(0, len(raw) - 1), label="cut at")])
        _check(lambda: load_heldout(p), ref, str(p))


# ----------------------------------------------------------------------------------- ERA5


@SETTINGS
@given(data=st.data())
def test_era5_netcdf_round_trips_and_a_cut_is_never_silent(data: st.DataObject) -> None:
    xr = pytest.importorskip("xarray")
    from attnuq_bench.data.era5 import load_field

    t_len, n_lat, n_lon = (data.draw(st.integers(2, 24)), data.draw(st.integers(1, 3)),
                           data.draw(st.integers(1, 3)))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    vals = 280 + rng.normal(size=(t_len, n_lat, n_lon))
    times = (np.datetime64("2019-03-01T00", "h") + np.arange(t_len).astype("timedelta64[h]"))
    ds = xr.Dataset({"t2m": (("time", "latitude", "longitude"), vals)},
                    coords={"time": times.astype("datetime64[ns]"),
                            "latitude": 52.0 - np.arange(n_lat), "longitude": np.arange(n_lon)})
    with _tmp() as d:
        p = d / "field.nc"
        ds.to_netcdf(p, engine="scipy")
        f = load_field(p)
        np.testing.assert_allclose(f.values.double().numpy(), vals, rtol=1e-6)  # round trip
        ref = [f.values, f.lat, f.lon]
        raw = p.read_bytes()
        p.write_bytes(raw[: data.draw(st.integers(0, len(raw) - 1), label="cut at")])

        def load() -> Any:
            g = load_field(p)
            return [g.values, g.lat, g.lon]

        _check(load, ref, str(p))
