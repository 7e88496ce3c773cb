"""``torch.nn.MultiheadAttention`` backend: the forward is swapped per instance.

How it hooks
------------
``nn.MultiheadAttention.forward`` is replaced on each selected instance (an instance attribute
``forward``; removed again on exit, or the previous instance attribute put back) by
:func:`_mha_forward`, which does the in-projection, the (stochastic) attention through
:func:`attnuq.patching._adapter.sampled_sdpa` and the out-projection exactly as
``F.multi_head_attention_forward`` does.

``nn.TransformerEncoderLayer`` in ``eval()`` mode normally bypasses ``self_attn.forward``
altogether: its "sparsity fast path" calls ``torch._transformer_encoder_layer_fwd`` with the raw
weights. That fast path is refused by torch whenever any submodule of the layer has a forward
hook, so the backend registers a forward pre-hook on each patched attention (the hook also refuses
nested-tensor inputs with a clear message). ``nn.TransformerEncoder`` additionally converts a
padded batch into a nested tensor on its own fast path; the backend sets ``use_nested_tensor``
to ``False`` on every ``TransformerEncoder`` that contains a patched attention for the block
(the instance attribute is put back on exit). Both are undone exactly by :meth:`PatchHandle.remove`.

Supported: ``batch_first`` either way, unbatched ``(L, E)`` inputs, ``kdim``/``vdim`` different
from ``embed_dim``, ``bias=False``, ``add_bias_kv``, ``add_zero_attn``, ``key_padding_mask``
(bool, True = ignore; or float, added), ``attn_mask`` (bool, True = NOT allowed; or float, added;
2-D ``(L, S)`` or 3-D ``(B*H, L, S)``), ``is_causal`` (a hint that ``attn_mask`` is causal, which
is then used, as in torch), ``need_weights`` and ``average_attn_weights``.

``need_weights=True`` returns the **softmax** weights ``pi`` (averaged over heads when
``average_attn_weights``), i.e. ``E[W/nu]``, not the sampled ``W/nu`` (the operator does not
materialise them). Fully masked query rows give a zero attention output (then the output
projection's bias), as SDPA does, and zero weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnuq.patching._adapter import sampled_sdpa
from attnuq.patching._install import set_attr_shared, swap_forward, track_hook
from attnuq.patching._sites import AttentionSite, SiteState, check_no_dropout
from attnuq.patching._undo import Undo, chain

__all__ = ["BACKEND"]


def _additive(mask: torch.Tensor | None, dtype: torch.dtype, name: str) -> torch.Tensor | None:
    """MHA mask -> additive float mask (bool True = masked out -> -inf)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
            mask, float("-inf")
        )
    if not torch.is_floating_point(mask):
        raise TypeError(f"{name} must be bool or floating point, got {mask.dtype=}")
    return mask.to(dtype)


