"""``attnuq bench uci``: FT-Transformer on the UCI regression splits, SA against the baselines.

For each data set and split (:func:`attnuq_bench.data.uci.load_uci`: 80 % fit / 10 % val / 10 % cal
of the training split, fixed seed; standardised with fit statistics) one FT-Transformer
backbone (rtdl default recipe, early stopping on validation RMSE) is trained and cached; every
post-hoc method uses that same frozen model, retraining methods use ``make_model(seed)`` with the
same recipe. Each (data set, split, method) run writes ``runs/<set>/split<K>/<method>.json``
(atomically); existing valid files of the same budget and the same data (``data_digest``:
:func:`attnuq_bench.suites._digests.split_digest` of the loaded split) are skipped, so an
interrupted run resumes, and a changed data set is run again. A torn or unreadable run file
is redone with a warning; one written under another
budget is redone with a message. The backbone and ensemble members are cached under
``<cache>/<set>/split<K>/[seed<S>/]<key>/``, ``key`` a hash of everything that shapes them
(blocks, epochs, patience, batch size, seed, recipe, and the fit/val data), so another
``--max-epochs`` or ``--n-blocks`` trains a new backbone instead of reusing the old one.

``--seed S`` offsets every seed (backbone and member initialisation and batch order, each
method's own ``seed``, the scoring generators) by ``100000 * S``; ``S = 0`` keeps the original
seeds. Runs with ``S != 0`` are written to ``runs/<set>/split<K>/seed<S>/<method>.json`` (models
to ``_models/<set>/split<K>/seed<S>``), so seeds never mix; the table aggregates the runs of
``--seed`` only. ``--device`` moves the data and every model there (scoring runs on the CPU).
Data sets may get their own ``--batch-size``/``--max-epochs`` by separate invocations; each run
JSON records its budget and the page lists the budget per data set. ``--batch-size auto`` (the
default) takes 32 when the fit part has <= 2,000 rows, 128 when <= 20,000, else 256; the
resolved number is what the budget and the backbone cache key record.

Scores on the test part (:func:`attnuq_bench.suites._scoring.sample_scores`, targets in original
units): ``rmse`` of the point prediction (the frozen/deterministic output where the method has
one, else the predictive mean; for :class:`attnuq.SAPredictive` its centre, which is the frozen
output unless ``recentre`` chose the draws' mean), PIT W1 native and after one pooled spread
factor, native coverage and width of the central 95 % interval, ``coverage``/``width`` after
*unified coverage calibration* (each interval scaled about its mean by the split-conformal
factor fitted on the ``cal`` part, :func:`attnuq_bench.methods.coverage_scale`), CRPS,
Gaussian NLL, and the cost (``fit_seconds``, ``fit_forward``, ``predict_forward_per_input``).

Runs on the bench spine (:mod:`attnuq_bench.suites._runner`: one JSON per (set, split, method);
:mod:`attnuq_bench.suites._page`). Writes ``<out>/runs/...json``, PIT histograms
``<out>/pit_<set>.png``, the table ``--table`` (default ``<out>.md``) with its JSON twin
(``.json``: provenance, headline, tables, the Implementations block each run recorded, the
command's budget) and the ``uci`` key of ``<out>/../summary.json``. ``--render-only`` writes the
table again from the stored run JSON and twin alone (:func:`render_page`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from attnuq._io import atomic_write_json, atomic_write_text, cache_key, read_json_or_none
from attnuq.distributed import is_writer
from attnuq_bench.suites import register
from attnuq_bench.suites._digests import split_digest
from attnuq_bench.suites._members import cached_state
from attnuq_bench.suites._options import add_methods_argument, check_method_names
from attnuq_bench.suites._page import (
    Page,
    pit_figure,
    read_twin,
    require_twin,
    twin_path,
    update_summary,
)
from attnuq_bench.suites._runner import Group, RunStore, run_items
from attnuq_bench.suites._scoring import sample_scores, to_cpu
from attnuq_bench.suites._uci_page import build_page, summary

__all__ = ["DEFAULT_METHODS", "aggregate", "render_page", "run", "run_one", "write_table"]

DEFAULT_METHODS: tuple[str, ...] = (
    "sa", "sa-paper", "sa-scale", "sa-crps", "sa-conformal", "sa-debiased", "sa-coverage",
    "sa-recentred", "sa-floor", "sa-layer", "sa-centre", "mc-dropout", "ensemble", "swag",
    "multiswag", "ivon",
    "laplace", "hsa", "conformal", "gaussian")
_SAMPLED = {"sa-paper", "sa-scale", "sa-crps", "sa-conformal", "mc-dropout", "swag", "multiswag",
            "ivon", "hsa", "sa", "sa-debiased", "sa-coverage", "sa-recentred", "sa-floor",
            "sa-layer", "sa-centre"}
_LEVEL = 0.95
#: ``--batch-size auto``: (fit rows at most, batch size), else the last
AUTO_BATCH = ((2_000, 32), (20_000, 128), (None, 256))


def _batch_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"--batch-size must be 'auto' or an int >= 1, got "
                                         f"{text!r}")
    return value


def batch_size_for(batch_size: int | str, n_fit: int) -> int:
    """The batch size of a data set whose fit part has ``n_fit`` rows (``"auto"``: see
    :data:`AUTO_BATCH`; an int is kept).

    >>> batch_size_for("auto", 741), batch_size_for("auto", 8592), batch_size_for("auto", 32925)
    (32, 128, 256)
    >>> batch_size_for(64, 10)
    64
    """
    if batch_size != "auto":
        return int(batch_size)
    return next(b for cap, b in AUTO_BATCH if cap is None or n_fit <= cap)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from attnuq_bench.data.uci import UCI_DATASETS

    p.add_argument("--datasets", nargs="+", default=list(UCI_DATASETS), metavar="NAME",
                   help="UCI set folder names (default: the six in the data dir)")
    p.add_argument("--splits", type=int, default=5, help="number of splits, 0..N-1 (default 5)")
    p.add_argument("--first-split", type=int, default=0, help="first split index (default 0)")
    add_methods_argument(p, default=DEFAULT_METHODS,
                         help=f"methods (default: all): {', '.join(DEFAULT_METHODS)}")
    p.add_argument("--data-dir", default=None,
                   help="folder holding <name>/ or uci/<name>/ ('bundled' for the package copy) "
                        "(default: $ATTNUQ_DATA_DIR, else ../shared/data)")
    p.add_argument("--out", default="docs/results/uci", help="results folder (JSON, PNG)")
    p.add_argument("--table", default=None, help="markdown table path (default: <out>.md)")
    p.add_argument("--cache-dir", default=None,
                   help="trained backbones/members (default: <out>/_models, git-ignored)")
    p.add_argument("--n-blocks", type=int, default=3, help="FT-Transformer blocks (default 3)")
    p.add_argument("--max-epochs", type=int, default=100, help="training epoch budget")
    p.add_argument("--patience", type=int, default=16, help="early-stopping patience (epochs)")
    p.add_argument("--batch-size", type=_batch_arg, default="auto",
                   help="training batch size, or 'auto' (default): 32 for a fit part of <= 2,000 "
                        "rows, 128 for <= 20,000, else 256")
    p.add_argument("--n-samples", type=int, default=100, help="Monte Carlo samples per input")
    p.add_argument("--swag-epochs", type=int, default=10,
                   help="SWAG epochs after the backbone's training")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument("--aggregate-only", action="store_true",
                   help="only rebuild the table and plots from existing JSON")
    p.add_argument("--render-only", action="store_true",
                   help="write the table again from the stored run JSON and the table's JSON "
                        "twin (same provenance and budget lines), no plots")


#: seed offset per unit of ``--seed``
_SEED_STRIDE = 100_000


def _seed(args: argparse.Namespace) -> int:
    return int(getattr(args, "seed", 0) or 0)


def _parts(name: str, split: int, seed: int) -> tuple[str, ...]:
    """Folder parts of the run JSONs of (data set, split, seed) under ``runs/``."""
    return (name, f"split{split}") if seed == 0 else (name, f"split{split}", f"seed{seed}")


def _method_kwargs(name: str, args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    progress = not args.no_progress
    if name in _SAMPLED:
        kw["n_samples"] = args.n_samples
    if name == "sa" or name.startswith("sa-"):
        kw["progress"] = progress
    if name in ("swag", "multiswag"):
        kw.update(epochs=args.swag_epochs, progress=progress)
    if name == "ivon":
        kw.update(max_epochs=args.max_epochs, patience=args.patience, progress=progress)
    return kw


def _budget(args: argparse.Namespace, batch_size: int | str | None = None) -> dict[str, Any]:
    return {
        "n_blocks": args.n_blocks,
        "max_epochs": args.max_epochs,
        "patience": args.patience,
        "batch_size": args.batch_size if batch_size is None else batch_size,
        "n_samples": args.n_samples,
        "swag_epochs": args.swag_epochs,
    }


#: bump when the backbone recipe in :func:`_make_task` changes in a way the options do not show;
#: the text is part of the cache key of every stored backbone (a rewording would retrain them)
_RECIPE = "FTTransformer rtdl defaults, train_regressor (AdamW, early stopping on val RMSE) v1"


def _cache_spec(data: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Everything that shapes the cached backbone and members of one (data set, split, seed).

    The budget that reaches training (blocks, epochs, patience, resolved batch size), the seed
    offset, the recipe, and the digest of the fit/val tensors (the data file and split identity).
    """
    from attnuq._io import tensor_digest

    return {
        "recipe": _RECIPE,
        "dataset": data.name,
        "split": data.split,
        "seed": _seed(args),
        "n_blocks": args.n_blocks,
        "max_epochs": args.max_epochs,
        "patience": args.patience,
        "batch_size": batch_size_for(args.batch_size, len(data.y_fit)),
        "n_features": data.n_features,
        "data": tensor_digest(data.x_fit, data.y_fit, data.x_val, data.y_val),
    }


