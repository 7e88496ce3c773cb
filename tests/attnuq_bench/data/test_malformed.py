"""Malformed data files fail with :class:`DataFormatError` naming file and line (issue #23, 7).

Each test here reproduces one silence of the issue: before the fix the file loaded wrongly (a
column or row lost, a negative index wrapping around, 29 of 744 GRIB steps) or failed with a
message that did not name the file. Generated malformed files are in test_malformed_properties.
"""

from __future__ import annotations

import io
import pickle
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from attnuq.cli._calibrate import load_heldout
from attnuq.data import DataFormatError
from attnuq_bench.data.ett import ETT_CHANNELS, load_ett
from attnuq_bench.data.physionet import load_physionet2012
from attnuq_bench.data.uci import load_uci, n_splits

SHARED = Path(__file__).resolve().parents[3].parent / "shared" / "data"


def _check(err: pytest.ExceptionInfo[DataFormatError], path: Path, line: int | None) -> None:
    e = err.value
    assert e.path == str(path) and e.line == line, (e.path, e.line, str(e))
    where = str(path) if line is None else f"{path}:{line}"
    assert str(e).startswith(f"{where}: "), str(e)


# ------------------------------------------------------------------ calibrate's CSV and NPZ


def test_error_type_keeps_path_and_line_through_pickling() -> None:
    e = pickle.loads(pickle.dumps(DataFormatError("a.csv", "bad", line=3)))
    assert (e.path, e.line, str(e)) == ("a.csv", 3, "a.csv:3: bad")
    with pytest.raises(ValueError, match="line=0"):
        DataFormatError("a.csv", "bad", line=0)


def test_csv_duplicate_column_names_are_refused(tmp_path: Path) -> None:
    """Before: ``--target t`` took the first ``t`` and the real target became an input."""
    p = tmp_path / "dup.csv"
    p.write_text("a,t,t\n1,2,3\n4,5,6\n")
    match = r"duplicate column name 't' \(columns 2 and 3\)"
    with pytest.raises(DataFormatError, match=match) as e:
        load_heldout(p, ["t"])
    _check(e, p, 1)


def test_csv_without_header_is_refused_not_shortened(tmp_path: Path) -> None:
    """Before: the first data row was taken as the header and silently lost."""
    p = tmp_path / "nohdr.csv"
    p.write_text("1,2,3\n4,5,6\n7,8,9\n")
    with pytest.raises(DataFormatError, match="header row of column names is required") as e:
        load_heldout(p)
    _check(e, p, 1)


