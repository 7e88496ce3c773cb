"""ViT field forecaster: shapes, persistence start, save/load, HF attention routing, training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from attnuq_bench.models.vit_field import ViTFieldForecaster, load_vit_field, save_vit_field
from attnuq_bench.training import fit

KW = dict(in_channels=2, out_channels=2, patch_size=2, hidden_size=16, num_layers=1,
          num_heads=2, mlp_size=16, mean=280.0, std=3.0)


def test_starts_at_persistence_and_roundtrip(tmp_path: Path) -> None:
    m = ViTFieldForecaster((5, 7), **KW).eval()
    x = 280 + 3 * torch.randn(4, 2, 5, 7)
    with torch.no_grad():
        y = m(x)
    assert y.shape == (4, 2, 5, 7)
    # zero-initialised head: the untrained model is exactly persistence for every lead
    torch.testing.assert_close(y, x[:, :1].expand(-1, 2, -1, -1), rtol=0, atol=0)
    with torch.no_grad():
        m.head.bias.fill_(0.1)
    save_vit_field(m, tmp_path / "v")
    back = load_vit_field(tmp_path / "v")
    assert not back.training and not any(p.requires_grad for p in back.parameters())
    with torch.no_grad():
        # bit-equal: load_state_dict copies the weights into the new model's own (freshly
        # allocated, 64-byte aligned) parameters, so the same kernels run on identical inputs
        torch.testing.assert_close(back(x), m(x), rtol=0, atol=0)
        # 0.1 * std; float32 near 280 K resolves ~3e-5
        torch.testing.assert_close(back(x) - x[:, :1], torch.full_like(y, 0.3), rtol=0, atol=1e-4)


def test_stochastic_attention_reaches_vit() -> None:
    import attnuq

    m = ViTFieldForecaster((5, 7), **KW).eval()
    with torch.no_grad():
        torch.nn.init.normal_(m.head.weight, std=0.5)
    sites = attnuq.find_attention(m)
    assert len(sites) == 1 and sites[0].backend == "hf"
    x = 280 + 3 * torch.randn(3, 2, 5, 7)
    with torch.no_grad():
        f = m(x)
        with attnuq.stochastic(m, nu=1, seed=0):
            a, b = m(x), m(x)
        assert not torch.equal(a, b)  # nu = 1: two passes differ
        torch.testing.assert_close(m(x), f, rtol=0, atol=0)  # restored after the block


def test_learns_a_shift() -> None:
    """Target = current field + 2 K: a few epochs must take the MSE well below persistence's 4."""
    g = torch.Generator().manual_seed(0)
    x = 280 + 3 * torch.randn(96, 2, 5, 7, generator=g)
    y = x[:, :1].expand(-1, 2, -1, -1) + 2.0
    m = ViTFieldForecaster((5, 7), **KW)
    rep = fit(m, (x[:64], y[:64]), (x[64:], y[64:]), metric="mse", max_epochs=4, patience=3,
              batch_size=16, lr=1e-2, weight_decay=0.0, progress=False)
    assert rep.best_val < 1.0, rep.val_metric


def test_errors(tmp_path: Path) -> None:
    m = ViTFieldForecaster((5, 7), **KW)
    with pytest.raises(ValueError, match=r"x must be \(B, 2, 5, 7\)"):
        m(torch.randn(2, 3, 5, 7))
    with pytest.raises(ValueError, match="hidden_size must be divisible"):
        ViTFieldForecaster((5, 7), **{**KW, "num_heads": 3})
    with pytest.raises(ValueError, match="std"):
        ViTFieldForecaster((5, 7), **{**KW, "std": 0.0})
    with pytest.raises(FileNotFoundError, match=r"model\.pt"):
        load_vit_field(tmp_path)


def test_base_weight_is_the_start_and_survives_save_load(tmp_path: Path) -> None:
    """With ``base_weight`` the untrained model is exactly that blend of its input channels."""
    w = [[0.25, 0.75], [1.5, -0.5]]
    m = ViTFieldForecaster((5, 7), **KW, base_weight=w).eval()
    x = 280 + 3 * torch.randn(4, 2, 5, 7)
    want = torch.einsum("oc,bchw->bohw", torch.tensor(w, dtype=torch.float64), x.double())
    with torch.no_grad():
        # float32 blend of ~280 K values (ulp 3e-5): 1e-4
        torch.testing.assert_close(m(x).double(), want, rtol=0, atol=1e-4)
        torch.nn.init.normal_(m.head.weight, std=0.1)
        save_vit_field(m, tmp_path / "b")
        back = load_vit_field(tmp_path / "b")
        assert back.config.base_weight == ((0.25, 0.75), (1.5, -0.5))
        assert "base_weight" not in back.state_dict()  # the config holds it
        torch.testing.assert_close(back(x), m(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"base_weight must be finite \(2, 2\)"):
        ViTFieldForecaster((5, 7), **KW, base_weight=[[1.0, 0.0]])
    with pytest.raises(ValueError, match="base_weight must be finite"):
        ViTFieldForecaster((5, 7), **KW, base_weight=[[float("nan"), 0.0], [1.0, 0.0]])


def test_centred_inputs_make_the_forecast_shift_equivariant(tmp_path: Path) -> None:
    """``center=True`` with a base whose rows sum to 1: shifting every input by c K shifts the
    forecast by c K (the ViT sees no level); the default model has no such property."""
    w = [[0.5, 0.5], [1.25, -0.25]]
    x = 280 + 3 * torch.randn(4, 2, 5, 7, generator=torch.Generator().manual_seed(1))
    for center in (True, False):
        m = ViTFieldForecaster((5, 7), **KW, base_weight=w, center=center).eval()
        with torch.no_grad():
            torch.nn.init.normal_(m.head.weight, std=0.3)
            d = (m(x + 4.0) - m(x) - 4.0).abs().max().item()
        # float32 at ~284 K (ulp 3e-5), a few roundings: 1e-3; the plain model moves by ~K
        assert (d < 1e-3) == center, (center, d)
    save_vit_field(m, tmp_path / "c")
    assert load_vit_field(tmp_path / "c").config.center is False
    m2 = ViTFieldForecaster((5, 7), **KW, center=True)
    save_vit_field(m2, tmp_path / "c2")
    assert load_vit_field(tmp_path / "c2").config.center is True
