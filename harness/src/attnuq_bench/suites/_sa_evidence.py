r"""What the regression evidence tells a user of the recommended ``sa`` (issue #34).

Pure functions of the stored records of every regression (suite, set) (no training, no
writes): the UCI run records ``<root>/uci/runs/<set>/split<K>/<method>.json``, the ETTh1 and
ERA5 results ``<root>/ett/ett_results.json`` and ``<root>/era5/era5_results.json`` (ERA5 per
lead: ``era5 +6h`` and ``era5 +24h`` are two sets scored from one fit). For each (suite, set):

* ``sa``'s test CRPS (mean and sd over splits) against the best method that needs no retraining
  of the backbone among those present (:data:`NO_RETRAIN`), the relative gap and whether ``sa`` is
  best (a tie counts as best);
* the diagnostics ``attnuq.SARegressor`` reports on validation data: the Spearman correlation of
  SA's spread with the absolute errors, the chosen ``nu`` and whether it sat at an edge of its
  range, the floor's ``beta`` (in units of the validation residual scale; ``inf`` is plain split
  conformal) and the chosen form;
* the rule :func:`rule_predicts` (fixed in advance, validation quantities only) and whether it
  predicted right that ``sa``'s test CRPS is below plain conformal's, per (suite, set, split) and
  per (suite, set).

A comparison is only made on one backbone: a UCI record whose backbone differs from the ``sa``
record's of the same split (``cache_key``, best epoch and validation RMSE) is not compared and is
listed as such; a missing record is shown as missing, never filled.

Examples
--------
>>> rule_predicts({"spearman": 0.3, "form": "sa-floor", "n_val": 200})
True
>>> rule_predicts({"spearman": 0.3, "form": "conformal", "n_val": 200})
False
>>> rule_predicts({"spearman": None, "form": "sa-floor", "n_val": 200}) is None
True
>>> round(spearman_threshold(93), 4), spearman_threshold(10_000), spearman_threshold(None)
(0.2043, 0.1, 0.1)
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnuq_bench.suites._page import Page, Table

__all__ = [
    "CENTRE_ROW",
    "GOAL_GAP",
    "NO_RETRAIN",
    "RULE_TEXT",
    "SPEARMAN_FLOOR",
    "CentreRow",
    "SetRow",
    "Unit",
    "add_section",
    "centre_line",
    "centre_rows",
    "centre_section",
    "collect",
    "evidence",
    "readme_paragraph",
    "rule_predicts",
    "scaled_line",
    "scaled_rows",
    "scaled_section",
    "spearman_threshold",
]

#: the methods that need no retraining of the backbone, in tie-break order (the first wins a tie)
NO_RETRAIN = ("conformal", "gaussian", "laplace", "mc-dropout", "swag", "seasonal-naive",
              "persistence", "climatology")

#: the row of ``SARegressor(recentre="auto")`` (centre chosen on validation), compared with ``sa``
CENTRE_ROW = "sa-centre"
#: the paper's nu with the spread of SA's samples scaled on the calibration part: the simplest
#: calibrated SA row, compared with ``sa``
SCALED_ROW = "sa-conformal"

#: issue #34's goal: ``sa``'s CRPS at most this much (relative) above the best no-retraining one
GOAL_GAP = 0.02

#: the least validation Spearman the rule asks for: Cohen's (1988) "small" correlation, below
#: which a rank association is conventionally negligible
SPEARMAN_FLOOR = 0.1

#: the two-sided 5 % normal quantile: Spearman's rho of ``n`` independent pairs has null sd
#: ``1 / sqrt(n - 1)`` (asymptotically normal)
_Z975 = 1.959963984540054

RULE_TEXT = (
    "predict that `sa` beats plain split conformal on test (lower CRPS) exactly when, on "
    "validation data, (a) SARegressor's cross-fitted validation CRPS chose a spread-scaled form "
    "(`form` is `sa-normalised` or `sa-floor`, not `conformal` or `gaussian`, the constant-width "
    "ones) and (b) the validation Spearman "
    "correlation of SA's spread with the absolute error exceeds max(0.1, 1.96 / sqrt(n_val - 1)), "
    "n_val the number of validation examples where the records give it (UCI: the validation "
    "part's rows; ERA5: its issue times; ETTh1: not recorded, so 0.1)"
)
RULE_WHY = (
    "Why these two conditions, fixed before any test score was read: plain conformal is the "
    "`beta = inf` end of the form SARegressor chooses (the Gaussian residual form is the other "
    "constant-width one), so (a) is the estimator's own validation verdict; a spread can only "
    "help if it ranks the errors, and (b) asks that its rank "
    "correlation be both non-negligible (Cohen's small effect, 0.1) and above what chance gives "
    "on n_val independent examples at the two-sided 5 % level (the null sd of Spearman's rho is "
    "1 / sqrt(n - 1); counting examples, not output elements, is conservative for the "
    "correlated outputs of ETTh1 and ERA5). Whether nu sat at an edge of its range is shown but "
    "not used: the conformal step rescales the spread, so its ranking, which (b) measures, is "
    "what matters. No threshold was tuned on test data."
)


def spearman_threshold(n_val: int | None) -> float:
    """The rule's Spearman threshold ``max(0.1, 1.96 / sqrt(n_val - 1))``; ``0.1`` when
    ``n_val`` is unknown (``None``) or below 3.

    >>> spearman_threshold(50) > spearman_threshold(5000) == 0.1
    True
    """
    if n_val is not None and (isinstance(n_val, bool) or not isinstance(n_val, int)):
        raise TypeError(f"n_val must be an int or None, got {n_val=!r}")
    if n_val is None or n_val < 3:
        return SPEARMAN_FLOOR
    return max(SPEARMAN_FLOOR, _Z975 / math.sqrt(n_val - 1))


def rule_predicts(diag: Mapping[str, Any]) -> bool | None:
    """The rule (:data:`RULE_TEXT`) on one fit's validation diagnostics: ``True`` (``sa``
    should beat plain conformal), ``False``, or ``None`` when a diagnostic it needs is missing.

    ``diag`` holds ``spearman`` (float or ``None``), ``form`` (``"sa-normalised"``,
    ``"sa-floor"``, ``"conformal"``, ``"gaussian"`` or ``None``) and ``n_val`` (int or
    ``None``).
    """
    if not isinstance(diag, Mapping):
        raise TypeError(f"diag must be a mapping, got {type(diag).__name__}")
    rho, form = diag.get("spearman"), diag.get("form")
    if rho is None or form is None or not math.isfinite(float(rho)):
        return None
    if form not in _FORMS:
        raise ValueError(f"diag['form'] must be one of {_FORMS}, got {form!r}")
    return form in _FORMS[:2] and float(rho) > spearman_threshold(diag.get("n_val"))


#: SARegressor's forms: the two that use SA's spread, then the two of constant width
_FORMS = ("sa-normalised", "sa-floor", "conformal", "gaussian")


# --------------------------------------------------------------------------- records -> units
@dataclass
class Unit:
    """One (suite, set, split): test CRPS per method on the ``sa`` record's backbone, and the
    validation diagnostics of the ``sa`` fit."""

    suite: str
    dataset: str
    split: int | None
    crps: dict[str, float] = field(default_factory=dict)
    diag: dict[str, Any] = field(default_factory=dict)
    other_backbone: list[str] = field(default_factory=list)
    #: the centre ``sa-centre`` (``recentre="auto"``) chose on validation, where it ran
    centre: str | None = None

    @property
    def label(self) -> str:
        return self.dataset + ("" if self.split is None else f" split {self.split}")

    @property
    def beats_conformal(self) -> bool | None:
        """``sa``'s test CRPS strictly below plain conformal's (``None``: one is missing)."""
        if "sa" not in self.crps or "conformal" not in self.crps:
            return None
        return self.crps["sa"] < self.crps["conformal"]


def _num(v: Any) -> float | None:
    """A stored number as a float (``"inf"`` / ``Infinity`` included); ``None`` if absent."""
    if v is None or isinstance(v, bool):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _diag(info: Mapping[str, Any], n_val: int | None) -> dict[str, Any]:
    """The diagnostics of one ``sa`` record's info (missing ones stay ``None``)."""
    edge = info.get("nu_at_edge")
    return {"spearman": _num(info.get("spearman_spread_abs_error")),
            "nu": info.get("nu_map") or info.get("nu"),
            "nu_at_edge": None if edge is None else str(edge),
            "beta_units": _num(info.get("floor_beta_units")),
            "form": info.get("form"), "n_val": n_val}


