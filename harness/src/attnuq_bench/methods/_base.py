"""One interface for every uncertainty method: a :class:`Task`, a :class:`Method`, a registry.

A :class:`Task` describes the problem generically, so the same method code serves an
FT-Transformer on UCI (inputs ``(B, F)``, outputs ``(B,)``), a Hugging Face PatchTST (dict inputs,
outputs ``(B, horizon, channels)``) and a ViT on ERA5 (outputs ``(B, lat, lon)``):

* ``model``: the trained, frozen backbone every post-hoc method uses,
* ``train``, ``val``, ``cal``: re-iterable ``(inputs, targets)`` batches (or ``(X, Y)`` tensors),
  or batch objects with a ``targets`` tensor (PhysioNet's ``ForecastBatch``: the batch itself is
  the input),
* ``forward_fn(model, inputs) -> prediction`` shaped like the targets (a tensor, or an output
  with a ``mean`` tensor such as the Levy forecaster's ``ForecastOutput``: methods read its
  mean, :func:`attnuq_bench.training.output_mean`),
* ``make_model(seed)`` and ``train_fn(model, train, val, seed)`` for methods that retrain
  (deep ensemble, MultiSWAG, IVON, HSA).

A :class:`Method` is fitted once (``fit(task)``) and then maps inputs to a predictive
distribution (``predict(inputs)`` -> :class:`~attnuq.predictive.Predictive` with samples
``(S, B, ...)`` or :class:`~attnuq.predictive.GaussianPredictive`). Each method books its extra
cost in :class:`Cost`: seconds and example-forward passes spent fitting (beyond the frozen
backbone), seconds predicting and forward passes per predicted input.

Convention for the held-out parts: methods fit their own parameters (``nu``, sigma, prior
precision, early stopping) on ``val``; split-conformal steps use ``cal``.

Examples
--------
>>> from attnuq_bench.methods import make_method, available_methods
>>> "gaussian" in available_methods()
True
>>> make_method("gaussian").name
'gaussian'
"""

from __future__ import annotations

import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnuq._io import (
    CorruptFileWarning,
    atomic_torch_save,
    atomic_write_json,
    describe_error,
    read_json_or_none,
    torch_load_or_none,
)
from attnuq.predictive import GaussianPredictive, Predictive
from attnuq_bench.training import Batches, as_batches, count_rows, default_forward, output_mean

__all__ = [
    "TASK_KINDS",
    "Cost",
    "Method",
    "PredictiveLike",
    "Task",
    "available_methods",
    "collect",
    "make_method",
    "method_implementation",
    "register_method",
    "split_batch",
]

PredictiveLike = Predictive | GaussianPredictive

#: the kinds of :class:`Task` (see its ``kind``)
TASK_KINDS = ("regression", "classification")


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """The draws inside come from ``torch.manual_seed(seed)``; the CPU generator's state is
    restored on exit (exceptions included), so a method's draws are reproducible and leave
    the caller's random stream as it was."""
    state = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_rng_state(state)


@dataclass
class Cost:
    """Extra cost of a method beyond training the frozen backbone once.

    ``fit_forward`` counts example-forwards during fitting (a training step on ``b`` rows counts
    ``b``); ``predict_forward_per_input`` is the number of forward passes of the network per
    predicted input (``S`` for a Monte Carlo method, 1 for a deterministic one).

    Examples
    --------
    >>> c = Cost(fit_seconds=2.5, fit_forward=640, predict_forward_per_input=50)
    >>> c.fit_forward, c.predict_seconds
    (640, 0.0)
    >>> sorted(c.to_dict())
    ['fit_forward', 'fit_seconds', 'predict_forward_per_input', 'predict_seconds']
    """

    fit_seconds: float = 0.0
    fit_forward: int = 0
    predict_seconds: float = 0.0
    predict_forward_per_input: int = 0

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)

    def add_fit(self, other: Cost) -> None:
        """Book ``other``'s fitting (seconds and example-forwards) into this cost."""
        self.fit_seconds += other.fit_seconds
        self.fit_forward += other.fit_forward


def member_paths(member_dir: str | Path, index: int) -> tuple[Path, Path]:
    """``member<index>.pt`` (state dict) and ``member<index>.json`` (its :class:`Cost`)."""
    p = Path(member_dir) / f"member{index}.pt"
    return p, p.with_suffix(".json")


