r"""Sampled (stochastic) attention and the closed-form moments of its output.

For one query of one head let :math:`\pi = \mathrm{softmax}(s)` be its attention weights over
``Lk`` keys and :math:`V` the ``(Lk, Dv)`` value matrix. Stochastic attention (SA, arXiv
2604.19530) replaces the output :math:`\mu = \pi^\top V` by

.. math:: Y = \frac{1}{\nu} W^\top V, \qquad W \sim \mathrm{Multinomial}(\nu, \pi),

i.e. the mean of ``nu`` value rows drawn i.i.d. from :math:`\pi`. Exactly:

* :math:`E[W/\nu] = \pi`, :math:`\mathrm{Cov}(W/\nu) = (\mathrm{diag}\,\pi - \pi\pi^\top)/\nu`;
* :math:`E[Y] = \mu` and :math:`\mathrm{Cov}(Y) = \frac{1}{\nu} V^\top(\mathrm{diag}\,\pi -
  \pi\pi^\top) V = \Sigma_V / \nu` with :math:`\Sigma_V = \sum_j \pi_j (v_j - \mu)(v_j - \mu)^\top`;
* :math:`\nu \to \infty` recovers the deterministic attention output.

:func:`attention_moments` returns :math:`\mu` and :math:`\mathrm{diag}\,\Sigma_V` in one pass
over the keys. Both functions take ``block_size`` to stream over key blocks without ever holding
an ``Lq x Lk`` probability matrix.

Implementation (dense path, ``block_size=None``): query rows are processed in chunks (a few
heads, or at least 128 queries of one head) whose scores against all keys sit in one reused
buffer (the ``log2(e)`` factor rides on the GEMM's ``alpha``), and each draw is an inverse-CDF
lookup of a uniform drawn for that chunk (``torch.rand(generator=...)``). On CPU a small C kernel
(:mod:`attnuq.ops._native`, compiled on first use; ``ATTNUQ_NATIVE=0`` switches it off) does the
row maximum, ``2^(s - max)``, a blocked CDF and the lookups in one pass per row; elsewhere, or
without a C compiler, torch ops turn the scores in place into an unnormalised CDF
(``cumsum(exp2(s - max))``) searched with ``searchsorted``. Both are exact inverse-CDF draws
from the softmax; they order the keys differently along the CDF, so the same uniforms give
different (equally distributed) draws on the two paths. The value
rows of the draws are summed with ``embedding_bag`` (measured faster here than forming the count
matrix ``W`` and a GEMM ``W V``, even for ``nu >= Lk``) straight into the preallocated output,
once per run of consecutive chunks holding about :data:`_GATHER_ELEMS` indices (one call per
small chunk measured 5-10 % slower), so no tensor of all ``B*H*Lq*nu`` indices or uniforms
exists. A chunk's rows are sized by ``Lk + 2 nu`` (its scores, uniforms and indices), at most
:data:`_CHUNK_MAX_ELEMS` of them, so a chunk stays small for any ``nu``. With ``is_causal``
each query chunk only scores the keys up to its last position. No tensor of
``B*H*Lq*Lk*nu`` (or ``B*H*Lq*Lk``) elements is formed.

Fused CPU kernels (float32). On CPU, with float32 computation (float32, float16 and bfloat16
inputs) and any ``attn_mask`` read in place (float32) or one bias table
(:meth:`Attn.kernel_bias`), both samplers and
:func:`attention_moments` (``block_size=None``, no gradient) run the fused C kernels of
``csrc/fused.c`` instead (:func:`attnuq.ops.native_status` says whether they are in use): each
thread takes a contiguous range of (group, tile) units and packs the keys of each key/value
group it enters once; per tile of 8 query rows (4 on the portable, non-AVX-512 build) a
register-blocked micro-GEMM computes the tile's scores against all keys (key-blocked: one key
block at a time), which then stay in L1/L2 for the row maximum, ``2^(s - max)``, the blocked CDF
and the draws, and the mean of the drawn value rows is written straight into the output (no
``embedding_bag``). The kernels read ``q``, ``k``, ``v`` and the mask's bias in their own ``(N,
H, L, D)`` strides (no grouped copy of, e.g., Hugging Face's transposed ``(B, L, H, D)`` memory)
and write the sampler's output in ``(N, Lq, Hq, Dv)`` memory, returned as an ``(N, Hq, Lq, Dv)``
view as SDPA's CPU kernel does. Their uniforms come from one int64 seed drawn from the
generator: the kernel derives each query row's uniforms from it (a SplitMix64 stream per row),
so no uniform or index tensor exists and the draws do not depend on chunks or threads. The
scores differ from torch's GEMM in rounding only (the scale multiplies ``q`` first); the draws
are exact inverse-CDF draws from the softmax of the scores as computed, as on the other paths.
With a gradient for ``v`` the kernel draws the indices and ``embedding_bag`` gathers them.
Float64, a per-query mask larger than the bias table allows, or
:func:`attnuq.ops._native.unfused` take the paths above.

Sizes. Every call first estimates the bytes it will allocate (the output, one chunk, the
gather buffer; with a gradient for ``v`` every index) and refuses, before allocating anything,
a call that needs more than the memory budget (:func:`max_bytes`: ``$ATTNUQ_MAX_BYTES``,
default 4 GiB), saying how many bytes it needs. One ``embedding_bag`` call never receives
``2**31`` indices or more: torch's CPU kernel counts a call's indices in a C ``int`` (in
``fbgemm_spmdm_report_error_`` and the int32 offsets of int32 indices) and fails with
``Expected i < index_size`` past that, on one thread, where one range covers every bag. Hence
``nu <= MAX_NU = 2**31 - 1``. Masks enter as additive biases in log2
units: the ``attn_mask`` bias is the ``C`` input of the scores GEMM (``beta = 1``), and a mask
that is the same for every query (key padding, also when materialised as ``(B, 1, Lq, Lk)``)
is one ``(G, Lk)`` bias for the whole call.

Key-blocked path (``block_size`` given): chunks of query rows stream over key blocks, and without
a gradient for ``v`` the value rows are gathered into the output as on the dense path, so no
``(B*H*Lq, nu)`` tensor exists: besides the output, the working memory is that of one chunk,
``O(rows * (block_size + nu))``, and the gather buffer. When ``v`` requires a gradient the
backward of ``embedding_bag`` needs every drawn index, so both paths keep all of them (and
gather them in calls of fewer than ``2**31`` indices).

Uniforms are taken from the generator chunk by chunk (and, blocked, key block by key block), so
which uniform serves which draw depends on the chunking. The chunking is a deterministic function
of the shapes, ``nu``, ``is_causal`` and ``block_size``, so the same generator state gives the
same draws. (On CPU, without ``is_causal``, the dense path's draws do not even depend on the
chunking: its chunks are whole groups or row blocks of one group in order, and consecutive
``torch.rand`` calls continue one serial stream. With ``is_causal`` a chunk is the same row block
of several groups, which changes the order.)

Inputs are checked for NaN/inf with one sum per tensor (a finite sum proves all entries finite;
otherwise an exact count is made for the message); an additive mask by one sum (below ``+inf``
proves no NaN and no ``+inf``). On the fused path ``q`` and ``k`` are checked by the kernel as
it reads them (the same message follows).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
import torch.nn.functional as F

from attnuq._validation import check_finite, check_nu, check_positive_int
from attnuq.ops import _native, _rng, _triton
from attnuq.ops._attn_common import (
    _MAX_BYTES_ENV,
    MAX_NU,
    Attn,
    EmptyRows,
    check_empty_rows,
    empty_rows_error,
    max_bytes,
    prepare,
)

__all__ = ["MAX_NU", "EmptyRows", "attention_moments", "max_bytes", "sampled_attention"]

_T = TypeVar("_T")
Chunk = tuple[int, int, int, int]  # (g0, g1, i0, i1): rows i0:i1 of groups g0:g1

# Dense path: elements of the score/CDF buffer per chunk (about L2-sized: the CDF is searched
# while still in cache) and the fewest query rows per chunk (keeps the GEMM efficient for long Lk).
_DENSE_CHUNK_ELEMS = 1 << 19
_DENSE_MIN_ROWS = 128
# Blocked path: elements per chunk, ``rows * (block_size + nu)``.
_BLOCKED_CHUNK_ELEMS = 1 << 20
_BLOCKED_MIN_ROWS = 64
# Blocked sampling: elements per chunk, ``rows * (block_size + nu)``. Smaller than the moments'
# budget: the key-blocked sampler is the low-memory path (1 MiB of float32 per chunk; measured
# about 10 % slower than 4 MiB chunks at B=8, H=8, L=512).
_BLOCKED_SAMPLE_ELEMS = 1 << 18
# Either sampler: most elements (scores + uniforms + indices) per chunk, whatever ``min_rows``
# asks for (64 MiB of float32); a chunk is one query row at the least.
_CHUNK_MAX_ELEMS = 1 << 24
# Gather: consecutive chunks' indices are summed by one embedding_bag call once they hold this
# many (int32: 16 MiB); one call per small chunk measured 5-10 % slower at B, H, L, D = 8, 8,
# 512, 64, nu = 8 than a single call.
_GATHER_ELEMS = 1 << 22
# ... or once their gathered rows would exceed this many elements (4 MiB of float32): the
# embedding_bag result is a temporary copied into the output, so without this cap it is as large
# as the output itself whenever the indices fit (measured: 32 MiB at B, H, L, D = 1, 8, 16384, 64,
# nu = 16, the whole working set of the blocked path)
_GATHER_OUT_ELEMS = 1 << 20
# Most indices one embedding_bag call may receive: torch's CPU kernel counts them in a C int
# (hence MAX_NU, :mod:`attnuq.ops._attn_common`).
_MAX_BAG_INDICES = MAX_NU


def _check_budget(att: Attn, nu: int, block_size: int | None, keep_all: bool, what: str) -> None:
    """Refuse, before anything is allocated, a call whose estimated allocation exceeds
    :func:`max_bytes` (the message names the bytes and their parts), and ``nu > MAX_NU``."""
    parts = _estimate_bytes(att, nu, block_size, keep_all)
    need = sum(parts.values())
    budget = max_bytes()
    if need > budget:
        detail = ", ".join(f"{k} {v:,}" for k, v in parts.items() if v)
        raise ValueError(
            f"{what} with {nu=} needs about {need:,} bytes ({need / 2**30:.3g} GiB: {detail}), "
            f"more than the memory budget of {budget:,} bytes ({budget / 2**30:.3g} GiB); lower "
            f"nu or the batch, pass block_size, or raise the budget with "
            f"{_MAX_BYTES_ENV}=<bytes>"
        )
    if nu > MAX_NU:
        raise ValueError(
            f"nu must be at most MAX_NU = 2**31 - 1 (one query's draws go to one embedding_bag "
            f"call, which counts its indices in 32 bits), got {nu=}"
        )


def _estimate_bytes(
    att: Attn, nu: int, block_size: int | None, keep_all: bool
) -> dict[str, int]:
    """Bytes a call allocates besides its inputs, by part (an upper estimate from the shapes and
    the chunk plan; ``keep_all``: every drawn index is held, as for a gradient or
    :func:`_draw`)."""
    es = att.q4.element_size()  # compute dtype
    ies = 4 if att.index_dtype == torch.int32 else 8
    g, m, lk, dv = att.groups, att.rows, att.lk, att.dv
    parts = {"output": g * m * dv * (es + att.out_dtype.itemsize)}
    if g * m == 0 or lk == 0 or dv == 0:
        return parts
    blocked = block_size is not None and block_size < lk
    if blocked:
        assert block_size is not None
        chunks = _blocked_chunks(att, nu, block_size)
        per_row = block_size * es + nu * (2 * es + 3 * ies + 1)  # scores; u, x, choice, local, take
    else:
        chunks = _dense_chunks(att, nu)
        per_row = lk * es + nu * (es + ies)  # scores; uniforms (scaled in place), indices
    rows = max((g1 - g0) * (i1 - i0) for g0, g1, i0, i1 in chunks)
    parts["one chunk"] = rows * per_row
    if keep_all:
        # every index, and embedding_bag's int64 bookkeeping of them (offset2bag, backward)
        parts["all indices"] = g * m * nu * (ies + 8)
    else:
        # indices of earlier chunks waiting for the gather (at most _GATHER_ELEMS; the current
        # chunk's are counted above), their concatenation, and the gathered rows
        held = min(g * m * nu, _GATHER_ELEMS)
        parts["gather"] = held * ies * 2 + min(g * m, held // nu + rows) * dv * es
    return parts


def _dense_chunks(att: Attn, nu: int) -> list[Chunk]:
    """Query chunks of the dense sampler: rows sized by ``Lk + 2 nu`` elements (scores,
    uniforms, indices), at least ``min(M, 128)`` (an efficient scores GEMM for long ``Lk``) but
    never more than :data:`_CHUNK_MAX_ELEMS` elements (one row at the least). With ``is_causal``
    and ``Lq > 128``: blocks of ~``Lq/4`` rows of several groups, each seeing only the keys up
    to its last position (for ``Lq <= 128`` a block would be a whole sequence anyway: no key
    saved, and chunks of whole groups save the per-chunk overhead)."""
    per_row = att.lk + 2 * nu
    cap = max(1, _CHUNK_MAX_ELEMS // per_row)
    causal = max(_DENSE_MIN_ROWS, att.lq // 4) if att.causal and att.lq > _DENSE_MIN_ROWS else None
    max_rows = cap if causal is None else min(causal, cap)
    return att.chunks(per_row, _DENSE_CHUNK_ELEMS, _DENSE_MIN_ROWS, max_rows, batch_groups=True)


def _blocked_chunks(att: Attn, nu: int, block_size: int) -> list[Chunk]:
    """Query chunks of the key-blocked sampler: ``rows * (block_size + nu)`` about
    :data:`_BLOCKED_SAMPLE_ELEMS` (at least :data:`_BLOCKED_MIN_ROWS` rows), at most
    :data:`_CHUNK_MAX_ELEMS` elements (one row at the least)."""
    per_row = block_size + nu
    cap = max(1, _CHUNK_MAX_ELEMS // per_row)
    return att.chunks(per_row, _BLOCKED_SAMPLE_ELEMS, _BLOCKED_MIN_ROWS, cap)


def _check_block_size(block_size: object) -> int | None:
    if block_size is None:
        return None
    return check_positive_int(block_size, "block_size")


def _exp2_cdf_(
    s: torch.Tensor, keep_max: list[torch.Tensor] | None = None, shift: bool = True
) -> torch.Tensor:
    """In place: scores (log2 units) -> unnormalised CDF ``cumsum(2^(s - max))`` along keys.

    Rows whose every score is ``-inf`` become all zeros (their maximum is replaced by 0). The
    row maxima ``(..., 1)`` are appended to ``keep_max`` when given. ``shift=False`` skips the
    maximum (the caller has proved ``|s| <= 64``)."""
    if not shift:
        return torch.exp2(s, out=s).cumsum_(-1)
    mx = s.amax(-1, keepdim=True).nan_to_num_(neginf=0.0)
    if keep_max is not None:
        keep_max.append(mx)
    torch.exp2(s.sub_(mx), out=s)
    return s.cumsum_(-1)


@torch.no_grad()
def _sample_dense(
    att: Attn, nu: int, generator: torch.Generator | None, empty: torch.Tensor
) -> Iterator[tuple[Chunk, torch.Tensor]]:
    """Dense inverse-CDF draws, query chunk by query chunk (the C kernel on CPU when available,
    else ``cumsum`` + ``searchsorted``).

    Yields ``(chunk, idx)`` with ``idx`` ``(g, rows, nu)`` (local key indices, dtype
    :attr:`Attn.index_dtype`, a fresh tensor the caller may modify) and writes the chunk's rows of
    ``empty`` ``(G, M)``. The uniforms are drawn chunk by chunk (``(g, rows, nu)`` each), in the
    order of :meth:`Attn.chunks`: no ``(G, M, nu)`` tensor of uniforms. The chunking is a
    deterministic function of the shapes (and ``is_causal``). Without ``is_causal`` the chunks
    come group-major, row-minor, and on CPU the generator fills consecutive calls from one serial
    stream, so the draws equal those of a single ``(G, M, nu)`` call whatever the chunking. With
    ``is_causal`` and ``Lq > 128`` a chunk is one block of query rows of several groups
    (``batch_groups``: one batched GEMM instead of one per group), each seeing only the keys up
    to its last position.
    """
    dev, dt = att.q.device, att.q.dtype
    lk = att.lk
    use_i32 = att.index_dtype == torch.int32
    chunks = _dense_chunks(att, nu)
    cap = max((g1 - g0) * (i1 - i0) for g0, g1, i0, i1 in chunks) * lk
    buf = torch.empty(cap, dtype=dt, device=dev)
    # the compiled kernel (CPU): max, 2^(s - max), blocked CDF and lookups in one pass per row
    native = dev.type == "cpu" and _native.available()
    # Torch path: |s_ij| <= |q_i| |k_j| * scale (Cauchy-Schwarz, log2 units). When that bound is
    # <= 64 everywhere and the mask is boolean (or absent), 2^s stays in the normal range
    # without subtracting the row maximum, which saves two passes over the scores. The cheap
    # bound D max|q| max|k| from the input check is tried first, the row norms only when it fails.
    shift = True
    if not native and (att.mask is None or att.mask.dtype == torch.bool):
        qk = att.qk_bound
        if qk is None or not qk * abs(att.scale) <= 64.0:
            qk = float(att.q.norm(dim=-1).amax() * att.k.norm(dim=-1).amax())
        shift = not qk * abs(att.scale) <= 64.0
    for g0, g1, i0, i1 in chunks:
        g, rows = g1 - g0, i1 - i0
        nk = att.causal_keys(i0, i1)
        b = buf[: g * rows * nk].view(g, rows, nk)
        att.scores(g0, g1, i0, i1, 0, nk, out=b)
        u = torch.rand((g, rows, nu), generator=generator, device=dev, dtype=dt)
        if native:
            ic = torch.empty(g, rows, nu, dtype=att.index_dtype, device=dev)
            em = torch.empty(g * rows, dtype=torch.bool, device=dev)
            _native.sample_rows(b.view(g * rows, nk), u.view(g * rows, nu), ic.view(-1, nu), em)
            empty[g0:g1, i0:i1] = em.view(g, rows)
            yield (g0, g1, i0, i1), ic
            continue
        c = _exp2_cdf_(b, shift=shift)
        empty[g0:g1, i0:i1] = c[..., -1] == 0
        # u < 1 is a float of the same precision as the total (a normal number: >= 1 with the
        # shift, >= 2^-64 without), so u * total < total after rounding: no key past the last
        # one of positive mass can be returned. The clamp only guards rows of zero total mass
        # (flagged empty).
        ic = torch.searchsorted(c, u.mul_(c[..., -1:]), right=True, out_int32=use_i32)
        yield (g0, g1, i0, i1), ic.clamp_max_(nk - 1)


@torch.no_grad()
def _sample_blocked(
    att: Attn,
    nu: int,
    block_size: int,
    generator: torch.Generator | None,
    empty: torch.Tensor,
) -> Iterator[tuple[Chunk, torch.Tensor]]:
    """Draws streaming over key blocks; yields ``(chunk, idx)`` like :func:`_sample_dense`.

    Each draw keeps a running choice. With running log-mass ``L`` of the keys seen so far and
    block log-mass ``l_b``, the choice is replaced by a draw from the block (inverse CDF within it)
    with probability ``p_b = 2^(l_b - L')``, ``L' = logaddexp2(L, l_b)`` (log2 units). By
    induction the choice after block ``b`` is distributed as the softmax restricted to blocks
    ``1..b``, so after the last block it is an exact draw from the full softmax. One uniform ``u``
    per draw and block serves both the coin (``u < p_b``) and, given replacement, the position
    within the block (``u / p_b`` is then uniform on ``[0, 1)``).

    Memory: one chunk of ``rows`` query rows at a time, ``rows * (block_size + nu)`` at most
    :data:`_BLOCKED_SAMPLE_ELEMS` (at least :data:`_BLOCKED_MIN_ROWS` rows): the block scores
    ``(rows, block_size)`` and a few ``(rows, nu)`` tensors (uniforms, running choice). No
    tensor of ``G * M * nu`` (or ``M * Lk``) elements is formed. The uniforms are drawn per chunk
    and key block, so the draws depend on the chunking, which is a deterministic function of the
    shapes, ``nu`` and ``block_size``: the same generator state gives the same draws.
    """
    dev, dt = att.q.device, att.q.dtype
    lk = att.lk
    # largest float below 1 in the compute dtype: keeps u / p_b < 1 after rounding, so that
    # (u / p_b) * total < total and a key of zero mass is never returned
    below_one = 1.0 - torch.finfo(dt).eps / 2
    idt = att.index_dtype
    use_i32 = idt == torch.int32
    chunks = _blocked_chunks(att, nu, block_size)
    cap = max((g1 - g0) * (i1 - i0) for g0, g1, i0, i1 in chunks) * block_size
    buf = torch.empty(cap, dtype=dt, device=dev)
    # the compiled kernel (CPU): per block and row, max, 2^(s - max), the block CDF, the running
    # log-mass and every draw's coin and lookup in one pass (csrc/sample_rows.c)
    native = dev.type == "cpu" and _native.available()
    for g0, g1, i0, i1 in chunks:
        g, rows = g1 - g0, i1 - i0
        run = torch.full((g, rows, 1), float("-inf"), dtype=dt, device=dev)  # log2-mass so far
        choice = torch.zeros(g, rows, nu, dtype=idt, device=dev)
        if native:
            run_flat, choice_flat = run.view(g * rows), choice.view(g * rows, nu)
            for j0 in range(0, lk, block_size):
                j1 = min(lk, j0 + block_size)
                b = buf[: g * rows * (j1 - j0)].view(g, rows, j1 - j0)
                att.scores(g0, g1, i0, i1, j0, j1, out=b)
                u = torch.rand((g, rows, nu), generator=generator, device=dev, dtype=dt)
                _native.sample_block(
                    b.view(g * rows, j1 - j0), u.view(g * rows, nu), run_flat, choice_flat, j0
                )
            empty[g0:g1, i0:i1] = (run == float("-inf")).squeeze(-1)
            yield (g0, g1, i0, i1), choice
            continue
        for j0 in range(0, lk, block_size):
            j1 = min(lk, j0 + block_size)
            b = buf[: g * rows * (j1 - j0)].view(g, rows, j1 - j0)
            att.scores(g0, g1, i0, i1, j0, j1, out=b)
            bmax: list[torch.Tensor] = []
            c = _exp2_cdf_(b, bmax)  # unnormalised block CDF, in place
            lb = c[..., -1:].log2().add_(bmax[0])  # block log2-mass (-inf if all masked)
            new_run = torch.logaddexp2(run, lb)
            # replacement probability; 0 for an empty block (NaN from -inf - -inf included)
            p = torch.exp2(lb - new_run).nan_to_num_(nan=0.0)
            run = new_run
            u = torch.rand((g, rows, nu), generator=generator, device=dev, dtype=dt)
            take = u < p  # (g, rows, nu)
            x = u.div_(p).clamp_max_(below_one).mul_(c[..., -1:])
            local = torch.searchsorted(c, x, right=True, out_int32=use_i32)
            local = local.clamp_max_(j1 - j0 - 1).add_(j0)
            choice = torch.where(take, local, choice)
        empty[g0:g1, i0:i1] = (run == float("-inf")).squeeze(-1)
        yield (g0, g1, i0, i1), choice


def _fused_bias(att: Attn) -> tuple[bool, torch.Tensor | None, bool]:
    """``(applies, bias, natural)``: whether the fused float32 kernels of
    :mod:`attnuq.ops._native` take this call (CPU, float32 computation, the kernels loaded and
    switched on, any mask read in place or one bias table: :meth:`Attn.kernel_bias`), the bias
    ``(N, Hk, R | 1, Lq | 1, Lk)`` (or None) and whether it is a float mask in natural units
    (else log2)."""
    if not (att.q4.device.type == "cpu" and att.q4.dtype == torch.float32
            and _native.fused_available()):
        return False, None, False
    if att.mask is None:
        return True, None, False
    bias, natural = att.kernel_bias()
    if bias is None:
        return False, None, False
    return True, bias, natural


def _fused_inputs(att: Attn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``q``, ``k`` with unit feature stride, and the value rows ``(w, offs, step)`` of
    :meth:`Attn.value_rows` (``w`` with unit last stride, ``offs`` ``(G,)`` int64)."""
    q = att.q if att.q.stride(-1) == 1 else att.q.contiguous()
    k = att.k if att.k.stride(-1) == 1 else att.k.contiguous()
    w, offs, step = att.value_rows()
    if att.dv and w.stride(-1) != 1:
        w = w.contiguous()
    return q, k, w, offs.reshape(-1).to(torch.int64), step


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    fused_ok: bool,
) -> tuple[Attn, bool]:
    """``(att, deferred)``: :func:`prepare`'s folding of the inputs, and whether the check of
    ``q`` and ``k`` for NaN/inf is left to the fused kernel, which reads every entry of both
    anyway (it reports one; the caller then runs :func:`_check_values`). Deferred only when
    ``fused_ok`` (the caller will take the fused path if :func:`_fused_bias` agrees), no tensor
    is empty and
    the fused kernels take the call; ``v`` is then checked here by one sum, as :func:`prepare`
    does (an additive mask is checked by :func:`prepare` in every case). Otherwise
    :func:`prepare` checks everything as usual."""
    tensors = all(isinstance(t, torch.Tensor) for t in (q, k, v))
    if (
        fused_ok and tensors and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and (attn_mask is None or isinstance(attn_mask, torch.Tensor))
        and min(q.numel(), k.numel(), v.numel()) > 0 and _native.fused_available()
    ):
        # a float32 mask is read in place by the kernels (Attn.kernel_bias), whatever its rows
        dedup = attn_mask is None or attn_mask.dtype != torch.float32
        att = prepare(q, k, v, attn_mask, is_causal, scale, enable_gqa, check_values=False,
                      dedup=dedup)
        if _fused_bias(att)[0]:
            if not math.isfinite(v.sum(dtype=att.q4.dtype).item()):
                _check_values(q, k, v)
            return att, True
    return prepare(q, k, v, attn_mask, is_causal, scale, enable_gqa), False


