r"""timm backend: ``timm.layers.Attention`` (ViT, DeiT, ...) and Swin's ``WindowAttention``.

How it hooks
------------
Each claimed module gets a per-instance ``forward`` (removed on exit) that repeats timm's own
steps and sends the attention through :func:`attnuq.patching._adapter.sampled_sdpa` (SDPA
conventions: bool mask True = attend, float mask added to the scores). timm computes the
attention either with ``F.scaled_dot_product_attention`` (``module.fused_attn`` True) or inline,
``softmax(q * scale @ k^T + bias) @ v`` (``fused_attn`` False, also after
``timm.layers.set_fused_attn(False)`` or ``TIMM_FUSED_ATTN=0``); the replacement covers both
paths, so the flag does not matter while the patch is on.

* ``timm.layers.Attention`` (also its older homes ``timm.models.vision_transformer`` and
  ``timm.models.layers.attention``): the fused ``qkv`` projection split into
  ``(B, H, N, head_dim)``, ``q_norm``/``k_norm``, the attention with the caller's
  ``attn_mask``/``is_causal``, the optional ``norm`` (``scale_norm``), the optional sigmoid
  ``gate`` (``gated=True``), ``proj`` and ``proj_drop``. Optional attributes are read with timm's
  defaults so that older versions (no ``q_norm``, ``norm``, ``gate``, ``head_dim`` or
  ``attn_mask`` argument) work too.
* ``timm.models.swin_transformer.WindowAttention`` (Swin v1; timm's default for it is the inline
  path): the scores of window ``w`` get the learned relative position bias
  :math:`B_{h,ij}` (``module._get_rel_pos_bias()``, ``(1, H, N, N)``) and, in shifted blocks, the
  block's window mask :math:`M_{w,ij} \in \{0, -100\}` (``(nW, N, N)``), so each query of head
  ``h`` samples from

  .. math:: \pi_{h,i} = \mathrm{softmax}_j\big(\mathrm{scale}\, q_{h,i} \cdot k_{h,j}
            + B_{h,ij} + M_{w,ij}\big),

  the same weights timm's forward computes. The sum ``B + M`` is handed to the operator as the
  additive float mask, laid out ``(nW * B, H, N, N)`` as timm's fused path lays it out.
  Swin v2 (``swin_transformer_v2``, cosine attention with a log-spaced position MLP) is a
  different class and is not claimed.

Other timm attention classes have steps of their own around the softmax (BEiT's q/v biases and
shared position bias, EVA's rotary embeddings, CaiT's class and talking-heads attention, ...)
and are not claimed here: the SDPA backend patches those whose forward calls
``F.scaled_dot_product_attention`` while ``fused_attn`` is on, and reports them unpatchable
while it is off. Codebases that copy timm's ``Attention`` (ClimaX does) can register their class
with :func:`register_class`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from attnuq.patching._adapter import sampled_sdpa
from attnuq.patching._install import swap_forward
from attnuq.patching._sites import AttentionSite, SiteState, check_no_dropout
from attnuq.patching._undo import Undo, chain

__all__ = ["BACKEND", "register_class"]

_EXTRA: list[type] = []


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

#: (module, class name) of the forward owner -> kind of replacement forward.
_KNOWN: dict[tuple[str, str], str] = {
    **{(m, "Attention"): "attention" for m in TIMM_MODULES},
    ("timm.models.swin_transformer", "WindowAttention"): "window",
}

#: attributes each kind needs (others are read with timm's defaults when missing).
_REQUIRED: dict[str, tuple[str, ...]] = {
    "attention": ("qkv", "num_heads", "proj"),
    "window": ("qkv", "num_heads", "proj", "scale", "_get_rel_pos_bias"),
}


def _kind(cls: type) -> str | None:
    """Which replacement forward serves ``cls`` (None: not a timm site)."""
    owner = _forward_owner(cls)
    if owner is None:
        return None
    if owner in _EXTRA:
        return "attention"
    return _KNOWN.get((owner.__module__, owner.__name__))


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _check_dropout(module: Any, site: str) -> None:
    drop = getattr(module, "attn_drop", None)
    if module.training and isinstance(drop, nn.Dropout):
        check_no_dropout(float(drop.p), site)


def _make_forward(state: SiteState) -> Callable[..., torch.Tensor]:
    """Replacement for ``timm.layers.Attention.forward`` (both paths; see the module doc)."""

    def _timm_forward(
        self: Any,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        site = state.name
        _check_dropout(self, site)
        bsz, n, c = x.shape
        heads = int(self.num_heads)
        head_dim = int(getattr(self, "head_dim", c // heads))
        attn_dim = int(getattr(self, "attn_dim", heads * head_dim))
        gate_layer = getattr(self, "gate", None)
        gate = None if gate_layer is None else gate_layer(x).sigmoid()  # (B, N, attn_dim)
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
        if gate is not None:
            y = y * gate
        y = self.proj(y)
        return getattr(self, "proj_drop", _identity)(y)

    return _timm_forward


def _make_window_forward(state: SiteState) -> Callable[..., torch.Tensor]:
    """Replacement for Swin's ``WindowAttention.forward``: relative position bias plus the
    shifted-window mask as one additive float mask (see the module doc)."""

    def _window_forward(
        self: Any, x: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        site = state.name
        _check_dropout(self, site)
        bw, n, _ = x.shape  # bw = nW * B windows of n tokens
        heads = int(self.num_heads)
        qkv = self.qkv(x).reshape(bw, n, 3, heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (nW * B, H, N, head_dim)
        bias = self._get_rel_pos_bias()  # (1, H, N, N)
        if mask is not None:
            nw = mask.shape[0]  # (nW, N, N), 0 or -100
            if mask.shape[1:] != (n, n) or bw % nw:
                raise ValueError(
                    f"window mask at site {site!r} must be (nW, {n}, {n}) with nW dividing "
                    f"the {bw} windows of the batch, got mask.shape={tuple(mask.shape)}"
                )
            win = mask.view(1, nw, 1, n, n).expand(bw // nw, -1, heads, -1, -1)
            bias = bias + win.reshape(bw, heads, n, n)  # (nW * B, H, N, N)
        out = sampled_sdpa(
            q, k, v, nu=state.nu, attn_mask=bias.to(q.dtype), scale=float(self.scale),
            generator=state.generator(q.device), site=site,
        )  # (nW * B, H, N, head_dim)
        y = self.proj(out.transpose(1, 2).reshape(bw, n, -1))
        return getattr(self, "proj_drop", _identity)(y)

    return _window_forward


_FORWARDS: dict[str, Callable[[SiteState], Callable[..., torch.Tensor]]] = {
    "attention": _make_forward,
    "window": _make_window_forward,
}


class _TimmBackend:
    name = "timm"

    def detect(self, name: str, module: nn.Module) -> AttentionSite | None:
        cls = type(module)
        kind = _kind(cls)
        if kind is None:
            return None
        missing = [a for a in _REQUIRED[kind] if not hasattr(module, a)]
        reason = (
            f"timm-style {cls.__name__} without {missing} (unsupported timm version?)"
            if missing else None
        )
        heads = getattr(module, "num_heads", None)
        return AttentionSite(
            name=name, backend=self.name, module_type=cls.__name__,
            num_heads=heads if isinstance(heads, int) else None, reason=reason,
        )

    def apply(self, model: nn.Module, sites: list[tuple[nn.Module, SiteState]]) -> Undo:
        undos = []
        for m, st in sites:
            kind = _kind(type(m))
            if st.nu is not None and kind is not None:
                undos.append(swap_forward(m, _FORWARDS[kind](st)))
        return chain(undos)


BACKEND = _TimmBackend()
