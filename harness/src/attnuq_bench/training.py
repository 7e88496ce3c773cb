r"""One training loop for every backbone: early stopping, one report, batching, checkpoints.

:func:`fit` trains any ``nn.Module`` by mini-batch descent and early stopping on a validation
metric; every backbone of the package (the FT-Transformer on UCI, PatchTST on ETT, the ViT on
ERA5, the Levy forecaster and its softmax control on PhysioNet) trains through it, and
:class:`TrainReport` is what it returns.

One epoch ``e`` (0-based) of :func:`fit`:

1. the learning rate of every parameter group is set to ``lr_g * schedule(e)`` (``"constant"``
   leaves it untouched, ``"type3"`` is PatchTST's ``adjust_learning_rate(type3)``:
   ``schedule(e) = 0.9 ** max(0, e - 3)``, or any callable ``epoch -> factor``);
2. for each training batch (at most ``max_steps_per_epoch``): ``l = loss(model, batch)`` (a
   scalar; ``None`` skips the batch without a step), ``l.backward()``, optional gradient-norm
   clipping, ``optimizer.step()``;
3. ``v = metric(model, val_batches)`` in eval mode (lower is better); the weights of the epoch
   with the smallest ``v`` are kept and restored at the end; training stops after ``patience``
   epochs without improvement, after ``max_epochs``, or once ``max_seconds`` have passed.

Data forms: ``(X, Y)`` tensors (cut into batches here; training batches reshuffled every epoch
by a generator seeded with ``seed``), any re-iterable of batches (a list, a ``DataLoader``), or
a batch factory ``epoch -> iterable`` for irregular data (PhysioNet's ``ForecastBatch`` lists);
the validation part may be a factory ``() -> iterable``. A batch is an ``(inputs, targets)``
pair for the ``"mse"`` loss and the ``"rmse"``/``"mse"`` metrics, or an object with
``targets`` and ``query_mask`` ``(B, Q)`` for ``"masked_mse"``.

``checkpoint=PATH`` writes model, optimiser, learning rates, random states (torch's global
generator, CUDA's, the batch generator), the best weights and the report after every epoch,
atomically (:mod:`attnuq._io`); a later call with the same path resumes after the last finished
epoch, and an interrupted-and-resumed run ends with the weights of an uninterrupted one, bit for
bit (a batch factory must draw its order from the epoch it is given, not from a hidden state).

Recipes
-------
The suites' backbones:

* FT-Transformer (UCI, the demo): ``fit(model, (x, y), (x_val, y_val))`` -- the defaults are
  rtdl's recipe (AdamW over ``make_parameter_groups()``, lr 1e-4, weight decay 1e-5, early
  stopping on validation RMSE, patience 16);
* PatchTST (ETT) and the ViT field forecaster (ERA5): ``fit(..., metric="mse", lr=1e-3,
  weight_decay=0.0, max_epochs=10, patience=3, batch_size=64, val_batch_size=512,
  seed_torch=True)`` (AdamW over the parameters: these models have no parameter groups);
* Levy forecaster and softmax control (PhysioNet): ``fit(model, epoch_batches, val_batches,
  loss=masked_mse_loss(forward_batch, nll_weight), metric="masked_mse",
  forward_fn=forward_batch, optimizer="adam", lr=1e-3, weight_decay=0.0, clip_grad_norm=5.0,
  max_epochs=20, patience=3)``.

PatchTST's own supervised ETTh1 script trains with Adam at lr 1e-4, batch 128 and the
``"type3"`` schedule: ``optimizer="adam", lr=1e-4, weight_decay=0.0, batch_size=128,
schedule="type3"``.

Examples
--------
>>> import torch
>>> from torch import nn
>>> from attnuq_bench.training import fit
>>> _ = torch.manual_seed(0)
>>> net = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1), nn.Flatten(0))
>>> x = torch.randn(64, 3)
>>> y = x.sum(1)
>>> rep = fit(net, (x, y), (x, y), lr=1e-2, max_epochs=5, patience=2, batch_size=16,
...           progress=False)
>>> rep.epochs_run, rep.metric, len(rep.val_metric), net.training
(5, 'rmse', 5, False)
>>> rep.best_val == min(rep.val_metric)
True
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from attnuq._io import atomic_torch_save, torch_load_or_none
from attnuq._validation import check_finite, check_positive_int

__all__ = [
    "Batches",
    "TensorBatches",
    "TrainReport",
    "as_batches",
    "count_rows",
    "default_forward",
    "evaluate_masked_mse",
    "evaluate_mse",
    "evaluate_rmse",
    "fit",
    "make_optimizer",
    "masked_mse",
    "masked_mse_loss",
    "mse_loss",
    "output_mean",
    "predict_batched",
    "progress_bar",
    "reseeded",
    "schedule_factor",
]

#: anything yielding ``(inputs, targets)`` pairs, or a pair of tensors ``(X, Y)``
Batches = Iterable[tuple[Any, torch.Tensor]] | tuple[torch.Tensor, torch.Tensor]

#: ``loss(model, batch) -> scalar tensor`` (``None``: skip the batch)
LossFn = Callable[[nn.Module, Any], "torch.Tensor | None"]
#: ``metric(model, val_batches) -> float``, lower is better
MetricFn = Callable[[nn.Module, Iterable[Any]], float]
ForwardFn = Callable[[nn.Module, Any], Any]


# -- forward, batching ------------------------------------------------------------------------


def default_forward(model: nn.Module, inputs: Any) -> Any:
    """Call ``model`` on a tensor, a tuple of tensors (positional) or a dict (keywords).

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> default_forward(nn.Identity(), torch.ones(2)).shape
    torch.Size([2])
    """
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def output_mean(out: Any) -> torch.Tensor:
    """The point prediction of a model output: the tensor itself, or its ``.mean`` tensor
    (e.g. the Levy forecaster's ``ForecastOutput``).

    Examples
    --------
    >>> import torch
    >>> from types import SimpleNamespace
    >>> output_mean(torch.zeros(2)).shape, output_mean(SimpleNamespace(mean=torch.ones(3))).shape
    (torch.Size([2]), torch.Size([3]))
    """
    if isinstance(out, torch.Tensor):
        return out
    mean = getattr(out, "mean", None)
    if isinstance(mean, torch.Tensor):
        return mean
    raise TypeError(
        f"a model output must be a tensor or have a tensor .mean, got {type(out).__name__}"
    )


class TensorBatches:
    """Re-iterable mini-batches ``(X[j], Y[j])`` over tensors; shuffled by a seeded generator.

    Each iteration draws a fresh order ``torch.randperm(N, generator=gen)`` when ``shuffle``
    (so the generator's state advances once per epoch), else ``0..N-1``; ``len`` is the
    number of batches ``ceil(N / batch_size)``.

    Examples
    --------
    >>> import torch
    >>> b = TensorBatches(torch.arange(5.0), torch.arange(5.0), batch_size=2)
    >>> len(b), [len(y) for _, y in b]
    (3, [2, 2, 1])
    """

    def __init__(
        self, x: torch.Tensor, y: torch.Tensor, batch_size: int, shuffle: bool = False,
        seed: int = 0,
    ) -> None:
        if len(x) != len(y):
            raise ValueError(f"inputs and targets differ in length: {len(x)} vs {len(y)}")
        if len(x) == 0:
            raise ValueError("empty data: got 0 rows")
        self.x, self.y = x, y
        self.batch_size = check_positive_int(batch_size, "batch_size")
        self.shuffle = bool(shuffle)
        self.gen = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return math.ceil(len(self.x) / self.batch_size)

    def reseeded(self, seed: int) -> TensorBatches:
        """The same tensors, batch size and shuffle flag with a generator of its own seeded by
        ``seed`` (what :func:`fit` shuffles, so a batch order never depends on who iterated
        this object before)."""
        return TensorBatches(self.x, self.y, self.batch_size, self.shuffle, seed)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        n = len(self.x)
        order = torch.randperm(n, generator=self.gen) if self.shuffle else torch.arange(n)
        for i in range(0, n, self.batch_size):
            j = order[i : i + self.batch_size]
            yield self.x[j], self.y[j]


def _is_pair(data: Any) -> bool:
    return (isinstance(data, tuple) and len(data) == 2
            and all(isinstance(t, torch.Tensor) for t in data))


def as_batches(
    data: Batches, *, batch_size: int = 256, shuffle: bool = False, seed: int = 0
) -> Any:
    """Turn ``(X, Y)`` tensors into :class:`TensorBatches`; pass other iterables through.

    Examples
    --------
    >>> import torch
    >>> b = as_batches((torch.zeros(10, 2), torch.zeros(10)), batch_size=4)
    >>> len(b), as_batches(b) is b
    (3, True)
    """
    if _is_pair(data):
        x, y = data
        assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
        return TensorBatches(x, y, check_positive_int(batch_size, "batch_size"), shuffle, seed)
    return data


def reseeded(batches: Any, seed: int) -> Any:
    """``batches.reseeded(seed)`` for :class:`TensorBatches`, other batches as they are.

    Every trainer that shuffles a shared ``task.train`` (:func:`fit`, SWAG, IVON) takes its own
    copy, so its batch order is set by its seed alone, not by which method ran before it.

    Examples
    --------
    >>> import torch
    >>> shared = TensorBatches(torch.arange(6.0), torch.arange(6.0), 2, shuffle=True)
    >>> _ = list(shared)  # someone iterated it: its generator moved on
    >>> a = [y.tolist() for _, y in reseeded(shared, 1)]
    >>> b = [y.tolist() for _, y in reseeded(shared, 1)]
    >>> a == b, reseeded([1, 2], 1)
    (True, [1, 2])
    """
    return batches.reseeded(seed) if isinstance(batches, TensorBatches) else batches


def count_rows(batches: Iterable[Any]) -> int:
    """Rows (examples) in ``batches``: ``N`` of :class:`TensorBatches`, else summed per batch
    (``len(targets)`` of a pair, ``len(batch.targets)`` of a batch object).

    Examples
    --------
    >>> import torch
    >>> count_rows([(None, torch.zeros(3)), (None, torch.zeros(2))])
    5
    """
    if isinstance(batches, TensorBatches):
        return len(batches.x)
    return sum(_rows(b) for b in batches)


def _rows(batch: Any) -> int:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return len(batch[1])
    targets = getattr(batch, "targets", None)
    if isinstance(targets, torch.Tensor):
        return int(targets.shape[0])
    raise TypeError(
        f"a batch must be an (inputs, targets) pair or have a .targets tensor, got "
        f"{type(batch).__name__}"
    )


@torch.no_grad()
def predict_batched(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, batch_size: int = 256
) -> torch.Tensor:
    """Apply ``fn`` to ``x`` in batches along axis 0 and concatenate (no gradients).

    Examples
    --------
    >>> import torch
    >>> predict_batched(lambda t: 2 * t, torch.arange(5.0), batch_size=2)
    tensor([0., 2., 4., 6., 8.])
    """
    batch_size = check_positive_int(batch_size, "batch_size")
    if x.shape[0] == 0:
        raise ValueError("x is empty (0 rows)")
    return torch.cat([fn(x[i : i + batch_size]) for i in range(0, x.shape[0], batch_size)])


def progress_bar(it: Sequence[int] | range, *, desc: str = "", enable: bool = True) -> Any:
    """``tqdm(it, desc=desc, leave=False)`` when ``enable`` and tqdm imports, else ``it``.

    Examples
    --------
    >>> progress_bar(range(3), enable=False)
    range(0, 3)
    """
    if not enable:
        return it
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the bench extra
        return it
    return tqdm(it, desc=desc, leave=False)


# -- losses and metrics -----------------------------------------------------------------------


def masked_mse(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``(pred - target)^2`` over ``mask``; raises on an empty mask.

    Examples
    --------
    >>> import torch
    >>> float(masked_mse(torch.tensor([1.0, 5.0]), torch.zeros(2), torch.tensor([True, False])))
    1.0
    """
    n = mask.sum()
    if int(n) == 0:
        raise ValueError("masked_mse: the mask selects no element")
    return ((pred - target) ** 2 * mask).sum() / n


def mse_loss(forward_fn: ForwardFn = default_forward) -> LossFn:
    """``loss(model, (inputs, targets)) = mean((forward_fn(model, inputs) - targets)^2)``.

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> float(mse_loss()(nn.Identity(), (torch.zeros(2), torch.tensor([1.0, 3.0]))))
    5.0
    """

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(forward_fn(model, inputs), targets)

    return loss


def masked_mse_loss(forward_fn: ForwardFn, nll_weight: float = 0.0) -> LossFn:
    r"""Masked MSE of the output's mean over ``batch.query_mask`` (+ a Gaussian NLL term).

    ``forward_fn(model, batch)`` returns a tensor or an object with ``mean`` (and ``sigma``)
    ``(B, Q)``. With ``nll_weight > 0`` and a ``sigma`` the loss adds ``nll_weight`` times the
    mean over masked points of :math:`\tfrac12 \log(2\pi s^2) + (y - \mu)^2 / (2 s^2)`,
    ``s^2 = sigma^2 + 1e-6``. A batch with no masked point returns ``None`` (skipped) before
    any forward pass.

    Examples
    --------
    >>> import torch
    >>> from types import SimpleNamespace
    >>> b = SimpleNamespace(x=torch.zeros(1, 2), targets=torch.tensor([[1.0, 9.0]]),
    ...                     query_mask=torch.tensor([[True, False]]))
    >>> loss = masked_mse_loss(lambda model, batch: batch.x)
    >>> float(loss(None, b))
    1.0
    >>> loss(None, SimpleNamespace(query_mask=torch.zeros(1, 2, dtype=torch.bool))) is None
    True
    """
    if not (math.isfinite(nll_weight) and nll_weight >= 0):
        raise ValueError(f"nll_weight must be a finite float >= 0, got {nll_weight=}")

    def loss(model: nn.Module, b: Any) -> torch.Tensor | None:
        if int(b.query_mask.sum()) == 0:
            return None
        out = forward_fn(model, b)
        mean = output_mean(out)
        val = masked_mse(mean, b.targets, b.query_mask)
        sigma = getattr(out, "sigma", None)
        if nll_weight > 0 and isinstance(sigma, torch.Tensor):
            s2 = sigma**2 + 1e-6
            nll = 0.5 * torch.log(2 * math.pi * s2) + (b.targets - mean) ** 2 / (2 * s2)
            val = val + nll_weight * (nll * b.query_mask).sum() / b.query_mask.sum()
        return val

    return loss


@torch.no_grad()
def evaluate_rmse(
    model: nn.Module, data: Batches, forward_fn: ForwardFn = default_forward
) -> float:
    """RMSE of ``forward_fn(model, inputs)`` against the targets over all batches (eval mode).

    ``sqrt(sum_batches sum (pred - y)^2 / N)``, squared errors summed per batch in the output
    dtype and accumulated as Python floats; ``(X, Y)`` tensors are cut into batches of 1024.

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> evaluate_rmse(nn.Identity(), (torch.zeros(4), torch.full((4,), 2.0)))
    2.0
    """
    was_training = model.training
    model.eval()
    se, n = 0.0, 0
    for inputs, targets in as_batches(data, batch_size=1024):
        pred = output_mean(forward_fn(model, inputs))
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


@torch.no_grad()
def evaluate_mse(
    model: nn.Module, data: Batches, forward_fn: ForwardFn = default_forward,
    batch_size: int = 512,
) -> float:
    """MSE of the concatenated predictions against the concatenated targets (eval mode).

    ``(X, Y)`` tensors are cut into batches of ``batch_size``. (PatchTST's validation loss.)

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> evaluate_mse(nn.Identity(), (torch.zeros(4), torch.full((4,), 2.0)))
    4.0
    """
    was_training = model.training
    model.eval()
    preds, ys = [], []
    for inputs, targets in as_batches(data, batch_size=batch_size):
        preds.append(output_mean(forward_fn(model, inputs)))
        ys.append(targets)
    model.train(was_training)
    if not preds:
        raise ValueError("empty data: no batches")
    p, y = torch.cat(preds), torch.cat(ys)
    if p.shape != y.shape:
        raise ValueError(
            f"prediction and targets differ in shape: {tuple(p.shape)} vs {tuple(y.shape)}"
        )
    return float(nn.functional.mse_loss(p, y))


@torch.no_grad()
def evaluate_masked_mse(
    model: nn.Module, batches: Iterable[Any], forward_fn: ForwardFn
) -> float:
    """Masked MSE of the output's mean over every ``query_mask`` point of ``batches`` (eval).

    ``sum (mean - y)^2 mask / sum mask``; ``forward_fn(model, batch)`` returns a tensor or an
    object with a ``mean`` ``(B, Q)``.

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> from types import SimpleNamespace
    >>> b = SimpleNamespace(targets=torch.tensor([[2.0, 5.0]]),
    ...                     query_mask=torch.tensor([[True, False]]))
    >>> evaluate_masked_mse(nn.Identity(), [b], lambda m, batch: torch.zeros(1, 2))
    4.0
    """
    was = model.training
    model.eval()
    se, n = 0.0, 0
    for b in batches:
        mean = output_mean(forward_fn(model, b))
        se += float((((mean - b.targets) ** 2) * b.query_mask).sum())
        n += int(b.query_mask.sum())
    model.train(was)
    if n == 0:
        raise ValueError("evaluate_masked_mse: no forecast points in the batches")
    return se / n


# -- optimiser and schedule -------------------------------------------------------------------


def make_optimizer(
    model: nn.Module,
    *,
    kind: Literal["adamw", "adam"] = "adamw",
    lr: float = 1e-4,
    weight_decay: float = 1e-5,
) -> torch.optim.Optimizer:
    """AdamW (default) or Adam over ``model.make_parameter_groups()`` when the model has it
    (rtdl's groups: no weight decay on embeddings, norms and biases), else its parameters.

    Examples
    --------
    >>> from torch import nn
    >>> type(make_optimizer(nn.Linear(2, 1), kind="adam", lr=1e-3)).__name__
    'Adam'
    """
    if not (isinstance(lr, (int, float)) and lr > 0 and math.isfinite(lr)):
        raise ValueError(f"lr must be a positive finite float, got {lr=}")
    if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0
            and math.isfinite(weight_decay)):
        raise ValueError(f"weight_decay must be a finite float >= 0, got {weight_decay=}")
    groups_fn = getattr(model, "make_parameter_groups", None)
    params: Any = groups_fn() if callable(groups_fn) else model.parameters()
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"optimizer kind must be 'adamw' or 'adam', got {kind=!r}")


