"""Levy attention: continuous-time Poisson cross-attention with single-pass uncertainty.

API (stable; ``attnuq.nn.LevyAttention`` is the module wrapper)
---------------------------------------------------------------
``levy_attention(q, k, a, times, mask, *, alpha, beta, h, omega=None, phase=None, D=None,
per_dim=True, block_size=256, backend="auto") -> LevyResult``

* ``q``     ``(B, H, Q, E)`` query embeddings (one per query time and head).
* ``k``     ``(B, H, N, E)`` key embeddings of the observations ``(t_i, c_i)``.
* ``a``     ``(B, H, N, Dv)`` value embeddings ``a_i`` of ``(x_i, c_i)``.
* ``times`` ``(B, N)`` observation times ``t_i`` (any real numbers; order does not matter).
* ``mask``  ``(B, N)`` bool, ``True`` = observed. Masked entries are ignored and may hold
  anything, NaN included.
* ``alpha``, ``beta`` ``> 0`` and ``h >= 0``: floats or tensors of shape ``()`` or ``(H,)``.
* ``omega``, ``phase``: ``(K,)`` or ``(H, K)`` Fourier frequencies ``omega_k`` and phases ``b_k``;
  ``D``: ``(Dv, K)`` or ``(H, Dv, K)``. Either all three or none (``D = 0``).

``LevyResult`` (frozen dataclass), shapes in the ``F.scaled_dot_product_attention`` convention
``(B, H, Q, ...)``:

* ``mean``      ``(B, H, Q, Dv)`` ``mu_q = sum_i p_qi (a_i + D m_i)``.
* ``var``       ``(B, H, Q, Dv)`` ``diag Sigma_V(q)``: the per-atom value covariance
  (``None`` with ``per_dim=False``, which computes only the trace and is cheaper).
* ``evidence``  ``(B, H, Q)`` ``Lambda_q = sum_i w_qi``.
* ``p_empty``   ``(B, H, Q)`` ``exp(-Lambda_q)``.
* ``phi``       ``(B, H, Q)`` ``phi(Lambda_q) = E[1/N | N >= 1]``.
* ``sigma``     ``(B, H, Q)`` ``sqrt(tr Sigma_V(q) phi(Lambda_q))``.
* ``sigma_dim`` ``(B, H, Q, Dv)`` ``sqrt(Sigma_V,jj(q) phi(Lambda_q))`` (``None`` with
  ``per_dim=False``).

``levy_attention_sample(q, k, a, times, mask, *, alpha, beta, h, omega, phase, D,
num_samples, generator=None) -> LevySamples`` draws the Poisson random measure explicitly:
``values`` ``(S, B, H, Q, Dv)``, ``counts`` ``(S, B, H, Q)`` (atoms ``N_q``), ``nonempty``
``(S, B, H, Q)`` (``N_q >= 1``; ``values`` is 0 where it is False).

Math (METHODS.md section 2), per batch element, head and query ``q``
-------------------------------------------------------------------
* ``w_qi = alpha exp(beta (cos(q, k_i) - 1))`` for observed ``i`` (0 for masked ``i``),
  ``Lambda_q = sum_i w_qi``, ``p_qi = w_qi / Lambda_q``.
* An atom spawned by ``i`` sits at ``t ~ N(t_i, h^2)`` and carries ``V_i(t) = a_i + D g(t)`` with
  ``g_k(t) = cos(omega_k t + b_k)``. Under the mollifier
  ``E g_k = m_ik = exp(-omega_k^2 h^2 / 2) cos(omega_k t_i + b_k)`` and, with ``z_k = omega_k t_i
  + b_k``, ``e_kl = exp(-(omega_k^2 + omega_l^2) h^2 / 2)`` and ``u_kl = omega_k omega_l h^2``,

      Cov(g)_kl = e_kl [ (cosh u_kl - 1) cos z_k cos z_l + sinh u_kl sin z_k sin z_l ],

  which is METHODS' ``E[g g^T] - m m^T`` rewritten without cancellation (``cosh u - 1 =
  2 sinh^2(u/2)``). Hence ``vbar_i = a_i + D m_i`` and the within-atom variance
  ``s_ij = D_j Cov(g) D_j^T`` are closed-form, and

      mu_q = sum_i p_qi vbar_i,      Sigma_V,jj(q) = sum_i p_qi (vbar_ij^2 + s_ij) - mu_qj^2.

* ``Y_q = (1/N_q) sum_m V_{i_m}(t_m)`` with ``N_q ~ Poisson(Lambda_q)``: conditional on
  ``N_q >= 1``, ``E Y_q = mu_q`` and ``E|Y_q - mu_q|^2 = tr Sigma_V(q) phi(Lambda_q)``.

Implementation notes
--------------------
* Compiled path (``backend="native"``; what ``"auto"`` runs on CPU without autograd):
  ``csrc/levy.c`` through :mod:`attnuq.ops._native`, everything after the time features
  (torch's ``cos``/``sin``) in one pass per series: the observed entries are gathered in order,
  keys normalised, ``vbar`` and the within-atom variance formed (field weights derived from
  ``D``, ``omega``, ``h`` in double), the rows ``[vbar - ref, second moment]`` kept in cache, then
  per head and tile of queries the scores, ``2^(s - max)``, the weighted rows, ``Lambda``,
  ``phi`` (the tables of :mod:`attnuq.ops.phi`) and the outputs. float32 and float64; any
  ``beta`` (max-shifted like the explicit path); sums over observations in index order, so
  appended masked entries change no bit. It reads only observed rows of ``k`` and ``a`` and
  checks them (and ``q``) itself: a non-finite value sends the call to the detailed checks of
  the torch path, which raise (or, for finite values whose squares overflow, run the torch path).
  Tested against the explicit path at 1e-12 in float64.
* Fused torch path (``backend="sdpa"``, chosen by ``"auto"`` otherwise when
  ``beta <= log(finfo.max) / 4``, i.e. 22 in float32 and 177 in float64): the sums
  ``sum_i e^{beta cos_qi} [v_i, v_i^2 + s_i]`` and the normaliser come from ONE fused attention
  call per block.

  - Without autograd (inference) on CPU: the flash-attention kernel behind
    ``F.scaled_dot_product_attention`` also returns ``lse_q = log sum_i e^{beta cos_qi}``, so
    ``Lambda_q = alpha e^{lse_q - beta}`` needs no extra key or column. Values are
    ``[v - ref, (v - ref)^2 + s]`` (width ``2 Dv``; ``Dv + 1`` for the trace), queries
    ``[beta qn, 0]`` and keys ``[kn, *]`` padded to that width (the kernel needs equal
    widths); keys and values are overlapping views of one ``[kn | v - ref | second moment]``
    buffer, the keys' padding being met by the queries' zeros. Masked keys get an additive
    ``-1e4`` (weight exactly 0).
  - With autograd on CPU (float32, float64): the same flash kernel and its log-sum-exp in a
    custom autograd function with a hand-derived backward (:class:`_FlashBlock`): key
    normalisation, centred values and the attention per block, and ONE call of the kernel's
    backward, handed a zero value column whose gradient carries ``dL/d lse`` (verified by
    gradcheck in float64). No sentinel key, no extra normaliser column.
  - With autograd elsewhere (or a torch build without the CPU flash backward): a sentinel key
    with known score ``-beta`` and value ``e_0`` is prepended; its output weight ``o_q`` gives
    ``Z_q e^{beta} = (1 - o_q) / o_q`` (every observed term is ``>= 1`` relative to the
    sentinel, so ``o_q <= 1/2`` and there is no cancellation), and
    ``Lambda_q = alpha e^{-2 beta} (1 - o_q) / o_q``. Masked keys get score ``-1e4``.

  The two agree to rounding (tested at 1e-12 in float64).
* Reference path (``backend="explicit"``, any ``beta``): scores, the exact max ``M_q`` over
  observed ``i``, ``exp(beta cos - M_q)`` and GEMMs; ``Lambda_q = alpha e^{M_q - beta} Z_q``.
  Tests check that both paths agree (values and gradients) to 1e-12 in float64.
* Within-atom variance without ``2 K^2`` products per observation: the summand of
  ``s_ij = sum_{k,l} D_jk D_jl Cov(g)_kl`` is symmetric in ``(k, l)``, so it is one GEMM of the
  ``K (K + 1)`` products ``c_k c_l``, ``s_k s_l`` with ``k <= l`` (off-diagonal weights doubled);
  for the trace only (``per_dim=False``) the weights are summed over ``j`` before the GEMM
  (see :func:`_field`).
* Masked entries: ``times`` are zeroed; ``k`` and ``a`` are zeroed only where needed (some
  non-finite entry in ``k``, or ``a`` not bounded by ``finfo.max ** (1/4)`` in norm, checked by
  one reduction each); otherwise their masked rows stay finite through every step and get
  weight exactly 0, contributing exact zeros. Every sum over observations runs over
  fixed-size, zero-padded blocks of ``block_size`` accumulated in order, so the same
  numbers meet the same kernels whatever the padded length: appending masked observations
  leaves every output bit-identical (tested with 3 and 300 extra entries, NaN and finite
  garbage, float64 and float32).
* The second moment is accumulated about a per-series reference (the plain mean of ``vbar`` over
  observed ``i``), which removes most of the cancellation of ``E v^2 - (E v)^2`` in float32.
* Empty series (no observed entry): ``evidence = 0``, ``p_empty = 1``, ``mean = 0``, ``var = 0``,
  ``phi = 1``, ``sigma = 0``; gradients are finite (zero where the output is constant). ``N = 0``
  (no entry at all) is the same: one masked entry is appended. ``B``, ``H`` or ``Q = 0`` give
  empty outputs.
  NOTE(paper): the moments conditional on ``N >= 1`` do not exist when ``Lambda = 0``; these
  values are a convention, and ``p_empty = 1`` is the signal to act on.
* Times are plain real numbers: negative and unsorted times are accepted (the operator is
  permutation invariant; tested to 1e-12).
* ``sqrt`` has an infinite derivative at 0: ``sigma`` and ``sigma_dim`` use a guarded square
  root whose gradient is 0 where the variance is exactly 0.
* NOTE(paper): the paper states the variance identity for the trace; the per-dimension
  ``sigma_dim`` uses the same identity per coordinate, which holds because the atoms are i.i.d.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from attnuq._validation import check_positive_int
from attnuq.ops import _native, _rng
from attnuq.ops.phi import poisson_phi

__all__ = [
    "LevyResult",
    "LevySamples",
    "levy_attention",
    "levy_attention_sample",
    "levy_weights",
]


@dataclass(frozen=True)
class LevyResult:
    """Output of :func:`levy_attention` (shapes ``(B, H, Q, ...)``; see the module docstring).

    Attributes
    ----------
    mean : ``(B, H, Q, Dv)`` expected output ``mu_q`` (0 for an empty series).
    var : ``(B, H, Q, Dv)`` ``diag Sigma_V(q)``, the covariance of one atom's value
        (``None`` when computed with ``per_dim=False``).
    evidence : ``(B, H, Q)`` ``Lambda_q``.
    p_empty : ``(B, H, Q)`` ``P(N_q = 0) = exp(-Lambda_q)``.
    phi : ``(B, H, Q)`` ``E[1/N_q | N_q >= 1]``.
    sigma : ``(B, H, Q)`` ``sqrt(tr Sigma_V(q) phi(Lambda_q))``.
    sigma_dim : ``(B, H, Q, Dv)`` ``sqrt(Sigma_V,jj(q) phi(Lambda_q))`` (``None`` when
        ``per_dim=False``).
    """

    mean: torch.Tensor
    var: torch.Tensor | None
    evidence: torch.Tensor
    p_empty: torch.Tensor
    phi: torch.Tensor
    sigma: torch.Tensor
    sigma_dim: torch.Tensor | None


class LevySamples(NamedTuple):
    """Explicit draws of the sampled Levy operator, samples first.

    values : ``(S, B, H, Q, Dv)`` ``Y_q`` per draw (0 where ``nonempty`` is False).
    counts : ``(S, B, H, Q)`` int64 atom counts ``N_q``.
    nonempty : ``(S, B, H, Q)`` bool, ``N_q >= 1``.
    """

    values: torch.Tensor
    counts: torch.Tensor
    nonempty: torch.Tensor


# ----------------------------------------------------------------------------- validation


def _head_param(
    x: float | torch.Tensor, name: str, heads: int, ref: torch.Tensor, *, strict: bool
) -> torch.Tensor:
    """Return ``x`` as a ``(H,)`` tensor of ``ref``'s dtype/device after range checks."""
    t = torch.as_tensor(x, dtype=ref.dtype, device=ref.device)
    if t.dim() == 0:
        t = t.expand(heads)
    if t.shape != (heads,):
        raise ValueError(f"{name} must be a scalar or have shape ({heads},), got {tuple(t.shape)}")
    bad = ~torch.isfinite(t) | ((t <= 0) if strict else (t < 0))
    if bool(bad.any()):
        rel = "> 0" if strict else ">= 0"
        raise ValueError(f"{name} must be finite and {rel}, got {name}={t.detach().tolist()}")
    return t


