"""The method loop of every suite: items by name, one JSON per finished item, resume and merge.

A suite's work is a list of :class:`Group` s -- e.g. one (data set, split) of UCI, one seed of
PhysioNet, the one test period of ETT -- each with the method names to run on it, chosen from
the methods registry (:func:`attnuq_bench.methods.make_method`) or the suite's own rows.
:func:`run_items` walks them:

* an item (group, method) whose JSON exists, is a valid record and was run with the group's
  ``reuse`` key (the config that shapes the result: budget, backbone recipe, ...) and on the
  group's ``data`` (a digest of the data it reads, :mod:`attnuq_bench.suites._digests`,
  stored in the record as ``data_digest``) is reused; a torn file is redone with a
  :class:`~attnuq._io.CorruptFileWarning`, one of another ``reuse`` key or other data (or
  without a ``data_digest``: written before digests were recorded, see
  ``python -m attnuq_bench.suites._digests``) is redone with a printed message;
* the group's ``setup`` (load data, train or load the backbone) runs once, only if some
  item of the group is to be done;
* each item's record gets its wall time and provenance (``run_info``: command, date, machine,
  :func:`attnuq._runtime.run_info`) and is written atomically to its own JSON
  (:meth:`RunStore.save`); a method that raises writes ``<method>.err.txt`` instead (listed by
  :meth:`RunStore.errors`, retried by the next invocation) and the loop goes on.

So an interrupted run resumes where it stopped, and invocations that ran other methods or other
groups merge: the page is rendered from every stored record (:meth:`RunStore.records`).

Under a ``torch.distributed`` process group (``torchrun ... -m attnuq.cli bench <suite>``) the
ranks share the items: rank 0 decides what is to do (the stored records, as above) and tells
the others; with at least as many groups to do as ranks, each group goes whole to one rank
(round robin: its ``setup``, e.g. a backbone trained and cached, runs once), else the items are
dealt out one by one (round robin; a bundle of :attr:`Group.together`, methods that share
work such as one set of SA draws, as one item) and a group held by several ranks is set up
by the lowest of them first, then by the others (which then find its caches; only the first
holder has :func:`attnuq.distributed.is_writer` true during ``setup``, the flag the suites'
setup writes check, so each is written once). Each rank saves the records of
its own items (one writer per file, atomic; the ranks share the results folder: one machine, or
a shared file system); ``on_saved`` runs on rank 0 only. ``setup`` and ``run_one`` run inside
:func:`attnuq.distributed.local`: the ``predict`` / ``calibrate`` calls of a rank's own item
run in that rank alone. When every rank is done, rank 0 returns
the summary of all of them and the others raise :class:`attnuq.distributed.WorkerDone`, so
that the suite's page is written once, by rank 0.

Examples
--------
>>> import tempfile, pathlib
>>> store = RunStore(pathlib.Path(tempfile.mkdtemp()), suite="demo",
...                  info={"command": "demo", "date": "d", "machine": "m"})
>>> g = Group(parts=("setA",), methods=["m1", "m2"], reuse={"epochs": 1})
>>> calls = []
>>> def setup(group):
...     calls.append(group.parts)
...     return 10
>>> def run_one(ctx, group, method):
...     return {"method": method, "value": ctx}
>>> run_items(store, [g], setup, run_one, progress=False).done
2
>>> run_items(store, [g], setup, run_one, progress=False).reused, calls  # setup ran once
(2, [('setA',)])
>>> sorted(r["method"] for r in store.records())
['m1', 'm2']
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnuq._io import atomic_write_json, atomic_write_text, read_json_or_none

__all__ = ["Group", "Interrupted", "RunStore", "RunSummary", "SkipGroup", "credits",
           "data_matches", "data_mismatch", "reuse_key", "run_items"]


class Interrupted(KeyboardInterrupt):
    """``KeyboardInterrupt`` (SIGINT) inside :func:`run_items`, saying where: the item (or the
    group's setup) that was running and how many items this invocation had saved; every item
    saved so far stays, and the same command resumes (``attnuq bench`` prints it, exit 130).

    Examples
    --------
    >>> str(Interrupted("uci runs", "concrete/split0/gaussian", 3))
    'uci runs stopped at concrete/split0/gaussian (3 item(s) saved by this run)'
    """

    def __init__(self, what: str, where: str, saved: int) -> None:
        super().__init__(f"{what} stopped at {where} ({saved} item(s) saved by this run)")
        self.what, self.where, self.saved = what, where, saved


def data_matches(record: Mapping[str, Any], data: str | None) -> bool:
    """Whether ``record`` was computed on the data of digest ``data`` (always, when ``data`` is
    None: not checked). A record without a ``data_digest`` matches no digest: nothing says on
    which data it was computed (``python -m attnuq_bench.suites._digests`` stamps records
    written before digests were recorded, from the data files they were computed on).

    >>> data_matches({"data_digest": "ab"}, "ab"), data_matches({}, "ab"), data_matches({}, None)
    (True, False, True)
    """
    return data is None or record.get("data_digest") == data


def data_mismatch(record: Mapping[str, Any], data: str | None) -> str:
    """Why ``record`` does not match ``data`` (for the redo messages)."""
    old = record.get("data_digest")
    if old is None:
        return ("has no data digest (written before digests were recorded; stamp such records "
                "with python -m attnuq_bench.suites._digests)")
    return f"was run on other data (digest {old}, now {data})"


class SkipGroup(Exception):
    """Raised by a group's ``setup`` when the group cannot run here (an optional extra or a
    data file is missing): its items are left undone, not failed, and the loop goes on."""


@dataclass(frozen=True)
class Group:
    """Items sharing one setup: ``parts`` name the folder (``runs/<parts...>/<method>.json``),
    ``methods`` the method names in run order, ``reuse`` the key a stored record must carry to
    be reused (``method_reuse[m]`` instead for a method whose key differs, e.g. one that
    depends on ``--ensemble``), ``payload`` whatever the suite's ``setup`` needs (not
    compared). ``data``: the digest of the data the group's items read (``None``: not
    checked), kept in every record it saves. ``together``: bundles of methods that share
    work inside one process (e.g.
    ``("sa-paper", "sa-conformal")``: one set of SA draws scores both rows); under a process
    group the items of a bundle still to do go to one rank as one unit, in ``methods`` order
    (names not among ``methods`` are ignored). ``accept(record, context)``: ``None`` when a
    stored record may be reused, else the reason it may not (it is then done again); called
    with ``context=None`` before the setup and, when the setup runs, again with its context
    (e.g. the record was scored on another backbone than the one the setup loaded)."""

    parts: tuple[str, ...]
    methods: Sequence[str]
    reuse: Any = None
    payload: Any = None
    method_reuse: Mapping[str, Any] = field(default_factory=dict)
    together: Sequence[Sequence[str]] = ()
    data: str | None = None
    accept: Callable[[Mapping[str, Any], Any], str | None] | None = None

    def reuse_for(self, method: str) -> Any:
        """The reuse key of ``method``'s record in this group."""
        return self.method_reuse.get(method, self.reuse)

    def __post_init__(self) -> None:
        bad = [p for p in self.parts if not p or "/" in p or p in (".", "..")]
        if bad:
            raise ValueError(f"group parts must be plain folder names, got {bad!r}")
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"methods of group {self.parts} repeat: {list(self.methods)}")
        seen: set[str] = set()
        for b in self.together:
            if isinstance(b, str) or not all(isinstance(m, str) for m in b):
                raise TypeError(f"together must hold sequences of method names, got {b!r}")
            if seen & set(b) or len(set(b)) != len(b):
                raise ValueError(f"a method is in two bundles of together={self.together!r}")
            seen |= set(b)

    def units(self, todo: Sequence[str]) -> list[list[str]]:
        """``todo`` cut into the units dealt to ranks: each bundle of :attr:`together` one unit
        (its members in ``todo``, in order), every other method alone.

        Examples
        --------
        >>> g = Group(parts=("x",), methods=list("abcd"), together=[("a", "c")])
        >>> g.units(list("abcd")), g.units(["b", "c", "d"])
        ([['a', 'c'], ['b'], ['d']], [['b'], ['c'], ['d']])
        """
        bundle = {m: tuple(b) for b in self.together for m in b}
        out: list[list[str]] = []
        placed: set[str] = set()
        for m in todo:
            if m in placed:
                continue
            unit = [x for x in todo if x in bundle[m]] if m in bundle else [m]
            placed.update(unit)
            out.append(unit)
        return out


