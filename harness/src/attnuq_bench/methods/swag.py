"""SWAG and MultiSWAG (Maddox et al. 2019; Wilson & Izmailov 2020), implemented here.

The reference code, ``wjmaddox/swa_gaussian``, is a research repository, not a package;
``torch-uncertainty`` (the ``uncertainty`` extra) has a ``SWAG`` wrapper. The few lines of
bookkeeping stay in :class:`SWAGCollector` because torch-uncertainty's wrapper collects one
snapshot per epoch of its Lightning routine and draws the low-rank part with a fresh ``z_2`` for
every parameter tensor (a block-diagonal low-rank covariance, not the formula below), scaled by
``1/sqrt(max_num_models - 1)`` even before ``max_num_models`` snapshots exist.
``tests/attnuq_bench/methods/test_library_agreement.py`` feeds both the same snapshots: the same
moments and deviation matrix (float64, 1e-12), the same draws from the same normal draws for a
one-tensor model (torch-uncertainty's ``scale=0.5`` is the formula's 1/2), and the block-diagonal
covariance of its draws otherwise (``docs/methods.md``, section 5).

From the trained weights, training continues for ``swag_epochs`` epochs at a constant learning
rate; ``snapshots_per_epoch`` times per epoch the flat weight vector ``w_i`` is collected into

* running first and second moments ``mean = 1/n sum w_i``, ``sq_mean = 1/n sum w_i^2``,
* the deviation matrix ``D`` whose columns are ``w_i - mean_i`` (the running mean after adding
  ``w_i``) for the last ``K = max_rank`` snapshots.

Samples follow the SWAG formula

    w = mean + 1/sqrt(2) * diag(Sigma_diag)^(1/2) z_1 + 1/sqrt(2 (K - 1)) * D z_2,

``z_1 ~ N(0, I_P)``, ``z_2 ~ N(0, I_K)``, ``Sigma_diag = max(sq_mean - mean^2, var_clamp)``, i.e.
``w ~ N(mean, (Sigma_diag + D D^T / (K - 1)) / 2)``. MultiSWAG fits one SWAG posterior per deep
ensemble member and pools their samples.

NOTE(paper): Maddox et al. run SGD with a constant (or cyclic) high learning rate; the
FT-Transformer recipe is AdamW, so SWAG continues with AdamW at a constant learning rate
(default: the recipe's 1e-4) for a budgeted number of epochs (default 10, 2 snapshots each).

Examples
--------
>>> import torch
>>> c = SWAGCollector(n_params=3, max_rank=4)
>>> for _ in range(5):
...     c.collect(torch.randn(3, dtype=torch.float64))
>>> c.sample(torch.Generator().manual_seed(0)).shape
torch.Size([3])
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from attnuq._validation import check_finite, check_positive_int
from attnuq.predictive import Predictive
from attnuq_bench.methods._base import Cost, Method, PredictiveLike, Task
from attnuq_bench.training import as_batches, make_optimizer, progress_bar, reseeded

__all__ = ["SWAG", "MultiSWAG", "SWAGCollector", "fit_swag"]


class SWAGCollector:
    """Running moments and low-rank deviations of a flat weight vector (see module docstring).

    Parameters
    ----------
    n_params
        Length ``P`` of the flat weight vector.
    max_rank
        ``K``, the number of most recent deviation columns kept.
    var_clamp
        Lower bound on the diagonal variance.

    Examples
    --------
    >>> import torch
    >>> c = SWAGCollector(n_params=2, max_rank=2)
    >>> for w in ([0.0, 0.0], [2.0, 0.0], [4.0, 3.0]):
    ...     c.collect(torch.tensor(w, dtype=torch.float64))
    >>> c.n, c.mean
    (3, tensor([2., 1.], dtype=torch.float64))
    >>> c.variance  # sq_mean - mean^2
    tensor([2.6667, 2.0000], dtype=torch.float64)
    >>> c.deviation_matrix.shape  # (P, K): only the last K = 2 deviations are kept
    torch.Size([2, 2])
    >>> c.sample(torch.Generator().manual_seed(0)).shape
    torch.Size([2])
    """

    def __init__(self, n_params: int, max_rank: int = 20, var_clamp: float = 1e-30) -> None:
        self.n_params = check_positive_int(n_params, "n_params")
        self.max_rank = check_positive_int(max_rank, "max_rank")
        self.var_clamp = float(var_clamp)
        self.n = 0
        self.mean: torch.Tensor | None = None
        self.sq_mean: torch.Tensor | None = None
        self.deviations: list[torch.Tensor] = []

    def collect(self, w: torch.Tensor) -> None:
        """Add snapshot ``w`` of shape ``(P,)``."""
        if w.dim() != 1 or w.numel() != self.n_params:
            raise ValueError(f"w must have shape ({self.n_params},), got w.shape={tuple(w.shape)}")
        check_finite(w, "w")
        w = w.detach().clone()
        if self.mean is None or self.sq_mean is None:
            self.mean, self.sq_mean = torch.zeros_like(w), torch.zeros_like(w)
        self.n += 1
        self.mean += (w - self.mean) / self.n
        self.sq_mean += (w * w - self.sq_mean) / self.n
        self.deviations.append(w - self.mean)
        if len(self.deviations) > self.max_rank:
            self.deviations.pop(0)

    @property
    def variance(self) -> torch.Tensor:
        """``(P,)`` diagonal variance ``max(sq_mean - mean^2, var_clamp)``."""
        if self.mean is None or self.sq_mean is None:
            raise RuntimeError("SWAGCollector is empty: collect snapshots first")
        return (self.sq_mean - self.mean**2).clamp_min(self.var_clamp)

    @property
    def deviation_matrix(self) -> torch.Tensor:
        """``(P, K)`` deviation columns, oldest first."""
        if not self.deviations:
            raise RuntimeError("SWAGCollector is empty: collect snapshots first")
        return torch.stack(self.deviations, dim=1)

    def covariance(self) -> torch.Tensor:
        """``(P, P)`` dense covariance of :meth:`sample` (for small ``P`` / tests)."""
        cov = torch.diag(self.variance)
        if len(self.deviations) >= 2:
            d = self.deviation_matrix
            cov = cov + d @ d.T / (d.shape[1] - 1)
        return cov / 2

    def sample(self, generator: torch.Generator | None = None, scale: float = 1.0) -> torch.Tensor:
        """One draw ``w ~ N(mean, scale * (Sigma_diag + D D^T/(K-1)) / 2)``, shape ``(P,)``."""
        if self.n < 2:
            raise RuntimeError(f"SWAG needs >= 2 snapshots to sample, got n={self.n}")
        assert self.mean is not None
        dev = self.mean.device  # draw on the CPU generator's device, then move
        z1 = torch.randn(self.n_params, generator=generator, dtype=self.mean.dtype).to(dev)
        out = self.variance.sqrt() * z1
        k = len(self.deviations)
        if k >= 2:
            z2 = torch.randn(k, generator=generator, dtype=self.mean.dtype).to(dev)
            out = out + self.deviation_matrix @ z2 / math.sqrt(k - 1)
        return self.mean + math.sqrt(scale / 2.0) * out


def fit_swag(
    model: nn.Module,
    task: Task,
    *,
    epochs: int = 10,
    snapshots_per_epoch: int = 2,
    lr: float = 1e-4,
    weight_decay: float = 1e-5,
    max_rank: int = 20,
    seed: int = 0,
    progress: bool = True,
) -> tuple[nn.Module, SWAGCollector, int]:
    """Continue training a copy of ``model`` at constant ``lr`` and collect SWAG moments.

    Returns ``(copy, collector, example_forwards)``; the copy holds the SWA mean afterwards.
    ``model`` itself is not changed. Training minimises the MSE between
    ``task.forward(copy, inputs)`` and the targets with AdamW; snapshots are taken
    ``snapshots_per_epoch`` times per epoch, evenly spaced over the epoch's steps.

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> from torch.nn.utils import parameters_to_vector
    >>> from attnuq_bench.methods import Task
    >>> _ = torch.manual_seed(0)
    >>> net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1), nn.Flatten(0)).eval()
    >>> x, y = torch.randn(32, 2), torch.randn(32)
    >>> task = Task(model=net, train=(x, y), val=(x, y), cal=(x, y), batch_size=16)
    >>> swa, coll, n_fwd = fit_swag(net, task, epochs=2, snapshots_per_epoch=2, max_rank=3,
    ...                             progress=False)
    >>> coll.n, n_fwd, coll.deviation_matrix.shape  # 2 x 2 snapshots, 2 x 32 rows, (P, K)
    (4, 64, torch.Size([33, 3]))
    >>> bool(torch.allclose(parameters_to_vector(swa.parameters()).double(), coll.mean))
    True
    """
    epochs = check_positive_int(epochs, "epochs")
    snapshots_per_epoch = check_positive_int(snapshots_per_epoch, "snapshots_per_epoch")
    net = copy.deepcopy(model)
    for p in net.parameters():  # the copy trains even if the frozen model has grads off
        p.requires_grad_(True)
    params = list(net.parameters())
    coll = SWAGCollector(sum(p.numel() for p in params), max_rank=max_rank)
    opt = make_optimizer(net, lr=lr, weight_decay=weight_decay)
    batches = reseeded(as_batches(task.train, shuffle=True, seed=seed), seed)  # own order
    n_steps = sum(1 for _ in batches)
    marks = {
        max(1, round((j + 1) * n_steps / snapshots_per_epoch))
        for j in range(snapshots_per_epoch)
    }
    torch.manual_seed(seed)
    n_fwd = 0
    for _ in progress_bar(range(epochs), desc="swag", enable=progress):
        net.train()
        for step, (inputs, targets) in enumerate(batches, start=1):
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(task.forward(net, inputs), targets)
            loss.backward()
            opt.step()
            n_fwd += len(targets)
            if step in marks:
                coll.collect(parameters_to_vector(params).detach().double())
    net.eval()
    assert coll.mean is not None
    vector_to_parameters(coll.mean.to(params[0].dtype), params)
    return net, coll, n_fwd


class SWAG(Method):
    """SWAG around the frozen model (``n_members=1``) or MultiSWAG (``n_members > 1``).

    Predicts with ``n_samples`` weight draws in total (split evenly over members): a
    :class:`~attnuq.predictive.Predictive` with samples ``(n_samples, B, ...)``, one forward pass
    per draw. Member 0 is the task's frozen model; more members need ``make_model`` and
    ``train_fn``.

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> from attnuq_bench.methods import Task
    >>> _ = torch.manual_seed(0)
    >>> net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1), nn.Flatten(0)).eval()
    >>> x, y = torch.randn(32, 2), torch.randn(32)
    >>> task = Task(model=net, train=(x, y), val=(x, y), cal=(x, y), batch_size=16)
    >>> swag = SWAG(n_samples=6, epochs=2, max_rank=4, progress=False).fit(task)
    >>> pred = swag.predict(x[:4])
    >>> pred.samples.shape, swag.cost.fit_forward  # 2 epochs x 32 rows
    (torch.Size([6, 4]), 64)
    """

    implementation = (
        "attnuq SWAGCollector (Maddox et al. 2019); moments and draws agree with "
        "torch-uncertainty 0.13 SWAG on the same snapshots "
        "(tests/attnuq_bench/methods/test_library_agreement.py), which however draws the "
        "low-rank part per parameter tensor (docs/methods.md)"
    )

    def __init__(
        self,
        n_members: int = 1,
        n_samples: int = 50,
        epochs: int = 10,
        snapshots_per_epoch: int = 2,
        lr: float = 1e-4,
        max_rank: int = 20,
        seed: int = 0,
        progress: bool = True,
    ) -> None:
        super().__init__()
        self.n_members = check_positive_int(n_members, "n_members")
        self.n_samples = check_positive_int(n_samples, "n_samples")
        if self.n_samples < self.n_members:
            raise ValueError(f"n_samples must be >= n_members, got {n_samples=}, {n_members=}")
        self.epochs = check_positive_int(epochs, "epochs")
        self.snapshots_per_epoch = check_positive_int(snapshots_per_epoch, "snapshots_per_epoch")
        if not lr > 0:
            raise ValueError(f"lr must be positive, got {lr=}")
        self.lr = float(lr)
        self.max_rank = check_positive_int(max_rank, "max_rank")
        self.seed = int(seed)
        self.progress = bool(progress)
        self._posteriors: list[tuple[nn.Module, SWAGCollector]] = []

    def _fit(self, task: Task) -> Cost | None:
        if self.n_members > 1:
            task.require_retraining(self.name)
        extra = Cost()
        self._posteriors = []
        for k in range(self.n_members):
            base, c = task.member(k)
            extra.add_fit(c)
            net, coll, n_fwd = fit_swag(
                base, task, epochs=self.epochs, snapshots_per_epoch=self.snapshots_per_epoch,
                lr=self.lr, max_rank=self.max_rank, seed=self.seed + k, progress=self.progress,
            )
            self.cost.fit_forward += n_fwd
            self._posteriors.append((net, coll))
        return extra

    def _predict(self, task: Task, inputs: Any) -> tuple[PredictiveLike, int]:
        gen = torch.Generator().manual_seed(self.seed)
        per = [self.n_samples // self.n_members + (k < self.n_samples % self.n_members)
               for k in range(self.n_members)]
        outs = []
        with torch.no_grad():
            for (net, coll), s in zip(self._posteriors, per, strict=True):
                params = [p for p in net.parameters() if p.requires_grad]
                keep = parameters_to_vector(params).clone()
                net.eval()
                try:
                    for _ in range(s):
                        vector_to_parameters(coll.sample(gen).to(keep), params)
                        outs.append(task.forward(net, inputs))
                finally:
                    vector_to_parameters(keep, params)
        return Predictive(samples=torch.stack(outs)), self.n_samples


class MultiSWAG(SWAG):
    """MultiSWAG: SWAG on each of ``n_members`` (default 5) ensemble members, samples pooled.

    Members are the deep-ensemble members of the task (:meth:`Task.member`, shared with
    :class:`~attnuq_bench.methods.DeepEnsemble`); samples ``(n_samples, B, ...)``.

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
    >>> ms = MultiSWAG(n_members=2, n_samples=6, epochs=2, max_rank=4, progress=False)
    >>> pred = ms.fit(task).predict(x[:4])
    >>> pred.samples.shape, ms.cost.fit_forward  # SWAG steps: 2 members x 2 epochs x 32 rows
    (torch.Size([6, 4]), 128)
    """

    implementation = (
        "attnuq SWAG (as 'swag') around each deep-ensemble member, samples pooled; SWAG agrees "
        "with torch-uncertainty 0.13 SWAG on the same snapshots "
        "(tests/attnuq_bench/methods/test_library_agreement.py; its per-tensor low-rank draw: "
        "docs/methods.md)"
    )

    def __init__(self, n_members: int = 5, **kwargs: Any) -> None:
        super().__init__(n_members=n_members, **kwargs)
