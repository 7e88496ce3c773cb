"""The bench spine on its own: the runner's resume rules, the page object, the formatter."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest

from attnuq_bench.suites._page import Page, Table, fmt, read_twin, update_summary
from attnuq_bench.suites._runner import Group, RunStore, SkipGroup, credits, run_items
from attnuq_bench.suites._scoring import mean_std, mean_std_n

INFO = {"command": "attnuq bench demo", "date": "2026-01-01 00:00 UTC", "machine": "m"}


def _store(tmp: Path) -> RunStore:
    return RunStore(tmp / "runs", suite="demo", info=INFO)


def test_runner_reuses_matching_items_and_redoes_the_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[str, ...]] = []

    def setup(g: Group) -> str:
        calls.append(g.parts)
        return g.parts[0]

    def one(ctx: str, g: Group, m: str) -> dict[str, Any]:
        return {"method": m, "value": f"{ctx}/{m}/{g.reuse}"}

    g1 = [Group(("a",), ["m1", "m2"], reuse={"e": 1}), Group(("b",), ["m1"], reuse={"e": 1})]
    store = _store(tmp_path)
    assert run_items(store, g1, setup, one, progress=False).done == 3
    rec = json.loads((tmp_path / "runs/a/m1.json").read_text())
    assert rec["reuse"] == {"e": 1} and rec["run_info"]["command"] == INFO["command"]
    assert {"started", "invocation", "date", "machine"} <= set(rec["run_info"])
    assert "wall_seconds" in rec
    # all stored with this key: nothing runs, setup is not called
    calls.clear()
    s = run_items(store, g1, setup, one, progress=False)
    assert (s.done, s.reused, calls) == (0, 3, [])
    # another key redoes the items (with a message naming the file), rerun= forces one
    g2 = [Group(("a",), ["m1", "m2"], reuse={"e": 2})]
    s = run_items(store, g2, setup, one, progress=False)
    assert s.done == 2 and "a/m1.json was run with config {\"e\": 1}" in capsys.readouterr().out
    s = run_items(store, g2, setup, one, progress=False, rerun=["m2"])
    assert (s.done, s.reused) == (1, 1)
    # a torn file is redone with a warning
    (tmp_path / "runs/b/m1.json").write_text("{")
    with pytest.warns(UserWarning, match="corrupt run"):
        assert run_items(store, g1[1:], setup, one, progress=False).done == 1


def test_runner_accept_redoes_records_of_another_setup(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``Group.accept`` sees each stored record before the setup (context ``None``) and, when
    the setup runs, again with its context: records of another setup are redone."""
    backbone = {"now": "A"}

    def setup(g: Group) -> str:
        return backbone["now"]

    def one(ctx: str, g: Group, m: str) -> dict[str, Any]:
        return {"method": m, "backbone": ctx}

    def accept(rec: Any, ctx: Any) -> str | None:
        return None if ctx is None or rec["backbone"] == ctx else "was made on another one"

    store = _store(tmp_path)
    assert run_items(store, [Group(("a",), ["m1"], accept=accept)], setup, one,
                     progress=False).done == 1
    backbone["now"] = "B"  # the setup now gives another context
    # all stored: the setup does not run, so nothing can tell; the record is reused
    s = run_items(store, [Group(("a",), ["m1"], accept=accept)], setup, one, progress=False)
    assert (s.done, s.reused) == (0, 1)
    # a new item makes the setup run: the stored one is checked against its context, redone
    s = run_items(store, [Group(("a",), ["m1", "m2"], accept=accept)], setup, one,
                  progress=False)
    assert (s.done, s.reused) == (2, 0)
    assert "a/m1.json was made on another one; redoing it" in capsys.readouterr().out
    assert json.loads((tmp_path / "runs/a/m1.json").read_text())["backbone"] == "B"
    # a refusal before the setup (context None) redoes it too
    s = run_items(store, [Group(("a",), ["m1"], accept=lambda r, c: "stale")], setup, one,
                  progress=False)
    assert (s.done, s.reused) == (1, 0)


def test_runner_records_failures_skips_groups_and_calls_back(tmp_path: Path) -> None:
    saved: list[str] = []

    def setup(g: Group) -> None:
        if g.parts == ("skip",):
            raise SkipGroup("extra missing")

    def one(ctx: None, g: Group, m: str) -> dict[str, Any]:
        if m == "bad":
            raise RuntimeError("boom")
        return {"method": m}

    store = _store(tmp_path)
    groups = [Group(("ok",), ["good", "bad"]), Group(("skip",), ["good"])]
    s = run_items(store, groups, setup, one, progress=False,
                  on_saved=lambda g, m, r: saved.append(m))
    assert (s.done, s.failed, s.skipped, saved) == (1, ["ok/bad"], {("skip",): "extra missing"},
                                                    ["good"])
    (err,) = store.errors()
    assert err.name == "bad.err.txt" and err.read_text().startswith("RuntimeError: boom")
    assert not (tmp_path / "runs/skip").exists()
    # a later success of the failed item removes its .err.txt
    s = run_items(store, groups[:1], setup, lambda c, g, m: {"method": m}, progress=False)
    assert s.done == 1 and store.errors() == []
    with pytest.raises(ValueError, match="repeat"):
        Group(("x",), ["m", "m"])
    with pytest.raises(ValueError, match="plain folder names"):
        Group(("a/b",), ["m"])
    with pytest.raises(ValueError, match="saved as"):
        store.save({"method": "x"}, ("ok",), "y")


