"""``attnuq bench ett`` end to end on a tiny synthetic ETT-layout CSV, and its score helpers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from attnuq.predictive import GaussianPredictive, Predictive
from attnuq_bench.data.ett import ETT_CHANNELS
from attnuq_bench.methods import ResidualQuantiles
from attnuq_bench.suites._scoring import StreamScores


def _member_file(res_dir: Path, name: str) -> Path:
    """The one cached member file ``name`` under ``res_dir/members/<recipe key>/``."""
    (path,) = (res_dir / "members").glob(f"*/{name}")
    return path


def test_residual_quantiles_conformal_coverage() -> None:
    """Per-element split conformal: coverage of f +- q_conf is exactly 38/40 = 0.95 here.

    E = 4000 independent elements, each with n = 39 calibration residuals and one test point,
    all N(0, 1): each element is covered with probability ceil(40 * 0.95) / 40 = 0.95. The mean
    over elements has sd sqrt(0.95 * 0.05 / 4000) = 0.00345; |cov - 0.95| < 5 sd fails with
    probability < 1e-6.
    """
    g = torch.Generator().manual_seed(0)
    e = 4000
    rv = torch.randn(200, e, generator=g, dtype=torch.float64)
    rc = torch.randn(39, e, generator=g, dtype=torch.float64)
    y = torch.randn(1, e, generator=g, dtype=torch.float64)
    rq = ResidualQuantiles.fit(rv, conformal_from=rc, level=0.95)
    pred = rq.predictive(torch.zeros(1, e, dtype=torch.float64))
    lo, hi = pred.interval(0.95)
    assert rq.q_conformal is not None
    torch.testing.assert_close(hi[0], rq.q_conformal)
    torch.testing.assert_close(lo[0], -rq.q_conformal)
    cov = float(((y >= lo) & (y <= hi)).double().mean())
    assert abs(cov - 0.95) < 5 * (0.95 * 0.05 / e) ** 0.5, cov
    with pytest.raises(ValueError, match="per-example shape"):
        ResidualQuantiles.fit(rv, conformal_from=rc[:, :3])


def test_stream_scores_match_direct_metrics() -> None:
    from attnuq import metrics

    g = torch.Generator().manual_seed(1)
    s = torch.randn(30, 50, 4, generator=g, dtype=torch.float64)
    y = torch.randn(50, 4, generator=g, dtype=torch.float64)
    sc = StreamScores()
    sc.update(Predictive(samples=s[:, :20]), y[:20])
    sc.update(Predictive(samples=s[:, 20:]), y[20:])
    r = sc.result()
    m = s.mean(0)
    assert r["mse"] == pytest.approx(float(((m - y) ** 2).mean()))
    assert r["mae"] == pytest.approx(float((m - y).abs().mean()))
    assert r["crps"] == pytest.approx(float(metrics.crps_samples(s, y)))
    lo, hi = Predictive(samples=s).interval(0.95)
    assert r["coverage"] == pytest.approx(float(metrics.coverage(lo, hi, y)))
    assert r["width"] == pytest.approx(float((hi - lo).mean()))
    # Gaussian branch: exact PIT, closed-form CRPS
    sg = StreamScores()
    mu, sd = torch.zeros(50, 4, dtype=torch.float64), torch.ones(50, 4, dtype=torch.float64)
    sg.update(GaussianPredictive(mean=mu, std=sd), y)
    assert sg.result()["crps"] == pytest.approx(float(metrics.crps_normal(mu, sd, y)))
    with pytest.raises(ValueError, match="0 targets"):
        StreamScores().result()


def test_committed_page_regenerates_from_its_json() -> None:
    """docs/results/ett.md is byte for byte what ``render`` makes of ett/ett_results.json."""
    from attnuq_bench.suites.ett import render_page

    docs = Path(__file__).resolve().parents[3] / "docs" / "results"
    page = render_page(docs / "ett", docs / "ett.md")
    assert page.markdown() == (docs / "ett.md").read_text()


def test_committed_results_are_run_records() -> None:
    """Each method of the committed ett_results.json is a run record under ett/runs/ETTh1 (so
    ``--resume`` on docs/results reuses it): the same scores and fan quantiles, the reuse key of
    the stored config, and the invocation the page credits it to as provenance."""
    from attnuq_bench.suites.ett import ALL_METHODS, _reuse

    res = Path(__file__).resolve().parents[3] / "docs" / "results" / "ett"
    p = json.loads((res / "ett_results.json").read_text())
    credited = {m: e["command"] for e in p["run"].get("merged_runs", []) for m in e["methods"]}
    stored = [m for m in ALL_METHODS if m in p["results"]]
    assert set(p["config"]["methods"].split(",")) <= set(stored)  # every row asked for
    for m in stored:
        rec = json.loads((res / "runs" / "ETTh1" / f"{m}.json").read_text())
        assert rec["method"] == m and rec["scores"] == p["results"][m], m
        assert rec["fan"] == p["fan_chart"][m] and rec["reuse"] == _reuse(p["config"], m), m
        assert rec["run_info"]["command"] == credited.get(m, p["run"]["command"]), m


def _tiny_csv(path: Path, n: int = 520) -> Path:
    rng = np.random.default_rng(0)
    df = pd.DataFrame({"date": pd.date_range("2021-01-01", periods=n, freq="h")})
    for i, c in enumerate(ETT_CHANNELS):
        df[c] = np.sin(2 * np.pi * np.arange(n) / 24 + i) + 0.3 * rng.normal(size=n)
    df.to_csv(path, index=False)
    return path


def test_bench_ett_end_to_end(tmp_path: Path) -> None:
    from attnuq.cli import main
    from attnuq_bench.data.ett import load_ett, seasonal_naive
    from attnuq_bench.models.patchtst import load_patchtst

    csv = _tiny_csv(tmp_path / "tiny.csv")
    out = tmp_path / "res"
    argv = ["bench", "ett", "--file", str(csv), "--out", str(out), "--context", "48",
            "--horizon", "12", "--d-model", "8", "--layers", "1", "--heads", "2", "--ffn", "8",
            "--patch", "8", "--stride", "8", "--epochs", "1", "--ensemble", "2",
            "--swag-epochs", "1", "--swag-snapshots", "2", "--n-samples", "3", "--n-passes", "2",
            "--chunk", "64", "--val-stride", "1", "--no-progress",
            # the rows of the committed page (the default is every row: the contract case)
            "--methods", "sa-paper,sa-crps,sa-conformal,mc-dropout,ensemble,swag,conformal,"
                         "seasonal-naive"]
    assert main(argv) == 0
    js = json.loads((out / "ett" / "ett_results.json").read_text())
    assert js["complete"] is True
    res = js["results"]
    for name in ("sa-paper", "sa-crps", "sa-conformal", "mc-dropout", "ensemble", "swag",
                 "conformal", "seasonal-naive"):
        r = res[name]
        for k in ("mse", "mae", "coverage", "width", "pit_w1", "crps"):
            assert np.isfinite(r[k]), (name, k)
        assert 0.0 <= r["coverage"] <= 1.0 and 0.0 <= r["pit_w1"] <= 0.5
    assert res["sa-paper"]["nu"] >= 1
    # the numbers in the file are the ones the saved (from_pretrained) model and loader give
    data = load_ett(csv, context=48)
    x, y = data.windows("test", horizon=12)
    f = load_patchtst(out / "ett" / "backbone")
    with torch.no_grad():
        mse = float(((f(x) - y) ** 2).mean())
    assert res["frozen"]["mse"] == pytest.approx(mse, rel=1e-5)
    sn = float(((seasonal_naive(x, 12) - y) ** 2).mean())
    assert res["seasonal-naive-point"]["mse"] == pytest.approx(sn, rel=1e-6)
    md = (out / "ett.md").read_text()
    assert "attnuq bench ett" in md and "machine:" in md and "| sa-conformal |" in md
    # the page is a pure function of the JSON, Implementations block included
    from attnuq_bench.suites.ett import render_page

    assert render_page(out / "ett", out / "ett.md").markdown() == md
    twin = json.loads((out / "ett.json").read_text())
    assert twin["suite"] == "ett" and twin["headline"][0].startswith("Point forecasts:")
    summary = json.loads((out / "summary.json").read_text())["ett"]["tiny"]
    assert summary["backbone"]["value"] == res["frozen"]["mse"]
    assert summary["methods"]["conformal"]["crps"] == res["conformal"]["crps"]
    assert [r[0] for r in js["implementations"]["rows"]] == [
        "sa-paper", "sa-crps", "sa-conformal", "mc-dropout", "ensemble", "swag", "conformal",
        "seasonal-naive"]
    assert (out / "ett" / "ett_fan_ot.png").stat().st_size > 1000
    # resume: nothing left to run, the table is rewritten from the stored results
    assert main([*argv, "--resume", "--methods", "conformal,seasonal-naive",
                 "--note", "a provenance note"]) == 0
    js2 = json.loads((out / "ett" / "ett_results.json").read_text())
    assert js2["results"]["sa-paper"] == res["sa-paper"]
    assert "* a provenance note" in (out / "ett.md").read_text()
    with pytest.raises(ValueError, match="another config"):
        import argparse

        from attnuq_bench.suites import get_suite

        p = argparse.ArgumentParser()
        get_suite("ett").add_arguments(p)
        get_suite("ett").run(p.parse_args([*argv[2:], "--resume", "--horizon", "6"]))
    with pytest.raises(ValueError, match="unknown methods"):
        from attnuq_bench.suites._ett_page import parse_methods

        parse_methods("sa-paper,bogus")


def _tiny_ett_argv(csv: Path, out: Path) -> list[str]:
    return ["bench", "ett", "--file", str(csv), "--out", str(out), "--context", "48",
            "--horizon", "12", "--d-model", "8", "--layers", "1", "--heads", "2", "--ffn", "8",
            "--patch", "8", "--stride", "8", "--epochs", "2", "--ensemble", "3",
            "--n-samples", "3", "--n-passes", "2", "--chunk", "64", "--val-stride", "1",
            "--no-progress", "--device", "cpu", "--seed", "2"]


def test_bench_ett_member_jobs_match_serial_and_rerun(tmp_path: Path) -> None:
    """Members from 2 spawned workers equal the serial ones bit for bit; --rerun with --merge."""
    from attnuq.cli import main

    csv = _tiny_csv(tmp_path / "tiny.csv")
    serial, par = tmp_path / "serial", tmp_path / "par"
    assert main([*_tiny_ett_argv(csv, serial), "--methods", "ensemble,seasonal-naive",
                 "--member-epochs", "1"]) == 0
    assert main([*_tiny_ett_argv(csv, par), "--methods", "ensemble", "--member-epochs", "1",
                 "--member-jobs", "2", "--model-dir", str(serial / "ett" / "backbone")]) == 0
    for k in (1, 2):
        a = torch.load(_member_file(serial / "ett", f"member{k}.pt"), weights_only=True)
        b = torch.load(_member_file(par / "ett", f"member{k}.pt"), weights_only=True)
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), (k, name)
    js_s = json.loads((serial / "ett" / "ett_results.json").read_text())
    js_p = json.loads((par / "ett" / "ett_results.json").read_text())
    for key in ("mse", "crps", "coverage", "pit_w1"):
        assert js_s["results"]["ensemble"][key] == js_p["results"]["ensemble"][key]
    assert js_s["results"]["ensemble"]["member_seeds"] == [2, 3, 4]
    assert js_s["results"]["ensemble"]["members_trained_here"] == [1, 2]
    assert js_p["results"]["ensemble"]["members_from_cache"] == []
    md = (serial / "ett.md").read_text()
    assert "members 1..2 had an epoch cap of 1" in md and "one after the other" in md

    # merging a file written with another member recipe: refused unless the ensemble is rerun
    part = serial / "ett" / "ett_results.json"
    merged = tmp_path / "merged"
    argv = [*_tiny_ett_argv(csv, merged), "--methods", "ensemble,seasonal-naive",
            "--model-dir", str(serial / "ett" / "backbone"), "--merge", str(part)]
    assert main(argv) == 2  # member_epochs differs and the ensemble would be taken over
    assert main([*argv, "--rerun", "ensemble"]) == 0
    js = json.loads((merged / "ett" / "ett_results.json").read_text())
    assert [m["methods"] for m in js["run"]["merged_runs"]] == [["seasonal-naive"]]
    assert js["results"]["seasonal-naive"] == js_s["results"]["seasonal-naive"]
    assert js["results"]["ensemble"]["member_epochs"] == 2
    # retrained here for 2 epochs (patience 2 cannot stop earlier) instead of 1
    fwd = js_s["results"]["ensemble"]["fit_forward"]
    assert js["results"]["ensemble"]["fit_forward"] == 2 * fwd
    assert "had an epoch cap" not in (merged / "ett.md").read_text()


@pytest.mark.slow
def test_bench_ett_torn_results_and_another_budget(tmp_path: Path) -> None:
    """Issue #23: a 0-byte results file made ``--resume`` fail ("Expecting value", no file
    named); another ``--epochs`` reused the saved backbone as if it were the new budget's. The
    stored record of a method is now its own JSON under ``ett/runs``: a torn one is redone.
    """
    from attnuq.cli import main

    csv = _tiny_csv(tmp_path / "tiny.csv")
    out = tmp_path / "res"
    argv = [*_tiny_ett_argv(csv, out), "--methods", "seasonal-naive"]
    assert main(argv) == 0
    results = out / "ett" / "ett_results.json"
    first = json.loads(results.read_text())["backbone"]["train"]
    assert not first["reused"] and first["epochs_run"] == 2
    item = out / "ett" / "runs" / "tiny" / "seasonal-naive.json"
    assert json.loads(item.read_text())["method"] == "seasonal-naive"
    item.write_bytes(b"")
    with pytest.warns(UserWarning, match="corrupt run"):
        assert main([*argv, "--resume"]) == 0
    assert json.loads(item.read_text())["method"] == "seasonal-naive"
    js = json.loads(results.read_text())
    assert "seasonal-naive" in js["results"] and js["backbone"]["train"]["reused"]
    i = argv.index("--epochs")
    assert main([*argv[:i + 1], "1", *argv[i + 2:]]) == 0
    other = json.loads(results.read_text())["backbone"]["train"]
    # patience 2 cannot stop a 1-epoch budget early, nor a 2-epoch one: 1 epoch means retrained
    assert not other["reused"] and other["epochs_run"] == 1
    assert Path(other["model_dir"]).name.startswith("backbone-")
    assert first["model_dir"] == str(out / "ett" / "backbone")


def test_render_only_rewrites_page_twin_and_summary_key(tmp_path: Path) -> None:
    """--render-only needs only the stored JSON; it also refreshes the ``ett`` summary key."""
    import shutil

    from attnuq.cli import main
    from attnuq_bench.suites.ett import summary

    res = Path(__file__).resolve().parents[3] / "docs" / "results"
    (tmp_path / "ett").mkdir()
    shutil.copy(res / "ett" / "ett_results.json", tmp_path / "ett")
    for suite in ("uci", "era5"):  # the page's section on what the evidence tells a user (#34)
        (tmp_path / suite).symlink_to(res / suite)  # reads every regression suite
    (tmp_path / "summary.json").write_text(json.dumps({"uci": {"kept": 1}, "ett": {"old": 1}}))
    assert main(["bench", "ett", "--out", str(tmp_path), "--render-only"]) == 0
    assert (tmp_path / "ett.md").read_text() == (res / "ett.md").read_text()
    got = json.loads((tmp_path / "summary.json").read_text())
    payload = json.loads((res / "ett" / "ett_results.json").read_text())
    assert got["uci"] == {"kept": 1} and got["ett"] == json.loads(json.dumps(summary(payload)))
