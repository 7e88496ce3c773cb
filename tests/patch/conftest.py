"""Run the patch tests single-threaded: the models are tiny, and two intra-op threads on a
loaded 2-core machine spend most of their time waiting for each other."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
