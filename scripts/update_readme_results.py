"""Copy the headline of each generated results page into the README.

The block between ``<!-- results:start -->`` and ``<!-- results:end -->`` of ``README.md`` is
rebuilt from the JSON twin of each page, ``docs/results/<suite>.json`` (written with the page by
``attnuq bench <suite>``, :class:`attnuq.bench._page.Page`): the page's title, date and its
headline lines (or headline table), with a link. Nothing is typed by hand. Transition (#18):
a suite whose page has no twin yet has its headline taken from the markdown page by line
prefix, as before (:data:`_LEGACY`); drop that once every suite writes its twin. ``--check``
exits 1 when the
README block is stale (the tests run it that way). ``docs/results/summary.json`` (issue #19's
machine-readable summary, each suite's key written by that suite) is named under the block when
it exists.
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

#: the suites whose headline the README shows, in README order
SUITES = ("uci", "ett", "era5", "physionet", "calibration")

#: transition only, for pages without a JSON twin: (line prefixes, heading of the first table)
_LEGACY: dict[str, tuple[tuple[str, ...], str | None]] = {
    "ett": (("Point forecasts:", "Best CRPS:"), None),
    "era5": (("Best CRPS:",), None),
    "physionet": ((), "## Accuracy and scores"),
}


def _legacy(suite: str, lines: list[str]) -> tuple[str, list[str]]:
    """(date, headline lines) scraped from a page without a twin (transition only)."""
    date = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("* date:")), "?")
    prefixes, heading = _LEGACY[suite]
    body, section = [], ""
    for x in lines:
        if x.startswith("## "):
            section = x[3:].strip()
        elif prefixes and x.startswith(prefixes):
            body.append(f"{section}: {x}" if section and suite == "era5" else x)
    if heading is not None and not body:
        start = next((i for i, x in enumerate(lines) if x.startswith(heading)), len(lines))
        for x in lines[start + 1:]:
            if x.startswith("|"):
                body.append(x)
            elif body:
                break
    return date, body


def summarise(suite: str) -> list[str]:
    """The README lines of ``suite``: bold title with link and date, then its headline."""
    page, twin_file = RESULTS / f"{suite}.md", RESULTS / f"{suite}.json"
    if not page.is_file():
        return [f"* `{suite}`: no results page yet (`attnuq bench {suite}`).", ""]
    if not twin_file.is_file() and suite in _LEGACY:
        lines = page.read_text().splitlines()
        date, body = _legacy(suite, lines)
        twin = {"title": lines[0].lstrip("# ").strip(), "provenance": {"date": date},
                "headline": [] if body[:1] and body[0].startswith("|") else body,
                "headline_table": body}
    elif not twin_file.is_file():
        return [f"* `{suite}`: its page has no JSON twin yet (`attnuq bench {suite}` writes "
                f"docs/results/{suite}.json).", ""]
    else:
        twin = json.loads(twin_file.read_text())
    date = (twin.get("provenance") or {}).get("date", "?")
    out = [f"**{twin['title']}** ([docs/results/{suite}.md](docs/results/{suite}.md), {date})",
           ""]
    if twin.get("headline"):
        return [*out, *[f"* {x[2:] if x.startswith('* ') else x}" for x in twin["headline"]], ""]
    return [*out, *(twin.get("headline_table") or []), ""]


def render(text: str) -> str:
    body: list[str] = []
    for suite in SUITES:
        body += summarise(suite)
    return replace_block(text, START, END, "\n".join(body), README)


def main() -> int:
    return write_or_check(README, render, "update_readme_results.py", __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