def _backbone(r: Mapping[str, Any]) -> tuple[Any, ...]:
    b = r.get("backbone") or {}
    return b.get("cache_key"), b.get("best_epoch"), b.get("best_val_rmse_std_units")


def _same_fit(r: Mapping[str, Any], sa: Mapping[str, Any]) -> bool:
    """``r`` scored on ``sa``'s backbone and data: the same backbone fingerprint (cache key,
    best epoch, validation RMSE: a retrained backbone differs in the last two) and the same
    data digest where both records have one."""
    d1, d2 = r.get("data_digest"), sa.get("data_digest")
    return _backbone(r) == _backbone(sa) and (d1 is None or d2 is None or d1 == d2)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def uci_units(runs: Path) -> list[Unit]:
    """The UCI units of ``runs`` (``<set>/split<K>/<method>.json``, seed 0): every split with a
    record; each method's CRPS kept only on the ``sa`` record's backbone (a split without
    ``sa`` is a unit with ``sa`` missing)."""
    units = []
    for split_dir in sorted(Path(runs).glob("*/split*")):
        if not split_dir.is_dir() or not split_dir.name[5:].isdigit():
            continue
        recs = {}
        for f in sorted(split_dir.glob("*.json")):
            r = _read(f)
            if r is not None and isinstance(r.get("metrics"), dict) and r.get("method"):
                recs[str(r["method"])] = r
        if not recs:
            continue
        sa = recs.get("sa")
        u = Unit("uci", split_dir.parent.name, int(split_dir.name[5:]))
        if sa is not None:
            val = (sa.get("sizes") or {}).get("val")
            u.diag = _diag(sa.get("info") or {}, val if isinstance(val, int) else None)
        for m in ("sa", *NO_RETRAIN, CENTRE_ROW, SCALED_ROW):
            r = recs.get(m)
            if r is None:
                continue
            if sa is not None and not _same_fit(r, sa):
                u.other_backbone.append(m)
                continue
            c = _num(r["metrics"].get("crps"))
            if c is not None and math.isfinite(c):
                u.crps[m] = c
                if m == CENTRE_ROW:
                    centre = (r.get("info") or {}).get("centre")
                    u.centre = None if centre is None else str(centre)
        units.append(u)
    return sorted(units, key=lambda u: (u.dataset, u.split))


