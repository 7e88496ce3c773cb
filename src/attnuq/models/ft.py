"""FT-Transformer regressor (rtdl-revisiting-models) and a small reusable training loop.

:func:`make_ft_transformer` builds ``rtdl_revisiting_models.FTTransformer`` with its default
hyper-parameters (``FTTransformer.get_default_kwargs(n_blocks)``) for continuous features and
wraps it in :class:`FTRegressor`, whose ``forward(x)`` takes one tensor ``(B, F)`` and returns
``(B,)`` (``d_out == 1``) or ``(B, d_out)``. The wrapper keeps the rtdl model as ``.ft`` so
patchers find its ``MultiheadAttention`` modules.

:func:`train_regressor` trains any model on ``(inputs, targets)`` batches with the FT-Transformer
recipe (AdamW over ``make_parameter_groups()`` when the model offers it, lr 1e-4, weight decay
1e-5) and early stopping on validation RMSE; it restores the best weights.

Examples
--------
>>> import torch
>>> from attnuq.models.ft import make_ft_transformer, train_regressor
>>> x, y = torch.randn(64, 3), torch.randn(64)
>>> m = make_ft_transformer(3, n_blocks=1, seed=0)
>>> res = train_regressor(m, (x, y), (x, y), max_epochs=1, progress=False)
>>> m(x).shape
torch.Size([64])
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from attnuq._validation import check_positive_int

__all__ = [
    "Batches",
    "FTRegressor",
    "TrainResult",
    "as_batches",
    "default_forward",
    "evaluate_rmse",
    "make_ft_transformer",
    "make_optimizer",
    "train_regressor",
]

#: anything yielding ``(inputs, targets)`` pairs, or a pair of tensors ``(X, Y)``
Batches = Iterable[tuple[Any, torch.Tensor]] | tuple[torch.Tensor, torch.Tensor]


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


def make_optimizer(
    model: nn.Module, *, lr: float = 1e-4, weight_decay: float = 1e-5
) -> torch.optim.Optimizer:
    """AdamW of the FT-Transformer recipe, using ``model.make_parameter_groups()`` if present."""
    if not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"lr must be a positive finite float, got {lr=}")
    groups_fn = getattr(model, "make_parameter_groups", None)
    params: Any = groups_fn() if callable(groups_fn) else model.parameters()
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def default_forward(model: nn.Module, inputs: Any) -> torch.Tensor:
    """Call ``model`` on a tensor, a tuple of tensors (positional) or a dict (keywords)."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


