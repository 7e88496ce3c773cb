"""Predictive distributions shared by SA, Levy attention and every baseline.

Two concrete forms with one interface (``mean``, ``std``, ``quantile``, ``interval``):

* :class:`Predictive` holds Monte Carlo samples, samples first: ``samples`` is ``(S, B, ...)``.
* :class:`GaussianPredictive` holds a per-element normal ``N(mean, std^2)`` (Levy attention's
  closed-form ``sigma_hat``, Laplace, GPs, homoscedastic baselines).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnuq._validation import (
    check_finite,
    check_float_tensor,
    check_positive_int,
    check_scale_factor,
)

__all__ = ["GaussianPredictive", "Predictive", "check_level", "check_probability", "recentre"]

#: the ``how=`` values of :func:`recentre`
RECENTRE = ("mean", "median")


def check_probability(q: float | torch.Tensor, name: str = "q") -> torch.Tensor:
    """Return ``q`` as a tensor after checking every entry lies strictly in (0, 1).

    ``q`` is a float or a tensor of any shape; the result is a float64 tensor of that shape.
    Empty, NaN, ``0`` or ``1`` entries raise ``ValueError`` naming ``name`` and the value.

    Examples
    --------
    >>> check_probability([0.05, 0.5, 0.95])
    tensor([0.0500, 0.5000, 0.9500], dtype=torch.float64)
    >>> check_probability(1.0, name="level")
    Traceback (most recent call last):
    ...
    ValueError: level must lie strictly in (0, 1), got level=1.0
    """
    qt = torch.as_tensor(q, dtype=torch.float64)
    if qt.numel() == 0 or bool(((qt <= 0) | (qt >= 1) | torch.isnan(qt)).any()):
        raise ValueError(f"{name} must lie strictly in (0, 1), got {name}={q!r}")
    return qt


def check_level(level: float) -> float:
    """Validate a central interval level in (0, 1) and return it as a float.

    Booleans, non-numbers and values outside the open interval raise ``ValueError``.

    Examples
    --------
    >>> check_level(0.9)
    0.9
    >>> check_level(95)
    Traceback (most recent call last):
    ...
    ValueError: level must be a float in (0, 1), got level=95
    """
    if not isinstance(level, (int, float)) or isinstance(level, bool) or not 0 < level < 1:
        raise ValueError(f"level must be a float in (0, 1), got {level=!r}")
    return float(level)


def recentre(samples: torch.Tensor, center: torch.Tensor, how: str = "mean") -> torch.Tensor:
    r"""Shift each element's samples so that their mean (or median) is ``center``.

    .. math:: \tilde y_s = y_s - m + c, \qquad m = \operatorname{mean}_s y_s \ \text{or}
              \ \operatorname{median}_s y_s,

    per element of ``(B, ...)``: the spread (every difference ``y_s - y_t``, hence the standard
    deviation and the interval widths) is unchanged, the location becomes ``c``. With ``c`` the
    frozen output, stochastic attention then never moves the point prediction.

    Exactness. ``"median"`` is the lower median (:func:`torch.median`, the ``ceil(S/2)``-th
    smallest draw): the draw ``y_k = m`` maps to ``(y_k - m) + c = 0 + c = c``, and a shift keeps
    the order, so ``torch.median`` of the result equals ``center`` bit for bit. ``"mean"`` is
    computed in float64 (``(y_s - m) + c``) and rounded once to the samples' dtype: the mean of
    the result equals ``center`` up to that one rounding (half an ulp of the largest draw in the
    samples' dtype) plus the rounding of the float64 mean (a few ``S`` ulps of float64).

    NOTE(paper): recentring is ours (#20): the paper reports the raw draws, whose mean can drift
    from the frozen output through the network's non-linearity; recentring keeps SA's spread and
    the frozen model's point prediction.

    Parameters
    ----------
    samples
        ``(S, B, ...)`` draws, ``S >= 1``.
    center
        ``(B, ...)`` the location to move to (e.g. ``Predictive.frozen``).
    how
        ``"mean"`` or ``"median"``.

    Returns
    -------
    torch.Tensor
        ``(S, B, ...)`` in the samples' dtype and device.

    Examples
    --------
    >>> import torch
    >>> s = torch.tensor([[1.0], [2.0], [6.0]])  # (S=3, B=1)
    >>> recentre(s, torch.tensor([0.0])).squeeze(-1).tolist()
    [-2.0, -1.0, 3.0]
    >>> recentre(s, torch.tensor([0.0]), how="median").squeeze(-1).tolist()
    [-1.0, 0.0, 4.0]
    """
    if how not in RECENTRE:
        raise ValueError(f"how must be one of {RECENTRE}, got {how=!r}")
    if not isinstance(samples, torch.Tensor) or samples.dim() < 2 or samples.shape[0] < 1:
        raise ValueError(
            f"samples must be a tensor of shape (S, B, ...), got shape="
            f"{getattr(samples, 'shape', None)}"
        )
    if not isinstance(center, torch.Tensor) or center.shape != samples.shape[1:]:
        raise ValueError(
            f"center must have shape samples.shape[1:]={tuple(samples.shape[1:])}, got "
            f"center.shape={tuple(getattr(center, 'shape', ()))}"
        )
    c = center.to(device=samples.device)
    if how == "median":
        m = samples.median(dim=0).values  # (B, ...): an actual draw
        return (samples - m) + c.to(samples.dtype)
    y = samples.to(torch.float64)
    return ((y - y.mean(0)) + c.to(torch.float64)).to(samples.dtype)


@dataclass(frozen=True)
class Predictive:
    """Sample-based predictive distribution.

    Parameters
    ----------
    samples
        ``(S, B, ...)`` Monte Carlo draws of the prediction (``S >= 1``).
    frozen
        ``(B, ...)`` the deterministic output of the unperturbed model, or ``None``.

    Examples
    --------
    >>> import torch
    >>> pred = Predictive(samples=torch.randn(1000, 4, 2))
    >>> pred.interval(0.9)[0].shape
    torch.Size([4, 2])
    """

    samples: torch.Tensor
    frozen: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.samples, torch.Tensor) or self.samples.dim() < 2:
            shape = getattr(self.samples, "shape", None)
            raise ValueError(f"samples must be a tensor of shape (S, B, ...), got shape={shape}")
        if self.samples.shape[0] < 1:
            raise ValueError(f"samples needs at least one draw, got S={self.samples.shape[0]}")
        check_float_tensor(self.samples, "samples")
        check_finite(self.samples, "samples")
        if self.frozen is not None and self.frozen.shape != self.samples.shape[1:]:
            raise ValueError(
                f"frozen must have shape samples.shape[1:]={tuple(self.samples.shape[1:])}, "
                f"got frozen.shape={tuple(self.frozen.shape)}"
            )

    @property
    def n_samples(self) -> int:
        return int(self.samples.shape[0])

    @property
    def mean(self) -> torch.Tensor:
        """``(B, ...)`` sample mean."""
        return self.samples.mean(0)

    def _need_spread(self, what: str) -> None:
        """Refuse a spread (std, interval) of fewer than two draws: one draw has none."""
        if self.n_samples < 2:
            raise ValueError(
                f"{what} needs at least 2 samples (one draw has no spread), got "
                f"S={self.n_samples} (samples.shape={tuple(self.samples.shape)})"
            )

    @property
    def std(self) -> torch.Tensor:
        """``(B, ...)`` sample standard deviation (unbiased; needs ``S >= 2``)."""
        self._need_spread("std")
        return self.samples.std(0, unbiased=True)

    def quantile(self, q: float | torch.Tensor) -> torch.Tensor:
        """Empirical quantile(s) over samples; ``(B, ...)`` for a float, ``(len(q), B, ...)``."""
        qt = check_probability(q).to(self.samples.dtype)
        return torch.quantile(self.samples, qt.to(self.samples.device), dim=0)

    def interval(self, level: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
        """Central ``level`` interval ``(lower, upper)`` from empirical quantiles (``S >= 2``)."""
        level = check_level(level)
        self._need_spread("interval")
        a = (1.0 - level) / 2.0
        return self.quantile(a), self.quantile(1.0 - a)

    def scaled(self, factor: float | torch.Tensor) -> Predictive:
        """Spread the samples about their mean by ``factor`` (conformal/coverage rescaling)."""
        factor = check_scale_factor(factor)
        m = self.mean
        return Predictive(samples=m + (self.samples - m) * factor, frozen=self.frozen)

    def pit(
        self, targets: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """``(B, ...)`` randomised PIT of ``targets`` (:func:`attnuq.metrics.pit_samples`)."""
        from attnuq.metrics import pit_samples

        return pit_samples(self.samples, targets, generator=generator)

    def crps(self, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Fair CRPS of the samples (:func:`attnuq.metrics.crps_samples`; ``S >= 2``)."""
        from attnuq.metrics import crps_samples

        self._need_spread("crps")
        return crps_samples(self.samples, targets, reduction=reduction)  # type: ignore[arg-type]


@dataclass(frozen=True)
class GaussianPredictive:
    """Element-wise normal predictive distribution ``N(mean, std^2)``.

    Examples
    --------
    >>> import torch
    >>> g = GaussianPredictive(mean=torch.zeros(3), std=torch.ones(3))
    >>> round(float(g.interval(0.95)[1][0]), 3)
    1.96
    """

    mean: torch.Tensor
    std: torch.Tensor

    def __post_init__(self) -> None:
        check_float_tensor(self.mean, "mean")
        check_float_tensor(self.std, "std")
        if self.mean.shape != self.std.shape:
            raise ValueError(
                f"mean and std must have the same shape, got {tuple(self.mean.shape)} "
                f"and {tuple(self.std.shape)}"
            )
        check_finite(self.mean, "mean")
        check_finite(self.std, "std")
        if bool((self.std < 0).any()):
            raise ValueError("std must be non-negative")

    def quantile(self, q: float | torch.Tensor) -> torch.Tensor:
        qt = check_probability(q).to(self.mean.dtype).to(self.mean.device)
        z = math.sqrt(2.0) * torch.erfinv(2 * qt - 1)
        if qt.dim() == 0:
            return self.mean + z * self.std
        shape = (-1,) + (1,) * self.mean.dim()
        return self.mean.unsqueeze(0) + z.reshape(shape) * self.std.unsqueeze(0)

    def interval(self, level: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
        level = check_level(level)
        a = (1.0 - level) / 2.0
        return self.quantile(a), self.quantile(1.0 - a)

    def sample(self, n: int, generator: torch.Generator | None = None) -> Predictive:
        """Draw ``n`` samples and return them as a :class:`Predictive`."""
        n = check_positive_int(n, "n")
        eps = torch.randn(
            (n, *self.mean.shape), generator=generator, dtype=self.mean.dtype,
            device=self.mean.device,
        )
        return Predictive(samples=self.mean + eps * self.std, frozen=self.mean)

    def scaled(self, factor: float | torch.Tensor) -> GaussianPredictive:
        return GaussianPredictive(mean=self.mean, std=self.std * check_scale_factor(factor))

    def crps(self, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Closed-form CRPS (:func:`attnuq.metrics.crps_normal`)."""
        from attnuq.metrics import crps_normal

        return crps_normal(self.mean, self.std, targets, reduction=reduction)  # type: ignore[arg-type]

    def nll(self, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Negative log-likelihood (:func:`attnuq.metrics.nll_normal`)."""
        from attnuq.metrics import nll_normal

        return nll_normal(self.mean, self.std, targets, reduction=reduction)  # type: ignore[arg-type]