def test_interrupt_keeps_the_items_saved_so_far(tmp_path: Path) -> None:
    def one(ctx: None, g: Group, m: str) -> dict[str, Any]:
        if m == "m2":
            raise KeyboardInterrupt
        return {"method": m}

    store = _store(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        run_items(store, [Group(("a",), ["m1", "m2", "m3"])], lambda g: None, one,
                  progress=False)
    assert [r["method"] for r in store.records()] == ["m1"] and store.errors() == []


def test_credits_group_by_invocation() -> None:
    recs = [{"method": m, "run_info": {"command": "c", "date": d, "started": s,
                                       "invocation": i, "machine": "m"}}
            for m, d, s, i in (("a", "3", "1", 1), ("b", "4", "1", 1), ("c", "9", "8", 2))]
    assert credits(recs) == [
        {"command": "c", "date": "1", "machine": "m", "methods": ["a", "b"]},
        {"command": "c", "date": "8", "machine": "m", "methods": ["c"]}]


def test_fmt_is_the_formatter_of_every_suite() -> None:
    # ETT / ERA5 / UCI / PhysioNet conventions, one function
    assert [fmt(0.12345), fmt(1234.56), fmt(None), fmt(3), fmt(float("-inf"))] == [
        "0.1235", "1234.6", "-", "3", "-inf"]
    assert fmt(float("nan"), nan="nan") == "nan"
    assert fmt(2.0, 3, std=0.5, big=None) == "2.000 ± 0.500"
    assert fmt(float("nan"), 3, std=0.0, nan="n/a") == "n/a"
    assert fmt([0.0069, 0.0004, 3], 3, scale=1e3, missing="n/a", big=None) == "6.900 ± 0.400"
    assert fmt([0.0069, 0.0, 1], 3, scale=1e3, big=None) == "6.900"
    assert fmt(None, missing="n/a") == "n/a" and fmt("x") == "x"
    with pytest.raises(ValueError, match="digits"):
        fmt(1.0, -1)
    with pytest.raises(ValueError, match="mean, std, n"):
        fmt([1.0, 2.0])


def test_page_writes_markdown_and_strict_json_twin(tmp_path: Path) -> None:
    page = Page("demo", "Demo", state={"k": 1})
    page.provenance(INFO)
    page.section("Part")
    t = Table(["method", "x"], spaced=True)
    t.add("a", fmt(float("nan")), values={"x": float("nan")})
    page.table(t, headline=True)
    page.headline("Best: a.", readme="Part: Best: a.")
    page.implementations({"intro": "I", "rows": [["a", "code"]], "scores": None})
    md = page.write(tmp_path / "demo.md")
    text = md.read_text()
    assert text.startswith("# Demo\n\n* command: `attnuq bench demo`\n") and "| --- | --- |" in text
    twin = read_twin(md)
    assert twin is not None and twin["headline"] == ["Part: Best: a."]
    assert twin["headline_table"] == t.lines() and twin["state"] == {"k": 1}
    assert twin["sections"][0]["tables"][0]["values"] == [{"x": None}]  # NaN -> null
    assert "NaN" not in md.with_suffix(".json").read_text()
    with pytest.raises(ValueError, match="lacks"):
        page.provenance({"command": "c"})
    with pytest.raises(ValueError, match="2 columns"):
        t.add("only one")
    with pytest.raises(ValueError, match=r"cannot end in \.json"):
        page.write(tmp_path / "demo.json")
    (tmp_path / "torn.json").write_text("{")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert read_twin(tmp_path / "torn.md") is None and "corrupt" in str(w[0].message)


def test_update_summary_keeps_other_suites_and_validates(tmp_path: Path) -> None:
    p = tmp_path / "summary.json"
    entry = {"backbone": {"metric": "rmse", "value": float("nan"), "reference": 1.0,
                          "reference_name": "r"}, "splits": 2, "methods": {}}
    update_summary(p, "uci", {"a": entry})
    update_summary(p, "ett", {})
    d = json.loads(p.read_text())
    assert sorted(d) == ["ett", "uci"] and d["uci"]["a"]["backbone"]["value"] is None
    with pytest.raises(ValueError, match="backbone metric"):
        update_summary(p, "uci", {"a": {**entry, "backbone": {"metric": "mae"}}})
    with pytest.raises(ValueError, match="needs backbone"):
        update_summary(p, "uci", {"a": {}})


def test_mean_std_drops_missing_values() -> None:
    assert mean_std([1.0, 3.0, None]) == (2.0, math.sqrt(2.0))
    assert mean_std([5.0]) == (5.0, 0.0)
    assert all(math.isnan(v) for v in mean_std([float("nan")]))
    assert mean_std_n([1.0, 3.0]) == [2.0, math.sqrt(2.0), 2]
    with pytest.raises(ValueError, match="at least one"):
        mean_std_n([])
