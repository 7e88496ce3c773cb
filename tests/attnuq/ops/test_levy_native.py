"""The compiled Levy-attention forward (``csrc/levy.c`` through ``attnuq.ops._native``).

It must give the numbers of the torch paths to rounding (float64: 1e-12), cover every input the
functional API accepts without autograd (shared or per-head frequencies, any head and value
width, long series, empty series), split the batch over threads without changing a bit, hand
non-finite inputs to the detailed checks, and be what ``backend="auto"`` runs for float32 on CPU.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from tests.attnuq.ops.test_levy import FIELDS, make_problem

from attnuq.nn import LevyAttention
from attnuq.ops import LevyResult, _native, levy_attention, poisson_phi

pytestmark = pytest.mark.skipif(
    not _native.available(),
    reason=f"native kernels unavailable: {_native.status()['reason']}",
)

F64 = torch.float64


def _close(r: LevyResult, s: LevyResult, rtol: float, atol: float) -> None:
    for f in FIELDS:
        x, y = getattr(r, f), getattr(s, f)
        assert (x is None) == (y is None), f
        if x is not None:
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=f)


def _shared(kw: dict[str, Any]) -> dict[str, Any]:
    """The same problem with frequencies and phases shared by the heads (the module's case)."""
    return dict(kw, omega=kw["omega"][0], phase=kw["phase"][0])


@pytest.mark.parametrize("per_dim", [True, False])
@pytest.mark.parametrize("field", ["per-head", "shared", "none"])
@pytest.mark.parametrize(("E", "Dv"), [(4, 3), (16, 16), (9, 11), (1, 1)])
def test_matches_explicit_float64(per_dim: bool, field: str, E: int, Dv: int) -> None:
    args, kw = make_problem(B=3, H=2, Q=7, N=37, E=E, Dv=Dv, K=5, fourier=field != "none")
    if field == "shared":
        kw = _shared(kw)
    kw["per_dim"] = per_dim
    r = levy_attention(*args, **kw, backend="native")
    _close(r, levy_attention(*args, **kw, backend="explicit"), rtol=1e-12, atol=1e-13)


def test_within_atom_variance_branches() -> None:
    """Bandwidths on both sides of |u| = |omega_k omega_l h^2| = 1 (sinh form / exp form)."""
    args, kw = make_problem(B=2, H=3, Q=5, N=20, K=6, seed=3)
    kw["h"] = torch.tensor([0.05, 0.5, 3.0], dtype=F64)
    u = (kw["omega"][:, :, None] * kw["omega"][:, None, :] * kw["h"][:, None, None] ** 2).abs()
    assert bool((u < 1).any()) and bool((u >= 1).any())
    r = levy_attention(*args, **kw, backend="native")
    _close(r, levy_attention(*args, **kw, backend="explicit"), rtol=1e-12, atol=1e-13)


def test_long_series_and_query_tiles() -> None:
    """N = 1500 observations (query tiles of 8 rows) and Q = 37 (a tile not a multiple of 4)."""
    args, kw = make_problem(B=2, H=2, Q=37, N=1500, E=6, Dv=5, K=3, seed=7, p_obs=0.6)
    r = levy_attention(*args, **kw, backend="native")
    _close(r, levy_attention(*args, **kw, backend="explicit"), rtol=1e-11, atol=1e-12)


def test_auto_choice_and_output_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 and float64 without autograd run the kernel under backend="auto" (float32 agrees
    with the torch path to its rounding); the outputs are (B, H, Q, ...) views of (B, Q, H, ...)
    memory; autograd and other dtypes keep the torch paths."""
    args, kw = make_problem(B=2, H=3, Q=6, N=50, E=8, Dv=4, K=3, dtype=torch.float32, seed=2)
    kw = {key: v.float() for key, v in _shared(kw).items()}
    calls = []
    real = _native.levy_forward

    def spy(*a: Any, **k: Any) -> Any:
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(_native, "levy_forward", spy)
    with torch.no_grad():
        r = levy_attention(*args, **kw)
    assert calls, "backend='auto' did not use the kernel for float32"
    assert r.mean.shape == (2, 3, 6, 4) and r.mean.transpose(1, 2).is_contiguous()
    ref = levy_attention(*args, **kw, backend="explicit")
    _close(r, ref, rtol=2e-5, atol=2e-6)
    calls.clear()
    args64 = tuple(x.double() if x.is_floating_point() else x for x in args)
    levy_attention(*args64, **{key: v.double() for key, v in kw.items()})
    assert len(calls) == 1, "backend='auto' did not use the kernel for float64"
    # autograd, and dtypes the kernel does not take, keep the torch paths
    calls.clear()
    leaves = [x.clone().requires_grad_(True) for x in args[:3]]
    levy_attention(*leaves, *args[3:], **kw).sigma.sum().backward()
    argsb = tuple(x.bfloat16() if x.is_floating_point() else x for x in args)
    rb = levy_attention(*argsb, **{key: v.bfloat16() for key, v in kw.items()})
    assert rb.mean.dtype == torch.bfloat16
    assert not calls


@pytest.mark.parametrize("openmp", [True, False])
def test_threads_do_not_change_a_bit(monkeypatch: pytest.MonkeyPatch, openmp: bool) -> None:
    """Batch elements split over 2 threads (OpenMP, or Python threads when the kernel has no
    OpenMP) give the same bits as one thread."""
    args, kw = make_problem(B=5, H=2, Q=9, N=120, E=8, Dv=6, K=4, seed=11)
    one = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        r1 = levy_attention(*args, **kw, backend="native")
        monkeypatch.setattr(_native, "_has_openmp", lambda lib: openmp)
        monkeypatch.setattr(_native, "_MIN_ELEMS_PER_THREAD", 1)
        torch.set_num_threads(2)
        r2 = levy_attention(*args, **kw, backend="native")
    finally:
        torch.set_num_threads(one)
    for f in FIELDS:
        assert torch.equal(getattr(r1, f), getattr(r2, f)), f


def test_empty_series_and_no_observations_at_all() -> None:
    args, kw = make_problem(B=3, N=9)
    q, k, a, times, mask = args
    mask = mask.clone()
    mask[1] = False
    r = levy_attention(q, k, a, times, mask, **kw, backend="native")
    _close(r, levy_attention(q, k, a, times, mask, **kw, backend="explicit"), 1e-12, 1e-13)
    assert bool((r.evidence[1] == 0).all()) and bool((r.p_empty[1] == 1).all())
    assert bool((r.phi[1] == 1).all()) and bool((r.sigma[1] == 0).all())
    assert bool((r.mean[1] == 0).all()) and bool((r.var[1] == 0).all())
    # N = 0: every series empty
    r0 = levy_attention(q, k[:, :, :0], a[:, :, :0], times[:, :0], mask[:, :0], **kw,
                        backend="native")
    assert bool((r0.evidence == 0).all()) and bool((r0.mean == 0).all())
    assert bool((r0.p_empty == 1).all()) and bool((r0.sigma == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize(("name", "match"), [("k", "k contains"), ("a", "a contains"),
                                             ("q", "q contains")])
def test_non_finite_observed_values_are_reported(dtype: torch.dtype, name: str,
                                                 match: str) -> None:
    args, kw = make_problem(N=9, dtype=dtype)
    kw = {key: v.to(dtype) for key, v in kw.items()}
    q, k, a, times, mask = (x.clone() for x in args)
    t = {"q": q, "k": k, "a": a}[name]
    t[0, 1, 0, 0] = math.nan  # entry 0 is observed
    with pytest.raises(ValueError, match=match):
        levy_attention(q, k, a, times, mask, **kw, backend="native")
    # the same value in a masked row is ignored
    if name != "q":
        m = mask.clone()
        m[0, 0] = False
        r = levy_attention(q, k, a, times, m, **kw, backend="native")
        assert all(bool(torch.isfinite(getattr(r, f)).all()) for f in FIELDS)


def test_overflowing_squares_fall_back_to_the_torch_path() -> None:
    """Finite values whose squares overflow pass the detailed checks; the torch path then runs
    and the result is exactly the explicit backend's."""
    args, kw = make_problem(N=9, dtype=torch.float32)
    kw = {key: v.float() for key, v in kw.items()}
    q, k, a, times, mask = (x.clone() for x in args)
    a[0, 0, 0, 0] = 1e20  # (1e20)^2 overflows float32
    with torch.no_grad():
        r = levy_attention(q, k, a, times, mask, **kw)
        s = levy_attention(q, k, a, times, mask, **kw, backend="explicit")
    for f in FIELDS:
        torch.testing.assert_close(getattr(r, f), getattr(s, f), rtol=0, atol=0, equal_nan=True)


def test_refuses_what_it_cannot_run() -> None:
    args, kw = make_problem()
    leaves = [x.clone().requires_grad_(True) for x in args[:3]]
    with pytest.raises(ValueError, match="autograd"):
        levy_attention(*leaves, *args[3:], **kw, backend="native")
    with _native.disabled(), pytest.raises(ValueError, match="unavailable"):
        levy_attention(*args, **kw, backend="native")
    with pytest.raises(ValueError, match="float32 or float64"):
        levy_attention(*(x.half() if x.is_floating_point() else x for x in args),
                       **{key: v.half() for key, v in kw.items()}, backend="native")


def test_levy_forward_rejects_bad_buffers() -> None:
    q, k, a = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 3)
    mask = torch.ones(1, 5, dtype=torch.bool)
    al = be = torch.ones(2)
    with pytest.raises(ValueError, match="levy_forward needs"):
        _native.levy_forward(q, k.double(), a, mask, al, be, None, True)
    with pytest.raises(ValueError, match="levy_forward needs"):
        _native.levy_forward(q.transpose(2, 3).contiguous().transpose(2, 3), k, a, mask, al, be,
                             None, True)
    bad_field = (torch.ones(1, 2, 5), torch.ones(1, 2, 5), torch.ones(1, 2), torch.ones(2, 3, 3),
                 torch.ones(2))
    with pytest.raises(ValueError, match="levy_forward needs"):
        _native.levy_forward(q, k, a, mask, al, be, bad_field, True)


