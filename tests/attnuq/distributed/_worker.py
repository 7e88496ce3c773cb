"""One rank of a test group: ``python _worker.py SCENARIO OUT [ARGS...]`` (env as torchrun's).

Each scenario saves what it computed to ``OUT/<scenario>_rank<R>.pt`` for the test to compare.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

torch.set_num_threads(1)

import attnuq  # noqa: E402
from attnuq.distributed import RankError  # noqa: E402


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    return torch.nn.Sequential(enc, torch.nn.Flatten(1), torch.nn.Linear(5 * 8, 2)).eval()


class Flaky(torch.nn.Module):
    """The model, raising on this rank when ``fail`` is set."""

    def __init__(self, inner: torch.nn.Module, fail: bool) -> None:
        super().__init__()
        self.inner, self.fail = inner, fail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("injected failure in the model's forward")
        return self.inner(x)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(11, 5, 8, generator=g)
    with torch.no_grad():
        y = small_model()(x) + 0.3 * torch.randn(11, 2, generator=g)
    return x, y


def local_value() -> float:
    """A small undistributed predict, as a method inside a bench item would run it."""
    x, _ = data()
    return float(attnuq.predict(small_model(), x[:2], nu=2, n_samples=2, seed=0).samples.sum())


def caught(fn: Any) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # the test checks type and message
        return type(exc).__name__, str(exc)
    return "none", ""


def same(rank: int, world: int) -> dict[str, Any]:
    model = small_model()
    x, y = data()
    torch.manual_seed(100 + rank)  # rank-local global RNG differs: seed=None takes rank 0's
    res: dict[str, Any] = {}
    p = attnuq.predict(model, x, nu=4, n_samples=7, chunk_examples=3, chunk_passes=3)
    res["samples"], res["frozen"] = p.samples, p.frozen
    res["samples_none"] = attnuq.predict(model, x, nu=2, n_samples=4, seed=None,
                                         chunk_examples=4).samples
    # 2 examples in units of 1 x 8 passes: 2 units, so rank 2 of 3 has none
    res["empty"] = attnuq.predict(model, x[:2], nu=3, n_samples=8, chunk_examples=1,
                                  chunk_passes=8).samples
    batches = [(x[:7], y[:7]), (x[7:], y[7:])]
    rep = attnuq.calibrate(model, batches, criterion="crps", search="bo", max_evals=4,
                           n_passes=3, nu_range=(1, 64), chunk_examples=3)
    res["nu"] = rep.nu
    res["evals"] = [(e.nu, e.objective, e.se, e.scale) for e in rep.evaluations]
    res["s0"] = rep.residual_scale
    # 3 examples in units of 2: 2 units, so rank 2 of 3 has none during calibration
    small = attnuq.calibrate(model, [(x[:3], y[:3])], criterion="paper", search="grid",
                             grid_size=3, n_passes=2, nu_range=(1, 16), chunk_examples=2)
    res["empty_cal"] = (small.nu, [(e.nu, e.objective) for e in small.evaluations])
    # seed=None: every rank takes the seed rank 0 draws from its global generator (seeded 100
    # above at every world size), so the report is the same on every rank and at every world
    # size, although the ranks' own generators differ
    none = attnuq.calibrate(model, [(x[:6], y[:6])], criterion="paper", search="bo",
                            max_evals=3, n_passes=2, nu_range=(1, 16), chunk_examples=2,
                            seed=None)
    res["cal_none"] = (none.nu, [(e.nu, e.objective, e.se) for e in none.evaluations])
    if world > 1:
        other = small_model()
        if rank == world - 1:
            with torch.no_grad():
                other[2].bias.add_(1e-6)
        res["mismatch"] = caught(lambda: attnuq.predict(other, x, nu=4, n_samples=4))
        res["mismatch_cal"] = caught(lambda: attnuq.calibrate(other, batches, n_passes=3))
        flaky = Flaky(model, fail=rank == 1).eval()
        res["raise"] = caught(lambda: attnuq.predict(flaky, x, nu=4, n_samples=4,
                                                     chunk_examples=1))
        res["after"] = attnuq.predict(model, x, nu=4, n_samples=7, chunk_examples=3,
                                      chunk_passes=3).samples  # the group still works
        # the bench runner is the harness's: skipped where only the library is installed
        res["runner"] = runner(rank, world, Path(sys.argv[2])) if _has_harness() else None
        res["first"] = first(rank, Path(sys.argv[2]))
        torch.save(res, Path(sys.argv[2]) / f"same_partial_rank{rank}.pt")
        res["dead"] = dead(rank, world)
    return res


def _has_harness() -> bool:
    from importlib.util import find_spec

    try:
        return find_spec("attnuq_bench.suites._runner") is not None
    except ModuleNotFoundError:
        return False


def runner(rank: int, world: int, out: Path) -> dict[str, Any]:
    """The bench runner on a fake suite: 5 groups (whole groups per rank), then 1 group of 4
    methods (items dealt out), each setup logged with its rank."""
    from attnuq.distributed import WorkerDone, is_active, is_writer
    from attnuq_bench.suites._runner import Group, RunStore, run_items

    res: dict[str, Any] = {}
    for name, groups in (
        ("whole", [Group(parts=(f"g{i}",), methods=["a", "b"], reuse=1) for i in range(5)]),
        ("items", [Group(parts=("one",), methods=["a", "b", "c", "d"], reuse=1)]),
        # a and d share work (as sa-paper and sa-conformal share SA draws): dealt as one unit
        ("bundle", [Group(parts=("one",), methods=["a", "b", "c", "d"], reuse=1,
                          together=[("a", "d")])]),
    ):
        root = out / f"runner_{name}_w{world}"
        store = RunStore(root, suite="fake", info={"command": "t", "date": "d", "machine": "m"})
        log = root / f"setup_rank{rank}.txt"

        writers: list[tuple[str, bool]] = []  # (group, is_writer) of each setup here

        def setup(g: Group, log: Path = log, writers: list[tuple[str, bool]] = writers) -> str:
            writers.append((g.parts[0], is_writer()))
            log.parent.mkdir(parents=True, exist_ok=True)
            with log.open("a") as fh:
                fh.write(f"{g.parts[0]}\n")
            return g.parts[0]

        def one(ctx: str, g: Group, m: str) -> dict[str, Any]:
            if m == "c":
                raise ValueError("method c fails")
            # a method calling predict on its own: local to this rank (no collective)
            return {"method": m, "group": ctx, "rank": rank, "sharded": is_active(),
                    "writer": is_writer(), "value": local_value()}

        try:
            summary = run_items(store, groups, setup, one, progress=False)
            res[name] = ("returned", summary.done, summary.reused, sorted(summary.failed))
        except WorkerDone as exc:
            res[name] = ("worker_done", str(exc))
        res[name + "_setups"] = log.read_text().split() if log.exists() else []
        res[name + "_writers"] = list(writers)
        try:
            s2 = run_items(store, groups, setup, one, progress=False)
            res[name + "_again"] = ("returned", s2.done, s2.reused)
        except WorkerDone:
            res[name + "_again"] = ("worker_done",)
    return res


def first(rank: int, out: Path) -> dict[str, Any]:
    """primary_first: rank 0 makes a cache file, then the other ranks find it (not writers)."""
    from attnuq.distributed import is_writer, primary_first

    cache = out / "primary_first_cache.txt"

    def work() -> dict[str, Any]:
        found = cache.exists()
        if not found:
            time.sleep(0.5)  # a slow "training": the others must still wait for it
            cache.write_text(str(rank))
        return {"rank": rank, "found": found, "writer": is_writer()}

    got = primary_first("test cache", work)
    return {**got, "writer_after": is_writer(), "content": cache.read_text()}


def dead(rank: int, world: int) -> dict[str, Any]:
    """The last rank exits before the call; the others must fail, not hang."""
    if rank == world - 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)
    model = small_model()
    x, _ = data()
    t0 = time.monotonic()
    out = caught(lambda: attnuq.predict(model, x, nu=4, n_samples=4))
    return {"error": out, "seconds": time.monotonic() - t0,
            "is_rank_error": out[0] == RankError.__name__}


def run_rank(scenario: str, out: Path) -> None:
    """This process is one rank (env as torchrun's): run ``scenario``, save its results."""
    timeout = float(os.environ.get("TEST_DIST_TIMEOUT", "60"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    res = {"same": same}[scenario](rank, world)
    torch.save(res, out / f"{scenario}_rank{rank}.pt")
    # no destroy_process_group: a peer may be gone (the dead-rank case); the process exits


def fork_all(out: Path, plan: list[dict[str, Any]]) -> None:
    """Fork every rank of every planned group from this (already imported) process."""
    import json

    import scipy.stats  # noqa: F401 (imported once here, not in every rank)

    children: dict[int, tuple[str, int]] = {}
    for spec in plan:
        d = Path(spec["out"])
        for r in range(spec["world"]):
            pid = os.fork()
            if pid == 0:  # the rank
                code = 1
                try:
                    log = os.open(d / f"rank{r}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                    os.dup2(log, 1)
                    os.dup2(log, 2)
                    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(spec["world"]),
                                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
                    sys.argv = [sys.argv[0], spec["scenario"], str(d)]
                    run_rank(spec["scenario"], d)
                    code = 0
                except BaseException:
                    import traceback

                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            children[pid] = (spec["out"], r)
    codes: dict[str, dict[int, int]] = {}
    for _ in range(len(children)):
        pid, status = os.wait()
        d, r = children[pid]
        codes.setdefault(d, {})[r] = os.waitstatus_to_exitcode(status)
    (out / "exit_codes.json").write_text(json.dumps(codes))


def main() -> None:
    if sys.argv[1] == "--fork":
        import json

        fork_all(Path(sys.argv[2]), json.loads(sys.argv[3]))
        return
    run_rank(sys.argv[1], Path(sys.argv[2]))


if __name__ == "__main__":
    main()
