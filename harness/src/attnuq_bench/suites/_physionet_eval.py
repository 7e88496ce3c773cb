"""The evaluation protocol of ``attnuq bench physionet``: every per-seed score, the GP, the plots.

Given the trained Levy forecaster and its softmax control of one seed (the suite,
:mod:`attnuq_bench.suites.physionet`, trains or loads them), :func:`score_seed` scores each row of
the page on the flattened forecast points (``query_mask``), every Gaussian method as
``N(mu, (T s)^2)`` with ``T`` fitted on validation and, separately, split-conformal intervals
(:func:`gaussian_scores`); MC dropout and the deep ensemble are the registered ``"mc-dropout"``
and ``"ensemble"`` methods on the control (:func:`control_task`). :func:`score_gp` fits the
per-channel GP baseline, :func:`plots` draws the test stays with the most uneven sampling.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnuq_bench.data.physionet import ForecastBatch, PhysioNet2012

__all__ = ["LEVELS", "SELECT_FRACTIONS", "SIGMA_FLOOR", "channel_spearman", "control_task",
           "flat", "gaussian_scores", "grid_entry", "plots", "score_gp", "score_seed",
           "selective_mse"]

LEVELS = (0.5, 0.8, 0.9, 0.95)
#: every method's spread is floored here (scaled units, 0.1 % of a channel's range) before T is
#: fitted: a spread of exactly 0 (one attended value, identical draws) would make T infinite
SIGMA_FLOOR = 1e-3
KEEP_FRACTIONS = (0.1, 0.5, 0.9)
#: selective prediction: the most uncertain fractions of the forecasts withheld
SELECT_FRACTIONS = (0.1, 0.2, 0.5)
#: a channel enters the within-channel Spearman with at least this many forecast points
MIN_CHANNEL_POINTS = 20
#: a channel needs this many distinct input times in [0, 24] h to be a plot candidate
PLOT_MIN_INPUTS = 6


def log(msg: str) -> None:
    print(f"[physionet {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def flat(batches: Sequence[ForecastBatch], per_batch: Sequence[torch.Tensor]) -> torch.Tensor:
    """The forecast points of every batch (``query_mask``), float64 on the CPU, ``(N,)``."""
    return torch.cat([x[b.query_mask.to(x.device)].double().cpu()
                      for b, x in zip(batches, per_batch, strict=True)])


def targets(batches: Sequence[ForecastBatch]) -> torch.Tensor:
    return flat(batches, [b.targets for b in batches])


def channels(batches: Sequence[ForecastBatch]) -> torch.Tensor:
    """The channel of every forecast point, ``(N,)`` int64 (aligned with :func:`targets`)."""
    return flat(batches, [b.query_channels for b in batches]).long()


def selective_mse(sd: torch.Tensor, mu: torch.Tensor, y: torch.Tensor,
                  fractions: Sequence[float] = SELECT_FRACTIONS) -> dict[str, float]:
    """MSE of the retained forecasts when the fraction ``f`` with the largest spread is withheld.

    Points are ordered by ``sd`` (ties: input order, a stable sort); the
    ``n - floor(f n)`` smallest spreads are kept. Keys ``sel_mse{int(100 f)}``.

    >>> import torch
    >>> selective_mse(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.zeros(4),
    ...               torch.tensor([1.0, 1.0, 2.0, 4.0]), (0.25, 0.5))
    {'sel_mse25': 2.0, 'sel_mse50': 1.0}
    """
    order = torch.argsort(sd, stable=True)
    se = ((y - mu) ** 2)[order]
    n = se.numel()
    return {f"sel_mse{round(100 * f)}": float(se[: n - math.floor(f * n)].mean())
            for f in fractions}


def channel_spearman(sd: torch.Tensor, mu: torch.Tensor, y: torch.Tensor, ch: torch.Tensor,
                     n_channels: int) -> tuple[list[float], float]:
    """Spearman(|y - mu|, sd) per channel and their mean weighted by the channel's points.

    A channel with fewer than :data:`MIN_CHANNEL_POINTS` points, or a constant ``sd`` or error,
    gets NaN and no weight. Within one channel the target's scale is fixed, so the within-channel
    value cannot be raised by ranking channels alone.
    """
    from attnuq.metrics import spearman_spread_error as spearman

    per, num, den = [], 0.0, 0
    for c in range(n_channels):
        s = ch == c
        k = int(s.sum())
        if k < MIN_CHANNEL_POINTS or float(sd[s].std()) == 0 or float((y - mu)[s].std()) == 0:
            per.append(math.nan)
            continue
        r = float(spearman(sd[s], mu[s], y[s]))
        per.append(r)
        num, den = num + r * k, den + k
    return per, (num / den if den else math.nan)


def batches(ds: PhysioNet2012, idx: np.ndarray, bs: int, keep: float = 1.0, seed: int = 0
            ) -> list[ForecastBatch]:
    return list(ds.batches(idx, bs, by_length=True, keep_fraction=keep,
                           generator=np.random.default_rng(seed)))


def _dev(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    r = fn()
    return r, time.perf_counter() - t0


@torch.no_grad()
def _levy_pass(model: Any, bs: list[ForecastBatch]) -> dict[str, torch.Tensor]:
    from attnuq.models.levy_forecaster import forward_batch

    model.eval()
    outs = [forward_batch(model, b.to_device(_dev(model))) for b in bs]
    return {k: flat(bs, [getattr(o, k) for o in outs])
            for k in ("mean", "sigma", "sigma_nophi", "evidence", "p_empty", "sigma_total")}


@torch.no_grad()
def _mean_pass(model: torch.nn.Module, bs: list[ForecastBatch]) -> torch.Tensor:
    from attnuq.models.levy_forecaster import forward_batch

    model.eval()
    return flat(bs, [forward_batch(model, b.to_device(_dev(model))).mean for b in bs])


def _mean_fn(model: torch.nn.Module, b: ForecastBatch) -> torch.Tensor:
    from attnuq.models.levy_forecaster import forward_batch

    return forward_batch(model, b.to_device(_dev(model))).mean


def control_task(ctrl: torch.nn.Module, train: list[ForecastBatch], val: list[ForecastBatch],
                 make_model: Callable[[int], torch.nn.Module] | None = None) -> Any:
    """The softmax control as a methods :class:`~attnuq_bench.methods.Task` over ``ForecastBatch``
    inputs (outputs ``(B, Q)``, padded past ``query_mask``). ``make_model(k)``: ensemble member
    ``k`` already trained (the suite's checkpoint cache), so members are not trained here."""
    from attnuq_bench.methods import Task

    pairs = [(b, b.targets) for b in val]
    return Task(model=ctrl, train=[(b, b.targets) for b in train], val=pairs, cal=pairs,
                forward_fn=_mean_fn, make_model=make_model,
                train_fn=None if make_model is None else (lambda *a: None), n_train=1)


def method_pass(method: Any, bs: list[ForecastBatch]) -> dict[str, torch.Tensor]:
    """Mean and spread (std over draws, or the Gaussian's std) of a fitted registered method."""
    preds = [method.predict(b) for b in bs]
    if getattr(preds[0], "samples", None) is not None:  # draws (S, B, Q): mean, std (ddof 1)
        d = torch.stack([flat(bs, [p.samples[s] for p in preds])
                         for s in range(preds[0].samples.shape[0])])
        return {"mean": d.mean(0), "sigma": d.std(0, unbiased=True)}
    return {"mean": flat(bs, [p.mean for p in preds]), "sigma": flat(bs, [p.std for p in preds])}


@torch.no_grad()
def _sampler(model: Any, bs: list[ForecastBatch], draws: int, seed: int
             ) -> dict[str, torch.Tensor]:
    dev = _dev(model)
    g = torch.Generator(device=dev).manual_seed(seed)
    means, sds = [], []
    for b in bs:
        b = b.to_device(dev)
        vals, ne = model.sample(b.obs_times, b.obs_channels, b.obs_values, b.obs_mask,
                                b.query_times, b.query_channels, num_samples=draws, generator=g)
        w = ne.to(vals.dtype)
        n = w.sum(0)
        m = (vals * w).sum(0) / n.clamp_min(1)
        v = (((vals - m) ** 2) * w).sum(0) / (n - 1).clamp_min(1)
        # no non-empty draw: fall back to the bias (the layer's empty-measure output)
        means.append(torch.where(n > 0, m, vals[0]))
        sds.append(torch.where(n > 1, v.sqrt(), torch.zeros_like(v)))
    return {"mean": flat(bs, means), "sigma": flat(bs, sds)}


def gaussian_scores(mu: torch.Tensor, sd: torch.Tensor, y: torch.Tensor,
                    val: tuple[torch.Tensor, ...], ch: torch.Tensor | None = None,
                    n_channels: int = 0) -> dict[str, Any]:
    """Every metric of one Gaussian method; ``val = (mu, sd, y)`` raw (before ``T``).

    With the points' channels ``ch``: ``spearman_within_channel`` (:func:`channel_spearman`);
    always the selective-prediction MSEs ``sel_mse{10,20,50}`` (:func:`selective_mse`).

    ``ccov``/``cwidth``: split conformal normalised by ``T sd``, calibrated on all of ``val``;
    ``fcov``/``fwidth``: the floor ``|y - mu| / sqrt(sd^2 + beta^2)``
    (:func:`attnuq.conformal.fit_floor`), ``beta`` on the first half of the validation points
    (in stay order) and the factor on the second half; ``floor_beta`` (residual-scale units).
    """
    from attnuq.conformal import conformal_scale, fit_floor
    from attnuq.metrics import coverage, crps_normal, interval_width, nll_normal
    from attnuq.metrics import spearman_spread_error as spearman
    from attnuq.models.levy_forecaster import fit_temperature
    from attnuq.predictive import GaussianPredictive

    vmu, vsd, vy = val
    T = fit_temperature(vmu, vsd, vy, floor=SIGMA_FLOOR)
    sd_t = (T * sd.clamp_min(SIGMA_FLOOR)).clamp_min(SIGMA_FLOOR)
    test_pred = GaussianPredictive(mu, sd_t)
    cal_pred = GaussianPredictive(vmu, (T * vsd.clamp_min(SIGMA_FLOOR)).clamp_min(SIGMA_FLOOR))
    err = y - mu
    out: dict[str, Any] = {
        "T": T, "mse": float((err**2).mean()), "mae": float(err.abs().mean()),
        "nll": float(nll_normal(mu, sd_t, y)), "crps": float(crps_normal(mu, sd_t, y)),
        "spearman": float(spearman(sd, mu, y)) if float(sd.std()) > 0 else float("nan"),
        **selective_mse(sd, mu, y),
    }
    if ch is not None:
        out["spearman_within_channel"] = channel_spearman(sd, mu, y, ch, n_channels)[1]
    h = vy.numel() // 2
    for lv in LEVELS:
        lo, hi = test_pred.interval(lv)
        clo, chi = conformal_scale(cal_pred, vy, alpha=1 - lv).interval(test_pred)
        p = int(lv * 100)
        if math.ceil((h + 1) * (1.0 - (1 - lv))) > h:  # too few validation points per half
            out.update({f"fcov{p}": math.nan, f"fwidth{p}": math.nan,
                        f"floor_beta{p}": math.nan})
        else:
            fl = fit_floor((vmu[:h], vsd[:h], vy[:h]), (vmu[h:], vsd[h:], vy[h:]), alpha=1 - lv)
            flo, fhi = fl.interval(mu, sd)
            out.update({f"fcov{p}": float(coverage(flo, fhi, y)),
                        f"fwidth{p}": float(interval_width(flo, fhi)),
                        f"floor_beta{p}": fl.beta_units})
        out.update({f"cov{p}": float(coverage(lo, hi, y)),
                    f"width{p}": float(interval_width(lo, hi)),
                    f"ccov{p}": float(coverage(clo, chi, y)),
                    f"cwidth{p}": float(interval_width(clo, chi))})
    return out


def _binned(mu: torch.Tensor, sd: torch.Tensor, y: torch.Tensor, T: float, bins: torch.Tensor
            ) -> list[dict[str, float]]:
    from attnuq.metrics import crps_normal, nll_normal

    sd_t = (T * sd.clamp_min(SIGMA_FLOOR)).clamp_min(SIGMA_FLOOR)
    rows = []
    for k in range(int(bins.max()) + 1):
        s = bins == k
        rows.append({"n": int(s.sum()), "nll": float(nll_normal(mu[s], sd_t[s], y[s])),
                     "crps": float(crps_normal(mu[s], sd_t[s], y[s])),
                     "mse": float(((y[s] - mu[s]) ** 2).mean()), "sd": float(sd_t[s].mean())})
    return rows


def grid_entry(model: Any, w: float, ctx: dict[str, Any]) -> dict[str, Any]:
    """Validation and test scores of one Levy model of the ``w`` grid, calibrated on validation.

    ``w = 0`` (MSE only; ``alpha`` has no gradient): ``alpha`` and ``T`` fitted jointly on
    validation by Gaussian NLL (:func:`~attnuq.models.levy_forecaster.fit_alpha_temperature`),
    spread ``sigma``; ``w > 0``: ``alpha`` as trained, spread ``sigma_total``, ``T`` in closed
    form on validation. ``val_crps`` (the choice of ``w``) is the CRPS on validation of that
    calibrated Gaussian; the test keys are recorded for the page, never used for the choice.
    The model's ``alpha`` is left as it was.
    """
    from attnuq.models.levy_forecaster import fit_alpha_temperature, fit_temperature

    val_b, test_b, y_val, y_test = (ctx[k] for k in ("val_b", "test_b", "y_val", "y_test"))
    alpha0 = float(model.layer_params()["alpha"].detach())
    v = _levy_pass(model, val_b)
    key = "sigma" if w == 0 else "sigma_total"
    alpha = alpha0
    try:
        if w == 0:
            alpha, _ = fit_alpha_temperature(v["mean"], v["sigma_nophi"] ** 2,
                                             v["evidence"] / alpha0, y_val, floor=SIGMA_FLOOR)
            model.set_alpha(alpha)
            v = _levy_pass(model, val_b)
        t, secs = _timed(lambda: _levy_pass(model, test_b))
    finally:
        model.set_alpha(alpha0)
    T = fit_temperature(v["mean"], v[key], y_val, floor=SIGMA_FLOOR)
    vs = gaussian_scores(v["mean"], v[key], y_val, (v["mean"], v[key], y_val))
    ts = gaussian_scores(t["mean"], t[key], y_test, (v["mean"], v[key], y_val), ctx["ch_test"],
                         ctx["ds"].n_channels)
    return {"w": float(w), "alpha_trained": alpha0, "alpha": alpha, "T": T,
            "temperature_trained": float(model.temperature.detach()),
            "val_crps": vs["crps"], "val_mse": vs["mse"], "val_nll": vs["nll"],
            "stays_per_s": len(ctx["te"]) / secs,
            **{k: ts[k] for k in ("mse", "crps", "nll", "spearman", "spearman_within_channel",
                                  "cov90", "ccov90", "sel_mse10", "sel_mse20", "sel_mse50")}}


def score_seed(levy: Any, ctrl: torch.nn.Module, ctx: dict[str, Any], seed: int, *,
               mc_passes: int, sampler_draws: int, weight: float = 0.0) -> dict[str, Any]:
    """Every per-seed row and analysis of the page for one seed's two trained models.

    ``weight``: the Levy model's loss weight ``w``. ``w = 0``: ``alpha`` and ``T`` fitted
    jointly on validation (two-stage), the spread is ``sigma``; ``w > 0``: ``alpha`` as trained
    (the prior on ``log alpha`` identifies it), the spread is ``sigma_total``.
    Returns ``calibration`` (alpha trained -> used, the validation ``T``),
    ``sigma_evidence_spearman``, ``evidence_edges`` / ``evidence_bins``, ``sparsity``,
    ``channel_spearman`` (row -> per-channel Spearman) and ``metrics`` (row key -> scores).
    Sets ``levy``'s alpha to the value used.
    """
    from scipy.stats import spearmanr

    from attnuq.models.levy_forecaster import fit_alpha_temperature, fit_temperature
    from attnuq.ops.phi import poisson_phi
    from attnuq_bench.methods import make_method

    ds, val_b, test_b, y_val, y_test = (ctx[k] for k in ("ds", "val_b", "test_b", "y_val",
                                                         "y_test"))
    C = ds.n_channels
    ch_test, chs_test = ctx["ch_test"], ctx["chs_test"]
    sub_val_b, sub_test_b = ctx["sub_val_b"], ctx["sub_test_b"]
    ys_val, ys_test = targets(sub_val_b), targets(sub_test_b)
    n_test, n_sub = len(ctx["te"]), len(ctx["sub_te"])
    rec: dict[str, Any] = {}
    lv_val0 = _levy_pass(levy, val_b)
    alpha0 = float(levy.layer_params()["alpha"].detach())
    if weight == 0:
        # second stage: alpha (no gradient from the MSE loss) and T by validation NLL
        alpha, T_joint = fit_alpha_temperature(
            lv_val0["mean"], lv_val0["sigma_nophi"] ** 2, lv_val0["evidence"] / alpha0, y_val,
            floor=SIGMA_FLOOR)
        sk = "sigma"
    else:
        alpha, sk = alpha0, "sigma_total"
        T_joint = fit_temperature(lv_val0["mean"], lv_val0[sk], y_val, floor=SIGMA_FLOOR)
    levy.set_alpha(alpha)
    rec["calibration"] = {"alpha_trained": alpha0, "alpha": alpha, "T": T_joint,
                          "weight": float(weight),
                          "temperature_trained": float(levy.temperature.detach()),
                          "prior_std": levy.prior_std.detach().tolist()}
    log(f"seed {seed}: w {weight:g}, alpha {alpha0:.4g} (trained) -> {alpha:.4g} (used), "
        f"T {T_joint:.4g}")

    def sd_at_alpha0(o: dict[str, torch.Tensor]) -> torch.Tensor:
        return (o["sigma_nophi"] ** 2 * poisson_phi(o["evidence"] * (alpha0 / alpha))).sqrt()

    def gs(mu: torch.Tensor, sd: torch.Tensor, y: torch.Tensor, val: tuple[torch.Tensor, ...],
           ch: torch.Tensor) -> dict[str, Any]:
        return gaussian_scores(mu, sd, y, val, ch, C)

    lv_val = _levy_pass(levy, val_b)
    lv_test, t_levy = _timed(lambda: _levy_pass(levy, test_b))
    c_test, t_ctrl = _timed(lambda: _mean_pass(ctrl, test_b))
    m: dict[str, Any] = {}
    chan: dict[str, list[float]] = {}
    m["levy"] = gs(lv_test["mean"], lv_test[sk], y_test, (lv_val["mean"], lv_val[sk], y_val),
                   ch_test)
    chan["levy"] = channel_spearman(lv_test[sk], lv_test["mean"], y_test, ch_test, C)[0]
    if weight == 0:
        # ablation: alpha as trained (sigma recomputed in closed form from the same pass)
        m["levy_alpha_trained"] = gs(lv_test["mean"], sd_at_alpha0(lv_test), y_test,
                                     (lv_val0["mean"], lv_val0["sigma"], y_val), ch_test)
    else:
        # ablation: the spread conditional on N >= 1 (no prior term)
        m["levy_cond"] = gs(lv_test["mean"], lv_test["sigma"], y_test,
                            (lv_val["mean"], lv_val["sigma"], y_val), ch_test)
    rec["sigma_evidence_spearman"] = {
        k: float(spearmanr(lv_test[s], lv_test["evidence"])[0])
        for k, s in (("levy", sk), ("levy_nophi", "sigma_nophi"))}
    m["levy_nophi"] = gs(lv_test["mean"], lv_test["sigma_nophi"], y_test,
                         (lv_val["mean"], lv_val["sigma_nophi"], y_val), ch_test)
    err_c = y_test - c_test
    m["softmax"] = {"mse": float((err_c**2).mean()), "mae": float(err_c.abs().mean())}
    for k in ("levy", "levy_nophi", "levy_alpha_trained", "levy_cond"):
        if k in m:
            m[k]["stays_per_s"] = n_test / t_levy
    m["softmax"]["stays_per_s"] = n_test / t_ctrl
    log(f"seed {seed}: levy MSE {m['levy']['mse']:.5f} CRPS {m['levy']['crps']:.5f} "
        f"softmax MSE {m['softmax']['mse']:.5f}")
    # the expensive baselines, on the (possibly smaller) evaluation subset
    ls_val, ls_test = _levy_pass(levy, sub_val_b), _levy_pass(levy, sub_test_b)
    m["levy_sub"] = gs(ls_test["mean"], ls_test[sk], ys_test,
                       (ls_val["mean"], ls_val[sk], ys_val), chs_test)
    chan["levy_sub"] = channel_spearman(ls_test[sk], ls_test["mean"], ys_test, chs_test, C)[0]
    mc = make_method("mc-dropout", n_samples=mc_passes, seed=seed)
    mc.fit(control_task(ctrl, sub_val_b, sub_val_b))
    mc_val = method_pass(mc, sub_val_b)
    mc_test, t_mc = _timed(lambda: method_pass(mc, sub_test_b))
    m["softmax_mcdropout"] = gs(mc_test["mean"], mc_test["sigma"], ys_test,
                                (mc_val["mean"], mc_val["sigma"], ys_val), chs_test)
    chan["softmax_mcdropout"] = channel_spearman(mc_test["sigma"], mc_test["mean"], ys_test,
                                                 chs_test, C)[0]
    m["softmax_mcdropout"]["stays_per_s"] = n_sub / t_mc
    log(f"seed {seed}: MC dropout CRPS {m['softmax_mcdropout']['crps']:.5f} "
        f"(levy on subset {m['levy_sub']['crps']:.5f})")
    # explicit sampler vs the closed form of the same layer, at alpha as trained: the draws
    # cost O(Lambda) atoms, so a large fitted alpha is out of reach, and a small one leaves most
    # draws empty (P(N = 0) = exp(-Lambda))
    levy.set_alpha(alpha0)
    sm_val = _sampler(levy, sub_val_b, sampler_draws, seed)
    sm_test, t_sm = _timed(lambda: _sampler(levy, sub_test_b, sampler_draws, seed + 1))
    levy.set_alpha(alpha)
    m["levy_sampler"] = gs(sm_test["mean"], sm_test["sigma"], ys_test,
                           (sm_val["mean"], sm_val["sigma"], ys_val), chs_test)
    m["levy_sampler"]["stays_per_s"] = n_sub / t_sm
    m["levy_sub_alpha_trained"] = gs(ls_test["mean"], sd_at_alpha0(ls_test), ys_test,
                                     (ls_val["mean"], sd_at_alpha0(ls_val), ys_val), chs_test)
    # evidence bins: quintiles of Lambda on the test points (full test; MC dropout on subset)
    lam = lv_test["evidence"]
    edges = torch.quantile(lam, torch.linspace(0, 1, 6, dtype=lam.dtype))
    bins = torch.bucketize(lam, edges[1:-1], right=False)
    sub_bins = torch.bucketize(ls_test["evidence"], edges[1:-1], right=False)
    rec["evidence_edges"] = edges.tolist()
    rec["evidence_bins"] = {
        "levy": _binned(lv_test["mean"], lv_test[sk], y_test, m["levy"]["T"], bins),
        "levy_nophi": _binned(lv_test["mean"], lv_test["sigma_nophi"], y_test,
                              m["levy_nophi"]["T"], bins),
        "softmax_mcdropout_sub": _binned(mc_test["mean"], mc_test["sigma"], ys_test,
                                         m["softmax_mcdropout"]["T"], sub_bins),
        "levy_sub": _binned(ls_test["mean"], ls_test[sk], ys_test, m["levy_sub"]["T"],
                            sub_bins),
    }
    # sparsity sweep: thin observed points of val and test alike, refit T per variant
    rec["sparsity"] = {}
    for keep in KEEP_FRACTIONS:
        vb = batches(ds, ctx["sub_va"], 64, keep, seed=7 + seed)
        tb = batches(ds, ctx["sub_te"], 64, keep, seed=8 + seed)
        lv_v, lv_t = _levy_pass(levy, vb), _levy_pass(levy, tb)
        yv, yt = targets(vb), targets(tb)
        ct = _mean_pass(ctrl, tb)
        s = {v: gaussian_scores(lv_t["mean"], lv_t[k], yt, (lv_v["mean"], lv_v[k], yv))
             for v, k in (("phi", sk), ("nophi", "sigma_nophi"))}
        rec["sparsity"][str(keep)] = {
            "levy_mse": s["phi"]["mse"], "softmax_mse": float(((yt - ct) ** 2).mean()),
            "mean_evidence": float(lv_t["evidence"].mean()),
            **{f"{k}_{v}": s[v][k] for k in ("nll", "crps", "spearman", "cov90")
               for v in ("phi", "nophi")}}
    rec["metrics"] = m
    rec["channel_spearman"] = chan
    log(f"seed {seed} done: sampler CRPS {m['levy_sampler']['crps']:.5f}")
    return rec


def score_ensemble(task: Any, members: int, ctx: dict[str, Any]) -> dict[str, Any]:
    """The registered ``"ensemble"`` of ``members`` softmax controls, scored as a Gaussian."""
    from attnuq_bench.methods import make_method

    ens = make_method("ensemble", n_members=members).fit(task)
    ev = method_pass(ens, ctx["val_b"])
    et, t_e = _timed(lambda: method_pass(ens, ctx["test_b"]))
    C = ctx["ds"].n_channels
    out = gaussian_scores(et["mean"], et["sigma"], ctx["y_test"],
                          (ev["mean"], ev["sigma"], ctx["y_val"]), ctx["ch_test"], C)
    out["channel_spearman"] = channel_spearman(et["sigma"], et["mean"], ctx["y_test"],
                                               ctx["ch_test"], C)[0]
    return {**out, "stays_per_s": len(ctx["te"]) / t_e, "members": members}


def score_gp(ctx: dict[str, Any], train_stays: int, iters: int) -> dict[str, Any]:
    """Per-stay per-channel exact GP: fit per channel on training stays, score on test."""
    from attnuq.metrics import crps_normal, nll_normal
    from attnuq_bench.models.gp_irregular import fit_channel_gps, predict_channel_gps

    ds, tr = ctx["ds"], ctx["tr"]
    log("GP: fitting per-channel hyperparameters")
    gp_tr = np.random.default_rng(0).choice(tr, min(len(tr), train_stays), replace=False)
    series: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    for n in gp_tr:
        t, c, v = ds.stay(int(n))
        for ch in np.unique(c):
            sel = c == ch
            series.setdefault(int(ch), ([], []))
            series[int(ch)][0].append(t[sel])
            series[int(ch)][1].append(v[sel])
    gps, t_fit = _timed(lambda: fit_channel_gps(series, ds.n_channels, iters=iters))

    def gp_pred(bs: list[ForecastBatch]) -> tuple[torch.Tensor, torch.Tensor]:
        out = [predict_channel_gps(gps, b.obs_times, b.obs_channels, b.obs_values, b.obs_mask,
                                   b.query_times, b.query_channels, b.query_mask) for b in bs]
        return flat(bs, [o[0] for o in out]), flat(bs, [o[1] for o in out])

    gv_mu, gv_sd = gp_pred(ctx["val_b"])
    (gt_mu, gt_sd), t_gp = _timed(lambda: gp_pred(ctx["test_b"]))
    y = ctx["y_test"]
    gp = gaussian_scores(gt_mu, gt_sd, y, (gv_mu, gv_sd, ctx["y_val"]), ctx["ch_test"],
                         ds.n_channels)
    gp["channel_spearman"] = channel_spearman(gt_sd, gt_mu, y, ctx["ch_test"],
                                              ds.n_channels)[0]
    gp.update(nll_untempered=float(nll_normal(gt_mu, gt_sd, y)),
              crps_untempered=float(crps_normal(gt_mu, gt_sd, y)),
              stays_per_s=len(ctx["te"]) / t_gp, fit_seconds=t_fit)
    log(f"GP: MSE {gp['mse']:.5f} CRPS {gp['crps']:.5f}")
    return gp


def _plot_choice(ds: PhysioNet2012, te: np.ndarray, n_plots: int) -> list[tuple[int, int, float]]:
    """``(stay, channel, gap ratio)`` of the ``n_plots`` test stays with the most uneven sampling.

    Per stay, the candidate channels have at least ``PLOT_MIN_INPUTS`` distinct input times in
    ``[0, observe]`` h and one target in ``(observe, horizon]`` h; a channel's score is the ratio
    of its longest to its median gap between distinct input times (a stay with both dense and
    sparse stretches scores high); the stay keeps its best channel; stays are ranked by score
    (ties: test order).
    """
    cands: list[tuple[int, int, float]] = []
    for n in te:
        t, c, _ = ds.stay(int(n))
        best: tuple[int, int, float] | None = None
        for ch in np.unique(c):
            sel = c == ch
            ti = np.unique(t[sel & (t <= ds.observe_hours)])
            fut = sel & (t > ds.observe_hours) & (t <= ds.horizon_hours)
            if ti.size < PLOT_MIN_INPUTS or not fut.any():
                continue
            gaps = np.diff(ti)
            r = float(gaps.max() / np.median(gaps))
            if best is None or r > best[2]:
                best = (int(n), int(ch), r)
        if best is not None:
            cands.append(best)
    order = sorted(range(len(cands)), key=lambda k: (-cands[k][2], k))
    return [cands[k] for k in order[:n_plots]]


@torch.no_grad()
def plots(model: Any, ds: PhysioNet2012, te: np.ndarray, out: Path, n_plots: int, T: float,
          sigma_key: str = "sigma") -> tuple[list[str], list[dict[str, Any]]]:
    """One PNG per chosen test stay (forecast band, observations; evidence and half-width)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from scipy.stats import spearmanr

    from attnuq._io import atomic_savefig

    dev = _dev(model)
    files, info = [], []
    z90 = 1.6448536269514722
    for n, ch, ratio in _plot_choice(ds, te, n_plots):
        t, c, v = ds.stay(n)
        b = ds.batch([n]).to_device(dev)
        grid = torch.linspace(0.0, ds.horizon_hours, 385, dtype=torch.float32, device=dev)[None]
        o = model(b.obs_times, b.obs_channels, b.obs_values, b.obs_mask, grid,
                  torch.full_like(grid, ch, dtype=torch.long))
        mu, sd = o.mean[0].cpu().numpy(), (T * getattr(o, sigma_key)[0]).cpu().numpy()
        lam, g = o.evidence[0].cpu().numpy(), grid[0].cpu().numpy()
        fig, (ax, ax_l) = plt.subplots(2, 1, figsize=(8, 5.6), sharex=True,
                                       gridspec_kw={"height_ratios": [2, 1]})
        ax.fill_between(g, mu - z90 * sd, mu + z90 * sd, alpha=0.3, label="90% band (T sigma)")
        ax.plot(g, mu, label="forecast mean")
        sel = c == ch
        obs, fut = sel & (t <= ds.observe_hours), sel & (t > ds.observe_hours)
        ax.scatter(t[obs], v[obs], s=12, c="k", label="observed (input)")
        ax.scatter(t[fut], v[fut], s=12, c="r", marker="x", label="target")
        ax.set_title(f"stay {ds.record_ids[n]}: {ds.channels[ch]} (longest / median input gap "
                     f"{ratio:.1f})")
        ax.set_ylabel("scaled value")
        ax.legend(fontsize=7, loc="upper left")
        ax_l.plot(g, lam, color="g", label="evidence Lambda")
        ax_l.set_ylabel("Lambda", color="g")
        ax_l.set_xlabel("hours")
        ax_s = ax_l.twinx()
        ax_s.plot(g, z90 * sd, color="C0", ls="--", label="band half-width")
        ax_s.set_ylabel("90% half-width", color="C0")
        for a_ in (ax, ax_l):
            a_.axvline(ds.observe_hours, color="grey", ls="--")
        fig.tight_layout()
        f = out / f"stay_{ds.record_ids[n]}.png"
        atomic_savefig(fig, f, dpi=90)
        plt.close(fig)
        files.append(f.name)
        w = g <= ds.observe_hours
        # local density of this channel's inputs: count within +-2 h of each grid time
        dens = (np.abs(t[obs][None, :] - g[w][:, None]) <= 2.0).sum(1)
        info.append({
            "spearman_lambda_density": float(spearmanr(lam[w], dens)[0]),
            "file": f.name, "record_id": int(ds.record_ids[n]), "channel": ds.channels[ch],
            "gap_ratio": ratio,
            "spearman_sd_lambda_observed": float(spearmanr(sd[w], lam[w])[0]),
            "spearman_sd_lambda_forecast": float(spearmanr(sd[~w], lam[~w])[0]),
            "halfwidth_min": float(z90 * sd.min()), "halfwidth_max": float(z90 * sd.max()),
            "lambda_min": float(lam.min()), "lambda_max": float(lam.max()),
        })
    return files, info
