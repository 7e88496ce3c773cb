"""PhysioNet/Computing in Cardiology Challenge 2012 loader (raw files, t-PatchGNN protocol).

Reads the challenge files exactly as distributed: a folder of ``<RecordID>.txt`` files or a
``set-a.tar.gz``-style archive (read in place with :mod:`tarfile`, nothing is extracted). Each
file is ``Time,Parameter,Value`` with ``Time`` as ``HH:MM`` since ICU admission. Every parameter
except ``RecordID`` is a channel; the static descriptors (``Age``, ``Gender``, ``Height``,
``ICUType``, ``Weight`` at ``00:00``) are observations at ``t = 0``; a descriptor value of ``-1``
means *missing* and is not an observation (counted in :attr:`PhysioNet2012.n_missing_descriptors`).
Repeated readings (same time, same parameter) are all kept. Times are in hours.

Protocol (t-PatchGNN, Zhang et al. 2024): observe ``[0, 24]`` h, forecast every observation in
``(24, 48]`` h; stays are split 60/20/20 into train/val/test with a fixed seed; values are min-max
scaled per channel with the minimum and maximum over all observations of the train+val stays.

Parsed arrays are cached on disk (``cache_dir``, default ``$XDG_CACHE_HOME/attnuq`` or
``~/.cache/attnuq``) under a key that hashes the source bytes and the parser version.

Malformed lines (wrong field count, bad ``HH:MM``, non-numeric or non-finite value, unknown
parameter name, empty parameter) and malformed files (no ``Time,Parameter,Value`` header, no
``RecordID``, undecodable bytes) are never dropped silently: with ``errors="raise"`` (default) the
first one raises :class:`attnuq.data.DataFormatError` naming file and line (``<archive>/<member>``
for a stay inside a tar file); with ``errors="warn"`` each is skipped, listed
in :attr:`PhysioNet2012.issues` as a :class:`ParseIssue` (file, line, message), and one
:class:`PhysioNetParseWarning` summarises them.

Examples
--------
>>> from attnuq_bench.data.physionet import load_physionet2012          # doctest: +SKIP
>>> ds = load_physionet2012("../shared/data/physionet2012/set-a.tar.gz")  # doctest: +SKIP
>>> batch = ds.batch(ds.split_indices("train")[:8])               # doctest: +SKIP
>>> batch.obs_values.shape, batch.query_times.shape               # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import math
import os
import tarfile
import warnings
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from attnuq.data import DataFormatError

__all__ = [
    "PARSER_VERSION",
    "STATIC_DESCRIPTORS",
    "ForecastBatch",
    "ParseIssue",
    "PhysioNet2012",
    "PhysioNetParseWarning",
    "default_cache_dir",
    "load_physionet2012",
    "parse_record",
]

#: bump when parsing changes, so old caches are not reused
PARSER_VERSION = "physionet2012-v1"

#: descriptors recorded once at 00:00; value -1 means missing
STATIC_DESCRIPTORS: tuple[str, ...] = ("Age", "Gender", "Height", "ICUType", "Weight")

#: the 42 parameter names of the challenge documentation (RecordID + 5 descriptors + 36 series);
#: any name outside this set is reported as an unknown parameter
KNOWN_PARAMETERS: tuple[str, ...] = (
    "RecordID", "Age", "Gender", "Height", "ICUType", "Weight",
    "Albumin", "ALP", "ALT", "AST", "Bilirubin", "BUN", "Cholesterol", "Creatinine",
    "DiasABP", "FiO2", "GCS", "Glucose", "HCO3", "HCT", "HR", "K", "Lactate", "Mg", "MAP",
    "MechVent", "Na", "NIDiasABP", "NIMAP", "NISysABP", "PaCO2", "PaO2", "pH", "Platelets",
    "RespRate", "SaO2", "SysABP", "Temp", "TroponinI", "TroponinT", "Urine", "WBC",
)

ErrorPolicy = Literal["raise", "warn"]
Split = Literal["train", "val", "test"]


class PhysioNetParseWarning(UserWarning):
    """Emitted once per load with ``errors="warn"`` when lines or files were skipped."""


@dataclass(frozen=True)
class ParseIssue:
    """One malformed line (``line >= 1``) or file (``line == 0``)."""

    file: str
    line: int
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where}: {self.message}"


@dataclass
class _Record:
    record_id: int
    times: list[float] = field(default_factory=list)
    params: list[str] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    n_missing: int = 0


def _check_errors(errors: str) -> ErrorPolicy:
    if errors not in ("raise", "warn"):
        raise ValueError(f"errors must be 'raise' or 'warn', got {errors=!r}")
    return errors  # type: ignore[return-value]


def parse_record(
    text: str,
    name: str,
    *,
    issues: list[ParseIssue],
    errors: ErrorPolicy = "raise",
    source: str | os.PathLike[str] | None = None,
) -> _Record | None:
    """Parse one stay's file text; return ``None`` if the file itself is malformed.

    Each problem becomes a :class:`ParseIssue` appended to ``issues`` (``errors="warn"``) or a
    :class:`~attnuq.data.DataFormatError` naming ``source/name`` (``name`` alone without a
    ``source``) and the line number (``errors="raise"``).
    """
    errors = _check_errors(errors)
    where = Path(source) / name if source is not None else Path(name)

    def report(line: int, msg: str) -> None:
        if errors == "raise":
            raise DataFormatError(where, msg, line=line or None)
        issues.append(ParseIssue(name, line, msg))

    lines = text.splitlines()
    if not lines or lines[0].strip().replace(" ", "") != "Time,Parameter,Value":
        first = lines[0][:60] if lines else ""
        report(1, f"missing header 'Time,Parameter,Value' (first line {first!r})")
        return None
    rec = _Record(record_id=-1)
    known = set(KNOWN_PARAMETERS)
    for lineno, raw in enumerate(lines[1:], start=2):
        line = raw.strip()
        if not line:
            continue  # blank lines (e.g. a trailing newline) carry nothing
        parts = line.split(",")
        if len(parts) != 3:
            report(lineno, f"expected 3 comma-separated fields, got {len(parts)}: {line!r}")
            continue
        tstr, param, vstr = (p.strip() for p in parts)
        hm = tstr.split(":")
        try:
            if len(hm) != 2:
                raise ValueError
            hh, mm = int(hm[0]), int(hm[1])
            if hh < 0 or not 0 <= mm < 60:
                raise ValueError
        except ValueError:
            report(lineno, f"bad time {tstr!r} (expected HH:MM)")
            continue
        if not param:
            report(lineno, "empty parameter name")
            continue
        if param not in known:
            report(lineno, f"unknown parameter {param!r}")
            continue
        try:
            value = float(vstr)
        except ValueError:
            report(lineno, f"non-numeric value {vstr!r} for {param}")
            continue
        if not math.isfinite(value):
            report(lineno, f"non-finite value {vstr!r} for {param}")
            continue
        if param == "RecordID":
            if value != round(value) or value < 0:
                report(lineno, f"RecordID {vstr!r} is not a non-negative integer")
                continue
            if rec.record_id != -1 and int(value) != rec.record_id:
                report(lineno, f"second RecordID {vstr} (first {rec.record_id})")
                continue
            rec.record_id = int(value)
            continue
        if param in STATIC_DESCRIPTORS and value == -1.0:
            rec.n_missing += 1  # documented missing-value code, not an observation
            continue
        rec.times.append(hh + mm / 60.0)
        rec.params.append(param)
        rec.values.append(value)
    if rec.record_id == -1:
        report(0, "no RecordID line")
        return None
    return rec


def _iter_sources(path: Path) -> Iterator[tuple[str, bytes]]:
    """Yield ``(name, bytes)`` for every ``*.txt`` stay file of a folder or a tar archive."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix == ".txt" and p.is_file())
        for p in files:
            if p.name.lower().startswith("outcomes"):
                continue
            yield p.name, p.read_bytes()
        return
    # read members in archive order (a gzip stream cannot seek backwards cheaply), then sort
    found: list[tuple[str, bytes]] = []
    try:
        if not tarfile.is_tarfile(path):
            raise DataFormatError(
                path, "PhysioNet source must be a folder of .txt files or a tar file"
            )
        with tarfile.open(path, "r:*") as tar:
            for m in tar:
                base = os.path.basename(m.name)
                skip = base.lower().startswith("outcomes") or not base.endswith(".txt")
                if not m.isfile() or skip:
                    continue
                fh = tar.extractfile(m)
                if fh is None:  # pragma: no cover - isfile() members always extract
                    continue
                found.append((m.name, fh.read()))
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:  # cut gzip header, truncated
        raise DataFormatError(path, f"could not read the archive: {type(exc).__name__}: "
                              f"{exc}") from exc
    yield from sorted(found)