def ett_units(path: Path) -> list[Unit]:
    """The ETTh1 unit of ``ett_results.json`` (none without results; ``sa`` may be missing)."""
    p = _read(Path(path))
    res = (p or {}).get("results") or {}
    if not res:
        return []
    u = Unit("ett", "ETTh1", None, diag=_diag(res["sa"], None) if "sa" in res else {})
    for m in ("sa", *NO_RETRAIN, CENTRE_ROW, SCALED_ROW):
        c = _num((res.get(m) or {}).get("crps"))
        if c is not None and math.isfinite(c):
            u.crps[m] = c
    u.centre = _centre(res)
    return [u]


def _centre(res: Mapping[str, Any]) -> str | None:
    """The centre ``sa-centre`` chose (its results' ``centre``), ``None`` without the row."""
    c = (res.get(CENTRE_ROW) or {}).get("centre")
    return None if c is None else str(c)


def era5_units(path: Path) -> list[Unit]:
    """The ERA5 units of ``era5_results.json``: one per lead (one ``sa`` fit covers every
    lead, so the diagnostics are shared; ``sa`` may be missing)."""
    p = _read(Path(path))
    res = (p or {}).get("results") or {}
    if not res:
        return []
    n_val = ((p or {}).get("data") or {}).get("examples", {}).get("val")
    diag = _diag(res["sa"], n_val if isinstance(n_val, int) else None) if "sa" in res else {}
    leads: list[str] = []
    for r in res.values():
        for lead in (r.get("per_lead") or {}) if isinstance(r, dict) else ():
            if lead not in leads:
                leads.append(lead)
    var = ((p or {}).get("data") or {}).get("variable") or "field"
    units = []
    for lead in leads:
        u = Unit("era5", f"{var} {lead}", None, diag=dict(diag), centre=_centre(res))
        for m in ("sa", *NO_RETRAIN, CENTRE_ROW, SCALED_ROW):
            c = _num(((res.get(m) or {}).get("per_lead") or {}).get(lead, {}).get("crps"))
            if c is not None and math.isfinite(c):
                u.crps[m] = c
        units.append(u)
    return units


def collect(root: Path) -> list[Unit]:
    """Every unit under the results folder ``root`` (``docs/results``), in suite order."""
    root = Path(root)
    return [*uci_units(root / "uci" / "runs"), *ett_units(root / "ett" / "ett_results.json"),
            *era5_units(root / "era5" / "era5_results.json")]


# ------------------------------------------------------------------------------ aggregation
def _mean_sd(v: Sequence[float]) -> tuple[float, float]:
    m = sum(v) / len(v)
    sd = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else 0.0
    return m, sd


@dataclass
class SetRow:
    """One (suite, set) over its splits."""

    suite: str
    dataset: str
    splits: list[int | None]
    sa: tuple[float, float] | None
    best: str | None
    best_crps: tuple[float, float] | None
    incomplete: dict[str, int]
    spearman: tuple[float, float] | None
    nus: list[Any]
    edges: list[str | None]
    betas: list[float | None]
    forms: list[str | None]
    predicted: bool | None
    beats: bool | None
    other_backbone: list[str]

    @property
    def gap(self) -> float | None:
        """``sa`` mean CRPS / best no-retraining mean CRPS - 1."""
        if self.sa is None or self.best_crps is None:
            return None
        return self.sa[0] / self.best_crps[0] - 1.0

    @property
    def sa_best(self) -> bool | None:
        g = self.gap
        return None if g is None else g <= 0.0


def _majority(votes: Sequence[bool | None]) -> bool | None:
    """``True`` when more than half of the votes are ``True`` (a tie is ``False``: the rule
    has to say ``sa`` wins on most splits); ``None`` if any vote is unknown (a set is predicted
    from all of its fits or not at all).

    >>> _majority([True, True, False]), _majority([True, False]), _majority([True, None])
    (True, False, None)
    """
    if not votes or any(v is None for v in votes):
        return None
    return sum(bool(v) for v in votes) * 2 > len(votes)


