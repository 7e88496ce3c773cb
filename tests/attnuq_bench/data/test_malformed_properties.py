"""Property tests: generated malformed files fail only with our error, naming file and line.

For the calibrate CSV/NPZ readers and the UCI, ETT and PhysioNet loaders, hypothesis builds a
valid small file, optionally plants one defect at a known line (blank lines sprinkled around
it so that line counting is exercised), and checks that

* without a defect the file loads and every generated value comes back (no row lost);
* with a defect the loader raises :class:`attnuq.data.DataFormatError` whose ``path`` is the
  file, whose ``line`` is the defect's line and whose message starts with ``path:line``;
* free-form garbage (random tokens, truncated archives) either loads consistently or raises
  that error (never a numpy/pandas/zipfile exception, never a warning).

Every defect kind is a pytest parameter (so each one is certainly tried); hypothesis varies the
rest (sizes, values, the defect's row and column, blank lines, folder or tar archive), 8
examples per kind and 50 for the free-form tests. It runs with ``derandomize=True`` (a fixed,
reproducible example sequence, no example database), so these tests cannot fail by chance: a
failure is a real counterexample, the same one on every machine.
"""

from __future__ import annotations

import io
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnuq.cli._calibrate import load_heldout
from attnuq.data import DataFormatError
from attnuq_bench.data.ett import ETT_CHANNELS, load_ett
from attnuq_bench.data.physionet import load_physionet2012
from attnuq_bench.data.uci import load_uci

