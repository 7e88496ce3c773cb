"""``torchrun --nproc-per-node 2 -m attnuq.cli calibrate``, and the bench runner's sharing of
items across ranks (a fake suite; the worker records who ran what)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from _worker import local_value

from conftest import results


def test_calibrate_under_torchrun(launched: dict[str, Any], w1: dict[str, Any]) -> None:
    (agent,) = launched["cli"].wait()
    assert agent.returncode == 0, agent.stderr[-4000:]
    out = launched["cli_out"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        p.name for p in w1["cli_out"].iterdir())
    assert {"calibration.json", "results.json", "report.html"} <= {p.name for p in out.iterdir()}
    assert agent.stdout.count("chosen nu = ") == 1  # rank 0 alone reports and writes
    assert agent.stdout.count("calibration report written to") == 1
    got = json.loads((out / "calibration.json").read_text())
    ref = json.loads((w1["cli_out"] / "calibration.json").read_text())
    assert w1["cli_rc"] == 0
    assert got["nu"] == ref["nu"]  # same nu as one rank; every evaluation the same
    assert [e["objective"] for e in got["evaluations"]] == [
        e["objective"] for e in ref["evaluations"]]
    assert [e["nu"] for e in got["evaluations"]] == [e["nu"] for e in ref["evaluations"]]


def test_calibrate_classification_under_torchrun(launched: dict[str, Any],
                                                 w1: dict[str, Any]) -> None:
    """Every rank fits the whole classifier (the search is not sharded), rank 0 alone writes
    it, and the fit is the one process's: nu, T, the calibration scores, every evaluation."""
    (agent,) = launched["cls"].wait()
    assert agent.returncode == 0, agent.stderr[-4000:]
    assert w1["cls_rc"] == 0
    out, ref_out = launched["cls_out"], w1["cls_out"]
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in ref_out.iterdir())
    assert agent.stdout.count("chosen nu = ") == 1
    got = json.loads((out / "estimator.json").read_text())
    ref = json.loads((ref_out / "estimator.json").read_text())
    assert got["estimator"] == "SAClassifier"
    assert got["fitted"] == ref["fitted"]  # nu, T, classes and the sorted calibration scores
    for key in ("val", "nu", "temperature", "forward_passes", "n_val", "n_cal"):
        assert got["diagnostics"][key] == ref["diagnostics"][key], key
    cal, cal_ref = (json.loads((d / "calibration.json").read_text()) for d in (out, ref_out))
    assert [(e["nu"], e["objective"]) for e in cal["evaluations"]] == [
        (e["nu"], e["objective"]) for e in cal_ref["evaluations"]]


@pytest.mark.parametrize("world", [2, 3])
def test_runner_whole_groups(world: int, launched: dict[str, Any]) -> None:
    """5 groups of 2 methods, >= world groups: group g goes whole to rank g % world."""
    pytest.importorskip("attnuq_bench.cli", reason="needs the harness attnuq-bench (its runner)")
    res = results(launched, world)
    root = launched["out"][world] / f"runner_whole_w{world}"
    ref = local_value()  # the same undistributed predict, here without a group
    for g in range(5):
        for m in ("a", "b"):
            rec = json.loads((root / f"g{g}" / f"{m}.json").read_text())
            assert rec["rank"] == g % world, (g, m, rec)
            # the item's own predict ran on its rank alone, as without a group
            assert rec["sharded"] is False and rec["value"] == ref
            assert rec["writer"] is True  # the rank that owns an item writes its files
    setups = {r: res[r]["runner"]["whole_setups"] for r in range(world)}
    assert sorted(s for v in setups.values() for s in v) == [f"g{g}" for g in range(5)]
    for r in range(world):
        assert setups[r] == [f"g{g}" for g in range(5) if g % world == r]
        # a group's one holder writes its setup files (attnuq.distributed.is_writer)
        assert res[r]["runner"]["whole_writers"] == [(s, True) for s in setups[r]]
    assert res[0]["runner"]["whole"] == ("returned", 10, 0, [])
    assert res[0]["runner"]["whole_again"] == ("returned", 0, 10)  # all reused
    for r in range(1, world):
        assert res[r]["runner"]["whole"][0] == "worker_done"
        assert res[r]["runner"]["whole_again"] == ("worker_done",)


@pytest.mark.parametrize("world", [2, 3])
def test_runner_items_of_one_group(world: int, launched: dict[str, Any]) -> None:
    """1 group of 4 methods, fewer groups than ranks: items dealt out, method k to rank
    k % world; the group set up once by each rank holding items (lowest first); a failing
    method recorded."""
    pytest.importorskip("attnuq_bench.cli", reason="needs the harness attnuq-bench (its runner)")
    res = results(launched, world)
    root = launched["out"][world] / f"runner_items_w{world}"
    for k, m in enumerate("abcd"):
        if m == "c":
            assert (root / "one" / "c.err.txt").is_file()
            assert not (root / "one" / "c.json").exists()
            continue
        rec = json.loads((root / "one" / f"{m}.json").read_text())
        assert rec["rank"] == k % world and rec["sharded"] is False and rec["writer"] is True
    for r in range(world):
        assert res[r]["runner"]["items_setups"] == ["one"]
        # the group's lowest holder (rank 0) writes its setup files; the others only read them
        assert res[r]["runner"]["items_writers"] == [("one", r == 0)]
    assert res[0]["runner"]["items"] == ("returned", 3, 0, ["one/c"])
    # the second run reuses a, b, d and retries c (it fails again)
    assert res[0]["runner"]["items_again"] == ("returned", 0, 3)


@pytest.mark.parametrize("world", [2, 3])
def test_runner_bundle_goes_to_one_rank(world: int, launched: dict[str, Any]) -> None:
    """``Group.together=[("a", "d")]``: units [a, d], [b], [c] dealt round robin, so a and d
    run on rank 0 one after the other (without the bundle d would be method 3, rank 3 % world);
    c fails as before."""
    pytest.importorskip("attnuq_bench.cli", reason="needs the harness attnuq-bench (its runner)")
    res = results(launched, world)
    root = launched["out"][world] / f"runner_bundle_w{world}"
    want = {"a": 0, "d": 0, "b": 1, "c": 2 % world}
    for m, r in want.items():
        if m == "c":
            assert (root / "one" / "c.err.txt").is_file()
            continue
        rec = json.loads((root / "one" / f"{m}.json").read_text())
        assert rec["rank"] == r, (m, rec)
    assert res[0]["runner"]["bundle"] == ("returned", 3, 0, ["one/c"])


@pytest.mark.parametrize("world", [2, 3])
def test_primary_first(world: int, launched: dict[str, Any]) -> None:
    """Rank 0 runs the work first (makes the cache, a writer); then the others (find it, not
    writers); outside the block every rank is back to its own default (rank 0 writes)."""
    res = results(launched, world)
    for r in range(world):
        got = res[r]["first"]
        assert got["rank"] == r and got["content"] == "0"
        assert got["found"] is (r != 0) and got["writer"] is (r == 0)
        assert got["writer_after"] is (r == 0)