def test_header_only_csv_names_the_problem_without_a_numpy_warning(tmp_path: Path) -> None:
    """Before: numpy's 'input contained no data' warning, then 'rows have 1 fields'."""
    p = tmp_path / "hdr.csv"
    p.write_text("a,b,t\n\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(DataFormatError, match="header row but no data rows") as e:
            load_heldout(p)
    _check(e, p, 1)
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(DataFormatError, match="empty file") as e:
        load_heldout(tmp_path / "empty.csv")
    _check(e, tmp_path / "empty.csv", 1)


def test_csv_rows_are_checked_with_their_line(tmp_path: Path) -> None:
    p = tmp_path / "d.csv"
    cases = {
        "a,b,t\n1,2,3\n\n4,5\n": (4, "row has 2 fields, the header has 3"),
        "a,b,t\n1,2,3\n4,x,6\n": (3, "non-numeric value 'x' in column 'b'"),
        "a,b,t\n1,,3\n": (2, "empty value in column 'b'"),
        "a,b,t\n1,2,3\n4,5,nan\n7,8,inf\n": (3, "NaN target value in column 't' \\(2 row"),
        'a,b,t\n1,2,3\n"4,5,6\n': (3, "malformed CSV"),
        "a,b,t\n1,2,3\n4,5,\xff6\n": (3, "not UTF-8"),
        "a,,t\n1,2,3\n": (1, "empty column name at position 2"),
        "a,b,t\n1,2,3\n": (1, "target columns \\['z'\\] not in the header"),
    }
    for text, (line, match) in cases.items():
        p.write_bytes(text.encode("latin-1"))
        with pytest.raises(DataFormatError, match=match) as e:
            load_heldout(p, ["z"] if "'z'" in match else None)
        _check(e, p, line)
    # quoted fields, blank lines and a BOM are fine; no row is lost
    p.write_bytes(b'\xef\xbb\xbf"a", b ,t\n\n1,2,3\n 4 ,5,6\n')
    x, y = load_heldout(p)
    assert x.tolist() == [[1.0, 2.0], [4.0, 5.0]] and y.tolist() == [3.0, 6.0]
    with pytest.raises(ValueError, match=r"--target names the columns \['t'\] more than once"):
        load_heldout(p, ["t", "t"])


def test_npz_content_errors_name_the_file(tmp_path: Path) -> None:
    p = tmp_path / "d.npz"
    x, y = np.zeros((4, 2)), np.arange(4.0)
    cases = [
        ({"x": x, "y": np.array(["a", "b", "c", "d"])}, "array 'y' has dtype <U1"),
        ({"x": np.float64(3.0), "y": y}, "array 'x' is a scalar"),
        ({"x": x, "mask": x, "y": y}, r"also the arrays \['mask'\], which would be ignored"),
        ({"x": x, "y": np.array([1.0, np.inf, 2.0, 3.0])}, "1 infinite target value"),
        ({"x": x[:3], "y": y}, r"inputs have \[3\] rows but targets have 4"),
        ({"x": x}, "has no array 'y'"),
    ]
    for arrays, match in cases:
        np.savez(p, **arrays)  # type: ignore[arg-type]
        with pytest.raises(DataFormatError, match=match) as e:
            load_heldout(p)
        _check(e, p, None)
    np.savez(p, x=np.array([{"a": 1}] * 4, dtype=object), y=y)
    with pytest.raises(DataFormatError, match=r"could not read as \.npz") as e:
        load_heldout(p)
    _check(e, p, None)
    np.save(tmp_path / "a.npy", x)
    (tmp_path / "a.npy").rename(p)
    with pytest.raises(DataFormatError, match=r"single \.npy array") as e:
        load_heldout(p)
    _check(e, p, None)


# ------------------------------------------------------------------------------------- UCI


def _uci(root: Path, n: int = 30) -> Path:
    folder = root / "toy"
    folder.mkdir(parents=True, exist_ok=True)
    data = np.random.default_rng(0).normal(size=(n, 4))
    np.savetxt(folder / "data.txt", data)
    (folder / "index_features.txt").write_text("0\n1\n2\n")
    (folder / "index_target.txt").write_text("3\n")
    (folder / "index_train_0.txt").write_text("".join(f"{i}\n" for i in range(n - 6)))
    (folder / "index_test_0.txt").write_text("".join(f"{i}\n" for i in range(n - 6, n)))
    (folder / "n_splits.txt").write_text("1\n")
    return folder


def test_uci_negative_feature_index_is_refused(tmp_path: Path) -> None:
    """Before: ``-1`` wrapped around to the last column, the target, used as a feature."""
    f = _uci(tmp_path)
    (f / "index_features.txt").write_text("0\n1\n-1\n")
    with pytest.raises(DataFormatError, match="negative index would wrap around") as e:
        load_uci("toy", 0, data_dir=tmp_path)
    _check(e, f / "index_features.txt", 3)


def test_uci_feature_list_holding_the_target_is_refused(tmp_path: Path) -> None:
    """Before: the target column was also an input (a perfect, meaningless predictor)."""
    f = _uci(tmp_path)
    (f / "index_features.txt").write_text("0\n3\n1\n")
    with pytest.raises(DataFormatError, match="feature column 3 is the target") as e:
        load_uci("toy", 0, data_dir=tmp_path)
    _check(e, f / "index_features.txt", 2)


def test_uci_index_and_table_errors_name_file_and_line(tmp_path: Path) -> None:
    f = _uci(tmp_path)
    good = {name: (f / name).read_text() for name in (
        "data.txt", "index_features.txt", "index_target.txt", "index_train_0.txt",
        "index_test_0.txt")}
    rows = good["data.txt"].splitlines()
    cases = [
        ("index_test_0.txt", "24\n25\n-2\n", 3, "below 0"),
        ("index_test_0.txt", "24\n30\n", 2, "index 30 out of range for data.txt with 30 rows"),
        ("index_test_0.txt", "24\n25\n24\n", 3, "index 24 listed twice"),
        ("index_test_0.txt", "24\n3\n", 2, "row 3 is also a training row of split 0"),
        ("index_test_0.txt", "24\n2.5\n", 2, "'2.5' is not an integer index"),
        ("index_target.txt", "3\n2\n", 2, r"must hold one column index, got \[3, 2\]"),
        ("index_features.txt", "0\n\n7\n", 3, "index 7 out of range .* 4 columns"),
        ("index_features.txt", "", None, "holds no indices"),
        ("data.txt", "\n".join([*rows[:4], "1 2 3", *rows[4:]]), 5,
         "row has 3 values, most rows have 4"),
        ("data.txt", "\n".join([*rows[:2], "# c", "1 2 x 4", *rows[2:]]), 4,
         "non-numeric value 'x' in column 2"),
        ("data.txt", "\n".join([*rows[:6], "", "1 2 nan 4", *rows[6:]]), 8,
         r"non-finite value in row 6"),
        ("data.txt", "", None, "holds no data rows"),
    ]
    for name, text, line, match in cases:
        (f / name).write_text(text)
        with pytest.raises(DataFormatError, match=match) as e:
            load_uci("toy", 0, data_dir=tmp_path)
        _check(e, f / name, line)
        (f / name).write_text(good[name])
    (f / "n_splits.txt").write_text("0\n")
    with pytest.raises(DataFormatError, match="value 0 is below 1") as e:
        n_splits("toy", tmp_path)
    _check(e, f / "n_splits.txt", 1)
    (f / "n_splits.txt").write_text("1\n")
    assert load_uci("toy", 0, data_dir=tmp_path, val_fraction=0.2, cal_fraction=0.2).sizes() == {
        "fit": 14, "val": 5, "cal": 5, "test": 6}


# ------------------------------------------------------------------------------------- ETT


def _ett(tmp_path: Path, n: int = 40) -> tuple[Path, list[str]]:
    rng = np.random.default_rng(0)
    df = pd.DataFrame({"date": pd.date_range("2020-01-01", periods=n, freq="h").astype(str)})
    for c in ETT_CHANNELS:
        df[c] = rng.normal(size=n).round(4)
    p = tmp_path / "ett.csv"
    df.to_csv(p, index=False)
    return p, p.read_text().splitlines()


def test_ett_bad_date_and_empty_file_name_the_file(tmp_path: Path) -> None:
    """Before: pandas' own message (no file name) for a bad date, and for an empty file."""
    p, lines = _ett(tmp_path)
    lines[6] = "2020-13-45 00:00:00" + lines[6][19:]
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataFormatError, match="bad date '2020-13-45 00:00:00'") as e:
        load_ett(p, context=4)
    _check(e, p, 7)
    p.write_text("")
    with pytest.raises(DataFormatError, match="empty file") as e:
        load_ett(p, context=4)
    _check(e, p, 1)


