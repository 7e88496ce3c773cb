"""One dispatcher over the execution strategies of :func:`attnuq.ops.levy_attention`.

Each strategy of :data:`STRATEGIES` implements one public ``backend`` and says, for given
inputs, why it cannot run ('' when it can). A call with ``backend="native"``, ``"sdpa"`` or
``"explicit"`` runs the first usable strategy of that backend; ``"auto"`` the compiled kernel
when usable, else ``"sdpa"`` for problems large enough to pay for a fused kernel (when
``beta`` allows), else ``"explicit"``.

====================  ========  ===================================================
strategy              backend   runs when
====================  ========  ===================================================
``native``            native    CPU float32/float64, no autograd, kernels built
``flash_grad``        sdpa      autograd on CPU float32/float64 (flash backward)
``triton``            sdpa      CUDA float32 inference, Triton available
``flash``             sdpa      inference on CPU float32/float64, values at least as
                                wide as the keys (flash + lse)
``sentinel``          sdpa      anything else (``F.scaled_dot_product_attention``)
``explicit``          explicit  always (scores, max shift, ``exp``, GEMMs; any ``beta``)
====================  ========  ===================================================

The torch strategies share their start (observations cut into fixed-size blocks, the value
field's moments per block, the per-series reference) and their end (the outputs from the
normaliser ``z`` and the moments, :func:`_finish`); each computes only ``z`` and the moments.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from attnuq.ops import _native
from attnuq.ops.levy import _common
from attnuq.ops.levy._common import _centered_values, _empty_result, _ordered_sum, _safe_sqrt
from attnuq.ops.levy._explicit import _accumulate_explicit
from attnuq.ops.levy._field import _field, _value_moments
from attnuq.ops.levy._flash import _accumulate_flash_grad, _phi_of_evidence, _Tail
from attnuq.ops.levy._native_path import _native_forward, _native_unusable
from attnuq.ops.levy._sdpa import _accumulate_lse, _accumulate_sdpa
from attnuq.ops.levy._types import LevyResult, _Call, _Inputs
from attnuq.ops.levy._validate import _pad_one_masked, _validate

_SDPA_MIN_SIZE = 1 << 16  # B * H * Q * N from which backend="auto" uses the fused path


class _Prepared(NamedTuple):
    """What every torch strategy starts from: the observation blocks, the value field's
    ``(vbar, within)`` per block, the observed count per series ``(B, 1, 1)`` and the reference
    (the plain mean of ``vbar`` over observed entries, ``(B, H, 1, Dv)``, computed on demand)."""

    blocks: list[_Inputs]
    mom_b: list[tuple[torch.Tensor, torch.Tensor | None]]
    n_obs: torch.Tensor
    reference: Callable[[], torch.Tensor]


class _Sums(NamedTuple):
    """What a torch strategy returns: ``z`` ``(B, H, Q)`` with ``Lambda = alpha e^{log_scale}
    z``, the normalised moments ``(B, H, Q, Dv + ws)`` ``[mu - ref | second moment]``, the
    reference, and whether the compiled tail (:class:`_Tail`) forms the outputs."""

    z: torch.Tensor
    mom: torch.Tensor
    ref: torch.Tensor
    log_scale: torch.Tensor
    native_tail: bool = False


class _Opts(NamedTuple):
    per_dim: bool
    block_size: int
    needs_grad: bool


# ----------------------------------------------------------------------------- the strategies


def _value_width(inp: _Inputs, opts: _Opts) -> int:
    dv = inp.a.shape[-1]
    return dv + (dv if opts.per_dim else 1)


def _lse_ok(q: torch.Tensor) -> bool:
    return (_common._FLASH is not None and q.device.type == "cpu"
            and q.dtype in (torch.float32, torch.float64))


def _why_not_flash_grad(q: torch.Tensor, opts: _Opts) -> str:
    if not opts.needs_grad:
        return "inference takes the flash kernel without its backward"
    if not _lse_ok(q) or _common._FLASH_BWD is None:
        return "needs torch's CPU flash kernels and float32/float64 on the CPU"
    return ""


def _triton_kernel(q: torch.Tensor, a_width: int, opts: _Opts) -> object | None:
    """The Triton flash kernel for CUDA float32 inference (None where it does not apply); it
    needs values at least as wide as the keys."""
    if opts.needs_grad or q.device.type != "cuda" or a_width < q.shape[-1]:
        return None
    from attnuq.ops import _triton

    return _triton.levy_flash(False, q)


def _why_not_triton(q: torch.Tensor, opts: _Opts, a_width: int) -> str:
    return "" if _triton_kernel(q, a_width, opts) is not None else "not CUDA float32 inference"


def _why_not_flash(q: torch.Tensor, opts: _Opts, width: int) -> str:
    if opts.needs_grad:
        return "autograd"
    if width < q.shape[-1]:  # the keys share the value rows' buffer (see _accumulate_lse)
        return f"value rows ({width} wide) narrower than the keys ({q.shape[-1]})"
    return "" if _lse_ok(q) else "needs torch's CPU flash kernel and CPU float32/float64"


def _sums_flash_grad(inp: _Inputs, prep: _Prepared, opts: _Opts) -> _Sums:
    """Autograd on CPU: one :class:`_FlashBlock` per block (flash forward with its log-sum-exp,
    one flash backward call); with one block (the usual case) the block forms the reference
    itself, the same GEMM, with its backward folded into the block's."""
    q = inp.q
    z, mom, ref = _accumulate_flash_grad(
        q, prep.blocks, prep.mom_b, None if len(prep.blocks) == 1 else prep.reference(),
        inp.beta, opts.per_dim, prep.n_obs)
    return _Sums(z, mom, ref, -inp.beta[:, None],  # Lambda = alpha e^{-beta} z
                 _native.train_loops_available(q.dtype, q.device))