def _all_finite(t: torch.Tensor) -> bool:
    """``True`` iff ``t`` has no NaN/inf. A finite sum proves it in one cheap pass (an inf or NaN
    entry always makes the sum inf or NaN); an overflowing sum falls back to the exact check."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _check_observed_finite(t: torch.Tensor, m: torch.Tensor, name: str) -> None:
    """NaN/inf check restricted to observed entries (``m`` broadcast to ``t``)."""
    if _all_finite(t.detach()):
        return
    bad = ~torch.isfinite(t) & m
    if bool(bad.any()):
        n_nan = int((torch.isnan(t) & m).sum())
        raise ValueError(
            f"{name} contains non-finite values at observed (mask=True) entries "
            f"({n_nan} NaN, {int(bad.sum()) - n_nan} inf) in a tensor of shape {tuple(t.shape)}"
        )


class _Call(NamedTuple):
    """The arguments of one :func:`levy_attention` call after its option checks (what the
    eager path and the custom op take; tensors not yet validated)."""

    q: torch.Tensor
    k: torch.Tensor
    a: torch.Tensor
    times: torch.Tensor
    mask: torch.Tensor
    alpha: float | torch.Tensor
    beta: float | torch.Tensor
    h: float | torch.Tensor
    omega: torch.Tensor | None
    phase: torch.Tensor | None
    D: torch.Tensor | None
    per_dim: bool
    block_size: int
    backend: str


class _Inputs(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    a: torch.Tensor
    times: torch.Tensor
    mask: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor
    h: torch.Tensor
    omega: torch.Tensor | None
    phase: torch.Tensor | None
    D: torch.Tensor | None


def _fast_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    a: torch.Tensor,
    times: torch.Tensor,
    mask: torch.Tensor,
    alpha: float | torch.Tensor,
    beta: float | torch.Tensor,
    h: float | torch.Tensor,
    omega: torch.Tensor | None,
    phase: torch.Tensor | None,
    D: torch.Tensor | None,
    light: bool = False,
) -> _Inputs | None:
    """The validated inputs when everything is in order, checked with one host sync; else None.

    In order means: every entry of ``times``, ``k``, ``q``, ``omega``, ``phase``, ``D`` finite
    (their sums are), ``|a| <= finfo.max ** (1/4)`` (so ``a`` is finite and its masked rows stay
    finite through the operator), ``alpha, beta > 0``, ``h >= 0`` and consistent shapes. The
    inputs are then used as given, exactly as :func:`_validate`'s detailed path would use them.
    With ``light`` the checks of ``q``, ``k`` and ``a`` are left to the caller (the compiled
    kernel checks the rows it reads, see :func:`_native_forward`).
    """
    H, Dv = q.shape[1], a.shape[3]
    pars = []
    for x in (alpha, beta, h):
        t = torch.as_tensor(x, dtype=q.dtype, device=q.device)
        if t.dim() == 0:
            t = t.expand(H)
        if t.shape != (H,):
            return None
        pars.append(t)
    om = ph = dd = None
    if omega is not None or phase is not None or D is not None:
        if omega is None or phase is None or D is None:
            return None
        om, ph, dd = omega.to(q.dtype), phase.to(q.dtype), D.to(q.dtype)
        hw = 1 if (om.dim() == 1 and ph.dim() == 1) else H
        om = om[None].expand(hw, -1) if om.dim() == 1 else om
        ph = ph[None].expand(hw, -1) if ph.dim() == 1 else ph
        dd = dd.expand(H, -1, -1) if dd.dim() == 2 else dd
        K = om.shape[-1]
        if om.shape != (hw, K) or ph.shape != (hw, K) or dd.shape != (H, Dv, K):
            return None
    # alpha, beta, h as Python floats (H values each): the range checks cost no tensor ops
    al_, be_, h_ = torch.stack(pars).detach().tolist()
    if not (all(math.isfinite(x) and x > 0 for x in al_ + be_)
            and all(math.isfinite(x) and x >= 0 for x in h_)):
        return None
    # one sum proves every entry finite (an inf or NaN entry makes it inf or NaN)
    big = (times, om, ph, dd) if light else (times, k, q, om, ph, dd)
    total = torch.stack([t.detach().sum() for t in big if t is not None]).sum()
    if not math.isfinite(float(total)):
        return None
    # |a| <= finfo.max ** (1/4): a is finite and its masked rows stay finite through the operator
    a_bound = torch.finfo(a.dtype).max ** 0.25
    if not light and not float(torch.linalg.vector_norm(a.detach())) <= a_bound:
        return None
    return _Inputs(q, k, a, times, mask, pars[0], pars[1], pars[2], om, ph, dd)


def _validate(
    q: torch.Tensor,
    k: torch.Tensor,
    a: torch.Tensor,
    times: torch.Tensor,
    mask: torch.Tensor,
    alpha: float | torch.Tensor,
    beta: float | torch.Tensor,
    h: float | torch.Tensor,
    omega: torch.Tensor | None,
    phase: torch.Tensor | None,
    D: torch.Tensor | None,
    light: bool = False,
) -> _Inputs:
    for t, n in ((q, "q"), (k, "k"), (a, "a"), (times, "times")):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{n} must be a floating-point torch.Tensor, got {type(t).__name__}")
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool torch.Tensor, got {getattr(mask, 'dtype', mask)!r}")
    if q.dim() != 4 or k.dim() != 4 or a.dim() != 4:
        raise ValueError(
            "q, k, a must be (B, H, Q, E), (B, H, N, E), (B, H, N, Dv), got "
            f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, a.shape={tuple(a.shape)}"
        )
    B, H, _, E = q.shape
    N = k.shape[2]
    if k.shape[:2] != (B, H) or k.shape[3] != E:
        raise ValueError(f"k must be (B, H, N, E) = ({B}, {H}, N, {E}), got {tuple(k.shape)}")
    if a.shape[:3] != (B, H, N):
        raise ValueError(f"a must be (B, H, N, Dv) = ({B}, {H}, {N}, Dv), got {tuple(a.shape)}")
    if times.shape != (B, N) or mask.shape != (B, N):
        raise ValueError(
            f"times and mask must be (B, N) = ({B}, {N}), got times.shape={tuple(times.shape)}, "
            f"mask.shape={tuple(mask.shape)}"
        )
    for t, n in ((q, "q"), (k, "k"), (a, "a"), (times, "times")):
        if t.dtype != q.dtype:
            raise TypeError(f"{n} must have dtype {q.dtype} like q, got {n}.dtype={t.dtype}")
    fast = _fast_inputs(q, k, a, times, mask, alpha, beta, h, omega, phase, D, light)
    if fast is not None:
        return fast
    # something is off (or merely unusual, e.g. a sum that overflows): the detailed checks
    # below raise with a precise message or zero the masked non-finite entries
    _check_observed_finite(times, mask, "times")
    m4 = mask[:, None, :, None]
    # Masked rows may hold anything. Where k is finite and a bounded everywhere (the usual case,
    # checked by one reduction each), the masked rows are left as they are: they stay finite
    # through every later step and get weight exactly 0. Otherwise they are zeroed here.
    if not _all_finite(k.detach()):
        _check_observed_finite(k, m4, "k")
        k = torch.where(m4, k, 0.0)
    a_norm = torch.linalg.vector_norm(a.detach())
    if not (bool(torch.isfinite(a_norm)) and float(a_norm) <= torch.finfo(a.dtype).max ** 0.25):
        _check_observed_finite(a, m4, "a")
        a = torch.where(m4, a, 0.0)
    if not _all_finite(q.detach()):
        raise ValueError(f"q contains non-finite values in a tensor of shape {tuple(q.shape)}")
    al = _head_param(alpha, "alpha", H, q, strict=True)
    be = _head_param(beta, "beta", H, q, strict=True)
    hh = _head_param(h, "h", H, q, strict=False)
    given = [x is not None for x in (omega, phase, D)]
    if any(given) and not all(given):
        raise ValueError(
            "omega, phase and D must be given together or not at all, got "
            f"omega={'set' if given[0] else None}, phase={'set' if given[1] else None}, "
            f"D={'set' if given[2] else None}"
        )
    om = ph = dd = None
    if omega is not None and phase is not None and D is not None:
        Dv = a.shape[3]
        om = omega.to(q.dtype)
        ph = phase.to(q.dtype)
        dd = D.to(q.dtype)
        # shared (1-D) frequencies and phases stay (1, K): the time features are then computed
        # once for all heads
        hw = 1 if (om.dim() == 1 and ph.dim() == 1) else H
        if om.dim() == 1:
            om = om[None].expand(hw, -1)
        if ph.dim() == 1:
            ph = ph[None].expand(hw, -1)
        if dd.dim() == 2:
            dd = dd.expand(H, -1, -1)
        K = om.shape[-1]
        if om.shape != (hw, K) or ph.shape != (hw, K) or dd.shape != (H, Dv, K):
            raise ValueError(
                "omega, phase must be (K,) or (H, K) and D (Dv, K) or (H, Dv, K), got "
                f"omega.shape={tuple(omega.shape)}, phase.shape={tuple(phase.shape)}, "
                f"D.shape={tuple(D.shape)} with H={H}, Dv={Dv}"
            )
        for t, n in ((om, "omega"), (ph, "phase"), (dd, "D")):
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{n} contains non-finite values")
    return _Inputs(q, k, a, times, mask, al, be, hh, om, ph, dd)


# ----------------------------------------------------------------------------- helpers

_SDPA_MIN_SIZE = 1 << 16  # B * H * Q * N from which backend="auto" uses the fused path


def _split_blocks(inp: _Inputs, block: int) -> list[_Inputs]:
    """Zero masked times, zero-pad the observation axis to a multiple of ``block``, cut it.

    Masked rows of ``k`` and ``a`` are finite (and ``a`` bounded) after :func:`_validate`, so
    anything derived from them is finite; the operator then gives them weight exactly 0.
    """
    n = inp.k.shape[2]
    nb = max(1, -(-n // block))
    pad = nb * block - n
    mask = inp.mask
    k, a = inp.k, inp.a
    times = torch.where(mask, inp.times, 0.0)
    if nb == 1 and not pad:
        return [inp._replace(k=k, a=a, times=times)]
    if pad:
        k = F.pad(k, (0, 0, 0, pad))
        a = F.pad(a, (0, 0, 0, pad))
        times = F.pad(times, (0, pad))
        mask = F.pad(mask, (0, pad), value=False)
    out = []
    for j in range(nb):
        sl = slice(j * block, (j + 1) * block)
        out.append(
            inp._replace(
                k=k[:, :, sl].contiguous(),
                a=a[:, :, sl].contiguous(),
                times=times[:, sl].contiguous(),
                mask=mask[:, sl].contiguous(),
            )
        )
    return out


def _ordered_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    """``xs[0] + xs[1] + ...`` left to right (trailing exact zeros leave the bits unchanged)."""
    acc = xs[0]
    for x in xs[1:]:
        acc = acc + x
    return acc


def _safe_sqrt(x: torch.Tensor) -> torch.Tensor:
    """``sqrt(x)`` for ``x >= 0`` with gradient 0 (instead of inf) where ``x == 0``."""
    pos = x > 0
    root = torch.sqrt(torch.where(pos, x, torch.ones_like(x)))
    return torch.where(pos, root, torch.zeros_like(x))


def _gcov_pairs(
    wk: torch.Tensor, wl: torch.Tensor, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M1_kl, M2_kl)`` for frequency pairs ``wk``, ``wl`` ``(H, P)``, bandwidths ``h`` ``(H,)``:
    ``Cov(g)_kl = M1_kl c_k c_l + M2_kl s_k s_l``.

    ``M1 = e (cosh u - 1)``, ``M2 = e sinh u`` with ``e_kl = exp(-(w_k^2 + w_l^2) h^2 / 2)`` and
    ``u_kl = w_k w_l h^2``. For ``|u| < 1`` they are formed from ``sinh`` (no cancellation), else
    from ``e cosh u = (e^{-(w_k - w_l)^2 h^2/2} + e^{-(w_k + w_l)^2 h^2/2}) / 2`` (no overflow).
    """
    h2 = (h * h)[:, None]  # (H, 1)
    u = wk * wl * h2
    e = torch.exp(-(wk * wk + wl * wl) * h2 / 2)
    if bool((u.detach().abs() < 1).all()):  # the usual case: only the sinh branch (fewer ops)
        return e * 2 * torch.sinh(u / 2) ** 2, e * torch.sinh(u)
    em = torch.exp(-((wk - wl) ** 2) * h2 / 2)
    ep = torch.exp(-((wk + wl) ** 2) * h2 / 2)
    small = u.abs() < 1
    us = torch.where(small, u, torch.zeros_like(u))
    m1 = torch.where(small, e * 2 * torch.sinh(us / 2) ** 2, (em + ep) / 2 - e)
    m2 = torch.where(small, e * torch.sinh(us), (em - ep) / 2)
    return m1, m2


