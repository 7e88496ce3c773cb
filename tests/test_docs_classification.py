"""The complete example of docs/classification.md runs as written and prints its numbers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "classification.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_classification_doc_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    full = [b for b in BLOCKS if "def data(" in b]
    assert len(full) == 1, "docs/classification.md should hold one complete example"
    exec(compile(full[0], str(DOC), "exec"), {"__name__": "__doc_example__"})
    out = capsys.readouterr().out
    assert "90 % sets: coverage" in out and "AURC" in out
