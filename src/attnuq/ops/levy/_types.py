"""Result and argument types of Levy attention (shapes ``(B, H, Q, ...)``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class LevyResult:
    """Output of :func:`levy_attention` (shapes ``(B, H, Q, ...)``; see the module docstring).

    Attributes
    ----------
    mean : ``(B, H, Q, Dv)`` expected output ``mu_q`` (0 for an empty series).
    var : ``(B, H, Q, Dv)`` ``diag Sigma_V(q)``, the covariance of one atom's value
        (``None`` when computed with ``per_dim=False``).
    evidence : ``(B, H, Q)`` ``Lambda_q``.
    p_empty : ``(B, H, Q)`` ``P(N_q = 0) = exp(-Lambda_q)``.
    phi : ``(B, H, Q)`` ``E[1/N_q | N_q >= 1]``.
    sigma : ``(B, H, Q)`` ``sqrt(tr Sigma_V(q) phi(Lambda_q))``.
    sigma_dim : ``(B, H, Q, Dv)`` ``sqrt(Sigma_V,jj(q) phi(Lambda_q))`` (``None`` when
        ``per_dim=False``).
    """

    mean: torch.Tensor
    var: torch.Tensor | None
    evidence: torch.Tensor
    p_empty: torch.Tensor
    phi: torch.Tensor
    sigma: torch.Tensor
    sigma_dim: torch.Tensor | None


class LevySamples(NamedTuple):
    """Explicit draws of the sampled Levy operator, samples first.

    values : ``(S, B, H, Q, Dv)`` ``Y_q`` per draw (0 where ``nonempty`` is False).
    counts : ``(S, B, H, Q)`` int64 atom counts ``N_q``.
    nonempty : ``(S, B, H, Q)`` bool, ``N_q >= 1``.
    """

    values: torch.Tensor
    counts: torch.Tensor
    nonempty: torch.Tensor


class _Args(NamedTuple):
    """The tensor arguments shared by every Levy operator, as given (not yet validated)."""

    q: torch.Tensor
    k: torch.Tensor
    a: torch.Tensor
    times: torch.Tensor
    mask: torch.Tensor
    alpha: float | torch.Tensor
    beta: float | torch.Tensor
    h: float | torch.Tensor
    omega: torch.Tensor | None
    phase: torch.Tensor | None
    D: torch.Tensor | None


class _Call(NamedTuple):
    """The arguments of one :func:`levy_attention` call after its option checks (what the
    eager path and the custom op take; tensors not yet validated)."""

    args: _Args
    per_dim: bool
    block_size: int
    backend: str


class _Inputs(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    a: torch.Tensor
    times: torch.Tensor
    mask: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor
    h: torch.Tensor
    omega: torch.Tensor | None
    phase: torch.Tensor | None
    D: torch.Tensor | None