class _Field(NamedTuple):
    """Per-call constants of the value field.

    ``wm``: mean loading ``damp_k D_jk``; ``ws``: within-atom variance weights on the
    ``2 P`` pair products (``P = K (K + 1) / 2``), per value dimension (``dw = Dv``) or summed
    over it (``dw = 1``, trace only). Shared time features (``Hw = 1``): ``wm`` ``(K, H * Dv)``,
    ``ws`` ``(2 P, H * dw)``; per-head features: ``(H, K, Dv)`` and ``(H, 2 P, dw)``.
    """

    wm: torch.Tensor
    ws: torch.Tensor


_PAIR_CACHE: dict[tuple[int, torch.dtype, torch.device], tuple[torch.Tensor, ...]] = {}


def _pair_index(
    K: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs ``(k, l)``, ``k <= l``, ordered by diagonal ``d = l - k`` then ``k`` (the order in
    which :func:`_pair_products` builds them), with multiplicity 1 on the diagonal, else 2:
    ``(iu, ju, mult)`` tensors of length ``P = K (K + 1) / 2`` (built once per K, dtype, device).
    """
    key = (K, dtype, device)
    if key not in _PAIR_CACHE:
        iu = [k for d in range(K) for k in range(K - d)]
        ju = [k + d for d in range(K) for k in range(K - d)]
        mult = [1.0 if d == 0 else 2.0 for d in range(K) for _ in range(K - d)]
        _PAIR_CACHE[key] = (torch.tensor(iu, device=device), torch.tensor(ju, device=device),
                            torch.tensor(mult, dtype=dtype, device=device))
    iu_t, ju_t, mu = _PAIR_CACHE[key]
    return iu_t, ju_t, mu


def _pair_products(c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``[c_k c_l, s_k s_l]`` for ``k <= l`` (order of :func:`_pair_index`): ``(..., K)`` ->
    ``(..., 2 P)``, one product per diagonal of the symmetric ``K x K`` outer products."""
    K = c.shape[-1]
    x = torch.stack([c, s], dim=-2)  # (..., 2, K)
    prods = torch.cat([x[..., : K - d] * x[..., d:] for d in range(K)], dim=-1)  # (..., 2, P)
    return prods.flatten(-2)


def _field(inp: _Inputs, per_dim: bool) -> _Field | None:
    r"""Constants of the value field (``None`` without one).

    Within-atom variance without the ``K^2`` products per observation: with ``c_k = cos z_k``,
    ``s_k = sin z_k`` (``z_k = omega_k t_i + b_k``) and the symmetric ``M1``, ``M2`` of
    :func:`_gcov_pairs`,

    .. math::

        s_{ij} = D_j \operatorname{Cov}(g) D_j^\top
               = \sum_{k \le l} \mu_{kl} D_{jk} D_{jl} (M1_{kl} c_k c_l + M2_{kl} s_k s_l),
        \qquad \mu_{kk} = 1,\ \mu_{k<l} = 2,

    because the summand is symmetric in ``(k, l)``: ``2 P = K (K + 1)`` features (72 for
    ``K = 8``) instead of ``2 K^2`` (128). For the trace only (``per_dim=False``) the weights are
    summed over ``j`` first, ``tr s_i = sum_{k<=l} (sum_j mu D_jk D_jl M1_kl) c_k c_l + ...``,
    so the per-observation cost is ``2 P H`` instead of ``2 P H Dv``.
    """
    if inp.omega is None or inp.phase is None or inp.D is None:
        return None
    H, _, K = inp.D.shape
    hw = inp.omega.shape[0]
    om_h = inp.omega.expand(H, -1)
    damp = torch.exp(-(om_h**2) * (inp.h**2)[:, None] / 2)  # (H, K)
    iu_t, ju_t, mu = _pair_index(K, inp.D.dtype, inp.D.device)
    m1, m2 = _gcov_pairs(om_h[:, iu_t], om_h[:, ju_t], inp.h)  # (H, P) each
    dd = inp.D[:, :, iu_t] * inp.D[:, :, ju_t] * mu  # (H, Dv, P)
    w = torch.cat([dd * m1[:, None], dd * m2[:, None]], dim=-1)
    if not per_dim:
        w = w.sum(1, keepdim=True)  # (H, 1, 2P)
    wm = damp[:, None, :] * inp.D  # (H, Dv, K)
    if hw == 1:
        return _Field(
            wm=wm.permute(2, 0, 1).reshape(K, -1), ws=w.permute(2, 0, 1).reshape(w.shape[-1], -1)
        )
    return _Field(wm=wm.transpose(-1, -2), ws=w.transpose(-1, -2))


class _SharedField(torch.autograd.Function):
    r"""The value field at the observations when all heads share the time features: ``vbar`` and
    the within-atom variance ``s`` with a hand-derived backward (no per-diagonal autograd nodes).

    Inputs: ``a`` ``(B, H, N, Dv)``, ``ct = cos z``, ``st = sin z`` ``(K, B N)``, ``wm``
    ``(K, H Dv)``, ``ws`` ``(2P, H dw)`` (:func:`_field`). With the pair features
    ``f = [c_k c_l, s_k s_l]_{k <= l}`` ``(2P, B N)`` (by diagonal ``d = l - k``):

    .. math::

        \bar v = a + (c^\top w_m),\qquad s = f^\top w_s,

    and the backward, with ``G_m = dL/d\bar v``, ``G_s = dL/ds`` as ``(B N, .)`` matrices:
    ``dL/da = G_m``, ``dL/dw_m = c G_m``, ``dL/dw_s = f G_s``, ``dL/df = w_s G_s^\top`` and,
    per diagonal, ``dL/dx_{k} += (dL/df_{k,k+d}) x_{k+d}``, ``dL/dx_{k+d} += (dL/df_{k,k+d})
    x_k`` for ``x = c, s``; ``dL/dc`` gains ``w_m G_m^\top``. Verified by gradcheck in float64;
    the backward is differentiable (gradgradcheck, for the explicit backend's double backward).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, a: torch.Tensor, ct: torch.Tensor, st: torch.Tensor, wm: torch.Tensor,
        ws: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        B, H, N, Dv = a.shape
        K = ct.shape[0]
        native = (_native.train_loops_available(ct.dtype, ct.device) and ct.is_contiguous()
                  and st.is_contiguous())
        if native:  # one compiled pass (csrc/levy_train.c, pairs)
            feats_t = _native.lt_pairs(ct, st)
        else:
            feats_t = torch.cat([x[: K - d] * x[d:] for x in (ct, st) for d in range(K)])
        ap = a.transpose(1, 2)  # (B, N, H, Dv): the embeddings' memory order
        if ap.is_contiguous():
            vbar = torch.addmm(ap.reshape(B * N, H * Dv), ct.t(), wm)
            vbar = vbar.view(B, N, H, Dv).transpose(1, 2)
        else:
            vbar = a + (ct.t() @ wm).view(B, N, H, Dv).transpose(1, 2)
        if ws.shape[1] < 32:
            # few outputs (the trace: one per head): (out x 2P) @ (2P x BN) is an order of
            # magnitude faster than (BN x 2P) @ (2P x out) with the transposed feature matrix
            s = (ws.t() @ feats_t).t().view(B, N, H, -1).transpose(1, 2)
        else:
            s = (feats_t.t() @ ws).view(B, N, H, -1).transpose(1, 2)
        ctx.save_for_backward(ct, st, wm, ws, feats_t)
        ctx.native = native
        return vbar, s

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, g_vbar: torch.Tensor, g_s: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        ct, st, wm, ws, feats_t = ctx.saved_tensors
        K, BN = ct.shape
        create_graph = torch.is_grad_enabled()
        if create_graph:
            # double backward (create_graph=True): the backward is made of differentiable ops;
            # the features are rebuilt from ct, st so that their dependence is on the graph
            feats_t = torch.cat([x[: K - d] * x[d:] for x in (ct, st) for d in range(K)])
        gm = g_vbar.transpose(1, 2).reshape(BN, -1)  # (BN, H Dv)
        g_wm = ct @ gm
        H, dw = g_s.shape[1], g_s.shape[3]
        if dw > 1 and g_s.stride(-1) == 0 and ctx.native and not create_graph:
            # as below, with the rank-H feature gradient and its products formed in one
            # compiled pass (csrc/levy_train.c, pairs_grad_heads; the features not re-read).
            # wm may have any strides (torch.mm reads them; _field's is the (1, K)-strided
            # view of a permuted (H, Dv, K) product)
            gT = g_s[..., 0].permute(1, 0, 2).reshape(H, BN).contiguous()  # (H, BN)
            g_x = torch.empty(2, K, BN, dtype=ct.dtype, device=ct.device)
            torch.mm(wm, gm.t(), out=g_x[0])
            g_x[1].zero_()
            wsum = ws.view(-1, H, dw).sum(-1).contiguous()  # (2P, H)
            g_wsh = _native.lt_pairs_grad_heads(wsum, gT, ct, st, g_x[0], g_x[1])
            g_ws = g_wsh[:, :, None].expand(-1, -1, dw).reshape(-1, H * dw)
            return g_vbar, g_x[0], g_x[1], g_wm, g_ws
        if dw > 1 and g_s.stride(-1) == 0:
            # the same gradient on every within column of a head (the training block's backward
            # on the trace, which expands one column): G_s = g 1^T per head, so
            # dL/dw_s = (f g) 1^T and dL/df = (w_s 1) g^T, products of width H, not H dw
            gtr = g_s[..., 0].transpose(1, 2).reshape(BN, H)  # (BN, H)
            g_ws = (feats_t @ gtr)[:, :, None].expand(-1, -1, dw).reshape(-1, H * dw)
            g_f = ws.view(-1, H, dw).sum(-1) @ gtr.t()  # (2P, BN)
        else:
            gs = g_s.transpose(1, 2).reshape(BN, -1)  # (BN, H dw)
            g_ws = feats_t @ gs
            g_f = ws @ gs.t()  # (2P, BN)
        if create_graph:
            g_x = torch.zeros(2, K, BN, dtype=ct.dtype, device=ct.device)
            g_x[0] = wm @ gm.t()
        else:
            g_x = torch.empty(2, K, BN, dtype=ct.dtype, device=ct.device)
            torch.mm(wm, gm.t(), out=g_x[0])
            g_x[1].zero_()
        if ctx.native and not create_graph and g_f.is_contiguous():
            _native.lt_pairs_grad(g_f, ct, st, g_x[0], g_x[1])
            return g_vbar, g_x[0], g_x[1], g_wm, g_ws
        off = 0
        for i, x in enumerate((ct, st)):
            for d in range(K):
                gd = g_f[off : off + K - d]
                g_x[i, : K - d].addcmul_(gd, x[d:])
                g_x[i, d:].addcmul_(gd, x[: K - d])
                off += K - d
        return g_vbar, g_x[0], g_x[1], g_wm, g_ws


def _value_moments(
    inp: _Inputs, fld: _Field | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``vbar`` ``(B, H, N, Dv)`` and within-atom variance ``s`` ``(B, H, N, dw)`` (or None).

    ``vbar = a + (damp * cos z) D^T`` and ``s`` (per dimension, ``dw = Dv``, or its sum over
    dimensions, ``dw = 1``) are one GEMM each over the time features, shared by all heads when
    the frequencies are (see :func:`_field`). Rows of masked entries are finite but meaningless
    (the callers weight them by exactly 0).
    """
    a = inp.a
    if fld is None or inp.omega is None or inp.phase is None:
        return a, None
    B, N = a.shape[0], a.shape[2]
    if inp.omega.shape[0] == 1:
        # shared time features, one GEMM each for all heads. Features are built transposed,
        # (K, B N) and (2P, B N), so that every product runs over B N contiguous numbers (a
        # (B N, K) layout has inner loops of K - d elements and costs several times more)
        zt = inp.omega[0][:, None] * inp.times.reshape(1, B * N) + inp.phase[0][:, None]
        vbar, s = _SharedField.apply(a, torch.cos(zt), torch.sin(zt), fld.wm, fld.ws)
        return vbar, s
    z = inp.times[:, None, :, None] * inp.omega[None, :, None, :] + inp.phase[None, :, None, :]
    c = torch.cos(z)  # (B, H, N, K)
    feats = _pair_products(c, torch.sin(z))  # (B, H, N, 2P)
    return a + c @ fld.wm, feats @ fld.ws


def _scores(inp: _Inputs) -> torch.Tensor:
    """``cos(q, k_i)`` ``(B, H, Q, N)`` (masked keys zeroed first)."""
    k = torch.where(inp.mask[:, None, :, None], inp.k, torch.zeros_like(inp.k))
    qn = F.normalize(inp.q, dim=-1, eps=1e-12)
    kn = F.normalize(k, dim=-1, eps=1e-12)
    return qn @ kn.transpose(-1, -2)


# ----------------------------------------------------------------------------- public ops


def levy_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor,
    *,
    alpha: float | torch.Tensor,
    beta: float | torch.Tensor,
) -> torch.Tensor:
    """Compatibilities ``w_qi = alpha exp(beta (cos(q, k_i) - 1))``, 0 for masked ``i``.

    Parameters
    ----------
    q : ``(B, H, Q, E)``; k : ``(B, H, N, E)``; mask : ``(B, N)`` bool (True = observed).
    alpha, beta : ``> 0``, scalars or ``(H,)``.

    Returns
    -------
    torch.Tensor
        ``(B, H, Q, N)``; ``evidence = w.sum(-1)``. May underflow to 0 for very large ``beta``
        (``levy_attention`` itself works in a shifted form that does not).

    Examples
    --------
    >>> import torch
    >>> q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4)
    >>> levy_weights(q, k, torch.ones(1, 5, dtype=torch.bool), alpha=1.0, beta=2.0).shape
    torch.Size([1, 2, 3, 5])
    """
    B, H = q.shape[:2]
    N = k.shape[2]
    dummy_a = k.new_zeros(B, H, N, 1)
    inp = _validate(q, k, dummy_a, k.new_zeros(B, N), mask, alpha, beta, 0.0, None, None, None)
    cos = _scores(inp)
    w = inp.alpha[:, None, None] * torch.exp(inp.beta[:, None, None] * (cos - 1))
    return torch.where(mask[:, None, None, :], w, torch.zeros_like(w))


