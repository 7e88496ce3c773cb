"""Make the attention of a frozen model stochastic for the length of a block.

``with attnuq.stochastic(model, nu=8, seed=0): ...`` or ``handle = attnuq.patch(model, nu=8);
handle.remove()``. Backends (one module each, hooked the way each library allows):

* :mod:`~attnuq.patching.hf` -- Hugging Face transformers 5.x, via ``AttentionInterface`` and
  ``AttentionMaskInterface``;
* :mod:`~attnuq.patching.mha` -- ``torch.nn.MultiheadAttention`` (including the fused fast path of
  ``nn.TransformerEncoder`` in eval mode);
* :mod:`~attnuq.patching.rtdl` -- rtdl-revisiting-models FT-Transformer;
* :mod:`~attnuq.patching.timm` -- timm ``Attention`` and Swin ``WindowAttention`` (fused and
  unfused paths);
* :mod:`~attnuq.patching.sdpa` -- any module whose forward calls ``F.scaled_dot_product_attention``.

:func:`find_attention` lists what was found and what cannot be patched, with the reason;
:func:`resolve` says which ``nu`` each site would get, without patching.

Inside, by responsibility, bottom first (each imports only those above it in this list):
``_undo`` (undo primitives), ``_frozen`` (pickling a patched object stores the frozen one),
``_install`` (attribute, forward and hook changes with their undos), ``_sites`` (sites and
per-site state), ``_nu`` (``nu`` resolved and validated once), ``_adapter`` (the one adapter onto
:func:`attnuq.ops.sampled_attention`), the backends, ``_registry`` (backend registry and
:func:`find_attention`), ``_handle`` (:class:`PatchHandle`, :func:`patch`, :func:`stochastic`).
"""

from attnuq.patching._handle import PatchHandle, patch, resolve, stochastic
from attnuq.patching._registry import find_attention
from attnuq.patching._sites import AttentionSite

__all__ = ["AttentionSite", "PatchHandle", "find_attention", "patch", "resolve", "stochastic"]

