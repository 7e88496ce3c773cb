"""Training deep-ensemble members inside a bench command, serially or in worker processes.

A suite describes its member recipe as a picklable object with two methods,
``make(index) -> nn.Module`` (a fresh, untrained backbone) and
``train(model, train, val, index) -> report`` (the backbone's training recipe, in place), the
same pair an :class:`attnuq_bench.methods.Task` takes as ``make_model`` / ``train_fn``.
:func:`train_members` trains the members ``indices`` that are not yet in the task's member cache
(``member<index>.pt`` + ``member<index>.json`` with the :class:`~attnuq_bench.methods.Cost`), either
one after the other in this process (``jobs=1``) or in ``jobs`` spawned worker processes, each
with one intra-op thread; the ensemble then reads them from the cache and books their recorded
training times once (:meth:`Task.member` would also train a missing member inside the
ensemble's fit, serially; ``Method.fit`` books such time once as well). A recipe whose
``train`` takes a ``checkpoint`` keyword gets ``member<index>.ckpt`` in the cache: the member's
training writes it every epoch and resumes from it when a killed run is started again (the
file is removed once the member is saved). Every
member seeds its own initialisation and training (the recipes call ``torch.manual_seed``
themselves), so a member is bit-identical whichever process trains it, as long as both use one
thread.

Examples
--------
>>> from attnuq_bench.suites._members import check_member_jobs
>>> check_member_jobs(2)
2
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from attnuq._validation import check_positive_int
from attnuq_bench.methods._base import Cost, load_member, save_member

__all__ = [
    "MemberRecipe",
    "cache_text",
    "cached_backbone",
    "cached_state",
    "check_member_jobs",
    "jobs_text",
    "load_or_train_backbone",
    "member_cache_dir",
    "member_checkpoint",
    "recipe_spec",
    "takes_checkpoint",
    "train_members",
]


class MemberRecipe(Protocol):
    """What :func:`train_members` needs from a suite (must pickle for ``jobs > 1``)."""

    def make(self, index: int) -> nn.Module: ...

    def train(self, model: nn.Module, train: Any, val: Any, index: int) -> Any: ...


def check_member_jobs(jobs: int) -> int:
    """Validate ``--member-jobs``: a positive int (``1`` = train members in this process)."""
    return check_positive_int(jobs, "member_jobs")


#: recipe fields that do not change the trained weights (where it runs, whether bars show)
_NOT_SHAPING = ("progress", "device")


def recipe_spec(recipe: Any, *, drop: Sequence[str] = ()) -> dict[str, Any]:
    """Everything in a dataclass ``recipe`` that shapes the models it trains, as plain JSON.

    Tensor fields (the training and early-stopping windows) enter by their digest
    (:func:`attnuq._io.tensor_digest`), so the data file, its split and the window strides are
    part of the spec; ``progress``, ``device`` and the fields in ``drop`` are left out.

    Examples
    --------
    >>> import dataclasses, torch
    >>> @dataclasses.dataclass
    ... class R:
    ...     epochs: int
    ...     train_xy: tuple
    ...     progress: bool = True
    >>> a = recipe_spec(R(3, (torch.zeros(2), torch.ones(2))))
    >>> sorted(a), a == recipe_spec(R(3, (torch.zeros(2), torch.ones(2)), progress=False))
    (['epochs', 'recipe', 'train_xy'], True)
    >>> a == recipe_spec(R(4, (torch.zeros(2), torch.ones(2))))
    False
    """
    import dataclasses

    from attnuq._io import tensor_digest

    if not dataclasses.is_dataclass(recipe) or isinstance(recipe, type):
        raise TypeError(f"recipe must be a dataclass instance, got {type(recipe).__name__}")
    spec: dict[str, Any] = {"recipe": type(recipe).__qualname__}
    for f in dataclasses.fields(recipe):
        if f.name in _NOT_SHAPING or f.name in drop:
            continue
        v = getattr(recipe, f.name)
        if isinstance(v, torch.Tensor):
            v = tensor_digest(v)
        elif isinstance(v, (tuple, list)) and v and all(isinstance(t, torch.Tensor) for t in v):
            v = tensor_digest(*v)
        spec[f.name] = v
    return spec


def member_cache_dir(base: str | Path, recipe: Any) -> Path:
    """``base/<key>``: the member cache of exactly this recipe (``key``: hash of its spec).

    Another epoch cap, architecture, seed or data gets another folder, so members of an older
    recipe are never used as if they were this one's.
    """
    from attnuq._io import cache_key

    return Path(base) / cache_key(recipe_spec(recipe))


def _exit_with_parent(parent: int, poll_seconds: float = 1.0) -> None:
    """Worker initializer: end this worker once process ``parent`` is gone.

    A pool's workers outlive a parent that is killed (``SIGTERM``/``SIGKILL`` skip the pool's
    shutdown), and would go on training members that nobody collects, into the same member
    checkpoints a restarted run resumes from. A daemon thread polls the parent's pid and
    ends the worker with ``os._exit`` when it has changed (the worker was re-parented).
    """
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_seconds)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _train_one(recipe: MemberRecipe, index: int, member_dir: str,
               single_thread: bool = True) -> tuple[int, float]:
    """Train member ``index`` (one thread in a worker) and write it to the member cache.

    Mirrors the training branch of :meth:`attnuq_bench.methods.Task.member` (same timing, same
    files).
    """
    if single_thread:
        torch.set_num_threads(1)
    model = recipe.make(index)
    ckpt = member_checkpoint(member_dir, index) if takes_checkpoint(recipe) else None
    t0 = time.perf_counter()
    if ckpt is None:
        out = recipe.train(model, None, None, index)
    else:
        out = recipe.train(model, None, None, index, checkpoint=ckpt)  # type: ignore[call-arg]
    seconds = getattr(out, "seconds", None)  # a resumed run's report sums its parts' times
    resumed = int(getattr(out, "resumed_from", 0) or 0)
    cost = Cost(fit_seconds=float(seconds) if resumed and seconds is not None
                else time.perf_counter() - t0,
                fit_forward=int(getattr(out, "n_forward", 0)))
    save_member(member_dir, index, model.state_dict(), cost)
    if ckpt is not None:
        ckpt.unlink(missing_ok=True)
    return index, float(cost.fit_seconds)


def member_checkpoint(member_dir: str | Path, index: int) -> Path:
    """``member_dir/member<index>.ckpt``: where member ``index``'s training checkpoints.

    >>> member_checkpoint("/c", 3).name
    'member3.ckpt'
    """
    return Path(member_dir) / f"member{index}.ckpt"


def takes_checkpoint(recipe: Any) -> bool:
    """Whether ``recipe.train`` accepts a ``checkpoint`` keyword (per-epoch resumable members).

    >>> class A:
    ...     def train(self, model, train, val, index, checkpoint=None): ...
    >>> class B:
    ...     def train(self, model, train, val, index): ...
    >>> takes_checkpoint(A()), takes_checkpoint(B())
    (True, False)
    """
    import inspect

    fn = getattr(recipe, "train", None)
    if fn is None:
        return False
    try:
        return "checkpoint" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


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
        (training cost) are written there, where :meth:`attnuq_bench.methods.Task.member` reads
        them.
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
    todo = [i for i in indices if load_member(member_dir, i) is None]  # missing or torn
    if not todo:
        return []
    if jobs == 1:
        for i in todo:
            _, sec = _train_one(recipe, i, str(member_dir), single_thread=False)
            print(f"[members] member {i} trained in {sec:.1f} s", flush=True)
        return todo
    ctx = torch.multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(todo)), mp_context=ctx,
                             initializer=_exit_with_parent, initargs=(os.getpid(),)) as pool:
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
    drop: Sequence[str] = ("member_epochs",),
) -> tuple[nn.Module, dict[str, Any]]:
    """The frozen backbone (member 0): read from ``model_dir``, else trained and saved there.

    The folder records the recipe it was trained under (``recipe.json``: :func:`recipe_spec`
    without ``drop``, e.g. the members' own epoch cap). It is reused unless ``retrain`` when
    that record equals this recipe's; a folder of another recipe is left alone and the backbone
    of this recipe lives in the sibling ``<model_dir>-<key>`` (found there next time). A folder
    written before recipes were recorded (``config.json`` without ``recipe.json``) is reused
    with a printed note saying so. A folder whose saved model or ``train_report.json`` cannot
    be read is trained again (with a :class:`~attnuq._io.CorruptFileWarning`).

    Otherwise ``recipe.make(0)`` is trained with ``recipe.train`` and written with
    ``save(model, dir)``, its training report (``train_report.json``) and ``recipe.json``. Either
    way the model is read back with ``load(dir)`` (the path a user's saved checkpoint takes) and
    moved to ``device``. Returns the model and the training report, with ``"reused"`` telling
    which branch ran and ``"model_dir"`` the folder used.
    """
    import dataclasses
    import json
    import warnings

    from attnuq._io import (
        CorruptFileWarning,
        atomic_write_json,
        cache_key,
        describe_error,
        read_json_or_none,
    )

    model_dir = Path(model_dir)
    spec = recipe_spec(recipe, drop=drop) if dataclasses.is_dataclass(recipe) else None
    if spec is not None:  # as recipe.json reads back (tuples become lists), so a match matches
        spec = json.loads(json.dumps(spec))
    if spec is not None and not retrain and (model_dir / "config.json").is_file():
        held = read_json_or_none(model_dir / "recipe.json", "backbone recipe")
        if held is not None and held != spec:
            other = model_dir.with_name(f"{model_dir.name}-{cache_key(spec)}")
            changed = sorted(k for k in set(held) | set(spec) if held.get(k) != spec.get(k))
            print(f"[backbone] {model_dir} was trained under another recipe (differs in "
                  f"{', '.join(changed)}); using {other}", flush=True)
            model_dir = other
        elif held is None and (model_dir / "recipe.json").exists():
            retrain = True  # a torn recipe record: nothing says what the folder holds
    if (model_dir / "config.json").is_file() and not retrain:
        report = read_json_or_none(model_dir / "train_report.json", "backbone training report",
                                   validate=lambda r: isinstance(r, dict))
        model: nn.Module | None = None
        if report is not None:
            try:
                model = load(model_dir)
            except Exception as exc:  # torn weights or config: train again
                warnings.warn(f"corrupt backbone {model_dir} ({describe_error(exc)}); "
                              "redoing it", CorruptFileWarning, stacklevel=2)
        if model is not None and report is not None:
            if spec is not None and not (model_dir / "recipe.json").is_file():
                print(f"[backbone] {model_dir} does not record its recipe (written before "
                      "recipes were recorded); reused as given, --retrain trains anew",
                      flush=True)
            report = {**report, "reused": True, "model_dir": str(model_dir)}
            return model.to(device), report
    net = recipe.make(0)  # member 0 = the backbone
    rep = recipe.train(net, None, None, 0)
    save(net.cpu(), model_dir)
    report = rep.to_dict()
    atomic_write_json(model_dir / "train_report.json", report, indent=1)
    if spec is not None:
        atomic_write_json(model_dir / "recipe.json", spec, indent=1)
    report = {**report, "reused": False, "model_dir": str(model_dir)}
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


def cached_state(cache: str | Path, make: Callable[[], nn.Module],
                 train: Callable[[nn.Module], dict[str, Any]], *,
                 device: torch.device | str = "cpu") -> tuple[nn.Module, dict[str, Any]]:
    """A backbone cached as a state dict: ``cache/backbone.pt`` + ``cache/backbone.json``.

    When both read back and the weights fit ``make()``'s model, that model is returned with the
    stored record; else (missing, torn or another architecture's weights: the latter two with a
    :class:`~attnuq._io.CorruptFileWarning`) ``train(model)`` trains a fresh ``make()`` in place
    and returns its record (a JSON-able dict with ``epochs_run``), and weights and record are
    written atomically. The caller keys ``cache`` by everything that shapes the backbone.

    Examples
    --------
    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> make = lambda: nn.Linear(2, 1)
    >>> _, info = cached_state(d, make, lambda m: {"epochs_run": 1})
    >>> cached_state(d, make, lambda m: {"epochs_run": 99})[1]  # read back, not trained
    {'epochs_run': 1}
    """
    import warnings

    from attnuq._io import (
        CorruptFileWarning,
        atomic_torch_save,
        atomic_write_json,
        describe_error,
        read_json_or_none,
        torch_load_or_none,
    )

    cache = Path(cache)
    model = make()
    wpath, ipath = cache / "backbone.pt", cache / "backbone.json"
    info = read_json_or_none(ipath, "backbone record",
                             validate=lambda r: isinstance(r, dict) and "epochs_run" in r)
    state = (None if info is None else
             torch_load_or_none(wpath, "backbone", map_location=device, weights_only=True))
    if state is not None:
        try:
            model.load_state_dict(state)
        except (RuntimeError, KeyError) as exc:  # keys or shapes unlike this recipe's model
            warnings.warn(f"corrupt backbone {wpath} ({describe_error(exc)}); redoing it",
                          CorruptFileWarning, stacklevel=2)
            model, state = make(), None
    if state is None or info is None:
        info = train(model)
        atomic_torch_save(model.state_dict(), wpath)
        atomic_write_json(ipath, info)
    return model, dict(info)


def cached_backbone(cache: Path, spec: dict[str, Any], seed: int, make: Callable[[], nn.Module],
                    train: Callable[[nn.Module, Path], dict[str, Any]]
                    ) -> tuple[nn.Module, dict[str, Any]]:
    """The backbone of ``seed`` under ``cache/backbones/<cache_key(spec)>/seed<seed>/``, in
    ``eval()`` mode, with its record plus ``cache_key`` (the folder's name).

    ``spec`` is everything that shapes the backbone (recipe and data digest), written beside
    as ``spec.json`` (by the writer only). The weights are :func:`cached_state`'s:
    ``train(model, checkpoint)`` trains a fresh ``make()`` in place, resuming from
    ``checkpoint`` (``seed<seed>/train.ckpt``) after a killed run; the checkpoint is removed
    once the backbone is saved.
    """
    from attnuq._io import atomic_write_json, cache_key, read_json_or_none
    from attnuq.distributed import is_writer

    folder = Path(cache) / "backbones" / cache_key(spec)
    sub = folder / f"seed{seed}"
    sub.mkdir(parents=True, exist_ok=True)
    if is_writer() and read_json_or_none(folder / "spec.json", "cache spec") != spec:
        atomic_write_json(folder / "spec.json", spec, indent=1)
    model, info = cached_state(sub, make, lambda m: train(m, sub / "train.ckpt"))
    (sub / "train.ckpt").unlink(missing_ok=True)
    model.eval()
    return model, {**info, "cache_key": folder.name}