def _default_reuse_of(record: Mapping[str, Any]) -> Any:
    return record.get("reuse")


def _default_valid(record: Any) -> bool:
    return isinstance(record, dict) and "method" in record


@dataclass
class RunStore:
    """The run JSONs of one suite under ``root`` (``root/<parts...>/<method>.json``).

    Parameters
    ----------
    root
        Folder of the run records (e.g. ``docs/results/uci/runs``).
    suite
        Name used in messages.
    info
        Provenance of this invocation (:func:`attnuq._runtime.run_info`); each saved record
        gets it with the date of its own save, plus ``started`` (the invocation's own date) and
        ``invocation`` (an id telling two invocations of one command apart), which
        :func:`credits` groups by.
    reuse_of
        Where a record keeps its reuse key (default: ``record["reuse"]``, which
        :meth:`save` sets from the group when the record has none).
    what
        What the reuse key is called in the redo message (``"budget"``, ``"config"``).
    valid
        Whether a parsed file is a finished record (else it is treated as torn).
    """

    root: Path
    suite: str
    info: Mapping[str, Any] = field(default_factory=dict)
    reuse_of: Callable[[Mapping[str, Any]], Any] = _default_reuse_of
    what: str = "config"
    valid: Callable[[Any], bool] = _default_valid

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if self.info:
            self.info = {"started": self.info.get("date"), "invocation": time.time_ns(),
                         **self.info}

    def path(self, parts: Sequence[str], method: str) -> Path:
        return self.root.joinpath(*parts) / f"{method}.json"

    def load(self, parts: Sequence[str], method: str, reuse: Any = None, *,
             check: bool = True, data: str | None = None) -> dict[str, Any] | None:
        """The finished record of ``(parts, method)``, or ``None`` when it has to be (re)done
        (missing; torn, with a warning; when ``check``: run under another ``reuse`` key, or,
        when ``data`` is given, on data of another digest or of none recorded, with a
        message)."""
        path = self.path(parts, method)
        rec = read_json_or_none(path, "run", validate=lambda r: self.valid(r) and (
            r.get("method") == method))
        if rec is None or not check:
            return rec
        old = self.reuse_of(rec)
        if old != reuse:
            print(f"[{self.suite}] {path} was run with {self.what} {json.dumps(old)}; redoing "
                  f"it with {json.dumps(reuse)}", flush=True)
            return None
        if not data_matches(rec, data):
            print(f"[{self.suite}] {path} {data_mismatch(rec, data)}; redoing it", flush=True)
            return None
        return dict(rec)

    def save(self, record: dict[str, Any], parts: Sequence[str], method: str, *,
             reuse: Any = None, data: str | None = None) -> Path:
        """Write ``record`` (with ``run_info``: this invocation's provenance, today's date, and
        ``data_digest`` when ``data`` is given) atomically and drop the item's ``.err.txt``;
        returns the path."""
        from attnuq._runtime import run_info

        if record.get("method") != method:
            raise ValueError(f"record of method {record.get('method')!r} saved as {method!r}")
        if self.reuse_of is _default_reuse_of:
            record.setdefault("reuse", reuse)
        if data is not None:
            record["data_digest"] = data
        record["run_info"] = {**self.info, "date": run_info()["date"]}
        path = self.path(parts, method)
        atomic_write_json(path, record, indent=1)
        err = path.with_suffix(".err.txt")
        if err.exists():
            err.unlink()
        return path

    def fail(self, exc: BaseException, parts: Sequence[str], method: str) -> Path:
        """Record a failed item (``<method>.err.txt``: the error and its traceback)."""
        err = self.path(parts, method).with_suffix(".err.txt")
        atomic_write_text(err, f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}")
        return err

    def records(self, pattern: str = "**/*.json") -> list[dict[str, Any]]:
        """Every valid record matching ``pattern`` under ``root`` (sorted by path; torn files
        are left out with a warning)."""
        out = [read_json_or_none(p, "run", validate=self.valid)
               for p in sorted(self.root.glob(pattern))]
        return [r for r in out if r is not None]

    def errors(self, pattern: str = "**/*.err.txt") -> list[Path]:
        """The failed items' ``.err.txt`` files (sorted)."""
        return sorted(self.root.glob(pattern))


