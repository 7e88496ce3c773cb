"""The one adapter onto the operator: every backend's stochastic attention calls
:func:`sampled_sdpa` (SDPA conventions, ``(B, H, L, D)``), which calls
:func:`attnuq.ops.sampled.sampled_attention_unchecked` (``nu`` comes validated from
:func:`attnuq.patch`) or, for deterministic heads, the genuine SDPA.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from attnuq.ops._rng import RngSource
from attnuq.ops.sampled import sampled_attention_unchecked

__all__ = ["ORIGINAL_SDPA", "sampled_sdpa"]

#: the genuine ``F.scaled_dot_product_attention``, captured before any backend can replace it.
ORIGINAL_SDPA: Callable[..., torch.Tensor] = F.scaled_dot_product_attention


def _sampled_or_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    nu: int | None,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    generator: RngSource,
) -> torch.Tensor:
    if nu is None:
        return ORIGINAL_SDPA(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
    # nu was validated by attnuq.patch; fully masked rows come back zero (empty_rows="zero")
    return sampled_attention_unchecked(
        q, k, v, nu, attn_mask, is_causal, scale, enable_gqa, None, generator, "zero"
    )


def sampled_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    nu: int | Sequence[int | None] | None,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    generator: RngSource = None,
    site: str = "",
) -> torch.Tensor:
    r"""Stochastic drop-in for ``F.scaled_dot_product_attention`` used by every backend.

    For each query row with softmax weights :math:`\pi = \mathrm{softmax}(s)` over the allowed keys,
    returns :math:`\tfrac{1}{\nu} W V` with :math:`W \sim \mathrm{Multinomial}(\nu, \pi)`
    (:func:`attnuq.ops.sampled_attention`). On top of the operator it handles:

    * per-head ``nu``: a sequence of length ``H``; heads are grouped by their ``nu`` and each group
      is one operator call; a ``None`` entry leaves that head deterministic (genuine SDPA);
    * ``nu=None``: the genuine SDPA (deterministic);
    * fully masked query rows (every key masked): output zero, as ``F.scaled_dot_product_attention``
      returns for them since torch 2.5;
    * inputs with other than 4 dimensions ``(..., L, D)``: flattened to ``(N, 1, L, D)``.

    Parameters
    ----------
    query, key, value : Tensor
        ``(B, H, Lq, D)``, ``(B, Hkv, Lk, D)``, ``(B, Hkv, Lk, Dv)`` (SDPA conventions).
    nu : int, sequence of (int or None) of length H, or None
        Number of draws per query (per head): a site's ``nu`` as :func:`attnuq.patch` resolved
        and validated it (ints ``>= 1``), not checked again here; only the per-head length,
        which depends on the call's shapes, is.
    attn_mask : Tensor, optional
        Boolean (True = attend) or additive float mask broadcastable to ``(B, H, Lq, Lk)``.
    is_causal, scale, enable_gqa : see ``F.scaled_dot_product_attention``.
    generator : torch.Generator, int or None
        Source of randomness (on the device of ``query``): a generator, the key of a registered
        source (what a patched site passes when traced by ``torch.compile``:
        :mod:`attnuq.ops._rng`), or None for the default generator.
    site : str
        Name of the calling site, used in error messages.

    Returns
    -------
    Tensor
        ``(B, H, Lq, Dv)``, dtype of ``value``.

    Examples
    --------
    >>> import torch
    >>> q = k = v = torch.randn(2, 4, 5, 8)
    >>> sampled_sdpa(q, k, v, nu=4).shape
    torch.Size([2, 4, 5, 8])
    """
    if query.dim() != 4:
        lead = query.shape[:-2]
        q4 = query.reshape(-1, 1, *query.shape[-2:])
        k4 = key.expand(*lead, *key.shape[-2:]).reshape(-1, 1, *key.shape[-2:])
        v4 = value.expand(*lead, *value.shape[-2:]).reshape(-1, 1, *value.shape[-2:])
        m4 = None
        if attn_mask is not None:
            me = attn_mask.expand(*lead, query.shape[-2], key.shape[-2])
            m4 = me.reshape(-1, 1, *me.shape[-2:])
        if isinstance(nu, Sequence):
            raise ValueError(
                f"per-head nu needs 4-D (B, H, L, D) inputs at site {site!r}, got "
                f"query.shape={tuple(query.shape)}"
            )
        out = sampled_sdpa(
            q4, k4, v4, nu=nu, attn_mask=m4, is_causal=is_causal, scale=scale,
            generator=generator, site=site,
        )
        return out.reshape(*lead, *out.shape[-2:])

    if nu is None or isinstance(nu, numbers.Integral):
        out = _sampled_or_dense(
            query, key, value, None if nu is None else int(nu), attn_mask, is_causal, scale,
            enable_gqa, generator,
        )
    else:
        heads = query.shape[1]
        nus = tuple(nu)  # type: ignore[arg-type]
        if len(nus) != heads:
            raise ValueError(
                f"per-head nu at site {site!r} has {len(nus)} entries but the layer has "
                f"{heads} heads, got nu={nus}"
            )
        if key.shape[1] != heads:  # grouped-query attention: give every query head its k/v
            rep = heads // key.shape[1]
            key = key.repeat_interleave(rep, dim=1)
            value = value.repeat_interleave(rep, dim=1)
        out = query.new_empty(*query.shape[:-1], value.shape[-1], dtype=value.dtype)
        for n in dict.fromkeys(nus):
            idx = torch.tensor([h for h, x in enumerate(nus) if x == n], device=query.device)
            m: torch.Tensor | None = attn_mask
            if m is not None and m.dim() == 4 and m.shape[1] == heads:
                m = m.index_select(1, idx)
            out[:, idx] = _sampled_or_dense(
                query.index_select(1, idx), key.index_select(1, idx),
                value.index_select(1, idx), n, m, is_causal, scale, False, generator,
            )
    return out
