"""``attnuq bench ett``: SA on a frozen Hugging Face PatchTST against the baselines on ETTh1.

The suite is data + backbone + config on the bench spine (:mod:`attnuq.bench._runner`,
``_page``, ``_scoring``); every step is recorded in the JSON written next to the page.

1. Data: :func:`attnuq.data.ett.load_ett` with the standard borders (train 12 months, val 4,
   test 4; val/test windows start ``context`` rows early; scaler fitted on train); metrics on
   the standardised scale, as in the PatchTST/Informer tables. The val windows are cut in time:
   the first half (``val``) for early stopping and each method's own fit (SA's ``nu``, the
   residual distributions), the second half (``cal``) for the split-conformal steps.
2. Backbone: ``PatchTSTForPrediction`` trained here through :func:`attnuq.training.fit` with
   early stopping, written with ``save_pretrained`` and read back with ``from_pretrained``
   (frozen). The deep ensemble retrains the same recipe with other seeds (member 0 = backbone).
3. Methods by name from :mod:`attnuq.methods` (``sa-conformal`` shares ``sa-paper``'s ``nu``
   and test draws), plus the suite's own reference row ``seasonal-naive`` (24 h). Scores over
   the test windows (:class:`~attnuq.bench._scoring.StreamScores`): MSE, MAE, coverage and width
   of the central 95 % interval, W1 of the PIT to U(0, 1), CRPS, extra cost; fan chart of ``OT``.
4. One JSON per scored method under ``<out>/ett/runs/<csv stem>/`` (``--resume`` reuses those of
   the same config), the assembled ``<out>/ett/ett_results.json`` that :func:`render_page` turns
   into ``ett.md`` and its JSON twin, and the ``ett`` key of ``summary.json``.

Examples
--------
Run the full suite (a few tens of minutes on a laptop core)::

    attnuq bench ett --data-dir ../shared/data --out docs/results
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnuq._io import atomic_savefig, atomic_write_json, read_json_or_none
from attnuq._validation import check_positive_int
from attnuq.bench import register
from attnuq.bench._members import cache_text, jobs_text
from attnuq.bench._page import Page, Table, fmt
from attnuq.bench._scoring import StreamScores, to_cpu
from attnuq.methods import ResidualQuantiles  # re-exported until era5 imports it from there
from attnuq.predictive import GaussianPredictive, Predictive

__all__ = ["ALL_METHODS", "ResidualQuantiles", "StreamScores", "add_arguments", "render_page",
           "run", "summary"]

#: every method the suite knows, in table order
ALL_METHODS: tuple[str, ...] = ("sa-paper", "sa-crps", "sa-conformal", "mc-dropout", "ensemble",
                                "swag", "conformal", "seasonal-naive")
#: cheap and central methods first, the retraining ones last (partial results stay useful)
_RUN_ORDER = ("sa-paper", "sa-conformal", "conformal", "seasonal-naive", "sa-crps", "mc-dropout",
              "swag", "ensemble")
#: config keys that do not shape a result
_RESUME_FREE = ("methods", "resume", "merge", "note", "no_progress", "threads", "retrain", "chunk",
                "out", "model_dir", "rerun", "member_jobs", "render_only")
#: config keys that change only these methods (checked only for a record of one of them)
_METHOD_KEYS: dict[str, tuple[str, ...]] = {
    "member_epochs": ("ensemble",), "ensemble": ("ensemble",), "swag_epochs": ("swag",),
    "swag_snapshots": ("swag",)}
_COLS = ("mse", "mae", "coverage", "width", "pit_w1", "crps", "mean_std")
_TITLE = "ETTh1: stochastic attention on a frozen PatchTST vs baselines"
#: published PatchTST/42 test MSE on ETTh1 at horizon 96 (Nie et al. 2023, table 3)
_REFERENCE = (0.375, "PatchTST/42 (Nie et al. 2023), ETTh1 horizon 96")
#: rows this suite computes itself (the others are registered methods: the registry's text)
_IMPLEMENTATIONS: dict[str, str] = {
    "seasonal-naive": "this suite: the last 24 h repeated (attnuq.data.ett.seasonal_naive) plus "
                      "val residual quantiles per (horizon step, channel)",
}

AnyPred = Predictive | GaussianPredictive


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", default=None, help="data root (holds ett/ETTh1.csv)")
    p.add_argument("--file", default="ETTh1.csv", help="ETT-layout CSV (name under ett/ or path)")
    p.add_argument("--out", default="docs/results", help="results root (writes ett.md, ett/)")
    p.add_argument("--model-dir", default=None,
                   help="folder for the save_pretrained backbone (default <out>/ett/backbone; "
                        "reused when it exists and --retrain is not given)")
    p.add_argument("--retrain", action="store_true", help="train the backbone even if saved")
    for flag, default in (("context", 336), ("horizon", 96), ("d-model", 32), ("layers", 2),
                          ("heads", 2), ("ffn", 64), ("patch", 16), ("stride", 8)):
        p.add_argument(f"--{flag}", type=int, default=default)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--patience", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-steps-per-epoch", type=int, default=None)
    p.add_argument("--member-epochs", type=int, default=None,
                   help="epoch cap for ensemble members (default: --epochs, the backbone's "
                        "recipe; a smaller cap is stated on the page)")
    p.add_argument("--ensemble", type=int, default=5, help="deep-ensemble size")
    p.add_argument("--member-jobs", type=int, default=1,
                   help="train the ensemble members in this many worker processes (spawn, one "
                        "thread each; same recipe, seeds and weights as 1 = one after the other)")
    p.add_argument("--swag-epochs", type=int, default=2)
    p.add_argument("--swag-snapshots", type=int, default=4, help="SWAG snapshots per epoch")
    p.add_argument("--n-samples", type=int, default=20, help="Monte Carlo passes per method")
    p.add_argument("--n-passes", type=int, default=10, help="passes per nu in calibration")
    p.add_argument("--nu-max", type=int, default=128,
                   help="upper end of SA's nu search (cost of a pass grows with nu)")
    p.add_argument("--test-stride", type=int, default=1, help="stride over test windows")
    p.add_argument("--val-stride", type=int, default=2,
                   help="stride over val/cal windows (calibration cost)")
    p.add_argument("--chunk", type=int, default=128, help="test windows per prediction call")
    p.add_argument("--methods", default=",".join(ALL_METHODS),
                   help=f"comma-separated subset of {','.join(ALL_METHODS)}")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the backbone and the methods; ensemble member k uses seed + k")
    p.add_argument("--device", default="cpu",
                   help="torch device: cpu, cuda, cuda:N or auto (default: cpu)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--note", action="append", default=None, metavar="TEXT",
                   help="provenance note printed in the markdown (e.g. how the backbone was "
                        "trained in an earlier invocation); repeatable")
    p.add_argument("--merge", action="append", default=None, metavar="JSON",
                   help="also take the methods scored in another ett_results.json written with "
                        "the same config (parallel runs); repeatable")
    p.add_argument("--resume", action="store_true",
                   help="keep the methods already scored in <out>/ett/runs (same config apart "
                        "from --methods/--resume) and run only the missing ones")
    p.add_argument("--render-only", action="store_true",
                   help="only write ett.md and its JSON twin again from <out>/ett/ett_results.json")
    p.add_argument("--rerun", default="", metavar="METHODS",
                   help="comma-separated methods to score again even when --resume/--merge "
                        "supply them")


def _parse_methods(spec: str) -> list[str]:
    ms = [m.strip() for m in spec.split(",") if m.strip()]
    bad = [m for m in ms if m not in ALL_METHODS]
    if bad or not ms:
        raise ValueError(f"unknown methods {bad} in --methods={spec!r}; known: {list(ALL_METHODS)}")
    return ms


def _split_val(x: torch.Tensor, y: torch.Tensor, stride: int) -> tuple[tuple[torch.Tensor, ...],
                                                                        tuple[torch.Tensor, ...]]:
    """First half of the val windows (in time) -> val, second half -> cal, both strided."""
    h = x.shape[0] // 2
    if h < 2:
        raise ValueError(f"too few val windows to split into val and cal: {x.shape[0]}")
    return (x[:h:stride], y[:h:stride]), (x[h::stride], y[h::stride])


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _fan_rows(pred: AnyPred, rows: torch.Tensor, ch: int) -> dict[str, list[list[float]]]:
    """Quantiles of channel ``ch`` for the chosen rows of a chunk, for the fan chart."""
    if isinstance(pred, GaussianPredictive):
        sub: AnyPred = GaussianPredictive(mean=pred.mean[rows][..., ch],
                                          std=pred.std[rows][..., ch])
    else:
        sub = Predictive(samples=pred.samples[:, rows][..., ch])
    return {name: sub.quantile(q).tolist() for name, q in (
        ("q025", 0.025), ("q25", 0.25), ("q50", 0.5), ("q75", 0.75), ("q975", 0.975))}


def _evaluate(predict_fn: Callable[[torch.Tensor], dict[str, AnyPred]], x: torch.Tensor,
              y: torch.Tensor, *, chunk: int, fan_idx: Sequence[int], fan_channel: int,
              seed: int, desc: str, progress: bool, device: torch.device | None = None,
              ) -> tuple[dict[str, dict[str, float]], dict[str, Any], float]:
    """Score every named predictive that ``predict_fn`` returns per chunk (shared samples).

    ``x`` and ``y`` stay on the CPU; each chunk of inputs goes to ``device`` for the prediction
    and the predictions come back to the CPU for scoring.
    """
    from tqdm.auto import tqdm

    scores: dict[str, StreamScores] = {}
    fans: dict[str, dict[str, list[list[float]]]] = {}
    t0 = time.perf_counter()
    for sl in tqdm(_chunks(x.shape[0], chunk), desc=desc, disable=not progress):
        with torch.no_grad():
            xs = x[sl] if device is None else x[sl].to(device)
            preds = {k: to_cpu(v) for k, v in predict_fn(xs).items()}
        rows = [i - sl.start for i in fan_idx if sl.start <= i < sl.stop]
        for name, pred in preds.items():
            scores.setdefault(name, StreamScores(seed=seed)).update(pred, y[sl])
            fan = fans.setdefault(name, {})
            if rows:
                for k, v in _fan_rows(pred, torch.tensor(rows), fan_channel).items():
                    fan.setdefault(k, []).extend(v)
    return {k: v.result() for k, v in scores.items()}, fans, time.perf_counter() - t0


@dataclass
class _MemberRecipe:
    """The backbone's recipe (picklable, for :func:`attnuq.bench._members.train_members`).

    Member ``k`` (``k = 0`` is the backbone) is initialised and trained with seed ``seed + k``;
    members ``k >= 1`` get at most ``member_epochs`` epochs (the backbone ``epochs``). Holds the
    training and early-stopping windows on the CPU; ``make`` and ``train`` use ``device``.
    """

    n_channels: int
    context: int
    horizon: int
    d_model: int
    layers: int
    heads: int
    ffn: int
    patch: int
    stride: int
    dropout: float
    epochs: int
    member_epochs: int
    lr: float
    batch_size: int
    patience: int
    max_steps_per_epoch: int | None
    seed: int
    progress: bool
    device: str
    train_xy: tuple[torch.Tensor, torch.Tensor]
    val_xy: tuple[torch.Tensor, torch.Tensor]

    def make(self, index: int) -> Any:
        from attnuq.models.patchtst import PatchTSTForecaster, build_patchtst

        return PatchTSTForecaster(build_patchtst(
            num_channels=self.n_channels, context_length=self.context,
            prediction_length=self.horizon, d_model=self.d_model, num_layers=self.layers,
            num_heads=self.heads, ffn_dim=self.ffn, patch_length=self.patch,
            patch_stride=self.stride, dropout=self.dropout, seed=self.seed + index,
        )).to(self.device)

    def train(self, model: Any, _train: Any, _val: Any, index: int) -> Any:
        from attnuq.training import fit

        dev = torch.device(self.device)
        # the Task's batches wrap exactly these tensors; train on the tensors directly (MSE,
        # AdamW without weight decay, torch seeded, val MSE over batches of 512)
        return fit(
            model, (self.train_xy[0].to(dev), self.train_xy[1].to(dev)),
            (self.val_xy[0].to(dev), self.val_xy[1].to(dev)), metric="mse",
            optimizer=torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=0.0),
            lr=self.lr, weight_decay=0.0,
            max_epochs=self.epochs if index == 0 else self.member_epochs,
            patience=self.patience, batch_size=self.batch_size, val_batch_size=512,
            max_steps_per_epoch=self.max_steps_per_epoch, seed=self.seed + index,
            seed_torch=True, count_val_forward=False, progress=self.progress,
            desc="backbone" if index == 0 else f"member{index}",
        )


def _reuse(cfg: dict[str, Any], method: str) -> dict[str, Any]:
    """The config a stored record of ``method`` must have been run with to be reused."""
    return {k: v for k, v in cfg.items() if k not in _RESUME_FREE
            and (k not in _METHOD_KEYS or method in _METHOD_KEYS[k])}


def _merged(files: Sequence[str], cfg: dict[str, Any], rerun: Sequence[str]
            ) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """Results, fan-chart quantiles and provenance taken from other runs' ett_results.json."""
    results: dict[str, Any] = {}
    fans: dict[str, Any] = {}
    runs: list[dict[str, Any]] = []
    for src in map(Path, files):
        prev = read_json_or_none(src, "ETT results", validate=lambda r: isinstance(r, dict)
                                 and isinstance(r.get("results"), dict) and "run" in r)
        if prev is None:
            raise ValueError(f"--merge: {src} is missing or not an ETT results file")
        got = {k: v for k, v in prev["results"].items() if k in ALL_METHODS and k not in rerun}
        old = prev.get("config", {})
        for m in got:
            same = {k: v for k, v in _reuse(old, m).items()}
            now = {k: cfg.get(k) for k in same}
            if same != now:
                raise ValueError(f"--resume/--merge: {src} was written with another config: "
                                 f"{same} vs {now}")
        results.update(got)
        fans.update({k: v for k, v in prev.get("fan_chart", {}).items() if k in got})
        earlier = prev["run"].get("merged_runs", [])
        by_earlier = {m for r in earlier for m in r.get("methods", [])}
        run_prev = {k: v for k, v in prev["run"].items() if k != "merged_runs"}
        runs += [{**run_prev, "file": str(src),
                  "methods": sorted(k for k in got if k not in by_earlier)}, *earlier]
        print(f"[ett] from {src}: already scored {sorted(got)}", flush=True)
    return results, fans, runs


