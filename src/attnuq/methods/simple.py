"""Cheap baselines on the frozen model: homoscedastic Gaussian, split conformal, MC dropout.

* ``gaussian``: ``N(f(x), sigma^2)`` with ``sigma^2 = mean_val (y - f(x))^2`` over every output
  element of the validation part.
* ``conformal``: split conformal on absolute residuals. The interval is ``f(x) +- q`` with ``q``
  the ``ceil((n+1)(1-alpha))``-th smallest ``|y - f(x)|`` on the ``n`` calibration elements
  (coverage ``>= 1 - alpha`` for exchangeable data). As a distribution (for PIT, CRPS, NLL) it
  returns ``f(x) + r_i`` over the signed validation residuals ``r_i`` (the empirical residual
  distribution), spread about its mean so that its central ``1 - alpha`` interval has half-width
  ``q`` at the residuals' quantiles.
* ``mc-dropout``: the frozen model with its dropout modules switched to training mode at test
  time only (Gal & Ghahramani 2016); ``S`` passes give samples ``(S, B, ...)``.

Examples
--------
>>> import torch
>>> from torch import nn
>>> from attnuq.methods import Task, make_method
>>> net = nn.Sequential(nn.Linear(2, 8), nn.Dropout(0.2), nn.Linear(8, 1), nn.Flatten(0))
>>> x, y = torch.randn(40, 2), torch.randn(40)
>>> task = Task(model=net.eval(), train=(x, y), val=(x, y), cal=(x, y))
>>> make_method("gaussian").fit(task).predict(x[:5]).std.shape
torch.Size([5])
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from attnuq._validation import check_positive_int
from attnuq.conformal import conformal_quantile
from attnuq.methods._base import Cost, Method, PredictiveLike, Task, collect
from attnuq.predictive import GaussianPredictive, Predictive

__all__ = ["HomoscedasticGaussian", "MCDropout", "SplitConformal", "dropout_active"]


class HomoscedasticGaussian(Method):
    """``N(f(x), sigma^2)``, one ``sigma`` from validation residuals (RMS).

    ``sigma^2 = mean_val (y - f(x))^2`` over every output element; :meth:`predict` returns a
    :class:`~attnuq.predictive.GaussianPredictive` with ``mean = f(x)`` and ``std = sigma``,
    both shaped like the model output ``(B, ...)`` (one forward pass per input).

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> from attnuq.methods import Task
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


class SplitConformal(Method):
    """Split conformal on absolute residuals of the frozen model (see module docstring).

    ``q`` is the ``ceil((n + 1)(1 - alpha))``-th smallest ``|y - f(x)|`` on the ``n``
    calibration elements; :meth:`predict` returns a :class:`~attnuq.predictive.Predictive` with
    samples ``(S, B, ...)``: ``f(x)`` plus the ``S`` rescaled validation residuals, whose central
    ``1 - alpha`` interval is ``f(x) +- q``.

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> from attnuq.methods import Task
    >>> _ = torch.manual_seed(0)
    >>> net = nn.Sequential(nn.Linear(2, 1), nn.Flatten(0)).eval()
    >>> x = torch.randn(64, 2)
    >>> with torch.no_grad():
    ...     y = net(x) + 0.5 * torch.randn(64)
    >>> cp = SplitConformal(alpha=0.1).fit(Task(model=net, train=(x, y), val=(x, y), cal=(x, y)))
    >>> pred = cp.predict(x[:3])
    >>> pred.samples.shape  # 64 validation residuals, 3 inputs
    torch.Size([64, 3])
    >>> lo, hi = pred.interval(0.9)
    >>> round(cp.q, 2), bool(torch.allclose((hi - lo) / 2, torch.tensor(cp.q)))
    (0.7, True)
    """

    implementation = "attnuq (split conformal, attnuq.conformal.conformal_quantile)"

    def __init__(self, alpha: float = 0.05) -> None:
        super().__init__()
        if not 0 < alpha < 1:
            raise ValueError(f"alpha must lie in (0, 1), got {alpha=}")
        self.alpha = float(alpha)
        self.q: float | None = None
        self._residuals: torch.Tensor | None = None

    def _fit(self, task: Task) -> Cost | None:
        pv, yv = collect(task.model, task.val, task.forward_fn)
        pc, yc = collect(task.model, task.cal, task.forward_fn)
        self.cost.fit_forward += yv.shape[0] + yc.shape[0]
        self.q = float(conformal_quantile((yc - pc).abs(), self.alpha))
        r = (yv - pv).reshape(-1)
        # Spread the residual distribution about its mean so that its central (1 - alpha)
        # interval has half-width q (the conformal interval), keeping its shape for PIT/CRPS.
        qs = torch.tensor([self.alpha / 2, 1 - self.alpha / 2], dtype=torch.float64,
                          device=r.device)
        lo, hi = torch.quantile(r.double(), qs)
        half = float(hi - lo) / 2
        if not half > 0:
            raise ValueError("validation residuals are degenerate (zero spread)")
        m = r.mean()
        self._residuals = (m + (r - m) * (self.q / half)).to(pv.dtype)
        return None

    def _predict(self, task: Task, inputs: Any) -> tuple[PredictiveLike, int]:
        assert self._residuals is not None
        with torch.no_grad():
            f = task.forward(task.model.eval(), inputs)
        shape = (-1,) + (1,) * f.dim()
        return Predictive(samples=f.unsqueeze(0) + self._residuals.reshape(shape), frozen=f), 1

    def info(self) -> dict[str, Any]:
        return {"q": self.q}


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
    >>> from attnuq.methods import Task
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
        "(tests/methods/test_library_agreement.py)"
    )

    def __init__(self, n_samples: int = 100, seed: int = 0) -> None:
        super().__init__()
        self.n_samples = check_positive_int(n_samples, "n_samples")
        self.seed = int(seed)

    def _fit(self, task: Task) -> Cost | None:
        with dropout_active(task.model) as n:
            if n == 0:
                raise ValueError(
                    "mc-dropout needs a model with dropout modules of p > 0; "
                    f"{type(task.model).__name__} has none"
                )
        return None

    def _predict(self, task: Task, inputs: Any) -> tuple[PredictiveLike, int]:
        model = task.model.eval()
        gen_state = torch.get_rng_state()
        torch.manual_seed(self.seed)
        try:
            with torch.no_grad():
                frozen = task.forward(model, inputs)
                with dropout_active(model):
                    samples = torch.stack(
                        [task.forward(model, inputs) for _ in range(self.n_samples)]
                    )  # (S, B, ...)
        finally:
            torch.set_rng_state(gen_state)
        return Predictive(samples=samples, frozen=frozen), self.n_samples
