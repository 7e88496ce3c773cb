"""levy_attention: closed form vs loop reference, explicit Poisson sampler, invariances, limits."""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import numpy as np
import pytest
import torch
from tests.attnuq.ops._reference_levy import ref_cosine_softmax, ref_levy, ref_phi

from attnuq.ops import LevyResult, _native, levy_attention, levy_attention_sample
from attnuq.ops import levy as levy_mod

F64 = torch.float64
FIELDS = ("mean", "var", "evidence", "p_empty", "phi", "sigma", "sigma_dim")


@pytest.fixture(autouse=True)
def _skip_native_without_kernel(request: pytest.FixtureRequest) -> None:
    """Cases of backend="native" skip, with the reason, where the kernel cannot be built."""
    cs = getattr(request.node, "callspec", None)
    if cs is not None and cs.params.get("backend") == "native" and not _native.available():
        pytest.skip(f"native kernels unavailable: {_native.status()['reason']}")


def make_problem(
    B: int = 2,
    H: int = 2,
    Q: int = 3,
    N: int = 7,
    E: int = 4,
    Dv: int = 3,
    K: int = 4,
    *,
    fourier: bool = True,
    dtype: torch.dtype = F64,
    seed: int = 0,
    p_obs: float = 0.75,
) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Q, E, generator=g, dtype=dtype)
    k = torch.randn(B, H, N, E, generator=g, dtype=dtype)
    a = torch.randn(B, H, N, Dv, generator=g, dtype=dtype)
    times = torch.rand(B, N, generator=g, dtype=dtype) * 6 - 1  # some negative, unsorted
    mask = torch.rand(B, N, generator=g) < p_obs
    mask[:, 0] = True
    kw: dict[str, Any] = {
        "alpha": torch.linspace(0.7, 1.9, H, dtype=dtype),
        "beta": torch.linspace(1.5, 3.0, H, dtype=dtype),
        "h": torch.linspace(0.2, 0.6, H, dtype=dtype),
    }
    if fourier:
        kw["omega"] = torch.rand(H, K, generator=g, dtype=dtype) * 3
        kw["phase"] = torch.rand(H, K, generator=g, dtype=dtype) * 2 * math.pi
        kw["D"] = torch.randn(H, Dv, K, generator=g, dtype=dtype)
    return (q, k, a, times, mask), kw


def assert_result_close(r: LevyResult, s: LevyResult, atol: float, rtol: float = 0.0) -> None:
    for f in FIELDS:
        torch.testing.assert_close(getattr(r, f), getattr(s, f), atol=atol, rtol=rtol, msg=f)


# ------------------------------------------------------------------------ closed form


@pytest.mark.parametrize("backend", ["native", "sdpa", "explicit"])
@pytest.mark.parametrize("fourier", [True, False])
def test_matches_loop_reference(fourier: bool, backend: str) -> None:
    args, kw = make_problem(fourier=fourier)
    r = levy_attention(*args, **kw, backend=backend)
    ref = ref_levy(*args, **kw)
    np.testing.assert_allclose(r.evidence.numpy(), ref["evidence"], rtol=1e-12, atol=0)
    np.testing.assert_allclose(r.mean.numpy(), ref["mean"], rtol=0, atol=1e-11)
    var_ref = np.diagonal(ref["cov"], axis1=-2, axis2=-1)
    np.testing.assert_allclose(r.var.numpy(), var_ref, rtol=0, atol=1e-11)
    phi = np.array([ref_phi(x) for x in ref["evidence"].ravel()]).reshape(ref["evidence"].shape)
    np.testing.assert_allclose(r.phi.numpy(), phi, rtol=1e-12)
    np.testing.assert_allclose(
        r.sigma.numpy(), np.sqrt(np.trace(ref["cov"], axis1=-2, axis2=-1) * phi), atol=1e-11
    )
    np.testing.assert_allclose(r.sigma_dim.numpy(), np.sqrt(var_ref * phi[..., None]), atol=1e-11)
    torch.testing.assert_close(r.p_empty, torch.exp(-r.evidence), rtol=0, atol=0)


def test_shapes_and_scalar_parameters() -> None:
    args, kw = make_problem(B=3, H=4, Q=5, N=6, Dv=2, K=3)
    kw.update(alpha=1.3, beta=2.0, h=0.4, omega=kw["omega"][0], phase=kw["phase"][0], D=kw["D"][0])
    r = levy_attention(*args, **kw)
    assert r.mean.shape == r.var.shape == r.sigma_dim.shape == (3, 4, 5, 2)
    for f in ("evidence", "p_empty", "phi", "sigma"):
        assert getattr(r, f).shape == (3, 4, 5)
    ref = ref_levy(*args, **kw)
    np.testing.assert_allclose(r.mean.numpy(), ref["mean"], atol=1e-11)


# ------------------------------------------------------------------------ explicit sampler

