"""Contract case of ``attnuq bench uci`` (tests/attnuq_bench/suites/test_suite_contract.py): every
method on one bundled split of concrete, one-epoch backbone, a few samples; backbone and members
cached in the folder both runs share."""

from __future__ import annotations

from pathlib import Path

from attnuq_bench.suites.uci import DEFAULT_METHODS

SUITE = "uci"
METHODS = list(DEFAULT_METHODS)
VOLATILE = ("fit s",)
INTERRUPT = "attnuq_bench.suites._runner.RunStore.save"


def argv(tmp: Path) -> list[str]:
    return ["bench", "uci", "--datasets", "concrete", "--splits", "1", "--data-dir", "bundled",
            "--out", str(tmp / "uci"), "--cache-dir", str(tmp.parent / "uci_models"),
            "--n-blocks", "1", "--max-epochs", "1", "--patience", "1", "--n-samples", "8",
            "--swag-epochs", "1", "--no-progress"]


def page(tmp: Path) -> Path:
    return tmp / "uci.md"
