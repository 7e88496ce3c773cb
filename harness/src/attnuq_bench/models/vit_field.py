"""A small Vision-Transformer forecaster for gridded fields, built from Hugging Face ViT blocks.

Architecture (ClimaX-like, much smaller):

* inputs ``(B, C_in, n_lat, n_lon)`` in the field's units are standardised with the training
  mean/std (buffers), zero-padded at the bottom/right to a multiple of the patch size
  (33 x 49 -> 36 x 52 for patch 4);
* ``transformers.ViTModel`` (``add_pooling_layer=False``): a convolutional patch embedding, a CLS
  token, learned position embeddings, ``num_layers`` pre-norm ViT blocks; its attention goes
  through ``ALL_ATTENTION_FUNCTIONS``, so :func:`attnuq.stochastic` patches it;
* a linear head maps every patch token to its ``patch x patch x C_out`` pixels; the padded grid is
  cropped back to ``(n_lat, n_lon)``;
* the output is a correction to persistence: ``y = x_t + std * head(...)`` (channel 0 of the
  input is the current field), in the field's units; with ``base_weight`` ``W`` (``C_out x C_in``)
  it is a correction to a fixed linear blend of the input channels instead,
  ``y_o = sum_c W[o, c] x_c + std * head(...)_o`` (e.g. a blend of persistence, the field 24 h
  before the valid time and climatology chosen on validation data; persistence is
  ``W[o] = (1, 0, ..., 0)``).

Shapes: ``(B, C_in, H, W) -> (B, C_out, H, W)``.

Examples
--------
>>> import torch
>>> m = ViTFieldForecaster(grid=(5, 7), in_channels=2, out_channels=2, patch_size=2,
...                        hidden_size=16, num_layers=1, num_heads=2, mlp_size=16)
>>> m.eval()(torch.randn(3, 2, 5, 7)).shape
torch.Size([3, 2, 5, 7])
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnuq._validation import check_positive_int

__all__ = ["ViTFieldConfig", "ViTFieldForecaster", "load_vit_field", "save_vit_field"]


@dataclass(frozen=True)
class ViTFieldConfig:
    """Hyper-parameters of :class:`ViTFieldForecaster` (JSON-serialisable)."""

    grid: tuple[int, int]
    in_channels: int = 2
    out_channels: int = 2
    patch_size: int = 4
    hidden_size: int = 64
    num_layers: int = 3
    num_heads: int = 4
    mlp_size: int = 128
    dropout: float = 0.1
    attention_dropout: float = 0.1
    mean: float = 0.0
    std: float = 1.0
    base_weight: tuple[tuple[float, ...], ...] | None = None
    center: bool = False

    def padded(self) -> tuple[int, int]:
        p = self.patch_size
        return (-(-self.grid[0] // p) * p, -(-self.grid[1] // p) * p)


class ViTFieldForecaster(nn.Module):
    """ViT field forecaster (see module docstring).

    Parameters
    ----------
    grid
        ``(n_lat, n_lon)`` of the fields.
    in_channels, out_channels
        Input fields (channel 0 = the current field) and output fields (one per lead).
    patch_size, hidden_size, num_layers, num_heads, mlp_size
        ViT size.
    dropout, attention_dropout
        Hidden and attention-probability dropout (MC dropout switches them on at test time).
    mean, std
        Standardisation of the fields (scalars, fitted on training data).
    base_weight
        ``(out_channels, in_channels)`` weights of the linear base the model corrects
        (``None``: persistence, channel 0 for every output).
    center
        Standardise the ViT's inputs as ``(x - mean_hw x_t) / std`` (each sample's domain mean
        of channel 0) instead of ``(x - mean) / std``: the correction then cannot depend on the
        absolute temperature level, and with a base whose rows sum to 1 the whole forecast
        shifts with a uniform shift of the inputs.

    Examples
    --------
    A base that averages the two input channels for both outputs (zero head: exactly the base):

    >>> m = ViTFieldForecaster((5, 7), in_channels=2, out_channels=2, patch_size=2,
    ...                        hidden_size=8, num_layers=1, num_heads=2, mlp_size=8,
    ...                        base_weight=[[0.5, 0.5], [0.5, 0.5]]).eval()
    >>> x = torch.randn(1, 2, 5, 7)
    >>> torch.allclose(m(x)[:, 1], x.mean(1))
    True
    """

    mean: torch.Tensor
    std: torch.Tensor
    base_weight: torch.Tensor  # only when config.base_weight is set

    def __init__(
        self,
        grid: tuple[int, int] | list[int],
        *,
        in_channels: int = 2,
        out_channels: int = 2,
        patch_size: int = 4,
        hidden_size: int = 64,
        num_layers: int = 3,
        num_heads: int = 4,
        mlp_size: int = 128,
        dropout: float = 0.1,
        attention_dropout: float = 0.1,
        mean: float = 0.0,
        std: float = 1.0,
        base_weight: Any = None,
        center: bool = False,
    ) -> None:
        super().__init__()
        from transformers import ViTConfig, ViTModel

        if len(grid) != 2:
            raise ValueError(f"grid must be (n_lat, n_lon), got {grid=}")
        g = (check_positive_int(grid[0], "grid[0]"), check_positive_int(grid[1], "grid[1]"))
        for name, v in (("in_channels", in_channels), ("out_channels", out_channels),
                        ("patch_size", patch_size), ("hidden_size", hidden_size),
                        ("num_layers", num_layers), ("num_heads", num_heads),
                        ("mlp_size", mlp_size)):
            check_positive_int(v, name)
        if hidden_size % num_heads:
            raise ValueError(
                f"hidden_size must be divisible by num_heads, got {hidden_size=}, {num_heads=}"
            )
        for name, p in (("dropout", dropout), ("attention_dropout", attention_dropout)):
            if not 0.0 <= p < 1.0:
                raise ValueError(f"{name} must lie in [0, 1), got {name}={p}")
        if not (std > 0 and torch.isfinite(torch.tensor(std)) and torch.isfinite(
                torch.tensor(mean))):
            raise ValueError(f"mean/std must be finite with std > 0, got {mean=}, {std=}")
        bw: tuple[tuple[float, ...], ...] | None = None
        if base_weight is not None:
            w = torch.as_tensor(base_weight, dtype=torch.float64)
            if w.shape != (out_channels, in_channels) or not bool(torch.isfinite(w).all()):
                raise ValueError(f"base_weight must be finite ({out_channels}, {in_channels}), "
                                 f"got shape {tuple(w.shape)}: {base_weight!r}")
            bw = tuple(tuple(float(v) for v in row) for row in w.tolist())
        self.config = ViTFieldConfig(
            grid=g, in_channels=in_channels, out_channels=out_channels, patch_size=patch_size,
            hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
            mlp_size=mlp_size, dropout=dropout, attention_dropout=attention_dropout,
            mean=float(mean), std=float(std), base_weight=bw, center=bool(center),
        )
        ph, pw = self.config.padded()
        vit_cfg = ViTConfig(
            image_size=[ph, pw],
            patch_size=patch_size,
            num_channels=in_channels,
            hidden_size=hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            intermediate_size=mlp_size,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=attention_dropout,
        )
        vit_cfg._attn_implementation = "eager"
        self.vit = ViTModel(vit_cfg, add_pooling_layer=False)
        self.head = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        nn.init.zeros_(self.head.weight)  # start at persistence
        nn.init.zeros_(self.head.bias)
        self.register_buffer("mean", torch.tensor(float(mean)))
        self.register_buffer("std", torch.tensor(float(std)))
        if bw is not None:  # not in the state dict: the config holds it (older files load)
            self.register_buffer("base_weight", torch.tensor(bw), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        if x.dim() != 4 or x.shape[1] != c.in_channels or tuple(x.shape[2:]) != c.grid:
            raise ValueError(
                f"x must be (B, {c.in_channels}, {c.grid[0]}, {c.grid[1]}), "
                f"got shape={tuple(x.shape)}"
            )
        h, w = c.grid
        ph, pw = c.padded()
        p = c.patch_size
        # centred: less each sample's domain mean of x(t), so the ViT never sees the level
        z = (x - (x[:, :1].mean((2, 3), keepdim=True) if c.center else self.mean)) / self.std
        z = nn.functional.pad(z, (0, pw - w, 0, ph - h))  # (B, C_in, ph, pw)
        tok = self.vit(pixel_values=z).last_hidden_state[:, 1:]  # (B, N, D), CLS dropped
        out = self.head(tok)  # (B, N, p*p*C_out)
        b = x.shape[0]
        out = out.reshape(b, ph // p, pw // p, p, p, c.out_channels)
        out = out.permute(0, 5, 1, 3, 2, 4).reshape(b, c.out_channels, ph, pw)
        delta = out[:, :, :h, :w]
        if c.base_weight is None:
            return x[:, :1] + self.std * delta  # (B, C_out, H, W)
        base = torch.einsum("oc,bchw->bohw", self.base_weight.to(x.dtype), x)
        return base + self.std * delta


def save_vit_field(model: ViTFieldForecaster, path: str | os.PathLike[str]) -> Path:
    """Write ``model.pt`` (state dict) and ``config.json`` into the folder ``path``, atomically."""
    if not isinstance(model, ViTFieldForecaster):
        raise TypeError(f"expected a ViTFieldForecaster, got {type(model).__name__}")
    from attnuq._io import atomic_torch_save, atomic_write_json

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    # each file atomically, config.json (what marks a saved model) last
    atomic_torch_save(model.state_dict(), out / "model.pt")
    atomic_write_json(out / "config.json", asdict(model.config), indent=1)
    return out


def load_vit_field(path: str | os.PathLike[str], *, freeze: bool = True) -> ViTFieldForecaster:
    """Read a model written by :func:`save_vit_field`, in eval mode (``freeze``: no grads)."""
    p = Path(path)
    if not (p / "config.json").is_file() or not (p / "model.pt").is_file():
        raise FileNotFoundError(
            f"no saved ViTFieldForecaster (config.json + model.pt) in {str(p)!r}"
        )
    cfg: dict[str, Any] = json.loads((p / "config.json").read_text())
    grid = tuple(cfg.pop("grid"))
    if cfg.get("base_weight") is None:
        cfg.pop("base_weight", None)
    m = ViTFieldForecaster(grid, **cfg)  # type: ignore[arg-type]
    m.load_state_dict(torch.load(p / "model.pt", map_location="cpu", weights_only=True))
    m.eval()
    for prm in m.parameters():
        prm.requires_grad_(not freeze)
    return m
