"""Contract case of ``attnuq bench physionet`` (tests/attnuq_bench/suites/test_suite_contract.py):
15 synthetic stays in the challenge format, two model seeds of a tiny forecaster (one epoch), every
row; the data and the checkpoint cache live in the folder both runs share, and ``--reuse`` lets the
resumed run take the seed records the interrupted one stored."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SUITE = "physionet"
_TAG = " [subset: 2 test stays]"
METHODS = [
    "Levy (one pass, MSE + 0.1 x CRPS, sigma_total)",
    "Levy, sigma conditional on N >= 1, no prior term (ablation)",
    "Levy, sigma without phi (ablation)", "softmax control (deterministic)",
    "Levy (one pass)" + _TAG, "Levy (one pass), sigma conditional on N >= 1, alpha as trained"
    + _TAG,
    "Levy, explicit Poisson sampler (4 draws), alpha as trained" + _TAG,
    "softmax control, MC dropout (2 passes)" + _TAG,
    "softmax deep ensemble (2 members, one ensemble)", "per-stay per-channel exact GP (one fit)",
]
#: wall times: training seconds per model, one-pass throughput
VOLATILE = ("Levy s", "softmax s", "stays/s")
#: the runner saves one seed record per call: the second seed is interrupted
INTERRUPT = "attnuq_bench.suites._runner.RunStore.save"


def _write_stays(root: Path) -> None:
    spec = importlib.util.spec_from_file_location(
        "_physionet_bench", Path(__file__).with_name("test_physionet_bench.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod._write_stays(root, 15)


def argv(tmp: Path) -> list[str]:
    data = tmp.parent / "physionet_data"
    if not (data / "physionet2012").is_dir():
        _write_stays(data / "physionet2012")
    return ["bench", "physionet", "--data-dir", str(data), "--seeds", "2", "--d", "8",
            "--max-epochs", "1", "--sub-stays", "2", "--mc-passes", "2", "--sampler-draws", "4",
            "--ensemble-members", "2", "--gp-train-stays", "4", "--gp-iters", "2", "--plots", "1",
            "--out", str(tmp / "physionet"), "--cache-dir", str(tmp.parent / "physionet_cache"),
            "--reuse", "--device", "cpu", "--uq-weights", "0.1"]


def page(tmp: Path) -> Path:
    return tmp / "physionet.md"