@dataclass
class RunSummary:
    """What :func:`run_items` did: items ``done`` now, ``reused`` from disk, ``failed``, and
    the groups ``skipped`` (``parts -> reason``, from :class:`SkipGroup`)."""

    done: int = 0
    reused: int = 0
    failed: list[str] = field(default_factory=list)
    skipped: dict[tuple[str, ...], str] = field(default_factory=dict)


def reuse_key(config: Mapping[str, Any], free: Iterable[str] = ()) -> dict[str, Any]:
    """``config`` without the keys that do not shape a result (``free``: which methods to run,
    progress bars, threads, output paths...), as the reuse key of a :class:`Group`.

    >>> reuse_key({"epochs": 3, "threads": 2, "methods": ["a"]}, free=("threads", "methods"))
    {'epochs': 3}
    """
    free = set(free)
    return {k: v for k, v in config.items() if k not in free}


def credits(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Which invocation produced which records: one entry per invocation (``run_info``
    command and ``invocation`` id; records without an id: per command), in order of date, with
    its ``date`` (the invocation's ``started``, else its records' first date), ``machine`` and
    the sorted ``methods``.

    >>> credits([{"method": "b", "run_info": {"command": "c1", "date": "2", "machine": "m"}},
    ...          {"method": "a", "run_info": {"command": "c1", "date": "1", "machine": "m"}}])
    [{'command': 'c1', 'date': '1', 'machine': 'm', 'methods': ['a', 'b']}]
    """
    by: dict[tuple[str, Any], dict[str, Any]] = {}
    for r in records:
        info = r.get("run_info") or {}
        cmd = str(info.get("command", "?"))
        date = info.get("started") or info.get("date", "?")
        e = by.setdefault((cmd, info.get("invocation")), {
            "command": cmd, "date": date, "machine": info.get("machine", "?"),
            "methods": set()})
        e["date"] = min(e["date"], date)
        e["methods"].add(r.get("method", "?"))
    out = [{**e, "methods": sorted(e["methods"])} for e in by.values()]
    return sorted(out, key=lambda e: e["date"])


def run_items(
    store: RunStore,
    groups: Iterable[Group],
    setup: Callable[[Group], Any],
    run_one: Callable[[Any, Group, str], dict[str, Any]],
    *,
    progress: bool = True,
    desc: str | None = None,
    rerun: Iterable[str] = (),
    on_saved: Callable[[Group, str, dict[str, Any]], None] | None = None,
    distributed: bool | None = None,
) -> RunSummary:
    """Run every (group, method) item not yet stored (see the module docstring).

    ``setup(group)`` returns the group's context (called once, only when an item is to do);
    ``run_one(context, group, method)`` returns the item's record (a dict with ``"method"``),
    to which the runner adds ``wall_seconds`` and ``run_info`` before saving it. Methods in
    ``rerun`` are run again even when stored. ``on_saved(group, method, record)`` is called
    after each save (e.g. to rewrite a partial page). Exceptions of ``run_one`` are recorded
    (:meth:`RunStore.fail`) and printed; ``setup`` may raise :class:`SkipGroup` to leave a group
    undone; its other exceptions and ``KeyboardInterrupt`` propagate (every item saved so far
    stays). ``distributed``: share the items across the ranks of the process group (``None``:
    when one is initialised; see the module docstring).
    """
    rerun = set(rerun)
    from tqdm.auto import tqdm

    from attnuq import distributed as _dist

    groups = list(groups)
    if _dist.is_active(distributed):
        return _run_sharded(store, groups, setup, run_one, progress=progress, desc=desc,
                            rerun=rerun, on_saved=on_saved)
    summary = RunSummary()
    bar = tqdm(total=sum(len(g.methods) for g in groups), desc=desc or f"{store.suite} runs",
               disable=not progress)
    where = "the list of items to do"
    try:
        for g in groups:
            where = "what is to do in " + ("/".join(g.parts) or store.suite)
            kept: dict[str, dict[str, Any]] = {}
            for m in g.methods:
                rec = None if m in rerun else store.load(g.parts, m, g.reuse_for(m),
                                                         data=g.data)
                if rec is not None and not _rejected(store, g, m, rec, None):
                    kept[m] = rec
            todo = [m for m in g.methods if m not in kept]
            if not todo:
                summary.reused += len(kept)
                bar.update(len(kept))
                continue
            where = "the setup of " + ("/".join(g.parts) or store.suite)
            try:
                ctx = setup(g)
            except SkipGroup as exc:
                summary.skipped[g.parts] = str(exc)
                bar.update(len(g.methods))
                continue
            # the setup's context (e.g. the backbone it loaded or trained) may reject more
            todo = [m for m in g.methods
                    if m not in kept or _rejected(store, g, m, kept[m], ctx)]
            summary.reused += len(g.methods) - len(todo)
            bar.update(len(g.methods) - len(todo))
            for m in todo:
                where = "/".join((*g.parts, m))
                bar.set_postfix_str(where)
                rec = _run_one_item(store, ctx, g, m, run_one, summary)
                if rec is not None and on_saved is not None:
                    on_saved(g, m, rec)
                bar.update(1)
    except KeyboardInterrupt as exc:
        if isinstance(exc, Interrupted):
            raise
        raise Interrupted(desc or f"{store.suite} runs", where, summary.done) from None
    finally:
        bar.close()
    return summary


def _rejected(store: RunStore, g: Group, m: str, rec: Mapping[str, Any], ctx: Any) -> bool:
    """Whether ``g.accept`` refuses the stored record ``rec`` of ``m`` (saying why)."""
    why = None if g.accept is None else g.accept(rec, ctx)
    if why:
        print(f"[{store.suite}] {store.path(g.parts, m)} {why}; redoing it", flush=True)
    return bool(why)


def _run_one_item(store: RunStore, ctx: Any, g: Group, m: str,
                  run_one: Callable[[Any, Group, str], dict[str, Any]],
                  summary: RunSummary) -> dict[str, Any] | None:
    """One item: run, save (or record the failure); the record, or None when it failed."""
    name = "/".join((*g.parts, m))
    t0 = time.perf_counter()
    try:
        rec = run_one(ctx, g, m)
    except Exception as exc:  # recorded, shown on the page, retried next run
        store.fail(exc, g.parts, m)
        print(f"[{store.suite}] {name} failed: {type(exc).__name__}: {exc}")
        summary.failed.append(name)
        return None
    rec["wall_seconds"] = time.perf_counter() - t0
    store.save(rec, g.parts, m, reuse=g.reuse_for(m), data=g.data)
    summary.done += 1
    return rec


def _run_sharded(
    store: RunStore,
    groups: list[Group],
    setup: Callable[[Group], Any],
    run_one: Callable[[Any, Group, str], dict[str, Any]],
    *,
    progress: bool,
    desc: str | None,
    rerun: set[str],
    on_saved: Callable[[Group, str, dict[str, Any]], None] | None,
) -> RunSummary:
    """:func:`run_items` under a process group (see the module docstring)."""
    from tqdm.auto import tqdm

    from attnuq import distributed as _dist

    rank, world = _dist.rank_world()
    long = _dist.long_group()

    def plan() -> list[list[str]] | None:
        # the plan is made before any setup: ``Group.accept`` sees no context here (a record
        # it would refuse only once the setup has run is reused under a process group)
        if rank != 0:
            return None

        def redo(g: Group, m: str) -> bool:
            if m in rerun:
                return True
            rec = store.load(g.parts, m, g.reuse_for(m), data=g.data)
            return rec is None or _rejected(store, g, m, rec, None)

        return [[m for m in g.methods if redo(g, m)] for g in groups]

    todo = _dist.phase(f"{store.suite}: what is to do", plan, group=long)[0]
    assert todo is not None
    summary = RunSummary()
    summary.reused = sum(len(g.methods) - len(t) for g, t in zip(groups, todo, strict=True))
    live = [gi for gi, t in enumerate(todo) if t]
    holders: dict[int, list[int]] = {}  # group -> ranks holding items of it, lowest first
    mine: dict[int, list[str]] = {}  # group -> this rank's methods
    if len(live) >= world:
        for k, gi in enumerate(live):
            holders[gi] = [k % world]
            if k % world == rank:
                mine[gi] = list(todo[gi])
    else:
        units = [(gi, u) for gi in live for u in groups[gi].units(todo[gi])]
        for k, (gi, u) in enumerate(units):  # a bundle of `together` is one unit
            hs = holders.setdefault(gi, [])
            if k % world not in hs:
                hs.append(k % world)
            if k % world == rank:
                mine.setdefault(gi, []).extend(u)
        for hs in holders.values():
            hs.sort()
    bar = tqdm(total=sum(len(v) for v in mine.values()),
               desc=(desc or f"{store.suite} runs") + f" (rank {rank}/{world})",
               disable=not progress or rank != 0)
    ctxs: dict[int, Any] = {}

    def set_up(gi: int) -> None:
        g = groups[gi]
        try:
            # a rank's own work: its predict/calibrate calls stay local; the group's first
            # holder alone writes its shared setup files (guarded by is_writer in the suites)
            with _dist.local(), _dist.writer(rank == holders[gi][0]):
                ctxs[gi] = setup(g)
        except SkipGroup as exc:
            summary.skipped[g.parts] = str(exc)
            bar.update(len(mine.get(gi, [])))

    def items_of(gi: int) -> None:
        g = groups[gi]
        if gi not in ctxs:
            return  # skipped
        for m in mine.get(gi, []):
            bar.set_postfix_str("/".join((*g.parts, m)))
            with _dist.local(), _dist.writer(True):  # this rank owns the item
                rec = _run_one_item(store, ctxs[gi], g, m, run_one, summary)
            if rec is not None and on_saved is not None and rank == 0:
                on_saved(g, m, rec)
            bar.update(1)
        ctxs.pop(gi, None)

    try:
        if len(live) >= world:  # whole groups: no rank waits for another until the end
            def whole() -> None:
                for gk in mine:
                    set_up(gk)
                    items_of(gk)

            _dist.phase(f"{store.suite}: items", whole, group=long)
        else:  # a group held by several ranks: its lowest holder sets it up first
            steps: list[int | None] = [*live, None]
            for k, nxt in enumerate(steps):
                def step(prev: int | None = steps[k - 1] if k else None,
                         nxt: int | None = nxt) -> None:
                    if prev is not None and rank in holders[prev]:
                        if rank != holders[prev][0]:
                            set_up(prev)
                        items_of(prev)
                    if nxt is not None and rank == holders[nxt][0]:
                        set_up(nxt)

                _dist.phase(f"{store.suite}: items", step, group=long)
    except KeyboardInterrupt as exc:
        if isinstance(exc, Interrupted):
            raise
        raise Interrupted((desc or f"{store.suite} runs") + f" (rank {rank}/{world})",
                          "its items", summary.done) from None
    finally:
        bar.close()
    every = _dist.phase(f"{store.suite}: summaries", lambda: summary, group=long)
    total = RunSummary(reused=summary.reused)
    for s in every:
        total.done += s.done
        total.failed += s.failed
        total.skipped.update(s.skipped)
    if rank != 0:
        raise _dist.WorkerDone(f"rank {rank}: {summary.done} item(s) done; rank 0 writes the page")
    return total
