"""Benchmark suites, registered by name and run with ``attnuq bench <suite>``.

A suite module calls :func:`register` at import time with a function
``run(args: argparse.Namespace) -> pathlib.Path`` (returning the results folder) and a function
``add_arguments(parser)`` adding its own options. The CLI imports every module listed in
``SUITES`` lazily, so a suite whose extras are missing fails only when it is asked for.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SUITES", "Suite", "get_suite", "register"]

#: suite name -> module that registers it
SUITES: dict[str, str] = {
    "uci": "attnuq.bench.uci",
    "ett": "attnuq.bench.ett",
    "era5": "attnuq.bench.era5",
    "physionet": "attnuq.bench.physionet",
    "calibration": "attnuq.bench.calibration",
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
    """Import and return the suite ``name``; raise ``ValueError`` naming the known suites."""
    if name not in SUITES:
        raise ValueError(f"unknown benchmark suite {name=}; known: {sorted(SUITES)}")
    if name not in _REGISTRY:
        importlib.import_module(SUITES[name])
    if name not in _REGISTRY:
        raise RuntimeError(f"module {SUITES[name]} did not register suite {name!r}")
    return _REGISTRY[name]
