"""Hugging Face transformers (5.x) backend: an attention function in ``AttentionInterface``.

How it hooks
------------
Models of transformers 5.x pick their attention kernel per call with
``ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager)`` and build their
masks with ``ALL_MASK_ATTENTION_FUNCTIONS[config._attn_implementation]``. For the block this
backend

1. registers :func:`sampled_attention_forward` under the name ``"attnuq_sampled"`` with
   ``AttentionInterface.register`` and HF's own ``sdpa_mask`` under the same name with
   ``AttentionMaskInterface.register`` (so causal, padding and sliding-window masks are built
   exactly as for SDPA and are never silently dropped);
2. sets ``_attn_implementation_internal = "attnuq_sampled"`` on every config object reached by
   the model (the configs of the attention modules and of every ``PreTrainedModel`` inside).
   The internal attribute is written directly, not through ``set_attn_implementation``, so that
   sub-configs are not rewritten and the exact previous values (instance ``__dict__`` entries)
   come back on removal. The switch is reference-counted per config object
   (:func:`~attnuq.patching._install.set_attr_shared`): models sharing one config (or threads with
   overlapping blocks) each hold it, and the previous value comes back when the last handle
   on that config is removed, in any order. While a config is held, modules that read it but
   are not stochastic sites of an active handle run HF's SDPA attention (below);
3. records each selected attention module with its ``nu`` in a weak map; the registered function
   looks the calling ``module`` up there. Modules that are not selected (``nu=None``) run HF's own
   ``sdpa_attention_forward``, which equals the eager path to float rounding.

The registry entries are added when the first handle using this backend is installed and taken
out again (or put back to what was there) when the last one is removed.

Grouped-query attention (fewer key/value heads than query heads) is passed to the operator with
``enable_gqa=True`` (query head ``h`` reads key/value head ``h // (H / Hkv)``, as ``repeat_kv``).
Models whose attention does not call the interface (their forward computes softmax inline) are
reported by :func:`attnuq.find_attention` as unpatchable.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from attnuq.patching._adapter import sampled_sdpa
from attnuq.patching._install import set_attr_shared
from attnuq.patching._sites import AttentionSite, SiteState, check_no_dropout, forward_names
from attnuq.patching._undo import SharedInstall, Undo, chain

__all__ = ["BACKEND", "IMPLEMENTATION", "sampled_attention_forward"]

#: the name registered in ``AttentionInterface`` and ``AttentionMaskInterface``.
IMPLEMENTATION = "attnuq_sampled"

_STATES: weakref.WeakKeyDictionary[nn.Module, SiteState] = weakref.WeakKeyDictionary()
_SHARED = SharedInstall()

# kwargs with which an HF kernel would change the attention in ways the operator cannot express
_UNSUPPORTED = ("softcap", "s_aux", "sinks", "cu_seq_lens_q", "cu_seq_lens_k")


def sampled_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention function registered as ``"attnuq_sampled"`` (same contract as HF's SDPA one).

    Parameters
    ----------
    module : nn.Module
        The calling attention module (looked up to find its ``nu`` and generator).
    query, key, value : Tensor
        ``(B, H, Lq, D)``, ``(B, Hkv, Lk, D)``, ``(B, Hkv, Lk, Dv)``.
    attention_mask : Tensor or None
        Boolean (True = attend) or additive mask broadcastable to ``(B, H, Lq, Lk)``.
    dropout : float
        Attention dropout; must be 0 (the model in ``eval()`` mode) for a stochastic site.
    scaling : float, optional
        Score scale (default ``1/sqrt(D)``).
    is_causal : bool, optional
        As in HF's SDPA function: used only when there is no mask and ``Lq > 1``.

    Returns
    -------
    tuple
        ``(out, None)`` with ``out`` of shape ``(B, Lq, H, Dv)`` (transposed, as HF expects); the
        attention weights are not returned (``None``, like HF's SDPA function).

    Notes
    -----
    For a selected module each query row ``i`` draws ``W_i ~ Multinomial(nu, pi_i)`` from
    ``pi_i = softmax(scaling * q_i k^T + mask_i)`` and returns ``(W_i / nu) V``
    (:func:`attnuq.ops.sampled_attention`); any other module gets HF's
    ``sdpa_attention_forward`` unchanged.

    Examples
    --------
    The function is normally called by HF models inside :func:`attnuq.stochastic`; a module
    that no handle selected gets HF's SDPA attention:

    >>> import torch
    >>> import torch.nn.functional as F
    >>> q, k, v = torch.randn(3, 1, 2, 5, 4, generator=torch.Generator().manual_seed(0))
    >>> out, weights = sampled_attention_forward(torch.nn.Module(), q, k, v, None,
    ...                                          is_causal=False)
    >>> out.shape, weights  # (B, Lq, H, Dv)
    (torch.Size([1, 5, 2, 4]), None)
    >>> bool(torch.allclose(out, F.scaled_dot_product_attention(q, k, v).transpose(1, 2)))
    True
    """
    state = _STATES.get(module)
    if state is None or state.nu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            is_causal=is_causal, **kwargs,
        )
    site = state.name
    check_no_dropout(float(dropout), site)
    for name in _UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"attnuq's HF attention does not support {name}= (site {site!r}); "
                "leave this site deterministic with nu={'<pattern>': None}"
            )
    q_len = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(q_len > 1 and attention_mask is None and causal)
    if causal and key.shape[2] > q_len:  # static-cache prefill, as HF's SDPA function does
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    position_bias = kwargs.get("position_bias")
    if position_bias is not None:
        from transformers.integrations.sdpa_attention import create_position_bias_mask

        if causal:
            position_bias = position_bias[..., : key.shape[2]]
        attention_mask = create_position_bias_mask(
            position_bias, attention_mask, causal, query, key
        )
        causal = False
    out = sampled_sdpa(
        query,
        key,
        value,
        nu=state.nu,
        attn_mask=attention_mask,
        is_causal=causal,
        scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
        generator=state.generator(query.device),
        site=site,
    )  # (B, H, Lq, Dv)
    return out.transpose(1, 2).contiguous(), None