#: the fields of a backbone's training record that tell two trainings apart (when the records
#: do not both hold the weights' digest)
_BACKBONE_FIELDS = ("epochs_run", "best_epoch", "best_val_rmse_std_units", "n_forward")


def backbone_mismatch(old: Any, cur: Any) -> str | None:
    """Why a record scored on backbone ``old`` (its ``backbone`` entry) may not be reused with
    backbone ``cur`` (the cached one's record), or ``None``: the weights' digests differ, or,
    for records without one, the training records (a backbone trained again need not
    reproduce: float results differ between CPUs, and early stopping amplifies them).

    Examples
    --------
    >>> a = {"epochs_run": 62, "best_epoch": 45, "best_val_rmse_std_units": 0.6198,
    ...      "n_forward": 2296542}
    >>> backbone_mismatch(a, dict(a)) is None
    True
    >>> why = backbone_mismatch(a, {**a, "epochs_run": 74, "best_epoch": 57})
    >>> why.startswith("was scored on another backbone (62 epochs, best 45"), "(74 epochs" in why
    (True, True)
    """
    if not isinstance(old, dict) or not isinstance(cur, dict):
        return None  # a record without its backbone, or no backbone cached: nothing to compare
    if "weights" in old and "weights" in cur:
        same = old["weights"] == cur["weights"]
    else:
        same = all(old.get(f) == cur.get(f) for f in _BACKBONE_FIELDS)
    if same:
        return None

    def said(b: dict[str, Any]) -> str:
        v = b.get("best_val_rmse_std_units")
        return (f"{b.get('epochs_run')} epochs, best {b.get('best_epoch')}, val RMSE "
                f"{v:.4g}" if isinstance(v, float) else f"{b.get('epochs_run')} epochs")

    return f"was scored on another backbone ({said(old)}) than the cached one ({said(cur)})"