def test_ett_other_errors_name_file_and_line(tmp_path: Path) -> None:
    p, good = _ett(tmp_path)
    header = good[0]
    cases = [
        ([header], 1, "header row but no data rows"),
        ([*good[:5], good[3], *good[5:]], 6, "is not after the previous row's"),
        ([*good[:9], good[9] + ",7", *good[10:]], 10, "row has 9 fields"),
        ([*good[:3], good[3].rsplit(",", 1)[0] + ",abc", *good[4:]], 4,
         r"values per column: \{'OT': 1\} \(first: 'abc' in column 'OT'\)"),
        ([header.replace("HULL", "HUFL"), *good[1:]], 1, "duplicate column name 'HUFL'"),
        ([header.replace("OT", "oil"), *good[1:]], 1, r"lacks columns \['OT'\]"),
    ]
    for lines, line, match in cases:
        p.write_text("\n".join(lines) + "\n")
        with pytest.raises(DataFormatError, match=match) as e:
            load_ett(p, context=4)
        _check(e, p, line)
    with pytest.raises(ValueError, match="distinct channels"):
        load_ett(p, context=4, columns=("OT", "OT"))


# ------------------------------------------------------------------------------------ ERA5


def _write_grib(path: Path, n_hours: int, *, other_level: bool = False) -> None:
    """``n_hours`` hourly GRIB 1 2 m temperature fields on a 3 x 4 grid (eccodes' sample)."""
    eccodes = pytest.importorskip("eccodes", reason="the 'weather' extra (eccodes) is missing")
    keys = dict(Ni=4, Nj=3, latitudeOfFirstGridPointInDegrees=52.0,
                latitudeOfLastGridPointInDegrees=50.0, longitudeOfFirstGridPointInDegrees=0.0,
                longitudeOfLastGridPointInDegrees=3.0, iDirectionIncrementInDegrees=1.0,
                jDirectionIncrementInDegrees=1.0, dataDate=20190301, indicatorOfParameter=167,
                table2Version=128)
    with path.open("wb") as fh:
        for h in range(n_hours + int(other_level)):
            g = eccodes.codes_grib_new_from_samples("GRIB1")
            for k, v in keys.items():
                eccodes.codes_set(g, k, v)
            eccodes.codes_set(g, "dataTime", (h % n_hours) * 100)
            if h == n_hours:  # the same field on a pressure level: cfgrib leaves it out
                eccodes.codes_set(g, "indicatorOfTypeOfLevel", 100)
                eccodes.codes_set(g, "level", 500)
            eccodes.codes_set_values(g, 280.0 + np.arange(12.0) + h)
            eccodes.codes_write(g, fh)
            eccodes.codes_release(g)


