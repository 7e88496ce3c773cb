"""Contract case of ``attnuq bench mortality`` (tests/bench/test_suite_contract.py): 80 synthetic
stays in the challenge format with an ``Outcomes-a.txt``, one model seed of each tiny backbone
(one epoch), every method; data and backbone cache in the folder both runs share."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from attnuq_bench.suites.mortality import DEFAULT_METHODS

SUITE = "mortality"
METHODS = sorted({m for ms in DEFAULT_METHODS.values() for m in ms})
VOLATILE = ("fit s",)
INTERRUPT = "attnuq_bench.suites._runner.RunStore.save"


def write_stays(root: Path, n: int = 80) -> None:
    """``n`` stays of HR and Temp over 48 h and their outcomes (every other stay dies)."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    outcomes = ["RecordID,SAPS-I,SOFA,Length_of_stay,Survival,In-hospital_death"]
    for i in range(n):
        rid = 140000 + i
        dies = i % 2
        lines = ["Time,Parameter,Value", f"00:00,RecordID,{rid}", f"00:00,Age,{40 + i % 50}",
                 "00:00,Weight,-1"]
        base = rng.uniform(60, 100) + 15 * dies
        for minute in sorted(rng.choice(48 * 60, 12, replace=False)):
            hh, mm = divmod(int(minute), 60)
            lines.append(f"{hh:02d}:{mm:02d},HR,{base + 5 * np.sin(minute / 300):.1f}")
            if minute % 2:
                lines.append(f"{hh:02d}:{mm:02d},Temp,{36 + rng.uniform(0, 2):.1f}")
        (root / f"{rid}.txt").write_text("\n".join(lines) + "\n")
        outcomes.append(f"{rid},1,1,5,-1,{dies}")
    (root / "Outcomes-a.txt").write_text("\n".join(outcomes) + "\n")


def argv(tmp: Path) -> list[str]:
    data = tmp.parent / "mortality_data"
    if not (data / "physionet2012").is_dir():
        write_stays(data / "physionet2012")
    return ["bench", "mortality", "--data-dir", str(data), "--seeds", "1", "--d", "8",
            "--layers", "1", "--levy-d", "8", "--levy-heads", "2", "--max-epochs", "1",
            "--cal-fraction", "0.45", "--ensemble", "2", "--mc-samples", "2", "--batch-size",
            "16", "--out", str(tmp / "mortality"), "--cache-dir",
            str(tmp.parent / "mortality_cache"), "--no-progress"]


def page(tmp: Path) -> Path:
    return tmp / "mortality.md"
