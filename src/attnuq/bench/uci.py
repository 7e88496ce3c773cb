"""``attnuq bench uci``: FT-Transformer on the UCI regression splits, SA against the baselines.

For each data set and split (:func:`attnuq.data.uci.load_uci`: 80 % fit / 10 % val / 10 % cal
of the training split, fixed seed; standardised with fit statistics) one FT-Transformer
backbone (rtdl default recipe, early stopping on validation RMSE) is trained and cached; every
post-hoc method uses that same frozen model, retraining methods use ``make_model(seed)`` with the
same recipe. Each (data set, split, method) run writes ``runs/<set>/split<K>/<method>.json``
(atomically); existing valid files of the same budget are skipped, so an interrupted run
resumes. A torn or unreadable run file is redone with a warning; one written under another
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
JSON records its budget and the page lists the budget per data set.

Metrics on the test part (targets in original units for RMSE, width, CRPS and NLL):

* ``rmse``: of the point prediction (the frozen/deterministic output where the method has one,
  else the predictive mean);
* ``w1_native``: W1 distance of the PIT values to ``U(0, 1)`` (randomised PIT for samples,
  ``Phi((y - m)/s)`` for Gaussians); ``w1_scaled``: the same after one pooled spread factor
  (:func:`attnuq.metrics.pit_w1_scaled`; Gaussians are sampled with 1000 draws for it);
* ``coverage_native`` / ``width_native``: the method's own central 95 % interval;
* ``coverage`` / ``width``: after *unified coverage calibration*: every method's interval is
  scaled about its mean by the split-conformal factor computed on the ``cal`` part
  (:func:`attnuq.methods.coverage_scale`) so that cal coverage is 95 %; then test coverage and
  mean width are reported;
* ``crps``: fair ensemble CRPS for samples, closed form for Gaussians (native distribution);
* ``nll``: Gaussian NLL; for sample-based methods of a Gaussian fitted to the samples (sample
  mean and std, std floored at 1e-6 standardised units);
* cost: ``fit_seconds``, ``fit_forward`` (example-forwards), ``predict_forward_per_input``.

Writes ``<out>/runs/...json``, PIT histograms ``<out>/pit_<set>.png`` and the table
``--table`` (default ``<out>.md``).
"""

from __future__ import annotations

import argparse
import json
import math
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

from attnuq._io import (
    CorruptFileWarning,
    atomic_savefig,
    atomic_torch_save,
    atomic_write_json,
    atomic_write_text,
    cache_key,
    describe_error,
    read_json_or_none,
    torch_load_or_none,
)
from attnuq.bench import register

__all__ = ["DEFAULT_METHODS", "aggregate", "run", "run_one", "write_table"]

DEFAULT_METHODS: tuple[str, ...] = (
    "sa-paper",
    "sa-scale",
    "sa-crps",
    "sa-conformal",
    "mc-dropout",
    "ensemble",
    "swag",
    "multiswag",
    "ivon",
    "laplace",
    "hsa",
    "conformal",
    "gaussian",
)
_SAMPLED = {"sa-paper", "sa-scale", "sa-crps", "sa-conformal", "mc-dropout", "swag", "multiswag",
            "ivon", "hsa"}
