"""``attnuq bench era5``: SA on a small frozen ViT forecaster of ERA5 2 m temperature.

Data + backbone + config on the bench spine; methods by registry name.

* Data: :func:`attnuq_bench.data.era5.load_field` (GRIB or NetCDF) in consecutive blocks of whole
  days, train / val / cal / test (default 18 / 5 / 4 / the rest of March 2019), each example's span
  ``[t - history, t + max lead]`` inside its block. Inputs at issue time ``t`` (hourly): the
  field at ``t`` and ``t - 6 h`` and, by default, the hour-of-day training climatology at the
  valid times; targets: the field at ``t + 6 h`` and ``t + 24 h``.
* Backbone: :class:`attnuq_bench.models.vit_field.ViTFieldForecaster` (HF ViT blocks, patch 4),
  trained by :func:`attnuq_bench.training.fit` with early stopping on val, saved, reloaded, frozen.
* Methods: ``sa-paper``, ``sa-crps``, ``sa-conformal``, ``conformal`` (split conformal on the
  frozen forecast, one factor per lead and grid point), ``mc-dropout``, ``ensemble`` (member 0 =
  the backbone) and the SA variants of issue #20 (``sa``, ``sa-debiased``, ``sa-recentred``,
  ``sa-floor``, ``sa-layer``) and ``sa-centre`` (``sa`` with the centre chosen on validation)
  from :mod:`attnuq_bench.methods`; the references ``persistence`` and
  ``climatology`` with the per-grid-point quantiles of their val residuals. Scores per lead on
  the test days: :func:`attnuq_bench.suites._fields.field_scores`, maps of mean error and predicted
  spread.

Each method is one run record ``<out>/era5/runs/<method>.json`` (+ maps ``.npz``), reused by
``--resume`` under the same config; the page ``<out>/era5.md``, its twin and the ``era5`` key of
``<out>/summary.json`` are functions of ``era5/era5_results.json`` (:func:`render_page`).

Examples
--------
::

    attnuq bench era5 --data-dir ../shared/data --out docs/results
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import attnuq
from attnuq._io import atomic_np_savez, atomic_write_json, read_json_or_none
from attnuq._runtime import resolve_device, run_info
from attnuq._validation import check_positive_int
from attnuq.distributed import is_writer, primary_first
from attnuq_bench.data import era5 as data
from attnuq_bench.methods import ResidualQuantiles, Task, make_method
from attnuq_bench.suites import _members as mb
from attnuq_bench.suites import register
from attnuq_bench.suites._ablation import ablation_block
from attnuq_bench.suites._digests import files_digest
from attnuq_bench.suites._era5_recipe import (
    Inputs,
    _MemberRecipe,
    _MemberRecipeV2,
    naive_weights,
    select_blend,
)
from attnuq_bench.suites._fields import error_maps, field_scores, load_maps, maps_png, point_scores
from attnuq_bench.suites._implementations import implementation_texts, merge_block
from attnuq_bench.suites._options import add_methods_argument, split_methods
from attnuq_bench.suites._page import Page, Table, fmt, update_summary
from attnuq_bench.suites._runner import Group, RunStore, credits, reuse_key, run_items
from attnuq_bench.suites._sa_evidence import add_section
from attnuq_bench.suites._scoring import to_cpu
from attnuq_bench.training import predict_batched

__all__ = ["ALL_METHODS", "add_arguments", "field_scores", "render", "render_page", "run"]

#: every method the suite knows, in table order; also the default of ``--methods`` (issue #19)
ALL_METHODS: tuple[str, ...] = (
    "sa-paper", "sa-crps", "sa-conformal", "conformal", "mc-dropout", "ensemble", "persistence",
    "climatology", "sa", "sa-debiased", "sa-recentred", "sa-floor", "sa-layer", "sa-centre")
#: the SA variants of issue #20 (each with the SA rows' budget)
_SA_VARIANTS = ("sa", "sa-debiased", "sa-recentred", "sa-floor", "sa-layer", "sa-centre")
_RUN_ORDER = ("sa-paper", "sa-conformal", "persistence", "climatology", "conformal", "sa-crps",
              "mc-dropout", "ensemble", *_SA_VARIANTS)
#: rows this suite computes itself (the others are registered methods: the registry's text)
_IMPLEMENTATIONS = {
    "persistence": "this suite: the field at issue time plus val residual quantiles per (lead, "
                   "grid point)",
    "climatology": "this suite: hour-of-day training climatology plus val residual quantiles per "
                   "(lead, grid point)",
}
_RESUME_FREE = ("methods", "resume", "note", "no_progress", "threads", "retrain", "out",
                "model_dir", "rerun", "member_jobs")
_COLS = ("rmse_lat", "acc", "pit_w1", "pit_w1_scaled", "width", "coverage", "crps", "mean_std")
_EXTRA = ("nu", "fit_seconds", "predict_seconds", "forward_per_input")
_HEAD = ("method", "RMSE (lat-w)", "ACC", "W1(PIT) native", "W1(PIT) scaled", "PI-95 width",
         "PI-95 coverage", "CRPS", "mean std", "nu", "fit s", "predict s", "passes")
_NAIVE = ("persistence-point", "day-ago-point", "climatology-point")  # summary's references
_BLEND_NAMES = {"day": "x(t+lead-24h)", "ydc": "yesterday's change x(t)+x(t+lead-24h)-x(t-24h)",
                "anom": "anomaly persistence x(t)-c(t)+c(t+lead)", "climatology": "c(t+lead)",
                "persistence": "x(t)"}
_TITLE = "ERA5 2 m temperature: stochastic attention on a frozen ViT forecaster vs baselines"


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--data-dir", default=None, help="data root (holds era5/<file>) (default: "
      "$ATTNUQ_DATA_DIR, else ../shared/data)")
    a("--file", default="era5-2mt-2019-03-uk.grib", help="GRIB or NetCDF: (time, lat, lon)")
    a("--variable", default=None, help="variable name (default: the only one)")
    a("--out", default="docs/results", help="results root (writes era5.md, era5/)")
    a("--model-dir", default=None, help="backbone folder (default <out>/era5/backbone)")
    a("--retrain", action="store_true", help="train the backbone even if saved")
    a("--split", default="18,5,4,-1",
      help="days in train,val,cal,test (consecutive; -1 = the rest)")
    a("--history", type=int, default=6, help="hours back of the second input field")
    a("--leads", default="6,24", help="lead times in hours")
    a("--no-clim-features", action="store_true", help="inputs: the two fields only")
    a("--day-ago", action="store_true", help="inputs also: the fields at t-24 h and 24 h before "
      "each valid time (+ the climatology at t); adds the day-ago-point row")
    a("--loo-clim", action="store_true", help="training inputs: leave-one-out climatology")
    a("--base", choices=("persistence", "blend"), default="persistence", help="the forecaster "
      "corrects persistence, or the convex blend of naive forecasts with least val RMSE")
    a("--weight-decay", type=float, default=0.0, help="AdamW weight decay of the backbone")
    a("--center-inputs", action="store_true", help="the ViT sees its inputs less the domain mean "
      "of x(t) (no absolute level; the output is still the base plus the ViT's correction)")
    for name, v, text in (
            ("patch", 4, "ViT patch size"), ("hidden", 64, "ViT width"),
            ("layers", 3, "ViT encoder layers"), ("heads", 4, "attention heads per layer"),
            ("mlp", 128, "ViT feed-forward width"),
            ("dropout", 0.1, "dropout rate of the backbone"),
            ("epochs", 40, "training epochs at most (early stopping on val)"),
            ("patience", 6, "early-stopping patience in epochs"),
            ("batch-size", 16, "training batch size"), ("lr", 1e-3, "learning rate"),
            ("ensemble", 5, "deep-ensemble size")):
        a(f"--{name}", type=type(v), default=v, help=text)
    a("--member-jobs", type=int, default=1, help="train the ensemble members in this many "
      "worker processes (one thread each; same weights as 1 = one after the other)")
    a("--n-samples", type=int, default=30, help="Monte Carlo passes per method")
    a("--n-passes", type=int, default=10, help="passes per nu in calibration")
    a("--nu-max", type=int, default=1024, help="upper end of SA's nu search")
    add_methods_argument(p, default=ALL_METHODS,
                         help=f"methods to score (default: {', '.join(ALL_METHODS)})")
    a("--seed", type=int, default=0, help="seed of the backbone; ensemble member k uses seed + k")
    a("--device", default="cpu", help="torch device: cpu, cuda, cuda:N or auto (default: cpu)")
    a("--threads", type=int, default=1, help="torch intra-op threads")
    a("--no-progress", action="store_true", help="hide progress bars")
    a("--resume", action="store_true", help="keep the methods already scored in "
      "<out>/era5/runs under the same config (and their maps); run only the rest")
    add_methods_argument(p, "--rerun", default=(),
                         help="methods to score again despite --resume (default: none)")
    a("--note", action="append", default=None, metavar="TEXT",
      help="a note for the page; repeatable (default: none)")
    a("--render-only", action="store_true", help="the page again from era5/era5_results.json")


def _parse_ints(spec: str, name: str) -> list[int]:
    try:
        return [int(v) for v in spec.split(",") if v.strip()]
    except ValueError as exc:
        raise ValueError(f"{name} must be comma-separated integers, got {spec!r}") from exc


#: options added since the committed page: left out of the config while at their defaults
_NEW_DEFAULTS = {"day_ago": False, "loo_clim": False, "base": "persistence", "weight_decay": 0.0,
                 "center_inputs": False}


def _check(args: argparse.Namespace) -> tuple[list[str], list[str], tuple[int, ...], list[int]]:
    """Validated ``(methods, rerun, leads, split)`` of the command line."""
    methods, rerun = (split_methods(v) for v in (args.methods, getattr(args, "rerun", None)))
    bad = [m for m in methods + rerun if m not in ALL_METHODS]
    if bad or not methods or any(m not in methods for m in rerun):
        raise ValueError(f"unknown methods {bad} in --methods={args.methods!r} / --rerun="
                         f"{getattr(args, 'rerun', '')!r} (a subset of --methods); known: "
                         f"{list(ALL_METHODS)}")
    for name in ("history", "n_samples", "n_passes", "ensemble", "epochs", "patience",
                 "batch_size", "threads"):
        check_positive_int(getattr(args, name), name)
    if args.n_samples < 2:
        raise ValueError(f"n_samples must be >= 2, got {args.n_samples=}")
    split = _parse_ints(args.split, "--split")
    if len(split) != 4:
        raise ValueError(f"--split needs 4 day counts (train,val,cal,test), got {args.split!r}")
    return methods, rerun, tuple(_parse_ints(args.leads, "--leads")), split


def run(args: argparse.Namespace) -> Path:
    """Run the ERA5 suite; returns ``<out>/era5``."""
    from attnuq_bench.models.vit_field import load_vit_field, save_vit_field  # extra: transformers

    res_dir = Path(args.out) / "era5"
    if getattr(args, "render_only", False):
        _write_page(res_dir, _stored(res_dir))
        return res_dir
    methods, rerun, leads, split = _check(args)
    torch.set_num_threads(args.threads)
    device = resolve_device(getattr(args, "device", "cpu"))
    member_jobs = mb.check_member_jobs(getattr(args, "member_jobs", 1))
    progress, info = not args.no_progress, run_info()
    res_dir.mkdir(parents=True, exist_ok=True)
    cfg = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "render_only"
           and (isinstance(v, (int, float, str, bool, type(None))) or k == "note")
           and not (k in _NEW_DEFAULTS and v == _NEW_DEFAULTS[k])}
    key = reuse_key(cfg, free=_RESUME_FREE)
    prev = (read_json_or_none(res_dir / "era5_results.json", "ERA5 results", validate=lambda r:
            isinstance(r, dict) and isinstance(r.get("config"), dict)) if args.resume else None)
    same = {k: v for k, v in (prev or {"config": {}})["config"].items() if k not in _RESUME_FREE}
    if same != (now := {k: cfg.get(k) for k in same}):  # as before the run records: refuse
        raise ValueError(f"--resume: {res_dir / 'era5_results.json'} was written with another "
                         f"config: {same} vs {now}")

    field = data.load_field(path := data.resolve_era5_path(args.file, args.data_dir), args.variable)
    blocks = data.day_blocks(field.times, list(zip(("train", "val", "cal", "test"), split,
                                                   strict=True)))
    opt: dict[str, Any] = {k: getattr(args, k, d) for k, d in _NEW_DEFAULTS.items()}
    build = Inputs(clim=data.hourly_climatology(field, blocks["train"]), leads=leads,
                   use_clim=not args.no_clim_features, history=args.history,
                   day_ago=opt["day_ago"], loo=opt["loo_clim"],
                   values=field.values, counts=np.bincount(field.hours[blocks["train"]], None, 24))
    ex = {k: data.make_examples(field, b, history=args.history, leads=leads,
                                extra_lags=build.extra_lags) for k, b in blocks.items()}
    X_cpu = {k: build(e.inputs, e.hours, e.t_index if k == "train" else None)
             for k, e in ex.items()}
    # models and their inputs live on `device`; scores are computed on the CPU
    X = {k: v.to(device) for k, v in X_cpu.items()}
    Y = {k: e.targets for k, e in ex.items()}
    Yd = {k: v.to(device) for k, v in Y.items()}
    lat = torch.from_numpy(np.array(field.lat, dtype=np.float64))
    tr_vals = field.values[blocks["train"]].double()
    day = {k: (str(field.times[b[0]])[:10], str(field.times[b[-1]])[:10])
           for k, b in blocks.items()}
    print(f"[era5] {path.name}: {field.values.shape} {field.variable}; examples "
          + ", ".join(f"{k} {len(e)} ({day[k][0]}..{day[k][1]})" for k, e in ex.items()),
          flush=True)
    naive = naive_weights(build)
    blend = (select_blend(X_cpu["val"], Y["val"], lat, naive)
             if opt["base"] == "blend" else None)
    v2 = ({"base_weight": blend[0].tolist()} if blend else {}) | (
        {"weight_decay": opt["weight_decay"]} if opt["weight_decay"] else {}) | (
        {"center": True} if opt["center_inputs"] else {})
    recipe = (_MemberRecipeV2 if v2 else _MemberRecipe)(  # type: ignore[call-arg]
        grid=[int(field.values.shape[1]), int(field.values.shape[2])],
        in_channels=X["train"].shape[1], out_channels=len(leads), patch=args.patch,
        hidden=args.hidden, layers=args.layers, heads=args.heads, mlp=args.mlp,
        dropout=args.dropout, mean=float(tr_vals.mean()), std=float(tr_vals.std()),
        epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, patience=args.patience,
        seed=args.seed, progress=progress, device=str(device),
        train_xy=(X_cpu["train"], Y["train"]), val_xy=(X_cpu["val"], Y["val"]), **v2)
    member_dir = mb.member_cache_dir(res_dir / "members", recipe)  # keyed by the recipe
    frozen, train_report = primary_first("era5: backbone", lambda: mb.load_or_train_backbone(
        recipe, Path(args.model_dir) if args.model_dir else res_dir / "backbone",  # torchrun:
        retrain=args.retrain and is_writer(), save=save_vit_field, load=load_vit_field,
        device=device))  # rank 0 trains, the others load
    task = Task(model=frozen, train=(X["train"], Yd["train"]), val=(X["val"], Yd["val"]),
                cal=(X["cal"], Yd["cal"]), make_model=recipe.make, train_fn=recipe.train,
                batch_size=args.batch_size * 4, member_dir=member_dir)
    xte, yte = X["test"], Y["test"]
    clim_te = build.valid_clim(ex["test"].hours)  # (N, L, H, W)

    def points(k: str) -> dict[str, Any]:  # point forecasts of split k: the frozen + naive ones
        clim_k = build.valid_clim(ex[k].hours)
        with torch.no_grad():
            fcs = {"frozen": predict_batched(frozen, X[k], 64).cpu(),
                   "persistence-point": _persistence(ex[k]), "climatology-point": clim_k}
        for name, w in (("day-ago-point", naive.get("day")),
                        ("blend-point", blend[0] if blend else None)):
            if w is not None:
                fcs[name] = torch.einsum("lc,nchw->nlhw", w.double(), X_cpu[k].double())
        return {n: {"per_lead": point_scores(fc, Y[k], clim_k, lat, leads)} for n, fc in
                fcs.items()}
    static: dict[str, Any] = {
        "data": {"file": str(field.path), "variable": field.variable,
                 "grid": list(field.values.shape[1:]), "days": day,
                 "examples": {k: len(e) for k, e in ex.items()}},
        "backbone": {"n_params": sum(p.numel() for p in frozen.parameters()),
                     "attention_sites": [s.name for s in attnuq.find_attention(frozen)],
                     "in_channels": recipe.in_channels, "train": train_report}}
    if opt["day_ago"] or blend:  # what the backbone was chosen on (the committed page has none)
        static["backbone"].update(channels=build.channels(), val_points=points("val"))
        if blend:
            static["backbone"].update(blend=blend[1], blend_val_rmse=blend[2])
    test_points = points("test")
    store = RunStore(res_dir / "runs", suite="era5", info=info)
    digest = files_digest([field.path])  # a record of other data is never reused
    maps: dict[str, dict[str, Any]] = {}
    recs = {m: r for m in ALL_METHODS if args.resume and m not in rerun
            and (r := store.load((), m, key, data=digest)) is not None
            and (mp := load_maps(store.path((), m).with_suffix(".npz"))) is not None
            and maps.setdefault(m, mp) is mp}
    kept = set(recs)
    sa = {"n_samples": args.n_samples, "n_passes": args.n_passes, "seed": args.seed,
          "progress": progress, "nu_range": (1, args.nu_max)}
    fitted: dict[str, Any] = {}
    kwargs = {"sa-paper": sa, "sa-crps": sa, "sa-conformal": sa, **dict.fromkeys(_SA_VARIANTS, sa),
              "ensemble": {"n_members": args.ensemble}, "conformal": {},
              "mc-dropout": {"n_samples": args.n_samples, "seed": args.seed}}

    def run_one(_ctx: Any, _g: Group, name: str) -> dict[str, Any]:
        t0, trained = time.perf_counter(), []
        if name in ("persistence", "climatology"):
            fn = _persistence if name == "persistence" else (lambda e: build.valid_clim(e.hours))
            rq = ResidualQuantiles.fit(Y["val"] - fn(ex["val"]), n_quantiles=50)
            pred: Any = rq.predictive(fn(ex["test"]))
            extra = {"fit_seconds": time.perf_counter() - t0, "forward_per_input": 0,
                     "note": "point reference + val residual quantiles per (lead, grid point)"}
        else:
            if name == "ensemble":  # members first, so that the fit books their training once
                trained = mb.train_members(recipe, list(range(1, args.ensemble)), member_dir,
                                           jobs=member_jobs)
            # sa-conformal after sa-paper: its nu and test draws, only the factor fitted on cal
            shared = name == "sa-conformal" and "sa-paper" in fitted
            base, bp = fitted["sa-paper"] if shared else (None, None)
            m = make_method(name, **({"base": base} if base else kwargs[name])).fit(task)
            pred = m.derive(bp) if base else m.predict(xte)  # type: ignore[attr-defined]
            if name == "sa-paper":
                fitted[name] = (m, pred)
            c = [m.cost, *([base.cost] if base else [])]
            extra = {"fit_seconds": sum(x.fit_seconds for x in c), "predict_seconds": c[-1]
                     .predict_seconds, "forward_per_input": c[-1].predict_forward_per_input, **{
                         k: v for k, v in m.info().items() if isinstance(v, (int, float, str))
                         or (k == "nu_map" and isinstance(v, dict))}}
            if name == "ensemble":
                extra.update(fit_forward=m.cost.fit_forward, member_jobs=member_jobs,
                             members_trained_here=trained, members_from_cache=[
                                 k for k in range(1, args.ensemble) if k not in trained],
                             member_seeds=[args.seed + k for k in range(args.ensemble)],
                             note="fit s = sum of the members' training times")
        pred = to_cpu(pred)
        sc = field_scores(pred, yte, lat=lat, clim=clim_te, leads=leads, seed=args.seed)
        maps[name] = error_maps(pred, yte)
        atomic_np_savez(store.path((), name).with_suffix(".npz"), **maps[name])
        print(f"[era5] {name}: " + "; ".join(f"{ld}: " + ", ".join(
            f"{k}={v:.4g}" for k, v in r.items() if k != "n_scored") for ld, r in sc.items()),
            flush=True)
        return {"method": name, "per_lead": sc, **extra,
                "implementation": implementation_texts([name], _IMPLEMENTATIONS)[name]}

    def write(_g: Any = None, name: str = "", rec: dict[str, Any] | None = None, *,
              final: bool = False) -> None:  # also the runner's on_saved callback
        if rec is not None:
            recs[name] = rec
        done = [m for m in ALL_METHODS if m in recs]
        credit = _earlier([recs[m] for m in done if m in kept])
        payload = {
            "run": {**info, **({"resumed_runs": credit} if credit else {})}, "config": cfg,
            "complete": final, **static, "results": {**test_points, **{m: {
                k: v for k, v in recs[m].items() if k not in (
                    "method", "reuse", "run_info", "implementation", "wall_seconds",
                    "data_digest")}
                for m in done}},
            "implementations": merge_block(done, {m: recs[m].get("implementation")
                                                  for m in done}, local=_IMPLEMENTATIONS)}
        atomic_write_json(res_dir / "era5_results.json", payload, indent=1)
        if done:
            atomic_np_savez(res_dir / "era5_maps.npz", **{
                f"{n}__{k}": v for n in done for k, v in maps[n].items()})
        if final and done:
            maps_png(res_dir / "era5_maps.png", {n: maps[n] for n in done}, field, leads)
        _write_page(res_dir, payload)

    if kept:
        print(f"[era5] resuming: already scored {sorted(kept)}", flush=True)
    order = sorted(methods, key=_RUN_ORDER.index)
    group = Group(parts=(), methods=order, reuse=key, data=digest,
                  together=[("sa-paper", "sa-conformal")])  # sa-conformal: sa-paper's draws
    summary = run_items(store, [group], lambda g: None,
                        run_one, progress=False, rerun=[m for m in order if m not in kept],
                        on_saved=write)
    write(final=not summary.failed)  # failures: recorded in runs/<method>.err.txt, page partial
    if summary.failed:
        raise RuntimeError(f"ERA5 methods failed: {summary.failed} (see {store.root}/*.err.txt)")
    return res_dir


def _earlier(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Which earlier invocations scored the kept ``records``, latest first (the page's lines)."""
    return credits(sorted(records, key=lambda r: r["run_info"].get("invocation") or 0))[::-1]


