"""``attnuq calibrate`` writes the fitted estimator; ``attnuq predict`` uses it (round trip),
and every bad input ends in one line with exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tests._cli import TinyRegressor, heldout, saved_regressor

from attnuq.cli import main
from attnuq.estimators._regressor import SARegressor


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    model_path, model = saved_regressor(tmp_path)
    g = torch.Generator().manual_seed(1)
    x, y = heldout(model, 80, noise=0.2, generator=g)
    np.savez(tmp_path / "heldout.npz", x=x, y=y)
    np.savez(tmp_path / "new.npz", x=torch.randn(10, 3, generator=g).numpy())
    return {"model": model_path, "data": tmp_path / "heldout.npz",
            "new": tmp_path / "new.npz", "out": tmp_path / "cal", "tmp": tmp_path}


def _calibrate(files: dict[str, Path], *extra: str) -> list[str]:
    return ["calibrate", str(files["model"]), str(files["data"]), "--n-passes", "4",
            "--out", str(files["out"]), *extra]


def test_calibrate_then_predict_round_trip(files: dict[str, Path],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_calibrate(files)) == 0
    out = capsys.readouterr().out
    assert "chosen nu = " in out and "form: " in out
    est = json.loads((files["out"] / "estimator.json").read_text())
    assert est["estimator"] == "SARegressor" and est["fitted"]["criterion_resolved"]
    assert est["settings"]["criterion"] == "auto"
    for key in ("nu", "nu_at_edge", "spearman_spread_abs_error", "floor_beta", "form",
                "raw_val_coverage"):
        assert key in est["diagnostics"]
    assert est["metadata"]["n_val_rows"] == 40 and est["metadata"]["n_cal_rows"] == 40
    # predict: npz with samples, and csv; equal to the library's own prediction
    pnpz, pcsv = files["tmp"] / "p.npz", files["tmp"] / "p.csv"
    fitted = str(files["out"] / "estimator.json")
    assert main(["predict", str(files["model"]), fitted, str(files["new"]), "--level", "0.8",
                 "--out", str(pnpz), "--samples"]) == 0
    assert main(["predict", str(files["model"]), fitted, str(files["new"]), "--level", "0.8",
                 "--out", str(pcsv)]) == 0
    z = np.load(pnpz)
    assert z["mean"].shape == (10,) and z["samples"].shape == (4, 10)
    assert (z["lower"] <= z["mean"]).all() and (z["mean"] <= z["upper"]).all()
    model = torch.load(files["model"], weights_only=False).eval()
    sa = SARegressor.load(fitted, model)
    pred = sa.predict(torch.as_tensor(np.load(files["new"])["x"]))
    lo, hi = pred.interval(0.8)
    np.testing.assert_array_equal(z["lower"], lo.numpy())
    np.testing.assert_array_equal(z["upper"], hi.numpy())
    rows = pcsv.read_text().splitlines()
    assert rows[0] == "mean,lower,upper" and len(rows) == 11
    np.testing.assert_allclose(np.array([float(v) for v in rows[1].split(",")]),
                               [z["mean"][0], z["lower"][0], z["upper"][0]], rtol=1e-6)


@pytest.mark.parametrize("centre, recentre", [("auto", "auto"), ("mean", False)])
def test_calibrate_centre_option_reaches_the_estimator(files: dict[str, Path], centre: str,
                                                       recentre: object,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    assert main(_calibrate(files, "--centre", centre)) == 0
    out = capsys.readouterr().out
    est = json.loads((files["out"] / "estimator.json").read_text())
    assert est["settings"]["recentre"] == recentre
    chosen = est["fitted"]["centre"]
    assert f"centre: {chosen}" in out
    assert chosen == "mean" if centre == "mean" else chosen in ("frozen", "mean")
    assert ("val_crps_by_centre" in est["diagnostics"]) == (centre == "auto")
    model = torch.load(files["model"], weights_only=False).eval()
    x = torch.as_tensor(np.load(files["new"])["x"])
    pred = SARegressor.load(files["out"] / "estimator.json", model).predict(x)
    if chosen == "mean":
        assert torch.equal(pred.mean, pred.samples.double().mean(0).float())  # in float64
    with torch.no_grad():
        assert torch.equal(pred.mean, model(x)) == (chosen == "frozen")


def test_taken_out_refused_unless_overwrite(files: dict[str, Path],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_calibrate(files)) == 0
    capsys.readouterr()
    assert main(_calibrate(files)) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnuq: error: --out") and "--overwrite" in err
    assert len(err.strip().splitlines()) == 1
    assert main(_calibrate(files, "--overwrite")) == 0


@pytest.mark.parametrize("case, message", [
    ("level-1", "--level must lie in (0, 1), got 1.0"),
    ("level-neg", "--level must lie in (0, 1), got -0.5"),
    ("torn", "not valid JSON"),
    ("foreign", "not a fitted attnuq estimator"),
    ("other-model", "fitted on another model"),
    ("bad-suffix", "--out must end in .npz or .csv"),
    ("other-model-hint", "pass --no-strict to load it anyway"),
    ("inputs-rejected", "model model.pt fails on the inputs of bad.npz (first batch, shape "
                        "(10, 3, 2))"),
    ("inputs-empty", "array 'x' has no rows"),
    ("inputs-folder", "is a folder, not a regular file"),
    ("metadata-list", "field 'metadata' must be a JSON object, got list"),
    ("out-unwritable", "--out '/proc/attnuq-x/p.npz': folder '/proc' does not take new files"),
    ("pool-without-head", "--pool shapes the input of --head; without a head it does nothing"),
    ("target-with-npz", "--target names CSV columns; new.npz is .npz"),
])
def test_predict_bad_input_one_line_exit_2(files: dict[str, Path], case: str, message: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_calibrate(files)) == 0
    capsys.readouterr()
    fitted = files["out"] / "estimator.json"
    model = files["model"]
    out = files["tmp"] / "p.npz"
    level = "0.9"
    if case == "level-1":
        level = "1"
    elif case == "level-neg":
        level = "-0.5"
    elif case == "torn":
        fitted = files["tmp"] / "torn.json"
        fitted.write_text((files["out"] / "estimator.json").read_text()[:100])
    elif case == "foreign":
        fitted = files["tmp"] / "foreign.json"
        fitted.write_text('{"nu": 4}')
    elif case == "other-model":
        torch.manual_seed(99)
        model = files["tmp"] / "other.pt"
        torch.save(TinyRegressor().eval(), model)
    elif case == "bad-suffix":
        out = files["tmp"] / "p.txt"
    elif case == "other-model-hint":
        torch.manual_seed(99)
        model = files["tmp"] / "other.pt"
        torch.save(TinyRegressor().eval(), model)
    new = files["new"]
    if case == "inputs-rejected":  # rows of (3, 2): the model's attention takes no 4-D tokens
        new = files["tmp"] / "bad.npz"
        np.savez(new, x=np.zeros((10, 3, 2), np.float32))
    elif case == "inputs-empty":
        new = files["tmp"] / "empty.npz"
        np.savez(new, x=np.zeros((0, 3), np.float32))
    elif case == "inputs-folder":
        new = files["tmp"]
    elif case == "metadata-list":
        est = json.loads(fitted.read_text())
        est["metadata"] = [1, 2]
        fitted = files["tmp"] / "meta.json"
        fitted.write_text(json.dumps(est))
    elif case == "out-unwritable":
        out = Path("/proc/attnuq-x/p.npz")
    extra = {"pool-without-head": ["--pool", "cls"],
             "target-with-npz": ["--target", "y"]}.get(case, [])
    rc = main(["predict", str(model), str(fitted), str(new), "--level", level,
               "--out", str(out), *extra])
    err = capsys.readouterr().err
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert not out.exists()


def test_interrupted_calibrate_leaves_no_folder(files: dict[str, Path],
                                                capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while calibrate writes its files: one line, exit 130, and no half-written
    folder (which predict would have taken and a rerun refused)."""
    import attnuq.html_report

    def stopped(*_: object, **__: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(attnuq.html_report, "render_report", stopped)
    assert main(_calibrate(files)) == 130
    err = capsys.readouterr().err  # the fit's warnings, then the one line of the interrupt
    assert err.strip().splitlines()[-1] == "attnuq: interrupted: attnuq calibrate stopped", err
    assert "Traceback" not in err
    assert not files["out"].exists()
    assert not [p for p in files["tmp"].iterdir() if p.name.startswith(".cal.")]
    monkeypatch.undo()
    assert main(_calibrate(files)) == 0  # the rerun is not refused
    assert (files["out"] / "report.html").is_file()


def test_calibrate_unwritable_out_is_refused_before_work(
        files: dict[str, Path], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from attnuq.estimators import _regressor

    def no_work(*_: object, **__: object) -> None:
        raise AssertionError("the fit started although --out cannot be written")

    monkeypatch.setattr(_regressor.SARegressor, "fit", no_work)
    files["out"] = Path("/proc/attnuq-x")
    assert main(_calibrate(files)) == 2
    err = capsys.readouterr().err
    assert "--out '/proc/attnuq-x': folder '/proc' does not take new files" in err, err


def test_calibrate_edge_is_reported(files: dict[str, Path],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Targets far noisier than SA's largest spread: nu = 1 at the lower edge, said on
    stderr (one line, both numbers), in the summary line and in the JSON; exit 0."""
    z = np.load(files["data"])
    rng = np.random.default_rng(2)
    np.savez(files["data"], x=z["x"], y=z["y"] + 100 * rng.normal(size=z["y"].shape))
    assert main(_calibrate(files)) == 0
    cap = capsys.readouterr()
    assert "at the lower edge of nu_range" in cap.out
    assert "attnuq: warning: SARegressor.fit: calibrate: nu = 1 sits at the lower edge" in cap.err
    assert "target scale" in cap.err
    est = json.loads((files["out"] / "estimator.json").read_text())
    assert est["diagnostics"]["nu_at_edge"] == "lower"
    assert est["diagnostics"]["edge_spread"] < est["diagnostics"]["edge_target_scale"]