_LEVEL = 0.95
#: methods whose point prediction is not the frozen backbone's output
_OWN_POINT = ("ensemble", "swag", "multiswag", "ivon", "hsa")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from attnuq.data.uci import UCI_DATASETS

    p.add_argument("--datasets", nargs="+", default=list(UCI_DATASETS), metavar="NAME",
                   help="UCI set folder names (default: the six in the data dir)")
    p.add_argument("--splits", type=int, default=5, help="number of splits, 0..N-1 (default 5)")
    p.add_argument("--first-split", type=int, default=0, help="first split index (default 0)")
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), metavar="METHOD",
                   help=f"methods (default: all): {', '.join(DEFAULT_METHODS)}")
    p.add_argument("--data-dir", default=None,
                   help="folder holding <name>/ or uci/<name>/ ('bundled' for the package copy)")
    p.add_argument("--out", default="docs/results/uci", help="results folder (JSON, PNG)")
    p.add_argument("--table", default=None, help="markdown table path (default: <out>.md)")
    p.add_argument("--cache-dir", default=None,
                   help="trained backbones/members (default: <out>/_models, git-ignored)")
    p.add_argument("--n-blocks", type=int, default=3, help="FT-Transformer blocks (default 3)")
    p.add_argument("--max-epochs", type=int, default=100, help="training epoch budget")
    p.add_argument("--patience", type=int, default=16, help="early-stopping patience (epochs)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--n-samples", type=int, default=100, help="Monte Carlo samples per input")
    p.add_argument("--swag-epochs", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument("--aggregate-only", action="store_true",
                   help="only rebuild the table and plots from existing JSON")


#: seed offset per unit of ``--seed``
_SEED_STRIDE = 100_000


def _seed(args: argparse.Namespace) -> int:
    return int(getattr(args, "seed", 0) or 0)


def _run_dir(out: Path, name: str, split: int, seed: int) -> Path:
    """Folder of the run JSONs of (data set, split, seed); seed 0 keeps the original layout."""
    d = out / "runs" / name / f"split{split}"
    return d if seed == 0 else d / f"seed{seed}"


def _method_kwargs(name: str, args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    progress = not args.no_progress
    if name in _SAMPLED:
        kw["n_samples"] = args.n_samples
    if name.startswith("sa-"):
        kw["progress"] = progress
    if name in ("swag", "multiswag"):
        kw.update(epochs=args.swag_epochs, progress=progress)
    if name == "ivon":
        kw.update(max_epochs=args.max_epochs, patience=args.patience, progress=progress)
    return kw


def _budget(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "n_blocks": args.n_blocks,
        "max_epochs": args.max_epochs,
        "patience": args.patience,
        "batch_size": args.batch_size,
        "n_samples": args.n_samples,
        "swag_epochs": args.swag_epochs,
    }


#: bump when the backbone recipe in :func:`_make_task` changes in a way the options do not show
_RECIPE = "FTTransformer rtdl defaults, train_regressor (AdamW, early stopping on val RMSE) v1"


def _cache_spec(data: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Everything that shapes the cached backbone and members of one (data set, split, seed).

    The budget that reaches training (blocks, epochs, patience, batch), the seed offset, the
    recipe, and the digest of the fit/val tensors (the data file and split identity).
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
        "batch_size": args.batch_size,
        "n_features": data.n_features,
        "data": tensor_digest(data.x_fit, data.y_fit, data.x_val, data.y_val),
    }


def _make_task(data: Any, args: argparse.Namespace, cache: Path) -> tuple[Any, dict[str, Any]]:
    from attnuq.methods import Task
    from attnuq.models.ft import make_ft_transformer, train_regressor

    progress = not args.no_progress
    seed_base = 100 * data.split + _SEED_STRIDE * _seed(args)
    device = torch.device(getattr(args, "device", None) or "cpu")

    def make_model(seed: int) -> torch.nn.Module:
        model = make_ft_transformer(data.n_features, n_blocks=args.n_blocks, seed=seed_base + seed)
        return model.to(device)

    def train_fn(model: torch.nn.Module, train: Any, val: Any, seed: int) -> Any:
        return train_regressor(
            model, train, val, max_epochs=args.max_epochs, patience=args.patience,
            batch_size=args.batch_size, seed=seed_base + seed, progress=progress,
            desc=f"{data.name}/{data.split} seed {seed}",
        )

    spec = _cache_spec(data, args)
    cache = cache / cache_key(spec)  # backbone and members of exactly this recipe and data
    cache.mkdir(parents=True, exist_ok=True)
    if read_json_or_none(cache / "spec.json", "cache spec") != spec:
        atomic_write_json(cache / "spec.json", spec, indent=1)
    model = make_model(0)
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
            model, state = make_model(0), None
    if state is None:
        res = train_fn(model, (data.x_fit, data.y_fit), (data.x_val, data.y_val), 0)
        info = {"best_epoch": res.best_epoch, "epochs_run": res.epochs_run,
                "best_val_rmse_std_units": res.best_val_rmse, "seconds": res.seconds,
                "n_forward": res.n_forward}
        atomic_torch_save(model.state_dict(), wpath)
        atomic_write_json(ipath, info)
    assert info is not None
    info = {**info, "cache_key": cache.name}
    model.eval()
    for p in model.parameters():
        p.requires_grad_(True)
    task = Task(
        model=model, train=(data.x_fit, data.y_fit), val=(data.x_val, data.y_val),
        cal=(data.x_cal, data.y_cal), make_model=make_model, train_fn=train_fn,
        batch_size=args.batch_size, member_dir=cache,
    )
    return task, info


def _scores(pred: Any, y: torch.Tensor, y_std: float, gen: torch.Generator) -> dict[str, Any]:
    from attnuq import metrics
    from attnuq.predictive import GaussianPredictive

    y64 = y.double()
    if isinstance(pred, GaussianPredictive):
        m, s = pred.mean.double(), pred.std.double()
        z = (y64 - m) / s.clamp_min(1e-12)
        pit = 0.5 * (1 + torch.erf(z / math.sqrt(2.0)))
        draws = pred.sample(1000, generator=gen).samples.double()
        w1s = float(metrics.pit_w1_scaled(draws, y64, generator=gen))
        crps = float(metrics.crps_normal(m, s.clamp_min(1e-12), y64))
        nll = float(metrics.nll_normal(m, s.clamp_min(1e-6), y64))
    else:
        smp = pred.samples.double()
        pit = metrics.pit_samples(smp, y64, generator=gen)
        w1s = (
            float(metrics.pit_w1_scaled(smp, y64, generator=gen))
            if smp.shape[0] > 1 else math.nan
        )
        crps = float(metrics.crps_samples(smp, y64))
        nll = float(metrics.nll_normal(smp.mean(0), smp.std(0).clamp_min(1e-6), y64))
    lo, hi = pred.interval(_LEVEL)
    return {
        "pit": pit,
        "w1_native": float(metrics.pit_w1(pit)),
        "w1_scaled": w1s,
        "coverage_native": float(metrics.coverage(lo.double(), hi.double(), y64)),
        "width_native": float(metrics.interval_width(lo.double(), hi.double())) * y_std,
        "crps": crps * y_std,
        "nll": nll + math.log(y_std),
    }


def run_one(method_name: str, task: Any, data: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Fit ``method_name`` on ``task`` and score it on ``data``'s test part."""
    from attnuq import metrics
    from attnuq.methods import coverage_scale, make_method

    off = _SEED_STRIDE * _seed(args)
    torch.manual_seed(1234 + data.split + off)
    method = make_method(method_name, **_method_kwargs(method_name, args))
    if off and hasattr(method, "seed"):
        method.seed = int(method.seed) + off
    method.fit(task)
    pred_cal = _cpu(method.predict(data.x_cal))
    pred = _cpu(method.predict(data.x_test))
    data = _split_to(data, torch.device("cpu"))
    gen = torch.Generator().manual_seed(4321 + data.split + off)
    sc = _scores(pred, data.y_test, data.y_std, gen)
    point = getattr(pred, "frozen", None)
    point = pred.mean if point is None else point
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
        "config": {**method.config(), "budget": _budget(args)},
        "sizes": data.sizes(),
        "pit": [round(float(u), 5) for u in pit.reshape(-1)],
    }


def _cpu(pred: Any) -> Any:
    """The predictive with its tensors on the CPU (scoring uses CPU generators)."""
    from attnuq.predictive import GaussianPredictive, Predictive

    if isinstance(pred, GaussianPredictive):
        return GaussianPredictive(mean=pred.mean.cpu(), std=pred.std.cpu())
    if isinstance(pred, Predictive):
        fz = None if pred.frozen is None else pred.frozen.cpu()
        return Predictive(samples=pred.samples.cpu(), frozen=fz)
    return pred


def _split_to(data: Any, device: torch.device) -> Any:
    """``data`` (a :class:`~attnuq.data.uci.UCISplit`) with its tensors on ``device``."""
    import dataclasses

    moved = {f.name: getattr(data, f.name).to(device) for f in dataclasses.fields(data)
             if isinstance(getattr(data, f.name), torch.Tensor)}
    return dataclasses.replace(data, **moved)


def run(args: argparse.Namespace) -> Path:
    from attnuq._runtime import run_info
    from attnuq.data.uci import load_uci, n_splits
    from attnuq.methods import available_methods

    torch.set_num_threads(max(1, int(args.threads)))
    seed = _seed(args)
    device = torch.device(getattr(args, "device", None) or "cpu")
    out = Path(args.out)
    table = Path(args.table) if args.table else out.with_suffix(".md")
    known = available_methods()
    for m in args.methods:
        if m not in known:
            raise ValueError(f"unknown method {m!r}; known: {known}")
    if args.splits < 1 or args.first_split < 0:
        raise ValueError(f"--splits must be >= 1 and --first-split >= 0, got {args.splits=}, "
                         f"{args.first_split=}")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / ".gitignore", "_models/\n*.err.txt\n")
    cache_root = Path(args.cache_dir) if args.cache_dir else out / "_models"
    info = run_info()
    if not args.aggregate_only:
        jobs = []
        for name in args.datasets:
            total = n_splits(name, args.data_dir)
            last = min(total, args.first_split + args.splits)
            jobs += [(name, k) for k in range(args.first_split, last)]
        bar = _tqdm(total=len(jobs) * len(args.methods), desc="uci runs",
                    disable=args.no_progress)
        for name, k in jobs:
            rdir = _run_dir(out, name, k, seed)
            todo = [m for m in args.methods
                    if _load_run(rdir / f"{m}.json", m, _budget(args)) is None]
            bar.update(len(args.methods) - len(todo))
            if not todo:
                continue
            data = _split_to(load_uci(name, k, data_dir=args.data_dir), device)
            mdir = cache_root / name / f"split{k}"
            task, backbone = _make_task(data, args, mdir if seed == 0 else mdir / f"seed{seed}")
            for m in todo:
                path = rdir / f"{m}.json"
                err = path.with_suffix(".err.txt")
                bar.set_postfix_str(f"{name}/{k}/{m}")
                t0 = time.perf_counter()
                try:
                    res = run_one(m, task, data, args)
                except Exception as exc:  # recorded, reported in the table, retried next run
                    atomic_write_text(
                        err, f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}")
                    print(f"[uci] {name}/split{k}/{m} failed: {type(exc).__name__}: {exc}")
                    bar.update(1)
                    continue
                res["backbone"] = backbone
                res["wall_seconds"] = time.perf_counter() - t0
                res["run_info"] = {**info, "date": run_info()["date"]}
                atomic_write_json(path, res, indent=1)
                if err.exists():
                    err.unlink()
                bar.update(1)
        bar.close()
    rows = aggregate(out, seed)
    plot_pits(out, rows)
    write_table(table, out, rows, info, args)
    return out


def _tqdm(**kw: Any) -> Any:
    from tqdm.auto import tqdm

    return tqdm(**kw)


def _valid_run(r: Any) -> bool:
    return (isinstance(r, dict) and isinstance(r.get("metrics"), dict)
            and all(k in r for k in ("dataset", "split", "method", "cost", "pit")))


def _load_run(path: Path, method: str | None = None,
              budget: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """A finished run JSON, or ``None`` when it has to be (re)done.

    Missing: ``None``. Unreadable or not a run record (a torn file): ``None`` with a
    :class:`~attnuq._io.CorruptFileWarning`. Written under another budget than ``budget``
    (when given): ``None``, with a message, since its backbone is not this command's.
    """
    rec = read_json_or_none(path, "run", validate=lambda r: _valid_run(r) and (
        method is None or r["method"] == method))
    if rec is None or budget is None:
        return rec
    old = (rec.get("config") or {}).get("budget")
    if old != budget:
        print(f"[uci] {path} was run with budget {json.dumps(old)}; redoing it with "
              f"{json.dumps(budget)}", flush=True)
        return None
    return dict(rec)


def aggregate(out: Path, seed: int = 0) -> list[dict[str, Any]]:
    """Every run JSON of ``seed`` under ``out/runs`` (sorted by data set, method, split).

    Seed 0 runs live in ``runs/<set>/split<K>/`` (files without a ``seed`` entry are seed 0),
    others in ``runs/<set>/split<K>/seed<S>/``.
    """
    pattern = "*/split*/*.json" if seed == 0 else f"*/split*/seed{seed}/*.json"
    loaded = [_load_run(p) for p in sorted((out / "runs").glob(pattern))]
    rows = [r for r in loaded if r is not None and int(r.get("seed", 0)) == seed]
    return sorted(rows, key=lambda r: (r["dataset"], r["method"], r["split"]))


def _mean_std(vals: list[float]) -> tuple[float, float]:
    v = [x for x in vals if x is not None and math.isfinite(x)]
    if not v:
        return math.nan, math.nan
    m = sum(v) / len(v)
    s = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else 0.0
    return m, s


def _order(methods: list[str]) -> list[str]:
    rank = {m: i for i, m in enumerate(DEFAULT_METHODS)}
    return sorted(methods, key=lambda m: (rank.get(m, len(rank)), m))


def plot_pits(out: Path, rows: list[dict[str, Any]]) -> list[Path]:
    """One PNG per data set: a PIT histogram per method (test PIT pooled over splits)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for ds in sorted({r["dataset"] for r in rows}):
        methods = _order(sorted({r["method"] for r in rows if r["dataset"] == ds}))
        ncol = min(4, len(methods))
        nrow = math.ceil(len(methods) / ncol)
        fig, axes = plt.subplots(nrow, ncol, figsize=(3.2 * ncol, 2.4 * nrow), squeeze=False)
        for ax, m in zip(axes.flat, methods, strict=False):
            pit = [u for r in rows if r["dataset"] == ds and r["method"] == m for u in r["pit"]]
            ax.hist(pit, bins=10, range=(0, 1), density=True, color="#3b6ea5", edgecolor="white")
            ax.axhline(1.0, color="k", lw=0.8, ls="--")
            n_sp = len({r["split"] for r in rows if r["dataset"] == ds and r["method"] == m})
            ax.set_title(f"{m} ({n_sp} split{'s' if n_sp != 1 else ''})", fontsize=9)
            ax.set_xlim(0, 1)
        for ax in list(axes.flat)[len(methods):]:
            ax.axis("off")
        fig.suptitle(f"UCI {ds}: test PIT histograms (native predictive)", fontsize=10)
        fig.tight_layout()
        p = out / f"pit_{ds}.png"
        atomic_savefig(fig, p, dpi=90)
        plt.close(fig)
        paths.append(p)
    return paths


_COLS: tuple[tuple[str, str, int], ...] = (
    ("rmse", "RMSE", 3),
    ("w1_native", "W1 native", 3),
    ("w1_scaled", "W1 scaled", 3),
    ("coverage_native", "cov native", 3),
    ("coverage", "cov (cal)", 3),
    ("width", "PI-95 width (cal)", 3),
    ("crps", "CRPS", 3),
    ("nll", "NLL", 2),
)


def _fmt(m: float, s: float, d: int) -> str:
    if not math.isfinite(m):
        return "n/a"
    return f"{m:.{d}f} ± {s:.{d}f}"


def write_table(
    table: Path, out: Path, rows: list[dict[str, Any]], info: dict[str, Any],
    args: argparse.Namespace,
) -> Path:
    """Markdown table: mean ± std over splits per data set and method, with SA win/loss lines."""
    lines = [
        "# UCI regression: FT-Transformer, SA against the baselines",
        "",
        "Generated by `attnuq bench uci` (src/attnuq/bench/uci.py); do not edit by hand.",
        "",
        f"* table written by: `{info['command']}`",
        f"* date: {info['date']}",
        f"* machine: {info['machine']}",
        f"* budget of this command: {json.dumps(_budget(args))}; seed {_seed(args)}",
    ]
    runs_by = sorted({(r.get("run_info") or {}).get("command", "?") for r in rows})
    dates = sorted((r.get("run_info") or {}).get("date", "?") for r in rows)
    machines = sorted({(r.get("run_info") or {}).get("machine", "?") for r in rows})
    budgets = sorted({json.dumps((r.get("config") or {}).get("budget")) for r in rows})
    if rows:
        lines += [f"* runs produced by: {', '.join(f'`{c}`' for c in runs_by)}",
                  f"* run dates: {dates[0]} to {dates[-1]}; machines: {'; '.join(machines)}",
                  f"* run budgets: {'; '.join(budgets)}"]
    run_b = [json.loads(b) for b in budgets if b != "null"] or [_budget(args)]
    low = [b for b in run_b if b["n_blocks"] != 3 or b["max_epochs"] < 100 or b["patience"] < 16]
    if low:
        desc = "; ".join(
            f"{b['n_blocks']} block(s), at most {b['max_epochs']} epochs, patience "
            f"{b['patience']}, batch {b['batch_size']}" for b in low
        )
        lines.append(
            f"* NOTE: the backbone budget is below the default recipe (rtdl default config "
            f"for {desc}; default: 3 blocks, 100 epochs, patience 16) to fit the CPU time "
            f"of this session. Within a data set every method gets the same budget; the budget "
            f"of each data set is listed under 'What this covers'."
        )
    lines.append("")
    datasets = sorted({r["dataset"] for r in rows})
    coverage_lines = []
    for ds in datasets:
        sp = sorted({r["split"] for r in rows if r["dataset"] == ds})
        ms = _order(sorted({r["method"] for r in rows if r["dataset"] == ds}))
        ds_b = sorted({json.dumps((r.get("config") or {}).get("budget"))
                       for r in rows if r["dataset"] == ds})
        coverage_lines.append(f"* {ds}: splits {sp}; methods {ms}; budget {'; '.join(ds_b)}")
        hi = {r["split"]: (r.get("info") or {}).get("hess_init") for r in rows
              if r["dataset"] == ds and r["method"] == "ivon"}
        grid = ", ".join(sorted({" ".join(f"{h:g}" for h in (r.get("info") or {}).get(
            "hess_inits", [])) for r in rows if r["dataset"] == ds and r["method"] == "ivon"}))
        if hi:
            chosen = ", ".join(f"split {k}: {v:g}" if isinstance(v, (int, float)) else
                               f"split {k}: fixed (old run)" for k, v in sorted(hi.items()))
            coverage_lines.append(f"  * ivon hess_init chosen per split by validation RMSE of the "
                                  f"predictive mean (grid {grid}): "
                                  f"{chosen}")
    from attnuq.data.uci import UCI_DATASETS

    missing = [d for d in UCI_DATASETS if d not in datasets]
    n_runs = len(rows)
    lines += ["## What this covers", "", f"{n_runs} runs (data set x split x method):", "",
              *coverage_lines, ""]
    if missing:
        lines += [f"Not covered by this table: {', '.join(missing)} (the full suite is 6 sets x "
                  ">= 5 splits; rerun the command with more --datasets/--splits, it resumes).", ""]
    short = []
    for ds in datasets:
        all_sp = {int(r["split"]) for r in rows if r["dataset"] == ds}
        if len(all_sp) < 5:
            short.append(f"{ds} has {len(all_sp)} split(s)")
        for m in _order(sorted({r["method"] for r in rows if r["dataset"] == ds})):
            got = {int(r["split"]) for r in rows if r["dataset"] == ds and r["method"] == m}
            if got != all_sp:
                short.append(f"{ds}/{m} lacks split(s) {sorted(all_sp - got)}")
    if short:
        lines += [f"Below the full suite (>= 5 splits, every method on every split): "
                  f"{'; '.join(short)}.", ""]
    errs = sorted(out.glob("runs/*/split*/*.err.txt"))
    if errs:
        lines += ["Runs that failed (no JSON written; re-running the command retries them):", ""]
        for e in errs:
            first = (e.read_text(errors="replace").splitlines() or ["(empty)"])[0][:200]
            lines.append(f"* `{e.relative_to(out)}`: {first}")
        lines.append("")
    lines += [
        "Parts: each standard training split is cut at random (fixed seed) into fit (80 %), "
        "validation (10 %: early stopping and each method's own post-hoc fitting, e.g. SA's nu "
        "and IVON's hess_init) and calibration (10 %) parts; the standard test split is only "
        "scored.",
        "",
        "Metrics: test part, mean ± std over splits. RMSE, PI-95 width and CRPS in target units; "
        "NLL of a Gaussian (fitted to the samples for sample-based methods). "
        "`cov (cal)` / `PI-95 width (cal)`: after unified coverage calibration, i.e. each "
        "method's central 95 % interval scaled about its mean by the split-conformal factor "
        "computed on the calibration part (10 % of the training split, unused by training), so "
        "that calibration coverage is 95 %. W1 native / scaled: W1 distance of test PIT values to "
        "U(0, 1) before / after one pooled spread factor. Cost: extra fit seconds beyond the "
        "shared backbone, and forward passes per predicted input. "
        "**Bold**: narrowest calibrated PI-95 and best CRPS per data set.",
        "",
    ]
    sa_wins, n_sets = 0, 0
    for ds in datasets:
        ms = _order(sorted({r["method"] for r in rows if r["dataset"] == ds}))
        stats: dict[str, dict[str, tuple[float, float]]] = {}
        for m in ms:
            rr = [r for r in rows if r["dataset"] == ds and r["method"] == m]
            stats[m] = {k: _mean_std([r["metrics"][k] for r in rr]) for k, _, _ in _COLS}
            stats[m]["fit_s"] = _mean_std([r["cost"]["fit_seconds"] for r in rr])
            stats[m]["fwd"] = _mean_std([r["cost"]["predict_forward_per_input"] for r in rr])
            stats[m]["n"] = (float(len(rr)), 0.0)
        widths = {m: stats[m]["width"][0] for m in ms if math.isfinite(stats[m]["width"][0])}
        crpss = {m: stats[m]["crps"][0] for m in ms if math.isfinite(stats[m]["crps"][0])}
        best_w = min(widths, key=widths.__getitem__) if widths else None
        best_c = min(crpss, key=crpss.__getitem__) if crpss else None
        header = ["method", "splits", *[c for _, c, _ in _COLS], "fit s", "passes/input"]
        lines += [f"## {ds}", "", "| " + " | ".join(header) + " |",
                  "|" + "---|" * len(header)]
        for m in ms:
            cells = [m, str(int(stats[m]["n"][0]))]
            for k, _, d in _COLS:
                txt = _fmt(*stats[m][k], d)
                if (k == "width" and m == best_w) or (k == "crps" and m == best_c):
                    txt = f"**{txt}**"
                cells.append(txt)
            cells += [f"{stats[m]['fit_s'][0]:.1f}", f"{stats[m]['fwd'][0]:.0f}"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        sa = {m: w for m, w in widths.items() if m.startswith("sa-")}
        other = {m: w for m, w in widths.items() if not m.startswith("sa-")}
        if sa and other:
            n_sets += 1
            bs = min(sa, key=sa.__getitem__)
            bo = min(other, key=other.__getitem__)
            ratio = other[bo] / sa[bs]
            if sa[bs] <= other[bo]:
                sa_wins += 1
                verdict = (f"**SA wins** on calibrated PI-95 width: {bs} {sa[bs]:.3f} vs the "
                           f"best baseline {bo} {other[bo]:.3f} (baseline {ratio:.2f}x wider)")
            else:
                verdict = (f"**SA loses** on calibrated PI-95 width: best baseline {bo} "
                           f"{other[bo]:.3f} vs best SA {bs} {sa[bs]:.3f} "
                           f"(SA {1 / ratio:.2f}x wider)")
            sa_c = {m: c for m, c in crpss.items() if m.startswith("sa-")}
            ot_c = {m: c for m, c in crpss.items() if not m.startswith("sa-")}
            if sa_c and ot_c:
                bsc, boc = min(sa_c, key=sa_c.__getitem__), min(ot_c, key=ot_c.__getitem__)
                word = "wins" if sa_c[bsc] <= ot_c[boc] else "loses"
                verdict += (f"; on CRPS SA {word}: {bsc} {sa_c[bsc]:.3f} vs {boc} "
                            f"{ot_c[boc]:.3f}")
            others_wider = sorted(
                f"{m} {w / sa[bs]:.2f}x" for m, w in other.items()
            )
            lines += [f"* {ds}: {verdict}.",
                      f"* width of each baseline relative to the best SA: "
                      f"{', '.join(others_wider)}."]
            frozen_m = next((m for m in ("gaussian", "laplace", "conformal", "mc-dropout", bs)
                             if m in stats), None)
            if frozen_m is not None:
                f_rmse = stats[frozen_m]["rmse"][0]
                own = [f"{m} {stats[m]['rmse'][0]:.3f}" for m in ms
                       if m in _OWN_POINT and math.isfinite(stats[m]["rmse"][0])]
                if own:
                    lines.append(
                        f"* point predictions differ from the shared frozen backbone (RMSE "
                        f"{f_rmse:.3f}) for {', '.join(own)}; interval widths after unified "
                        "calibration also reflect these RMSE differences."
                    )
            lines.append("")
        lines.append(f"![PIT histograms {ds}](uci/pit_{ds}.png)" if out.name == "uci"
                     else f"PIT histograms: `{out / f'pit_{ds}.png'}`")
        lines.append("")
    from attnuq.bench._implementations import implementation_lines

    lines += implementation_lines(_order(sorted({r["method"] for r in rows})))
    lines.insert(
        lines.index("## What this covers"),
        f"**Summary:** SA has the narrowest calibrated PI-95 on {sa_wins} of {n_sets} data sets "
        f"covered here (the paper: 7 of 8).\n",
    )
    atomic_write_text(table, "\n".join(lines) + "\n")
    return table


register(
    "uci",
    help="UCI regression (FT-Transformer): SA against the baselines, standard splits",
    add_arguments=add_arguments,
    run=run,
)
