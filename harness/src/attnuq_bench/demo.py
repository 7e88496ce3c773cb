"""``attnuq demo``: the end-to-end path a new user takes, on a data set bundled with the package.

1. Load a UCI regression set (bundled: ``concrete``, the standard split ``split``) and cut the
   training split into fit / val / cal parts (:func:`attnuq_bench.data.uci.load_uci`).
2. Train a small FT-Transformer (rtdl-revisiting-models, default recipe, early stopping), or reuse
   the one a previous run saved in the report folder (same data, split, seed and epochs).
3. Stochastic attention as recommended, the registered method ``sa``: ``nu`` calibrated on the
   val part (:func:`attnuq.calibrate`, criterion ``"auto"`` -- the debiased ``L_SA`` on this
   scalar target --, Bayesian optimisation), ``n_samples`` stochastic passes per test input
   (:func:`attnuq.predict`) recentred on the frozen output, and a conformal floor under the
   spread (``beta`` on val, the factor on cal).
4. Compare with the paper's recipe (``sa-paper``) and MC dropout on the same frozen model
   (:mod:`attnuq_bench.methods`).
5. Write ``results.json``, PNG figures and a self-contained ``report.html``.

Everything is reported in the target's own units.

Examples
--------
>>> from attnuq_bench.demo import run_demo  # doctest: +SKIP
>>> run_demo("attnuq-demo")  # doctest: +SKIP
"""

from __future__ import annotations

import math
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from attnuq._io import (
    CorruptFileWarning,
    atomic_savefig,
    atomic_torch_save,
    atomic_write_json,
    check_out_dir,
    describe_error,
    read_json_or_none,
    tensor_digest,
    torch_load_or_none,
)
from attnuq._validation import check_positive_int

__all__ = ["run_demo"]


def _pit(pred: Any, y: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Randomised PIT of samples (and of an SAPredictive), ``Phi((y - mu) / sigma)`` of a
    Gaussian."""
    from attnuq import metrics
    from attnuq.estimators._regressor import SAPredictive
    from attnuq.predictive import GaussianPredictive

    if isinstance(pred, GaussianPredictive):
        z = (y - pred.mean) / pred.std.clamp_min(1e-12)
        return 0.5 * (1.0 + torch.erf(z / 2.0**0.5))
    if isinstance(pred, SAPredictive):  # its calibrated distribution, not the raw draws
        return pred.pit(y, generator=gen).to(y.dtype)
    return metrics.pit_samples(pred.samples, y, generator=gen)


def _scores(pred: Any, y: torch.Tensor, gen: torch.Generator) -> dict[str, float | None]:
    from attnuq import metrics

    lo, hi = pred.interval(0.95)
    std = pred.std.clamp_min(1e-12)
    return {
        "RMSE": float(metrics.rmse(pred.mean, y)),
        "CRPS": float(pred.crps(y)),
        "NLL (Gaussian fit)": float(metrics.nll_normal(pred.mean, std, y)),
        "coverage 95%": float(metrics.coverage(lo, hi, y)),
        "PI-95 width": float(metrics.interval_width(lo, hi)),
        "W1(PIT, U)": float(metrics.pit_w1(_pit(pred, y, gen))),
        # undefined for a constant spread (the floor may choose beta = inf: plain conformal):
        # None, shown as n/a (JSON null, not NaN)
        "Spearman(|err|, std)": float(metrics.spearman_spread_error(std, pred.mean, y))
        if float(std.max() - std.min()) > 0 else None,
    }


def _beta_text(units: float) -> float | str:
    """The floor's beta for results.json: a number, or ``"inf (plain conformal)"`` (JSON has no
    infinity)."""
    return units if math.isfinite(units) else "inf (plain conformal)"


def _json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced, so results.json is strict JSON: NaN (an
    undefined score) by None, +-inf (e.g. the floor's ``beta = inf``) by ``"inf"`` / ``"-inf"``.

    >>> _json_safe({"a": [1.0, float("nan")], "b": float("inf")})
    {'a': [1.0, None], 'b': 'inf'}
    """
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _fingerprint(
    dataset: str, split: int, seed: int, max_epochs: int, n_rows: int, n_blocks: int,
    data: str = "",
) -> dict[str, Any]:
    return {"dataset": dataset, "split": split, "seed": seed, "max_epochs": max_epochs,
            "n_fit_rows": n_rows, "data_sha256_16": data,
            "backbone": f"FTTransformer(n_blocks={n_blocks}, rtdl default kwargs)",
            "optimiser": "AdamW lr 3e-4, batch 64, patience 16"}


