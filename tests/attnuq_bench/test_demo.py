"""``attnuq demo`` end to end on the bundled data, with a tiny training budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnuq.cli import main


@pytest.mark.slow
def test_demo_writes_report_and_reuses_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "demo"
    args = ["demo", "--out", str(out), "--max-epochs", "2", "--n-samples", "8"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert f"report written to {out / 'report.html'}" in printed
    for name in ("report.html", "results.json", "pit.png", "reliability.png",
                 "calibration_curve.png", "intervals.png", "model.pt"):
        assert (out / name).is_file(), name
    def strict(token: str) -> None:  # NaN / Infinity are not JSON: undefined scores are null
        raise AssertionError(f"results.json holds {token}")

    res = json.loads((out / "results.json").read_text(), parse_constant=strict)
    methods = [row[0] for row in res["tables"][0]["rows"]]
    assert methods == ["frozen model (point only)", "SA", "SA, paper recipe", "plain conformal",
                       "MC dropout"]
    assert res["tables"][0]["rows"][0][2] is None  # the frozen model has no CRPS
    assert res["summary"]["chosen nu (sa: auto criterion, BO)"] >= 1
    assert res["calibration"]["nu"] == res["summary"]["chosen nu (sa: auto criterion, BO)"]
    assert res["summary"]["criterion used by auto"] == "paper-debiased"  # a scalar target
    assert res["methods"]["SA"]["recentre"] == "mean"
    assert res["methods"]["SA"]["form"] in ("sa-normalised", "sa-floor", "conformal", "gaussian")
    captions = [f["caption"] for f in res["figures"]]
    assert any("In this run" in c for c in captions) and any("The search tried" in c
                                                              for c in captions)
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 4
    # a second run reuses the cached model instead of training again
    assert main(args) == 0
    assert "reusing the model trained before" in capsys.readouterr().out
    res2 = json.loads((out / "results.json").read_text())
    assert res2["summary"]["model"] == "reused from a previous run"
    # ... and the cache is keyed: another training budget retrains
    assert main([*args[:-4], "--max-epochs", "1", "--n-samples", "8"]) == 0
    assert "reusing" not in capsys.readouterr().out
    # a torn checkpoint (a crash while saving, before writes were atomic) is retrained
    ckpt = out / "model.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:100])
    with pytest.warns(UserWarning, match="corrupt demo checkpoint"):
        assert main([*args[:-4], "--max-epochs", "1", "--n-samples", "8"]) == 0
    assert "reusing" not in capsys.readouterr().out
    assert ckpt.stat().st_size > 1000


def test_demo_rejects_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--out", str(tmp_path), "--n-samples", "1"]) == 2
    assert "--n-samples must be an int >= 2" in capsys.readouterr().err  # the flag's name
    assert main(["demo", "--out", str(tmp_path), "--dataset", "nope"]) == 2
    assert "not found" in capsys.readouterr().err
