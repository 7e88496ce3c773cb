"""Shared by the scripts that regenerate parts of the docs: marker blocks and --check mode."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def replace_block(text: str, start: str, end: str, body: str, where: Path) -> str:
    """Return ``text`` with the lines between the ``start`` and ``end`` markers set to ``body``."""
    if start not in text or end not in text:
        raise SystemExit(f"{where} lacks the markers {start} / {end}")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body.rstrip()}\n{end}{tail}"


def write_or_check(path: Path, render: Callable[[str], str], script: str, doc: str) -> int:
    """CLI of a generator script: write ``render(old)`` to ``path``, or with ``--check`` exit 1
    (naming ``script``) when ``path`` differs from what it would write."""
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--check", action="store_true", help=f"fail if {path.name} is stale")
    a = ap.parse_args()
    old = path.read_text() if path.is_file() else ""
    new = render(old)
    if a.check:
        if new != old:
            print(f"{path} is stale: run python scripts/{script}", file=sys.stderr)
            return 1
        return 0
    path.write_text(new)
    print(f"wrote {path}")
    return 0
