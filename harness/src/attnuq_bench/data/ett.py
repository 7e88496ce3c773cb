"""Electricity Transformer Temperature (ETT) loader with the standard train/val/test borders.

The ETT CSVs (``ETTh1.csv``, ``ETTh2.csv``, ``ETTm1.csv``, ``ETTm2.csv``) have a ``date`` column
followed by the seven channels ``HUFL, HULL, MUFL, MULL, LUFL, LULL, OT`` (``OT``, the oil
temperature, is the usual target). This module reads any CSV of that layout.

Splits follow the Informer / PatchTST code (``Dataset_ETT_hour`` / ``Dataset_ETT_minute``):

* hourly files: train = the first ``12*30*24`` rows, val = the next ``4*30*24``, test = the next
  ``4*30*24``; the 15-minute files use four times as many rows;
* the val and test *windows* start ``context`` steps before their border, so the first
  forecast of the val segment starts exactly at the val border (context overlap convention);
* a ``StandardScaler`` (per-channel mean and population std) is fitted on the train rows only.

A CSV that is too short for the month borders (e.g. a custom file) is split 60/20/20 by rows
(the same 12:4:4 proportions) and the returned :class:`ETTData` says so in ``split_rule``.

Examples
--------
>>> import numpy as np, pandas as pd, tempfile, os
>>> d = tempfile.mkdtemp()
>>> t = pd.date_range("2020-01-01", periods=400, freq="h")
>>> df = pd.DataFrame({"date": t, **{c: np.sin(np.arange(400) / (i + 2)) for i, c in
...                   enumerate(ETT_CHANNELS)}})
>>> df.to_csv(os.path.join(d, "tiny.csv"), index=False)
>>> data = load_ett(os.path.join(d, "tiny.csv"), context=24)
>>> x, y = data.windows("test", context=24, horizon=8)
>>> tuple(x.shape), tuple(y.shape)
((73, 24, 7), (73, 8, 7))
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from attnuq._validation import check_positive_int
from attnuq.data import DataFormatError
from attnuq.data.readers import CSVTable, read_csv_table
from attnuq_bench.data import data_dir

__all__ = [
    "ETT_CHANNELS",
    "ETTData",
    "ett_borders",
    "load_ett",
    "resolve_ett_path",
    "seasonal_naive",
]

#: the seven channels of every ETT file, in file order; ``OT`` is the usual target
ETT_CHANNELS: tuple[str, ...] = ("HUFL", "HULL", "MUFL", "MULL", "LUFL", "LULL", "OT")

Split = Literal["train", "val", "test"]
_SPLITS: tuple[str, ...] = ("train", "val", "test")


def _float_or_nan(s: str) -> float:
    """``float(s)``, or NaN where ``s`` is not a number."""
    try:
        return float(s)
    except ValueError:
        return math.nan


def resolve_ett_path(
    file: str | os.PathLike[str] = "ETTh1.csv",
    data_dir_path: str | os.PathLike[str] | None = None,
) -> Path:
    """Find an ETT CSV: an existing path as given, else ``<data_dir>/ett/<file>``, else
    ``<data_dir>/<file>``; raise ``FileNotFoundError`` naming every place looked at.

    Examples
    --------
    >>> resolve_ett_path(None)
    Traceback (most recent call last):
    ...
    TypeError: file must be a path or a file name such as 'ETTh1.csv', got file=None
    """
    if not isinstance(file, (str, os.PathLike)) or str(file) == "":
        raise TypeError(f"file must be a path or a file name such as 'ETTh1.csv', got {file=!r}")
    p = Path(file)
    if p.is_file():
        return p
    root = data_dir(data_dir_path)
    tried = [str(p)]
    for cand in (root / "ett" / p, root / p):
        tried.append(str(cand))
        if cand.is_file():
            return cand
    raise FileNotFoundError(f"ETT file {str(file)!r} not found (tried {tried})")


def ett_borders(
    n_rows: int, context: int, *, freq: Literal["h", "15min"] = "h"
) -> tuple[dict[str, tuple[int, int]], str]:
    """Row ranges ``[start, end)`` of the train/val/test *series* (windows may start earlier).

    Parameters
    ----------
    n_rows
        Number of rows in the file.
    context
        Context length; val/test ranges start ``context`` rows before their border.
    freq
        ``"h"`` for ETTh (30-day months of 24 rows per day) or ``"15min"`` for ETTm (96 per day).

    Returns
    -------
    borders, rule
        ``{"train": (0, b1), "val": (b1 - context, b2), "test": (b2 - context, b3)}`` and a
        description of the rule used (month borders or the 60/20/20 fallback).
    """
    n_rows = check_positive_int(n_rows, "n_rows")
    context = check_positive_int(context, "context")
    if freq not in ("h", "15min"):
        raise ValueError(f"freq must be 'h' or '15min', got {freq=!r}")
    per_month = 30 * 24 * (4 if freq == "15min" else 1)
    b1, b2, b3 = 12 * per_month, 16 * per_month, 20 * per_month
    if n_rows >= b3:
        rule = f"standard ETT borders: 12/4/4 months of {per_month} rows ({freq})"
    else:
        # NOTE(paper): the Informer code has no rule for short ETT-layout files; we keep the
        # 12:4:4 proportions by rows so that a custom CSV still loads.
        b1, b2, b3 = int(0.6 * n_rows), int(0.8 * n_rows), n_rows
        rule = f"60/20/20 row split (file has {n_rows} rows < {20 * per_month} for month borders)"
    if b1 - context < 0 or b1 <= context:
        raise ValueError(
            f"file too short for context={context}: train part has {b1} rows (n_rows={n_rows})"
        )
    return {"train": (0, b1), "val": (b1 - context, b2), "test": (b2 - context, b3)}, rule


@dataclass(frozen=True)
class ETTData:
    """A scaled ETT series with its split borders.

    Attributes
    ----------
    values
        ``(T, C)`` float32 tensor, standardised with the train mean/std.
    mean, std
        ``(C,)`` float64 arrays of the scaler fitted on the train rows.
    columns
        Channel names, file order.
    dates
        ``(T,)`` ``numpy.datetime64`` array.
    borders
        Row ranges ``[start, end)`` per split, val/test starting ``context`` rows early.
    context
        Context length the borders were made for.
    split_rule
        Which border rule was applied.
    path
        The file read.
    """

    values: torch.Tensor
    mean: np.ndarray
    std: np.ndarray
    columns: tuple[str, ...]
    dates: np.ndarray
    borders: dict[str, tuple[int, int]]
    context: int
    split_rule: str
    path: Path
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def n_channels(self) -> int:
        return int(self.values.shape[1])

    def channel_index(self, name: str) -> int:
        """Column position of channel ``name`` (``ValueError`` naming the known channels)."""
        if name not in self.columns:
            raise ValueError(f"unknown channel {name=!r}; known: {list(self.columns)}")
        return self.columns.index(name)

    def segment(self, split: Split) -> torch.Tensor:
        """``(T_split, C)`` rows of one split (including the context overlap for val/test)."""
        if split not in _SPLITS:
            raise ValueError(f"split must be one of {_SPLITS}, got {split=!r}")
        a, b = self.borders[split]
        return self.values[a:b]

    def window_starts(self, split: Split, horizon: int, *, stride: int = 1) -> np.ndarray:
        """Absolute row index of the first context row of each window of ``split``."""
        horizon = check_positive_int(horizon, "horizon")
        stride = check_positive_int(stride, "stride")
        a, b = self.borders[split] if split in _SPLITS else (None, None)
        if a is None or b is None:
            raise ValueError(f"split must be one of {_SPLITS}, got {split=!r}")
        n = (b - a) - self.context - horizon + 1
        if n < 1:
            raise ValueError(
                f"split {split!r} has {b - a} rows, too few for context={self.context} + "
                f"{horizon=}"
            )
        return a + np.arange(0, n, stride)

    def windows(
        self,
        split: Split,
        *,
        context: int | None = None,
        horizon: int,
        stride: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sliding windows of one split.

        Returns
        -------
        past, future
            ``(N, context, C)`` and ``(N, horizon, C)`` (views into :attr:`values` where possible),
            ``N = (T_split - context - horizon) // stride + 1``.
        """
        if context is not None and context != self.context:
            raise ValueError(
                f"data was loaded for context={self.context}, got {context=}; reload with "
                "load_ett(..., context=...)"
            )
        starts = self.window_starts(split, horizon, stride=stride)
        a, b = self.borders[split]
        seg = self.values[a:b]
        allw = seg.unfold(0, self.context + horizon, 1)  # (N_all, C, L + H)
        w = allw[starts - a].transpose(1, 2)  # (N, L + H, C)
        return w[:, : self.context], w[:, self.context :]

    def inverse_transform(self, x: torch.Tensor) -> torch.Tensor:
        """Undo the standard scaling on the last axis (``(..., C)``)."""
        if x.shape[-1] != self.n_channels:
            raise ValueError(
                f"last axis must have {self.n_channels} channels, got shape={tuple(x.shape)}"
            )
        m = torch.as_tensor(self.mean, dtype=x.dtype, device=x.device)
        s = torch.as_tensor(self.std, dtype=x.dtype, device=x.device)
        return x * s + m