def run_demo(
    out_dir: str | Path = "attnuq-demo",
    *,
    dataset: str = "concrete",
    split: int = 0,
    data_dir: str | Path | None = "bundled",
    seed: int = 0,
    device: str = "cpu",
    retrain: bool = False,
    max_epochs: int = 100,
    n_blocks: int = 1,
    n_samples: int = 100,
    progress: bool | None = None,
) -> Path:
    """Run the demo and return the report folder (``report.html`` inside).

    Parameters
    ----------
    out_dir
        Report folder; a trained model is cached there as ``model.pt`` and reused when its
        fingerprint (data set, split, the training data's digest, seed, epochs, blocks)
        matches, unless ``retrain``; a torn checkpoint is retrained with a warning.
    dataset, split, data_dir
        UCI set, standard split, and data root (``"bundled"`` for the copies in the package).
    max_epochs, n_blocks
        Training budget (early stopping with patience 16 on the val part) and depth of the
        FT-Transformer (rtdl's default width for that depth). The demo trains with AdamW at
        lr 3e-4 on batches of 64 (rtdl's recipe: 1e-4, larger batches), which reaches the same
        accuracy on the small bundled set in far fewer epochs; one block keeps the demo within
        a few minutes on two CPU cores.
    n_samples
        Stochastic passes per test input, for SA and for MC dropout alike.
    """
    check_positive_int(max_epochs, "max_epochs")
    check_positive_int(n_blocks, "n_blocks")
    if n_blocks > 6:
        raise ValueError(f"n_blocks must be in 1..6 (rtdl default configs), got {n_blocks=}")
    check_positive_int(n_samples, "n_samples")
    check_out_dir(out_dir)  # before any work: a file named as the report folder fails now
    if n_samples < 2:
        raise ValueError(f"n_samples must be at least 2 for intervals, got {n_samples=}")
    # The demo's tensors are tiny (9 tokens of width 96): one intra-op thread is as fast as two
    # on an idle machine and many times faster on a busy one (no spin-waiting between threads).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_demo(out_dir, dataset=dataset, split=split, data_dir=data_dir, seed=seed,
                         device=device, retrain=retrain, max_epochs=max_epochs,
                         n_blocks=n_blocks, n_samples=n_samples, progress=progress)
    finally:
        torch.set_num_threads(threads)


