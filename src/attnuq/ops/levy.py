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
* Fast path (``backend="sdpa"``, chosen by ``"auto"`` when ``beta <= log(finfo.max) / 4``, i.e.
  22 in float32 and 177 in float64): the sums ``sum_i e^{beta cos_qi} [1, v_i, v_i^2 + s_i]``
  come from ONE fused ``F.scaled_dot_product_attention`` call per block. Softmax discards the
  normaliser ``Z_q`` that the evidence needs, so a sentinel key with known score ``-beta`` and
  value ``e_0`` is prepended: its output weight ``o_q`` gives ``Z_q e^{beta} = (1 - o_q) / o_q``
  (every observed term is ``>= 1`` relative to the sentinel, so ``o_q <= 1/2`` and there is no
  cancellation), and ``Lambda_q = alpha e^{-2 beta} (1 - o_q) / o_q``. Masked keys get score
  ``-1e4`` (weight exactly 0).
* Reference path (``backend="explicit"``, any ``beta``): scores, the exact max ``M_q`` over
  observed ``i``, ``exp(beta cos - M_q)`` and GEMMs; ``Lambda_q = alpha e^{M_q - beta} Z_q``.
  Tests check that both paths agree (values and gradients) to 1e-12 in float64.
* Masked entries of ``k``, ``a``, ``times`` are replaced by zeros once (``torch.where``), so
  whatever they held (NaN included) they contribute exact zeros. Every sum over observations
  runs over fixed-size, zero-padded blocks of ``block_size`` accumulated in order, so the same
  numbers meet the same kernels whatever the padded length: appending masked observations
  leaves every output bit-identical (tested with 3 and 300 extra entries).
* The second moment is accumulated about a per-series reference (the plain mean of ``vbar`` over
  observed ``i``), which removes most of the cancellation of ``E v^2 - (E v)^2`` in float32.
