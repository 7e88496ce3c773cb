"""Every results page says which implementation produced each row, and says it currently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnuq.bench._implementations import implementation_lines
from attnuq.methods import method_implementation

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"


def _local(suite: str) -> dict[str, str]:
    if suite == "ett":
        from attnuq.bench import ett

        return ett._IMPLEMENTATIONS
    if suite == "era5":
        from attnuq.bench import era5

        return era5._IMPLEMENTATIONS
    return {}  # uci: every row is a registered method


def _method_rows(lines: list[str]) -> list[str]:
    """First cells of every table whose header starts with ``| method |``, in page order."""
    rows, inside = [], False
    for line in lines:
        if line.startswith("| method |"):
            inside = True
            continue
        if inside and line.startswith("|"):
            cell = line.split("|")[1].strip()
            if not set(cell) <= set("- "):
                rows.append(cell)
        else:
            inside = False
    return rows


def test_implementation_lines_registry_local_and_errors() -> None:
    lines = implementation_lines(["swag", "swag", "naive"], local={"naive": "this suite"},
                                 scores=None)
    table = [x for x in lines if x.startswith("| ") and not x.startswith("| row")]
    assert table == [f"| swag | {method_implementation('swag')} |", "| naive | this suite |"]
    # a suite's own text wins over the registry for a row that shares a registered name
    assert "| conformal | own |" in implementation_lines(["conformal"], local={"conformal": "own"})
    with pytest.raises(ValueError, match="name='mystery'"):
        implementation_lines(["mystery"])


@pytest.mark.parametrize("suite", ["uci", "ett", "era5", "physionet"])
def test_committed_page_lists_the_current_implementation_of_every_row(suite: str) -> None:
    lines = (RESULTS / f"{suite}.md").read_text().splitlines()
    assert "## Implementations" in lines, f"{suite}.md has no Implementations block"
    start = lines.index("## Implementations")
    block = lines[start:]
    block = block[: next(i for i, x in enumerate(block) if x.startswith("Scores:")) + 1]
    listed = [x.split("|")[1].strip() for x in block if x.startswith("| ")][1:]
    rows = _method_rows(lines[:start])
    assert rows and set(rows) <= set(listed), (suite, sorted(set(rows) - set(listed)))
    # the block is what today's registry and suite texts give for these rows (re-render if not);
    # physionet's rows are labels built inside its page function: the render test below
    if suite != "physionet":
        assert block == implementation_lines(listed, local=_local(suite))[:-1]


def test_era5_and_physionet_pages_render_from_their_json(tmp_path: Path) -> None:
    """These two pages are exactly what their page functions make of the stored JSON."""
    from attnuq.bench import era5, physionet

    p = json.loads((RESULTS / "era5" / "era5_results.json").read_text())
    assert era5._markdown(p) == (RESULTS / "era5.md").read_text()
    res = json.loads((RESULTS / "physionet" / "physionet.json").read_text())
    per_seed = res.pop("per_seed")
    md = tmp_path / "physionet.md"
    physionet._write_md(md, RESULTS / "physionet", res, per_seed)
    assert md.read_text() == (RESULTS / "physionet.md").read_text()
