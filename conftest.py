"""Root pytest configuration: also applies to the docstring examples under ``src/attnuq`` and
``harness/src/attnuq_bench`` (``pytest --doctest-modules ...``), which do not see
``tests/conftest.py``."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

# one intra-op thread, as in the tests: the examples are tiny, and oversubscribing the cores of a
# shared machine makes them orders of magnitude slower
torch.set_num_threads(1)


def _harness_entry_points() -> None:
    """Make the harness's ``attnuq.commands`` entry points visible when it is importable but not
    installed (a source tree on ``PYTHONPATH``, as in a worktree using a shared environment).

    ``attnuq`` finds ``bench`` and ``demo`` through package metadata only; this writes the
    metadata ``pip install -e harness`` would (read from ``harness/pyproject.toml``) into a
    temporary folder on ``sys.path`` and on ``PYTHONPATH`` (for the CLI tests' subprocesses).
    Nothing is written when an installed harness already declares them, or without a harness.
    """
    from importlib.metadata import entry_points
    from importlib.util import find_spec

    if list(entry_points(group="attnuq.commands")):
        return
    try:
        spec = find_spec("attnuq_bench.cli")
    except ModuleNotFoundError:  # no harness here (the library's own environment)
        return
    if spec is None or spec.origin is None:
        return
    pyproject = Path(spec.origin).resolve().parents[2] / "pyproject.toml"
    if not pyproject.is_file():
        return
    import tomllib

    project = tomllib.loads(pyproject.read_text())["project"]
    eps = project["entry-points"]["attnuq.commands"]
    meta = Path(tempfile.mkdtemp(prefix="attnuq-bench-meta-"))
    # removed when this process exits (its test subprocesses have ended by then)
    atexit.register(shutil.rmtree, meta, ignore_errors=True)
    info = meta / f"attnuq_bench-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    (info / "entry_points.txt").write_text(
        "[attnuq.commands]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
    sys.path.append(str(meta))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.environ.get("PYTHONPATH"), str(meta)) if p)


_harness_entry_points()
