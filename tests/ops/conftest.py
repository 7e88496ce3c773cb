"""Fixtures shared by the sampled-attention tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from attnuq.ops import _native


@pytest.fixture(params=["native", "torch"])
def sampler(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run with the compiled CPU kernel of the dense sampler and with the pure-torch path (the
    two draw from the same distribution through different code; the gather is shared). The
    kernel case skips, with the kernel's reason, only where it cannot be built or is switched
    off (``ATTNUQ_NATIVE=0``)."""
    if request.param == "torch":
        with _native.disabled():
            yield request.param
        return
    if not _native.available():
        pytest.skip(f"native sampling kernel unavailable: {_native.status()['reason']}")
    yield request.param
