"""Strict readers of text data files (header CSV, whitespace tables): the CLI reads a user's
held-out data with them, and the harness's benchmark loaders share them.

Every malformed input raises :class:`attnuq.data.DataFormatError` naming the file and the
1-based line; nothing is dropped or guessed silently (no skipped first row, no first-of-two
duplicate columns, no numpy/pandas message without the file).
"""

from __future__ import annotations

import csv
import io
import math
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from attnuq.data import DataFormatError

__all__ = [
    "CSVTable",
    "decode_text",
    "read_csv_table",
    "read_int_list",
    "read_number_rows",
    "row_lines",
    "token_lines",
]


def decode_text(path: str | os.PathLike[str]) -> str:
    """The file's text as UTF-8 (a leading byte-order mark is dropped).

    Undecodable bytes raise :class:`DataFormatError` with the line of the first bad byte; a NUL
    byte (a binary file, or one cut and zero-filled) is refused the same way.
    """
    p = Path(path)
    data = p.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise DataFormatError(
            p, f"not UTF-8 text ({exc.reason} at byte {exc.start})", line=line
        ) from None
    nul = text.find("\0")
    if nul >= 0:
        raise DataFormatError(p, "NUL byte in a text file", line=text.count("\n", 0, nul) + 1)
    return text


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _float_or_nan(s: str) -> float:
    """``float(s)``, or NaN where ``s`` is not a number."""
    try:
        return float(s)
    except ValueError:
        return math.nan


@dataclass(frozen=True)
class CSVTable:
    """A header CSV read strictly: ``rows[i]`` came from file line ``lines[i]`` (1-based).

    Header names are stripped; data fields are kept as read (:meth:`strings` strips them,
    :meth:`floats` ignores surrounding blanks as ``float`` does).
    """

    path: Path
    header: tuple[str, ...]
    rows: list[list[str]]
    lines: list[int]
    header_line: int

    def index(self, name: str) -> int:
        """Column position of ``name`` (:class:`DataFormatError` naming the header if absent)."""
        if name not in self.header:
            raise DataFormatError(
                self.path, f"no column {name!r} (columns: {list(self.header)})",
                line=self.header_line,
            )
        return self.header.index(name)

    def strings(self, name: str) -> list[str]:
        """The stripped fields of column ``name``, one per data row."""
        j = self.index(name)
        return [r[j].strip() for r in self.rows]

    def floats(self, names: Sequence[str]) -> np.ndarray:
        """``(N, len(names))`` float64 of the named columns.

        ``nan``/``inf`` spellings parse (callers decide whether they are allowed); an empty or
        non-numeric field raises :class:`DataFormatError` with its line and column.
        """
        idx = [self.index(n) for n in names]
        cols = [[r[j] for r in self.rows] for j in idx]
        try:
            return np.array(cols, dtype=np.float64).T.reshape(len(self.rows), len(idx))
        except ValueError:
            pass
        for i, row in enumerate(self.rows):
            for name, j in zip(names, idx, strict=True):
                if not _is_number(row[j]):
                    v = row[j].strip()
                    what = "empty value" if not v else f"non-numeric value {v!r}"
                    raise DataFormatError(
                        self.path, f"{what} in column {name!r}", line=self.lines[i]
                    ) from None
        raise DataFormatError(self.path, f"columns {list(names)} could not be read as numbers")


def read_csv_table(path: str | os.PathLike[str]) -> CSVTable:
    """Read a comma-separated file whose first non-blank line is a header of column names.

    Refused, each with its line: undecodable bytes, bad quoting, an empty or duplicate column
    name, a first line made only of numbers (a file without header would otherwise lose its
    first row), a row with another field count than the header, a header without data rows.
    Blank lines are skipped; fields and names are stripped of surrounding blanks.
    """
    p = Path(path)
    text = decode_text(p)
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    header: tuple[str, ...] | None = None
    header_line = 1
    rows: list[list[str]] = []
    lines: list[int] = []
    prev = 0
    try:
        for row in reader:
            start, prev = prev + 1, reader.line_num
            if not row or (len(row) == 1 and not row[0].strip()):
                continue  # blank line
            if header is None:
                names = [f.strip() for f in row]
                header, header_line = _check_header(p, names, start), start
                continue
            if len(row) != len(header):
                raise DataFormatError(
                    p, f"row has {len(row)} fields, the header has {len(header)}", line=start
                )
            rows.append(row)
            lines.append(start)
    except csv.Error as exc:
        raise DataFormatError(p, f"malformed CSV ({exc})", line=reader.line_num or 1) from None
    if header is None:
        raise DataFormatError(p, "empty file; expected a header row of column names", line=1)
    if not rows:
        raise DataFormatError(p, "has a header row but no data rows", line=header_line)
    return CSVTable(path=p, header=header, rows=rows, lines=lines, header_line=header_line)


