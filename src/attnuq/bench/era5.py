"""``attnuq bench era5``: SA on a small frozen ViT forecaster of ERA5 2 m temperature.

Pipeline (recorded in the JSON next to the markdown table):

1. :func:`attnuq.data.era5.load_field` (GRIB through cfgrib, or NetCDF); the hourly fields are
   cut into consecutive blocks of whole days: train / val / cal / test (default 18 / 5 / 4 /
   the rest, i.e. 1-18, 19-23, 24-27 and 28-31 March 2019). Every example's time span
   ``[t - history, t + max lead]`` lies inside its block, so the parts share no field.
2. Inputs at issue time ``t`` (every hour): the field at ``t`` and at ``t - 6 h`` and, by default,
   the hour-of-day training climatology at the two valid times (hour features); targets: the
   field at ``t + 6 h`` and ``t + 24 h``.
3. Backbone: :class:`attnuq.models.vit_field.ViTFieldForecaster` (Hugging Face ViT blocks,
   patch 4 on the 33 x 49 grid padded to 36 x 52, linear per-patch head) trained here with
   early stopping on val, saved, reloaded and frozen.
4. Methods: ``sa-paper`` (calibration-first), ``sa-crps`` (score-first), ``sa-conformal``
   (``sa-paper``'s draws with a conformal spread factor from cal), ``mc-dropout``, ``ensemble``
   (member 0 = the backbone), and the references ``persistence`` and ``climatology``
   (hour-of-day mean of the training days), each with the per-grid-point distribution of its
   val residuals so that they get probabilistic scores too.
5. Scores per lead on the test days: latitude-weighted RMSE (of the predictive mean), ACC against
   the hour-of-day training climatology (WeatherBench/ClimaX pooled definition), native and
   scaled W1 of the PIT, PI-95 width and coverage, CRPS, extra cost; maps of the mean error and of
   the predicted spread.

Examples
--------
::

    attnuq bench era5 --data-dir ../shared/data --out docs/results
"""

from __future__ import annotations

import argparse
import json
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnuq._io import (
    CorruptFileWarning,
    atomic_np_savez,
    atomic_savefig,
    atomic_write_json,
    atomic_write_text,
    read_json_or_none,
)
from attnuq._validation import check_positive_int
from attnuq.bench import register
from attnuq.bench._members import cache_text, jobs_text
from attnuq.bench.ett import ResidualQuantiles, StreamScores
from attnuq.predictive import GaussianPredictive, Predictive

__all__ = ["ALL_METHODS", "add_arguments", "field_scores", "run"]

ALL_METHODS: tuple[str, ...] = (
    "sa-paper",
    "sa-crps",
    "sa-conformal",
    "mc-dropout",
    "ensemble",
    "persistence",
    "climatology",
)
_RUN_ORDER = ("sa-paper", "sa-conformal", "persistence", "climatology", "sa-crps", "mc-dropout",
              "ensemble")
AnyPred = Predictive | GaussianPredictive


def _lead_slice(pred: AnyPred, i: int) -> AnyPred:
    if isinstance(pred, GaussianPredictive):
        return GaussianPredictive(mean=pred.mean[:, i], std=pred.std[:, i])
    return Predictive(samples=pred.samples[:, :, i])


def _mean(pred: AnyPred) -> torch.Tensor:
    return pred.mean if isinstance(pred, GaussianPredictive) else pred.samples.mean(0)


def _spread(pred: AnyPred) -> torch.Tensor:
    if isinstance(pred, GaussianPredictive):
        return pred.std
    return pred.samples.std(0) if pred.samples.shape[0] > 1 else torch.zeros_like(pred.samples[0])


def _scaled_w1(pred: AnyPred, y: torch.Tensor, seed: int) -> float:
    """W1 of the PIT after one pooled spread factor (see :func:`attnuq.metrics.pit_w1_scaled`).

    For a Gaussian the factor is ``k^2 = mean (y - m)^2 / mean s^2`` and the PIT is exact,
    ``Phi((y - m) / (k s))``.
    """
    from attnuq import metrics

    if isinstance(pred, GaussianPredictive):
        m, s = pred.mean.double(), pred.std.double().clamp_min(1e-12)
        k = math.sqrt(float(((y.double() - m) ** 2).mean() / (s**2).mean()))
        pit = 0.5 * (1 + torch.erf((y.double() - m) / (k * s) / math.sqrt(2.0)))
        return float(metrics.pit_w1(pit.reshape(-1)))
    if pred.samples.shape[0] < 2 or float(pred.samples.std(0).max()) == 0.0:
        return float("nan")
    g = torch.Generator().manual_seed(seed)
    return float(metrics.pit_w1_scaled(pred.samples.double(), y.double(), generator=g))


