"""``phi(L) = E[1/N | N >= 1]`` for ``N ~ Poisson(L)``, with its closed-form derivative.

Math
----
With ``Ein(L) = sum_{k>=1} L^k / (k k!) = Ei(L) - ln L - gamma`` (gamma: Euler's constant),

    phi(L) = sum_{k>=1} (1/k) e^{-L} L^k / k! / (1 - e^{-L})
           = e^{-L} (Ei(L) - ln L - gamma) / (1 - e^{-L})
           = Ein(L) / (e^L - 1).

Since ``Ein'(L) = (e^L - 1) / L`` the derivative is

    dphi/dL = 1/L - phi(L) e^L / (e^L - 1).

Limits: ``phi(L) -> 1 - L/4 + ...`` as ``L -> 0``; ``phi(L) ~ 1/L + 1/L^2 + 2/L^3`` as
``L -> inf``. PyTorch has no ``Ei``, and ``Ei`` overflows near ``L = 709``, so ``phi`` is
evaluated in float64 without ever forming ``Ei`` itself:

* ``L <= 1``: the Taylor series of ``phi`` about 0 (radius ``2 pi``, 24 terms; coefficients
  exact in :class:`fractions.Fraction`); its derivative term by term, so no ``1/L - 1/L``
  cancellation near 0.
* ``1 < L <= 4096``: a piecewise Chebyshev expansion (dyadic pieces ``[1,2], [2,4], ...,
  [2048,4096]``, degree 20) of ``phi`` and, separately, of ``phi'``, with coefficients computed
  at import from exact node values: up to ``L = 128`` the positive series ``Ein(L)``
  (``math.fsum``) divided by ``expm1(L)``, above it the asymptotic series below truncated at
  its smallest term (error about ``e^{-L}``, below ``1e-55``). Every dyadic piece sees the poles
  ``2 pi i n`` of ``phi`` at the same relative distance, so degree 20 suffices on each.
* ``L > 4096``: the asymptotic series ``e^{-L} Ei(L) ~ sum_{k=0}^{n} k! / L^{k+1}`` (n = 8,
  truncation error below ``1e-25`` relative) minus the exact ``e^{-L}(ln L + gamma)``, and its
  term-wise derivative ``-sum (k+1)! / L^{k+2}`` (no cancellation).

Evaluation cost: every ``L`` in ``(1, 4096]`` (the range where the evidence of an attention
layer lives) takes five tensor operations whatever its piece: the powers ``t^0 .. t^20`` of the
piece variable, one small GEMM against every piece's coefficients (converted at import from
the Chebyshev form to the monomial form, which is exact to ``1e-15`` here, see
:func:`_monomial`) and a gather of each element's own piece. The Taylor and asymptotic branches
run only when some element needs them.

Relative error is below 1e-12 in float64 for ``L`` in ``[0, 1e6]`` (tested against mpmath for
``L`` in ``[1e-8, 1e6]``). float32 / float16 inputs are computed in float64 and cast back.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction
from typing import Any

import torch

__all__ = ["poisson_phi", "poisson_phi_derivative"]

_EULER_GAMMA = 0.57721566490153286060651209008240243
_SMALL = 1.0  # Taylor branch for L <= _SMALL
_LARGE = 4096.0  # asymptotic branch for L > _LARGE
_N_TAYLOR = 24  # |L| <= 1 in a series of radius 2 pi: (1/2pi)^24 ~ 1e-19
_N_ASYMPTOTIC = 8


def _taylor_coefficients(n: int) -> list[float]:
    """Exact Taylor coefficients ``c_j`` of ``phi(L) = sum_j c_j L^j`` (as floats).

    ``phi = (Ein(L)/L) / ((e^L - 1)/L)`` with numerator coefficients ``1/((j+1)(j+1)!)`` and
    denominator coefficients ``1/(j+1)!``; power-series division in exact rationals.
    """
    num = [Fraction(1, (j + 1) * math.factorial(j + 1)) for j in range(n)]
    den = [Fraction(1, math.factorial(j + 1)) for j in range(n)]
    c: list[Fraction] = []
    for j in range(n):
        acc = num[j] - sum((c[m] * den[j - m] for m in range(j)), Fraction(0))
        c.append(acc / den[0])
    return [float(x) for x in c]


_TAYLOR = _taylor_coefficients(_N_TAYLOR)


def _horner(coeffs: list[float], x: torch.Tensor) -> torch.Tensor:
    """``sum_j coeffs[j] x^j`` by Horner's rule (two in-place elementwise ops per term)."""
    out = torch.full_like(x, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        out.mul_(x).add_(c)
    return out


def _phi_py(x: float) -> tuple[float, float]:
    """``phi(x)`` and ``dphi/dx`` for ``0 <= x <= 128`` in Python floats (exact series)."""
    if x <= _SMALL:
        val = sum(c * x**j for j, c in enumerate(_TAYLOR))
        der = sum(j * c * x ** (j - 1) for j, c in enumerate(_TAYLOR) if j)
        return val, der
    n_terms = int(x + 9.0 * math.sqrt(x) + 12.0)
    term, parts = 1.0, []
    for k in range(1, n_terms + 1):
        term *= x / k  # x^k / k!
        parts.append(term / k)
    val = math.fsum(parts) / math.expm1(x)
    return val, 1.0 / x - val / -math.expm1(-x)


def _phi_asymptotic_py(x: float) -> tuple[float, float]:
    """``phi(x)`` and ``dphi/dx`` for ``x >= 128`` in Python floats: the asymptotic series of
    ``e^{-x} Ei(x)`` and of its derivative, each truncated at its smallest term (absolute error
    about ``e^{-x}``), plus the exact ``e^{-x}`` terms."""
    f_parts: list[float] = []
    d_parts: list[float] = []
    term = 1.0 / x  # k! / x^{k+1}
    k = 0
    while True:
        f_parts.append(term)
        d_parts.append(-term * (k + 1) / x)  # -(k+1)! / x^{k+2}
        k += 1
        nxt = term * k / x
        if nxt >= term or nxt < 1e-40 * f_parts[0]:
            break
        term = nxt
    f = math.fsum(f_parts)
    fprime = math.fsum(d_parts)
    em = math.exp(-x)
    log_term = math.log(x) + _EULER_GAMMA
    r = f - em * log_term
    one_m = -math.expm1(-x)
    rprime = fprime + em * log_term - em / x
    return r / one_m, rprime / one_m - r * em / (one_m * one_m)


def _chebyshev_tables() -> tuple[list[float], list[list[float]], list[list[float]]]:
    """Chebyshev coefficients of ``phi`` and ``phi'`` on ``[1,2], [2,4], ..., [2048,4096]``.

    Degree 20 on each piece: the nearest singularities of ``phi`` are the poles ``2 pi i n``
    (zeros of ``e^L - 1``), far enough from every piece that the coefficients fall below 1e-16
    (Bernstein ellipse parameter >= 6).
    """
    edges = list(_EDGES)
    n = _CHEB_DEG + 1
    cv: list[list[float]] = []
    cd: list[list[float]] = []
    for a, b in itertools.pairwise(edges):
        th = [math.pi * (j + 0.5) / n for j in range(n)]
        xs = [(a + b) / 2 + (b - a) / 2 * math.cos(t) for t in th]
        vals = [_phi_py(x) if x <= 128.0 else _phi_asymptotic_py(x) for x in xs]
        for idx, out in ((0, cv), (1, cd)):
            co = [
                2.0 / n * math.fsum(v[idx] * math.cos(k * t) for v, t in zip(vals, th, strict=True))
                for k in range(n)
            ]
            co[0] /= 2
            out.append(co)
    return edges, cv, cd


def _monomial(cheb: list[float]) -> list[float]:
    """Coefficients in ``t^j`` of ``sum_k cheb[k] T_k(t)`` (exact integer ``T_k``, ``fsum``).

    On ``[-1, 1]`` the sum of their magnitudes stays below 1.5 times ``|cheb[0]|`` for every
    piece (the Chebyshev coefficients decay like ``5.8^-k``, faster than ``T_k``'s coefficients
    grow, ``(1 + sqrt 2)^k``), so evaluating the monomial form loses nothing measurable: it
    agrees with Clenshaw's recurrence to ``1e-15`` relative.
    """
    t_polys: list[list[int]] = [[1], [0, 1]]
    for _ in range(2, len(cheb)):
        prev, cur = t_polys[-2], t_polys[-1]
        nxt = [0, *(2 * c for c in cur)]
        for j, c in enumerate(prev):
            nxt[j] -= c
        t_polys.append(nxt)
    return [
        math.fsum(cheb[k] * t_polys[k][j] for k in range(len(cheb)) if j < len(t_polys[k]))
        for j in range(len(cheb))
    ]


_CHEB_DEG = 20
_EDGES = tuple(float(2**j) for j in range(13))  # 1, 2, 4, ..., 4096
_, _CHEB_VAL, _CHEB_DER = _chebyshev_tables()
_MONO_VAL = [_monomial(c) for c in _CHEB_VAL]
_MONO_DER = [_monomial(c) for c in _CHEB_DER]
_FACT = [float(math.factorial(k)) for k in range(_N_ASYMPTOTIC + 2)]


_CONST_CACHE: dict[tuple[torch.dtype, torch.device], dict[str, torch.Tensor]] = {}


def _constants(dt: torch.dtype, dev: torch.device) -> dict[str, torch.Tensor]:
    """Coefficient tensors on ``(dt, dev)``, built once: monomial tables ``(d + 1, pieces)``."""
    key = (dt, dev)
    if key not in _CONST_CACHE:
        _CONST_CACHE[key] = {
            "mono_val": torch.tensor(_MONO_VAL, dtype=dt, device=dev).T.contiguous(),
            "mono_der": torch.tensor(_MONO_DER, dtype=dt, device=dev).T.contiguous(),
        }
    return _CONST_CACHE[key]


_TAYLOR_DER = [j * c for j, c in enumerate(_TAYLOR)][1:]


def _powers(x: torch.Tensor, m: int) -> torch.Tensor:
    """``(n, m)`` matrix ``[1, x, x^2, ..., x^{m-1}]`` by a running product (two operations)."""
    rep = x[:, None].repeat(1, m)
    rep[:, 0] = 1.0
    return rep.cumprod_(1)


def _phi_and_derivative(
    lam: torch.Tensor, derivative: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float64 ``phi(lam)`` and (optionally) ``dphi/dlam`` for float64 ``lam >= 0`` (no checks).

    ``lam <= 1``: Taylor series (Horner); ``1 < lam <= 4096``: piecewise Chebyshev (degree 20)
    of ``phi`` and of ``phi'`` (monomial form: powers of ``t`` times every piece's coefficients
    in one GEMM, then each element's piece);
    ``lam > 4096``: asymptotic series (Horner in ``1/lam``). Only the branches that some element
    needs are evaluated, each on every element (inputs clamped to its range) and selected with
    ``torch.where``: no data-dependent shapes, about two elementwise operations per series term
    and no transcendental function of a matrix (cost: a few tenths of a millisecond for 10^4
    elements on one CPU thread).
    """
    shape = lam.shape
    x = lam.reshape(-1)
    small, large = x <= _SMALL, x > _LARGE
    has_s, has_l = bool(small.any()), bool(large.any())
    mid = ~(small | large)
    has_c = bool(mid.any())
    phi = torch.zeros_like(x)
    dphi = torch.zeros_like(x) if derivative else None
    if has_s:  # --- Taylor on [0, 1]
        xs = x.clamp(0.0, _SMALL)
        phi = torch.where(small, _horner(_TAYLOR, xs), phi)
        if dphi is not None:
            dphi = torch.where(small, _horner(_TAYLOR_DER, xs), dphi)
    if has_c:  # --- Chebyshev pieces [1, 2], [2, 4], ..., [2048, 4096]
        c = _constants(x.dtype, x.device)
        xc = x.clamp(_SMALL, _LARGE)
        piece = torch.floor(torch.log2(xc)).clamp_(0, len(_EDGES) - 2)  # 0..11
        lo = torch.exp2(piece)
        t = ((2 * xc - 3 * lo) / lo).clamp_(-1.0, 1.0)  # piece [lo, 2 lo] -> [-1, 1]
        piece_i = piece.to(torch.long)[:, None]
        # every piece's polynomial at every t (one small GEMM), then each element's own piece
        pw = _powers(t, _CHEB_DEG + 1)  # (n, d + 1)
        phi = torch.where(mid, (pw @ c["mono_val"]).gather(1, piece_i)[:, 0], phi)
        if dphi is not None:
            dphi = torch.where(mid, (pw @ c["mono_der"]).gather(1, piece_i)[:, 0], dphi)
    if has_l:  # --- F = e^{-x} Ei(x) ~ sum_k k!/x^{k+1};  F' = 1/x - F ~ -sum_k (k+1)!/x^{k+2}
        xl = x.clamp_min(_LARGE)
        u = 1.0 / xl
        f = _horner(_FACT[: _N_ASYMPTOTIC + 1], u) * u
        em = torch.exp(-xl)
        log_term = torch.log(xl) + _EULER_GAMMA
        r = f - em * log_term  # e^{-x} Ein(x)
        one_m = -torch.expm1(-xl)  # 1 - e^{-x}
        phi = torch.where(large, r / one_m, phi)
        if dphi is not None:
            fprime = -_horner(_FACT[1 : _N_ASYMPTOTIC + 2], u) * u * u
            rprime = fprime + em * log_term - em * u
            dphi = torch.where(large, rprime / one_m - r * em / (one_m * one_m), dphi)
    return phi.reshape(shape), (None if dphi is None else dphi.reshape(shape))


def _check_lam(lam: torch.Tensor) -> None:
    if not isinstance(lam, torch.Tensor):
        raise TypeError(f"lam must be a torch.Tensor, got {type(lam).__name__}")
    if not lam.is_floating_point():
        raise TypeError(f"lam must be a floating-point tensor, got {lam.dtype=}")
    if bool((lam >= 0).all()) and bool(torch.isfinite(lam.sum())):
        return  # NaN fails ">= 0"; an inf entry makes the sum inf
    bad = torch.isnan(lam) | (lam < 0) | torch.isinf(lam)
    if bool(bad.any()):
        first = lam[bad].flatten()[0].item()
        raise ValueError(
            f"lam must be finite and >= 0, got {int(bad.sum())} bad entries, e.g. lam={first!r}"
        )


class _PoissonPhi(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, lam: torch.Tensor) -> torch.Tensor:
        lam64 = lam.detach().to(torch.float64)
        phi, _ = _phi_and_derivative(lam64, derivative=False)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(lam64)
        ctx.in_dtype = lam.dtype
        return phi.to(lam.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> torch.Tensor:
        (lam64,) = ctx.saved_tensors
        _, dphi = _phi_and_derivative(lam64)
        assert dphi is not None
        return (grad_out.to(torch.float64) * dphi).to(ctx.in_dtype)


def poisson_phi(lam: torch.Tensor) -> torch.Tensor:
    r"""``phi(lam) = E[1/N | N >= 1]`` for ``N ~ Poisson(lam)``, elementwise and differentiable.

    .. math::

        \phi(L) = \frac{e^{-L}\,(\mathrm{Ei}(L) - \ln L - \gamma)}{1 - e^{-L}}
                = \frac{\sum_{k\ge1} L^k/(k\,k!)}{e^L - 1},
        \qquad \phi'(L) = \frac1L - \frac{\phi(L)\,e^L}{e^L - 1}.

    ``phi(0) = 1`` (the limit), ``phi(L) ~ 1/L + 1/L^2 + 2/L^3`` for large ``L``. Computed in
    float64 on a Taylor / series / asymptotic split (see the module docstring) and returned in
    ``lam.dtype``; the backward pass uses the closed-form derivative (first order only).

    Parameters
    ----------
    lam
        ``(...)`` floating tensor of Poisson rates, finite and ``>= 0``.

    Returns
    -------
    torch.Tensor
        ``(...)`` same shape and dtype as ``lam``, values in ``(0, 1]``.

    Raises
    ------
    ValueError
        If ``lam`` holds NaN, inf or negative entries.

    Examples
    --------
    >>> import torch
    >>> from attnuq.ops import poisson_phi
    >>> poisson_phi(torch.tensor([0.0, 1.0, 10.0, 100.0], dtype=torch.float64))
    tensor([1.0000, 0.7670, 0.1130, 0.0101], dtype=torch.float64)
    """
    _check_lam(lam)
    out: torch.Tensor = _PoissonPhi.apply(lam)
    return out


def poisson_phi_derivative(lam: torch.Tensor) -> torch.Tensor:
    """``dphi/dlam`` in closed form (float64 internally, returned in ``lam.dtype``).

    Parameters
    ----------
    lam
        ``(...)`` floating tensor, finite and ``>= 0``.

    Examples
    --------
    >>> import torch
    >>> from attnuq.ops.phi import poisson_phi_derivative
    >>> float(poisson_phi_derivative(torch.tensor(0.0, dtype=torch.float64)))
    -0.25
    """
    _check_lam(lam)
    dphi = _phi_and_derivative(lam.detach().to(torch.float64))[1]
    assert dphi is not None
    return dphi.to(lam.dtype)