def _source_hash(path: Path) -> str:
    h = hashlib.sha256(PARSER_VERSION.encode())
    if path.is_dir():
        for p in sorted(path.iterdir()):
            if p.suffix == ".txt" and p.is_file():
                h.update(p.name.encode())
                h.update(p.read_bytes())
    else:
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:20]


def default_cache_dir() -> Path:
    """``$ATTNUQ_CACHE_DIR``, else ``$XDG_CACHE_HOME/attnuq``, else ``~/.cache/attnuq``."""
    if os.environ.get("ATTNUQ_CACHE_DIR"):
        return Path(os.environ["ATTNUQ_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "attnuq"


@dataclass
class ForecastBatch:
    """Padded batch of stays; ``B`` stays, ``L`` observed points, ``Q`` query points.

    Attributes
    ----------
    obs_times, obs_channels, obs_values, obs_mask
        ``(B, L)``: hours, channel index (long), min-max scaled value, True where real.
    query_times, query_channels, targets, query_mask
        ``(B, Q)``: the forecast window's observations (targets scaled like the inputs).
    """

    obs_times: torch.Tensor
    obs_channels: torch.Tensor
    obs_values: torch.Tensor
    obs_mask: torch.Tensor
    query_times: torch.Tensor
    query_channels: torch.Tensor
    targets: torch.Tensor
    query_mask: torch.Tensor
    index: torch.Tensor

    @property
    def n_stays(self) -> int:
        return int(self.obs_times.shape[0])

    def to(self, dtype: torch.dtype) -> ForecastBatch:
        return ForecastBatch(
            self.obs_times.to(dtype), self.obs_channels, self.obs_values.to(dtype),
            self.obs_mask, self.query_times.to(dtype), self.query_channels,
            self.targets.to(dtype), self.query_mask, self.index,
        )

    def to_device(self, device: torch.device | str) -> ForecastBatch:
        """The same batch with every tensor on ``device`` (``self`` if already there)."""
        dev = torch.device(device)
        if self.obs_times.device == dev:
            return self
        return ForecastBatch(*(getattr(self, f).to(dev) for f in (
            "obs_times", "obs_channels", "obs_values", "obs_mask", "query_times",
            "query_channels", "targets", "query_mask", "index")))


@dataclass
class PhysioNet2012:
    """Parsed PhysioNet 2012 stays in a flat (CSR) layout with the protocol attached.

    Attributes
    ----------
    record_ids
        ``(N,)`` RecordID of each stay (sorted by file name).
    channels
        channel names; ``channel`` indices refer to this list.
    offsets
        ``(N + 1,)`` stay ``n`` owns entries ``offsets[n]:offsets[n + 1]`` of the flat arrays.
    times, channel, values
        flat arrays: hours since admission, channel index, raw value; sorted by time per stay.
    split
        ``(N,)`` 0 = train, 1 = val, 2 = test.
    vmin, vmax
        ``(C,)`` per-channel min/max over train+val observations (the scaler).
    issues
        malformed lines/files that were skipped (``errors="warn"``).
    """

    record_ids: np.ndarray
    channels: list[str]
    offsets: np.ndarray
    times: np.ndarray
    channel: np.ndarray
    values: np.ndarray
    split: np.ndarray
    vmin: np.ndarray
    vmax: np.ndarray
    observe_hours: float = 24.0
    horizon_hours: float = 48.0
    issues: list[ParseIssue] = field(default_factory=list)
    n_missing_descriptors: int = 0
    source: str = ""
    cache_path: str | None = None

    @property
    def n_stays(self) -> int:
        return int(self.record_ids.shape[0])

    @property
    def n_channels(self) -> int:
        return len(self.channels)

    def split_indices(self, name: Split) -> np.ndarray:
        """Stay indices of split ``name`` (``"train"``, ``"val"`` or ``"test"``)."""
        codes = {"train": 0, "val": 1, "test": 2}
        if name not in codes:
            raise ValueError(f"split must be 'train', 'val' or 'test', got {name=!r}")
        return np.flatnonzero(self.split == codes[name])

    def scale(self, values: np.ndarray, channel: np.ndarray) -> np.ndarray:
        """Min-max scale raw values per channel: ``(x - min_c) / (max_c - min_c)``."""
        span = self.vmax - self.vmin
        span = np.where(span > 0, span, 1.0)
        return (values - self.vmin[channel]) / span[channel]

    def unscale(self, scaled: np.ndarray, channel: np.ndarray) -> np.ndarray:
        span = self.vmax - self.vmin
        span = np.where(span > 0, span, 1.0)
        return scaled * span[channel] + self.vmin[channel]

    def stay(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(times, channel, scaled values)`` of stay ``n`` over the full 48 h."""
        if not 0 <= n < self.n_stays:
            raise IndexError(f"stay index out of range, got {n=} for {self.n_stays} stays")
        s, e = int(self.offsets[n]), int(self.offsets[n + 1])
        ch = self.channel[s:e]
        return self.times[s:e], ch, self.scale(self.values[s:e], ch)

    def batch(
        self,
        indices: Sequence[int] | np.ndarray,
        *,
        keep_fraction: float = 1.0,
        max_queries: int | None = None,
        generator: np.random.Generator | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> ForecastBatch:
        """Pad the stays ``indices`` into a :class:`ForecastBatch`.

        ``keep_fraction < 1`` keeps a random subset of the *observed* points of each stay (the
        sparsity sweep); the forecast targets are never thinned by it. ``max_queries`` keeps a
        random subset of at most that many forecast points per stay (training speed only;
        evaluation uses every point). A stay with no observation in the window gets an empty
        (fully masked) row.
        """
        if max_queries is not None and max_queries < 1:
            raise ValueError(f"max_queries must be >= 1 or None, got {max_queries=}")
        idx = np.asarray(indices, dtype=np.int64)
        if idx.ndim != 1 or idx.size == 0:
            raise ValueError(f"indices must be a non-empty 1-D sequence, got shape {idx.shape}")
        if not 0.0 < keep_fraction <= 1.0:
            raise ValueError(f"keep_fraction must lie in (0, 1], got {keep_fraction=}")
        rng = generator if generator is not None else np.random.default_rng(0)
        obs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        qry: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for n in idx:
            t, c, v = self.stay(int(n))
            o = t <= self.observe_hours
            q = (t > self.observe_hours) & (t <= self.horizon_hours)
            ot, oc, ov = t[o], c[o], v[o]
            if keep_fraction < 1.0 and ot.size:
                keep = rng.random(ot.size) < keep_fraction
                ot, oc, ov = ot[keep], oc[keep], ov[keep]
            qt, qc, qv = t[q], c[q], v[q]
            if max_queries is not None and qt.size > max_queries:
                sel = np.sort(rng.choice(qt.size, size=max_queries, replace=False))
                qt, qc, qv = qt[sel], qc[sel], qv[sel]
            obs.append((ot, oc, ov))
            qry.append((qt, qc, qv))
        ot_, oc_, ov_, om_ = _pad(obs, dtype)
        qt_, qc_, qv_, qm_ = _pad(qry, dtype)
        return ForecastBatch(ot_, oc_, ov_, om_, qt_, qc_, qv_, qm_, torch.as_tensor(idx))

    def batches(
        self,
        indices: np.ndarray,
        batch_size: int,
        *,
        shuffle: bool = False,
        by_length: bool = False,
        generator: np.random.Generator | None = None,
        keep_fraction: float = 1.0,
        max_queries: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Iterable[ForecastBatch]:
        """Iterate over :meth:`batch` of chunks of ``indices``.

        ``by_length`` groups stays of similar length (less padding; chunk order shuffled when
        ``shuffle``); otherwise chunks are consecutive or, with ``shuffle``, random.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size=}")
        rng = generator if generator is not None else np.random.default_rng(0)
        idx = np.asarray(indices, dtype=np.int64)
        if by_length:
            n_obs = (self.offsets[idx + 1] - self.offsets[idx]).astype(np.float64)
            jitter = rng.random(idx.size) if shuffle else np.zeros(idx.size)
            order = idx[np.lexsort((jitter, n_obs))]
            chunks = [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
            if shuffle:
                chunks = [chunks[i] for i in rng.permutation(len(chunks))]
        else:
            order = rng.permutation(idx) if shuffle else idx
            chunks = [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
        for chunk in chunks:
            yield self.batch(
                chunk, keep_fraction=keep_fraction, max_queries=max_queries, generator=rng,
                dtype=dtype,
            )

    def summary(self) -> dict[str, object]:
        """Counts for the results file (stays, channels, observations, split sizes, issues)."""
        n_obs = np.diff(self.offsets)
        first = np.array(
            [int((self.times[s:e] <= self.observe_hours).sum())
             for s, e in zip(self.offsets[:-1], self.offsets[1:], strict=True)]
        )
        return {
            "source": Path(self.source).name,
            "n_stays": self.n_stays,
            "n_channels": self.n_channels,
            "channels": list(self.channels),
            "n_observations": int(n_obs.sum()),
            "mean_observed_points_per_stay": float(first.mean()) if first.size else 0.0,
            "mean_forecast_points_per_stay": float((n_obs - first).mean()) if first.size else 0.0,
            "split_sizes": {k: len(self.split_indices(k)) for k in ("train", "val", "test")},
            "n_missing_descriptors": self.n_missing_descriptors,
            "n_issues": len(self.issues),
        }


def _pad(
    rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    b = len(rows)
    length = max(1, max(r[0].size for r in rows))
    t = torch.zeros(b, length, dtype=dtype)
    c = torch.zeros(b, length, dtype=torch.long)
    v = torch.zeros(b, length, dtype=dtype)
    m = torch.zeros(b, length, dtype=torch.bool)
    for i, (ti, ci, vi) in enumerate(rows):
        k = ti.size
        if k:
            t[i, :k] = torch.as_tensor(ti, dtype=dtype)
            c[i, :k] = torch.as_tensor(ci, dtype=torch.long)
            v[i, :k] = torch.as_tensor(vi, dtype=dtype)
            m[i, :k] = True
    return t, c, v, m


def _parse_all(
    path: Path, errors: ErrorPolicy
) -> tuple[list[_Record], list[ParseIssue]]:
    issues: list[ParseIssue] = []
    records: list[_Record] = []
    seen: dict[int, str] = {}
    for name, raw in _iter_sources(path):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = raw[: exc.start].count(b"\n") + 1
            msg = f"not UTF-8 text ({exc.reason} at byte {exc.start})"
            if errors == "raise":
                raise DataFormatError(path / name, msg, line=line) from None
            issues.append(ParseIssue(name, line, msg))
            continue
        rec = parse_record(text, name, issues=issues, errors=errors, source=path)
        if rec is None:
            continue
        if rec.record_id in seen:
            msg = f"duplicate RecordID {rec.record_id} (also {seen[rec.record_id]})"
            if errors == "raise":
                raise DataFormatError(path / name, msg)
            issues.append(ParseIssue(name, 0, msg))
            continue
        seen[rec.record_id] = name
        records.append(rec)
    return records, issues


def load_physionet2012(
    source: str | os.PathLike[str] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    use_cache: bool = True,
    errors: str = "raise",
    seed: int = 0,
    fractions: tuple[float, float, float] = (0.6, 0.2, 0.2),
    observe_hours: float = 24.0,
    horizon_hours: float = 48.0,
) -> PhysioNet2012:
    """Load PhysioNet 2012 stays from a folder or an archive and attach the forecast protocol.

    Parameters
    ----------
    source
        folder of ``<RecordID>.txt`` files, a tar(.gz) archive of them, or a folder holding
        ``set-a.tar.gz`` (default: ``attnuq.data.data_dir() / "physionet2012" / "set-a.tar.gz"``).
    cache_dir
        where parsed arrays are cached (default :func:`default_cache_dir`); never the repository.
    errors
        ``"raise"``: the first malformed line/file raises :class:`~attnuq.data.DataFormatError`
        (a ``ValueError``) with file and line;
        ``"warn"``: skip it, list it in ``issues``, emit one :class:`PhysioNetParseWarning`.
    seed
        seed of the train/val/test permutation (fixed across model seeds).
    fractions
        train/val/test fractions (sum 1).

    Returns
    -------
    PhysioNet2012
        channels are the parameters present in the files (every one except ``RecordID``),
        in the order of ``KNOWN_PARAMETERS``.
    """
    policy = _check_errors(errors)
    if len(fractions) != 3 or any(f <= 0 for f in fractions) or abs(sum(fractions) - 1) > 1e-9:
        raise ValueError(f"fractions must be three positive numbers summing to 1, got {fractions=}")
    if not 0 < observe_hours < horizon_hours:
        raise ValueError(
            f"need 0 < observe_hours < horizon_hours, got {observe_hours=}, {horizon_hours=}"
        )
    path = _resolve_source(source)
    key = _source_hash(path)
    cdir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache_file = cdir / f"physionet2012-{key}-{policy}.pt"
    arrays: dict[str, object] | None = None
    if use_cache and cache_file.is_file():
        try:
            arrays = torch.load(cache_file, weights_only=False)
        except Exception as exc:  # a corrupt cache is re-parsed, not trusted
            warnings.warn(f"ignoring unreadable cache {cache_file}: {exc}", stacklevel=2)
            arrays = None
    if arrays is None:
        arrays = _build_arrays(path, policy)
        if use_cache:
            cdir.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(".tmp")
            torch.save(arrays, tmp)
            os.replace(tmp, cache_file)
    issues = [ParseIssue(*x) for x in arrays["issues"]]  # type: ignore[attr-defined]
    if issues:
        shown = "; ".join(str(i) for i in issues[:5])
        more = f" (+{len(issues) - 5} more)" if len(issues) > 5 else ""
        warnings.warn(
            f"PhysioNet 2012: skipped {len(issues)} malformed line(s)/file(s): {shown}{more}",
            PhysioNetParseWarning,
            stacklevel=2,
        )
    record_ids = np.asarray(arrays["record_ids"])
    n = record_ids.shape[0]
    if n < 3:
        raise DataFormatError(path, f"need at least 3 stays for a train/val/test split, got {n}")
    perm = np.random.default_rng(seed).permutation(n)
    n_train = round(fractions[0] * n)
    n_val = round(fractions[1] * n)
    n_train = min(max(n_train, 1), n - 2)
    n_val = min(max(n_val, 1), n - n_train - 1)
    split = np.full(n, 2, dtype=np.int64)
    split[perm[:n_train]] = 0
    split[perm[n_train : n_train + n_val]] = 1
    offsets = np.asarray(arrays["offsets"])
    times = np.asarray(arrays["times"])
    channel = np.asarray(arrays["channel"])
    values = np.asarray(arrays["values"])
    channels = list(arrays["channels"])  # type: ignore[call-overload]
    stay_of = np.repeat(np.arange(n), np.diff(offsets))
    in_fit = (split[stay_of] <= 1) & (times <= horizon_hours)
    c_count = len(channels)
    vmin = np.zeros(c_count)
    vmax = np.ones(c_count)
    for c in range(c_count):
        sel = in_fit & (channel == c)
        if sel.any():
            vmin[c], vmax[c] = values[sel].min(), values[sel].max()
    return PhysioNet2012(
        record_ids=record_ids, channels=channels, offsets=offsets, times=times,
        channel=channel, values=values, split=split, vmin=vmin, vmax=vmax,
        observe_hours=observe_hours, horizon_hours=horizon_hours, issues=issues,
        n_missing_descriptors=int(arrays["n_missing"]),  # type: ignore[call-overload]
        source=str(path), cache_path=str(cache_file) if use_cache else None,
    )


def _resolve_source(source: str | os.PathLike[str] | None) -> Path:
    if source is None:
        from attnuq_bench.data import data_dir

        source = data_dir() / "physionet2012"
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"PhysioNet 2012 source not found: {path}")
    stay_files = (
        [p for p in path.iterdir() if p.suffix == ".txt" and not p.name.lower().startswith("outc")]
        if path.is_dir()
        else []
    )
    if path.is_dir() and not stay_files:
        tars = sorted(path.glob("set-*.tar.gz"))
        if not tars:
            raise FileNotFoundError(f"no <RecordID>.txt files or set-*.tar.gz archive in {path}")
        if len(tars) > 1:
            raise ValueError(f"several archives in {path}: {[t.name for t in tars]}; pass one")
        path = tars[0]
    return path


def _build_arrays(path: Path, errors: ErrorPolicy) -> dict[str, object]:
    records, issues = _parse_all(path, errors)
    if not records:
        shown = f"; first: {issues[0]}" if issues else ""
        raise DataFormatError(
            path, f"no valid PhysioNet stay files ({len(issues)} issues{shown})"
        )
    present = {p for r in records for p in r.params}
    channels = [p for p in KNOWN_PARAMETERS if p in present]
    cidx = {p: i for i, p in enumerate(channels)}
    offsets = [0]
    t_all: list[np.ndarray] = []
    c_all: list[np.ndarray] = []
    v_all: list[np.ndarray] = []
    for r in records:
        t = np.asarray(r.times, dtype=np.float64)
        c = np.asarray([cidx[p] for p in r.params], dtype=np.int64)
        v = np.asarray(r.values, dtype=np.float64)
        order = np.argsort(t, kind="stable")
        t_all.append(t[order])
        c_all.append(c[order])
        v_all.append(v[order])
        offsets.append(offsets[-1] + t.size)
    def cat(xs: list[np.ndarray], dt: type) -> np.ndarray:
        return np.concatenate(xs) if xs else np.zeros(0, dtype=dt)

    return {
        "record_ids": np.asarray([r.record_id for r in records], dtype=np.int64),
        "channels": channels,
        "offsets": np.asarray(offsets, dtype=np.int64),
        "times": cat(t_all, np.float64),
        "channel": cat(c_all, np.int64),
        "values": cat(v_all, np.float64),
        "issues": [(i.file, i.line, i.message) for i in issues],
        "n_missing": int(sum(r.n_missing for r in records)),
        "parser_version": PARSER_VERSION,
    }