def set_row(units: Sequence[Unit]) -> SetRow:
    """The row of one (suite, set) from its units (all of one suite and set).

    A baseline is compared on the splits where ``sa`` was scored; one missing on some of them
    is listed in ``incomplete`` (split count) and not compared. The outcome ``beats`` compares
    the mean CRPS of ``sa`` and ``conformal`` over the splits both have.
    """
    if not units or len({(u.suite, u.dataset) for u in units}) != 1:
        raise ValueError(f"set_row needs the units of one (suite, set), got "
                         f"{sorted({(u.suite, u.dataset) for u in units})}")
    sa_units = [u for u in units if "sa" in u.crps]
    sa = _mean_sd([u.crps["sa"] for u in sa_units]) if sa_units else None
    means, incomplete = {}, {}
    for m in NO_RETRAIN:
        have = [u.crps[m] for u in sa_units if m in u.crps]
        if not have:
            continue
        if len(have) < len(sa_units):
            incomplete[m] = len(have)
        else:
            means[m] = _mean_sd(have)
    best = min(means, key=lambda m: (means[m][0], NO_RETRAIN.index(m))) if means else None
    both = [u for u in sa_units if "conformal" in u.crps]
    beats = (None if not both else
             sum(u.crps["sa"] for u in both) < sum(u.crps["conformal"] for u in both))
    rhos = [u.diag["spearman"] for u in units if u.diag.get("spearman") is not None]
    return SetRow(
        suite=units[0].suite, dataset=units[0].dataset, splits=[u.split for u in units],
        sa=sa, best=best, best_crps=None if best is None else means[best],
        incomplete=incomplete, spearman=_mean_sd(rhos) if rhos else None,
        nus=[u.diag.get("nu") for u in units], edges=[u.diag.get("nu_at_edge") for u in units],
        betas=[u.diag.get("beta_units") for u in units],
        forms=[u.diag.get("form") for u in units],
        predicted=_majority([rule_predicts(u.diag) for u in units]), beats=beats,
        other_backbone=sorted({m for u in units for m in u.other_backbone}))


def _tally(pairs: Sequence[tuple[bool | None, bool | None]]) -> dict[str, int]:
    """Right / scored / unscored counts of (prediction, outcome) pairs."""
    scored = [(p, o) for p, o in pairs if p is not None and o is not None]
    return {"right": sum(p == o for p, o in scored), "scored": len(scored),
            "unscored": len(pairs) - len(scored), "beats": sum(bool(o) for _, o in scored),
            "predicted_beats": sum(bool(p) for p, _ in scored)}


def evidence(units: Sequence[Unit]) -> dict[str, Any]:
    """Set rows, the rule's record over sets and over splits, and the goal's state."""
    keys: list[tuple[str, str]] = []
    for u in units:
        if (u.suite, u.dataset) not in keys:
            keys.append((u.suite, u.dataset))
    rows = [set_row([u for u in units if (u.suite, u.dataset) == k]) for k in keys]
    by_split = _tally([(rule_predicts(u.diag), u.beats_conformal) for u in units])
    by_set = _tally([(r.predicted, r.beats) for r in rows])
    gaps = [r.gap for r in rows]
    known = [g for g in gaps if g is not None]
    return {
        "rows": rows, "units": list(units), "rule_by_set": by_set, "rule_by_split": by_split,
        "goal": {"sets": len(rows), "compared": len(known),
                 "within": sum(g <= GOAL_GAP for g in known),
                 "best": sum(g <= 0.0 for g in known),
                 "worst": max(known) if known else None,
                 "met": bool(rows) and len(known) == len(rows)
                 and all(g <= GOAL_GAP for g in known) and 2 * sum(g <= 0.0 for g in known)
                 >= len(rows)},
    }


# -------------------------------------------------------------------------------- rendering
def _f(x: float | None, d: int = 4) -> str:
    return "missing" if x is None or not math.isfinite(x) else f"{x:.{d}f}"


def _ms(x: tuple[float, float] | None, n: int, d: int | None = None) -> str:
    """``mean ± sd`` (``mean`` alone for one split); ``d`` decimals, by default at least 4 and
    enough for three significant digits of the mean (naval's CRPS ~0.0013 -> 0.00129)."""
    if x is None:
        return "missing"
    if d is None:
        d = 4 if not x[0] or not math.isfinite(x[0]) else max(
            4, 2 - math.floor(math.log10(abs(x[0]))))
    return f"{x[0]:.{d}f} ± {x[1]:.{d}f}" if n > 1 else f"{x[0]:.{d}f}"


def _beta(b: float | None) -> str:
    if b is None:
        return "missing"
    return "inf" if math.isinf(b) else f"{b:g}"


def _counts(values: Sequence[Any]) -> str:
    """``"a x3, b x2"`` in first-seen order (missing values as ``missing``)."""
    seen: dict[str, int] = {}
    for v in values:
        k = "missing" if v is None else str(v)
        seen[k] = seen.get(k, 0) + 1
    return ", ".join(k if n == 1 and len(seen) == 1 and len(values) == 1 else f"{k} x{n}"
                     for k, n in seen.items())