def _same_backbone(folder: Path) -> Any:
    """``Group.accept`` of a UCI split: a stored record is reused only with the backbone it
    was scored on (before the setup: the cached backbone's record, if one is cached; after
    it: the backbone the setup loaded or trained)."""
    def accept(rec: Any, ctx: Any) -> str | None:
        if ctx is not None:
            cur = ctx[2]
        elif (folder / "backbone.pt").is_file():
            cur = read_json_or_none(folder / "backbone.json", "backbone record")
        else:
            cur = None
        return backbone_mismatch(rec.get("backbone"), cur)

    return accept


def _make_task(data: Any, args: argparse.Namespace, cache: Path) -> tuple[Any, dict[str, Any]]:
    from attnuq_bench.methods import Task
    from attnuq_bench.models.ft import make_ft_transformer
    from attnuq_bench.training import fit

    progress = not args.no_progress
    seed_base = 100 * data.split + _SEED_STRIDE * _seed(args)
    device = torch.device(getattr(args, "device", None) or "cpu")
    batch_size = batch_size_for(args.batch_size, len(data.y_fit))

    def make_model(seed: int) -> torch.nn.Module:
        model = make_ft_transformer(data.n_features, n_blocks=args.n_blocks, seed=seed_base + seed)
        return model.to(device)

    def train_fn(model: torch.nn.Module, train: Any, val: Any, seed: int,
                 checkpoint: Path | None = None) -> Any:
        return fit(  # the FT recipe: AdamW, lr 1e-4, wd 1e-5, early stopping on val RMSE
            model, train, val, max_epochs=args.max_epochs, patience=args.patience,
            batch_size=batch_size, seed=seed_base + seed, progress=progress,
            desc=f"{data.name}/{data.split} seed {seed}", checkpoint=checkpoint,
        )

    spec = _cache_spec(data, args)
    cache = cache / cache_key(spec)  # backbone and members of exactly this recipe and data
    cache.mkdir(parents=True, exist_ok=True)
    if is_writer() and read_json_or_none(cache / "spec.json", "cache spec") != spec:
        atomic_write_json(cache / "spec.json", spec, indent=1)
    def train(model: torch.nn.Module) -> dict[str, Any]:
        # every finished epoch is checkpointed: a killed run resumes the backbone where it
        # stopped (bit for bit, see attnuq_bench.training), which a full-budget backbone of
        # the larger sets (an hour or more on one thread) needs
        res = train_fn(model, (data.x_fit, data.y_fit), (data.x_val, data.y_val), 0,
                       checkpoint=cache / "train.ckpt")
        # the thread count and CPU kernels of the process that finished the training: its
        # seconds are wall time on that many threads, and a run on other kernels or another
        # thread count does not reproduce the weights
        return {"best_epoch": res.best_epoch, "epochs_run": res.epochs_run,
                "best_val_rmse_std_units": res.best_val, "seconds": res.seconds,
                "n_forward": res.n_forward, "threads": torch.get_num_threads(),
                "cpu_capability": torch.backends.cpu.get_cpu_capability()}

    model, info = cached_state(cache, lambda: make_model(0), train, device=device)
    if is_writer():
        (cache / "train.ckpt").unlink(missing_ok=True)
    from attnuq.montecarlo import model_digest

    info = {**info, "cache_key": cache.name, "weights": model_digest(model)}
    model.eval()
    for p in model.parameters():
        p.requires_grad_(True)
    task = Task(
        model=model, train=(data.x_fit, data.y_fit), val=(data.x_val, data.y_val),
        cal=(data.x_cal, data.y_cal), make_model=make_model, train_fn=train_fn,
        batch_size=batch_size, member_dir=cache,
    )
    return task, info


