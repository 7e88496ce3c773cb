"""Readers of users' data files: strict CSV and whitespace tables (:mod:`attnuq.data.readers`).

Every reader reports malformed file *content* with :class:`DataFormatError` (a ``ValueError``)
naming the file and, where the format has lines, the 1-based line; a missing file is a
``FileNotFoundError``.
"""

from __future__ import annotations

import os

__all__ = ["DataFormatError"]


class DataFormatError(ValueError):
    """A data file whose content is malformed.

    The message reads ``"<path>:<line>: <reason>"`` (``"<path>: <reason>"`` when the format has
    no lines, e.g. a ``.npz`` archive or a GRIB file), so it names the file and the place.

    Parameters
    ----------
    path
        The file (for a member of an archive: ``<archive>/<member>``).
    reason
        What is wrong, naming the bad value.
    line
        1-based line number, or ``None`` where lines mean nothing.

    Examples
    --------
    >>> err = DataFormatError("held.csv", "3 fields, header has 4", line=7)
    >>> str(err), err.path, err.line
    ('held.csv:7: 3 fields, header has 4', 'held.csv', 7)
    >>> isinstance(err, ValueError)
    True
    """

    def __init__(
        self, path: str | os.PathLike[str], reason: str, *, line: int | None = None
    ) -> None:
        if line is not None and (isinstance(line, bool) or not isinstance(line, int) or line < 1):
            raise ValueError(f"line must be a positive int or None, got {line=!r}")
        self.path = str(path)
        self.line = line
        self.reason = reason
        where = self.path if line is None else f"{self.path}:{line}"
        super().__init__(f"{where}: {reason}")

    def __reduce__(self) -> tuple[object, ...]:  # keep path/line through pickling
        return (_rebuild_data_format_error, (self.path, self.reason, self.line))


def _rebuild_data_format_error(path: str, reason: str, line: int | None) -> DataFormatError:
    return DataFormatError(path, reason, line=line)
