"""Shared input handling for the sampled-attention operators (private).

Every public operator in :mod:`attnuq.ops.sampled` follows the conventions of
:func:`torch.nn.functional.scaled_dot_product_attention` (SDPA): ``q`` is ``(*batch, Hq, Lq, D)``,
``k`` is ``(*batch, Hk, Lk, D)``, ``v`` is ``(*batch, Hk, Lk, Dv)``; ``attn_mask`` is boolean
(``True`` = take part) or additive and broadcastable to ``(*batch, Hq, Lq, Lk)``; ``is_causal``
keeps key ``j`` for query ``i`` iff ``j <= i`` (top-left aligned, as SDPA when ``Lq != Lk``);
with ``enable_gqa`` query head ``h`` reads key/value head ``h // (Hq // Hk)``.

Internally the query heads that share one key/value head are folded into the query rows, so the
work is a batch of ``G = N * Hk`` *groups* (``N`` = product of the batch dims), each with
``M = R * Lq`` query rows (``R = Hq // Hk``) against its own ``Lk`` keys.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from attnuq._validation import check_finite

__all__ = ["Attn", "compute_dtype", "empty_rows_error", "prepare"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating dtype is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class Attn:
    """Inputs folded into groups. Shapes: ``q`` ``(G, M, D)`` (already multiplied by the scale),
    ``k`` ``(G, Lk, D)``, ``v`` ``(G, Lk, Dv)``, all in the compute dtype."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None  # (N, Hk, R|1, Lq|1, Lk), a broadcast view of the user's mask
    causal: bool
    batch_shape: tuple[int, ...]
    has_head_dim: bool
    n: int
    hk: int
    r: int
    lq: int
    lk: int
    dv: int
    out_dtype: torch.dtype

    @property
    def groups(self) -> int:
        return self.n * self.hk

    @property
    def rows(self) -> int:
        return self.r * self.lq

    @property
    def out_shape(self) -> tuple[int, ...]:
        heads = (self.hk * self.r,) if self.has_head_dim else ()
        return (*self.batch_shape, *heads, self.lq, self.dv)

    def unfold(self, x: torch.Tensor) -> torch.Tensor:
        """``(G, M, ...)`` -> ``(*batch, Hq, Lq, ...)`` (drops the head dim for 2-D inputs)."""
        tail = tuple(x.shape[2:])
        heads = (self.hk * self.r,) if self.has_head_dim else ()
        return x.reshape(*self.batch_shape, *heads, self.lq, *tail)

    def scores(self, g0: int, g1: int, j0: int, j1: int) -> torch.Tensor:
        """Masked scaled scores of groups ``g0:g1`` against keys ``j0:j1``: ``(g, M, j1 - j0)``.

        Masked entries are ``-inf``. Out-of-place, so it is safe under autograd.
        """
        s = torch.bmm(self.q[g0:g1], self.k[g0:g1, j0:j1].transpose(1, 2))  # (g, M, nk)
        g, nk = g1 - g0, j1 - j0
        if self.mask is None and not self.causal:
            return s
        s4 = s.view(g, self.r, self.lq, nk)
        if self.mask is not None:
            idx = torch.arange(g0, g1, device=s.device)
            m = self.mask[..., j0:j1][idx // self.hk, idx % self.hk]  # (g, R|1, Lq|1, nk)
            if m.dtype == torch.bool:
                s4 = s4.masked_fill(~m, float("-inf"))
            else:
                s4 = s4 + m.to(s.dtype)
        if self.causal:
            qi = torch.arange(self.lq, device=s.device).unsqueeze(-1)
            kj = torch.arange(j0, j1, device=s.device)
            s4 = s4.masked_fill(kj > qi, float("-inf"))  # (Lq, nk) broadcast
        return s4.reshape(g, self.rows, nk)


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    *,
    check_values: bool = True,
) -> Attn:
    """Validate SDPA-style inputs and fold them into groups (see the module docstring)."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {name}.dtype={t.dtype}")
        if t.dim() < 2:
            raise ValueError(
                f"{name} must have at least 2 dims (..., L, D), got {name}.shape={tuple(t.shape)}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k and v must share one dtype, got {q.dtype=}, {k.dtype=}, {v.dtype=}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k and v must be on one device, got {q.device=}, {k.device=}, {v.device=}"
        )
    if not (q.dim() == k.dim() == v.dim()):
        raise ValueError(
            "q, k and v must have the same number of dims, got "
            f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must share the last (feature) dim D, got q.shape={tuple(q.shape)} "
            f"and k.shape={tuple(k.shape)}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"k and v must have the same number of keys Lk (dim -2), got k.shape={tuple(k.shape)} "
            f"and v.shape={tuple(v.shape)}"
        )
    if k.shape[:-2] != v.shape[:-2]:
        raise ValueError(
            f"k and v must share batch and head dims, got k.shape={tuple(k.shape)} "
            f"and v.shape={tuple(v.shape)}"
        )
    has_head_dim = q.dim() >= 3
    batch_shape = tuple(q.shape[:-3]) if has_head_dim else ()
    if has_head_dim and tuple(k.shape[:-3]) != batch_shape:
        raise ValueError(
            f"q and k must share the batch dims, got q.shape={tuple(q.shape)} "
            f"and k.shape={tuple(k.shape)}"
        )
    hq = q.shape[-3] if has_head_dim else 1
    hk = k.shape[-3] if has_head_dim else 1
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool, got {enable_gqa=!r}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {is_causal=!r}")
    if hq != hk:
        if not enable_gqa:
            raise ValueError(
                f"q has {hq} heads but k/v have {hk}; pass enable_gqa=True for grouped-query "
                f"attention (q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)})"
            )
        if hk == 0 or hq % hk != 0:
            raise ValueError(
                f"with enable_gqa the number of query heads must be a multiple of the key/value "
                f"heads, got Hq={hq} and Hk={hk}"
            )
    if scale is not None and (not _is_real(scale) or not math.isfinite(float(scale))):
        raise ValueError(f"scale must be None or a finite real number, got {scale=!r}")
    if check_values:
        check_finite(q, "q")
        check_finite(k, "k")
        check_finite(v, "v")

    r = hq // hk if hk else 1
    lq, lk, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    n = math.prod(batch_shape)
    full = (*batch_shape, hq, lq, lk) if has_head_dim else (lq, lk)

    mask5: torch.Tensor | None = None
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(
                f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}"
            )
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(f"attn_mask must be boolean or floating, got {attn_mask.dtype=}")
        if attn_mask.device != q.device:
            raise ValueError(
                f"attn_mask must be on q's device, got {attn_mask.device=}, {q.device=}"
            )
        try:
            ok = torch.broadcast_shapes(attn_mask.shape, full) == torch.Size(full)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(
                f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to the "
                f"attention shape {full} (*batch, Hq, Lq, Lk)"
            )
        if attn_mask.is_floating_point() and check_values:
            bad = torch.isnan(attn_mask) | (attn_mask == float("inf"))
            if bool(bad.any()):
                raise ValueError(
                    f"additive attn_mask must not hold NaN or +inf, got {int(bad.sum())} such "
                    f"entries (use -inf or a boolean mask to exclude keys)"
                )
        m = attn_mask
        while m.dim() < len(full):
            m = m.unsqueeze(0)
        # Keep the Lq and R dims broadcast (size 1) where the user's mask is; expand the rest.
        if has_head_dim:
            m = m.expand(*batch_shape, hq, m.shape[-2], lk)
        else:
            m = m.expand(1, m.shape[-2], lk)
        m = m.reshape(n, hk, r, m.shape[-2], lk)
        mask5 = m

    cdt = compute_dtype(q.dtype)
    sc = float(scale) if scale is not None else 1.0 / math.sqrt(d) if d > 0 else 1.0
    qg = (q.to(cdt) * sc).reshape(n * hk, r * lq, d)
    kg = k.to(cdt).reshape(n * hk, lk, d)
    vg = v.to(cdt).reshape(n * hk, lk, dv)
    return Attn(
        q=qg,
        k=kg,
        v=vg,
        mask=mask5,
        causal=is_causal,
        batch_shape=batch_shape,
        has_head_dim=has_head_dim,
        n=n,
        hk=hk,
        r=r,
        lq=lq,
        lk=lk,
        dv=dv,
        out_dtype=q.dtype,
    )


def empty_rows_error(att: Attn, empty: torch.Tensor) -> ValueError:
    """A ``ValueError`` naming how many query rows have no admissible key and the first one.

    ``empty`` is ``(G, M)`` boolean.
    """
    count = int(empty.sum())
    first = int(torch.nonzero(empty.reshape(-1))[0, 0])
    g, i = divmod(first, att.rows)
    nb, hkv = divmod(g, att.hk)
    rr, qi = divmod(i, att.lq)
    head = hkv * att.r + rr
    where = []
    if att.batch_shape:
        b = torch.unravel_index(torch.tensor(nb), att.batch_shape)
        where.append(f"batch index {tuple(int(x) for x in b)}")
    if att.has_head_dim:
        where.append(f"head {head}")
    where.append(f"query {qi}")
    return ValueError(
        f"{count} query row(s) have every key masked (no key with positive weight), first at "
        f"{', '.join(where)}; pass empty_rows='zero' to return zeros for them "
        f"(what F.scaled_dot_product_attention returns)"
    )
