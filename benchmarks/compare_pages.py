"""Compare the ratios of the performance pages with those committed at a git revision.

Reads ``docs/benchmarks/{sampled,levy,patch_overhead,predict}.json`` of the working tree (the
pages as re-measured) and of ``--base`` (``git show BASE:docs/benchmarks/<page>.json``, the pages
as committed), and writes a page listing every ratio: old, new, relative change ``new / old - 1``
and whether it lies within ``--tolerance`` (5 %) of the old one.

A ratio outside the tolerance can be load on the shared machine or the code. ``--runs DIR``
holds re-runs of the same benchmark scripts, one JSON per run, named
``<page>.<label>.<n>.json``: label ``post`` for the code of this tree, ``pre`` for the code the
committed pages measured (a checkout of that revision, run in the same session, alternating with
the ``post`` runs, so that both see the same machine). For each ratio outside the tolerance the
page lists both sets (count, median, range) and calls it

* ``noise``: the medians of the two codes measured now are within the tolerance of each other
  (the shift from the committed value is the machine's, not the code's);
* ``slower`` / ``faster``: they are not (the code of this tree is worse / better);
* ``no re-runs``: nothing to decide on.

Usage (from the repository root)::

    python benchmarks/compare_pages.py --base main --runs docs/benchmarks/after_split \\
        --out docs/benchmarks/after_split.md --json docs/benchmarks/after_split.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnuq._io import atomic_write_json, atomic_write_text

PAGES = ("sampled", "levy", "patch_overhead", "predict")


@dataclass(frozen=True)
class Ratio:
    """One ratio of a page: its value, the middle half of its per-pair values where the page
    records them, and which direction is better."""

    value: float
    iqr: tuple[float, float] | None
    lower_is_better: bool


def _iqr(x: Any) -> tuple[float, float] | None:
    return None if x is None else (float(x[0]), float(x[1]))


def _sampled(d: dict[str, Any]) -> dict[str, Ratio]:
    out = {
        f"speed: {r['variant']}": Ratio(float(r["ratio"]), _iqr((r.get("ratio_q25"),
                                                                  r.get("ratio_q75")))
                                        if r.get("ratio_q25") is not None else None, True)
        for r in d.get("speed", [])
    }
    mem = {r["variant"]: r for r in d.get("memory", [])}
    if "blocked" in mem:
        b = mem["blocked"]
        for name in ("dense", "dense-rows", "dense-unchunked"):
            if name not in mem:
                continue
            m = mem[name]
            out[f"memory: blocked / {name}, peak extra"] = Ratio(
                b["peak_extra_mb"] / m["peak_extra_mb"], None, True)
            out[f"memory: blocked / {name}, working"] = Ratio(
                (b["peak_extra_mb"] - b["output_mb"]) / (m["peak_extra_mb"] - m["output_mb"]),
                None, True)
    return out


def _levy(d: dict[str, Any]) -> dict[str, Ratio]:
    # the draws rows are sampler time / closed-form time: larger is better
    return {r["case"]: Ratio(float(r["ratio"]), None, not r["case"].startswith("50 explicit"))
            for r in d["rows"]}


def _patch(d: dict[str, Any]) -> dict[str, Ratio]:
    out: dict[str, Ratio] = {}
    for r in d["rows"]:
        out[f"{r['model']}: cpu ratio"] = Ratio(float(r["cpu_ratio"]),
                                                _iqr(r.get("cpu_ratio_iqr")), True)
        out[f"{r['model']}: wall ratio"] = Ratio(float(r["ratio"]), None, True)
    for r in d.get("op_rows", []):
        out[f"operator {r['shape']} {r['mask']}: sampled / SDPA"] = Ratio(
            float(r["ratio"]), None, True)
    return out


def _predict(d: dict[str, Any]) -> dict[str, Ratio]:
    return {f"{r['model']}: speed-up": Ratio(float(r["speedup"]), _iqr(r.get("speedup_iqr")),
                                             False)
            for r in d["rows"]}


EXTRACT: dict[str, Callable[[dict[str, Any]], dict[str, Ratio]]] = {
    "sampled": _sampled, "levy": _levy, "patch_overhead": _patch, "predict": _predict,
}


def _committed(base: str, page: str) -> dict[str, Any]:
    text = subprocess.run(["git", "show", f"{base}:docs/benchmarks/{page}.json"],
                          check=True, capture_output=True, text=True).stdout
    return json.loads(text)


def _runs(runs: Path | None, page: str, label: str) -> list[dict[str, Ratio]]:
    if runs is None:
        return []
    files = sorted(runs.glob(f"{page}.{label}.*.json"),
                   key=lambda p: int(p.name.split(".")[-2]))
    return [EXTRACT[page](json.loads(f.read_text())) for f in files]


def _date(d: dict[str, Any]) -> str:
    return str(d.get("date") or d.get("run", {}).get("date", "?"))


def _command(d: dict[str, Any]) -> str:
    return str(d.get("command") or d.get("run", {}).get("command", "?"))


def _fmt(x: float) -> str:
    return f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"


def _range(iqr: tuple[float, float] | None) -> str:
    return "-" if iqr is None else f"{_fmt(iqr[0])}-{_fmt(iqr[1])}"


def _spread(vals: list[float]) -> str:
    if not vals:
        return "-"
    return f"{len(vals)}: {_fmt(statistics.median(vals))} ({_fmt(min(vals))}-{_fmt(max(vals))})"


def compare(base: str, docs: Path, runs: Path | None, tol: float,
            variants: dict[str, str] | None = None) -> dict[str, Any]:
    """Every ratio of every page: old (at ``base``), new (``docs``), change, re-runs (and the
    runs of each diagnostic variant, label -> what it changes)."""
    variants = variants or {}
    result: dict[str, Any] = {"base": base, "tolerance": tol, "variants": variants,
                              "pages": {}}
    for page in PAGES:
        old_d = _committed(base, page)
        new_d = json.loads((docs / f"{page}.json").read_text())
        old, new = EXTRACT[page](old_d), EXTRACT[page](new_d)
        post, pre = _runs(runs, page, "post"), _runs(runs, page, "pre")
        var_runs = {label: _runs(runs, page, label) for label in variants}
        rows = []
        for case, o in old.items():
            n = new.get(case)
            row: dict[str, Any] = {"case": case, "old": o.value,
                                   "old_iqr": o.iqr, "lower_is_better": o.lower_is_better}
            if n is None:
                rows.append({**row, "new": None, "verdict": "missing in the new page"})
                continue
            change = n.value / o.value - 1
            within = abs(change) <= tol
            worse = change > 0 if o.lower_is_better else change < 0
            row.update(new=n.value, new_iqr=n.iqr, change=change, within=within)
            if not within:
                post_v = [n.value] + [r[case].value for r in post if case in r]
                pre_v = [r[case].value for r in pre if case in r]
                row.update(post_runs=post_v, pre_runs=pre_v, variant_runs={
                    label: [r[case].value for r in rs if case in r]
                    for label, rs in var_runs.items() if any(case in r for r in rs)})
                if pre_v:
                    rel = statistics.median(post_v) / statistics.median(pre_v) - 1
                    row["post_vs_pre"] = rel
                    if abs(rel) <= tol:
                        row["verdict"] = "noise"
                    else:
                        slower = rel > 0 if o.lower_is_better else rel < 0
                        row["verdict"] = "slower" if slower else "faster"
                else:
                    row["verdict"] = "no re-runs" if worse else "better (no re-runs)"
            rows.append(row)
        result["pages"][page] = {
            "old_date": _date(old_d), "new_date": _date(new_d), "command": _command(new_d),
            "post_runs": len(post), "pre_runs": len(pre), "rows": rows,
        }
    return result


def render(res: dict[str, Any]) -> str:
    tol = res["tolerance"]
    pct = f"{100 * tol:g} %"
    lines = [
        "# Performance pages after the package split (#31)",
        "",
        "Generated by `python benchmarks/compare_pages.py` (the full command, with the notes "
        "below, is in the JSON twin of this page) from the pages' JSON: *old* is the "
        f"ratio committed at `{res['base']}`, *new* the one of the re-measured page beside this "
        f"one; change = new / old - 1; *within* = |change| <= {pct}. *Better* says which "
        "direction of a ratio is the good one. The IQR columns are the middle half of the "
        "per-pair ratios where a page records them (how much a ratio moves within one run).",
        "",
    ]
    out_of_tol = []
    for page, p in res["pages"].items():
        lines += [
            f"## {page}",
            "",
            f"* command: `{p['command']}`; old run {p['old_date']}, new run {p['new_date']}",
            "",
            "| case | better | old | old IQR | new | new IQR | change | within |",
            "|---|---|---:|---|---:|---|---:|:---:|",
        ]
        for r in p["rows"]:
            better = "lower" if r["lower_is_better"] else "higher"
            oiqr = _range(r["old_iqr"])
            if r.get("new") is None:
                lines.append(f"| {r['case']} | {better} | {_fmt(r['old'])} | {oiqr} | - | - | - "
                             f"| {r['verdict']} |")
                continue
            niqr = _range(r["new_iqr"])
            mark = "yes" if r["within"] else "**no**"
            lines.append(f"| {r['case']} | {better} | {_fmt(r['old'])} | {oiqr} | "
                         f"{_fmt(r['new'])} | {niqr} | {100 * r['change']:+.1f} % | {mark} |")
            if not r["within"]:
                out_of_tol.append((page, r))
        n_in = sum(1 for r in p["rows"] if r.get("within"))
        lines += ["", f"{n_in} of {len(p['rows'])} ratios within {pct}.", ""]
    lines += [f"## Ratios outside {pct}: re-runs", ""]
    if not out_of_tol:
        lines += ["None.", ""]
    else:
        lines += _rerun_lines(res, out_of_tol, pct)
    if res.get("notes"):
        lines += ["## Notes", "", *(f"* {n}" for n in res["notes"]), ""]
    return "\n".join(lines)


def _rerun_lines(res: dict[str, Any], out_of_tol: list[tuple[str, dict[str, Any]]],
                 pct: str) -> list[str]:
    lines = [
        "Each case outside the tolerance was measured again by re-running its page's script "
        "(same options, outputs kept in `docs/benchmarks/after_split/`): *this code* = the "
        "page's run and its re-runs with the code of this tree; *pre-split code* = the same "
        f"script at {res.get('pre_revision') or 'the revision the committed page measured'}, "
        "run in the same session "
        "alternately with this code's re-runs. Columns: count: median (min-max). "
        f"*this / pre* = ratio of the two medians - 1. Verdict: `noise` when the two codes "
        f"measured now are within {pct} of each other; `slower` / `faster` when this code is "
        f"worse / better by more; `better (no re-runs)` for a move in the good direction.",
        "",
        "| page | case | better | old | this code | pre-split code | this / pre | verdict |",
        "|---|---|---|---:|---|---|---:|---|",
    ]
    for page, r in out_of_tol:
        better = "lower" if r["lower_is_better"] else "higher"
        rel = "-" if "post_vs_pre" not in r else f"{100 * r['post_vs_pre']:+.1f} %"
        lines.append(f"| {page} | {r['case']} | {better} | {_fmt(r['old'])} | "
                     f"{_spread(r['post_runs'])} | {_spread(r['pre_runs'])} | {rel} | "
                     f"{r['verdict']} |")
    lines.append("")
    diag = [(page, r, label, vals) for page, r in out_of_tol
            for label, vals in r.get("variant_runs", {}).items()]
    if diag:
        lines += [
            "Diagnostic runs of this code with one option changed (count: median (min-max)):",
            "",
            "| page | case | old | this code | variant | variant runs |",
            "|---|---|---:|---|---|---|",
        ]
        for page, r, label, vals in diag:
            lines.append(f"| {page} | {r['case']} | {_fmt(r['old'])} | "
                         f"{_spread(r['post_runs'])} | {res['variants'][label]} | "
                         f"{_spread(vals)} |")
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="main", help="git revision of the committed pages")
    ap.add_argument("--docs", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--runs", type=Path, default=None,
                    help="folder of re-runs <page>.<post|pre>.<n>.json")
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--pre-revision", default=None,
                    help="the revision the pre runs measured (named on the page)")
    ap.add_argument("--note", action="append", default=[],
                    help="a sentence for the page's notes (what a verdict means); repeatable")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=TEXT",
                    help="runs <page>.LABEL.<n>.json of this code with an option changed "
                         "(TEXT says which); repeatable")
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/after_split.md"))
    ap.add_argument("--json", type=Path, default=Path("docs/benchmarks/after_split.json"))
    args = ap.parse_args(argv)
    if not 0 < args.tolerance < 1:
        ap.error(f"--tolerance must lie in (0, 1), got {args.tolerance}")
    if args.runs is not None and not args.runs.is_dir():
        ap.error(f"--runs must be a folder, got {args.runs}")
    variants = {}
    for v in args.variant:
        label, sep, text = v.partition("=")
        if not sep or not label or label in ("pre", "post") or "." in label:
            ap.error(f"--variant must be LABEL=TEXT (LABEL not pre/post, no dot), got {v!r}")
        variants[label] = text
    try:
        res = compare(args.base, args.docs, args.runs, args.tolerance, variants)
    except subprocess.CalledProcessError as exc:
        ap.error(f"--base {args.base!r}: git show failed: {exc.stderr.strip()}")
    except (OSError, KeyError, ValueError) as exc:
        ap.error(f"cannot read a page's JSON: {type(exc).__name__}: {exc}")
    res["notes"] = list(args.note)
    res["pre_revision"] = args.pre_revision
    res["command"] = "python benchmarks/compare_pages.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    text = render(res)
    atomic_write_text(args.out, text)
    atomic_write_json(args.json, res, indent=2)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
