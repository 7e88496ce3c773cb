"""Copy the headline lines of each generated results page into the README.

The block between ``<!-- results:start -->`` and ``<!-- results:end -->`` of ``README.md`` is
rebuilt from ``docs/results/<suite>.md`` (pages written by ``attnuq bench <suite>``): the page's
title, date and its headline lines (or headline table), with a link. Nothing is typed by hand.
``--check`` exits 1 when the README block is stale (the tests run it that way).
"""

from __future__ import annotations

import sys
from pathlib import Path

from _generated import replace_block, write_or_check

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"

#: suite -> (line prefixes to copy, heading whose first table is copied when no prefix matches)
SUITES: dict[str, tuple[tuple[str, ...], str | None]] = {
    "uci": (("**Summary:**",), None),
    "ett": (("Point forecasts:", "Best CRPS:"), None),
    "era5": (("Best CRPS:",), None),
    "physionet": ((), "## Accuracy and scores"),
    "calibration": (("Summary:",), None),
}


def _first_table(lines: list[str], heading: str) -> list[str]:
    starts = [i for i, x in enumerate(lines) if x.startswith(heading)]
    if not starts:
        return []
    out: list[str] = []
    for line in lines[starts[0] + 1 :]:
        if line.startswith("|"):
            out.append(line)
        elif out:
            break
    return out


def summarise(suite: str) -> list[str]:
    page = ROOT / "docs" / "results" / f"{suite}.md"
    if not page.is_file():
        return [f"* `{suite}`: no results page yet (`attnuq bench {suite}`)."]
    lines = page.read_text().splitlines()
    title = lines[0].lstrip("# ").strip() if lines else suite
    date = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("* date:")), "?")
    prefixes, heading = SUITES[suite]
    body: list[str] = []
    section = ""
    for x in lines:
        if x.startswith("## "):
            section = x[3:].strip()
        elif prefixes and x.startswith(prefixes):
            body.append(f"{section}: {x}" if section and suite == "era5" else x)
    if heading is not None and not body:
        body = _first_table(lines, heading)
    out = [f"**{title}** ([docs/results/{suite}.md](docs/results/{suite}.md), {date})", ""]
    if body and body[0].startswith("|"):
        out += [*body, ""]
    else:
        out += [f"* {x[2:] if x.startswith('* ') else x}" for x in body] + [""]
    return out


def render(text: str) -> str:
    body: list[str] = []
    for suite in SUITES:
        body += summarise(suite)
    return replace_block(text, START, END, "\n".join(body), README)


def main() -> int:
    return write_or_check(README, render, "update_readme_results.py", __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
