"""CRPS of ensembles (fair estimator) and CRPS / NLL of normal predictive distributions."""

from __future__ import annotations

import math

import torch

from attnuq.metrics._checks import (
    Reduction,
    check_pair,
    check_reduction,
    check_samples,
    reduce,
)


def crps_samples(
    samples: torch.Tensor, targets: torch.Tensor, *, reduction: Reduction = "mean"
) -> torch.Tensor:
    r"""Fair (unbiased) CRPS estimator of an ensemble, element-wise.

    .. math:: \mathrm{CRPS}_{fair} = \frac1S \sum_i |x_i - y|
              - \frac{1}{2 S (S - 1)} \sum_{i, j} |x_i - x_j|,

    the unbiased estimator of ``E|X - y| - E|X - X'|/2`` (Ferro 2014), identical to
    ``scoringrules.crps_ensemble(y, x, estimator="fair")``. The double sum is computed from the
    sorted draws: ``sum_{i,j} |x_i - x_j| = 2 sum_i (2 i - S - 1) x_(i)`` (1-based), so the cost
    is ``O(S log S)`` per element.

    Parameters
    ----------
    samples
        ``(S, B, ...)`` with ``S >= 2``.
    targets
        ``(B, ...)``.
    reduction
        ``"mean"`` (0-d tensor over all elements) or ``"none"`` (``(B, ...)``).

    Examples
    --------
    >>> import torch
    >>> round(float(crps_samples(torch.tensor([[0.0], [1.0], [2.0]]), torch.tensor([0.3]))), 6)
    0.233333
    """
    check_reduction(reduction)
    s, y = check_samples(samples, targets, min_samples=2)
    n = s.shape[0]
    term1 = (s - y).abs().mean(0)
    xs = torch.sort(s, dim=0).values
    i = torch.arange(1, n + 1, dtype=s.dtype, device=s.device)
    coef = (2 * i - n - 1).reshape((n,) + (1,) * (s.dim() - 1))
    pair_sum = 2.0 * (coef * xs).sum(0)  # sum_{i,j} |x_i - x_j|
    return reduce(term1 - pair_sum / (2.0 * n * (n - 1)), reduction)


def _check_std(std: torch.Tensor) -> None:
    if bool((std <= 0).any()):
        bad = std[std <= 0][0].item()
        raise ValueError(f"std must be strictly positive, got a value std={bad!r}")


def crps_normal(
    mean: torch.Tensor,
    std: torch.Tensor,
    targets: torch.Tensor,
    *,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    r"""Closed-form CRPS of ``N(mean, std^2)`` at ``targets`` (Gneiting et al. 2005).

    .. math:: \mathrm{CRPS} = \sigma \left[ z (2\Phi(z) - 1) + 2\varphi(z)
              - 1/\sqrt{\pi} \right], \qquad z = (y - \mu)/\sigma.

    Parameters
    ----------
    mean, std, targets
        Same shape ``(B, ...)``; ``std > 0``.
    reduction
        ``"mean"`` or ``"none"``.

    Examples
    --------
    >>> import torch
    >>> round(float(crps_normal(torch.zeros(1), torch.ones(1), torch.zeros(1))), 6)
    0.233695
    """
    check_reduction(reduction)
    mu, sd = check_pair(mean, std, ("mean", "std"))
    mu, y = check_pair(mu, targets, ("mean", "targets"))
    sd = sd.to(mu.dtype)
    _check_std(sd)
    z = (y - mu) / sd
    cdf = 0.5 * (1.0 + torch.erf(z / math.sqrt(2.0)))
    pdf = torch.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    out = sd * (z * (2.0 * cdf - 1.0) + 2.0 * pdf - 1.0 / math.sqrt(math.pi))
    return reduce(out, reduction)


def nll_normal(
    mean: torch.Tensor,
    std: torch.Tensor,
    targets: torch.Tensor,
    *,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    r"""Negative log-likelihood of ``targets`` under ``N(mean, std^2)``.

    .. math:: \mathrm{NLL} = \tfrac12 \ln(2\pi\sigma^2) + \frac{(y - \mu)^2}{2\sigma^2}.

    Examples
    --------
    >>> import torch
    >>> round(float(nll_normal(torch.zeros(1), torch.ones(1), torch.zeros(1))), 6)
    0.918939
    """
    check_reduction(reduction)
    mu, sd = check_pair(mean, std, ("mean", "std"))
    mu, y = check_pair(mu, targets, ("mean", "targets"))
    sd = sd.to(mu.dtype)
    _check_std(sd)
    out = 0.5 * torch.log(2.0 * math.pi * sd * sd) + (y - mu) ** 2 / (2.0 * sd * sd)
    return reduce(out, reduction)
