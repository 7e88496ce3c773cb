"""``attnuq bench era5`` end to end on a tiny synthetic NetCDF field, and its field scores."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

xr = pytest.importorskip("xarray")
pytest.importorskip("scipy")
pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from attnuq.predictive import GaussianPredictive, Predictive  # noqa: E402
from attnuq_bench.suites.era5 import field_scores  # noqa: E402


def _member_file(res_dir: Path, name: str) -> Path:
    """The one cached member file ``name`` under ``res_dir/members/<recipe key>/``."""
    (path,) = (res_dir / "members").glob(f"*/{name}")
    return path


def test_field_scores_match_metrics() -> None:
    from attnuq import metrics

    g = torch.Generator().manual_seed(0)
    y = torch.randn(7, 2, 4, 5, generator=g, dtype=torch.float64)
    s = y + torch.randn(16, 7, 2, 4, 5, generator=g, dtype=torch.float64)
    clim = torch.zeros_like(y) + 0.1
    lat = torch.tensor([60.0, 50.0, 40.0, 30.0], dtype=torch.float64)
    sc = field_scores(Predictive(samples=s), y, lat=lat, clim=clim, leads=(6, 24))
    m = s.mean(0)
    for i, key in enumerate(("+6h", "+24h")):
        assert sc[key]["rmse_lat"] == pytest.approx(
            float(metrics.lat_weighted_rmse(m[:, i], y[:, i], lat)))
        assert sc[key]["acc"] == pytest.approx(
            float(metrics.lat_weighted_acc(m[:, i], y[:, i], clim[:, i], lat)))
        assert sc[key]["crps"] == pytest.approx(float(metrics.crps_samples(s[:, :, i], y[:, i])))
    # a Gaussian whose spread is 3x too small: the scaled W1 removes the global factor
    yy = torch.randn(4000, 1, 2, 2, generator=g, dtype=torch.float64)
    gp = GaussianPredictive(mean=torch.zeros_like(yy), std=torch.full_like(yy, 1 / 3))
    r = field_scores(gp, yy, lat=torch.tensor([10.0, 20.0], dtype=torch.float64),
                     clim=torch.zeros_like(yy) + 0.5, leads=(6,))["+6h"]
    # PIT of 16000 exact-N(0,1) draws: W1 of the empirical PIT has sd ~ 0.003; 0.02 is > 5 sd
    assert r["pit_w1_scaled"] < 0.02 < r["pit_w1"]
    with pytest.raises(ValueError, match="clim must have"):
        field_scores(gp, yy, lat=torch.tensor([10.0, 20.0]), clim=clim, leads=(6,))


def _tiny_nc(path: Path, days: int = 10) -> Path:
    n = 24 * days
    t = np.arange("2019-03-01", n, dtype="datetime64[h]").astype("datetime64[ns]")
    lat, lon = np.linspace(58, 50, 6), np.linspace(-10, 2, 8)
    rng = np.random.default_rng(0)
    hour = np.arange(n) % 24
    # degC-like magnitudes: a 1-epoch tiny model's SA spread is far below float32's resolution
    # at ~280 K (ulp 3e-5), which would leave some elements with exactly zero spread
    v = (5 + 3 * np.sin(2 * np.pi * hour / 24)[:, None, None]
         + 0.5 * lat[None, :, None] / 58 + 0.3 * rng.normal(size=(n, 6, 8)))
    xr.Dataset({"t2m": (("time", "latitude", "longitude"), v)},
               coords={"time": t, "latitude": lat, "longitude": lon}).to_netcdf(
        path, engine="scipy")
    return path


def test_bench_era5_end_to_end(tmp_path: Path) -> None:
    from attnuq import metrics
    from attnuq.cli import main
    from attnuq_bench.data.era5 import day_blocks, load_field, make_examples

    nc = _tiny_nc(tmp_path / "tiny.nc")
    out = tmp_path / "res"
    argv = ["bench", "era5", "--file", str(nc), "--out", str(out), "--split", "4,2,2,-1",
            "--patch", "2", "--hidden", "8", "--layers", "1", "--heads", "2", "--mlp", "8",
            "--epochs", "1", "--ensemble", "2", "--n-samples", "3", "--n-passes", "2",
            "--nu-max", "16", "--no-progress",
            # the rows of the committed page (the default is every row: the contract case)
            "--methods", "sa-paper,sa-crps,sa-conformal,mc-dropout,ensemble,persistence,"
                         "climatology"]
    assert main(argv) == 0
    js = json.loads((out / "era5" / "era5_results.json").read_text())
    assert js["complete"] is True
    res = js["results"]
    for name in ("sa-paper", "sa-crps", "sa-conformal", "mc-dropout", "ensemble",
                 "persistence", "climatology"):
        for lead in ("+6h", "+24h"):
            r = res[name]["per_lead"][lead]
            for k in ("rmse_lat", "pit_w1", "width", "coverage", "crps"):
                assert np.isfinite(r[k]), (name, lead, k)
    # the persistence row is the one computed directly from the loader
    f = load_field(nc)
    b = day_blocks(f.times, [("train", 4), ("val", 2), ("cal", 2), ("test", -1)])
    ex = make_examples(f, b["test"], history=6, leads=(6, 24))
    lat = torch.from_numpy(np.array(f.lat))
    want = float(metrics.lat_weighted_rmse(ex.inputs[:, 0].double(), ex.targets[:, 1].double(),
                                           lat))
    assert res["persistence-point"]["per_lead"]["+24h"]["rmse_lat"] == pytest.approx(want)
    md = (out / "era5.md").read_text()
    assert "attnuq bench era5" in md and "## Lead +24h" in md and "| sa-paper |" in md
    assert (out / "era5" / "era5_maps.png").stat().st_size > 1000


def _tiny_argv(nc: Path, out: Path) -> list[str]:
    return ["bench", "era5", "--file", str(nc), "--out", str(out), "--split", "4,2,2,-1",
            "--patch", "2", "--hidden", "8", "--layers", "1", "--heads", "2", "--mlp", "8",
            "--epochs", "2", "--ensemble", "3", "--n-samples", "3", "--n-passes", "2",
            "--nu-max", "16", "--no-progress", "--device", "cpu", "--seed", "3"]


def test_bench_era5_member_jobs_match_serial_training(tmp_path: Path) -> None:
    """Members trained in 2 spawned workers are bit-identical to the serial ones (1 thread)."""
    from attnuq.cli import main

    nc = _tiny_nc(tmp_path / "tiny.nc", days=10)
    serial, par = tmp_path / "serial", tmp_path / "par"
    assert main([*_tiny_argv(nc, serial), "--methods", "ensemble,persistence"]) == 0
    assert main([*_tiny_argv(nc, par), "--methods", "ensemble", "--member-jobs", "2"]) == 0
    for k in (1, 2):
        a = torch.load(_member_file(serial / "era5", f"member{k}.pt"), weights_only=True)
        b = torch.load(_member_file(par / "era5", f"member{k}.pt"), weights_only=True)
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), (k, name)
    # members differ from each other and from the backbone (seeds 3 + k)
    m1 = torch.load(_member_file(serial / "era5", "member1.pt"), weights_only=True)
    m2 = torch.load(_member_file(serial / "era5", "member2.pt"), weights_only=True)
    assert not torch.equal(m1["head.weight"], m2["head.weight"])
    js_s = json.loads((serial / "era5" / "era5_results.json").read_text())
    js_p = json.loads((par / "era5" / "era5_results.json").read_text())
    assert js_s["results"]["ensemble"]["per_lead"] == js_p["results"]["ensemble"]["per_lead"]
    assert js_p["results"]["ensemble"]["member_jobs"] == 2
    assert js_s["results"]["ensemble"]["member_seeds"] == [3, 4, 5]
    assert "in 2 parallel worker processes" in (par / "era5.md").read_text()

    # --resume --rerun ensemble: persistence kept and credited to the first invocation,
    # the ensemble scored again here (its members come from the cache: same numbers)
    assert main([*_tiny_argv(nc, serial), "--resume", "--rerun", "ensemble", "--methods",
                 "ensemble,persistence"]) == 0
    js = json.loads((serial / "era5" / "era5_results.json").read_text())
    runs = js["run"]["resumed_runs"]
    assert [r["methods"] for r in runs] == [["persistence"]]
    assert runs[0]["date"] == js_s["run"]["date"]
    assert js["results"]["persistence"] == js_s["results"]["persistence"]
    assert js["results"]["ensemble"]["per_lead"] == js_s["results"]["ensemble"]["per_lead"]
    assert js_s["results"]["ensemble"]["members_trained_here"] == [1, 2]
    assert js["results"]["ensemble"]["members_from_cache"] == [1, 2]
    assert "members 1, 2 loaded from the member cache" in (serial / "era5.md").read_text()
    # a second resume keeps crediting the first invocation, not the resuming one
    assert main([*_tiny_argv(nc, serial), "--resume", "--methods", "persistence"]) == 0
    js2 = json.loads((serial / "era5" / "era5_results.json").read_text())
    assert [(r["methods"], r["date"]) for r in js2["run"]["resumed_runs"]] == [
        (["ensemble"], js["run"]["date"]), (["persistence"], runs[0]["date"])]
    assert main([*_tiny_argv(nc, serial), "--member-jobs", "0", "--methods", "persistence"]) == 2
    # every later run reused the backbone of the first (its recipe.json equals the recipe)
    assert js2["backbone"]["train"]["reused"] is True
    assert not list((serial / "era5").glob("backbone-*"))


RESULTS = Path(__file__).resolve().parents[3] / "docs" / "results"


def test_committed_page_regenerates_from_its_json() -> None:
    """era5.md is exactly what render_page makes of the stored era5_results.json (#18)."""
    from attnuq_bench.suites import era5

    page = era5.render_page(RESULTS / "era5", RESULTS / "era5.md")
    assert page.markdown() == (RESULTS / "era5.md").read_text()
    assert page.to_dict() == json.loads((RESULTS / "era5.json").read_text())


def test_render_only_writes_page_twin_and_summary(tmp_path: Path) -> None:
    """--render-only needs nothing but the stored JSON; the summary key follows issue #19."""
    import shutil

    from attnuq.cli import main
    from attnuq_bench.suites import era5

    (tmp_path / "era5").mkdir()
    shutil.copy(RESULTS / "era5" / "era5_results.json", tmp_path / "era5")
    for suite in ("uci", "ett"):  # the page's section on what the evidence tells a user (#34)
        (tmp_path / suite).symlink_to(RESULTS / suite)  # reads every regression suite
    (tmp_path / "summary.json").write_text(json.dumps({"uci": {"kept": 1}}))
    assert main(["bench", "era5", "--out", str(tmp_path), "--render-only"]) == 0
    assert (tmp_path / "era5.md").read_text() == (RESULTS / "era5.md").read_text()
    twin = json.loads((tmp_path / "era5.json").read_text())
    assert twin["headline"][0].startswith("Lead +6h: Best CRPS: **")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["uci"] == {"kept": 1} and sorted(summary["era5"]) == ["t2m+24h", "t2m+6h"]
    res = json.loads((RESULTS / "era5" / "era5_results.json").read_text())["results"]
    for lead in ("+6h", "+24h"):
        e = summary["era5"][f"t2m{lead}"]
        refs = {k.removesuffix("-point"): res[k]["per_lead"][lead]["rmse_lat"]
                for k in era5._NAIVE if k in res}
        assert len(refs) >= 2  # persistence and climatology at least
        best = min(refs, key=lambda k: refs[k])
        assert e["backbone"] == {"metric": "rmse", "reference_name": best,
                                 "value": res["frozen"]["per_lead"][lead]["rmse_lat"],
                                 "reference": refs[best]}
        assert e["splits"] == 1 and e["methods"]["sa-paper"]["crps"] == (
            res["sa-paper"]["per_lead"][lead]["crps"])
    assert main(["bench", "era5", "--out", str(tmp_path / "empty"), "--render-only"]) == 2
    with pytest.raises(ValueError, match="no ERA5 results"):
        era5.render_page(tmp_path / "empty" / "era5", tmp_path / "empty" / "era5.md")


def test_committed_run_records_hold_the_committed_results() -> None:
    """docs/results/era5/runs is what --resume keeps: each
    record is its method's stored result under the committed config's reuse key, with its maps."""
    from attnuq._io import decode_nonfinite
    from attnuq_bench.suites import era5
    from attnuq_bench.suites._fields import load_maps
    from attnuq_bench.suites._runner import RunStore, reuse_key

    # the results file spells a non-finite number as the run record does once read back
    p = decode_nonfinite(json.loads((RESULTS / "era5" / "era5_results.json").read_text()))
    store = RunStore(RESULTS / "era5" / "runs", suite="era5")
    key = reuse_key(p["config"], free=era5._RESUME_FREE)
    scored = [m for m in era5.ALL_METHODS if m in p["results"]]
    with np.load(RESULTS / "era5" / "era5_maps.npz") as z:
        for m in scored:
            rec = store.load((), m, key)
            assert rec is not None, m
            assert {k: v for k, v in rec.items() if k not in (
                "method", "reuse", "run_info", "implementation", "wall_seconds",
                "data_digest")} == p["results"][m]
            assert len(rec["data_digest"]) == 16  # stamped: the data it was computed on
            assert [rec["implementation"]] == [t for r, t in p["implementations"]["rows"]
                                               if r == m]
            maps = load_maps(store.path((), m).with_suffix(".npz"))
            assert maps is not None and all(np.array_equal(maps[k], z[f"{m}__{k}"])
                                            for k in ("error", "spread"))
    kept = era5._earlier([store.load((), m, key) for m in scored])
    # the page's last invocation re-ran nothing: every record is credited to an earlier one
    assert [(c["methods"], c["date"]) for c in kept] == [
        (c["methods"], c["date"]) for c in p["run"]["resumed_runs"]]