def _yes(v: bool | None) -> str:
    return "missing" if v is None else ("yes" if v else "no")


COLUMNS = ["suite", "set", "splits", "sa CRPS", "best no-retraining", "its CRPS", "gap",
           "sa best", "val Spearman", "nu", "nu at edge", "floor beta (units)", "form",
           "rule says sa beats conformal", "sa beat conformal"]


def row_cells(r: SetRow) -> list[str]:
    """The table cells of one set row (:data:`COLUMNS`)."""
    n = sum(1 for s in r.splits)
    g = r.gap
    return [r.suite, r.dataset, str(n), _ms(r.sa, n), r.best or "missing",
            _ms(r.best_crps, n), "missing" if g is None else f"{100 * g:+.1f} %",
            _yes(r.sa_best), _ms(r.spearman, n, 3),
            ", ".join("missing" if v is None else str(v) for v in r.nus),
            _counts(r.edges), ", ".join(_beta(b) for b in r.betas), _counts(r.forms),
            _yes(r.predicted), _yes(r.beats)]


def row_values(r: SetRow) -> dict[str, Any]:
    """The raw numbers of one set row (strict JSON: ``beta = inf`` as the string ``"inf"``)."""
    return {"suite": r.suite, "set": r.dataset, "splits": r.splits,
            "sa_crps": None if r.sa is None else list(r.sa), "best": r.best,
            "best_crps": None if r.best_crps is None else list(r.best_crps), "gap": r.gap,
            "sa_best": r.sa_best, "incomplete": r.incomplete,
            "spearman": None if r.spearman is None else list(r.spearman), "nu": r.nus,
            "nu_at_edge": r.edges,
            "beta_units": [b if b is None or math.isfinite(b) else "inf" for b in r.betas],
            "form": r.forms, "rule_predicts_beats": r.predicted, "beats_conformal": r.beats,
            "other_backbone": r.other_backbone}


def _acc(t: Mapping[str, int], what: str) -> str:
    if not t["scored"]:
        return f"over {what}: nothing to score (records missing)"
    out = (f"over {what}: right {t['right']} of {t['scored']} "
           f"({100 * t['right'] / t['scored']:.0f} %); `sa` beat conformal in {t['beats']} of "
           f"{t['scored']}, the rule said it would in {t['predicted_beats']}")
    if t["unscored"]:
        out += f"; {t['unscored']} not scored (a record or diagnostic missing)"
    return out


def rule_lines(ev: Mapping[str, Any]) -> list[str]:
    """The rule, its justification and its record (a markdown list)."""
    s, sp = ev["rule_by_set"], ev["rule_by_split"]
    lines = [f"* The rule: {RULE_TEXT}.", f"* {RULE_WHY}",
             f"* How often it was right {_acc(sp, 'every (suite, set, split) fit')}.",
             f"* How often it was right {_acc(s, 'every (suite, set)')} (a set's prediction: "
             "the rule's answer on most of its splits, only when every split has the "
             "diagnostics; its outcome: the mean CRPS of `sa` and conformal over the splits "
             "both have)."]
    for t in (s, sp):
        if t["scored"]:
            base = max(t["beats"], t["scored"] - t["beats"])
            if t["right"] <= base:
                lines.append(
                    f"* The rule is no better than always answering the more frequent outcome "
                    f"({base} of {t['scored']} right): on this evidence it does not tell a user "
                    "more than the base rate.")
                break
    return lines


def goal_line(ev: Mapping[str, Any]) -> str:
    """Issue #34's goal (within 2 % everywhere, best on at least half) against the rows."""
    g = ev["goal"]
    if not g["compared"]:
        return "Issue #34's goal: nothing to compare yet (records missing)."
    worst = g["worst"]
    state = "met" if g["met"] else "not met"
    missing = g["sets"] - g["compared"]
    return (f"Issue #34's goal (`sa` within {100 * GOAL_GAP:.0f} % of the best no-retraining "
            f"CRPS on every (suite, set), the best on at least half): {state}: within "
            f"{100 * GOAL_GAP:.0f} % on {g['within']} of the {g['compared']} compared, best on "
            f"{g['best']} of them, worst gap {100 * worst:+.1f} %"
            + (f"; {missing} set(s) without a comparison" if missing else "") + ".")


