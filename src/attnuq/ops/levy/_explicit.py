"""The explicit path of Levy attention: scores, the exact maximum over observed keys, ``exp``
and GEMMs (any ``beta``).
"""

from __future__ import annotations

import torch

from attnuq.ops.levy._common import _ordered_sum
from attnuq.ops.levy._types import _Inputs


def _accumulate_explicit(
    qn: torch.Tensor,
    kn_b: list[torch.Tensor],
    vals_b: list[tuple[torch.Tensor, torch.Tensor]],
    blocks: list[_Inputs],
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference path: ``exp(beta cos - M)`` with ``M`` the max over observed keys, then GEMMs.

    Returns ``z`` ``(B, H, Q)``, the weighted sums ``(B, H, Q, W)`` and ``log_scale`` with
    ``Lambda = alpha exp(log_scale) z`` (``log_scale = M - beta``). Works for any ``beta``.
    """
    beta4 = beta[:, None, None]
    qb = qn * beta4
    neg_inf = torch.tensor(float("-inf"), dtype=qn.dtype, device=qn.device)
    scores = [qb @ kn.transpose(-1, -2) for kn in kn_b]  # beta cos, (B, H, Q, bs)
    mx = torch.stack(
        [torch.where(blk.mask[:, None, None, :], sc, neg_inf).amax(-1)
         for blk, sc in zip(blocks, scores, strict=True)],
        dim=-1,
    ).amax(-1, keepdim=True).detach()  # (B, H, Q, 1): exact and order-independent
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    z_parts, t_parts = [], []
    for blk, sc, (vc, sq) in zip(blocks, scores, vals_b, strict=True):
        vb = torch.cat([vc, sq], dim=-1)
        m4 = blk.mask[:, None, None, :]
        e = torch.where(m4, torch.exp(torch.where(m4, sc - mx, 0.0)), 0.0)
        z_parts.append(e.sum(-1))
        t_parts.append(e @ vb)
    return _ordered_sum(z_parts), _ordered_sum(t_parts), mx[..., 0] - beta4[..., 0]
