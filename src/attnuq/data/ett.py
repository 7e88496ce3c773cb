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

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from attnuq._validation import check_positive_int
from attnuq.data import data_dir

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


def resolve_ett_path(
    file: str | os.PathLike[str] = "ETTh1.csv",
    data_dir_path: str | os.PathLike[str] | None = None,
) -> Path:
    """Find an ETT CSV: an existing path as given, else ``<data_dir>/ett/<file>``, else
    ``<data_dir>/<file>``; raise ``FileNotFoundError`` naming every place looked at."""
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
    ValueError
        Missing columns (named), NaN or non-numeric entries (column and count named), a file too
        short for the context.
    """
    import pandas as pd

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"ETT file not found: {str(p)!r}")
    context = check_positive_int(context, "context")
    cols = list(columns)
    if not cols:
        raise ValueError(f"columns must name at least one channel, got {columns=!r}")
    df = pd.read_csv(p)
    missing = [c for c in ["date", *cols] if c not in df.columns]
    if missing:
        raise ValueError(
            f"ETT file {p.name!r} lacks columns {missing}; it has {list(df.columns)}"
        )
    if len(df) == 0:
        raise ValueError(f"ETT file {p.name!r} has no rows")
    num = df[cols].apply(pd.to_numeric, errors="coerce")
    bad = {c: int(n) for c, n in num.isna().sum().items() if n > 0}
    if bad:
        raise ValueError(f"ETT file {p.name!r} has NaN or non-numeric values per column: {bad}")
    arr = num.to_numpy(dtype=np.float64)
    if not np.isfinite(arr).all():
        raise ValueError(f"ETT file {p.name!r} has infinite values")
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
    dates = pd.to_datetime(df["date"]).to_numpy()
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
