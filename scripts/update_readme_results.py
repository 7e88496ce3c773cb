"""Copy the headline of each generated results page into the README.

The block between ``<!-- results:start -->`` and ``<!-- results:end -->`` of ``README.md`` is
rebuilt from the JSON twin of each page, ``docs/results/<suite>.json`` (written with the page by
``attnuq bench <suite>``, :class:`attnuq_bench.suites._page.Page`): the page's title, date and its
headline lines (or headline table), with a link. Nothing is typed by hand and no markdown is
scraped; a page without a twin is listed as such. ``--check`` exits 1 when the
README block is stale (the tests run it that way). From ``docs/results/summary.json`` (issue
#19's machine-readable summary, each suite's key written by that suite) each suite gets one line
more: its frozen backbone's accuracy beside the reference it is held to.

The block between ``<!-- sa-rule:start -->`` and ``<!-- sa-rule:end -->`` is the paragraph on
what the regression evidence tells a user of ``sa`` (issue #34): the lines stored in
``docs/results/sa_evidence.json`` (``state.readme``, written by ``attnuq bench evidence``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from _generated import replace_block, write_or_check

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS = ROOT / "docs" / "results"
START, END = "<!-- results:start -->", "<!-- results:end -->"
SA_START, SA_END = "<!-- sa-rule:start -->", "<!-- sa-rule:end -->"

#: the suites whose headline the README shows, in README order
SUITES = ("uci", "ett", "era5", "physionet", "calibration", "mortality", "digits")

def backbone_line(suite: str) -> str | None:
    """``suite``'s frozen backbone beside its reference, per data set, from summary.json
    (``None`` when the file or the suite's key is missing)."""
    path = RESULTS / "summary.json"
    entries = json.loads(path.read_text()).get(suite) if path.is_file() else None
    if not entries:
        return None
    groups: dict[str, list[str]] = {}
    for ds, e in entries.items():
        b = e["backbone"]
        if b.get("value") is None:
            continue
        ref = "" if b.get("reference") is None else f" / {b['reference']:.4g}"
        head = b["metric"].upper() + (f", ours / {b['reference_name']}" if ref else "")
        groups.setdefault(head, []).append(f"{ds} {b['value']:.4g}{ref}")
    if not groups:
        return None
    return ("* frozen backbone (docs/results/summary.json): "
            + "; ".join(f"{h}: {', '.join(v)}" for h, v in groups.items()))


def summarise(suite: str) -> list[str]:
    """The README lines of ``suite``: bold title with link and date, then its headline."""
    page, twin_file = RESULTS / f"{suite}.md", RESULTS / f"{suite}.json"
    if not page.is_file():
        return [f"* `{suite}`: no results page yet (`attnuq bench {suite}`).", ""]
    if not twin_file.is_file():
        return [f"* `{suite}`: its page has no JSON twin yet (`attnuq bench {suite}` writes "
                f"docs/results/{suite}.json).", ""]
    else:
        twin = json.loads(twin_file.read_text())
    date = (twin.get("provenance") or {}).get("date", "?")
    out = [f"**{twin['title']}** ([docs/results/{suite}.md](docs/results/{suite}.md), {date})",
           ""]
    extra = backbone_line(suite)
    if twin.get("headline"):
        bullets = [f"* {x[2:] if x.startswith('* ') else x}" for x in twin["headline"]]
        return [*out, *bullets, *([extra] if extra else []), ""]
    return [*out, *(twin.get("headline_table") or []), *(["", extra] if extra else []), ""]


def sa_rule_lines(results: Path = RESULTS) -> list[str]:
    """The README paragraph of ``results/sa_evidence.json`` (its ``state.readme`` lines), or a
    line saying the page is not written yet."""
    twin_file = results / "sa_evidence.json"
    if not twin_file.is_file():
        return ["No SA evidence page yet (`attnuq bench evidence --out docs/results`)."]
    lines = (json.loads(twin_file.read_text()).get("state") or {}).get("readme")
    if not isinstance(lines, list) or not all(isinstance(x, str) for x in lines):
        raise SystemExit(f"{twin_file}: state.readme must be a list of strings")
    return lines


def render(text: str, results: Path = RESULTS) -> str:
    body: list[str] = []
    for suite in SUITES:
        body += summarise(suite)
    text = replace_block(text, START, END, "\n".join(body), README)
    return replace_block(text, SA_START, SA_END, "\n".join(sa_rule_lines(results)), README)


def main() -> int:
    return write_or_check(README, render, "update_readme_results.py", __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
