"""Inputs of the ERA5 suite's forecaster and the naive blend it may correct.

* :class:`Inputs` assembles the model inputs from :func:`attnuq_bench.data.era5.make_examples`'
  fields: the fields at ``t``, ``t - history`` and (``day_ago``) ``t - 24 h`` and the field 24 h
  before each valid time ``t + lead - 24 h`` (leads under 24 h; at 24 h that field is ``x(t)``),
  then the hour-of-day training climatology at each valid time and (``day_ago``) at ``t``. With
  ``loo`` the climatology channels of training examples leave out the example's own field (the
  mean of the other training days at that hour of day, ``(n_h c_h - x) / (n_h - 1)``), so that
  the training targets are not part of their own inputs.
* :func:`naive_weights` writes the naive forecasts as weights over those channels: persistence
  ``x(t)``, the field 24 h earlier ``x(t + lead - 24 h)``, climatology ``c(t + lead)``, anomaly
  persistence ``x(t) - c(t) + c(t + lead)`` and yesterday's change ``x(t) + x(t + lead - 24 h) -
  x(t - 24 h)``;
* ``_MemberRecipe`` (and ``_MemberRecipeV2``, with a blend base and weight decay; the class
  names are part of the member cache key, kept from bench.era5 where they were defined): how
  the suite makes and trains its backbone and ensemble members;
* :func:`select_blend` picks per lead the convex combination of the naive forecasts (simplex grid,
  step ``1 / steps``) with the smallest latitude-weighted RMSE on the validation examples: the
  rule by which the base of :class:`~attnuq_bench.models.vit_field.ViTFieldForecaster` is chosen.

Examples
--------
>>> import numpy as np, torch
>>> clim = torch.zeros(24, 1, 1)
>>> inp = Inputs(clim=clim, leads=(6, 24), use_clim=True, history=6, day_ago=True)
>>> inp.extra_lags, inp.channels()
((24, 18), ['x(t)', 'x(t-6h)', 'x(t-24h)', 'x(t-18h)', 'clim(t+6h)', 'clim(t+24h)', 'clim(t)'])
>>> w = naive_weights(inp)
>>> w["day"][0].tolist(), w["day"][1].tolist()  # lead 6: x(t-18h); lead 24: x(t)
([0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from attnuq import metrics
from attnuq_bench.training import fit

__all__ = ["Inputs", "naive_weights", "select_blend"]


@dataclass
class Inputs:
    """Assemble model inputs ``(N, C, H, W)`` from example fields and issue hours (see module).

    ``clim`` ``(24, H, W)`` is the training climatology; ``values`` ``(T, H, W)`` (the field)
    and ``counts`` ``(24,)`` (training times per hour of day, each >= 2) are needed for ``loo``
    only, which applies to the calls given the examples' issue-time indices ``t_index``.
    """

    clim: torch.Tensor
    leads: tuple[int, ...]
    use_clim: bool
    history: int = 6
    day_ago: bool = False
    loo: bool = False
    values: torch.Tensor | None = None
    counts: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.day_ago and max(self.leads) > 24:
            raise ValueError(f"day_ago needs leads <= 24 h (the field 24 h before the valid time "
                             f"must be known at issue time), got leads={self.leads}")
        if self.loo and (self.values is None or self.counts is None
                         or int(np.min(self.counts)) < 2):
            raise ValueError(f"loo needs values and counts >= 2 per hour of day, got "
                             f"counts={self.counts}")

    @property
    def extra_lags(self) -> tuple[int, ...]:
        """Hours back of the input fields after ``x(t)`` and ``x(t - history)``."""
        if not self.day_ago:
            return ()
        return (24, *[24 - ld for ld in self.leads if ld < 24])

    def channels(self) -> list[str]:
        """The name of every input channel, in order."""
        names = ["x(t)", f"x(t-{self.history}h)", *[f"x(t-{lag}h)" for lag in self.extra_lags]]
        if self.use_clim:
            names += [f"clim(t+{ld}h)" for ld in self.leads] + (["clim(t)"] if self.day_ago else [])
        return names

    def _clim(self, hours: np.ndarray, t_index: np.ndarray | None) -> torch.Tensor:
        c = self.clim[torch.from_numpy(hours % 24)]
        if t_index is None or not self.loo:
            return c
        assert self.values is not None and self.counts is not None
        k = torch.from_numpy(self.counts[hours % 24]).to(c.dtype)[:, None, None]
        return (k * c - self.values[torch.from_numpy(t_index)].to(c.dtype)) / (k - 1)

    def valid_clim(self, hours: np.ndarray, t_index: np.ndarray | None = None) -> torch.Tensor:
        """``(N, L, H, W)`` climatology at ``t + lead`` for issue hours ``hours`` (``t_index``:
        the issue times of training examples, for ``loo``)."""
        return torch.stack([self._clim(hours + ld, None if t_index is None else t_index + ld)
                            for ld in self.leads], dim=1)

    def __call__(self, fields: torch.Tensor, hours: np.ndarray,
                 t_index: np.ndarray | None = None) -> torch.Tensor:
        if fields.shape[1] != 2 + len(self.extra_lags):
            raise ValueError(f"fields must have {2 + len(self.extra_lags)} channels "
                             f"({self.channels()[:2 + len(self.extra_lags)]}), got "
                             f"{tuple(fields.shape)}")
        if not self.use_clim:
            return fields
        parts = [fields, self.valid_clim(hours, t_index)]
        if self.day_ago:
            parts.append(self._clim(hours, t_index)[:, None])
        return torch.cat(parts, dim=1)


def naive_weights(inp: Inputs) -> dict[str, torch.Tensor]:
    """The naive forecasts as ``(L, C)`` weights over :meth:`Inputs.channels` (``clim`` and
    ``anom`` need the climatology channels, ``day`` and ``ydc`` need ``day_ago``)."""
    ch = inp.channels()
    n_l, n_c = len(inp.leads), len(ch)

    def w(terms: list[list[tuple[str, float]]]) -> torch.Tensor:
        out = torch.zeros(n_l, n_c, dtype=torch.float64)
        for i, t in enumerate(terms):
            for name, v in t:  # pairs, not a dict: at lead 24 h "day" is x(t) again
                out[i, ch.index(name)] += v
        return out

    def day(ld: int) -> str:
        return "x(t)" if ld == 24 else f"x(t-{24 - ld}h)"

    out = {"persistence": w([[("x(t)", 1.0)] for _ in inp.leads])}
    if inp.day_ago:
        out["day"] = w([[(day(ld), 1.0)] for ld in inp.leads])
        out["ydc"] = w([[("x(t)", 1.0), (day(ld), 1.0), ("x(t-24h)", -1.0)] for ld in inp.leads])
    if inp.use_clim:
        out["climatology"] = w([[(f"clim(t+{ld}h)", 1.0)] for ld in inp.leads])
        if inp.day_ago:
            out["anom"] = w([[("x(t)", 1.0), ("clim(t)", -1.0), (f"clim(t+{ld}h)", 1.0)]
                             for ld in inp.leads])
    return out


def select_blend(x: torch.Tensor, y: torch.Tensor, lat: torch.Tensor,
                 naive: dict[str, torch.Tensor], steps: int = 10
                 ) -> tuple[torch.Tensor, list[dict[str, float]], list[float]]:
    """Per lead, the convex blend of the ``naive`` forecasts with the least latitude-weighted
    RMSE on ``(x, y)`` (validation inputs ``(N, C, H, W)``, targets ``(N, L, H, W)``).

    The blend weights ``a`` run over the simplex grid ``{a_k in {0, 1/steps, ..., 1}, sum a = 1}``
    (ties: the first in :func:`itertools.product` order of ``naive``'s keys). Returns the
    ``(L, C)`` channel weights ``sum_k a_k W_k``, the chosen ``a`` per lead and its RMSE.

    Examples
    --------
    >>> x = torch.stack([torch.zeros(4, 2, 3), torch.ones(4, 2, 3)], 1)  # two channels
    >>> naive = {"a": torch.tensor([[1.0, 0.0]]), "b": torch.tensor([[0.0, 1.0]])}
    >>> w, a, r = select_blend(x, torch.full((4, 1, 2, 3), 0.3), torch.tensor([50.0, 51.0]),
    ...                        naive)
    >>> a, w.tolist(), round(r[0], 6)
    ([{'a': 0.7, 'b': 0.3}], [[0.7, 0.3]], 0.0)
    """
    if not naive:
        raise ValueError("select_blend needs at least one naive forecast")
    steps = int(steps)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps=}")
    names = list(naive)
    grid = [a for a in itertools.product(range(steps + 1), repeat=len(names))
            if sum(a) == steps]
    xd = x.double()
    preds = {k: torch.einsum("c,nchw->nhw", v.double(), xd)
             for k, v in ((f"{k}:{i}", naive[k][i]) for k in names for i in range(y.shape[1]))}
    weight = torch.zeros(next(iter(naive.values())).shape, dtype=torch.float64)
    chosen, rmse = [], []
    for i in range(y.shape[1]):
        yi = y[:, i].double()
        def blend(a: tuple[int, ...], i: int = i) -> torch.Tensor:
            return torch.stack([a_k / steps * preds[f"{k}:{i}"]
                                for a_k, k in zip(a, names, strict=True)]).sum(0)

        best = min(((float(metrics.lat_weighted_rmse(blend(a), yi, lat)), a) for a in grid),
                   key=lambda r: r[0])
        rmse.append(best[0])
        chosen.append({k: a_k / steps for a_k, k in zip(best[1], names, strict=True)})
        weight[i] = torch.stack([a_k / steps * naive[k][i].double()
                                 for a_k, k in zip(best[1], names, strict=True)]).sum(0)
    return weight, chosen, rmse


@dataclass
class _MemberRecipe:
    """The backbone's recipe (picklable, for :mod:`attnuq_bench.suites._members`): member ``k`` (0 =
    the backbone) is made and trained with seed ``seed + k``, on ``device``, from CPU tensors."""

    grid: list[int]  # a list, as recipe.json holds it (a tuple would never compare equal)
    in_channels: int
    out_channels: int
    patch: int
    hidden: int
    layers: int
    heads: int
    mlp: int
    dropout: float
    mean: float
    std: float
    epochs: int
    lr: float
    batch_size: int
    patience: int
    seed: int
    progress: bool
    device: str
    train_xy: tuple[torch.Tensor, torch.Tensor]
    val_xy: tuple[torch.Tensor, torch.Tensor]

    def make(self, index: int) -> Any:
        from attnuq_bench.models.vit_field import ViTFieldForecaster

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + index)
            m = ViTFieldForecaster(
                self.grid, in_channels=self.in_channels, out_channels=self.out_channels,
                patch_size=self.patch, hidden_size=self.hidden, num_layers=self.layers,
                num_heads=self.heads, mlp_size=self.mlp, dropout=self.dropout,
                attention_dropout=self.dropout, mean=self.mean, std=self.std,
                base_weight=getattr(self, "base_weight", None),
                **({"center": True} if getattr(self, "center", False) else {}))
        return m.to(self.device)

    def train(self, model: Any, _train: Any, _val: Any, index: int) -> Any:
        """MSE, AdamW (weight decay 0 or the recipe's), early stopping on val MSE."""
        dev = torch.device(self.device)
        return fit(model, tuple(t.to(dev) for t in self.train_xy),
                   tuple(t.to(dev) for t in self.val_xy), metric="mse", optimizer="adamw",
                   lr=self.lr, weight_decay=float(getattr(self, "weight_decay", 0.0)),
                   max_epochs=self.epochs, patience=self.patience,
                   batch_size=self.batch_size, val_batch_size=512, seed=self.seed + index,
                   seed_torch=True, progress=self.progress,
                   desc=f"member{index}")


@dataclass
class _MemberRecipeV2(_MemberRecipe):
    """:class:`_MemberRecipe` with the options of ``--base blend`` / ``--weight-decay`` (its own
    class: the cache key of a recipe without them stays what it was)."""

    base_weight: list[list[float]] | None = None
    weight_decay: float = 0.0
    center: bool = False