* Empty series (no observed entry): ``evidence = 0``, ``p_empty = 1``, ``mean = 0``, ``var = 0``,
  ``phi = 1``, ``sigma = 0``; gradients are finite (zero where the output is constant).
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
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from attnuq._validation import check_positive_int
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
    _check_observed_finite(times, mask, "times")
    _check_observed_finite(k, mask[:, None, :, None], "k")
    _check_observed_finite(a, mask[:, None, :, None], "a")
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
    """Zero masked entries, zero-pad the observation axis to a multiple of ``block``, cut it.

    After this, masked rows of ``k``, ``a`` and ``times`` hold exact zeros (so anything derived
    from them is finite); the operator then gives them weight exactly 0.
    """
    n = inp.k.shape[2]
    nb = max(1, -(-n // block))
    pad = nb * block - n
    mask = inp.mask
    m4 = mask[:, None, :, None]
    k = torch.where(m4, inp.k, 0.0)
    a = torch.where(m4, inp.a, 0.0)
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


def _gcov_matrices(omega: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M1, M2)`` each ``(H, K, K)``: ``Cov(g)_kl = M1_kl c_k c_l + M2_kl s_k s_l``.

    ``M1 = e (cosh u - 1)``, ``M2 = e sinh u`` with ``e_kl = exp(-(w_k^2 + w_l^2) h^2 / 2)`` and
    ``u_kl = w_k w_l h^2``. For ``|u| < 1`` they are formed from ``sinh`` (no cancellation), else
    from ``e cosh u = (e^{-(w_k - w_l)^2 h^2/2} + e^{-(w_k + w_l)^2 h^2/2}) / 2`` (no overflow).
    """
    h2 = (h * h)[:, None, None]  # (H, 1, 1)
    wk = omega[:, :, None]
    wl = omega[:, None, :]
    u = wk * wl * h2
    e = torch.exp(-(wk * wk + wl * wl) * h2 / 2)
    em = torch.exp(-((wk - wl) ** 2) * h2 / 2)
    ep = torch.exp(-((wk + wl) ** 2) * h2 / 2)
    small = u.abs() < 1
    us = torch.where(small, u, torch.zeros_like(u))
    m1 = torch.where(small, e * 2 * torch.sinh(us / 2) ** 2, (em + ep) / 2 - e)
    m2 = torch.where(small, e * torch.sinh(us), (em - ep) / 2)
    return m1, m2


class _Field(NamedTuple):
    """Per-call constants of the value field: damping ``(H, K)``, ``D^T`` ``(H, K, Dv)`` and
    the within-atom variance weights ``(2 K^2, H * Dv)``."""

    damp: torch.Tensor
    dt: torch.Tensor
    w: torch.Tensor


def _field(inp: _Inputs) -> _Field | None:
    if inp.omega is None or inp.phase is None or inp.D is None:
        return None
    H, Dv = inp.D.shape[:2]
    om_h = inp.omega.expand(H, -1)
    damp = torch.exp(-(om_h**2) * (inp.h**2)[:, None] / 2)  # (H, K)
    m1, m2 = _gcov_matrices(om_h, inp.h)  # (H, K, K) each
    dd = inp.D[:, :, :, None] * inp.D[:, :, None, :]  # (H, Dv, K, K)
    w1 = (dd * m1[:, None]).flatten(-2)  # (H, Dv, K*K)
    w2 = (dd * m2[:, None]).flatten(-2)
    w = torch.cat([w1, w2], dim=-1)  # (H, Dv, 2 K^2)
    w = w.permute(2, 0, 1).reshape(-1, H * Dv)  # (2 K^2, H * Dv)
    return _Field(damp=damp, dt=inp.D.transpose(-1, -2), w=w)


def _value_moments(
    inp: _Inputs, fld: _Field | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``vbar`` ``(B, H, N, Dv)`` and within-atom variance ``s`` ``(B, H, N, Dv)`` (or None).

    ``s_ij = D_j Cov(g) D_j^T = sum_{k,l} D_jk D_jl (M1_kl c_k c_l + M2_kl s_k s_l)`` is one
    GEMM of the ``2 K^2`` products of the time features with fixed weights. Rows of masked
    entries are finite but meaningless (the callers weight them by exactly 0).
    """
    a = inp.a
    if fld is None or inp.omega is None or inp.phase is None:
        return a, None
    B, H, N, Dv = a.shape
    times = inp.times
    z = times[:, None, :, None] * inp.omega[None, :, None, :] + inp.phase[None, :, None, :]
    c = torch.cos(z)  # (B, Hw, N, K), Hw in {1, H}
    sn = torch.sin(z)
    vbar = a + (c * fld.damp[None, :, None, :]) @ fld.dt  # (B, H, N, Dv)
    feats = torch.cat(
        [(c[..., :, None] * c[..., None, :]).flatten(-2),
         (sn[..., :, None] * sn[..., None, :]).flatten(-2)],
        dim=-1,
    )  # (B, Hw, N, 2 K^2)
    hw = feats.shape[1]
    if hw == 1:  # shared time features: one GEMM for all heads
        s = (feats[:, 0] @ fld.w).view(B, N, H, Dv).transpose(1, 2)
    else:
        w = fld.w.view(-1, H, Dv).transpose(0, 1)  # (H, 2T, Dv)
        s = feats @ w
    return vbar, s


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
        the trace (``sigma``), which halves the width of the fused attention call.
    block_size : int
        Observations per block in the sums over ``N`` (see module docstring).
    backend : {"auto", "sdpa", "explicit"}
        ``"sdpa"``: one fused ``F.scaled_dot_product_attention`` per block with a sentinel key
        that recovers the normaliser (see :func:`_accumulate_sdpa`); needs
        ``beta <= log(finfo.max) / 4`` (22 in float32, 177 in float64). ``"explicit"``: scores,
        a max shift, ``exp`` and GEMMs (the reference; any ``beta``). ``"auto"`` picks
        ``"sdpa"`` when ``beta`` allows and ``B * H * Q * N_obs >= 65536`` (``N_obs``: most observed
        entries in a series; below that the fused
        kernel's thread start-up costs more than it saves).

    Returns
    -------
    LevyResult
        ``mean``, ``var``, ``evidence``, ``p_empty``, ``phi``, ``sigma``, ``sigma_dim``.

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
    if backend not in ("auto", "sdpa", "explicit"):
        raise ValueError(f"backend must be 'auto', 'sdpa' or 'explicit', got {backend=!r}")
    if not isinstance(per_dim, bool):
        raise TypeError(f"per_dim must be a bool, got {per_dim=!r}")
    inp = _validate(q, k, a, times, mask, alpha, beta, h, omega, phase, D)
    B, H = q.shape[:2]
    Dv = a.shape[-1]
    # Every per-observation quantity and every sum over observations is computed on fixed-size,
    # zero-padded blocks of `block_size` observations, so that the same numbers meet the same
    # kernels whatever the padded length N is (bit-identical under appended masked entries).
    # Masked observations have all-zero key and value rows, so they add exact zeros.
    blocks = _split_blocks(inp, block_size)
    fld = _field(inp)
    mom_b = [_value_moments(blk, fld) for blk in blocks]  # vbar, within: (B, H, bs, Dv)
    count = mask.sum(-1).clamp_min(1).to(q.dtype)[:, None, None, None]
    # reference: plain mean of vbar over observed entries
    ref = _ordered_sum(
        [blk.mask.to(q.dtype)[:, None, None, :].expand(B, H, 1, -1) @ mb[0]
         for blk, mb in zip(blocks, mom_b, strict=True)]
    ) / count  # (B, H, 1, Dv)
    vals_b = []  # per block: v - ref (B, H, bs, Dv); (v - ref)^2 + s (Dv) or its sum (1)
    for vbar, within in mom_b:
        vc = vbar - ref  # masked rows: finite, weighted by exactly 0 below
        sq = vc * vc if within is None else vc * vc + within
        if not per_dim:
            sq = sq.sum(-1, keepdim=True)
        vals_b.append((vc, sq))
    kn_b = [F.normalize(blk.k, dim=-1, eps=1e-12) for blk in blocks]  # (B, H, bs, E)
    qn = F.normalize(q, dim=-1, eps=1e-12)
    limit = 0.25 * math.log(torch.finfo(q.dtype).max)  # 22 in float32, 177 in float64
    if backend == "auto":
        # the fused kernel pays a thread fork per call: only worth it for non-tiny problems
        # (sized by observed entries, so that masked padding cannot change the choice)
        n_obs = int(mask.sum(-1).max()) if mask.numel() else 0
        big = q.shape[0] * q.shape[1] * q.shape[2] * n_obs >= _SDPA_MIN_SIZE
        backend = "sdpa" if big and float(inp.beta.detach().max()) <= limit else "explicit"
    if backend == "sdpa":
        if float(inp.beta.detach().max()) > limit:
            raise ValueError(
                f"backend='sdpa' needs beta <= {limit:.1f} in {q.dtype}, got "
                f"beta={inp.beta.detach().tolist()}"
            )
        z, tsum = _accumulate_sdpa(qn, kn_b, vals_b, blocks, inp.beta)
        log_scale = -2 * inp.beta[:, None]  # Lambda = alpha e^{-2 beta} z
    else:
        z, tsum, log_scale = _accumulate_explicit(qn, kn_b, vals_b, blocks, inp.beta)

    nonempty = z > 0
    zs = torch.where(nonempty, z, torch.ones_like(z))
    mu_c = tsum[..., :Dv] / zs[..., None]
    m2 = tsum[..., Dv:] / zs[..., None]
    mean = torch.where(nonempty[..., None], mu_c + ref, torch.zeros_like(mu_c))
    if per_dim:
        var: torch.Tensor | None = torch.clamp_min(m2 - mu_c * mu_c, 0.0)
        assert var is not None
        trace = var.sum(-1)
    else:
        var = None
        trace = torch.clamp_min(m2[..., 0] - (mu_c * mu_c).sum(-1), 0.0)
    evidence = inp.alpha[:, None] * torch.exp(log_scale) * z  # (B, H, Q)
    phi = poisson_phi(evidence)
    p_empty = torch.exp(-evidence)
    sigma = _safe_sqrt(trace * phi)
    sigma_dim = None if var is None else _safe_sqrt(var * phi[..., None])
    return LevyResult(
        mean=mean, var=var, evidence=evidence, p_empty=p_empty, phi=phi, sigma=sigma,
        sigma_dim=sigma_dim,
    )


def _accumulate_sdpa(
    qn: torch.Tensor,
    kn_b: list[torch.Tensor],
    vals_b: list[tuple[torch.Tensor, torch.Tensor]],
    blocks: list[_Inputs],
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``z = sum_i e^{beta (cos_i + 1)}`` ``(B, H, Q)`` and ``sum_i e^{beta (cos_i + 1)} v_i``.

    One fused ``F.scaled_dot_product_attention`` per block. A *sentinel* key with score
    ``-beta`` and value ``e_0`` is prepended: its output weight ``o = e^{-beta} / (e^{-beta} +
    sum_i e^{beta cos_i})`` gives the normaliser the softmax discards, ``z = (1 - o) / o``, and
    the other output columns times ``1 / o`` give the unnormalised sums. Every observed term
    is ``>= 1`` so ``o <= 1/2`` for a block with an observation (no cancellation). Masked keys get
    score ``-1e4`` (weight exactly 0); ``q``, ``k`` and ``v`` are zero-padded to one width ``Dp``
    because the fused CPU kernel needs equal head dims.
    """
    B, H, Q, E = qn.shape
    dv, ws = vals_b[0][0].shape[-1], vals_b[0][1].shape[-1]
    w_cols = dv + ws
    dp = max(E + 1, w_cols + 1)
    qa = qn.new_zeros(B, H, Q, dp)
    qa[..., :E] = qn * beta[:, None, None]
    qa[..., E] = 1.0
    z_parts, t_parts = [], []
    for blk, kn, (vc, sq) in zip(blocks, kn_b, vals_b, strict=True):
        bs = kn.shape[2]
        # buffers written column by column (no zero-fill of what is overwritten anyway)
        keys = kn.new_empty(B, H, bs + 1, dp)
        keys[:, :, 0, :] = 0.0
        keys[:, :, 0, E] = -beta
        keys[:, :, 1:, :E] = kn
        keys[:, :, 1:, E] = torch.where(blk.mask, 0.0, -1e4).to(kn.dtype)[:, None, :]
        keys[:, :, 1:, E + 1 :] = 0.0
        vals = vc.new_empty(B, H, bs + 1, dp)
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
    return _ordered_sum(z_parts), _ordered_sum(t_parts)


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