Schedule = Literal["constant", "type3"] | Callable[[int], float]


def schedule_factor(schedule: Schedule, epoch: int) -> float:
    """The learning-rate factor of ``epoch`` (0-based) under ``schedule``.

    ``"constant"``: 1. ``"type3"``: PatchTST's ``adjust_learning_rate`` with ``lradj="type3"``
    (called there with ``epoch + 1`` after each epoch): 1 for epochs 0-3, then ``0.9`` per
    epoch, ``0.9 ** max(0, epoch - 3)``. A callable is called with the epoch.

    Examples
    --------
    >>> [round(schedule_factor("type3", e), 3) for e in range(6)]
    [1.0, 1.0, 1.0, 1.0, 0.9, 0.81]
    """
    if schedule == "constant":
        return 1.0
    if schedule == "type3":
        return 0.9 ** max(0, epoch - 3)
    if callable(schedule):
        f = float(schedule(epoch))
        if not (math.isfinite(f) and f > 0):
            raise ValueError(f"schedule({epoch}) must be a positive finite factor, got {f}")
        return f
    raise ValueError(f"schedule must be 'constant', 'type3' or a callable, got {schedule=!r}")


# -- report -----------------------------------------------------------------------------------


@dataclass
class TrainReport:
    """What :func:`fit` did.

    ``train_loss[e]``: mean training loss of epoch ``e`` (per row); ``val_metric[e]``: the
    validation ``metric`` after it;
    ``best_epoch``/``best_val``: the epoch whose weights were kept and its metric;
    ``stopped_by``: ``"max_epochs"``, ``"patience"`` or ``"max_seconds"``; ``steps``:
    optimiser steps; ``n_forward``: example-forwards spent (training rows, plus validation rows
    per epoch); ``seconds``: wall time (summed over resumed parts); ``resumed_from``: epochs
    read from a checkpoint (0 when none).

    Examples
    --------
    >>> r = TrainReport(metric="mse", val_metric=[2.0, 1.0], best_epoch=1, best_val=1.0)
    >>> r.val_metric, r.best_val, sorted(r.to_dict())[:3]
    ([2.0, 1.0], 1.0, ['best_epoch', 'best_val', 'epochs_run'])
    """

    metric: str = "rmse"
    train_loss: list[float] = field(default_factory=list)
    val_metric: list[float] = field(default_factory=list)
    best_epoch: int = -1
    best_val: float = math.inf
    epochs_run: int = 0
    seconds: float = 0.0
    steps: int = 0
    n_forward: int = 0
    stopped_by: str = "max_epochs"
    resumed_from: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainReport:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# -- the loop ---------------------------------------------------------------------------------