def uci_coverage_line(ev: Mapping[str, Any], *, n_splits: int = 5) -> str:
    """Issue #34's coverage goal: every UCI set with ``sa`` on ``n_splits`` splits.

    >>> print(uci_coverage_line({"units": []}))  # doctest: +ELLIPSIS
    Issue #34's coverage goal (...): not met: 0 of 6 sets; short: bostonHousing (0 of 5 splits), ...
    """
    from attnuq_bench.data.uci import UCI_DATASETS

    have = {d: len({u.split for u in ev["units"] if u.suite == "uci" and u.dataset == d
                    and "sa" in u.crps}) for d in UCI_DATASETS}
    short = [f"{d} ({have[d]} of {n_splits} splits)" for d in UCI_DATASETS
             if have[d] < n_splits]
    done = len(UCI_DATASETS) - len(short)
    return (f"Issue #34's coverage goal (all {len(UCI_DATASETS)} UCI sets with `sa` on "
            f"{n_splits} splits at the full budget): {'not met' if short else 'met'}: {done} "
            f"of {len(UCI_DATASETS)} sets" + (f"; short: {', '.join(short)} (the runs resume; "
            "what they cost and the command: docs/results/_pending/README.md)" if short else "")
            + ".")


def missing_lines(ev: Mapping[str, Any]) -> list[str]:
    """What is missing or not comparable, per set."""
    out = []
    for r in ev["rows"]:
        n = len(r.splits)
        miss = r.sa is not None and r.beats is None
        parts = []
        if r.incomplete:
            parts.append("on fewer splits than sa (not compared): " + ", ".join(
                f"{m} ({k} of {n})" for m, k in r.incomplete.items()))
        if r.other_backbone:
            parts.append("records on another backbone (not compared): "
                         + ", ".join(r.other_backbone))
        if miss:
            parts.append("no conformal row on sa's splits")
        if r.sa is None:
            parts.append("no `sa` record")
        elif any(u is None for u in r.forms) or r.spearman is None:
            parts.append("sa's validation diagnostics (form / Spearman) not recorded by its run")
        if parts:
            out.append(f"* {r.suite} {r.dataset}: " + "; ".join(parts) + ".")
    return out


def add_section(page: Page, root: Path, suite: str) -> bool:
    """Append the "What it tells a user" section of ``suite``'s page (``uci``, ``ett``,
    ``era5``) to ``page``: its sets' rows (a table, raw numbers in the twin), what is missing,
    the goal and the rule's record over every suite under ``root`` (``docs/results``). Nothing
    is added (``False``) when ``suite`` has no ``sa`` record."""
    if suite not in ("uci", "ett", "era5"):
        raise ValueError(f"suite must be 'uci', 'ett' or 'era5', got {suite=!r}")
    units = collect(Path(root))
    if not any(u.suite == suite and "sa" in u.crps for u in units):
        return False
    ev = evidence(units)
    mine = [r for r in ev["rows"] if r.suite == suite]
    page.section("What it tells a user")
    page.add("Written by the page's own renderer from the stored records of every regression "
             "suite (harness/src/attnuq_bench/suites/_sa_evidence.py; all suites and every "
             "fit: [sa_evidence.md](sa_evidence.md), `attnuq bench evidence`): the recommended "
             "`sa` against the best method that needs no retraining among those present "
             f"({', '.join(NO_RETRAIN)}), test CRPS mean ± sd over splits, gap = `sa` / best - "
             "1, with the validation diagnostics SARegressor reports (Spearman of its spread "
             "with |error|, nu and its edge, the floor's beta in units of the validation "
             "residual scale, `inf` = plain conformal, and the chosen form).", "")
    t = Table(COLUMNS[1:])
    for r in mine:
        t.add(*row_cells(r)[1:], values=row_values(r))
    page.table(t)
    cover = [f"* {uci_coverage_line(ev)}"] if suite == "uci" else []
    page.add("", *missing_lines({"rows": mine}), f"* {goal_line(ev)}", *cover, *rule_lines(ev),
             "")
    return True


def _with_sa(units: Sequence[Unit], row: str) -> list[tuple[str, str, list[Unit]]]:
    """``(suite, set, units)`` for each (suite, set) where ``row`` and ``sa`` share at least
    one split (on one backbone), in the units' order."""
    out: dict[tuple[str, str], list[Unit]] = {}
    for u in units:
        if "sa" in u.crps and row in u.crps:
            out.setdefault((u.suite, u.dataset), []).append(u)
    return [(suite, ds, us) for (suite, ds), us in out.items()]


@dataclass
class CentreRow:
    """``sa-centre`` against ``sa`` on one (suite, set): the splits both have, on one backbone."""

    suite: str
    dataset: str
    sa: tuple[float, float]
    auto: tuple[float, float]
    centres: list[str | None]
    #: per split where the draws' mean was chosen: ``sa-centre``'s test CRPS below ``sa``'s
    mean_better: list[bool]
    n: int

    @property
    def gap(self) -> float:
        """``sa-centre`` mean CRPS / ``sa`` mean CRPS - 1."""
        return self.auto[0] / self.sa[0] - 1.0


