r"""Experiment classifiers: a softmax transformer over hourly series, a Levy-attention
classifier over irregular observations, and a tiny timm ViT for 8x8 images.

* :class:`GridTransformerClassifier`: inputs ``(B, T, F)`` (e.g. PhysioNet's hourly grid of
  carried-forward values, observed flags and gaps), a linear token embedding plus learned
  positions, ``layers`` pre-norm ``nn.TransformerEncoderLayer`` s (softmax attention through
  ``nn.MultiheadAttention``, which :func:`attnuq.stochastic` patches), mean pooling over the
  ``T`` tokens (or, ``pool="first"``, the first token's output: a summary token placed first,
  as the mortality suite does), a linear head: logits ``(B, n_logits)`` (one logit = binary).
* :class:`LevyClassifier`: :class:`attnuq.nn.LevyAttention` with one query per channel at each
  of the ``query_times`` (``t_j``; by default only the end of the window, ``query_channels =
  c``) and ``out_features = 1``; the logit is the sum over the ``J C`` queries divided by
  ``sqrt(J C)`` (``scale_logit``: its scale at initialisation then does not grow with ``J C``),

  .. math:: \mu = \frac{1}{\sqrt{J C}} \sum_{j, c} \mu_{j c}, \qquad
            \sigma^2 = \frac{1}{J C} \sum_{j, c} \sigma_{j c}^2,

  exact for the layer's sampled operator, whose Poisson draws are independent across queries
  and heads (:func:`attnuq.ops.levy_attention_sample`). The predictive probability is the
  probit approximation :func:`probit_probability`
  ``sigmoid(mu / sqrt(1 + pi sigma^2 / 8))`` (MacKay 1992), also the training objective's
  probability (binary cross-entropy), so ``alpha`` and the layer's spread are trained too.
* :func:`tiny_vit`: ``timm.models.vision_transformer.VisionTransformer`` for ``8 x 8`` one-channel
  images (patch 2: 16 tokens and a class token), with dropout for the MC-dropout baseline.

Examples
--------
>>> import torch
>>> m = GridTransformerClassifier(n_features=6, n_steps=5, d=16, layers=1, heads=2).eval()
>>> m(torch.randn(3, 5, 6)).shape
torch.Size([3, 1])
>>> lev = LevyClassifier(num_channels=3, value_features=2, d_model=8, num_heads=2)
>>> out = lev(torch.rand(2, 6) * 48, torch.randint(0, 3, (2, 6)), torch.randn(2, 6, 2),
...           torch.ones(2, 6, dtype=torch.bool))
>>> out.mean.shape, out.sigma.shape, bool((probit_probability(out.mean, out.sigma) > 0).all())
(torch.Size([2]), torch.Size([2]), True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attnuq._validation import check_positive_int

__all__ = ["GridTransformerClassifier", "LevyClassifier", "LevyLogit", "probit_probability",
           "tiny_vit"]


class GridTransformerClassifier(nn.Module):
    """Softmax-attention transformer over ``(B, T, F)`` token features -> logits ``(B, K)``.

    Parameters
    ----------
    n_features, n_steps
        ``F`` features per token and ``T`` tokens (positions are learned).
    n_logits
        ``K`` (1: binary, a sigmoid logit).
    d, layers, heads, dropout
        Width, encoder layers, attention heads, dropout (attention, feed-forward, head).
    pool
        ``"mean"`` over the tokens, or ``"first"``: the first token's output (a summary token
        placed first, as a class token).
    """

    def __init__(self, n_features: int, n_steps: int, *, n_logits: int = 1, d: int = 64,
                 layers: int = 2, heads: int = 4, dropout: float = 0.2,
                 pool: str = "mean") -> None:
        super().__init__()
        check_positive_int(n_features, "n_features")
        check_positive_int(n_steps, "n_steps")
        check_positive_int(n_logits, "n_logits")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must lie in [0, 1), got {dropout=}")
        if pool not in ("mean", "first"):
            raise ValueError(f"pool must be 'mean' or 'first', got {pool=!r}")
        self.pool = pool
        self.n_steps = n_steps
        self.embed = nn.Linear(n_features, d)
        self.pos = nn.Parameter(torch.zeros(1, n_steps, d))
        nn.init.normal_(self.pos, std=0.02)
        self.encoder = nn.ModuleList(
            nn.TransformerEncoderLayer(d, nhead=heads, dim_feedforward=2 * d, dropout=dropout,
                                       batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(d, n_logits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(B, T, F)`` -> logits ``(B, K)``."""
        if x.dim() != 3 or x.shape[1] != self.n_steps:
            raise ValueError(f"x must be (B, {self.n_steps}, F), got {tuple(x.shape)}")
        h = self.embed(x) + self.pos  # (B, T, d)
        for layer in self.encoder:
            h = layer(h)
        h = self.norm(h)
        return self.head(self.drop(h.mean(1) if self.pool == "mean" else h[:, 0]))  # (B, K)


@dataclass(frozen=True)
class LevyLogit:
    """One-pass logit of :class:`LevyClassifier`: ``mean`` and ``sigma`` ``(B,)``."""

    mean: torch.Tensor
    sigma: torch.Tensor


