"""``attnuq bench ett``: SA on a frozen Hugging Face PatchTST against the baselines on ETTh1.

Data + backbone + config on the bench spine; every step is recorded in the JSON next to the page.

1. Data: :func:`attnuq_bench.data.ett.load_ett`, standard borders (train 12 months, val 4, test 4;
   scaler fitted on train; metrics on the standardised scale, as in the PatchTST tables); the
   val windows cut in time: the first half (``val``) for early stopping and the methods' own
   fits (SA's ``nu``, residual distributions), the second half (``cal``) for conformal steps.
2. Backbone: ``PatchTSTForPrediction`` trained through :func:`attnuq_bench.training.fit` with early
   stopping, ``save_pretrained`` then ``from_pretrained`` (frozen); the deep ensemble retrains
   the recipe with seeds ``seed + k`` (member 0 = the backbone).
3. Methods by name from :mod:`attnuq_bench.methods` (``sa-conformal`` shares ``sa-paper``'s ``nu``
   and test draws) and the suite's reference row ``seasonal-naive`` (24 h), scored over the test
   windows (:class:`~attnuq_bench.suites._scoring.StreamScores`); one record per method under
   ``<out>/ett/runs/<csv stem>/`` (``--resume`` reuses those of the same config), assembled in
   ``<out>/ett/ett_results.json``, from which :mod:`attnuq_bench.suites._ett_page` renders
   ``ett.md``, its JSON twin, the fan chart of ``OT`` and the ``ett`` key of ``summary.json``.

Examples
--------
Run the full suite (a few tens of minutes on a laptop core)::

    attnuq bench ett --data-dir ../shared/data --out docs/results
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from attnuq._io import atomic_write_json, read_json_or_none
from attnuq._validation import check_positive_int
from attnuq.distributed import is_writer, primary_first
from attnuq.predictive import GaussianPredictive, Predictive
from attnuq_bench.methods import ResidualQuantiles
from attnuq_bench.suites import register
from attnuq_bench.suites._ett_page import (
    ALL_METHODS,
    DEFAULT_METHODS,
    IMPLEMENTATIONS,
    chunks,
    fan_plot,
    parse_methods,
    render_page,
    score_chunks,
    scored,
    summary,
)
from attnuq_bench.suites._options import add_methods_argument

__all__ = ["ALL_METHODS", "add_arguments", "render_page", "run", "summary"]

#: cheap and central methods first, the retraining ones last (partial results stay useful)
_RUN_ORDER = ("sa-paper", "sa-conformal", "conformal", "seasonal-naive", "sa-crps", "mc-dropout",
              "swag", "ensemble", "sa", "sa-debiased", "sa-recentred", "sa-floor", "sa-layer",
              "sa-centre")
#: config keys that do not shape a result
_RESUME_FREE = ("methods", "resume", "merge", "note", "no_progress", "threads", "retrain", "chunk",
                "out", "model_dir", "rerun", "member_jobs", "render_only")
#: recipe options added after results were stored: a config without them ran with these
_ADDED = {"optimizer": "adamw", "schedule": "constant"}
#: config keys that change only these methods (checked only for a record of one of them)
_METHOD_KEYS: dict[str, tuple[str, ...]] = {
    "member_epochs": ("ensemble",), "ensemble": ("ensemble",), "swag_epochs": ("swag",),
    "swag_snapshots": ("swag",)}
AnyPred = Predictive | GaussianPredictive


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``attnuq bench ett`` (data, backbone recipe, method budgets, resume)."""
    p.add_argument("--data-dir", default=None,
                   help="data root (holds ett/ETTh1.csv) (default: $ATTNUQ_DATA_DIR, else "
                        "../shared/data)")
    p.add_argument("--file", default="ETTh1.csv", help="ETT-layout CSV (name under ett/ or path)")
    p.add_argument("--out", default="docs/results", help="results root (writes ett.md, ett/)")
    p.add_argument("--model-dir", default=None,
                   help="folder for the save_pretrained backbone (default <out>/ett/backbone; "
                        "reused when it exists and --retrain is not given)")
    p.add_argument("--retrain", action="store_true", help="train the backbone even if saved")
    typed: tuple[tuple[str, type, Any, str], ...] = (
        ("context", int, 336, "input window in hours (PatchTST context length)"),
        ("horizon", int, 96, "forecast horizon in hours"),
        ("d-model", int, 32, "PatchTST model width"),
        ("layers", int, 2, "PatchTST encoder layers"),
        ("heads", int, 2, "attention heads per layer"),
        ("ffn", int, 64, "feed-forward width"),
        ("patch", int, 16, "patch length in hours"),
        ("stride", int, 8, "stride between patches in hours"),
        ("dropout", float, 0.1, "dropout rate of the backbone"),
        ("epochs", int, 8, "training epochs at most (early stopping on val)"),
        ("patience", int, 2, "early-stopping patience in epochs"),
        ("batch-size", int, 64, "training batch size"),
        ("lr", float, 1e-3, "learning rate of the backbone"),
        ("max-steps-per-epoch", int, None,
         "cap on optimiser steps per epoch (default: none, every training window)"))
    for flag, kind, default, text in typed:
        p.add_argument(f"--{flag}", type=kind, default=default, help=text)
    p.add_argument("--optimizer", choices=("adamw", "adam"), default="adamw",
                   help="backbone optimiser (no weight decay)")
    p.add_argument("--schedule", choices=("constant", "type3"), default="constant",
                   help="learning-rate schedule (type3: PatchTST's, x0.9 per epoch after 3)")
    p.add_argument("--member-epochs", type=int, default=None,
                   help="epoch cap for ensemble members (default: --epochs, the backbone's "
                        "recipe; a smaller cap is stated on the page)")
    p.add_argument("--ensemble", type=int, default=5, help="deep-ensemble size")
    p.add_argument("--member-jobs", type=int, default=1,
                   help="train the ensemble members in this many worker processes (spawn, one "
                        "thread each; same recipe, seeds and weights as 1 = one after the other)")
    p.add_argument("--swag-epochs", type=int, default=2,
                   help="SWAG epochs after the backbone's training")
    p.add_argument("--swag-snapshots", type=int, default=4, help="SWAG snapshots per epoch")
    p.add_argument("--n-samples", type=int, default=20, help="Monte Carlo passes per method")
    p.add_argument("--n-passes", type=int, default=10, help="passes per nu in calibration")
    p.add_argument("--nu-max", type=int, default=128,
                   help="upper end of SA's nu search (cost of a pass grows with nu)")
    p.add_argument("--test-stride", type=int, default=1, help="stride over test windows")
    p.add_argument("--val-stride", type=int, default=2,
                   help="stride over val/cal windows (calibration cost)")
    p.add_argument("--chunk", type=int, default=128, help="test windows per prediction call")
    add_methods_argument(p, default=DEFAULT_METHODS,
                         help=f"methods to score (default: {', '.join(DEFAULT_METHODS)})")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the backbone and the methods; ensemble member k uses seed + k")
    p.add_argument("--device", default="cpu",
                   help="torch device: cpu, cuda, cuda:N or auto (default: cpu)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument("--note", action="append", default=None, metavar="TEXT",
                   help="provenance note printed in the markdown (e.g. how the backbone was "
                        "trained in an earlier invocation); repeatable (default: none)")
    p.add_argument("--merge", action="append", default=None, metavar="JSON",
                   help="also take the methods scored in another ett_results.json written with "
                        "the same config (parallel runs); repeatable (default: none)")
    p.add_argument("--resume", action="store_true",
                   help="keep the methods already scored in <out>/ett/runs (same config apart "
                        "from --methods/--resume) and run only the missing ones")
    p.add_argument("--render-only", action="store_true",
                   help="only write ett.md and its JSON twin again from <out>/ett/ett_results.json")
    add_methods_argument(p, "--rerun", default=(),
                         help="methods to score again even when --resume/--merge supply them "
                              "(default: none)")


