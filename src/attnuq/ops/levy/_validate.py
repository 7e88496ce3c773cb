"""Input checks of the Levy operators: one call of :func:`_validate` per public call.

The usual case costs one host synchronisation (:func:`_fast_inputs`: finite sums prove every
entry finite); anything unusual takes the detailed checks, which raise with a message naming
the argument, or zero masked rows that hold non-finite values (they get weight 0 anyway).
"""

from __future__ import annotations

import math
import numbers

import torch

from attnuq.ops.levy._types import _Args, _Inputs


def _per_head(x: float | torch.Tensor, heads: int, ref: torch.Tensor, name: str = "value"
              ) -> torch.Tensor:
    """``x`` as a tensor of ``ref``'s dtype/device, a scalar expanded to ``(heads,)`` (any other
    shape is left for the caller to reject; a non-number is refused naming ``name``)."""
    if isinstance(x, bool) or not isinstance(x, (numbers.Real, torch.Tensor)):
        raise TypeError(f"{name} must be a float or a tensor, got {name}={x!r}")
    t = torch.as_tensor(x, dtype=ref.dtype, device=ref.device)
    return t.expand(heads) if t.dim() == 0 else t


def _head_param(
    x: float | torch.Tensor, name: str, heads: int, ref: torch.Tensor, *, strict: bool
) -> torch.Tensor:
    """Return ``x`` as a ``(H,)`` tensor of ``ref``'s dtype/device after range checks."""
    t = _per_head(x, heads, ref, name)
    if t.shape != (heads,):
        raise ValueError(f"{name} must be a scalar or have shape ({heads},), got {tuple(t.shape)}")
    bad = ~torch.isfinite(t) | ((t <= 0) if strict else (t < 0))
    if bool(bad.any()):
        rel = "> 0" if strict else ">= 0"
        raise ValueError(f"{name} must be finite and {rel}, got {name}={t.detach().tolist()}")
    return t


def _fourier(
    omega: torch.Tensor, phase: torch.Tensor, D: torch.Tensor, heads: int, dv: int,
    ref: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``omega``, ``phase`` as ``(1, K)`` when both are shared 1-D (the time features are then
    computed once for all heads), else ``(H, K)``, and ``D`` as ``(H, Dv, K)``, in ``ref``'s
    dtype; ``None`` where the shapes do not fit."""
    if omega.dim() not in (1, 2) or phase.dim() not in (1, 2) or D.dim() not in (2, 3):
        return None
    om, ph, dd = omega.to(ref.dtype), phase.to(ref.dtype), D.to(ref.dtype)
    hw = 1 if (om.dim() == 1 and ph.dim() == 1) else heads
    om = om[None].expand(hw, -1) if om.dim() == 1 else om
    ph = ph[None].expand(hw, -1) if ph.dim() == 1 else ph
    dd = dd.expand(heads, -1, -1) if dd.dim() == 2 else dd
    K = om.shape[-1]
    if om.shape != (hw, K) or ph.shape != (hw, K) or dd.shape != (heads, dv, K):
        return None
    return om, ph, dd


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


def _fast_inputs(args: _Args, light: bool = False) -> _Inputs | None:
    """The validated inputs when everything is in order, checked with one host sync; else None.

    In order means: every entry of ``times``, ``k``, ``q``, ``omega``, ``phase``, ``D`` finite
    (their sums are), ``|a| <= finfo.max ** (1/4)`` (so ``a`` is finite and its masked rows stay
    finite through the operator), ``alpha, beta > 0``, ``h >= 0`` and consistent shapes. The
    inputs are then used as given, exactly as :func:`_validate`'s detailed path would use them.
    With ``light`` the checks of ``q``, ``k`` and ``a`` are left to the caller (the compiled
    kernel checks the rows it reads, see :func:`_native_forward`).
    """
    q, k, a, times, mask, alpha, beta, h, omega, phase, D = args
    H = q.shape[1]
    pars = [_per_head(x, H, q, n) for x, n in ((alpha, "alpha"), (beta, "beta"), (h, "h"))]
    if any(t.shape != (H,) for t in pars):
        return None
    om = ph = dd = None
    if omega is not None or phase is not None or D is not None:
        if omega is None or phase is None or D is None:
            return None
        fourier = _fourier(omega, phase, D, H, a.shape[3], q)
        if fourier is None:
            return None
        om, ph, dd = fourier
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


def _validate(args: _Args, light: bool = False) -> _Inputs:
    """The checked inputs of one Levy call (see the module docstring); raises ``TypeError`` or
    ``ValueError`` naming the argument. With ``light`` the finiteness of ``q``, ``k`` and ``a``
    is left to the caller when everything else is in order (:func:`_fast_inputs`)."""
    q, k, a, times, mask, alpha, beta, h, omega, phase, D = args
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
    fast = _fast_inputs(args, light)
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
        fourier = _fourier(omega, phase, D, H, a.shape[3], q)
        if fourier is None:
            raise ValueError(
                "omega, phase must be (K,) or (H, K) and D (Dv, K) or (H, Dv, K), got "
                f"omega.shape={tuple(omega.shape)}, phase.shape={tuple(phase.shape)}, "
                f"D.shape={tuple(D.shape)} with H={H}, Dv={a.shape[3]}"
            )
        om, ph, dd = fourier
        for t, n in ((om, "omega"), (ph, "phase"), (dd, "D")):
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{n} contains non-finite values")
    return _Inputs(q, k, a, times, mask, al, be, hh, om, ph, dd)


def _pad_one_masked(inp: _Inputs) -> _Inputs:
    """``N = 0`` inputs with one masked (ignored) observation appended, so that every path sees
    an ordinary empty series (masked entries add exact zeros)."""
    q, k, a, times, mask = inp.q, inp.k, inp.a, inp.times, inp.mask
    B, H = q.shape[:2]
    k1 = torch.zeros(B, H, 1, k.shape[3], dtype=k.dtype, device=k.device)
    a1 = torch.zeros(B, H, 1, a.shape[3], dtype=a.dtype, device=a.device)
    t1, m1 = times.new_zeros(B, 1), mask.new_zeros(B, 1)
    return inp._replace(k=torch.cat([k, k1], 2), a=torch.cat([a, a1], 2),
                        times=torch.cat([times, t1], 1), mask=torch.cat([mask, m1], 1))
