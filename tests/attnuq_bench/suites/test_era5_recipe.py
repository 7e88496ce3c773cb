"""The ERA5 suite's recipe options (issue #19): day-ago inputs, leave-one-out climatology, the
blend base chosen on val, weight decay; and that without them the recipe and its keys are the
committed page's."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

xr = pytest.importorskip("xarray")
pytest.importorskip("scipy")
pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from tests.attnuq_bench.suites._synthetic import tiny_era5_nc  # noqa: E402

from attnuq import metrics  # noqa: E402
from attnuq_bench.data.era5 import (  # noqa: E402
    day_blocks,
    hourly_climatology,
    load_field,
    make_examples,
)
from attnuq_bench.suites._era5_recipe import Inputs, naive_weights, select_blend  # noqa: E402


def _nc(path: Path) -> Path:
    return tiny_era5_nc(path, days=13)


def _setup(tmp_path: Path) -> tuple:
    f = load_field(_nc(tmp_path / "f.nc"))
    b = day_blocks(f.times, [("train", 4), ("val", 3), ("cal", 3), ("test", -1)])
    inp = Inputs(clim=hourly_climatology(f, b["train"]), leads=(6, 24), use_clim=True,
                 history=6, day_ago=True, loo=True, values=f.values,
                 counts=np.bincount(f.hours[b["train"]], None, 24))
    return f, b, inp


def test_day_ago_channels_and_loo_climatology(tmp_path: Path) -> None:
    f, b, inp = _setup(tmp_path)
    v = f.values.double()
    ex = make_examples(f, b["train"], leads=(6, 24), extra_lags=inp.extra_lags)
    x = inp(ex.inputs, ex.hours, ex.t_index).double()
    t = ex.t_index
    assert x.shape == (len(ex), 7, 6, 8) and t[0] == b["train"][0] + 24
    assert inp.channels() == ["x(t)", "x(t-6h)", "x(t-24h)", "x(t-18h)", "clim(t+6h)",
                              "clim(t+24h)", "clim(t)"]
    for c, lag in enumerate((0, 6, 24, 18)):  # the fields, read from the loader directly
        assert torch.equal(x[:, c], v[t - lag])
    tr = b["train"]
    for i in (0, len(ex) // 2, len(ex) - 1):  # leave-one-out: the other training days' mean
        for c, s in ((4, t[i] + 6), (5, t[i] + 24), (6, t[i])):
            others = [k for k in tr if f.hours[k] == f.hours[s] and k != s]
            assert len(others) == 3
            # float32 climatology (mean of ~5 K values, ulp 5e-7) rescaled by 4/3: 1e-5
            torch.testing.assert_close(x[i, c], v[others].mean(0), rtol=0, atol=1e-5)
    # val inputs (no t_index): the plain training climatology
    ev = make_examples(f, b["val"], leads=(6, 24), extra_lags=inp.extra_lags)
    xv = inp(ev.inputs, ev.hours)
    assert torch.equal(xv[:, 4], inp.clim[torch.from_numpy((ev.hours + 6) % 24)])
    with pytest.raises(ValueError, match="fields must have 4 channels"):
        inp(ex.inputs[:, :2], ex.hours)
    with pytest.raises(ValueError, match="leads <= 24"):
        Inputs(clim=inp.clim, leads=(6, 48), use_clim=True, day_ago=True)
    with pytest.raises(ValueError, match="loo needs"):
        Inputs(clim=inp.clim, leads=(6,), use_clim=True, loo=True)


def test_naive_weights_are_the_naive_forecasts(tmp_path: Path) -> None:
    f, b, inp = _setup(tmp_path)
    v = f.values.double()
    ex = make_examples(f, b["val"], leads=(6, 24), extra_lags=inp.extra_lags)
    x = inp(ex.inputs, ex.hours).double()
    t, h = ex.t_index, ex.hours
    clim = inp.clim.double()
    for i, ld in enumerate((6, 24)):
        want = {"persistence": v[t], "day": v[t + ld - 24], "climatology": clim[(h + ld) % 24],
                "anom": v[t] - clim[h % 24] + clim[(h + ld) % 24],
                "ydc": v[t] + v[t + ld - 24] - v[t - 24]}
        for name, w in naive_weights(inp).items():
            got = torch.einsum("c,nchw->nhw", w[i], x)
            torch.testing.assert_close(got, want[name], rtol=0, atol=1e-12)
    plain = Inputs(clim=inp.clim, leads=(6, 24), use_clim=False)
    assert list(naive_weights(plain)) == ["persistence"]


def test_select_blend_is_the_grid_minimum() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 3, 4, 5, generator=g, dtype=torch.float64)
    y = (0.5 * x[:, :1] + 0.3 * x[:, 1:2] + 0.2 * x[:, 2:3]
         + 0.3 * torch.randn(20, 1, 4, 5, generator=g, dtype=torch.float64))
    lat = torch.tensor([60.0, 55.0, 50.0, 45.0], dtype=torch.float64)
    naive = {k: torch.eye(3, dtype=torch.float64)[i][None] for i, k in enumerate("abc")}
    w, a, r = select_blend(x, y, lat, naive, steps=5)
    brute = min((float(metrics.lat_weighted_rmse(
        sum(c / 5 * x[:, i] for i, c in enumerate(p)), y[:, 0], lat)), p)
        for p in itertools.product(range(6), repeat=3) if sum(p) == 5)
    assert r[0] == pytest.approx(brute[0], rel=1e-12)
    assert [round(a[0][k] * 5) for k in "abc"] == list(brute[1])
    torch.testing.assert_close(w[0], torch.tensor(brute[1], dtype=torch.float64) / 5)
    with pytest.raises(ValueError, match="steps"):
        select_blend(x, y, lat, naive, steps=0)


def _argv(nc: Path, out: Path, *extra: str) -> list[str]:
    return ["bench", "era5", "--file", str(nc), "--out", str(out), "--split", "4,3,3,-1",
            "--patch", "2", "--hidden", "8", "--layers", "1", "--heads", "2", "--mlp", "8",
            "--epochs", "2", "--ensemble", "2", "--n-samples", "3", "--n-passes", "2",
            "--nu-max", "16", "--no-progress", "--methods", "persistence", *extra]


def test_bench_with_the_recipe_options(tmp_path: Path) -> None:
    from attnuq.cli import main
    from attnuq_bench.models.vit_field import load_vit_field

    nc = _nc(tmp_path / "f.nc")
    plain, rich = tmp_path / "plain", tmp_path / "rich"
    assert main(_argv(nc, plain)) == 0
    assert main(_argv(nc, rich, "--day-ago", "--loo-clim", "--base", "blend",
                      "--weight-decay", "0.01")) == 0
    jp = json.loads((plain / "era5" / "era5_results.json").read_text())
    jr = json.loads((rich / "era5" / "era5_results.json").read_text())
    # without the options: no new config keys (reuse keys as before), the old recipe class
    assert not {"day_ago", "loo_clim", "base", "weight_decay"} & set(jp["config"])
    rec = json.loads((plain / "era5" / "backbone" / "recipe.json").read_text())
    assert rec["recipe"] == "_MemberRecipe" and "weight_decay" not in rec
    assert "day-ago-point" not in jp["results"] and "val_points" not in jp["backbone"]
    rec2 = json.loads((rich / "era5" / "backbone" / "recipe.json").read_text())
    assert rec2["recipe"] == "_MemberRecipeV2" and rec2["weight_decay"] == 0.01
    b = jr["backbone"]
    assert b["in_channels"] == 7 and len(b["channels"]) == 7
    # the blend chosen on val is the best naive forecast on val or better, at every lead
    for i, lead in enumerate(("+6h", "+24h")):
        vp = b["val_points"]
        best_naive = min(vp[k]["per_lead"][lead]["rmse_lat"] for k in (
            "persistence-point", "day-ago-point", "climatology-point"))
        assert vp["blend-point"]["per_lead"][lead]["rmse_lat"] <= best_naive + 1e-12
        assert b["blend_val_rmse"][i] == pytest.approx(
            vp["blend-point"]["per_lead"][lead]["rmse_lat"], rel=1e-9)
        assert sum(b["blend"][i].values()) == pytest.approx(1.0)
    # the saved backbone carries the blend as its base
    m = load_vit_field(rich / "era5" / "backbone")
    assert m.config.base_weight is not None and len(m.config.base_weight) == 2
    md = (rich / "era5.md").read_text()
    assert "| day-ago-point |" in md and "| blend-point |" in md
    assert "validation days (what the recipe was chosen on)" in md
    assert "AdamW weight decay 0.01" in md and "(leave-one-out on the training days)" in md
    summary = json.loads((rich / "summary.json").read_text())["era5"]
    for lead in ("+6h", "+24h"):
        refs = {k: jr["results"][f"{k}-point"]["per_lead"][lead]["rmse_lat"]
                for k in ("persistence", "day-ago", "climatology")}
        assert summary[f"t2m{lead}"]["backbone"]["reference"] == min(refs.values())