def _num_heads(module: nn.Module) -> int | None:
    for attr in ("num_heads", "num_attention_heads", "n_heads"):
        v = getattr(module, attr, None)
        if isinstance(v, int):
            return v
    cfg = getattr(module, "config", None)
    v = getattr(cfg, "num_attention_heads", None)
    return v if isinstance(v, int) else None


class _HFBackend:
    name = "hf"

    def detect(self, name: str, module: nn.Module) -> AttentionSite | None:
        cls = type(module)
        if not cls.__module__.startswith("transformers."):
            return None
        names = forward_names(cls)
        if "ALL_ATTENTION_FUNCTIONS" not in names:
            return None
        reason = None
        cfg = getattr(module, "config", None)
        if cfg is None or not hasattr(cfg, "_attn_implementation_internal"):
            reason = "attention module has no .config with _attn_implementation to switch"
        return AttentionSite(
            name=name, backend=self.name, module_type=cls.__name__,
            num_heads=_num_heads(module), reason=reason,
        )

    def apply(self, model: nn.Module, sites: list[tuple[nn.Module, SiteState]]) -> Undo:
        from transformers import PreTrainedModel

        undos: list[Undo] = [_register()]
        try:
            configs: dict[int, Any] = {}
            for m, _ in sites:
                configs[id(m.config)] = m.config
            for m in model.modules():
                if isinstance(m, PreTrainedModel):
                    configs[id(m.config)] = m.config
            for cfg in configs.values():
                undos.append(
                    set_attr_shared(cfg, "_attn_implementation_internal", IMPLEMENTATION)
                )
            for m, st in sites:
                undos.append(_set_state(m, st))
        except BaseException:
            chain(undos)()
            raise
        return chain(undos)


def _set_state(module: nn.Module, state: SiteState) -> Undo:
    _STATES[module] = state

    def undo() -> None:
        if _STATES.get(module) is state:
            del _STATES[module]

    return undo


def _register_implementation() -> Undo:
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    undos: list[Undo] = []
    try:
        for iface, fn in (
            (AttentionInterface, sampled_attention_forward),
            (AttentionMaskInterface, sdpa_mask),
        ):
            g = iface._global_mapping
            had, old = IMPLEMENTATION in g, g.get(IMPLEMENTATION)

            def undo(g: Any = g, had: bool = had, old: Any = old) -> None:
                if had:
                    g[IMPLEMENTATION] = old
                else:
                    g.pop(IMPLEMENTATION, None)

            undos.append(undo)
            iface.register(IMPLEMENTATION, fn)
    except BaseException:
        chain(undos)()
        raise
    return chain(undos)


def _register() -> Undo:
    """Add ``"attnuq_sampled"`` to both HF registries while any handle needs it; the undo."""
    return _SHARED.acquire(IMPLEMENTATION, _register_implementation)


BACKEND = _HFBackend()