# Each setting: (alpha, beta, description). Per setting we compare, over the draws with N >= 1,
# the empirical mean per value dimension with `mean`, the empirical E|Y - mu|^2 with
# tr Sigma_V * phi(Lambda), the fraction of empty draws with p_empty and the mean atom count with
# Lambda. Each comparison is a z-test with the standard error estimated from the same draws,
# |z| <= 5: two-sided false-failure probability 5.7e-7 per comparison; with at most
# 3 settings x 2 heads x (2 + 1 + 1 + 1) = 30 comparisons the suite fails by chance with
# probability below 2e-5 (seeds are fixed, so a given run is deterministic). The Lambda > 50
# setting uses one head only (1e5 draws x ~55 atoms is the cost driver).
_MC_SETTINGS = [(0.06, 1.0, "Lambda < 0.5"), (1.0, 0.5, "Lambda ~ 2-4"), (14.0, 0.3, "Lambda > 50")]


@pytest.mark.slow
@pytest.mark.parametrize(("alpha", "beta", "label"), _MC_SETTINGS)
def test_sampler_matches_closed_form(alpha: float, beta: float, label: str) -> None:
    S, Z = 100_000, 5.0
    H = 1 if label == "Lambda > 50" else 2
    args, kw = make_problem(B=1, H=H, Q=1, N=5, E=3, Dv=2, K=3, seed=3, p_obs=1.0)
    kw.update(alpha=alpha, beta=beta)
    r = levy_attention(*args, **kw)
    lam = r.evidence.flatten()
    if label == "Lambda < 0.5":
        assert bool((lam < 0.5).all()), lam
    if label == "Lambda > 50":
        assert bool((lam > 50).all()), lam
    smp = levy_attention_sample(
        *args, **kw, num_samples=S, generator=torch.Generator().manual_seed(11)
    )
    assert smp.values.shape == (S, 1, H, 1, 2)
    for hd in range(H):
        cnt = smp.counts[:, 0, hd, 0].to(F64)
        ne = smp.nonempty[:, 0, hd, 0]
        lam_h = r.evidence[0, hd, 0]
        # atom count ~ Poisson(Lambda): mean Lambda, standard error sqrt(Lambda / S)
        assert abs(cnt.mean() - lam_h) <= Z * math.sqrt(lam_h / S)
        # empty draws ~ Binomial(S, p_empty)
        pe = r.p_empty[0, hd, 0]
        assert abs((~ne).to(F64).mean() - pe) <= Z * math.sqrt(pe * (1 - pe) / S) + 1e-12
        y = smp.values[ne, 0, hd, 0]  # (n, Dv)
        n = y.shape[0]
        mu = r.mean[0, hd, 0]
        z_mean = (y.mean(0) - mu) / (y.std(0) / math.sqrt(n))
        assert bool((z_mean.abs() <= Z).all()), (label, hd, z_mean)
        d2 = ((y - mu) ** 2).sum(-1)
        target = r.var[0, hd, 0].sum() * r.phi[0, hd, 0]
        z_var = (d2.mean() - target) / (d2.std() / math.sqrt(n))
        assert abs(z_var) <= Z, (label, hd, float(z_var), float(d2.mean()), float(target))


def test_sampler_empty_series_and_shapes() -> None:
    args, kw = make_problem(B=2, H=2, Q=2, N=4, Dv=2, K=3)
    q, k, a, times, mask = args
    mask = mask.clone()
    mask[1] = False
    smp = levy_attention_sample(q, k, a, times, mask, **kw, num_samples=50)
    assert smp.values.shape == (50, 2, 2, 2, 2)
    assert bool((smp.counts[:, 1] == 0).all()) and not bool(smp.nonempty[:, 1].any())
    assert bool((smp.values[:, 1] == 0).all())


def test_sampler_refuses_a_draw_larger_than_its_atom_budget() -> None:
    """Huge evidence (alpha = 1e7) would need ~1e7 atoms in one draw: a clear error naming the
    count and the budget instead of an attempt to allocate them."""
    args, kw = make_problem(B=1, H=1, Q=2, N=4, Dv=2, K=0)
    kw = {**kw, "alpha": torch.full_like(torch.as_tensor(kw["alpha"]), 1e7)}
    with pytest.raises(ValueError, match=r"one draw holds \d+ atoms .*max_atoms_per_chunk=1000"):
        levy_attention_sample(*args, **kw, num_samples=2, max_atoms_per_chunk=1000)


# ------------------------------------------------------------------------ gradients


