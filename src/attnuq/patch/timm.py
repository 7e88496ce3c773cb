"""timm backend: ``timm.layers.Attention`` (and ``timm.models.vision_transformer.Attention``).

How it hooks
------------
timm's ``Attention.forward`` takes one of two paths: with ``fused_attn`` it calls
``F.scaled_dot_product_attention(q, k, v, attn_mask=..., dropout_p=..., is_causal=...)``;
without, it computes ``softmax(q * scale @ k^T + mask) @ v`` inline. Both are covered by one
per-instance ``forward`` (removed on exit) that repeats timm's steps -- the fused ``qkv``
projection split into ``(B, H, N, head_dim)``, ``q_norm``/``k_norm``, the attention through
:func:`attnuq.patch._core.sampled_sdpa` (SDPA mask conventions: bool True = attend, float added;
``is_causal``), the optional ``norm`` (``scale_norm``), ``proj`` and ``proj_drop`` -- and reads
optional attributes with timm's defaults so that older timm versions (no ``q_norm``, ``norm``,
``head_dim`` or ``attn_mask`` argument) work too.

timm needs torchvision, which cannot be installed beside the CPU torch build used to develop
attnuq, so this backend is tested where timm imports; elsewhere the same call pattern
(fused ``qkv``, SDPA masks) is exercised through HF ViT and through a timm-compatible stand-in
class registered with :func:`register_class`. Codebases that copy timm's ``Attention`` (ClimaX
does) can register their class the same way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attnuq.patch._core import (
    AttentionSite,
    SiteState,
    Undo,
    chain,
    check_no_dropout,
    sampled_sdpa,
    swap_forward,
)

__all__ = ["BACKEND", "register_class"]

_EXTRA: list[type] = []
_REQUIRED = ("qkv", "num_heads", "proj")


def register_class(cls: type) -> None:
    """Treat ``cls`` (a class with timm ``Attention``'s attributes and forward) as timm's.

    ``cls`` must have ``qkv`` (``Linear(dim, 3 * H * head_dim)``), ``num_heads`` and ``proj``;
    ``head_dim``, ``scale``, ``q_norm``, ``k_norm``, ``attn_drop``, ``norm`` and ``proj_drop``
    are used when present. Registration lasts for the process; registering twice is harmless.

    Examples
    --------
    A copy of timm's ``Attention`` (as in ClimaX): without registration the generic SDPA
    backend claims it (and cannot tell its heads); registered, the timm backend does:

    >>> import torch
    >>> import torch.nn.functional as F
    >>> from torch import nn
    >>> import attnuq
    >>> class MyAttention(nn.Module):
    ...     def __init__(self, dim=8, num_heads=2):
    ...         super().__init__()
    ...         self.num_heads = num_heads
    ...         self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
    ...     def forward(self, x):
    ...         B, N, C = x.shape
    ...         qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads)
    ...         q, k, v = qkv.permute(2, 0, 3, 1, 4)  # (B, H, N, head_dim) each
    ...         y = F.scaled_dot_product_attention(q, k, v)
    ...         return self.proj(y.transpose(1, 2).reshape(B, N, C))
    >>> _ = torch.manual_seed(0)
    >>> attn = MyAttention().eval()
    >>> [(s.backend, s.num_heads) for s in attnuq.find_attention(attn)]
    [('sdpa', None)]
    >>> register_class(MyAttention)
    >>> [(s.backend, s.num_heads) for s in attnuq.find_attention(attn)]
    [('timm', 2)]
    >>> x = torch.randn(2, 5, 8)
    >>> with torch.no_grad(), attnuq.stochastic(attn, nu=4, seed=0):
    ...     y = attn(x)
    >>> y.shape, bool(torch.equal(y, attn(x)))
    (torch.Size([2, 5, 8]), False)
    """
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise TypeError(f"cls must be an nn.Module subclass, got {cls!r}")
    if cls not in _EXTRA:
        _EXTRA.append(cls)


def _forward_owner(cls: type) -> type | None:
    for c in cls.__mro__:
        if "forward" in c.__dict__:
            return c
    return None


#: modules that define timm's standard ``Attention`` (new and old locations). Other timm classes
#: that happen to be called ``Attention`` (BEiT's, with relative position bias, ...) compute
#: something else and are left to the other backends.
TIMM_MODULES = frozenset(
    {"timm.layers.attention", "timm.models.vision_transformer", "timm.models.layers.attention"}
)


def _is_timm_attention(cls: type) -> bool:
    owner = _forward_owner(cls)
    if owner is None:
        return False
    if owner in _EXTRA:
        return True
    return owner.__name__ == "Attention" and owner.__module__ in TIMM_MODULES


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _make_forward(state: SiteState):
    def _timm_forward(
        self: Any,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        site = state.name
        drop = getattr(self, "attn_drop", None)
        if self.training and isinstance(drop, nn.Dropout):
            check_no_dropout(float(drop.p), site)
        bsz, n, c = x.shape
        heads = int(self.num_heads)
        head_dim = int(getattr(self, "head_dim", c // heads))
        attn_dim = int(getattr(self, "attn_dim", heads * head_dim))
        qkv = self.qkv(x).reshape(bsz, n, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, H, N, head_dim)
        q = getattr(self, "q_norm", _identity)(q)
        k = getattr(self, "k_norm", _identity)(k)
        scale = getattr(self, "scale", None)
        out = sampled_sdpa(
            q, k, v, nu=state.nu, attn_mask=attn_mask, is_causal=is_causal,
            scale=None if scale is None else float(scale),
            generator=state.generator(q.device), site=site,
        )  # (B, H, N, head_dim)
        y = out.transpose(1, 2).reshape(bsz, n, attn_dim)
        y = getattr(self, "norm", _identity)(y)
        y = self.proj(y)
        return getattr(self, "proj_drop", _identity)(y)

    return _timm_forward


class _TimmBackend:
    name = "timm"

    def detect(self, name: str, module: nn.Module) -> AttentionSite | None:
        cls = type(module)
        if not _is_timm_attention(cls):
            return None
        missing = [a for a in _REQUIRED if not hasattr(module, a)]
        reason = f"timm-style Attention without {missing}" if missing else None
        heads = getattr(module, "num_heads", None)
        return AttentionSite(
            name=name, backend=self.name, module_type=cls.__name__,
            num_heads=heads if isinstance(heads, int) else None, reason=reason,
        )

    def apply(self, model: nn.Module, sites: list[tuple[nn.Module, SiteState]]) -> Undo:
        undos = [swap_forward(m, _make_forward(st)) for m, st in sites if st.nu is not None]
        return chain(undos)


BACKEND = _TimmBackend()