@dataclasses.dataclass
class _MemberRecipe:
    """The backbone's recipe (picklable, for :func:`attnuq_bench.suites._members.train_members`):
    member ``k`` (``k = 0``: the backbone) is initialised and trained with seed ``seed + k``,
    members ``k >= 1`` for at most ``member_epochs`` epochs (the backbone ``epochs``); holds the
    training and early-stopping windows on the CPU; ``make`` and ``train`` use ``device``."""

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
    optimizer: Literal["adamw", "adam"]
    schedule: Literal["constant", "type3"]
    batch_size: int
    patience: int
    max_steps_per_epoch: int | None
    seed: int
    progress: bool
    device: str
    train_xy: tuple[torch.Tensor, torch.Tensor]
    val_xy: tuple[torch.Tensor, torch.Tensor]

    def make(self, index: int) -> Any:
        from attnuq_bench.models.patchtst import PatchTSTForecaster, build_patchtst

        return PatchTSTForecaster(build_patchtst(
            num_channels=self.n_channels, context_length=self.context,
            prediction_length=self.horizon, d_model=self.d_model, num_layers=self.layers,
            num_heads=self.heads, ffn_dim=self.ffn, patch_length=self.patch,
            patch_stride=self.stride, dropout=self.dropout, seed=self.seed + index,
        )).to(self.device)

    def train(self, model: Any, _train: Any, _val: Any, index: int,
              checkpoint: str | Path | None = None) -> Any:
        """Train member ``index`` (MSE, no weight decay, torch seeded, val MSE in batches of
        512); the backbone (``index == 0``) checkpoints every epoch when one is set, member
        ``index >= 1`` to ``checkpoint`` (given by
        :func:`attnuq_bench.suites._members.train_members`, so that a killed ensemble run resumes
        its members where they stopped)."""
        from attnuq_bench.training import fit

        dev = torch.device(self.device)
        return fit(
            model, (self.train_xy[0].to(dev), self.train_xy[1].to(dev)),
            (self.val_xy[0].to(dev), self.val_xy[1].to(dev)), metric="mse",
            optimizer=self.optimizer, lr=self.lr, weight_decay=0.0, schedule=self.schedule,
            checkpoint=self.__dict__.get("_checkpoint") if index == 0 else checkpoint,
            max_epochs=self.epochs if index == 0 else self.member_epochs,
            patience=self.patience, batch_size=self.batch_size, val_batch_size=512,
            max_steps_per_epoch=self.max_steps_per_epoch, seed=self.seed + index,
            seed_torch=True, progress=self.progress,
            desc="backbone" if index == 0 else f"member{index}",
        )


