"""End-to-end ``attnuq bench uci`` on one bundled split with cheap methods, and table logic."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from attnuq.cli import main
from attnuq_bench.methods import method_implementation
from attnuq_bench.suites.uci import write_table


def test_bench_uci_tiny_end_to_end_and_resumable(tmp_path: Path) -> None:
    out = tmp_path / "uci"
    argv = ["bench", "uci", "--datasets", "concrete", "--splits", "1", "--data-dir", "bundled",
            "--methods", "gaussian", "conformal", "laplace", "--out", str(out),
            "--n-blocks", "1", "--max-epochs", "1", "--patience", "1", "--no-progress"]
    assert main(argv) == 0
    runs = sorted((out / "runs" / "concrete" / "split0").glob("*.json"))
    assert [p.stem for p in runs] == ["conformal", "gaussian", "laplace"]
    for p in runs:
        r = json.loads(p.read_text())
        m = r["metrics"]
        assert r["sizes"]["test"] == len(r["pit"]) == 103
        assert 0 <= m["coverage"] <= 1 and 0 <= m["coverage_native"] <= 1
        assert m["width"] > 0 and m["rmse"] > 0 and m["crps"] > 0 and m["scale_factor"] > 0
        assert 0 <= m["w1_native"] <= 0.5
        assert r["backbone"]["epochs_run"] == 1
        assert r["implementation"] == method_implementation(r["method"])  # stored with the run
    # the three post-hoc methods share the frozen backbone, hence the point prediction
    rm = {json.loads(p.read_text())["metrics"]["rmse"] for p in runs}
    assert len(rm) == 1
    table = (tmp_path / "uci.md").read_text()
    for s in ("| gaussian |", "| laplace |", "| conformal |", "runs produced by:", "machine:",
              "concrete: splits [0]"):
        assert s in table
    assert (out / "pit_concrete.png").stat().st_size > 1000
    # resumable: a second run skips existing JSON (files untouched)
    stamps = {p: p.stat().st_mtime_ns for p in runs}
    assert main(argv) == 0
    assert all(p.stat().st_mtime_ns == t for p, t in stamps.items())
    # the JSON twin of the page holds its tables as data and renders the same page again
    from attnuq_bench.suites.uci import render_page

    twin = json.loads((tmp_path / "uci.json").read_text())
    assert twin["suite"] == "uci" and twin["headline"][0].startswith("**Summary:** SA has")
    (tab,) = [t for s in twin["sections"] if s["heading"] == "concrete" for t in s["tables"]]
    assert [r[0] for r in tab["rows"]] == ["laplace", "conformal", "gaussian"]
    assert render_page(out, tmp_path / "uci.md").markdown() == (tmp_path / "uci.md").read_text()


def test_bad_method_name_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "uci", "--datasets", "concrete", "--splits", "1", "--data-dir", "bundled",
            "--methods", "nope", "--out", str(tmp_path / "o"), "--no-progress"]
    assert main(argv) == 2
    assert "'nope'" in capsys.readouterr().err


def _row(ds: str, method: str, split: int, width: float, crps: float) -> dict:
    metrics = {k: 0.1 for k in ("rmse", "w1_native", "w1_scaled", "coverage_native", "coverage",
                                "nll")}
    metrics.update(width=width, crps=crps)
    return {"dataset": ds, "method": method, "split": split, "metrics": metrics, "pit": [0.5],
            "cost": {"fit_seconds": 1.0, "predict_forward_per_input": 1}}


def test_table_says_where_sa_loses_and_bolds_the_narrowest(tmp_path: Path) -> None:
    rows = [
        _row("a", "sa-paper", 0, 2.0, 1.0), _row("a", "sa-paper", 1, 2.2, 1.0),
        _row("a", "gaussian", 0, 3.0, 0.9), _row("a", "gaussian", 1, 3.2, 0.9),
        _row("b", "sa-paper", 0, 5.0, 1.0), _row("b", "conformal", 0, 4.0, 1.1),
    ]
    args = argparse.Namespace(n_blocks=1, max_epochs=1, patience=1, batch_size=32, n_samples=10,
                              swag_epochs=1)
    info = {"command": "attnuq bench uci", "date": "d", "machine": "m"}
    text = write_table(tmp_path / "t.md", tmp_path, rows, info, args).read_text()
    assert "a: **SA wins** on calibrated PI-95 width: sa-paper 2.100 vs the best baseline " \
           "gaussian 3.100 (baseline 1.48x wider); on CRPS SA loses" in text
    assert "b: **SA loses** on calibrated PI-95 width: best baseline conformal 4.000 vs " \
           "best SA sa-paper 5.000 (SA 1.25x wider)" in text
    assert "SA has the narrowest calibrated PI-95 on 1 of 2 data sets" in text
    assert "**2.100 ± 0.141**" in text  # narrowest width on a, mean ± std over 2 splits
    assert "| conformal | 1 |" in text
    assert "Below the full suite (>= 5 splits, every method on every split): a has 2 split(s); " \
           "b has 1 split(s)." in text


def test_table_names_methods_missing_a_split(tmp_path: Path) -> None:
    rows = [_row("a", "sa-paper", k, 2.0, 1.0) for k in range(5)]
    rows += [_row("a", "gaussian", k, 3.0, 1.0) for k in (0, 2, 3, 4)]
    args = argparse.Namespace(n_blocks=1, max_epochs=1, patience=1, batch_size=32, n_samples=10,
                              swag_epochs=1)
    info = {"command": "attnuq bench uci", "date": "d", "machine": "m"}
    text = write_table(tmp_path / "t.md", tmp_path, rows, info, args).read_text()
    assert "every method on every split): a/gaussian lacks split(s) [1]." in text
    # the rows carry no wall time and no backbone record: the cost line says so, with no number
    assert "* Missing on a: 1 row(s) that read the backbone (gaussian: split(s) [1]). Measured " \
           "on this set (1 thread): the rows 0 s (0.0 core-hours: gaussian not timed " \
           "on this set)." in text


def test_rows_on_fewer_splits_are_shown_but_not_compared(tmp_path: Path) -> None:
    # sa-paper on split 1 alone has the narrowest width and the lowest CRPS of any mean, but a
    # mean over split 1 is not comparable with means over splits 0-1: not bolded, not the verdict
    rows = [_row("a", "sa", k, 3.0, 1.0) for k in (0, 1)]
    rows += [_row("a", "gaussian", k, 2.5, 1.2) for k in (0, 1)]
    rows.append(_row("a", "sa-paper", 1, 1.0, 0.5))
    args = argparse.Namespace(n_blocks=1, max_epochs=1, patience=1, batch_size=32, n_samples=10,
                              swag_epochs=1)
    info = {"command": "attnuq bench uci", "date": "d", "machine": "m"}
    text = write_table(tmp_path / "t.md", tmp_path, rows, info, args).read_text()
    assert "| sa-paper | 1 | " + "0.100 ± 0.000 | " * 5 + "1.000 ± 0.000 | 0.500 ± 0.000 |" in text
    assert "**2.500 ± 0.000**" in text and "**1.000 ± 0.000**" in text  # gaussian, sa
    assert "a: **SA loses** on calibrated PI-95 width: best baseline gaussian 2.500 vs best " \
           "SA sa 3.000" in text
    assert "Rows on fewer than the set's 2 splits (sa-paper 1) are shown but not compared" in text
    assert "The ablation table compares the SA rows on the split(s) [1] every row ran on." in text
    assert "**Ablations on a** (SA variants against their reference rows, split(s) [1] " \
           "alone):" in text


@pytest.mark.parametrize("bad", [["--splits", "0"]])
def test_bad_split_count_is_refused(tmp_path: Path, bad: list[str]) -> None:
    argv = ["bench", "uci", "--datasets", "concrete", "--data-dir", "bundled", "--methods",
            "gaussian", "--out", str(tmp_path / "o"), "--no-progress", *bad]
    assert main(argv) == 2


def test_seed_offsets_every_seed_and_never_mixes_with_seed0(tmp_path: Path) -> None:
    from attnuq.cli import main as cli_main
    from attnuq_bench.suites.uci import aggregate

    out = tmp_path / "uci"
    base = ["bench", "uci", "--datasets", "concrete", "--splits", "1", "--data-dir", "bundled",
            "--methods", "gaussian", "--out", str(out), "--n-blocks", "1", "--max-epochs", "1",
            "--patience", "1", "--no-progress", "--device", "cpu"]
    assert cli_main(base) == 0
    assert cli_main([*base, "--seed", "1"]) == 0
    r0 = json.loads((out / "runs/concrete/split0/gaussian.json").read_text())
    r1 = json.loads((out / "runs/concrete/split0/seed1/gaussian.json").read_text())
    assert (r0["seed"], r1["seed"]) == (0, 1) and r1["device"] == "cpu"
    # a different seed trains a different backbone (own model cache folder)
    assert r0["metrics"]["rmse"] != r1["metrics"]["rmse"]
    assert len(list((out / "_models/concrete/split0/seed1").glob("*/backbone.pt"))) == 1
    assert [r["seed"] for r in aggregate(out, 0)] == [0]
    assert [r["seed"] for r in aggregate(out, 1)] == [1]
    # the table of seed 1 is built from seed-1 runs only
    assert "seed 1" in (tmp_path / "uci.md").read_text()


def test_bad_device_gives_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from attnuq.cli import main as cli_main

    argv = ["bench", "uci", "--datasets", "concrete", "--splits", "1", "--data-dir", "bundled",
            "--methods", "gaussian", "--out", str(tmp_path / "o"), "--no-progress",
            "--device", "bogus"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bogus" in err[0] and err[0].startswith("attnuq: error:")
    assert not (tmp_path / "o").exists()


def _tiny_argv(out: Path, *extra: str) -> list[str]:
    return ["bench", "uci", "--datasets", "concrete", "--splits", "1", "--data-dir", "bundled",
            "--methods", "gaussian", "--out", str(out), "--n-blocks", "1", "--max-epochs", "1",
            "--patience", "1", "--no-progress", *extra]


def test_torn_run_json_and_backbone_are_redone_with_a_warning(tmp_path: Path) -> None:
    """Issue #23 item 5: a 0-byte run JSON made every rerun fail ("Expecting value", no file
    named) and a torn ``backbone.pt`` gave a traceback; both are now redone with a warning
    (an ``attnuq._io.CorruptFileWarning``, a ``UserWarning``)."""
    out = tmp_path / "uci"
    assert main(_tiny_argv(out)) == 0
    run_json = out / "runs/concrete/split0/gaussian.json"
    (backbone,) = (out / "_models/concrete/split0").rglob("backbone.pt")
    good = json.loads(run_json.read_text())
    run_json.write_bytes(b"")
    backbone.write_bytes(backbone.read_bytes()[:64])
    with pytest.warns(UserWarning) as rec:
        assert main(_tiny_argv(out)) == 0
    text = " ".join(str(w.message) for w in rec)
    assert f"corrupt run {run_json}" in text and f"corrupt backbone {backbone}" in text
    redone = json.loads(run_json.read_text())
    assert redone["method"] == "gaussian" and redone["backbone"]["epochs_run"] == 1
    assert redone["metrics"].keys() == good["metrics"].keys()
    assert backbone.stat().st_size > 1000  # trained again and saved whole
    # no temporary files left behind by the atomic writes
    assert not [p for p in out.rglob("*.tmp")]


def test_records_of_another_backbone_are_redone(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A row is reused only with the backbone it was scored on: a backbone trained again need
    not reproduce the first (float results differ between CPUs; early stopping amplifies
    them), and a row of the old one beside rows of the new one would mix two models."""
    out = tmp_path / "uci"
    assert main(_tiny_argv(out)) == 0
    run_json = out / "runs/concrete/split0/gaussian.json"
    rec = json.loads(run_json.read_text())
    assert len(rec["backbone"]["weights"]) > 8  # the weights' digest keys the row
    # what a training reproduces only with: its thread count and CPU kernels
    assert rec["backbone"]["threads"] == torch.get_num_threads()
    assert rec["backbone"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    capsys.readouterr()
    assert main(_tiny_argv(out)) == 0  # same backbone: reused
    assert "redoing" not in capsys.readouterr().out
    # the row as if scored on another training (an older record: no weights digest)
    old = {k: v for k, v in rec["backbone"].items() if k != "weights"}
    run_json.write_text(json.dumps({**rec, "backbone": {**old, "epochs_run": 99}}))
    assert main(_tiny_argv(out)) == 0
    said = capsys.readouterr().out
    assert "gaussian.json was scored on another backbone (99 epochs" in said, said
    assert json.loads(run_json.read_text())["backbone"] == rec["backbone"]


@pytest.mark.slow
def test_other_budget_or_depth_retrains_the_backbone(tmp_path: Path) -> None:
    """Issue #23 item 6: another ``--max-epochs`` reused the old backbone (and labelled the JSON
    with the new budget); another ``--n-blocks`` gave a size-mismatch traceback."""
    out = tmp_path / "uci"
    run_json = out / "runs/concrete/split0/gaussian.json"
    assert main(_tiny_argv(out)) == 0
    first = json.loads(run_json.read_text())
    argv2 = [*_tiny_argv(out)[:-1], "--max-epochs", "2", "--no-progress"]
    assert main(argv2) == 0
    second = json.loads(run_json.read_text())
    # patience 1 cannot stop before epoch 2, so a backbone trained under this budget ran 2
    assert first["backbone"]["epochs_run"] == 1 and second["backbone"]["epochs_run"] == 2
    assert second["config"]["budget"]["max_epochs"] == 2
    assert second["backbone"]["cache_key"] != first["backbone"]["cache_key"]
    argv3 = [*argv2[:-1], "--n-blocks", "2", "--no-progress"]
    assert main(argv3) == 0
    third = json.loads(run_json.read_text())
    assert third["config"]["budget"]["n_blocks"] == 2
    assert len({first["backbone"]["cache_key"], second["backbone"]["cache_key"],
                third["backbone"]["cache_key"]}) == 3
    assert len(list((out / "_models/concrete/split0").glob("*/backbone.pt"))) == 3
    # back to the first budget: its cached backbone is found again, nothing retrained
    assert main(_tiny_argv(out)) == 0
    again = json.loads(run_json.read_text())
    assert again["backbone"] == first["backbone"]


def test_batch_size_auto_resolves_by_fit_rows_and_keeps_the_cache_key(tmp_path: Path) -> None:
    """``--batch-size auto`` (default): 32 / 128 / 256 by the fit part's rows; the backbone cache
    spec records the resolved number, so auto on a small set hits the cache of ``32``."""
    from attnuq._io import cache_key
    from attnuq_bench.data.uci import load_uci
    from attnuq_bench.suites.uci import _cache_spec, batch_size_for

    assert [batch_size_for("auto", n) for n in (1, 2000, 2001, 20000, 20001)] == [
        32, 32, 128, 128, 256]
    assert batch_size_for(64, 10**6) == 64
    data = load_uci("concrete", 0, data_dir="bundled")
    base = dict(n_blocks=1, max_epochs=1, patience=1, seed=0)
    auto = _cache_spec(data, argparse.Namespace(**base, batch_size="auto"))
    fixed = _cache_spec(data, argparse.Namespace(**base, batch_size=32))
    assert auto["batch_size"] == 32 and cache_key(auto) == cache_key(fixed)
    assert cache_key(_cache_spec(data, argparse.Namespace(**base, batch_size=128))) != \
        cache_key(fixed)
    # the page states the rule when the command ran with auto
    args = argparse.Namespace(n_blocks=3, max_epochs=100, patience=16, batch_size="auto",
                              n_samples=10, swag_epochs=1)
    info = {"command": "attnuq bench uci", "date": "d", "machine": "m"}
    text = write_table(tmp_path / "t.md", tmp_path, [_row("a", "sa-paper", 0, 2.0, 1.0)], info,
                       args).read_text()
    assert "batch size auto: 32 when the fit part has <= 2,000 rows, 128 when <= 20,000, " \
           "else 256" in text
    with pytest.raises(SystemExit):
        main(["bench", "uci", "--batch-size", "0"])


def test_page_says_when_sa_point_accuracy_is_off_the_frozen_backbone(tmp_path: Path) -> None:
    """Issue #19: an SA row whose point RMSE differs from the frozen model's by > 1 % is named."""
    rows = [_row("a", "sa-paper", 0, 2.0, 1.0), _row("a", "gaussian", 0, 3.0, 0.9),
            _row("a", "sa-crps", 0, 2.5, 1.0)]
    rows[0]["metrics"]["rmse"] = 0.105  # +5 % over the frozen 0.1; sa-crps's 0.1 is not named
    args = argparse.Namespace(n_blocks=1, max_epochs=1, patience=1, batch_size=32, n_samples=10,
                              swag_epochs=1)
    info = {"command": "attnuq bench uci", "date": "d", "machine": "m"}
    text = write_table(tmp_path / "t.md", tmp_path, rows, info, args).read_text()
    assert "* SA's point RMSE differs from the frozen backbone's (0.100) by more than 1 % for " \
           "sa-paper 0.105 (+5.0 %)." in text


def test_the_recommended_sa_row_counts_as_sa_and_gets_the_suite_budget(tmp_path: Path) -> None:
    """``sa`` (no ``sa-`` prefix) is an SA row of the verdict, and the suite passes it (and the
    other new SA rows) its ``--n-samples`` like every sampled method."""
    from attnuq_bench.suites.uci import _method_kwargs

    rows = [_row("a", "sa", 0, 2.0, 1.0), _row("a", "gaussian", 0, 3.0, 0.9)]
    args = argparse.Namespace(n_blocks=1, max_epochs=1, patience=1, batch_size=32, n_samples=10,
                              swag_epochs=1, no_progress=True)
    info = {"command": "attnuq bench uci", "date": "d", "machine": "m"}
    text = write_table(tmp_path / "t.md", tmp_path, rows, info, args).read_text()
    assert "a: **SA wins** on calibrated PI-95 width: sa 2.000 vs the best baseline " \
           "gaussian 3.000" in text
    for name in ("sa", "sa-debiased", "sa-recentred", "sa-floor"):
        assert _method_kwargs(name, args) == {"n_samples": 10, "progress": False}, name


def test_issue_20_goal_lines_count_the_recommended_row_only(tmp_path: Path) -> None:
    """sa against the baselines alone (a better sa-crps does not count for it); sa-debiased's raw
    coverage within 5 points; met / not met / open by the sets still to run."""
    from attnuq_bench.suites._uci_page import _stats, goal_lines

    rows = []
    sets = (("a", 1.0, 0.5, 0.93), ("b", 3.0, 0.5, 0.80), ("c", 1.0, 2.0, 0.99))
    for ds, sa_w, sa_c, cov in sets:
        for k in range(2):
            rows += [_row(ds, "sa", k, sa_w, sa_c), _row(ds, "gaussian", k, 2.0, 1.0),
                     _row(ds, "sa-crps", k, 0.5, 0.1), _row(ds, "sa-debiased", k, 9.0, 9.0)]
            rows[-1]["metrics"]["coverage_native"] = cov
    per = {ds: _stats(rows, ds, ()) for ds in "abc"}
    lines = goal_lines(per)
    assert lines == [
        "* issue #20 goal, `sa`: narrowest calibrated PI-95 on at least 5 of 6 sets: 2 of the 3 "
        "run (a, c): open (3 set(s) not yet run).",
        "* issue #20 goal, `sa`: best CRPS on at least 4 of 6 sets: 2 of the 3 run (a, b): "
        "open (3 set(s) not yet run).",
        "* issue #20 goal, `sa-debiased` (the default criterion's row): raw 95 % coverage of "
        "the default criterion within 5 points on at least 4 of 6 sets: 2 of the 3 run (a, c): "
        "open (3 set(s) not yet run).",
    ]
    # 6 sets run, sa losing width on 2 of them (b, e): 4 < 5, not met; CRPS 5 of 6: met
    per.update({d: per[k] for d, k in (("d", "a"), ("e", "b"), ("f", "a"))})
    got = goal_lines(per)
    assert got[0].endswith("4 of the 6 run (a, c, d, f): not met.")
    assert got[1].endswith("5 of the 6 run (a, b, d, e, f): met.")
    args = argparse.Namespace(n_blocks=1, max_epochs=1, patience=1, batch_size=32, n_samples=10,
                              swag_epochs=1)
    info = {"command": "attnuq bench uci", "date": "d", "machine": "m"}
    text = write_table(tmp_path / "t.md", tmp_path, rows, info, args).read_text()
    assert "issue #20's goals are counted for the recommended row alone:" in text
    assert lines[0] in text


def test_a_killed_backbone_training_resumes_to_the_uninterrupted_weights(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full-budget backbone trains for an hour or more: a run killed mid-training resumes
    from its per-epoch checkpoint (``train.ckpt`` in the backbone's cache folder) and ends with
    the weights of an uninterrupted run, bit for bit (same kernels, same inputs); the
    checkpoint is removed once the backbone is saved."""
    import torch

    import attnuq_bench.models.ft as ft

    argv = [*_tiny_argv(tmp_path / "x")[:-5], "--max-epochs", "3", "--patience", "5",
            "--no-progress"]

    def run(out: Path) -> int:
        return main([*argv[:argv.index("--out") + 1], str(out),
                     *argv[argv.index("--out") + 2:]])

    assert run(tmp_path / "whole") == 0
    (want,) = (tmp_path / "whole/_models/concrete/split0").rglob("backbone.pt")

    make = ft.make_ft_transformer
    calls = {"n": 0}

    def make_dying(*a: object, **k: object) -> torch.nn.Module:
        model = make(*a, **k)  # type: ignore[arg-type]

        def hook(mod: torch.nn.Module, inputs: object) -> None:
            calls["n"] += mod.training
            if calls["n"] == 40:  # in the second epoch (21 training batches an epoch)
                raise KeyboardInterrupt

        model.register_forward_pre_hook(hook)
        return model

    monkeypatch.setattr(ft, "make_ft_transformer", make_dying)
    assert run(tmp_path / "killed") == 130  # the CLI's "interrupted, resume with" exit
    (ckpt,) = (tmp_path / "killed/_models/concrete/split0").rglob("train.ckpt")
    assert not list((tmp_path / "killed/_models").rglob("backbone.pt"))
    monkeypatch.setattr(ft, "make_ft_transformer", make)
    assert run(tmp_path / "killed") == 0
    (got,) = (tmp_path / "killed/_models/concrete/split0").rglob("backbone.pt")
    a, b = torch.load(want, weights_only=True), torch.load(got, weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not ckpt.exists()
    rec = json.loads((got.parent / "backbone.json").read_text())
    assert rec["epochs_run"] == 3


def test_implementations_block_shows_the_newest_records_text_and_counts_the_others() -> None:
    """Records of one method from two code versions: the newest record's text, and how many
    records recorded another; one text alone is shown as it is."""
    from attnuq_bench.suites._uci_page import _block

    def rec(m: str, text: str, date: str) -> dict[str, Any]:
        return {"method": m, "implementation": text, "run_info": {"date": date}}

    rows = [rec("laplace", "old words", "2026-12-01 10:00 UTC"),
            rec("laplace", "new words", "2026-12-03 10:00 UTC"),
            rec("laplace", "new words", "2026-12-02 10:00 UTC"),
            rec("gaussian", "g", "2026-12-01 10:00 UTC")]
    block = dict(_block(rows, None, ["laplace", "gaussian"])["rows"])
    assert block["laplace"] == ("new words (1 of 3 records were run by earlier code, whose "
                                "recorded text differs: see those records)")
    assert block["gaussian"] == "g"
