"""Checks of the held-out data that calibration reads (its model side is
:mod:`attnuq.calibration._sharded`, with and without a process group)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from attnuq._validation import check_finite
from attnuq.montecarlo import Inputs


def check_data(data: Iterable[Any]) -> None:
    """``TypeError`` unless ``data`` is an iterable (not a tensor or a string)."""
    if isinstance(data, (torch.Tensor, str, bytes)) or not isinstance(data, Iterable):
        raise TypeError(
            f"data must be an iterable of (inputs, targets) pairs, got {type(data).__name__}"
        )


def check_pair(i: int, item: Any) -> tuple[Inputs, torch.Tensor]:
    """Item ``i`` of the data as ``(inputs, targets)``: a pair, finite non-empty targets."""
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise ValueError(
            "data must yield (inputs, targets) pairs, got item "
            f"{i} of type {type(item).__name__}"
        )
    x, y = item
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"targets of batch {i} must be a tensor, got {type(y).__name__}")
    if y.numel() == 0:
        raise ValueError(f"targets of batch {i} are empty, got shape={tuple(y.shape)}")
    check_finite(y, f"targets (batch {i})")
    return x, y
