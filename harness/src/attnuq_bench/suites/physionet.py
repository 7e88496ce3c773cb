"""``attnuq bench physionet``: Levy-attention forecaster on PhysioNet 2012 vs its baselines.

Protocol (t-PatchGNN): observe ``[0, 24]`` h, forecast every observation in ``(24, 48]`` h; 60/20/20
split (split seed fixed, ``--split-seed``); min-max scaling on train+val; metrics on scaled values.

Methods, all scored as Gaussians ``N(mu, (T s)^2)`` with ``T`` fitted on validation in closed form
(:func:`attnuq.models.levy_forecaster.fit_temperature`) and, separately, split-conformal intervals
calibrated on validation (:func:`attnuq.conformal.conformal_scale`, one pooled factor per level):

* ``levy``: our model, one pass, ``s = sqrt(Sigma_V,cc phi(Lambda))``, trained on the MSE of
  ``mu`` (exact gradients through the expected output); ``mu`` does not depend on ``alpha``, so
  ``alpha`` and ``T`` are then fitted jointly on validation by Gaussian NLL
  (:func:`attnuq.models.levy_forecaster.fit_alpha_temperature`, two-stage fit) and the model's
  ``alpha`` is set to that value for every Levy row, the sampler, the sweep and the plots;
* ``levy_alpha_trained``: the same pass with ``alpha`` as trained (no second stage; ablation);
  ``levy_sub_alpha_trained`` the same on the subset;
* ``levy_nophi``: the same pass with ``s = sqrt(Sigma_V,cc)`` (no evidence term; ablation);
* ``levy_sampler``: 50 explicit Poisson draws of the same layer (mean and std of the non-empty
  draws) at ``alpha`` as trained, against the closed form at that ``alpha``
  (``levy_sub_alpha_trained``): draws cost ``O(Lambda)`` atoms, out of reach for a large fitted
  ``alpha``, and a small one leaves most draws empty;
* ``softmax_mcdropout``: the registered ``"mc-dropout"`` on the matched softmax control (only
  its dropout modules active), 20 passes, mean and std of the draws;
* ``ensemble``: the registered ``"ensemble"`` of 5 independently initialised controls (seeds
  ``--seed + k``, from the checkpoint cache; one ensemble, its metrics are not averaged over
  seeds);
* ``gp``: per-stay, per-channel exact GP (:mod:`attnuq_bench.models.gp_irregular`);
* ``softmax`` (the control's deterministic output) enters the MSE/MAE comparison only.

Model seeds are ``--seed + k`` for ``k < --seeds`` (the deep ensemble uses the same first seeds);
``--device`` places the neural models and their batches (the GP baseline runs on the CPU).

Plots: the test stays whose channel has the most uneven input sampling (largest ratio of the
longest to the median gap between distinct input times in ``[0, 24]`` h, channels with at least
``PLOT_MIN_INPUTS`` input times and one forecast target), one figure per stay with the evidence
``Lambda`` and the band half-width under the forecast, so the relation can be read off; the page
also reports Spearman(sigma, Lambda) over every test point.

Writes ``<out>/physionet.json`` (with one ``<out>/seed_<S>.json`` per model seed, reused by
``--reuse`` when their training options and scoring version match), PNG plots of a few test
stays, the markdown page ``--md`` with its JSON twin, and the ``physionet`` key of
``summary.json`` beside the page. The suite is data + backbone + config: the per-seed scoring
(:mod:`attnuq_bench.suites._physionet_eval`; MC dropout and the deep ensemble are the registered
``"mc-dropout"`` and ``"ensemble"``) and the page (:mod:`attnuq_bench.suites._physionet_page`, a
pure function of ``physionet.json``: :func:`render_page`, ``--render-only``) sit on the bench spine;
the forecasters train through :func:`attnuq_bench.training.fit`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnuq._io import (
    atomic_torch_save,
    atomic_write_json,
    read_json,
    read_json_or_none,
    torch_load_or_none,
)
from attnuq.distributed import is_primary, primary_first
from attnuq.models.levy_forecaster import check_score_weight
from attnuq_bench.data.physionet import ForecastBatch, PhysioNet2012, load_physionet2012
from attnuq_bench.suites import register
from attnuq_bench.suites._page import Page, update_summary
from attnuq_bench.suites._physionet_eval import (
    SIGMA_FLOOR,
    batches,
    channels,
    control_task,
    grid_entry,
    log,
    plots,
    score_ensemble,
    score_gp,
    score_seed,
    targets,
)
from attnuq_bench.suites._physionet_page import (
    SCORING_VERSION,
    build_page,
    impl_record,
    page_rows,
    stopped_by,
    summarise,
)

__all__ = ["SPEED_BENCHMARK", "UQ_WEIGHTS", "add_arguments", "parse_weights", "render_page", "run",
           "speed_record"]

#: the grid of the Levy loss weight w, fixed before any run (0: the MSE-only recipe)
UQ_WEIGHTS = (0.0, 0.1, 1.0)


def parse_weights(text: str) -> tuple[float, ...]:
    """``--uq-weights``: a comma list of distinct finite weights ``>= 0``, at least one.

    >>> parse_weights("0, 0.1,1")
    (0.0, 0.1, 1.0)
    """
    from attnuq.models.levy_forecaster import check_score_weight

    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        raise ValueError(f"--uq-weights must list at least one weight, got {text!r}")
    out = []
    for p in parts:
        try:
            w = float(p)
        except ValueError:
            raise ValueError(f"--uq-weights entries must be numbers, got {p!r}") from None
        out.append(check_score_weight(w, "--uq-weights entry"))
    if len(set(out)) != len(out):
        raise ValueError(f"--uq-weights must not repeat a weight, got {text!r}")
    return tuple(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", default=None, help="data root (holding physionet2012/) or the "
                   "PhysioNet folder/archive itself (default: $ATTNUQ_DATA_DIR, else "
                   "../shared/data)")
    p.add_argument("--cache-dir", default=None, help="parsed-array cache (default ~/.cache/attnuq)")
    p.add_argument("--out", default="docs/results/physionet", help="folder for JSON and PNG")
    p.add_argument("--md", default=None, help="markdown table (default <out>/../physionet.md)")
    p.add_argument("--seeds", type=int, default=3,
                   help="number of model seeds: --seed .. --seed + seeds - 1")
    p.add_argument("--split-seed", type=int, default=0,
                   help="seed of the train/val/test split of the stays")
    p.add_argument("--max-stays", type=int, default=None,
                   help="subsample each split (quick runs; default: every stay)")
    p.add_argument("--d", type=int, default=32, help="model width of both forecasters")
    p.add_argument("--encoder-layers", type=int, default=0,
                   help="pre-norm transformer layers over the observations (0: none)")
    p.add_argument("--dropout", type=float, default=0.1, help="dropout rate")
    p.add_argument("--batch-size", type=int, default=32, help="training batch size (stays)")
    p.add_argument("--max-epochs", type=int, default=10,
                   help="training epochs at most (early stopping on val)")
    p.add_argument("--patience", type=int, default=2, help="early-stopping patience in epochs")
    p.add_argument("--lr", type=float, default=2e-3, help="learning rate")
    p.add_argument("--nll-weight", type=float, default=0.0, help="Levy loss: MSE + w * NLL")
    p.add_argument("--uq-weights", default=",".join(f"{w:g}" for w in UQ_WEIGHTS),
                   help="grid of w for the Levy loss MSE + w * score of N(mu, (T sigma)^2), "
                   "fixed in advance; w is chosen by validation CRPS (comma list, each >= 0)")
    p.add_argument("--uq-score", default="crps", choices=("crps", "nll"),
                   help="the score of the Levy loss (closed-form Gaussian CRPS or NLL)")
    p.add_argument("--alpha-prior", type=float, default=1e-3,
                   help="kappa of the prior kappa * log(alpha)^2 in the Levy loss (w > 0)")
    p.add_argument("--grid-seeds", type=int, default=None,
                   help="the first this many model seeds train every w of the grid (default: "
                   "all); the others train the chosen w only")
    p.add_argument("--max-train-queries", type=int, default=64,
                   help="forecast points per stay per training batch (random subset)")
    p.add_argument("--max-train-seconds", type=float, default=None,
                   help="training time cap per model in seconds (default: none)")
    p.add_argument("--ensemble-members", type=int, default=5,
                   help="members of the softmax deep ensemble")
    p.add_argument("--mc-passes", type=int, default=20, help="MC-dropout passes")
    p.add_argument("--sampler-draws", type=int, default=50,
                   help="draws of the explicit Poisson sampler")
    p.add_argument("--gp-train-stays", type=int, default=200,
                   help="training stays that fit the GP baseline's hyperparameters")
    p.add_argument("--gp-iters", type=int, default=30,
                   help="optimiser iterations of the GP hyperparameters")
    p.add_argument("--plots", type=int, default=3, help="number of test stays to plot")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--sub-stays", type=int, default=None,
                   help="MC dropout, sampler and sparsity sweep on this many random val and test "
                   "stays (compute limit; the Levy model is scored on the same subset too; "
                   "default: every stay)")
    p.add_argument("--only-seed", type=int, default=None,
                   help="run model seed S's block, write <out>/seed_<S>.json and stop "
                   "(parallel runs; default: every seed)")
    p.add_argument("--train-only", default=None,
                   help="comma list kind:seed (e.g. softmax:3) to train and checkpoint, then stop "
                   "(default: none)")
    p.add_argument("--only-gp", action="store_true",
                   help="run the GP baseline only, write <out>/gp.json and stop")
    p.add_argument("--reuse", action="store_true",
                   help="reuse <out>/seed_<S>.json records and checkpoints of the same config")
    p.add_argument("--render-only", action="store_true",
                   help="only rewrite the page (and its twin) from <out>/physionet.json")


def data_source(data_dir: str | None) -> Path:
    """The data source ``--data-dir`` names (see :func:`_resolve`)."""
    return _resolve(data_dir)


def _resolve(data_dir: str | None) -> Path:
    """``--data-dir``: a data root holding ``physionet2012/``, that folder, or an archive file."""
    from attnuq_bench.data import data_dir as _dd

    if data_dir is not None and Path(data_dir).is_file():
        return Path(data_dir)  # the archive itself, as the --data-dir help says
    root = _dd(data_dir) if data_dir is not None else _dd()
    return root / "physionet2012" if (root / "physionet2012").exists() else root


# ----------------------------------------------------------------------------- backbone


_CONFIG_KEYS = ("d", "encoder_layers", "dropout", "batch_size", "max_epochs", "patience", "lr",
                "nll_weight", "max_train_queries", "max_train_seconds", "max_stays", "split_seed")


def _train_config(args: argparse.Namespace, ds: PhysioNet2012, w: float | None = None
                  ) -> dict[str, Any]:
    """The options that shape a trained model; ``w``: the Levy model's loss weight (its score,
    prior and the model version join the key), ``None`` for the softmax control."""
    cfg = {k: getattr(args, k, None) for k in _CONFIG_KEYS}
    cfg["cache"] = Path(ds.cache_path or ds.source).name
    if w is not None:
        cfg.update(uq_weight=float(w), uq_score=args.uq_score, alpha_prior=args.alpha_prior,
                   levy_version=LEVY_VERSION)
    return cfg


#: bump when the Levy forecaster's parameters or loss change (its checkpoints are keyed by it)
LEVY_VERSION = 2


def _ckpt_dir(args: argparse.Namespace, ds: PhysioNet2012, w: float | None = None) -> Path:
    """Checkpoint folder (in the cache, never the repository) keyed by data and config."""
    import hashlib

    from attnuq_bench.data.physionet import default_cache_dir

    cfg = _train_config(args, ds, w)
    key = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]
    base = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    return base / "physionet-runs" / key


def _same_run(info: dict[str, Any], old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """Stop reason under ``new`` if a model trained under ``old`` is what ``new`` would train.

    Training is deterministic and nothing in it depends on the epoch or time caps (constant
    learning rate), so a run under ``old`` that ended after ``E`` epochs equals a run under
    ``new`` (same other options) when ``new`` would also end after ``E`` epochs: by patience
    (``E <= new max_epochs``), or by the epoch cap (``E == new max_epochs``), and without
    reaching ``new``'s wall-clock cap (the old run's seconds, timing noise aside). Returns
    ``None`` when the run is not reusable.
    """
    caps = ("max_epochs", "max_train_seconds")
    if any(old.get(k) != new.get(k) for k in set(old) | set(new) if k not in caps):
        return None
    ns = argparse.Namespace(max_epochs=old["max_epochs"], patience=old["patience"])
    why, e = stopped_by(info, ns), int(info["epochs"])
    cap = new.get("max_train_seconds")
    if cap is not None and float(info["seconds"]) > float(cap):
        return None
    if why == "patience" and e <= int(new["max_epochs"]):
        return "patience"
    if e == int(new["max_epochs"]):
        return "max_epochs"
    return None


def _valid_blob(blob: Any) -> bool:
    """A checkpoint as :func:`_model` writes it: ``{"state": state_dict, "info": dict}``."""
    return (isinstance(blob, dict) and isinstance(blob.get("state"), dict)
            and isinstance(blob.get("info"), dict))


def _find_ckpt(kind: str, seed: int, args: argparse.Namespace, ds: PhysioNet2012,
               w: float | None = None) -> tuple[Path, str | None] | None:
    """This config's checkpoint, else one of another cap config that trained the same model."""
    here = _ckpt_dir(args, ds, w)
    ck = here / f"{kind}_{seed}.pt"
    if _valid_blob(torch_load_or_none(ck, "checkpoint", weights_only=False, map_location="cpu")):
        return ck, None  # a torn checkpoint of this config is warned about and retrained
    new = _train_config(args, ds, w)
    for cfg_file in sorted(here.parent.glob("*/config.json")):
        other = cfg_file.parent / f"{kind}_{seed}.pt"
        if cfg_file.parent == here or not other.is_file():
            continue
        old = read_json_or_none(cfg_file, "checkpoint config")
        blob = torch_load_or_none(other, "checkpoint", weights_only=False, map_location="cpu")
        if not isinstance(old, dict) or not _valid_blob(blob):
            continue  # unreadable: not a model to reuse
        info = blob["info"]
        why = _same_run(info, old, new)
        if why is not None:
            return other, why
    return None


