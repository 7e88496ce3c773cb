"""The page of ``attnuq bench uci`` (:mod:`attnuq_bench.suites.uci`): tables, SA verdicts, summary
key.

:func:`build_page` turns the stored run records into the :class:`~attnuq_bench.suites._page.Page`
(header on the runs and budgets, what the runs cover, one table per data set with mean ± std
over splits, the SA-vs-baselines lines, the Implementations block the runs recorded);
:func:`summary` gives the ``uci`` key of ``docs/results/summary.json``. Pure functions of the
records (no training, no writes), so the page renders again from the stored JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attnuq_bench.suites._ablation import ablation_block, is_sa, point_flag
from attnuq_bench.suites._page import Page, Table, error_lines, fmt, gap_lines, runs_lines
from attnuq_bench.suites._sa_evidence import add_section
from attnuq_bench.suites._scoring import mean_std

__all__ = ["GOALS_20", "REFERENCE_RMSE", "build_page", "goal_lines", "summary"]

#: methods whose point prediction is not the frozen backbone's output
_OWN_POINT = ("ensemble", "swag", "multiswag", "ivon", "hsa")
#: methods whose point prediction is the frozen backbone's output
_FROZEN = ("gaussian", "laplace", "conformal", "mc-dropout")


#: a stochastic-attention row: ``sa`` (the recommended configuration) or ``sa-*``
_is_sa = is_sa

#: backbone RMSE of the MC-dropout paper (Gal & Ghahramani 2016), per set folder name
REFERENCE_RMSE = {"bostonHousing": 2.97, "concrete": 5.23, "energy": 1.66,
                  "naval-propulsion-plant": 0.01, "power-plant": 4.02,
                  "protein-tertiary-structure": 4.36}
_AUTO_TEXT = ("batch size auto: 32 when the fit part has <= 2,000 rows, 128 when <= 20,000, "
              "else 256 (the resolved number is in each data set's budget)")

def _order(methods: Any, order: Sequence[str]) -> list[str]:
    rank = {m: i for i, m in enumerate(order)}
    return sorted(methods, key=lambda m: (rank.get(m, len(rank)), m))


def _of(rows: list[dict[str, Any]], ds: str, m: str | None = None) -> list[dict[str, Any]]:
    return [r for r in rows if r["dataset"] == ds and (m is None or r["method"] == m)]


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
_TITLE = "UCI regression: FT-Transformer, SA against the baselines"
_TEXT = (
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
)


def _stats(rows: list[dict[str, Any]], ds: str, order: Sequence[str]
           ) -> dict[str, dict[str, tuple[float, float]]]:
    """method -> metric -> (mean, std) over the splits of ``ds`` (plus fit_s, fwd, n)."""
    stats: dict[str, dict[str, tuple[float, float]]] = {}
    for m in _order({r["method"] for r in _of(rows, ds)}, order):
        rr = _of(rows, ds, m)
        stats[m] = {k: mean_std([r["metrics"][k] for r in rr]) for k, _, _ in _COLS}
        stats[m]["fit_s"] = mean_std([r["cost"]["fit_seconds"] for r in rr])
        stats[m]["fwd"] = mean_std([r["cost"]["predict_forward_per_input"] for r in rr])
        stats[m]["n"] = (float(len(rr)), 0.0)
    return stats


def _splits_of(rows: list[dict[str, Any]], ds: str) -> dict[str, set[int]]:
    """Method -> the splits of ``ds`` it ran on."""
    by_m: dict[str, set[int]] = {}
    for rec in _of(rows, ds):
        by_m.setdefault(rec["method"], set()).add(int(rec["split"]))
    return by_m


def _one_thread_backbone_seconds(rows: list[dict[str, Any]]) -> dict[int, float]:
    """Split -> its backbone's training seconds, from the records trained on one thread.

    A record naming another thread count (``backbone.threads``, written since the records
    hold it) is left out: its seconds are wall time on that many threads, not core-seconds.
    Records without the field come from this suite's one-thread runs.

    >>> r = lambda s, sec, **kw: {"split": s, "backbone": {"seconds": sec, **kw}}
    >>> _one_thread_backbone_seconds([r(0, 3000.0), r(1, 1800.0, threads=2),
    ...                               r(2, 3600.0, threads=1)])
    {0: 3000.0, 2: 3600.0}
    """
    return {int(rec["split"]): float(b) for rec in rows
            if (b := _one_thread_seconds(rec)) is not None}


def _one_thread_seconds(rec: dict[str, Any]) -> float | None:
    """The backbone training seconds of record ``rec`` if it trained on one thread (a record
    without ``backbone.threads`` did), else ``None``."""
    bb = rec.get("backbone") or {}
    sec = bb.get("seconds")
    return float(sec) if sec and int(bb.get("threads", 1)) == 1 else None


def _partial(rows: list[dict[str, Any]], ds: str) -> tuple[dict[str, int], list[int]]:
    """The methods of ``ds`` run on fewer splits than the set has (method -> its number of
    splits) and the splits every method of ``ds`` ran on, in order.

    A mean over other splits is not comparable with the set's full-split means, so the page
    compares the full-split rows alone, and the ablation table on the shared splits.

    >>> r = lambda s, m: {"dataset": "a", "split": s, "method": m}
    >>> _partial([r(0, "sa"), r(1, "sa"), r(1, "sa-paper")], "a")
    ({'sa-paper': 1}, [1])
    """
    by_m = _splits_of(rows, ds)
    all_sp = set().union(*by_m.values()) if by_m else set()
    shared = set.intersection(*by_m.values()) if by_m else set()
    return {m: len(sp) for m, sp in by_m.items() if sp != all_sp}, sorted(shared)


def _best(d: dict[str, float]) -> str | None:
    return min(d, key=d.__getitem__) if d else None


#: the columns in target units, whose decimals follow the set's scale (:func:`target_digits`)
_TARGET_COLS = frozenset({"rmse", "width", "crps"})


def target_digits(stats: dict[str, dict[str, tuple[float, float]]]) -> int:
    """Decimals for a set's target-unit numbers: three significant digits of its smallest
    mean RMSE, at least 3 (naval's RMSE ~0.0018 -> 5; power's ~3.85 -> 3).

    >>> target_digits({"a": {"rmse": (0.00178, 0.0)}}), target_digits({"a": {"rmse": (3.85, 0.1)}})
    (5, 3)
    """
    vals = [st["rmse"][0] for st in stats.values()
            if "rmse" in st and math.isfinite(st["rmse"][0]) and st["rmse"][0] > 0]
    if not vals:
        return 3
    return max(3, 2 - math.floor(math.log10(min(vals))))


def _verdict(ds: str, stats: dict[str, dict[str, tuple[float, float]]]) -> tuple[list[str],
                                                                                   bool | None]:
    """The SA win/loss lines of ``ds`` and whether SA wins (``None``: nothing to compare)."""
    ms = list(stats)
    d = target_digits(stats)
    widths = {m: stats[m]["width"][0] for m in ms if math.isfinite(stats[m]["width"][0])}
    crpss = {m: stats[m]["crps"][0] for m in ms if math.isfinite(stats[m]["crps"][0])}
    sa = {m: w for m, w in widths.items() if _is_sa(m)}
    other = {m: w for m, w in widths.items() if not _is_sa(m)}
    if not (sa and other):
        return [], None
    bs, bo = _best(sa), _best(other)
    assert bs is not None and bo is not None
    ratio = other[bo] / sa[bs]
    win = sa[bs] <= other[bo]
    if win:
        verdict = (f"**SA wins** on calibrated PI-95 width: {bs} {sa[bs]:.{d}f} vs the "
                   f"best baseline {bo} {other[bo]:.{d}f} (baseline {ratio:.2f}x wider)")
    else:
        verdict = (f"**SA loses** on calibrated PI-95 width: best baseline {bo} "
                   f"{other[bo]:.{d}f} vs best SA {bs} {sa[bs]:.{d}f} (SA {1 / ratio:.2f}x wider)")
    sa_c = {m: c for m, c in crpss.items() if _is_sa(m)}
    ot_c = {m: c for m, c in crpss.items() if not _is_sa(m)}
    if sa_c and ot_c:
        bsc, boc = _best(sa_c), _best(ot_c)
        assert bsc is not None and boc is not None
        word = "wins" if sa_c[bsc] <= ot_c[boc] else "loses"
        verdict += f"; on CRPS SA {word}: {bsc} {sa_c[bsc]:.{d}f} vs {boc} {ot_c[boc]:.{d}f}"
    wider = sorted(f"{m} {w / sa[bs]:.2f}x" for m, w in other.items())
    lines = [f"* {ds}: {verdict}.",
             f"* width of each baseline relative to the best SA: {', '.join(wider)}."]
    frozen_m = next((m for m in ("gaussian", "laplace", "conformal", "mc-dropout", bs)
                     if m in stats), None)
    if frozen_m is not None:
        own = [f"{m} {stats[m]['rmse'][0]:.{d}f}" for m in ms
               if m in _OWN_POINT and math.isfinite(stats[m]["rmse"][0])]
        if own:
            lines.append(f"* point predictions differ from the shared frozen backbone (RMSE "
                         f"{stats[frozen_m]['rmse'][0]:.{d}f}) for {', '.join(own)}; interval "
                         "widths after unified calibration also reflect these RMSE differences.")
    if frozen_m is not None and frozen_m in _FROZEN:  # issue #19: SA's point off the frozen one
        flag = point_flag({m: stats[m]["rmse"][0] for m in ms}, stats[frozen_m]["rmse"][0],
                          metric="RMSE", digits=d)
        if flag is not None:
            lines.append(flag)
    return [*lines, ""], win


#: issue #20's UCI goals: (what, how many sets at least, of how many)
GOALS_20 = (("narrowest calibrated PI-95", 5, 6), ("best CRPS", 4, 6),
            ("raw 95 % coverage of the default criterion within 5 points", 4, 6))


def goal_lines(per_ds: dict[str, dict[str, dict[str, tuple[float, float]]]]) -> list[str]:
    """Issue #20's UCI goals, counted over the data sets of ``per_ds`` (set -> :func:`_stats`).

    For the recommended row ``sa`` alone (no other SA variant is picked after the fact): the
    sets where its mean calibrated PI-95 width, and its mean CRPS, is at most every baseline's
    (the rows that are not SA); and the sets where the raw (native) 95 % coverage of
    ``sa-debiased`` -- the default ``"auto"`` criterion resolves to ``"paper-debiased"`` on a
    scalar target -- lies within 0.05 of 0.95. A set without the rows a goal needs is not
    counted for it. Each line says met or not met against :data:`GOALS_20`.
    """
    counts: list[tuple[list[str], int]] = [([], 0), ([], 0), ([], 0)]
    for ds, st in per_ds.items():
        base = [m for m in st if not _is_sa(m)]
        if "sa" in st and base:
            for i, key in ((0, "width"), (1, "crps")):
                vals = [st[m][key][0] for m in base if math.isfinite(st[m][key][0])]
                if vals and math.isfinite(st["sa"][key][0]):
                    won, n = counts[i]
                    counts[i] = ([*won, ds] if st["sa"][key][0] <= min(vals) else won, n + 1)
        if "sa-debiased" in st and math.isfinite(c := st["sa-debiased"]["coverage_native"][0]):
            won, n = counts[2]
            counts[2] = ([*won, ds] if abs(c - 0.95) <= 0.05 else won, n + 1)
    lines = []
    for k, ((what, need, of), (won, n)) in enumerate(zip(GOALS_20, counts, strict=True)):
        if n == 0:
            continue
        state = "met" if len(won) >= need else (
            "not met" if len(won) + (of - n) < need else f"open ({of - n} set(s) not yet run)")
        row = "`sa`" if k < 2 else "`sa-debiased` (the default criterion's row)"
        lines.append(f"* issue #20 goal, {row}: {what} on at least {need} of {of} sets: "
                     f"{len(won)} of the {n} run ({', '.join(won) or 'none'}): {state}.")
    return lines


def backbone_lines(rows: list[dict[str, Any]], ds: str, order: Sequence[str] = ()
                   ) -> list[str]:
    """Which rows of ``ds`` were scored on the same trained backbone: a backbone is named by
    its cache key and its best validation RMSE (two trainings under one cache key, e.g. by
    training loops of different versions, differ in the second). Nothing when every row shares
    one per split; otherwise one line per group, so that rows are compared within a group.

    Examples
    --------
    >>> def rec(m, k, v):
    ...     return {"dataset": "d", "split": k, "method": m,
    ...             "backbone": {"cache_key": "c", "best_val_rmse_std_units": v}}
    >>> backbone_lines([rec("sa", 0, 0.2), rec("gaussian", 0, 0.2)], "d")
    []
    >>> for line in backbone_lines([rec("sa", 0, 0.2), rec("sa-paper", 0, 0.3)], "d"):
    ...     print(line)
    * backbones: 2 trainings of one recipe (one cache key, other weights); compare within a group:
      * sa: split 0 val RMSE 0.2000
      * sa-paper: split 0 val RMSE 0.3000
    """
    def ident(r: dict[str, Any]) -> tuple[Any, Any]:
        b = r.get("backbone") or {}
        return b.get("cache_key"), b.get("best_val_rmse_std_units")

    groups: dict[tuple[Any, ...], list[str]] = {}
    for m in _order({r["method"] for r in _of(rows, ds)}, order):
        recs = sorted(_of(rows, ds, m), key=lambda r: int(r["split"]))
        key = tuple((int(r["split"]), *ident(r)) for r in recs)
        groups.setdefault(key, []).append(m)
    splits: dict[int, set[tuple[Any, Any]]] = {}
    for key in groups:
        for k, *idn in key:
            splits.setdefault(k, set()).add(tuple(idn))
    if all(len(v) <= 1 for v in splits.values()):
        return []
    n = max(len(v) for v in splits.values())
    lines = [f"* backbones: {n} trainings of one recipe (one cache key, other weights); compare "
             "within a group:"]
    for key, ms in groups.items():
        val = ", ".join(f"split {k} val RMSE {v:.4f}" if isinstance(v, (int, float))
                        else f"split {k} val RMSE n/a" for k, _, v in key)
        lines.append(f"  * {', '.join(ms)}: {val}")
    return lines


def _frozen_rmse(stats: dict[str, dict[str, tuple[float, float]]]) -> float | None:
    """The shared frozen backbone's mean RMSE (a row whose point is the backbone's), if any."""
    m = next((m for m in _FROZEN if m in stats), None)
    return None if m is None else stats[m]["rmse"][0]


def _nu_of(rows: list[dict[str, Any]], ds: str) -> dict[str, dict[str, Any]]:
    """Per SA row of ``ds``: split label -> its calibrated ``nu`` (the per-site map if any)."""
    out: dict[str, dict[str, Any]] = {}
    for r in sorted(_of(rows, ds), key=lambda r: int(r["split"])):
        i = r.get("info") or {}
        if is_sa(r["method"]) and (i.get("nu_map") or i.get("nu")) is not None:
            out.setdefault(r["method"], {})[f"split {r['split']}"] = i.get("nu_map") or i["nu"]
    return out


def _floor_of(rows: list[dict[str, Any]], ds: str) -> dict[str, list[dict[str, Any]]]:
    """Per SA row of ``ds``: the ``info`` of its splits, in split order (the floor's beta)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(_of(rows, ds), key=lambda r: int(r["split"])):
        if is_sa(r["method"]) and isinstance(r.get("info"), dict):
            out.setdefault(r["method"], []).append(r["info"])
    return out


def _ablation_rows(stats: dict[str, dict[str, tuple[float, float]]]
                   ) -> dict[str, dict[str, float]]:
    """The rows of the ablation table (:mod:`attnuq_bench.suites._ablation`): means over splits."""
    keys = (("point", "rmse"), ("crps", "crps"), ("coverage", "coverage_native"),
            ("width", "width"), ("w1", "w1_native"))
    return {m: {k: st[src][0] for k, src in keys} for m, st in stats.items()}


def _budget_lines(rows: list[dict[str, Any]], budget: dict[str, Any]) -> list[str]:
    """The header lines on the runs: commands, dates, machines, budgets, a low-budget note."""
    def of(r: dict[str, Any]) -> Any:
        return (r.get("config") or {}).get("budget")

    lines = runs_lines(rows, of)
    run_b = [b for b in (json.loads(x) for x in sorted({json.dumps(of(r)) for r in rows}))
             if b is not None] or [budget]
    low = [b for b in run_b if b["n_blocks"] != 3 or b["max_epochs"] < 100 or b["patience"] < 16]
    if low:
        desc = "; ".join(f"{b['n_blocks']} block(s), at most {b['max_epochs']} epochs, patience "
                         f"{b['patience']}, batch {b['batch_size']}" for b in low)
        lines.append(
            f"* NOTE: the backbone budget is below the default recipe (rtdl default config "
            f"for {desc}; default: 3 blocks, 100 epochs, patience 16) to fit the CPU time "
            f"of this session. Within a data set every method gets the same budget; the budget "
            f"of each data set is listed under 'What this covers'."
        )
    return [*lines, ""]


#: the methods that train models of their own (everything else reads the shared backbone)
RETRAINING = ("ensemble", "multiswag", "ivon", "hsa")


def retraining_cost_lines(rows: list[dict[str, Any]], datasets: Sequence[str], *,
                          n_splits: int = 5) -> list[str]:
    """What the retraining methods cost, measured where they ran, and what they would need on
    the sets where they did not.

    Per method, the pooled ratio ``sum(fit seconds) / sum(backbone seconds)`` over every
    (set, split) that ran it (both from the same record: ``cost.fit_seconds`` and
    ``backbone.seconds``, the shared backbone's training time) is its cost in backbone
    trainings. A set without any of them gets ``sum of ratios x mean backbone seconds of the
    set x n_splits`` core-seconds (1 thread, as the runs here).

    >>> r = lambda ds, m, fit, bb: {"dataset": ds, "split": 0, "method": m,
    ...     "cost": {"fit_seconds": fit}, "backbone": {"seconds": bb}}
    >>> rows = [r("a", "ensemble", 500, 100), r("a", "ivon", 300, 100), r("b", "sa", 9, 3600)]
    >>> print("\\n".join(retraining_cost_lines(rows, ["a", "b"])))  # doctest: +NORMALIZE_WHITESPACE
    * Not run on b: ensemble, ivon, which train models of their own (measured where they ran,
      as fit seconds over the same split's backbone seconds: ensemble 5.0, ivon 3.0 backbone
      trainings per split, 8.0 in all). b's backbone trained in 3600 s on average (1 split(s),
      1 thread): they would need about 8.0 x 3600 s x 5 splits = 40.0 core-hours.
    """
    ratio: dict[str, float] = {}
    for m in RETRAINING:
        fit = bb = 0.0
        for rec in rows:
            b = _one_thread_seconds(rec)
            f = (rec.get("cost") or {}).get("fit_seconds")
            if rec["method"] == m and b and f is not None:
                fit, bb = fit + float(f), bb + float(b)
        if bb > 0:
            ratio[m] = fit / bb
    if not ratio:
        return []
    total = sum(ratio.values())
    lines = []
    for ds in datasets:
        rr = _of(rows, ds)
        if any(rec["method"] in RETRAINING for rec in rr):
            continue
        per_split = _one_thread_backbone_seconds(rr)
        if not per_split:
            continue
        sec = sum(per_split.values()) / len(per_split)
        each = ", ".join(f"{m} {v:.1f}" for m, v in ratio.items())
        lines.append(
            f"* Not run on {ds}: {', '.join(ratio)}, which train models of their own "
            f"(measured where they ran, as fit seconds over the same split's backbone "
            f"seconds: {each} backbone trainings per split, {total:.1f} in all). {ds}'s "
            f"backbone trained in {sec:.0f} s on average ({len(per_split)} split(s), 1 "
            f"thread): they would need about "
            f"{total:.1f} x {sec:.0f} s x {n_splits} splits = "
            f"{total * sec * n_splits / 3600:.1f} core-hours.")
    return lines


def missing_rows_cost_lines(rows: list[dict[str, Any]], datasets: Sequence[str]) -> list[str]:
    """What the rows that read the shared backbone but lack a split of their set would cost,
    measured on that set.

    The expected rows of a set are every method outside :data:`RETRAINING` that ran on any set,
    on every split the set has. A missing (method, split) row costs the method's mean
    ``wall_seconds`` over the splits of the set that ran it (not timed when none did); a
    split that lacks any row also needs its backbone trained again when it is no longer
    cached (the set's mean ``backbone.seconds`` per split). :data:`RETRAINING` methods are
    left to :func:`retraining_cost_lines`.

    >>> r = lambda ds, s, m, w: {"dataset": ds, "split": s, "method": m, "wall_seconds": w,
    ...     "backbone": {"seconds": 3000.0}}
    >>> rows = [r("a", 0, "sa", 1200), r("a", 1, "sa", 1300), r("a", 1, "sa-paper", 600),
    ...         r("b", 0, "sa-scale", 60)]
    >>> print("\\n".join(missing_rows_cost_lines(rows, ["a"])))  # doctest: +NORMALIZE_WHITESPACE
    * Missing on a: 3 row(s) that read the backbone (sa-paper: split(s) [0]; sa-scale: split(s)
      [0, 1]). Measured on this set (1 thread): the rows 600 s (0.2 core-hours: sa-paper 600 s
      a row; sa-scale not timed on this set), plus, where the backbone of split(s) [0, 1] is no
      longer cached, 2 x 3000 s = 1.7 core-hours to train again.
    """
    expected = sorted({rec["method"] for rec in rows if rec["method"] not in RETRAINING})
    lines = []
    for ds in datasets:
        rr = _of(rows, ds)
        ran = _splits_of(rows, ds)
        all_sp = set().union(*ran.values()) if ran else set()
        have = {m: ran.get(m, set()) for m in expected}
        gaps = {m: sorted(all_sp - got) for m, got in have.items() if got != all_sp}
        if not gaps:
            continue
        each: dict[str, float | None] = {}
        for m in gaps:
            w = [float(rec["wall_seconds"]) for rec in _of(rows, ds, m)
                 if rec.get("wall_seconds") is not None]
            each[m] = sum(w) / len(w) if w else None
        row_s = sum((each[m] or 0.0) * len(sp) for m, sp in gaps.items())
        splits = sorted(set().union(*map(set, gaps.values())))
        per_split = _one_thread_backbone_seconds(rr)
        again = ""
        if per_split:
            bb = sum(per_split.values()) / len(per_split)
            again = (f", plus, where the backbone of split(s) {splits} is no longer cached, "
                     f"{len(splits)} x {bb:.0f} s = {len(splits) * bb / 3600:.1f} core-hours "
                     "to train again")
        n_rows = sum(map(len, gaps.values()))
        what = "; ".join(f"{m}: split(s) {sp}" for m, sp in gaps.items())
        timed = [f"{m} {v:.0f} s" for m, v in each.items() if v is not None]
        untimed = [m for m, v in each.items() if v is None]
        per = "; ".join(([", ".join(timed) + " a row"] if timed else [])
                        + ([f"{', '.join(untimed)} not timed on this set"] if untimed else []))
        lines.append(
            f"* Missing on {ds}: {n_rows} row(s) that read the backbone ({what}). Measured on "
            f"this set (1 thread): the rows {row_s:.0f} s ({row_s / 3600:.1f} core-hours: "
            f"{per}){again}.")
    return lines


def _coverage_lines(rows: list[dict[str, Any]], datasets: list[str], order: Sequence[str],
                    errors: Sequence[Path], out: Path) -> list[str]:
    """'What this covers': runs per data set, IVON's choices, what is missing or failed."""
    from attnuq_bench.data.uci import UCI_DATASETS

    cov = []
    for ds in datasets:
        rr = _of(rows, ds)
        ds_b = sorted({json.dumps((r.get("config") or {}).get("budget")) for r in rr})
        cov.append(f"* {ds}: splits {sorted({r['split'] for r in rr})}; methods "
                   f"{_order({r['method'] for r in rr}, order)}; budget {'; '.join(ds_b)}")
        iv = _of(rows, ds, "ivon")
        hi = {r["split"]: (r.get("info") or {}).get("hess_init") for r in iv}
        grid = ", ".join(sorted({" ".join(f"{h:g}" for h in (r.get("info") or {}).get(
            "hess_inits", [])) for r in iv}))
        if hi:
            chosen = ", ".join(f"split {k}: {v:g}" if isinstance(v, (int, float)) else
                               f"split {k}: fixed (old run)" for k, v in sorted(hi.items()))
            cov.append(f"  * ivon hess_init chosen per split by validation RMSE of the "
                       f"predictive mean (grid {grid}): {chosen}")
    lines = ["## What this covers", "", f"{len(rows)} runs (data set x split x method):", "",
             *cov, ""]
    missing = [d for d in UCI_DATASETS if d not in datasets]
    if missing:
        lines += [f"Not covered by this table: {', '.join(missing)} (the full suite is 6 sets x "
                  ">= 5 splits; rerun the command with more --datasets/--splits, it resumes).", ""]
    lines += retraining_cost_lines(rows, datasets)
    lines += missing_rows_cost_lines(rows, datasets)
    if lines[-1]:
        lines.append("")
    have = {ds: {m: {int(r["split"]) for r in _of(rows, ds, m)}
                 for m in _order({r["method"] for r in _of(rows, ds)}, order)} for ds in datasets}
    lines += gap_lines(have)
    lines += error_lines(list(errors), out)
    return lines


def _block(rows: list[dict[str, Any]], previous: dict[str, Any] | None, order: Sequence[str]
           ) -> dict[str, Any]:
    """The Implementations block: the text each method's runs recorded (that of the newest
    record, with the count of records whose earlier code recorded another text), else the
    previous block of this page, else today's registry text."""
    from attnuq_bench.suites._implementations import merge_block

    names = _order({r["method"] for r in rows}, order)
    recorded: dict[str, str | None] = {}
    for m in names:
        recs = [r for r in rows if r["method"] == m]
        if any(not r.get("implementation") for r in recs):
            recorded[m] = None
            continue
        newest = max(recs, key=lambda r: str((r.get("run_info") or {}).get("date", "")))
        text = str(newest["implementation"])
        older = sum(r["implementation"] != text for r in recs)
        recorded[m] = text + (f" ({older} of {len(recs)} records were run by earlier code, "
                              "whose recorded text differs: see those records)" if older else "")
    return merge_block(names, recorded, previous)


def build_page(out: Path, rows: list[dict[str, Any]], info: dict[str, Any],
               state: dict[str, Any], previous: dict[str, Any] | None = None, *,
               order: Sequence[str] = (), errors: Sequence[Path] = ()) -> Page:
    """The page of ``rows`` (the run records under ``out``): ``info`` is the provenance of the
    command that writes it, ``state`` its ``budget`` and ``seed``, ``previous`` the
    Implementations block stored with an earlier rendering (texts for runs that did not record
    their own), ``order`` the method order, ``errors`` the failed items' ``.err.txt`` files."""
    budget, seed = state["budget"], int(state.get("seed", 0))
    page = Page("uci", _TITLE, state=state)
    page.add("Generated by `attnuq bench uci` (harness/src/attnuq_bench/suites/uci.py); "
             "do not edit by hand.", "")
    page.provenance(info, label="table written by")
    page.add(f"* budget of this command: {json.dumps(budget)}; seed {seed}")
    if budget.get("batch_size") == "auto":
        page.add(f"* {_AUTO_TEXT}")
    page.add(*_budget_lines(rows, budget))
    datasets = sorted({r["dataset"] for r in rows})
    per_ds = {ds: _stats(rows, ds, order) for ds in datasets}
    partial = {ds: _partial(rows, ds) for ds in datasets}
    # the comparisons (bold, verdict, goals) read the rows run on every split of their set
    full = {ds: {m: st for m, st in per_ds[ds].items() if m not in partial[ds][0]}
            for ds in datasets}
    verdicts = {ds: _verdict(ds, full[ds]) for ds in datasets}
    wins = [w for _, w in verdicts.values() if w is not None]
    page.headline(f"**Summary:** SA has the narrowest calibrated PI-95 on {sum(wins)} of "
                  f"{len(wins)} data sets covered here (the paper: 7 of 8).")
    page.add("")
    goals = goal_lines(full)
    if goals:
        page.add("The best SA row above is the best of every SA variant on test data; issue "
                 "#20's goals are counted for the recommended row alone:", *goals, "")
    add_section(page, Path(out).parent, "uci")  # issue #34: what the evidence tells a user
    cov = _coverage_lines(rows, datasets, order, errors, out)
    page.section(cov[0][3:])
    page.add(*cov[2:], *_TEXT)
    header = ["method", "splits", *[c for _, c, _ in _COLS], "fit s", "passes/input"]
    for ds in datasets:
        stats = per_ds[ds]
        short, shared = partial[ds]
        best = {k: _best({m: st[k][0] for m, st in full[ds].items() if math.isfinite(st[k][0])})
                for k in ("width", "crps")}
        page.section(ds)
        tdig = target_digits(stats)
        t = Table(header)
        for m, st in stats.items():
            cells = [m, str(int(st["n"][0]))]
            for k, _, d in _COLS:
                d = tdig if k in _TARGET_COLS else d
                txt = fmt(st[k][0], d, std=st[k][1], nan="n/a", big=None)
                cells.append(f"**{txt}**" if best.get(k) == m else txt)
            t.add(*cells, f"{st['fit_s'][0]:.1f}", f"{st['fwd'][0]:.0f}",
                  values={k: list(v) for k, v in st.items()})
        page.table(t)
        n_sp = len({int(r["split"]) for r in _of(rows, ds)})
        if short:
            where = (f"The ablation table compares the SA rows on the split(s) {shared} every "
                     "row ran on." if shared else "They are left out of the ablation table.")
            page.add("", f"Rows on fewer than the set's {n_sp} splits "
                     f"({', '.join(f'{m} {k}' for m, k in short.items())}) are shown but not "
                     "compared (not bolded, not in the lines below): their means are over other "
                     f"splits. {where}")
        abl_rows = rows if not short else [r for r in rows if int(r["split"]) in shared]
        abl = _stats(abl_rows, ds, order) if shared else full[ds]
        over = "means over splits" if not short else f"split(s) {shared} alone"
        page.add("", *verdicts[ds][0], *backbone_lines(rows, ds, order))
        if ablation_block(page, _ablation_rows(abl), point="RMSE", frozen=_frozen_rmse(abl),
                          digits=tdig,
                          title=f"**Ablations on {ds}** (SA variants against their reference "
                          f"rows, {over}):", flag=False,  # the flag: in the verdict
                          nu=_nu_of(abl_rows, ds), floor=_floor_of(abl_rows, ds)):
            page.add("")
        page.add(f"![PIT histograms {ds}](uci/pit_{ds}.png)" if out.name == "uci"
                 else f"PIT histograms: `{out / f'pit_{ds}.png'}`", "")
    page.implementations(_block(rows, previous, order))
    return page


def summary(rows: list[dict[str, Any]], order: Sequence[str] = ()) -> dict[str, Any]:
    """The ``uci`` key of summary.json (issue #19): per set the frozen backbone's RMSE beside
    the MC-dropout paper's, and each method's mean scores over its splits."""
    keys = (("rmse", "rmse"), ("crps", "crps"), ("pi95_width_cal", "width"),
            ("coverage95_native", "coverage_native"), ("w1_native", "w1_native"))
    out: dict[str, Any] = {}
    for ds in sorted({r["dataset"] for r in rows}):
        stats = _stats(rows, ds, order)
        methods = {m: {k: st[src][0] for k, src in keys} for m, st in stats.items()}
        frozen = next((m for m in ("gaussian", "laplace", "conformal", "mc-dropout")
                       if m in stats), None)
        value = None if frozen is None else stats[frozen]["rmse"][0]
        if value is not None:
            methods = {"frozen": {"rmse": value}, **methods}
        out[ds] = {"backbone": {"metric": "rmse", "value": value,
                                "reference": REFERENCE_RMSE.get(ds),
                                "reference_name": "Gal & Ghahramani 2016 (MC dropout)"
                                if ds in REFERENCE_RMSE else None},
                   "splits": len({r["split"] for r in _of(rows, ds)}), "methods": methods}
    return out