def _make_forward(state: SiteState):
    def _mha_forward(
        self: nn.MultiheadAttention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        site = state.name
        if query.is_nested or key.is_nested or value.is_nested:
            raise NotImplementedError(f"nested-tensor inputs are not supported (site {site!r})")
        check_no_dropout(self.dropout if self.training else 0.0, site)
        if is_causal and attn_mask is None:
            raise RuntimeError(
                f"MultiheadAttention at {site!r}: is_causal=True needs attn_mask (torch's rule: "
                "is_causal is only a hint that attn_mask is the causal mask)"
            )
        batched = query.dim() == 3
        if not batched:
            if query.dim() != 2:
                raise ValueError(f"query must be 2-D or 3-D, got {query.dim()=} at {site!r}")
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        # (B, L, E)
        bsz, tgt_len, embed_dim = query.shape
        if embed_dim != self.embed_dim:
            raise ValueError(
                f"query has embedding size {embed_dim} but the layer expects {self.embed_dim} "
                f"(site {site!r})"
            )
        heads, head_dim = self.num_heads, self.head_dim
        dtype = query.dtype

        b_q = b_k = b_v = None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        q = F.linear(query, w_q, b_q)
        k = F.linear(key, w_k, b_k)
        v = F.linear(value, w_v, b_v)

        attn = _additive(attn_mask, dtype, "attn_mask")
        kpm = _additive(key_padding_mask, dtype, "key_padding_mask")
        if self.bias_k is not None and self.bias_v is not None:
            k = torch.cat([k, self.bias_k.expand(bsz, 1, -1)], dim=1)
            v = torch.cat([v, self.bias_v.expand(bsz, 1, -1)], dim=1)
            attn = None if attn is None else F.pad(attn, (0, 1))
            kpm = None if kpm is None else F.pad(kpm, (0, 1))
        # (B, H, L, Dh)
        q = q.view(bsz, tgt_len, heads, head_dim).transpose(1, 2)
        k = k.view(bsz, k.shape[1], heads, head_dim).transpose(1, 2)
        v = v.view(bsz, v.shape[1], heads, head_dim).transpose(1, 2)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(bsz, heads, 1, head_dim)], dim=2)
            v = torch.cat([v, v.new_zeros(bsz, heads, 1, head_dim)], dim=2)
            attn = None if attn is None else F.pad(attn, (0, 1))
            kpm = None if kpm is None else F.pad(kpm, (0, 1))
        src_len = k.shape[2]

        mask: torch.Tensor | None = None  # additive, broadcastable to (B, H, Lq, Lk)
        if attn is not None:
            if attn.dim() == 2:
                if attn.shape != (tgt_len, src_len):
                    raise ValueError(
                        f"2-D attn_mask must be ({tgt_len}, {src_len}), got "
                        f"{tuple(attn.shape)} at {site!r}"
                    )
                mask = attn.view(1, 1, tgt_len, src_len)
            elif attn.dim() == 3:
                if attn.shape != (bsz * heads, tgt_len, src_len):
                    raise ValueError(
                        f"3-D attn_mask must be ({bsz * heads}, {tgt_len}, {src_len}), got "
                        f"{tuple(attn.shape)} at {site!r}"
                    )
                mask = attn.view(bsz, heads, tgt_len, src_len)
            else:
                raise ValueError(f"attn_mask must be 2-D or 3-D, got {attn.dim()=} at {site!r}")
        if kpm is not None:
            if kpm.shape != (bsz, src_len):
                raise ValueError(
                    f"key_padding_mask must be ({bsz}, {src_len}), got {tuple(kpm.shape)} "
                    f"at {site!r}"
                )
            kp = kpm.view(bsz, 1, 1, src_len)
            mask = kp if mask is None else mask + kp

        out = sampled_sdpa(
            q, k, v, nu=state.nu, attn_mask=mask, generator=state.generator(q.device), site=site
        )  # (B, H, Lq, Dh)
        out = out.transpose(1, 2).reshape(bsz, tgt_len, embed_dim)
        out = F.linear(out, self.out_proj.weight, self.out_proj.bias)

        weights: torch.Tensor | None = None
        if need_weights:
            s = (q.float() @ k.float().transpose(-2, -1)) * head_dim**-0.5
            if mask is not None:
                s = s + mask.float()
            dead = torch.isneginf(s).all(dim=-1, keepdim=True)
            weights = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
            weights = weights.to(dtype)  # (B, H, Lq, Lk)
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if not batched:
                weights = weights.squeeze(0)
        if not batched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    return _mha_forward


def _refuse_nested(module: nn.Module, args: tuple[object, ...]) -> None:
    """Forward pre-hook: its presence disables TransformerEncoderLayer's fused fast path."""
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_nested:
            raise NotImplementedError(
                "attnuq: a nested tensor reached a patched nn.MultiheadAttention; "
                "nested-tensor inputs are not supported"
            )


class _MHABackend:
    name = "mha"

    def detect(self, name: str, module: nn.Module) -> AttentionSite | None:
        if not isinstance(module, nn.MultiheadAttention):
            return None
        reason = None
        if type(module).forward is not nn.MultiheadAttention.forward:
            reason = f"{type(module).__name__} overrides MultiheadAttention.forward"
        return AttentionSite(
            name=name, backend=self.name, module_type=type(module).__name__,
            num_heads=module.num_heads, reason=reason,
        )

    def apply(self, model: nn.Module, sites: list[tuple[nn.Module, SiteState]]) -> Undo:
        undos: list[Undo] = []
        try:
            patched: list[nn.Module] = []
            for m, st in sites:
                if st.nu is None:
                    continue
                undos.append(swap_forward(m, _make_forward(st)))
                undos.append(track_hook(m, m.register_forward_pre_hook(_refuse_nested)))
                patched.append(m)
            for enc in model.modules():
                if isinstance(enc, nn.TransformerEncoder) and any(
                    any(p is sub for sub in enc.modules()) for p in patched
                ):
                    undos.append(set_attr_shared(enc, "use_nested_tensor", False))
        except BaseException:
            chain(undos)()
            raise
        return chain(undos)


BACKEND = _MHABackend()
