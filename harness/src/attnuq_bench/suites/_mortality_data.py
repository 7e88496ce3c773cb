"""The data of ``attnuq bench mortality``: PhysioNet 2012 stays, their outcomes, the splits.

* stays: :func:`attnuq_bench.data.physionet.load_physionet2012` over the whole 48 h (every
  observation is an input: ``observe_hours=48``), the split of mTAN (Shukla & Marlin 2021) on
  set-a: 20 % test by a fixed permutation (``split_seed``), 20 % of the rest for validation;
  the calibration part (split conformal, SA's sets) is carved from the training part
  (``cal_fraction`` of it, by the same seed), so the backbone trains on the rest;
* labels: ``In-hospital_death`` of ``Outcomes-<set>.txt`` (:func:`read_outcomes`), matched by
  ``RecordID``; a stay without an outcome line is an error naming the file;
* standardisation: per channel, mean and std of the training observations after clipping
  them to their 0.5 % / 99.5 % quantiles (the clip is kept and applied to every part);
* two views of a stay (:func:`grid_inputs`, :func:`irregular_inputs`): tokens of time
  windows for the softmax transformer (per window and channel: value carried forward, window
  mean / min / max, count, time since the last observation, and the absolute values of the
  first four; ``(48 / window, 10 C)``) and the
  irregular observations for the Levy classifier (times, channels, per-observation features,
  mask; ``(N,)`` each).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnuq.data import DataFormatError

__all__ = [
    "N_GRID_FEATURES",
    "N_OBS_FEATURES",
    "IrregularInputs",
    "MortalityData",
    "grid_inputs",
    "irregular_inputs",
    "load_mortality",
    "n_obs_features",
    "read_outcomes",
]

N_HOURS = 48
#: per-observation features of the Levy classifier besides the value slots
#: (:func:`n_obs_features`): time / 48, "last observation of its channel" flag,
#: log(1 + number of observations of its channel) / 5
N_OBS_FEATURES = 3
#: features per channel of a :func:`grid_inputs` token
N_GRID_FEATURES = 10


def n_obs_features(n_channels: int) -> int:
    """Features per observation of :func:`irregular_inputs` for ``n_channels`` channels.

    The standardised value ``z`` and ``|z|`` sit in slots of their channel (``2 C`` columns,
    zero elsewhere), then the :data:`N_OBS_FEATURES` shared ones. In slots, the Levy value
    embedding (linear in the features) weighs each channel's value with its own sign and
    size, and ``|z|`` lets it score values far from typical on either side.

    >>> n_obs_features(41)
    85
    """
    return 2 * n_channels + N_OBS_FEATURES


def read_outcomes(path: str | Path, column: str = "In-hospital_death") -> dict[int, int]:
    """``RecordID -> label`` from a PhysioNet 2012 ``Outcomes-*.txt`` (comma-separated, header).

    Raises :class:`~attnuq.data.DataFormatError` naming the file and line on a missing column,
    a wrong field count or a label other than 0/1.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "Outcomes-a.txt"
    >>> _ = p.write_text("RecordID,SAPS-I,In-hospital_death\\n1,3,0\\n2,5,1\\n")
    >>> read_outcomes(p)
    {1: 0, 2: 1}
    """
    path = Path(path)
    lines = path.read_text().splitlines()
    if not lines:
        raise DataFormatError(path, "empty outcomes file")
    head = [h.strip() for h in lines[0].split(",")]
    if "RecordID" not in head or column not in head:
        raise DataFormatError(path, f"header must name RecordID and {column!r}, got {head}",
                              line=1)
    ir, ic = head.index("RecordID"), head.index(column)
    out: dict[int, int] = {}
    for k, raw in enumerate(lines[1:], start=2):
        if not raw.strip():
            continue
        f = [x.strip() for x in raw.split(",")]
        if len(f) != len(head):
            raise DataFormatError(path, f"{len(f)} fields, header has {len(head)}", line=k)
        try:
            rid, lab = int(f[ir]), int(f[ic])
        except ValueError:
            raise DataFormatError(path, f"non-integer RecordID or label: {raw!r}", line=k) from None
        if lab not in (0, 1):
            raise DataFormatError(path, f"{column} must be 0 or 1, got {lab}", line=k)
        out[rid] = lab
    return out


@dataclass
class MortalityData:
    """Stays, labels and parts (indices into the loader's stays) of one PhysioNet set."""

    ds: Any  # attnuq_bench.data.physionet.PhysioNet2012
    labels: np.ndarray  # (N,) int64
    parts: dict[str, np.ndarray]  # train / cal / val / test
    mean: np.ndarray  # (C,)
    std: np.ndarray  # (C,)
    lo: np.ndarray  # (C,) clip
    hi: np.ndarray  # (C,)
    source: str
    outcomes: str

    def summary(self) -> dict[str, Any]:
        return {"source": Path(self.source).name, "outcomes": Path(self.outcomes).name,
                "n_stays": int(self.labels.size), "n_channels": self.ds.n_channels,
                "positive_rate": float(self.labels.mean()),
                "sizes": {k: int(v.size) for k, v in self.parts.items()},
                "positives": {k: int(self.labels[v].sum()) for k, v in self.parts.items()}}


def _find_outcomes(src: Path) -> Path:
    folder = src if src.is_dir() else src.parent
    name = src.name.split(".")[0]  # set-a
    if name.startswith("set-"):
        cand = folder / f"Outcomes-{name[4:]}.txt"
        if cand.is_file():
            return cand
    found = sorted(folder.glob("Outcomes-*.txt"))
    if len(found) != 1:
        raise FileNotFoundError(f"need one Outcomes-*.txt beside {src}, found "
                                f"{[p.name for p in found]}")
    return found[0]


def load_mortality(source: str | Path, *, split_seed: int = 0, cal_fraction: float = 0.15,
                   cache_dir: str | Path | None = None, max_stays: int | None = None
                   ) -> MortalityData:
    """Load a PhysioNet 2012 set (folder or ``set-*.tar.gz``) with its outcomes and parts.

    ``max_stays``: keep a random subset of that many stays before splitting (quick runs and
    tests; the page says so).
    """
    from attnuq_bench.data.physionet import _resolve_source, load_physionet2012

    if not 0.0 < cal_fraction < 0.5:
        raise ValueError(f"cal_fraction must lie in (0, 0.5), got {cal_fraction=}")
    src = _resolve_source(source)
    outcomes = _find_outcomes(src)
    # the loader's own split is not used (fractions only need to be valid)
    ds = load_physionet2012(src, cache_dir=cache_dir, errors="warn", seed=split_seed,
                            observe_hours=float(N_HOURS), horizon_hours=float(N_HOURS) + 1.0)
    lab = read_outcomes(outcomes)
    missing = [int(r) for r in ds.record_ids if int(r) not in lab]
    if missing:
        raise DataFormatError(outcomes, f"no outcome for {len(missing)} stay(s), e.g. "
                              f"RecordID {missing[0]}")
    labels = np.asarray([lab[int(r)] for r in ds.record_ids], dtype=np.int64)
    rng = np.random.default_rng(split_seed)
    idx = np.arange(ds.n_stays)
    if max_stays is not None and max_stays < idx.size:
        idx = np.sort(rng.choice(idx, max_stays, replace=False))
    perm = rng.permutation(idx)
    n_test = round(0.2 * perm.size)
    rest = perm[n_test:]
    n_val = round(0.2 * rest.size)
    train_all = rest[n_val:]
    n_cal = max(1, round(cal_fraction * train_all.size))
    parts = {"train": np.sort(train_all[n_cal:]), "cal": np.sort(train_all[:n_cal]),
             "val": np.sort(rest[:n_val]), "test": np.sort(perm[:n_test])}
    # standardisation from the training observations (clipped to their 0.5/99.5 % quantiles)
    C = ds.n_channels
    stay_of = np.repeat(np.arange(ds.n_stays), np.diff(ds.offsets))
    in_tr = np.isin(stay_of, parts["train"])
    mean, std = np.zeros(C), np.ones(C)
    lo, hi = np.full(C, -np.inf), np.full(C, np.inf)
    for c in range(C):
        v = ds.values[in_tr & (ds.channel == c)]
        if v.size:
            lo[c], hi[c] = np.quantile(v, 0.005), np.quantile(v, 0.995)
            v = np.clip(v, lo[c], hi[c])
            mean[c], std[c] = v.mean(), max(v.std(), 1e-6)
    return MortalityData(ds=ds, labels=labels, parts=parts, mean=mean, std=std, lo=lo, hi=hi,
                         source=str(src), outcomes=str(outcomes))


def _stay(data: MortalityData, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ds = data.ds
    s, e = int(ds.offsets[n]), int(ds.offsets[n + 1])
    t, c, v = ds.times[s:e], ds.channel[s:e], ds.values[s:e]
    z = (np.clip(v, data.lo[c], data.hi[c]) - data.mean[c]) / data.std[c]
    return t, c, z


def grid_inputs(data: MortalityData, idx: np.ndarray, window: int = 4, *,
                summary: bool = True) -> torch.Tensor:
    """Tokens of ``window``-hour windows ``(B, 48 / window, 10 C)`` float32; with ``summary``
    a first token of the whole 48 h (the same features over one window) is prepended:
    ``(B, 1 + 48 / window, 10 C)``.

    Per window (observations with ``t`` in ``(w0, w0 + window]``, time 0 in the first) and
    channel: the last standardised value carried forward (0, the training mean, before the
    first observation), the mean, minimum and maximum of the window's values (carried-forward
    value when it has none), ``log(1 + count)`` of its observations, hours since the last
    observation / 48 (1 before the first), then the absolute values of the first four: many
    vital signs and labs are dangerous both far above and far below their typical value, and
    ``|z|`` gives the token embedding (linear) that U-shape directly.
    """
    if window < 1 or N_HOURS % window:
        raise ValueError(f"window must divide {N_HOURS}, got {window=}")
    if summary:
        return torch.cat([grid_inputs(data, idx, N_HOURS, summary=False),
                          grid_inputs(data, idx, window, summary=False)], dim=1)
    C = data.ds.n_channels
    T = N_HOURS // window
    out = np.zeros((len(idx), T, N_GRID_FEATURES * C), dtype=np.float32)
    for b, n in enumerate(idx):
        t, c, z = _stay(data, int(n))
        w = np.clip(np.ceil(t / window).astype(np.int64) - 1, 0, T - 1)
        last = np.zeros(C)
        t_last = np.full(C, np.nan)
        for k in range(T):
            sel = w == k
            ck, zk, tk = c[sel], z[sel], t[sel]
            cnt = np.bincount(ck, minlength=C).astype(float)
            s = np.bincount(ck, weights=zk, minlength=C)
            mn = np.full(C, np.inf)
            mx = np.full(C, -np.inf)
            np.minimum.at(mn, ck, zk)
            np.maximum.at(mx, ck, zk)
            for i in range(ck.size):  # time-sorted: the last one wins
                last[ck[i]] = zk[i]
                t_last[ck[i]] = tk[i]
            seen = cnt > 0
            end = (k + 1) * window
            out[b, k, :C] = last
            out[b, k, C:2 * C] = np.where(seen, s / np.maximum(cnt, 1), last)
            out[b, k, 2 * C:3 * C] = np.where(seen, mn, last)
            out[b, k, 3 * C:4 * C] = np.where(seen, mx, last)
            out[b, k, 4 * C:5 * C] = np.log1p(cnt)
            out[b, k, 5 * C:6 * C] = np.where(np.isnan(t_last), 1.0, (end - t_last) / N_HOURS)
    out[..., 6 * C:] = np.abs(out[..., :4 * C])
    return torch.from_numpy(out)


@dataclass(frozen=True)
class IrregularInputs:
    """Padded irregular observations of ``B`` stays, ``N`` the longest stay's count.

    ``times`` ``(B, N)`` hours, ``channels`` ``(B, N)`` int64, ``features`` ``(B, N, F)``
    (``F =`` :func:`n_obs_features` ``(C)``), ``mask`` ``(B, N)`` bool."""

    times: torch.Tensor
    channels: torch.Tensor
    features: torch.Tensor
    mask: torch.Tensor

    def to(self, device: torch.device | str) -> IrregularInputs:
        return IrregularInputs(*(getattr(self, f).to(device)
                                 for f in ("times", "channels", "features", "mask")))

    def __len__(self) -> int:
        return int(self.times.shape[0])


def irregular_inputs(data: MortalityData, idx: np.ndarray) -> IrregularInputs:
    """The observations of stays ``idx`` with their per-observation features (module doc)."""
    rows = [_stay(data, int(n)) for n in idx]
    N = max(1, max(r[0].size for r in rows))
    B = len(rows)
    times = torch.zeros(B, N)
    chans = torch.zeros(B, N, dtype=torch.long)
    C = data.ds.n_channels
    feats = torch.zeros(B, N, n_obs_features(C))
    mask = torch.zeros(B, N, dtype=torch.bool)
    for b, (t, c, z) in enumerate(rows):
        k = t.size
        if not k:
            continue
        counts = np.bincount(c, minlength=C)
        last = np.zeros(k, dtype=bool)
        seen: set[int] = set()
        for i in range(k - 1, -1, -1):  # time-sorted: the last one per channel
            if int(c[i]) not in seen:
                last[i] = True
                seen.add(int(c[i]))
        slots = np.zeros((k, 2 * C))
        slots[np.arange(k), c] = z
        slots[np.arange(k), C + c] = np.abs(z)
        f = np.concatenate([slots, np.stack([t / N_HOURS, last.astype(float),
                                             np.log1p(counts[c]) / 5.0], axis=1)], axis=1)
        times[b, :k] = torch.as_tensor(t, dtype=torch.float32)
        chans[b, :k] = torch.as_tensor(c)
        feats[b, :k] = torch.as_tensor(f, dtype=torch.float32)
        mask[b, :k] = True
    return IrregularInputs(times, chans, feats, mask)


def positive_rate_nll(p: float) -> float:
    """NLL of always predicting the base rate ``p`` (the page's no-skill reference).

    >>> round(positive_rate_nll(0.5), 4)
    0.6931
    """
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))