def run(args: argparse.Namespace) -> Path:
    """Run the ETT suite; returns the results folder ``<out>/ett``."""
    import attnuq
    from attnuq._runtime import resolve_device, run_info
    from attnuq.bench._members import (
        check_member_jobs,
        load_or_train_backbone,
        member_cache_dir,
        train_members,
    )
    from attnuq.bench._runner import Group, RunStore, run_items
    from attnuq.data.ett import load_ett, resolve_ett_path, seasonal_naive
    from attnuq.methods import Task, make_method
    from attnuq.models.patchtst import load_patchtst, save_patchtst
    from attnuq.training import predict_batched

    res_dir = Path(args.out) / "ett"
    if getattr(args, "render_only", False):
        render_page(res_dir, res_dir.parent / "ett.md").write(res_dir.parent / "ett.md")
        return res_dir
    torch.set_num_threads(check_positive_int(args.threads, "threads"))
    device = resolve_device(getattr(args, "device", "cpu"))
    member_jobs = check_member_jobs(getattr(args, "member_jobs", 1))
    progress = not args.no_progress
    methods = _parse_methods(args.methods)
    rerun = _parse_methods(args.rerun) if getattr(args, "rerun", "") else []
    if any(m not in methods for m in rerun):
        raise ValueError(f"--rerun={args.rerun!r} names methods missing from "
                         f"--methods={args.methods!r}")
    if args.member_epochs is not None:
        check_positive_int(args.member_epochs, "member_epochs")
    for name in ("context", "horizon", "n_samples", "n_passes", "test_stride", "val_stride",
                 "chunk", "ensemble", "epochs", "patience", "swag_epochs"):
        check_positive_int(getattr(args, name), name)
    if args.n_samples < 2:
        raise ValueError(f"n_samples must be >= 2 for intervals and CRPS, got {args.n_samples=}")
    cfg = {k: v for k, v in vars(args).items() if not k.startswith("_") and
           (isinstance(v, (int, float, str, bool, type(None))) or k in ("note", "merge"))}
    info = run_info()
    res_dir.mkdir(parents=True, exist_ok=True)

    # ---- data ---------------------------------------------------------------------------------
    path = resolve_ett_path(args.file, args.data_dir)
    data = load_ett(path, context=args.context)
    H = args.horizon
    xtr, ytr = data.windows("train", horizon=H)
    xv_all, yv_all = data.windows("val", horizon=H)
    (xv, yv), (xc, yc) = _split_val(xv_all, yv_all, args.val_stride)
    xte, yte = data.windows("test", horizon=H, stride=args.test_stride)
    n_test_all = data.windows("test", horizon=H)[0].shape[0]
    ot = data.channel_index("OT") if "OT" in data.columns else data.n_channels - 1
    print(f"[ett] {path.name}: train {len(xtr)}, val {len(xv)}, cal {len(xc)}, "
          f"test {len(xte)} of {n_test_all} windows", flush=True)
    # two consecutive 96-h forecasts (a week with the context shown) when the stride allows
    fan_idx = [0, H // args.test_stride] if H % args.test_stride == 0 else [0]
    fan_idx = [i for i in fan_idx if i < len(xte)]

    # ---- backbone: train + save_pretrained, then from_pretrained (the hub user's path) --------
    recipe = _MemberRecipe(
        n_channels=data.n_channels, context=args.context, horizon=H, d_model=args.d_model,
        layers=args.layers, heads=args.heads, ffn=args.ffn, patch=args.patch,
        stride=args.stride, dropout=args.dropout, epochs=args.epochs,
        member_epochs=args.member_epochs or args.epochs, lr=args.lr,
        batch_size=args.batch_size, patience=args.patience,
        max_steps_per_epoch=args.max_steps_per_epoch, seed=args.seed, progress=progress,
        device=str(device), train_xy=(xtr, ytr), val_xy=(xv, yv),
    )
    member_dir = member_cache_dir(res_dir / "members", recipe)  # keyed by the recipe
    model_dir = Path(args.model_dir) if args.model_dir else res_dir / "backbone"
    frozen, train_report = load_or_train_backbone(
        recipe, model_dir, retrain=args.retrain, save=save_patchtst, load=load_patchtst,
        device=device,
    )
    if train_report["reused"]:
        print(f"[ett] reusing saved backbone {model_dir}", flush=True)
    backbone = {"n_params": sum(p.numel() for p in frozen.parameters()),
                "attention_sites": [s.name for s in attnuq.find_attention(frozen)],
                "train": train_report}
    # the methods fit on `device`; the test windows stay on the CPU (moved chunk by chunk)
    xtr_d, ytr_d, xv, yv, xc, yc = (t.to(device) for t in (xtr, ytr, xv, yv, xc, yc))
    task = Task(model=frozen, train=(xtr_d, ytr_d), val=(xv, yv), cal=(xc, yc),
                make_model=recipe.make, train_fn=recipe.train, batch_size=args.chunk,
                member_dir=member_dir)

    # frozen point forecast (no uncertainty): MSE/MAE only, shared by the post-hoc methods
    with torch.no_grad():
        f_test = torch.cat([predict_batched(frozen, xte[sl].to(device), args.chunk).cpu()
                            for sl in _chunks(len(xte), args.chunk)])
    sn = seasonal_naive(xte, H, season=24)
    points = {name: {"mse": float(((f - yte) ** 2).mean()), "mae": float((f - yte).abs().mean())}
              for name, f in (("frozen", f_test), ("seasonal-naive-point", sn))}
    print(f"[ett] frozen: {points['frozen']}; seasonal naive: {points['seasonal-naive-point']}",
          flush=True)

    # ---- methods: one stored record per method (the runner), merged runs' files -----------------
    merged, merged_fans, merged_runs = _merged(args.merge or [], cfg, rerun)
    store = RunStore(res_dir / "runs", suite="ett", info={**info, "started": info["date"]})
    parts = (path.stem,)
    order = sorted(methods, key=_RUN_ORDER.index)
    group = Group(parts=parts, methods=[m for m in order if m not in merged], reuse=None,
                  method_reuse={m: _reuse(cfg, m) for m in ALL_METHODS})
    if args.resume:  # a stored record of another config is an error, not something to redo
        for m in ALL_METHODS:
            rec = store.load(parts, m, check=False)
            if rec is not None and m not in rerun and rec.get("reuse") != group.reuse_for(m):
                raise ValueError(f"--resume/--merge: {store.path(parts, m)} was written with "
                                 f"another config: {rec.get('reuse')} vs {group.reuse_for(m)}")
    S = args.n_samples
    pending: dict[str, dict[str, Any]] = {}

    def score(names: Sequence[str], predict_fn: Callable[[torch.Tensor], dict[str, AnyPred]],
              extras: dict[str, dict[str, Any]]) -> None:
        scores, fan, sec = _evaluate(
            predict_fn, xte, yte, chunk=args.chunk, fan_idx=fan_idx, fan_channel=ot,
            seed=args.seed, desc="+".join(names), progress=progress, device=device,
        )
        for name in names:
            pending[name] = {"method": name, "fan": fan[name],
                             "scores": {**scores[name], "predict_seconds": sec, **extras[name]}}
            print(f"[ett] {name}: " + ", ".join(f"{k}={v:.4g}" for k, v in scores[name].items()),
                  flush=True)

    def one(name: str, fn: Callable[[torch.Tensor], AnyPred], extra: dict[str, Any]) -> None:
        score([name], lambda xb: {name: fn(xb)}, {name: extra})

    def run_one(_ctx: Any, _group: Group, name: str) -> dict[str, Any]:
        if name in pending:  # scored with the draws of another row (sa-conformal)
            return pending.pop(name)
        t0 = time.perf_counter()
        sa = {"n_samples": S, "n_passes": args.n_passes, "seed": args.seed, "progress": progress,
              "nu_range": (1, args.nu_max)}
        if name in ("sa-paper", "sa-conformal") and "sa-conformal" in methods:
            # one set of SA draws on the test windows scores both rows: the registry's
            # sa-conformal shares sa-paper's nu and draws (base=, derive) and fits its factor on cal
            base = make_method("sa-paper", **sa).fit(task)
            t_fit = time.perf_counter() - t0
            sc = make_method("sa-conformal", base=base).fit(task)
            score(["sa-paper", "sa-conformal"], functools.partial(_with_derived, base, sc), {
                "sa-paper": {"fit_seconds": t_fit, "forward_per_input": S, **_info(base)},
                "sa-conformal": {"fit_seconds": time.perf_counter() - t0,
                                 "forward_per_input": S, **_info(sc)},
            })
            return pending.pop(name)
        if name == "seasonal-naive":  # the suite's reference forecast
            rsn = ResidualQuantiles.fit(yv - seasonal_naive(xv, H, season=24))
            one(name, _Residual(rsn, functools.partial(seasonal_naive, horizon=H, season=24)),
                {"fit_seconds": time.perf_counter() - t0, "forward_per_input": 0,
                 "note": "repeat the last 24 h; distribution = val residual quantiles per "
                         "(horizon step, channel)"})
            return pending.pop(name)
        kw: dict[str, Any] = {
            "sa-paper": sa, "sa-crps": sa, "mc-dropout": {"n_samples": S, "seed": args.seed},
            "conformal": {}, "ensemble": {"n_members": args.ensemble},
            "swag": {"n_samples": S, "epochs": args.swag_epochs, "lr": args.lr / 10,
                     "snapshots_per_epoch": args.swag_snapshots, "seed": args.seed,
                     "progress": progress}}[name]
        fit_task, extra = task, {}
        if name == "ensemble":
            # train (or find) the members first, so that the fit books their training once
            trained = train_members(recipe, list(range(1, args.ensemble)), member_dir,
                                    jobs=member_jobs)
            extra = {"member_epochs": recipe.member_epochs, "member_jobs": member_jobs,
                     "members_trained_here": trained,
                     "members_from_cache": [k for k in range(1, args.ensemble) if k not in trained],
                     "member_seeds": [args.seed + k for k in range(args.ensemble)],
                     "note": "fit s = sum of the members' training times"}
        elif name == "swag":
            # SWAG continues training a copy: give it the same weights with gradients on
            fit_task = dataclasses.replace(
                task, model=load_patchtst(model_dir, freeze=False).to(device))
            extra = {"swag_epochs": args.swag_epochs, "swag_lr": args.lr / 10}
        m = make_method(name, **kw).fit(fit_task)
        booked = name in ("ensemble", "swag")  # their fit time is the cost the method books
        one(name, m.predict, {
            "fit_seconds": m.cost.fit_seconds if booked else time.perf_counter() - t0,
            "forward_per_input": {"ensemble": args.ensemble, "conformal": 1}.get(name, S),
            **({"fit_forward": m.cost.fit_forward} if booked else _info(m)), **extra})
        return pending.pop(name)

    def write(final: bool = False) -> None:
        now = info["command"], info["date"]
        recs: dict[str, dict[str, Any]] = {}
        earlier: dict[Any, dict[str, Any]] = {}  # records of earlier invocations (--resume)
        for m in ALL_METHODS:
            r = None if m in merged else store.load(parts, m, check=False)
            if r is None or r.get("reuse") != group.reuse_for(m):
                continue
            ri = r.get("run_info", {})
            key = ri.get("command"), ri.get("started")
            if key == now or args.resume:
                recs[m] = r
            if key != now and args.resume:
                earlier.setdefault(key, {"command": key[0], "date": key[1],
                                         "machine": ri.get("machine"), "file": str(store.root),
                                         "methods": []})["methods"].append(m)
        runs = merged_runs + list(earlier.values())
        payload = {
            "run": {**info, **({"merged_runs": runs} if runs else {})},
            "config": cfg, "complete": final,
            "data": {"file": str(data.path), "split_rule": data.split_rule,
                     "borders": data.borders, "n_test_windows": int(xte.shape[0]),
                     "n_test_windows_all": int(n_test_all), "columns": list(data.columns)},
            "backbone": backbone,
            "results": {**points, **merged, **{m: r["scores"] for m, r in recs.items()}},
            "fan_chart": {"channel": data.columns[ot], "window_index": list(fan_idx),
                          **merged_fans, **{m: r["fan"] for m, r in recs.items()}},
        }
        _write(res_dir, payload, final=final,
               fan=lambda p, fans: _fan_plot(p, fans, xte, yte, fan_idx, ot, data))

    done = run_items(store, [group], lambda g: None, run_one, progress=False,
                     rerun=group.methods if not args.resume else rerun,
                     on_saved=lambda g, m, r: write())
    write(final=not done.failed)
    if done.failed:
        raise RuntimeError(f"methods failed: {done.failed} (see {store.root}/**/*.err.txt)")
    return res_dir


def _as_samples(p: AnyPred) -> Predictive:
    if not isinstance(p, Predictive):
        raise TypeError(f"expected a sample-based Predictive, got {type(p).__name__}")
    return p


def _with_derived(base: Any, derived: Any, x: torch.Tensor) -> dict[str, AnyPred]:
    """sa-paper's ``p = base.predict(x)`` and sa-conformal's ``derived.derive(p)``."""
    p = _as_samples(base.predict(x))
    return {"sa-paper": p, "sa-conformal": derived.derive(p)}


@dataclass
class _Residual:
    """``point_fn(x)`` plus residual quantiles."""

    rq: ResidualQuantiles
    point_fn: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, x: torch.Tensor) -> AnyPred:
        return self.rq.predictive(self.point_fn(x))