def test_truncated_grib_is_refused_with_the_count(tmp_path: Path) -> None:
    """Before: a GRIB cut inside message k loaded its k - 1 complete messages silently."""
    pytest.importorskip("cfgrib", reason="the 'weather' extra (cfgrib) is not installed")
    from attnuq_bench.data.era5 import grib_message_count, load_field

    p = tmp_path / "six.grib"
    _write_grib(p, 6)
    assert grib_message_count(p) == 6 and load_field(p).values.shape == (6, 3, 4)
    raw = p.read_bytes()
    size = len(raw) // 6
    cut = tmp_path / "cut.grib"
    cut.write_bytes(raw[: 4 * size + size // 2])
    with pytest.raises(DataFormatError, match=r"message 5 .* only the 4 complete messages") as e:
        load_field(cut)
    _check(e, cut, None)
    cut.write_bytes(raw[: 2 * size + 10])  # the header of message 3 itself cut off
    with pytest.raises(DataFormatError, match="only the 2 complete"):
        load_field(cut)
    broken = bytearray(raw)
    broken[2 * size - 4 : 2 * size] = b"0000"  # message 2 loses its end marker
    cut.write_bytes(bytes(broken))
    with pytest.raises(DataFormatError, match=r"message 2 at byte .* does not end with '7777'"):
        load_field(cut)
    _write_grib(cut, 6, other_level=True)
    with pytest.raises(DataFormatError, match="holds 7 GRIB messages but only 6 fields were read"):
        load_field(cut)


def test_truncated_shared_grib_is_refused(tmp_path: Path) -> None:
    """The issue's case: the shared March 2019 file cut to 100 kB gave 29 of 744 steps."""
    pytest.importorskip("cfgrib", reason="the 'weather' extra (cfgrib) is not installed")
    from attnuq_bench.data.era5 import load_field

    src = SHARED / "era5" / "era5-2mt-2019-03-uk.grib"
    if not src.is_file():
        pytest.skip("../shared/data not present")
    cut = tmp_path / "cut.grib"
    with src.open("rb") as fh:
        cut.write_bytes(fh.read(100_000))
    with pytest.raises(DataFormatError, match="only the 29 complete messages") as e:
        load_field(cut)
    _check(e, cut, None)


# ------------------------------------------------------------------------------- PhysioNet


def _stays(n: int = 4) -> dict[str, str]:
    out = {}
    for i in range(n):
        rid = 140000 + i
        body = "".join(f"{h:02d}:00,HR,{60 + h + i}\n" for h in range(0, 48, 6))
        out[f"set-z/{rid}.txt"] = f"Time,Parameter,Value\n00:00,RecordID,{rid}\n" + body
    return out


def _tar(path: Path, files: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return path


def test_physionet_errors_inside_an_archive_name_archive_member_and_line(tmp_path: Path) -> None:
    files = _stays()
    files["set-z/140002.txt"] = files["set-z/140002.txt"].replace("12:00,HR", "12:00,HRR")
    arch = _tar(tmp_path / "set-z.tar.gz", files)
    with pytest.raises(DataFormatError, match="unknown parameter 'HRR'") as e:
        load_physionet2012(arch, use_cache=False)
    _check(e, arch / "set-z/140002.txt", 5)
    files = _stays()
    files["set-z/140001.txt"] = files["set-z/140001.txt"].replace("RecordID,140001", "RecordID,1.5")
    match = r"RecordID '1\.5' is not a non-negative integer"
    with pytest.raises(DataFormatError, match=match) as e:
        load_physionet2012(_tar(arch, files), use_cache=False)
    _check(e, arch / "set-z/140001.txt", 2)
    (tmp_path / "notes.md").write_text("not an archive")
    with pytest.raises(DataFormatError, match=r"must be a folder of \.txt files or a tar file"):
        load_physionet2012(tmp_path / "notes.md", use_cache=False)


def test_bench_physionet_data_dir_accepts_the_archive_its_help_promises(tmp_path: Path) -> None:
    """Before: ``--data-dir set-a.tar.gz`` failed with 'data directory not found'."""
    from attnuq_bench.suites.physionet import _resolve

    arch = _tar(tmp_path / "set-z.tar.gz", _stays(5))
    assert _resolve(str(arch)) == arch
    assert load_physionet2012(_resolve(str(arch)), use_cache=False).n_stays == 5
    (tmp_path / "physionet2012").mkdir()
    assert _resolve(str(tmp_path)) == tmp_path / "physionet2012"  # the data root still works
