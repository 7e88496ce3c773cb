"""Contract case of ``attnuq bench calibration``: the exact-answer model, every criterion, one
seed, a small grid and BO budget."""

from __future__ import annotations

from pathlib import Path

from attnuq.calibration import CRITERIA

SUITE = "calibration"
METHODS = ["uniform-mha"]  # the rows are models; every criterion runs on it
VOLATILE = ()
INTERRUPT = "attnuq_bench.suites._runner.RunStore.save"


def argv(tmp: Path) -> list[str]:
    return ["bench", "calibration", "--models", "uniform-mha", "--criteria", *CRITERIA,
            "--seeds", "1", "--nu-max", "64", "--grid-size", "5", "--max-evals", "2",
            "--n-passes", "2", "--out", str(tmp / "calibration")]


def page(tmp: Path) -> Path:
    return tmp / "calibration.md"
