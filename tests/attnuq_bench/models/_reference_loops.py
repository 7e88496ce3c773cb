"""Frozen copies of the three training loops that attnuq_bench.training.fit replaced (commit 304deaf).

tests/attnuq_bench/test_training.py checks that fit, given the same seed and inputs, ends with bit-identical
weights and the same histories as each of these, so a backbone cached by the old code stays
valid. Do not edit: these are the reference, not library code.
"""
# ruff: noqa

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from attnuq._validation import check_finite, check_positive_int

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


# ---- models/patchtst.py

@dataclass
class TrainReport:
    """What :func:`train_forecaster` did: per-epoch losses, the best epoch, the time taken."""

    train_loss: list[float] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    best_epoch: int = -1
    best_val: float = math.inf
    epochs_run: int = 0
    seconds: float = 0.0
    steps: int = 0
    #: example-forwards spent training (rows per step summed), for cost accounting
    n_forward: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@torch.no_grad()
def predict_batched(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, batch_size: int = 256
) -> torch.Tensor:
    """Apply ``fn`` to ``x`` in batches along axis 0 and concatenate."""
    batch_size = check_positive_int(batch_size, "batch_size")
    if x.shape[0] == 0:
        raise ValueError("x is empty (0 rows)")
    return torch.cat([fn(x[i : i + batch_size]) for i in range(0, x.shape[0], batch_size)])