def _reuse(cfg: dict[str, Any], method: str) -> dict[str, Any]:
    """The config a stored record of ``method`` must have been run with to be reused."""
    return {k: v for k, v in {**_ADDED, **cfg}.items() if k not in _RESUME_FREE
            and (k not in _METHOD_KEYS or method in _METHOD_KEYS[k])}


def _merged(files: Sequence[str], cfg: dict[str, Any], rerun: Sequence[str]
            ) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]], dict[str, str]]:
    """Results, fan-chart quantiles, provenance and Implementations texts taken from other
    runs' ett_results.json."""
    results: dict[str, Any] = {}
    fans: dict[str, Any] = {}
    texts: dict[str, str] = {}
    runs: list[dict[str, Any]] = []
    for src in map(Path, files):
        prev = read_json_or_none(src, "ETT results", validate=lambda r: isinstance(r, dict)
                                 and isinstance(r.get("results"), dict) and "run" in r)
        if prev is None:
            raise ValueError(f"--merge: {src} is missing or not an ETT results file")
        got = {k: v for k, v in prev["results"].items() if k in ALL_METHODS and k not in rerun}
        old = prev.get("config", {})
        for m in got:
            same = _reuse(old, m)
            now = {k: cfg.get(k) for k in same}
            if same != now:
                raise ValueError(f"--resume/--merge: {src} was written with another config: "
                                 f"{same} vs {now}")
        results.update(got)
        fans.update({k: v for k, v in prev.get("fan_chart", {}).items() if k in got})
        texts.update({r: t for r, t in (prev.get("implementations") or {}).get("rows", [])
                      if r in got})
        earlier = prev["run"].get("merged_runs", [])
        by_earlier = {m for r in earlier for m in r.get("methods", [])}
        run_prev = {k: v for k, v in prev["run"].items() if k != "merged_runs"}
        runs += [{**run_prev, "file": str(src),
                  "methods": sorted(k for k in got if k not in by_earlier)}, *earlier]
        print(f"[ett] from {src}: already scored {sorted(got)}", flush=True)
    return results, fans, runs, texts


