"""Resolving the ``--device`` option of the command line and the benchmark suites."""

from __future__ import annotations

import torch

__all__ = ["resolve_device"]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """Return a usable :class:`torch.device` for ``device``, or fail naming the bad value.

    ``None`` and ``"auto"`` pick ``cuda`` when available, else ``cpu``. A device string torch
    does not parse, or a CUDA/MPS device on a machine without one, raises ``ValueError``.

    Examples
    --------
    >>> from attnuq._device import resolve_device
    >>> resolve_device("cpu")
    device(type='cpu')
    """
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r}: {exc}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available here")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {device!r} requested but only {torch.cuda.device_count()} CUDA "
                "device(s) exist"
            )
    elif dev.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise ValueError(f"device {device!r} requested but MPS is not available here")
    return dev
