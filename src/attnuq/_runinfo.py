"""Provenance lines written next to every generated result: command, date, machine."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import sys
from typing import Any

__all__ = ["machine_line", "run_info"]


def machine_line() -> str:
    """One line naming the machine: OS, CPU, cores, Python, torch (and CUDA device if used)."""
    import torch

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
    from attnuq import __version__

    args = sys.argv if argv is None else argv
    prog = os.path.basename(args[0]) if args else "attnuq"
    return {
        "command": " ".join([prog, *map(shlex.quote, args[1:])]),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_line(),
        "attnuq": __version__,
    }
