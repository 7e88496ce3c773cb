"""The classification suites' pieces (issue #33): outcomes parsing, the stays' two views, the
scores of one prediction file, and the summary.json layout of ``mortality`` and ``digits``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from attnuq.data import DataFormatError


def test_read_outcomes_names_the_file_and_line_of_a_bad_label(tmp_path: Path) -> None:
    from attnuq_bench.suites._mortality_data import read_outcomes

    p = tmp_path / "Outcomes-a.txt"
    p.write_text("RecordID,In-hospital_death\n1,0\n2,3\n")
    with pytest.raises(DataFormatError, match=r"Outcomes-a.txt:3: In-hospital_death must be 0 "
                                              r"or 1, got 3"):
        read_outcomes(p)
    p.write_text("RecordID,Survival\n1,0\n")
    with pytest.raises(DataFormatError, match="In-hospital_death"):
        read_outcomes(p)


def test_mortality_parts_and_views_of_synthetic_stays(tmp_path: Path) -> None:
    import importlib.util

    from attnuq_bench.suites._mortality_data import (
        N_GRID_FEATURES,
        grid_inputs,
        irregular_inputs,
        load_mortality,
        n_obs_features,
    )

    spec = importlib.util.spec_from_file_location(
        "_cm", Path(__file__).with_name("_contract_mortality.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.write_stays(tmp_path / "physionet2012", 50)
    d = load_mortality(tmp_path / "physionet2012", cal_fraction=0.2, cache_dir=tmp_path / "c")
    sizes = {k: v.size for k, v in d.parts.items()}
    assert sizes == {"test": 10, "val": 8, "cal": 6, "train": 26}
    every = np.concatenate(list(d.parts.values()))
    assert sorted(every.tolist()) == list(range(50))  # a partition of the stays
    assert d.labels.tolist() == [i % 2 for i in range(50)]
    g = grid_inputs(d, d.parts["test"], 4)
    C = d.ds.n_channels
    assert g.shape == (10, 13, N_GRID_FEATURES * C)
    # the 48 h summary token's carried-forward value equals the last window's
    torch.testing.assert_close(g[:, 0, :C], g[:, -1, :C])
    # the last four blocks are |carried forward|, |mean|, |min|, |max|
    torch.testing.assert_close(g[..., 6 * C:], g[..., :4 * C].abs())
    assert (g[..., :4 * C] < 0).any()  # standardised values of both signs: the check can fail
    x = irregular_inputs(d, d.parts["test"])
    assert x.features.shape[:2] == x.mask.shape
    assert x.features.shape[2] == n_obs_features(C) == 2 * C + 3
    # each observation's z and |z| sit in its own channel's slots, zero elsewhere
    f, ch = x.features[x.mask], x.channels[x.mask]
    rows = torch.arange(len(ch))
    z = f[rows, ch]
    torch.testing.assert_close(f[rows, C + ch], z.abs())
    assert int((f[:, :2 * C] != 0).sum(1).max()) <= 2
    n_obs = np.diff(d.ds.offsets)[d.parts["test"]]
    assert x.mask.sum(1).tolist() == n_obs.tolist()


def test_class_scores_of_a_binary_prediction() -> None:
    from attnuq_bench.suites._classify import class_scores

    p1 = np.array([0.9, 0.8, 0.7, 0.6, 0.4, 0.3, 0.2, 0.1, 0.55, 0.45])
    y = np.array([1, 1, 0, 1, 0, 0, 1, 0, 0, 1])
    sc = class_scores(np.stack([1 - p1, p1], 1), y)
    # the 8 most confident (max(p, 1 - p)) leave out 0.55 and 0.45
    keep = np.argsort(-np.maximum(p1, 1 - p1), kind="stable")[:8]
    from sklearn.metrics import roc_auc_score

    assert sc["auroc_top80"] == pytest.approx(roc_auc_score(y[keep], p1[keep]))
    assert sc["auroc"] == pytest.approx(roc_auc_score(y, p1))
    assert sc["brier"] == pytest.approx(float(np.mean((p1 - y) ** 2)))
    assert sc["accuracy"] == pytest.approx(float(np.mean((p1 > 0.5) == y)))


def _digits_rows() -> list[dict]:
    from attnuq_bench.suites.digits import EVAL_SETS

    rows = []
    for seed in (0, 1):
        for m in ("softmax", "sa-cls"):
            sc = {ds: {"accuracy": 0.9, "nll": 0.3 + seed, "brier": 0.1, "ece": 0.05,
                       "aurc": 0.02, "auroc_error": 0.8, "coverage_90": 0.91, "size_90": 1.2,
                       "coverage_95": 0.96, "size_95": 1.5} for ds in EVAL_SETS}
            sc["ood"] = {"auroc_ood": 0.7, "auroc_ood_msp": 0.7}
            rows.append({"method": m, "seed": seed, "scores": sc})
    return rows


def test_summary_layout_of_the_classification_suites(tmp_path: Path) -> None:
    from attnuq_bench.suites import digits, mortality
    from attnuq_bench.suites._page import update_summary

    dg = digits.summary(_digits_rows())
    assert sorted(dg) == sorted([*digits.EVAL_SETS, "ood"])
    assert dg["noise-3"]["backbone"]["metric"] == "accuracy"
    assert set(dg["noise-3"]["methods"]["sa-cls"]) == {
        "nll", "brier", "ece", "aurc", "auroc_error", "set_coverage_90", "set_size_90"}
    assert dg["clean"]["methods"]["sa-cls"]["nll"] == pytest.approx(0.8)  # mean of 2 seeds
    assert dg["ood"]["methods"]["softmax"] == {"auroc_ood": 0.7}
    mrows = [{"dataset": "set-a", "backbone": b, "method": m, "seed": s,
              "scores": {"auroc": 0.84, "nll": 0.3, "brier": 0.1, "ece": 0.02, "aurc": 0.05,
                         "auroc_error": 0.7}}
             for b in ("transformer", "levy") for m in ("softmax", "temperature")
             for s in (0, 1, 2)]
    mo = mortality.summary(mrows)
    assert sorted(mo) == ["set-a/levy", "set-a/transformer"]
    e = mo["set-a/transformer"]
    assert e["backbone"]["metric"] == "auroc" and e["backbone"]["value"] == pytest.approx(0.84)
    assert e["splits"] == 3
    assert set(e["methods"]["temperature"]) == {"nll", "brier", "ece", "aurc", "auroc_error"}
    path = tmp_path / "summary.json"
    update_summary(path, "mortality", mo)
    update_summary(path, "digits", dg)
    both = json.loads(path.read_text())
    assert sorted(both) == ["digits", "mortality"]
    with pytest.raises(ValueError, match="backbone metric"):
        update_summary(path, "x", {"a": {"backbone": {"metric": "f1"}, "splits": 1,
                                         "methods": {}}})
    assert not math.isnan(both["digits"]["ood"]["methods"]["sa-cls"]["auroc_ood"])


def test_digits_shifts_are_fixed_and_ood_is_not_digits() -> None:
    from attnuq_bench.suites.digits import digits_data

    a, b = digits_data(max_images=300), digits_data(max_images=300)
    for k in ("noise-3", "rotation-2", "ood"):
        assert torch.equal(a[k][0], b[k][0])
    x = a["clean"][0]
    assert not torch.equal(a["noise-1"][0], x) and float(a["noise-3"][0].min()) >= 0.0
    assert a["ood"][0].shape == (2 * len(x), 1, 8, 8)
    # shuffled pixels keep each image's pixel values
    n = len(x)
    torch.testing.assert_close(a["ood"][0][:n].reshape(n, -1).sort(1).values,
                               x.reshape(n, -1).sort(1).values)


def test_one_score_agrees_with_class_scores() -> None:
    from attnuq_bench.suites._classify import class_scores, one_score

    rng = np.random.default_rng(3)
    for C in (2, 4):
        p = rng.dirichlet(np.ones(C), size=60)
        y = rng.integers(0, C, 60)
        full = class_scores(p, y)
        for key in ("nll", "brier", "ece", "aurc", "auroc_error"):
            assert one_score(p, y, key) == pytest.approx(full[key], rel=1e-12, abs=1e-15), key
    with pytest.raises(ValueError, match="key must be"):
        one_score(p, y, "auroc")


def test_paired_bootstrap_se_of_identical_methods_is_zero_and_shrinks_with_n() -> None:
    from attnuq_bench.suites._classify import paired_bootstrap_se

    rng = np.random.default_rng(5)
    a = rng.normal(size=1600)
    assert paired_bootstrap_se([(1600, lambda i: float(a[i].mean() - a[i].mean()))]) == 0.0
    # a mean of n unit normals has SE 1/sqrt(n): quadrupling n halves it (200 replicates give
    # the SE to ~5 %, so the ratio's band of +-25 % is > 3 sigma on each side)
    se_small = paired_bootstrap_se([(400, lambda i: float(a[:400][i].mean()))])
    se_large = paired_bootstrap_se([(1600, lambda i: float(a[i].mean()))])
    assert 1.5 < se_small / se_large < 2.5
    with pytest.raises(ValueError, match="diffs"):
        paired_bootstrap_se([])


def test_digits_shift_moves_each_image_by_its_own_offset_within_the_range() -> None:
    from attnuq_bench.suites.digits import shifted

    x = torch.zeros(200, 1, 8, 8)
    x[:, 0, 3, 4] = 1.0  # one lit pixel, two steps from every border
    y = shifted(x, 2, torch.Generator().manual_seed(0))
    assert y.shape == x.shape and torch.equal(y.sum((1, 2, 3)), x.sum((1, 2, 3)))
    pos = y[:, 0].flatten(1).argmax(1)
    dy, dx = pos // 8 - 3, pos % 8 - 4
    assert dy.abs().max() <= 2 and dx.abs().max() <= 2
    # 200 images over 25 offsets: each offset is hit (P(one of 25 missed) < 25 (24/25)^200 < 1e-2
    # for a fair draw; the seed is fixed, so the test's outcome is too)
    assert len(set(zip(dy.tolist(), dx.tolist(), strict=True))) == 25
    assert torch.equal(y, shifted(x, 2, torch.Generator().manual_seed(0)))  # seeded
    assert shifted(x, 0, torch.Generator()) is x
    with pytest.raises(ValueError, match="shift must be"):
        shifted(x, -1, torch.Generator())


def test_noise_note_tells_identical_from_beyond_noise() -> None:
    from attnuq_bench.suites._classify import noise_note

    rng = np.random.default_rng(7)
    n = 400
    y = rng.integers(0, 2, n)
    good = np.where(y[:, None] == np.arange(2), 0.9, 0.1)  # right and confident
    bad = np.full((n, 2), 0.5)
    cal = {"cal_probs": good[:100], "cal_y": y[:100]}

    def rec(p: np.ndarray, seed: int = 0) -> dict[str, object]:
        return {"seed": seed, "_pred": {"test_probs": p, "test_y": y, **cal}}

    by = {"a": [rec(good)], "b": [rec(good)], "c": [rec(bad)]}
    assert "identical on every resample" in noise_note(by, "a", "b", "nll", "test_probs", "x")
    far = noise_note(by, "a", "c", "nll", "test_probs", "test rows")
    assert "beyond noise" in far and "over the 400 test rows" in far
    assert float(far.split("difference ")[1].split(",")[0]) < -0.5  # NLL 0.105 vs 0.693
    assert noise_note(by, "a", "missing", "nll", "test_probs", "x") == ""


def test_mortality_fit_why_reads_the_fits_validation_diagnostics() -> None:
    from attnuq_bench.suites.mortality import _fit_why

    def rec(nu: int, sa: float, ts: float, edge: str | None) -> dict[str, object]:
        return {"info": {"nu": nu, "nu_at_edge": edge, "val_mean_mutual_information": 0.002,
                         "val": {"sa": {"ece": sa}, "temperature_scaling": {"ece": ts}}}}

    line = _fit_why([rec(1, 0.04, 0.03, "lower"), rec(8, 0.02, 0.01, None)], "ece", "ECE")
    assert "SA's ECE was 0.0300 against temperature scaling's 0.0200" in line
    assert "validation already showed no gain" in line and "nu = [1, 8] (1 of 2 at an edge" in line
    assert "0.0020 nats" in line
    lower = _fit_why([rec(4, 0.01, 0.03, None)], "ece", "ECE")
    assert "validation did not foresee the test miss" in lower
    # records without the fit's diagnostics (the Levy rows) give no reason rather than a wrong one
    assert _fit_why([{"info": {}}], "ece", "ECE") == ""
    assert _fit_why([], "ece", "ECE") == ""


def test_mortality_sigma_lines_explain_sigma_by_the_observation_counts() -> None:
    """The levy-sigma lines state the observation-count correlations per seed and read a
    mechanism off them only when every seed has the same signs; none without them."""
    from attnuq_bench.suites.mortality import _sigma_lines

    def rec(seed: int, sn: float | None, ne: float | None) -> dict[str, object]:
        return {"seed": seed, "info": {
            "sigma_scale": 1.0, "nll_by_scale": {"0": 0.34, "1": 0.33},
            "spearman_sigma_error_val": -0.3, "error_auroc_sigma_val": 0.42,
            "error_auroc_max_p_val": 0.83, "spearman_sigma_nobs_val": sn,
            "spearman_nobs_error_val": ne}}

    lines = _sigma_lines({"levy-sigma": [rec(1, -0.8, 0.25), rec(0, -0.7, 0.3)]})
    why = [x for x in lines if x.startswith("* why")]
    assert why == ["* why, on the validation stays: Spearman(sigma, number of observations) per "
                   "seed -0.700, -0.800, Spearman(number of observations, |y - p|) per seed "
                   "0.300, 0.250: the stays with more observations have the smaller sigma on "
                   "every seed and the larger errors on every seed: sigma measures how much of "
                   "the series was observed (the Poisson evidence), and on these stays that "
                   "runs against how hard the stay is to predict"]
    mixed = _sigma_lines({"levy-sigma": [rec(0, -0.8, 0.25), rec(1, -0.7, -0.1)]})
    assert next(x for x in mixed if x.startswith("* why")).endswith("no consistent sign on "
                                                                    "every seed")
    older = _sigma_lines({"levy-sigma": [rec(0, None, None)]})
    assert not any(x.startswith("* why") for x in older) and older


def test_lac_size_at_coverage_agrees_with_a_threshold_sweep() -> None:
    from attnuq_bench.suites._classify import lac_size_at_coverage

    rng = np.random.default_rng(3)
    for n, c in ((37, 4), (200, 10), (5, 2)):
        probs = rng.dirichlet(np.ones(c), size=n)
        y = rng.integers(0, c, n)
        for cov in (0.1, 0.5, 0.9, 0.95, 1.0):
            # every candidate threshold, the smallest whose sets cover >= cov of the rows
            best = None
            for q in np.sort(np.unique(1 - probs)):
                sets = (1 - probs) <= q
                if sets[np.arange(n), y].mean() >= cov - 1e-12:
                    best = sets.sum(1).mean()
                    break
            assert best is not None
            assert lac_size_at_coverage(probs, y, cov) == pytest.approx(best)
    with pytest.raises(ValueError, match="coverage"):
        lac_size_at_coverage(probs, y, 0.0)
    with pytest.raises(ValueError, match="shapes"):
        lac_size_at_coverage(probs[:, 0], y, 0.5)


def test_equal_coverage_note_of_a_method_against_itself_and_a_sharper_one() -> None:
    from attnuq_bench.suites._classify import equal_coverage_note

    rng = np.random.default_rng(0)
    n = 400
    y = rng.integers(0, 3, n)
    logits = rng.normal(size=(n, 3))
    logits[np.arange(n), y] += 1.5

    def rec(t: float) -> dict[str, object]:
        p = np.exp(logits / t) / np.exp(logits / t).sum(1, keepdims=True)
        return {"seed": 0, "_pred": {"test_probs": p, "test_y": y}}

    by = {"a": [rec(1.0)], "b": [rec(1.0)], "flat": [rec(4.0)]}
    same = equal_coverage_note(by, "a", "b", 0.9, "test_probs", "rows")
    assert same is not None and same[0] == same[1] and "identical on every resample" in same[2]
    # a temperature keeps the ranking within a row but not across rows: sizes differ, and the
    # note reports a difference with its SE
    other = equal_coverage_note(by, "flat", "a", 0.9, "test_probs", "rows")
    assert other is not None and other[0] != other[1] and "paired bootstrap SE" in other[2]
    assert equal_coverage_note(by, "a", "missing", 0.9, "test_probs", "rows") is None


def test_mortality_auroc_noise_is_the_test_sets_bootstrap_se() -> None:
    from attnuq_bench.suites.mortality import GOAL_AUROC, _auroc_noise

    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 600)
    perfect = np.stack([1.0 - y, y.astype(float)], 1)
    rec = {"_pred": {"test_probs": perfect, "test_y": y}}
    # a perfect ranking on every resample: no noise, so the goal is beyond 2 SE
    assert _auroc_noise([rec], 1.0) == (f"; bootstrap SE 0.000 over the 600 test stays: "
                                       f"{GOAL_AUROC} lies beyond 2 SE of it")
    # an uninformative score: the SE of an AUROC of 0.5 with n+ ~ n- ~ 300 is
    # sqrt((n+ + n- + 1) / (12 n+ n-)) ~ 0.024 (Hanley & McNeil 1982); 200 replicates estimate
    # it to ~5 %, so (0.015, 0.035) fails with negligible probability (seeded: the outcome is
    # fixed)
    noise = np.stack([1 - (q := rng.random(600)), q], 1)
    line = _auroc_noise([{"_pred": {"test_probs": noise, "test_y": y}}], 0.5)
    se = float(line.split("SE ")[1].split(" ")[0])
    assert 0.015 < se < 0.035 and "beyond 2 SE" in line
    assert _auroc_noise([], 0.8) == ""


@pytest.mark.parametrize("bad", [["60"], ["36", "36"], ["-1", "48"]])
def test_mortality_refuses_bad_levy_query_times_before_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: list[str]) -> None:
    from attnuq.cli import main

    out = tmp_path / "m"
    assert main(["bench", "mortality", "--out", str(out), "--data-dir", str(tmp_path),
                 "--levy-query-times", *bad]) == 2
    err = capsys.readouterr().err
    assert "--levy-query-times must be distinct hours in [0, 48], got " + " ".join(
        f"{float(b):g}" for b in bad) in err and "Traceback" not in err
    assert not out.exists()
