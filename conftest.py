"""Root pytest configuration: also applies to the docstring examples under ``src/attnuq``
(``pytest --doctest-modules src/attnuq``), which do not see ``tests/conftest.py``."""

from __future__ import annotations

import torch

# one intra-op thread, as in the tests: the examples are tiny, and oversubscribing the cores of a
# shared machine makes them orders of magnitude slower
torch.set_num_threads(1)
