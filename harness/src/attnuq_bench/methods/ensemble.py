"""Deep ensemble (Lakshminarayanan et al. 2017): ``M`` backbones retrained with different seeds.

Member 0 is the task's frozen model; members ``1 .. M-1`` are ``make_model(seed)`` trained with
``train_fn`` (cached in the task, so MultiSWAG reuses them; each method still books their
training cost). The predictive distribution is ``N(mean_m f_m(x), var_m f_m(x))`` with the
unbiased variance over members.

NOTE(paper): the original deep ensemble trains mean-variance networks with a Gaussian NLL; the
backbones here are trained with MSE (the same recipe as the frozen model), so the ensemble spread
is epistemic only and the benchmark's unified coverage calibration supplies the scale. A Gaussian
is used instead of the ``M`` empirical quantiles because 5 samples cannot resolve a 95 % interval.

Examples
--------
>>> from attnuq_bench.methods import make_method
>>> make_method("ensemble").n_members
5
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attnuq._validation import check_positive_int
from attnuq.predictive import GaussianPredictive
from attnuq_bench.methods._base import Cost, Method, PredictiveLike, Task

__all__ = ["DeepEnsemble"]


class DeepEnsemble(Method):
    """``n_members`` backbones (seeds ``0 .. n_members - 1``); Gaussian over member outputs.

    With member outputs ``f_m(x)`` (``m = 0 .. M-1``; member 0 is the task's frozen model),
    :meth:`predict` returns ``N(mean_m f_m(x), var_m f_m(x))`` (unbiased variance) as a
    :class:`~attnuq.predictive.GaussianPredictive` shaped like the output ``(B, ...)``, at ``M``
    forward passes per input. ``fit`` needs the task's ``make_model`` and ``train_fn``.

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> from attnuq_bench.methods import Task
    >>> def make_model(seed):
    ...     torch.manual_seed(seed)
    ...     return nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1), nn.Flatten(0))
    >>> def train_fn(model, train, val, seed):  # a few SGD steps stand in for the recipe
    ...     opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ...     for _ in range(10):
    ...         for xb, yb in train:
    ...             opt.zero_grad()
    ...             nn.functional.mse_loss(model(xb), yb).backward()
    ...             opt.step()
    >>> x = torch.randn(32, 2, generator=torch.Generator().manual_seed(0))
    >>> y = x.sum(1)
    >>> net = make_model(0)
    >>> task = Task(model=net, train=(x, y), val=(x, y), cal=(x, y), batch_size=16,
    ...             make_model=make_model, train_fn=train_fn)
    >>> train_fn(net, task.train, task.val, 0)  # the frozen model (member 0)
    >>> ens = DeepEnsemble(n_members=3).fit(task)
    >>> pred = ens.predict(x[:4])
    >>> pred.mean.shape, bool((pred.std > 0).all()), ens.cost.predict_forward_per_input
    (torch.Size([4]), True, 3)
    """

    implementation = "attnuq (members retrained with the suite's recipe; Gaussian over members)"

    def __init__(self, n_members: int = 5) -> None:
        super().__init__()
        self.n_members = check_positive_int(n_members, "n_members")
        if self.n_members < 2:
            raise ValueError(f"an ensemble needs n_members >= 2, got {n_members=}")
        self._models: list[nn.Module] = []

    def _fit(self, task: Task) -> Cost | None:
        self._models, extra = task.members(self.n_members, self.name)
        return extra

    def _predict(self, task: Task, inputs: Any) -> tuple[PredictiveLike, int]:
        with torch.no_grad():
            # (M, B, ...)
            outs = torch.stack([task.forward(m.eval(), inputs) for m in self._models])
        return GaussianPredictive(mean=outs.mean(0), std=outs.std(0, unbiased=True)), len(outs)
