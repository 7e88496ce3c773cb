"""FT-Transformer regressor (rtdl-revisiting-models): ``make_ft_transformer`` and its wrapper.

:func:`make_ft_transformer` builds ``rtdl_revisiting_models.FTTransformer`` with its default
hyper-parameters (``FTTransformer.get_default_kwargs(n_blocks)``) for continuous features and
wraps it in :class:`FTRegressor`, whose ``forward(x)`` takes one tensor ``(B, F)`` and returns
``(B,)`` (``d_out == 1``) or ``(B, d_out)``. The wrapper keeps the rtdl model as ``.ft`` so
patchers find its ``MultiheadAttention`` modules, and offers rtdl's parameter groups
(``make_parameter_groups``) to :func:`attnuq_bench.training.make_optimizer`.

Training lives in :mod:`attnuq_bench.training`: ``fit(model, (x, y), (x_val, y_val))`` with its
defaults is the FT-Transformer recipe (AdamW over the parameter groups, lr 1e-4, weight decay
1e-5, early stopping on validation RMSE).

Examples
--------
>>> import torch
>>> from attnuq_bench.models.ft import make_ft_transformer
>>> from attnuq_bench.training import fit
>>> x, y = torch.randn(64, 3), torch.randn(64)
>>> m = make_ft_transformer(3, n_blocks=1, seed=0)
>>> rep = fit(m, (x, y), (x, y), max_epochs=1, progress=False)
>>> m(x).shape
torch.Size([64])
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attnuq._validation import check_positive_int

__all__ = [
    "FTRegressor",
    "make_ft_transformer",
]

class FTRegressor(nn.Module):
    """``rtdl_revisiting_models.FTTransformer`` on continuous features, ``forward(x) -> (B,)``.

    Parameters
    ----------
    ft
        An ``FTTransformer`` built with ``cat_cardinalities=[]``.
    d_out
        Its output size; ``1`` squeezes the last dimension.
    """

    def __init__(self, ft: nn.Module, d_out: int = 1) -> None:
        super().__init__()
        self.ft = ft
        self.d_out = check_positive_int(d_out, "d_out")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            raise ValueError(f"x must have shape (B, F), got x.shape={tuple(x.shape)}")
        out = self.ft(x, None)  # (B, d_out)
        return out.squeeze(-1) if self.d_out == 1 else out

    def make_parameter_groups(self) -> list[dict[str, Any]]:
        """The rtdl parameter groups (no weight decay on embeddings, norms and biases)."""
        return self.ft.make_parameter_groups()  # type: ignore[no-any-return,operator]


def make_ft_transformer(
    n_features: int,
    *,
    d_out: int = 1,
    n_blocks: int = 3,
    seed: int | None = None,
    **overrides: Any,
) -> FTRegressor:
    """Build the default FT-Transformer (``get_default_kwargs(n_blocks)``) for ``n_features``.

    ``overrides`` replace entries of the default kwargs (e.g. ``attention_dropout=0.2``).
    ``seed`` seeds the weight initialisation (``torch.manual_seed``) when given.
    """
    from rtdl_revisiting_models import FTTransformer

    n_features = check_positive_int(n_features, "n_features")
    check_positive_int(n_blocks, "n_blocks")
    if n_blocks > 6:
        raise ValueError(f"n_blocks must be in 1..6 (rtdl default configs), got {n_blocks=}")
    kwargs = FTTransformer.get_default_kwargs(n_blocks)
    unknown = set(overrides) - set(kwargs)
    if unknown:
        raise ValueError(
            f"unknown FT-Transformer overrides {sorted(unknown)}; known {sorted(kwargs)}"
        )
    kwargs.update(overrides)
    if overrides:
        kwargs["_is_default"] = False
    if seed is not None:
        torch.manual_seed(seed)
    ft = FTTransformer(n_cont_features=n_features, cat_cardinalities=[], d_out=d_out, **kwargs)
    return FTRegressor(ft, d_out=d_out)
