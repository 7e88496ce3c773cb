"""rtdl-revisiting-models backend (FT-Transformer's ``MultiheadAttention``).

How it hooks
------------
``rtdl_revisiting_models.MultiheadAttention.forward(x_q, x_kv)`` computes
``softmax(q k^T / sqrt(d_head)) v`` inline, so there is no function to swap. Each selected
instance gets an instance ``forward`` (removed on exit) that performs the same projections,
the optional Linformer key/value compression, and replaces the inline softmax-times-values by
:func:`attnuq.patching._adapter.sampled_sdpa`; the output ("mixing") projection ``W_out``
follows as in the original. FT-Transformer's last block may attend from the [CLS] token only
(``x_q = x[:, -1:]``); that is cross-attention here and is supported.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from attnuq.patching._adapter import sampled_sdpa
from attnuq.patching._install import swap_forward
from attnuq.patching._sites import AttentionSite, SiteState, check_no_dropout
from attnuq.patching._undo import Undo, chain

__all__ = ["BACKEND"]


def _rtdl_class() -> type | None:
    try:
        import rtdl_revisiting_models as r
    except Exception:  # pragma: no cover - optional extra
        return None
    return r.MultiheadAttention


def _make_forward(state: SiteState):
    def _rtdl_forward(self: Any, x_q: torch.Tensor, x_kv: torch.Tensor) -> torch.Tensor:
        site = state.name
        if self.training and self.dropout is not None:
            check_no_dropout(float(self.dropout.p), site)
        q, k, v = self.W_q(x_q), self.W_k(x_kv), self.W_v(x_kv)
        if self.key_compression is not None:
            k = self.key_compression(k.transpose(1, 2)).transpose(1, 2)
            comp = self.value_compression
            if comp is None:
                comp = self.key_compression
            v = comp(v.transpose(1, 2)).transpose(1, 2)
        h = self._n_heads
        bsz, n_q = q.shape[0], q.shape[1]
        d_k, d_v = k.shape[-1] // h, v.shape[-1] // h
        # (B, H, L, D)
        q4 = q.reshape(bsz, n_q, h, d_k).transpose(1, 2)
        k4 = k.reshape(bsz, k.shape[1], h, d_k).transpose(1, 2)
        v4 = v.reshape(bsz, v.shape[1], h, d_v).transpose(1, 2)
        out = sampled_sdpa(
            q4, k4, v4, nu=state.nu, scale=1.0 / math.sqrt(d_k),
            generator=state.generator(q.device), site=site,
        )  # (B, H, Lq, Dv)
        x = out.transpose(1, 2).reshape(bsz, n_q, h * d_v)
        if self.W_out is not None:
            x = self.W_out(x)
        return x

    return _rtdl_forward


class _RtdlBackend:
    name = "rtdl"

    def detect(self, name: str, module: nn.Module) -> AttentionSite | None:
        cls = _rtdl_class()
        if cls is None or not isinstance(module, cls):
            return None
        mod: Any = module
        reason = None
        if type(module).forward is not getattr(cls, "forward", None):
            reason = f"{type(module).__name__} overrides rtdl MultiheadAttention.forward"
        return AttentionSite(
            name=name, backend=self.name, module_type=type(module).__name__,
            num_heads=int(mod._n_heads), reason=reason,
        )

    def apply(self, model: nn.Module, sites: list[tuple[nn.Module, SiteState]]) -> Undo:
        undos = [swap_forward(m, _make_forward(st)) for m, st in sites if st.nu is not None]
        return chain(undos)


BACKEND = _RtdlBackend()