def levy_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    a: torch.Tensor,
    times: torch.Tensor,
    mask: torch.Tensor,
    *,
    alpha: float | torch.Tensor,
    beta: float | torch.Tensor,
    h: float | torch.Tensor,
    omega: torch.Tensor | None = None,
    phase: torch.Tensor | None = None,
    D: torch.Tensor | None = None,
    per_dim: bool = True,
    block_size: int = 256,
    backend: str = "auto",
) -> LevyResult:
    r"""Expected Levy attention output and its closed-form uncertainty in one pass.

    .. math::

        w_{qi} = \alpha e^{\beta(\cos(q, k_i) - 1)},\quad \Lambda_q = \sum_i w_{qi},\quad
        p_{qi} = w_{qi} / \Lambda_q,\quad
        \mu_q = \sum_i p_{qi} (a_i + D m_i),\quad
        \hat\sigma_q = \sqrt{\operatorname{tr}\Sigma_V(q)\,\phi(\Lambda_q)},

    with ``m_ik = exp(-omega_k^2 h^2/2) cos(omega_k t_i + b_k)`` and ``Sigma_V(q)`` the covariance
    of one atom's value ``a_i + D g(t)``, ``i ~ p_q``, ``t ~ N(t_i, h^2)`` (module docstring).

    Parameters
    ----------
    q : torch.Tensor
        ``(B, H, Q, E)`` query embeddings.
    k : torch.Tensor
        ``(B, H, N, E)`` key embeddings of the observations.
    a : torch.Tensor
        ``(B, H, N, Dv)`` value embeddings ``a_i``.
    times : torch.Tensor
        ``(B, N)`` observation times (any real values, any order).
    mask : torch.Tensor
        ``(B, N)`` bool, ``True`` = observed; masked entries are ignored (may be NaN).
    alpha, beta : float or torch.Tensor
        ``> 0``, scalar or ``(H,)``: atoms per fully compatible observation, sharpness.
    h : float or torch.Tensor
        ``>= 0``, scalar or ``(H,)``: bandwidth of the Gaussian mollifier.
    omega, phase : torch.Tensor, optional
        ``(K,)`` or ``(H, K)`` Fourier frequencies and phases of ``g(t)``.
    D : torch.Tensor, optional
        ``(Dv, K)`` or ``(H, Dv, K)`` loading of ``g`` in the value field (None means ``D = 0``).
    per_dim : bool
        Compute ``var`` and ``sigma_dim`` per value dimension (default). ``False`` computes only
        the trace (``sigma``), which halves the width of the weighted value rows.
    block_size : int
        Observations per block in the sums over ``N`` of the torch paths (see module
        docstring); the compiled path sums in index order and ignores it.
    backend : {"auto", "native", "sdpa", "explicit"}
        ``"native"``: the compiled CPU kernel (inference only; float32 or float64; see the
        module docstring); raises ``ValueError`` where it cannot run (autograd, another device
        or dtype, no C compiler / ``ATTNUQ_NATIVE=0``). ``"sdpa"``: one fused attention call
        per block; on CPU (float32, float64) the flash kernel, whose log-sum-exp gives the
        normaliser (with autograd through a custom function whose backward is one call of the
        kernel's backward, see :class:`_FlashBlock`), elsewhere
        ``F.scaled_dot_product_attention`` with a sentinel key that recovers it (see
        :func:`_accumulate_sdpa`); needs ``beta <= log(finfo.max) / 4`` (22 in float32, 177 in
        float64). ``"explicit"``: scores, a max shift, ``exp`` and GEMMs (the
        reference; any ``beta``). ``"auto"``: ``"native"`` for float32 and float64 on CPU
        without autograd when the kernel is available; otherwise ``"sdpa"`` when ``beta`` allows and
        ``B * H * Q * N_obs >= 65536`` (``N_obs``: most observed entries in a series; below that
        the fused kernel's thread start-up costs more than it saves), else ``"explicit"``.

    Returns
    -------
    LevyResult
        ``mean``, ``var``, ``evidence``, ``p_empty``, ``phi``, ``sigma``, ``sigma_dim``, shaped
        ``(B, H, Q, ...)`` (on the compiled path: transposed views of ``(B, Q, H, ...)`` memory,
        so that concatenating the heads is free).

    Raises
    ------
    ValueError
        NaN/inf in observed ``times``, ``k``, ``a`` or in ``q``; ``alpha <= 0``, ``beta <= 0``,
        ``h < 0``; inconsistent shapes.

    Examples
    --------
    >>> import torch
    >>> from attnuq.ops import levy_attention
    >>> B, H, Q, N, E, Dv, K = 2, 4, 3, 10, 8, 5, 6
    >>> r = levy_attention(torch.randn(B, H, Q, E), torch.randn(B, H, N, E),
    ...                    torch.randn(B, H, N, Dv), torch.rand(B, N) * 48,
    ...                    torch.ones(B, N, dtype=torch.bool), alpha=1.0, beta=3.0, h=0.5,
    ...                    omega=torch.rand(K), phase=torch.rand(K), D=torch.randn(Dv, K))
    >>> r.mean.shape, r.sigma.shape, bool((r.p_empty == torch.exp(-r.evidence)).all())
    (torch.Size([2, 4, 3, 5]), torch.Size([2, 4, 3]), True)
    """
    block_size = check_positive_int(block_size, "block_size")
    if backend not in ("auto", "native", "sdpa", "explicit"):
        raise ValueError(
            f"backend must be 'auto', 'native', 'sdpa' or 'explicit', got {backend=!r}"
        )
    if not isinstance(per_dim, bool):
        raise TypeError(f"per_dim must be a bool, got {per_dim=!r}")
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad
        for t in (q, k, a, times, alpha, beta, h, omega, phase, D))
    call = _Call(q, k, a, times, mask, alpha, beta, h, omega, phase, D, per_dim, block_size,
                 backend)
    if not needs_grad and isinstance(q, torch.Tensor) and _rng.tracing(q):
        # traced inference (torch.compile, torch.export): one opaque custom op
        return _levy_via_op(call)
    return _levy_attention_impl(call, needs_grad)