def _sums_sentinel(inp: _Inputs, prep: _Prepared, opts: _Opts) -> _Sums:
    qn = F.normalize(inp.q, dim=-1, eps=1e-12)
    ref = prep.reference()
    z, mom = _accumulate_sdpa(qn, prep.blocks, prep.mom_b, ref, inp.beta, opts.per_dim)
    return _Sums(z, mom, ref, -2 * inp.beta[:, None])  # Lambda = alpha e^{-2 beta} z


def _sums_lse(inp: _Inputs, prep: _Prepared, opts: _Opts, flash: object = None) -> _Sums:
    qn = F.normalize(inp.q, dim=-1, eps=1e-12)
    ref = prep.reference()
    z, mom = _accumulate_lse(qn, prep.blocks, prep.mom_b, ref, inp.beta, opts.per_dim, flash)
    return _Sums(z, mom, ref, -inp.beta[:, None])  # Lambda = alpha e^{-beta} z


def _sums_triton(inp: _Inputs, prep: _Prepared, opts: _Opts) -> _Sums:
    return _sums_lse(inp, prep, opts, _triton_kernel(inp.q, _value_width(inp, opts), opts))


def _sums_explicit(inp: _Inputs, prep: _Prepared, opts: _Opts) -> _Sums:
    ref = prep.reference()
    vals_b = [_centered_values(vbar, within, ref, opts.per_dim) for vbar, within in prep.mom_b]
    kn_b = [F.normalize(blk.k, dim=-1, eps=1e-12) for blk in prep.blocks]  # (B, H, bs, E)
    qn = F.normalize(inp.q, dim=-1, eps=1e-12)
    z, tsum, log_scale = _accumulate_explicit(qn, kn_b, vals_b, prep.blocks, inp.beta)
    mom = tsum / torch.where(z > 0, z, torch.ones_like(z))[..., None]
    return _Sums(z, mom, ref, log_scale)


class _Strategy(NamedTuple):
    name: str
    backend: str
    why_not: Callable[[_Inputs, _Opts], str]
    sums: Callable[[_Inputs, _Prepared, _Opts], _Sums] | None  # None: not a torch strategy


#: Every execution strategy, in the order the dispatcher tries them within a backend.
STRATEGIES: tuple[_Strategy, ...] = (
    _Strategy("native", "native", lambda inp, o: _native_unusable(inp.q, o.needs_grad), None),
    _Strategy("flash_grad", "sdpa", lambda inp, o: _why_not_flash_grad(inp.q, o),
              _sums_flash_grad),
    _Strategy("triton", "sdpa", lambda inp, o: _why_not_triton(inp.q, o, _value_width(inp, o)),
              _sums_triton),
    _Strategy("flash", "sdpa", lambda inp, o: _why_not_flash(inp.q, o, _value_width(inp, o)),
              _sums_lse),
    _Strategy("sentinel", "sdpa", lambda inp, o: "", _sums_sentinel),
    _Strategy("explicit", "explicit", lambda inp, o: "", _sums_explicit),
)


