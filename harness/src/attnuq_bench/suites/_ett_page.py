"""The page of ``attnuq bench ett`` (:mod:`attnuq_bench.suites.ett`): table, headlines, fan chart.

:func:`render_page` builds ``ett.md`` and its JSON twin from the stored ``ett_results.json``
alone (no training, no writes); :func:`summary` gives the ``ett`` key of
``docs/results/summary.json``; :func:`score_chunks` scores predictions over chunks of test
windows (:class:`~attnuq_bench.suites._scoring.StreamScores`) and collects the fan-chart quantiles
of chosen windows (:func:`fan_rows`), which :func:`fan_plot` draws (``ett/ett_fan_ot.png``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnuq._io import atomic_savefig, read_json_or_none
from attnuq.predictive import GaussianPredictive, Predictive
from attnuq_bench.suites._ablation import ablation_block
from attnuq_bench.suites._members import cache_text, jobs_text
from attnuq_bench.suites._options import split_methods
from attnuq_bench.suites._page import Page, Table, fmt
from attnuq_bench.suites._sa_evidence import add_section
from attnuq_bench.suites._scoring import StreamScores, to_cpu

__all__ = ["ALL_METHODS", "DEFAULT_METHODS", "IMPLEMENTATIONS", "chunks", "fan_plot", "fan_rows",
           "parse_methods", "render_page", "score_chunks", "scored", "summary"]

#: every method the suite knows (``--methods`` may name any), in table order
ALL_METHODS: tuple[str, ...] = ("sa-paper", "sa-crps", "sa-conformal", "mc-dropout", "ensemble",
                                "swag", "conformal", "seasonal-naive", "sa", "sa-debiased",
                                "sa-recentred", "sa-floor", "sa-layer", "sa-centre")
#: the methods a run scores when ``--methods`` is not given: every one (issue #19)
DEFAULT_METHODS: tuple[str, ...] = ALL_METHODS
_COLS = ("mse", "mae", "coverage", "width", "pit_w1", "crps", "mean_std")
_TITLE = "ETTh1: stochastic attention on a frozen PatchTST vs baselines"
#: published PatchTST/42 test MSE on ETTh1 at horizon 96 (Nie et al. 2023, table 3)
_REFERENCE = (0.375, "PatchTST/42 (Nie et al. 2023), ETTh1 horizon 96")
#: rows this suite computes itself (the others are registered methods: the registry's text)
IMPLEMENTATIONS: dict[str, str] = {
    "seasonal-naive": "this suite: the last 24 h repeated "
                      "(attnuq_bench.data.ett.seasonal_naive) plus "
                      "val residual quantiles per (horizon step, channel)",
}

AnyPred = Predictive | GaussianPredictive


def parse_methods(spec: str | Sequence[str]) -> list[str]:
    """The rows named in ``--methods``/``--rerun`` (the shared syntax,
    :func:`attnuq_bench.suites._options.split_methods`; ``ValueError`` naming unknown ones)."""
    ms = split_methods(spec)
    bad = [m for m in ms if m not in ALL_METHODS]
    if bad or not ms:
        raise ValueError(f"unknown methods {bad} in --methods={spec!r}; known: {list(ALL_METHODS)}")
    return ms


def chunks(n: int, size: int) -> list[slice]:
    """Slices of ``size`` rows covering ``range(n)``."""
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def fan_rows(pred: AnyPred, rows: torch.Tensor, ch: int) -> dict[str, list[list[float]]]:
    """Quantiles of channel ``ch`` for the chosen rows of a chunk, for the fan chart."""
    from attnuq.estimators._regressor import SAPredictive

    if isinstance(pred, SAPredictive):
        one = pred.select(rows).select((Ellipsis, ch))
        return {name: one.quantile(q).tolist() for name, q in (
            ("q025", 0.025), ("q25", 0.25), ("q50", 0.5), ("q75", 0.75), ("q975", 0.975))}
    if isinstance(pred, GaussianPredictive):
        sub: AnyPred = GaussianPredictive(mean=pred.mean[rows][..., ch],
                                          std=pred.std[rows][..., ch])
    else:
        sub = Predictive(samples=pred.samples[:, rows][..., ch])
    return {name: sub.quantile(q).tolist() for name, q in (
        ("q025", 0.025), ("q25", 0.25), ("q50", 0.5), ("q75", 0.75), ("q975", 0.975))}


def score_chunks(predict_fn: Callable[[torch.Tensor], dict[str, AnyPred]], x: torch.Tensor,
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
    for sl in tqdm(chunks(x.shape[0], chunk), desc=desc, disable=not progress):
        with torch.no_grad():
            xs = x[sl] if device is None else x[sl].to(device)
            preds = {k: to_cpu(v) for k, v in predict_fn(xs).items()}
        rows = [i - sl.start for i in fan_idx if sl.start <= i < sl.stop]
        for name, pred in preds.items():
            scores.setdefault(name, StreamScores(seed=seed)).update(pred, y[sl])
            fan = fans.setdefault(name, {})
            if rows:
                for k, v in fan_rows(pred, torch.tensor(rows), fan_channel).items():
                    fan.setdefault(k, []).extend(v)
    return {k: v.result() for k, v in scores.items()}, fans, time.perf_counter() - t0


def fan_plot(path: Path, fans: dict[str, Any], xte: torch.Tensor, yte: torch.Tensor,
             fan_idx: Sequence[int], ot: int, data: Any) -> None:
    """Fan chart of channel ``ot`` per method (stored quantiles ``fans[method]``) over the test
    windows ``fan_idx``, with the last 72 h of context and the truth, written to ``path``."""
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
    for k, v in scored(res).items():
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


def scored(res: dict[str, Any]) -> dict[str, Any]:
    """The table's rows: the scored methods, in table order."""
    return {k: res[k] for k in ALL_METHODS if k in res and "crps" in res[k]}


