"""PatchTST backbone: build, train with early stopping, save_pretrained / from_pretrained."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from attnuq_bench.models.patchtst import (
    PatchTSTForecaster,
    build_patchtst,
    load_patchtst,
    save_patchtst,
)
from attnuq_bench.training import fit

KW = dict(context_length=32, prediction_length=8, d_model=16, num_layers=1, num_heads=2,
          ffn_dim=16, patch_length=8, patch_stride=4)


def _sine(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(40, dtype=torch.float32)
    phase = torch.rand(n, 1, 2, generator=g) * 6.28
    s = torch.sin(t[None, :, None] * 0.5 + phase) + 0.05 * torch.randn(n, 40, 2, generator=g)
    return s[:, :32], s[:, 32:]


def test_train_improves_and_roundtrip(tmp_path: Path) -> None:
    model = PatchTSTForecaster(build_patchtst(num_channels=2, seed=1, **KW))
    tr, va = _sine(256, 0), _sine(64, 1)
    with torch.no_grad():
        model.eval()
        before = float(torch.nn.functional.mse_loss(model(va[0]), va[1]))
    rep = fit(model, tr, va, metric="mse", max_epochs=3, patience=3, batch_size=16, lr=1e-2,
              weight_decay=0.0, progress=False)
    assert rep.epochs_run >= 1 and rep.best_epoch >= 0 and rep.steps > 0
    # the best restored weights give the reported best validation loss
    with torch.no_grad():
        after = float(torch.nn.functional.mse_loss(model(va[0]), va[1]))
    assert after == pytest.approx(rep.best_val, rel=1e-5)
    # a noiseless-phase sine is learnable: 3 epochs must at least halve the untrained loss
    assert after < 0.5 * before, (before, after)
    save_patchtst(model, tmp_path / "m")
    assert (tmp_path / "m" / "config.json").is_file()
    back = load_patchtst(tmp_path / "m")
    assert not any(p.requires_grad for p in back.parameters())
    assert not back.training
    # the weights come back bit-for-bit ...
    want, got = model.state_dict(), back.state_dict()
    assert want.keys() == got.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    # ... but not the output bits: from_pretrained memory-maps the safetensors file, so the
    # reloaded tensors sit at another alignment (seen: 56 mod 64 bytes) and MKL / oneDNN pick
    # another GEMM blocking on AVX-512 (686 of 1024 elements off by <= 6e-7 on a Xeon with
    # AMX). Same function, other summation order: a few float32 ulps of |y| <= ~2.
    with torch.no_grad():
        torch.testing.assert_close(back(va[0]), model(va[0]), rtol=1e-5, atol=1e-5)


def test_attention_goes_through_attention_interface() -> None:
    """The SA patcher hooks ALL_ATTENTION_FUNCTIONS; PatchTST must route attention through it."""
    from transformers import AttentionInterface
    from transformers.models.patchtst.modeling_patchtst import eager_attention_forward

    calls: list[tuple[int, ...]] = []

    def spy(module, query, key, value, attention_mask, **kw):  # type: ignore[no-untyped-def]
        calls.append(tuple(query.shape))
        return eager_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("attnuq_test_spy", spy)
    m = build_patchtst(num_channels=2, **KW)
    m.set_attn_implementation("attnuq_test_spy")
    with torch.no_grad():
        PatchTSTForecaster(m).eval()(torch.randn(3, 32, 2))
    assert len(calls) == 1  # one layer
    assert calls[0][0] == 3 * 2  # channel-independent: batch x channels sequences


def test_paper_layout_flattened_head_post_norm() -> None:
    """The head reads all ``num_patches x d_model`` features (PatchTST's flatten head), not HF's
    default mean over patches, which cannot tell the patches' order apart."""
    m = build_patchtst(num_channels=2, **KW)
    n_patches = (KW["context_length"] - KW["patch_length"]) // KW["patch_stride"] + 1  # 7
    assert m.head.projection.in_features == KW["d_model"] * n_patches
    assert m.config.pooling_type is None and m.config.pre_norm is False
    assert m.config.head_dropout == 0.0 and m.config.norm_type == "batchnorm"
    with pytest.raises(ValueError, match="head_dropout"):
        build_patchtst(num_channels=2, head_dropout=1.0, **KW)


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="d_model"):
        build_patchtst(num_channels=2, **{**KW, "num_heads": 3})
    with pytest.raises(ValueError, match="dropout"):
        build_patchtst(num_channels=2, dropout=1.5, **KW)
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_patchtst(tmp_path)
    f = PatchTSTForecaster(build_patchtst(num_channels=2, **KW))
    with pytest.raises(ValueError, match="past must be"):
        f(torch.randn(3, 31, 2))
    x = torch.randn(4, 32, 2)
    y = torch.randn(4, 8, 2)
    y[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="train targets"):
        fit(f, (x, y), (x, y), metric="mse", max_epochs=1, progress=False)