def centre_rows(units: Sequence[Unit]) -> list[CentreRow]:
    """One :class:`CentreRow` per (suite, set) with both ``sa`` and ``sa-centre`` on at least
    one split (the splits where both are scored on one backbone), in the units' order.

    >>> us = [Unit("uci", "a", k, crps={"sa": 1.0, "sa-centre": c}, centre=w)
    ...       for k, (c, w) in enumerate([(0.9, "mean"), (1.0, "frozen"), (1.1, "mean")])]
    >>> r = centre_rows(us)[0]
    >>> r.n, r.centres, r.mean_better, round(r.gap, 4)
    (3, ['mean', 'frozen', 'mean'], [True, False], 0.0)
    """
    rows = []
    for suite, ds, both in _with_sa(units, CENTRE_ROW):
        rows.append(CentreRow(
            suite=suite, dataset=ds, sa=_mean_sd([u.crps["sa"] for u in both]),
            auto=_mean_sd([u.crps[CENTRE_ROW] for u in both]),
            centres=[u.centre for u in both],
            mean_better=[u.crps[CENTRE_ROW] < u.crps["sa"] for u in both if u.centre == "mean"],
            n=len(both)))
    return rows


def centre_section(page: Page, units: Sequence[Unit]) -> bool:
    """Append the section on ``sa-centre`` (``SARegressor(recentre="auto")``) against ``sa``
    to ``page``; ``False`` (nothing added) when no set has both rows."""
    rows = centre_rows(units)
    if not rows:
        return False
    page.section("The centre chosen on validation (`sa-centre`)")
    page.add("`sa-centre` is `sa` with `recentre=\"auto\"`: the same passes and form choice, "
             "scored about two centres, the frozen output and the mean of SA's draws, and the "
             "lower cross-fitted validation CRPS decides (ties: the frozen output, which is "
             "`sa`). On a split where it keeps the frozen output it is `sa` exactly; where it "
             "takes the draws' mean the point prediction moves. Test CRPS mean ± sd over the "
             "splits both rows have; gap = `sa-centre` / `sa` - 1.", "")
    t = Table(["suite", "set", "splits", "sa CRPS", "sa-centre CRPS", "gap", "centre chosen",
               "mean chosen: sa-centre better on"])
    for r in rows:
        k = len(r.mean_better)
        t.add(r.suite, r.dataset, str(r.n), _ms(r.sa, r.n), _ms(r.auto, r.n),
              _pct(r.gap), _counts(r.centres),
              "-" if not k else f"{sum(r.mean_better)} of {k}",
              values={"suite": r.suite, "set": r.dataset, "splits": r.n, "sa": list(r.sa),
                      "sa_centre": list(r.auto), "gap": r.gap, "centres": r.centres,
                      "mean_better": r.mean_better})
    page.table(t)
    page.add("", f"* {centre_line(rows)}", "")
    return True


@dataclass
class ScaledRow:
    """``sa-conformal`` against ``sa`` on one (suite, set): the splits both have, on one
    backbone."""

    suite: str
    dataset: str
    sa: tuple[float, float]
    scaled: tuple[float, float]
    #: per split: ``sa-conformal``'s test CRPS below ``sa``'s
    lower: list[bool]

    @property
    def gap(self) -> float:
        """``sa-conformal`` mean CRPS / ``sa`` mean CRPS - 1."""
        return self.scaled[0] / self.sa[0] - 1.0


def scaled_rows(units: Sequence[Unit]) -> list[ScaledRow]:
    """One :class:`ScaledRow` per (suite, set) with both ``sa`` and ``sa-conformal`` on at
    least one split, in the units' order.

    >>> us = [Unit("uci", "a", k, crps={"sa": 1.0, "sa-conformal": c})
    ...       for k, c in enumerate([0.9, 1.0, 1.2])]
    >>> r = scaled_rows(us)[0]
    >>> r.lower, round(r.gap, 4)
    ([True, False, False], 0.0333)
    """
    rows = []
    for suite, ds, both in _with_sa(units, SCALED_ROW):
        rows.append(ScaledRow(
            suite=suite, dataset=ds, sa=_mean_sd([u.crps["sa"] for u in both]),
            scaled=_mean_sd([u.crps[SCALED_ROW] for u in both]),
            lower=[u.crps[SCALED_ROW] < u.crps["sa"] for u in both]))
    return rows


def scaled_line(rows: Sequence[ScaledRow]) -> str:
    """One sentence: where the simplest calibrated SA row beat the recommended one."""
    better = [r for r in rows if r.gap < 0]
    worse = [r for r in rows if r.gap > 0]
    low = [b for r in rows for b in r.lower]
    return (f"Over {len(rows)} (suite, set) pairs, `sa-conformal` has the lower mean CRPS on "
            f"{len(better)} and the higher on {len(worse)}"
            + (" (" + ", ".join(f"{r.dataset} {_pct(r.gap)}" for r in better + worse) + ")"
               if better or worse else "")
            + f"; it was lower on {sum(low)} of {len(low)} splits.")


