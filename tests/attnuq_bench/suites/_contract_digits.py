"""Contract case of ``attnuq bench digits`` (tests/bench/test_suite_contract.py): 400 of the
digits images, one model seed of a one-block ViT (one epoch), every method; the backbone cache
lives in the folder both runs share."""

from __future__ import annotations

from pathlib import Path

from attnuq_bench.suites.digits import DEFAULT_METHODS

SUITE = "digits"
METHODS = list(DEFAULT_METHODS)
VOLATILE = ("fit s",)
INTERRUPT = "attnuq_bench.suites._runner.RunStore.save"


def argv(tmp: Path) -> list[str]:
    return ["bench", "digits", "--max-images", "400", "--seeds", "1", "--embed-dim", "16",
            "--depth", "1", "--heads", "2", "--max-epochs", "1", "--ensemble", "2",
            "--mc-samples", "2", "--out", str(tmp / "digits"), "--cache-dir",
            str(tmp.parent / "digits_cache"), "--no-progress"]


def page(tmp: Path) -> Path:
    return tmp / "digits.md"