def save_member(member_dir: str | Path, index: int, state: dict[str, torch.Tensor],
                cost: Cost) -> None:
    """Write member ``index`` to the member cache, atomically: weights first, then its cost.

    A crash in between leaves weights without a cost file, which :func:`load_member` treats as
    not cached.
    """
    pt, js = member_paths(member_dir, index)
    atomic_torch_save({k: v.detach().cpu() for k, v in state.items()}, pt)
    atomic_write_json(js, cost.to_dict())


def load_member(member_dir: str | Path, index: int
                ) -> tuple[dict[str, torch.Tensor], Cost] | None:
    """Member ``index`` from the member cache: ``(state_dict, cost)``, or ``None`` to retrain.

    ``None`` when either file is missing, and (with a :class:`~attnuq._io.CorruptFileWarning`)
    when either is torn or unreadable.
    """
    pt, js = member_paths(member_dir, index)
    fields = set(Cost.__dataclass_fields__)
    rec = read_json_or_none(js, "member cost", validate=lambda r: isinstance(r, dict)
                            and set(r) <= fields and "fit_seconds" in r)
    if rec is None:
        return None
    state = torch_load_or_none(pt, "member", map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        if state is not None:
            warnings.warn(f"corrupt member {pt} (not a state dict); redoing it",
                          CorruptFileWarning, stacklevel=2)
        return None
    return state, Cost(**rec)


@dataclass
class Task:
    """A trained model with its data, described generically (see module docstring).

    Parameters
    ----------
    model
        The trained backbone; post-hoc methods never change its weights.
    train, val, cal
        Batches of ``(inputs, targets)`` (or batch objects with ``targets``); ``(X, Y)`` tensor
        pairs are batched with ``batch_size``. The training batches are shared by every method;
        those that shuffle them (:func:`attnuq_bench.training.fit`, SWAG, IVON) shuffle a copy
        seeded by their own seed (:func:`attnuq_bench.training.reseeded`), so no method's result
        depends on which methods ran before it on the same Task.
    forward_fn
        ``forward_fn(model, inputs) -> Tensor`` shaped like the targets.
    make_model
        ``make_model(seed) -> nn.Module``: a fresh, untrained backbone (for retraining methods).
    train_fn
        ``train_fn(model, train, val, seed) -> None``: trains ``model`` in place with the backbone's
        recipe (early stopping on ``val``).
    n_train
        Number of training examples (IVON's effective sample size); counted when ``None``.
    member_dir
        Optional folder where retrained members are cached as ``member<seed>.pt`` (+ cost JSON),
        so interrupted benchmarks resume without retraining.
    kind
        ``"regression"`` (``forward_fn`` gives predictions shaped like the targets) or
        ``"classification"`` (``forward_fn`` gives logits ``(B, K)``, targets are class ids
        ``(B,)``; see :mod:`attnuq.methods.classification`). A method states the kinds it
        serves (:attr:`Method.task_kinds`) and refuses the others.

    Examples
    --------
    A 2-feature regressor with outputs ``(B,)``; ``(X, Y)`` tensors are cut into batches:

    >>> import torch
    >>> from torch import nn
    >>> _ = torch.manual_seed(0)
    >>> net = nn.Sequential(nn.Linear(2, 1), nn.Flatten(0)).eval()  # (B, 2) -> (B,)
    >>> x, y = torch.randn(40, 2), torch.randn(40)
    >>> task = Task(model=net, train=(x, y), val=(x, y), cal=(x, y), batch_size=16)
    >>> task.n_train, [len(t) for _, t in task.val]
    (40, [16, 16, 8])
    >>> task.forward(net, x[:4]).shape
    torch.Size([4])
    >>> task.member(0)[0] is net  # seed 0 is the frozen model itself
    True
    """

    model: nn.Module
    train: Batches
    val: Batches
    cal: Batches
    forward_fn: Callable[[nn.Module, Any], torch.Tensor] = default_forward
    make_model: Callable[[int], nn.Module] | None = None
    train_fn: Callable[[nn.Module, Batches, Batches, int], Any] | None = None
    n_train: int | None = None
    batch_size: int = 256
    member_dir: Path | None = None
    kind: str = "regression"
    _members: dict[int, tuple[nn.Module, Cost]] = field(default_factory=dict, repr=False)
    #: seconds spent training members inside :meth:`member` (so a method's fit does not book
    #: the same training twice: once as elapsed time, once as the member's recorded cost)
    _member_train_seconds: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(self.model).__name__}")
        if self.kind not in TASK_KINDS:
            raise ValueError(f"kind must be one of {TASK_KINDS}, got kind={self.kind!r}")
        self.train = as_batches(self.train, batch_size=self.batch_size, shuffle=True)
        self.val = as_batches(self.val, batch_size=self.batch_size)
        self.cal = as_batches(self.cal, batch_size=self.batch_size)
        if self.n_train is None:
            self.n_train = count_rows(self.train)
        if self.n_train < 1:
            raise ValueError(f"training data is empty, got n_train={self.n_train}")

    def forward(self, model: nn.Module, inputs: Any) -> torch.Tensor:
        """The point prediction ``forward_fn(model, inputs)`` (its ``mean`` when the model
        returns an output object, :func:`attnuq_bench.training.output_mean`)."""
        return output_mean(self.forward_fn(model, inputs))

    def require_retraining(
        self, method: str
    ) -> tuple[Callable[[int], nn.Module], Callable[..., Any]]:
        """Return ``(make_model, train_fn)`` or raise naming the method that needs them."""
        if self.make_model is None or self.train_fn is None:
            raise ValueError(
                f"method {method!r} retrains the backbone: the Task needs make_model and "
                f"train_fn, got make_model={self.make_model!r}, train_fn={self.train_fn!r}"
            )
        return self.make_model, self.train_fn

    def members(self, n: int, method: str) -> tuple[list[nn.Module], Cost]:
        """The backbones of seeds ``0 .. n - 1`` (:meth:`member`; ``n > 1`` needs
        ``make_model`` and ``train_fn``, refused naming ``method``) and what training them
        took, to book."""
        if n > 1:
            self.require_retraining(method)
        models, cost = [], Cost()
        for seed in range(n):
            model, c = self.member(seed)
            models.append(model)
            cost.add_fit(c)
        return models, cost

    def member(self, seed: int) -> tuple[nn.Module, Cost]:
        """Backbone trained with ``seed``: seed 0 is the frozen ``model`` (no extra cost).

        Other seeds are trained with ``make_model(seed)`` / ``train_fn`` once, then cached (in
        memory and in ``member_dir``). The returned cost is what training the member took, also
        when it comes from the cache, so every method that uses it books it honestly.
        """
        if seed == 0:
            return self.model, Cost()
        if seed in self._members:
            return self._members[seed]
        make_model, train_fn = self.require_retraining("member")
        model = make_model(seed)
        cached = None if self.member_dir is None else load_member(self.member_dir, seed)
        if cached is not None:
            try:
                model.load_state_dict(cached[0])
            except (RuntimeError, KeyError) as exc:  # keys or shapes unlike make_model's
                warnings.warn(
                    f"corrupt member {member_paths(self.member_dir or '', seed)[0]} "
                    f"({describe_error(exc)}); redoing it",
                    CorruptFileWarning, stacklevel=2,
                )
                model, cached = make_model(seed), None
        if cached is not None:
            cost = cached[1]
        else:
            t0 = time.perf_counter()
            out = train_fn(model, self.train, self.val, seed)
            n_fwd = int(getattr(out, "n_forward", 0))
            cost = Cost(fit_seconds=time.perf_counter() - t0, fit_forward=n_fwd)
            self._member_train_seconds += cost.fit_seconds
            if self.member_dir is not None:
                save_member(self.member_dir, seed, model.state_dict(), cost)
        model.eval()
        self._members[seed] = (model, cost)
        return model, cost