def _model(kind: str, seed: int, ds: PhysioNet2012, tr: np.ndarray, val_b: list[ForecastBatch],
           args: argparse.Namespace, w: float = 0.0) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Load ``kind`` seed ``seed`` from the checkpoint cache, or train and save it.

    A checkpoint of a configuration that differs only in ``--max-epochs`` /
    ``--max-train-seconds`` is reused when it is the model this configuration would train
    (:func:`_same_run`); its record then says so (``reused_from``). ``w``: the Levy model's
    loss weight (ignored for the control).
    """
    wk = float(w) if kind == "levy" else None
    here = _ckpt_dir(args, ds, wk)
    here.mkdir(parents=True, exist_ok=True)
    cfg_file = here / "config.json"
    cfg = _train_config(args, ds, wk)
    if is_primary() and read_json_or_none(cfg_file, "checkpoint config") != cfg:
        atomic_write_json(cfg_file, cfg, sort_keys=True)  # shared by the seeds; absent or torn
    found = _find_ckpt(kind, seed, args, ds, wk)
    if found is not None:
        ck, why = found
        blob = torch.load(ck, weights_only=False, map_location=args.device)
        model = _new_model(kind, ds, args)
        model.load_state_dict(blob["state"])
        model.eval()
        info = dict(blob["info"])
        if why is not None:
            info.update(stopped_by=why, reused_from=ck.parent.name, max_epochs=args.max_epochs,
                        max_train_seconds=args.max_train_seconds)
        log(f"loaded {kind} seed {seed} from {ck}" + (f" (same run: {why})" if why else ""))
        return model, info
    ck = here / f"{kind}_{seed}.pt"
    partial = ck.with_suffix(".train.pt")  # per-epoch state: an interrupted training resumes
    model, info = _train(kind, seed, ds, tr, val_b, args, checkpoint=partial, w=float(w))
    atomic_torch_save({"state": model.state_dict(), "info": info}, ck)
    partial.unlink(missing_ok=True)
    return model, info


def _new_model(kind: str, ds: PhysioNet2012, args: argparse.Namespace) -> torch.nn.Module:
    from attnuq.models.levy_forecaster import LevyForecaster, SoftmaxForecaster

    if kind not in ("levy", "softmax"):
        raise ValueError(f"model kind must be 'levy' or 'softmax', got {kind=!r}")
    common = {"d": args.d, "encoder_layers": args.encoder_layers, "dropout": args.dropout}
    cls = LevyForecaster if kind == "levy" else SoftmaxForecaster
    return cls(ds.n_channels, **common).to(args.device)


def _levy_loss(w: float, args: argparse.Namespace) -> Any:
    """The Levy model's training loss: :func:`~attnuq.models.levy_forecaster.forecast_loss`
    (masked MSE + ``w`` x the ``--uq-score`` of ``N(mu, (T sigma_total)^2)`` + the prior on
    ``log alpha``, ``T`` the model's learned temperature)."""
    import torch.nn.functional as F

    from attnuq.models.levy_forecaster import forecast_loss, forward_batch

    def loss(model: Any, b: Any) -> torch.Tensor | None:
        if int(b.query_mask.sum()) == 0:
            return None
        out = forward_batch(model, b)
        log_alpha = torch.log(F.softplus(model.raw_alpha))
        return forecast_loss(out, b.targets, b.query_mask, weight=w, score=args.uq_score,
                             temperature=model.temperature, log_alpha=log_alpha,
                             alpha_prior=args.alpha_prior, floor=SIGMA_FLOOR)

    return loss


def _train(kind: str, seed: int, ds: PhysioNet2012, tr: np.ndarray, val_b: list[ForecastBatch],
           args: argparse.Namespace, checkpoint: Path | None = None, w: float = 0.0
           ) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Train ``kind`` of ``seed``: Adam on the masked MSE of ``mu`` (Levy with ``w > 0``: plus
    ``w`` x the score of its predictive, :func:`_levy_loss`; ``w = 0``: ``--nll-weight`` x NLL),
    early stopping on validation MSE (:func:`attnuq_bench.training.fit`); ``checkpoint``: fit's
    per-epoch state (resumed)."""
    from attnuq.models.levy_forecaster import forward_batch
    from attnuq_bench.training import fit, masked_mse_loss

    torch.manual_seed(seed)
    model = _new_model(kind, ds, args)

    def train_batches(epoch: int) -> Any:
        return (b.to_device(args.device) for b in ds.batches(
            tr, args.batch_size, shuffle=True, by_length=True, max_queries=args.max_train_queries,
            generator=np.random.default_rng(1000 * seed + epoch)))

    val_d = [b.to_device(args.device) for b in val_b]
    loss = (_levy_loss(w, args) if kind == "levy" and w > 0 else
            masked_mse_loss(forward_batch, args.nll_weight if kind == "levy" else 0.0))
    rep = fit(model, train_batches, lambda: val_d, loss=loss,
              metric="masked_mse", forward_fn=forward_batch, optimizer="adam", lr=args.lr,
              weight_decay=0.0, clip_grad_norm=5.0, max_epochs=args.max_epochs,
              patience=args.patience, max_seconds=args.max_train_seconds,
              checkpoint=checkpoint,
              progress=lambda s: log(f"{kind}{f' w={w:g}' if kind == 'levy' else ''} seed "
                                     f"{seed} {s}"))
    info = {"epochs": len(rep.val_metric), "best_epoch": rep.best_epoch,
            "best_val_mse": rep.best_val, "seconds": rep.seconds,
            "val_mse_curve": list(rep.val_metric), "stopped_by": rep.stopped_by,
            "max_epochs": args.max_epochs, "patience": args.patience,
            "max_train_seconds": args.max_train_seconds}
    if kind == "levy":
        lp = model.layer_params()  # type: ignore[operator]
        info.update({k: float(lp[k].detach()) for k in ("alpha", "beta", "h")})
        lm: Any = model
        info.update(uq_weight=float(w), temperature=float(lm.temperature.detach()),
                    prior_std_median=float(lm.prior_std.detach().median()))
    return model, info


# ----------------------------------------------------------------------------- run


def _context(args: argparse.Namespace) -> dict[str, Any]:
    """The data: splits (``--max-stays``), the evaluation subset (``--sub-stays``), batches."""
    src = _resolve(args.data_dir)
    log(f"loading {src}")
    ds = primary_first("physionet: data", lambda: load_physionet2012(  # torchrun: rank 0 first
        src, cache_dir=args.cache_dir, errors="warn", seed=args.split_seed))  # (writes a cache)
    splits = {k: ds.split_indices(k) for k in ("train", "val", "test")}
    if args.max_stays:
        rng = np.random.default_rng(12345)
        splits = {k: np.sort(rng.choice(v, min(len(v), args.max_stays), replace=False))
                  for k, v in splits.items()}
    tr, va, te = splits["train"], splits["val"], splits["test"]
    rng = np.random.default_rng(54321)
    k = args.sub_stays
    sub_va = va if not k or k >= len(va) else np.sort(rng.choice(va, k, replace=False))
    sub_te = te if not k or k >= len(te) else np.sort(rng.choice(te, k, replace=False))
    ctx: dict[str, Any] = {"ds": ds, "splits": splits, "tr": tr, "va": va, "te": te,
                           "val_b": batches(ds, va, 64), "test_b": batches(ds, te, 64),
                           "sub_va": sub_va, "sub_te": sub_te,
                           "sub_val_b": batches(ds, sub_va, 64),
                           "sub_test_b": batches(ds, sub_te, 64)}
    ctx["y_val"], ctx["y_test"] = targets(ctx["val_b"]), targets(ctx["test_b"])
    for k, b in (("ch_val", "val_b"), ("ch_test", "test_b"), ("chs_val", "sub_val_b"),
                 ("chs_test", "sub_test_b")):
        ctx[k] = channels(ctx[b])
    log(f"{len(tr)}/{len(va)}/{len(te)} stays; {len(ctx['y_test'])} test points; subset "
        f"{len(sub_va)}/{len(sub_te)} val/test stays; checkpoints {_ckpt_dir(args, ds)}")
    return ctx


def _select_weight(seeds: list[int], ctx: dict[str, Any], args: argparse.Namespace
                   ) -> dict[str, Any]:
    """Train (or load) the Levy model of every ``--uq-weights`` ``w`` for the grid seeds and
    choose ``w`` by the validation CRPS (seed mean; each ``w``'s own calibration on validation,
    :func:`attnuq_bench.suites._physionet_eval.grid_entry`). The test scores of every grid model are
    recorded beside (the cost of ``w`` in point accuracy), never used for the choice."""
    ds, tr, val_b = ctx["ds"], ctx["tr"], ctx["val_b"]
    n_grid = len(seeds) if args.grid_seeds is None else min(args.grid_seeds, len(seeds))
    entries: dict[str, list[dict[str, Any]]] = {}
    for s in seeds[:n_grid]:
        for w in args.uq_weight_grid:
            model, info = _model("levy", s, ds, tr, val_b, args, w=w)
            e = grid_entry(model, w, ctx)
            e.update(seed=s, epochs=info["epochs"], best_epoch=info["best_epoch"],
                     seconds=info["seconds"], stopped_by=stopped_by(info, args))
            entries.setdefault(f"{w:g}", []).append(e)
            log(f"grid seed {s} w={w:g}: val CRPS {e['val_crps']:.5f}, val MSE "
                f"{e['val_mse']:.5f}")
    val = {k: float(np.mean([e["val_crps"] for e in v])) for k, v in entries.items()}
    chosen = min(args.uq_weight_grid, key=lambda w: (val[f"{w:g}"], w))
    log(f"chosen w = {chosen:g} (validation CRPS {val})")
    return {"weights": list(args.uq_weight_grid), "seeds": seeds[:n_grid], "entries": entries,
            "val_crps": val, "chosen": chosen, "score": args.uq_score,
            "alpha_prior": args.alpha_prior}


def _seed_record(seed: int, ctx: dict[str, Any], args: argparse.Namespace, w: float
                 ) -> dict[str, Any]:
    """Train (or load) both models of one seed (Levy at the chosen ``w``) and score every
    per-seed row."""
    ds, tr, val_b = ctx["ds"], ctx["tr"], ctx["val_b"]
    rec: dict[str, Any] = {"method": f"seed_{seed}", "seed": seed,
                           "scoring_version": SCORING_VERSION,
                           "train_config": _train_config(args, ds, w)}
    levy, rec["train_levy"] = _model("levy", seed, ds, tr, val_b, args, w=w)
    ctrl, rec["train_softmax"] = _model("softmax", seed, ds, tr, val_b, args)
    for key in ("train_levy", "train_softmax"):
        rec[key] = dict(rec[key], stopped_by=stopped_by(rec[key], args))
    return {**rec, **score_seed(levy, ctrl, ctx, seed, mc_passes=args.mc_passes,
                                sampler_draws=args.sampler_draws, weight=w)}


def _seeds(seeds: list[int], ctx: dict[str, Any], args: argparse.Namespace, w: float,
           on_saved: Any = None) -> list[dict[str, Any]]:
    """The seed records ``<out>/seed_<S>.json`` (the runner's items; ``--reuse``: reused when
    their training options and scoring version match this run's)."""
    from attnuq._runtime import run_info
    from attnuq_bench.suites._runner import Group, RunStore, run_items

    store = RunStore(Path(args.out), suite="physionet", info=run_info(), what="options",
                     reuse_of=lambda r: [r.get("scoring_version"), r.get("train_config")],
                     valid=lambda r: isinstance(r, dict) and "metrics" in r)
    names = [f"seed_{s}" for s in seeds]
    from attnuq_bench.suites._digests import files_digest

    group = Group(parts=(), methods=names,
                  reuse=[SCORING_VERSION, _train_config(args, ctx["ds"], w)],
                  data=files_digest([_resolve(args.data_dir)]))  # other data: never reused
    run_items(store, [group], lambda g: ctx,
              lambda c, g, m: _seed_record(int(m.split("_")[1]), c, args, w), progress=False,
              rerun=() if args.reuse else names, on_saved=on_saved)
    recs = [store.load((), m, check=False) for m in names]
    failed = [m for m, r in zip(names, recs, strict=True) if r is None]
    if failed:
        raise RuntimeError(f"seed runs failed: {failed} (see {args.out}/<seed>.err.txt)")
    return [r for r in recs if r is not None]


def parse_train_only(text: str | None) -> list[tuple[str, int, float | None]]:
    """``--train-only``: a comma list of ``kind:seed`` (``levy@w:seed`` for one weight) as
    ``(kind, seed, w or None)``; a malformed item is refused naming it.

    Examples
    --------
    >>> parse_train_only("softmax:3, levy@0.1:0")
    [('softmax', 3, None), ('levy', 0, 0.1)]
    >>> parse_train_only("bogus")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: --train-only items must be kind:seed or levy@w:seed (kind softmax or levy), ...
    """
    out: list[tuple[str, int, float | None]] = []
    for item in (text or "").split(","):
        if not item.strip():
            continue
        head, sep, seed = item.strip().partition(":")
        kind, _, wt = head.strip().partition("@")
        try:
            if not sep or not kind:
                raise ValueError
            s = int(seed)
            w = float(wt) if wt else None
            bad_w = w is not None and (kind != "levy" or not (math.isfinite(w) and w >= 0))
            if s < 0 or kind not in ("levy", "softmax") or bad_w:
                raise ValueError
        except ValueError:
            raise ValueError(f"--train-only items must be kind:seed or levy@w:seed (kind "
                             f"softmax or levy), got {item.strip()!r}") from None
        out.append((kind, s, w))
    return out


def run(args: argparse.Namespace) -> Path:
    """Run the suite; return the results folder."""
    from attnuq._runtime import run_info

    out = Path(args.out)
    md = Path(args.md) if args.md else out.parent / "physionet.md"
    if args.render_only:
        _write_page(out, md, read_json(out / "physionet.json"))
        return out
    torch.set_num_threads(max(1, int(args.threads)))
    if args.seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
    args.uq_weight_grid = parse_weights(args.uq_weights)
    check_score_weight(args.alpha_prior, "--alpha-prior")
    if args.grid_seeds is not None and args.grid_seeds < 1:
        raise ValueError(f"--grid-seeds must be >= 1, got {args.grid_seeds}")
    train_only = parse_train_only(args.train_only)  # before the data is loaded
    info = run_info()
    import time

    t_start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    ctx = _context(args)
    ds, tr, te, val_b = ctx["ds"], ctx["tr"], ctx["te"], ctx["val_b"]
    if train_only:  # kind:seed, levy at every grid weight (levy@w:seed: that w only)
        for kind, seed, wt in train_only:
            for w in ((wt,) if wt is not None else args.uq_weight_grid) if kind == "levy" \
                    else (0.0,):
                _model(kind, seed, ds, tr, val_b, args, w=w)
        return out
    if args.only_gp:
        atomic_write_json(out / "gp.json", score_gp(ctx, args.gp_train_stays, args.gp_iters),
                          indent=1, default=float)
        return out
    seeds = [args.seed + k for k in range(args.seeds)]
    grid = _select_weight(seeds, ctx, args)
    w = float(grid["chosen"])
    if args.only_seed is not None:
        _seeds([int(args.only_seed)], ctx, argparse.Namespace(**{**vars(args), "reuse": False}),
               w)
        return out
    results: dict[str, Any] = {"run": info, "data": ds.summary(), "args": {
        k: v for k, v in vars(args).items() if not k.startswith("_") and not callable(v)}}
    results["data"]["used_split_sizes"] = {k: len(v) for k, v in ctx["splits"].items()}
    results["data"]["subset_sizes"] = {"val": len(ctx["sub_va"]), "test": len(ctx["sub_te"])}
    results["data"]["issues"] = [str(i) for i in ds.issues[:50]]
    results["grid"] = grid
    done: list[dict[str, Any]] = []

    def saved(group: Any, method: str, rec: dict[str, Any]) -> None:  # a partial results file
        done.append(rec)
        _write_json(out, results, done)

    per_seed = _seeds(seeds, ctx, args, w, on_saved=saved)
    ens: dict[str, Any] = {}
    if args.ensemble_members >= 2:  # members = softmax controls of seeds --seed + k
        ctrl0 = _model("softmax", args.seed, ds, tr, val_b, args)[0]
        task = control_task(ctrl0, val_b, val_b, make_model=lambda k: _model(
            "softmax", args.seed + k, ds, tr, val_b, args)[0])
        ens = {**score_ensemble(task, args.ensemble_members, ctx),
               "seeds": [args.seed + k for k in range(args.ensemble_members)]}
    results["ensemble"] = ens
    gp_file = out / "gp.json"
    gp_old = (read_json_or_none(gp_file, "GP results", validate=lambda r: isinstance(r, dict))
              if args.reuse else None)
    if gp_old is not None:
        log(f"reusing {gp_file}")
        results["gp"] = gp_old
    else:
        results["gp"] = score_gp(ctx, args.gp_train_stays, args.gp_iters)
        atomic_write_json(gp_file, results["gp"], indent=1, default=float)
    if args.plots > 0:
        levy0, _ = _model("levy", seeds[0], ds, tr, val_b, args, w=w)
        levy0.set_alpha(float(per_seed[0]["calibration"]["alpha"]))  # type: ignore[operator]
        results["plots"], results["plot_info"] = plots(
            levy0, ds, te, out, args.plots, per_seed[0]["metrics"]["levy"]["T"],
            sigma_key="sigma_total" if w > 0 else "sigma")
    results["sigma_floor"] = SIGMA_FLOOR
    # this process's wall time (models and records loaded from the cache cost little here)
    results["run_seconds"] = time.perf_counter() - t_start
    results["implementations"] = impl_record(page_rows({**results, "per_seed": per_seed}))
    full = _write_json(out, results, per_seed)
    _write_page(out, md, full)
    return out


def _write_json(out: Path, results: dict[str, Any], per_seed: list[dict[str, Any]]
                ) -> dict[str, Any]:
    full = {**results, "per_seed": per_seed, "summary": summarise(per_seed)}
    atomic_write_json(out / "physionet.json", full, indent=1, default=float)
    return full


#: the inference benchmark that judges issue #36's speed goal, relative to the docs folder
#: (the page's folder's parent: ``docs/results/physionet.md`` -> ``docs/benchmarks/...``)
SPEED_BENCHMARK = Path("benchmarks") / "levy_forecaster.json"


def speed_record(md: Path) -> dict[str, Any] | None:
    """The record of ``benchmarks/bench_levy_forecaster.py`` beside the page ``md``
    (:data:`SPEED_BENCHMARK`), with ``"page"``: its markdown page relative to ``md``; ``None``
    when there is none (the page then judges the speed goal from the in-run timings), or, with
    a warning, when it is unreadable or lacks the fields the page reads.

    >>> import tempfile
    >>> speed_record(Path(tempfile.mkdtemp()) / "results" / "physionet.md") is None
    True
    """
    import warnings

    path = Path(md).parent.parent / SPEED_BENCHMARK
    if not path.is_file():
        return None
    try:
        rec = read_json(path)
        row = rec["rows"][0]
        ok = (all(math.isfinite(float(rec[k])) for k in ("ratio", "ratio_q25", "ratio_q75"))
              and all(math.isfinite(float(row["stays_per_s"][k])) for k in "abc")
              and isinstance(rec["date"], str) and int(rec["shape"]["test_stays"]) > 0
              and int(row["repeats"]) > 0)
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        ok, why = False, f"{type(exc).__name__}: {exc}"
    else:
        why = "non-finite or missing numbers"
    if not ok:
        warnings.warn(f"ignoring the speed benchmark {path} ({why}); the page judges the speed "
                      "goal from the in-run timings", UserWarning, stacklevel=2)
        return None
    page = path.with_suffix(".md")
    return {**rec, "page": Path(os.path.relpath(page, Path(md).parent)).as_posix()}


def _write_page(out: Path, md: Path, results: dict[str, Any]) -> None:
    """The page and its twin from ``results``; the ``physionet`` key of ``summary.json``."""
    build_page(results, out_name=Path(os.path.relpath(out, md.parent)).as_posix(),
               speed=speed_record(md)).write(md)
    summ = summarise(results["per_seed"])
    if "levy" in summ and "softmax" in summ:
        name = Path(str(results["data"].get("source") or "physionet")).name.split(".")[0]
        rows = {**{k: {m: v[0] for m, v in r.items()} for k, r in summ.items()},
                **{k: results[k] for k in ("ensemble", "gp") if results.get(k)}}
        methods = {"frozen": {"mse": summ["levy"]["mse"][0]}} | {
            key: {k: row[s] for k, s in (("mse", "mse"), ("crps", "crps"), ("pi95_width_cal",
                  "cwidth95"), ("coverage95_native", "cov95"), ("spearman", "spearman"),
                  ("spearman_within_channel", "spearman_within_channel")) if s in row}
            for key, row in rows.items()}
        update_summary(md.parent / "summary.json", "physionet", {name: {
            "backbone": {"metric": "mse", "value": summ["levy"]["mse"][0],
                         "reference": 1.03 * summ["softmax"]["mse"][0],
                         "reference_name": "1.03 x the softmax control's MSE"},
            "splits": len(results["per_seed"]), "methods": methods}})


def render_page(out: Path, table: Path) -> Page:
    """The page of the stored ``<out>/physionet.json`` and the speed benchmark beside the page
    ``table`` (:func:`speed_record`; no training, no writes)."""
    return build_page(read_json(Path(out) / "physionet.json"),
                      out_name=Path(os.path.relpath(out, Path(table).parent)).as_posix(),
                      speed=speed_record(Path(table)))


register("physionet", help="Levy-attention forecaster on PhysioNet 2012 (t-PatchGNN protocol)",
         add_arguments=add_arguments, run=run)
