"""Data loaders for the benchmark sets (UCI, ETT, PhysioNet 2012, ERA5).

The data directory is resolved by :func:`data_dir`: an explicit argument (the CLI's
``--data-dir``), else the ``ATTNUQ_DATA_DIR`` environment variable, else ``../shared/data``
relative to the current directory.

Every loader reports malformed file *content* with :class:`attnuq.data.DataFormatError` (a
``ValueError``) naming the file and, where the format has lines, the 1-based line; a missing file
is a ``FileNotFoundError``.
"""

from __future__ import annotations

import os
from pathlib import Path

from attnuq.data import DataFormatError

__all__ = ["DATA_DIR_ENV", "DataFormatError", "data_dir"]

DATA_DIR_ENV = "ATTNUQ_DATA_DIR"


def data_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """Return the data directory; raise ``FileNotFoundError`` naming every place looked at."""
    tried: list[str] = []
    candidates: list[Path] = []
    if path is not None:
        candidates.append(Path(path))
    elif os.environ.get(DATA_DIR_ENV):
        candidates.append(Path(os.environ[DATA_DIR_ENV]))
    else:
        candidates.append(Path.cwd().parent / "shared" / "data")
        candidates.append(Path.cwd() / ".." / "shared" / "data")
    for c in candidates:
        tried.append(str(c))
        if c.is_dir():
            return c.resolve()
    raise FileNotFoundError(
        f"data directory not found (tried {tried}); pass --data-dir or set {DATA_DIR_ENV}"
    )