class _TensorBatches:
    """Re-iterable mini-batches over tensors ``(X, Y)``; shuffled with a seeded generator."""

    def __init__(
        self, x: torch.Tensor, y: torch.Tensor, batch_size: int, shuffle: bool, seed: int
    ) -> None:
        if len(x) != len(y):
            raise ValueError(f"inputs and targets differ in length: {len(x)} vs {len(y)}")
        if len(x) == 0:
            raise ValueError("empty data: got 0 rows")
        self.x, self.y, self.batch_size, self.shuffle = x, y, batch_size, shuffle
        self.gen = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return math.ceil(len(self.x) / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        n = len(self.x)
        order = torch.randperm(n, generator=self.gen) if self.shuffle else torch.arange(n)
        for i in range(0, n, self.batch_size):
            j = order[i : i + self.batch_size]
            yield self.x[j], self.y[j]


def as_batches(
    data: Batches, *, batch_size: int = 256, shuffle: bool = False, seed: int = 0
) -> Any:
    """Turn ``(X, Y)`` tensors into re-iterable batches; pass other iterables through."""
    if (
        isinstance(data, tuple)
        and len(data) == 2
        and all(isinstance(t, torch.Tensor) for t in data)
    ):
        x, y = data
        assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
        return _TensorBatches(x, y, check_positive_int(batch_size, "batch_size"), shuffle, seed)
    return data


@torch.no_grad()
def evaluate_rmse(
    model: nn.Module,
    data: Batches,
    forward_fn: Callable[[nn.Module, Any], torch.Tensor] = default_forward,
) -> float:
    """RMSE of ``forward_fn(model, inputs)`` against the targets, over all batches."""
    was_training = model.training
    model.eval()
    se, n = 0.0, 0
    for inputs, targets in as_batches(data, batch_size=1024):
        pred = forward_fn(model, inputs)
        if pred.shape != targets.shape:
            raise ValueError(
                f"prediction and targets differ in shape: {tuple(pred.shape)} vs "
                f"{tuple(targets.shape)}"
            )
        se += float(((pred.float() - targets.float()) ** 2).sum())
        n += targets.numel()
    model.train(was_training)
    if n == 0:
        raise ValueError("empty data: no batches")
    return math.sqrt(se / n)


@dataclass
class TrainResult:
    """What :func:`train_regressor` did: best epoch, histories, seconds, forward passes."""

    best_epoch: int
    best_val_rmse: float
    epochs_run: int
    seconds: float
    n_forward: int
    train_loss: list[float] = field(default_factory=list)
    val_rmse: list[float] = field(default_factory=list)


def train_regressor(
    model: nn.Module,
    train: Batches,
    val: Batches,
    *,
    max_epochs: int = 100,
    patience: int = 16,
    batch_size: int = 256,
    lr: float = 1e-4,
    weight_decay: float = 1e-5,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    forward_fn: Callable[[nn.Module, Any], torch.Tensor] = default_forward,
    seed: int = 0,
    progress: bool = True,
    desc: str = "train",
    on_epoch_end: Callable[[nn.Module, int], None] | None = None,
    restore_best: bool = True,
) -> TrainResult:
    """Train ``model`` by mini-batch descent on the MSE with early stopping on validation RMSE.

    Parameters
    ----------
    model
        Any module; ``forward_fn(model, inputs)`` must return a tensor shaped like the targets.
    train, val
        ``(X, Y)`` tensors (batched here, training batches shuffled with ``seed``) or iterables of
        ``(inputs, targets)`` (a ``DataLoader``); inputs may be a tensor, tuple or dict.
    max_epochs, patience
        Stop after ``max_epochs`` or when validation RMSE has not improved for ``patience`` epochs.
    optimizer
        Defaults to :func:`make_optimizer` (AdamW, ``lr``, ``weight_decay``).
    loss_fn
        ``loss_fn(pred, target) -> scalar``; default mean squared error.
    on_epoch_end
        Called as ``on_epoch_end(model, epoch)`` after each epoch (e.g. SWAG snapshots).
    restore_best
        Load the weights of the best validation epoch at the end.

    Returns
    -------
    TrainResult
        ``n_forward`` counts example-forwards (training rows + validation rows per epoch).
    """
    max_epochs = check_positive_int(max_epochs, "max_epochs")
    patience = check_positive_int(patience, "patience")
    opt = optimizer if optimizer is not None else make_optimizer(
        model, lr=lr, weight_decay=weight_decay
    )
    lossf = loss_fn if loss_fn is not None else nn.functional.mse_loss
    train_b = as_batches(train, batch_size=batch_size, shuffle=True, seed=seed)
    val_b = as_batches(val, batch_size=1024)
    t0 = time.perf_counter()
    best = math.inf
    best_state: dict[str, torch.Tensor] | None = None
    best_epoch, bad, n_fwd = -1, 0, 0
    res = TrainResult(best_epoch=-1, best_val_rmse=math.inf, epochs_run=0, seconds=0.0, n_forward=0)
    bar = _tqdm(range(max_epochs), desc=desc, disable=not progress)
    for epoch in bar:
        model.train()
        tot, cnt = 0.0, 0
        for inputs, targets in train_b:
            opt.zero_grad(set_to_none=True)
            pred = forward_fn(model, inputs)
            loss = lossf(pred, targets)
            if not torch.isfinite(loss):
                raise RuntimeError(f"non-finite training loss at epoch {epoch}: {float(loss)}")
            loss.backward()
            opt.step()
            tot += float(loss.detach()) * len(targets)
            cnt += len(targets)
        n_fwd += cnt
        v = evaluate_rmse(model, val_b, forward_fn)
        n_fwd += _count_rows(val_b)
        res.train_loss.append(tot / max(cnt, 1))
        res.val_rmse.append(v)
        res.epochs_run = epoch + 1
        if on_epoch_end is not None:
            on_epoch_end(model, epoch)
        if v < best:
            best, best_epoch, bad = v, epoch, 0
            if restore_best:
                best_state = copy.deepcopy(model.state_dict())
        else:
            bad += 1
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(
                loss=f"{res.train_loss[-1]:.4f}", val_rmse=f"{v:.4f}", best=f"{best:.4f}"
            )
        if bad >= patience:
            break
    if restore_best and best_state is not None:
        model.load_state_dict(best_state)
    model.eval()
    res.best_epoch, res.best_val_rmse = best_epoch, best
    res.seconds = time.perf_counter() - t0
    res.n_forward = n_fwd
    return res


def _count_rows(batches: Iterable[tuple[Any, torch.Tensor]]) -> int:
    if isinstance(batches, _TensorBatches):
        return len(batches.x)
    return sum(len(t) for _, t in batches)


def _tqdm(it: Sequence[int] | range, **kw: Any) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the bench extra
        return it
    return tqdm(it, leave=False, **kw)