def _check_values(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise :func:`attnuq._validation.check_finite`'s error for the first of ``q``, ``k``,
    ``v`` holding NaN/inf (as :func:`prepare` does; nothing when all are finite)."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        check_finite(t, name)


def _sample_fused(
    att: Attn,
    nu: int,
    block_size: int | None,
    generator: torch.Generator | None,
    empty: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
    idx: torch.Tensor | None = None,
    bias_natural: bool = False,
) -> bool:
    """The dense (``block_size`` None or ``>= Lk``) or key-blocked sampler in the fused kernel:
    scores tile by tile, draws and (into ``out`` ``(N, Hq, Lq, Dv)`` float32, any strides with
    a unit last one) the mean drawn value rows, and/or the drawn keys into ``idx``
    ``(G, M, nu)``; fills ``empty``. ``q``, ``k`` and ``v`` are read in their own layout.
    Returns whether every entry of ``q`` and ``k`` was finite.

    One seed is drawn from ``generator`` (an int64); the kernel derives every uniform from it,
    the row and the draw (one SplitMix64 stream per query row, ``csrc/fused.c``), so the same
    generator state gives the same draws, whatever the threads, and no tensor of uniforms
    exists (the key-blocked sampler needs one uniform per draw and key block)."""
    lk = att.lk
    block = block_size if block_size is not None and block_size < lk else 0
    seed = int(torch.randint(0, 2**63 - 1, (1,), generator=generator, dtype=torch.int64))
    return _native.fused_call_4d(
        "sample", att.q4, att.k4, att.v4(), att.scale, bias, att.causal, empty, seed=seed,
        nu=nu, block=block, out=out, idx=idx, bias_natural=bias_natural,
    )  # fmt: skip


def _draw_chunks(
    att: Attn,
    nu: int,
    block_size: int | None,
    generator: torch.Generator | None,
    empty: torch.Tensor,
) -> Iterator[tuple[Chunk, torch.Tensor]]:
    """The dense or key-blocked draws (``att.lk >= 1``), chunk by chunk; fills ``empty``."""
    if block_size is None or block_size >= att.lk:
        return _sample_dense(att, nu, generator, empty)
    return _sample_blocked(att, nu, block_size, generator, empty)


def _draw(
    att: Attn,
    nu: int,
    block_size: int | None,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All draws at once: ``idx`` ``(G, M, nu)`` (dtype :attr:`Attn.index_dtype`) and ``empty``
    ``(G, M)``. For tests, :func:`_sample_indices` and the autograd path only; the forward
    without gradient consumes :func:`_draw_chunks` chunk by chunk instead."""
    dev = att.q4.device
    empty = torch.ones(att.groups, att.rows, dtype=torch.bool, device=dev)
    if att.lk == 0:
        return torch.zeros(att.groups, att.rows, nu, dtype=torch.long, device=dev), empty
    idx = torch.empty(att.groups, att.rows, nu, dtype=att.index_dtype, device=dev)
    fused, bias, natural = _fused_bias(att)
    if fused:
        _sample_fused(att, nu, block_size, generator, empty, bias, idx=idx, bias_natural=natural)
        return idx, empty
    for (g0, g1, i0, i1), ic in _draw_chunks(att, nu, block_size, generator, empty):
        idx[g0:g1, i0:i1] = ic
    return idx, empty


def _sample_indices(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Private: the key indices drawn by :func:`sampled_attention` (for tests and benchmarks).

    The seed is drawn from ``generator`` as :func:`sampled_attention_unchecked` draws it, so the
    same generator state gives the indices behind :func:`sampled_attention`.

    Returns ``idx`` ``(*batch, Hq, Lq, nu)`` int64 and ``empty`` ``(*batch, Hq, Lq)`` bool
    (rows with every key masked; their indices are meaningless).
    """
    nu = check_nu(nu)
    block_size = _check_block_size(block_size)
    att = prepare(q, k, v, attn_mask, is_causal, scale, enable_gqa)
    _check_budget(att, nu, block_size, True, "_sample_indices")
    dev = att.q4.device
    gen = _rng.generator_from_seed(_rng.draw_seed(_rng.resolve(generator, dev), dev), dev)
    idx, empty = _draw(att, nu, block_size, gen)
    return att.unfold(idx.long()), att.unfold(empty.unsqueeze(-1)).squeeze(-1)


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
    empty_rows: EmptyRows = "error",
) -> torch.Tensor:
    r"""Stochastic attention: the mean of ``nu`` value rows drawn i.i.d. from the softmax weights.

    For every query (and head) with weights :math:`\pi = \mathrm{softmax}(q K^\top \cdot
    \mathrm{scale} + \mathrm{mask})` this returns :math:`Y = W^\top V / \nu` with
    :math:`W \sim \mathrm{Multinomial}(\nu, \pi)`, so that

    * :math:`E[Y] = \pi^\top V` (the ordinary attention output, exactly),
    * :math:`\mathrm{Cov}(Y) = \frac{1}{\nu} V^\top(\mathrm{diag}\,\pi - \pi\pi^\top)V`
      (from :math:`E[W/\nu] = \pi` and
      :math:`\mathrm{Cov}(W/\nu) = (\mathrm{diag}\,\pi - \pi\pi^\top)/\nu`).

    The closed-form mean and per-dimension variance are :func:`attention_moments` (divide its
    ``var`` by ``nu``). Draws are independent across queries, heads and batch entries.

    Parameters
    ----------
    q : Tensor
        Queries ``(*batch, Hq, Lq, D)`` (also ``(Lq, D)``), float32, float64, float16 or bfloat16.
    k : Tensor
        Keys ``(*batch, Hk, Lk, D)``, same dtype and device as ``q``.
    v : Tensor
        Values ``(*batch, Hk, Lk, Dv)``.
    nu : int
        Number of draws per query, ``>= 1``.
    attn_mask : Tensor, optional
        Boolean (``True`` = key takes part) or additive float mask broadcastable to
        ``(*batch, Hq, Lq, Lk)``, as in :func:`torch.nn.functional.scaled_dot_product_attention`.
    is_causal : bool
        Query ``i`` sees keys ``j <= i`` (top-left aligned when ``Lq != Lk``, like SDPA). May be
        combined with ``attn_mask`` (both apply; SDPA itself refuses the combination).
    scale : float, optional
        Score scale, default ``1 / sqrt(D)``.
    enable_gqa : bool
        Grouped-query attention: ``Hq`` a multiple of ``Hk``; query head ``h`` uses key/value
        head ``h // (Hq // Hk)``.
    block_size : int, optional
        Stream over key blocks of this size (a running categorical choice per draw, exact in
        distribution), never holding an ``Lq x Lk`` matrix: besides the output, the working
        memory is that of one chunk of ``rows`` queries, ``O(rows * (nu + block_size))`` with
        ``rows * (nu + block_size)`` about ``2**18`` elements, independent of ``Lk``. ``None``
        (default) is the dense path (faster), which holds the scores, uniforms and indices of
        one chunk of queries against all keys (``rows * (Lk + 2 nu)`` about ``2**19`` elements,
        at least 128 rows when that fits in ``2**24`` elements, at least one row). Without a
        gradient for ``v`` neither path holds the ``(B, H, Lq, nu)`` drawn indices; with one,
        both do (the backward needs them). On CPU in float32 both run the fused kernels
        (module docstring), which hold per thread one key/value group's packed keys and the
        scores of a tile of 8 query rows against all keys (dense) or one key block (blocked).
    generator : torch.Generator, optional
        Source of the uniforms; the same generator state (and the same arguments) gives the same
        draws (the fused CPU kernels draw one seed from it and derive the uniforms from it).
        CUDA tensors (float16, bfloat16, float32, no gradient for ``v``) take the Triton
        kernel when triton imports (:mod:`attnuq.ops._triton`): it draws one seed from the
        generator, and its draws differ from the CPU paths' (the same distribution).
    empty_rows : {"error", "zero"}
        What to do with a query whose every key is masked: ``"error"`` (default) raises a
        ``ValueError`` naming the count and the first ``(batch, head, query)``; ``"zero"`` returns
        a zero row, which is what ``F.scaled_dot_product_attention`` returns for such rows in
        torch 2.5+ (checked on 2.13), e.g. for left-padded queries. A row is empty only when
        every key is excluded by ``False`` or a ``-inf`` bias; a large finite bias such as
        ``torch.finfo(dtype).min`` is an ordinary score (uniform weights, as in SDPA).

    Returns
    -------
    Tensor
        ``(*batch, Hq, Lq, Dv)`` in the dtype of ``q`` (empty for ``Dv = 0``). Sampling runs in
        float32 (float64 for float64 inputs). Differentiable with respect to ``v`` (the
        sampled counts are constants); no gradient flows to ``q`` or ``k``.

    Raises
    ------
    ValueError
        Bad shapes, dtypes or values (NaN/inf), an empty row with ``empty_rows="error"``;
        ``nu > MAX_NU``; a call whose estimated allocation (output, one chunk, the gather
        buffer, with a gradient every index) exceeds the memory budget :func:`max_bytes`
        (``$ATTNUQ_MAX_BYTES``, default 4 GiB), refused before anything is allocated, with the
        bytes it needs and the budget in the message.

    Examples
    --------
    >>> import torch
    >>> from attnuq.ops import sampled_attention
    >>> q, k, v = torch.randn(3, 2, 4, 5, 8).unbind(0)  # (B=2, H=4, L=5, D=8)
    >>> g = torch.Generator().manual_seed(0)
    >>> y = sampled_attention(q, k, v, nu=8, is_causal=True, generator=g)
    >>> y.shape
    torch.Size([2, 4, 5, 8])
    >>> torch.allclose(y[..., 0, :], v[..., 0, :])  # the first query can only see key 0
    True
    """
    return sampled_attention_unchecked(
        q, k, v, check_nu(nu), attn_mask, is_causal, scale, enable_gqa,
        _check_block_size(block_size), generator, check_empty_rows(empty_rows),
    )  # fmt: skip


def sampled_attention_unchecked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    nu: int,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    block_size: int | None,
    generator: _rng.RngSource,
    empty_rows: EmptyRows,
) -> torch.Tensor:
    """:func:`sampled_attention` for callers that validated ``nu``, ``block_size`` and
    ``empty_rows`` at their own public boundary (:func:`attnuq.patch`,
    :class:`attnuq.nn.SampledAttention`): ``nu`` an int ``>= 1``, ``block_size`` None or an int
    ``>= 1``, ``empty_rows`` ``"error"`` or ``"zero"``; they are not checked again. The tensors
    are (by :func:`~attnuq.ops._attn_common.prepare`).

    Randomness (:mod:`attnuq.ops._rng`): one seed is drawn from ``generator`` (a
    ``torch.Generator``, a registered source key, or None for the default generator) and seeds
    the private generator of every uniform of the call. Traced (``torch.compile``,
    ``torch.export``), the call is the custom op ``attnuq::sampled_attention`` and the seed comes
    from ``attnuq::next_seed``: the same generator state gives the same draws as eagerly."""
    v_grad = torch.is_grad_enabled() and bool(getattr(v, "requires_grad", 0))
    if isinstance(q, torch.Tensor) and _rng.tracing(q):
        seed = _rng.seed_tensor(generator, q)
        return _sampled_op(
            q, k, v, attn_mask, seed, nu, is_causal, scale, enable_gqa, block_size, empty_rows,
            v_grad,
        )  # fmt: skip
    dev = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    gen = _rng.generator_from_seed(_rng.draw_seed(_rng.resolve(generator, dev), dev), dev)
    return _sampled_impl(
        q, k, v, nu, attn_mask, is_causal, scale, enable_gqa, block_size, gen, empty_rows,
        not v_grad,
    )  # fmt: skip


