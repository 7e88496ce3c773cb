"""Backend for modules whose ``forward`` calls ``F.scaled_dot_product_attention`` directly.

How it is scoped
----------------
A site is a module whose class's ``forward`` mentions ``scaled_dot_product_attention``
(read from the compiled code's names, after unwrapping decorators), when no more specific backend
claims it. While at least one handle uses this backend, ``torch.nn.functional
.scaled_dot_product_attention`` is replaced by :func:`scoped_sdpa` (and so is a module-level
name ``scaled_dot_product_attention`` in the site class's own Python module when it was imported
by name and is torch's function). The replacement is a pass-through to the genuine function
**unless** the current thread is inside the ``forward`` of a selected site: each site gets a
forward pre-hook that pushes its state on a thread-local stack and a forward hook registered with
``always_call=True`` that pops it (also when the forward raises). Calls from anywhere else -- other
modules, other threads, code outside the model -- are untouched. Inside a site, every SDPA call
(including those of submodules that are not sites themselves) is made stochastic with that
site's ``nu``; the innermost site wins. The original function objects are put back when the
last handle is removed (identity is restored, not a wrapper).

A ``dropout_p > 0`` inside a site is refused (stochastic attention is for inference).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attnuq.patching._adapter import ORIGINAL_SDPA, sampled_sdpa
from attnuq.patching._install import set_attr, track_hook
from attnuq.patching._sites import AttentionSite, SiteState, check_no_dropout, forward_names
from attnuq.patching._undo import SharedInstall, Undo, chain

__all__ = ["BACKEND", "scoped_sdpa"]

_NAME = "scaled_dot_product_attention"
_TLS = threading.local()
_SHARED = SharedInstall()


def _stack() -> list[SiteState | None]:
    st = getattr(_TLS, "stack", None)
    if st is None:
        st = []
        _TLS.stack = st
    return st


def scoped_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Stand-in for ``F.scaled_dot_product_attention`` while a handle is active.

    Same signature and conventions as torch's function. Outside the forward of a selected
    site (see the module docstring) it calls torch's function unchanged; inside it returns the
    stochastic attention :func:`attnuq.patching._adapter.sampled_sdpa` with the site's ``nu``.
    Shapes as in torch: ``query`` ``(B, H, Lq, D)``, ``key``/``value`` ``(B, Hkv, Lk, D)``
    / ``(B, Hkv, Lk, Dv)``; returns ``(B, H, Lq, Dv)``.

    Examples
    --------
    A module whose forward calls ``F.scaled_dot_product_attention`` is an SDPA site:

    >>> import torch
    >>> import torch.nn.functional as F
    >>> import attnuq
    >>> class Attend(torch.nn.Module):
    ...     def forward(self, q, k, v):
    ...         return F.scaled_dot_product_attention(q, k, v)
    >>> attend = Attend().eval()
    >>> q = torch.randn(1, 2, 5, 4, generator=torch.Generator().manual_seed(0))  # (B, H, L, D)
    >>> ref = F.scaled_dot_product_attention(q, q, q)
    >>> with attnuq.stochastic(attend, nu=4, seed=0):
    ...     swapped = F.scaled_dot_product_attention is scoped_sdpa
    ...     inside = attend(q, q, q)  # inside the site: stochastic
    ...     outside = F.scaled_dot_product_attention(q, q, q)  # elsewhere: torch's function
    >>> swapped, bool(torch.equal(inside, ref)), bool(torch.equal(outside, ref))
    (True, False, True)
    >>> F.scaled_dot_product_attention is scoped_sdpa  # put back on exit
    False
    """
    stack = _stack()
    state = stack[-1] if stack else None
    if state is None or state.nu is None:
        return ORIGINAL_SDPA(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
            scale=scale, enable_gqa=enable_gqa,
        )
    check_no_dropout(float(dropout_p), state.name, name="dropout_p", training=state.training)
    stack.append(None)  # nested SDPA calls inside the operator (if any) are genuine
    try:
        return sampled_sdpa(
            query, key, value, nu=state.nu, attn_mask=attn_mask, is_causal=is_causal,
            scale=scale, enable_gqa=enable_gqa, generator=state.generator(query.device),
            site=state.name,
        )
    finally:
        stack.pop()


def _module_binds_name(cls: type) -> str | None:
    mod = sys.modules.get(cls.__module__)
    if mod is not None and mod.__dict__.get(_NAME) is ORIGINAL_SDPA:
        return cls.__module__
    return None


def _replace_global() -> Undo:
    if F.scaled_dot_product_attention is not ORIGINAL_SDPA:
        raise RuntimeError(
            "torch.nn.functional.scaled_dot_product_attention has been replaced by "
            f"someone else ({F.scaled_dot_product_attention!r}); refusing to stack on it"
        )
    return set_attr(F, _NAME, scoped_sdpa)


def _install_global() -> Undo:
    """``F.scaled_dot_product_attention`` -> :func:`scoped_sdpa` while any handle needs it."""
    return _SHARED.acquire(F, _replace_global)


def _install_module(modname: str) -> Undo:
    """The module-level name ``scaled_dot_product_attention`` of ``modname``, likewise."""
    return _SHARED.acquire(
        modname, lambda: set_attr(sys.modules[modname], _NAME, scoped_sdpa)
    )


def _hooks(module: nn.Module, state: SiteState) -> Undo:
    def pre(mod: nn.Module, args: Any) -> None:
        state.training = mod.training  # for the dropout message (one flag per module)
        _stack().append(state)

    def post(mod: nn.Module, args: Any, output: Any) -> None:
        stack = _stack()
        if stack:
            stack.pop()

    undo_pre = track_hook(module, module.register_forward_pre_hook(pre))
    undo_post = track_hook(module, module.register_forward_hook(post, always_call=True))
    return chain([undo_pre, undo_post])


class _SDPABackend:
    name = "sdpa"

    def detect(self, name: str, module: nn.Module) -> AttentionSite | None:
        cls = type(module)
        if _NAME not in forward_names(cls):
            return None
        reason = None
        if getattr(module, "fused_attn", True) is False:
            # timm-style modules: F.sdpa only on the fused path, softmax inline otherwise
            reason = (
                "fused_attn is False, so this module computes softmax inline instead of calling "
                "F.scaled_dot_product_attention; set module.fused_attn = True to patch it"
            )
        return AttentionSite(name=name, backend=self.name, module_type=cls.__name__, reason=reason)

    def apply(self, model: nn.Module, sites: list[tuple[nn.Module, SiteState]]) -> Undo:
        undos: list[Undo] = []
        try:
            active = [(m, st) for m, st in sites if st.nu is not None]
            if active:
                undos.append(_install_global())
                for modname in dict.fromkeys(
                    n for n in (_module_binds_name(type(m)) for m, _ in active) if n
                ):
                    undos.append(_install_module(modname))
            for m, st in active:
                undos.append(_hooks(m, st))
        except BaseException:
            chain(undos)()
            raise
        return chain(undos)


BACKEND = _SDPABackend()