def test_kernel_phi_matches_poisson_phi() -> None:
    """The kernel's phi (the tables of attnuq.ops.phi, Horner form) against poisson_phi."""
    edges = torch.tensor([2.0**j for j in range(13)], dtype=F64)
    x = torch.cat([
        torch.tensor([0.0, 1e-300, 1e-8], dtype=F64),
        torch.logspace(-8, 6, 3001, dtype=F64),
        edges, edges * (1 + 1e-15), edges * (1 - 1e-15),
    ])
    torch.testing.assert_close(_native.phi(x), poisson_phi(x), rtol=2e-15, atol=0)


def test_module_float32_matches_the_torch_path() -> None:
    """LevyAttention in float32 eval mode (kernel) against the same layer on the torch path."""
    torch.manual_seed(0)
    B, N, Q, C = 3, 40, 6, 5
    x = {"times": torch.rand(B, N) * 24, "channels": torch.randint(0, C, (B, N)),
         "values": torch.randn(B, N), "mask": torch.rand(B, N) > 0.3,
         "query_times": torch.rand(B, Q) * 24 + 24}
    for out_features, per_dim in ((None, True), (None, False), (2, True)):
        layer = LevyAttention(C, 16, 4, out_features=out_features, per_dim=per_dim).eval()
        with torch.no_grad():
            got = layer(**x)
            with _native.disabled():
                want = layer(**x)
        for f in ("mean", "sigma", "sigma_dim", "evidence", "p_empty"):
            g, w = getattr(got, f), getattr(want, f)
            assert (g is None) == (w is None), f
            if g is not None:
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=f)


