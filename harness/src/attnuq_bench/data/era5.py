"""Gridded reanalysis fields (ERA5 2 m temperature) from GRIB or NetCDF, and forecast examples.

:func:`load_field` opens any file with one variable on ``(time, latitude, longitude)`` through
xarray: GRIB with the ``cfgrib`` engine (extra ``weather``; no index file is written next to the
data), NetCDF with whatever NetCDF engine xarray has (``netcdf4``, ``h5netcdf`` or ``scipy``).
Singleton extra dimensions (``step``, ``number``, ``surface``) are dropped; anything else is an
error naming the dimensions found.

:func:`make_examples` builds forecast examples: inputs at issue time ``t`` are the field at ``t``
and at ``t - history`` (hours), targets are the fields at ``t + lead`` for each lead. A split by
whole days (:func:`day_blocks`) keeps the whole time span ``[t - history, t + max lead]`` of
every example inside its block, so train/val/cal/test share no field.

:func:`hourly_climatology` is the hour-of-day mean of a period (the ACC reference).

Examples
--------
>>> import numpy as np, xarray as xr, tempfile, os
>>> t = np.arange("2019-03-01", "2019-03-03", dtype="datetime64[h]").astype("datetime64[ns]")
>>> ds = xr.Dataset({"t2m": (("time", "latitude", "longitude"),
...                          280 + np.random.default_rng(0).normal(size=(48, 3, 4)))},
...                 coords={"time": t, "latitude": [52.0, 51.0, 50.0],
...                         "longitude": [0.0, 1.0, 2.0, 3.0]})
>>> p = os.path.join(tempfile.mkdtemp(), "tiny.nc")
>>> ds.to_netcdf(p, engine="scipy")
>>> f = load_field(p)
>>> f.values.shape, f.variable
(torch.Size([48, 3, 4]), 't2m')
>>> ex = make_examples(f, np.arange(48), history=6, leads=(6, 24))
>>> ex.inputs.shape, ex.targets.shape
(torch.Size([18, 2, 3, 4]), torch.Size([18, 2, 3, 4]))
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from attnuq._validation import check_positive_int
from attnuq.data import DataFormatError
from attnuq_bench.data import data_dir

__all__ = [
    "Examples",
    "Field",
    "day_blocks",
    "grib_message_count",
    "hourly_climatology",
    "load_field",
    "make_examples",
    "resolve_era5_path",
]

_GRIB = (".grib", ".grb", ".grib1", ".grib2", ".grb2")
_NETCDF = (".nc", ".nc4", ".netcdf", ".cdf")
_ALIASES = {"lat": "latitude", "lon": "longitude", "valid_time": "time"}
_HORIZONTAL = ("latitude", "longitude", "lat", "lon", "values", "x", "y")


@dataclass(frozen=True)
class Field:
    """One variable on a regular grid, hourly.

    Attributes
    ----------
    values
        ``(T, n_lat, n_lon)`` float32 tensor (the file's units, e.g. kelvin).
    times
        ``(T,)`` ``datetime64[ns]``, strictly increasing.
    lat, lon
        ``(n_lat,)`` and ``(n_lon,)`` degrees.
    variable
        Name of the variable read.
    path
        The file read.
    """

    values: torch.Tensor
    times: np.ndarray
    lat: np.ndarray
    lon: np.ndarray
    variable: str
    path: Path

    @property
    def hours(self) -> np.ndarray:
        """``(T,)`` hour of day of every time (0..23)."""
        return ((self.times - self.times.astype("datetime64[D]")) // np.timedelta64(1, "h")).astype(
            np.int64
        )


def resolve_era5_path(
    file: str | os.PathLike[str] = "era5-2mt-2019-03-uk.grib",
    data_dir_path: str | os.PathLike[str] | None = None,
) -> Path:
    """Find a field file: an existing path as given, else ``<data_dir>/era5/<file>``, else
    ``<data_dir>/<file>``; ``FileNotFoundError`` names every place looked at."""
    p = Path(file)
    if p.is_file():
        return p
    root = data_dir(data_dir_path)
    tried = [str(p)]
    for cand in (root / "era5" / p, root / p):
        tried.append(str(cand))
        if cand.is_file():
            return cand
    raise FileNotFoundError(f"field file {str(file)!r} not found (tried {tried})")


def grib_message_count(path: str | os.PathLike[str]) -> int | None:
    """Count the complete GRIB messages of a file by their headers, refusing a cut-off file.

    Each message starts with ``GRIB``, states its total length (edition 1: 3 bytes at offset 4;
    edition 2: 8 bytes at offset 8) and ends with ``7777``; bytes between messages (padding)
    are skipped. eccodes silently drops an incomplete last message (cfgrib then loads the
    complete ones), so a download cut short would load as a shorter month.

    Returns
    -------
    int or None
        The number of messages; ``None`` when a GRIB 1 message uses ECMWF's large-message
        length encoding, whose true length needs the section contents (not checked).

    Raises
    ------
    DataFormatError
        No GRIB message at all, a message running past the end of the file (the count of
        complete ones named), a message not ending with ``7777``, an unknown edition. A file
        cut exactly at a message boundary cannot be told from a shorter one.

    Examples
    --------
    >>> import os, tempfile
    >>> msg = b"GRIB" + (20).to_bytes(3, "big") + b"\x01" + bytes(8) + b"7777"  # GRIB 1 frame
    >>> p = os.path.join(tempfile.mkdtemp(), "two.grib")
    >>> _ = open(p, "wb").write(msg + bytes(4) + msg)  # zero padding between messages is fine
    >>> grib_message_count(p)
    2
    >>> _ = open(p, "wb").write(msg * 2 + msg[:12])
    >>> grib_message_count(p)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    attnuq.data.DataFormatError: ...two.grib: truncated GRIB file: message 3 at byte 40 ...
    """
    p = Path(path)
    size = p.stat().st_size
    n = 0
    pos = 0
    with p.open("rb") as fh:
        while (start := _find(fh, b"GRIB", pos)) >= 0:
            fh.seek(start)
            head = fh.read(16)
            edition = head[7] if len(head) >= 8 else -1
            problem = ""
            if edition == 1:
                length = int.from_bytes(head[4:7], "big")
                if length & 0x800000:
                    return None
            elif edition == 2 and len(head) == 16:
                length = int.from_bytes(head[8:16], "big")
            elif len(head) < 16 and edition in (-1, 2):
                length = 16  # header itself cut off: reported as truncated below
            else:
                length = 0
                problem = f"message {n + 1} at byte {start} has unknown edition {edition}"
            if not problem and start + length > size:
                problem = (
                    f"message {n + 1} at byte {start} needs {length} bytes but the file ends "
                    f"{size - start} bytes into it"
                )
                if n:
                    raise DataFormatError(
                        p, f"truncated GRIB file: {problem}; only the {n} complete messages "
                        "before it would load (was the download cut short?)",
                    )
            if not problem:
                fh.seek(start + length - 4)
                if length < 12 or fh.read(4) != b"7777":
                    problem = (
                        f"message {n + 1} at byte {start} (length {length}) does not end with "
                        "'7777': the file is corrupt"
                    )
            if problem:
                if n == 0:  # the first 'GRIB' was no message: most likely not a GRIB file
                    problem = f"could not read {p.name!r} as GRIB: no complete message ({problem})"
                raise DataFormatError(p, problem)
            n += 1
            pos = start + length
    if n == 0:
        raise DataFormatError(p, f"could not read {p.name!r} as GRIB: no GRIB message in it")
    return n


def _find(fh: BinaryIO, token: bytes, pos: int, chunk: int = 1 << 20) -> int:
    """Offset of the first ``token`` at or after ``pos`` in the open file, or -1."""
    while True:
        fh.seek(pos)
        buf = fh.read(chunk)
        if len(buf) < len(token):
            return -1
        k = buf.find(token)
        if k >= 0:
            return pos + k
        pos += len(buf) - len(token) + 1


def _open(path: Path):  # type: ignore[no-untyped-def]
    import xarray as xr

    suffix = path.suffix.lower()
    kwargs: dict[str, Any]
    if suffix in _GRIB:
        try:
            import cfgrib  # noqa: F401
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ImportError(
                f"reading GRIB file {path.name!r} needs cfgrib + eccodes (extra 'weather')"
            ) from exc
        # indexpath="": do not write a .idx file next to (possibly read-only) data
        kind, kwargs = "GRIB", {"engine": "cfgrib", "backend_kwargs": {"indexpath": ""}}
    elif suffix in _NETCDF:
        kind, kwargs = "NetCDF", {}
    else:
        raise ValueError(
            f"unknown field file type {suffix!r} for {path.name!r}; expected GRIB {_GRIB} or "
            f"NetCDF {_NETCDF}"
        )
    try:
        return xr.open_dataset(path, **kwargs)
    except (EOFError, OSError, ValueError, KeyError) as exc:  # not GRIB/NetCDF, or truncated
        raise DataFormatError(path, f"could not read {path.name!r} as {kind}: "
                              f"{type(exc).__name__}: {exc}") from exc


def load_field(path: str | os.PathLike[str], variable: str | None = None) -> Field:
    """Read one ``(time, latitude, longitude)`` variable from a GRIB or NetCDF file.

    Parameters
    ----------
    path
        GRIB (``.grib``, ``.grb``, ...) or NetCDF (``.nc``, ...) file.
    variable
        Variable to read; by default the only data variable (error if there are several).

    Raises
    ------
    FileNotFoundError
        No such file.
    attnuq.data.DataFormatError
        A file that does not open, a truncated GRIB (see :func:`grib_message_count`), GRIB
        messages that were not read (skipped by cfgrib), wrong dimensions (named), NaN/inf values
        (counted), times not strictly increasing, fewer than 2 times.
    ValueError
        Unknown variable (the known ones named), several variables and no ``variable``.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"field file not found: {str(p)!r}")
    n_messages = grib_message_count(p) if p.suffix.lower() in _GRIB else None
    ds = _open(p)
    try:
        names = list(ds.data_vars)
        if variable is None:
            if len(names) != 1:
                raise ValueError(f"{p.name!r} has data variables {names}; pass variable=")
            variable = names[0]
        if variable not in ds.data_vars:
            raise ValueError(f"unknown {variable=!r} in {p.name!r}; it has {names}")
        da = ds[variable]
        da = da.rename({d: _ALIASES[d] for d in da.dims if d in _ALIASES})
        extra = [d for d in da.dims if d not in ("time", "latitude", "longitude")]
        for d in extra:
            if da.sizes[d] != 1:
                raise DataFormatError(
                    p, f"variable {variable!r} has non-singleton dimension {d!r} "
                    f"(size {da.sizes[d]}); dims={dict(da.sizes)}; expected "
                    "(time, latitude, longitude)"
                )
        da = da.squeeze(extra, drop=True) if extra else da
        missing = [d for d in ("time", "latitude", "longitude") if d not in da.dims]
        if missing:
            raise DataFormatError(
                p, f"variable {variable!r} lacks dimensions {missing}; dims={dict(da.sizes)}"
            )
        da = da.transpose("time", "latitude", "longitude")
        arr = np.asarray(da.values, dtype=np.float64)
        times = np.asarray(da["time"].values).astype("datetime64[ns]")
        lat = np.asarray(da["latitude"].values, dtype=np.float64)
        lon = np.asarray(da["longitude"].values, dtype=np.float64)
        # 2-D fields in the dataset: one GRIB message each
        n_fields = sum(
            int(v.size) // max(1, int(np.prod([v.sizes[d] for d in v.dims if d in _HORIZONTAL])))
            for v in ds.data_vars.values()
        )
    finally:
        ds.close()
    if n_messages is not None and n_messages > n_fields:
        raise DataFormatError(
            p, f"the file holds {n_messages} GRIB messages but only {n_fields} fields were read "
            f"({len(times)} time steps of {variable!r}): cfgrib skipped messages (corrupt, or "
            "of another level type or variable)",
        )
    bad = ~np.isfinite(arr)
    if bad.any():
        raise DataFormatError(
            p, f"variable {variable!r} has {int(bad.sum())} NaN/inf values "
            f"(first at time index {int(np.argwhere(bad)[0][0])})"
        )
    if len(times) < 2:
        raise DataFormatError(p, f"{len(times)} time steps; need at least 2")
    if not (np.diff(times) > np.timedelta64(0, "ns")).all():
        k = int(np.argmin(np.diff(times) > np.timedelta64(0, "ns"))) + 1
        raise DataFormatError(p, f"times are not strictly increasing (time index {k})")
    return Field(
        values=torch.from_numpy(arr.astype(np.float32)),
        times=times,
        lat=lat,
        lon=lon,
        variable=str(variable),
        path=p,
    )