SETTINGS = settings(
    max_examples=50, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
#: per defect kind (the kinds are parametrized, so each one is certainly tried)
PER_KIND = settings(SETTINGS, max_examples=8)


@contextmanager
def _tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


@contextmanager
def _no_warnings() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def _check(e: DataFormatError, path: Path, line: int | None) -> None:
    assert e.path == str(path), (e.path, str(e))
    assert e.line == line, (e.line, line, str(e))
    where = str(path) if line is None else f"{path}:{line}"
    assert str(e).startswith(f"{where}: "), str(e)


@dataclass
class _Doc:
    """Lines of a text file; ``mark`` is the index (0-based) of the line holding the defect."""

    lines: list[str]
    mark: int | None = None

    def spread_blanks(self, where: list[int]) -> None:
        """Insert a blank line before each position in ``where`` (indices into the original)."""
        for k in sorted(where, reverse=True):
            k = min(k, len(self.lines))
            self.lines.insert(k, "")
            if self.mark is not None and k <= self.mark:
                self.mark += 1

    @property
    def line(self) -> int | None:
        return None if self.mark is None else self.mark + 1

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


_NUM = st.floats(-1e6, 1e6, allow_nan=False, width=32).map(float)
_WORDS = st.sampled_from(["abc", "1.2.3", "--1", "0x10", "e5", "one", "1 2", "1e", "."])
_TOKENS = st.sampled_from(["abc", "1.2.3", "--1", "0x10", "e5", "one", "1e", "."])  # no blank


# --------------------------------------------------------------------------- calibrate CSV

_CSV_DEFECTS = ("short", "long", "word", "empty", "nan_target", "inf_target", "dup_name",
                "empty_name", "numeric_header", "no_rows", "bad_utf8", "nul")


@st.composite
def _csv_case(draw: st.DrawFn, defect: str | None) -> tuple[_Doc, np.ndarray]:
    n_cols = draw(st.integers(2, 4))
    n_rows = draw(st.integers(1, 6))
    values = np.array(draw(st.lists(st.lists(_NUM, min_size=n_cols, max_size=n_cols),
                                    min_size=n_rows, max_size=n_rows)))
    names = [f"c{j}" for j in range(n_cols)]
    doc = _Doc([",".join(names)] + [",".join(repr(float(v)) for v in row) for row in values])
    r = draw(st.integers(1, n_rows))  # the data line that gets the defect
    j = draw(st.integers(0, n_cols - 2))  # an input column
    fields = doc.lines[r].split(",")
    if defect == "short":
        doc.lines[r], doc.mark = ",".join(fields[:-1]), r
    elif defect == "long":
        doc.lines[r], doc.mark = doc.lines[r] + ",1", r
    elif defect in ("word", "empty"):
        fields[j] = draw(_WORDS) if defect == "word" else ""
        doc.lines[r], doc.mark = ",".join(fields), r
    elif defect in ("nan_target", "inf_target"):
        fields[-1] = "nan" if defect == "nan_target" else "-inf"
        doc.lines[r], doc.mark = ",".join(fields), r
    elif defect in ("dup_name", "empty_name", "numeric_header"):
        new = list(names)
        if defect == "dup_name":
            new[j + 1] = new[j]
        elif defect == "empty_name":
            new[j] = " "
        else:
            new = [str(k) for k in range(n_cols)]
        doc.lines[0], doc.mark = ",".join(new), 0
    elif defect == "no_rows":
        doc.lines, doc.mark = doc.lines[:1], 0
    elif defect in ("bad_utf8", "nul"):
        doc.lines[r], doc.mark = doc.lines[r] + ("\udcff" if defect == "bad_utf8" else "\0"), r
    doc.spread_blanks(draw(st.lists(st.integers(0, len(doc.lines)), max_size=3)))
    return doc, values


def _write(path: Path, doc: _Doc) -> None:
    # "\udcff" (a lone surrogate) stands for an undecodable byte 0xff
    path.write_bytes(doc.text().encode("utf-8", "surrogateescape"))


@pytest.mark.parametrize("defect", [None, *_CSV_DEFECTS])
@PER_KIND
@given(data=st.data())
def test_csv_defects_are_found_at_their_line(defect: str | None, data: st.DataObject) -> None:
    doc, values = data.draw(_csv_case(defect))
    with _tmp() as d, _no_warnings():
        p = d / "held.csv"
        _write(p, doc)
        if defect is None:
            x, y = load_heldout(p)
            np.testing.assert_array_equal(x.numpy(), values[:, :-1].astype(np.float32))
            np.testing.assert_array_equal(y.numpy(), values[:, -1].astype(np.float32))
            return
        with pytest.raises(DataFormatError) as e:
            load_heldout(p)
        _check(e.value, p, doc.line)


_CSV_TOKENS = st.sampled_from(["1", "-2.5", "3e4", "nan", "inf", "", " ", "x", '"', '"7"',
                               '"a,b"', "é", "\t7", "0x1", "\r", "\0", "#"])


@SETTINGS
@given(rows=st.lists(st.lists(_CSV_TOKENS, max_size=4), max_size=6))
def test_csv_garbage_loads_consistently_or_fails_with_our_error(rows: list[list[str]]) -> None:
    text = "\n".join(",".join(r) for r in rows)
    with _tmp() as d, _no_warnings():
        p = d / "g.csv"
        p.write_text(text, encoding="utf-8", newline="")
        try:
            x, y = load_heldout(p)
        except DataFormatError as e:
            assert e.path == str(p) and str(e).startswith(str(p))
            n_lines = text.count("\n") + text.count("\r") + 1
            assert e.line is None or 1 <= e.line <= n_lines, str(e)
        else:
            assert len(x) == len(y) >= 1 and bool(y.isfinite().all())


# ----------------------------------------------------------------------------------- NPZ

_ARRAY = st.tuples(
    st.sampled_from(["float64", "int32", "bool", "U3", "object"]),
    st.sampled_from([(), (4,), (4, 2), (3,), (0,)]),
)


@SETTINGS
@given(
    spec=st.dictionaries(st.sampled_from(["x", "y", "a", "ids"]), _ARRAY, max_size=3),
    cut=st.none() | st.floats(0.0, 1.0),
)
def test_npz_garbage_loads_consistently_or_fails_with_our_error(
    spec: dict[str, tuple[str, tuple[int, ...]]], cut: float | None
) -> None:
    with _tmp() as d, _no_warnings():
        p = d / "h.npz"
        arrays = {}
        for k, (dtype, shape) in spec.items():
            base = np.arange(int(np.prod(shape))).reshape(shape)
            arrays[k] = base.astype(dtype) if dtype != "object" else base.astype(object)
        np.savez(p, **arrays)  # type: ignore[arg-type]
        if cut is not None:
            raw = p.read_bytes()
            p.write_bytes(raw[: int(cut * len(raw))])
        try:
            inputs, y = load_heldout(p)
        except DataFormatError as e:
            _check(e, p, None)
        else:
            parts = inputs.values() if isinstance(inputs, dict) else [inputs]
            assert all(len(v) == len(y) >= 1 for v in parts) and bool(y.isfinite().all())


# ----------------------------------------------------------------------------------- UCI

_UCI_DEFECTS = (
    ("data.txt", "ragged"), ("data.txt", "word"), ("data.txt", "nan"),
    ("index_features.txt", "negative"), ("index_features.txt", "target"),
    ("index_features.txt", "range"), ("index_features.txt", "float"),
    ("index_train_0.txt", "duplicate"), ("index_test_0.txt", "overlap"),
    ("index_test_0.txt", "range"), ("index_test_0.txt", "negative"),
)


@st.composite
def _uci_case(
    draw: st.DrawFn, defect: tuple[str, str] | None
) -> tuple[dict[str, _Doc], np.ndarray]:
    n_rows, n_cols = draw(st.integers(20, 26)), draw(st.integers(3, 5))
    # values from a seeded generator: hypothesis' favourite all-zero table has a constant target
    data = np.random.default_rng(draw(st.integers(0, 2**16))).normal(size=(n_rows, n_cols))
    n_test = 5
    files = {
        "data.txt": _Doc([" ".join(repr(float(v)) for v in row) for row in data]),
        "index_features.txt": _Doc([str(j) for j in range(n_cols - 1)]),
        "index_target.txt": _Doc([str(n_cols - 1)]),
        "index_train_0.txt": _Doc([str(i) for i in range(n_rows - n_test)]),
        "index_test_0.txt": _Doc([str(i) for i in range(n_rows - n_test, n_rows)]),
    }
    if defect is not None:
        name, kind = defect
        doc = files[name]
        r = draw(st.integers(1 if kind == "duplicate" else 0, len(doc.lines) - 1))
        limit = n_rows if name.startswith("index_t") else n_cols
        toks = doc.lines[r].split()
        new = {
            "ragged": " ".join(toks[:-1]),
            "word": " ".join([draw(_TOKENS), *toks[1:]]),
            "nan": " ".join([draw(st.sampled_from(["nan", "inf", "-inf"])), *toks[1:]]),
            "negative": "-1",
            "target": str(n_cols - 1),
            "range": str(limit + draw(st.integers(0, 3))),
            "float": "1.5",
            "duplicate": doc.lines[0],
            "overlap": "0",
        }[kind]
        doc.lines[r], doc.mark = new, r
    for doc in files.values():
        doc.spread_blanks(draw(st.lists(st.integers(0, len(doc.lines)), max_size=2)))
    return files, data


@pytest.mark.parametrize("defect", [None, *_UCI_DEFECTS], ids=str)
@PER_KIND
@given(data=st.data())
def test_uci_defects_are_found_in_their_file_and_line(
    defect: tuple[str, str] | None, data: st.DataObject
) -> None:
    files, table = data.draw(_uci_case(defect))
    with _tmp() as d, _no_warnings():
        folder = d / "toy"
        folder.mkdir()
        for name, doc in files.items():
            _write(folder / name, doc)
        if defect is None:
            s = load_uci("toy", 0, data_dir=d, val_fraction=0.2, cal_fraction=0.2)
            raw = s.y_test.double() * s.y_std + s.y_mean
            np.testing.assert_allclose(raw.numpy(), table[-5:, -1], rtol=1e-5, atol=1e-5)
            assert sum(s.sizes().values()) == len(table)
            return
        with pytest.raises(DataFormatError) as e:
            load_uci("toy", 0, data_dir=d, val_fraction=0.2, cal_fraction=0.2)
        name = defect[0]
        _check(e.value, folder / name, files[name].line)


# ----------------------------------------------------------------------------------- ETT

_ETT_DEFECTS = ("bad_date", "repeat_date", "short", "word", "empty", "nan", "dup_name",
                "no_rows")


@st.composite
def _ett_case(draw: st.DrawFn, defect: str | None) -> tuple[_Doc, np.ndarray]:
    n = draw(st.integers(12, 16))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    values = rng.normal(size=(n, len(ETT_CHANNELS))).round(3)
    dates = np.datetime64("2020-01-01T00", "h") + np.arange(n).astype("timedelta64[h]")
    doc = _Doc([",".join(["date", *ETT_CHANNELS])] + [
        f"{str(t).replace('T', ' ')}:00:00," + ",".join(repr(float(v)) for v in row)
        for t, row in zip(dates, values, strict=True)])
    r = draw(st.integers(2, n))
    fields = doc.lines[r].split(",")
    j = draw(st.integers(1, len(ETT_CHANNELS)))
    if defect == "bad_date":
        fields[0] = draw(st.sampled_from(["2020-02-30 01:00:00", "yesterday", "",
                                          "2020-01-01 25:00:00"]))
    elif defect == "repeat_date":
        fields[0] = doc.lines[r - 1].split(",")[0]
    elif defect == "short":
        fields = fields[:-1]
    elif defect in ("word", "empty", "nan"):
        fields[j] = {"word": draw(_WORDS), "empty": "", "nan": "NaN"}[defect]
    if defect in ("bad_date", "repeat_date", "short", "word", "empty", "nan"):
        doc.lines[r], doc.mark = ",".join(fields), r
    elif defect == "dup_name":
        doc.lines[0], doc.mark = doc.lines[0].replace("HULL", "LULL"), 0
    elif defect == "no_rows":
        doc.lines, doc.mark = doc.lines[:1], 0
    doc.spread_blanks(draw(st.lists(st.integers(1, len(doc.lines)), max_size=3)))
    return doc, values


@pytest.mark.parametrize("defect", [None, *_ETT_DEFECTS])
@PER_KIND
@given(data=st.data())
def test_ett_defects_are_found_at_their_line(defect: str | None, data: st.DataObject) -> None:
    doc, values = data.draw(_ett_case(defect))
    with _tmp() as d, _no_warnings():
        p = d / "ETTh9.csv"
        _write(p, doc)
        if defect is None:
            data = load_ett(p, context=2)
            back = data.inverse_transform(data.values.double()).numpy()
            np.testing.assert_allclose(back, values, rtol=1e-5, atol=1e-5)
            return
        with pytest.raises(DataFormatError) as e:
            load_ett(p, context=2)
        _check(e.value, p, doc.line)


# ------------------------------------------------------------------------------ PhysioNet

_PN_DEFECTS = ("bad_time", "unknown", "word", "inf", "fields", "empty_param", "header",
               "record_id", "bad_utf8")


@st.composite
def _physionet_case(draw: st.DrawFn, defect: str | None) -> tuple[dict[str, _Doc], str]:
    files: dict[str, _Doc] = {}
    for i in range(3):
        rid = 135000 + i
        hours = sorted(draw(st.lists(st.integers(0, 47), min_size=2, max_size=6)))
        files[f"{rid}.txt"] = _Doc(["Time,Parameter,Value", f"00:00,RecordID,{rid}",
                                    "00:00,Age,60"] + [f"{h:02d}:30,HR,{70 + h}" for h in hours])
    name = draw(st.sampled_from(sorted(files)))
    doc = files[name]
    r = draw(st.integers(3, len(doc.lines) - 1))
    t, _, v = doc.lines[r].split(",")
    new = {
        "bad_time": f"{draw(st.sampled_from(['1:2:3', '12:61', 'ab:00', '-1:00', '12']))},HR,{v}",
        "unknown": f"{t},HeartRate,{v}",
        "word": f"{t},HR,{draw(_WORDS)}",
        "inf": f"{t},HR,{draw(st.sampled_from(['inf', 'nan', '-Infinity']))}",
        "fields": f"{t},HR,{v},1",
        "empty_param": f"{t}, ,{v}",
        "bad_utf8": f"{t},HR,{v}\udcff",
    }
    if defect in new:
        doc.lines[r], doc.mark = new[defect], r
    elif defect == "header":
        doc.lines[0], doc.mark = "Time;Parameter;Value", 0
    elif defect == "record_id":
        doc.lines[1], doc.mark = "00:00,RecordID,12.5", 1
    for d in files.values():
        d.spread_blanks(draw(st.lists(st.integers(1, len(d.lines)), max_size=2)))
    return files, name


@pytest.mark.parametrize("defect", [None, *_PN_DEFECTS])
@PER_KIND
@given(data=st.data(), as_tar=st.booleans())
def test_physionet_defects_are_found_at_their_file_and_line(
    defect: str | None, data: st.DataObject, as_tar: bool
) -> None:
    import tarfile

    files, name = data.draw(_physionet_case(defect))
    with _tmp() as d, _no_warnings():
        src = d / "set-q"
        src.mkdir()
        for fname, doc in files.items():
            _write(src / fname, doc)
        where = src / name
        if as_tar:
            arch = d / "set-q.tar.gz"
            with tarfile.open(arch, "w:gz") as tar:
                for fname in files:
                    tar.add(src / fname, arcname=f"set-q/{fname}")
            src, where = arch, arch / "set-q" / name
        if defect is None:
            ds = load_physionet2012(src, use_cache=False)
            n_obs = sum(1 for doc in files.values() for ln in doc.lines if ",HR," in ln)
            assert ds.n_stays == 3 and int(np.sum(ds.channel == ds.channels.index("HR"))) == n_obs
            return
        with pytest.raises(DataFormatError) as e:
            load_physionet2012(src, use_cache=False)
        _check(e.value, where, files[name].line)


def test_physionet_torn_archive_fails_with_our_error() -> None:
    """Every cut of a small archive: our error naming the archive, or (a cut that leaves whole
    members) a clean load of fewer stays; never a tarfile/zlib/EOFError."""
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for rid in range(136000, 136004):
            text = f"Time,Parameter,Value\n00:00,RecordID,{rid}\n01:00,HR,70\n".encode()
            info = tarfile.TarInfo(f"s/{rid}.txt")
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text))
    blob = buf.getvalue()
    with _tmp() as d:
        p = d / "s.tar.gz"
        for cut in range(0, len(blob), max(1, len(blob) // 40)):
            p.write_bytes(blob[:cut])
            try:
                ds = load_physionet2012(p, use_cache=False)
            except DataFormatError as e:
                assert e.path.startswith(str(p)), str(e)
            else:
                assert 3 <= ds.n_stays <= 4