def load_ett(
    path: str | os.PathLike[str],
    *,
    context: int = 336,
    columns: Sequence[str] = ETT_CHANNELS,
    freq: Literal["h", "15min"] | None = None,
) -> ETTData:
    """Read an ETT-layout CSV, fit the scaler on train rows and set the split borders.

    Parameters
    ----------
    path
        CSV with a ``date`` column and the ``columns`` (default the seven ETT channels).
    context
        Context length: val/test windows start this many rows before their border.
    columns
        Channels to keep, in this order.
    freq
        ``"h"`` or ``"15min"``; by default ``"15min"`` when the file name starts with ``ETTm``.

    Raises
    ------
    FileNotFoundError
        The file does not exist.
    attnuq.data.DataFormatError
        Malformed content, naming the file and line: an empty file or one without data rows, a
        bad header (duplicate names, missing columns), ragged rows, NaN, infinite or non-numeric
        entries (counted per column, the first one's line named), a date that does not parse or
        is not after the previous row's.
    ValueError
        A file too short for the context, channels constant on the train rows.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"ETT file not found: {str(p)!r}")
    context = check_positive_int(context, "context")
    cols = list(columns)
    if not cols or len(set(cols)) != len(cols):
        raise ValueError(f"columns must name distinct channels, at least one, got {columns=!r}")
    table = read_csv_table(p)
    missing = [c for c in ["date", *cols] if c not in table.header]
    if missing:
        raise DataFormatError(
            p, f"ETT file lacks columns {missing}; it has {list(table.header)}",
            line=table.header_line,
        )
    arr = _channel_values(table, cols)
    dates = _dates(table)
    if freq is None:
        freq = "15min" if p.name.lower().startswith("ettm") else "h"
    borders, rule = ett_borders(len(arr), context, freq=freq)
    a, b = borders["train"]
    mean = arr[a:b].mean(0)
    std = arr[a:b].std(0)  # population std, as sklearn's StandardScaler
    if (std <= 0).any():
        const = [c for c, s in zip(cols, std, strict=True) if s <= 0]
        raise ValueError(f"channels {const} are constant on the train rows; cannot standardise")
    scaled = (arr - mean) / std
    return ETTData(
        values=torch.from_numpy(scaled.astype(np.float32)),
        mean=mean,
        std=std,
        columns=tuple(cols),
        dates=dates,
        borders=borders,
        context=context,
        split_rule=rule,
        path=p,
    )


def _channel_values(table: CSVTable, cols: list[str]) -> np.ndarray:
    """``(T, C)`` float64 of the channels; any NaN, inf or non-number is a format error."""
    arr = np.empty((len(table.rows), len(cols)))
    for j, c in enumerate(cols):
        k = table.index(c)
        vals = [r[k] for r in table.rows]
        try:
            arr[:, j] = np.array(vals, dtype=np.float64)
        except ValueError:
            arr[:, j] = [_float_or_nan(v) for v in vals]
    bad = ~np.isfinite(arr)
    if bad.any():
        counts = {c: int(n) for c, n in zip(cols, bad.sum(0), strict=True) if n}
        i = int(np.flatnonzero(bad.any(1))[0])
        j = int(np.flatnonzero(bad[i])[0])
        raise DataFormatError(
            table.path, f"ETT file has NaN, infinite or non-numeric values per column: {counts} "
            f"(first: {table.rows[i][table.index(cols[j])].strip()!r} in column {cols[j]!r})",
            line=table.lines[i],
        )
    return arr


def _dates(table: CSVTable) -> np.ndarray:
    """The ``date`` column as ``datetime64``; unparsable or non-increasing dates are refused."""
    import warnings

    import pandas as pd

    raw = table.strings("date")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "could not infer format": the NaT check reports it
            parsed = pd.to_datetime(pd.Series(raw), errors="coerce")
    except (ValueError, TypeError, OverflowError) as exc:  # e.g. mixed time zones
        raise DataFormatError(
            table.path, f"column 'date' does not parse as dates ({exc})"
        ) from None
    nat = parsed.isna().to_numpy()
    if nat.any():
        i = int(np.argmax(nat))
        raise DataFormatError(
            table.path, f"bad date {raw[i]!r} ({int(nat.sum())} unparsable dates; the format is "
            f"taken from the first row, {raw[0]!r})", line=table.lines[i],
        )
    dates = parsed.to_numpy()
    step = np.diff(dates) > np.timedelta64(0) if dates.dtype.kind == "M" else np.ones(0, bool)
    if step.size and not step.all():
        i = int(np.argmin(step)) + 1
        raise DataFormatError(
            table.path, f"date {raw[i]!r} is not after the previous row's {raw[i - 1]!r}",
            line=table.lines[i],
        )
    return dates


def seasonal_naive(past: torch.Tensor, horizon: int, *, season: int = 24) -> torch.Tensor:
    """Seasonal-naive forecast: repeat the last full season of the context.

    ``yhat[t + h] = x[t + h - season * ceil(h / season)]`` for ``h = 1..horizon``.

    Parameters
    ----------
    past
        ``(B, L, C)`` context, ``L >= season``.
    horizon
        Steps ahead ``H``.
    season
        Period in steps (24 for hourly data with a daily cycle).

    Returns
    -------
    ``(B, H, C)`` forecast.

    Examples
    --------
    >>> x = torch.arange(48.).reshape(1, 48, 1)
    >>> seasonal_naive(x, 3, season=24)[0, :, 0].tolist()
    [24.0, 25.0, 26.0]
    """
    horizon = check_positive_int(horizon, "horizon")
    season = check_positive_int(season, "season")
    if past.dim() != 3:
        raise ValueError(f"past must be (B, L, C), got shape={tuple(past.shape)}")
    if past.shape[1] < season:
        raise ValueError(f"context length {past.shape[1]} shorter than {season=}")
    last = past[:, -season:]  # (B, season, C)
    reps = -(-horizon // season)
    return last.repeat(1, reps, 1)[:, :horizon]
