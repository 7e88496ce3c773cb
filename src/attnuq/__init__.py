"""attnuq: prediction uncertainty from attention layers.

* Stochastic attention (SA) for frozen transformers: ``with attnuq.stochastic(model, nu=8): ...``
* Levy attention for irregular time series: :class:`attnuq.nn.LevyAttention`.

Public names are imported lazily so that ``import attnuq`` does not import optional extras.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("attnuq")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0+unknown"

# public name -> "module:attribute"
_LAZY: dict[str, str] = {
    "stochastic": "attnuq.patch:stochastic",
    "patch": "attnuq.patch:patch",
    "find_attention": "attnuq.patch:find_attention",
    "CalibrationReport": "attnuq.calibrate:CalibrationReport",
    "Predictive": "attnuq.predictive:Predictive",
    "GaussianPredictive": "attnuq.predictive:GaussianPredictive",
}
_SUBMODULES = ("ops", "nn", "metrics", "plots", "data", "models", "baselines", "bench")

__all__ = ["__version__", "calibrate", "predict", *_LAZY, *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod, attr = _LAZY[name].split(":")
        return getattr(importlib.import_module(mod), attr)
    if name in _SUBMODULES:
        return importlib.import_module(f"attnuq.{name}")
    raise AttributeError(f"module 'attnuq' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


# ``attnuq.calibrate`` and ``attnuq.predict`` name both a function and the module defining it.
# Importing a submodule binds it as an attribute of the package, which would shadow the lazy
# function; binding the functions eagerly here (after the submodule import) keeps
# ``attnuq.calibrate(...)`` and ``attnuq.predict(...)`` callable whatever is imported later.
from attnuq.calibrate import calibrate  # noqa: E402
from attnuq.predict import predict  # noqa: E402
