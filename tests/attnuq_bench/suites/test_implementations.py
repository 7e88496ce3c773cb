"""Every results page says which implementation produced each row, as stored with its results."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnuq_bench.methods import method_implementation
from attnuq_bench.suites._implementations import (
    INTRO_TEXT,
    block_from_page,
    block_lines,
    implementation_block,
    implementation_lines,
    merge_block,
)

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "docs" / "results"


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
def test_committed_page_lists_every_row_and_its_block_round_trips(suite: str) -> None:
    lines = (RESULTS / f"{suite}.md").read_text().splitlines()
    assert "## Implementations" in lines, f"{suite}.md has no Implementations block"
    start = lines.index("## Implementations")
    block = block_from_page(lines)
    assert block is not None and block["rows"]
    listed = [name for name, _ in block["rows"]]
    rows = _method_rows(lines[:start])
    if suite != "physionet":  # physionet's method column holds labels, its block the same labels
        assert rows and set(rows) <= set(listed), (suite, sorted(set(rows) - set(listed)))
    # the block as data renders back to the page's lines (the stored form loses nothing)
    assert block_lines(block)[:-1] == lines[start:start + len(block_lines(block)) - 1]


def test_block_is_data_and_stored_texts_win() -> None:
    today = implementation_block(["swag", "naive"], local={"naive": "own"})
    assert today["intro"] == INTRO_TEXT and today["rows"] == [
        ["swag", method_implementation("swag")], ["naive", "own"]]
    assert block_lines(today) == implementation_lines(["swag", "naive"], local={"naive": "own"})
    # rows as a mapping read the same as rows as pairs
    assert block_lines({**today, "rows": dict(today["rows"])}) == block_lines(today)
    prev = {"intro": "old intro", "rows": [["swag", "old swag text"]], "scores": "old scores"}
    # a text the runs recorded wins; else the earlier stored block's; else today's registry
    got = merge_block(["swag", "laplace"], {"swag": None, "laplace": "recorded"}, prev)
    assert got == {"intro": "old intro", "scores": "old scores",
                   "rows": [["swag", "old swag text"], ["laplace", "recorded"]]}
    fresh = merge_block(["swag"], {"swag": None}, None)
    assert fresh["rows"] == [["swag", method_implementation("swag")]]
    assert fresh["intro"] == INTRO_TEXT
    with pytest.raises(ValueError, match="string pairs"):
        block_lines({"intro": "i", "rows": [["a"]], "scores": None})