def _info(m: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in (m.info() or {}).items():
        if isinstance(v, (int, float, str, bool)) or v is None:
            out[k] = v
    return out


def _fan_plot(path: Path, fans: dict[str, Any], xte: torch.Tensor, yte: torch.Tensor,
              fan_idx: Sequence[int], ot: int, data: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in fans if fans[n]]
    if not names:
        return
    H = yte.shape[1]
    L = xte.shape[1]
    hist = min(L, 72)
    ncol = 2
    nrow = math.ceil(len(names) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(12, 2.6 * nrow), squeeze=False, sharey=True)
    truth = torch.cat([yte[i, :, ot] for i in fan_idx]).numpy()
    t_f = np.arange(len(truth))
    past = xte[fan_idx[0], -hist:, ot].numpy()
    for ax, name in zip(axes.flat, names, strict=False):
        f = fans[name]
        lo95, hi95 = np.concatenate(f["q025"]), np.concatenate(f["q975"])
        lo50, hi50 = np.concatenate(f["q25"]), np.concatenate(f["q75"])
        med = np.concatenate(f["q50"])
        ax.plot(np.arange(-hist, 0), past, color="0.4", lw=0.8)
        ax.fill_between(t_f, lo95, hi95, color="C0", alpha=0.25, label="95 %")
        ax.fill_between(t_f, lo50, hi50, color="C0", alpha=0.45, label="50 %")
        ax.plot(t_f, med, color="C0", lw=0.9, label="median")
        ax.plot(t_f, truth, color="k", lw=0.9, label="OT")
        for j in range(1, len(fan_idx)):
            ax.axvline(j * H, color="0.6", ls=":", lw=0.8)
        ax.set_title(name, fontsize=9)
    for ax in axes.flat[len(names):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, loc="upper left")
    start = str(data.dates[data.borders["test"][0] + data.context])[:16]
    issued = f"at the test border ({start})" + (f" and {H} h later" if len(fan_idx) > 1 else "")
    fig.suptitle(f"{data.columns[ot]} (standardised), forecasts issued {issued}; {hist} h of "
                 "context shown", fontsize=9)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=110)
    plt.close(fig)


