"""Every ``python`` code block of the README runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_examples() -> None:
    assert len(BLOCKS) >= 2, "README should show a Hugging Face and a Levy-layer example"


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code: str, capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})
    assert capsys.readouterr().out.strip(), "each example prints what it shows"


def test_docs_list_every_paper_departure() -> None:
    """docs/methods.md carries every NOTE(paper) remark of the source (regenerate if stale)."""
    import subprocess
    import sys

    script = README.parent / "scripts" / "collect_paper_notes.py"
    proc = subprocess.run([sys.executable, str(script), "--check"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_api_reference_is_current() -> None:
    """docs/api.md is what scripts/build_api_docs.py builds from today's docstrings."""
    import subprocess
    import sys

    script = README.parent / "scripts" / "build_api_docs.py"
    proc = subprocess.run([sys.executable, str(script), "--check"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr


def test_readme_results_block_is_current() -> None:
    """The README's results block is what the generated results pages say today."""
    import subprocess
    import sys

    script = README.parent / "scripts" / "update_readme_results.py"
    proc = subprocess.run([sys.executable, str(script), "--check"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
