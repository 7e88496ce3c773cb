"""The groups of tests/distributed, started once per session and all at once.

Starting a process costs seconds here (importing torch on a loaded machine), so every 2- and
3-rank case runs inside two launches of ``_worker.py`` (all scenarios, in order) and one
``torchrun ... -m attnuq.cli calibrate``, started together; the world-size-1 reference runs in
this process, in a gloo group of one, while they run.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
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


@pytest.fixture(scope="session")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("dist_files")
    x, y = _worker.data()
    torch.save(_worker.small_model(), d / "model.pt")
    np.savez(d / "heldout.npz", x=x.numpy(), y=y.numpy())
    return {"model": d / "model.pt", "data": d / "heldout.npz", "dir": d}


@pytest.fixture(scope="session")
def launched(files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, Any]:
    out = {w: tmp_path_factory.mktemp(f"dist_w{w}") for w in (2, 3)}
    cli_out = tmp_path_factory.mktemp("dist_cli") / "report"
    top = tmp_path_factory.mktemp("dist_fork")
    return {
        "out": out,
        "top": top,
        "cli_out": cli_out,
        "ranks": _launch.start_forked([("same", 2, out[2]), ("same", 3, out[3])], top,
                                      TEST_DIST_TIMEOUT=str(TIMEOUT_S)),
        "cli": _launch.start_torchrun(2, cli_args(files, cli_out)),
    }


@pytest.fixture(scope="session")
def w1(launched: dict[str, Any], files: dict[str, Path],
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The world-size-1 results (a gloo group of one in this process), and the CLI's."""
    from attnuq.cli import main

    assert not dist.is_initialized()
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_launch.free_port()}",
                            rank=0, world_size=1, timeout=timedelta(seconds=TIMEOUT_S))
    try:
        res = _worker.same(0, 1)
        out = tmp_path_factory.mktemp("dist_cli_w1") / "report"
        res["cli_rc"] = main(cli_args(files, out))
        res["cli_out"] = out
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(n)
    yield res


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