def _write(res_dir: Path, payload: dict[str, Any], *, final: bool,
           fan: Callable[[Path, dict[str, Any]], None]) -> None:
    """``ett_results.json`` (with today's Implementations block), the fan chart (at the end),
    ``ett.md`` and its twin, and the ``ett`` key of ``summary.json``."""
    from attnuq.bench._implementations import implementation_block
    from attnuq.bench._page import update_summary

    res = payload["results"]
    payload["implementations"] = implementation_block(_scored(res), local=_IMPLEMENTATIONS)
    atomic_write_json(res_dir / "ett_results.json", payload, indent=1)
    fans = {m: v for m, v in payload["fan_chart"].items() if m in ALL_METHODS}
    if fans and final:  # drawing is slow on a busy core: once, at the end
        fan(res_dir / "ett_fan_ot.png", fans)
    render_page(res_dir, res_dir.parent / "ett.md").write(res_dir.parent / "ett.md")
    if "frozen" in res:
        update_summary(res_dir.parent / "summary.json", "ett", summary(payload))


def summary(p: dict[str, Any]) -> dict[str, Any]:
    """The suite's key of ``summary.json`` (issue #19) from the stored results ``p``.

    The data set is the CSV's stem (``ETTh1``); the backbone's metric is the frozen model's
    test MSE, with PatchTST/42's published figure as reference for ETTh1 at horizon 96 and the
    seasonal-naive (24 h) MSE otherwise; per method: MSE, CRPS, native PI-95 coverage, W1(PIT).
    """
    res, c = p["results"], p["config"]
    name = Path(p["data"]["file"]).stem
    ref, ref_name = _REFERENCE if (name, c["horizon"]) == ("ETTh1", 96) else (
        res.get("seasonal-naive-point", {}).get("mse"), "seasonal naive (24 h)")
    methods = {"frozen": {"mse": res["frozen"]["mse"]}}
    for k, v in _scored(res).items():
        methods[k] = {"mse": v["mse"], "crps": v["crps"], "coverage95_native": v["coverage"],
                      "w1_native": v["pit_w1"]}
    return {name: {"backbone": {"metric": "mse", "value": res["frozen"]["mse"], "reference": ref,
                                "reference_name": ref_name},
                   "splits": 1, "methods": methods}}


