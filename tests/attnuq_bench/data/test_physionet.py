"""PhysioNet 2012 loader on small synthetic files in the challenge format (no real data needed)."""

from __future__ import annotations

import tarfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from attnuq_bench.data.physionet import (
    ParseIssue,
    PhysioNetParseWarning,
    load_physionet2012,
    parse_record,
)


def _stay_text(rid: int, rng: np.random.Generator, *, extra: str = "") -> str:
    lines = ["Time,Parameter,Value", f"00:00,RecordID,{rid}", "00:00,Age,54", "00:00,Gender,-1",
             f"00:00,Height,{-1 if rid % 2 else 170.2}", "00:00,Weight,80"]
    for minute in sorted(rng.choice(48 * 60, 12, replace=False)):
        hh, mm = divmod(int(minute), 60)
        lines.append(f"{hh:02d}:{mm:02d},HR,{60 + rng.integers(0, 60)}")
        if minute % 3 == 0:
            lines.append(f"{hh:02d}:{mm:02d},Glucose,{rng.uniform(80, 200):.1f}")
    lines.append("30:00,HR,77")  # a repeated reading at the same time
    lines.append("30:00,HR,78")
    return "\n".join(lines) + "\n" + extra


def _write_folder(root: Path, n: int = 10, extra: dict[int, str] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        rid = 132000 + i
        (root / f"{rid}.txt").write_text(_stay_text(rid, rng, extra=(extra or {}).get(i, "")))
    return root


def test_folder_and_tar_load_identically(tmp_path: Path) -> None:
    folder = _write_folder(tmp_path / "set-x")
    arch = tmp_path / "set-x.tar.gz"
    with tarfile.open(arch, "w:gz") as tar:
        tar.add(folder, arcname="set-x")
    a = load_physionet2012(folder, cache_dir=tmp_path / "cache")
    b = load_physionet2012(arch, cache_dir=tmp_path / "cache")
    assert a.n_stays == b.n_stays == 10
    assert a.channels == b.channels == ["Age", "Height", "Weight", "Glucose", "HR"]
    for k in ("times", "channel", "values", "offsets", "record_ids"):
        np.testing.assert_array_equal(getattr(a, k), getattr(b, k))
    # Gender -1 (10 stays) and Height -1 (5 odd ids) are missing, not observations
    assert a.n_missing_descriptors == 15
    t, c, _ = a.stay(0)
    assert (t[c == a.channels.index("Age")] == 0).all()
    # the two 30:00 HR readings are both kept; times are hours
    hr = c == a.channels.index("HR")
    assert int(np.sum(t[hr] == 30.0)) >= 2


def test_cache_written_outside_source_and_reused(tmp_path: Path) -> None:
    folder = _write_folder(tmp_path / "d", n=6)
    cache = tmp_path / "cache"
    a = load_physionet2012(folder, cache_dir=cache)
    assert a.cache_path is not None and Path(a.cache_path).is_file()
    assert Path(a.cache_path).parent == cache
    mtime = Path(a.cache_path).stat().st_mtime_ns
    b = load_physionet2012(folder, cache_dir=cache)
    assert b.cache_path == a.cache_path and Path(b.cache_path).stat().st_mtime_ns == mtime
    # changing a file changes the key
    (folder / "132000.txt").write_text(_stay_text(132000, np.random.default_rng(5)))
    c = load_physionet2012(folder, cache_dir=cache)
    assert c.cache_path != a.cache_path


def test_malformed_lines_raise_with_file_and_line(tmp_path: Path) -> None:
    folder = _write_folder(tmp_path / "d", n=4, extra={2: "12:3x,HR,80\n"})
    with pytest.raises(ValueError, match=r"132002\.txt:\d+: bad time '12:3x'"):
        load_physionet2012(folder, cache_dir=tmp_path / "c")


def test_malformed_lines_and_files_are_reported_in_warn_mode(tmp_path: Path) -> None:
    bad = "13:00,HR,abc\n14:00,HR\n15:00,Foo,3\n16:00,HR,nan\n"
    folder = _write_folder(tmp_path / "d", n=5, extra={1: bad})
    (folder / "999999.txt").write_text("garbage\n1,2,3\n")
    with pytest.warns(PhysioNetParseWarning, match="skipped 5 malformed"):
        ds = load_physionet2012(folder, cache_dir=tmp_path / "c", errors="warn")
    assert ds.n_stays == 5
    msgs = [(i.file, i.message.split(" ")[0]) for i in ds.issues]
    assert ("132001.txt", "non-numeric") in msgs
    assert ("132001.txt", "expected") in msgs
    assert ("132001.txt", "unknown") in msgs
    assert ("132001.txt", "non-finite") in msgs
    assert ("999999.txt", "missing") in msgs
    lines = sorted(i.line for i in ds.issues if i.file == "132001.txt")
    text = (folder / "132001.txt").read_text().splitlines()
    expected = [k + 1 for k, line in enumerate(text) if line in bad.splitlines()]
    assert lines == expected and len(expected) == 4
    assert str(ds.issues[0]).startswith(ds.issues[0].file)
    # the cached load reports the same issues again
    with pytest.warns(PhysioNetParseWarning):
        again = load_physionet2012(folder, cache_dir=tmp_path / "c", errors="warn")
    assert again.issues == ds.issues


def test_parse_record_unit() -> None:
    issues: list[ParseIssue] = []
    rec = parse_record("Time,Parameter,Value\n00:00,RecordID,5\n01:30,HR,70\n", "x.txt",
                       issues=issues, errors="warn")
    assert rec is not None and rec.times == [1.5] and rec.params == ["HR"] and issues == []
    assert parse_record("Time,Parameter,Value\n01:30,HR,70\n", "y.txt", issues=issues,
                        errors="warn") is None
    assert issues[-1].message == "no RecordID line" and issues[-1].line == 0
    with pytest.raises(ValueError, match="errors must be"):
        parse_record("", "z", issues=issues, errors="ignore")  # type: ignore[arg-type]


def test_split_scaler_and_batches(tmp_path: Path) -> None:
    folder = _write_folder(tmp_path / "d", n=20)
    ds = load_physionet2012(folder, cache_dir=tmp_path / "c", seed=3)
    sizes = {k: len(ds.split_indices(k)) for k in ("train", "val", "test")}
    assert sizes == {"train": 12, "val": 4, "test": 4}
    ds2 = load_physionet2012(folder, cache_dir=tmp_path / "c", seed=3)
    np.testing.assert_array_equal(ds.split, ds2.split)
    # scaler uses train+val only: scaled train+val values lie in [0, 1]
    fit_idx = np.concatenate([ds.split_indices("train"), ds.split_indices("val")])
    vals = np.concatenate([ds.stay(int(n))[2] for n in fit_idx])
    assert vals.min() == 0.0 and vals.max() == 1.0
    hr = ds.channels.index("HR")
    raw = np.concatenate([ds.values[ds.offsets[n]:ds.offsets[n + 1]][
        ds.channel[ds.offsets[n]:ds.offsets[n + 1]] == hr] for n in fit_idx])
    assert ds.vmin[hr] == raw.min() and ds.vmax[hr] == raw.max()
    b = ds.batch(ds.split_indices("test"))
    assert (b.obs_times[b.obs_mask] <= 24).all()
    assert (b.query_times[b.query_mask] > 24).all() and (b.query_times[b.query_mask] <= 48).all()
    n_q = int(b.query_mask.sum())
    thin = ds.batch(ds.split_indices("test"), keep_fraction=0.5,
                    generator=np.random.default_rng(1))
    assert int(thin.query_mask.sum()) == n_q  # targets never thinned
    assert int(thin.obs_mask.sum()) < int(b.obs_mask.sum())
    capped = ds.batch(ds.split_indices("test"), max_queries=2)
    assert int(capped.query_mask.sum(1).max()) <= 2
    allq = sum(int(x.query_mask.sum()) for x in ds.batches(ds.split_indices("val"), 3,
                                                               by_length=True, shuffle=True))
    assert allq == int(ds.batch(ds.split_indices("val")).query_mask.sum())
    assert b.obs_values.dtype == torch.float32


def test_bad_arguments(tmp_path: Path) -> None:
    folder = _write_folder(tmp_path / "d", n=4)
    with pytest.raises(ValueError, match="errors="):
        load_physionet2012(folder, cache_dir=tmp_path / "c", errors="ignore")
    with pytest.raises(ValueError, match="fractions"):
        load_physionet2012(folder, cache_dir=tmp_path / "c", fractions=(0.5, 0.5, 0.0))
    with pytest.raises(FileNotFoundError):
        load_physionet2012(tmp_path / "nope", cache_dir=tmp_path / "c")
    ds = load_physionet2012(folder, cache_dir=tmp_path / "c")
    with pytest.raises(ValueError, match="keep_fraction"):
        ds.batch([0], keep_fraction=0.0)
    with pytest.raises(ValueError, match="split must be"):
        ds.split_indices("dev")  # type: ignore[arg-type]
    with pytest.raises(IndexError, match="n=99"):
        ds.stay(99)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_physionet2012(folder, cache_dir=tmp_path / "c")  # clean data: no warning


def test_all_41_parameters_load_when_present(tmp_path: Path) -> None:
    """A copy with every documented parameter (ICUType included) gives 41 channels, ICUType's
    descriptor an observation at t = 0, and ``to_device`` keeps the batch intact."""
    from attnuq_bench.data.physionet import KNOWN_PARAMETERS

    root = tmp_path / "all"
    root.mkdir()
    for i in range(4):
        rid = 150000 + i
        lines = ["Time,Parameter,Value", f"00:00,RecordID,{rid}", "00:00,Age,61",
                 "00:00,Gender,1", "00:00,Height,175", f"00:00,ICUType,{1 + i % 4}",
                 "00:00,Weight,70"]
        for k, p in enumerate(KNOWN_PARAMETERS[6:]):
            lines.append(f"{(k % 47):02d}:{(7 * k) % 60:02d},{p},{k + i + 0.5}")
        (root / f"{rid}.txt").write_text("\n".join(lines) + "\n")
    ds = load_physionet2012(root, cache_dir=tmp_path / "c")
    assert ds.n_channels == 41 and ds.channels == list(KNOWN_PARAMETERS[1:])
    icu = ds.channels.index("ICUType")
    t, c, _ = ds.stay(2)
    assert list(t[c == icu]) == [0.0]
    assert ds.summary()["n_channels"] == 41
    b = ds.batch([0, 1])
    b2 = b.to_device("cpu")
    assert b2 is b and torch.equal(b2.query_channels, b.query_channels)