def render_page(out: Path, table: Path) -> Page:
    """The page ``table`` (``ett.md``) built from the stored ``<out>/ett_results.json`` alone.

    Examples
    --------
    The committed page of the checkout is what this makes of the committed JSON:

    >>> from pathlib import Path
    >>> docs = Path(__file__).resolve().parents[4] / "docs" / "results"
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
        + (f"with {c['optimizer']} (lr {c['lr']}, {c['schedule']} schedule, batch size "
           f"{c['batch_size']}, epoch cap {c['epochs']}, patience {c['patience']}) "
           if "optimizer" in c else "")
        + f"({tr.get('epochs_run')} epochs, best epoch {tr.get('best_epoch')}, best val MSE "
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
    rows = scored(res)
    for name, v in rows.items():
        t.add(name, *[fmt(v.get(k)) for k in (*_COLS, *extra)],
              values={k: v.get(k) for k in (*_COLS, *extra)})
    page.table(t)
    if rows:
        best_crps = min(rows, key=lambda k: rows[k]["crps"])
        best_w1 = min(rows, key=lambda k: rows[k]["pit_w1"])
        closest = min(rows, key=lambda k: abs(rows[k]["coverage"] - 0.95))
        page.add("")
        page.headline(f"Best CRPS: **{best_crps}**; lowest W1(PIT, U): **{best_w1}**; coverage "
                      f"closest to 95 %: **{closest}**.")
        for sa in ("sa-paper", "sa-crps", "sa-conformal", "sa", "sa-debiased", "sa-recentred",
                   "sa-floor", "sa-layer", "sa-centre"):
            if sa in rows:
                beaten = [k for k in rows if k != sa and rows[k]["crps"] < rows[sa]["crps"]]
                page.add(f"* {sa} CRPS is beaten by: {', '.join(beaten) or 'none'}.")
        ablation_block(page, {k: {"point": v["mse"], "crps": v["crps"], "coverage": v["coverage"],
                                  "w1": v["pit_w1"]} for k, v in rows.items()},
                       point="MSE", frozen=res.get("frozen", {}).get("mse"),
                       metrics=("point", "crps", "coverage", "w1"), digits=4,
                       heading="Ablations: SA variants against their reference rows",
                       nu={k: v.get("nu_map", v.get("nu")) for k, v in rows.items()},
                       floor=dict(rows))
        fz = res.get("frozen", {}).get("mse")
        if "sa" in rows and fz:  # issue #20's ETTh1 goal, read off the sa row
            cov, mse = rows["sa"]["coverage"], rows["sa"]["mse"]
            ok = cov >= 0.85 and abs(mse / fz - 1) <= 0.01
            page.add("", "Issue #20's ETTh1 goal, `sa` native 95 % coverage at least 0.85 with "
                     f"MSE within 1 % of the frozen model's: coverage {fmt(cov, 3)}, MSE "
                     f"{fmt(mse)} ({100 * (mse / fz - 1):+.2f} % against {fmt(fz)}): "
                     f"{'met' if ok else 'not met'}.")
        page.add("")
        add_section(page, Path(out).parent, "ett")  # issue #34: what the evidence tells a user
        page.implementations(p["implementations"], trailing_blank=False)
    notes = c.get("note") or []
    if notes:
        page.add("", "Notes:", *[f"* {n}" for n in notes])
    page.add("", "Fan chart of OT: `ett/ett_fan_ot.png`; raw numbers: `ett/ett_results.json`.",
             "", "![fan chart](ett/ett_fan_ot.png)")
    return page
