"""attnuq.models holds architectures only (#18): no training loop, no import of a higher layer.

Every module of src/attnuq/models is parsed (not imported): no import, anywhere in the module
(functions included), of attnuq.training, attnuq.methods/baselines, attnuq.calibration,
attnuq.bench or attnuq.cli; no name of the loops that moved to attnuq.training is defined.
Each check is also run on a synthetic source that breaks it, so a checker that found nothing
could not pass silently.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

MODELS = Path(__file__).resolve().parents[2] / "src" / "attnuq" / "models"
ABOVE = ("attnuq.training", "attnuq.methods", "attnuq.baselines", "attnuq.calibration",
         "attnuq.bench", "attnuq.cli", "attnuq.prediction", "attnuq.conformal")
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
            root = "attnuq" in mods  # the package facade is the top layer
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        if root:
            out.append(f"{name}:{node.lineno} imports attnuq")
        for m in mods:
            if any(m == a or m.startswith(a + ".") for a in ABOVE):
                out.append(f"{name}:{node.lineno} imports {m}")
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in MOVED:
            out.append(f"{name}:{node.lineno} defines {node.name} (moved to attnuq.training)")
    return out


def test_models_import_nothing_above_their_layer_and_hold_no_training_loop() -> None:
    files = sorted(MODELS.glob("*.py"))
    assert len(files) >= 5
    found = [v for f in files for v in _violations(f.read_text(), f.name)]
    assert found == []


@pytest.mark.parametrize(
    "source",
    [
        "def f():\n    from attnuq.training import fit\n",
        "import attnuq.methods\n",
        "from attnuq import training\n",
        "import attnuq\n",
        "def train_regressor(model):\n    pass\n",
    ],
)
def test_the_checker_finds_each_kind_of_violation(source: str) -> None:
    assert _violations(source, "x.py") != []


def test_the_checker_allows_lower_layers() -> None:
    ok = "from attnuq._validation import check_finite\nfrom attnuq.ops.levy import levy_attention\n"
    assert _violations(ok, "x.py") == []
