"""UCI loader: standard-split layout, holdout fractions, standardisation, errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from attnuq_bench.data.uci import BUNDLED_DIR, load_uci, n_splits, uci_dir


def _raw(folder: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    data = np.loadtxt(folder / "data.txt", ndmin=2)
    f = np.loadtxt(folder / "index_features.txt", ndmin=1).astype(int)
    t = int(np.loadtxt(folder / "index_target.txt"))
    return data, f, np.array([t])


def test_bundled_concrete_parts_are_a_partition_of_the_split() -> None:
    s = load_uci("concrete", 0, data_dir="bundled")
    folder = BUNDLED_DIR / "concrete"
    train = np.loadtxt(folder / "index_train_0.txt").astype(int)
    test = np.loadtxt(folder / "index_test_0.txt").astype(int)
    idx = s.indices
    fit_val_cal = np.concatenate([idx["fit"], idx["val"], idx["cal"]])
    assert sorted(fit_val_cal.tolist()) == sorted(train.tolist())
    assert len(set(fit_val_cal.tolist())) == len(fit_val_cal)
    assert np.array_equal(idx["test"], test)
    n = len(train)
    assert s.sizes() == {"fit": n - 2 * round(0.1 * n), "val": round(0.1 * n),
                         "cal": round(0.1 * n), "test": len(test)}
    assert s.fractions == pytest.approx((0.8, 0.1, 0.1))


def test_standardisation_uses_fit_statistics_and_inverts_exactly() -> None:
    s = load_uci("concrete", 1, data_dir="bundled")
    data, f, t = _raw(BUNDLED_DIR / "concrete")
    xf = s.x_fit.double()
    torch.testing.assert_close(xf.mean(0), torch.zeros(s.n_features, dtype=torch.float64),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(xf.std(0, unbiased=False), torch.ones(s.n_features,
                               dtype=torch.float64), atol=1e-5, rtol=0)
    # targets of every part map back to the raw column
    for part in ("fit", "val", "cal", "test"):
        y = getattr(s, f"y_{part}").double() * s.y_std + s.y_mean
        raw = torch.as_tensor(data[s.indices[part], t[0]])
        torch.testing.assert_close(y, raw, atol=1e-3, rtol=1e-5)
        x = getattr(s, f"x_{part}").double() * s.x_std.double() + s.x_mean.double()
        torch.testing.assert_close(x, torch.as_tensor(data[s.indices[part]][:, f]),
                                   atol=1e-2, rtol=1e-5)


def test_fixed_seed_is_reproducible_and_seed_changes_the_holdout() -> None:
    a = load_uci("concrete", 2, data_dir="bundled")
    b = load_uci("concrete", 2, data_dir="bundled")
    c = load_uci("concrete", 2, data_dir="bundled", seed=1)
    assert torch.equal(a.x_val, b.x_val) and torch.equal(a.y_cal, b.y_cal)
    assert not np.array_equal(a.indices["val"], c.indices["val"])


def _write_layout(root: Path, name: str, n: int = 40, n_split: int = 2) -> Path:
    rng = np.random.default_rng(0)
    folder = root / name
    folder.mkdir(parents=True)
    data = rng.normal(size=(n, 4))
    data[:, 2] = 5.0  # a constant feature keeps scale 1
    np.savetxt(folder / "data.txt", data)
    np.savetxt(folder / "index_features.txt", [0, 1, 2], fmt="%d")
    np.savetxt(folder / "index_target.txt", [3], fmt="%d")
    for k in range(n_split):
        perm = rng.permutation(n)
        np.savetxt(folder / f"index_train_{k}.txt", perm[:30], fmt="%d")
        np.savetxt(folder / f"index_test_{k}.txt", perm[30:], fmt="%d")
    (folder / "n_splits.txt").write_text(f"{n_split}\n")
    return folder


def test_any_folder_of_the_layout_loads_from_root_or_uci_subfolder(tmp_path: Path) -> None:
    _write_layout(tmp_path / "uci", "toy")
    for root in (tmp_path, tmp_path / "uci"):
        assert uci_dir("toy", root) == tmp_path / "uci" / "toy"
        assert n_splits("toy", root) == 2
        s = load_uci("toy", 1, data_dir=root, val_fraction=0.2, cal_fraction=0.2)
        assert s.sizes() == {"fit": 18, "val": 6, "cal": 6, "test": 10}
        assert torch.all(s.x_fit[:, 2] == 0)  # constant feature: centred, not divided by 0
        assert bool(torch.isfinite(s.x_test).all())


def test_errors_name_the_bad_value(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nonexistent"):
        load_uci("nonexistent", 0, data_dir=tmp_path)
    with pytest.raises(ValueError, match="split=7"):
        load_uci("concrete", 7, data_dir="bundled")
    with pytest.raises(ValueError, match="split=-1"):
        load_uci("concrete", -1, data_dir="bundled")
    with pytest.raises(ValueError, match=r"val_fraction=0\.6"):
        load_uci("concrete", 0, data_dir="bundled", val_fraction=0.6)
    folder = _write_layout(tmp_path, "bad")
    data = np.loadtxt(folder / "data.txt")
    data[3, 0] = np.nan
    np.savetxt(folder / "data.txt", data)
    with pytest.raises(ValueError, match="non-finite"):
        load_uci("bad", 0, data_dir=tmp_path)


def test_bundled_copy_matches_shared_data_when_present() -> None:
    try:
        shared = uci_dir("concrete", None)
    except FileNotFoundError:
        pytest.skip("shared data folder not present")
    if shared.parent == BUNDLED_DIR:
        pytest.skip("shared data folder not present (fell back to the bundled copy)")
    a = load_uci("concrete", 0, data_dir=shared.parent)
    b = load_uci("concrete", 0, data_dir="bundled")
    assert torch.equal(a.x_fit, b.x_fit) and torch.equal(a.y_test, b.y_test)
