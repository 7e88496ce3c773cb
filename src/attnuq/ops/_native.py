"""Bindings of the compiled CPU kernels (private, optional): the dense sampler's inverse-CDF
step, the fused attention kernels and the Levy-attention forward and training loops.

Sampler. The dense path of :func:`attnuq.ops.sampled_attention` turns each chunk of scores
into draws: row maximum, ``2^(s - max)``, a CDF and one lookup per draw. In torch ops that is
four passes over the scores plus ``searchsorted``; on CPU it costs more than the scores GEMM
itself. The C kernel in ``csrc/sample_rows.c`` does it with SIMD in one pass per row after the
maximum (blocks of at most 16 keys in an interleaved order, so that the in-block prefix sums are
vector adds; a branch-free search over the blocks and at most 16 compares per draw; details in
the source). The two sampler paths walk the keys along the CDF in different orders, so the same
uniforms give different (equally distributed) draws; the same generator state gives the same
draws on a given path.

Levy attention. ``csrc/levy.c`` computes the whole inference forward of
:func:`attnuq.ops.levy_attention` in one pass over each series' observed entries: key
normalisation, the value field's mean and within-atom variance, scores, weights, the weighted
value rows and second moments, ``phi(Lambda)`` and the outputs (see :func:`levy_forward` and
the source). It gives the torch paths' numbers to rounding.

Library. :mod:`attnuq.ops._build` compiles, caches, verifies and loads the shared library;
here every kernel's C signature is declared from one table (:data:`_SIGNATURES`) and the
sizes of the argument structs the wrappers fill are checked against the library's own
(:data:`_STRUCT_WORDS`). With OpenMP the work of a call is split over the process's OpenMP
threads (in a torch process the shared ``libgomp`` is torch's own pool); without it, over
Python threads (ctypes releases the GIL). Without a compiler, or with ``ATTNUQ_NATIVE=0``, the
pure-torch paths run instead; :func:`status` says which and why.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import operator
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

from attnuq.ops import _build
from attnuq.ops import phi as _phi

__all__ = [
    "available", "disabled", "fused_available", "fused_call", "fused_call_4d", "levy_forward",
    "native_status", "sample_block", "sample_rows", "status", "unfused",
]

# fewest score elements per thread before rows are split over threads
_MIN_ELEMS_PER_THREAD = 1 << 15
_enabled = True
_fused_enabled = True

_VP, _I64, _F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
_FLOATS = ("f32", "f64")

#: C signature of every kernel: name -> (restype, argtypes). ``{t}`` stands for both float
#: types (``f32``, ``f64``). Most kernels take one pointer to an int64 array holding their
#: argument struct field by field (sizes in :data:`_STRUCT_WORDS`).
_SIGNATURES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    # csrc/sample_rows.c: (s, rows, lk, stride, u, nu, out_i32, out_i64, empty, threads)
    "attnuq_sample_rows_{t}": (_I64, (_VP, _I64, _I64, _I64, _VP, _I64, _VP, _VP, _VP, _I64)),
    # (s, rows, lk, stride, u, nu, run, choice_i32, choice_i64, j0, threads)
    "attnuq_sample_block_{t}": (
        _I64, (_VP, _I64, _I64, _I64, _VP, _I64, _VP, _VP, _VP, _I64, _I64)),
    "attnuq_openmp": (_I64, ()),
    # csrc/levy.c: (struct levy_args, b0, b1, threads)
    "attnuq_levy_{t}": (_I64, (_VP, _I64, _I64, _I64)),
    "attnuq_levy_args_words": (_I64, ()),
    "attnuq_phi_tab_len": (_I64, ()),
    "attnuq_phi_f64": (None, (_VP, _I64, _VP, _VP)),  # (x, n, table, out)
    # csrc/fused.c: (struct fused_args, scale)
    "attnuq_fused_sample_f32": (_I64, (_VP, _F64)),
    "attnuq_fused_moments_f32": (_I64, (_VP, _F64)),
    "attnuq_fused_args_words": (_I64, ()),
    "attnuq_fused_lanes": (_I64, ()),
    # csrc/levy_train.c
    "attnuq_levy_train_words": (_I64, (_I64,)),
    "attnuq_lt_tail_words": (_I64, ()),
    "attnuq_lt_prep_{t}": (None, (_VP, _I64, _I64, _I64)),  # (struct, b0, b1, threads)
    "attnuq_lt_post_{t}": (None, (_VP, _I64, _I64, _I64)),
    "attnuq_lt_uniform_{t}": (_I64, (_VP,)),
    "attnuq_lt_rows_{t}": (None, (_VP,)),
    "attnuq_lt_qprep_{t}": (None, (_VP,)),
    "attnuq_lt_qpost_{t}": (None, (_VP,)),
    "attnuq_lt_tail_fwd_{t}": (None, (_VP,)),
    "attnuq_lt_tail_bwd_{t}": (None, (_VP,)),
    "attnuq_lt_pairs_{t}": (None, (_VP, _VP, _I64, _I64, _VP)),  # (ct, st, K, n, feats)
    # (g_f, ct, st, K, n, g_c, g_s)
    "attnuq_lt_pairs_grad_{t}": (None, (_VP, _VP, _VP, _I64, _I64, _VP, _VP)),
    # (wsum, gT, H, ct, st, K, n, g_c, g_s, g_ws)
    "attnuq_lt_pairs_grad_heads_{t}": (
        None, (_VP, _VP, _I64, _VP, _VP, _I64, _I64, _VP, _VP, _VP)),
    "attnuq_lt_phi_f64": (None, (_VP, _I64, _VP, _VP, _VP, _VP)),  # (x, n, val, der, phi, dphi)
}

# words of struct levy_args (csrc/levy.c) and struct fused_args (csrc/fused.c), passed as one
# int64 array in field order
_LEVY_ARGS_WORDS = 43
_FUSED_ARGS_WORDS = 45
# words of struct lt_prep_args, lt_post_args, lt_rows_args, lt_q_args and lt_tail_args
# (csrc/levy_train.c)
_LT_WORDS = (26, 24, 21, 18)
_LT_TAIL_WORDS = 39

#: (the library's size query, its argument, the words the wrappers pass, the struct)
_STRUCT_WORDS: tuple[tuple[str, tuple[int, ...], int, str], ...] = (
    ("attnuq_levy_args_words", (), _LEVY_ARGS_WORDS, "struct levy_args"),
    ("attnuq_fused_args_words", (), _FUSED_ARGS_WORDS, "struct fused_args"),
    *(("attnuq_levy_train_words", (i,), n, f"levy_train struct {i}")
      for i, n in enumerate(_LT_WORDS)),
    ("attnuq_lt_tail_words", (), _LT_TAIL_WORDS, "struct lt_tail_args"),
)

# return codes of attnuq_levy_* (or-ed over threads)
_LEVY_NOMEM = 1
_LEVY_NONFINITE = 2


def _bind(lib: ctypes.CDLL) -> str | None:
    """Declare every signature of :data:`_SIGNATURES` on ``lib`` and check the struct sizes;
    None, or why the library does not fit these wrappers."""
    for pattern, (restype, argtypes) in _SIGNATURES.items():
        for name in {pattern.format(t=t) for t in _FLOATS}:
            try:
                fn = getattr(lib, name)
            except AttributeError:
                return f"the kernel library lacks {name} (sources out of sync)"
            fn.restype, fn.argtypes = restype, list(argtypes)
    for query, args, words, struct in _STRUCT_WORDS:
        got = int(getattr(lib, query)(*args))
        if got != words:
            return f"{struct} has {got} words, the wrappers pass {words} (sources out of sync)"
    return None


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    """``(library, reason)``: the loaded kernels with their signatures declared, or None and
    why not (cached per process)."""
    lib, reason = _build.load_library()
    if lib is None:
        return None, reason
    err = _bind(lib)
    if err is not None:
        return None, f"{reason.split(': ', 1)[-1]}: {err}"
    return lib, reason


def _lib() -> ctypes.CDLL:
    """The loaded library, or RuntimeError with the reason it is not there."""
    lib, reason = _load()
    if lib is None:
        raise RuntimeError(f"native kernels unavailable: {reason}")
    return lib


def status() -> dict[str, object]:
    """Whether the kernel is in use: ``{"available": bool, "enabled": bool, "reason": str}``.

    Example
    -------
    >>> from attnuq.ops import _native
    >>> sorted(_native.status())
    ['available', 'enabled', 'reason']
    """
    lib, reason = _load()
    return {"available": lib is not None, "enabled": _enabled, "reason": reason}


def native_status() -> dict[str, object]:
    """Which CPU path attnuq's operators take, and why.

    Returns ``{"available", "enabled", "openmp", "fused", "simd", "reason"}``: whether the C
    kernels are compiled and loaded, whether they are switched on (``ATTNUQ_NATIVE=0`` or
    :func:`disabled` switch them off), whether they split rows over OpenMP threads, whether
    the fused attention kernels run (``fused``), which vector path those were built for
    (``simd``: ``"avx512"``, 16 float lanes, or ``"portable"``, 8 lanes as on AVX2, forced by
    ``ATTNUQ_NATIVE_PORTABLE=1``; None without the kernels), and the compiler line and library
    path, or why they are not in use (no compiler, a cache folder refused because another user
    owns it, ...). Without the kernels the pure-torch paths run: the same distribution for the
    sampler, the same numbers to rounding for Levy attention and the moments.

    Dispatch on the CPU. :func:`attnuq.ops.sampled_attention` (dense or key-blocked) with
    float32 computation (float32, float16 and bfloat16 inputs) takes the fused kernels when
    ``fused`` is true and any ``attn_mask`` fits one bias table (a mask that is the same for
    every query, or at most ``2**22`` elements once expanded to every query row): scores, draws
    and the gather of the drawn value rows in one pass (with a gradient for ``v`` the kernel
    draws the indices and ``embedding_bag`` gathers them, as the backward needs).
    :func:`attnuq.ops.attention_moments` takes them under the same conditions with
    ``block_size=None`` and no gradient for ``q``, ``k`` or ``v``. Otherwise (float64, a larger
    per-query mask, :func:`unfused`) the sampler runs torch's score GEMM and the row kernels
    (``available``), or pure torch ops.

    Examples
    --------
    >>> import attnuq.ops
    >>> s = attnuq.ops.native_status()
    >>> sorted(s), isinstance(s["reason"], str)
    (['available', 'enabled', 'fused', 'openmp', 'reason', 'simd'], True)
    >>> s["openmp"] <= s["available"]  # OpenMP only ever reported for a loaded kernel
    True
    """
    lib, reason = _load()
    lanes = None if lib is None else int(lib.attnuq_fused_lanes())
    return {"available": lib is not None, "enabled": _enabled,
            "openmp": lib is not None and _has_openmp(lib),
            "fused": lib is not None and _enabled and _fused_enabled,
            "simd": None if lanes is None else "avx512" if lanes == 16 else "portable",
            "reason": reason}


def available() -> bool:
    """True when the kernel is compiled, loaded and not switched off by :func:`disabled`."""
    return _enabled and _load()[0] is not None


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block the dense sampler uses the pure-torch path (for tests and benchmarks).

    Example
    -------
    >>> from attnuq.ops import _native
    >>> with _native.disabled():
    ...     _native.available()
    False
    """
    global _enabled
    prev, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = prev