def _persistence(e: Any) -> torch.Tensor:
    """``(N, L, H, W)``: the field at issue time, for every lead."""
    return e.inputs[:, :1].expand_as(e.targets)


def _summary(p: dict[str, Any]) -> dict[str, Any]:
    """The ``era5`` key of ``summary.json`` (issue #19): per ``<variable>+<lead>h``, the frozen
    backbone's latitude-weighted RMSE against the best point reference's, and each method's
    RMSE, CRPS, native PI-95 coverage and native W1 (no calibrated width: this suite has none)."""
    res, out = p["results"], {}
    for ld in _parse_ints(p["config"]["leads"], "leads"):
        key = f"+{ld}h"
        refs = {k.removesuffix("-point"): res[k]["per_lead"][key]["rmse_lat"]
                for k in _NAIVE if k in res}
        best = min(refs, key=lambda k: refs[k]) if refs else None
        methods: dict[str, Any] = {"frozen": {"rmse": res["frozen"]["per_lead"][key]["rmse_lat"]}}
        for m, v in ((m, res[m]["per_lead"][key]) for m in ALL_METHODS if m in res):
            methods[m] = {"rmse": v["rmse_lat"], "crps": v["crps"],
                          "coverage95_native": v["coverage"], "w1_native": v["pit_w1"]}
        out[f"{p['data']['variable']}{key}"] = {"backbone": {
            "metric": "rmse", "value": methods["frozen"]["rmse"], "reference": refs.get(best or ""),
            "reference_name": best}, "splits": 1, "methods": methods}
    return out


