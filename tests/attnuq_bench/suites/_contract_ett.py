"""Contract case of ``attnuq bench ett`` (tests/attnuq_bench/suites/test_suite_contract.py): every
method (the default rows and the SA variants only named by ``--methods``) on a
tiny synthetic ETT-layout CSV (520 hourly rows), a one-layer PatchTST trained for one epoch, an
ensemble of two, a few samples. The run is interrupted at its second stored record (sa-paper is
stored, sa-conformal, scored from the same draws, is not) and resumed with ``--resume`` (part of
both argvs: a fresh folder has nothing to resume)."""

from __future__ import annotations

from pathlib import Path

from tests.attnuq_bench.suites._synthetic import tiny_ett_csv

from attnuq_bench.suites.ett import ALL_METHODS

SUITE = "ett"
METHODS = list(ALL_METHODS)
VOLATILE = ("fit s", "predict s")
INTERRUPT = "attnuq_bench.suites._runner.RunStore.save"


def _csv(path: Path, n: int = 520) -> Path:
    return path if path.is_file() else tiny_ett_csv(path, n)


def argv(tmp: Path) -> list[str]:
    tmp.parent.mkdir(parents=True, exist_ok=True)
    csv = _csv(tmp.parent / "tiny_ett.csv")
    return ["bench", "ett", "--file", str(csv), "--out", str(tmp), "--context", "48",
            "--horizon", "12", "--d-model", "8", "--layers", "1", "--heads", "2", "--ffn", "8",
            "--patch", "8", "--stride", "8", "--epochs", "1", "--ensemble", "2",
            "--swag-epochs", "1", "--swag-snapshots", "2", "--n-samples", "3", "--n-passes", "2",
            "--chunk", "64", "--val-stride", "1", "--no-progress", "--resume",
            "--methods", ",".join(ALL_METHODS)]


def page(tmp: Path) -> Path:
    return tmp / "ett.md"