def collect(
    model: nn.Module,
    batches: Batches,
    forward_fn: Callable[[nn.Module, Any], torch.Tensor] = default_forward,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic predictions and targets over all batches, concatenated on dim 0.

    The model runs in ``eval()`` mode without gradients (its previous mode is restored);
    returns ``(predictions, targets)``, both ``(N, ...)`` with ``N`` the total number of rows.
    A batch is an ``(inputs, targets)`` pair or an object with ``targets`` (passed whole to
    ``forward_fn``; padded positions are not masked out); an output object gives its ``mean``.

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(2, 1), nn.Flatten(0))
    >>> x, y = torch.randn(10, 2), torch.randn(10)
    >>> pred, targets = collect(net, [(x[:6], y[:6]), (x[6:], y[6:])])
    >>> pred.shape, bool(torch.equal(targets, y)), net.training
    (torch.Size([10]), True, True)
    """
    preds, ys = [], []
    was = model.training
    model.eval()
    with torch.no_grad():
        for batch in as_batches(batches):
            inputs, targets = split_batch(batch)
            preds.append(output_mean(forward_fn(model, inputs)))
            ys.append(targets)
    model.train(was)
    if not preds:
        raise ValueError("empty data: no batches")
    p, y = torch.cat(preds), torch.cat(ys)
    if p.shape != y.shape:
        raise ValueError(
            f"predictions {tuple(p.shape)} and targets {tuple(y.shape)} differ in shape"
        )
    return p, y


def split_batch(batch: Any) -> tuple[Any, torch.Tensor]:
    """``(inputs, targets)`` of a batch: a pair as it is, an object with ``targets`` as
    ``(batch, batch.targets)``.

    Examples
    --------
    >>> import torch
    >>> from types import SimpleNamespace
    >>> b = SimpleNamespace(targets=torch.zeros(2))
    >>> split_batch(b)[0] is b, split_batch((1, torch.ones(3)))[1].shape
    (True, torch.Size([3]))
    """
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    targets = getattr(batch, "targets", None)
    if isinstance(targets, torch.Tensor):
        return batch, targets
    raise TypeError(f"a batch must be an (inputs, targets) pair or have a .targets tensor, "
                    f"got {type(batch).__name__}")


class Method(ABC):
    """Base class: ``fit(task)`` then ``predict(inputs)``; keeps :attr:`cost` up to date.

    A subclass implements ``_fit(task)`` (fit its own parameters; may return the :class:`Cost`
    of cached members) and ``_predict(task, inputs)`` (return the predictive distribution and
    the forward passes per input); :meth:`fit` and :meth:`predict` time them into :attr:`cost`.

    Examples
    --------
    The smallest possible method, ``N(f(x), 1)``:

    >>> import torch
    >>> from torch import nn
    >>> from attnuq.predictive import GaussianPredictive
    >>> class UnitNoise(Method):
    ...     def _fit(self, task):
    ...         return None
    ...     def _predict(self, task, inputs):
    ...         with torch.no_grad():
    ...             mean = task.forward(task.model, inputs)  # (B,)
    ...         return GaussianPredictive(mean=mean, std=torch.ones_like(mean)), 1
    >>> net = nn.Sequential(nn.Linear(2, 1), nn.Flatten(0)).eval()
    >>> x, y = torch.randn(8, 2), torch.randn(8)
    >>> method = UnitNoise().fit(Task(model=net, train=(x, y), val=(x, y), cal=(x, y)))
    >>> method.predict(x).std.shape, method.cost.predict_forward_per_input
    (torch.Size([8]), 1)
    """

    #: registry name, set by :func:`register_method`
    name: str = "method"
    #: which code computes the method and how it was checked against a maintained library
    #: (results pages print it per row, see :func:`method_implementation`)
    implementation: str = "attnuq"
    #: registry name of a method whose predictions :meth:`derive` maps to this method's (one
    #: set of draws scores both rows, e.g. ``sa-conformal`` built with ``base=`` a fitted
    #: ``sa-paper``); ``None``: :meth:`predict` only
    derived_from: str | None = None
    #: the :attr:`Task.kind` s this method serves (:meth:`fit` refuses the others)
    task_kinds: tuple[str, ...] = ("regression",)

    def __init__(self) -> None:
        self.cost = Cost()
        self._task: Task | None = None

    @property
    def task(self) -> Task:
        if self._task is None:
            raise RuntimeError(f"method {self.name!r} is not fitted: call fit(task) first")
        return self._task

    def fit(self, task: Task) -> Method:
        """Fit the method on ``task`` and return ``self``; the time goes to ``cost.fit_seconds``."""
        if not isinstance(task, Task):
            raise TypeError(f"task must be an attnuq_bench.methods.Task, got {type(task).__name__}")
        if task.kind not in self.task_kinds:
            raise ValueError(f"method {self.name!r} serves {list(self.task_kinds)} tasks, got "
                             f"a task of kind={task.kind!r}")
        self._task = task
        t0, trained0 = time.perf_counter(), task._member_train_seconds
        extra = self._fit(task)
        # members trained during this fit are booked once, through ``extra`` below
        in_fit = task._member_train_seconds - trained0
        self.cost.fit_seconds += time.perf_counter() - t0 - in_fit
        if extra is not None:  # members' training cost (trained now or read from the cache)
            self.cost.add_fit(extra)
        return self

    def predict(self, inputs: Any) -> PredictiveLike:
        """Predictive distribution for ``inputs`` (a batch the task's ``forward_fn`` accepts)."""
        task = self.task
        t0 = time.perf_counter()
        pred, passes = self._predict(task, inputs)
        self.cost.predict_seconds += time.perf_counter() - t0
        self.cost.predict_forward_per_input = int(passes)
        return pred

    def derive(self, pred: Any) -> PredictiveLike:
        """This method's prediction from the prediction of :attr:`derived_from` on the same
        inputs (only methods that set :attr:`derived_from` implement it)."""
        raise NotImplementedError(f"method {self.name!r} derives from no other method")

    @abstractmethod
    def _fit(self, task: Task) -> Cost | None:
        """Fit; may return the cost of cached members to add to :attr:`cost`."""

    @abstractmethod
    def _predict(self, task: Task, inputs: Any) -> tuple[PredictiveLike, int]:
        """Return the predictive distribution and the forward passes per input."""

    def config(self) -> dict[str, Any]:
        """JSON-serialisable settings of the method (for result files)."""
        return {k: v for k, v in vars(self).items()
                if not k.startswith("_") and isinstance(v, (int, float, str, bool, type(None)))}

    def info(self) -> dict[str, Any]:
        """Fitted quantities worth recording (``nu``, sigma, prior precision, ...)."""
        return {}


_METHODS: dict[str, tuple[type[Method], dict[str, Any]]] = {}


def register_method(name: str, cls: type[Method], **defaults: Any) -> None:
    """Register ``cls`` under ``name`` with default constructor keywords.

    Registering a name again replaces its entry. :mod:`attnuq_bench.methods` registers every
    built-in method on import; :func:`make_method` looks the name up.

    Examples
    --------
    The call :mod:`attnuq_bench.methods` makes for ``"sa-crps"`` (registering it again is harmless):

    >>> from attnuq_bench.methods import StochasticAttention
    >>> register_method("sa-crps", StochasticAttention, criterion="crps")
    >>> make_method("sa-crps").criterion
    'crps'
    """
    _METHODS[name] = (cls, defaults)


def available_methods() -> list[str]:
    """Names accepted by :func:`make_method`, in registration order.

    Examples
    --------
    >>> names = available_methods()
    >>> names[:3], {"gaussian", "conformal", "laplace", "swag"} <= set(names)
    (['sa', 'sa-paper', 'sa-debiased'], True)
    """
    _load_all()
    return list(_METHODS)


def make_method(name: str, **kwargs: Any) -> Method:
    """Build the method registered as ``name``; ``kwargs`` override its defaults.

    Examples
    --------
    >>> m = make_method("mc-dropout", n_samples=20)
    >>> m.name, m.n_samples
    ('mc-dropout', 20)
    >>> make_method("gp")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: unknown method name='gp'; known: [...]
    """
    cls, defaults = _registered(name)
    m = cls(**{**defaults, **kwargs})
    m.name = name
    return m


def _registered(name: str) -> tuple[type[Method], dict[str, Any]]:
    """The class and default settings registered as ``name``; unknown names raise."""
    _load_all()
    if name not in _METHODS:
        raise ValueError(f"unknown method {name=!r}; known: {sorted(_METHODS)}")
    return _METHODS[name]


def method_implementation(name: str) -> str:
    """Which implementation the method registered as ``name`` runs (its class attribute).

    Examples
    --------
    >>> method_implementation("laplace")  # doctest: +ELLIPSIS
    'attnuq closed form (last layer, full GGN); agrees with laplace-torch 0.3 ...'
    >>> method_implementation("gp")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: unknown method name='gp'; known: [...]
    """
    return _registered(name)[0].implementation


def _load_all() -> None:
    import attnuq_bench.methods  # noqa: F401  (registers every method on import)
