"""Issue #34: what the regression evidence tells a user of ``sa`` (``attnuq bench evidence``).

Small synthetic record folders in the suites' layouts (UCI run records, ETTh1 / ERA5 results):
the aggregation over splits, missing records shown as missing, records on another backbone not
compared, ``beta = inf``, ties, the rule's bookkeeping per fit and per set, the page, its
``--render-only`` path and the README block.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from attnuq.cli import main
from attnuq_bench.suites import _sa_evidence as ev
from attnuq_bench.suites._page import Page

ROOT = Path(__file__).resolve().parents[3]

BACKBONE = {"cache_key": "k", "best_epoch": 3, "best_val_rmse_std_units": 0.25}


def _uci(root: Path, ds: str, split: int, method: str, crps: float, *,
         info: dict[str, Any] | None = None, backbone: dict[str, Any] | None = None,
         n_val: int = 400, digest: str | None = "d") -> None:
    d = root / "uci" / "runs" / ds / f"split{split}"
    d.mkdir(parents=True, exist_ok=True)
    rec = {"dataset": ds, "split": split, "method": method, "metrics": {"crps": crps},
           "info": info or {}, "sizes": {"val": n_val}, "backbone": backbone or BACKBONE,
           "data_digest": digest}
    # json.dumps writes inf as Infinity, as the suites' records do
    (d / f"{method}.json").write_text(json.dumps(rec))


def _sa_info(rho: float | None, form: str | None, beta: float | str, nu: int = 8,
             edge: str = "no") -> dict[str, Any]:
    return {"nu": nu, "nu_at_edge": edge, "form": form, "floor_beta_units": beta,
            "spearman_spread_abs_error": rho}


def _records(root: Path) -> None:
    """Two UCI sets, ETTh1 and ERA5 (two leads) with known outcomes.

    set ``a`` (3 splits): split 0 sa 1.0 / conformal 1.2 / laplace 0.9 (rule yes, right);
    split 1 sa 1.0 / conformal 0.9 (rule yes, wrong); split 2: conformal missing, laplace on
    another backbone. Set ``b`` (2 splits): beta = inf (form conformal), sa ties conformal.
    """
    _uci(root, "a", 0, "sa", 1.0, info=_sa_info(0.5, "sa-floor", 0.5))
    _uci(root, "a", 0, "conformal", 1.2)
    _uci(root, "a", 0, "laplace", 0.9)
    _uci(root, "a", 1, "sa", 1.0, info=_sa_info(0.4, "sa-normalised", 0.0))
    _uci(root, "a", 1, "conformal", 0.9)
    _uci(root, "a", 1, "laplace", 0.95)
    _uci(root, "a", 2, "sa", 1.3, info=_sa_info(0.05, "sa-floor", 1.0))
    _uci(root, "a", 2, "laplace", 0.5, backbone={**BACKBONE, "best_val_rmse_std_units": 0.3})
    _uci(root, "a", 2, "ensemble", 0.1)  # retrains the backbone: never a comparison
    _uci(root, "a", 2, "gaussian", 0.2, digest="other")  # other data: not compared
    _uci(root, "a", 2, "swag", 0.2, digest=None)  # no digest: the backbone decides
    _uci(root, "c", 0, "conformal", 3.0)  # a set without sa: a row with sa missing
    for k in (0, 1):
        _uci(root, "b", k, "sa", 2.0, info=_sa_info(0.3, "conformal", math.inf, edge="lower"))
        _uci(root, "b", k, "conformal", 2.0)
        _uci(root, "b", k, "gaussian", 2.0)
    (root / "ett").mkdir(parents=True)
    (root / "ett" / "ett_results.json").write_text(json.dumps({"results": {
        "sa": {"crps": 0.30, "nu": 1, "nu_at_edge": "lower", "form": "sa-floor",
               "floor_beta_units": 0.25, "spearman_spread_abs_error": 0.05},
        "conformal": {"crps": 0.35}, "seasonal-naive": {"crps": 0.34},
        "ensemble": {"crps": 0.2}}}))
    (root / "era5").mkdir(parents=True)
    lead = {"+6h": {"crps": 0.8}, "+24h": {"crps": 0.9}}
    (root / "era5" / "era5_results.json").write_text(json.dumps({
        "data": {"examples": {"val": 72}, "variable": "t2m"},
        "results": {"sa": {"per_lead": lead, "nu": 1, "form": "sa-floor",
                           "floor_beta_units": "inf", "spearman_spread_abs_error": None},
                    "conformal": {"per_lead": {"+6h": {"crps": 0.7}, "+24h": {"crps": 0.95}}},
                    "persistence": {"per_lead": {"+6h": {"crps": 1.4}}}}}))


def test_threshold_and_rule_on_the_diagnostics() -> None:
    assert ev.spearman_threshold(None) == ev.SPEARMAN_FLOOR == ev.spearman_threshold(2)
    assert ev.spearman_threshold(101) == pytest.approx(1.959963984540054 / 10)
    assert ev.spearman_threshold(10**6) == 0.1
    assert ev.rule_predicts({"spearman": 0.2, "form": "sa-floor", "n_val": 101}) is True
    assert ev.rule_predicts({"spearman": 0.19, "form": "sa-floor", "n_val": 101}) is False
    assert ev.rule_predicts({"spearman": 0.9, "form": "conformal", "n_val": None}) is False
    assert ev.rule_predicts({"spearman": 0.9, "form": None}) is None
    assert ev.rule_predicts({"spearman": 0.9, "form": "gaussian", "n_val": 101}) is False
    with pytest.raises(ValueError, match=r"diag\['form'\].*'laplace'"):
        ev.rule_predicts({"spearman": 0.9, "form": "laplace"})
    with pytest.raises(TypeError, match="n_val"):
        ev.spearman_threshold(3.5)  # type: ignore[arg-type]


def test_units_keep_one_backbone_and_show_missing_records(tmp_path: Path) -> None:
    _records(tmp_path)
    units = ev.collect(tmp_path)
    assert [(u.suite, u.label) for u in units] == [
        ("uci", "a split 0"), ("uci", "a split 1"), ("uci", "a split 2"), ("uci", "b split 0"),
        ("uci", "b split 1"), ("uci", "c split 0"), ("ett", "ETTh1"), ("era5", "t2m +6h"),
        ("era5", "t2m +24h")]
    a2 = units[2]
    assert a2.crps == {"sa": 1.3, "swag": 0.2} and a2.other_backbone == ["gaussian", "laplace"]
    assert a2.beats_conformal is None  # conformal missing: not filled
    assert units[3].diag["beta_units"] == math.inf and units[3].diag["n_val"] == 400
    assert units[5].crps == {"conformal": 3.0} and units[5].diag == {}
    assert units[7].diag["beta_units"] == math.inf and units[7].diag["n_val"] == 72
    assert units[6].diag["n_val"] is None and "ensemble" not in units[6].crps
    assert units[8].crps == {"sa": 0.9, "conformal": 0.95}  # persistence lacks +24h


def test_set_rows_average_over_splits_with_ties_and_incomplete_baselines(tmp_path: Path
                                                                         ) -> None:
    _records(tmp_path)
    rows = {(r.suite, r.dataset): r for r in ev.evidence(ev.collect(tmp_path))["rows"]}
    a = rows[("uci", "a")]
    assert a.sa == pytest.approx((1.1, math.sqrt(0.03)))
    # conformal and laplace lack split 2 (missing / other backbone): not compared
    assert a.best is None and a.gap is None and a.sa_best is None
    assert a.incomplete == {"conformal": 2, "laplace": 2, "swag": 1}
    assert a.beats is True  # over the splits both have (0, 1): sa 2.0 against conformal 2.1
    b = rows[("uci", "b")]
    # a three-way tie: conformal first in NO_RETRAIN wins it, sa tied counts as best
    assert b.best == "conformal" and b.gap == 0.0 and b.sa_best is True and b.beats is False
    assert b.betas == [math.inf, math.inf] and b.edges == ["lower", "lower"]
    ett = rows[("ett", "ETTh1")]
    assert ett.best == "seasonal-naive" and ett.gap == pytest.approx(0.30 / 0.34 - 1)
    p6 = rows[("era5", "t2m +6h")]
    assert p6.best == "conformal" and p6.gap == pytest.approx(0.8 / 0.7 - 1)
    cells = ev.row_cells(b)
    assert cells[ev.COLUMNS.index("floor beta (units)")] == "inf, inf"
    assert cells[ev.COLUMNS.index("form")] == "conformal x2"
    assert ev.row_values(b)["beta_units"] == ["inf", "inf"]  # strict JSON
    json.dumps(ev.row_values(b), allow_nan=False)
    assert ev.row_cells(a)[ev.COLUMNS.index("its CRPS")] == "missing"


def test_the_rule_is_scored_per_fit_and_per_set(tmp_path: Path) -> None:
    _records(tmp_path)
    e = ev.evidence(ev.collect(tmp_path))
    # fits: a0 yes/yes right; a1 yes/no wrong; a2 no/unknown; b0, b1 no/no (tie) right;
    # ETTh1 rho 0.05 -> no, sa beat conformal -> wrong; ERA5: Spearman missing, unscored; c:
    # no sa, unscored
    assert e["rule_by_split"] == {"right": 3, "scored": 5, "unscored": 4, "beats": 2,
                                  "predicted_beats": 2}
    # sets: a: majority of (yes, yes, no) = yes, outcome yes (splits 0-1): right; b: no/no
    # right; ETTh1 wrong; ERA5 leads and c unscored
    assert e["rule_by_set"] == {"right": 2, "scored": 3, "unscored": 3, "beats": 2,
                                "predicted_beats": 1}
    # compared: b (0 %), ETTh1 (-11.8 %), +6h (+14.3 %), +24h (-5.3 %); a has no complete
    # baseline
    g = e["goal"]
    assert (g["sets"], g["compared"], g["within"], g["best"], g["met"]) == (6, 4, 3, 3, False)
    c = next(r for r in e["rows"] if r.dataset == "c")
    assert c.sa is None and c.best is None
    assert "* uci c: no `sa` record." in ev.missing_lines(e)
    assert g["worst"] == pytest.approx(0.8 / 0.7 - 1)
    lines = ev.rule_lines(e)
    assert any("right 3 of 5" in x for x in lines) and any("right 2 of 3" in x for x in lines)
    # 3 of 5 right against a base rate of 3 of 5 (sa lost 3 times): said plainly
    assert any("no better than always answering" in x for x in lines)
    assert "not met" in ev.goal_line(e) and "+14.3 %" in ev.goal_line(e)


def test_set_prediction_needs_every_split() -> None:
    u = [ev.Unit("uci", "s", k, {"sa": 1.0, "conformal": 2.0},
                 {"spearman": 0.9, "form": "sa-floor", "n_val": 100}) for k in range(2)]
    assert ev.set_row(u).predicted is True
    u[1].diag = {"spearman": None, "form": "sa-floor", "n_val": 100}
    assert ev.set_row(u).predicted is None
    with pytest.raises(ValueError, match="one \\(suite, set\\)"):
        ev.set_row([u[0], ev.Unit("ett", "ETTh1", None)])


def test_page_section_and_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _records(tmp_path)
    page = Page("uci", "t")
    assert ev.add_section(page, tmp_path, "uci")
    md = page.markdown()
    assert "## What it tells a user" in md and "| a | 3 | 1.1000 ± 0.1732 | missing |" in md
    assert "not compared" in md and "## What it tells a user" in md
    assert not ev.add_section(Page("uci", "t"), tmp_path / "none", "uci")  # no sa: no section
    with pytest.raises(ValueError, match="suite must be"):
        ev.add_section(page, tmp_path, "physionet")

    assert main(["bench", "evidence", "--out", str(tmp_path)]) == 0
    out = tmp_path / "sa_evidence.md"
    twin = json.loads(out.with_suffix(".json").read_text())
    assert twin["suite"] == "evidence" and twin["headline"]
    assert twin["state"]["readme"][0].startswith("**What the evidence tells a user**")
    assert (tmp_path / "sa_evidence" / "gap_vs_spearman.png").stat().st_size > 1000
    text = out.read_text()
    assert "| uci | a split 2 | 1.3000 | missing | missing |" in text
    # the render path writes the same page from the records and the twin alone
    assert main(["bench", "evidence", "--out", str(tmp_path), "--render-only"]) == 0
    assert out.read_text() == text
    capsys.readouterr()
    assert main(["bench", "evidence", "--out", str(tmp_path / "nowhere")]) == 2
    assert "--out" in capsys.readouterr().err


def _script() -> Any:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        spec = importlib.util.spec_from_file_location(
            "_update_readme_results", ROOT / "scripts" / "update_readme_results.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return mod


def test_readme_block_is_the_twins_paragraph(tmp_path: Path) -> None:
    mod = _script()
    text = ("intro\n<!-- results:start -->\nold\n<!-- results:end -->\n\n"
            "<!-- sa-rule:start -->\nstale line\n<!-- sa-rule:end -->\ntail\n")
    out = mod.render(text, results=tmp_path)
    assert "stale line" not in out and "No SA evidence page yet" in out
    (tmp_path / "sa_evidence.json").write_text(json.dumps({"state": {"readme": ["para A."]}}))
    out = mod.render(text, results=tmp_path)
    block = out.split("<!-- sa-rule:start -->\n")[1].split("\n<!-- sa-rule:end -->")[0]
    assert block == "para A." and out.endswith("<!-- sa-rule:end -->\ntail\n")
    assert mod.render(out, results=tmp_path) == out  # idempotent
    (tmp_path / "sa_evidence.json").write_text(json.dumps({"state": {"readme": [3]}}))
    with pytest.raises(SystemExit, match=r"state\.readme"):
        mod.render(text, results=tmp_path)
    (tmp_path / "sa_evidence.json").unlink()
    with pytest.raises(SystemExit, match="sa-rule"):
        mod.render("<!-- results:start -->\n<!-- results:end -->\n", results=tmp_path)


def test_uci_coverage_line_counts_the_splits_with_an_sa_record() -> None:
    """A set counts once ``sa`` has 5 splits; a split with other rows but no ``sa`` does not."""
    from attnuq_bench.data.uci import UCI_DATASETS

    units = [ev.Unit("uci", d, k, {"sa": 1.0}) for d in UCI_DATASETS[:-1] for k in range(5)]
    last = UCI_DATASETS[-1]
    units += [ev.Unit("uci", last, k, {"sa": 1.0}) for k in range(2)]
    units += [ev.Unit("uci", last, 2, {"conformal": 1.0}), ev.Unit("ett", last, None, {"sa": 1.0})]
    line = ev.uci_coverage_line({"units": units})
    assert f": not met: {len(UCI_DATASETS) - 1} of {len(UCI_DATASETS)} sets" in line, line
    assert f"short: {last} (2 of 5 splits)" in line, line
    units += [ev.Unit("uci", last, k, {"sa": 1.0}) for k in range(2, 5)]
    assert ": met: 6 of 6 sets." in ev.uci_coverage_line({"units": units})


def test_centre_rows_compare_sa_centre_with_sa_on_one_backbone(tmp_path: Path) -> None:
    """``sa-centre`` records on two of set ``a``'s splits (one took the draws' mean and was
    better, one kept the frozen output and equals ``sa``), one on another backbone (not
    compared); the section and the README sentence say so, and nothing is added without
    ``sa-centre`` records."""
    _records(tmp_path)
    page = Page("evidence", "E")
    assert ev.centre_section(page, ev.collect(tmp_path)) is False and not page.markdown().count(
        "sa-centre")
    _uci(tmp_path, "a", 0, "sa-centre", 0.8, info={"centre": "mean"})
    _uci(tmp_path, "a", 1, "sa-centre", 1.0, info={"centre": "frozen"})
    _uci(tmp_path, "a", 2, "sa-centre", 0.1, info={"centre": "mean"},
         backbone={**BACKBONE, "best_epoch": 9})
    units = ev.collect(tmp_path)
    assert units[2].other_backbone == ["gaussian", "laplace", "sa-centre"]
    (row,) = ev.centre_rows(units)
    assert (row.dataset, row.n, row.centres, row.mean_better) == ("a", 2, ["mean", "frozen"],
                                                                  [True])
    assert row.sa == (1.0, 0.0) and row.auto[0] == pytest.approx(0.9)
    assert row.gap == pytest.approx(-0.1)
    page = Page("evidence", "E")
    assert ev.centre_section(page, units) is True
    text = page.markdown()
    assert ("| uci | a | 2 | 1.0000 ± 0.0000 | 0.9000 ± 0.1414 | -10.0 % | mean x1, frozen x1 "
            "| 1 of 1 |") in text
    assert ("lower mean CRPS on 1 and the higher on 0 (a -10.0 %); it took the draws' mean on 1 "
            "of 2 splits, and there its test CRPS was below `sa`'s on 1 of 1.") in text
    para = ev.readme_paragraph(ev.evidence(units))[0]
    assert 'SARegressor(recentre="auto")' in para and "(a -10.0 %)" in para


def test_scaled_rows_compare_sa_conformal_with_sa_on_one_backbone(tmp_path: Path) -> None:
    """``sa-conformal`` (the paper's nu with its spread scaled on the calibration part) against
    ``sa``: the section and the README sentence say where the simpler row was lower; a record
    on another backbone is not compared, and nothing is added without the row."""
    _records(tmp_path)
    page = Page("evidence", "E")
    assert ev.scaled_section(page, ev.collect(tmp_path)) is False
    _uci(tmp_path, "a", 0, "sa-conformal", 0.9)
    _uci(tmp_path, "a", 1, "sa-conformal", 1.2)
    _uci(tmp_path, "a", 2, "sa-conformal", 0.1, backbone={**BACKBONE, "best_epoch": 9})
    units = ev.collect(tmp_path)
    (row,) = ev.scaled_rows(units)
    assert row.lower == [True, False] and row.gap == pytest.approx(0.05)
    page = Page("evidence", "E")
    assert ev.scaled_section(page, units) is True
    text = page.markdown()
    assert "| uci | a | 2 | 1.0000 ± 0.0000 | 1.0500 ± 0.2121 | +5.0 % | 1 of 2 |" in text
    assert ("`sa-conformal` has the lower mean CRPS on 0 and the higher on 1 (a +5.0 %); it "
            "was lower on 1 of 2 splits.") in text
    para = ev.readme_paragraph(ev.evidence(units))[0]
    assert "simplest calibrated SA row (`sa-conformal`" in para and "(a +5.0 %)" in para


def test_centre_rows_read_ett_and_era5_results(tmp_path: Path) -> None:
    """ETTh1 and ERA5 keep ``sa-centre``'s CRPS and its chosen centre in their results files;
    ERA5's one fit gives a row per lead with the same centre."""
    _records(tmp_path)
    ett = json.loads((tmp_path / "ett" / "ett_results.json").read_text())
    ett["results"]["sa-centre"] = {"crps": 0.27, "centre": "mean"}
    (tmp_path / "ett" / "ett_results.json").write_text(json.dumps(ett))
    era = json.loads((tmp_path / "era5" / "era5_results.json").read_text())
    era["results"]["sa-centre"] = {"per_lead": {"+6h": {"crps": 0.8}, "+24h": {"crps": 0.99}},
                                   "centre": "frozen"}
    (tmp_path / "era5" / "era5_results.json").write_text(json.dumps(era))
    rows = {(r.suite, r.dataset): r for r in ev.centre_rows(ev.collect(tmp_path))}
    assert set(rows) == {("ett", "ETTh1"), ("era5", "t2m +6h"), ("era5", "t2m +24h")}
    e = rows["ett", "ETTh1"]
    assert e.centres == ["mean"] and e.mean_better == [True] and e.gap == pytest.approx(-0.1)
    assert rows["era5", "t2m +24h"].centres == ["frozen"]
    assert rows["era5", "t2m +24h"].mean_better == [] and rows["era5", "t2m +6h"].gap == 0.0