def _acc(f: torch.Tensor, y: torch.Tensor, clim: torch.Tensor, lat: torch.Tensor) -> float:
    """Latitude-weighted ACC; NaN when the forecast anomaly is identically zero (the
    climatology forecast itself), where the correlation is undefined."""
    from attnuq import metrics

    try:
        return float(metrics.lat_weighted_acc(f.double(), y.double(), clim.double(), lat))
    except ValueError:
        return float("nan")


def field_scores(
    pred: AnyPred,
    y: torch.Tensor,
    *,
    lat: torch.Tensor,
    clim: torch.Tensor,
    leads: tuple[int, ...],
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """Scores per lead of a predictive distribution of fields.

    Parameters
    ----------
    pred
        Samples ``(S, B, L, n_lat, n_lon)`` or a Gaussian with ``(B, L, n_lat, n_lon)`` moments.
    y
        ``(B, L, n_lat, n_lon)`` observed fields; ``L`` = number of leads.
    lat
        ``(n_lat,)`` degrees (for the latitude weights of RMSE and ACC).
    clim
        ``(B, L, n_lat, n_lon)`` climatology at each valid time (ACC reference).

    Returns
    -------
    ``{"+6h": {...}, "+24h": {...}}`` with ``rmse_lat``, ``acc``, ``mse``, ``mae``, ``coverage``,
    ``width`` (PI-95), ``pit_w1`` (native), ``pit_w1_scaled``, ``crps``, ``mean_std``.
    """
    from attnuq import metrics

    if y.dim() != 4 or y.shape[1] != len(leads):
        raise ValueError(f"y must be (B, {len(leads)}, n_lat, n_lon), got {tuple(y.shape)}")
    if clim.shape != y.shape:
        raise ValueError(f"clim must have y's shape {tuple(y.shape)}, got {tuple(clim.shape)}")
    out: dict[str, dict[str, float]] = {}
    for i, lead in enumerate(leads):
        p = _lead_slice(pred, i)
        yi = y[:, i].double()
        sc = StreamScores(seed=seed)
        sc.update(p, yi)
        r = sc.result()
        m = _mean(p).double()
        r["rmse_lat"] = float(metrics.lat_weighted_rmse(m, yi, lat))
        r["acc"] = _acc(m, yi, clim[:, i], lat)
        r["pit_w1_scaled"] = _scaled_w1(p, yi, seed)
        out[f"+{lead}h"] = r
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", default=None, help="data root (holds era5/<file>)")
    p.add_argument("--file", default="era5-2mt-2019-03-uk.grib",
                   help="GRIB or NetCDF file with (time, latitude, longitude)")
    p.add_argument("--variable", default=None, help="variable name (default: the only one)")
    p.add_argument("--out", default="docs/results", help="results root (writes era5.md, era5/)")
    p.add_argument("--model-dir", default=None,
                   help="backbone folder (default <out>/era5/backbone)")
    p.add_argument("--retrain", action="store_true")
    p.add_argument("--split", default="18,5,4,-1",
                   help="days in train,val,cal,test (consecutive; -1 = the rest)")
    p.add_argument("--history", type=int, default=6, help="hours back of the second input field")
    p.add_argument("--leads", default="6,24", help="lead times in hours")
    p.add_argument("--no-clim-features", action="store_true",
                   help="inputs = current and previous field only (no climatology channels)")
    p.add_argument("--patch", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--mlp", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--patience", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ensemble", type=int, default=5)
    p.add_argument("--member-jobs", type=int, default=1,
                   help="train the ensemble members in this many worker processes (spawn, one "
                        "thread each; same recipe, seeds and weights as 1 = one after the other)")
    p.add_argument("--n-samples", type=int, default=30)
    p.add_argument("--n-passes", type=int, default=10)
    p.add_argument("--nu-max", type=int, default=1024, help="upper end of SA's nu search")
    p.add_argument("--methods", default=",".join(ALL_METHODS),
                   help=f"comma-separated subset of {','.join(ALL_METHODS)}")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the backbone; ensemble member k uses seed + k")
    p.add_argument("--device", default="cpu",
                   help="torch device: cpu, cuda, cuda:N or auto (default: cpu)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--resume", action="store_true",
                   help="keep the methods already scored in <out>/era5/era5_results.json (and "
                        "their maps) when written with the same config; run only the rest")
    p.add_argument("--rerun", default="", metavar="METHODS",
                   help="comma-separated methods to score again even when --resume holds them")
    p.add_argument("--note", action="append", default=None, metavar="TEXT",
                   help="provenance note printed in the markdown; repeatable")


def _parse_ints(spec: str, name: str) -> list[int]:
    try:
        return [int(v) for v in spec.split(",") if v.strip()]
    except ValueError as exc:
        raise ValueError(f"{name} must be comma-separated integers, got {spec!r}") from exc


@dataclass
class _Inputs:
    """Assemble model inputs: fields ``(N, 2, H, W)`` + climatology at the valid times."""

    clim: torch.Tensor  # (24, H, W)
    leads: tuple[int, ...]
    use_clim: bool

    def valid_clim(self, hours: np.ndarray) -> torch.Tensor:
        """``(N, L, H, W)`` climatology at ``t + lead`` for issue hours ``hours``."""
        idx = [(hours + lead) % 24 for lead in self.leads]
        return torch.stack([self.clim[torch.from_numpy(i)] for i in idx], dim=1)

    def for_examples(self, e: Any) -> torch.Tensor:
        """Climatology forecast ``(N, L, H, W)`` of an :class:`~attnuq.data.era5.Examples`."""
        return self.valid_clim(e.hours)

    def __call__(self, fields: torch.Tensor, hours: np.ndarray) -> torch.Tensor:
        if not self.use_clim:
            return fields
        return torch.cat([fields, self.valid_clim(hours)], dim=1)


@dataclass
class _MemberRecipe:
    """The backbone's recipe (picklable, for :func:`attnuq.bench._members.train_members`).

    Member ``k`` (``k = 0`` is the backbone) is initialised and trained with seed ``seed + k``.
    Holds the training and validation tensors on the CPU; ``make`` and ``train`` put the model
    and the data on ``device``.
    """

    grid: tuple[int, int]
    in_channels: int
    out_channels: int
    patch: int
    hidden: int
    layers: int
    heads: int
    mlp: int
    dropout: float
    mean: float
    std: float
    epochs: int
    lr: float
    batch_size: int
    patience: int
    seed: int
    progress: bool
    device: str
    train_xy: tuple[torch.Tensor, torch.Tensor]
    val_xy: tuple[torch.Tensor, torch.Tensor]

    def make(self, index: int) -> Any:
        from attnuq.models.vit_field import ViTFieldForecaster

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + index)
            m = ViTFieldForecaster(
                self.grid, in_channels=self.in_channels, out_channels=self.out_channels,
                patch_size=self.patch, hidden_size=self.hidden, num_layers=self.layers,
                num_heads=self.heads, mlp_size=self.mlp, dropout=self.dropout,
                attention_dropout=self.dropout, mean=self.mean, std=self.std,
            )
        return m.to(self.device)

    def train(self, model: Any, _train: Any, _val: Any, index: int) -> Any:
        from attnuq.models.patchtst import train_forecaster

        dev = torch.device(self.device)
        return train_forecaster(
            model, tuple(t.to(dev) for t in self.train_xy),  # type: ignore[arg-type]
            tuple(t.to(dev) for t in self.val_xy),  # type: ignore[arg-type]
            epochs=self.epochs, lr=self.lr, batch_size=self.batch_size,
            patience=self.patience, seed=self.seed + index, progress=self.progress,
            desc=f"member{index}",
        )


def _to_cpu(pred: AnyPred) -> AnyPred:
    if isinstance(pred, GaussianPredictive):
        return GaussianPredictive(mean=pred.mean.cpu(), std=pred.std.cpu())
    return Predictive(samples=pred.samples.cpu(),
                      frozen=None if pred.frozen is None else pred.frozen.cpu())


def run(args: argparse.Namespace) -> Path:
    """Run the ERA5 suite; returns ``<out>/era5``."""
    import attnuq
    from attnuq._runtime import resolve_device, run_info
    from attnuq.bench._members import (
        check_member_jobs,
        load_or_train_backbone,
        member_cache_dir,
        train_members,
    )
    from attnuq.data.era5 import (
        day_blocks,
        hourly_climatology,
        load_field,
        make_examples,
        resolve_era5_path,
    )
    from attnuq.methods import Task, coverage_scale, make_method
    from attnuq.models.patchtst import predict_batched
    from attnuq.models.vit_field import load_vit_field, save_vit_field

    torch.set_num_threads(check_positive_int(args.threads, "threads"))
    device = resolve_device(getattr(args, "device", "cpu"))
    member_jobs = check_member_jobs(getattr(args, "member_jobs", 1))
    progress = not args.no_progress
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    rerun = [m.strip() for m in (getattr(args, "rerun", "") or "").split(",") if m.strip()]
    bad = [m for m in methods + rerun if m not in ALL_METHODS]
    if bad or not methods:
        raise ValueError(f"unknown methods {bad} in --methods={args.methods!r} / "
                         f"--rerun={getattr(args, 'rerun', '')!r}; known: {list(ALL_METHODS)}")
    if any(m not in methods for m in rerun):
        raise ValueError(f"--rerun={args.rerun!r} names methods missing from "
                         f"--methods={args.methods!r}")
    for name in ("history", "n_samples", "n_passes", "ensemble", "epochs", "patience",
                 "batch_size"):
        check_positive_int(getattr(args, name), name)
    if args.n_samples < 2:
        raise ValueError(f"n_samples must be >= 2, got {args.n_samples=}")
    leads = tuple(_parse_ints(args.leads, "--leads"))
    split = _parse_ints(args.split, "--split")
    if len(split) != 4:
        raise ValueError(f"--split needs 4 day counts (train,val,cal,test), got {args.split!r}")
    info = run_info()
    res_dir = Path(args.out) / "era5"
    res_dir.mkdir(parents=True, exist_ok=True)

    path = resolve_era5_path(args.file, args.data_dir)
    field = load_field(path, args.variable)
    blocks = day_blocks(field.times, list(zip(("train", "val", "cal", "test"), split,
                                              strict=True)))
    ex = {k: make_examples(field, b, history=args.history, leads=leads)
          for k, b in blocks.items()}
    clim = hourly_climatology(field, blocks["train"])  # (24, H, W)
    build = _Inputs(clim=clim, leads=leads, use_clim=not args.no_clim_features)
    X_cpu = {k: build(e.inputs, e.hours) for k, e in ex.items()}
    # models and their inputs live on `device`; scores are computed on the CPU
    X = {k: v.to(device) for k, v in X_cpu.items()}
    Y = {k: e.targets for k, e in ex.items()}
    lat = torch.from_numpy(np.array(field.lat, dtype=np.float64))
    tr_vals = field.values[blocks["train"]].double()
    mean, std = float(tr_vals.mean()), float(tr_vals.std())
    day = {k: (str(field.times[b[0]])[:10], str(field.times[b[-1]])[:10])
           for k, b in blocks.items()}
    print(f"[era5] {path.name}: {field.values.shape} {field.variable}; examples "
          + ", ".join(f"{k} {len(e)} ({day[k][0]}..{day[k][1]})" for k, e in ex.items()),
          flush=True)

    grid = (int(field.values.shape[1]), int(field.values.shape[2]))
    in_ch = X["train"].shape[1]

    recipe = _MemberRecipe(
        grid=grid, in_channels=in_ch, out_channels=len(leads), patch=args.patch,
        hidden=args.hidden, layers=args.layers, heads=args.heads, mlp=args.mlp,
        dropout=args.dropout, mean=mean, std=std, epochs=args.epochs, lr=args.lr,
        batch_size=args.batch_size, patience=args.patience, seed=args.seed, progress=progress,
        device=str(device), train_xy=(X_cpu["train"], Y["train"]),
        val_xy=(X_cpu["val"], Y["val"]),
    )

    member_dir = member_cache_dir(res_dir / "members", recipe)  # keyed by the recipe
    model_dir = Path(args.model_dir) if args.model_dir else res_dir / "backbone"
    frozen, train_report = load_or_train_backbone(
        recipe, model_dir, retrain=args.retrain, save=save_vit_field, load=load_vit_field,
        device=device,
    )
    n_params = sum(p.numel() for p in frozen.parameters())
    sites = [s.name for s in attnuq.find_attention(frozen)]
    Yd = {k: v.to(device) for k, v in Y.items()}
    task = Task(model=frozen, train=(X["train"], Yd["train"]), val=(X["val"], Yd["val"]),
                cal=(X["cal"], Yd["cal"]), make_model=recipe.make, train_fn=recipe.train,
                batch_size=args.batch_size * 4, member_dir=member_dir)
    S = args.n_samples
    xte, yte = X["test"], Y["test"]
    clim_te = build.valid_clim(ex["test"].hours)  # (N, L, H, W)
    results: dict[str, Any] = {}
    maps: dict[str, dict[str, np.ndarray]] = {}
    old = res_dir / "era5_results.json"
    prev = (read_json_or_none(old, "ERA5 results", validate=lambda r: isinstance(r, dict)
                              and isinstance(r.get("results"), dict) and "run" in r)
            if args.resume else None)  # a torn file: warned about, every method is redone
    if prev is not None:
        same = {k: v for k, v in prev.get("config", {}).items() if k not in _RESUME_FREE}
        now = {k: getattr(args, k, None) for k in same}
        if same != now:
            raise ValueError(f"--resume: {old} was written with another config: {same} vs {now}")
        results = {k: v for k, v in prev["results"].items()
                   if k in ALL_METHODS and k not in rerun}
        if results and (res_dir / "era5_maps.npz").is_file():
            try:
                with np.load(res_dir / "era5_maps.npz") as z:
                    for key in z.files:
                        n, kind = key.split("__")
                        if n in results:
                            maps.setdefault(n, {})[kind] = z[key]
            except Exception as exc:  # torn maps: the methods they belong to are redone
                warnings.warn(f"corrupt ERA5 maps {res_dir / 'era5_maps.npz'} "
                              f"({type(exc).__name__}: {exc}); redoing the methods",
                              CorruptFileWarning, stacklevel=2)
                results, maps = {}, {}
        info["resumed_runs"] = _resumed_runs(prev["run"], set(results))
        print(f"[era5] resuming: already scored {sorted(results)}", flush=True)

    def record(name: str, pred: AnyPred, extra: dict[str, Any]) -> None:
        pred = _to_cpu(pred)
        sc = field_scores(pred, yte, lat=lat, clim=clim_te, leads=leads, seed=args.seed)
        results[name] = {"per_lead": sc, **extra}
        m = _mean(pred)
        maps[name] = {"error": (m - yte).mean(0).numpy(), "spread": _spread(pred).mean(0).numpy()}
        print(f"[era5] {name}: " + "; ".join(
            f"{ld}: " + ", ".join(f"{k}={v:.4g}" for k, v in r.items() if k != "n_scored")
            for ld, r in sc.items()), flush=True)
        _write(res_dir, info, args, field, day, {k: len(e) for k, e in ex.items()},
               train_report, n_params, sites, results, maps, leads, in_ch)

    # frozen deterministic forecast and point references
    with torch.no_grad():
        f_te = predict_batched(frozen, xte, 64).cpu()
    pers = ex["test"].inputs[:, :1].expand_as(yte)
    point = {"frozen": f_te, "persistence-point": pers, "climatology-point": clim_te}
    for name, fc in point.items():
        results[name] = {"per_lead": {
            f"+{ld}h": {
                "rmse_lat": float(attnuq.metrics.lat_weighted_rmse(fc[:, i].double(),
                                                                   yte[:, i].double(), lat)),
                "acc": _acc(fc[:, i], yte[:, i], clim_te[:, i], lat),
            } for i, ld in enumerate(leads)}}
    print("[era5] point: " + json.dumps({k: v["per_lead"] for k, v in results.items()}),
          flush=True)

    for name in sorted(methods, key=_RUN_ORDER.index):
        if name in results:
            continue
        t0 = time.perf_counter()
        if name == "sa-crps" or (name == "sa-paper" and "sa-conformal" not in methods):
            m = make_method(name, n_samples=S, n_passes=args.n_passes, seed=args.seed,
                            progress=progress, nu_range=(1, args.nu_max)).fit(task)
            t_fit = time.perf_counter() - t0
            t1 = time.perf_counter()
            pred = m.predict(xte)
            record(name, pred, {"fit_seconds": t_fit, "predict_seconds":
                                time.perf_counter() - t1, "forward_per_input": S,
                                **_info(m)})
        elif name in ("sa-paper", "sa-conformal"):
            base = make_method("sa-paper", n_samples=S, n_passes=args.n_passes, seed=args.seed,
                               progress=progress, nu_range=(1, args.nu_max)).fit(task)
            t_fit = time.perf_counter() - t0
            pc = base.predict(X["cal"])
            assert isinstance(pc, Predictive)
            c = coverage_scale(pc, Yd["cal"], level=0.95)
            t_conf = time.perf_counter() - t0
            t1 = time.perf_counter()
            pred = base.predict(xte)
            assert isinstance(pred, Predictive)
            t_pred = time.perf_counter() - t1
            record("sa-paper", pred, {"fit_seconds": t_fit, "predict_seconds": t_pred,
                                      "forward_per_input": S, **_info(base)})
            record("sa-conformal", pred.scaled(c), {
                "fit_seconds": t_conf, "predict_seconds": t_pred, "forward_per_input": S,
                "nu": _info(base).get("nu"), "conformal_scale": c,
                "note": "sa-paper's nu and test draws, spread scaled by a conformal factor "
                        "fitted on the cal days"})
        elif name == "mc-dropout":
            m = make_method(name, n_samples=S, seed=args.seed).fit(task)
            t1 = time.perf_counter()
            pred = m.predict(xte)
            record(name, pred, {"fit_seconds": t1 - t0,
                                "predict_seconds": time.perf_counter() - t1,
                                "forward_per_input": S})
        elif name == "ensemble":
            # train (or find) the members first, so that the fit books their training once
            trained = train_members(recipe, list(range(1, args.ensemble)), member_dir,
                                    jobs=member_jobs)
            m = make_method(name, n_members=args.ensemble).fit(task)
            t1 = time.perf_counter()
            pred = m.predict(xte)
            record(name, pred, {"fit_seconds": m.cost.fit_seconds,
                                "fit_forward": m.cost.fit_forward,
                                "predict_seconds": time.perf_counter() - t1,
                                "forward_per_input": args.ensemble,
                                "member_jobs": member_jobs,
                                "members_trained_here": trained,
                                "members_from_cache": [k for k in range(1, args.ensemble)
                                                       if k not in trained],
                                "member_seeds": [args.seed + k for k in range(args.ensemble)],
                                "note": "fit s = sum of the members' training times"})
        elif name in ("persistence", "climatology"):
            fn = _persistence if name == "persistence" else build.for_examples
            rq = ResidualQuantiles.fit(Y["val"] - fn(ex["val"]), n_quantiles=50)
            record(name, rq.predictive(fn(ex["test"])), {
                "fit_seconds": time.perf_counter() - t0, "forward_per_input": 0,
                "note": "point reference + val residual quantiles per (lead, grid point)"})
    _write(res_dir, info, args, field, day, {k: len(e) for k, e in ex.items()}, train_report,
           n_params, sites, results, maps, leads, in_ch, final=True)
    return res_dir


def _resumed_runs(prev_run: dict[str, Any], kept: set[str]) -> list[dict[str, Any]]:
    """Which earlier invocation scored each kept method, following a chain of resumes.

    ``prev_run`` is the ``run`` record of the results file being resumed; methods that it had
    itself resumed are credited to the invocations it names (``resumed_runs``, or the older
    single ``resumed_from``), the rest to ``prev_run``. Runs left with no kept method are dropped.
    """
    earlier = list(prev_run.get("resumed_runs", []))
    if "resumed_from" in prev_run:
        earlier.append(prev_run["resumed_from"])
    out: list[dict[str, Any]] = []
    credited: set[str] = set()
    for r in earlier:
        ms = sorted(set(r.get("methods", [])) & kept - credited)
        credited |= set(ms)
        if ms:
            out.append({**r, "methods": ms})
    own = sorted(kept - credited)
    if own:
        base = {k: v for k, v in prev_run.items() if k not in ("resumed_runs", "resumed_from")}
        out.insert(0, {**base, "methods": own})
    return out


def _persistence(e: Any) -> torch.Tensor:
    """``(N, L, H, W)``: the field at issue time, for every lead."""
    return e.inputs[:, :1].expand_as(e.targets)


def _info(m: Any) -> dict[str, Any]:
    return {k: v for k, v in (m.info() or {}).items()
            if isinstance(v, (int, float, str, bool)) or v is None}


def _maps_png(path: Path, maps: dict[str, dict[str, np.ndarray]], field: Any,
              leads: tuple[int, ...]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(maps)
    ext = (float(field.lon.min()), float(field.lon.max()), float(field.lat.min()),
           float(field.lat.max()))
    origin = "upper" if field.lat[0] > field.lat[-1] else "lower"
    ncol = 2 * len(leads)
    fig, axes = plt.subplots(len(names), ncol, figsize=(3.2 * ncol, 2.1 * len(names)),
                             squeeze=False, layout="constrained")
    emax = max(float(np.abs(maps[n]["error"]).max()) for n in names) or 1.0
    for r, n in enumerate(names):
        for i, ld in enumerate(leads):
            ax = axes[r, i]
            im = ax.imshow(maps[n]["error"][i], extent=ext, origin=origin, cmap="RdBu_r",
                           vmin=-emax, vmax=emax)
            ax.set_title(f"{n}: mean error +{ld}h (K)", fontsize=7)
            ax.tick_params(labelsize=5)
            fig.colorbar(im, ax=ax, shrink=0.8).ax.tick_params(labelsize=5)
            ax2 = axes[r, len(leads) + i]
            sp = maps[n]["spread"][i]
            im2 = ax2.imshow(sp, extent=ext, origin=origin, cmap="viridis", vmin=0,
                             vmax=float(sp.max()) or 1.0)
            ax2.set_title(f"{n}: mean predicted std +{ld}h (K)", fontsize=7)
            ax2.tick_params(labelsize=5)
            fig.colorbar(im2, ax=ax2, shrink=0.8).ax.tick_params(labelsize=5)
    atomic_savefig(fig, path, dpi=100)
    plt.close(fig)


_RESUME_FREE = ("methods", "resume", "note", "no_progress", "threads", "retrain", "out",
                "model_dir", "rerun", "member_jobs")

_COLS = ("rmse_lat", "acc", "pit_w1", "pit_w1_scaled", "width", "coverage", "crps", "mean_std")


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "nan" if not math.isfinite(v) else (f"{v:.4f}" if abs(v) < 1000 else f"{v:.1f}")
    return str(v)


def _write(res_dir: Path, info: dict[str, Any], args: argparse.Namespace, field: Any,
           day: dict[str, tuple[str, str]], n_ex: dict[str, int], train_report: dict[str, Any],
           n_params: int, sites: list[str], results: dict[str, Any],
           maps: dict[str, dict[str, np.ndarray]], leads: tuple[int, ...], in_ch: int,
           final: bool = False) -> None:
    cfg = {k: v for k, v in vars(args).items() if not k.startswith("_")
           and (isinstance(v, (int, float, str, bool, type(None))) or k == "note")}
    payload = {
        "run": info, "config": cfg, "complete": final,
        "data": {"file": str(field.path), "variable": field.variable,
                 "grid": list(field.values.shape[1:]), "days": day, "examples": n_ex},
        "backbone": {"n_params": n_params, "attention_sites": sites, "in_channels": in_ch,
                     "train": train_report},
        "results": results,
    }
    atomic_write_json(res_dir / "era5_results.json", payload, indent=1)
    if maps:
        arrays: dict[str, Any] = {f"{n}__{k}": v for n, d in maps.items() for k, v in d.items()}
        atomic_np_savez(res_dir / "era5_maps.npz", **arrays)
    if final and maps:
        _maps_png(res_dir / "era5_maps.png", maps, field, leads)
    atomic_write_text(res_dir.parent / "era5.md", _markdown(payload))


#: rows this suite computes itself (the others are registered methods: the registry's text)
_IMPLEMENTATIONS: dict[str, str] = {
    "sa-conformal": "attnuq stochastic attention: sa-paper's nu and test draws, spread scaled by "
                    "attnuq.methods.coverage_scale fitted on cal (this suite)",
    "persistence": "this suite: the field at issue time plus val residual quantiles per (lead, "
                   "grid point)",
    "climatology": "this suite: hour-of-day training climatology plus val residual quantiles per "
                   "(lead, grid point)",
}


def _markdown(p: dict[str, Any]) -> str:
    r, c, d, b = p["run"], p["config"], p["data"], p["backbone"]
    tr = b["train"]
    res = p["results"]
    lines = [
        "# ERA5 2 m temperature: stochastic attention on a frozen ViT forecaster vs baselines",
        "",
        "Generated by `attnuq bench era5` -- do not edit by hand."
        + ("" if p["complete"] else " **(partial: run still in progress or interrupted)**"),
        "",
        f"* command: `{r['command']}`",
        f"* date: {r['date']}",
        f"* machine: {r['machine']}",
        *[f"* methods {', '.join(m['methods'])} scored earlier by `{m['command']}` "
          f"({m['date']}), same config, kept with --resume"
          for m in [*r.get("resumed_runs", []), *([r["resumed_from"]] if "resumed_from" in r
                                                    else [])] if m.get("methods")],
        f"* data: `{Path(d['file']).name}` ({d['variable']}, grid {d['grid']}); consecutive "
        "day blocks " + ", ".join(f"{k} {v[0]}..{v[1]} ({d['examples'][k]} issue times)"
                                  for k, v in d["days"].items())
        + f"; issue every hour, inputs: field at t and t-{c['history']} h"
        + ("" if c["no_clim_features"] else " + training hour-of-day climatology at the valid "
           "times")
        + f"; leads {c['leads']} h",
        f"* backbone: ViT from HF `ViTModel` blocks, patch {c['patch']}, hidden {c['hidden']}, "
        f"{c['layers']} layers, {c['heads']} heads, mlp {c['mlp']}, dropout {c['dropout']}, "
        f"{b['n_params']} parameters, predicts the change from persistence; trained here "
        f"({tr.get('epochs_run')} epochs, best {tr.get('best_epoch')}, best val MSE "
        f"{_fmt(tr.get('best_val'))} K^2, {_fmt(tr.get('seconds'))} s"
        f"{', reused from disk' if tr.get('reused') else ''}), frozen",
        f"* Monte Carlo samples {c['n_samples']}; calibration passes per nu {c['n_passes']}, "
        f"nu searched in [1, {c.get('nu_max', 1024)}] (BO); "
        f"deep ensemble {c['ensemble']} members (member 0 = the backbone, members 1.."
        f"{c['ensemble'] - 1} retrained by this suite with the backbone's recipe and seeds "
        f"{c['seed']}+k, "
        f"{jobs_text(res.get('ensemble', {}).get('member_jobs', c.get('member_jobs', 1)))}"
        f"{cache_text(res.get('ensemble', {}), 'era5')})",
        "* RMSE and ACC are latitude-weighted (ACC: anomalies against the hour-of-day mean of "
        "the training days, pooled WeatherBench/ClimaX definition); PIT, W1, coverage, width "
        "and CRPS are plain means over grid points and issue times; units K",
        "",
    ]
    pt = [k for k in ("frozen", "persistence-point", "climatology-point") if k in res]
    if pt:
        lines += ["| point forecast | " + " | ".join(
            f"RMSE +{ld}h | ACC +{ld}h" for ld in _parse_ints(c["leads"], "leads")) + " |",
            "|---|" + "---|---|" * len(_parse_ints(c["leads"], "leads"))]
        for k in pt:
            lines.append(f"| {k} | " + " | ".join(
                f"{_fmt(v['rmse_lat'])} | {_fmt(v['acc'])}" for v in res[k]["per_lead"].values())
                + " |")
        lines.append("")
    scored = [k for k in ALL_METHODS if k in res]
    for ld in _parse_ints(c["leads"], "leads"):
        key = f"+{ld}h"
        lines += [f"## Lead {key}", "",
                  "| method | RMSE (lat-w) | ACC | W1(PIT) native | W1(PIT) scaled | PI-95 width "
                  "| PI-95 coverage | CRPS | mean std | nu | fit s | predict s | passes |",
                  "|---|" + "---|" * 12]
        for k in scored:
            v = res[k]["per_lead"][key]
            lines.append(f"| {k} | " + " | ".join(_fmt(v.get(col)) for col in _COLS) + " | "
                         + " | ".join(_fmt(res[k].get(e)) for e in (
                             "nu", "fit_seconds", "predict_seconds", "forward_per_input"))
                         + " |")
        if scored:
            sc = {k: res[k]["per_lead"][key] for k in scored}
            best = min(sc, key=lambda k: sc[k]["crps"])
            closest = min(sc, key=lambda k: abs(sc[k]["coverage"] - 0.95))
            w1 = min(sc, key=lambda k: sc[k]["pit_w1"])
            lines += ["", f"Best CRPS: **{best}**; coverage closest to 95 %: **{closest}**; "
                          f"lowest native W1: **{w1}**."]
            for sa in ("sa-paper", "sa-crps", "sa-conformal"):
                if sa in sc:
                    beaten = [k for k in sc if k != sa and sc[k]["crps"] < sc[sa]["crps"]]
                    lines.append(f"* {sa} CRPS beaten by: {', '.join(beaten) or 'none'}.")
            lines.append("")
    if scored:
        from attnuq.bench._implementations import implementation_lines

        lines += implementation_lines(scored, local=_IMPLEMENTATIONS)
    notes = c.get("note") or []
    if notes:
        lines += ["Notes:", *[f"* {n}" for n in notes], ""]
    lines += ["Maps of mean error and predicted spread: `era5/era5_maps.png`; raw numbers: "
              "`era5/era5_results.json`.", "", "![maps](era5/era5_maps.png)", ""]
    return "\n".join(lines)


register(
    "era5",
    help="ERA5 2 m temperature: SA on a small frozen HF-ViT forecaster vs baselines",
    add_arguments=add_arguments,
    run=run,
)