def _choose(inp: _Inputs, opts: _Opts, backend: str) -> _Strategy:
    """The first usable torch strategy of ``backend`` (``"auto"``: ``"sdpa"`` for large enough
    problems when ``beta`` allows, else ``"explicit"``)."""
    q = inp.q
    limit = 0.25 * math.log(torch.finfo(q.dtype).max)  # 22 in float32, 177 in float64
    beta_max = float(inp.beta.detach().max())
    if backend == "auto":
        # the fused kernel pays a thread fork per call: only worth it for non-tiny problems
        # (sized by observed entries, so that masked padding cannot change the choice)
        n_obs = int(inp.mask.sum(-1).max()) if inp.mask.numel() else 0
        big = q.shape[0] * q.shape[1] * q.shape[2] * n_obs >= _SDPA_MIN_SIZE
        backend = "sdpa" if big and beta_max <= limit else "explicit"
    if backend == "sdpa" and beta_max > limit:
        raise ValueError(
            f"backend='sdpa' needs beta <= {limit:.1f} in {q.dtype}, got "
            f"beta={inp.beta.detach().tolist()}"
        )
    for s in STRATEGIES:
        if s.backend == backend and s.sums is not None and not s.why_not(inp, opts):
            return s
    raise AssertionError(f"no strategy for backend {backend!r}")  # sentinel, explicit: always


# ----------------------------------------------------------------------------- the torch paths


def _prepare(inp: _Inputs, block_size: int, per_dim: bool) -> _Prepared:
    """Every per-observation quantity and every sum over observations is computed on
    fixed-size, zero-padded blocks of ``block_size`` observations, so that the same numbers
    meet the same kernels whatever the padded length N is (bit-identical under appended
    masked entries). Masked observations get weight exactly 0."""
    q, mask = inp.q, inp.mask
    B, H = q.shape[:2]
    Dv = inp.a.shape[-1]
    blocks = _common._split_blocks(inp, block_size)
    fld = _field(inp, per_dim)
    # vbar (B, H, bs, Dv); within-atom variance (B, H, bs, Dv) or, per_dim=False, its trace (1)
    mom_b = [_value_moments(blk, fld) for blk in blocks]
    count = mask.sum(-1).clamp_min(1).to(q.dtype)[:, None, None]

    def reference() -> torch.Tensor:
        # plain mean of vbar over observed entries, one (1 x bs) @ (bs x H Dv) GEMM per series
        # and block, in the (B, N, H, Dv) layout the embeddings come in
        ref = _ordered_sum(
            [blk.mask.to(q.dtype)[:, None, :] @ mb[0].transpose(1, 2).reshape(B, -1, H * Dv)
             for blk, mb in zip(blocks, mom_b, strict=True)]
        ) / count  # (B, 1, H * Dv)
        return ref.view(B, 1, H, Dv).transpose(1, 2)  # (B, H, 1, Dv)

    return _Prepared(blocks, mom_b, count, reference)


def _finish(inp: _Inputs, sums: _Sums, opts: _Opts) -> LevyResult:
    """The outputs from the normaliser and the moments: ``mean = mu + [z > 0] ref``, ``var =
    max(m2 - mu^2, 0)``, ``Lambda = alpha e^{log_scale} z``, ``phi(Lambda)``, the sigmas."""
    z, mom, ref, log_scale, native_tail = sums
    per_dim = opts.per_dim
    if native_tail:
        # the outputs and their backward in one compiled pass each (csrc/levy_train.c, tail)
        t_mean, t_var, t_ev, t_pe, t_phi, t_sigma, t_sd = _Tail.apply(
            mom, z, ref, inp.alpha, inp.beta, per_dim)
        return LevyResult(mean=t_mean, var=t_var if per_dim else None, evidence=t_ev,
                          p_empty=t_pe, phi=t_phi, sigma=t_sigma,
                          sigma_dim=t_sd if per_dim else None)
    Dv = inp.a.shape[-1]
    nonempty = z > 0
    mu_c, m2 = mom[..., :Dv], mom[..., Dv:]
    # mu_c = 0 where the series is empty, so this is where(nonempty, mu_c + ref, 0)
    mean = torch.addcmul(mu_c, ref, nonempty[..., None].to(mu_c.dtype))
    var: torch.Tensor | None
    if per_dim:
        var = torch.clamp_min(torch.addcmul(m2, mu_c, mu_c, value=-1), 0.0)
        trace = var.sum(-1)
    else:
        var = None
        trace = torch.clamp_min(m2[..., 0] - (mu_c * mu_c).sum(-1), 0.0)
    evidence = inp.alpha[:, None] * torch.exp(log_scale) * z  # (B, H, Q)
    phi = _phi_of_evidence(evidence)
    p_empty = torch.exp(-evidence)
    # same values; _safe_sqrt only changes the gradient at 0
    root = _safe_sqrt if opts.needs_grad else torch.sqrt
    sigma = root(trace * phi)
    sigma_dim = None if var is None else root(var * phi[..., None])
    return LevyResult(
        mean=mean, var=var, evidence=evidence, p_empty=p_empty, phi=phi, sigma=sigma,
        sigma_dim=sigma_dim,
    )


