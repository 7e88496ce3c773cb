"""``attnuq bench uci`` end to end under ``torchrun --nproc-per-node 2`` against one process:
the same files, each written exactly once (every atomic write counted), the same numbers.

Tiny: the bundled concrete split 0, a one-block backbone for one epoch, three methods (one
group of three items, fewer groups than ranks: the items are dealt out, the group is set up by
rank 0 first, which trains and caches the backbone, then by rank 1, which finds the cache).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("attnuq_bench.cli", reason="needs the harness attnuq-bench (attnuq bench uci)")
from _count_writes import logging_writes
from _launch import WORKER, start_torchrun

METHODS = ["conformal", "sa-paper", "mc-dropout"]
#: record keys whose values are wall times or provenance (differ between any two runs)
VOLATILE_KEYS = ("run_info", "started", "invocation", "date", "command")
#: page columns of wall times
VOLATILE_COLUMNS = ("fit s",)


def argv(root: Path) -> list[str]:
    return ["bench", "uci", "--datasets", "concrete", "--splits", "1", "--data-dir", "bundled",
            "--out", str(root / "uci"), "--cache-dir", str(root / "models"), "--n-blocks", "1",
            "--max-epochs", "1", "--patience", "1", "--n-samples", "8", "--threads", "1",
            "--methods", *METHODS, "--no-progress"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The 2-rank run (torchrun, in the background) and the 1-process run (here, meanwhile)."""
    from attnuq.cli import main

    base = tmp_path_factory.mktemp("bench_uci")
    roots = {w: base / f"w{w}" for w in (1, 2)}
    logs = {w: base / f"log{w}" for w in (1, 2)}
    for d in (*roots.values(), *logs.values()):
        d.mkdir()
    launch = start_torchrun(2, argv(roots[2]), timeout_s=240.0,
                            script=[str(WORKER.with_name("_count_writes.py")), str(logs[2])])
    n = torch.get_num_threads()
    try:
        with logging_writes(logs[1] / "writes_rank0.txt"):
            rc1 = main(argv(roots[1]))
    finally:
        torch.set_num_threads(n)
    (agent,) = launch.wait()
    return {"roots": roots, "logs": logs, "rc1": rc1, "agent": agent}


def _writes(runs: dict[str, Any], world: int) -> dict[int, Counter[str]]:
    """Per rank: how often each path (relative to the run's root) was atomically written."""
    root = runs["roots"][world].resolve()
    out = {}
    for r in range(world):
        lines = (runs["logs"][world] / f"writes_rank{r}.txt").read_text().split()
        out[r] = Counter(str(Path(p).relative_to(root)) for p in lines)
    return out


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _strip(obj: Any) -> Any:
    """``obj`` without wall times (``*seconds*`` keys) and provenance."""
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items()
                if "seconds" not in k and k not in VOLATILE_KEYS}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def _tables(twin: dict[str, Any]) -> list[Any]:
    """The page's headline and tables without the wall-time columns."""
    out: list[Any] = [twin["headline"], twin["implementations"]]
    for sec in twin["sections"]:
        for t in sec["tables"]:
            keep = [i for i, c in enumerate(t["columns"]) if c not in VOLATILE_COLUMNS]
            out.append((sec["heading"], [t["columns"][i] for i in keep],
                        [[row[i] for i in keep] for row in t["rows"]]))
    return out


def test_both_runs_finish(runs: dict[str, Any]) -> None:
    agent = runs["agent"]
    assert runs["rc1"] == 0
    assert agent.returncode == 0, agent.stderr[-4000:]
    assert agent.stdout.count("results written to") == 1  # rank 0 alone reports the page


def test_same_files_each_written_once(runs: dict[str, Any]) -> None:
    one, two = _writes(runs, 1)[0], _writes(runs, 2)
    # the backbone's training checkpoint is rewritten every epoch (by the same atomic writer)
    # and removed once the backbone is saved: the one written file not left behind
    ckpts = {f for f in one if f.endswith("/train.ckpt")}
    assert ckpts, one
    assert one and all(c == 1 for f, c in one.items() if f not in ckpts), one  # every file once
    # two ranks: the same files, each written once, by one rank (none by both)
    assert two[0] + two[1] == one, (two, one)
    assert not set(two[0]) & set(two[1]), (two[0], two[1])
    # rank 1 wrote its own item's record and nothing shared (.gitignore, spec.json, page)
    assert set(two[1]) == {"uci/runs/concrete/split0/sa-paper.json"}, two[1]
    assert _files(runs["roots"][2]) == _files(runs["roots"][1])
    # every file came from an atomic write, and no checkpoint is left behind
    assert set(_files(runs["roots"][1])) == set(one) - ckpts


def test_same_numbers(runs: dict[str, Any]) -> None:
    r1, r2 = runs["roots"][1], runs["roots"][2]
    recs = sorted(str(p.relative_to(r1)) for p in (r1 / "uci" / "runs").rglob("*.json"))
    assert len(recs) == len(METHODS)
    for rel in recs:
        a, b = (json.loads((r / rel).read_text()) for r in (r1, r2))
        assert _strip(b) == _strip(a), rel  # metrics, PIT values, nu, config, backbone
    twin1, twin2 = (json.loads((r / "uci.json").read_text()) for r in (r1, r2))
    assert _tables(twin2) == _tables(twin1)
    summ1, summ2 = (json.loads((r / "summary.json").read_text()) for r in (r1, r2))
    assert _strip(summ2) == _strip(summ1)