def _check_header(p: Path, names: list[str], line: int) -> tuple[str, ...]:
    for k, n in enumerate(names):
        if not n:
            raise DataFormatError(p, f"empty column name at position {k + 1} of the header",
                                  line=line)
    seen: dict[str, int] = {}
    for k, n in enumerate(names):
        if n in seen:
            raise DataFormatError(
                p, f"duplicate column name {n!r} (columns {seen[n] + 1} and {k + 1})", line=line
            )
        seen[n] = k
    if all(_is_number(n) for n in names):
        raise DataFormatError(
            p, f"first line {','.join(names)[:60]!r} holds only numbers: a header row of "
            "column names is required (rename the columns if these are names)", line=line,
        )
    return tuple(names)


def _tokens(text: str) -> Iterator[tuple[int, list[str]]]:
    """``(line, tokens)`` of every non-blank line; ``#`` starts a comment (as ``np.loadtxt``)."""
    for i, raw in enumerate(text.splitlines(), start=1):
        toks = raw.split("#", 1)[0].split()
        if toks:
            yield i, toks


def _loadtxt(p: Path, ndmin: Literal[1, 2]) -> np.ndarray | None:
    """numpy's fast reader, or ``None`` when it refuses the file (then the slow path explains)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "input contained no data": reported by the caller
            arr = np.loadtxt(p, dtype=np.float64, ndmin=ndmin, encoding="utf-8-sig")
    except (ValueError, UnicodeError):
        return None
    return arr if arr.size else None


def read_number_rows(path: str | os.PathLike[str]) -> np.ndarray:
    """A whitespace-separated numeric table (``#`` starts a comment, blank lines skipped).

    Returns the ``(N, C)`` float64 table; a ragged row, a non-numeric token, undecodable bytes or
    an empty file raise :class:`DataFormatError` with the line. :func:`row_lines` maps rows back
    to lines.
    """
    p = Path(path)
    arr = _loadtxt(p, 2)
    if arr is not None:
        return arr
    rows_t = list(_tokens(decode_text(p)))
    widths = [len(toks) for _, toks in rows_t]
    width = max(set(widths), key=widths.count) if widths else None  # the usual width
    rows: list[list[float]] = []
    for line, toks in rows_t:
        if len(toks) != width:
            raise DataFormatError(
                p, f"row has {len(toks)} values, most rows have {width}", line=line
            )
        for k, t in enumerate(toks):
            if not _is_number(t):
                raise DataFormatError(p, f"non-numeric value {t!r} in column {k}", line=line)
        rows.append([float(t) for t in toks])
    if width is None:
        raise DataFormatError(p, "holds no data rows")
    return np.asarray(rows, dtype=np.float64)


def row_lines(path: str | os.PathLike[str]) -> list[int]:
    """1-based file line of each row :func:`read_number_rows` returns (for error messages)."""
    return [line for line, _ in _tokens(decode_text(path))]


def read_int_list(path: str | os.PathLike[str], *, low: int = 0) -> tuple[np.ndarray, list[int]]:
    """Whitespace-separated integers ``>= low`` (an integral float such as ``8.0`` counts).

    Returns the ``(N,)`` int64 values and the 1-based line of each (computed only on the slow
    path, else ``[]``: call :func:`token_lines` for messages); an empty file, a non-integer or a
    value below ``low`` raises :class:`DataFormatError` with the line.
    """
    p = Path(path)
    arr = _loadtxt(p, 1)
    if arr is not None:
        flat = arr.reshape(-1)
        if np.isfinite(flat).all() and (flat == np.round(flat)).all() and (flat >= low).all():
            return flat.astype(np.int64), []
    vals: list[int] = []
    lines: list[int] = []
    for i, toks in _tokens(decode_text(p)):
        for t in toks:
            v = _float_or_nan(t)
            if not (math.isfinite(v) and v == round(v)):
                raise DataFormatError(p, f"{t!r} is not an integer index", line=i)
            if v < low:
                why = " (a negative index would wrap around)" if v < 0 else ""
                raise DataFormatError(p, f"value {t} is below {low}{why}", line=i)
            vals.append(int(v))
            lines.append(i)
    if not vals:
        raise DataFormatError(p, "holds no indices")
    return np.asarray(vals, dtype=np.int64), lines


def token_lines(path: str | os.PathLike[str]) -> list[int]:
    """1-based file line of each value :func:`read_int_list` returns (for error messages)."""
    return [line for line, toks in _tokens(decode_text(path)) for _ in toks]
