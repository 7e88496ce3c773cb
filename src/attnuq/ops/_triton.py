r"""Triton forward passes of sampled attention and its moments (private).

:func:`attnuq.ops.sampled_attention` and :func:`attnuq.ops.attention_moments` take these for
CUDA tensors when triton imports (float16, bfloat16 or float32 inputs, no gradient requested);
otherwise, and for every CPU tensor, their torch / C paths run. The functions here can be called
directly, also on CPU tensors when triton's interpreter is active (``TRITON_INTERPRET=1`` set
before triton is first imported), which is how the test suite checks them without a GPU.

Sampling: a flash-style pass over key tiles with an online maximum and one running categorical
choice per draw (the exact softmax distribution; no ``Lq x Lk`` tensor): with the mass ``l`` of
the keys seen so far and the tile mass ``T``, each draw switches to a key of the tile with
probability ``T / (l + T)`` (inverse CDF within the tile). By induction the choice after the
last tile is a draw from :math:`\mathrm{softmax}(s)`. A second kernel averages the ``nu`` drawn
value rows. See :mod:`attnuq.ops._triton_kernels`.

Random numbers: one 63-bit seed is drawn from ``generator`` (``torch.randint``, on the tensors'
device; the default generator of that device when ``generator`` is None) and every uniform is
Philox of the counter ``(row, draw, key tile, group)`` under that seed (``tl.philox``). The
same generator state therefore gives the same draws, and the generator advances by one draw per
call. These draws differ from those of the CPU paths (other uniforms, used differently): the
distribution is the same.

Numerics: inputs are validated and folded by :func:`attnuq.ops._attn_common.prepare` (the same
checks and messages as the CPU path), keeping their dtype (a view when the layout allows, as
for the CPU path). Scores are dot products of the inputs accumulated in float32 (``ieee``
precision for float32 inputs, so no tf32 rounding of the scores); weights, masses and sums are
float32. The moments' weighted sums of the (centred, float32) values use ``tf32`` for 16-bit
inputs. float64 inputs stay on the torch path.

Memory: besides the output, the drawn indices ``(G, M, nu)`` int32 (checked against
:func:`attnuq.ops.max_bytes` before anything is allocated).

Levy attention: :func:`flash_lse` (softmax attention with a per-key bias that also returns the
log-sum-exp) replaces torch's CPU flash kernel in the fused inference backend of
:func:`attnuq.ops.levy.levy_attention` for CUDA float32 tensors without autograd
(:func:`levy_flash`); elsewhere that backend runs as before.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from attnuq._validation import check_nu
from attnuq.ops._attn_common import (
    MAX_NU,
    Attn,
    EmptyRows,
    check_empty_rows,
    empty_rows_error,
    max_bytes,
    prepare,
)

__all__ = [
    "attention_moments",
    "attention_moments_unchecked",
    "available",
    "flash_lse",
    "levy_flash",
    "sample_indices",
    "sampled_attention",
    "sampled_attention_unchecked",
    "usable",
]

# Key tile: fixed (no autotuning). The uniforms are indexed by (row, draw, key tile, group), so
# the draws are a function of the seed, the shapes and _BLOCK_N only (not of the row block or of
# the draws per program, which differ between the GPU and the interpreter).
_BLOCK_N = 32
_BLOCK_M = 64
_NU_B = 4  # draws per program on a GPU (programs along the third grid axis cover nu)
_NU_B_INTERPRET = 64  # the interpreter's cost is per program: fewer, larger ones
_GATHER_BLOCK_M = 32
# Launch shape on a GPU: compiled for sm_90 without a device (tests/attnuq/ops/_triton_aot.py),
# 8 warps keep the sampler and the 16-bit moments within 255 registers without spills at 64
# rows; the float32 moments (ieee products, no tensor cores) take 32 rows and still spill a few
# bytes.
_NUM_WARPS = 8
_MOMENTS_BLOCK_M_F32 = 32
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def _kernels() -> Any:
    """The kernel module (imports triton on first use)."""
    from attnuq.ops import _triton_kernels

    return _triton_kernels


@functools.cache
def available() -> bool:
    """Whether triton imports (cached)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Whether triton's interpreter runs the kernels (``TRITON_INTERPRET=1`` when triton was
    imported): they then run on CPU memory."""
    if not available():
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.rand, InterpretedFunction)


def usable(q: torch.Tensor, needs_grad: bool) -> bool:
    """Whether the public operators send this call to Triton: a CUDA tensor of a supported dtype,
    no gradient requested, and triton importable."""
    return (
        q.device.type == "cuda" and q.dtype in _TRITON_DTYPES and not needs_grad and available()
    )


def _check_device(att: Attn, what: str) -> None:
    if not available():
        raise RuntimeError(f"{what} needs triton, which does not import here")
    dev = att.q.device
    if dev.type != "cuda" and not interpreting():
        raise ValueError(
            f"{what} runs CUDA tensors (or CPU tensors under TRITON_INTERPRET=1, set before "
            f"triton is imported), got tensors on {dev}"
        )


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, n - 1).bit_length())


def _prec(att: Attn) -> str:
    return "ieee" if att.out_dtype == torch.float32 else "tf32"


def _mask_args(att: Attn) -> tuple[torch.Tensor, tuple[int, ...], bool, bool]:
    """The mask (bool as uint8), its 5 strides (0 where broadcast) and flags."""
    mk = att.mask
    if mk is None:
        return att.q, (0, 0, 0, 0, 0), False, False
    strides = tuple(0 if sz == 1 else st for sz, st in zip(mk.shape, mk.stride(), strict=True))
    if mk.dtype == torch.bool:
        return mk.view(torch.uint8), strides, True, True
    return mk, strides, True, False


def _seed(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """One int64 seed in ``[0, 2**62)`` drawn from ``generator`` (kept on ``device``)."""
    gdev = generator.device if generator is not None else device
    s = torch.randint(0, 2**62, (1,), generator=generator, device=gdev, dtype=torch.int64)
    return s.to(device)


def _draw(att: Attn, nu: int, generator: torch.Generator | None) -> tuple[torch.Tensor, ...]:
    """Drawn local key indices ``(G, M, nu)`` int32 and ``empty`` ``(G, M)`` bool."""
    g, m, lk, d = att.groups, att.rows, att.lk, att.q.shape[-1]
    dev = att.q.device
    idx = torch.empty(g, m, nu, dtype=torch.int32, device=dev)
    empty = torch.empty(g, m, dtype=torch.int8, device=dev)
    mask, ms, has_mask, mask_bool = _mask_args(att)
    q, k = att.q, att.k
    interp = interpreting()
    nu_b = min(_NU_B_INTERPRET, _pow2(nu, 2)) if interp else _NU_B
    grid = (-(-m // _BLOCK_M), g, -(-nu // nu_b))
    _kernels().sample_kernel[grid](
        q, k, mask, _seed(generator, dev), idx, empty,
        m, att.lq, lk, d, att.hk, nu, att.scale,
        *q.stride(), *k.stride(), *ms,
        HAS_MASK=has_mask, MASK_BOOL=mask_bool, CAUSAL=att.causal, PREC=_prec(att),
        UPCAST=interp,
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_D=_pow2(d), NU_B=nu_b, num_warps=_NUM_WARPS,
    )  # fmt: skip
    return idx, empty.bool()


def _check_budget(att: Attn, nu: int) -> None:
    """Refuse, before allocating, a call needing more than :func:`attnuq.ops.max_bytes`: the
    drawn indices ``(G, M, nu)`` int32, the output and the empty flags."""
    if nu > MAX_NU:
        raise ValueError(f"nu must be at most MAX_NU = 2**31 - 1, got {nu=}")
    rows = att.groups * att.rows
    need = rows * (4 * nu + att.dv * att.q.element_size() + 2)
    budget = max_bytes()
    if need > budget:
        raise ValueError(
            f"sampled_attention (Triton) with {nu=} needs about {need:,} bytes (indices "
            f"{rows * 4 * nu:,}, output {rows * att.dv * att.q.element_size():,}), more than the "
            f"memory budget of {budget:,} bytes; lower nu or the batch, or raise the budget with "
            f"ATTNUQ_MAX_BYTES=<bytes>"
        )


def _sampled(
    att: Attn, nu: int, generator: torch.Generator | None, empty_rows: str
) -> torch.Tensor:
    """Sampled attention of prepared inputs (``att.lk >= 1``, ``att.dv >= 1``, ``G * M >= 1``):
    ``(*batch, Hq, Lq, Dv)`` in the dtype of ``q``."""
    _check_device(att, "the Triton sampled attention")
    _check_budget(att, nu)
    idx, empty = _draw(att, nu, generator)
    g, m, dv = att.groups, att.rows, att.dv
    v = att.v
    out = torch.empty(g, m, dv, dtype=att.out_dtype, device=v.device)
    grid = (-(-m // _GATHER_BLOCK_M), g)
    _kernels().gather_mean_kernel[grid](
        v, idx, out, m, nu, dv, *v.stride(), 1.0 / nu,
        BLOCK_M=_GATHER_BLOCK_M, BLOCK_DV=_pow2(dv, 1),
    )  # fmt: skip
    if empty_rows == "error":
        if bool(empty.any()):
            raise empty_rows_error(att, empty)
    else:
        out.masked_fill_(empty.unsqueeze(-1), 0.0)
    return att.unfold(out)


def _moments(att: Attn, empty_rows: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and per-dimension variance of prepared inputs (``att.lk, att.dv >= 1``)."""
    _check_device(att, "the Triton attention moments")
    g, m, lk, d, dv = att.groups, att.rows, att.lk, att.q.shape[-1], att.dv
    q, k, v = att.q, att.k, att.v
    vbar = v.mean(dim=1, dtype=torch.float32).contiguous()  # (G, Dv)
    mean = torch.empty(g, m, dv, dtype=att.out_dtype, device=v.device)
    var = torch.empty_like(mean)
    empty = torch.empty(g, m, dtype=torch.int8, device=v.device)
    mask, ms, has_mask, mask_bool = _mask_args(att)
    bm = _MOMENTS_BLOCK_M_F32 if att.q.dtype == torch.float32 else _BLOCK_M
    grid = (-(-m // bm), g)
    _kernels().moments_kernel[grid](
        q, k, v, vbar, mask, mean, var, empty,
        m, att.lq, lk, d, dv, att.hk, att.scale,
        *q.stride(), *k.stride(), *v.stride(), *ms,
        HAS_MASK=has_mask, MASK_BOOL=mask_bool, CAUSAL=att.causal, PREC=_prec(att),
        UPCAST=interpreting(),
        BLOCK_M=bm, BLOCK_N=_BLOCK_N, BLOCK_D=_pow2(d), BLOCK_DV=_pow2(dv),
        num_warps=_NUM_WARPS,
    )  # fmt: skip
    emp = empty.bool()
    if empty_rows == "error" and bool(emp.any()):
        raise empty_rows_error(att, emp)
    return att.unfold(mean), att.unfold(var)


def _no_work(att: Attn, empty_rows: str) -> bool:
    """Whether the output is empty or all zeros (no rows, keys or value dims), without a kernel;
    rows without keys raise under ``empty_rows="error"``."""
    if att.groups * att.rows == 0 or att.lk == 0 or att.dv == 0:
        if att.groups * att.rows > 0 and att.lk == 0 and empty_rows == "error":
            raise empty_rows_error(att, torch.ones(att.groups, att.rows, dtype=torch.bool))
        return True
    return False


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> Attn:
    if isinstance(q, torch.Tensor) and q.is_floating_point() and q.dtype not in _TRITON_DTYPES:
        raise TypeError(f"the Triton kernels take float16, bfloat16 or float32, got {q.dtype=}")
    # the same checks and messages as the CPU path; q, k, v stay in their dtype (no copy)
    return prepare(q, k, v, attn_mask, is_causal, scale, enable_gqa, convert=False)


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
    generator: torch.Generator | None = None,
    empty_rows: str = "error",
) -> torch.Tensor:
    """Triton sampled attention with the signature and conventions of
    :func:`attnuq.ops.sampled_attention` (no ``block_size``: the kernel always streams over key
    tiles). No gradient flows (a forward for inference). ``(*batch, Hq, Lq, Dv)``."""
    return sampled_attention_unchecked(
        q, k, v, check_nu(nu), attn_mask, is_causal, scale, enable_gqa, generator,
        check_empty_rows(empty_rows),
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
    generator: torch.Generator | None,
    empty_rows: EmptyRows,
) -> torch.Tensor:
    """:func:`sampled_attention` with ``nu`` (an int ``>= 1``) and ``empty_rows`` validated by
    the caller (:func:`attnuq.ops.sampled.sampled_attention_unchecked`)."""
    att = _prepare(q, k, v, attn_mask, is_causal, scale, enable_gqa)
    if _no_work(att, empty_rows):
        return torch.zeros(att.out_shape, dtype=att.out_dtype, device=q.device)
    with torch.no_grad():
        return _sampled(att, nu, generator, empty_rows)


def sample_indices(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    nu: int,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The key indices the Triton sampler draws: ``idx`` ``(*batch, Hq, Lq, nu)`` int64 and
    ``empty`` ``(*batch, Hq, Lq)`` (rows with every key masked; their indices are meaningless).
    The same generator state gives the indices behind :func:`sampled_attention`."""
    nu = check_nu(nu)
    att = _prepare(q, k, v, attn_mask, is_causal, scale, enable_gqa)
    if att.lk == 0:
        raise ValueError(f"sample_indices needs at least one key, got Lk={att.lk}")
    _check_device(att, "the Triton sampler")
    with torch.no_grad():
        idx, empty = _draw(att, nu, generator)
    return att.unfold(idx.long()), att.unfold(empty.unsqueeze(-1)).squeeze(-1)


def attention_moments(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    empty_rows: str = "error",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton mean and per-dimension variance, as :func:`attnuq.ops.attention_moments` (one
    online-softmax pass over key tiles; no gradient)."""
    return attention_moments_unchecked(
        q, k, v, attn_mask, is_causal, scale, enable_gqa, check_empty_rows(empty_rows)
    )


def attention_moments_unchecked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    empty_rows: EmptyRows,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_moments` with ``empty_rows`` validated by the caller
    (:func:`attnuq.ops.sampled.attention_moments_unchecked`)."""
    att = _prepare(q, k, v, attn_mask, is_causal, scale, enable_gqa)
    if _no_work(att, empty_rows):
        z = torch.zeros(att.out_shape, dtype=att.out_dtype, device=q.device)
        return z, z.clone()
    with torch.no_grad():
        return _moments(att, empty_rows)


def flash_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Softmax attention with a per-key additive bias and its log-sum-exp (Triton, float32).

    ``out = softmax(q k^T + b) v`` and :math:`\mathrm{lse}_q = \log \sum_j e^{q \cdot k_j +
    b_j}` (scale 1), one online-softmax pass over key tiles: the inference forward of Levy
    attention on CUDA (:func:`attnuq.ops.levy.levy_attention`'s fused backend), in place of the
    CPU flash kernel that returns the same pair. A query whose every key has bias ``-inf`` gets
    a zero row and ``lse = -inf``.

    Parameters
    ----------
    q : Tensor
        ``(B, H, Lq, D)`` float32.
    k : Tensor
        ``(B, H, Lk, D)`` float32.
    v : Tensor
        ``(B, H, Lk, Dv)`` float32.
    key_bias : Tensor
        ``(B, Lk)`` additive bias (float, no NaN or ``+inf``).

    Returns
    -------
    out, lse : Tensor
        ``(B, H, Lq, Dv)`` and ``(B, H, Lq)``, float32.
    """
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.dtype != torch.float32:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            dt = t.dtype if isinstance(t, torch.Tensor) else None
            raise ValueError(f"{name} must be a 4-D float32 tensor, got {name}={got} ({dt})")
    b, h, lq, d = q.shape
    lk, dv = k.shape[2], v.shape[3]
    if k.shape != (b, h, lk, d) or v.shape[:3] != (b, h, lk):
        raise ValueError(
            f"k must be (B, H, Lk, D) and v (B, H, Lk, Dv) for q (B, H, Lq, D), got "
            f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}"
        )
    if not isinstance(key_bias, torch.Tensor) or tuple(key_bias.shape) != (b, lk):
        got = tuple(key_bias.shape) if isinstance(key_bias, torch.Tensor) else key_bias
        raise ValueError(f"key_bias must be (B, Lk) = {(b, lk)}, got {got}")
    if not (q.device == k.device == v.device == key_bias.device):
        raise ValueError(
            f"q, k, v and key_bias must be on one device, got {q.device}, {k.device}, "
            f"{v.device}, {key_bias.device}"
        )
    if not available():
        raise RuntimeError("flash_lse needs triton, which does not import here")
    if q.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"flash_lse runs CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), got {q.device}"
        )
    out = torch.empty(b, h, lq, dv, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, lq, dtype=torch.float32, device=q.device)
    if out.numel() == 0 and lse.numel() == 0:
        return out, lse
    bm = _MOMENTS_BLOCK_M_F32
    grid = (-(-lq // bm), b * h)
    _kernels().flash_lse_kernel[grid](
        q, k, v, key_bias, out, lse, h, lq, lk, d, dv,
        *q.stride(), *k.stride(), *v.stride(), *key_bias.stride(),
        UPCAST=interpreting(), BLOCK_M=bm, BLOCK_N=_BLOCK_N, BLOCK_D=_pow2(d),
        BLOCK_DV=_pow2(dv), num_warps=_NUM_WARPS,
    )  # fmt: skip
    return out, lse


def levy_flash(needs_grad: bool, q: torch.Tensor) -> Any:
    """For Levy attention's fused inference backend: a function with the call signature of
    torch's CPU flash kernel (``(q, k, v, dropout_p, is_causal, *, attn_mask, scale)`` returning
    ``(out, lse)``) that runs :func:`flash_lse`, or None when it does not apply (not CUDA,
    not float32, a gradient needed, triton missing)."""
    if needs_grad or q.device.type != "cuda" or q.dtype != torch.float32 or not available():
        return None
    return _flash_like


def _flash_like(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`flash_lse` behind the CPU flash kernel's signature (no dropout, not causal,
    scale 1, ``attn_mask`` ``(B, 1, 1, Lk)``)."""
    if dropout_p != 0.0 or is_causal or scale != 1.0 or attn_mask.dim() != 4:
        raise ValueError(
            f"_flash_like takes dropout_p=0, is_causal=False, scale=1 and a (B, 1, 1, Lk) mask, "
            f"got {dropout_p=}, {is_causal=}, {scale=}, attn_mask.shape={tuple(attn_mask.shape)}"
        )
    return flash_lse(q, k, v, attn_mask[:, 0, 0, :])
