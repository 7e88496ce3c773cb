"""The backend registry, above the backends: detection runs the backends in registration order.

Every backend (one module each: :mod:`~attnuq.patching.hf`, :mod:`~attnuq.patching.mha`,
:mod:`~attnuq.patching.rtdl`, :mod:`~attnuq.patching.timm`, :mod:`~attnuq.patching.sdpa`)
implements two things:

* ``detect(name, module) -> AttentionSite | None``: whether it recognises ``module`` as an attention
  site (patchable, or recognisable but not patchable with a reason);
* ``apply(model, sites) -> undo``: install the stochastic attention for the given sites (each with a
  resolved :class:`~attnuq.patching._sites.SiteState`) and return a callable that undoes exactly
  what it did.

Everything the backends install calls :func:`~attnuq.patching._adapter.sampled_sdpa`, the one
adapter onto :func:`attnuq.ops.sampled_attention`. Backends import only the patcher's lower
modules (``_sites``, ``_undo``, ``_install``, ``_adapter``); this module imports them and
registers the built-in ones, and :mod:`attnuq.patching._handle` sits above it.
"""

from __future__ import annotations

from typing import Protocol

from torch import nn

from attnuq.patching import hf, mha, rtdl, sdpa, timm
from attnuq.patching._sites import AttentionSite, SiteState
from attnuq.patching._undo import Undo

__all__ = ["Backend", "find_attention"]


class Backend(Protocol):
    """What a backend module provides (see the module docstring).

    ``detect(name, module)`` returns an :class:`AttentionSite` for a module the backend
    recognises (with a ``reason`` when it cannot patch it) and ``None`` otherwise;
    ``apply(model, sites)`` installs the stochastic attention for ``(module, SiteState)`` pairs
    and returns a callable that undoes exactly that. Backends are tried in registration order
    (:func:`register_backend`); the first claim wins.

    Examples
    --------
    >>> import torch
    >>> from attnuq.patching.mha import BACKEND
    >>> BACKEND.name
    'mha'
    >>> site = BACKEND.detect("attn", torch.nn.MultiheadAttention(8, 2))
    >>> site.name, site.backend, site.num_heads, site.patchable
    ('attn', 'mha', 2, True)
    >>> BACKEND.detect("fc", torch.nn.Linear(8, 8)) is None
    True
    """

    name: str

    def detect(self, name: str, module: nn.Module) -> AttentionSite | None: ...

    def apply(self, model: nn.Module, sites: list[tuple[nn.Module, SiteState]]) -> Undo: ...


_BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    """Add a backend; detection runs in registration order and the first claim wins."""
    _BACKENDS[backend.name] = backend


def get_backend(name: str) -> Backend:
    """The registered backend called ``name`` (the ``backend`` of a site it detected)."""
    return _BACKENDS[name]


# registration order = detection priority: specific adapters before the generic SDPA one
for _mod in (hf, mha, rtdl, timm, sdpa):
    register_backend(_mod.BACKEND)
del _mod


_ATTN_NAME = ("attention", "attn")


def scan(model: nn.Module) -> tuple[list[tuple[AttentionSite, nn.Module]], list[AttentionSite]]:
    """Claimed sites (with their modules) and attention-looking modules no backend claims."""
    backends = _BACKENDS
    claimed: list[tuple[AttentionSite, nn.Module]] = []
    claimed_names: list[str] = []
    lookalike: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name == c or name.startswith(c + ".") for c in claimed_names):
            continue  # inside a claimed site (e.g. MHA.out_proj)
        site = None
        for b in backends.values():
            site = b.detect(name, module)
            if site is not None:
                break
        if site is not None:
            claimed.append((site, module))
            claimed_names.append(name)
        elif any(s in type(module).__name__.lower() for s in _ATTN_NAME):
            lookalike.append((name, module))
    unknown: list[AttentionSite] = []
    for name, module in lookalike:
        # containers of claimed sites (BertAttention around BertSelfAttention) are not sites
        prefix = name + "." if name else ""
        if any(c.startswith(prefix) for c in claimed_names):
            continue
        unknown.append(
            AttentionSite(
                name=name,
                backend="none",
                module_type=type(module).__name__,
                reason="no attnuq backend recognises this class (HF AttentionInterface, "
                "nn.MultiheadAttention, rtdl, timm Attention or a forward calling "
                "F.scaled_dot_product_attention)",
            )
        )
    return claimed, unknown


def find_attention(model: nn.Module) -> list[AttentionSite]:
    """List the attention sites of ``model``: those attnuq can patch and those it cannot.

    Parameters
    ----------
    model : nn.Module
        Any module.

    Returns
    -------
    list of AttentionSite
        In ``named_modules()`` order: first every site a backend claims (``site.reason`` is None
        when patchable, else the reason it is not), then modules whose class name contains
        "Attention"/"Attn" that no backend recognises (``backend="none"``, with the reason).

    Examples
    --------
    >>> import torch
    >>> layer = torch.nn.TransformerEncoderLayer(16, 2, batch_first=True)
    >>> enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    >>> [(s.name, s.backend) for s in find_attention(enc)]
    [('layers.0.self_attn', 'mha'), ('layers.1.self_attn', 'mha')]
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    claimed, unknown = scan(model)
    return [s for s, _ in claimed] + unknown
