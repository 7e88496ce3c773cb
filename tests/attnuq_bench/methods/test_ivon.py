"""IVON chooses hess_init on the validation part only (never on calibration or test data)."""

from __future__ import annotations

import argparse
import math
from typing import Any

import pytest
import torch
from torch import nn

from attnuq_bench.methods import IVONMethod, Task
from attnuq_bench.models.ft import make_ft_transformer
from attnuq_bench.training import fit

pytest.importorskip("ivon")


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return x, x[:, 0] - 0.5 * x[:, 1] ** 2 + 0.3 * torch.randn(n, generator=g)


def _tiny(seed: int) -> nn.Module:
    return make_ft_transformer(4, n_blocks=1, seed=seed, d_block=8, attention_n_heads=2)


def _train(model: nn.Module, train: Any, val: Any, seed: int) -> Any:
    return fit(model, train, val, max_epochs=1, patience=1, seed=seed, progress=False)


def _task(cal: tuple[torch.Tensor, torch.Tensor]) -> Task:
    torch.manual_seed(0)
    model = _tiny(0)
    _train(model, _data(48, 0), _data(24, 1), 0)
    return Task(model=model.eval(), train=_data(48, 0), val=_data(24, 1), cal=cal,
                make_model=_tiny, train_fn=_train, batch_size=16)


def _fit(task: Task, grid: tuple[float, ...]) -> IVONMethod:
    m = IVONMethod(n_samples=4, n_select=8, max_epochs=2, patience=2, hess_inits=grid,
                   progress=False)
    return m.fit(task)  # type: ignore[return-value]


def test_choice_is_the_smallest_validation_rmse_and_ignores_cal() -> None:
    grid = (0.3, 10.0, 300.0)
    real = _fit(_task(_data(24, 2)), grid)
    nan_x = torch.full((24, 4), math.nan)
    blind = _fit(_task((nan_x, torch.full((24,), math.nan))), grid)
    info, info_b = real.info(), blind.info()
    assert info["hess_init"] in grid
    assert info["selection"] == "validation RMSE of the predictive mean"
    nlls = [c["val_rmse_pred"] for c in info["candidates"]]
    assert [c["hess_init"] for c in info["candidates"]] == list(grid)
    assert all(math.isfinite(v) for v in nlls)
    assert info["hess_init"] == grid[nlls.index(min(nlls))]
    # the candidates differ, so the choice is not trivial
    assert len({round(v, 6) for v in nlls}) == len(grid)
    # NaN calibration data changes nothing: the choice and every score come from train/val
    assert info_b == info
    assert real.config()["hess_init"] == info["hess_init"]


def test_bench_task_without_test_data_gives_the_same_choice() -> None:
    from attnuq_bench.data.uci import load_uci
    from attnuq_bench.suites.uci import _make_task

    args = argparse.Namespace(n_blocks=1, max_epochs=1, patience=1, batch_size=64,
                              no_progress=True, seed=0, device="cpu")
    data = load_uci("concrete", 0, data_dir="bundled")
    nan = torch.full_like(data.x_test, math.nan)
    blind_data = type(data)(**{**data.__dict__, "x_test": nan,
                               "y_test": torch.full_like(data.y_test, math.nan),
                               "x_cal": torch.full_like(data.x_cal, math.nan),
                               "y_cal": torch.full_like(data.y_cal, math.nan)})
    choices = []
    for d in (data, blind_data):
        import tempfile
        from pathlib import Path

        with tempfile.TemporaryDirectory() as tmp:
            task, _ = _make_task(d, args, Path(tmp))
            choices.append(_fit(task, (1.0, 30.0)).info())
    assert choices[0] == choices[1]


def test_bad_grid_names_the_value() -> None:
    with pytest.raises(ValueError, match="hess_inits"):
        IVONMethod(hess_inits=(1.0, -2.0))
    with pytest.raises(ValueError, match="hess_inits"):
        IVONMethod(hess_inits=())