def _run_demo(
    out_dir: str | Path,
    *,
    dataset: str,
    split: int,
    data_dir: str | Path | None,
    seed: int,
    device: str,
    retrain: bool,
    max_epochs: int,
    n_blocks: int,
    n_samples: int,
    progress: bool | None,
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from attnuq import plots
    from attnuq._runtime import run_info
    from attnuq.html_report import render_report
    from attnuq.predictive import GaussianPredictive
    from attnuq_bench.data.uci import load_uci
    from attnuq_bench.methods import Task, make_method
    from attnuq_bench.models.ft import make_ft_transformer
    from attnuq_bench.training import fit

    t_start = time.perf_counter()
    out = Path(out_dir)
    torch.manual_seed(seed)
    dev = torch.device(device)

    s = load_uci(dataset, split=split, data_dir=data_dir)  # a bad set or split: no folder made
    out.mkdir(parents=True, exist_ok=True)
    sizes = s.sizes()
    print(f"[attnuq demo] {dataset} split {split}: {sizes} rows (fit/val/cal/test)")

    def to(t: torch.Tensor) -> torch.Tensor:
        return t.to(dev)

    # -- 1. backbone: train or reuse -----------------------------------------------------------
    model = make_ft_transformer(s.n_features, n_blocks=n_blocks, seed=seed).to(dev)
    fp = _fingerprint(dataset, split, seed, max_epochs, sizes["fit"], n_blocks,
                      tensor_digest(s.x_fit, s.y_fit, s.x_val, s.y_val))
    ckpt, meta = out / "model.pt", out / "model.json"
    reused = False
    train_seconds = 0.0
    state = None
    if not retrain and read_json_or_none(meta, "demo model record") == fp:
        state = torch_load_or_none(ckpt, "demo checkpoint", map_location=dev, weights_only=True)
        if state is not None:
            try:
                model.load_state_dict(state)
            except (RuntimeError, KeyError) as exc:  # keys/shapes unlike the recorded recipe
                warnings.warn(f"corrupt demo checkpoint {ckpt} ({describe_error(exc)}); "
                              "retraining", CorruptFileWarning, stacklevel=2)
                model = make_ft_transformer(s.n_features, n_blocks=n_blocks, seed=seed).to(dev)
                state = None
    if state is not None:
        reused = True
        print(f"[attnuq demo] reusing the model trained before ({ckpt})")
    else:
        res = fit(
            model, (to(s.x_fit), to(s.y_fit)), (to(s.x_val), to(s.y_val)),
            max_epochs=max_epochs, patience=16, seed=seed, desc="train FT-Transformer",
            batch_size=64, lr=3e-4,
            progress=progress is not False,
        )
        train_seconds = res.seconds
        atomic_torch_save(model.state_dict(), ckpt)
        atomic_write_json(meta, fp, indent=2)
        print(f"[attnuq demo] trained {res.epochs_run} epochs in {res.seconds:.0f} s "
              f"(best val RMSE {res.best_val * s.y_std:.3f})")
    model.eval()

    task = Task(model=model, train=(to(s.x_fit), to(s.y_fit)), val=(to(s.x_val), to(s.y_val)),
                cal=(to(s.x_cal), to(s.y_cal)))
    x_test, y_test = to(s.x_test), to(s.y_test)

    def unscale(p: Any) -> Any:
        from attnuq.estimators._regressor import SAPredictive

        if isinstance(p, GaussianPredictive):
            return GaussianPredictive(mean=p.mean * s.y_std + s.y_mean, std=p.std * s.y_std)
        if isinstance(p, SAPredictive):
            return SAPredictive(mean=p.mean * s.y_std + s.y_mean, spread=p.spread * s.y_std,
                                scores=p.scores, ranks=p.ranks, n=p.n,
                                samples=p.samples * s.y_std + s.y_mean,
                                frozen=p.frozen * s.y_std + s.y_mean, form=p.form)
        return p.__class__(samples=p.samples * s.y_std + s.y_mean,
                           frozen=None if p.frozen is None else p.frozen * s.y_std + s.y_mean)

    y_units = y_test * s.y_std + s.y_mean
    # -- 2. methods ----------------------------------------------------------------------------
    specs: list[tuple[str, str, dict[str, Any]]] = [
        ("SA", "sa", {}),
        ("SA, paper recipe", "sa-paper", {}),
        ("plain conformal", "conformal", {}),
        ("MC dropout", "mc-dropout", {}),
    ]
    preds: dict[str, Any] = {}
    rows: list[list[Any]] = []
    with torch.no_grad():  # the frozen model: a point prediction, no uncertainty
        frozen_units = task.forward(model, x_test) * s.y_std + s.y_mean
    from attnuq import metrics as _metrics

    frozen_row: list[Any] = ["frozen model (point only)",
                             float(_metrics.rmse(frozen_units, y_units))]
    infos: dict[str, Any] = {}
    sa_method: Any = None
    for label, name, kw in specs:
        kwargs: dict[str, Any] = ({} if name == "conformal"
                                  else {"n_samples": n_samples, "seed": seed, **kw})
        if name.startswith("sa"):
            kwargs["progress"] = progress is not False
        m = make_method(name, **kwargs)
        t0 = time.perf_counter()
        m.fit(task)
        p = unscale(m.predict(x_test))
        secs = time.perf_counter() - t0
        preds[label] = p
        infos[label] = {**m.info(), "cost": m.cost.to_dict(), "seconds": secs}
        if name == "sa":
            sa_method = m
        sc = _scores(p, y_units, torch.Generator().manual_seed(seed))
        rows.append([label, *sc.values(), secs])
        print(f"[attnuq demo] {label:>15}: " + ", ".join(
            f"{k} {'n/a (constant spread)' if v is None else f'{v:.3f}'}" for k, v in sc.items()))
    columns = ["method", *_scores(preds["SA"], y_units, torch.Generator()).keys(), "seconds"]
    rows.insert(0, frozen_row + [None] * (len(columns) - len(frozen_row)))
    sa_info = sa_method.info()
    sa_report = sa_method.estimator.report
    nu = int(sa_info["nu"])

    # -- 3. figures ----------------------------------------------------------------------------
    figures: list[dict[str, str]] = []

    def save(fig: Any, name: str, caption: str) -> None:
        fig.tight_layout()
        atomic_savefig(fig, out / name, dpi=110)
        plt.close(fig)
        figures.append({"file": name, "caption": caption})

    ncol = 2
    nrow = (len(preds) + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.0 * ncol, 4.2 * nrow), squeeze=False)
    pit_w1 = {}
    for ax, (label, p) in zip(axes.reshape(-1), preds.items(), strict=False):
        u = _pit(p, y_units, torch.Generator().manual_seed(seed))
        pit_w1[label] = float(_metrics.pit_w1(u.reshape(-1).double()))
        plots.pit_histogram(u, ax=ax, bins=10)
        ax.set_title(f"PIT: {label}", fontsize=12)
        ax.tick_params(labelsize=10)
    for ax in axes.reshape(-1)[len(preds):]:
        ax.set_visible(False)
    flattest = min(pit_w1, key=lambda k: pit_w1[k])
    save(fig, "pit.png", "PIT histograms on the test part (a flat histogram = calibrated; a "
         "U shape = intervals too narrow, a hump = too wide). In this run the flattest is "
         f"{flattest} (W1 to uniform " + ", ".join(f"{k} {v:.3f}" for k, v in pit_w1.items())
         + ").")

    fig, ax = plt.subplots(figsize=(5.2, 4.8))
    gaps = []
    for label, p in preds.items():
        plots.reliability_diagram(p, y_units, ax=ax, label=label)
        lv = plots.DEFAULT_LEVELS
        obs = []
        for v in lv:
            lo_v, hi_v = p.interval(v)
            obs.append(float(_metrics.coverage(lo_v, hi_v, y_units)))
        worst = max(range(len(lv)), key=lambda i: abs(obs[i] - lv[i]))
        gaps.append(f"{label} {'over' if obs[worst] > lv[worst] else 'under'}-covers most at "
                    f"{lv[worst]:.0%} ({obs[worst]:.0%} observed)")
    save(fig, "reliability.png", "Observed against nominal coverage of the central intervals "
         "(on the diagonal = calibrated). In this run: " + "; ".join(gaps) + ".")

    fig, ax = plt.subplots(figsize=(6.0, 4.2))
    sa_report.plot(ax=ax)
    tried = [int(e.nu) for e in sa_report.evaluations]
    save(fig, "calibration_curve.png",
         f"How nu was chosen: nu is the number of value rows each attention draws (few draws = "
         f"more noise, a wider spread). The search tried {len(tried)} values of nu "
         f"({', '.join(map(str, tried))}; one dot each) and measured how well SA's spread "
         f"matched the validation errors ({sa_info['criterion_resolved']}, lower is better); "
         f"it kept nu = {nu}"
         + (", an end of its range: SA's spread could not match the errors there"
            if sa_info.get("nu_at_edge") not in (None, "no") else "") + ".")

    fig, ax = plt.subplots(figsize=(9, 3.8))
    _intervals_vs_truth(ax, preds["SA"], preds["MC dropout"], y_units)
    cov = {}
    for k, p in preds.items():
        lo95, hi95 = p.interval(0.95)
        cov[k] = float(_metrics.coverage(lo95, hi95, y_units))
    save(fig, "intervals.png", "95 % intervals against the truth, test points sorted by "
         f"prediction. Coverage here: SA {cov['SA']:.1%}, MC dropout {cov['MC dropout']:.1%}.")

    # -- 4. results + report -------------------------------------------------------------------
    info = run_info()
    results = {
        "title": f"attnuq demo: FT-Transformer on UCI {dataset} (split {split})",
        "summary": {
            "chosen nu (sa: auto criterion, BO)": nu,
            "criterion used by auto": sa_info["criterion_resolved"],
            "form chosen on val (sa)": sa_info["form"],
            "floor beta (units of the val residual scale)": _beta_text(
                sa_info["floor_beta_units"]),
            "val Spearman(spread, |error|) (sa)": sa_info["spearman_spread_abs_error"],
            "rows fit / val / cal / test": " / ".join(str(v) for v in sizes.values()),
            "model": "reused from a previous run" if reused else
                     f"trained here in {train_seconds:.0f} s",
            "stochastic passes per input": n_samples,
            "total seconds": round(time.perf_counter() - t_start, 1),
        },
        "tables": [{
            "title": f"Test scores in target units ({dataset})",
            "columns": columns,
            "rows": rows,
            "note": "CRPS, NLL, width: lower is better; coverage: nominal 0.95; W1(PIT, U): 0 "
                    "for a calibrated forecast. SA is the recommended configuration (method "
                    "'sa' = attnuq.SARegressor: auto criterion, draws recentred on the frozen "
                    "output, the form chosen on val by cross-fitted CRPS, conformal scores on "
                    "cal); SA, paper recipe is 'sa-paper' (L_SA, raw draws); plain conformal "
                    "is a constant-width split-conformal interval on the frozen model; the "
                    "frozen model row has a point prediction only. NLL uses a Gaussian with the "
                    "predictive's mean and std. Spearman(|err|, std) is n/a where "
                    "the spread is the same for every input (constant width).",
        }],
        "figures": figures,
        "methods": infos,
        "calibration": sa_report.to_dict(),
        "meta": info,
    }
    atomic_write_json(out / "results.json", _json_safe(results), indent=2, default=float)
    page = render_report(out / "results.json")
    print(f"[attnuq demo] done in {time.perf_counter() - t_start:.0f} s")
    return page.parent


def _intervals_vs_truth(ax: Any, sa: Any, mcd: Any, y: torch.Tensor) -> None:
    order = torch.argsort(sa.mean)
    x = torch.arange(len(y))
    for p, label, color in ((mcd, "MC dropout", "#d62728"), (sa, "SA", "#1f77b4")):
        lo, hi = p.interval(0.95)
        ax.fill_between(x, lo[order], hi[order], alpha=0.3, color=color, step="mid",
                        label=f"{label} 95 %", linewidth=0)
    ax.plot(x, sa.mean[order], color="#1f77b4", lw=1, label="SA mean")
    ax.scatter(x, y[order], s=6, color="k", label="truth", zorder=3)
    ax.set_xlabel("test point (sorted by SA mean)")
    ax.set_ylabel("target")
    ax.legend(loc="upper left", fontsize=8)
