"""Training deep-ensemble members inside a bench command, serially or in worker processes.

A suite describes its member recipe as a picklable object with two methods,
``make(index) -> nn.Module`` (a fresh, untrained backbone) and
``train(model, train, val, index) -> report`` (the backbone's training recipe, in place), the
same pair an :class:`attnuq.baselines.Task` takes as ``make_model`` / ``train_fn``.
:func:`train_members` trains the members ``indices`` that are not yet in the task's member cache
(``member<index>.pt`` + ``member<index>.json`` with the :class:`~attnuq.baselines.Cost`), either
one after the other in this process (``jobs=1``) or in ``jobs`` spawned worker processes, each
with one intra-op thread; the ensemble then reads them from the cache and books their recorded
training times once (:meth:`Task.member` would also train a missing member inside the
ensemble's fit, serially; ``Method.fit`` books such time once as well). Every
member seeds its own initialisation and training (the recipes call ``torch.manual_seed``
themselves), so a member is bit-identical whichever process trains it, as long as both use one
thread.

Examples
--------
>>> from attnuq.bench._members import check_member_jobs
>>> check_member_jobs(2)
2
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from attnuq._validation import check_positive_int

__all__ = [
    "MemberRecipe",
    "cache_text",
    "check_member_jobs",
    "jobs_text",
    "load_or_train_backbone",
    "train_members",
]


class MemberRecipe(Protocol):
    """What :func:`train_members` needs from a suite (must pickle for ``jobs > 1``)."""

    def make(self, index: int) -> nn.Module: ...

    def train(self, model: nn.Module, train: Any, val: Any, index: int) -> Any: ...


def check_member_jobs(jobs: int) -> int:
    """Validate ``--member-jobs``: a positive int (``1`` = train members in this process)."""
    return check_positive_int(jobs, "member_jobs")


def _paths(member_dir: Path, index: int) -> tuple[Path, Path]:
    p = Path(member_dir) / f"member{index}.pt"
    return p, p.with_suffix(".json")


def _train_one(recipe: MemberRecipe, index: int, member_dir: str,
               single_thread: bool = True) -> tuple[int, float]:
    """Train member ``index`` (one thread in a worker) and write it to the member cache.

    Mirrors the training branch of :meth:`attnuq.baselines.Task.member` (same timing, same files).
    """
    if single_thread:
        torch.set_num_threads(1)
    model = recipe.make(index)
    t0 = time.perf_counter()
    out = recipe.train(model, None, None, index)
    cost = {"fit_seconds": time.perf_counter() - t0,
            "fit_forward": int(getattr(out, "n_forward", 0)),
            "predict_seconds": 0.0, "predict_forward_per_input": 0}
    pt, js = _paths(Path(member_dir), index)
    pt.parent.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, pt)
    js.write_text(json.dumps(cost))
    return index, float(cost["fit_seconds"])


def train_members(
    recipe: MemberRecipe,
    indices: Sequence[int],
    member_dir: str | Path,
    *,
    jobs: int = 1,
) -> list[int]:
    """Train the members ``indices`` missing from ``member_dir`` in ``jobs`` worker processes.

    Parameters
    ----------
    recipe
        A picklable object with ``make(index)`` and ``train(model, train, val, index)`` (see the
        module docstring); ``train`` is called with ``train = val = None``, so the recipe must
        hold its own data.
    indices
        Member indices (``>= 1``; member 0 is the frozen backbone and is never trained here).
    member_dir
        The task's member cache: ``member<index>.pt`` (state dict) and ``member<index>.json``
        (training cost) are written there, where :meth:`attnuq.baselines.Task.member` reads them.
    jobs
        Worker processes (``torch.multiprocessing`` spawn context, one thread each). With
        ``jobs=1`` the members are trained in this process, one after the other, with its
        thread setting.

    Returns
    -------
    The indices trained by this call (those already cached are skipped).

    Examples
    --------
    >>> train_members(object(), [], "/nonexistent")  # nothing asked for: nothing trained
    []
    """
    jobs = check_member_jobs(jobs)
    bad = [i for i in indices if not isinstance(i, int) or i < 1]
    if bad:
        raise ValueError(f"member indices must be ints >= 1 (0 is the backbone), got {bad}")
    todo = [i for i in indices if not all(p.is_file() for p in _paths(Path(member_dir), i))]
    if not todo:
        return []
    if jobs == 1:
        for i in todo:
            _, sec = _train_one(recipe, i, str(member_dir), single_thread=False)
            print(f"[members] member {i} trained in {sec:.1f} s", flush=True)
        return todo
    ctx = torch.multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(todo)), mp_context=ctx) as pool:
        futures = [pool.submit(_train_one, recipe, i, str(member_dir)) for i in todo]
        for f in futures:
            i, sec = f.result()
            print(f"[members] member {i} trained in {sec:.1f} s", flush=True)
    return todo


def load_or_train_backbone(
    recipe: MemberRecipe,
    model_dir: Path,
    *,
    retrain: bool,
    save: Callable[[Any, Path], Any],
    load: Callable[[Path], nn.Module],
    device: torch.device | str,
) -> tuple[nn.Module, dict[str, Any]]:
    """The frozen backbone (member 0): read from ``model_dir``, else trained and saved there.

    A folder with ``config.json`` is reused unless ``retrain``; otherwise ``recipe.make(0)`` is
    trained with ``recipe.train`` and written with ``save(model, model_dir)`` plus its training
    report (``train_report.json``). Either way the model is read back with ``load(model_dir)``
    (the path a user's saved checkpoint takes) and moved to ``device``. Returns the model and the
    training report, with ``"reused"`` telling which branch ran.
    """
    if (model_dir / "config.json").is_file() and not retrain:
        report = json.loads((model_dir / "train_report.json").read_text())
        report["reused"] = True
    else:
        net = recipe.make(0)  # member 0 = the backbone
        rep = recipe.train(net, None, None, 0)
        save(net.cpu(), model_dir)
        report = rep.to_dict()
        (model_dir / "train_report.json").write_text(json.dumps(report, indent=1))
        report["reused"] = False
    return load(model_dir).to(device), report


def jobs_text(jobs: int) -> str:
    """How the members were trained, for a results page: serially or in ``jobs`` workers.

    >>> jobs_text(1), jobs_text(3)
    ('one after the other', 'in 3 parallel worker processes of one thread each')
    """
    return ("one after the other" if jobs == 1
            else f"in {jobs} parallel worker processes of one thread each")


def cache_text(record: dict[str, Any], suite: str) -> str:
    """The page's note on members read from the member cache (``""`` when none was).

    >>> cache_text({"members_from_cache": [1, 2]}, "ett")[:44]
    '; members 1, 2 loaded from the member cache '
    """
    cached = record.get("members_from_cache") or []
    if not cached:
        return ""
    return (f"; members {', '.join(map(str, cached))} loaded from the member cache "
            f"`{suite}/members` written by an earlier invocation (their fit time is the "
            "training time recorded then)")
