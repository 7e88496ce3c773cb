"""Build ``docs/api.md`` from the docstrings of attnuq's public modules (offline, stdlib only).

Usage: ``.venv/bin/python scripts/build_api_docs.py [--check]``. With ``--check`` it exits 1 when
``docs/api.md`` is out of date (the tests run it this way).
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path

from _generated import write_or_check

MODULES = [
    "attnuq",
    "attnuq.ops",
    "attnuq.nn",
    "attnuq.patching",
    "attnuq.calibration",
    "attnuq.montecarlo",
    "attnuq.predictive",
    "attnuq.conformal",
    "attnuq.distributed",
    "attnuq.metrics",
    "attnuq.plots",
    "attnuq.models",
    "attnuq.data",
    "attnuq.html_report",
    "attnuq_bench.methods",
    "attnuq_bench.training",
    "attnuq_bench.models",
    "attnuq_bench.data",
    "attnuq_bench.suites",
]

OUT = Path(__file__).resolve().parent.parent / "docs" / "api.md"


def _signature(obj: object) -> str:
    try:
        sig = str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "(...)"
    return re.sub(r" at 0x[0-9a-f]+>", ">", sig)  # memory addresses differ from run to run


def _doc(obj: object) -> str:
    d = inspect.getdoc(obj) or "*(no docstring)*"
    return d.strip()


def build() -> str:
    lines = [
        "# API reference",
        "",
        "Generated from the docstrings by `python scripts/build_api_docs.py`; do not edit by hand.",
        "",
    ]
    for modname in MODULES:
        try:
            mod = importlib.import_module(modname)
        except ImportError as exc:  # an optional extra is missing
            lines += [f"## `{modname}`", "", f"*(not importable here: {exc})*", ""]
            continue
        lines += [f"## `{modname}`", "", _doc(mod).split("\n\n")[0], ""]
        names = getattr(mod, "__all__", [])
        for name in names:
            if name.startswith("_") or modname == "attnuq":
                continue
            try:
                obj = getattr(mod, name)
            except (AttributeError, ImportError):
                continue
            if inspect.ismodule(obj):
                continue
            kind = "class" if inspect.isclass(obj) else "function" if callable(obj) else "data"
            sig = _signature(obj) if kind != "data" else ""
            lines += [f"### `{modname}.{name}{sig}`", "", f"*{kind}*", "", "```text", _doc(obj),
                      "```", ""]
            if inspect.isclass(obj):
                for mname, meth in inspect.getmembers(obj):
                    if mname.startswith("_") or mname not in obj.__dict__:
                        continue
                    if not (inspect.isfunction(meth) or isinstance(meth, property)):
                        continue
                    msig = _signature(meth) if inspect.isfunction(meth) else ""
                    first = (inspect.getdoc(meth) or "").split("\n\n")[0]
                    lines.append(f"* `{mname}{msig}`: {first}")
                lines.append("")
        if modname == "attnuq":
            lines += ["Top-level names: " + ", ".join(f"`{n}`" for n in names), ""]
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    return write_or_check(OUT, lambda _old: build(), "build_api_docs.py", __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