def _ensemble_text(c: dict[str, Any], res: dict[str, Any]) -> str:
    """The deep-ensemble recipe line of the page, from the ensemble's own record if scored."""
    e = res.get("ensemble", {})
    m_ep = e.get("member_epochs", c.get("member_epochs") or c["epochs"])
    jobs = e.get("member_jobs", c.get("member_jobs", 1))
    k = c["ensemble"] - 1
    text = (f"deep ensemble: {c['ensemble']} members (member 0 = the backbone; members 1..{k} "
            f"retrained by this suite with seeds {c['seed']}+k, epoch cap {m_ep}, steps/epoch "
            f"cap {c['max_steps_per_epoch']}, "
            + jobs_text(jobs) + ")")
    text += cache_text(e, "ett")
    if m_ep != c["epochs"]:
        text += (f" -- **members 1..{k} had an epoch cap of {m_ep}, the backbone's recipe "
                 f"{c['epochs']}: they are not trained like the backbone**")
    return text


def _scored(res: dict[str, Any]) -> dict[str, Any]:
    """The table's rows: the scored methods, in table order."""
    return {k: res[k] for k in ALL_METHODS if k in res and "crps" in res[k]}


def render_page(out: Path, table: Path) -> Page:
    """The page ``table`` (``ett.md``) built from the stored ``<out>/ett_results.json`` alone.

    Examples
    --------
    The committed page of the checkout is what this makes of the committed JSON:

    >>> from pathlib import Path
    >>> docs = Path(__file__).resolve().parents[3] / "docs" / "results"
    >>> page = render_page(docs / "ett", docs / "ett.md")
    >>> page.markdown() == (docs / "ett.md").read_text()
    True
    """
    p = read_json_or_none(Path(out) / "ett_results.json", "ETT results")
    if p is None:
        raise ValueError(f"no ETT results to render in {out} (run `attnuq bench ett` first)")
    r, c, d, b = p["run"], p["config"], p["data"], p["backbone"]
    tr = b["train"]
    res = p["results"]
    page = Page("ett", _TITLE, state={"results": f"{Path(out).name}/ett_results.json"})
    page.add("Generated by `attnuq bench ett` -- do not edit by hand."
             + ("" if p["complete"] else " **(partial: run still in progress or interrupted)**"),
             "")
    page.provenance(r)
    page.add(
        *[f"* methods {', '.join(m['methods'])} scored earlier by `{m['command']}` "
          f"({m['date']}), same config, merged from its JSON" for m in r.get("merged_runs", [])
          if m["methods"]],
        f"* data: `{Path(d['file']).name}`, {d['split_rule']}; borders (rows, val/test include "
        f"the {c['context']}-row context overlap): "
        f"{ {k: tuple(v) for k, v in d['borders'].items()} }",
        f"* test windows scored: {d['n_test_windows']} of {d['n_test_windows_all']} "
        f"(stride {c['test_stride']}), horizon {c['horizon']}, all {len(d['columns'])} channels;"
        " metrics on the train-standardised scale",
        f"* val windows: first half (stride {c['val_stride']}) for early stopping and each "
        "method's own fit (SA's nu, residual distributions); second half (same stride) = cal "
        "for the conformal steps",
        f"* backbone: HF `PatchTSTForPrediction`, context {c['context']}, d_model {c['d_model']}, "
        f"{c['layers']} layers, {c['heads']} heads, ffn {c['ffn']}, patch {c['patch']} stride "
        f"{c['stride']}, dropout {c['dropout']}, {b['n_params']} parameters; trained here "
        f"({tr.get('epochs_run')} epochs, best epoch {tr.get('best_epoch')}, best val MSE "
        f"{fmt(tr.get('best_val'))}, {fmt(tr.get('seconds'))} s"
        f"{', reused from disk' if tr.get('reused') else ''}), `save_pretrained` then "
        "`from_pretrained` (frozen)",
        f"* Monte Carlo samples per method: {c['n_samples']}; calibration passes per nu: "
        f"{c['n_passes']}, nu searched in [1, {c.get('nu_max')}] (BO); {_ensemble_text(c, res)}; "
        f"SWAG: {c['swag_epochs']} epochs x {c.get('swag_snapshots')} snapshots at lr/10",
        "",
    )
    if "frozen" in res:
        sn = res.get("seasonal-naive-point", {})
        page.headline(f"Point forecasts: frozen PatchTST MSE {fmt(res['frozen']['mse'])}, MAE "
                      f"{fmt(res['frozen']['mae'])}; seasonal naive (24 h) MSE "
                      f"{fmt(sn.get('mse'))}, MAE {fmt(sn.get('mae'))}.")
        page.add("")
    t = Table(["method", "MSE", "MAE", "PI-95 coverage", "PI-95 width", "W1(PIT, U)", "CRPS",
               "mean std", "nu", "fit s", "predict s", "passes/input"])
    extra = ("nu", "fit_seconds", "predict_seconds", "forward_per_input")
    scored = _scored(res)
    for name, v in scored.items():
        t.add(name, *[fmt(v.get(k)) for k in (*_COLS, *extra)],
              values={k: v.get(k) for k in (*_COLS, *extra)})
    page.table(t)
    if scored:
        best_crps = min(scored, key=lambda k: scored[k]["crps"])
        best_w1 = min(scored, key=lambda k: scored[k]["pit_w1"])
        closest = min(scored, key=lambda k: abs(scored[k]["coverage"] - 0.95))
        page.add("")
        page.headline(f"Best CRPS: **{best_crps}**; lowest W1(PIT, U): **{best_w1}**; coverage "
                      f"closest to 95 %: **{closest}**.")
        for sa in ("sa-paper", "sa-crps", "sa-conformal"):
            if sa in scored:
                beaten = [k for k in scored if k != sa and scored[k]["crps"] < scored[sa]["crps"]]
                page.add(f"* {sa} CRPS is beaten by: {', '.join(beaten) or 'none'}.")
        page.add("")
        page.implementations(p["implementations"], trailing_blank=False)
    notes = c.get("note") or []
    if notes:
        page.add("", "Notes:", *[f"* {n}" for n in notes])
    page.add("", "Fan chart of OT: `ett/ett_fan_ot.png`; raw numbers: `ett/ett_results.json`.",
             "", "![fan chart](ett/ett_fan_ot.png)")
    return page


register(
    "ett",
    help="ETTh1 (or any ETT-layout CSV): SA on a frozen HF PatchTST vs baselines",
    add_arguments=add_arguments,
    run=run,
)


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("MPLBACKEND", "Agg")