def probit_probability(mean: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    r"""``sigmoid(mu / sqrt(1 + pi sigma^2 / 8))``: the probit approximation of
    ``E[sigmoid(z)]``, ``z ~ N(mu, sigma^2)`` (MacKay 1992).

    >>> import torch
    >>> float(probit_probability(torch.tensor(0.0), torch.tensor(3.0)))
    0.5
    >>> bool(probit_probability(torch.tensor(2.0), torch.tensor(2.0)) < torch.sigmoid(
    ...     torch.tensor(2.0)))
    True
    """
    return torch.sigmoid(mean / torch.sqrt(1.0 + math.pi * sigma**2 / 8.0))


class LevyClassifier(nn.Module):
    """Binary classifier: Levy attention pooled by per-channel queries (module docstring).

    Parameters
    ----------
    num_channels, value_features
        ``C`` channels and ``F`` features per observation.
    d_model, num_heads, n_fourier, alpha, beta, h, max_period
        :class:`attnuq.nn.LevyAttention` settings.
    query_times
        The times ``t_j`` at which every channel is queried (``J C`` queries; the default is
        the end of the observation window). Earlier times let the logit weigh how a channel
        moved, not only where it ended.
    scale_logit
        Divide the summed logit by ``sqrt(J C)`` (and its sigma alike: the same linear map), so
        that its scale at initialisation does not grow with the number of queries (summed, on
        the mortality stays the mean ``|mu|`` at initialisation was 2-3 for 36 queries, 4-5 for
        72 and 7-10 for 144: probabilities near 0 or 1 before any training).
    """

    def __init__(self, num_channels: int, value_features: int, *, d_model: int = 32,
                 num_heads: int = 4, n_fourier: int = 4, alpha: float = 1.0, beta: float = 2.0,
                 h: float = 1.0, max_period: float = 48.0,
                 query_times: Sequence[float] = (48.0,), scale_logit: bool = True) -> None:
        super().__init__()
        from attnuq.nn import LevyAttention

        self.num_channels = check_positive_int(num_channels, "num_channels")
        qts = list(query_times) if isinstance(query_times, (list, tuple)) else None
        if not qts or not all(isinstance(t, (int, float)) and not isinstance(t, bool)
                              and math.isfinite(t) for t in qts):
            raise ValueError("query_times must be a non-empty list or tuple of finite numbers, "
                             f"got {query_times=!r}")
        self.query_times = tuple(float(t) for t in qts)
        self.scale_logit = bool(scale_logit)
        self.levy = LevyAttention(num_channels, d_model, num_heads,
                                  value_features=value_features, out_features=1,
                                  n_fourier=n_fourier, alpha=alpha, beta=beta, h=h,
                                  max_period=max_period)

    def forward(self, times: torch.Tensor, channels: torch.Tensor, features: torch.Tensor,
                mask: torch.Tensor) -> LevyLogit:
        """Observations ``(B, N)`` (features ``(B, N, F)``) -> :class:`LevyLogit` ``(B,)``."""
        B = times.shape[0]
        C = self.num_channels
        J = len(self.query_times)
        qt = torch.tensor(self.query_times, dtype=times.dtype, device=times.device)
        qt = qt.repeat_interleave(C).expand(B, J * C)  # query j * C + c: time t_j, channel c
        qc = torch.arange(C, device=times.device).repeat(J).expand(B, J * C)
        out = self.levy(times, channels, features, mask, qt, query_channels=qc)
        assert out.sigma_dim is not None
        # out_proj's bias is added once per query: J C b in total, one learned constant
        mean = out.mean[..., 0].sum(1)  # (B,)
        sigma = out.sigma_dim[..., 0].pow(2).sum(1).clamp_min(0).sqrt()
        if self.scale_logit:
            k = (J * C) ** -0.5
            mean, sigma = mean * k, sigma * k
        return LevyLogit(mean=mean, sigma=sigma)

    def forward_inputs(self, x: Any) -> LevyLogit:
        """``forward`` on an object with ``times, channels, features, mask`` attributes."""
        return self(x.times, x.channels, x.features, x.mask)


def tiny_vit(num_classes: int = 10, *, img_size: int = 8, patch_size: int = 2,
             embed_dim: int = 48, depth: int = 3, num_heads: int = 4, dropout: float = 0.1
             ) -> nn.Module:
    """A small timm ``VisionTransformer`` for ``(B, 1, img_size, img_size)`` images.

    >>> import torch
    >>> tiny_vit(embed_dim=16, depth=1, num_heads=2).eval()(torch.randn(2, 1, 8, 8)).shape
    torch.Size([2, 10])
    """
    from timm.models.vision_transformer import VisionTransformer

    if img_size % patch_size:
        raise ValueError(f"patch_size must divide img_size, got {patch_size=}, {img_size=}")
    return VisionTransformer(img_size=img_size, patch_size=patch_size, in_chans=1,
                             num_classes=num_classes, embed_dim=embed_dim, depth=depth,
                             num_heads=num_heads, mlp_ratio=2.0, drop_rate=dropout,
                             proj_drop_rate=dropout, attn_drop_rate=0.0)
