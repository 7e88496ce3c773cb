"""Fixtures shared by the sampled-attention tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from attnuq.ops import _native


@pytest.fixture(params=["fused", "native", "torch"])
def sampler(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run with each CPU path of the samplers and moments: ``fused`` (the fused C kernels of
    ``csrc/fused.c``: scores, draws and gather in one pass, float32), ``native`` (torch's score
    GEMM and the row kernels of ``csrc/sample_rows.c``; :func:`attnuq.ops._native.unfused`) and
    ``torch`` (pure torch ops; :func:`attnuq.ops._native.disabled`). The three draw from the same
    distribution through different code. The kernel cases skip, with the kernel's reason, only
    where it cannot be built or is switched off (``ATTNUQ_NATIVE=0``)."""
    if request.param == "torch":
        with _native.disabled():
            yield request.param
        return
    if not _native.available():
        pytest.skip(f"native sampling kernel unavailable: {_native.status()['reason']}")
    if request.param == "native":
        with _native.unfused():
            yield request.param
        return
    yield request.param