def scaled_section(page: Page, units: Sequence[Unit]) -> bool:
    """Append the section on ``sa-conformal`` against ``sa`` to ``page``; ``False`` (nothing
    added) when no set has both rows."""
    rows = scaled_rows(units)
    if not rows:
        return False
    page.section("The simplest calibrated SA row (`sa-conformal`)")
    page.add("`sa-conformal` is the paper's recipe (nu by the paper's criterion `L_SA`) with the "
             "spread of SA's samples about their mean scaled on the calibration part so that "
             "its 95 % interval covers (split conformal on one level); `sa` is "
             "`SARegressor`. Where `sa-conformal` is lower, the recommended recipe loses to a "
             "simpler one on that set. Test CRPS mean ± sd over the splits both rows have; "
             "gap = `sa-conformal` / `sa` - 1.", "")
    t = Table(["suite", "set", "splits", "sa CRPS", "sa-conformal CRPS", "gap",
               "sa-conformal lower on"])
    for r in rows:
        n = len(r.lower)
        t.add(r.suite, r.dataset, str(n), _ms(r.sa, n), _ms(r.scaled, n), _pct(r.gap),
              f"{sum(r.lower)} of {n}",
              values={"suite": r.suite, "set": r.dataset, "splits": n, "sa": list(r.sa),
                      "sa_conformal": list(r.scaled), "gap": r.gap, "lower": r.lower})
    page.table(t)
    page.add("", f"* {scaled_line(rows)}", "")
    return True


def _pct(g: float) -> str:
    """A relative gap in percent: one decimal, two below 0.1 % (so that a nonzero gap never
    reads as ``+0.0 %``).

    >>> _pct(0.0123), _pct(-0.00012), _pct(0.0)
    ('+1.2 %', '-0.01 %', '+0.0 %')
    """
    return f"{100 * g:+.2f} %" if 0 < abs(g) < 1e-3 else f"{100 * g:+.1f} %"


def centre_line(rows: Sequence[CentreRow]) -> str:
    """One sentence: on how many sets and splits the validation choice of the centre helped."""
    mb = [b for r in rows for b in r.mean_better]
    better = [r for r in rows if r.gap < 0]
    worse = [r for r in rows if r.gap > 0]
    return (f"Over {len(rows)} (suite, set) pairs, `sa-centre` has the lower mean CRPS on "
            f"{len(better)} and the higher on {len(worse)}"
            + (" (" + ", ".join(f"{r.dataset} {_pct(r.gap)}" for r in better + worse)
               + ")" if better or worse else "")
            + f"; it took the draws' mean on {len(mb)} of {sum(r.n for r in rows)} splits, and "
            f"there its test CRPS was below `sa`'s on {sum(mb)} of {len(mb)}.")


def readme_paragraph(ev: Mapping[str, Any]) -> list[str]:
    """The README paragraph of the evidence ``ev`` (stored in the page twin's state)."""
    s, sp = ev["rule_by_set"], ev["rule_by_split"]
    rows = ev["rows"]
    worst = [r for r in rows if r.gap is not None and r.gap > GOAL_GAP]
    text = (f"**What the evidence tells a user** ([docs/results/sa_evidence.md]"
            f"(docs/results/sa_evidence.md)): over {len(rows)} regression (suite, set) pairs, "
            f"the recommended `sa` (`attnuq.SARegressor`) is the best of the methods that need "
            f"no retraining on {ev['goal']['best']} and within {100 * GOAL_GAP:.0f} % of the "
            f"best on {ev['goal']['within']} of the {ev['goal']['compared']} compared")
    if worst:
        text += "; it is further behind on " + ", ".join(
            f"{r.suite} {r.dataset} ({100 * r.gap:+.1f} % against {r.best})" for r in worst
            if r.gap is not None)
    text += (". A rule on validation data alone, fixed in advance, predicts whether it beats "
             "plain split conformal: SARegressor's diagnostic `form` is spread-scaled "
             "(`sa-normalised` or `sa-floor`) and `spearman_spread_abs_error` exceeds "
             "max(0.1, 1.96 / sqrt(n_val - 1)). ")
    if not sp["scored"]:
        return [text + "Its record: nothing to score yet (records missing)."]
    bases = {k: max(t["beats"], t["scored"] - t["beats"]) for k, t in (("set", s), ("fit", sp))}
    text += (f"That rule was right on {s['right']} of {s['scored']} (suite, set) pairs and "
             f"{sp['right']} of {sp['scored']} (suite, set, split) fits; always answering the "
             f"more frequent outcome is right on {bases['set']} and {bases['fit']}")
    if s["right"] <= bases["set"] or sp["right"] <= bases["fit"]:
        text += (": on this evidence the rule does not tell a user reliably more than that "
                 "base rate, so compare `sa` with plain conformal on your own validation data")
    text += "."
    rows = centre_rows(ev["units"])
    if rows:
        text += (" `SARegressor(recentre=\"auto\")` (row `sa-centre`) also lets the validation "
                 "CRPS choose between the frozen output and the mean of SA's draws as the "
                 "centre: " + (line := centre_line(rows))[0].lower() + line[1:])
    srows = scaled_rows(ev["units"])
    if srows:
        text += (" Against the simplest calibrated SA row (`sa-conformal`, the paper's nu with "
                 "its spread scaled on the calibration part): "
                 + (line := scaled_line(srows))[0].lower() + line[1:])
    return [text]