@pytest.mark.parametrize("backend", ["sdpa", "sdpa-sentinel", "explicit"])
def test_gradcheck_mean_and_sigma(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """gradcheck (float64, full Jacobians) of mean and sigma w.r.t. every input and parameter.

    ``sdpa`` on CPU is the flash kernel with the hand-derived backward (:class:`_FlashBlock`);
    ``sdpa-sentinel`` is the sentinel-key path that runs where the flash backward is missing
    (and on CUDA), forced here by hiding the flash backward."""
    if backend == "sdpa-sentinel":
        monkeypatch.setattr(levy_mod, "_FLASH_BWD", None)
        backend = "sdpa"
    args, kw = make_problem(B=1, H=2, Q=2, N=3, E=2, Dv=2, K=2)
    q, k, a, times, mask = args
    mask = torch.tensor([[True, False, True]])
    names = ["q", "k", "a", "times", "alpha", "beta", "h", "omega", "phase", "D"]
    leaves = [q, k, a, times, kw["alpha"], kw["beta"], kw["h"], kw["omega"], kw["phase"], kw["D"]]
    leaves = [x.clone().requires_grad_(True) for x in leaves]

    def f(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        d = dict(zip(names, xs, strict=True))
        r = levy_attention(
            d["q"], d["k"], d["a"], d["times"], mask,
            alpha=d["alpha"], beta=d["beta"], h=d["h"], omega=d["omega"], phase=d["phase"],
            D=d["D"], backend=backend,
        )
        return r.mean, r.sigma

    assert torch.autograd.gradcheck(f, tuple(leaves), eps=1e-6, atol=1e-7, rtol=1e-5)



@pytest.mark.parametrize("loops", ["compiled", "torch"])
@pytest.mark.parametrize("per_dim", [True, False])
@pytest.mark.parametrize("within", [True, False])
@pytest.mark.parametrize("trace_loss", [False, True])
def test_flash_block_gradcheck(per_dim: bool, within: bool, trace_loss: bool, loops: str) -> None:
    """The hand-derived backward of the CPU training path's block (query and key
    normalisation, the queries' scale ``beta``, centred values, flash attention with its
    log-sum-exp; one flash backward call) against finite differences: gradcheck in float64,
    full Jacobians of ``out`` and ``lse`` w.r.t. every differentiable input, masked keys
    (additive -1e4) included, for the compiled row loops (csrc/levy_train.c) and the torch ones
    (``_native.disabled()``, as without a compiler). ``trace_loss``: the outputs read the
    second-moment columns only through their sum, so the incoming gradient is the same on each
    of them and the backward takes its narrow ``[vc, tr sq]`` path. (A fully masked series is
    left out here: its scores sit near -1e4, where central differences lose about
    1e-4 * 2^-52 / eps ~ 2e-6 to rounding; the operator multiplies that block by z > 0 = 0
    anyway, see test_gradients_finite_with_empty_series_and_large_beta.)"""
    if levy_mod._FLASH is None or levy_mod._FLASH_BWD is None:
        pytest.fail("this torch build lacks the CPU flash-attention kernels the path needs")
    if loops == "compiled" and not _native.available():
        pytest.skip(f"native kernels unavailable: {_native.status()['reason']}")
    g = torch.Generator().manual_seed(3)
    B, H, Q, N, E, dv = 2, 2, 3, 5, 4, 3
    ws = dv if per_dim else 1
    q = torch.randn(B, H, Q, E, generator=g, dtype=F64)
    beta = torch.tensor([1.5, 2.5], dtype=F64)
    k = torch.randn(B, H, N, E, generator=g, dtype=F64)
    vbar = torch.randn(B, H, N, dv, generator=g, dtype=F64)
    s = torch.rand(B, H, N, ws, generator=g, dtype=F64) if within else None
    ref = torch.randn(B, H, 1, dv, generator=g, dtype=F64)
    mask = torch.tensor([[True, False, True, True, False], [False, False, True, False, False]])
    bias = torch.where(mask, 0.0, -1e4).to(F64)[:, None, None, :]
    leaves = [t.clone().requires_grad_(True) for t in (q, beta, k, vbar, ref)]
    sl = None if s is None else s.clone().requires_grad_(True)

    def f(q_: torch.Tensor, b_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor,
          r_: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = levy_mod._FlashBlock.apply(q_, b_, k_, v_, rest[0] if rest else None, r_,
                                              bias, per_dim)
        if trace_loss:
            return torch.cat([out[..., :dv], out[..., dv : dv + ws].sum(-1, keepdim=True)],
                             -1), lse
        return out, lse

    inputs = (*leaves, *([] if sl is None else [sl]))
    ctx = _native.disabled() if loops == "torch" else contextlib.nullcontext()
    with ctx:
        assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)
        # the forward is the plain definition (one softmax over the observed keys)
        with torch.no_grad():
            out, lse = levy_mod._FlashBlock.apply(*inputs[:4], sl, inputs[4], bias, per_dim)
    qa = beta[:, None, None] * q / q.norm(dim=-1, keepdim=True)
    kn = k / k.norm(dim=-1, keepdim=True)
    sc = qa @ kn.transpose(-1, -2) + bias
    vc = vbar - ref
    sq = vc * vc if per_dim else (vc * vc).sum(-1, keepdim=True)
    sq = sq if s is None else sq + s
    v = torch.cat([vc, sq], -1)
    torch.testing.assert_close(lse, torch.logsumexp(sc, -1), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(out[..., : dv + ws], torch.softmax(sc, -1) @ v, atol=1e-12,
                               rtol=1e-12)
    assert bool((out[..., dv + ws :] == 0).all())


@pytest.mark.parametrize("dw", [5, 40, 1])
def test_shared_field_gradcheck(dw: int) -> None:
    """The hand-derived backward of the shared-frequency value field (``vbar`` and the
    within-atom variance from the pair features) against finite differences: gradcheck in
    float64 w.r.t. ``a``, ``cos z``, ``sin z`` and both weight matrices; ``dw = 40`` takes the
    ``(BN x 2P) @ (2P x out)`` product, 5 and 1 the transposed one. The forward is checked
    against the pair features built from the outer products."""
    g = torch.Generator().manual_seed(4)
    B, H, N, Dv, K = 2, 2, 3, 5, 3
    P = K * (K + 1) // 2
    a = torch.randn(B, H, N, Dv, generator=g, dtype=F64)
    z = torch.randn(K, B * N, generator=g, dtype=F64) * 3
    wm = torch.randn(K, H * Dv, generator=g, dtype=F64)
    ws = torch.randn(2 * P, H * dw, generator=g, dtype=F64)
    leaves = tuple(t.clone().requires_grad_(True) for t in (a, torch.cos(z), torch.sin(z), wm, ws))
    assert torch.autograd.gradcheck(levy_mod._SharedField.apply, leaves, eps=1e-6, atol=1e-7,
                                    rtol=1e-5)
    vbar, s = levy_mod._SharedField.apply(*leaves)
    c, sn = torch.cos(z).t(), torch.sin(z).t()  # (BN, K)
    iu, ju, _ = levy_mod._pair_index(K, F64, torch.device("cpu"))
    feats = torch.cat([c[:, iu] * c[:, ju], sn[:, iu] * sn[:, ju]], dim=1)  # (BN, 2P)
    torch.testing.assert_close(
        vbar, a + (c @ wm).view(B, N, H, Dv).transpose(1, 2), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(
        s, (feats @ ws).view(B, N, H, dw).transpose(1, 2), atol=1e-12, rtol=1e-12)

def test_gradients_finite_with_empty_series_and_large_beta() -> None:
    args, kw = make_problem(B=2, H=2, Q=2, N=5)
    q, k, a, times, mask = args
    mask = mask.clone()
    mask[1] = False
    kw["beta"] = torch.tensor([2.0, 400.0], dtype=F64)  # exp(-800) underflows without the shift
    leaves = [x.clone().requires_grad_(True) for x in (q, k, a, times)]
    r = levy_attention(*leaves, mask, **kw)
    total = sum(getattr(r, f).sum() for f in FIELDS)
    total.backward()
    for x in leaves:
        assert x.grad is not None and bool(torch.isfinite(x.grad).all())
    assert bool((r.evidence[0] > 0).all())


# ------------------------------------------------------------------------ invariances


@pytest.mark.parametrize("backend", ["auto", "native", "sdpa", "explicit"])
@pytest.mark.parametrize("extra", [3, 300])
def test_masked_padding_is_bit_identical(extra: int, backend: str) -> None:
    """Appending masked entries (holding NaN / garbage) leaves every output bit-identical.

    ``extra = 300`` crosses the 256-observation block boundary.
    """
    args, kw = make_problem(B=2, H=2, Q=3, N=9)
    kw["backend"] = backend
    q, k, a, times, mask = args
    r = levy_attention(q, k, a, times, mask, **kw)
    B, H, _, E = q.shape
    g = torch.Generator().manual_seed(5)
    k2 = torch.cat([k, torch.randn(B, H, extra, E, generator=g, dtype=F64) * 1e3], dim=2)
    a2 = torch.cat([a, torch.full((B, H, extra, a.shape[-1]), math.nan, dtype=F64)], dim=2)
    t2 = torch.cat([times, torch.full((B, extra), math.nan, dtype=F64)], dim=1)
    m2 = torch.cat([mask, torch.zeros(B, extra, dtype=torch.bool)], dim=1)
    r2 = levy_attention(q, k2, a2, t2, m2, **kw)
    for f in FIELDS:
        assert torch.equal(getattr(r, f), getattr(r2, f)), f
    # changing what masked entries hold (in place, same N) also changes nothing
    assert bool((~mask).any())
    a3 = torch.where(mask[:, None, :, None], a, torch.full_like(a, 1e6))
    t3 = torch.where(mask, times, torch.full_like(times, -7.0))
    k3 = torch.where(mask[:, None, :, None], k, torch.full_like(k, 3.0))
    r3 = levy_attention(q, k3, a3, t3, mask, **kw)
    for f in FIELDS:
        assert torch.equal(getattr(r, f), getattr(r3, f)), f


@pytest.mark.parametrize("backend", ["auto", "native"])
def test_permutation_invariance(backend: str) -> None:
    args, kw = make_problem(B=2, H=2, Q=3, N=11)
    kw["backend"] = backend
    q, k, a, times, mask = args
    r = levy_attention(q, k, a, times, mask, **kw)
    perm = torch.randperm(11, generator=torch.Generator().manual_seed(2))
    r2 = levy_attention(q, k[:, :, perm], a[:, :, perm], times[:, perm], mask[:, perm], **kw)
    assert_result_close(r, r2, atol=1e-12)


@pytest.mark.parametrize("backend", ["native", "sdpa", "explicit"])
def test_block_size_does_not_change_result(backend: str) -> None:
    args, kw = make_problem(N=10)
    kw["backend"] = backend
    r = levy_attention(*args, **kw)
    for bs in (1, 3, 10, 1000):
        assert_result_close(r, levy_attention(*args, **kw, block_size=bs), atol=1e-13)


# ------------------------------------------------------------------------ limits


@pytest.mark.parametrize("backend", ["auto", "native"])
def test_h_zero_no_fourier_is_cosine_softmax(backend: str) -> None:
    args, _ = make_problem(fourier=False)
    q, k, a, times, mask = args
    for h in (0.0, 0.3):  # with D = 0 the bandwidth plays no role
        r = levy_attention(q, k, a, times, mask, alpha=1.0, beta=2.5, h=h, backend=backend)
        torch.testing.assert_close(
            r.mean, ref_cosine_softmax(q, k, a, mask, 2.5), atol=1e-13, rtol=0
        )
    # D = 0 given explicitly is the same operator
    z = levy_attention(
        q, k, a, times, mask, alpha=1.0, beta=2.5, h=0.0,
        omega=torch.rand(4, dtype=F64), phase=torch.rand(4, dtype=F64),
        D=torch.zeros(a.shape[-1], 4, dtype=F64), backend=backend,
    )
    torch.testing.assert_close(z.mean, ref_cosine_softmax(q, k, a, mask, 2.5), atol=1e-13, rtol=0)


@pytest.mark.parametrize("backend", ["auto", "native"])
def test_h_to_zero_is_continuous_and_removes_within_atom_variance(backend: str) -> None:
    """At h = 0 each atom of observation i carries exactly a_i + D g(t_i)."""
    args, kw = make_problem()
    kw["backend"] = backend
    q, k, a, times, mask = args
    kw0 = dict(kw, h=0.0)
    r0 = levy_attention(*args, **kw0)
    r_small = levy_attention(*args, **dict(kw, h=1e-7))
    assert_result_close(r0, r_small, atol=1e-10)
    g = torch.cos(times[:, None, :, None] * kw["omega"][None, :, None] + kw["phase"][None, :, None])
    v = a + torch.einsum("bhnk,hjk->bhnj", g, kw["D"])
    r_plain = levy_attention(q, k, v, times, mask, alpha=kw["alpha"], beta=kw["beta"], h=0.0,
                             backend=backend)
    assert_result_close(r0, r_plain, atol=1e-12)


@pytest.mark.parametrize("backend", ["auto", "native"])
def test_alpha_to_infinity_drives_sigma_to_zero(backend: str) -> None:
    args, kw = make_problem()
    kw["backend"] = backend
    sig, tr = [], []
    for alpha in (1.0, 1e2, 1e4, 1e6):
        r = levy_attention(*args, **dict(kw, alpha=alpha))
        sig.append(r.sigma)
        tr.append(r.var.sum(-1))
        # phi(Lambda) ~ 1/Lambda: sigma^2 Lambda -> tr Sigma_V, mean unchanged
        torch.testing.assert_close(r.mean, levy_attention(*args, **kw).mean, atol=1e-12, rtol=0)
    assert bool((sig[1] < sig[0]).all() and (sig[2] < sig[1]).all() and (sig[3] < sig[2]).all())
    assert float((sig[3] / sig[0]).max()) < 1e-2
    r = levy_attention(*args, **dict(kw, alpha=1e6))
    torch.testing.assert_close(r.sigma**2 * r.evidence, tr[3], rtol=1e-5, atol=0)


# ------------------------------------------------------------------------ edge cases


@pytest.mark.parametrize("backend", ["auto", "native"])
def test_empty_series_defined_output(backend: str) -> None:
    args, kw = make_problem(B=2)
    kw["backend"] = backend
    q, k, a, times, mask = args
    mask = mask.clone()
    mask[0] = False
    r = levy_attention(q, k, a, times, mask, **kw)
    assert bool((r.evidence[0] == 0).all()) and bool((r.p_empty[0] == 1).all())
    assert bool((r.mean[0] == 0).all()) and bool((r.var[0] == 0).all())
    assert bool((r.sigma[0] == 0).all()) and bool((r.phi[0] == 1).all())
    for f in FIELDS:
        assert bool(torch.isfinite(getattr(r, f)).all()), f
    # the other series is unaffected by its neighbour being empty
    r1 = levy_attention(q[1:], k[1:], a[1:], times[1:], mask[1:], **kw)
    assert_result_close(
        LevyResult(**{f: getattr(r, f)[1:] for f in FIELDS}), r1, atol=1e-14
    )


@pytest.mark.parametrize("backend", ["auto", "native", "sdpa", "explicit"])
@pytest.mark.parametrize(("B", "Q", "N"), [(0, 3, 7), (2, 0, 7), (2, 3, 0), (0, 0, 0)])
def test_zero_sizes_give_empty_or_empty_series_outputs(B: int, Q: int, N: int,
                                                       backend: str) -> None:
    """``B = 0`` or ``Q = 0``: outputs of the right (empty) shapes; ``N = 0``: every series is
    empty and gets the empty-series values (issue #23: obscure internal errors before). With
    autograd (torch paths) the outputs stay on the graph and gradients are zeros."""
    args, kw = make_problem(B=max(B, 1), Q=max(Q, 1), N=max(N, 1))
    q, k, a, times, mask = args
    q, k, a = q[:B, :, :Q], k[:B, :, :N], a[:B, :, :N]
    times, mask = times[:B, :N], mask[:B, :N]
    r = levy_attention(q, k, a, times, mask, backend=backend, **kw)
    assert r.mean.shape == r.var.shape == r.sigma_dim.shape == (B, 2, Q, 3)
    for f in ("evidence", "p_empty", "phi", "sigma"):
        assert getattr(r, f).shape == (B, 2, Q), f
    if B * Q:  # N = 0
        assert bool((r.evidence == 0).all() and (r.p_empty == 1).all() and (r.phi == 1).all())
        assert bool((r.mean == 0).all() and (r.sigma == 0).all())
    s = levy_attention_sample(q, k, a, times, mask, num_samples=4, **{
        n: kw[n] for n in ("alpha", "beta", "h", "omega", "phase", "D")})
    assert s.values.shape == (4, B, 2, Q, 3) and not bool(s.nonempty.any())
    if backend == "native":
        return
    qg = q.clone().requires_grad_(True)
    ag = a.clone().requires_grad_(True)
    rg = levy_attention(qg, k, ag, times, mask, backend=backend, **kw)
    (rg.mean.sum() + rg.sigma.sum()).backward()
    assert qg.grad is not None and bool((qg.grad == 0).all())
    assert ag.grad is not None and ag.grad.shape == a.shape


@pytest.mark.parametrize("backend", ["auto", "native"])
def test_negative_and_unsorted_times_are_allowed(backend: str) -> None:
    args, kw = make_problem()
    q, k, a, times, mask = args
    shifted = times - 100.0
    r = levy_attention(q, k, a, shifted, mask, **kw, backend=backend)
    ref = ref_levy(q, k, a, shifted, mask, **kw)
    np.testing.assert_allclose(r.mean.numpy(), ref["mean"], atol=1e-10)


@pytest.mark.parametrize("backend", ["native", "sdpa", "explicit"])
def test_float32_close_to_float64(backend: str) -> None:
    args, kw = make_problem(N=40, seed=4)
    r64 = levy_attention(*args, **kw, backend="explicit")
    args32 = tuple(x.float() if x.is_floating_point() else x for x in args)
    kw32 = {key: v.float() for key, v in kw.items()}
    r32 = levy_attention(*args32, **kw32, backend=backend)
    for f in FIELDS:
        torch.testing.assert_close(getattr(r32, f).double(), getattr(r64, f), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"times_nan": True}, "times"),
        ({"a_nan": True}, "a contains"),
        ({"alpha": 0.0}, "alpha"),
        ({"beta": -1.0}, "beta"),
        ({"h": -0.1}, "h must"),
        ({"D": None}, "together"),
        ({"alpha": torch.ones(3)}, "alpha"),
        # 0-dim Fourier parameters: a shape error naming them, not an IndexError
        ({"omega": torch.tensor(1.0)}, r"omega, phase must be .*omega.shape=\(\)"),
        ({"phase": torch.tensor(0.0)}, r"omega, phase must be .*phase.shape=\(\)"),
        ({"D": torch.tensor(0.1)}, r"omega, phase must be .*D.shape=\(\)"),
    ],
)
@pytest.mark.parametrize("entry", ["levy_attention", "sample", "reference"])
def test_bad_input(change: dict[str, Any], match: str, entry: str) -> None:
    """Every public entry runs the same validation: the same bad input, the same message."""
    call = {
        "levy_attention": levy_attention,
        "sample": functools.partial(levy_attention_sample, num_samples=2),
        "reference": levy_mod.levy_attention_reference,
    }[entry]
    args, kw = make_problem()
    q, k, a, times, mask = args
    times, a = times.clone(), a.clone()
    change = dict(change)  # the parameter is shared by the entries
    if change.pop("times_nan", False):
        times[0, 0] = math.nan  # entry 0 is observed
    if change.pop("a_nan", False):
        a[0, 1, 0, 0] = math.nan
    kw.update(change)
    with pytest.raises(ValueError, match=match):
        call(q, k, a, times, mask, **kw)


@pytest.mark.parametrize("name", ["q", "k", "a"])
def test_non_finite_input_raises_when_the_kernel_cannot_run(monkeypatch, name: str) -> None:
    """backend='auto' validates lightly when it expects the compiled kernel to check q, k and
    a itself; where the kernel cannot run (ATTNUQ_NATIVE=0, no compiler, another device or
    dtype) the torch path must check them instead of returning NaN."""
    from attnuq.ops.levy import _dispatch

    monkeypatch.setattr(_dispatch, "_native_unusable", lambda q, needs_grad: "switched off")
    args, kw = make_problem()
    t = dict(zip(("q", "k", "a"), (x.clone() for x in args[:3]), strict=True))
    t[name][0, 1, 0, 0] = math.nan  # observation 0 is observed in every series
    with pytest.raises(ValueError, match=f"{name} contains non-finite"):
        levy_attention(t["q"], t["k"], t["a"], args[3], args[4], **kw)


def test_bad_shapes() -> None:
    args, kw = make_problem()
    q, k, a, times, mask = args
    with pytest.raises(ValueError, match="times and mask"):
        levy_attention(q, k, a, times[:, :-1], mask, **kw)
    with pytest.raises(ValueError, match="a must be"):
        levy_attention(q, k, a[:, :, :-1], times, mask, **kw)
    with pytest.raises(TypeError, match="mask"):
        levy_attention(q, k, a, times, mask.long(), **kw)


def test_large_beta_shifted_path_matches_softmax() -> None:
    """beta = 600: exp(beta (cos - 1)) falls below sqrt(tiny) and the max-shifted path is used."""
    args, _ = make_problem(fourier=False)
    q, k, a, times, mask = args
    r = levy_attention(q, k, a, times, mask, alpha=2.0, beta=600.0, h=0.0)
    torch.testing.assert_close(r.mean, ref_cosine_softmax(q, k, a, mask, 600.0), atol=1e-12, rtol=0)
    qn = q / q.norm(dim=-1, keepdim=True)
    kn = k / k.norm(dim=-1, keepdim=True)
    s = (600.0 * (qn @ kn.transpose(-1, -2) - 1)).masked_fill(~mask[:, None, None, :], -math.inf)
    lam = 2.0 * torch.exp(torch.logsumexp(s, dim=-1))
    assert bool((lam < torch.finfo(F64).tiny ** 0.5).any())  # the fallback really is exercised
    torch.testing.assert_close(r.evidence, lam, rtol=1e-12, atol=0)


@pytest.mark.parametrize("fourier", [True, False])
def test_fused_and_explicit_backends_agree(fourier: bool) -> None:
    """The fused SDPA path (sentinel key) against the explicit reference path, values and grads."""
    args, kw = make_problem(fourier=fourier, N=13)
    leaves = [x.clone().requires_grad_(True) for x in args[:4]]
    outs = {}
    for backend in ("sdpa", "explicit"):
        r = levy_attention(*leaves, args[4], **kw, backend=backend, block_size=5)
        grads = torch.autograd.grad(
            r.mean.sum() + r.sigma.sum() + r.evidence.sum(), leaves, allow_unused=True
        )
        outs[backend] = (r, grads)
    assert_result_close(outs["sdpa"][0], outs["explicit"][0], atol=1e-12, rtol=1e-12)
    for g1, g2 in zip(outs["sdpa"][1], outs["explicit"][1], strict=True):
        assert (g1 is None) == (g2 is None)  # times are unused without the Fourier field
        if g1 is not None:
            torch.testing.assert_close(g1, g2, atol=1e-11, rtol=1e-11)


def test_trace_only_mode_matches_per_dim() -> None:
    args, kw = make_problem()
    full = levy_attention(*args, **kw)
    tr = levy_attention(*args, **kw, per_dim=False)
    assert tr.var is None and tr.sigma_dim is None
    for f in ("mean", "evidence", "p_empty", "phi", "sigma"):
        torch.testing.assert_close(getattr(tr, f), getattr(full, f), atol=1e-12, rtol=0)


def test_sdpa_backend_refuses_large_beta() -> None:
    args, kw = make_problem()
    with pytest.raises(ValueError, match="beta"):
        levy_attention(*args, **dict(kw, beta=200.0), backend="sdpa")
    with pytest.raises(ValueError, match="backend"):
        levy_attention(*args, **kw, backend="fast")


def test_float32_fused_path_near_its_beta_limit() -> None:
    """beta = 20 (the fused path allows <= 22 in float32): the sentinel weight is ~e^{-40}."""
    args, kw = make_problem(N=40, seed=6)
    kw["beta"] = torch.full((2,), 20.0, dtype=F64)
    r64 = levy_attention(*args, **kw, backend="explicit")
    args32 = tuple(x.float() if x.is_floating_point() else x for x in args)
    r32 = levy_attention(*args32, **{key: v.float() for key, v in kw.items()}, backend="sdpa")
    for f in ("mean", "var", "sigma", "phi"):
        torch.testing.assert_close(getattr(r32, f).double(), getattr(r64, f), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(r32.evidence.double(), r64.evidence, atol=0, rtol=1e-4)


@pytest.mark.parametrize("per_dim", [True, False])
def test_inference_path_matches_autograd_path(per_dim: bool) -> None:
    """The fused backend without autograd (log-sum-exp normaliser, one buffer for keys and
    values) and with it (sentinel key) give the same numbers to rounding."""
    args, kw = make_problem(B=3, H=2, Q=4, N=13, E=5, Dv=4, K=3)
    kw.update(backend="sdpa", per_dim=per_dim)
    with torch.no_grad():
        r_inf = levy_attention(*args, **kw)
    leaves = [t.clone().requires_grad_(True) for t in args[:4]]
    r_grad = levy_attention(*leaves, args[4], **kw)
    for f in FIELDS:
        x, y = getattr(r_inf, f), getattr(r_grad, f)
        if x is None:
            assert y is None
            continue
        torch.testing.assert_close(x, y.detach(), atol=1e-12, rtol=1e-12, msg=f)


def test_inference_path_float32_masked_garbage_is_bit_identical() -> None:
    """float32, no autograd: masked rows holding large finite garbage (left as they are) and
    NaN (zeroed) leave every output bit-identical."""
    args, kw = make_problem(B=2, H=2, Q=3, N=9, dtype=torch.float32)
    q, k, a, times, mask = args
    kw = {key: v.float() for key, v in kw.items()}
    kw["backend"] = "sdpa"
    r = levy_attention(q, k, a, times, mask, **kw)
    m4 = mask[:, None, :, None]
    for fill in (1e4, math.nan):
        k2 = torch.where(m4, k, torch.full_like(k, fill))
        a2 = torch.where(m4, a, torch.full_like(a, fill))
        r2 = levy_attention(q, k2, a2, times, mask, **kw)
        for f in FIELDS:
            assert torch.equal(getattr(r, f), getattr(r2, f)), (fill, f)


@pytest.mark.parametrize("fill", [math.nan, 1e200, 3.0])
def test_autograd_path_masked_garbage(fill: float) -> None:
    """CPU autograd path (flash kernels, q, k, a checked through the finiteness of the sums):
    masked rows of k and a holding NaN, values whose squares overflow (1e200 in float64: the
    sums turn non-finite, the detailed checks zero those rows and the call repeats) or ordinary
    garbage give bit-identical outputs and gradients, exact zeros on the masked rows; a NaN at
    an observed entry raises with the detailed message."""
    args, kw = make_problem(B=2, H=2, Q=3, N=9)
    kw["backend"] = "sdpa"
    q, k, a, times, mask = args
    m4 = mask[:, None, :, None]

    def run(k_: torch.Tensor, a_: torch.Tensor) -> tuple[LevyResult, tuple[torch.Tensor, ...]]:
        leaves = [t.clone().requires_grad_(True) for t in (q, k_, a_)]
        r = levy_attention(*leaves, times, mask, **kw)
        grads = torch.autograd.grad(r.mean.sum() + r.sigma.sum() + r.evidence.sum(), leaves)
        return r, grads

    r, g = run(k, a)
    r2, g2 = run(torch.where(m4, k, fill), torch.where(m4, a, fill))
    for f in FIELDS:
        assert torch.equal(getattr(r, f), getattr(r2, f)), f
    assert torch.equal(g[0], g2[0])
    for x, y in zip(g[1:], g2[1:], strict=True):
        assert torch.equal(torch.where(m4, x, 0.0), y)
        assert bool((y.masked_select(~m4.expand_as(y)) == 0).all())
    a_bad = a.clone()
    a_bad[0, 1, 0, 0] = math.nan  # entry 0 is observed in every series
    with pytest.raises(ValueError, match="a contains non-finite values at observed"):
        run(k, a_bad)


def test_explicit_backend_double_backward() -> None:
    """The explicit (reference) backend stays twice differentiable through the value field's
    custom function: gradgradcheck in float64 w.r.t. the value embeddings and the field's
    parameters (the flash path's kernel backward is first order only, as SDPA's is)."""
    args, kw = make_problem(B=1, H=1, Q=2, N=3, E=2, Dv=2, K=2)
    q, k, a, times, mask = args
    kw1 = {key: v[0] if v.dim() == 2 else v for key, v in kw.items() if key in ("omega", "phase")}
    leaves = tuple(t.clone().requires_grad_(True) for t in (a, kw1["omega"], kw1["phase"],
                                                            kw["D"]))

    def f(a_: torch.Tensor, om: torch.Tensor, ph: torch.Tensor, d_: torch.Tensor) -> torch.Tensor:
        r = levy_attention(q, k, a_, times, mask, alpha=kw["alpha"], beta=kw["beta"], h=kw["h"],
                           omega=om, phase=ph, D=d_, backend="explicit")
        return r.mean.sum(-1) + r.sigma

    assert torch.autograd.gradgradcheck(f, leaves, eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("loops", ["compiled", "torch"])
def test_levy_shared_field_backward_one_column_per_head(loops: str) -> None:
    """_SharedField's backward when the within gradient is one column per head broadcast over
    the value dimension (stride 0, as the training block's trace-only backward hands it): the
    width-H products give the gradients of the materialised (contiguous) gradient, to float64
    rounding, for the compiled pair loops and the torch ones."""
    if loops == "compiled" and not _native.available():
        pytest.skip(f"native kernels unavailable: {_native.status()['reason']}")
    g = torch.Generator().manual_seed(6)
    B, H, N, Dv, K = 2, 3, 5, 4, 3
    P = K * (K + 1) // 2
    a = torch.randn(B, H, N, Dv, generator=g, dtype=F64)
    z = torch.randn(K, B * N, generator=g, dtype=F64) * 3
    # wm and ws in the (1, K)- and (1, 2P)-strided layouts _field hands over
    wm = torch.randn(H * Dv, K, generator=g, dtype=F64).t()
    ws = torch.randn(H * Dv, 2 * P, generator=g, dtype=F64).t()
    g_vbar = torch.randn(B, N, H, Dv, generator=g, dtype=F64).transpose(1, 2)
    g_tr = torch.randn(B, N, H, 1, generator=g, dtype=F64).transpose(1, 2)
    ctx = _native.disabled() if loops == "torch" else contextlib.nullcontext()
    grads = []
    with ctx:
        for g_s in (g_tr.expand(-1, -1, -1, Dv), g_tr.expand(-1, -1, -1, Dv).contiguous()):
            leaves = [t.clone().requires_grad_(True) for t in (a, torch.cos(z), torch.sin(z), wm,
                                                             ws)]
            vbar, s = levy_mod._SharedField.apply(*leaves)
            grads.append(torch.autograd.grad((vbar, s), leaves, (g_vbar, g_s)))
    assert grads[0][0].shape == a.shape
    for x, y in zip(*grads, strict=True):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-12)
