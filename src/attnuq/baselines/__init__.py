"""Alias of :mod:`attnuq.methods`, the registry of uncertainty methods (its name until 0.3).

Examples
--------
>>> import attnuq.baselines, attnuq.methods
>>> attnuq.baselines.make_method is attnuq.methods.make_method
True
"""

from __future__ import annotations

from attnuq.methods import *  # noqa: F403
from attnuq.methods import __all__ as __all__
