"""A stochastic-attention model whose perturbation law is known in closed form.

``UniformMHA``: one ``nn.MultiheadAttention`` head with zero queries (so the softmax weights are
uniform, ``pi_j = 1/L``) and identity value/output projections, so the output is the mean of the
``L`` value rows and a stochastic pass is the mean of ``nu`` rows drawn uniformly. The values are
``c`` times ``E`` balanced, mutually orthogonal columns of a Hadamard matrix with random signs per
example: mean ``0`` and value covariance ``Sigma_V = c^2 I_E`` exactly, so
``f_nu - f`` has mean ``0`` and covariance ``(c^2 / nu) I_E`` (METHODS.md: Cov(W/nu)).
Targets ``y = f + sigma * eps`` with ``eps ~ N(0, I_E)``: the perturbation matches the noise at
``nu* = c^2 / sigma^2``.
"""

from __future__ import annotations

import torch
from torch import nn


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


class UniformMHA(nn.Module):
    """Zero queries: uniform attention over the rows of ``v`` ``(B, L, E)``; output ``(B, E)``."""

    def __init__(self, e: int) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(e, 1, bias=False, batch_first=True)
        with torch.no_grad():
            w = torch.cat([torch.zeros(e, e), torch.eye(e), torch.eye(e)])
            self.mha.in_proj_weight.copy_(w)
            self.mha.out_proj.weight.copy_(torch.eye(e))

    def forward(self, v: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        q = torch.zeros(v.shape[0], 1, v.shape[2], dtype=v.dtype)
        return scale * self.mha(q, v, v, need_weights=False)[0][:, 0]


def make_uniform_problem(
    n: int = 256, length: int = 32, e: int = 8, c: float = 4.0, sigma: float = 1.0, seed: int = 0
) -> tuple[UniformMHA, torch.Tensor, torch.Tensor]:
    """Model, values ``(n, L, E)`` and targets ``(n, E)`` with ``nu* = c^2 / sigma^2``."""
    g = torch.Generator().manual_seed(seed)
    h = hadamard(length)[:, 1 : e + 1]  # (L, E): balanced, orthogonal columns
    signs = torch.randint(0, 2, (n, 1, e), generator=g).double() * 2 - 1
    v = (c * h[None] * signs).float()  # (n, L, E)
    model = UniformMHA(e).eval()
    with torch.no_grad():
        f = model(v)
    y = f + sigma * torch.randn(n, e, generator=g)
    return model, v, y