def _levy_attention_impl(call: _Call, needs_grad: bool) -> LevyResult:
    """:func:`levy_attention` after its option checks (eager; the custom op's body)."""
    q, k, a, times, mask, alpha, beta, h, omega, phase, D, per_dim, block_size, backend = call
    want_native = backend in ("native", "auto")
    # CPU autograd through the flash kernels: q, k and a are checked afterwards, by the
    # finiteness of the sums (a non-finite entry, observed or masked, or an overflowing square
    # makes them NaN/inf; then the detailed checks run and the call is repeated on their inputs)
    grad_light = (needs_grad and backend in ("auto", "sdpa") and isinstance(q, torch.Tensor)
                  and q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)
                  and _FLASH is not None and _FLASH_BWD is not None)
    light = (want_native and not needs_grad) or grad_light
    inp = _validate(q, k, a, times, mask, alpha, beta, h, omega, phase, D, light=light)
    if q.shape[0] * q.shape[1] * q.shape[2] == 0:  # B, H or Q is 0: nothing to compute
        return _empty_result(q, a, per_dim, needs_grad,
                             (q, k, a, times, alpha, beta, h, omega, phase, D))
    if k.shape[2] == 0:  # N = 0: one masked entry gives every series the empty-series values
        q, k, a, times, mask = _pad_one_masked(q, k, a, times, mask)
        inp = _validate(q, k, a, times, mask, alpha, beta, h, omega, phase, D, light=light)
    if want_native:
        why_not = _native_unusable(inp, needs_grad)
        if backend == "native" and why_not:
            raise ValueError(f"backend='native' cannot run here: {why_not}")
        if not why_not:
            res = _native_forward(inp, per_dim)
            if res is not None:
                return res
            # the kernel met a non-finite observed row (or squares that overflow): the detailed
            # checks raise with a precise message; if they pass, the torch path below runs
            inp = _validate(q, k, a, times, mask, alpha, beta, h, omega, phase, D)
        elif light and not grad_light:
            # the light checks left q, k and a to the kernel, which does not run: check them here
            inp = _validate(q, k, a, times, mask, alpha, beta, h, omega, phase, D)
        backend = "auto"
    if grad_light:
        res = _torch_path(inp, per_dim, block_size, backend, needs_grad, check_sums=True)
        if res is not None:
            return res
        inp = _validate(q, k, a, times, mask, alpha, beta, h, omega, phase, D)
    res = _torch_path(inp, per_dim, block_size, backend, needs_grad)
    assert res is not None
    return res


def _torch_path(
    inp: _Inputs, per_dim: bool, block_size: int, backend: str, needs_grad: bool,
    check_sums: bool = False,
) -> LevyResult | None:
    """The torch paths of :func:`levy_attention` on validated inputs. With ``check_sums``
    (inputs whose ``q``, ``k``, ``a`` are unchecked) ``None`` when the sums over observations
    are not all finite."""
    q, a, mask = inp.q, inp.a, inp.mask
    B, H = q.shape[:2]
    Dv = a.shape[-1]
    # Every per-observation quantity and every sum over observations is computed on fixed-size,
    # zero-padded blocks of `block_size` observations, so that the same numbers meet the same
    # kernels whatever the padded length N is (bit-identical under appended masked entries).
    # Masked observations have all-zero key and value rows, so they add exact zeros.
    blocks = _split_blocks(inp, block_size)
    fld = _field(inp, per_dim)
    # vbar (B, H, bs, Dv); within-atom variance (B, H, bs, Dv) or, per_dim=False, its trace (1)
    mom_b = [_value_moments(blk, fld) for blk in blocks]
    count = mask.sum(-1).clamp_min(1).to(q.dtype)[:, None, None]

    def reference() -> torch.Tensor:
        # reference: plain mean of vbar over observed entries, one (1 x bs) @ (bs x H Dv) GEMM
        # per series and block, in the (B, N, H, Dv) layout the embeddings come in
        ref = _ordered_sum(
            [blk.mask.to(q.dtype)[:, None, :] @ mb[0].transpose(1, 2).reshape(B, -1, H * Dv)
             for blk, mb in zip(blocks, mom_b, strict=True)]
        ) / count  # (B, 1, H * Dv)
        return ref.view(B, 1, H, Dv).transpose(1, 2)  # (B, H, 1, Dv)

    tail_native = False
    limit = 0.25 * math.log(torch.finfo(q.dtype).max)  # 22 in float32, 177 in float64
    beta_max = float(inp.beta.detach().max())
    if backend == "auto":
        # the fused kernel pays a thread fork per call: only worth it for non-tiny problems
        # (sized by observed entries, so that masked padding cannot change the choice)
        n_obs = int(mask.sum(-1).max()) if mask.numel() else 0
        big = q.shape[0] * q.shape[1] * q.shape[2] * n_obs >= _SDPA_MIN_SIZE
        backend = "sdpa" if big and beta_max <= limit else "explicit"
    if backend == "sdpa":
        if beta_max > limit:
            raise ValueError(
                f"backend='sdpa' needs beta <= {limit:.1f} in {q.dtype}, got "
                f"beta={inp.beta.detach().tolist()}"
            )
        lse_ok = (_FLASH is not None and q.device.type == "cpu"
                  and q.dtype in (torch.float32, torch.float64))
        flash = None
        # CUDA float32 inference: the Triton kernel when triton imports (its widths as below)
        if q.device.type == "cuda" and Dv + (Dv if per_dim else 1) >= q.shape[-1]:
            from attnuq.ops import _triton

            flash = _triton.levy_flash(needs_grad, q)
        if needs_grad and lse_ok and _FLASH_BWD is not None:
            # autograd on CPU: flash forward + its log-sum-exp, one flash backward call
            # one block (the usual case): _FlashBlock forms the reference itself, the same
            # GEMM, with its backward folded into the block's (no autograd nodes for it)
            z, mom, ref = _accumulate_flash_grad(
                q, blocks, mom_b, None if len(blocks) == 1 else reference(), inp.beta, per_dim,
                count)
            log_scale = -inp.beta[:, None]  # Lambda = alpha e^{-beta} z
            tail_native = _native.train_loops_available(q.dtype, q.device)
        elif needs_grad or not (lse_ok or flash is not None):
            qn = F.normalize(q, dim=-1, eps=1e-12)
            ref = reference()
            z, mom = _accumulate_sdpa(qn, blocks, mom_b, ref, inp.beta, per_dim)
            log_scale = -2 * inp.beta[:, None]  # Lambda = alpha e^{-2 beta} z
        else:
            qn = F.normalize(q, dim=-1, eps=1e-12)
            ref = reference()
            z, mom = _accumulate_lse(qn, blocks, mom_b, ref, inp.beta, per_dim, flash)
            log_scale = -inp.beta[:, None]  # Lambda = alpha e^{-beta} z
    else:
        ref = reference()
        vals_b = [_centered_values(vbar, within, ref, per_dim) for vbar, within in mom_b]
        kn_b = [F.normalize(blk.k, dim=-1, eps=1e-12) for blk in blocks]  # (B, H, bs, E)
        qn = F.normalize(q, dim=-1, eps=1e-12)
        z, tsum, log_scale = _accumulate_explicit(qn, kn_b, vals_b, blocks, inp.beta)
        mom = tsum / torch.where(z > 0, z, torch.ones_like(z))[..., None]

    if check_sums and not math.isfinite(float(z.detach().sum() + mom.detach().sum())):
        return None
    if tail_native:
        # the outputs and their backward in one compiled pass each (csrc/levy_train.c, tail)
        t_mean, t_var, t_ev, t_pe, t_phi, t_sigma, t_sd = _Tail.apply(
            mom, z, ref, inp.alpha, inp.beta, per_dim)
        return LevyResult(mean=t_mean, var=t_var if per_dim else None, evidence=t_ev,
                          p_empty=t_pe, phi=t_phi, sigma=t_sigma,
                          sigma_dim=t_sd if per_dim else None)
    nonempty = z > 0
    mu_c, m2 = mom[..., :Dv], mom[..., Dv:]
    # mu_c = 0 where the series is empty, so this is where(nonempty, mu_c + ref, 0)
    mean = torch.addcmul(mu_c, ref, nonempty[..., None].to(mu_c.dtype))
    if per_dim:
        var: torch.Tensor | None = torch.clamp_min(torch.addcmul(m2, mu_c, mu_c, value=-1), 0.0)
        assert var is not None
        trace = var.sum(-1)
    else:
        var = None
        trace = torch.clamp_min(m2[..., 0] - (mu_c * mu_c).sum(-1), 0.0)
    evidence = inp.alpha[:, None] * torch.exp(log_scale) * z  # (B, H, Q)
    phi = _phi_of_evidence(evidence)
    p_empty = torch.exp(-evidence)
    # same values; _safe_sqrt only changes the gradient at 0
    root = _safe_sqrt if needs_grad else torch.sqrt
    sigma = root(trace * phi)
    sigma_dim = None if var is None else root(var * phi[..., None])
    return LevyResult(
        mean=mean, var=var, evidence=evidence, p_empty=p_empty, phi=phi, sigma=sigma,
        sigma_dim=sigma_dim,
    )


