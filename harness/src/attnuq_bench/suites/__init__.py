"""Benchmark suites, registered by name and run with ``attnuq bench <suite>``.

A suite module calls :func:`register` at import time with a function
``run(args: argparse.Namespace) -> pathlib.Path`` (returning the results folder) and a function
``add_arguments(parser)`` adding its own options. The CLI imports every module listed in
``SUITES`` lazily, so a suite whose extras are missing fails only when it is asked for.

Each suite is data + backbone + config on a shared spine (no suite imports another):

* :mod:`attnuq_bench.suites._runner`: the method loop over (group, method) items chosen by name, one
  JSON per finished item written atomically, reused when its config matches (resume and merge),
  provenance per record;
* :mod:`attnuq_bench.suites._scoring`: the shared scores
  (:class:`~attnuq_bench.suites._scoring.StreamScores`,
  :func:`~attnuq_bench.suites._scoring.sample_scores`);
* :mod:`attnuq_bench.suites._page`: the results page object writing the markdown page and its JSON
  twin (title, provenance, headline lines, tables as data, Implementations block, the render
  state), the one number formatter, and ``docs/results/summary.json``;
* :mod:`attnuq_bench.suites._implementations`: the Implementations block, stored with the results;
* :mod:`attnuq_bench.suites._members`: ensemble members and backbone caching.

Every suite module also has ``render_page(out, table) -> Page``: the page built from the stored
JSON alone (no training, no writes), used by ``--render-only`` and by the page-regeneration test
(tests/attnuq_bench/suites/test_pages_regenerate.py); a suite may keep its page layout in a private
``bench/_<suite>_page.py`` that only it imports. Each suite plugs into the contract test
(tests/attnuq_bench/suites/test_suite_contract.py) with a case file
``tests/attnuq_bench/suites/_contract_<suite>.py``.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["REPORTS", "SUITES", "Suite", "get_suite", "register"]

#: suite name -> module that registers it
SUITES: dict[str, str] = {
    "uci": "attnuq_bench.suites.uci",
    "ett": "attnuq_bench.suites.ett",
    "era5": "attnuq_bench.suites.era5",
    "physionet": "attnuq_bench.suites.physionet",
    "calibration": "attnuq_bench.suites.nu_search",
    "mortality": "attnuq_bench.suites.mortality",
    "digits": "attnuq_bench.suites.digits",
}

#: report name -> module that registers it: commands of ``attnuq bench`` that read the suites'
#: stored results and train nothing (no runs to interrupt or resume, so outside the suites'
#: contract); registered and called like a suite
REPORTS: dict[str, str] = {
    "evidence": "attnuq_bench.suites.sa_evidence",
}


@dataclass(frozen=True)
class Suite:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], Path]


_REGISTRY: dict[str, Suite] = {}


def register(
    name: str,
    *,
    help: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], Path],
) -> Suite:
    """Register a benchmark suite under ``name`` (called by each suite module on import)."""
    suite = Suite(name=name, help=help, add_arguments=add_arguments, run=run)
    _REGISTRY[name] = suite
    return suite


def get_suite(name: str) -> Suite:
    """Import and return the suite (or report) ``name``; raise ``ValueError`` naming the known
    ones."""
    modules = {**SUITES, **REPORTS}
    if name not in modules:
        raise ValueError(f"unknown benchmark suite {name=}; known: {sorted(modules)}")
    if name not in _REGISTRY:
        importlib.import_module(modules[name])
    if name not in _REGISTRY:
        raise RuntimeError(f"module {modules[name]} did not register suite {name!r}")
    return _REGISTRY[name]