def _sampled_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    nu: int,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    block_size: int | None,
    generator: torch.Generator | None,
    empty_rows: EmptyRows,
    allow_triton: bool,
) -> torch.Tensor:
    """The sampler itself, every uniform from ``generator`` (eager; the custom op's body).
    ``allow_triton``: CUDA tensors may take the Triton kernel (only without a gradient for
    ``v``: its draws differ from the torch path's, which the backward recomputes)."""
    if isinstance(q, torch.Tensor) and allow_triton and _triton.usable(q, False):
        return _triton.sampled_attention_unchecked(
            q, k, v, nu=nu, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa, generator=generator, empty_rows=empty_rows,
        )  # fmt: skip
    v_grad = torch.is_grad_enabled() and bool(getattr(v, "requires_grad", 0))
    att, deferred = _prepare(q, k, v, attn_mask, is_causal, scale, enable_gqa, not v_grad)
    if att.groups * att.rows == 0 or att.lk == 0:
        if att.groups * att.rows > 0 and empty_rows == "error":  # no keys at all
            raise empty_rows_error(att, torch.ones(att.groups, att.rows, dtype=torch.bool))
        return torch.zeros(att.out_shape, dtype=att.out_dtype, device=q.device)
    if att.dv == 0:  # nothing to average: the empty output SDPA returns
        return torch.zeros(att.out_shape, dtype=att.out_dtype, device=q.device)
    g, m, dv = att.groups, att.rows, att.dv
    grad = torch.is_grad_enabled() and att.v_src.requires_grad
    _check_budget(att, nu, block_size, grad, "sampled_attention")
    if grad:
        # value j of group g is row offs[g] + j * step of w (a view of v's memory when possible)
        w, offs, step = att.value_rows()
        # All indices (G, M, nu) at once, then the gather: the backward of embedding_bag needs
        # every index anyway (and one dense gradient for v beats one per chunk). The gather runs
        # in calls of fewer than 2**31 indices (torch's CPU kernel counts them in a C int).
        idx, empty = _draw(att, nu, block_size, generator)
        has_empty = bool(empty.any())
        if has_empty and empty_rows == "error":
            raise empty_rows_error(att, empty)
        if step != 1:
            idx.mul_(step)
        flat = idx.add_(offs).view(g * m, nu)  # global row of v, in place (idx is ours)
        per_call = max(1, _MAX_BAG_INDICES // nu)  # bags per embedding_bag call
        pieces = [F.embedding_bag(f, w, mode="sum") for f in flat.split(per_call)]
        out = (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).view(g, m, dv)  # (G, M, Dv)
        out = out * (1.0 / nu)
        if has_empty:
            out = out.masked_fill(empty.unsqueeze(-1), 0.0)
        return att.unfold(out).to(att.out_dtype)
    # No gradient: the value rows of each run of chunks are gathered as soon as their indices
    # are drawn, straight into the output; besides it, the memory is that of one chunk and the
    # gather buffer (no (G, M, nu) tensor).
    empty = torch.empty(g, m, dtype=torch.bool, device=q.device)
    fused, bias, natural = _fused_bias(att)
    if fused:  # scores, draws and the gather in one compiled pass (float32)
        # the output in (N, Lq, Hq, Dv) memory, returned as an (N, Hq, Lq, Dv) view, as
        # F.scaled_dot_product_attention's CPU kernel does: callers that transpose it back to
        # (B, L, H * Dv) (Hugging Face, timm) then copy nothing
        hq = att.hk * att.r
        res = torch.empty(att.n, att.lq, hq, dv, device=q.device).transpose(1, 2)
        if not _sample_fused(att, nu, block_size, generator, empty, bias, out=res,
                             bias_natural=natural) and deferred:
            _check_values(q, k, v)  # the kernel saw NaN/inf in q or k: raises
        # rows with no admissible key are zero already (the kernel writes them so)
        if empty_rows == "error" and bool(empty.any()):
            raise empty_rows_error(att, empty)
        return res.to(att.out_dtype).view(att.out_shape)
    out = torch.empty(g, m, dv, dtype=att.out_dtype, device=q.device)
    w, offs, step = att.value_rows()
    with torch.no_grad():
        _gather(_draw_chunks(att, nu, block_size, generator, empty), w, offs, step, nu, out)
    if bool(empty.any()):
        if empty_rows == "error":
            raise empty_rows_error(att, empty)
        out.masked_fill_(empty.unsqueeze(-1), 0.0)
    return att.unfold(out)


def _gather(
    draws: Iterator[tuple[Chunk, torch.Tensor]],
    w: torch.Tensor,
    offs: torch.Tensor,
    step: int,
    nu: int,
    out: torch.Tensor,
) -> None:
    """Write the mean drawn value row of every chunk's queries into ``out`` ``(G, M, Dv)``.

    ``draws`` yields ``(chunk, idx)`` with local key indices ``idx`` ``(g, rows, nu)`` (modified
    in place). Consecutive chunks are collected until they hold :data:`_GATHER_ELEMS` indices (or
    :data:`_GATHER_OUT_ELEMS` gathered elements) and then summed by one ``embedding_bag`` call;
    a call never receives more indices than that plus one chunk's, far below ``2**31`` (one
    chunk holds at most :data:`_CHUNK_MAX_ELEMS` elements, or one row of ``nu <= MAX_NU``
    draws).
    """
    pending: list[tuple[Chunk, torch.Tensor]] = []
    held = 0
    max_bags = max(1, _GATHER_OUT_ELEMS // max(1, w.shape[1]))

    def flush() -> None:
        flats = [f for _, f in pending]
        flat = flats[0] if len(flats) == 1 else torch.cat(flats)
        y = F.embedding_bag(flat, w, mode="sum").mul_(1.0 / nu)  # (bags, Dv)
        r0 = 0
        for (g0, g1, i0, i1), f in pending:
            r1 = r0 + f.shape[0]
            out[g0:g1, i0:i1] = y[r0:r1].view(g1 - g0, i1 - i0, -1)  # cast to the output dtype
            r0 = r1
        pending.clear()

    for chunk, ic in draws:
        g0, g1 = chunk[0], chunk[1]
        if step != 1:
            ic.mul_(step)
        flat = ic.add_(offs[g0:g1]).view(-1, nu)  # (g * rows, nu) global rows of w
        if pending and (
            held + flat.numel() > _GATHER_ELEMS or (held + flat.numel()) // nu > max_bags
        ):
            flush()
            held = 0
        pending.append((chunk, flat))
        held += flat.numel()
    if pending:
        flush()


def _moments(att: Attn, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online-softmax moments over key blocks: mean, var ``(G, M, Dv)`` and empty ``(G, M)``.

    Per chunk of query rows: running max ``m`` (log2 units, no gradient: any shift cancels),
    normaliser ``l = sum_j 2^(s_j - m)``, ``a1 = sum_j 2^(s_j - m) vc_j`` and
    ``a2 = sum_j 2^(s_j - m) vc_j^2``, rescaled by ``2^(m_old - m_new)`` when the max grows.
    Values are centred on their unweighted mean per group (``vbar``) to limit cancellation in
    ``E[v^2] - E[v]^2``; the shift cancels exactly (variance is shift-invariant).
    """
    dt = att.q.dtype
    lk, dv = att.lk, att.dv
    nb = min(block_size, lk)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (att.q, att.k, att.v))
    vbar = att.v.mean(dim=1, keepdim=True)  # (G, 1, Dv)
    vc = att.v - vbar
    ones = torch.ones(*vc.shape[:-1], 1, dtype=dt, device=vc.device)
    # one GEMM per block gives sum e*vc, sum e*vc^2 and sum e (the normaliser)
    vv = torch.cat([vc, vc * vc, ones], dim=-1)  # (G, Lk, 2 Dv + 1)
    means, vars_, empties = [], [], []
    for g0, g1, i0, i1 in att.chunks(nb + 2 * dv, _BLOCKED_CHUNK_ELEMS, _DENSE_MIN_ROWS):
        run_max: torch.Tensor | None = None
        acc: torch.Tensor | None = None
        for j0 in range(0, lk, nb):
            j1 = min(lk, j0 + nb)
            s = att.scores(g0, g1, i0, i1, j0, j1)  # (g, rows, nk)
            with torch.no_grad():
                bm = s.amax(-1, keepdim=True)
                new_max = bm if run_max is None else torch.maximum(run_max, bm)
                shift = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
            # masked keys -> 0; in place when no gradient is recorded
            e = torch.exp2(s - shift) if grad else torch.exp2(s.sub_(shift), out=s)
            blk = torch.bmm(e, vv[g0:g1, j0:j1])  # (g, rows, 2 Dv + 1)
            if acc is None:
                acc = blk
            else:
                assert run_max is not None
                with torch.no_grad():
                    fin = torch.isfinite(run_max)
                    old = torch.where(fin, run_max, torch.zeros_like(run_max))
                    alpha = torch.where(fin, torch.exp2(old - shift), torch.zeros_like(old))
                acc = acc * alpha + blk if grad else acc.mul_(alpha).add_(blk)
            run_max = new_max
        assert acc is not None
        a1, a2, l_acc = acc[..., :dv], acc[..., dv : 2 * dv], acc[..., 2 * dv :]
        emp = ~(l_acc > 0)  # (g, rows, 1)
        denom = torch.where(emp, torch.ones_like(l_acc), l_acc)
        mc = a1 / denom
        var = (a2 / denom - mc * mc).clamp_min(0.0)
        zero = torch.zeros((), dtype=dt, device=mc.device)
        means.append(torch.where(emp, zero, mc + vbar[g0:g1]).reshape(-1, dv))
        vars_.append(torch.where(emp, zero, var).reshape(-1, dv))
        empties.append(emp.reshape(-1))
    shape = (att.groups, att.rows)
    return (
        torch.cat(means).view(*shape, dv),
        torch.cat(vars_).view(*shape, dv),
        torch.cat(empties).view(shape),
    )


def _moments_fused(
    att: Attn,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool] | None:
    """Mean, var ``(G, M, Dv)``, empty ``(G, M)`` and whether every entry of ``q`` and ``k`` was
    finite, by the fused moments kernel (CPU, float32, no gradient; None where
    :func:`_fused_bias` says it does not apply): per tile of query rows
    the scores, the exact row maximum, ``e = 2^(s - max)`` and one micro-GEMM of ``e`` with the
    values ``[vc, vc^2]`` centred on their unweighted mean (the formulas of :func:`_moments`)."""
    ok, bias, natural = _fused_bias(att)
    if not ok:
        return None
    g, m, dv = att.groups, att.rows, att.dv
    mean = torch.empty(g, m, dv)
    var = torch.empty(g, m, dv)
    empty = torch.empty(g, m, dtype=torch.bool)
    shape4 = (att.n, att.hk * att.r, att.lq, dv)
    finite = _native.fused_call_4d(
        "moments", att.q4, att.k4, att.v4(), att.scale, bias, att.causal, empty,
        out=mean.view(shape4), var=var.view(shape4), bias_natural=natural,
    )  # fmt: skip
    return mean, var, empty, finite


def _moments_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    att: Attn,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Mean, var ``(G, M, Dv)`` and empty ``(G, M)`` by two fused attention calls (CPU, no
    gradient, 4-D inputs; None where it does not apply).

    With values centred on their unweighted mean ``vbar`` (as in :func:`_moments`),
    ``mc = SDPA(q, k, v - vbar)`` and ``m2 = SDPA(q, k, (v - vbar)^2)`` give ``mean = mc + vbar``
    and ``var = max(m2 - mc^2, 0)``. The flash kernel behind ``F.scaled_dot_product_attention``
    needs equal query and value widths, so the two moments are two calls (one call with values
    ``[vc, vc^2]`` would need queries and keys zero-padded to ``2 D``, the same work). Measured
    faster than the torch path's scores + exp + one GEMM with ``[vc, vc^2, 1]``
    (``docs/benchmarks/sampled.md``). Rows whose every key is masked are found from the mask."""
    if (
        q.device.type != "cpu"
        or (attn_mask is not None and is_causal)  # SDPA refuses the combination
        or att.dv != att.q.shape[-1]  # the flash kernel needs Dv = D
    ):
        return None
    cdt = att.q.dtype
    n, hk, r, lq, lk = att.n, att.hk, att.r, att.lq, att.lk
    # every batch layout as (N, H, L, D), the mask as (N, Hq | 1, Lq | 1, Lk)
    qc = q.to(cdt).reshape(n, hk * r, lq, -1)
    kc = k.to(cdt).reshape(n, hk, lk, -1)
    vv = v.to(cdt).reshape(n, hk, lk, -1)
    vbar = vv.mean(dim=-2, keepdim=True)  # (N, Hk, 1, Dv)
    vc = vv - vbar
    mask = att.mask
    if mask is not None:
        if mask.shape[2] == 1 and (hk == 1 or mask.stride(1) == 0):
            mask = mask[:, :1, 0]  # the same for every head: (N, 1, Lq | 1, Lk)
        else:
            mask = mask.expand(n, hk, r, *mask.shape[3:]).reshape(n, hk * r, *mask.shape[3:])
        if mask.dtype != torch.bool:
            mask = mask.to(cdt)
    kw = dict(attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=r > 1)
    mc = F.scaled_dot_product_attention(qc, kc, vc, **kw)  # type: ignore[arg-type]
    m2 = F.scaled_dot_product_attention(qc, kc, vc.mul_(vc), **kw)  # type: ignore[arg-type]
    var = m2.sub_(mc * mc).clamp_min_(0.0)
    if att.r > 1:
        vbar = vbar.repeat_interleave(att.r, dim=-3)
    mean = mc.add_(vbar)
    g, m = att.groups, att.rows
    if mask is None:
        empty = torch.zeros(g, m, dtype=torch.bool, device=q.device)
    else:
        keep = mask if mask.dtype == torch.bool else ~torch.isneginf(mask)
        dead = ~keep.any(dim=-1)  # broadcastable to (N, Hq, Lq)
        empty = dead.expand(n, hk * r, lq).reshape(g, m)
        if bool(empty.any()):
            zero = torch.zeros((), dtype=cdt, device=q.device)
            rows = dead.unsqueeze(-1)
            mean, var = torch.where(rows, zero, mean), torch.where(rows, zero, var)
    return mean.reshape(g, m, att.dv), var.reshape(g, m, att.dv), empty


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
    empty_rows: EmptyRows = "error",
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Attention output and per-dimension value variance, in one pass over the keys.

    For each query with weights :math:`\pi` and values :math:`v_j`:

    * ``mean`` :math:`= \mu = \sum_j \pi_j v_j` (equals ``F.scaled_dot_product_attention``),
    * ``var`` :math:`= \mathrm{diag}\,\Sigma_V = \sum_j \pi_j v_j^{\odot 2} - \mu^{\odot 2}`,
      so ``var.sum(-1)`` is :math:`\mathrm{tr}\,\Sigma_V` and
      ``var / nu`` is the per-dimension variance of :func:`sampled_attention`'s output.

    Accumulation uses one extra accumulator for :math:`\sum_j \pi_j v_j^2` (with values centred
    on their unweighted mean to limit cancellation), online softmax (running max and normaliser)
    over key blocks when ``block_size`` is given. Float64 inputs accumulate in float64, others in
    float32. Differentiable in ``q``, ``k`` and ``v``.

    Parameters
    ----------
    q, k, v, attn_mask, is_causal, scale, enable_gqa
        As in :func:`sampled_attention` (SDPA conventions, ``(*batch, H, L, D)``).
    block_size : int, optional
        Key block size of the online-softmax pass; never holds an ``Lq x Lk`` matrix. ``None``
        processes all keys at once for chunks of query rows.
    empty_rows : {"error", "zero"}
        Rows with every key masked: raise (default) or return zero mean and zero variance
        (SDPA returns a zero output for them).

    Returns
    -------
    mean, var : Tensor
        Both ``(*batch, Hq, Lq, Dv)`` in the dtype of ``q``.

    Examples
    --------
    >>> import torch
    >>> from attnuq.ops import attention_moments
    >>> q, k, v = torch.randn(3, 2, 4, 16, 8, dtype=torch.float64).unbind(0)
    >>> mean, var = attention_moments(q, k, v, block_size=4)
    >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    >>> bool(torch.allclose(mean, ref)), var.shape
    (True, torch.Size([2, 4, 16, 8]))
    """
    return attention_moments_unchecked(
        q, k, v, attn_mask, is_causal, scale, enable_gqa, _check_block_size(block_size),
        check_empty_rows(empty_rows),
    )  # fmt: skip


def attention_moments_unchecked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    block_size: int | None,
    empty_rows: EmptyRows,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_moments` for callers that validated ``block_size`` (None or an int
    ``>= 1``) and ``empty_rows`` (``"error"`` or ``"zero"``) at their own public boundary
    (:class:`attnuq.nn.SampledAttention`); they are not checked again. Traced
    (``torch.compile``, ``torch.export``) the call is the custom op ``attnuq::attention_moments``
    (its backward recomputes the forward with autograd)."""
    if isinstance(q, torch.Tensor) and _rng.tracing(q):
        mean, var = _moments_op(
            q, k, v, attn_mask, is_causal, scale, enable_gqa, block_size, empty_rows
        )
        return mean, var
    return _moments_impl(q, k, v, attn_mask, is_causal, scale, enable_gqa, block_size, empty_rows)


def _moments_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    block_size: int | None,
    empty_rows: EmptyRows,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The moments themselves (eager; the custom op's body)."""
    grad = torch.is_grad_enabled() and any(getattr(t, "requires_grad", 0) for t in (q, k, v))
    if isinstance(q, torch.Tensor) and _triton.usable(q, grad):  # CUDA, when triton imports
        return _triton.attention_moments_unchecked(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa, empty_rows=empty_rows,
        )  # fmt: skip
    att, deferred = _prepare(q, k, v, attn_mask, is_causal, scale, enable_gqa,
                             block_size is None and not grad)
    if att.groups * att.rows == 0 or att.lk == 0 or att.dv == 0:
        if att.groups * att.rows > 0 and att.lk == 0 and empty_rows == "error":
            raise empty_rows_error(att, torch.ones(att.groups, att.rows, dtype=torch.bool))
        z = torch.zeros(att.out_shape, dtype=att.out_dtype, device=q.device)
        return z, z.clone()
    res: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    if block_size is None and not grad:
        fz = _moments_fused(att)
        if fz is not None:
            if not fz[3] and deferred:
                _check_values(q, k, v)  # the kernel saw NaN/inf in q or k: raises
            res = fz[0], fz[1], fz[2]
        else:
            res = _moments_sdpa(q, k, v, attn_mask, is_causal, scale, enable_gqa, att)
    mean, var, empty = res if res is not None else _moments(att, block_size or att.lk)
    if empty_rows == "error" and bool(empty.any()):
        raise empty_rows_error(att, empty)
    return att.unfold(mean).to(att.out_dtype), att.unfold(var).to(att.out_dtype)


# ----------------------------------------------------------------------------- torch.library ops
#
# The operators as custom ops with fake (meta) implementations, so that torch.compile and
# torch.export see each call as one opaque node (no graph break inside the sampler). Eager calls
# run the implementations directly (same numbers, none of the dispatch overhead); traced calls go
# through the ops (``_rng.tracing``). Randomness enters as a seed tensor (:mod:`attnuq.ops._rng`),
# so each op is a deterministic function of its inputs (what ``torch.library.opcheck`` needs).
# Every op returns contiguous tensors, the layout of its fake implementation, whichever path
# (fused kernel, row kernel, torch) computed them: torch.compile's Inductor backend plans the
# graph's memory from the fake's strides.
# Backward formulas recompute the forward with autograd inside an opaque backward op: for
# sampled attention the same seed gives the same draws, so the gradient for ``v`` (the sampled
# counts divided by nu, scattered) is the one of the eager path; no gradient flows to q, k, the
# mask or the seed, as eagerly. Double backward is not supported.


def _with_autograd(fn: Callable[[], _T], device: torch.device) -> _T:
    """``fn()`` in a fresh thread, where autograd works: a custom op's body runs below the
    autograd dispatch key (a thread-local setting that ``torch.enable_grad`` does not undo), so
    the backward ops recompute the forward with autograd in a thread of their own (on the
    caller's CUDA stream) and wait for it."""
    box: list[object] = []
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def run() -> None:
        try:
            if stream is not None:
                with torch.cuda.stream(stream):
                    box.append(fn())
            else:
                box.append(fn())
        except BaseException as e:  # re-raised in the caller's thread
            box.append(e)

    t = threading.Thread(target=run, name="attnuq-backward")
    t.start()
    t.join()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]  # type: ignore[return-value]


def _out_like(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@torch.library.custom_op(
    "attnuq::sampled_attention",
    mutates_args=(),
    schema=(
        "(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor seed, int nu, bool is_causal, "
        "float? scale, bool enable_gqa, int? block_size, str empty_rows, bool v_grad) -> Tensor"
    ),
)
def _sampled_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    seed: torch.Tensor,
    nu: int,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    block_size: int | None,
    empty_rows: str,
    v_grad: bool,
) -> torch.Tensor:
    """``attnuq::sampled_attention``: :func:`sampled_attention` with every uniform from a
    generator seeded by ``seed`` (``v_grad``: a gradient for ``v`` is wanted, so the draws must
    be the torch path's, which the backward recomputes)."""
    gen = _rng.generator_from_seed(seed, q.device)
    with torch.no_grad():
        out = _sampled_impl(
            q, k, v, nu, attn_mask, is_causal, scale, enable_gqa, block_size, gen,
            check_empty_rows(empty_rows), not v_grad,
        )  # fmt: skip
    # the fused kernels write SDPA's (N, Lq, Hq, Dv) memory, the other paths contiguous
    # memory: the op returns one layout, the one its fake promises
    return out.contiguous()


@_sampled_op.register_fake
def _sampled_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: object
) -> torch.Tensor:
    return _out_like(q, v)


@torch.library.custom_op(
    "attnuq::sampled_attention_backward",
    mutates_args=(),
    schema=(
        "(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor seed, int nu, "
        "bool is_causal, float? scale, bool enable_gqa, int? block_size, str empty_rows) -> Tensor"
    ),
)
def _sampled_backward_op(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    seed: torch.Tensor,
    nu: int,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    block_size: int | None,
    empty_rows: str,
) -> torch.Tensor:
    """``attnuq::sampled_attention_backward``: the gradient for ``v`` of the draws that ``seed``
    gives (``sum`` over the draws of ``grad / nu`` at the drawn rows), by redrawing them."""
    def run() -> torch.Tensor | None:
        gen = _rng.generator_from_seed(seed, q.device)
        with torch.enable_grad():
            vv = v.detach().requires_grad_(True)
            out = _sampled_impl(
                q.detach(), k.detach(), vv, nu, attn_mask, is_causal, scale, enable_gqa,
                block_size, gen, check_empty_rows(empty_rows), False,
            )  # fmt: skip
            if not out.requires_grad:  # no key, no row or Dv = 0: nothing reaches v
                return None
            (gv,) = torch.autograd.grad(out, vv, grad.to(out.dtype), allow_unused=True)
        return gv

    gv = _with_autograd(run, q.device)
    return v.new_zeros(v.shape) if gv is None else gv.contiguous()


@_sampled_backward_op.register_fake
def _sampled_backward_fake(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, *args: object) -> torch.Tensor:
    return v.new_empty(v.shape)


def _sampled_setup(ctx: object, inputs: tuple[object, ...], output: torch.Tensor) -> None:
    q, k, v, mask, seed = inputs[:5]
    ctx.save_for_backward(q, k, v, mask, seed)  # type: ignore[attr-defined]
    ctx.args = inputs[5:11]  # type: ignore[attr-defined]


def _sampled_backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    q, k, v, mask, seed = ctx.saved_tensors  # type: ignore[attr-defined]
    gv = None
    if ctx.needs_input_grad[2]:  # type: ignore[attr-defined]
        gv = _sampled_backward_op(grad, q, k, v, mask, seed, *ctx.args)  # type: ignore[attr-defined]
    return (None, None, gv) + (None,) * 9


_sampled_op.register_autograd(_sampled_backward, setup_context=_sampled_setup)


@torch.library.custom_op(
    "attnuq::attention_moments",
    mutates_args=(),
    schema=(
        "(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, bool is_causal, float? scale, "
        "bool enable_gqa, int? block_size, str empty_rows) -> (Tensor, Tensor)"
    ),
)
def _moments_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    block_size: int | None,
    empty_rows: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attnuq::attention_moments``: :func:`attention_moments` (mean, var)."""
    with torch.no_grad():
        mean, var = _moments_impl(
            q, k, v, attn_mask, is_causal, scale, enable_gqa, block_size,
            check_empty_rows(empty_rows),
        )  # fmt: skip
    return mean.contiguous(), var.contiguous()


@_moments_op.register_fake
def _moments_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: object
) -> tuple[torch.Tensor, torch.Tensor]:
    return _out_like(q, v), _out_like(q, v)


@torch.library.custom_op(
    "attnuq::attention_moments_backward",
    mutates_args=(),
    schema=(
        "(Tensor grad_mean, Tensor grad_var, Tensor q, Tensor k, Tensor v, Tensor? attn_mask, "
        "bool is_causal, float? scale, bool enable_gqa, int? block_size, str empty_rows) "
        "-> (Tensor, Tensor, Tensor)"
    ),
)
def _moments_backward_op(
    grad_mean: torch.Tensor,
    grad_var: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    block_size: int | None,
    empty_rows: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``attnuq::attention_moments_backward``: gradients for ``q``, ``k``, ``v`` of
    ``<grad_mean, mean> + <grad_var, var>``, by the torch path's autograd."""
    def run() -> tuple[torch.Tensor | None, ...]:
        with torch.enable_grad():
            qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
            mean, var = _moments_impl(
                qq, kk, vv, attn_mask, is_causal, scale, enable_gqa, block_size,
                check_empty_rows(empty_rows),
            )  # fmt: skip
            if not (mean.requires_grad or var.requires_grad):
                return (None, None, None)
            return torch.autograd.grad(
                (mean, var), (qq, kk, vv), (grad_mean.to(mean.dtype), grad_var.to(var.dtype)),
                allow_unused=True,
            )

    grads = _with_autograd(run, q.device)
    gq, gk, gv = (t.new_zeros(t.shape) if g is None else g.contiguous()
                  for g, t in zip(grads, (q, k, v), strict=True))
    return gq, gk, gv


@_moments_backward_op.register_fake
def _moments_backward_fake(
    grad_mean: torch.Tensor, grad_var: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, *args: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _moments_setup(
    ctx: object, inputs: tuple[object, ...], output: tuple[torch.Tensor, torch.Tensor]
) -> None:
    q, k, v, mask = inputs[:4]
    ctx.save_for_backward(q, k, v, mask)  # type: ignore[attr-defined]
    ctx.args = inputs[4:]  # type: ignore[attr-defined]


def _moments_backward(
    ctx: object, grad_mean: torch.Tensor, grad_var: torch.Tensor
) -> tuple[torch.Tensor | None, ...]:
    q, k, v, mask = ctx.saved_tensors  # type: ignore[attr-defined]
    need = ctx.needs_input_grad  # type: ignore[attr-defined]
    if not any(need[:3]):
        return (None,) * 9
    gq, gk, gv = _moments_backward_op(grad_mean, grad_var, q, k, v, mask, *ctx.args)  # type: ignore[attr-defined]
    return (gq if need[0] else None, gk if need[1] else None, gv if need[2] else None) + (
        None,
    ) * 6


_moments_op.register_autograd(_moments_backward, setup_context=_moments_setup)
