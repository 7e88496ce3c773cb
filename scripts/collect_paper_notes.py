"""Collect every ``NOTE(paper):`` remark of the source into ``docs/methods.md``.

The remarks mark each place where attnuq departs from the two papers. This script rewrites the
block between ``<!-- paper-notes:start -->`` and ``<!-- paper-notes:end -->`` of the method notes
with one bullet per remark (file and text). ``--check`` exits 1 when the block is stale (the
tests run it that way, so a new remark cannot be forgotten in the docs).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

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
    for path in sorted((ROOT / "src" / "attnuq").rglob("*.py")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if "NOTE(paper):" in line:
                rel = path.relative_to(ROOT)
                bullets.append(f"* `{rel}`: {_remark(lines, i)}")
    return bullets


def render(doc: str) -> str:
    if START not in doc or END not in doc:
        raise SystemExit(f"{DOC} lacks the markers {START} / {END}")
    head, rest = doc.split(START, 1)
    _, tail = rest.split(END, 1)
    body = "\n".join(collect())
    return f"{head}{START}\n{body}\n{END}{tail}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="fail if docs/methods.md is stale")
    a = ap.parse_args()
    doc = DOC.read_text()
    new = render(doc)
    if a.check:
        if new != doc:
            print("docs/methods.md is stale: run python scripts/collect_paper_notes.py",
                  file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
