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

__all__ = ["cpu_name", "machine_line", "resolve_device", "run_info", "version"]

# the vector instruction sets that decide which kernels run, widest first (Linux flag names)
_ISA_FLAGS = (("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"), ("neon", "NEON"),
              ("asimd", "NEON"))


def cpu_name(cpuinfo: str | None = None) -> str:
    r"""The CPU's model name and its widest vector instruction sets, e.g.
    ``"AMD EPYC (AVX-512)"`` or ``"Intel(R) Xeon(R) Platinum 8480+ (AMX, AVX-512)"``, read from
    ``/proc/cpuinfo`` (or the text ``cpuinfo``); ``platform.processor()`` or the architecture
    where that file is absent (macOS, Windows). Float results of the kernels may differ in the
    last bits between such CPUs, which is why results pages name them.

    Examples
    --------
    >>> cpu_name("model name\t: AMD EPYC 9B14\nflags\t\t: fpu sse2 avx2 avx512f\n")
    'AMD EPYC 9B14 (AVX-512)'
    >>> cpu_name("") == (platform.processor() or platform.machine())  # nothing known
    True
    """
    text = cpuinfo
    if text is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                text = f.read(1 << 16)
        except OSError:
            text = ""
    name, flags = "", set[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model") and not name:
            name = " ".join(value.split())
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    name = name or platform.processor() or platform.machine()
    isas = list(dict.fromkeys(label for flag, label in _ISA_FLAGS if flag in flags))
    isas = [i for i in isas if not (i == "AVX2" and "AVX-512" in isas)]
    return f"{name} ({', '.join(isas)})" if isas else name


def machine_line() -> str:
    """One line naming the machine: OS, CPU (:func:`cpu_name`), cores, Python, torch (and CUDA
    device if used)."""
    cpu = cpu_name()
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
    if prog == "__main__.py":  # ``python -m attnuq.cli ...`` is the ``attnuq`` entry point
        prog = "attnuq"
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
