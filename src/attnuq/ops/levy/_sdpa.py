"""The fused inference and sentinel paths of Levy attention: one fused attention call per block
of observations, the normaliser from the kernel's log-sum-exp (:func:`_accumulate_lse`) or from
a sentinel key (:func:`_accumulate_sdpa`).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F

from attnuq.ops.levy import _common
from attnuq.ops.levy._common import _centered_values, _ordered_sum
from attnuq.ops.levy._types import _Inputs

_SCRATCH = threading.local()


def _scratch(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised buffer for the no-autograd path, reused by the next call in the same
    thread with the same shape, dtype and device (one buffer kept per thread).

    The fused kernel only reads it during the call that fills it, so reuse is safe; it saves
    allocating (and, with glibc, page-faulting) several MB per call.
    """
    buf: torch.Tensor | None = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.shape != shape or buf.dtype != like.dtype or buf.device != like.device:
        buf = like.new_empty(shape)
        _SCRATCH.buf = buf
    return buf


def _accumulate_sdpa(
    qn: torch.Tensor,
    blocks: list[_Inputs],
    mom_b: list[tuple[torch.Tensor, torch.Tensor | None]],
    ref: torch.Tensor,
    beta: torch.Tensor,
    per_dim: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``z = sum_i e^{beta (cos_i + 1)}`` ``(B, H, Q)`` and the moments ``sum_i p_i v_i``
    ``(B, H, Q, W)`` (``p_i`` the normalised weights; 0 where ``z = 0``).

    Differentiable fused path. ``v_i = [vc_i, sq_i]`` from :func:`_centered_values`. One fused
    ``F.scaled_dot_product_attention`` per block. A *sentinel* key with score
    ``-beta`` and value ``e_0`` is prepended: its output weight ``o = e^{-beta} / (e^{-beta} +
    sum_i e^{beta cos_i})`` gives the normaliser the softmax discards, ``z = (1 - o) / o``, and
    the other output columns times ``1 / o`` give the unnormalised sums. Every observed term
    is ``>= 1`` so ``o <= 1/2`` for a block with an observation (no cancellation). Masked keys get
    score ``-1e4`` (weight exactly 0); ``q``, ``k`` and ``v`` are zero-padded to one width ``Dp``
    because the fused CPU kernel needs equal head dims (a narrower ``v`` is refused by the
    fused kernel). The buffers are laid out ``(B, N, H, Dp)`` in memory and passed as
    ``(B, H, N, Dp)`` views, the layout of the module's projections.
    """
    B, H, Q, E = qn.shape
    dv = mom_b[0][0].shape[-1]
    ws = dv if per_dim else 1
    w_cols = dv + ws
    dp = max(E + 1, w_cols + 1)
    qa = qn.new_empty(B, Q, H, dp).transpose(1, 2)
    qa[..., :E] = qn * beta[:, None, None]
    qa[..., E] = 1.0
    qa[..., E + 1 :] = 0.0
    z_parts, t_parts = [], []
    for blk, (vbar, within) in zip(blocks, mom_b, strict=True):
        bs = blk.k.shape[2]
        # buffers written column by column (no zero-fill of what is overwritten anyway)
        keys = qn.new_empty(B, bs + 1, H, dp).transpose(1, 2)
        keys[:, :, 0, :] = 0.0
        keys[:, :, 0, E] = -beta
        keys[:, :, 1:, :E] = F.normalize(blk.k, dim=-1, eps=1e-12)
        keys[:, :, 1:, E] = torch.where(blk.mask, 0.0, -1e4).to(qn.dtype)[:, None, :]
        keys[:, :, 1:, E + 1 :] = 0.0
        vc, sq = _centered_values(vbar, within, ref, per_dim)
        vals = qn.new_empty(B, bs + 1, H, dp).transpose(1, 2)
        vals[:, :, 0, :] = 0.0
        vals[:, :, 0, 0] = 1.0
        vals[:, :, 1:, 0] = 0.0
        vals[:, :, 1:, 1 : 1 + dv] = vc
        vals[:, :, 1:, 1 + dv : 1 + w_cols] = sq
        vals[:, :, 1:, 1 + w_cols :] = 0.0
        out = F.scaled_dot_product_attention(qa, keys, vals, scale=1.0)  # (B, H, Q, dp)
        o = out[..., 0]
        z_parts.append((1 - o) / o)
        t_parts.append(out[..., 1 : 1 + w_cols] / o[..., None])
    z = _ordered_sum(z_parts)
    return z, _ordered_sum(t_parts) / torch.where(z > 0, z, torch.ones_like(z))[..., None]


def _accumulate_lse(
    qn: torch.Tensor,
    blocks: list[_Inputs],
    mom_b: list[tuple[torch.Tensor, torch.Tensor | None]],
    ref: torch.Tensor,
    beta: torch.Tensor,
    per_dim: bool,
    flash: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``z = sum_i e^{beta cos_i}`` ``(B, H, Q)`` and the moments ``sum_i p_i v_i`` (no autograd;
    ``p_i`` the normalised weights, 0 where ``z = 0``). ``flash``: a kernel with the CPU flash
    kernel's signature to use instead (on CUDA, :func:`attnuq.ops._triton.levy_flash`).

    Inference path of the fused backend: the CPU flash-attention kernel also returns the
    log-sum-exp of the scores, ``lse_q = log sum_i e^{beta cos_qi}``, so the normaliser needs
    no sentinel key and no indicator column: ``z = e^{lse}`` (``Lambda = alpha e^{-beta} z``);
    blocks are combined as ``sum_b (z_b / z) out_b``. Widths: values ``[vc, sq]`` (``2 Dv`` per
    dimension, ``Dv + 1`` for the trace), queries ``[beta qn, 0]`` and keys padded to the same
    width. Keys and values are two overlapping views of ONE buffer per block laid out
    ``[kn | vc | sq]`` per observation: the keys' padding columns are the first value columns
    (finite, and met by the queries' zeros), so nothing is zero-filled and each quantity is
    computed straight into the buffer. Masked keys get an additive ``-1e4`` (weight exactly 0;
    a block with no observation gives ``z = 0``).
    """
    B, H, Q, E = qn.shape
    dv = mom_b[0][0].shape[-1]
    ws = dv if per_dim else 1
    w_cols = dv + ws
    assert w_cols >= E, "queries and keys are padded up to the value width"
    dt = qn.dtype
    qa = qn.new_zeros(B, Q, H, w_cols).transpose(1, 2)
    torch.mul(qn, beta[:, None, None], out=qa[..., :E])
    z_parts, t_parts = [], []
    ref_p = ref.transpose(1, 2)  # (B, 1, H, Dv)
    for blk, (vbar, within) in zip(blocks, mom_b, strict=True):
        bs = blk.k.shape[2]
        # everything below is indexed (B, N, H, .), the memory order of the buffer and of the
        # module's projections: operands with one common order run several times faster
        buf = _scratch(qn, (B, bs, H, E + w_cols))  # [kn | vc | sq] per observation and head
        kp = blk.k.transpose(1, 2)
        # F.normalize(k) = k / max(|k|, eps), computed into the buffer
        nrm = torch.linalg.vector_norm(kp, dim=-1, keepdim=True).clamp_min_(1e-12)
        torch.div(kp, nrm, out=buf[..., :E])
        _centered_values(vbar.transpose(1, 2), None if within is None else within.transpose(1, 2),
                         ref_p, per_dim, out=(buf[..., E : E + dv], buf[..., E + dv :]))
        bias = torch.where(blk.mask, 0.0, -1e4).to(dt)[:, None, None, :]  # (B, 1, 1, bs)
        fl = _common._FLASH if flash is None else flash
        assert fl is not None
        out, lse = fl(qa, buf[..., :w_cols].transpose(1, 2), buf[..., E:].transpose(1, 2),
                      0.0, False, attn_mask=bias, scale=1.0)
        z_parts.append(torch.exp(lse))  # (B, H, Q)
        t_parts.append(out)
    z = _ordered_sum(z_parts)
    zs = torch.where(z > 0, z, torch.ones_like(z))
    # block-weighted mean of the normalised outputs: with one block (or extra blocks holding
    # only masked entries, z_b = 0) the weights are exactly 1 and 0
    return z, _ordered_sum([(zb / zs)[..., None] * ob for zb, ob in zip(z_parts, t_parts,
                                                                        strict=True)])