def run_one(method_name: str, task: Any, data: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Fit ``method_name`` on ``task`` and score it on ``data``'s test part."""
    from attnuq import SAPredictive, metrics
    from attnuq_bench.methods import coverage_scale, make_method, method_implementation

    off = _SEED_STRIDE * _seed(args)
    torch.manual_seed(1234 + data.split + off)
    method = make_method(method_name, **_method_kwargs(method_name, args))
    if off and hasattr(method, "seed"):
        method.seed = int(method.seed) + off
    method.fit(task)
    pred_cal = to_cpu(method.predict(data.x_cal))
    pred = to_cpu(method.predict(data.x_test))
    data = _split_to(data, torch.device("cpu"))
    gen = torch.Generator().manual_seed(4321 + data.split + off)
    sc = sample_scores(pred, data.y_test, y_std=data.y_std, generator=gen, level=_LEVEL)
    point = getattr(pred, "frozen", None)
    if point is None or isinstance(pred, SAPredictive):  # SARegressor's centre is its point
        point = pred.mean
    c = coverage_scale(pred_cal, data.y_cal, level=_LEVEL)
    lo, hi = pred.scaled(c).interval(_LEVEL)
    y64 = data.y_test.double()
    pit = sc.pop("pit")
    return {
        "dataset": data.name,
        "split": data.split,
        "method": method_name,
        "seed": _seed(args),
        "device": str(getattr(args, "device", None) or "cpu"),
        "metrics": {
            "rmse": float(metrics.rmse(point.double(), y64)) * data.y_std,
            **sc,
            "coverage": float(metrics.coverage(lo.double(), hi.double(), y64)),
            "width": float(metrics.interval_width(lo.double(), hi.double())) * data.y_std,
            "scale_factor": c,
        },
        "cost": method.cost.to_dict(),
        "info": method.info(),
        "config": {**method.config(),
                   "budget": _budget(args, batch_size_for(args.batch_size, len(data.y_fit)))},
        "sizes": data.sizes(),
        "pit": [round(float(u), 5) for u in pit.reshape(-1)],
        "implementation": method_implementation(method_name),
    }


def _split_to(data: Any, device: torch.device) -> Any:
    """``data`` (a :class:`~attnuq_bench.data.uci.UCISplit`) with its tensors on ``device``."""
    import dataclasses

    moved = {f.name: getattr(data, f.name).to(device) for f in dataclasses.fields(data)
             if isinstance(getattr(data, f.name), torch.Tensor)}
    return dataclasses.replace(data, **moved)


def _valid_run(r: Any) -> bool:
    return (isinstance(r, dict) and isinstance(r.get("metrics"), dict)
            and all(k in r for k in ("dataset", "split", "method", "cost", "pit")))


def _store(out: Path, info: dict[str, Any] | None = None) -> RunStore:
    return RunStore(out / "runs", suite="uci", info=info or {}, what="budget", valid=_valid_run,
                    reuse_of=lambda r: (r.get("config") or {}).get("budget"))


def run(args: argparse.Namespace) -> Path:
    from attnuq._runtime import run_info
    from attnuq_bench.data.uci import load_uci, n_splits

    torch.set_num_threads(max(1, int(args.threads)))
    seed = _seed(args)
    device = torch.device(getattr(args, "device", None) or "cpu")
    out = Path(args.out)
    table = Path(args.table) if args.table else out.with_suffix(".md")
    twin_path(table)  # a --table that cannot have a JSON twin is refused before any work
    if getattr(args, "render_only", False) and args.aggregate_only:
        raise ValueError("--render-only (the page from <out>.json) and --aggregate-only (the "
                         "page from the run records) are two ways to render: pass one")
    if getattr(args, "render_only", False):
        page = render_page(out, table)
        page.write(table)
        _write_summary(out, aggregate(out, int(page.state.get("seed", 0))))
        return out
    check_method_names(args.methods)
    if args.splits < 1 or args.first_split < 0:
        raise ValueError(f"--splits must be >= 1 and --first-split >= 0, got {args.splits=}, "
                         f"{args.first_split=}")
    if not args.aggregate_only:
        for name in args.datasets:  # a first split past the last one would run nothing
            n = n_splits(name, args.data_dir)
            if args.first_split >= n:
                raise ValueError(f"--first-split {args.first_split} is past the last split of "
                                 f"{name!r}, which has {n} (0..{n - 1})")
    out.mkdir(parents=True, exist_ok=True)
    if is_writer():  # under torchrun: rank 0 (attnuq.distributed)
        atomic_write_text(out / ".gitignore", "_models/\n*.err.txt\n")
    cache_root = Path(args.cache_dir) if args.cache_dir else out / "_models"
    info = run_info()
    if not args.aggregate_only:
        groups = []
        for name in args.datasets:
            last = min(n_splits(name, args.data_dir), args.first_split + args.splits)
            for k in range(args.first_split, last):
                # loaded now: its digest keys the records (a changed data set is redone) and
                # with --batch-size auto its fit size decides the batch size, hence the budget
                held: dict[str, Any] = {"data": load_uci(name, k, data_dir=args.data_dir)}
                bs = batch_size_for(args.batch_size, len(held["data"].y_fit))
                mdir = cache_root / name / f"split{k}"
                folder = (mdir if seed == 0 else mdir / f"seed{seed}") / cache_key(
                    _cache_spec(held["data"], args))
                groups.append(Group(parts=_parts(name, k, seed), methods=list(args.methods),
                                    reuse=_budget(args, bs), payload=(name, k, held),
                                    data=split_digest(held["data"]),
                                    accept=_same_backbone(folder)))

        def setup(g: Group) -> tuple[Any, Any, dict[str, Any]]:
            name, k, held = g.payload
            data = held.pop("data", None) or load_uci(name, k, data_dir=args.data_dir)
            data = _split_to(data, device)
            mdir = cache_root / name / f"split{k}"
            task, backbone = _make_task(data, args, mdir if seed == 0 else mdir / f"seed{seed}")
            return task, data, backbone

        def one(ctx: tuple[Any, Any, dict[str, Any]], g: Group, m: str) -> dict[str, Any]:
            task, data, backbone = ctx
            return {**run_one(m, task, data, args), "backbone": backbone}

        run_items(_store(out, info), groups, setup, one, progress=not args.no_progress,
                  desc="uci runs")
    rows = aggregate(out, seed)
    if args.aggregate_only and not rows:  # an empty page of zero runs is not a result
        raise ValueError(f"--aggregate-only: no run records under {out / 'runs'} to aggregate")
    plot_pits(out, rows)
    write_table(table, out, rows, info, args)
    return out


def aggregate(out: Path, seed: int = 0) -> list[dict[str, Any]]:
    """Every run JSON of ``seed`` under ``out/runs`` (sorted by data set, method, split).

    Seed 0 runs live in ``runs/<set>/split<K>/`` (files without a ``seed`` entry are seed 0),
    others in ``runs/<set>/split<K>/seed<S>/``.
    """
    pattern = "*/split*/*.json" if seed == 0 else f"*/split*/seed{seed}/*.json"
    rows = [r for r in _store(out).records(pattern) if int(r.get("seed", 0)) == seed]
    return sorted(rows, key=lambda r: (r["dataset"], r["method"], r["split"]))


def _order(methods: Any) -> list[str]:
    rank = {m: i for i, m in enumerate(DEFAULT_METHODS)}
    return sorted(methods, key=lambda m: (rank.get(m, len(rank)), m))


def _of(rows: list[dict[str, Any]], ds: str, m: str | None = None) -> list[dict[str, Any]]:
    return [r for r in rows if r["dataset"] == ds and (m is None or r["method"] == m)]


def plot_pits(out: Path, rows: list[dict[str, Any]]) -> list[Path]:
    """One PNG per data set: a PIT histogram per method (test PIT pooled over splits)."""
    paths = []
    for ds in sorted({r["dataset"] for r in rows}):
        panels = {}
        for m in _order({r["method"] for r in _of(rows, ds)}):
            n_sp = len({r["split"] for r in _of(rows, ds, m)})
            panels[f"{m} ({n_sp} split{'s' if n_sp != 1 else ''})"] = [
                u for r in _of(rows, ds, m) for u in r["pit"]]
        paths.append(pit_figure(out / f"pit_{ds}.png",
                                f"UCI {ds}: test PIT histograms (native predictive)", panels))
    return paths


def _write_summary(out: Path, rows: list[dict[str, Any]]) -> None:
    if out.parent.is_dir():
        update_summary(out.parent / "summary.json", "uci", summary(rows, DEFAULT_METHODS))


def _errors(out: Path) -> list[Path]:
    return _store(out).errors("*/split*/*.err.txt")


def write_table(
    table: Path, out: Path, rows: list[dict[str, Any]], info: dict[str, Any],
    args: argparse.Namespace,
) -> Path:
    """Markdown table (and JSON twin, and the summary key): mean ± std over splits per data set
    and method, with SA win/loss lines."""
    twin = read_twin(table)
    page = build_page(out, rows, info, {"budget": _budget(args), "seed": _seed(args)},
                      None if twin is None else twin.get("implementations"),
                      order=DEFAULT_METHODS, errors=_errors(out))
    page.write(table)
    _write_summary(out, rows)
    return table


def render_page(out: Path, table: Path) -> Page:
    """The page ``table`` again from the stored run JSON under ``out`` and the page's twin
    (provenance, budget and seed of the command that wrote it, its Implementations block)."""
    twin = require_twin(table, ": write the table with --aggregate-only first")
    rows = aggregate(Path(out), int(twin["state"].get("seed", 0)))
    return build_page(Path(out), rows, twin["provenance"], twin["state"],
                      twin.get("implementations"), order=DEFAULT_METHODS, errors=_errors(Path(out)))


register(
    "uci",
    help="UCI regression (FT-Transformer): SA against the baselines, standard splits",
    add_arguments=add_arguments,
    run=run,
)
