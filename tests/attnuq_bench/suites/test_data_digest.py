"""Issue #35 item 2: run records are keyed by a digest of the data as well as the budget, so a
changed data set never reuses the old records; records written before digests were recorded
are stamped once by ``python -m attnuq_bench.suites._digests`` (then reused)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import attnuq_bench.data
from attnuq.cli import main
from attnuq_bench.suites import _digests

BUNDLED = Path(attnuq_bench.data.__file__).parent / "bundled"


def _argv(out: Path, data: Path) -> list[str]:
    return ["bench", "uci", "--datasets", "concrete", "--splits", "1", "--data-dir", str(data),
            "--methods", "gaussian", "--out", str(out), "--n-blocks", "1", "--max-epochs", "1",
            "--patience", "1", "--no-progress"]


def _rmse(out: Path) -> float:
    rec = json.loads((out / "runs" / "concrete" / "split0" / "gaussian.json").read_text())
    return float(rec["metrics"]["rmse"])


def test_changed_data_is_run_again_and_stamped_records_are_reused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    shutil.copytree(BUNDLED / "concrete", data / "concrete")
    out = tmp_path / "uci"
    assert main(_argv(out, data)) == 0
    first = _rmse(out)
    rec_path = out / "runs" / "concrete" / "split0" / "gaussian.json"
    digest = json.loads(rec_path.read_text())["data_digest"]
    # the same data: reused, untouched
    t0 = rec_path.stat().st_mtime_ns
    assert main(_argv(out, data)) == 0
    assert rec_path.stat().st_mtime_ns == t0
    # targets x 2 + 10 (the case): the record is redone on the new data
    table = np.loadtxt(data / "concrete" / "data.txt")
    target = int(np.loadtxt(data / "concrete" / "index_target.txt"))
    table[:, target] = 2 * table[:, target] + 10
    np.savetxt(data / "concrete" / "data.txt", table)
    capsys.readouterr()
    assert main(_argv(out, data)) == 0
    assert "was run on other data" in capsys.readouterr().out
    second = _rmse(out)
    new_digest = json.loads(rec_path.read_text())["data_digest"]
    assert new_digest != digest
    # the RMSE in original units doubles with the targets (same recipe, standardised fit):
    # a reused record would have kept the first value
    assert second == pytest.approx(2 * first, rel=0.05)
    # a record without a digest (written before digests were recorded) is not reused ...
    rec = json.loads(rec_path.read_text())
    del rec["data_digest"]
    rec_path.write_text(json.dumps(rec, indent=1))
    capsys.readouterr()
    assert _digests.main(["uci", "--out", str(out), "--data-dir", str(data), "--dry-run"]) == 0
    assert "1 of 1 record(s) to stamp" in capsys.readouterr().out
    assert "data_digest" not in json.loads(rec_path.read_text())  # a dry run writes nothing
    # ... until stamped from the files it was computed on; then it is reused as it is
    assert _digests.main(["uci", "--out", str(out), "--data-dir", str(data)]) == 0
    assert json.loads(rec_path.read_text())["data_digest"] == new_digest
    t1 = rec_path.stat().st_mtime_ns
    assert main(_argv(out, data)) == 0
    assert rec_path.stat().st_mtime_ns == t1
    # stamping twice changes nothing
    capsys.readouterr()
    assert _digests.main(["uci", "--out", str(out), "--data-dir", str(data)]) == 0
    assert "0 of 1 record(s) stamped" in capsys.readouterr().out


def test_a_record_without_digest_is_redone_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from attnuq_bench.suites._runner import Group, RunStore, run_items

    store = RunStore(tmp_path, suite="t", info={"command": "c", "date": "d", "machine": "m"})
    g = Group(parts=("a",), methods=["m"], reuse=1, data="d1")
    calls: list[str] = []

    def one(_ctx: object, _g: Group, m: str) -> dict[str, object]:
        calls.append(m)
        return {"method": m}

    run_items(store, [g], lambda _g: None, one, progress=False)
    assert json.loads(store.path(("a",), "m").read_text())["data_digest"] == "d1"
    run_items(store, [g], lambda _g: None, one, progress=False)
    assert calls == ["m"]  # same data: reused
    run_items(store, [Group(parts=("a",), methods=["m"], reuse=1, data="d2")], lambda _g: None,
              one, progress=False)
    assert calls == ["m", "m"] and "was run on other data (digest d1, now d2)" in (
        capsys.readouterr().out)
    rec = json.loads(store.path(("a",), "m").read_text())
    del rec["data_digest"]
    store.path(("a",), "m").write_text(json.dumps(rec))
    run_items(store, [Group(parts=("a",), methods=["m"], reuse=1, data="d2")], lambda _g: None,
              one, progress=False)
    assert calls == ["m", "m", "m"] and "has no data digest" in capsys.readouterr().out


def test_files_digest_sees_every_file_of_a_folder(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.txt").write_text("1")
    d1 = _digests.files_digest([tmp_path / "a"])
    (tmp_path / "a" / "y.txt").write_text("2")
    assert _digests.files_digest([tmp_path / "a"]) != d1
    with pytest.raises(FileNotFoundError, match="data file not found"):
        _digests.files_digest([tmp_path / "missing"])
