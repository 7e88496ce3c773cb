"""The runtime around a command: the ``--device`` option, and the provenance lines written next to
every generated result (command, date, machine, attnuq's version from the package metadata)."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import sys
from typing import Any

import torch

__all__ = ["machine_line", "resolve_device", "run_info", "version"]


def machine_line() -> str:
    """One line naming the machine: OS, CPU, cores, Python, torch (and CUDA device if used)."""
    cpu = platform.processor() or platform.machine()
    parts = [
        f"{platform.system()} {platform.machine()}",
        f"cpu={cpu}",
        f"cores={os.cpu_count()}",
        f"python={platform.python_version()}",
        f"torch={torch.__version__}",
        f"threads={torch.get_num_threads()}",
    ]
    if torch.cuda.is_available():
        parts.append(f"cuda={torch.cuda.get_device_name(0)}")
    return ", ".join(parts)


def run_info(argv: list[str] | None = None) -> dict[str, Any]:
    """Command line, UTC date and machine line, for a results file."""
    args = sys.argv if argv is None else argv
    prog = os.path.basename(args[0]) if args else "attnuq"
    return {
        "command": " ".join([prog, *map(shlex.quote, args[1:])]),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_line(),
        "attnuq": version(),
    }


def version() -> str:
    """attnuq's version, read from the installed package's metadata.

    Examples
    --------
    >>> from attnuq._runtime import version
    >>> isinstance(version(), str)
    True
    """
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _dist_version

    try:
        return _dist_version("attnuq")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0.0.0+unknown"


def resolve_device(device: str | torch.device | None) -> torch.device:
    """Return a usable :class:`torch.device` for ``device``, or fail naming the bad value.

    ``None`` and ``"auto"`` pick ``cuda`` when available, else ``cpu``. A device string torch
    does not parse, or a CUDA/MPS device on a machine without one, raises ``ValueError``.

    Examples
    --------
    >>> from attnuq._runtime import resolve_device
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