class _Tail(torch.autograd.Function):
    r"""The operator's outputs from the moments of the CPU training path, forward and backward
    each one compiled pass (``csrc/levy_train.c``, tail), the torch formulas of
    :func:`_torch_path` with ``Lambda = alpha e^{-beta} z``:

    .. math::

        \text{mean} = \mu + [z > 0]\,\text{ref},\quad
        \text{var}_j = \max(m_{2,j} - \mu_j^2, 0),\quad
        \sigma = \sqrt{\operatorname{tr}\text{var}\;\phi(\Lambda)},\quad
        \sigma_j = \sqrt{\text{var}_j\,\phi(\Lambda)},\quad p_\emptyset = e^{-\Lambda},

    (trace only: ``tr var = max(m2 - |mu|^2, 0)``), square roots with gradient 0 at 0 and the
    clamp passing its gradient where its argument is ``>= 0``, as ``torch.clamp_min``.
    Inputs: ``mom`` ``(B, H, Q, Dv + ws)``, ``z`` ``(B, H, Q)``, ``ref`` ``(B, H, 1, Dv)``,
    ``alpha``, ``beta`` ``(H,)``. Outputs are ``(B, H, Q, ...)`` views of ``(B, Q, H, ...)``
    memory (the heads of the module concatenate for free); ``var`` and ``sigma_dim`` are empty
    without ``per_dim``. Checked against the torch formulas (tests/ops/test_levy.py).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, mom: torch.Tensor, z: torch.Tensor, ref: torch.Tensor, alpha: torch.Tensor,
        beta: torch.Tensor, per_dim: bool,
    ) -> tuple[torch.Tensor, ...]:
        args = (_unit(mom), z, _unit(ref[:, :, 0]), alpha.detach().contiguous(),
                beta.detach().contiguous(), per_dim)
        o = _native.lt_tail(*args)
        ctx.args, ctx.o = args, o
        ctx.set_materialize_grads(False)
        empty = mom.new_empty(0)

        def t(x: torch.Tensor | None) -> torch.Tensor:
            return empty if x is None else x.transpose(1, 2)

        return (t(o.mean), t(o.var), t(o.evidence), t(o.p_empty), t(o.phi), t(o.sigma),
                t(o.sigma_dim))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, *grads: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        per_dim = ctx.args[-1]
        g_mean, g_var, g_ev, g_pe, g_phi, g_sigma, g_sd = grads
        if not per_dim:
            g_var = g_sd = None

        def bqh(g: torch.Tensor | None) -> torch.Tensor | None:
            return None if g is None else g.transpose(1, 2).contiguous()

        mom, z, ref, alpha, beta, _ = ctx.args
        g_mom, g_z, g_ref, g_ab = _native.lt_tail_grad(
            mom, z, ref, alpha, beta, per_dim, ctx.o,
            [bqh(g) for g in (g_mean, g_var, g_sd, g_ev, g_pe, g_phi, g_sigma)])
        return g_mom.transpose(1, 2), g_z.transpose(1, 2), g_ref[:, :, None], g_ab[0], g_ab[1], None


class _PhiNative(torch.autograd.Function):
    """``phi(Lambda)`` with its derivative from one compiled pass (``csrc/levy_train.c``; the
    tables of :mod:`attnuq.ops.phi`, in float64 like :func:`attnuq.ops.poisson_phi`)."""

    @staticmethod
    def forward(ctx: Any, lam: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        phi64, dphi64 = _native.lt_phi(lam)
        ctx.save_for_backward(dphi64)
        return phi64.to(lam.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (dphi64,) = ctx.saved_tensors
        return (grad_out.to(torch.float64) * dphi64).to(grad_out.dtype)


def _phi_of_evidence(evidence: torch.Tensor) -> torch.Tensor:
    """``phi(Lambda)`` of the operator's evidence (finite and ``>= 0`` by construction): the
    compiled tables where they run, else :func:`attnuq.ops.poisson_phi` (the same tables)."""
    if _native.train_loops_available(evidence.dtype, evidence.device):
        out: torch.Tensor = _PhiNative.apply(evidence)
        return out
    return poisson_phi(evidence)


# ----------------------------------------------------------------------------- torch.library op
#
# The inference forward as the custom op ``attnuq::levy_attention`` (fake implementation below),
# so that torch.compile / torch.export see one opaque node; with autograd the differentiable torch
# path runs as it is (traced op by op). The seven outputs are fresh contiguous tensors; ``var``
# and ``sigma_dim`` are empty ``(0,)`` tensors when ``per_dim`` is False (None in LevyResult).

_LEVY_FIELDS = ("mean", "var", "evidence", "p_empty", "phi", "sigma", "sigma_dim")


@torch.library.custom_op(
    "attnuq::levy_attention",
    mutates_args=(),
    schema=(
        "(Tensor q, Tensor k, Tensor a, Tensor times, Tensor mask, Tensor alpha, Tensor beta, "
        "Tensor h, Tensor? omega, Tensor? phase, Tensor? D, bool per_dim, int block_size, "
        "str backend) -> Tensor[]"
    ),
)
def _levy_op(
    q: torch.Tensor,
    k: torch.Tensor,
    a: torch.Tensor,
    times: torch.Tensor,
    mask: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    h: torch.Tensor,
    omega: torch.Tensor | None,
    phase: torch.Tensor | None,
    D: torch.Tensor | None,
    per_dim: bool,
    block_size: int,
    backend: str,
) -> list[torch.Tensor]:
    """``attnuq::levy_attention``: the fields of :func:`levy_attention` (no autograd)."""
    with torch.no_grad():
        res = _levy_attention_impl(_Call(q, k, a, times, mask, alpha, beta, h, omega, phase, D,
                                         per_dim, block_size, backend), False)
    empty = q.new_empty((0,))
    return [empty.clone() if t is None else t.clone(memory_format=torch.contiguous_format)
            for t in (getattr(res, f) for f in _LEVY_FIELDS)]


@_levy_op.register_fake
def _levy_fake(
    q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, *args: object
) -> list[torch.Tensor]:
    per_dim = bool(args[8])
    B, H, Q = q.shape[:3]
    full = (B, H, Q, a.shape[-1])
    dim = [q.new_empty(full) if per_dim else q.new_empty((0,)) for _ in range(2)]
    return [q.new_empty(full), dim[0], *(q.new_empty((B, H, Q)) for _ in range(4)), dim[1]]


def _levy_via_op(call: _Call) -> LevyResult:
    q, per_dim = call.q, call.per_dim

    def tens(x: float | torch.Tensor) -> torch.Tensor:
        return x if isinstance(x, torch.Tensor) else torch.tensor(float(x), dtype=q.dtype,
                                                                  device=q.device)

    out = _levy_op(*call[:5], tens(call.alpha), tens(call.beta), tens(call.h), *call[8:])
    mean, var, evidence, p_empty, phi, sigma, sigma_dim = out
    return LevyResult(mean=mean, var=var if per_dim else None, evidence=evidence,
                      p_empty=p_empty, phi=phi, sigma=sigma,
                      sigma_dim=sigma_dim if per_dim else None)


def _pad_one_masked(
    q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, times: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``N = 0`` inputs with one masked (ignored) observation appended, so that every path sees
    an ordinary empty series (masked entries add exact zeros)."""
    B, H = q.shape[:2]
    k1 = torch.zeros(B, H, 1, k.shape[3], dtype=k.dtype, device=k.device)
    a1 = torch.zeros(B, H, 1, a.shape[3], dtype=a.dtype, device=a.device)
    t1, m1 = times.new_zeros(B, 1), mask.new_zeros(B, 1)
    return q, torch.cat([k, k1], 2), torch.cat([a, a1], 2), torch.cat([times, t1], 1), torch.cat(
        [mask, m1], 1
    )


def _empty_result(
    q: torch.Tensor, a: torch.Tensor, per_dim: bool, needs_grad: bool, inputs: tuple[object, ...]
) -> LevyResult:
    """The (empty) result for ``B * H * Q = 0``, attached to the inputs' graph when they need a
    gradient (through an empty slice of each, so no value is read: masked entries may be NaN)."""
    B, H, Q = q.shape[:3]
    z = torch.zeros(B, H, Q, dtype=q.dtype, device=q.device)
    zd = torch.zeros(B, H, Q, a.shape[3], dtype=q.dtype, device=q.device)
    if needs_grad:
        anchor = sum(
            (t.reshape(-1)[:0].sum() for t in inputs
             if isinstance(t, torch.Tensor) and t.requires_grad),
            torch.zeros((), dtype=q.dtype, device=q.device),
        )
        z, zd = z + anchor, zd + anchor
    return LevyResult(mean=zd, var=zd if per_dim else None, evidence=z, p_empty=z + 1.0,
                      phi=z + 1.0, sigma=z, sigma_dim=zd if per_dim else None)


def _native_unusable(inp: _Inputs, needs_grad: bool) -> str:
    """Why the compiled forward cannot run on these inputs ('' when it can)."""
    if needs_grad:
        return "autograd needs the differentiable torch path"
    if inp.q.device.type != "cpu":
        return f"the kernel is CPU-only, got device {inp.q.device}"
    if inp.q.dtype not in (torch.float32, torch.float64):
        return f"the kernel takes float32 or float64, got {inp.q.dtype}"
    if not _native.available():
        return f"native kernels unavailable ({_native.status()['reason']})"
    return ""


def _native_forward(inp: _Inputs, per_dim: bool) -> LevyResult | None:
    """The whole inference forward in the compiled kernel (:func:`attnuq.ops._native.levy_forward`):
    time features here (torch's vectorised ``cos``/``sin``), everything else in one pass over
    each series. ``None`` when the kernel met a non-finite value in an observed row of ``k`` or
    ``a`` or in ``q`` (their checks were left to it)."""
    B, N = inp.times.shape
    field = None
    if inp.omega is not None and inp.phase is not None and inp.D is not None and inp.D.shape[-1]:
        times = torch.where(inp.mask, inp.times, 0.0)
        # (Hw, K, B N): omega_k t + phase_k, Hw = 1 when the heads share the frequencies
        zt = torch.addcmul(inp.phase[:, :, None], inp.omega[:, :, None], times.reshape(1, 1, B * N))
        field = (torch.cos(zt), torch.sin(zt), inp.omega, inp.D, inp.h)

    def unit(t: torch.Tensor) -> torch.Tensor:
        return t if t.stride(-1) == 1 else t.contiguous()

    out = _native.levy_forward(
        unit(inp.q), unit(inp.k), unit(inp.a), inp.mask, inp.alpha, inp.beta, field, per_dim
    )
    if out is None:
        return None
    return LevyResult(mean=out.mean, var=out.var, evidence=out.evidence,
                      p_empty=torch.exp(-out.evidence), phi=out.phi, sigma=out.sigma,
                      sigma_dim=out.sigma_dim)


# the CPU flash-attention kernel behind F.scaled_dot_product_attention; it also returns the
# log-sum-exp of the scores (private ATen op: the inference path falls back to the sentinel
# path if a torch build lacks it)
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


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


