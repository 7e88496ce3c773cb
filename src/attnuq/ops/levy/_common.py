"""Helpers shared by the torch paths of Levy attention: the fixed-size observation blocks,
ordered sums, guarded square roots, centred value rows, and torch's CPU flash-attention kernels.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from attnuq.ops.levy._types import LevyResult, _Inputs


def _split_blocks(inp: _Inputs, block: int) -> list[_Inputs]:
    """Zero masked times, zero-pad the observation axis to a multiple of ``block``, cut it.

    Masked rows of ``k`` and ``a`` are finite (and ``a`` bounded) after :func:`_validate`, so
    anything derived from them is finite; the operator then gives them weight exactly 0.
    """
    n = inp.k.shape[2]
    nb = max(1, -(-n // block))
    pad = nb * block - n
    mask = inp.mask
    k, a = inp.k, inp.a
    times = torch.where(mask, inp.times, 0.0)
    if nb == 1 and not pad:
        return [inp._replace(k=k, a=a, times=times)]
    if pad:
        k = F.pad(k, (0, 0, 0, pad))
        a = F.pad(a, (0, 0, 0, pad))
        times = F.pad(times, (0, pad))
        mask = F.pad(mask, (0, pad), value=False)
    out = []
    for j in range(nb):
        sl = slice(j * block, (j + 1) * block)
        out.append(
            inp._replace(
                k=k[:, :, sl].contiguous(),
                a=a[:, :, sl].contiguous(),
                times=times[:, sl].contiguous(),
                mask=mask[:, sl].contiguous(),
            )
        )
    return out


def _ordered_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    """``xs[0] + xs[1] + ...`` left to right (trailing exact zeros leave the bits unchanged)."""
    acc = xs[0]
    for x in xs[1:]:
        acc = acc + x
    return acc


def _safe_sqrt(x: torch.Tensor) -> torch.Tensor:
    """``sqrt(x)`` for ``x >= 0`` with gradient 0 (instead of inf) where ``x == 0``; NaN
    (an overflowed variance) stays NaN rather than reading as a spread of 0."""
    pos = x > 0
    root = torch.sqrt(torch.where(pos, x, torch.ones_like(x)))
    return torch.where(pos, root, torch.where(torch.isnan(x), x, torch.zeros_like(x)))


def _scores(inp: _Inputs) -> torch.Tensor:
    """``cos(q, k_i)`` ``(B, H, Q, N)`` (masked keys zeroed first)."""
    k = torch.where(inp.mask[:, None, :, None], inp.k, torch.zeros_like(inp.k))
    qn = F.normalize(inp.q, dim=-1, eps=1e-12)
    kn = F.normalize(k, dim=-1, eps=1e-12)
    return qn @ kn.transpose(-1, -2)


def _weights(inp: _Inputs) -> torch.Tensor:
    """``w_qi = alpha exp(beta (cos(q, k_i) - 1))``, 0 for masked ``i``, ``(B, H, Q, N)``, from
    the definition (no max shift, so it underflows for very large ``beta``)."""
    w = inp.alpha[:, None, None] * torch.exp(inp.beta[:, None, None] * (_scores(inp) - 1))
    return torch.where(inp.mask[:, None, None, :], w, torch.zeros_like(w))


def _unit(t: torch.Tensor, broadcast_ok: bool = False) -> torch.Tensor:
    """``t`` itself when its last stride is 1 (or 0 with ``broadcast_ok``), else a contiguous
    copy (what the compiled loops read)."""
    if t.stride(-1) == 1 or t.shape[-1] == 1 or (broadcast_ok and t.stride(-1) == 0):
        return t
    return t.contiguous()


def _centered_values(
    vbar: torch.Tensor,
    within: torch.Tensor | None,
    ref: torch.Tensor,
    per_dim: bool,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``vc = vbar - ref`` and ``sq = vc^2 + s`` (per dimension) or ``|vc|^2 + tr s``.

    With ``out`` the two results are written into the given views (no autograd); the values
    are the same either way (same kernels, same order).
    """
    if out is None:
        vc = vbar - ref  # masked rows: finite, weighted by exactly 0 later
        if per_dim:
            sq = vc * vc if within is None else torch.addcmul(within, vc, vc)
        else:
            sq = torch.linalg.vecdot(vc, vc)[..., None]
            sq = sq if within is None else sq + within
        return vc, sq
    vc, sq = out
    torch.sub(vbar, ref, out=vc)
    if per_dim:
        if within is None:
            torch.mul(vc, vc, out=sq)
        else:
            torch.addcmul(within, vc, vc, out=sq)
    else:
        tr = torch.linalg.vecdot(vc, vc)[..., None]
        sq.copy_(tr if within is None else tr + within)
    return vc, sq


def _empty_result(
    q: torch.Tensor, a: torch.Tensor, per_dim: bool, needs_grad: bool, inputs: tuple[object, ...]
) -> LevyResult:
    """The (empty) result for ``B * H * Q = 0``, attached to the inputs' graph when they need a
    gradient (through an empty slice of each, so no value is read: masked entries may be NaN)."""
    B, H, Q = q.shape[:3]
    z = torch.zeros(B, H, Q, dtype=q.dtype, device=q.device)
    zd = torch.zeros(B, H, Q, a.shape[3], dtype=q.dtype, device=q.device)
    if needs_grad:
        anchor = sum(
            (t.reshape(-1)[:0].sum() for t in inputs
             if isinstance(t, torch.Tensor) and t.requires_grad),
            torch.zeros((), dtype=q.dtype, device=q.device),
        )
        z, zd = z + anchor, zd + anchor
    return LevyResult(mean=zd, var=zd if per_dim else None, evidence=z, p_empty=z + 1.0,
                      phi=z + 1.0, sigma=z, sigma_dim=zd if per_dim else None)


# the CPU flash-attention kernel behind F.scaled_dot_product_attention; it also returns the
# log-sum-exp of the scores (private ATen op: the inference path falls back to the sentinel
# path if a torch build lacks it)
_FLASH: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# the CPU flash kernel's backward (recomputes the weights from q, k and the log-sum-exp)
_FLASH_BWD: Any = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