def _has_openmp(lib: ctypes.CDLL) -> bool:
    """Whether the kernel splits rows itself (compiled with OpenMP)."""
    return bool(lib.attnuq_openmp())


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="attnuq-sample")


def sample_rows(
    s: torch.Tensor, u: torch.Tensor, out: torch.Tensor, empty: torch.Tensor
) -> None:
    """Inverse-CDF draws for every row of ``s`` (CPU, needs :func:`available`).

    ``s`` ``(R, L)`` scores in log2 units (``-inf`` = excluded key), rows contiguous;
    ``u`` ``(R, nu)`` uniforms in ``[0, 1)``, contiguous, same dtype (float32 or float64);
    ``out`` ``(R, nu)`` int32 or int64, contiguous: the drawn key of each uniform;
    ``empty`` ``(R,)`` bool, contiguous: rows whose every score is ``-inf`` (their indices are 0).
    """
    lib = _lib()
    rows, lk = s.shape
    nu = u.shape[1]
    if not (
        s.device.type == "cpu"
        and s.dtype in (torch.float32, torch.float64)
        and u.dtype == s.dtype
        and u.shape == (rows, nu)
        and out.shape == (rows, nu)
        and out.dtype in (torch.int32, torch.int64)
        and empty.shape == (rows,)
        and empty.dtype == torch.bool
        and s.stride(1) == 1
        and u.is_contiguous()
        and out.is_contiguous()
        and empty.is_contiguous()
    ):
        raise ValueError(
            "sample_rows needs CPU float32/float64 s (R, L) with unit key stride, contiguous u "
            f"(R, nu), out (R, nu) int32/int64 and empty (R,) bool; got s {tuple(s.shape)} "
            f"{s.dtype} {s.device} stride {s.stride()}, u {tuple(u.shape)} {u.dtype}, "
            f"out {tuple(out.shape)} {out.dtype}, empty {tuple(empty.shape)} {empty.dtype}"
        )
    fn = lib.attnuq_sample_rows_f32 if s.dtype == torch.float32 else lib.attnuq_sample_rows_f64
    i32 = out.dtype == torch.int32
    ss, us, os_ = s.element_size(), u.element_size(), out.element_size()
    sp, up, op, ep = s.data_ptr(), u.data_ptr(), out.data_ptr(), empty.data_ptr()
    stride = s.stride(0)

    workers = _row_workers(rows, lk, nu)

    def run(r0: int, r1: int, threads: int) -> int:
        o = op + r0 * nu * os_
        return int(
            fn(
                sp + r0 * stride * ss, r1 - r0, lk, stride, up + r0 * nu * us, nu,
                o if i32 else None, None if i32 else o, ep + r0, threads,  # bool: 1 byte
            )
        )

    if any(_dispatch(lib, rows, workers, run)):
        raise MemoryError(f"native sampling kernel could not allocate scratch for Lk={lk}")