def train_forecaster(
    model: nn.Module,
    train: tuple[torch.Tensor, torch.Tensor],
    val: tuple[torch.Tensor, torch.Tensor],
    *,
    epochs: int = 10,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    batch_size: int = 64,
    patience: int = 3,
    max_steps_per_epoch: int | None = None,
    seed: int = 0,
    progress: bool = True,
    desc: str = "train",
) -> TrainReport:
    """Train ``model`` (``forward(x) -> prediction``) on MSE with Adam and early stopping.

    The weights of the epoch with the lowest validation MSE are restored at the end.

    Parameters
    ----------
    model
        Maps ``(B, ...)`` inputs to predictions with the targets' shape.
    train, val
        ``(inputs, targets)`` tensors, rows first.
    epochs, patience
        At most ``epochs`` epochs; stop after ``patience`` epochs without improvement.
    max_steps_per_epoch
        Optional cap on optimiser steps per epoch (random subset of batches), for CPU budgets.
    """
    from tqdm.auto import tqdm

    epochs = check_positive_int(epochs, "epochs")
    patience = check_positive_int(patience, "patience")
    batch_size = check_positive_int(batch_size, "batch_size")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr=}")
    xtr, ytr = train
    xva, yva = val
    for name, t in (("train inputs", xtr), ("train targets", ytr), ("val inputs", xva),
                    ("val targets", yva)):
        check_finite(t, name)
    if xtr.shape[0] != ytr.shape[0] or xtr.shape[0] == 0:
        raise ValueError(
            f"train inputs/targets must have the same non-zero number of rows, got "
            f"{xtr.shape[0]} and {ytr.shape[0]}"
        )
    if xva.shape[0] != yva.shape[0] or xva.shape[0] == 0:
        raise ValueError(
            f"val inputs/targets must have the same non-zero number of rows, got "
            f"{xva.shape[0]} and {yva.shape[0]}"
        )
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    rep = TrainReport()
    best_state = copy.deepcopy(model.state_dict())
    bad = 0
    t0 = time.perf_counter()
    n = xtr.shape[0]
    n_batches = math.ceil(n / batch_size)
    steps = n_batches if max_steps_per_epoch is None else min(n_batches, max_steps_per_epoch)
    for ep in range(epochs):
        model.train()
        perm = torch.randperm(n, generator=gen)
        tot, cnt = 0.0, 0
        bar = tqdm(range(steps), desc=f"{desc} ep{ep}", disable=not progress, leave=False)
        for i in bar:
            idx = perm[i * batch_size : (i + 1) * batch_size]
            pred = model(xtr[idx])
            loss = torch.nn.functional.mse_loss(pred, ytr[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += float(loss.detach()) * len(idx)
            cnt += len(idx)
            rep.steps += 1
            rep.n_forward += len(idx)
        model.eval()
        with torch.no_grad():
            vp = predict_batched(model, xva, 512)
            vl = float(torch.nn.functional.mse_loss(vp, yva))
        rep.train_loss.append(tot / max(cnt, 1))
        rep.val_loss.append(vl)
        rep.epochs_run = ep + 1
        if progress:
            print(f"[{desc}] epoch {ep}: train {tot / max(cnt, 1):.4f} val {vl:.4f}", flush=True)
        if vl < rep.best_val:
            rep.best_val, rep.best_epoch, bad = vl, ep, 0
            best_state = copy.deepcopy(model.state_dict())
        else:
            bad += 1
            if bad >= patience:
                break
    model.load_state_dict(best_state)
    model.eval()
    rep.seconds = time.perf_counter() - t0
    return rep


# ---- models/levy_forecaster.py

def masked_mse(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``(pred - target)^2`` over ``mask``; raises on an empty mask."""
    n = mask.sum()
    if int(n) == 0:
        raise ValueError("masked_mse: the mask selects no element")
    return ((pred - target) ** 2 * mask).sum() / n


def _forward(model: nn.Module, b: _Batch) -> ForecastOutput:
    out: ForecastOutput = model(
        b.obs_times, b.obs_channels, b.obs_values, b.obs_mask, b.query_times, b.query_channels
    )
    return out


@dataclass
class FitReport:
    """Training history: per-epoch train loss and validation MSE, best epoch, seconds."""

    train_loss: list[float] = field(default_factory=list)
    val_mse: list[float] = field(default_factory=list)
    best_epoch: int = -1
    best_val_mse: float = float("inf")
    seconds: float = 0.0
    #: why training ended: ``"max_epochs"``, ``"patience"`` or ``"max_seconds"``
    stopped_by: str = "max_epochs"


@torch.no_grad()
def evaluate_mse(model: nn.Module, batches: Iterable[_Batch]) -> float:
    """Masked MSE of the model's mean over every forecast point of ``batches`` (eval mode)."""
    was = model.training
    model.eval()
    se, n = 0.0, 0
    for b in batches:
        out = _forward(model, b)
        se += float((((out.mean - b.targets) ** 2) * b.query_mask).sum())
        n += int(b.query_mask.sum())
    model.train(was)
    if n == 0:
        raise ValueError("evaluate_mse: no forecast points in the batches")
    return se / n


def fit(
    model: nn.Module,
    train_batches: Callable[[int], Iterable[_Batch]],
    val_batches: Callable[[], Iterable[_Batch]],
    *,
    max_epochs: int = 20,
    patience: int = 3,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    nll_weight: float = 0.0,
    max_seconds: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> FitReport:
    """Train with Adam on masked MSE of ``mu`` (+ ``nll_weight`` x Gaussian NLL), early stopping.

    Parameters
    ----------
    train_batches
        ``epoch -> iterable of batches`` (shuffle inside with the epoch as seed).
    val_batches
        ``() -> iterable of batches``; validation MSE after each epoch selects the best weights,
        which are restored at the end.
    nll_weight
        weight of ``mean over points of 0.5 log(2 pi s^2) + (y - mu)^2 / (2 s^2)`` with
        ``s^2 = sigma^2 + 1e-6`` (Levy model only; ignored when ``sigma`` is ``None``).
    max_seconds
        wall-clock cap on training (checked after each epoch).
    """
    check_positive_int(max_epochs, "max_epochs")
    check_positive_int(patience, "patience")
    if not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"lr must be a positive float, got {lr=}")
    if nll_weight < 0:
        raise ValueError(f"nll_weight must be >= 0, got {nll_weight=}")
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    rep = FitReport()
    best_state = copy.deepcopy(model.state_dict())
    bad = 0
    t0 = time.perf_counter()
    for epoch in range(max_epochs):
        model.train()
        tot, nb = 0.0, 0
        for b in train_batches(epoch):
            if int(b.query_mask.sum()) == 0:
                continue
            out = _forward(model, b)
            loss = masked_mse(out.mean, b.targets, b.query_mask)
            if nll_weight > 0 and out.sigma is not None:
                s2 = out.sigma**2 + 1e-6
                nll = 0.5 * torch.log(2 * math.pi * s2) + (b.targets - out.mean) ** 2 / (2 * s2)
                loss = loss + nll_weight * (nll * b.query_mask).sum() / b.query_mask.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            tot += float(loss.detach())
            nb += 1
        rep.train_loss.append(tot / max(nb, 1))
        v = evaluate_mse(model, val_batches())
        rep.val_mse.append(v)
        if progress is not None:
            progress(f"epoch {epoch}: train {rep.train_loss[-1]:.5f} val MSE {v:.5f}")
        if v < rep.best_val_mse:
            rep.best_val_mse, rep.best_epoch, bad = v, epoch, 0
            best_state = copy.deepcopy(model.state_dict())
        else:
            bad += 1
        if bad >= patience:
            rep.stopped_by = "patience"
            break
        if (max_seconds is not None and time.perf_counter() - t0 > max_seconds
                and epoch + 1 < max_epochs):
            rep.stopped_by = "max_seconds"
            break
    model.load_state_dict(best_state)
    model.eval()
    rep.seconds = time.perf_counter() - t0
    return rep


