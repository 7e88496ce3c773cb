"""Shared pytest configuration: deterministic, single-process torch, offline Hugging Face."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

import pytest
import torch

# one thread per pytest-xdist worker (scripts/test.sh runs two workers on two cores)
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
