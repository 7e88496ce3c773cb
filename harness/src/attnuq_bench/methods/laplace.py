"""Exact last-layer Laplace approximation for Gaussian regression (closed form).

``laplace-torch`` (Daxberger et al. 2021; the ``laplace`` extra) is the maintained library for
this. For Gaussian regression the last-layer Laplace is exact and closed-form, so it is written
out here: it runs any ``forward_fn`` and input form (tensor, tuple, dict) with outputs
``(B, ...)`` of any shape, where laplace-torch calls ``model(x)`` and wants ``(B, K)``.
``tests/attnuq_bench/methods/test_library_agreement.py`` checks it against
``laplace.Laplace(model, "regression", subset_of_weights="last_layer",
hessian_structure="full")`` on the same model and data in float64: at the same ``alpha`` and
``sigma`` the predictive mean and variance agree to 1e-6 relative (6e-9 seen), the log marginal
likelihood to 1e-6 (2e-8 seen, near-collinear features), laplace-torch's log marginal likelihood
on our grid peaks at our ``alpha``, and its own fit (Adam on ``log alpha``) lies within half a
grid step. The noise is chosen differently: ours is the MLE ``RSS / N`` of the frozen model's
training residuals; laplace-torch takes ``sigma_noise`` as given (or fits it by marginal
likelihood during training).

Let ``phi(x) in R^d`` be the input of the last ``nn.Linear`` (``K`` outputs, weights ``W``,
bias ``b``) and ``phi~ = [phi, 1]`` (``d~ = d + 1`` with a bias). With a Gaussian likelihood of
variance ``s2`` and the prior ``N(0, alpha^-1 I)`` on ``theta = (W, b)``, the GGN of the
negative log-posterior is exact for the last layer and factorises over the ``K`` outputs:

    H = I_K (x) A,   A = Phi~^T Phi~ / s2 + alpha I_{d~},   Sigma = A^-1,

where ``Phi~`` stacks ``phi~`` over every training row. The linearised predictive of output
``k`` is ``N(f_k(x), phi~(x)^T Sigma phi~(x) + s2)``.

* ``s2``: mean squared training residual of the frozen model (MLE of the noise).
* ``alpha``: maximiser of the Laplace log marginal likelihood (``prior="marglik"``) over a grid
  ``10^[-6, 6]``::

      log Z(alpha) = -N/2 log(2 pi s2) - RSS/(2 s2) - alpha/2 |theta*|^2
                     + P/2 log alpha - K/2 sum_i log(lambda_i / s2 + alpha),

  ``lambda_i`` the eigenvalues of ``Phi~^T Phi~``, ``N`` the number of output elements,
  ``P = K d~``; or the maximiser of the validation Gaussian log-likelihood (``prior="val"``);
  or a given ``prior_precision``.

The last linear's output must *be* the prediction (up to a reshape); otherwise a
``NotImplementedError`` names the mismatch.

Examples
--------
>>> import torch
>>> from torch import nn
>>> from attnuq_bench.methods import Task, make_method
>>> net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1), nn.Flatten(0)).eval()
>>> x, y = torch.randn(50, 2), torch.randn(50)
>>> la = make_method("laplace").fit(Task(model=net, train=(x, y), val=(x, y), cal=(x, y)))
>>> la.predict(x[:3]).std.shape
torch.Size([3])
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from attnuq.predictive import GaussianPredictive
from attnuq_bench.methods._base import Cost, Method, PredictiveLike, Task

__all__ = ["LastLayerLaplace", "find_last_linear", "laplace_log_marglik"]


def find_last_linear(model: nn.Module, name: str | None = None) -> tuple[str, nn.Linear]:
    """The ``nn.Linear`` called ``name``, or the last one in ``model.named_modules()`` order.

    Returns ``(qualified_name, layer)``; raises ``ValueError`` if ``model`` has no linear layer
    or none called ``name`` (the message lists the linear layers).

    Examples
    --------
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))
    >>> name, layer = find_last_linear(net)
    >>> name, layer.in_features
    ('2', 8)
    >>> find_last_linear(net, "0")[1].out_features
    8
    """
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layer for last-layer Laplace")
    if name is None:
        return linears[-1]
    for n, m in linears:
        if n == name:
            return n, m
    raise ValueError(f"no nn.Linear named {name=!r}; linear layers: {[n for n, _ in linears]}")


def laplace_log_marglik(
    eig: torch.Tensor, alpha: torch.Tensor, *, s2: float, rss: float, n: int, k: int,
    theta_sq: float,
) -> torch.Tensor:
    """Laplace log marginal likelihood of the last layer for each prior precision in ``alpha``.

    ``eig``: eigenvalues ``(d~,)`` of ``Phi~^T Phi~``; ``alpha``: ``(G,)``; returns ``(G,)``::

        log Z(alpha) = -n/2 log(2 pi s2) - rss/(2 s2) - alpha/2 theta_sq
                       + P/2 log alpha - k/2 sum_i log(eig_i / s2 + alpha),   P = k d~,

    with ``s2`` the noise variance, ``rss`` the residual sum of squares over the ``n`` output
    elements, ``k`` the outputs of the last layer and ``theta_sq = |theta*|^2`` the squared norm
    of its weights and bias (see the module docstring).

    Examples
    --------
    >>> import torch
    >>> eig = torch.tensor([10.0, 1.0, 0.1], dtype=torch.float64)
    >>> alpha = torch.logspace(-3, 3, 7, dtype=torch.float64)
    >>> lml = laplace_log_marglik(eig, alpha, s2=0.5, rss=12.0, n=50, k=1, theta_sq=2.0)
    >>> lml.shape, float(alpha[lml.argmax()])
    (torch.Size([7]), 1.0)
    """
    p = k * eig.numel()
    a = alpha.reshape(-1, 1)
    logdet = k * torch.log(eig.reshape(1, -1).clamp_min(0) / s2 + a).sum(1)
    return (
        -0.5 * n * math.log(2 * math.pi * s2) - rss / (2 * s2)
        - 0.5 * alpha * theta_sq + 0.5 * p * torch.log(alpha) - 0.5 * logdet
    )


class _Capture:
    def __init__(self, layer: nn.Linear) -> None:
        self.inp: torch.Tensor | None = None
        self.out: torch.Tensor | None = None
        self.handle = layer.register_forward_hook(self._hook)

    def _hook(self, mod: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        self.inp, self.out = args[0].detach(), out.detach()


class LastLayerLaplace(Method):
    """Closed-form last-layer Laplace for Gaussian regression (see module docstring).

    :meth:`predict` returns a :class:`~attnuq.predictive.GaussianPredictive` with mean ``f(x)``
    and variance ``phi~(x)^T Sigma phi~(x) + s2`` shaped like the output ``(B, ...)``
    (one forward pass per input).

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> from attnuq_bench.methods import Task
    >>> _ = torch.manual_seed(0)
    >>> net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1), nn.Flatten(0)).eval()
    >>> x = torch.randn(50, 2)
    >>> with torch.no_grad():
    ...     y = net(x) + 0.3 * torch.randn(50)
    >>> la = LastLayerLaplace(prior="marglik").fit(Task(model=net, train=(x, y), val=(x, y),
    ...                                                  cal=(x, y)))
    >>> la.info()["layer"], round(la.info()["prior_precision"], 2)
    ('2', 8.91)
    >>> pred = la.predict(x[:3])
    >>> pred.std.shape, bool((pred.std**2 > la.s2).all())  # epistemic part + noise s2
    (torch.Size([3]), True)
    """

    implementation = (
        "attnuq closed form (last layer, full GGN); agrees with laplace-torch 0.3 "
        "FullLLLaplace to 1e-6 relative in mean, variance and log marginal likelihood "
        "(tests/attnuq_bench/methods/test_library_agreement.py)"
    )

    def __init__(
        self,
        prior: str = "marglik",
        prior_precision: float | None = None,
        sigma: float | None = None,
        layer: str | None = None,
    ) -> None:
        super().__init__()
        if prior not in ("marglik", "val"):
            raise ValueError(f"prior must be 'marglik' or 'val', got {prior=!r}")
        if prior_precision is not None and not prior_precision > 0:
            raise ValueError(f"prior_precision must be positive, got {prior_precision=}")
        if sigma is not None and not sigma > 0:
            raise ValueError(f"sigma must be positive, got {sigma=}")
        self.prior = prior
        self.prior_precision = prior_precision
        self.sigma = sigma
        self.layer = layer
        self._sigma_post: torch.Tensor | None = None
        self._layer: nn.Linear | None = None

    def _features(self, task: Task, inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Prediction ``(B, ...)`` and features ``phi~`` ``(R, d~)``, ``R * K = pred.numel()``."""
        assert self._layer is not None
        cap = _Capture(self._layer)
        try:
            with torch.no_grad():
                pred = task.forward(task.model.eval(), inputs)
        finally:
            cap.handle.remove()
        if cap.inp is None or cap.out is None:
            raise RuntimeError(f"last linear layer {self.layer!r} was not called by forward_fn")
        same = cap.out.numel() == pred.numel() and torch.equal(
            cap.out.reshape(-1), pred.reshape(-1)
        )
        if not same:
            raise NotImplementedError(
                "last-layer Laplace needs the last linear layer's output to be the prediction "
                f"(up to a reshape); got layer output {tuple(cap.out.shape)} vs prediction "
                f"{tuple(pred.shape)} with different values"
            )
        phi = cap.inp.reshape(-1, cap.inp.shape[-1]).double()
        if self._layer.bias is not None:
            phi = torch.cat([phi, phi.new_ones(len(phi), 1)], 1)
        return pred, phi

    def _fit(self, task: Task) -> Cost | None:
        self.layer, self._layer = find_last_linear(task.model, self.layer)
        k = self._layer.out_features
        gram, rss, n = None, 0.0, 0
        for inputs, targets in task.train:
            pred, phi = self._features(task, inputs)
            if pred.shape != targets.shape:
                raise ValueError(
                    f"prediction {tuple(pred.shape)} and targets {tuple(targets.shape)} differ"
                )
            g = phi.T @ phi
            gram = g if gram is None else gram + g
            rss += float(((pred.double() - targets.double()) ** 2).sum())
            n += targets.numel()
            self.cost.fit_forward += len(targets)
        assert gram is not None
        s2 = self.sigma**2 if self.sigma is not None else rss / n
        if not s2 > 0:
            raise ValueError("training residuals are all zero: the noise variance s2 is 0")
        w = self._layer.weight.detach().double()
        theta_sq = float((w**2).sum())
        if self._layer.bias is not None:
            theta_sq += float((self._layer.bias.detach().double() ** 2).sum())
        eig, vec = torch.linalg.eigh(gram)
        eig = eig.clamp_min(0)
        self.s2, self.rss, self.n_elements = s2, rss, n
        if self.prior_precision is not None:
            alpha = float(self.prior_precision)
        else:
            grid = torch.logspace(-6, 6, 241, dtype=torch.float64, device=gram.device)
            if self.prior == "marglik":
                lml = laplace_log_marglik(eig, grid, s2=s2, rss=rss, n=n, k=k, theta_sq=theta_sq)
                alpha = float(grid[int(torch.argmax(lml))])
            else:
                alpha = self._val_alpha(task, grid, eig, vec, s2)
        self.alpha = alpha
        self._sigma_post = (vec / (eig / s2 + alpha)) @ vec.T  # (d~, d~)
        return None

    def _val_alpha(
        self, task: Task, grid: torch.Tensor, eig: torch.Tensor, vec: torch.Tensor, s2: float
    ) -> float:
        best, best_a = -math.inf, float(grid[0])
        feats = [(self._features(task, x), y) for x, y in task.val]
        for a in grid.tolist():
            sig = (vec / (eig / s2 + a)) @ vec.T
            ll = 0.0
            for (pred, phi), y in feats:
                var = ((phi @ sig) * phi).sum(1) + s2  # (R,)
                var = var.repeat_interleave(pred.numel() // len(var)).reshape(pred.shape)
                r2 = (y.double() - pred.double()) ** 2
                ll += float((-0.5 * (torch.log(2 * math.pi * var) + r2 / var)).sum())
            if ll > best:
                best, best_a = ll, a
        return best_a

    def _predict(self, task: Task, inputs: Any) -> tuple[PredictiveLike, int]:
        assert self._sigma_post is not None
        pred, phi = self._features(task, inputs)
        var = ((phi @ self._sigma_post) * phi).sum(1)  # (R,) epistemic, same for the K outputs
        var = var.repeat_interleave(pred.numel() // len(var)).reshape(pred.shape) + self.s2
        return GaussianPredictive(mean=pred, std=var.sqrt().to(pred.dtype)), 1

    def info(self) -> dict[str, Any]:
        return {"prior_precision": getattr(self, "alpha", None), "s2": getattr(self, "s2", None),
                "layer": self.layer}