def test_random_shapes_against_explicit() -> None:
    """40 seeded random problems (B, H, Q, N, E, Dv, K, observed fraction, per-head or shared
    frequencies, per_dim, beta up to 40): the kernel against the explicit path, float64."""
    g = torch.Generator().manual_seed(123)

    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    for case in range(40):
        B, H, Q, N = draw(1, 4), draw(1, 5), draw(1, 19), draw(0, 70)
        E, Dv, K = draw(1, 20), draw(1, 20), draw(0, 6)
        p_obs = float(torch.rand(1, generator=g)) * 0.9 + 0.05
        args, kw = make_problem(B=B, H=H, Q=Q, N=max(N, 1), E=E, Dv=Dv, K=max(K, 1),
                                fourier=K > 0, seed=1000 + case, p_obs=p_obs)
        q, k, a, times, mask = args
        if N == 0:
            k, a, times, mask = k[:, :, :0], a[:, :, :0], times[:, :0], mask[:, :0]
        elif draw(0, 3) == 0:
            mask = torch.zeros_like(mask)  # every series empty
        if K > 0 and draw(0, 1):
            kw = _shared(kw)
        kw["beta"] = kw["beta"] * (1 + 12 * float(torch.rand(1, generator=g)))
        kw["per_dim"] = bool(draw(0, 1))
        r = levy_attention(q, k, a, times, mask, **kw, backend="native")
        s = levy_attention(q, k, a, times, mask, **kw, backend="explicit")
        _close(r, s, rtol=1e-11, atol=1e-12)
