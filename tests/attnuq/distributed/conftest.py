"""The groups of tests/attnuq/distributed, started once per session and all at once.

Starting a process costs seconds here (importing torch on a loaded machine), so every 2- and
3-rank case runs inside two launches of ``_worker.py`` (all scenarios, in order) and one
``torchrun ... -m attnuq.cli calibrate``, started together; the world-size-1 reference runs in
this process, in a gloo group of one, while they run. Under pytest-xdist only one worker
computes all this (``dist_run``); the tests read it. A second torchrun launch runs
``attnuq calibrate --task classification`` (every rank fits the whole classifier).
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

import _launch
import _worker

#: the process groups' timeout in the workers (the dead-rank case must fail well within it)
TIMEOUT_S = 30


def cli_args(files: dict[str, Path], out: Path) -> list[str]:
    return ["calibrate", str(files["model"]), str(files["data"]), "--n-passes", "3",
            "--batch-size", "4", "--out", str(out)]


def cls_args(files: dict[str, Path], out: Path) -> list[str]:
    """``attnuq calibrate --task classification``: the same model's two outputs read as the
    logits of two classes, on labels drawn from them."""
    return ["calibrate", str(files["model"]), str(files["cls_data"]), "--task",
            "classification", "--n-passes", "3", "--batch-size", "4", "--out", str(out)]


def _files(d: Path) -> dict[str, Path]:
    x, y = _worker.data()
    torch.save(_worker.small_model(), d / "model.pt")
    np.savez(d / "heldout.npz", x=x.numpy(), y=y.numpy())
    g = torch.Generator().manual_seed(2)
    xc = torch.randn(24, 5, 8, generator=g)
    with torch.no_grad():
        yc = torch.multinomial((2 * _worker.small_model()(xc)).softmax(-1), 1, generator=g)
    np.savez(d / "heldout_cls.npz", x=xc.numpy(), y=yc[:, 0].numpy())
    return {"model": d / "model.pt", "data": d / "heldout.npz",
            "cls_data": d / "heldout_cls.npz", "dir": d}


class _Finished:
    """A finished launch: ``wait()`` returns its processes' results (as ``Launch.wait``)."""

    def __init__(self, procs: list[subprocess.CompletedProcess[str]]) -> None:
        self.procs = procs

    def wait(self) -> list[subprocess.CompletedProcess[str]]:
        return self.procs


def _compute(root: Path) -> dict[str, Any]:
    """Start the launches, run the world-size-1 reference here meanwhile, wait for them."""
    from attnuq.cli import main

    sub = {k: root / k for k in ("files", "w2", "w3", "fork", "cli", "cli_w1", "cls",
                                 "cls_w1")}
    for d in sub.values():
        d.mkdir(parents=True, exist_ok=True)
    files = _files(sub["files"])
    out = {2: sub["w2"], 3: sub["w3"]}
    ranks = _launch.start_forked([("same", 2, out[2]), ("same", 3, out[3])], sub["fork"],
                                 TEST_DIST_TIMEOUT=str(TIMEOUT_S))
    cli = _launch.start_torchrun(2, cli_args(files, sub["cli"] / "report"))
    cls = _launch.start_torchrun(2, cls_args(files, sub["cls"] / "report"))
    assert not dist.is_initialized()
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain = _worker.same(0, 1)  # no process group at all: the same numbers must come out
    finally:
        torch.set_num_threads(n)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_launch.free_port()}",
                            rank=0, world_size=1, timeout=timedelta(seconds=TIMEOUT_S))
    try:
        w1 = _worker.same(0, 1)
        w1["cli_out"] = sub["cli_w1"] / "report"
        w1["cli_rc"] = main(cli_args(files, w1["cli_out"]))
        w1["cls_out"] = sub["cls_w1"] / "report"
        w1["cls_rc"] = main(cls_args(files, w1["cls_out"]))
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(n)
    return {"w1": w1, "plain": plain, "out": out, "top": sub["fork"],
            "cli_out": sub["cli"] / "report", "cls_out": sub["cls"] / "report",
            "ranks": ranks.wait(), "cli": cli.wait(), "cls": cls.wait()}


@pytest.fixture(scope="session")
def dist_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Everything the tests compare, computed once per test run: under pytest-xdist the first
    worker to get here computes it (the others wait on the lock, then read it from disk)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    root = shared / "attnuq_distributed"
    done = root / "done.pt"
    with FileLock(str(shared / "attnuq_distributed.lock")):
        if not done.exists():
            root.mkdir(exist_ok=True)
            torch.save(_compute(root), done)
    return dict(torch.load(done, weights_only=False))


@pytest.fixture(scope="session")
def launched(dist_run: dict[str, Any]) -> dict[str, Any]:
    """The 2- and 3-rank groups and the torchrun launch, all finished."""
    return {"out": dist_run["out"], "top": dist_run["top"], "cli_out": dist_run["cli_out"],
            "cls_out": dist_run["cls_out"], "ranks": _Finished(dist_run["ranks"]),
            "cli": _Finished(dist_run["cli"]), "cls": _Finished(dist_run["cls"])}


@pytest.fixture(scope="session")
def plain(dist_run: dict[str, Any]) -> dict[str, Any]:
    """The same scenario in the test process without any process group."""
    return dict(dist_run["plain"])


@pytest.fixture(scope="session")
def w1(dist_run: dict[str, Any]) -> dict[str, Any]:
    """The world-size-1 results (a gloo group of one in the test process), and the CLI's."""
    return dict(dist_run["w1"])


def exit_codes(launched: dict[str, Any], world: int) -> list[int]:
    """The exit status of each rank of the ``world``-rank group (all finished)."""
    import json

    (zygote,) = launched["ranks"].wait()
    assert zygote.returncode == 0, zygote.stderr[-3000:]
    codes = json.loads((launched["top"] / "exit_codes.json").read_text())
    return [codes[str(launched["out"][world])][str(r)] for r in range(world)]


def results(launched: dict[str, Any], world: int) -> list[dict[str, Any]]:
    """Every rank's saved results of the ``world``-rank group (which must have finished)."""
    for r, code in enumerate(exit_codes(launched, world)):
        want = 3 if r == world - 1 else 0  # the last rank leaves with 3 in the dead-rank case
        log = launched["out"][world] / f"rank{r}.log"
        assert code == want, f"rank {r} of {world}: exit {code}\n{log.read_text()[-3000:]}"
    return [torch.load(launched["out"][world] / f"same_rank{r}.pt", weights_only=False)
            for r in range(world - 1)] + [_last(launched, world)]


def _last(launched: dict[str, Any], world: int) -> dict[str, Any]:
    """The last rank's results: it exits inside the dead-rank case, after saving the others'
    scenarios in ``same_partial``."""
    path = launched["out"][world] / f"same_partial_rank{world - 1}.pt"
    return torch.load(path, weights_only=False)