def day_blocks(
    times: np.ndarray, splits: Sequence[tuple[str, int]]
) -> dict[str, np.ndarray]:
    """Consecutive blocks of whole days, in order: ``[("train", 18), ("val", 5), ...]``.

    Returns time indices per block; a count of ``-1`` for the last block takes the remaining
    days. Raises ``ValueError`` if the file has fewer days than asked.
    """
    days = times.astype("datetime64[D]")
    uniq = np.unique(days)
    out: dict[str, np.ndarray] = {}
    k = 0
    for i, (name, n) in enumerate(splits):
        if n == -1 and i == len(splits) - 1:
            n = len(uniq) - k
        if n < 1 or k + n > len(uniq):
            raise ValueError(
                f"cannot take {n} days for {name!r} after {k} of {len(uniq)} days "
                f"({uniq[0]} .. {uniq[-1]})"
            )
        sel = np.isin(days, uniq[k : k + n])
        out[name] = np.flatnonzero(sel)
        k += n
    return out


@dataclass(frozen=True)
class Examples:
    """Forecast examples: ``inputs`` ``(N, 2 + n_extra, n_lat, n_lon)`` (field at ``t``, at
    ``t - history``, at ``t - lag`` for each extra lag),
    ``targets`` ``(N, n_leads, n_lat, n_lon)``, ``t_index`` ``(N,)`` issue-time index into the
    field, ``hours`` ``(N,)`` issue hour of day, ``leads`` in hours."""

    inputs: torch.Tensor
    targets: torch.Tensor
    t_index: np.ndarray
    hours: np.ndarray
    leads: tuple[int, ...]
    history: int

    def __len__(self) -> int:
        return int(self.inputs.shape[0])


