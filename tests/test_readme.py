"""The README's examples run as written, its commands parse, and its generated blocks are current.

Every ``python`` block of README.md and docs/kernels.md (the internals moved out of the README)
is executed, except

* a block preceded by ``<!-- readme-test: not run (REASON) -->``: the reason is stated there and
  checked to be non-empty here;
* the README's regression example, which is ``examples/regression.py`` without its docstring
  (checked equal below) and runs as that file in
  tests/attnuq/estimators/test_regressor.py::test_readme_example_runs;
* a block that imports an optional integration is skipped only when that extra is not
  installed, naming the extra (``scripts/setup.sh`` installs every extra, so CI runs them all).
"""

from __future__ import annotations

import re
import shlex
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
KERNELS = ROOT / "docs" / "kernels.md"
EXAMPLE = ROOT / "examples" / "regression.py"

_BLOCK = re.compile(
    r"(?:<!-- readme-test: not run \((?P<why>[^\n]*)\) -->\n)?```python\n(?P<code>.*?)```",
    flags=re.S,
)

#: module imported by a block -> the extra of pyproject.toml that installs it
EXTRAS = {"transformers": "hf", "timm": "vision", "rtdl_revisiting_models": "tabular",
          "matplotlib": "plots"}


def _blocks(path: Path) -> list[tuple[str, str | None]]:
    """``(code, reason it is not run or None)`` of every python block of ``path``."""
    return [(m["code"], m["why"]) for m in _BLOCK.finditer(path.read_text())]


def _example_code() -> str:
    """examples/regression.py without its module docstring."""
    text = EXAMPLE.read_text()
    assert text.startswith('"""'), "examples/regression.py should open with its docstring"
    return text[text.index('"""', 3) + 3:].lstrip("\n")


README_BLOCKS = _blocks(README)
KERNEL_BLOCKS = _blocks(KERNELS)
RUN = [(f"{path.name}:block{i}", path, code)
       for path, blocks in ((README, README_BLOCKS), (KERNELS, KERNEL_BLOCKS))
       for i, (code, why) in enumerate(blocks)
       if why is None and code != _example_code()]


def test_readme_shows_the_examples_issue_32_asks_for() -> None:
    codes = [c for c, _ in README_BLOCKS]
    assert _example_code() in codes, (
        "README's regression example must be examples/regression.py without its docstring "
        "(copy the file's code into the README, or the README block into the file)")
    assert any("SARegressor(" in c and "output_fn=" in c for c in codes), "val_data example"
    assert any("LevyAttention(" in c for c in codes), "Levy attention example"
    assert any("SAClassifier(" in c for c in codes), "SAClassifier lines"
    assert len(RUN) >= 3  # the val_data, Levy and low-level (docs/kernels.md) examples


def test_blocks_not_run_say_why() -> None:
    for path, blocks in ((README, README_BLOCKS), (KERNELS, KERNEL_BLOCKS)):
        for i, (_, why) in enumerate(blocks):
            assert why is None or len(why.strip()) > 20, f"{path.name} block {i}: state a reason"


@pytest.mark.parametrize(("path", "code"), [(p, c) for _, p, c in RUN],
                         ids=[name for name, _, _ in RUN])
def test_example_runs(path: Path, code: str, capsys: pytest.CaptureFixture[str]) -> None:
    for module, extra in EXTRAS.items():
        if re.search(rf"^\s*(from|import) {module}\b", code, flags=re.M):
            pytest.importorskip(module, reason=f"this example needs the extra '{extra}' "
                                               f"(pip install '.[{extra}]')")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the estimator's warnings are part of what it shows
        exec(compile(code, str(path), "exec"), {"__name__": "__readme__"})
    assert capsys.readouterr().out.strip(), "each example prints what it shows"


def test_readme_commands_parse() -> None:
    """Each ``attnuq ...`` line of the README's bash blocks is accepted by the real parser."""
    from attnuq.cli import build_parser

    lines = [ln.strip() for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
             for ln in block.splitlines() if ln.strip().startswith("attnuq ")]
    commands = {shlex.split(ln)[1] for ln in lines}
    assert {"calibrate", "predict", "report", "bench", "demo"} <= commands, commands
    for ln in lines:
        argv = shlex.split(ln.split("#")[0])[1:]
        build_parser(argv).parse_args(argv)  # SystemExit (exit 2) on an unknown flag


def test_sa_rule_block_is_present() -> None:
    """The "When SA helps" section holds the marker pair that
    scripts/update_readme_results.py fills, in order, with text between them."""
    text = README.read_text()
    start, end = "<!-- sa-rule:start -->", "<!-- sa-rule:end -->"
    assert text.count(start) == 1 and text.count(end) == 1
    section = text.index("## When SA helps, and when plain conformal is as good")
    assert section < text.index(start) < text.index(end)
    assert text[text.index(start) + len(start):text.index(end)].strip()


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