def _resolve_loss(loss: str | LossFn, forward_fn: ForwardFn) -> LossFn:
    if loss == "mse":
        return mse_loss(forward_fn)
    if loss == "masked_mse":
        return masked_mse_loss(forward_fn)
    if callable(loss):
        return loss
    raise ValueError(f"loss must be 'mse', 'masked_mse' or a callable, got {loss=!r}")


def _resolve_metric(metric: str | MetricFn, forward_fn: ForwardFn, val_batch_size: int
                    ) -> tuple[str, MetricFn]:
    if metric == "rmse":
        return "rmse", lambda m, b: evaluate_rmse(m, b, forward_fn)
    if metric == "mse":
        return "mse", lambda m, b: evaluate_mse(m, b, forward_fn, val_batch_size)
    if metric == "masked_mse":
        return "masked_mse", lambda m, b: evaluate_masked_mse(m, b, forward_fn)
    if callable(metric):
        return getattr(metric, "__name__", "metric"), metric
    raise ValueError(
        f"metric must be 'rmse', 'mse', 'masked_mse' or a callable, got {metric=!r}"
    )


def _epoch_source(data: Any, name: str, factory_arity: int) -> Callable[[int], Iterable[Any]]:
    if callable(data) and not isinstance(data, (tuple, list)) and not hasattr(data, "__iter__"):
        if factory_arity == 1:
            return data  # type: ignore[no-any-return]
        return lambda epoch: data()
    if not hasattr(data, "__iter__"):
        raise TypeError(f"{name} must be (X, Y) tensors, batches or a batch factory, got "
                        f"{type(data).__name__}")
    if isinstance(data, Iterator):
        raise TypeError(f"{name} is a one-shot iterator ({type(data).__name__}); pass a list, "
                        "a re-iterable (DataLoader) or a batch factory")
    return lambda epoch: data


