"""Estimators: a frozen model in, calibrated predictions out, in a few lines.

* :class:`SARegressor` -- ``SARegressor(model).fit(val_data, cal_data).predict(x)``: the
  recommended stochastic-attention recipe for regression, with intervals calibrated at any level.

Shared pieces (data checks, the model digest, the saved-estimator JSON) are in ``_common``.
Public names are imported lazily.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY: dict[str, str] = {
    "SARegressor": "attnuq.estimators._regressor:SARegressor",
    "SAPredictive": "attnuq.estimators._regressor:SAPredictive",
    "EstimatorWarning": "attnuq.estimators._common:EstimatorWarning",
    "SAClassifier": "attnuq.estimators._classifier:SAClassifier",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod, attr = _LAZY[name].split(":")
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'attnuq.estimators' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
