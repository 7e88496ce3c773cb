"""Build, train, save and reload a Hugging Face ``PatchTSTForPrediction`` forecaster.

This is the ETT backbone: a small multivariate PatchTST (channel-independent patches of length
16 with stride 8, a few transformer layers) trained with early stopping
(:func:`attnuq_bench.training.fit` with ``metric="mse", seed_torch=True, val_batch_size=512``),
written with
``save_pretrained`` and read back with ``from_pretrained`` -- the same code path a user takes with
a hub checkpoint. The reloaded model is then frozen and perturbed only at inference time.

Shapes: ``past_values`` ``(B, L, C)`` -> forecast ``(B, H, C)``.

Examples
--------
>>> import torch
>>> m = build_patchtst(num_channels=2, context_length=32, prediction_length=8, d_model=16,
...                    num_layers=1, num_heads=2, ffn_dim=16, patch_length=8, patch_stride=8)
>>> f = PatchTSTForecaster(m).eval()
>>> f(torch.randn(3, 32, 2)).shape
torch.Size([3, 8, 2])
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnuq._validation import check_positive_int

__all__ = [
    "PatchTSTForecaster",
    "build_patchtst",
    "load_patchtst",
    "save_patchtst",
]

def build_patchtst(
    *,
    num_channels: int,
    context_length: int = 336,
    prediction_length: int = 96,
    d_model: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    ffn_dim: int = 64,
    patch_length: int = 16,
    patch_stride: int = 8,
    dropout: float = 0.1,
    head_dropout: float = 0.0,
    seed: int = 0,
) -> Any:
    """A randomly initialised ``PatchTSTForPrediction`` (point forecasts, MSE loss), laid out as
    in the PatchTST paper (Nie et al. 2023, PatchTST/42 and /64).

    ``dropout`` is used for attention and feed-forward dropout (what MC dropout switches on at
    test time), ``head_dropout`` before the linear head (the paper's supervised ETT scripts: 0).
    The model's own per-window ``"std"`` scaler (RevIN-style instance normalisation) is kept on.
    Three settings differ from ``PatchTSTConfig``'s defaults to match the paper: the head reads
    the *flattened* ``num_patches x d_model`` encoder output (``pooling_type=None``; HF's default
    ``"mean"`` hands the head one ``d_model`` mean over patches, which loses the order of the
    patches: on ETTh1 such a model stayed at the "context mean" forecast, val MSE 1.34, where the
    flattened head learns), post-norm residual blocks (``pre_norm=False``) with batch norm, and
    ``head_dropout``.
    """
    from transformers import PatchTSTConfig, PatchTSTForPrediction

    for name, v in (
        ("num_channels", num_channels), ("context_length", context_length),
        ("prediction_length", prediction_length), ("d_model", d_model),
        ("num_layers", num_layers), ("num_heads", num_heads), ("ffn_dim", ffn_dim),
        ("patch_length", patch_length), ("patch_stride", patch_stride),
    ):
        check_positive_int(v, name)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must lie in [0, 1), got {dropout=}")
    if not 0.0 <= head_dropout < 1.0:
        raise ValueError(f"head_dropout must lie in [0, 1), got {head_dropout=}")
    if d_model % num_heads:
        raise ValueError(f"d_model must be divisible by num_heads, got {d_model=}, {num_heads=}")
    if patch_length > context_length:
        raise ValueError(f"patch_length must be <= context_length, got {patch_length=}")
    config = PatchTSTConfig(
        num_input_channels=num_channels,
        context_length=context_length,
        prediction_length=prediction_length,
        patch_length=patch_length,
        patch_stride=patch_stride,
        d_model=d_model,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        ffn_dim=ffn_dim,
        attention_dropout=dropout,
        ff_dropout=dropout,
        path_dropout=0.0,
        positional_dropout=0.0,
        head_dropout=head_dropout,
        pooling_type=None,
        pre_norm=False,
        norm_type="batchnorm",
        scaling="std",
        loss="mse",
        share_embedding=True,
        channel_attention=False,
        do_mask_input=False,
    )
    # eager attention: the SA patcher swaps the implementation for the length of its block
    config._attn_implementation = "eager"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = PatchTSTForPrediction(config)
    return model


class PatchTSTForecaster(nn.Module):
    """``nn.Module`` view of a ``PatchTSTForPrediction``: ``forward(past) -> (B, H, C)`` tensor.

    The wrapper holds the HF model as ``.model`` so that attention finders walk into it.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    @property
    def _cfg(self) -> Any:
        return self.model.config

    @property
    def context_length(self) -> int:
        return int(self._cfg.context_length)

    @property
    def prediction_length(self) -> int:
        return int(self._cfg.prediction_length)

    @property
    def num_channels(self) -> int:
        return int(self._cfg.num_input_channels)

    def forward(self, past: torch.Tensor) -> torch.Tensor:
        if past.dim() != 3 or past.shape[1:] != (self.context_length, self.num_channels):
            raise ValueError(
                f"past must be (B, {self.context_length}, {self.num_channels}), "
                f"got shape={tuple(past.shape)}"
            )
        out = self.model(past_values=past)
        return out.prediction_outputs  # (B, H, C)


def save_patchtst(model: nn.Module, path: str | os.PathLike[str]) -> Path:
    """``save_pretrained`` the HF model (or the one inside a :class:`PatchTSTForecaster`).

    Every file is moved into ``path`` whole (``os.replace``), ``config.json`` last.
    """
    hf = model.model if isinstance(model, PatchTSTForecaster) else model
    if not hasattr(hf, "save_pretrained"):
        raise TypeError(f"expected a PatchTSTForPrediction, got {type(hf).__name__}")
    import shutil
    import tempfile

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    # save into a temporary folder beside it, then move each file in with os.replace,
    # config.json (what marks a saved model) last: a crash never leaves a torn weights file
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        hf.save_pretrained(tmp)  # type: ignore[operator]
        files = sorted(tmp.iterdir(), key=lambda f: f.name == "config.json")
        for f in files:
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_patchtst(path: str | os.PathLike[str], *, freeze: bool = True) -> PatchTSTForecaster:
    """``PatchTSTForPrediction.from_pretrained(path)`` wrapped, in eval mode.

    With ``freeze=True`` every parameter gets ``requires_grad=False`` (the frozen backbone of the
    post-hoc methods); ``freeze=False`` keeps them trainable (SWAG continues training a copy).
    Raises ``FileNotFoundError`` naming the folder when it holds no ``config.json``.
    """
    from transformers import PatchTSTForPrediction

    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"no saved PatchTST model (config.json) in {str(p)!r}")
    hf = PatchTSTForPrediction.from_pretrained(str(p), attn_implementation="eager")
    f = PatchTSTForecaster(hf).eval()
    for prm in f.parameters():
        prm.requires_grad_(not freeze)
    return f
