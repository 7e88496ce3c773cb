"""``SampledAttention``: a thin module holding the settings of ``sampled_attention``."""

from __future__ import annotations

import torch
from torch import nn

from attnuq._validation import check_bool, check_nu, check_positive_int
from attnuq.ops._attn_common import check_empty_rows
from attnuq.ops.sampled import (
    EmptyRows,
    attention_moments_unchecked,
    sampled_attention_unchecked,
)

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

    ``nu``, ``block_size`` and ``empty_rows`` are validated when set (in the constructor or by
    assignment later, with the messages of :func:`attnuq.ops.sampled_attention`), so
    ``forward`` passes them to the operator without checking them again.

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
        self.nu = nu
        self.enable_gqa = check_bool(enable_gqa, "enable_gqa")
        self.block_size = block_size
        self.empty_rows = empty_rows
        self.stochastic = check_bool(stochastic, "stochastic")

    @property
    def nu(self) -> int:
        """Draws per query (an int ``>= 1``, checked when set)."""
        return self._nu

    @nu.setter
    def nu(self, value: int) -> None:
        self._nu = check_nu(value)

    @property
    def block_size(self) -> int | None:
        """Key block size of the streaming computation, or None (checked when set)."""
        return self._block_size

    @block_size.setter
    def block_size(self, value: int | None) -> None:
        self._block_size = None if value is None else check_positive_int(value, "block_size")

    @property
    def empty_rows(self) -> EmptyRows:
        """``"error"`` or ``"zero"`` for queries whose every key is masked (checked when set)."""
        return self._empty_rows

    @empty_rows.setter
    def empty_rows(self, value: EmptyRows) -> None:
        self._empty_rows = check_empty_rows(value)

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
            mean, _ = attention_moments_unchecked(
                q, k, v, attn_mask, is_causal, scale, self.enable_gqa, self._block_size,
                self._empty_rows,
            )  # fmt: skip
            return mean
        return sampled_attention_unchecked(
            q, k, v, self._nu, attn_mask, is_causal, scale, self.enable_gqa, self._block_size,
            generator, self._empty_rows,
        )  # fmt: skip