def make_examples(
    field: Field,
    block: np.ndarray,
    *,
    history: int = 6,
    leads: Sequence[int] = (6, 24),
    step: int = 1,
    extra_lags: Sequence[int] = (),
) -> Examples:
    """Examples whose whole span ``[t - history, t + max(leads)]`` lies inside ``block``.

    Parameters
    ----------
    field
        Hourly field (times must be exactly hourly inside the block).
    block
        Sorted, contiguous time indices (e.g. one entry of :func:`day_blocks`).
    history, leads
        Hours back for the second input field; hours ahead for the targets.
    step
        Hours between consecutive issue times.
    extra_lags
        Hours back of further input fields, appended as channels ``x(t - lag)`` after the two
        (e.g. ``(24, 18)``: the field a day before the issue time and a day before the valid
        time of lead 6 h); the span then starts at ``t - max(history, *extra_lags)``.

    Examples
    --------
    >>> import numpy as np, torch
    >>> t = np.arange("2019-03-01", 72, dtype="datetime64[h]").astype("datetime64[ns]")
    >>> f = Field(torch.arange(72.0)[:, None, None].expand(72, 1, 1), t, np.zeros(1),
    ...           np.zeros(1), "t2m", Path("x"))
    >>> ex = make_examples(f, np.arange(72), leads=(6,), extra_lags=(24, 18))
    >>> ex.inputs[0, :, 0, 0].tolist(), ex.t_index[0]  # x(t), x(t-6), x(t-24), x(t-18)
    ([24.0, 18.0, 0.0, 6.0], np.int64(24))
    """
    history = check_positive_int(history, "history")
    step = check_positive_int(step, "step")
    leads_t = tuple(check_positive_int(int(v), "lead") for v in leads)
    lags = tuple(check_positive_int(int(v), "extra lag") for v in extra_lags)
    span = max((history, *lags))
    if not leads_t:
        raise ValueError(f"leads must not be empty, got {leads=}")
    block = np.asarray(block, dtype=np.int64)
    if block.size == 0 or (np.diff(block) != 1).any():
        raise ValueError("block must be a non-empty run of consecutive time indices")
    dt = np.diff(field.times[block]) / np.timedelta64(1, "h")
    if block.size > 1 and not np.allclose(dt, 1.0):
        raise ValueError("times inside the block are not hourly")
    lo, hi = int(block[0]), int(block[-1])
    t0 = np.arange(lo + span, hi - max(leads_t) + 1, step)
    if t0.size == 0:
        raise ValueError(
            f"block of {block.size} hours is too short for {history=}, extra_lags={lags} and "
            f"leads={leads_t}"
        )
    v = field.values
    inputs = torch.stack([v[t0], v[t0 - history], *[v[t0 - lag] for lag in lags]], dim=1)
    targets = torch.stack([v[t0 + h] for h in leads_t], dim=1)
    return Examples(
        inputs=inputs, targets=targets, t_index=t0, hours=field.hours[t0],
        leads=leads_t, history=history,
    )


def hourly_climatology(field: Field, block: np.ndarray) -> torch.Tensor:
    """``(24, n_lat, n_lon)`` hour-of-day mean over the times in ``block``.

    Raises ``ValueError`` naming the hours of day with no data in the block.
    """
    block = np.asarray(block, dtype=np.int64)
    hrs = field.hours[block]
    missing = sorted(set(range(24)) - set(hrs.tolist()))
    if missing:
        raise ValueError(f"no data for hours of day {missing} in the climatology period")
    v = field.values[block].double()
    clim = torch.stack([v[torch.from_numpy(hrs == h)].mean(0) for h in range(24)])
    return clim.float()
