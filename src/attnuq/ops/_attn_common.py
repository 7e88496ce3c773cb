"""Shared input handling for the sampled-attention operators (private).

Every public operator in :mod:`attnuq.ops.sampled` follows the conventions of
:func:`torch.nn.functional.scaled_dot_product_attention` (SDPA): ``q`` is ``(*batch, Hq, Lq, D)``,
``k`` is ``(*batch, Hk, Lk, D)``, ``v`` is ``(*batch, Hk, Lk, Dv)``; ``attn_mask`` is boolean
(``True`` = take part) or additive and broadcastable to ``(*batch, Hq, Lq, Lk)``; ``is_causal``
keeps key ``j`` for query ``i`` iff ``j <= i`` (top-left aligned, as SDPA when ``Lq != Lk``);
with ``enable_gqa`` query head ``h`` reads key/value head ``h // (Hq // Hk)``.

Internally the query heads that share one key/value head are folded into the query rows, so the
work is a batch of ``G = N * Hk`` *groups* (``N`` = product of the batch dims), each with
``M = R * Lq`` query rows (``R = Hq // Hk``) against its own ``Lk`` keys.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Literal

import torch

from attnuq._validation import check_finite

__all__ = [
    "LOG2E",
    "MAX_NU",
    "Attn",
    "EmptyRows",
    "check_empty_rows",
    "compute_dtype",
    "empty_rows_error",
    "max_bytes",
    "prepare",
]

#: what an operator does with a query whose every key is masked
EmptyRows = Literal["error", "zero"]
#: Largest ``nu``: the draws of one query are summed by one ``embedding_bag`` call, which takes
#: fewer than ``2**31`` indices (torch's CPU kernel counts a call's indices in a C ``int``).
MAX_NU = 2**31 - 1
_MAX_BYTES_ENV = "ATTNUQ_MAX_BYTES"
_DEFAULT_MAX_BYTES = 1 << 32

LOG2E = 1.0 / math.log(2.0)
# masks up to this many elements are checked for being the same for every query (one pass)
_MASK_DEDUP_ELEMS = 1 << 24
# a per-query mask is converted to one (G, M, Lk) bias per call up to this many elements
_FULL_BIAS_ELEMS = 1 << 22


def max_bytes() -> int:
    """The memory budget of one sampled-attention call, in bytes.

    ``$ATTNUQ_MAX_BYTES`` (a positive integer, e.g. ``8000000000``) when set, else 4 GiB
    (``2**32``). :func:`sampled_attention` estimates the bytes a call allocates besides its
    inputs (output, one chunk of scores, uniforms and indices, the gather buffer; with a gradient
    for ``v`` every drawn index) and refuses a call that needs more, before allocating.

    Examples
    --------
    >>> from attnuq.ops import max_bytes
    >>> max_bytes() > 0
    True
    """
    raw = os.environ.get(_MAX_BYTES_ENV, "").strip()
    if not raw:
        return _DEFAULT_MAX_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(
            f"{_MAX_BYTES_ENV} must be a positive integer number of bytes, got "
            f"{_MAX_BYTES_ENV}={raw!r}"
        )
    return value


def check_empty_rows(empty_rows: object) -> EmptyRows:
    """``empty_rows`` if it is ``"error"`` or ``"zero"``, else ``ValueError`` naming it."""
    if empty_rows not in ("error", "zero"):
        raise ValueError(f"empty_rows must be 'error' or 'zero', got {empty_rows=!r}")
    return empty_rows  # type: ignore[return-value]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating dtype is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class Attn:
    """Inputs folded into groups. Shapes: ``q`` ``(G, M, D)``, ``k`` ``(G, Lk, D)``, ``v``
    ``(G, Lk, Dv)``, all in the compute dtype. ``scale`` is the SDPA scale times ``log2(e)``:
    scores are in log2 units and weights are ``exp2(scores - max)``.

    ``q4`` ``(N, Hq, Lq, D)`` and ``k4`` ``(N, Hk, Lk, D)`` are the inputs as given (views; a
    copy only when the batch dims do not merge into one); the grouped ``q`` and ``k`` are
    formed from them on first use (a copy when the layout needs one, e.g. Hugging Face's
    transposed ``(B, L, H, D)`` memory), so the fused kernels, which read the 4-D layout in
    place, never pay for it."""

    q4: torch.Tensor
    k4: torch.Tensor
    v_src: torch.Tensor  # v in the compute dtype, as given (*batch, Hk, Lk, Dv): not copied
    scale: float
    mask: torch.Tensor | None  # (N, Hk, R|1, Lq|1, Lk), a broadcast view of the user's mask
    causal: bool
    batch_shape: tuple[int, ...]
    has_head_dim: bool
    n: int
    hk: int
    r: int
    lq: int
    lk: int
    dv: int
    out_dtype: torch.dtype
    # D * max|q| * max|k| (None when the values were not checked): bounds every |q_i . k_j|
    qk_bound: float | None = None
    # per-call cache: ("mask", dtype) -> the attn_mask bias table (G, 1 | M, Lk); ("causal",
    # j0, j1, ...) -> (M, nk) for chunks of whole groups; ("tri", n, ...) -> (n, n) causal
    # triangle; ("v",) -> the grouped values (G, Lk, Dv)
    _cache: dict[tuple[object, ...], torch.Tensor] = field(
        default_factory=dict, repr=False
    )

    @property
    def q(self) -> torch.Tensor:
        """``(G, M, D)`` grouped queries (formed once per call, on first use)."""
        t = self._cache.get(("q",))
        if t is None:
            t = _grouped(self.q4, (self.groups, self.rows, self.q4.shape[-1]))
            self._cache[("q",)] = t
        return t

    @property
    def k(self) -> torch.Tensor:
        """``(G, Lk, D)`` grouped keys (formed once per call, on first use)."""
        t = self._cache.get(("k",))
        if t is None:
            t = _grouped(self.k4, (self.groups, self.lk, self.k4.shape[-1]))
            self._cache[("k",)] = t
        return t

    def v4(self) -> torch.Tensor:
        """``(N, Hk, Lk, Dv)`` values: a view of ``v`` (a copy only when the batch dims do not
        merge into one)."""
        return _grouped(self.v_src, (self.n, self.hk, self.lk, self.dv))

    def bias5(self, dtype: torch.dtype) -> torch.Tensor | None:
        """``attn_mask`` as an additive log2 bias ``(N, Hk, R | 1, Lq | 1, Lk)`` with unit key
        stride, the broadcast dims of the user's mask of stride 0 (no expanded copy), or None
        where :meth:`_bias_table` would be None (a per-query mask of more than
        :data:`_FULL_BIAS_ELEMS` elements once expanded). For the fused kernels, which address
        every row's bias through these strides."""
        key = ("mask5", dtype)
        if key in self._cache:
            return self._cache[key]
        mk = self.mask
        assert mk is not None
        per_key = mk.shape[2] == 1 and mk.shape[3] == 1
        table: torch.Tensor | None = None
        if per_key or self.groups * self.rows * self.lk <= _FULL_BIAS_ELEMS:
            compact = mk[tuple(
                slice(0, 1) if st == 0 and sz > 1 else slice(None)
                for st, sz in zip(mk.stride(), mk.shape, strict=True)
            )]
            b = self._to_bias(compact, dtype)
            if b.shape[-1] != self.lk or b.stride(-1) != 1:
                b = b.expand(*b.shape[:-1], self.lk).contiguous()
            table = b.expand(mk.shape)
        self._cache[key] = table  # type: ignore[assignment]
        return table

    def kernel_bias(self) -> tuple[torch.Tensor | None, bool]:
        """``(bias, natural)`` for the fused float32 kernels: a float32 ``attn_mask`` with unit
        key stride is handed over as it is, ``(N, Hk, R | 1, Lq | 1, Lk)`` with its broadcast
        dims of stride 0 (``natural``: the kernel converts each entry as it reads it, so the
        call makes no bias tensor); any other mask is :meth:`bias5`'s log2 table (or None, see
        there). Requires a mask."""
        mk = self.mask
        assert mk is not None
        if mk.dtype == torch.float32 and (mk.shape[-1] <= 1 or mk.stride(-1) == 1):
            return mk, True
        return self.bias5(torch.float32), False

    @property
    def index_dtype(self) -> torch.dtype:
        """Dtype of drawn key indices: int32 when every grouped value row ``g * Lk + j``
        fits, else int64."""
        return torch.int32 if self.groups * self.lk < 2**31 - 1 else torch.long

    @property
    def v(self) -> torch.Tensor:
        """``(G, Lk, Dv)`` values (a copy, made once, when ``v`` is not laid out that way)."""
        vg = self._cache.get(("v",))
        if vg is None:
            vg = self.v_src.reshape(self.groups, self.lk, self.dv)
            self._cache[("v",)] = vg
        return vg

    def value_rows(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Every value row as a row of one 2-D tensor, without copying ``v`` when its layout
        allows: ``(w, offs, step)`` with value ``j`` of group ``g`` at row
        ``offs[g] + j * step`` of ``w`` ``(rows, Dv)``; ``offs`` is ``(G, 1, 1)`` in the index
        dtype of the draws.

        ``v`` laid out as ``(B, Lk, H, Dv)`` and transposed (what Hugging Face passes) has every
        row contiguous at a multiple of ``Dv`` elements: ``w`` is then a view of its memory
        (``as_strided``) and no copy is made. Otherwise (or when ``v`` needs a gradient) ``w``
        is the grouped copy :attr:`v` with ``offs[g] = g * Lk`` and ``step = 1``.
        """
        g, lk, dv = self.groups, self.lk, self.dv
        idt = self.index_dtype
        dev = self.v_src.device
        src = self.v_src
        need_grad = torch.is_grad_enabled() and src.requires_grad
        v4 = _view_or_none(src, (self.n, self.hk, lk, dv))
        if v4 is not None and not need_grad and dv > 0 and v4.stride(-1) == 1 and all(
            st % dv == 0 for st in v4.stride()[:3]
        ):
            sn, sh, sl = (st // dv for st in v4.stride()[:3])
            last = (self.n - 1) * sn + (self.hk - 1) * sh + (lk - 1) * sl
            if last < 2**31 - 1 or idt == torch.long:
                w = torch.as_strided(v4, (last + 1, dv), (dv, 1), v4.storage_offset())
                ng = torch.arange(self.n, device=dev, dtype=idt).view(-1, 1) * sn
                hg = torch.arange(self.hk, device=dev, dtype=idt).view(1, -1) * sh
                return w, (ng + hg).view(g, 1, 1), sl
        offs = torch.arange(g, device=dev, dtype=idt).mul_(lk).view(g, 1, 1)
        return self.v.reshape(g * lk, dv), offs, 1

    @property
    def groups(self) -> int:
        return self.n * self.hk

    @property
    def rows(self) -> int:
        return self.r * self.lq

    @property
    def out_shape(self) -> tuple[int, ...]:
        heads = (self.hk * self.r,) if self.has_head_dim else ()
        return (*self.batch_shape, *heads, self.lq, self.dv)

    def unfold(self, x: torch.Tensor) -> torch.Tensor:
        """``(G, M, ...)`` -> ``(*batch, Hq, Lq, ...)`` (drops the head dim for 2-D inputs)."""
        tail = tuple(x.shape[2:])
        heads = (self.hk * self.r,) if self.has_head_dim else ()
        return x.reshape(*self.batch_shape, *heads, self.lq, *tail)

    def chunks(
        self,
        per_row: int,
        budget: int,
        min_rows: int,
        max_rows: int | None = None,
        batch_groups: bool = False,
    ) -> list[tuple[int, int, int, int]]:
        """Split the ``(G, M)`` query rows into chunks ``(g0, g1, i0, i1)``.

        A chunk holds about ``budget // per_row`` rows (at least ``min(M, min_rows)``; at most
        ``max_rows`` rows of a group when a group has more rows than that): several whole groups
        when one group fits, else a block of rows of one group. Chunks come in group-major,
        row-minor order: concatenating their ``(rows, ...)`` results gives ``(G, M, ...)``.

        With ``batch_groups`` a block of rows is taken from several groups at once (the same
        rows ``i0:i1`` of groups ``g0:g1``, about ``budget`` elements in all): fewer, larger
        batched GEMMs. Blocks of groups come in order, and within one the row blocks; the
        concatenation property above then no longer holds.
        """
        m, g = self.rows, self.groups
        rows = max(min(m, min_rows), budget // max(1, per_row))
        if max_rows is not None and m > max_rows:
            rows = max(1, min(rows, max_rows))
        if rows >= m:
            step = max(1, rows // max(1, m))
            return [(g0, min(g, g0 + step), 0, m) for g0 in range(0, g, step)]
        gb = max(1, budget // max(1, per_row * rows)) if batch_groups else 1
        return [
            (g0, min(g, g0 + gb), i0, min(m, i0 + rows))
            for g0 in range(0, g, gb)
            for i0 in range(0, m, rows)
        ]

    def _tri(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``(n, n)`` additive mask: 0 on and below the diagonal, ``-inf`` above (cached)."""
        key = ("tri", n, dtype, device)
        t = self._cache.get(key)
        if t is None:
            t = torch.full((n, n), float("-inf"), dtype=dtype, device=device).triu_(1)
            self._cache[key] = t
        return t

    def causal_keys(self, i0: int, i1: int) -> int:
        """Number of leading keys that rows ``i0:i1`` may see under ``is_causal`` (else ``Lk``)."""
        if not self.causal:
            return self.lk
        if i1 - i0 >= self.lq or i0 // self.lq != (i1 - 1) // self.lq:
            last = self.lq - 1
        else:
            last = (i1 - 1) % self.lq
        return max(1, min(self.lk, last + 1))

    def _to_bias(self, m: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A mask slice as an additive bias in log2 units: boolean ``False`` and ``-inf`` give
        ``-inf`` (the key is excluded); every finite bias stays finite (``finfo.min * log2(e)``
        would overflow to ``-inf`` and exclude a key that SDPA weights as an ordinary score)."""
        if m.dtype == torch.bool:
            zero = torch.zeros((), dtype=dtype, device=m.device)
            return torch.where(m, zero, float("-inf"))
        b = m.to(dtype) * LOG2E
        return torch.where(torch.isneginf(b) & torch.isfinite(m), torch.finfo(dtype).min, b)

    def _mask_bias(
        self, g0: int, g1: int, i0: int, i1: int, j0: int, j1: int, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """``attn_mask`` as an additive bias broadcastable to ``(g, rows, nk)`` (or None):
        a view of the per-call :meth:`_bias_table` when there is one, else the chunk's rows
        gathered from the mask."""
        mk = self.mask
        if mk is None:
            return None
        table = self._bias_table(dtype)
        if table is not None:  # (G, 1, Lk) or (G, M, Lk)
            rows = slice(None) if table.shape[1] == 1 else slice(i0, i1)
            return table[g0:g1, rows, j0:j1]
        dev = mk.device
        ri = torch.arange(i0, i1, device=dev)
        gi = torch.arange(g0, g1, device=dev).unsqueeze(1)  # (g, 1)
        r_sel = (ri // self.lq) if mk.shape[2] > 1 else torch.zeros_like(ri)
        l_sel = (ri % self.lq) if mk.shape[3] > 1 else torch.zeros_like(ri)
        m = mk[:, :, :, :, j0:j1][gi // self.hk, gi % self.hk, r_sel, l_sel]  # (g, rows, nk)
        return self._to_bias(m, dtype)

    def _bias_table(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The whole ``attn_mask`` as one additive bias per call: ``(G, 1, Lk)`` for a mask that
        is the same for every query (key padding), else ``(G, M, Lk)`` when that has at most
        :data:`_FULL_BIAS_ELEMS` elements; None otherwise (chunks then gather their rows).

        The conversion to a bias runs on the user's mask without its broadcast dims (e.g.
        ``(B, 1, Lq, Lk)`` for every head), then one copy expands it; chunks take views. This is
        the same number of elements the per-chunk gathers would produce, in two passes."""
        key = ("mask", dtype)
        if key in self._cache:
            return self._cache[key]
        mk = self.mask
        assert mk is not None
        per_key = mk.shape[2] == 1 and mk.shape[3] == 1
        rows = 1 if per_key else self.rows
        if self.groups * rows * self.lk > _FULL_BIAS_ELEMS and not per_key:
            return None
        compact = mk[tuple(
            slice(0, 1) if st == 0 and sz > 1 else slice(None)
            for st, sz in zip(mk.stride(), mk.shape, strict=True)
        )]
        shape = mk.shape if per_key else (self.n, self.hk, self.r, self.lq, self.lk)
        table = self._to_bias(compact, dtype).expand(shape).reshape(self.groups, rows, self.lk)
        self._cache[key] = table
        return table

    def _causal_bias(
        self, i0: int, i1: int, j0: int, j1: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """``(rows, nk)`` additive bias, ``-inf`` where key ``j`` is after the row's query
        position. Cached when the rows are whole groups (the same for every chunk)."""
        whole = i0 == 0 and i1 == self.rows
        key = ("causal", j0, j1, dtype, device)
        if whole and key in self._cache:
            return self._cache[key]
        lq_idx = torch.arange(i0, i1, device=device) % self.lq
        future = torch.arange(j0, j1, device=device) > lq_idx.unsqueeze(-1)  # (rows, nk)
        zero = torch.zeros((), dtype=dtype, device=device)
        b = torch.where(future, float("-inf"), zero)
        if whole:
            self._cache[key] = b
        return b

    def scores(
        self,
        g0: int,
        g1: int,
        i0: int,
        i1: int,
        j0: int,
        j1: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Masked scores (in log2 units) of rows ``i0:i1`` of groups ``g0:g1`` against keys
        ``j0:j1``: ``(g, i1 - i0, j1 - j0)``; masked entries are ``-inf``.

        Masks are additive biases: the ``attn_mask`` bias is the GEMM's ``C`` input (``beta =
        1``), which costs about nothing, and the causal bias is added afterwards (on the last
        ``rows x rows`` block only when the rows are consecutive positions of one head).
        With ``out`` the result is written there in place (no autograd); without it every step
        is out-of-place (safe under autograd).
        """
        kt = self.k[g0:g1, j0:j1].transpose(1, 2)
        qc = self.q[g0:g1, i0:i1]
        dt = self.q.dtype
        bias = self._mask_bias(g0, g1, i0, i1, j0, j1, dt)
        if out is None:
            s = torch.bmm(qc * self.scale, kt) if bias is None else torch.baddbmm(
                bias, qc * self.scale, kt
            )  # (g, rows, nk)
        elif bias is None:  # the scale rides on the GEMM (alpha) for free
            s = torch.baddbmm(out, qc, kt, beta=0.0, alpha=self.scale, out=out)
        else:
            s = torch.baddbmm(bias, qc, kt, alpha=self.scale, out=out)
        if not self.causal:
            return s
        dev = s.device
        rows = i1 - i0
        p0 = i0 % self.lq
        if i0 // self.lq == (i1 - 1) // self.lq and j0 == 0 and j1 == p0 + rows:
            # Rows are positions p0..p0+rows-1 and the keys end at the last of them: the
            # future keys are the strict upper triangle of the last (rows x rows) block.
            tri = self._tri(rows, s.dtype, dev)
            if out is not None:
                s[..., p0:j1].add_(tri)
            else:
                s = torch.cat([s[..., :p0], s[..., p0:j1] + tri], dim=-1)
            return s
        cb = self._causal_bias(i0, i1, j0, j1, s.dtype, dev)
        return s.add_(cb) if out is not None else s + cb


def _view_or_none(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    """``t.view(shape)``, or None when that needs a copy."""
    try:
        return t.view(shape)
    except RuntimeError:
        return None


def _grouped(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``t.reshape(shape)``: a view when possible, else a contiguous copy (``reshape`` of a
    transposed 4-D view copies about 2x slower than ``contiguous()``, measured on
    ``(112, 16, 63, 8)`` in Hugging Face's ``(B, L, H, D)`` memory)."""
    view = _view_or_none(t, shape)
    return view if view is not None else t.contiguous().view(shape)


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    *,
    check_values: bool = True,
    convert: bool = True,
    dedup: bool = True,
) -> Attn:
    """Validate SDPA-style inputs and fold them into groups (see the module docstring).

    ``convert=False`` keeps ``q``, ``k``, ``v`` in their dtype instead of the compute dtype
    (the Triton kernels read 16-bit inputs as they are). ``dedup=False`` skips the check of a
    per-query mask for equal rows (one pass over the mask), for callers that read the mask in
    place whatever its rows (the fused kernels with a float32 mask)."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {name}.dtype={t.dtype}")
        if t.dim() < 2:
            raise ValueError(
                f"{name} must have at least 2 dims (..., L, D), got {name}.shape={tuple(t.shape)}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k and v must share one dtype, got {q.dtype=}, {k.dtype=}, {v.dtype=}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k and v must be on one device, got {q.device=}, {k.device=}, {v.device=}"
        )
    if not (q.dim() == k.dim() == v.dim()):
        raise ValueError(
            "q, k and v must have the same number of dims, got "
            f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must share the last (feature) dim D, got q.shape={tuple(q.shape)} "
            f"and k.shape={tuple(k.shape)}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"k and v must have the same number of keys Lk (dim -2), got k.shape={tuple(k.shape)} "
            f"and v.shape={tuple(v.shape)}"
        )
    if k.shape[:-2] != v.shape[:-2]:
        raise ValueError(
            f"k and v must share batch and head dims, got k.shape={tuple(k.shape)} "
            f"and v.shape={tuple(v.shape)}"
        )
    has_head_dim = q.dim() >= 3
    batch_shape = tuple(q.shape[:-3]) if has_head_dim else ()
    if has_head_dim and tuple(k.shape[:-3]) != batch_shape:
        raise ValueError(
            f"q and k must share the batch dims, got q.shape={tuple(q.shape)} "
            f"and k.shape={tuple(k.shape)}"
        )
    hq = q.shape[-3] if has_head_dim else 1
    hk = k.shape[-3] if has_head_dim else 1
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool, got {enable_gqa=!r}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {is_causal=!r}")
    if hq != hk:
        if not enable_gqa:
            raise ValueError(
                f"q has {hq} heads but k/v have {hk}; pass enable_gqa=True for grouped-query "
                f"attention (q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)})"
            )
        if hk == 0 or hq % hk != 0:
            raise ValueError(
                f"with enable_gqa the number of query heads must be a multiple of the key/value "
                f"heads, got Hq={hq} and Hk={hk}"
            )
    if scale is not None and (not _is_real(scale) or not math.isfinite(float(scale))):
        raise ValueError(f"scale must be None or a finite real number, got {scale=!r}")
    r = hq // hk if hk else 1
    lq, lk, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    n = math.prod(batch_shape)
    full = (*batch_shape, hq, lq, lk) if has_head_dim else (lq, lk)

    mask5: torch.Tensor | None = None
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(
                f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}"
            )
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(f"attn_mask must be boolean or floating, got {attn_mask.dtype=}")
        if attn_mask.device != q.device:
            raise ValueError(
                f"attn_mask must be on q's device, got {attn_mask.device=}, {q.device=}"
            )
        ms = tuple(attn_mask.shape)
        ok = len(ms) <= len(full) and all(
            a in (1, b) for a, b in zip(ms[::-1], full[::-1], strict=False)
        )
        if not ok:
            raise ValueError(
                f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to the "
                f"attention shape {full} (*batch, Hq, Lq, Lk)"
            )
        # a sum below +inf proves no NaN and no +inf (either makes the sum NaN or +inf); only
        # then (or on overflow) the exact count
        if attn_mask.is_floating_point() and attn_mask.numel() and not (
            attn_mask.sum().item() < math.inf  # False for NaN as well
        ):
            bad = torch.isnan(attn_mask) | (attn_mask == float("inf"))
            if bool(bad.any()):
                raise ValueError(
                    f"additive attn_mask must not hold NaN or +inf, got {int(bad.sum())} such "
                    f"entries (use -inf or a boolean mask to exclude keys)"
                )
        m = attn_mask
        if m.dim() >= 2 and m.shape[-2] > 1 and m.stride(-2) == 0:
            m = m[..., :1, :]  # an expanded view: one row is the whole mask
        if dedup and m.dim() >= 2 and m.shape[-2] > 1 and m.numel() <= _MASK_DEDUP_ELEMS:
            # A mask that is the same for every query (e.g. a key-padding mask that Hugging Face
            # materialised as (B, 1, Lq, Lk)) keeps one row: it is then one additive bias per
            # key for the whole call instead of a gather per chunk. Exact: equal rows.
            first = m[..., :1, :]
            if bool((m == first).all()):
                m = first
        while m.dim() < len(full):
            m = m.unsqueeze(0)
        # Keep the Lq and R dims broadcast (size 1) where the user's mask is; expand the rest.
        if has_head_dim:
            m = m.expand(*batch_shape, hq, m.shape[-2], lk)
        else:
            m = m.expand(1, m.shape[-2], lk)
        m = m.reshape(n, hk, r, m.shape[-2], lk)
        mask5 = m

    sc = float(scale) if scale is not None else 1.0 / math.sqrt(d) if d > 0 else 1.0
    cdt = compute_dtype(q.dtype) if convert else q.dtype
    # q and k as (N, H, L, D) views (a copy only when the batch dims do not merge); the grouped
    # (G, M, D) forms are made on first use (Attn.q, Attn.k)
    q4 = _grouped(q.to(cdt), (n, hq, lq, d))
    k4 = _grouped(k.to(cdt), (n, hk, lk, d))
    qk_bound: float | None = None
    if check_values:
        # One cheap reduction per tensor and one host sync: finite extremes of q and k and a
        # finite sum of v prove every entry finite, since NaN and +-inf propagate. Only when a
        # summary is not finite (or overflows) run the exact, slower check that names the count.
        with torch.no_grad():
            summaries = []
            for t in (q4, k4):
                if t.numel():
                    lo, hi = torch.aminmax(t)
                    summaries.append(torch.maximum(hi, -lo))  # max |entry|
                else:
                    summaries.append(torch.zeros((), dtype=cdt, device=t.device))
            summaries.append(v.sum(dtype=cdt))
            both = torch.stack(summaries)
        if not bool(torch.isfinite(both).all()):
            for t, name in ((q, "q"), (k, "k"), (v, "v")):
                check_finite(t, name)
        # |q_i . k_j| <= |q_i|_2 |k_j|_2 <= D max|q| max|k|
        qk_bound = float(both[0] * both[1]) * d
    return Attn(
        q4=q4,
        k4=k4,
        v_src=v.to(cdt),
        scale=sc * LOG2E,
        mask=mask5,
        causal=is_causal,
        batch_shape=batch_shape,
        has_head_dim=has_head_dim,
        n=n,
        hk=hk,
        r=r,
        lq=lq,
        lk=lk,
        dv=dv,
        out_dtype=q.dtype,
        qk_bound=qk_bound,
    )


def empty_rows_error(att: Attn, empty: torch.Tensor) -> ValueError:
    """A ``ValueError`` naming how many query rows have no admissible key and the first one.

    ``empty`` is ``(G, M)`` boolean.
    """
    count = int(empty.sum())
    first = int(torch.nonzero(empty.reshape(-1))[0, 0])
    g, i = divmod(first, att.rows)
    nb, hkv = divmod(g, att.hk)
    rr, qi = divmod(i, att.lq)
    head = hkv * att.r + rr
    where = []
    if att.batch_shape:
        b = torch.unravel_index(torch.tensor(nb), att.batch_shape)
        where.append(f"batch index {tuple(int(x) for x in b)}")
    if att.has_head_dim:
        where.append(f"head {head}")
    where.append(f"query {qi}")
    return ValueError(
        f"{count} query row(s) have every key masked (no key with positive weight), first at "
        f"{', '.join(where)}; pass empty_rows='zero' to return zeros for them "
        f"(what F.scaled_dot_product_attention returns)"
    )
