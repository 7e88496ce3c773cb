"""Sampled attention and its closed-form moments (first, dense version).

NOTE: placeholder-quality dense implementation written to unblock the patching work; the core
issue replaces it with the validated, blocked and benchmarked version.
"""

from __future__ import annotations

import math

import torch

from attnuq._validation import check_finite, check_nu

__all__ = ["attention_moments", "sampled_attention"]


def _probs(
    q: torch.Tensor,
    k: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    lq, lk = q.shape[-2], k.shape[-2]
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(rep, dim=-3)
    s = (q.float() @ k.float().transpose(-2, -1)) * (
        scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    )
    if is_causal:
        causal = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, float("-inf"))
        else:
            s = s + attn_mask.float()
    return torch.softmax(s, dim=-1)


def sampled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    nu: int,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    block_size: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Mean of ``nu`` value rows drawn i.i.d. from each query's softmax weights."""
    nu = check_nu(nu)
    for t, n in ((q, "q"), (k, "k"), (v, "v")):
        check_finite(t, n)
    p = _probs(q, k, attn_mask, is_causal, scale, enable_gqa)
    flat = p.reshape(-1, p.shape[-1])
    idx = torch.multinomial(flat, nu, replacement=True, generator=generator)
    w = torch.zeros_like(flat).scatter_add_(1, idx, torch.ones_like(idx, dtype=flat.dtype))
    w = (w / nu).reshape(p.shape)
    if enable_gqa and v.shape[-3] != q.shape[-3]:
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    return (w @ v.float()).to(v.dtype)


def attention_moments(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    block_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic output and per-dimension value variance ``diag Sigma_V``."""
    p = _probs(q, k, attn_mask, is_causal, scale, enable_gqa)
    if enable_gqa and v.shape[-3] != q.shape[-3]:
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    vf = v.float() if v.dtype != torch.float64 else v
    mean = p.to(vf.dtype) @ vf
    var = (p.to(vf.dtype) @ (vf * vf) - mean * mean).clamp_min(0)
    return mean.to(v.dtype), var.to(v.dtype)