def _torch_path(inp: _Inputs, opts: _Opts, backend: str, check_sums: bool) -> LevyResult | None:
    """A torch strategy of ``backend`` on validated inputs. With ``check_sums`` (``q``, ``k``
    and ``a`` not checked yet) ``None`` when the sums over observations are not all finite."""
    strategy = _choose(inp, opts, backend)
    assert strategy.sums is not None
    sums = strategy.sums(inp, _prepare(inp, opts.block_size, opts.per_dim), opts)
    if check_sums and not math.isfinite(float(sums.z.detach().sum() + sums.mom.detach().sum())):
        return None
    return _finish(inp, sums, opts)


# ----------------------------------------------------------------------------- the dispatcher


def levy_attention_impl(call: _Call, needs_grad: bool) -> LevyResult:
    """:func:`attnuq.ops.levy_attention` after its option checks (eager; the custom op's
    body): the one validation of the call, then the strategy.

    Where the strategy checks the values itself (the compiled kernel reads only observed rows
    and reports a non-finite one; the CPU autograd path's sums are NaN/inf when an entry is),
    the validation leaves the finiteness of ``q``, ``k`` and ``a`` to it; only when it reports
    one do the detailed checks run, to raise with a precise message or, for masked non-finite
    rows or squares that overflow, to run the torch path on sanitised inputs.
    """
    q, k, a = call.args.q, call.args.k, call.args.a
    per_dim, block_size, backend = call.per_dim, call.block_size, call.backend
    opts = _Opts(per_dim, block_size, needs_grad)
    is_tensor = isinstance(q, torch.Tensor)
    why_not_native = _native_unusable(q, needs_grad) if is_tensor else "no tensor"
    run_native = backend in ("native", "auto") and not why_not_native
    # CPU autograd through the flash kernels: the sums over observations are checked instead
    grad_light = (backend in ("auto", "sdpa") and is_tensor
                  and not _why_not_flash_grad(q, opts))
    light = run_native or grad_light
    inp = _validate(call.args, light=light)
    if q.shape[0] * q.shape[1] * q.shape[2] == 0:  # B, H or Q is 0: nothing to compute
        return _empty_result(q, a, per_dim, needs_grad, call.args)
    if k.shape[2] == 0:  # N = 0: one masked entry gives every series the empty-series values
        inp = _pad_one_masked(inp)
    if backend == "native" and why_not_native:
        raise ValueError(f"backend='native' cannot run here: {why_not_native}")
    if run_native:
        res = _native_forward(inp, per_dim)
        if res is not None:
            return res
        # the kernel met a non-finite observed row (or squares that overflow): the detailed
        # checks raise with a precise message; if they pass, the torch path below runs
        inp = _full_checks(call, inp)
        light = False
    if backend == "native":
        backend = "auto"
    res = _torch_path(inp, opts, backend, check_sums=light)
    if res is None:
        res = _torch_path(_full_checks(call, inp), opts, backend, check_sums=False)
    assert res is not None
    return res


def _full_checks(call: _Call, inp: _Inputs) -> _Inputs:
    """The detailed checks of every input (after a strategy reported a non-finite value)."""
    if call.args.k.shape[2] == 0:
        return inp  # nothing observed: no value to check
    return _validate(call.args)
