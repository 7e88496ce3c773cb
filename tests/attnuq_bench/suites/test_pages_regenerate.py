"""Every committed results page is what its suite's render path makes of the stored JSON.

Issue #18: ``docs/results/<page>.md`` regenerates byte-identical (or with only its date line
changed) from the stored results by the suite module's ``render_page(out, table)`` (the path of
``attnuq bench <suite> --render-only``), which reads the stored JSON only; the committed JSON
twin ``docs/results/<page>.json`` is that page's data (what the README reads).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from attnuq_bench.suites import REPORTS, SUITES

RESULTS = Path(__file__).resolve().parents[3] / "docs" / "results"

#: (suite, page): every committed page; calibration has a second one (nu up to 1024); the
#: report ``evidence`` writes sa_evidence.md (issue #34)
PAGES = [(s, s) for s in SUITES] + [("calibration", "calibration_nu1024"),
                                    ("evidence", "sa_evidence")]
MODULES = {**SUITES, **REPORTS}


def _dateless(text: str) -> list[str]:
    return [x for x in text.splitlines() if not x.startswith("* date:")]


def check_twin(twin: dict, suite: str) -> None:
    """The shape every JSON twin has (:class:`attnuq_bench.suites._page.Page`)."""
    from attnuq_bench.suites._page import TWIN_KEYS

    assert set(twin) == set(TWIN_KEYS), sorted(set(twin) ^ set(TWIN_KEYS))
    assert twin["suite"] == suite and isinstance(twin["title"], str) and twin["title"]
    assert {"command", "date", "machine"} <= set(twin["provenance"])
    assert all(isinstance(x, str) for x in twin["headline"])
    assert twin["headline"] or twin["headline_table"], "nothing for the README to show"
    for sec in twin["sections"]:
        for t in sec["tables"]:
            assert t["columns"] and all(len(r) == len(t["columns"]) for r in t["rows"])
            assert "values" not in t or len(t["values"]) == len(t["rows"])
    json.dumps(twin, allow_nan=False)  # strict JSON: no NaN


def test_every_committed_page_is_covered() -> None:
    pages = {p.stem for p in RESULTS.glob("*.md")}
    assert pages == {page for _, page in PAGES}, sorted(pages ^ {page for _, page in PAGES})


@pytest.mark.parametrize(("suite", "page"), PAGES, ids=[p for _, p in PAGES])
def test_committed_page_regenerates_from_its_stored_json(suite: str, page: str) -> None:
    mod = importlib.import_module(MODULES[suite])
    md = RESULTS / f"{page}.md"
    rendered = mod.render_page(RESULTS / page, md)
    assert _dateless(rendered.markdown()) == _dateless(md.read_text()), (
        f"{md.name} is not what `attnuq bench {suite} --render-only` writes from its stored JSON")
    twin_file = md.with_suffix(".json")
    assert twin_file.is_file(), f"{twin_file.name} (the page's JSON twin) is not committed"
    twin = json.loads(twin_file.read_text())
    check_twin(twin, suite)
    new = rendered.to_dict()
    for t in (twin, new):
        t["provenance"] = {k: v for k, v in t["provenance"].items() if k != "date"}
    assert new == twin, f"{twin_file.name} is stale (`attnuq bench {suite} --render-only`)"
