"""``attnuq calibrate --task classification`` fits :class:`attnuq.SAClassifier` for a saved
classifier; ``attnuq predict`` with its ``estimator.json`` writes the class probabilities, the
uncertainty scores and the prediction sets, equal to the library's; every bad input ends in one
line with exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tests._cli import (
    assert_one_line_exit_2,
    class_heldout,
    run,
    saved_classifier,
    saved_regressor,
)

from attnuq import SAClassifier


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 3-class classifier, its held-out file (120 rows: 60 / 60), fresh inputs, and the
    folder ``attnuq calibrate --task classification`` wrote (fitted once for the module)."""
    tmp = tmp_path_factory.mktemp("clf")
    model_path, model = saved_classifier(tmp)
    g = torch.Generator().manual_seed(1)
    x, y = class_heldout(model, 120, generator=g)
    np.savez(tmp / "held.npz", x=x, y=y)
    np.savez(tmp / "new.npz", x=torch.randn(9, 3, generator=g).numpy())
    out = tmp / "cal"
    from attnuq.cli import main

    assert main(["calibrate", str(model_path), str(tmp / "held.npz"), "--task",
                 "classification", "--n-passes", "4", "--out", str(out)]) == 0
    return {"model": model_path, "data": tmp / "held.npz", "new": tmp / "new.npz",
            "fitted": out / "estimator.json", "out": out, "tmp": tmp}


