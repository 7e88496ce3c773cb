"""Shared pytest configuration: deterministic, single-process torch, offline Hugging Face."""

from __future__ import annotations

import os
from collections.abc import Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
# Triton kernels (tests/attnuq/ops/test_triton.py) run under triton's interpreter on CPU
# tensors: the switch is read when triton is first imported (transformers and laplace import it),
# so it is set here, before any test module. scripts/gpu_check.sh sets TRITON_INTERPRET=0
# (compiled, CUDA).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_and_one_thread() -> Iterator[None]:
    """Every test starts from torch seed 0 and runs single-threaded.

    The tests' tensors are tiny: several intra-op threads spend most of their time waiting for
    each other, badly so on a loaded machine (gradcheck ran ~8x slower). scripts/test.sh runs
    two pytest-xdist workers, which keeps both cores busy. The thread count is restored after.
    """
    torch.manual_seed(0)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