def _centered_values(
    vbar: torch.Tensor,
    within: torch.Tensor | None,
    ref: torch.Tensor,
    per_dim: bool,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``vc = vbar - ref`` and ``sq = vc^2 + s`` (per dimension) or ``|vc|^2 + tr s``.

    With ``out`` the two results are written into the given views (no autograd); the values
    are the same either way (same kernels, same order).
    """
    if out is None:
        vc = vbar - ref  # masked rows: finite, weighted by exactly 0 later
        if per_dim:
            sq = vc * vc if within is None else torch.addcmul(within, vc, vc)
        else:
            sq = torch.linalg.vecdot(vc, vc)[..., None]
            sq = sq if within is None else sq + within
        return vc, sq
    vc, sq = out
    torch.sub(vbar, ref, out=vc)
    if per_dim:
        if within is None:
            torch.mul(vc, vc, out=sq)
        else:
            torch.addcmul(within, vc, vc, out=sq)
    else:
        tr = torch.linalg.vecdot(vc, vc)[..., None]
        sq.copy_(tr if within is None else tr + within)
    return vc, sq


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


# the CPU flash kernel's backward (recomputes the weights from q, k and the log-sum-exp)
_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


class _FlashBlock(torch.autograd.Function):
    r"""One block of the differentiable CPU path: key normalisation, centred values, one flash
    attention call with its log-sum-exp, and a hand-derived backward around ONE flash backward.

    Inputs: ``qa`` ``(B, H, Q, E)`` (``beta qn``), ``k`` ``(B, H, N, E)`` (raw keys),
    ``vbar`` ``(B, H, N, dv)``, ``within`` ``(B, H, N, ws)`` or ``None``, ``ref``
    ``(B, H, 1, dv)``, ``bias`` ``(B, 1, 1, N)`` (additive mask, no gradient), ``per_dim``.
    Forward, with ``kn = k / max(|k|, eps)``, ``vc = vbar - ref``, ``sq = vc^2 + s`` (per
    dimension) or ``|vc|^2 + tr s`` (``ws = 1``), scores ``s_qi = qa_q . kn_i + bias_i``:

    .. math::

        lse_q = \log \sum_i e^{s_{qi}},\quad p_{qi} = e^{s_{qi} - lse_q},\quad
        out_q = \sum_i p_{qi} v_i,\quad v_i = [vc_i, sq_i, 0, \dots].

    Backward (``g = dL/d out``, ``g^{lse} = dL/d lse``):

    .. math::

        \frac{\partial L}{\partial s_{qi}} = p_{qi}\big(g_q\cdot(v_i - out_q) + g^{lse}_q\big),
        \quad
        \bar{vc}_i = \bar v_{i,vc} + 2\, vc_i \odot \bar v_{i,sq},\quad
        \bar k_i = \frac{\bar{kn}_i - [|k_i| > eps]\, kn_i (kn_i \cdot \bar{kn}_i)}
                        {\max(|k_i|, eps)},

    ``bar vbar = bar vc``, ``bar ref = -sum_i bar vc_i``, ``bar s = bar v_{sq}``. The kernel
    needs equal head dims: ONE buffer ``[kn | T | Z | vc | sq | 0]`` per observation and head
    holds keys (its first columns; their padding is met by the queries' zeros) and values
    (``[vc | sq]`` in the forward, ``[vc | sq | 0]`` in the backward). A value column that is
    identically 0 has a free output gradient: the backward sets its ``g = 1`` and hands the
    kernel ``out = -g^{lse}`` there; the kernel's ``rowsum(g * out)`` becomes
    ``g . out - g^{lse}`` and its ``p (g . v_i - rowsum)`` is exactly the line above, so one
    flash backward gives every gradient (no sentinel key, no normaliser column). Masked keys
    have ``p = 0`` exactly, so their gradients are exact zeros. When the incoming gradient is
    the same on every ``sq`` column (a loss that reads the second moments only through their
    sum, e.g. through ``sigma``), the backward runs on ``[vc, tr sq]`` alone: the same
    gradients (``g . v_i = g_vc . vc_i + g_tr tr sq_i``) from a kernel of width ``dv + 2``
    instead of ``2 dv + 1``, on the values ``[T | Z | vc]`` (``T = tr sq`` written into the
    buffer then, ``Z = 0`` the zero column). Returns ``out`` ``(B, H, Q, max(E, dv + ws))``
    and ``lse`` ``(B, H, Q)``; both backward paths verified by ``torch.autograd.gradcheck``
    in float64 (tests/ops/test_levy.py).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, beta: torch.Tensor, k: torch.Tensor, vbar: torch.Tensor,
        within: torch.Tensor | None, ref: torch.Tensor | None, bias: torch.Tensor,
        per_dim: bool, obs: torch.Tensor | None = None, count: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        B, H, Q, E = q.shape
        N, dv = k.shape[2], vbar.shape[-1]
        ctx.own_ref = ref is None
        if ref is None:
            # the reference formed here (the caller's GEMM, so the same bits) and returned
            assert obs is not None and count is not None
            ref_flat = torch.bmm(obs, vbar.transpose(1, 2).reshape(B, N, H * dv)) / count
            ref = ref_flat.view(B, 1, H, dv).transpose(1, 2)
            ctx.obs = (obs, count)
        ws = dv if per_dim else 1
        c = dv + ws
        dp = max(E, c + 1, dv + 2)  # the widest view the kernel gets (forward and backward)
        pad = max(E - c, 1)
        v0 = E + 2  # first value column: [kn | T | Z | vc | sq | 0 ...] (module docstring)
        # everything below is indexed (B, L, H, .), the memory order of the buffers, of the
        # kernel's outputs and of the module's projections (one common order is several times
        # faster than mixed ones); the kernel gets (B, H, L, .) views
        ctx.native = _native.train_loops_available(k.dtype, k.device)
        if ctx.native:  # [beta q / |q| | 0] and |q| in one compiled pass
            qp, qnrm = _native.lt_queries(_unit(q), beta, dp)
        else:
            qnrm = torch.linalg.vector_norm(q, dim=-1, keepdim=True).clamp_min_(1e-12)
            qp = q.new_empty(B, Q, H, dp)
            torch.mul(q / qnrm, beta[:, None, None], out=qp[..., :E].transpose(1, 2))
            qp[..., E:] = 0.0
            qnrm = qnrm.transpose(1, 2)[..., 0]  # (B, Q, H)
        buf = k.new_empty(B, N, H, v0 + c + pad)
        kt = k.transpose(1, 2)
        wt = None if within is None else within.transpose(1, 2)
        if ctx.native:
            # one compiled pass per row (csrc/levy_train.c, prep): kn, nrm, T = tr sq, vc, sq
            nrm = k.new_empty(B, N, H)
            _native.lt_prep(_unit(kt), _unit(vbar.transpose(1, 2)),
                            None if wt is None else _unit(wt, broadcast_ok=True),
                            _unit(ref[:, :, 0]), buf, nrm, per_dim)
            nrm = nrm[..., None]
        else:
            nrm = torch.linalg.vector_norm(kt, dim=-1, keepdim=True).clamp_min_(1e-12)
            torch.div(kt, nrm, out=buf[..., :E])
            buf[..., E:v0] = 0.0  # T (the trace column of the narrow backward) and Z
            vc = torch.sub(vbar.transpose(1, 2), ref.transpose(1, 2),
                           out=buf[..., v0 : v0 + dv])
            if per_dim:
                sq = buf[..., v0 + dv : v0 + c]
                if wt is None:
                    torch.mul(vc, vc, out=sq)
                else:
                    torch.addcmul(wt, vc, vc, out=sq)
            else:
                tr = torch.linalg.vecdot(vc, vc)[..., None]
                buf[..., v0 + dv : v0 + c] = tr if wt is None else tr + wt
            buf[..., v0 + c :] = 0.0
        dpf = max(E, c)
        assert _FLASH is not None
        out, lse = _FLASH(qp[..., :dpf].transpose(1, 2), buf[..., :dpf].transpose(1, 2),
                          buf[..., v0 : v0 + dpf].transpose(1, 2), 0.0, False, attn_mask=bias,
                          scale=1.0)
        ctx.save_for_backward(out, lse, bias)
        # intermediates, kept on ctx (the narrow backward writes its T column into buf)
        ctx.bufs = (qp, buf, nrm, qnrm, beta)
        ctx.dims = (E, dv, ws, within is not None)
        if ctx.own_ref:
            return out, lse, ref
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, g_out: torch.Tensor, g_lse: torch.Tensor, *g_ref_out: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        grads = _FlashBlock._backward_block(ctx, g_out, g_lse)
        if not ctx.own_ref:
            return (*grads, None, None)
        # ref = (obs @ vbar) / count formed in the forward: its total gradient (the block's,
        # -sum_i bar vc_i, plus the caller's) reaches vbar as obs_i * bar ref / count
        obs, count = ctx.obs
        g_vc, g_ref = grads[3], grads[5]
        assert g_vc is not None and g_ref is not None
        if g_ref_out[0] is not None:
            g_ref = g_ref + g_ref_out[0]
        B, N = obs.shape[0], obs.shape[2]
        g_vbar = torch.addcmul(g_vc.transpose(1, 2), obs.view(B, N, 1, 1),
                               g_ref.transpose(1, 2) / count[..., None])
        return (*grads[:3], g_vbar.transpose(1, 2), grads[4], None, *grads[6:], None, None)

    @staticmethod
    def _backward_block(
        ctx: Any, g_out: torch.Tensor, g_lse: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        """The gradients of the eight inputs of :meth:`forward` (``ref`` as an input)."""
        out, lse, bias = ctx.saved_tensors
        qp, buf, nrm, qnrm, beta = ctx.bufs
        E, dv, ws, has_within = ctx.dims
        c = dv + ws
        v0 = E + 2
        g_sq_in = g_out[..., dv:c]
        # a loss that reads the second moments only through their sum over dimensions (sigma;
        # the per-dimension var and sigma_dim unused) sends the same gradient to every sq
        # column: then the backward needs only [T = tr sq, Z, vc] (width dv + 2, exactly the
        # same gradients: g . v_i = g_vc . vc_i + g_tr tr sq_i), about 60 % of the full cost
        B, H, Q = out.shape[:3]
        if ctx.native:
            return _FlashBlock._backward_native(ctx, g_out, g_lse)
        narrow = ws > 1 and bool((g_sq_in == g_sq_in[..., :1]).all())
        if narrow:
            # values [T | Z | vc | ...] start at column E; the kernel's value columns beyond
            # dv + 2 (if E > dv + 2) get gradient 0 and are ignored
            dp, first, zc = max(E, dv + 2), E, 1
            torch.sum(buf[..., v0 + dv : v0 + c], -1, out=buf[..., E])
        else:
            # values [vc | sq | 0 ...] start at column v0; column c is the zero column
            dp, first, zc = max(E, c + 1), v0, c
        # gradient and output rows in out's (B, Q, H, .) memory order, width dp
        gt = out.new_zeros(B, Q, H, dp).transpose(1, 2)
        ot = out.new_zeros(B, Q, H, dp).transpose(1, 2)
        if narrow:
            gt[..., 0] = g_sq_in[..., 0]
            ot[..., 0] = out[..., dv:c].sum(-1)
            gt[..., 2 : 2 + dv] = g_out[..., :dv]
            ot[..., 2 : 2 + dv] = out[..., :dv]
        else:
            gt[..., :c] = g_out[..., :c]
            ot[..., :c] = out[..., :c]
        gt[..., zc] = 1.0
        ot[..., zc] = -g_lse
        assert _FLASH_BWD is not None
        gq, gkn, gv = _FLASH_BWD(gt, qp[..., :dp].transpose(1, 2), buf[..., :dp].transpose(1, 2),
                                 buf[..., first : first + dp].transpose(1, 2), ot, lse, 0.0,
                                 False, attn_mask=bias, scale=1.0)
        # (B, N, H, .) views of the kernel's gradients (its memory order)
        gkn, gv = gkn.transpose(1, 2)[..., :E], gv.transpose(1, 2)
        if narrow:
            g_vv, g_sq = gv[..., 2 : 2 + dv], gv[..., :1]
        else:
            g_vv, g_sq = gv[..., :dv], gv[..., dv:c]
        kn, vc = buf[..., :E], buf[..., v0 : v0 + dv]
        # F.normalize's backward: (g - kn (kn . g)) / max(|k|, eps); the clamp (|k| <= eps)
        # passes no radial part
        radial = torch.linalg.vecdot(kn, gkn)[..., None]
        if bool((nrm <= 1e-12).any()):
            radial = radial * (nrm > 1e-12)
        g_k = torch.addcmul(gkn, kn, radial, value=-1.0).div_(nrm)
        g_vc = torch.addcmul(g_vv, vc, g_sq, value=2.0)  # g_sq broadcasts if 1 wide
        g_ref = -g_vc.sum(1, keepdim=True)
        g_within = None
        if has_within:
            g_within = (g_sq.expand(-1, -1, -1, ws) if narrow else g_sq).transpose(1, 2)
        # queries qa = beta qn, qn = q / max(|q|, eps): the same backward as for the keys
        qn = qp[..., :E].transpose(1, 2) / beta[:, None, None]
        gqa = gq[..., :E]
        g_beta = torch.linalg.vecdot(qn, gqa).sum((0, 2))
        g_qn = gqa * beta[:, None, None]
        rad_q = torch.linalg.vecdot(qn, g_qn)[..., None] * (qnrm.transpose(1, 2) > 1e-12)[..., None]
        g_q = torch.addcmul(g_qn, qn, rad_q, value=-1.0) / qnrm.transpose(1, 2)[..., None]
        return (g_q, g_beta, g_k.transpose(1, 2), g_vc.transpose(1, 2), g_within,
                g_ref.transpose(1, 2), None, None)

    @staticmethod
    def _backward_native(
        ctx: Any, g_out: torch.Tensor, g_lse: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        """:meth:`backward` with the row loops compiled (csrc/levy_train.c: rows, post); the
        same flash backward call, the same formulas."""
        out, lse, bias = ctx.saved_tensors
        qp, buf, nrm, qnrm, beta = ctx.bufs
        E, dv, ws, has_within = ctx.dims
        c = dv + ws
        v0 = E + 2
        g_out, g_lse = _unit(g_out), g_lse
        narrow = ws > 1 and _native.lt_uniform(g_out, out, g_lse, dv, ws)
        if narrow:  # values [T | Z | vc | ...] (T = tr sq, written by the forward's loop)
            dp, first, cols = max(E, dv + 2), E, (2, 0)
        else:  # values [vc | sq | 0 ...]
            dp, first, cols = max(E, c + 1), v0, (0, dv)
        gt, ot = _native.lt_rows(g_out, out, g_lse, dv, ws, dp, narrow)
        assert _FLASH_BWD is not None
        gq, gkn, gv = _FLASH_BWD(gt, qp[..., :dp].transpose(1, 2), buf[..., :dp].transpose(1, 2),
                                 buf[..., first : first + dp].transpose(1, 2), ot, lse, 0.0,
                                 False, attn_mask=bias, scale=1.0)
        wsq = 1 if (narrow or ws == 1) else ws
        g_k, g_vc, g_sq, g_ref = _native.lt_post(
            _unit(gkn.transpose(1, 2)), _unit(gv.transpose(1, 2)), buf, nrm[..., 0], E, dv, wsq,
            cols)
        g_within = None
        if has_within:
            g_within = (g_sq.expand(-1, -1, -1, ws) if wsq < ws else g_sq).transpose(1, 2)
        g_q, g_beta = _native.lt_queries_grad(gq, beta, qp, qnrm, E)
        return (g_q.transpose(1, 2), g_beta, g_k.transpose(1, 2), g_vc.transpose(1, 2),
                g_within, g_ref[:, :, None], None, None)


def _unit(t: torch.Tensor, broadcast_ok: bool = False) -> torch.Tensor:
    """``t`` itself when its last stride is 1 (or 0 with ``broadcast_ok``), else a contiguous
    copy (what the compiled loops read)."""
    if t.stride(-1) == 1 or t.shape[-1] == 1 or (broadcast_ok and t.stride(-1) == 0):
        return t
    return t.contiguous()


def _accumulate_flash_grad(
    q: torch.Tensor,
    blocks: list[_Inputs],
    mom_b: list[tuple[torch.Tensor, torch.Tensor | None]],
    ref: torch.Tensor | None,
    beta: torch.Tensor,
    per_dim: bool,
    count: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``z = sum_i e^{beta cos_i}`` ``(B, H, Q)``, the moments ``sum_i p_i v_i``
    ``(B, H, Q, W)`` (0 where ``z = 0``) and the reference ``(B, H, 1, Dv)``, differentiable:
    the autograd path on CPU.

    One :class:`_FlashBlock` call per block (CPU flash forward with its log-sum-exp; one flash
    backward call in the backward pass), combined as in :func:`_accumulate_lse`,
    ``sum_b (z_b / z) out_b`` (with one block the weight is 1, or 0 for an empty series).
    ``ref=None`` (one block only): the block forms the reference, ``obs @ vbar / count``
    (``count`` ``(B, 1, 1)``, observed entries per series, at least 1), and returns it.
    """
    dv = mom_b[0][0].shape[-1]
    w_cols = dv + (dv if per_dim else 1)
    z_parts, t_parts = [], []
    for blk, (vbar, within) in zip(blocks, mom_b, strict=True):
        bias = torch.where(blk.mask, 0.0, -1e4).to(q.dtype)[:, None, None, :]
        if ref is None:
            assert len(blocks) == 1
            out, lse, ref = _FlashBlock.apply(q, beta, blk.k, vbar, within, None, bias, per_dim,
                                              blk.mask.to(q.dtype)[:, None, :], count)
        else:
            out, lse = _FlashBlock.apply(q, beta, blk.k, vbar, within, ref, bias, per_dim)
        z_parts.append(torch.exp(lse))
        t_parts.append(out[..., :w_cols])
    assert ref is not None
    z = _ordered_sum(z_parts)
    if len(z_parts) == 1:
        if bool((z > 0).all()):  # no empty series: the weight is exactly 1
            return z, t_parts[0], ref
        return z, t_parts[0] * (z > 0)[..., None].to(q.dtype), ref
    zs = torch.where(z > 0, z, torch.ones_like(z))
    return z, _ordered_sum([(zb / zs)[..., None] * ob for zb, ob in zip(z_parts, t_parts,
                                                                        strict=True)]), ref


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
        fl = _FLASH if flash is None else flash
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


def _accumulate_explicit(
    qn: torch.Tensor,
    kn_b: list[torch.Tensor],
    vals_b: list[tuple[torch.Tensor, torch.Tensor]],
    blocks: list[_Inputs],
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference path: ``exp(beta cos - M)`` with ``M`` the max over observed keys, then GEMMs.

    Returns ``z`` ``(B, H, Q)``, the weighted sums ``(B, H, Q, W)`` and ``log_scale`` with
    ``Lambda = alpha exp(log_scale) z`` (``log_scale = M - beta``). Works for any ``beta``.
    """
    beta4 = beta[:, None, None]
    qb = qn * beta4
    neg_inf = torch.tensor(float("-inf"), dtype=qn.dtype, device=qn.device)
    scores = [qb @ kn.transpose(-1, -2) for kn in kn_b]  # beta cos, (B, H, Q, bs)
    mx = torch.stack(
        [torch.where(blk.mask[:, None, None, :], sc, neg_inf).amax(-1)
         for blk, sc in zip(blocks, scores, strict=True)],
        dim=-1,
    ).amax(-1, keepdim=True).detach()  # (B, H, Q, 1): exact and order-independent
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    z_parts, t_parts = [], []
    for blk, sc, (vc, sq) in zip(blocks, scores, vals_b, strict=True):
        vb = torch.cat([vc, sq], dim=-1)
        m4 = blk.mask[:, None, None, :]
        e = torch.where(m4, torch.exp(torch.where(m4, sc - mx, 0.0)), 0.0)
        z_parts.append(e.sum(-1))
        t_parts.append(e @ vb)
    return _ordered_sum(z_parts), _ordered_sum(t_parts), mx[..., 0] - beta4[..., 0]


@torch.no_grad()
def levy_attention_sample(
    q: torch.Tensor,
    k: torch.Tensor,
    a: torch.Tensor,
    times: torch.Tensor,
    mask: torch.Tensor,
    *,
    alpha: float | torch.Tensor,
    beta: float | torch.Tensor,
    h: float | torch.Tensor,
    omega: torch.Tensor | None = None,
    phase: torch.Tensor | None = None,
    D: torch.Tensor | None = None,
    num_samples: int,
    generator: torch.Generator | None = None,
    max_atoms_per_chunk: int = 4_000_000,
) -> LevySamples:
    r"""Draw the Poisson random measure explicitly (the sampled operator the layer averages).

    For each draw, query and head: ``N_q ~ Poisson(Lambda_q)``; each atom picks
    ``i ~ p_q`` and ``t ~ N(t_i, h^2)`` and carries ``V_i(t) = a_i + D g(t)``;
    ``Y_q = (1/N_q) sum_m V_{i_m}(t_m)`` if ``N_q >= 1``. Vectorised: counts first, then all
    atoms of a chunk of draws at once (inverse CDF on a row-offset global CDF), then a
    scatter-add per draw. Memory is ``O(max_atoms_per_chunk * (Dv + K))``.

    Parameters
    ----------
    q, k, a, times, mask, alpha, beta, h, omega, phase, D
        As in :func:`levy_attention`.
    num_samples : int
        ``S``, the number of independent draws.
    generator : torch.Generator, optional
        Source of randomness (on the inputs' device).
    max_atoms_per_chunk : int
        Draws are processed in chunks holding about this many atoms.

    Returns
    -------
    LevySamples
        ``values`` ``(S, B, H, Q, Dv)``, ``counts`` ``(S, B, H, Q)``, ``nonempty``
        ``(S, B, H, Q)``.

    Examples
    --------
    >>> import torch
    >>> from attnuq.ops import levy_attention_sample
    >>> out = levy_attention_sample(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4),
    ...                             torch.randn(1, 2, 5, 2), torch.rand(1, 5),
    ...                             torch.ones(1, 5, dtype=torch.bool),
    ...                             alpha=1.0, beta=2.0, h=0.1, num_samples=100)
    >>> out.values.shape
    torch.Size([100, 1, 2, 3, 2])
    """
    S = check_positive_int(num_samples, "num_samples")
    chunk_atoms = check_positive_int(max_atoms_per_chunk, "max_atoms_per_chunk")
    inp = _validate(q, k, a, times, mask, alpha, beta, h, omega, phase, D)
    if k.shape[2] == 0:  # N = 0: one masked entry; every draw is then empty
        q, k, a, times, mask = _pad_one_masked(q, k, a, times, mask)
        inp = _validate(q, k, a, times, mask, alpha, beta, h, omega, phase, D)
    B, H, Q, _ = q.shape
    N, Dv = a.shape[2], a.shape[3]
    dt, dev = q.dtype, q.device
    # weights directly from the definition (a separate path from levy_attention's shifted form)
    cos = _scores(inp)
    w = inp.alpha[:, None, None] * torch.exp(inp.beta[:, None, None] * (cos - 1))
    w = torch.where(mask[:, None, None, :], w, torch.zeros_like(w))  # (B, H, Q, N)
    lam = w.sum(-1)  # (B, H, Q)
    R = B * H * Q
    cdf = w.reshape(R, N).cumsum(-1)
    tot = cdf[:, -1:]
    cdf = cdf / torch.where(tot > 0, tot, torch.ones_like(tot))  # last entry exactly 1
    gcdf = (cdf + torch.arange(R, device=dev, dtype=dt)[:, None]).reshape(-1)  # (R * N,)
    # flat position r * N + i  ->  source row (b * H + h) * N + i of a, times and the head
    r_idx = torch.arange(R, device=dev)
    bh_of_row = r_idx // Q  # b * H + h
    src_of_pos = (bh_of_row[:, None] * N + torch.arange(N, device=dev)).reshape(-1)
    head_of_pos = (bh_of_row % H).repeat_interleave(N)
    # last position with positive weight per row (guards u + r rounding up to r + 1)
    pos_w = (w.reshape(R, N) > 0).to(torch.long) * torch.arange(1, N + 1, device=dev)
    last_pos = r_idx * N + (pos_w.amax(-1) - 1).clamp_min(0)
    a_flat = torch.where(mask[:, None, :, None], a, torch.zeros_like(a)).reshape(B * H * N, Dv)
    t_flat = torch.where(mask, times, torch.zeros_like(times))[:, None, :].expand(B, H, N)
    t_flat = t_flat.reshape(-1)
    fourier = inp.omega is not None and inp.phase is not None and inp.D is not None

    counts = torch.poisson(lam.reshape(1, R).expand(S, R).contiguous(), generator=generator)
    counts = counts.to(torch.long)  # (S, R)
    values = torch.zeros(S, R, Dv, dtype=dt, device=dev)
    per_draw = counts.sum(-1)  # (S,)
    biggest = int(per_draw.max()) if S else 0
    if biggest > chunk_atoms:
        raise ValueError(
            f"one draw holds {biggest} atoms (total evidence sum(Lambda) = "
            f"{float(lam.sum()):.4g} over {R} query rows), more than "
            f"max_atoms_per_chunk={chunk_atoms}: the explicit sampler costs O(Lambda) memory and "
            "time per draw; raise max_atoms_per_chunk if that memory is available, or use the "
            "closed form (levy_attention)"
        )
    s0 = 0
    while s0 < S:
        # grow the chunk of draws until it holds about chunk_atoms atoms (at least one draw)
        csum = torch.cumsum(per_draw[s0:], 0)
        s1 = s0 + max(1, int((csum <= chunk_atoms).sum()))
        cnt = counts[s0:s1].reshape(-1)  # ((s1 - s0) * R,)
        n_atoms = int(cnt.sum())
        if n_atoms:
            slot = torch.repeat_interleave(cnt)  # draw-row slot of every atom
            row = slot % R if R > 1 else torch.zeros_like(slot)
            u = torch.rand(n_atoms, generator=generator, dtype=dt, device=dev)
            pos = torch.searchsorted(gcdf, u.add_(row), right=True)
            pos = torch.minimum(pos, last_pos[row])  # atom's (row, i) in the flat CDF
            src = src_of_pos[pos]
            v = a_flat[src]  # (n_atoms, Dv)
            if fourier:
                assert inp.omega is not None and inp.phase is not None and inp.D is not None
                eps = torch.randn(n_atoms, generator=generator, dtype=dt, device=dev)
                if H == 1:
                    t = t_flat[src] + inp.h[0] * eps
                    g = torch.cos(t[:, None] * inp.omega[0] + inp.phase[0])  # (n_atoms, K)
                    v = v + g @ inp.D[0].transpose(0, 1)
                else:
                    hd = head_of_pos[pos]
                    t = t_flat[src] + inp.h[hd] * eps
                    om_h, ph_h = inp.omega.expand(H, -1), inp.phase.expand(H, -1)
                    g = torch.cos(t[:, None] * om_h[hd] + ph_h[hd])  # (n_atoms, K)
                    full = (g @ inp.D.reshape(H * Dv, -1).transpose(0, 1)).view(-1, H, Dv)
                    v = v + full.gather(1, hd[:, None, None].expand(-1, 1, Dv))[:, 0]
            sums = torch.zeros(cnt.numel(), Dv, dtype=dt, device=dev).index_add_(0, slot, v)
            values[s0:s1] = sums.reshape(s1 - s0, R, Dv)
        s0 = s1
    nonempty = counts >= 1
    values = values / counts.clamp_min(1).to(dt)[..., None]
    return LevySamples(
        values=values.reshape(S, B, H, Q, Dv),
        counts=counts.reshape(S, B, H, Q),
        nonempty=nonempty.reshape(S, B, H, Q),
    )
