"""Class-probability predictives: temperature fitting against torch-uncertainty, the Monte
Carlo NLL against a direct computation, logits canonicalisation and label rows."""

from __future__ import annotations

import pytest
import torch

from attnuq.categorical import (
    CategoricalPredictive,
    class_logits,
    fit_temperature,
    labelled_rows,
    mc_nll,
)

D = torch.float64


def test_fit_temperature_matches_torch_uncertainty() -> None:
    from torch.utils.data import DataLoader, TensorDataset
    from torch_uncertainty.post_processing import TemperatureScaler

    g = torch.Generator().manual_seed(0)
    z = torch.randn(2000, 5, generator=g)
    y = torch.multinomial(z.softmax(-1), 1, generator=g)[:, 0]
    ts = TemperatureScaler(model=torch.nn.Identity(), init_temperature=1.0, max_iter=200, lr=0.1)
    ts.fit(DataLoader(TensorDataset(3 * z, y), batch_size=500), progress=False)
    # both minimise the same convex NLL in 1/T; torch-uncertainty's LBFGS stops at its own
    # tolerance (float32), ours at |Delta ln T| < 1e-4
    assert fit_temperature(3 * z, y) == pytest.approx(ts.temperature[0].item(), rel=2e-3)


def test_mc_nll_is_the_nll_of_the_mean_probability() -> None:
    g = torch.Generator().manual_seed(1)
    z = 20 * torch.randn(6, 40, 4, generator=g, dtype=D)  # confident draws: stability matters
    y = torch.randint(0, 4, (40,), generator=g)
    direct = -torch.log((z / 1.7).softmax(-1).mean(0).gather(-1, y[:, None])[:, 0])
    assert torch.allclose(mc_nll(z, y, 1.7), direct, rtol=1e-10, atol=1e-12)


def test_class_logits_and_rows() -> None:
    z = torch.tensor([-1.0, 0.0, 3.0])
    two = class_logits(z)
    assert torch.allclose(two.softmax(-1)[:, 1], torch.sigmoid(z))
    assert torch.equal(class_logits(z[:, None]), two)
    with pytest.raises(ValueError, match=r"logits of shape \(B,\), \(B, C\) or \(B, L, C\), "
                                         r"got shape=\(2, 2, 2, 2\)"):
        class_logits(torch.zeros(2, 2, 2, 2))
    with pytest.raises(TypeError, match="floating tensor of logits"):
        class_logits(torch.zeros(3, dtype=torch.long))
    out, mask, labels = labelled_rows(torch.zeros(2, 3, 4), torch.tensor([[1, -100, 3],
                                                                          [0, 2, -100]]))
    assert mask.tolist() == [[True, False, True], [True, True, False]]
    assert labels.tolist() == [1, 3, 0, 2] and out.shape == (2, 3, 4)
    # every entry ignored (a prompt-only batch): no row, no error (the part is checked)
    out, mask, labels = labelled_rows(torch.zeros(2, 4), torch.full((2,), -100), name="t")
    assert not mask.any() and labels.shape == (0,) and labels.dtype == torch.int64
    with pytest.raises(ValueError, match=r"fitted with 5"):
        labelled_rows(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), n_classes=5)


def test_predictive_checks_its_shapes() -> None:
    with pytest.raises(ValueError, match=r"samples must be \(S, B, \[L,\] C\)"):
        CategoricalPredictive(samples=torch.ones(4, 1))
    with pytest.raises(ValueError, match=r"frozen must have shape \(3, 2\)"):
        CategoricalPredictive(samples=torch.full((5, 3, 2), 0.5), frozen=torch.ones(3, 3))
    with pytest.raises(ValueError, match=r"temperature must be a finite float > 0, got "
                                         r"temperature=0"):
        CategoricalPredictive.from_logits(torch.zeros(2, 3, 2), temperature=0)
