"""``SampledAttention``: a thin module holding the settings of ``sampled_attention``."""

from __future__ import annotations

import torch
from torch import nn

from attnuq._validation import check_nu, check_positive_int
from attnuq.ops.sampled import EmptyRows, attention_moments, sampled_attention

__all__ = ["SampledAttention"]


class SampledAttention(nn.Module):
    r"""Stochastic attention as a module (no parameters): holds ``nu`` and the options.

    ``forward(q, k, v, attn_mask=None, is_causal=False, scale=None, generator=None)`` returns
    :func:`attnuq.ops.sampled_attention` in training *and* eval mode when ``stochastic`` is True,
    and the deterministic output (the ``nu -> infinity`` limit, computed by
    :func:`attnuq.ops.attention_moments`) when it is False. Shapes follow
    ``F.scaled_dot_product_attention``: ``q`` ``(B, Hq, Lq, D)``, ``k`` ``(B, Hk, Lk, D)``,
    ``v`` ``(B, Hk, Lk, Dv)`` -> ``(B, Hq, Lq, Dv)``. The output has mean ``pi^T V`` and covariance
    ``(1/nu) V^T (diag(pi) - pi pi^T) V`` per query.

    Parameters
    ----------
    nu : int
        Draws per query (``>= 1``).
    enable_gqa : bool
        Grouped-query attention, as in SDPA.
    block_size : int, optional
        Key-blocked (streaming) computation, see :func:`attnuq.ops.sampled_attention`.
    empty_rows : {"error", "zero"}
        Behaviour for queries whose every key is masked.
    stochastic : bool
        When False, return the deterministic attention output instead of a sample.

    Examples
    --------
    >>> import torch
    >>> from attnuq.nn.sampled import SampledAttention
    >>> layer = SampledAttention(nu=8)
    >>> q = k = v = torch.randn(2, 4, 6, 8)
    >>> layer(q, k, v, is_causal=True).shape
    torch.Size([2, 4, 6, 8])
    """

    def __init__(
        self,
        nu: int,
        *,
        enable_gqa: bool = False,
        block_size: int | None = None,
        empty_rows: EmptyRows = "error",
        stochastic: bool = True,
    ) -> None:
        super().__init__()
        self.nu = check_nu(nu)
        self.enable_gqa = bool(enable_gqa)
        self.block_size = (
            None if block_size is None else check_positive_int(block_size, "block_size")
        )
        if empty_rows not in ("error", "zero"):
            raise ValueError(f"empty_rows must be 'error' or 'zero', got {empty_rows=!r}")
        self.empty_rows: EmptyRows = empty_rows
        self.stochastic = bool(stochastic)

    def extra_repr(self) -> str:
        return (
            f"nu={self.nu}, enable_gqa={self.enable_gqa}, block_size={self.block_size}, "
            f"empty_rows={self.empty_rows!r}, stochastic={self.stochastic}"
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        scale: float | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        if not self.stochastic:
            mean, _ = attention_moments(
                q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                enable_gqa=self.enable_gqa, block_size=self.block_size,
                empty_rows=self.empty_rows,
            )
            return mean
        return sampled_attention(
            q, k, v, nu=self.nu, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
            enable_gqa=self.enable_gqa, block_size=self.block_size, generator=generator,
            empty_rows=self.empty_rows,
        )
