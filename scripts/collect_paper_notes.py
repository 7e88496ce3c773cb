"""Collect every ``NOTE(paper):`` remark of the source into ``docs/methods.md``.

The remarks mark each place where attnuq departs from the two papers. This script rewrites the
block between ``<!-- paper-notes:start -->`` and ``<!-- paper-notes:end -->`` of the method notes
with one bullet per remark (file and text). ``--check`` exits 1 when the block is stale (the
tests run it that way, so a new remark cannot be forgotten in the docs).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from _generated import replace_block, write_or_check

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "methods.md"
START, END = "<!-- paper-notes:start -->", "<!-- paper-notes:end -->"


def _remark(lines: list[str], i: int) -> str:
    """The remark starting on line ``i``: following lines of the same comment or paragraph."""
    first = lines[i]
    is_comment = first.lstrip().startswith("#")
    text = [first.split("NOTE(paper):", 1)[1].strip()]
    for line in lines[i + 1 :]:
        s = line.strip()
        if is_comment:
            if not s.startswith("#") or "NOTE(paper)" in s:
                break
            text.append(s.lstrip("#").strip())
        else:
            if not s or s.startswith(('"""', "'''", "NOTE(", "Parameters", "Examples", "----")):
                break
            if re.match(r"^\w[\w, ]* : ", s):  # the next numpydoc parameter entry
                break
            text.append(s.rstrip('"').strip())
    return re.sub(r"\s+", " ", " ".join(text)).strip()


def collect() -> list[str]:
    bullets = []
    paths = [*(ROOT / "src" / "attnuq").rglob("*.py"),
             *(ROOT / "harness" / "src" / "attnuq_bench").rglob("*.py")]
    for path in sorted(paths):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if "NOTE(paper):" in line:
                rel = path.relative_to(ROOT)
                bullets.append(f"* `{rel}`: {_remark(lines, i)}")
    return bullets


def render(doc: str) -> str:
    return replace_block(doc, START, END, "\n".join(collect()), DOC)


def main() -> int:
    return write_or_check(DOC, render, "collect_paper_notes.py", __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
