"""Models hold architectures only (#18): no training loop, no import of a higher layer.

Every module of src/attnuq/models and harness/src/attnuq_bench/models is parsed (not
imported): no import, anywhere in the module (functions included), of the training loop, the
methods, calibration, the suites, prediction, conformal or a CLI; no name of the loops that
moved to attnuq_bench.training is defined. Each check is also run on a synthetic source that
breaks it, so a checker that found nothing could not pass silently.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
#: the library's user-facing models and the harness's experiment architectures
MODELS = (ROOT / "src" / "attnuq" / "models", ROOT / "harness" / "src" / "attnuq_bench" / "models")
ABOVE = ("attnuq_bench.training", "attnuq_bench.methods", "attnuq.calibration",
         "attnuq_bench.suites", "attnuq.cli", "attnuq_bench.cli", "attnuq.montecarlo",
         "attnuq.conformal")
MOVED = ("train_regressor", "train_forecaster", "fit", "as_batches", "evaluate_rmse",
         "evaluate_mse", "predict_batched", "make_optimizer", "TrainResult", "TrainReport",
         "FitReport", "_tqdm")


def _violations(source: str, name: str) -> list[str]:
    tree = ast.parse(source)
    out = []
    for node in ast.walk(tree):
        mods: list[str] = []
        root = False
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
            root = bool({"attnuq", "attnuq_bench"} & set(mods))  # the facades are the top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        if root:
            out.append(f"{name}:{node.lineno} imports a package facade")
        for m in mods:
            if any(m == a or m.startswith(a + ".") for a in ABOVE):
                out.append(f"{name}:{node.lineno} imports {m}")
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in MOVED:
            out.append(f"{name}:{node.lineno} defines {node.name} (moved to attnuq_bench.training)")
    return out


def test_models_import_nothing_above_their_layer_and_hold_no_training_loop() -> None:
    files = sorted(f for d in MODELS for f in d.glob("*.py"))
    assert len(files) >= 5
    found = [v for f in files for v in _violations(f.read_text(), f.name)]
    assert found == []


@pytest.mark.parametrize(
    "source",
    [
        "def f():\n    from attnuq_bench.training import fit\n",
        "import attnuq_bench.methods\n",
        "from attnuq_bench import training\n",
        "import attnuq_bench\n",
        "import attnuq\n",
        "def train_regressor(model):\n    pass\n",
    ],
)
def test_the_checker_finds_each_kind_of_violation(source: str) -> None:
    assert _violations(source, "x.py") != []


def test_the_checker_allows_lower_layers() -> None:
    ok = "from attnuq._validation import check_finite\nfrom attnuq.ops.levy import levy_attention\n"
    assert _violations(ok, "x.py") == []