def _rng_state(batches: Any) -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if isinstance(batches, TensorBatches):
        state["batches"] = batches.gen.get_state()
    return state


def _set_rng_state(state: dict[str, Any], batches: Any) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "batches" in state and isinstance(batches, TensorBatches):
        batches.gen.set_state(state["batches"])


def _opt_state(opt: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
    """The optimiser's state keyed by parameter *name*: rtdl's parameter groups are built from
    a set, so the position of a parameter in its group differs between two builds of a model."""
    sd = opt.state_dict()
    names = {id(p): n for n, p in model.named_parameters()}
    idx: dict[int, str] = {}
    for g_sd, g in zip(sd["param_groups"], opt.param_groups, strict=True):
        for i, p in zip(g_sd["params"], g["params"], strict=True):
            if id(p) not in names:
                return {"positional": sd}
            idx[i] = names[id(p)]
    return {"param_groups": sd["param_groups"],
            "state": {idx[i]: st for i, st in sd["state"].items()},
            "names": [[idx[i] for i in g["params"]] for g in sd["param_groups"]]}


def _load_opt_state(opt: torch.optim.Optimizer, model: nn.Module, saved: dict[str, Any]) -> None:
    if "positional" in saved:
        opt.load_state_dict(saved["positional"])
        return
    names = {id(p): n for n, p in model.named_parameters()}
    cur = opt.state_dict()
    groups, at = [], {}
    for g_sd, g, held in zip(cur["param_groups"], opt.param_groups, saved["names"], strict=True):
        now = [names[id(p)] for p in g["params"]]
        if sorted(now) != sorted(held):
            raise ValueError("checkpoint's optimiser groups hold other parameters")
        at.update({n: i for n, i in zip(now, g_sd["params"], strict=True)})
    for g_saved, g_sd in zip(saved["param_groups"], cur["param_groups"], strict=True):
        groups.append({**g_saved, "params": g_sd["params"]})
    opt.load_state_dict({"state": {at[n]: st for n, st in saved["state"].items()},
                         "param_groups": groups})


def _state_copy(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fit(
    model: nn.Module,
    train: Any,
    val: Any,
    *,
    loss: str | LossFn = "mse",
    metric: str | MetricFn = "rmse",
    forward_fn: ForwardFn = default_forward,
    optimizer: Literal["adamw", "adam"] | torch.optim.Optimizer = "adamw",
    lr: float = 1e-4,
    weight_decay: float = 1e-5,
    schedule: Schedule = "constant",
    clip_grad_norm: float | None = None,
    max_epochs: int = 100,
    patience: int = 16,
    max_steps_per_epoch: int | None = None,
    max_seconds: float | None = None,
    batch_size: int = 256,
    val_batch_size: int = 1024,
    seed: int = 0,
    seed_torch: bool = False,
    restore_best: bool = True,
    on_epoch_end: Callable[[nn.Module, int], None] | None = None,
    checkpoint: str | Path | None = None,
    progress: bool | Callable[[str], None] = True,
    desc: str = "train",
) -> TrainReport:
    """Train ``model`` with early stopping on a validation metric (see the module docstring).

    Parameters
    ----------
    model
        Any module; trained in place, left in eval mode with the best weights.
    train
        ``(X, Y)`` tensors (batched by ``batch_size``, reshuffled every epoch by a generator
        seeded with ``seed``), a re-iterable of batches (a :class:`TensorBatches` is shuffled
        by a copy seeded with ``seed``, :func:`reseeded`), or a factory
        ``epoch -> iterable of batches``.
    val
        ``(X, Y)`` tensors (batches of ``val_batch_size``), a re-iterable, or ``() -> iterable``.
    loss
        ``"mse"`` (pairs), ``"masked_mse"`` (batch objects, see :func:`masked_mse_loss`) or
        ``loss(model, batch) -> scalar | None``.
    metric
        ``"rmse"`` (:func:`evaluate_rmse`), ``"mse"`` (:func:`evaluate_mse`), ``"masked_mse"``
        (:func:`evaluate_masked_mse`) or ``metric(model, val_batches) -> float``; lower is
        better.
    forward_fn
        ``forward_fn(model, inputs)`` for the named losses and metrics.
    optimizer
        ``"adamw"``/``"adam"`` (:func:`make_optimizer` with ``lr`` and ``weight_decay``) or a
        built optimiser.
    schedule
        ``"constant"``, ``"type3"`` or ``epoch -> factor`` (:func:`schedule_factor`).
    clip_grad_norm
        Clip the gradient norm of ``model.parameters()`` to this value before each step.
    max_epochs, patience, max_steps_per_epoch, max_seconds
        Stopping rules; ``max_steps_per_epoch`` keeps the first steps of each epoch's batches.
    seed, seed_torch
        ``seed`` seeds the batch order of ``(X, Y)`` training tensors; ``seed_torch=True`` also
        calls ``torch.manual_seed(seed)`` before the first epoch (dropout draws). ETT's PatchTST
        and ERA5's ViT recipes set it, so their committed backbones (docs/results/ett.md,
        era5.md) retrain identically from the seed alone.
    on_epoch_end
        ``on_epoch_end(model, epoch)`` after each epoch's validation.
    checkpoint
        File written after every epoch; when it exists, training resumes from it.
    progress
        ``True``: a tqdm bar over epochs; a callable receives one line per epoch.

    Returns
    -------
    TrainReport

    Raises
    ------
    RuntimeError
        On a non-finite training loss (naming the epoch).
    ValueError
        On a bad setting (named), non-finite ``(X, Y)`` tensors (named), or a checkpoint
        written under other settings.

    Examples
    --------
    PatchTST-style: validation MSE, the ``"type3"`` schedule, a checkpoint to resume from.

    >>> import tempfile, torch
    >>> from pathlib import Path
    >>> from torch import nn
    >>> _ = torch.manual_seed(0)
    >>> net = nn.Sequential(nn.Linear(4, 2), nn.Dropout(0.1))
    >>> x = torch.randn(40, 4)
    >>> y = x[:, :2] * 2
    >>> with tempfile.TemporaryDirectory() as d:
    ...     rep = fit(net, (x, y), (x, y), metric="mse", lr=1e-2, schedule="type3",
    ...               max_epochs=3, batch_size=8, progress=False, checkpoint=Path(d) / "ck.pt")
    ...     again = fit(net, (x, y), (x, y), metric="mse", lr=1e-2, schedule="type3",
    ...                 max_epochs=3, batch_size=8, progress=False, checkpoint=Path(d) / "ck.pt")
    >>> rep.steps, again.resumed_from, again.val_metric == rep.val_metric
    (15, 3, True)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    max_epochs = check_positive_int(max_epochs, "max_epochs")
    patience = check_positive_int(patience, "patience")
    batch_size = check_positive_int(batch_size, "batch_size")
    val_batch_size = check_positive_int(val_batch_size, "val_batch_size")
    if max_steps_per_epoch is not None:
        max_steps_per_epoch = check_positive_int(max_steps_per_epoch, "max_steps_per_epoch")
    if clip_grad_norm is not None and not (math.isfinite(clip_grad_norm) and clip_grad_norm > 0):
        raise ValueError(f"clip_grad_norm must be a positive finite float, got {clip_grad_norm=}")
    if max_seconds is not None and not max_seconds >= 0:
        raise ValueError(f"max_seconds must be >= 0, got {max_seconds=}")
    schedule_factor(schedule, 0)  # validates the schedule
    for part, data in (("train", train), ("val", val)):
        if _is_pair(data):
            check_finite(data[0], f"{part} inputs")
            check_finite(data[1], f"{part} targets")
    lossf = _resolve_loss(loss, forward_fn)
    metric_name, metricf = _resolve_metric(metric, forward_fn, val_batch_size)
    if isinstance(optimizer, torch.optim.Optimizer):
        opt = optimizer
    else:
        opt = make_optimizer(model, kind=optimizer, lr=lr, weight_decay=weight_decay)
    for g in opt.param_groups:
        g.setdefault("initial_lr", g["lr"])
    # a TensorBatches passed in (e.g. a Task's shared training batches) is shuffled by a copy
    # with its own generator seeded by ``seed``: the order depends on ``seed`` alone
    train_b = reseeded(as_batches(train, batch_size=batch_size, shuffle=True, seed=seed), seed)
    val_b = as_batches(val, batch_size=val_batch_size)
    train_src = _epoch_source(train_b, "train", 1)
    val_src = _epoch_source(val_b, "val", 0)

    settings = {"loss": loss if isinstance(loss, str) else "callable", "metric": metric_name,
                "lr": lr, "weight_decay": weight_decay, "patience": patience,
                "batch_size": batch_size, "seed": seed, "seed_torch": seed_torch,
                "max_steps_per_epoch": max_steps_per_epoch, "clip_grad_norm": clip_grad_norm,
                "schedule": schedule if isinstance(schedule, str) else "callable"}
    rep = TrainReport(metric=metric_name)
    best_state = _state_copy(model)
    bad, start, seconds0 = 0, 0, 0.0
    ckpt = None if checkpoint is None else Path(checkpoint)
    saved = None
    if ckpt is not None:
        saved = torch_load_or_none(ckpt, "training checkpoint", map_location="cpu",
                                   weights_only=True)
    if saved is not None:
        held = saved.get("settings", {})
        diff = sorted(k for k in set(held) | set(settings) if held.get(k) != settings.get(k))
        if diff:
            raise ValueError(f"checkpoint {str(ckpt)!r} was written under other settings "
                             f"(differ in {', '.join(diff)}); remove it to train anew")
        model.load_state_dict(saved["model"])
        _load_opt_state(opt, model, saved["optimizer"])
        best_state = saved["best"]
        rep = TrainReport.from_dict(saved["report"])
        bad = int(saved["bad"])
        start = rep.epochs_run
        rep.resumed_from = start
        seconds0 = rep.seconds
        _set_rng_state(saved["rng"], train_b)
        finished = rep.stopped_by in ("patience", "max_seconds") and bool(saved.get("done"))
        if finished or start >= max_epochs:
            start = max_epochs  # nothing left to run
    elif seed_torch:
        torch.manual_seed(seed)

    t0 = time.perf_counter()
    n_val_rows: int | None = None
    rep.stopped_by = "max_epochs"
    epochs = range(start, max_epochs)
    bar: Any = progress_bar(epochs, desc=desc, enable=progress is True)
    for epoch in bar:
        if schedule != "constant":
            f = schedule_factor(schedule, epoch)
            for g in opt.param_groups:
                g["lr"] = g["initial_lr"] * f
        model.train()
        tot, cnt, steps = 0.0, 0, 0
        for batch in train_src(epoch):
            if max_steps_per_epoch is not None and steps >= max_steps_per_epoch:
                break
            opt.zero_grad(set_to_none=True)
            value = lossf(model, batch)
            if value is None:
                continue
            if not torch.isfinite(value):
                raise RuntimeError(
                    f"non-finite training loss at epoch {epoch}: {float(value.detach())}"
                )
            value.backward()
            if clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
            opt.step()
            rows = _rows(batch)
            tot += float(value.detach()) * rows
            cnt += rows
            steps += 1
            rep.n_forward += rows
        rep.steps += steps
        v = float(metricf(model, val_src(epoch)))
        if n_val_rows is None:  # counted once, on a fresh iterable (a factory may be lazy)
            n_val_rows = count_rows(val_src(epoch))
        rep.n_forward += n_val_rows
        rep.train_loss.append(tot / max(cnt, 1))
        rep.val_metric.append(v)
        rep.epochs_run = epoch + 1
        if on_epoch_end is not None:
            on_epoch_end(model, epoch)
        if v < rep.best_val:
            rep.best_val, rep.best_epoch, bad = v, epoch, 0
            if restore_best:
                best_state = _state_copy(model)
        else:
            bad += 1
        line = f"epoch {epoch}: train {rep.train_loss[-1]:.5f} val {metric_name} {v:.5f}"
        if callable(progress):
            progress(line)
        elif hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{rep.train_loss[-1]:.4f}", val=f"{v:.4f}",
                            best=f"{rep.best_val:.4f}")
        done = False
        if bad >= patience:
            rep.stopped_by, done = "patience", True
        elif (max_seconds is not None and seconds0 + time.perf_counter() - t0 > max_seconds
              and epoch + 1 < max_epochs):
            rep.stopped_by, done = "max_seconds", True
        rep.seconds = seconds0 + time.perf_counter() - t0
        if ckpt is not None:
            atomic_torch_save({
                "settings": settings, "model": model.state_dict(),
                "optimizer": _opt_state(opt, model), "best": best_state, "report": rep.to_dict(),
                "bad": bad, "rng": _rng_state(train_b), "done": done,
            }, ckpt)
        if done:
            break
    if saved is not None and start >= max_epochs:
        rep.stopped_by = str(saved["report"].get("stopped_by", rep.stopped_by))
    if restore_best:
        model.load_state_dict(best_state)
    model.eval()
    rep.seconds = seconds0 + time.perf_counter() - t0
    return rep
