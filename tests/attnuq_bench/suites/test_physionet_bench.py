"""Tiny end-to-end run of ``attnuq bench physionet`` on synthetic stays in the challenge format."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from attnuq.cli import main
from attnuq_bench.methods import method_implementation


def _write_stays(root: Path, n: int) -> None:
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        rid = 140000 + i
        lines = ["Time,Parameter,Value", f"00:00,RecordID,{rid}", f"00:00,Age,{40 + i}",
                 "00:00,Weight,-1"]
        base = rng.uniform(60, 100)
        for minute in sorted(rng.choice(48 * 60, 16, replace=False)):
            hh, mm = divmod(int(minute), 60)
            lines.append(f"{hh:02d}:{mm:02d},HR,{base + 5 * np.sin(minute / 300):.1f}")
            if minute % 2:
                lines.append(f"{hh:02d}:{mm:02d},Temp,{36 + rng.uniform(0, 2):.1f}")
        (root / f"{rid}.txt").write_text("\n".join(lines) + "\n")


@pytest.mark.slow
def test_bench_physionet_end_to_end(tmp_path: Path) -> None:
    data = tmp_path / "data" / "physionet2012"
    _write_stays(data, 15)
    out = tmp_path / "res" / "physionet"
    common = ["bench", "physionet", "--data-dir", str(tmp_path / "data"), "--seeds", "1",
              "--d", "8", "--max-epochs", "1", "--sub-stays", "2", "--mc-passes", "2",
              "--sampler-draws", "4", "--ensemble-members", "2", "--gp-train-stays", "4",
              "--gp-iters", "2", "--plots", "1", "--out", str(out),
              "--cache-dir", str(tmp_path / "cache"), "--seed", "1", "--device", "cpu",
              "--uq-weights", "0,0.1"]
    assert main([*common, "--only-seed", "1"]) == 0
    seed1 = json.loads((out / "seed_1.json").read_text())
    (out / "seed_1.json").write_bytes(b"")  # torn by a crash: redone with a warning
    with pytest.warns(UserWarning, match="corrupt run"):
        assert main([*common, "--reuse"]) == 0
    seed1 = json.loads((out / "seed_1.json").read_text())
    assert main([*common, "--reuse"]) == 0
    res = json.loads((out / "physionet.json").read_text())
    assert res["per_seed"][0] == seed1  # the parallel-run record is reused as is
    assert seed1["seed"] == 1 and res["ensemble"]["seeds"] == [1, 2]  # --seed honoured
    assert res["args"]["device"] == "cpu"
    cal = seed1["calibration"]
    grid = res["grid"]
    assert grid["weights"] == [0.0, 0.1] and set(grid["entries"]) == {"0", "0.1"}
    w = grid["chosen"]  # by validation CRPS only
    assert grid["val_crps"][f"{w:g}"] == min(grid["val_crps"].values())
    assert cal["weight"] == w and seed1["train_levy"]["uq_weight"] == w
    g0 = grid["entries"]["0"][0]
    assert g0["alpha_trained"] == pytest.approx(1.0, rel=1e-5)  # MSE gives alpha no gradient
    assert grid["entries"]["0.1"][0]["alpha_trained"] != pytest.approx(1.0, rel=1e-6)
    assert cal["alpha"] > 0 and np.isfinite(cal["T"])
    assert seed1["train_levy"]["stopped_by"] == "max_epochs"
    summ = res["summary"]
    ablation = "levy_alpha_trained" if w == 0 else "levy_cond"
    for meth in ("levy", ablation, "levy_nophi", "levy_sub", "levy_sampler",
                 "levy_sub_alpha_trained", "softmax_mcdropout"):
        for key in ("mse", "mae", "nll", "crps", "T", "cov90", "ccov90", "width95", "cwidth95",
                    "sel_mse10", "sel_mse20", "sel_mse50"):
            assert np.isfinite(summ[meth][key][0]), (meth, key)
        assert "spearman_within_channel" in summ[meth]
    assert len(seed1["channel_spearman"]["levy"]) == 3  # one per channel
    for key in ("spearman_within_channel", "sel_mse50", "channel_spearman"):
        assert key in res["ensemble"] and key in res["gp"], key
    assert summ["levy"]["mse"] == summ["levy_nophi"]["mse"]  # same pass, different spread
    # the floor under sigma_hat (beta on the first half of val, factor on the second)
    for key in ("fcov50", "fwidth50", "floor_beta50"):
        assert key in summ["levy"], key
    assert 0 <= summ["levy"]["fcov50"][0] <= 1 and summ["levy"]["fwidth50"][0] > 0
    assert set(res["per_seed"][0]["sparsity"]) == {"0.1", "0.5", "0.9"}
    assert res["ensemble"]["members"] == 2 and np.isfinite(res["gp"]["crps"])
    assert res["data"]["n_stays"] == 15 and res["data"]["channels"] == ["Age", "HR", "Temp"]
    md = (tmp_path / "res" / "physionet.md").read_text()
    assert "MSE within 5.6 %" in md and "machine:" in md and "command:" in md
    for head in ("Loss weight w", "Selective prediction", "per channel", "Goals of issue #36",
                 "What ran:"):
        assert head in md, head
    assert "floor under sigma_hat" in md
    assert "(matched: both models" in md and "alpha trained -> fitted" in md
    assert "absent from this copy of the data: Gender, Height, ICUType" in md
    assert res["plots"] and (out / res["plots"][0]).is_file()
    info = res["plot_info"][0]
    assert info["channel"] in ("HR", "Temp") and info["gap_ratio"] >= 1
    assert f"stay {info['record_id']}" in md
    # the twin, the stored Implementations block (MC dropout and the ensemble: the registry's
    # classes) and this suite's key of summary.json
    twin = json.loads((tmp_path / "res" / "physionet.json").read_text())
    assert twin["suite"] == "physionet" and twin["headline_table"][0].startswith("| method |")
    rows = dict(res["implementations"]["rows"])
    assert rows["softmax control, MC dropout (2 passes) [subset: 2 test stays]"] == (
        method_implementation("mc-dropout"))
    assert rows["softmax deep ensemble (2 members, one ensemble)"] == (
        method_implementation("ensemble"))
    entry = json.loads((tmp_path / "res" / "summary.json").read_text())["physionet"]
    assert entry["physionet2012"]["backbone"]["value"] == summ["levy"]["mse"][0]
    assert entry["physionet2012"]["backbone"]["reference"] == pytest.approx(
        1.03 * summ["softmax"]["mse"][0])
    assert set(entry["physionet2012"]["methods"]) >= {"frozen", "levy", "softmax_mcdropout",
                                                      "ensemble", "gp"}
    for meth in ("levy", "softmax_mcdropout", "ensemble", "gp"):  # every method with a spread
        assert {"mse", "crps", "spearman", "spearman_within_channel"} <= set(
            entry["physionet2012"]["methods"][meth]), meth
    # --render-only rewrites the same page from physionet.json alone
    (tmp_path / "res" / "physionet.md").write_text("")
    assert main([*common, "--render-only"]) == 0
    assert (tmp_path / "res" / "physionet.md").read_text() == md


def test_bench_physionet_rejects_unavailable_device(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "physionet", "--data-dir", str(tmp_path), "--device", "cuda:99"]) == 2
    assert "cuda:99" in capsys.readouterr().err
    assert not (tmp_path / "physionet.json").exists()


def test_checkpoint_of_another_cap_config_is_reused_only_when_it_is_the_same_run() -> None:
    from attnuq_bench.suites.physionet import _same_run

    base = {"d": 32, "patience": 2, "max_epochs": 10, "max_train_seconds": 1500.0, "lr": 2e-3}
    capped = {"epochs": 5, "best_epoch": 4, "seconds": 1550.0, "val_mse_curve": [1.0] * 5}
    full = {"epochs": 10, "best_epoch": 9, "seconds": 1100.0, "val_mse_curve": [1.0] * 10}
    early = {"epochs": 4, "best_epoch": 1, "seconds": 400.0, "stopped_by": "patience"}
    no_cap = dict(base, max_train_seconds=None)
    # stopped by the time cap after 5 epochs: the run of --max-epochs 5, not of --max-epochs 10
    assert _same_run(capped, base, dict(no_cap, max_epochs=5)) == "max_epochs"
    assert _same_run(capped, base, no_cap) is None
    # ended by the epoch cap well inside the time cap: the same as without a cap
    assert _same_run(full, base, no_cap) == "max_epochs"
    assert _same_run(full, base, dict(no_cap, max_epochs=12)) is None
    assert _same_run(full, base, dict(base, max_train_seconds=600.0)) is None
    # early stopping: the same for any epoch cap it did not reach
    assert _same_run(early, base, dict(no_cap, max_epochs=30)) == "patience"
    assert _same_run(early, base, dict(no_cap, max_epochs=3)) is None
    # any other option differs: never reused
    assert _same_run(full, base, dict(no_cap, lr=1e-3)) is None


def test_torn_checkpoint_is_retrained_with_a_warning(tmp_path: Path) -> None:
    """Issue #23 item 5: a torn checkpoint in the cache gave a traceback from torch.load."""
    data = tmp_path / "data" / "physionet2012"
    _write_stays(data, 9)
    common = ["bench", "physionet", "--data-dir", str(tmp_path / "data"), "--d", "4",
              "--max-epochs", "1", "--out", str(tmp_path / "res"), "--cache-dir",
              str(tmp_path / "cache"), "--train-only", "levy@0:0"]
    assert main(common) == 0
    (ck,) = (tmp_path / "cache" / "physionet-runs").glob("*/levy_0.pt")
    size = ck.stat().st_size
    ck.write_bytes(ck.read_bytes()[: size // 3])
    with pytest.warns(UserWarning, match="corrupt checkpoint"):
        assert main(common) == 0
    import torch

    blob = torch.load(ck, weights_only=False)  # trained again and saved whole
    assert set(blob) == {"state", "info"} and blob["state"]
    assert not list(ck.parent.glob("*.tmp"))


def test_committed_page_regenerates_from_its_json() -> None:
    """docs/results/physionet.md is exactly what render makes of the stored physionet.json."""
    from attnuq._io import read_json
    from attnuq_bench.suites._physionet_page import build_page
    from attnuq_bench.suites.physionet import render_page

    root = Path(__file__).resolve().parents[3] / "docs" / "results"
    page = render_page(root / "physionet", root / "physionet.md")
    assert page.markdown() == (root / "physionet.md").read_text()
    assert page.to_dict() == json.loads((root / "physionet.json").read_text())  # the twin
    # the stored Implementations block is what the page shows, not today's texts
    res = read_json(root / "physionet" / "physionet.json")  # non-finite spellings decoded
    res["implementations"]["rows"] = [[k, "changed"] for k, _ in res["implementations"]["rows"]]
    assert "| softmax control (deterministic) | changed |" in build_page(res).markdown()
    # the committed seed records are runner items (``--reuse`` takes them without a warning)
    import warnings

    from attnuq_bench.suites._runner import RunStore

    store = RunStore(root / "physionet", suite="physionet",
                     valid=lambda r: isinstance(r, dict) and "metrics" in r)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recs = [store.load((), f"seed_{s}", check=False) for s in range(3)]
    # the page's copies are the records as scored; the files carry the data digest (the
    # page's copies do too when the run that made them saved the records first)
    assert all(r is not None and len(r.pop("data_digest")) == 16 for r in recs)
    assert recs == [{k: v for k, v in r.items() if k != "data_digest"} for r in res["per_seed"]]


def test_interrupted_training_resumes_to_the_same_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model's training keeps fit's per-epoch state beside its checkpoint: a run killed after
    its first epoch resumes there and ends with the weights of an uninterrupted run."""
    import torch

    import attnuq_bench.training

    data = tmp_path / "data" / "physionet2012"
    _write_stays(data, 9)

    def train(cache: str) -> dict[str, torch.Tensor]:
        assert main(["bench", "physionet", "--data-dir", str(tmp_path / "data"), "--d", "4",
                     "--max-epochs", "3", "--patience", "3", "--out", str(tmp_path / "res"),
                     "--cache-dir", str(tmp_path / cache), "--train-only", "levy@0:0"]) == 0
        (ck,) = (tmp_path / cache / "physionet-runs").glob("*/levy_0.pt")
        assert not list(ck.parent.glob("*.train.pt"))  # the per-epoch state is dropped at the end
        blob = torch.load(ck, weights_only=False)
        assert blob["info"]["epochs"] == 3
        return blob["state"]

    straight = train("a")
    real, calls = attnuq_bench.training.atomic_torch_save, []

    def dies_at_the_second_epoch(obj: object, path: object) -> None:
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(obj, path)

    with monkeypatch.context() as m:
        m.setattr(attnuq_bench.training, "atomic_torch_save", dies_at_the_second_epoch)
        with pytest.raises(AssertionError, match="assert 130 == 0"):
            train("b")  # interrupted: one line and exit 130 (issue #35 item 13)
    assert str(calls[0]).endswith("levy_0.train.pt")
    resumed = train("b")
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


@pytest.mark.parametrize("weights", ["", " , ", "-0.1", "0,nan", "0,x", "0,0.1,0"])
def test_bad_weight_grid_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], weights: str
) -> None:
    """An empty or negative --uq-weights grid fails before any work, naming the value."""
    assert main(["bench", "physionet", "--data-dir", str(tmp_path), "--out",
                 str(tmp_path / "res"), "--uq-weights", weights]) == 2
    err = capsys.readouterr().err
    assert "--uq-weights" in err and "Traceback" not in err
    assert not (tmp_path / "res").exists()


def test_parse_weights() -> None:
    from attnuq_bench.suites.physionet import UQ_WEIGHTS, parse_weights

    assert parse_weights("0, 0.1,1") == UQ_WEIGHTS == (0.0, 0.1, 1.0)
    with pytest.raises(ValueError, match=r"-0\.5"):
        parse_weights("0,-0.5")
    with pytest.raises(ValueError, match="at least one"):
        parse_weights("")


def _speed_rec(ratio: float) -> dict[str, object]:
    """A record as ``benchmarks/bench_levy_forecaster.py`` writes it (the fields the page reads)."""
    return {"date": "2026-12-03 05:10 UTC", "ratio": ratio, "ratio_q25": ratio - 0.01,
            "ratio_q75": ratio + 0.01, "shape": {"test_stays": 799, "batch_size": 64},
            "rows": [{"weights": "Levy: random (torch.manual_seed(0)); control: random",
                      "repeats": 21, "stays_per_s": {"a": 1000.0 * ratio, "b": 1000.0,
                                                     "c": 450.0}}]}


def _speed_line(markdown: str) -> str:
    (line,) = [ln for ln in markdown.splitlines()
               if ln.startswith("* one pass at no extra cost")]
    return line


def test_speed_goal_judged_from_the_benchmark_record(tmp_path: Path) -> None:
    """Issue #36's speed goal: judged by the inference benchmark's ratio when its JSON is beside
    the page (>= 0.9 met, below not), from the in-run timings (said so) when it is absent; a
    torn record is ignored with a warning."""
    from attnuq._io import read_json
    from attnuq_bench.suites._physionet_page import build_page
    from attnuq_bench.suites.physionet import speed_record

    res = read_json(Path(__file__).resolve().parents[3] / "docs" / "results" / "physionet"
                    / "physionet.json")
    md = tmp_path / "docs" / "results" / "physionet.md"
    md.parent.mkdir(parents=True)
    assert speed_record(md) is None  # absent: the in-run timings judge, and the page says so
    line = _speed_line(build_page(res, speed=None).markdown())
    assert "no inference benchmark record" in line and "judged from the in-run timings" in line
    bench = tmp_path / "docs" / "benchmarks" / "levy_forecaster.json"
    bench.parent.mkdir()
    for ratio, verdict in ((0.95, "met"), (0.9, "met"), (0.899, "NOT met")):
        bench.write_text(json.dumps(_speed_rec(ratio)))
        rec = speed_record(md)
        assert rec is not None and rec["page"] == "../benchmarks/levy_forecaster.md"
        line = _speed_line(build_page(res, speed=rec).markdown())
        assert f"ratio {ratio:.3f} (IQR" in line
        assert f"criterion >= 0.9 -> {verdict});" in line
        assert "([levy_forecaster.md](../benchmarks/levy_forecaster.md), 2026-12-03" in line
        assert "In-run, for context only (load-dependent): stays/s of the chosen w" in line
    bench.write_text('{"ratio": 0.95, "rows": [')  # torn
    with pytest.warns(UserWarning, match="ignoring the speed benchmark"):
        assert speed_record(md) is None
    bench.write_text(json.dumps({**_speed_rec(0.95), "ratio": "NaN"}))  # no number to judge by
    with pytest.warns(UserWarning, match="non-finite or missing"):
        assert speed_record(md) is None
