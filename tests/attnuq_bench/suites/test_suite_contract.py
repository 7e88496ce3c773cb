"""The contract of every benchmark suite, on tiny data (issue #18).

Each suite plugs in with a case file ``tests/attnuq_bench/suites/_contract_<suite>.py`` (owned by
the suite's author) defining, as module attributes:

* ``SUITE``: the suite name (``attnuq bench <SUITE>``);
* ``METHODS``: every method (row) the suite runs;
* ``argv(tmp: Path) -> list[str]``: a tiny ``attnuq bench ...`` argv writing everything under
  ``tmp`` (``tmp.parent`` is shared by the two runs of a test: caches of data or models may go
  there);
* ``page(tmp: Path) -> Path``: the markdown page that argv writes;
* ``VOLATILE``: table columns that differ from run to run (wall times);
* ``INTERRUPT``: ``"module.Class.method"`` (or ``"module.function"``) that the interrupted run
  makes raise ``KeyboardInterrupt`` on its second call (``None``: the suite cannot be
  interrupted between items, which the test then reports as a failure).

For every case the test runs the suite through the real entry point (:func:`attnuq.cli.main`):
once straight through, once interrupted after its first stored item and then resumed; both must
give the same page (its JSON twin: headline and tables, volatile columns dropped), the twin must
be valid, every method must have a row, and ``--render-only`` must write the same page again.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from attnuq.cli import main
from attnuq_bench.suites import SUITES

HERE = Path(__file__).resolve().parent
CASE_FILES = sorted(HERE.glob("_contract_*.py"))


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_contract_case_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


CASES = {path.stem.removeprefix("_contract_"): path for path in CASE_FILES}


def _check_twin(twin: dict[str, Any], suite: str) -> None:
    from attnuq_bench.suites._page import TWIN_KEYS

    assert set(twin) == set(TWIN_KEYS), sorted(set(twin) ^ set(TWIN_KEYS))
    assert twin["suite"] == suite and twin["title"]
    assert {"command", "date", "machine"} <= set(twin["provenance"])
    assert twin["headline"] or twin["headline_table"]
    # a page of method rows says which code produced them (calibration compares searches: none)
    assert twin["implementations"] is None or twin["implementations"]["rows"]
    for sec in twin["sections"]:
        for t in sec["tables"]:
            assert all(len(r) == len(t["columns"]) for r in t["rows"])
    json.dumps(twin, allow_nan=False)  # strict JSON: no NaN


def _comparable(twin: dict[str, Any], volatile: tuple[str, ...]) -> dict[str, Any]:
    """Headline and tables of a twin without the volatile columns."""
    tables = []
    for sec in twin["sections"]:
        for t in sec["tables"]:
            keep = [i for i, c in enumerate(t["columns"]) if c not in volatile]
            tables.append((sec["heading"], [t["columns"][i] for i in keep],
                           [[r[i] for i in keep] for r in t["rows"]]))
    # a headline table is also one of the section tables (Page.table(t, headline=True)), where
    # its volatile columns are dropped; here only whether there is one
    return {"headline": twin["headline"], "headline_table": twin["headline_table"] is not None,
            "tables": tables, "implementations": twin["implementations"]}


def _rows(twin: dict[str, Any]) -> set[str]:
    return {r[0].strip("*") for sec in twin["sections"] for t in sec["tables"] for r in t["rows"]}


def _interrupt(monkeypatch: pytest.MonkeyPatch, target: str) -> None:
    """Make ``target`` raise KeyboardInterrupt on its second call (the first one goes through)."""
    mod_name, _, attr = target.rpartition(".")
    try:
        owner: Any = importlib.import_module(mod_name)
    except ModuleNotFoundError:  # "module.Class.method"
        mod_name, _, cls = mod_name.rpartition(".")
        owner = getattr(importlib.import_module(mod_name), cls)
    original = getattr(owner, attr)
    calls = []

    def wrapped(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt("interrupted by the contract test")
        return original(*a, **kw)

    monkeypatch.setattr(owner, attr, wrapped)


def test_every_suite_has_a_contract_case() -> None:
    missing = sorted(set(SUITES) - set(CASES))
    assert set(CASES) == set(SUITES), f"suites without a case file: {missing}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_suite_runs_every_method_and_an_interrupted_run_resumes_to_the_same_page(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = _load(CASES[name])
    assert case.SUITE == name and case.SUITE in SUITES
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(case.argv(straight)) == 0
    twin_a = json.loads(case.page(straight).with_suffix(".json").read_text())
    _check_twin(twin_a, name)
    assert set(case.METHODS) <= _rows(twin_a), sorted(set(case.METHODS) - _rows(twin_a))
    # issue #20: a run with both rows of an ablation pair shows the spine's ablation table
    from attnuq_bench.suites._ablation import PAIRS

    pairs = [[what, a, b] for what, a, b in PAIRS if {a, b} <= set(case.METHODS)]
    shown = [r[:3] for sec in twin_a["sections"] for t in sec["tables"]
             if t["columns"][0] == "ablation" for r in t["rows"]]
    assert all(p in shown for p in pairs) and all(r in pairs for r in shown), (pairs, shown)

    assert case.INTERRUPT is not None, f"{name}: no point to interrupt the run at"
    with monkeypatch.context() as m:
        _interrupt(m, case.INTERRUPT)
        with pytest.raises(KeyboardInterrupt):
            main(case.argv(resumed))
    assert main(case.argv(resumed)) == 0
    twin_b = json.loads(case.page(resumed).with_suffix(".json").read_text())
    _check_twin(twin_b, name)
    volatile = tuple(case.VOLATILE)
    assert _comparable(twin_b, volatile) == _comparable(twin_a, volatile)

    # the render path alone writes the same page again from what the run stored
    page = case.page(resumed)
    before = page.read_text()
    assert main([*case.argv(resumed), "--render-only"]) == 0
    assert page.read_text() == before