def _row_workers(rows: int, lk: int, nu: int) -> int:
    """Threads for a row kernel: at most torch's thread count and one per row, and no more than
    one per ``_MIN_ELEMS_PER_THREAD`` elements of work (``rows * max(lk, nu)``)."""
    workers = min(torch.get_num_threads(), max(1, rows * max(lk, nu) // _MIN_ELEMS_PER_THREAD))
    return max(1, min(workers, rows))


def sample_block(
    s: torch.Tensor, u: torch.Tensor, run: torch.Tensor, choice: torch.Tensor, j0: int
) -> None:
    """One key block of the key-blocked sampler, in place (CPU, needs :func:`available`).

    ``s`` ``(R, L)`` block scores in log2 units (``-inf`` = excluded), unit key stride; ``u``
    ``(R, nu)`` uniforms in ``[0, 1)``, contiguous, same dtype (float32 or float64); ``run``
    ``(R,)`` the rows' log2-mass of the keys seen so far (``-inf`` before the first block),
    updated to ``logaddexp2(run, lb)`` with ``lb`` the block's log2-mass; ``choice`` ``(R, nu)``
    int32 or int64: each draw is replaced, with probability ``p = 2^(lb - run')``, by
    ``j0`` plus an inverse-CDF draw within the block (``u / p`` the threshold; see
    ``csrc/sample_rows.c``).
    """
    lib = _lib()
    rows, lk = s.shape
    nu = u.shape[1]
    if not (
        s.device.type == "cpu"
        and s.dtype in (torch.float32, torch.float64)
        and u.dtype == s.dtype
        and run.dtype == s.dtype
        and u.shape == (rows, nu)
        and run.shape == (rows,)
        and choice.shape == (rows, nu)
        and choice.dtype in (torch.int32, torch.int64)
        and s.stride(1) == 1
        and u.is_contiguous()
        and run.is_contiguous()
        and choice.is_contiguous()
    ):
        raise ValueError(
            "sample_block needs CPU float32/float64 s (R, L) with unit key stride, contiguous "
            f"u (R, nu) and run (R,) of s's dtype, choice (R, nu) int32/int64; got s "
            f"{tuple(s.shape)} {s.dtype} stride {s.stride()}, u {tuple(u.shape)} {u.dtype}, "
            f"run {tuple(run.shape)} {run.dtype}, choice {tuple(choice.shape)} {choice.dtype}"
        )
    fn = lib.attnuq_sample_block_f32 if s.dtype == torch.float32 else lib.attnuq_sample_block_f64
    i32 = choice.dtype == torch.int32
    ss, es, cs = s.element_size(), u.element_size(), choice.element_size()
    sp, up, rp, cp = s.data_ptr(), u.data_ptr(), run.data_ptr(), choice.data_ptr()
    stride = s.stride(0)
    workers = _row_workers(rows, lk, nu)

    def go(r0: int, r1: int, threads: int) -> int:
        c = cp + r0 * nu * cs
        return int(
            fn(
                sp + r0 * stride * ss, r1 - r0, lk, stride, up + r0 * nu * es, nu,
                rp + r0 * es, c if i32 else None, None if i32 else c, j0, threads,
            )
        )

    if any(_dispatch(lib, rows, workers, go)):
        raise MemoryError(f"native sampling kernel could not allocate scratch for L={lk}")


def _dispatch(
    lib: ctypes.CDLL, rows: int, workers: int, run: Callable[[int, int, int], int]
) -> list[int]:
    """The return codes of ``run(r0, r1, threads)`` over ``[0, rows)`` on ``workers`` threads.

    With OpenMP one call, ``run(0, rows, workers)``: the kernel splits the rows over the
    process's OpenMP threads (torch's own, which would otherwise spin idle beside Python
    threads). Without it, contiguous shares on as many Python threads, one thread each (the
    calling thread takes the first; ctypes releases the GIL during each call).
    """
    if workers == 1 or _has_openmp(lib):
        return [run(0, rows, workers)]
    bounds = [rows * i // workers for i in range(workers + 1)]
    pool = _pool(workers - 1)
    futs = [pool.submit(run, bounds[i], bounds[i + 1], 1) for i in range(1, workers)]
    return [run(bounds[0], bounds[1], 1)] + [f.result() for f in futs]


def fused_available() -> bool:
    """True when the fused float32 attention kernels (``csrc/fused.c``) may run: the library is
    loaded, :func:`disabled` is not active and neither is :func:`unfused`."""
    return _fused_enabled and available()


@contextlib.contextmanager
def unfused() -> Iterator[None]:
    """Within the block the samplers and moments skip the fused kernels (the row kernels and
    torch's GEMM run instead; for tests and benchmarks).

    Example
    -------
    >>> from attnuq.ops import _native
    >>> with _native.unfused():
    ...     _native.fused_available()
    False
    """
    global _fused_enabled
    prev, _fused_enabled = _fused_enabled, False
    try:
        yield
    finally:
        _fused_enabled = prev


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def fused_call(
    what: str,
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None,
    causal_lq: int,
    chunk: tuple[int, int, int, int],
    v: torch.Tensor,
    offs: torch.Tensor,
    step: int,
    dv: int,
    empty: torch.Tensor,
    *,
    seed: int = 0,
    nu: int = 0,
    block: int = 0,
    out: torch.Tensor | None = None,
    var: torch.Tensor | None = None,
    idx: torch.Tensor | None = None,
    bias_natural: bool = False,
) -> bool:
    """Run a fused kernel of ``csrc/fused.c`` on rows ``i0:i1`` of groups ``g0:g1`` (``chunk``);
    returns whether every entry of ``q`` (those rows) and ``k`` (those groups) is finite (when
    not, the outputs are meaningless and the caller reports the input).

    ``what`` is ``"sample"`` (dense sampler, ``block = 0``, or key-blocked with ``block``
    keys per block) or ``"moments"``. All float tensors float32 on the CPU: ``q`` ``(G, M, D)``
    and ``k`` ``(G, Lk, D)`` with unit last stride; ``scale`` multiplies ``q`` (log2 units);
    ``bias`` None or ``(G, M | 1, Lk)`` additive log2 bias with unit key stride (with
    ``bias_natural``: an additive float mask in natural units, which the kernel converts as it
    reads it: ``b log2(e)``, a finite ``b`` never becoming ``-inf``; no NaN or ``+inf``);
    ``causal_lq`` 0, or ``Lq`` when row ``i`` sees keys ``j <= i mod Lq``; value ``j`` of
    group ``g`` is row ``offs[g] + j * step`` of ``v`` ``(rows, dv)`` (unit last stride;
    ``offs`` ``(G,)`` int64);
    ``empty`` ``(G, M)`` bool, written for the chunk's rows. Sampler: ``nu`` draws per row
    from uniforms that the kernel derives from ``seed`` (an int in ``[0, 2**63)``), the group
    and the row (a SplitMix64 stream per row, ``csrc/fused.c``), so the draws do not depend on
    the chunk; ``out`` ``(G, M, dv)`` contiguous or None gets the mean drawn value row, ``idx``
    ``(g, rows, nu)`` int32 or int64 contiguous or None the drawn keys. Moments: ``out`` and
    ``var`` ``(G, M, dv)`` contiguous get the mean and the per-dimension variance.
    """
    lib = _lib()
    g0, g1, i0, i1 = chunk
    G, M, D = q.shape
    lk = k.shape[1]
    f32 = torch.float32
    rows = (g1 - g0) * (i1 - i0)
    checks = [
        q.device.type == "cpu" and q.dtype == f32 and q.stride(2) == 1,
        k.dtype == f32 and k.shape == (G, lk, D) and k.stride(2) == 1,
        bias is None or (bias.dtype == f32 and bias.dim() == 3 and bias.shape[0] == G
                         and bias.shape[1] in (1, M) and bias.shape[2] == lk
                         and bias.stride(2) == 1),
        0 <= g0 <= g1 <= G and 0 <= i0 <= i1 <= M,
        v.dtype == f32 and v.dim() == 2 and v.shape[1] == dv and (dv == 0 or v.stride(1) == 1),
        offs.dtype == torch.int64 and offs.shape == (G,) and offs.is_contiguous(),
        empty.dtype == torch.bool and empty.shape == (G, M) and empty.is_contiguous(),
        out is None or (out.dtype == f32 and out.shape == (G, M, dv) and out.is_contiguous()),
    ]
    if what == "sample":
        checks += [
            nu >= 1 and 0 <= seed < 2**63,
            idx is None or (idx.dtype in (torch.int32, torch.int64) and idx.is_contiguous()
                            and idx.shape == (g1 - g0, i1 - i0, nu)),
        ]
    elif what == "moments":
        checks += [out is not None and var is not None and var.dtype == f32
                   and var.shape == (G, M, dv) and var.is_contiguous()]
    else:
        checks = [False]
    if not all(checks):
        raise ValueError(
            f"fused_call({what!r}) got inconsistent buffers (check {checks.index(False)}): q "
            f"{tuple(q.shape)} {q.dtype} stride {q.stride()}, k {tuple(k.shape)} {k.dtype}, "
            f"bias {None if bias is None else (tuple(bias.shape), bias.dtype, bias.stride())}, "
            f"chunk {chunk}, v {tuple(v.shape)} {v.dtype}, offs {tuple(offs.shape)} "
            f"{offs.dtype}, empty {tuple(empty.shape)} {empty.dtype}, seed {seed}, nu {nu}, "
            f"block {block}, out "
            f"{None if out is None else (tuple(out.shape), out.dtype)}, idx "
            f"{None if idx is None else (tuple(idx.shape), idx.dtype)}"
        )
    o_sn = M * dv
    words = [
        q.data_ptr(), q.stride(0), 0, q.stride(1), k.data_ptr(), k.stride(0), 0, k.stride(1),
        G, M, lk, D, 1, 1, max(1, M),
        _ptr(bias), 0 if bias is None else bias.stride(0), 0, 0,
        0 if bias is None or bias.shape[1] == 1 else bias.stride(1),
        int(causal_lq > 0), max(1, causal_lq), g0, g1, i0, i1,
        seed, nu, max(0, block), v.data_ptr(), v.stride(0), 0, step * v.stride(0), offs.data_ptr(),
        dv,
        _ptr(out), o_sn, 0, dv, _ptr(var), _ptr(idx),
        int(idx is not None and idx.dtype == torch.int64), empty.data_ptr(),
        int(bias is not None and bias_natural),
    ]
    return _fused_run(lib, what, words, scale, rows, lk, nu, dv, D)


def _fused_run(lib: ctypes.CDLL, what: str, words: list[int], scale: float, rows: int, lk: int,
               nu: int, dv: int, d: int) -> bool:
    """Call the fused kernel ``what`` on ``words`` (struct fused_args without its last word,
    the thread count, which is added here); whether every entry of ``q`` and ``k`` read was
    finite."""
    words.append(_row_workers(rows, lk, max(nu, dv)) if _has_openmp(lib) else 1)
    args = (ctypes.c_int64 * _FUSED_ARGS_WORDS)(*words)
    fn = lib.attnuq_fused_sample_f32 if what == "sample" else lib.attnuq_fused_moments_f32
    code = int(fn(ctypes.addressof(args), float(scale)))
    if code & 1:
        raise MemoryError(f"fused {what} kernel could not allocate scratch for Lk={lk}, D={d}")
    return not code & 2


def _unit_last(t: torch.Tensor) -> bool:
    return t.shape[-1] <= 1 or t.stride(-1) == 1


def fused_call_4d(
    what: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None,
    causal: bool,
    empty: torch.Tensor,
    *,
    seed: int = 0,
    nu: int = 0,
    block: int = 0,
    out: torch.Tensor | None = None,
    var: torch.Tensor | None = None,
    idx: torch.Tensor | None = None,
    bias_natural: bool = False,
) -> bool:
    """:func:`fused_call` on every row, reading the inputs in their own 4-D layout (no copy
    into groups): ``q`` ``(N, Hq, Lq, D)``, ``k`` ``(N, Hk, Lk, D)``, ``v`` ``(N, Hk, Lk, Dv)``
    float32 with unit last strides and any other strides (``Hq = R Hk``; query head
    ``h R + r`` reads key/value head ``h``); ``bias`` None or ``(N, Hk, R | 1, Lq | 1, Lk)``
    (broadcast dims of stride 0 welcome) with unit key stride, in log2 units or, with
    ``bias_natural``, natural ones (as :func:`fused_call`'s); ``out`` (and ``var``)
    ``(N, Hq, Lq, Dv)`` float32 of any strides with a unit last stride (one layout for both).
    Groups are ``g = n Hk + h``, rows ``i = r Lq + l``, as in :class:`attnuq.ops._attn_common.
    Attn`; ``empty`` ``(G, M)`` bool contiguous, ``idx`` ``(G, M, nu)`` contiguous, the seed and
    the draws as :func:`fused_call`'s (the same inputs give the same draws bit for bit).

    Example
    -------
    Hugging Face's transposed ``(B, L, H, D)`` memory is read in place and gives the draws of a
    contiguous copy; where the kernels are not built, the call is refused with the reason
    :func:`status` gives:

    >>> import torch
    >>> from attnuq.ops import _native
    >>> q, k, v = (x.transpose(1, 2) for x in torch.randn(3, 2, 5, 4, 8).unbind(0))
    >>> def draws(q, k, v):
    ...     idx = torch.empty(8, 5, 3, dtype=torch.int64)  # (G, M, nu), G = 2 x 4 groups
    ...     empty = torch.empty(8, 5, dtype=torch.bool)
    ...     _native.fused_call_4d("sample", q, k, v, 0.5, None, False, empty, seed=7, nu=3,
    ...                           idx=idx)
    ...     return idx
    >>> try:
    ...     ok = torch.equal(draws(q, k, v), draws(q.contiguous(), k.contiguous(), v.contiguous()))
    ... except RuntimeError as e:  # no kernel here
    ...     ok = _native.status()["available"] is False and str(e).endswith(
    ...         _native.status()["reason"])
    >>> ok
    True
    """
    lib = _lib()
    f32 = torch.float32
    n, hq, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    dv = v.shape[3]
    r = hq // max(1, hk)
    G, M = n * hk, r * lq
    o = out if out is not None else var
    checks = [
        q.device.type == "cpu" and q.dtype == f32 and q.dim() == 4 and _unit_last(q),
        k.dtype == f32 and k.dim() == 4 and k.shape[0] == n and k.shape[3] == d
        and hk >= 1 and hq == r * hk and _unit_last(k),
        v.dtype == f32 and v.dim() == 4 and v.shape[:3] == k.shape[:3] and _unit_last(v),
        bias is None or (bias.dtype == f32 and bias.dim() == 5
                         and bias.shape[:2] == (n, hk) and bias.shape[2] in (1, r)
                         and bias.shape[3] in (1, lq) and bias.shape[4] == lk
                         and _unit_last(bias)),
        empty.dtype == torch.bool and empty.shape == (G, M) and empty.is_contiguous(),
        o is None or (o.dtype == f32 and o.shape == (n, hq, lq, dv) and _unit_last(o)),
        var is None or out is None or var.stride() == out.stride(),
    ]
    if what == "sample":
        checks += [
            nu >= 1 and 0 <= seed < 2**63,
            idx is None or (idx.dtype in (torch.int32, torch.int64) and idx.is_contiguous()
                            and idx.shape == (G, M, nu)),
        ]
    elif what == "moments":
        checks += [out is not None and var is not None]
    else:
        checks = [False]
    if not all(checks):
        raise ValueError(
            f"fused_call_4d({what!r}) got inconsistent buffers (check {checks.index(False)}): "
            f"q {tuple(q.shape)} {q.dtype} stride {q.stride()}, k {tuple(k.shape)} {k.dtype} "
            f"stride {k.stride()}, v {tuple(v.shape)} {v.dtype} stride {v.stride()}, bias "
            f"{None if bias is None else (tuple(bias.shape), bias.dtype, bias.stride())}, "
            f"empty {tuple(empty.shape)} {empty.dtype}, seed {seed}, nu {nu}, out "
            f"{None if o is None else (tuple(o.shape), o.dtype, o.stride())}, idx "
            f"{None if idx is None else (tuple(idx.shape), idx.dtype)}"
        )
    bs = (0, 0, 0, 0) if bias is None else tuple(
        0 if sz == 1 else st for sz, st in zip(bias.shape[:4], bias.stride()[:4], strict=True))
    os_ = (0, 0, 0) if o is None else o.stride()[:3]
    words = [
        q.data_ptr(), *q.stride()[:3], k.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
        G, M, lk, d, hk, r, max(1, lq),
        _ptr(bias), *bs,
        int(causal), max(1, lq), 0, G, 0, M,
        seed, nu, max(0, block), v.data_ptr(), v.stride(0), v.stride(1), v.stride(2), 0, dv,
        _ptr(out), *os_, _ptr(var), _ptr(idx), int(idx is not None and idx.dtype == torch.int64),
        empty.data_ptr(), int(bias is not None and bias_natural),
    ]
    return _fused_run(lib, what, words, scale, G * M, lk, nu, dv, d)


@functools.cache
def _phi_table() -> torch.Tensor:
    """The tables of :mod:`attnuq.ops.phi` in the layout of ``phi_eval`` in ``csrc/levy.c``."""
    tab = torch.tensor(
        [*_phi._TAYLOR, *(c for piece in _phi._MONO_VAL for c in piece),
         *_phi._FACT[: _phi._N_ASYMPTOTIC + 1]],
        dtype=torch.float64,
    )
    lib = _load()[0]
    if lib is not None and tab.numel() != lib.attnuq_phi_tab_len():
        raise RuntimeError(f"phi tables: {tab.numel()} numbers, the kernel expects "
                           f"{lib.attnuq_phi_tab_len()} (csrc/levy.c out of sync)")
    return tab


def phi(x: torch.Tensor) -> torch.Tensor:
    """The kernel's ``phi`` (float64, for tests against :func:`attnuq.ops.poisson_phi`).

    Example
    -------
    Where the kernels are built, the kernel's ``phi`` equals the torch one; where they are not,
    the call is refused with the reason :func:`status` gives:

    >>> import torch
    >>> from attnuq.ops import _native, poisson_phi
    >>> x = torch.tensor([0.5, 3.0, 1e4], dtype=torch.float64)
    >>> try:
    ...     ok = bool(torch.allclose(_native.phi(x), poisson_phi(x), rtol=1e-14))
    ... except RuntimeError as e:  # no kernel here
    ...     ok = _native.status()["available"] is False and str(e).endswith(
    ...         _native.status()["reason"])
    >>> ok
    True
    """
    lib = _lib()
    x = x.detach().to(torch.float64).contiguous()
    out = torch.empty_like(x)
    tab = _phi_table()
    lib.attnuq_phi_f64(x.data_ptr(), x.numel(), tab.data_ptr(), out.data_ptr())
    return out


class LevyKernelOutput(NamedTuple):
    """Outputs of :func:`levy_forward`, ``(B, H, Q, ...)`` views of ``(B, Q, H, ...)`` memory."""

    mean: torch.Tensor
    var: torch.Tensor | None
    evidence: torch.Tensor
    phi: torch.Tensor
    sigma: torch.Tensor
    sigma_dim: torch.Tensor | None


def levy_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    a: torch.Tensor,
    mask: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    field: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    per_dim: bool,
) -> LevyKernelOutput | None:
    """Inference forward of Levy attention in the compiled kernel (CPU, needs :func:`available`).

    ``q`` ``(B, H, Q, E)``, ``k`` ``(B, H, N, E)``, ``a`` ``(B, H, N, Dv)``: one float dtype
    (float32 or float64), any strides with a unit last stride; ``mask`` ``(B, N)`` bool
    (``True`` = observed; excluded rows are never read and may hold anything); ``alpha``,
    ``beta`` ``(H,)``. ``field`` is ``None`` (no value field) or ``(ct, st, omega, D, h)``:
    ``ct``, ``st`` ``(Hw, K, B N)`` the cosines and sines of ``omega_k t_i + phase_k`` (series
    ``b`` at columns ``b N ..``; ``Hw = 1`` when the heads share the frequencies, else ``H``),
    ``omega`` ``(Hw, K)``, ``D`` ``(H, Dv, K)``, ``h`` ``(H,)`` (the kernel derives the field
    weights of :func:`attnuq.ops.levy._field` from them).

    Returns the outputs, shaped ``(B, H, Q, ...)`` as :class:`attnuq.ops.LevyResult` without
    ``p_empty`` (``exp(-evidence)``, the caller's), as transposed views of ``(B, Q, H, ...)``
    memory (the layout a module concatenating heads wants); ``var`` and ``sigma_dim`` are
    ``None`` unless ``per_dim``. Returns ``None`` when an observed row of ``k`` or ``a``, or a
    row of ``q``, is not finite (its sum of squares is NaN/inf): the caller decides.

    Example
    -------
    Where the kernels are built, the kernel gives the reference path's mean; where they are
    not, the call is refused with the reason :func:`status` gives:

    >>> import torch
    >>> from attnuq.ops import _native, levy_attention
    >>> q, k, a = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 6)
    >>> mask, one = torch.ones(2, 5, dtype=torch.bool), torch.ones(4)
    >>> try:
    ...     out = _native.levy_forward(q, k, a, mask, one, 2 * one, None, True)
    ...     ref = levy_attention(q, k, a, torch.zeros(2, 5), mask, alpha=1.0, beta=2.0, h=0.0,
    ...                          backend="explicit")
    ...     ok = out.mean.shape == (2, 4, 3, 6) and bool(
    ...         torch.allclose(out.mean, ref.mean, atol=1e-5))
    ... except RuntimeError as e:  # no kernel here
    ...     ok = _native.status()["available"] is False and str(e).endswith(
    ...         _native.status()["reason"])
    >>> ok
    True
    """
    lib = _lib()
    B, H, Q, E = q.shape
    N, Dv = k.shape[2], a.shape[3]
    dt = q.dtype
    K = 0 if field is None else field[0].shape[-2]
    hw = 1 if field is None else field[0].shape[0]
    ok = (
        q.device.type == "cpu" and dt in (torch.float32, torch.float64)
        and k.dtype == dt and a.dtype == dt and k.shape == (B, H, N, E) and a.shape[:3] == (B, H, N)
        and q.stride(3) == 1 and k.stride(3) == 1 and a.stride(3) == 1
        and mask.shape == (B, N) and mask.dtype == torch.bool
        and alpha.shape == (H,) and beta.shape == (H,) and alpha.dtype == dt and beta.dtype == dt
    )
    if field is not None:
        ct, st, om, dd, hh = field
        ok = (ok and hw in (1, H) and ct.shape == (hw, K, B * N) and st.shape == ct.shape
              and om.shape == (hw, K) and dd.shape == (H, Dv, K) and hh.shape == (H,)
              and all(t.dtype == dt for t in field))
    if not ok:
        raise ValueError(
            "levy_forward needs CPU float32/float64 q (B, H, Q, E), k (B, H, N, E), "
            "a (B, H, N, Dv) with unit last strides, a (B, N) bool mask, (H,) alpha and beta of "
            f"the same dtype and a consistent field; got q {tuple(q.shape)} {q.dtype} {q.device}, "
            f"k {tuple(k.shape)} {k.dtype}, a {tuple(a.shape)} {a.dtype}, "
            f"mask {tuple(mask.shape)} {mask.dtype}, alpha {tuple(alpha.shape)} {alpha.dtype}, "
            f"beta {tuple(beta.shape)} {beta.dtype}, field "
            f"{None if field is None else [(tuple(t.shape), t.dtype) for t in field]}"
        )
    # every tensor the kernel reads stays referenced (by `keep`) until it returns
    keep = [mask.contiguous(), alpha.contiguous(), beta.contiguous()]
    if field is not None:
        keep += [t.contiguous() for t in field]
    mean = q.new_empty(B, Q, H, Dv)
    var = q.new_empty(B, Q, H, Dv) if per_dim else None
    sigma_dim = q.new_empty(B, Q, H, Dv) if per_dim else None
    evidence, phi_, sigma = (q.new_empty(B, Q, H) for _ in range(3))
    ct_, st_, om_, dd_, hh_ = keep[3:] if field is not None else (None,) * 5

    def ptr(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.data_ptr()

    words = [  # struct levy_args, field by field
        q.data_ptr(), k.data_ptr(), a.data_ptr(), *q.stride()[:3], *k.stride()[:3],
        *a.stride()[:3], ptr(ct_), ptr(st_), 0 if ct_ is None else ct_.stride(1), hw,
        keep[0].data_ptr(), B, H, Q, N, E, Dv, K, int(per_dim),
        keep[1].data_ptr(), keep[2].data_ptr(), ptr(hh_), ptr(om_), ptr(dd_),
        _phi_table().data_ptr(), mean.data_ptr(), ptr(var), ptr(sigma_dim),
        evidence.data_ptr(), phi_.data_ptr(), sigma.data_ptr(),
        Q * H * Dv, Dv, H * Dv,  # (b, h, q) strides of (B, Q, H, Dv) memory
        Q * H, 1, H,  # and of (B, Q, H)
    ]
    args = (ctypes.c_int64 * _LEVY_ARGS_WORDS)(*words)
    fn = lib.attnuq_levy_f32 if dt == torch.float32 else lib.attnuq_levy_f64
    # batch elements are split over the threads (each takes all heads of its series)
    work = H * Q * max(N, 1) * (E + 2 * Dv)
    workers = max(1, min(torch.get_num_threads(), B, B * work // _MIN_ELEMS_PER_THREAD))
    ref = ctypes.addressof(args)
    codes = _dispatch(lib, B, workers, lambda b0, b1, th: int(fn(ref, b0, b1, th))) if B else []
    code = functools.reduce(operator.or_, codes, 0)
    if code & _LEVY_NOMEM:
        raise MemoryError(f"native Levy kernel could not allocate scratch for N={N}, H={H}")
    if code & _LEVY_NONFINITE:
        return None

    def t(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.transpose(1, 2)

    return LevyKernelOutput(mean.transpose(1, 2), t(var), evidence.transpose(1, 2),
                            phi_.transpose(1, 2), sigma.transpose(1, 2), t(sigma_dim))


# ----------------------------------------------------------------------------- training loops
#
# csrc/levy_train.c: the elementwise passes of the Levy training path (attnuq.ops.levy's
# _FlashBlock and _SharedField) as plain C loops, float32 and float64. Each wrapper takes
# tensors whose shapes and strides its caller guarantees (they are private) and checks only
# what the C code relies on for memory safety.

_LT_SFX = {torch.float32: "f32", torch.float64: "f64"}


def train_loops_available(dtype: torch.dtype, device: torch.device) -> bool:
    """True when the training loops of ``csrc/levy_train.c`` can run on tensors of this dtype
    and device (CPU float32/float64, the library loaded, :func:`disabled` not active).

    Example
    -------
    >>> import torch
    >>> from attnuq.ops import _native
    >>> _native.train_loops_available(torch.float16, torch.device("cpu"))
    False
    """
    return device.type == "cpu" and dtype in _LT_SFX and available()


def _words(n: int, words: list[int]) -> ctypes.Array[ctypes.c_int64]:
    assert len(words) == n, (len(words), n)
    return (ctypes.c_int64 * n)(*words)


def _lt_run(fn: Callable[..., None], args: ctypes.Array[ctypes.c_int64], B: int) -> None:
    """``fn(args, b0, b1, threads)`` over the batch, split as :func:`_dispatch` does."""
    lib = _lib()
    workers = max(1, min(torch.get_num_threads(), B))
    ref = ctypes.addressof(args)

    def run(b0: int, b1: int, threads: int) -> int:
        fn(ref, b0, b1, threads)
        return 0

    if B:
        _dispatch(lib, B, workers, run)


def lt_prep(
    k: torch.Tensor, vbar: torch.Tensor, within: torch.Tensor | None, ref: torch.Tensor,
    buf: torch.Tensor, nrm: torch.Tensor, per_dim: bool,
) -> None:
    """Forward loop of the training block: ``buf`` ``(B, N, H, W)`` rows
    ``[kn | tr sq | 0 | vc | sq | 0 ...]`` and ``nrm`` ``(B, N, H)`` (csrc/levy_train.c, prep).

    ``k`` ``(B, N, H, E)``, ``vbar`` ``(B, N, H, dv)``, ``within`` ``(B, N, H, ws)`` or None,
    ``ref`` ``(B, H, dv)``: any strides with a unit last stride (``within`` may broadcast its
    last axis); ``buf`` and ``nrm`` contiguous, same dtype.
    """
    lib = _lib()
    B, N, H, E = k.shape
    dv = vbar.shape[-1]
    ws = dv if per_dim else 1
    W = buf.shape[-1]
    assert (buf.is_contiguous() and nrm.is_contiguous() and buf.shape[:3] == (B, N, H)
            and W >= E + 2 + dv + ws and vbar.shape[:3] == (B, N, H) and ref.shape == (B, H, dv)
            and k.stride(3) == 1 and vbar.stride(3) == 1 and ref.stride(2) == 1
            and nrm.shape == (B, N, H))
    assert all(t.dtype == k.dtype for t in (vbar, ref, buf, nrm))
    keep = [k, vbar, ref, buf, nrm]
    if within is not None:
        assert within.shape[:3] == (B, N, H) and within.dtype == k.dtype
        assert within.shape[3] == ws or (within.stride(3) == 0 and per_dim)
        wst = [*within.stride()[:3], within.stride(3) if within.shape[3] > 1 else 0]
        keep.append(within)
    else:
        wst = [0, 0, 0, 0]
    args = _words(_LT_WORDS[0], [
        k.data_ptr(), *k.stride()[:3], vbar.data_ptr(), *vbar.stride()[:3],
        0 if within is None else within.data_ptr(), *wst, ref.data_ptr(), *ref.stride()[:2],
        buf.data_ptr(), nrm.data_ptr(), B, N, H, E, dv, ws, W, int(per_dim)])
    _lt_run(getattr(lib, "attnuq_lt_prep_" + _LT_SFX[k.dtype]), args, B)
    del keep


def lt_post(
    gk: torch.Tensor, gv: torch.Tensor, buf: torch.Tensor, nrm: torch.Tensor, E: int, dv: int,
    wsq: int, cols: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward loop of the training block (csrc/levy_train.c, post): from the flash backward's
    key and value gradients ``gk``, ``gv`` ``(B, N, H, .)`` (unit last stride) and the forward's
    ``buf``, ``nrm``: ``g_k`` ``(B, N, H, E)``, ``g_vc`` ``(B, N, H, dv)``, ``g_sq``
    ``(B, N, H, wsq)`` (contiguous) and ``g_ref = -sum_n g_vc`` ``(B, H, dv)``. ``cols``: the
    columns of ``gv`` where the ``vc`` and the ``sq`` gradients start."""
    lib = _lib()
    B, N, H, W = buf.shape
    assert gk.shape[:3] == (B, N, H) and gv.shape[:3] == (B, N, H)
    assert gk.stride(3) == 1 and gv.stride(3) == 1 and gk.shape[3] >= E
    assert gv.shape[3] >= max(cols[0] + dv, cols[1] + wsq)
    assert buf.is_contiguous() and nrm.is_contiguous()
    assert gk.dtype == buf.dtype and gv.dtype == buf.dtype and nrm.dtype == buf.dtype
    g_k = buf.new_empty(B, N, H, E)
    g_vc = buf.new_empty(B, N, H, dv)
    g_sq = buf.new_empty(B, N, H, wsq)
    g_ref = buf.new_empty(B, H, dv)
    args = _words(_LT_WORDS[1], [
        gk.data_ptr(), *gk.stride()[:3], gv.data_ptr(), *gv.stride()[:3], buf.data_ptr(),
        nrm.data_ptr(), g_k.data_ptr(), g_vc.data_ptr(), g_sq.data_ptr(), g_ref.data_ptr(),
        B, N, H, E, dv, wsq, W, cols[0], cols[1], E + 2])
    _lt_run(getattr(lib, "attnuq_lt_post_" + _LT_SFX[buf.dtype]), args, B)
    return g_k, g_vc, g_sq, g_ref


def _rows_args(g_out: torch.Tensor, out: torch.Tensor, g_lse: torch.Tensor, dv: int, ws: int,
               dp: int, narrow: bool, gt: torch.Tensor | None,
               ot: torch.Tensor | None) -> ctypes.Array[ctypes.c_int64]:
    B, H, Q = out.shape[:3]
    assert g_out.shape[:3] == (B, H, Q) and g_out.shape[3] >= dv + ws and out.shape[3] >= dv + ws
    assert g_out.stride(3) == 1 and out.stride(3) == 1 and g_lse.shape == (B, H, Q)
    assert g_out.dtype == out.dtype and g_lse.dtype == out.dtype
    return _words(_LT_WORDS[2], [
        g_out.data_ptr(), *g_out.stride()[:3], out.data_ptr(), *out.stride()[:3],
        g_lse.data_ptr(), *g_lse.stride(), 0 if gt is None else gt.data_ptr(),
        0 if ot is None else ot.data_ptr(), B, H, Q, dv, ws, dp, int(narrow)])


def lt_uniform(g_out: torch.Tensor, out: torch.Tensor, g_lse: torch.Tensor, dv: int,
               ws: int) -> bool:
    """Whether ``g_out[..., dv : dv + ws]`` is the same on every column, row by row."""
    lib = _lib()
    args = _rows_args(g_out, out, g_lse, dv, ws, 0, False, None, None)
    return bool(getattr(lib, "attnuq_lt_uniform_" + _LT_SFX[out.dtype])(ctypes.addressof(args)))


def lt_rows(g_out: torch.Tensor, out: torch.Tensor, g_lse: torch.Tensor, dv: int, ws: int,
            dp: int, narrow: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient and output rows handed to the flash backward, ``(B, H, Q, dp)`` views of
    ``(B, Q, H, dp)`` memory (see ``attnuq.ops.levy._FlashBlock.backward``)."""
    lib = _lib()
    B, H, Q = out.shape[:3]
    gt = out.new_empty(B, Q, H, dp)
    ot = out.new_empty(B, Q, H, dp)
    assert dp >= (dv + 2 if narrow else dv + ws + 1)
    args = _rows_args(g_out, out, g_lse, dv, ws, dp, narrow, gt, ot)
    getattr(lib, "attnuq_lt_rows_" + _LT_SFX[out.dtype])(ctypes.addressof(args))
    return gt.transpose(1, 2), ot.transpose(1, 2)


def lt_pairs(ct: torch.Tensor, st: torch.Tensor) -> torch.Tensor:
    """Pair features ``[c_k c_l, s_k s_l]_{k <= l}`` ``(K (K + 1), n)`` of contiguous
    ``(K, n)`` cosines and sines (rows by diagonal ``l - k``, then ``k``)."""
    lib = _lib()
    K, n = ct.shape
    assert ct.is_contiguous() and st.is_contiguous() and st.shape == (K, n)
    assert st.dtype == ct.dtype
    feats = ct.new_empty(K * (K + 1), n)
    getattr(lib, "attnuq_lt_pairs_" + _LT_SFX[ct.dtype])(ct.data_ptr(), st.data_ptr(), K, n,
                                                          feats.data_ptr())
    return feats


def lt_pairs_grad(g_f: torch.Tensor, ct: torch.Tensor, st: torch.Tensor, g_c: torch.Tensor,
                  g_s: torch.Tensor) -> None:
    """``g_c``, ``g_s`` ``(K, n)`` += the backward of :func:`lt_pairs` for ``g_f``."""
    lib = _lib()
    K, n = ct.shape
    assert all(t.is_contiguous() and t.dtype == ct.dtype for t in (g_f, ct, st, g_c, g_s))
    assert g_f.shape == (K * (K + 1), n) and g_c.shape == (K, n) and g_s.shape == (K, n)
    getattr(lib, "attnuq_lt_pairs_grad_" + _LT_SFX[ct.dtype])(
        g_f.data_ptr(), ct.data_ptr(), st.data_ptr(), K, n, g_c.data_ptr(), g_s.data_ptr())


@functools.cache
def _phi_der_table() -> torch.Tensor:
    """The tables of ``phi'`` (:mod:`attnuq.ops.phi`) in the layout of ``attnuq_lt_phi_f64``
    (csrc/levy_train.c): Taylor coefficients padded to 24, the pieces, ``0!, ..., 9!``."""
    taylor = [*_phi._TAYLOR_DER, 0.0][: len(_phi._TAYLOR)]
    return torch.tensor([*taylor, *(c for piece in _phi._MONO_DER for c in piece),
                         *_phi._FACT[: _phi._N_ASYMPTOTIC + 2]], dtype=torch.float64)


def lt_phi(lam: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``phi(lam)`` and ``phi'(lam)`` (float64, shaped like ``lam``) for finite ``lam >= 0``
    (unchecked), by the tables of :mod:`attnuq.ops.phi` in one compiled pass."""
    lib = _lib()
    x = lam.detach().to(torch.float64).contiguous()
    phi_, dphi = torch.empty_like(x), torch.empty_like(x)
    lib.attnuq_lt_phi_f64(x.data_ptr(), x.numel(), _phi_table().data_ptr(),
                          _phi_der_table().data_ptr(), phi_.data_ptr(), dphi.data_ptr())
    return phi_, dphi


def lt_queries(q: torch.Tensor, beta: torch.Tensor, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``qp`` ``(B, Q, H, dp)`` rows ``[beta_h q / max(|q|, 1e-12) | 0 ...]`` and the norms
    ``(B, Q, H)`` of ``q`` ``(B, H, Q, E)`` (unit last stride; csrc/levy_train.c, qprep)."""
    lib = _lib()
    B, H, Q, E = q.shape
    assert q.stride(3) == 1 and dp >= E and beta.shape == (H,) and beta.dtype == q.dtype
    beta = beta.detach().contiguous()
    qp, qnrm = q.new_empty(B, Q, H, dp), q.new_empty(B, Q, H)
    args = _words(_LT_WORDS[3], [q.data_ptr(), *q.stride()[:3], beta.data_ptr(), qp.data_ptr(),
                                 qnrm.data_ptr(), 0, 0, 0, 0, 0, 0, B, H, Q, E, dp])
    getattr(lib, "attnuq_lt_qprep_" + _LT_SFX[q.dtype])(ctypes.addressof(args))
    return qp, qnrm


def lt_queries_grad(gq: torch.Tensor, beta: torch.Tensor, qp: torch.Tensor, qnrm: torch.Tensor,
                    E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of :func:`lt_queries` for the flash backward's query gradient ``gq``
    ``(B, H, Q, .)``: ``g_q`` ``(B, Q, H, E)`` and ``g_beta`` ``(H,)``."""
    lib = _lib()
    B, Q, H, dp = qp.shape
    assert gq.shape[:3] == (B, H, Q) and gq.stride(3) == 1 and gq.dtype == qp.dtype
    assert qp.is_contiguous() and qnrm.is_contiguous() and beta.shape == (H,)
    beta = beta.detach().contiguous()
    g_q, g_beta = qp.new_empty(B, Q, H, E), qp.new_empty(B, H)
    args = _words(_LT_WORDS[3], [0, 0, 0, 0, beta.data_ptr(), qp.data_ptr(), qnrm.data_ptr(),
                                 gq.data_ptr(), *gq.stride()[:3], g_q.data_ptr(),
                                 g_beta.data_ptr(), B, H, Q, E, dp])
    getattr(lib, "attnuq_lt_qpost_" + _LT_SFX[qp.dtype])(ctypes.addressof(args))
    return g_q, g_beta.sum(0)


class TailOutputs(NamedTuple):
    """Outputs of :func:`lt_tail`, ``(B, Q, H, ...)`` contiguous (``var``, ``sigma_dim`` None
    without ``per_dim``), and ``dphi`` ``(B, Q, H)`` float64 ``phi'(evidence)``."""

    mean: torch.Tensor
    var: torch.Tensor | None
    evidence: torch.Tensor
    p_empty: torch.Tensor
    phi: torch.Tensor
    sigma: torch.Tensor
    sigma_dim: torch.Tensor | None
    dphi: torch.Tensor


def _tail_words(mom: torch.Tensor, z: torch.Tensor, ref: torch.Tensor, alpha: torch.Tensor,
                beta: torch.Tensor, outs: list[torch.Tensor | None],
                grads: list[torch.Tensor | None], gouts: list[torch.Tensor | None],
                per_dim: bool) -> ctypes.Array[ctypes.c_int64]:
    B, H, Q = z.shape
    dv = ref.shape[-1]
    assert mom.shape[:3] == (B, H, Q) and mom.shape[3] >= dv + (dv if per_dim else 1)
    assert mom.stride(3) == 1 and ref.shape == (B, H, dv) and ref.stride(2) == 1
    assert alpha.shape == (H,) and beta.shape == (H,) and alpha.is_contiguous()
    assert beta.is_contiguous()
    assert all(t is None or (t.is_contiguous() and t.dtype in (mom.dtype, torch.float64))
               for t in (*outs, *grads, *gouts))

    def p(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.data_ptr()

    return _words(_LT_TAIL_WORDS, [
        mom.data_ptr(), *mom.stride()[:3], z.data_ptr(), *z.stride(), ref.data_ptr(),
        *ref.stride()[:2], alpha.data_ptr(), beta.data_ptr(), _phi_table().data_ptr(),
        _phi_der_table().data_ptr(), *(p(t) for t in outs), *(p(t) for t in grads),
        *(p(t) for t in gouts), B, H, Q, dv, int(per_dim)])


def lt_tail(mom: torch.Tensor, z: torch.Tensor, ref: torch.Tensor, alpha: torch.Tensor,
            beta: torch.Tensor, per_dim: bool) -> TailOutputs:
    """The operator's outputs from its moments (csrc/levy_train.c, tail): ``mom`` ``(B, H, Q,
    dv + ws)`` ``[mu | m2]`` (unit last stride), ``z`` ``(B, H, Q)``, ``ref`` ``(B, H, dv)``
    (unit last stride), ``alpha``, ``beta`` ``(H,)`` contiguous, one dtype."""
    lib = _lib()
    B, H, Q = z.shape
    dv = ref.shape[-1]
    new = mom.new_empty
    mean = new(B, Q, H, dv)
    var = new(B, Q, H, dv) if per_dim else None
    sd = new(B, Q, H, dv) if per_dim else None
    ev, pe, phi_, sigma = (new(B, Q, H) for _ in range(4))
    dphi = torch.empty(B, Q, H, dtype=torch.float64)
    outs = [mean, var, sd, ev, pe, phi_, sigma, dphi]
    args = _tail_words(mom, z, ref, alpha, beta, outs, [None] * 7, [None] * 4, per_dim)
    getattr(lib, "attnuq_lt_tail_fwd_" + _LT_SFX[mom.dtype])(ctypes.addressof(args))
    return TailOutputs(mean, var, ev, pe, phi_, sigma, sd, dphi)


def lt_tail_grad(
    mom: torch.Tensor, z: torch.Tensor, ref: torch.Tensor, alpha: torch.Tensor,
    beta: torch.Tensor, per_dim: bool, out: TailOutputs, grads: list[torch.Tensor | None],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of :func:`lt_tail`: ``grads`` are the incoming gradients of ``mean``,
    ``var``, ``sigma_dim``, ``evidence``, ``p_empty``, ``phi``, ``sigma`` in ``(B, Q, H, ...)``
    contiguous memory (None = 0). Returns ``g_mom`` ``(B, Q, H, dv + ws)``, ``g_z``
    ``(B, Q, H)``, ``g_ref`` ``(B, H, dv)`` and ``g_ab`` ``(2, H)`` (alpha, beta)."""
    lib = _lib()
    B, H, Q = z.shape
    dv = ref.shape[-1]
    g_mom = mom.new_empty(B, Q, H, dv + (dv if per_dim else 1))
    g_z = mom.new_empty(B, Q, H)
    g_ref = mom.new_empty(B, H, dv)
    g_ab = mom.new_empty(B, 2, H)
    outs = [out.mean, out.var, out.sigma_dim, out.evidence, out.p_empty, out.phi, out.sigma,
            out.dphi]
    args = _tail_words(mom, z, ref, alpha, beta, outs, grads, [g_mom, g_z, g_ref, g_ab],
                       per_dim)
    getattr(lib, "attnuq_lt_tail_bwd_" + _LT_SFX[mom.dtype])(ctypes.addressof(args))
    return g_mom, g_z, g_ref, g_ab.sum(0)


def lt_pairs_grad_heads(wsum: torch.Tensor, gT: torch.Tensor, ct: torch.Tensor,
                        st: torch.Tensor, g_c: torch.Tensor, g_s: torch.Tensor) -> torch.Tensor:
    """:func:`lt_pairs_grad` for the rank-``H`` feature gradient ``wsum @ gT`` (``wsum``
    ``(2P, H)``, ``gT`` ``(H, n)``, contiguous), formed on the fly; returns ``f @ gT^T``
    ``(2P, H)`` (the weights' gradient), ``f`` the pair features."""
    lib = _lib()
    K, n = ct.shape
    H = gT.shape[0]
    assert all(t.is_contiguous() and t.dtype == ct.dtype for t in (wsum, gT, ct, st, g_c, g_s))
    assert wsum.shape == (K * (K + 1), H) and gT.shape == (H, n) and st.shape == (K, n)
    assert g_c.shape == (K, n) and g_s.shape == (K, n)
    gws = ct.new_empty(K * (K + 1), H)
    getattr(lib, "attnuq_lt_pairs_grad_heads_" + _LT_SFX[ct.dtype])(
        wsum.data_ptr(), gT.data_ptr(), H, ct.data_ptr(), st.data_ptr(), K, n, g_c.data_ptr(),
        g_s.data_ptr(), gws.data_ptr())
    return gws
