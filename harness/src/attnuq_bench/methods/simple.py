"""Cheap baselines on the frozen model: homoscedastic Gaussian, split conformal, MC dropout.

* ``gaussian``: ``N(f(x), sigma^2)`` with ``sigma^2 = mean_val (y - f(x))^2`` over every output
  element of the validation part.
* ``conformal``: split conformal on absolute residuals, per output coordinate. For each
  coordinate ``e`` of the output ``(B, *E)`` (one for UCI's ``(B,)``, each (horizon step,
  channel) for ETT, each grid point for ERA5) the interval is ``f(x)_e +- q_e`` with ``q_e`` the
  ``ceil((n+1)(1-alpha))``-th smallest ``|y_e - f(x)_e|`` over the ``n`` calibration rows
  (coverage ``>= 1 - alpha`` per coordinate for exchangeable rows). As a distribution (for PIT,
  CRPS, NLL) it returns ``K`` (``n_quantiles``) equally weighted samples ``f(x) + s_k``: the
  validation residuals' quantiles at levels ``(k - 1/2)/K`` per coordinate, shifted and stretched
  so that their central ``1 - alpha`` interval is exactly ``[-q_e, q_e]``
  (:class:`ResidualQuantiles`). Until 0.3 ETT's suite did this itself and UCI's ``conformal``
  used all signed validation residuals as samples, spread about their mean; one method serves
  both now (the committed pages were regenerated from stored results, not re-run).
* ``mc-dropout``: the frozen model with its dropout modules switched to training mode at test
  time only (Gal & Ghahramani 2016); ``S`` passes give samples ``(S, B, ...)``.

Examples
--------
>>> import torch
>>> from torch import nn
>>> from attnuq_bench.methods import Task, make_method
>>> net = nn.Sequential(nn.Linear(2, 8), nn.Dropout(0.2), nn.Linear(8, 1), nn.Flatten(0))
>>> x, y = torch.randn(40, 2), torch.randn(40)
>>> task = Task(model=net.eval(), train=(x, y), val=(x, y), cal=(x, y))
>>> make_method("gaussian").fit(task).predict(x[:5]).std.shape
torch.Size([5])
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attnuq._validation import check_finite, check_positive_int
from attnuq.conformal import conformal_quantile
from attnuq.predictive import GaussianPredictive, Predictive
from attnuq_bench.methods._base import Cost, Method, PredictiveLike, Task, collect, seeded

__all__ = [
    "HomoscedasticGaussian",
    "MCDropout",
    "ResidualQuantiles",
    "SplitConformal",
    "dropout_active",
]


class HomoscedasticGaussian(Method):
    """``N(f(x), sigma^2)``, one ``sigma`` from validation residuals (RMS).

    ``sigma^2 = mean_val (y - f(x))^2`` over every output element; :meth:`predict` returns a
    :class:`~attnuq.predictive.GaussianPredictive` with ``mean = f(x)`` and ``std = sigma``,
    both shaped like the model output ``(B, ...)`` (one forward pass per input).

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> from attnuq_bench.methods import Task
    >>> _ = torch.manual_seed(0)
    >>> net = nn.Sequential(nn.Linear(2, 1), nn.Flatten(0)).eval()
    >>> x = torch.randn(64, 2)
    >>> with torch.no_grad():
    ...     y = net(x) + 0.5 * torch.randn(64)  # noise sd 0.5
    >>> g = HomoscedasticGaussian().fit(Task(model=net, train=(x, y), val=(x, y), cal=(x, y)))
    >>> round(g.sigma, 2), g.predict(x[:3]).std.shape
    (0.44, torch.Size([3]))
    """

    implementation = "attnuq (one sigma: the validation RMS residual)"

    def __init__(self) -> None:
        super().__init__()
        self.sigma: float | None = None

    def _fit(self, task: Task) -> Cost | None:
        pred, y = collect(task.model, task.val, task.forward_fn)
        self.sigma = float(((pred - y) ** 2).mean().sqrt())
        self.cost.fit_forward += y.shape[0]
        if not self.sigma > 0:
            raise ValueError(f"validation residuals are all zero: sigma={self.sigma}")
        return None

    def _predict(self, task: Task, inputs: Any) -> tuple[PredictiveLike, int]:
        assert self.sigma is not None
        with torch.no_grad():
            mean = task.forward(task.model.eval(), inputs)
        return GaussianPredictive(mean=mean, std=torch.full_like(mean, self.sigma)), 1

    def info(self) -> dict[str, Any]:
        return {"sigma": self.sigma}


@dataclass
class ResidualQuantiles:
    """Point forecast plus per-coordinate residual quantiles, as a sample-based distribution.

    Fitted on held-out residuals ``r = y - f(x)`` of shape ``(N, *E)`` (``E`` the per-example
    output shape, e.g. ``(horizon, channels)``; ``()`` for scalar outputs): ``K`` evenly spaced
    quantiles of ``r`` per output coordinate, at levels ``(k - 1/2) / K``, become ``K`` equally
    weighted "samples" ``f(x) + q_k``.

    With ``conformal_from`` residuals (a second held-out part), the quantiles are shifted and
    stretched so that the central ``level`` interval becomes exactly ``f(x) +- q_conf``, with
    ``q_conf`` the split-conformal quantile of ``|r|`` per coordinate
    (:func:`attnuq.conformal.conformal_quantile`: the ``ceil((n + 1) level)``-th smallest), so
    the interval has finite-sample coverage ``>= level`` per coordinate for exchangeable rows.
    (Moved here from ``bench/ett.py``; the ``conformal`` method and the suites' naive
    baselines use it.)

    Examples
    --------
    >>> import torch
    >>> r = torch.randn(500, 3, generator=torch.Generator().manual_seed(0))
    >>> rq = ResidualQuantiles.fit(r, n_quantiles=50)
    >>> rq.predictive(torch.zeros(4, 3)).samples.shape
    torch.Size([50, 4, 3])
    >>> rc = ResidualQuantiles.fit(r, n_quantiles=50, conformal_from=2 * r, level=0.9)
    >>> lo, hi = rc.predictive(torch.zeros(4, 3)).interval(0.9)
    >>> bool(torch.allclose(hi[0], rc.q_conformal.float()))
    True
    """

    quantiles: torch.Tensor  # (K, *E)
    q_conformal: torch.Tensor | None = None  # (*E,)

    @classmethod
    def fit(
        cls,
        residuals: torch.Tensor,
        *,
        n_quantiles: int = 100,
        conformal_from: torch.Tensor | None = None,
        level: float = 0.95,
    ) -> ResidualQuantiles:
        k = check_positive_int(n_quantiles, "n_quantiles")
        if not isinstance(residuals, torch.Tensor):
            raise TypeError(f"residuals must be a torch.Tensor, got {type(residuals).__name__}")
        if residuals.dim() < 1 or residuals.shape[0] < 2:
            raise ValueError(
                f"residuals must be (N, ...) with N >= 2, got shape={tuple(residuals.shape)}"
            )
        if not 0 < level < 1:
            raise ValueError(f"level must lie in (0, 1), got {level=}")
        check_finite(residuals, "residuals")
        r = residuals.double()
        lv = (torch.arange(k, dtype=torch.float64, device=r.device) + 0.5) / k
        q = torch.quantile(r.reshape(r.shape[0], -1), lv, dim=0).reshape(k, *r.shape[1:])
        if conformal_from is None:
            return cls(quantiles=q)
        if conformal_from.shape[1:] != residuals.shape[1:]:
            raise ValueError(
                f"conformal_from must have per-example shape {tuple(residuals.shape[1:])}, "
                f"got {tuple(conformal_from.shape[1:])}"
            )
        check_finite(conformal_from, "conformal_from")
        a = 1.0 - level
        qc = conformal_quantile(conformal_from.double().abs(), a, dim=0)  # (*E,)
        lo = torch.quantile(q, a / 2, dim=0)
        hi = torch.quantile(q, 1 - a / 2, dim=0)
        mid, half = (hi + lo) / 2, ((hi - lo) / 2).clamp_min(1e-12)
        # shift and stretch the residual shape so that its central interval is exactly
        # [-q_conf, +q_conf] (quantiles commute with increasing affine maps)
        q = (q - mid) * (qc / half)
        return cls(quantiles=q, q_conformal=qc)

    def predictive(self, point: torch.Tensor) -> Predictive:
        """``K`` samples ``point + q_k``; ``point`` is ``(B, *E)``."""
        if point.shape[1:] != self.quantiles.shape[1:]:
            raise ValueError(
                f"point must be (B, {tuple(self.quantiles.shape[1:])}), got {tuple(point.shape)}"
            )
        q = self.quantiles.to(dtype=point.dtype, device=point.device)
        return Predictive(samples=point.unsqueeze(0) + q.unsqueeze(1), frozen=point)


class SplitConformal(Method):
    """Split conformal on absolute residuals of the frozen model, per output coordinate.

    ``q_e`` is the ``ceil((n + 1)(1 - alpha))``-th smallest ``|y_e - f(x)_e|`` over the ``n``
    calibration rows, for each coordinate ``e`` of the output ``(B, *E)``
    (:attr:`q_per_output`, shape ``E``; :attr:`q` is its mean, the one ``q`` of a scalar
    output). :meth:`predict` returns a :class:`~attnuq.predictive.Predictive` with
    ``n_quantiles`` samples ``(K, B, *E)``: ``f(x)`` plus the validation residual quantiles,
    shaped so that the central ``1 - alpha`` interval is ``f(x) +- q`` (see the module
    docstring and :class:`ResidualQuantiles`).

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> from attnuq_bench.methods import Task
    >>> _ = torch.manual_seed(0)
    >>> net = nn.Sequential(nn.Linear(2, 1), nn.Flatten(0)).eval()
    >>> x = torch.randn(64, 2)
    >>> with torch.no_grad():
    ...     y = net(x) + 0.5 * torch.randn(64)
    >>> cp = SplitConformal(alpha=0.1).fit(Task(model=net, train=(x, y), val=(x, y), cal=(x, y)))
    >>> pred = cp.predict(x[:3])
    >>> pred.samples.shape  # 100 residual quantiles, 3 inputs
    torch.Size([100, 3])
    >>> lo, hi = pred.interval(0.9)
    >>> round(cp.q, 2), bool(torch.allclose((hi - lo) / 2, torch.tensor(cp.q)))
    (0.7, True)

    Multi-output (ETT's ``(B, horizon, channels)``): one ``q`` per coordinate.

    >>> net3 = nn.Sequential(nn.Flatten(1), nn.Linear(4, 6), nn.Unflatten(1, (3, 2))).eval()
    >>> xs = torch.randn(50, 2, 2)
    >>> with torch.no_grad():
    ...     ys = net3(xs) + torch.randn(50, 3, 2) * torch.tensor([0.1, 1.0])
    >>> cp3 = SplitConformal(n_quantiles=40).fit(
    ...     Task(model=net3, train=(xs, ys), val=(xs, ys), cal=(xs, ys)))
    >>> cp3.q_per_output.shape, cp3.predict(xs[:4]).samples.shape
    (torch.Size([3, 2]), torch.Size([40, 4, 3, 2]))
    >>> bool((cp3.q_per_output[:, 1] > cp3.q_per_output[:, 0]).all())
    True
    """

    implementation = ("attnuq (split conformal per output coordinate, "
                      "attnuq.conformal.conformal_quantile; "
                      "attnuq_bench.methods.ResidualQuantiles)")

    def __init__(self, alpha: float = 0.05, n_quantiles: int = 100) -> None:
        super().__init__()
        if not 0 < alpha < 1:
            raise ValueError(f"alpha must lie in (0, 1), got {alpha=}")
        self.alpha = float(alpha)
        self.n_quantiles = check_positive_int(n_quantiles, "n_quantiles")
        self.q: float | None = None
        self.q_per_output: torch.Tensor | None = None
        self._rq: ResidualQuantiles | None = None

    def _fit(self, task: Task) -> Cost | None:
        pv, yv = collect(task.model, task.val, task.forward_fn)
        pc, yc = collect(task.model, task.cal, task.forward_fn)
        self.cost.fit_forward += yv.shape[0] + yc.shape[0]
        rv = yv - pv
        if float((rv - rv.mean(0)).abs().max()) == 0.0:
            raise ValueError("validation residuals are degenerate (zero spread)")
        self._rq = ResidualQuantiles.fit(rv, n_quantiles=self.n_quantiles,
                                         conformal_from=yc - pc, level=1.0 - self.alpha)
        assert self._rq.q_conformal is not None
        self.q_per_output = self._rq.q_conformal
        self.q = float(self.q_per_output.mean())
        return None

    def _predict(self, task: Task, inputs: Any) -> tuple[PredictiveLike, int]:
        assert self._rq is not None
        with torch.no_grad():
            f = task.forward(task.model.eval(), inputs)
        return self._rq.predictive(f), 1

    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {"q": self.q, "n_quantiles": self.n_quantiles}
        if self.q_per_output is not None and self.q_per_output.numel() > 1:
            out["q_min"] = float(self.q_per_output.min())
            out["q_max"] = float(self.q_per_output.max())
        return out


@contextmanager
def dropout_active(model: nn.Module) -> Iterator[int]:
    """Switch only the dropout modules of ``model`` to training mode; yields how many there are.

    Everything else stays in eval mode (LayerNorm/BatchNorm statistics untouched); the previous
    modes are restored on exit, exceptions included. Dropout modules with ``p = 0`` are not
    counted.

    Examples
    --------
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(2, 4), nn.Dropout(0.5), nn.LayerNorm(4)).eval()
    >>> with dropout_active(net) as n:
    ...     print(n, net[1].training, net[2].training)
    1 True False
    >>> net[1].training
    False
    """
    drops = [m for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd)
             and m.p > 0]
    modes = [m.training for m in drops]
    try:
        for m in drops:
            m.train()
        yield len(drops)
    finally:
        for m, t in zip(drops, modes, strict=True):
            m.train(t)


class MCDropout(Method):
    """MC dropout on the frozen model: dropout active at test time only, ``n_samples`` passes.

    :meth:`predict` returns a :class:`~attnuq.predictive.Predictive` with samples
    ``(n_samples, B, ...)`` and the deterministic (eval-mode) output as ``frozen``; the draws are
    seeded with ``seed`` (torch's global random state is restored afterwards), so repeated calls
    give the same samples. ``fit`` only checks that the model has dropout with ``p > 0``.

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> from attnuq_bench.methods import Task
    >>> _ = torch.manual_seed(0)
    >>> net = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1),
    ...                     nn.Flatten(0)).eval()
    >>> x, y = torch.randn(32, 2), torch.randn(32)
    >>> mc = MCDropout(n_samples=8).fit(Task(model=net, train=(x, y), val=(x, y), cal=(x, y)))
    >>> pred = mc.predict(x[:4])
    >>> pred.samples.shape, bool(torch.equal(pred.frozen, net(x[:4])))
    (torch.Size([8, 4]), True)
    >>> bool(torch.equal(mc.predict(x[:4]).samples, pred.samples)), net[2].training
    (True, False)
    """

    implementation = (
        "attnuq (only the dropout modules in training mode, passes in a loop); the draws equal "
        "torch-uncertainty 0.13 mc_dropout(on_batch=False) bit for bit "
        "(tests/attnuq_bench/methods/test_library_agreement.py)"
    )

    def __init__(self, n_samples: int = 100, seed: int = 0) -> None:
        super().__init__()
        self.n_samples = check_positive_int(n_samples, "n_samples")
        self.seed = int(seed)

    def _fit(self, task: Task) -> Cost | None:
        with dropout_active(task.model) as n:
            if n == 0:
                raise ValueError(
                    f"{self.name} needs a model with dropout modules of p > 0; "
                    f"{type(task.model).__name__} has none"
                )
        return None

    def _predict(self, task: Task, inputs: Any) -> tuple[PredictiveLike, int]:
        model = task.model.eval()
        with seeded(self.seed), torch.no_grad():
            frozen = task.forward(model, inputs)
            with dropout_active(model):
                samples = torch.stack(
                    [task.forward(model, inputs) for _ in range(self.n_samples)]
                )  # (S, B, ...)
        return Predictive(samples=samples, frozen=frozen), self.n_samples