def run(args: argparse.Namespace) -> Path:
    """Run the ETT suite; returns the results folder ``<out>/ett``."""
    import attnuq
    from attnuq._io import cache_key
    from attnuq._runtime import resolve_device, run_info
    from attnuq_bench.data.ett import load_ett, resolve_ett_path, seasonal_naive
    from attnuq_bench.methods import Task, make_method
    from attnuq_bench.models.patchtst import load_patchtst, save_patchtst
    from attnuq_bench.suites._digests import files_digest
    from attnuq_bench.suites._implementations import implementation_texts, merge_block
    from attnuq_bench.suites._members import (
        check_member_jobs,
        load_or_train_backbone,
        member_cache_dir,
        recipe_spec,
        train_members,
    )
    from attnuq_bench.suites._runner import (
        Group,
        RunStore,
        data_matches,
        data_mismatch,
        run_items,
    )
    from attnuq_bench.training import predict_batched

    res_dir = Path(args.out) / "ett"
    if getattr(args, "render_only", False):  # the page, its twin and the summary key
        from attnuq._io import read_json
        from attnuq_bench.suites._page import update_summary

        render_page(res_dir, res_dir.parent / "ett.md").write(res_dir.parent / "ett.md")
        payload = read_json(res_dir / "ett_results.json")
        if "frozen" in payload.get("results", {}):
            update_summary(res_dir.parent / "summary.json", "ett", summary(payload))
        return res_dir
    torch.set_num_threads(check_positive_int(args.threads, "threads"))
    device = resolve_device(getattr(args, "device", "cpu"))
    member_jobs = check_member_jobs(getattr(args, "member_jobs", 1))
    progress = not args.no_progress
    methods = parse_methods(args.methods)
    rerun = parse_methods(args.rerun) if getattr(args, "rerun", None) else []
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
    for k in ("methods", "rerun"):  # the rows asked for, as the command line spells them
        if isinstance(getattr(args, k, None), list):
            cfg[k] = ",".join(getattr(args, k))
    if args.patch > args.context:
        raise ValueError(f"--patch must be at most --context ({args.context} h), got "
                         f"--patch {args.patch}")
    # merged runs' files are read before any training: a bad --merge fails now
    merged, merged_fans, merged_runs, texts = _merged(args.merge or [], cfg, rerun)
    info = run_info()
    res_dir.mkdir(parents=True, exist_ok=True)

    # ---- data ---------------------------------------------------------------------------------
    path = resolve_ett_path(args.file, args.data_dir)
    data = load_ett(path, context=args.context)
    H = args.horizon
    xtr, ytr = data.windows("train", horizon=H)
    xv_all, yv_all = data.windows("val", horizon=H)
    h, vs = len(xv_all) // 2, args.val_stride  # val: first half in time, cal: second half
    if h < 2:
        raise ValueError(f"too few val windows to split into val and cal: {len(xv_all)}")
    (xv, yv), (xc, yc) = (xv_all[:h:vs], yv_all[:h:vs]), (xv_all[h::vs], yv_all[h::vs])
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
        n_channels=data.n_channels, horizon=H, member_epochs=args.member_epochs or args.epochs,
        progress=progress, device=str(device), train_xy=(xtr, ytr), val_xy=(xv, yv),
        **{k: getattr(args, k) for k in ("context", "d_model", "layers", "heads", "ffn", "patch",
                                         "stride", "dropout", "epochs", "lr", "optimizer",
                                         "schedule", "batch_size", "patience",
                                         "max_steps_per_epoch", "seed")})
    member_dir = member_cache_dir(res_dir / "members", recipe)  # keyed by the recipe
    model_dir = Path(args.model_dir) if args.model_dir else res_dir / "backbone"
    # a killed backbone training resumes from its checkpoint (per recipe; not a recipe field)
    key = cache_key(recipe_spec(recipe))
    recipe.__dict__["_checkpoint"] = model_dir.with_name(f"{model_dir.name}-{key}.ckpt")
    frozen, train_report = primary_first("ett: backbone", lambda: load_or_train_backbone(
        recipe, model_dir, retrain=args.retrain and is_writer(), save=save_patchtst,
        load=load_patchtst, device=device))  # under torchrun: rank 0 trains, the others load
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
                            for sl in chunks(len(xte), args.chunk)])
    sn = seasonal_naive(xte, H, season=24)
    points = {name: {"mse": float(((f - yte) ** 2).mean()), "mae": float((f - yte).abs().mean())}
              for name, f in (("frozen", f_test), ("seasonal-naive-point", sn))}
    print(f"[ett] frozen: {points['frozen']}; seasonal naive: {points['seasonal-naive-point']}",
          flush=True)

    # ---- methods: one stored record per method (the runner), merged runs' files -----------------
    old = read_json_or_none(res_dir / "ett_results.json", "ETT results") if args.resume else None
    previous = (old or {}).get("implementations")  # texts of rows stored before records had them
    store = RunStore(res_dir / "runs", suite="ett", info=info)  # stamps started, invocation
    parts = (path.stem,)
    order = sorted(methods, key=_RUN_ORDER.index)
    group = Group(parts=parts, methods=[m for m in order if m not in merged], reuse=None,
                  method_reuse={m: _reuse(cfg, m) for m in ALL_METHODS},
                  together=[("sa-paper", "sa-conformal")],  # one set of SA draws, one rank
                  data=files_digest([path]))  # a record of other data is never reused
    if args.resume:  # a stored record of another config is an error, not something to redo
        for m in ALL_METHODS:
            rec = store.load(parts, m, check=False)
            if rec is not None and m not in rerun and rec.get("reuse") != group.reuse_for(m):
                raise ValueError(f"--resume/--merge: {store.path(parts, m)} was written with "
                                 f"another config: {rec.get('reuse')} vs {group.reuse_for(m)}")
            if rec is not None and m not in rerun and not data_matches(rec, group.data):
                raise ValueError(f"--resume: {store.path(parts, m)} "
                                 f"{data_mismatch(rec, group.data)}")
    S = args.n_samples
    pending: dict[str, dict[str, Any]] = {}

    def score(names: Sequence[str], predict_fn: Callable[[torch.Tensor], dict[str, AnyPred]],
              extras: dict[str, dict[str, Any]]) -> None:
        scores, fan, sec = score_chunks(
            predict_fn, xte, yte, chunk=args.chunk, fan_idx=fan_idx, fan_channel=ot,
            seed=args.seed, desc="+".join(names), progress=progress, device=device,
        )
        for name in names:
            pending[name] = {"method": name, "fan": fan[name],
                             "scores": {**scores[name], "predict_seconds": sec, **extras[name]},
                             "implementation": implementation_texts([name], IMPLEMENTATIONS)[name]}
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
            one(name, lambda xb: rsn.predictive(seasonal_naive(xb, H, season=24)),
                {"fit_seconds": time.perf_counter() - t0, "forward_per_input": 0,
                 "note": "repeat the last 24 h; distribution = val residual quantiles per "
                         "(horizon step, channel)"})
            return pending.pop(name)
        kw: dict[str, Any] = {
            "sa-paper": sa, "sa-crps": sa, "mc-dropout": {"n_samples": S, "seed": args.seed},
            **dict.fromkeys(("sa", "sa-debiased", "sa-recentred", "sa-floor", "sa-layer",
                             "sa-centre"), sa),
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
        now = store.info["command"], store.info["invocation"]
        recs: dict[str, dict[str, Any]] = {}
        earlier: dict[Any, dict[str, Any]] = {}  # records of earlier invocations (--resume)
        for m in ALL_METHODS:
            r = None if m in merged else store.load(parts, m, check=False)
            if r is None or r.get("reuse") != group.reuse_for(m) or not data_matches(
                    r, group.data):
                continue
            ri = r.get("run_info", {})
            key = ri.get("command"), ri.get("invocation")
            if key == now or args.resume:
                recs[m] = r
            if key != now and args.resume:
                earlier.setdefault(key, {"command": key[0], "date": ri.get("started"),
                                         "machine": ri.get("machine"), "file": str(store.root),
                                         "methods": []})["methods"].append(m)
        runs = merged_runs + list(earlier.values())
        results = {**points, **merged, **{m: r["scores"] for m, r in recs.items()}}
        block = merge_block(scored(results), {**texts, **{m: r.get("implementation")
                                                          for m, r in recs.items()}},
                            previous, IMPLEMENTATIONS)
        payload = {
            "run": {**info, **({"merged_runs": runs} if runs else {})},
            "config": cfg, "complete": final,
            "data": {"file": str(data.path), "split_rule": data.split_rule,
                     "borders": data.borders, "n_test_windows": int(xte.shape[0]),
                     "n_test_windows_all": int(n_test_all), "columns": list(data.columns)},
            "backbone": backbone,
            "results": results,
            "fan_chart": {"channel": data.columns[ot], "window_index": list(fan_idx),
                          **merged_fans, **{m: r["fan"] for m, r in recs.items()}},
            "implementations": block,
        }
        _write(res_dir, payload, final=final,
               fan=lambda p, fans: fan_plot(p, fans, xte, yte, fan_idx, ot, data))

    done = run_items(store, [group], lambda g: None, run_one, progress=False,
                     rerun=group.methods if not args.resume else rerun,
                     on_saved=lambda g, m, r: write())
    write(final=not done.failed)
    if done.failed:
        raise RuntimeError(f"methods failed: {done.failed} (see {store.root}/**/*.err.txt)")
    return res_dir


def _with_derived(base: Any, derived: Any, x: torch.Tensor) -> dict[str, AnyPred]:
    """sa-paper's ``p = base.predict(x)`` and sa-conformal's ``derived.derive(p)``."""
    p = base.predict(x)  # SA's draws: a Predictive (derive raises TypeError otherwise)
    return {"sa-paper": p, "sa-conformal": derived.derive(p)}


def _info(m: Any) -> dict[str, Any]:
    """The scalar entries of ``m.info()`` (what a record keeps), and sa-layer's ``nu_map``."""
    return {k: v for k, v in (m.info() or {}).items()
            if v is None or isinstance(v, (int, float, str, bool))
            or (k == "nu_map" and isinstance(v, dict))}


def _write(res_dir: Path, payload: dict[str, Any], *, final: bool,
           fan: Callable[[Path, dict[str, Any]], None]) -> None:
    """``ett_results.json``, the fan chart (at the end), ``ett.md`` and its twin, and the
    ``ett`` key of ``summary.json``."""
    from attnuq_bench.suites._page import update_summary

    res = payload["results"]
    atomic_write_json(res_dir / "ett_results.json", payload, indent=1)
    fans = {m: v for m, v in payload["fan_chart"].items() if m in ALL_METHODS}
    if fans and final:  # drawing is slow on a busy core: once, at the end
        fan(res_dir / "ett_fan_ot.png", fans)
    render_page(res_dir, res_dir.parent / "ett.md").write(res_dir.parent / "ett.md")
    if "frozen" in res:
        update_summary(res_dir.parent / "summary.json", "ett", summary(payload))


register("ett", help="ETTh1 (or any ETT-layout CSV): SA on a frozen HF PatchTST vs baselines",
         add_arguments=add_arguments, run=run)

