"""poisson_phi: E[1/N | N >= 1] for N ~ Poisson(lam), value and closed-form derivative."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tests.attnuq.ops._reference_levy import ref_dphi, ref_phi, ref_phi_poisson_sum

from attnuq.ops import poisson_phi
from attnuq.ops.phi import poisson_phi_derivative

F64 = torch.float64


# log-spaced grid over the required range plus every branch edge (1 and 32) and its neighbours
_GRID = np.unique(
    np.concatenate(
        [
            np.logspace(-8, 6, 141),
            [0.5, 1 - 1e-12, 1.0, 1 + 1e-12, 1.5, 2.0, 31.999, 32.0, 32.0 + 1e-9, 33.0, 709.0, 710],
        ]
    )
)


def test_methods_values() -> None:
    """METHODS.md quotes phi(1) = 0.76699, phi(10) = 0.11302, phi(100) = 0.010102 (rounded)."""
    got = poisson_phi(torch.tensor([1.0, 10.0, 100.0], dtype=F64)).tolist()
    assert abs(got[0] - 0.76699) < 5e-6
    assert abs(got[1] - 0.11302) < 5e-6
    assert abs(got[2] - 0.010102) < 5e-7


def test_relative_error_vs_mpmath() -> None:
    lam = torch.tensor(_GRID, dtype=F64)
    got = poisson_phi(lam).numpy()
    ref = np.array([ref_phi(x) for x in _GRID])
    rel = np.abs(got - ref) / ref
    worst = int(np.argmax(rel))
    assert rel.max() <= 1e-10, f"worst rel. error {rel.max():.3g} at lam={_GRID[worst]}"


def test_relative_error_vs_direct_poisson_sum() -> None:
    grid = np.logspace(-3, 3, 25)
    got = poisson_phi(torch.tensor(grid, dtype=F64)).numpy()
    ref = np.array([ref_phi_poisson_sum(x) for x in grid])
    rel = np.abs(got - ref) / ref
    assert rel.max() <= 1e-10, f"worst rel. error {rel.max():.3g}"


def test_limits_and_asymptotics() -> None:
    assert poisson_phi(torch.tensor(0.0, dtype=F64)).item() == 1.0
    assert poisson_phi_derivative(torch.tensor(0.0, dtype=F64)).item() == pytest.approx(
        -0.25, rel=1e-15
    )
    # phi ~ 1/L + 1/L^2 + 2/L^3 + 6/L^4: with L = 1e4 the next term is 6e-16 relative
    L = 1e4
    got = poisson_phi(torch.tensor(L, dtype=F64)).item()
    assert got == pytest.approx(1 / L + 1 / L**2 + 2 / L**3, rel=1e-11)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_no_nan_or_inf_and_float32_accuracy(dtype: torch.dtype) -> None:
    lam64 = torch.cat([torch.tensor([0.0]), torch.logspace(-8, 6, 2001)]).to(F64)
    lam = lam64.to(dtype).requires_grad_(True)
    out = poisson_phi(lam)
    out.sum().backward()
    assert out.dtype == dtype and lam.grad is not None
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lam.grad).all())
    assert bool(((out > 0) & (out <= 1)).all())
    # the float32 result is the float64 value of the rounded input, rounded once
    ref = poisson_phi(lam.detach().to(F64))
    rel = ((out.detach().to(F64) - ref).abs() / ref).max().item()
    assert rel <= (6e-8 if dtype == torch.float32 else 1e-15)


def test_derivative_formula_vs_mpmath() -> None:
    """Closed form dphi/dL = 1/L - phi e^L / (e^L - 1), evaluated stably, vs mpmath."""
    lam = torch.tensor(_GRID, dtype=F64)
    got = poisson_phi_derivative(lam).numpy()
    ref = np.array([ref_dphi(x) for x in _GRID])
    rel = np.abs(got - ref) / np.abs(ref)
    worst = int(np.argmax(rel))
    assert rel.max() <= 1e-10, f"worst rel. error {rel.max():.3g} at lam={_GRID[worst]}"


def test_derivative_vs_finite_differences() -> None:
    """Central differences with step 1e-4 L (5e-9 below the first grid point): O(step^2) error."""
    grid = np.logspace(-8, 6, 57)
    lam = torch.tensor(grid, dtype=F64, requires_grad=True)
    poisson_phi(lam).sum().backward()
    assert lam.grad is not None
    step = torch.tensor(np.maximum(grid * 1e-4, 5e-9), dtype=F64)
    with torch.no_grad():
        fd = (poisson_phi(lam + step) - poisson_phi(lam - step)) / (2 * step)
    rel = ((lam.grad - fd).abs() / fd.abs()).max().item()
    assert rel <= 1e-6, f"worst rel. difference {rel:.3g}"


def test_gradcheck_float64() -> None:
    lam = torch.tensor(
        [1e-5, 0.3, 0.999, 1.001, 7.0, 31.9, 32.1, 300.0, 1e5], dtype=F64, requires_grad=True
    )
    assert torch.autograd.gradcheck(poisson_phi, (lam,), eps=1e-6, atol=1e-9, rtol=1e-6)


@pytest.mark.parametrize(
    ("lam", "exc", "match"),
    [
        (torch.tensor([1.0, -0.5]), ValueError, "lam"),
        (torch.tensor([math.nan]), ValueError, "lam"),
        (torch.tensor([math.inf]), ValueError, "lam"),
        (torch.tensor([1, 2]), TypeError, "lam"),
    ],
)
def test_bad_input(lam: torch.Tensor, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        poisson_phi(lam)


def test_relative_error_at_dyadic_pieces_and_asymptotic_edge() -> None:
    """Every Chebyshev piece [2^j, 2^{j+1}] up to 4096 and both sides of the asymptotic edge."""
    pts = sorted({x * f for x in [2.0**j for j in range(13)] for f in (1 - 1e-12, 1.0, 1 + 1e-12)}
                 | {1.5 * 2.0**j for j in range(12)} | {4096.5, 5000.0, 1e4})
    lam = torch.tensor(pts, dtype=F64)
    got, dgot = poisson_phi(lam).numpy(), poisson_phi_derivative(lam).numpy()
    ref = np.array([ref_phi(x) for x in pts])
    dref = np.array([ref_dphi(x) for x in pts])
    assert (np.abs(got - ref) / ref).max() <= 1e-12
    assert (np.abs(dgot - dref) / np.abs(dref)).max() <= 1e-10
