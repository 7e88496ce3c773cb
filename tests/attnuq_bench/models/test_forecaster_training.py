"""The Levy forecaster and its softmax control trained through the harness's loop with the
recipe the physionet suite uses: validation MSE falls, the best epoch is restored, the stop reason
is reported; the masked MSE refuses an empty mask."""

from __future__ import annotations

import pytest
import torch
from tests.attnuq.models.test_levy_forecaster import C, _inputs

from attnuq.models.levy_forecaster import LevyForecaster, SoftmaxForecaster, forward_batch
from attnuq_bench.training import evaluate_masked_mse, masked_mse, masked_mse_loss
from attnuq_bench.training import fit as train_fit


def fit(model, train_batches, val_batches, *, lr=1e-3, nll_weight=0.0, **kw):  # type: ignore[no-untyped-def]
    """The forecasters' recipe (what physionet trains with) through attnuq_bench.training.fit."""
    return train_fit(model, train_batches, val_batches,
                     loss=masked_mse_loss(forward_batch, nll_weight), metric="masked_mse",
                     forward_fn=forward_batch, optimizer="adam", lr=lr, weight_decay=0.0,
                     clip_grad_norm=5.0,
                     progress=False, **kw)



def evaluate_mse(model, batches):  # type: ignore[no-untyped-def]
    return evaluate_masked_mse(model, batches, forward_batch)



class _B:
    def __init__(self, x, y, qm):
        (self.obs_times, self.obs_channels, self.obs_values, self.obs_mask, self.query_times,
         self.query_channels) = x
        self.targets, self.query_mask = y, qm



def test_fit_reduces_validation_mse_and_restores_best() -> None:
    torch.manual_seed(0)
    # target = value of the stay's last observation of the query's channel, roughly
    batches = []
    for s in range(4):
        x = _inputs(B=8, L=10, Q=5, seed=s, dtype=torch.float32)
        y = x[2].mean(1, keepdim=True).expand(-1, 5).clone()
        batches.append(_B(x, y, torch.ones(8, 5, dtype=torch.bool)))
    m = LevyForecaster(C, d=8, encoder_layers=0, dropout=0.0)
    before = evaluate_mse(m, batches[3:])
    rep = fit(m, lambda e: batches[:3], lambda: batches[3:], max_epochs=4, patience=4, lr=2e-2)
    assert rep.best_val < before
    assert abs(evaluate_mse(m, batches[3:]) - rep.best_val) < 1e-6
    assert len(rep.val_metric) == 4 and rep.best_val == min(rep.val_metric)



def test_fit_reports_why_it_stopped() -> None:
    batches = []
    for s in range(2):
        x = _inputs(B=4, L=6, Q=3, seed=s, dtype=torch.float32)
        batches.append(_B(x, x[2][:, :3].clone(), torch.ones(4, 3, dtype=torch.bool)))
    torch.manual_seed(0)
    m = SoftmaxForecaster(C, d=8, encoder_layers=0, dropout=0.0)
    rep = fit(m, lambda e: batches[:1], lambda: batches[1:], max_epochs=3, patience=5,
              max_seconds=0.0)
    assert rep.stopped_by == "max_seconds" and len(rep.val_metric) == 1
    rep = fit(m, lambda e: batches[:1], lambda: batches[1:], max_epochs=2, patience=5)
    assert rep.stopped_by == "max_epochs" and len(rep.val_metric) == 2
    rep = fit(m, lambda e: batches[:1], lambda: batches[1:], max_epochs=50, patience=1,
              lr=0.5)
    assert rep.stopped_by == "patience" and len(rep.val_metric) < 50


def test_masked_mse_refuses_an_empty_mask() -> None:
    with pytest.raises(ValueError, match="selects no element"):
        masked_mse(torch.zeros(2), torch.zeros(2), torch.zeros(2, dtype=torch.bool))