def test_calibrate_writes_a_classifier(fitted: dict[str, Path]) -> None:
    est = json.loads(fitted["fitted"].read_text())
    assert est["estimator"] == "SAClassifier"
    assert est["settings"]["score"] == "aps" and est["settings"]["temperature"] == "joint"
    assert est["settings"]["n_samples"] == 4 and est["settings"]["n_passes"] == 4
    assert est["metadata"]["task"] == "classification"
    assert est["metadata"]["n_val_rows"] == 60 and est["metadata"]["n_cal_rows"] == 60
    d = est["diagnostics"]
    assert d["n_classes"] == 3 and d["n_val"] == 60 and d["n_cal"] == 60
    assert sorted(d["val"]) == ["frozen", "sa", "temperature_scaling"]
    assert len(est["fitted"]["cal_scores"]) == 60
    results = json.loads((fitted["out"] / "results.json").read_text())
    assert results["summary"]["classes"] == 3
    assert results["summary"]["largest set level the calibration part supports"] == 60 / 61
    assert (fitted["out"] / "report.html").is_file()
    assert (fitted["out"] / "calibration.json").is_file()
    for key in ("frozen", "temperature_scaling", "sa"):  # the validation reliability bins
        rel = d["val"][key]["reliability"]
        assert sum(rel["count"]) == 60 and len(rel["accuracy"]) == 15
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:  # the library alone: no figures, said on stdout
        return
    figs = {f["file"] for f in results["figures"]}
    assert figs == {"calibration_curve.png", "reliability.png"}
    assert (fitted["out"] / "reliability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_predict_equals_the_library(fitted: dict[str, Path],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    pnpz, pcsv = fitted["tmp"] / "p.npz", fitted["tmp"] / "p.csv"
    base = ["predict", str(fitted["model"]), str(fitted["fitted"]), str(fitted["new"]),
            "--level", "0.8", "--overwrite", "--batch-size", "4"]  # 3 batches of 9 rows
    rc, out, err = run([*base, "--out", str(pnpz), "--samples"], capsys)
    assert rc == 0, err
    assert f"predictions written to {pnpz}" in out
    rc, _, err = run([*base, "--out", str(pcsv)], capsys)
    assert rc == 0, err
    z = np.load(pnpz)
    model = torch.load(fitted["model"], weights_only=False).eval()
    clf = SAClassifier.load(fitted["fitted"], model)
    x = torch.as_tensor(np.load(fitted["new"])["x"])
    parts = [clf.predict_with_set(x[i:i + 4], alpha=0.2) for i in range(0, 9, 4)]
    probs = torch.cat([p.probs for p, _ in parts])
    sets = torch.cat([s for _, s in parts])
    np.testing.assert_array_equal(z["probs"], probs.numpy())
    np.testing.assert_array_equal(z["set"], sets.numpy())
    np.testing.assert_array_equal(z["label"], probs.argmax(-1).numpy())
    np.testing.assert_array_equal(
        z["mutual_information"], torch.cat([p.mutual_information for p, _ in parts]).numpy())
    assert z["samples"].shape == (4, 9, 3) and float(z["level"]) == 0.8
    # every set holds the predicted class here (APS sets are non-empty and ordered)
    assert z["set"][np.arange(9), z["label"]].all()
    rows = pcsv.read_text().splitlines()
    assert rows[0] == ("label,prob_0,prob_1,prob_2,confidence,entropy,expected_entropy,"
                       "mutual_information,set_size,set_0,set_1,set_2")
    assert len(rows) == 10
    first = rows[1].split(",")
    assert int(first[0]) == int(z["label"][0])
    np.testing.assert_allclose([float(v) for v in first[1:4]], z["probs"][0], rtol=1e-6)
    assert int(first[8]) == int(z["set"][0].sum())
    assert [int(v) for v in first[9:]] == z["set"][0].astype(int).tolist()


def test_binary_model_and_csv_heldout(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                      ) -> None:
    """A model with one logit is a binary classifier ([1 - p, p]); a CSV's last column holds
    the class id."""
    model_path, model = saved_regressor(tmp_path)  # (B, F) -> (B,): one logit
    x, y = class_heldout(model, 80)
    lines = ["a,b,c,label"] + [f"{r[0]},{r[1]},{r[2]},{int(t)}" for r, t in zip(x, y, strict=True)]
    (tmp_path / "held.csv").write_text("\n".join(lines) + "\n")
    rc, out, err = run(["calibrate", str(model_path), str(tmp_path / "held.csv"), "--task",
                        "classification", "--n-passes", "3", "--score", "lac", "--out",
                        str(tmp_path / "cal")], capsys)
    assert rc == 0, err
    assert "chosen nu = " in out and "temperature T = " in out and "validation NLL" in out
    assert "prediction sets (lac) from 40 calibration rows: --level up to 0.9756" in out
    est = json.loads((tmp_path / "cal" / "estimator.json").read_text())
    assert est["diagnostics"]["n_classes"] == 2 and est["settings"]["score"] == "lac"
    (tmp_path / "new.csv").write_text("a,b,c,label\n0.1,0.2,0.3,1\n-1,0,2,0\n")
    rc, _, err = run(["predict", str(model_path), str(tmp_path / "cal" / "estimator.json"),
                        str(tmp_path / "new.csv"), "--out", str(tmp_path / "p.csv")], capsys)
    assert rc == 0, err  # the calibration's --target (label) is dropped from the inputs
    rows = (tmp_path / "p.csv").read_text().splitlines()
    assert rows[0].startswith("label,prob_0,prob_1,") and len(rows) == 3
    p0, p1 = (float(v) for v in rows[1].split(",")[1:3])
    assert abs(p0 + p1 - 1) < 1e-6
    # the same rows without the label column give the same probabilities
    (tmp_path / "new2.csv").write_text("a,b,c\n0.1,0.2,0.3\n-1,0,2\n")
    rc, _, err = run(["predict", str(model_path), str(tmp_path / "cal" / "estimator.json"),
                      str(tmp_path / "new2.csv"), "--out", str(tmp_path / "p2.csv")], capsys)
    assert rc == 0, err
    assert (tmp_path / "p2.csv").read_text() == (tmp_path / "p.csv").read_text()
    # columns in another order, or another column, are refused (this model would take them)
    for name, header in (("swapped", "b,a,c"), ("renamed", "a,b,d")):
        (tmp_path / f"{name}.csv").write_text(f"{header}\n0.1,0.2,0.3\n")
        rc, _, err = run(["predict", str(model_path), str(tmp_path / "cal" / "estimator.json"),
                          str(tmp_path / f"{name}.csv"), "--out", str(tmp_path / f"{name}.npz")],
                         capsys)
        assert_one_line_exit_2(rc, err, f"input columns {header.split(',')} are not the "
                                        "calibration's ['a', 'b', 'c'] (in that order)")


def test_predict_without_calibration_part_warns_and_writes_no_sets(
    fitted: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model = torch.load(fitted["model"], weights_only=False).eval()
    z = np.load(fitted["data"])
    x, y = torch.as_tensor(z["x"]), torch.as_tensor(z["y"])
    clf = SAClassifier(model, nu=8, n_samples=3, progress=False).fit([(x, y)])
    clf.save(fitted["tmp"] / "nocal.json")
    rc, _, err = run(["predict", str(fitted["model"]), str(fitted["tmp"] / "nocal.json"),
                        str(fitted["new"]), "--out", str(fitted["tmp"] / "nocal.npz"),
                        "--overwrite"], capsys)
    assert rc == 0, err
    assert "fitted without a calibration part: no prediction sets are written" in err
    assert "set" not in np.load(fitted["tmp"] / "nocal.npz").files


@pytest.mark.parametrize("case, message", [
    ("fractional", "classification targets must be integer class ids; row 0 holds 0.5"),
    ("out-of-range", "targets (batch 0)"),
    ("score-with-regression", "--score applies to --task classification only, got --score lac "
                              "with --task regression"),
    ("temperature-with-regression", "--temperature applies to --task classification only"),
    ("criterion-with-classification", "--criterion applies to --task regression only, got "
                                      "--criterion crps with --task classification"),
    ("centre-with-classification", "--centre applies to --task regression only"),
    ("two-csv-targets", "--task classification takes one --target column (the class id); "
                        "held2.csv gives 2 target columns"),
])
def test_calibrate_bad_input_one_line_exit_2(tmp_path: Path, case: str, message: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    model_path, model = saved_classifier(tmp_path)
    x, y = class_heldout(model, 40)
    data = tmp_path / "held.npz"
    extra = ["--task", "classification"]
    if case == "fractional":
        y = y.astype(float)
        y[0] = 0.5
    elif case == "out-of-range":
        y[5] = 3  # the model has 3 classes: 0, 1, 2
    elif case == "score-with-regression":
        extra = ["--score", "lac"]
    elif case == "temperature-with-regression":
        extra = ["--task", "regression", "--temperature", "after"]
    elif case == "criterion-with-classification":
        extra += ["--criterion", "crps"]
    elif case == "centre-with-classification":
        extra += ["--centre", "mean"]
    elif case == "two-csv-targets":
        data = tmp_path / "held2.csv"
        data.write_text("a,b,c,t1,t2\n" + "".join(f"{r[0]},{r[1]},{r[2]},{t},{t}\n"
                                                  for r, t in zip(x, y, strict=True)))
        extra += ["--target", "t1", "--target", "t2"]
    np.savez(tmp_path / "held.npz", x=x, y=y)
    rc, _, err = run(["calibrate", str(model_path), str(data), *extra, "--n-passes", "3",
                        "--out", str(tmp_path / "cal")], capsys)
    assert_one_line_exit_2(rc, err, message)
    assert not (tmp_path / "cal").exists()
    if case == "out-of-range":
        assert "3" in err.splitlines()[-1]  # the bad label is named


@pytest.mark.parametrize("case, message", [
    ("level-too-high", "--level 0.99 is above what the calibration part supports: its n = 60 "
                       "rows give prediction sets up to --level 0.9836 (--level 0.99 needs at "
                       "least 99 rows"),
    ("samples-csv", "--samples with a .csv --out: a classifier's draws are (S, N, C)"),
    ("level-1", "--level must lie in (0, 1), got 1.0"),
    ("inputs-rejected", "model clf.pt fails on the inputs of bad.npz"),
    ("other-arrays", "has the input arrays ['input_ids'], but the calibration's were ['x']"),
])
def test_predict_bad_input_one_line_exit_2(fitted: dict[str, Path], case: str, message: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = fitted["tmp"] / f"{case}.npz"
    inputs = fitted["new"]
    extra: list[str] = []
    if case == "level-too-high":
        extra = ["--level", "0.99"]
    elif case == "samples-csv":
        out = fitted["tmp"] / f"{case}.csv"
        extra = ["--samples"]
    elif case == "level-1":
        extra = ["--level", "1"]
    elif case == "inputs-rejected":
        inputs = fitted["tmp"] / "bad.npz"
        np.savez(inputs, x=np.zeros((4, 3, 2), dtype=np.float32))
    elif case == "other-arrays":
        inputs = fitted["tmp"] / "ids.npz"
        np.savez(inputs, input_ids=np.zeros((4, 3), dtype=np.int64))
    rc, _, err = run(["predict", str(fitted["model"]), str(fitted["fitted"]), str(inputs),
                      "--out", str(out), *extra], capsys)
    assert_one_line_exit_2(rc, err, message)
    assert not out.exists()


class TinyTokenModel(torch.nn.Module):
    """Per-token logits of a one-layer attention model: ``input_ids (B, L) -> (B, L, V)``."""

    def __init__(self, vocab: int = 5, d: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.attn = torch.nn.MultiheadAttention(d, 2, batch_first=True)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = self.embed(input_ids)
        return self.head(self.attn(t, t, t, need_weights=False)[0])


def test_per_token_labels_npz_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``y`` of shape ``(N, L)`` with ``-100`` for unlabelled tokens: per-token probabilities
    and sets ``(N, L, V)`` in an ``.npz``; a ``.csv`` --out is refused before any work."""
    torch.manual_seed(0)
    model = TinyTokenModel().eval()
    path = tmp_path / "lm.pt"
    torch.save(model, path)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 5, (60, 6), generator=g)
    y = torch.randint(0, 5, (60, 6), generator=g)
    y[:, :2] = -100  # a prompt: not scored
    np.savez(tmp_path / "held.npz", input_ids=ids.numpy(), y=y.numpy())
    np.savez(tmp_path / "new.npz", input_ids=ids[:7].numpy())
    rc, _, err = run(["calibrate", str(path), str(tmp_path / "held.npz"), "--task",
                      "classification", "--n-passes", "3", "--out", str(tmp_path / "cal")],
                     capsys)
    assert rc == 0, err
    est = json.loads((tmp_path / "cal" / "estimator.json").read_text())
    assert est["diagnostics"]["per_token"] is True
    assert est["diagnostics"]["n_val"] == 30 * 4  # 30 sequences x 4 labelled tokens
    fitted = str(tmp_path / "cal" / "estimator.json")
    rc, _, err = run(["predict", str(path), fitted, str(tmp_path / "new.npz"), "--out",
                      str(tmp_path / "p.npz")], capsys)
    assert rc == 0, err
    z = np.load(tmp_path / "p.npz")
    assert z["probs"].shape == (7, 6, 5) and z["set"].shape == (7, 6, 5)
    assert z["mutual_information"].shape == (7, 6)
    np.savez(tmp_path / "more.npz", input_ids=ids[:7].numpy(), attention_mask=ids[:7].numpy())
    rc, _, err = run(["predict", str(path), fitted, str(tmp_path / "more.npz"), "--out",
                      str(tmp_path / "more_p.npz")], capsys)
    assert_one_line_exit_2(rc, err, "has the input arrays ['attention_mask', 'input_ids'], but "
                                    "the calibration's were ['input_ids']")
    rc, _, err = run(["predict", str(path), fitted, str(tmp_path / "new.npz"), "--out",
                      str(tmp_path / "p.csv")], capsys)
    assert_one_line_exit_2(rc, err, "this classifier predicts per token ((N, L, C) "
                                    "probabilities): use an .npz --out")
