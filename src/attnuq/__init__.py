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
    "calibrate": "attnuq.calibration:calibrate",
    "predict": "attnuq.montecarlo:predict",
    "stochastic": "attnuq.patching:stochastic",
    "patch": "attnuq.patching:patch",
    "find_attention": "attnuq.patching:find_attention",
    "CalibrationReport": "attnuq.calibration:CalibrationReport",
    "Predictive": "attnuq.predictive:Predictive",
    "GaussianPredictive": "attnuq.predictive:GaussianPredictive",
    "recentre": "attnuq.predictive:recentre",
}
_SUBMODULES = ("ops", "nn", "metrics", "plots", "models", "calibration", "montecarlo", "patching")

__all__ = ["__version__", *_LAZY, *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod, attr = _LAZY[name].split(":")
        return getattr(importlib.import_module(mod), attr)
    if name in _SUBMODULES:
        return importlib.import_module(f"attnuq.{name}")
    raise AttributeError(f"module 'attnuq' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)