def _write_page(res_dir: Path, payload: dict[str, Any]) -> None:
    """Write ``era5.md`` + twin from ``payload`` (the stored results) and the summary key."""
    render(payload, root=res_dir.parent).write(res_dir.parent / "era5.md")
    update_summary(res_dir.parent / "summary.json", "era5", _summary(payload))


def _stored(res_dir: Path) -> dict[str, Any]:
    p = read_json_or_none(Path(res_dir) / "era5_results.json", "ERA5 results",
                          validate=lambda r: isinstance(r, dict) and "results" in r)
    if p is None:
        raise ValueError(f"no ERA5 results to render in {Path(res_dir) / 'era5_results.json'}")
    return p


def render_page(out: Path, table: Path) -> Page:
    """The page ``table`` (``era5.md``) again from ``out/era5_results.json`` alone."""
    return render(_stored(out), root=Path(out).parent)


def render(p: dict[str, Any], root: Path | None = None) -> Page:
    """The results page of the stored results ``p`` (pure: no data, no training); with
    ``root`` (the folder holding ``era5/``, e.g. ``docs/results``) also the section on what the
    regression evidence tells a user (issue #34, from the records under ``root``)."""
    r, c, d, b = p["run"], p["config"], p["data"], p["backbone"]
    tr, res, leads = b["train"], p["results"], _parse_ints(c["leads"], "leads")
    page = Page("era5", _TITLE, state={"results": "era5/era5_results.json"})
    page.add("Generated by `attnuq bench era5` -- do not edit by hand." + ("" if p["complete"]
             else " **(partial: run still in progress or interrupted)**"), "")
    page.provenance(r)
    page.add(
        *[f"* methods {', '.join(m['methods'])} scored earlier by `{m['command']}` "
          f"({m['date']}), same config, kept with --resume"
          for m in r.get("resumed_runs", []) if m.get("methods")],
        f"* data: `{Path(d['file']).name}` ({d['variable']}, grid {d['grid']}); consecutive "
        "day blocks " + ", ".join(f"{k} {v[0]}..{v[1]} ({d['examples'][k]} issue times)"
                                  for k, v in d["days"].items())
        + f"; issue every hour, inputs: field at t and t-{c['history']} h"
        + ("" if c["no_clim_features"] else " + training hour-of-day climatology at the valid "
           "times" + (" (leave-one-out on the training days)" if c.get("loo_clim") else ""))
        + ("; also the fields at t-24 h and 24 h before each valid time"
           + ("" if c["no_clim_features"] else " and the climatology at t") if c.get("day_ago")
           else "") + f"; leads {c['leads']} h",
        f"* backbone: ViT from HF `ViTModel` blocks, patch {c['patch']}, hidden {c['hidden']}, "
        f"{c['layers']} layers, {c['heads']} heads, mlp {c['mlp']}, dropout {c['dropout']}, "
        f"{b['n_params']} parameters, predicts the change from " + (
            "persistence" if not b.get("blend") else "the convex blend of naive forecasts with "
            "least val RMSE (" + "; ".join(f"+{ld}h: " + ", ".join(
                f"{w:g} {_BLEND_NAMES.get(k, k)}" for k, w in a.items() if w)
                for ld, a in zip(leads, b["blend"], strict=True)) + ")")
        + (f"; AdamW weight decay {c['weight_decay']}" if c.get("weight_decay") else "")
        + ("; inputs centred on the domain mean of x(t)" if c.get("center_inputs") else "")
        + "; trained here "
        f"({tr.get('epochs_run')} epochs, best {tr.get('best_epoch')}, best val MSE "
        f"{fmt(tr.get('best_val'), nan='nan')} K^2, {fmt(tr.get('seconds'), nan='nan')} s"
        f"{', reused from disk' if tr.get('reused') else ''}), frozen",
        f"* Monte Carlo samples {c['n_samples']}; calibration passes per nu {c['n_passes']}, "
        f"nu searched in [1, {c.get('nu_max', 1024)}] (BO); "
        f"deep ensemble {c['ensemble']} members (member 0 = the backbone, members 1.."
        f"{c['ensemble'] - 1} retrained by this suite with the backbone's recipe and seeds "
        f"{c['seed']}+k, "
        f"{mb.jobs_text(res.get('ensemble', {}).get('member_jobs', c.get('member_jobs', 1)))}"
        f"{mb.cache_text(res.get('ensemble', {}), 'era5')})",
        "* RMSE and ACC are latitude-weighted (ACC: anomalies against the hour-of-day mean of "
        "the training days, pooled WeatherBench/ClimaX definition); PIT, W1, coverage, width "
        "and CRPS are plain means over grid points and issue times; units K",
        "")
    for title, pts in (("", res), ("validation days (what the recipe was chosen on)",
                                    b.get("val_points", {}))):
        pt = [k for k in ("frozen", *_NAIVE, "blend-point") if k in pts]
        if pt:
            t = Table([f"point forecast{title and ', ' + title}",
                       *[f"{m} +{ld}h" for ld in leads for m in ("RMSE", "ACC")]])
            for k in pt:
                t.add(k, *[fmt(v[m], nan="nan") for v in pts[k]["per_lead"].values()
                           for m in ("rmse_lat", "acc")], values=pts[k]["per_lead"])
            page.table(t)
            page.add("")
    scored = [k for k in ALL_METHODS if k in res]
    for ld in leads:
        key = f"+{ld}h"
        page.section(f"Lead {key}")
        t = Table(_HEAD)
        for k in scored:
            v = res[k]["per_lead"][key]
            t.add(k, *[fmt(v.get(col), nan="nan") for col in _COLS],
                  *[fmt(res[k].get(e), nan="nan") for e in _EXTRA],
                  values={col: v.get(col) for col in _COLS})
        page.table(t)
        if scored:
            sc = {k: res[k]["per_lead"][key] for k in scored}
            best = min(sc, key=lambda k: sc[k]["crps"])
            closest = min(sc, key=lambda k: abs(sc[k]["coverage"] - 0.95))
            w1 = min(sc, key=lambda k: sc[k]["pit_w1"])
            text = (f"Best CRPS: **{best}**; coverage closest to 95 %: **{closest}**; "
                    f"lowest native W1: **{w1}**.")
            page.add("")
            page.headline(text, readme=f"Lead {key}: {text}")
            for sa in ("sa-paper", "sa-crps", "sa-conformal", *_SA_VARIANTS):
                if sa in sc:
                    beaten = [k for k in sc if k != sa and sc[k]["crps"] < sc[sa]["crps"]]
                    page.add(f"* {sa} CRPS beaten by: {', '.join(beaten) or 'none'}.")
            ablation_block(page, {k: {"point": v["rmse_lat"], "crps": v["crps"],
                                      "coverage": v["coverage"], "w1": v["pit_w1"]}
                                  for k, v in sc.items()}, point="RMSE",
                           frozen=res.get("frozen", {}).get("per_lead", {}).get(key, {}).get(
                               "rmse_lat"), metrics=("point", "crps", "coverage", "w1"),
                           title=f"**Ablations at {key}** (SA variants against their reference "
                           "rows; RMSE latitude-weighted):",
                           nu={k: res[k].get("nu_map", res[k].get("nu")) for k in sc},
                           floor={k: res[k] for k in sc})
            page.add("")
    if "sa" in res:  # issue #20's goal for this suite, read off the W1 column
        sa_w1 = {f"+{ld}h": res["sa"]["per_lead"][f"+{ld}h"]["pit_w1"] for ld in leads}
        page.add("Issue #20's ERA5 goal, native W1(PIT, U) of `sa` at most 0.05 at every lead: "
                 + "; ".join(f"{k} {fmt(v)} ({'met' if v <= 0.05 else 'not met'})"
                             for k, v in sa_w1.items()) + ".", "")
    if root is not None:  # issue #34: what the evidence tells a user
        add_section(page, root, "era5")
    if scored:
        page.implementations(p["implementations"])
    if c.get("note"):
        page.add("Notes:", *[f"* {n}" for n in c["note"]], "")
    page.add("Maps of mean error and predicted spread: `era5/era5_maps.png`; raw numbers: "
             "`era5/era5_results.json`.", "", "![maps](era5/era5_maps.png)")
    return page


register("era5", help="ERA5 2 m temperature: SA on a small frozen HF-ViT forecaster vs baselines",
         add_arguments=add_arguments, run=run)
