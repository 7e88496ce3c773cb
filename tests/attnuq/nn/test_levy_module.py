"""nn.LevyAttention: shapes, exact folded per-output sigma, gradients, invariances, bad input."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from tests.attnuq.ops._reference_levy import ref_cosine_softmax, ref_levy

from attnuq.nn import LevyAttention
from attnuq.ops import levy_attention

F64 = torch.float64


def make_inputs(
    B: int = 2, N: int = 6, Q: int = 3, C: int = 3, F: int = 1, seed: int = 0
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, N, generator=g) < 0.8
    mask[:, 0] = True
    vals = torch.randn(B, N, F, generator=g, dtype=F64)
    return {
        "times": torch.rand(B, N, generator=g, dtype=F64) * 10 - 2,
        "channels": torch.randint(0, C, (B, N), generator=g),
        "values": vals[..., 0] if F == 1 else vals,
        "mask": mask,
        "query_times": torch.rand(B, Q, generator=g, dtype=F64) * 10,
        "query_channels": torch.randint(0, C, (B, Q), generator=g),
    }


def make_layer(seed: int = 0, **kw: Any) -> LevyAttention:
    torch.manual_seed(seed)
    opts: dict[str, Any] = {"num_channels": 3, "d_model": 8, "num_heads": 2, "n_fourier": 3}
    opts.update(kw)
    layer = LevyAttention(**opts).double()
    with torch.no_grad():  # make the value field and the heads non-trivial
        if layer.D is not None:
            layer.D.normal_(0, 0.5)
        layer.alpha_raw.copy_(torch.linspace(0.0, 1.0, layer.num_heads))
        layer.h_raw.copy_(torch.linspace(-1.0, 0.0, layer.num_heads))
    return layer


@pytest.mark.parametrize("out_features", [None, 2])
@pytest.mark.parametrize("F", [1, 3])
def test_shapes(out_features: int | None, F: int) -> None:
    layer = make_layer(out_features=out_features, value_features=F)
    x = make_inputs(F=F)
    out = layer(**x)
    d_out = 8 if out_features is None else out_features
    assert out.mean.shape == out.sigma_dim.shape == (2, 3, d_out)
    assert out.sigma.shape == (2, 3)
    assert out.evidence.shape == out.p_empty.shape == (2, 3, 2)
    assert out.heads.mean.shape == (2, 2, 3, 8 // 2 if out_features is None else out_features)
    torch.testing.assert_close(out.sigma**2, (out.sigma_dim**2).sum(-1), rtol=1e-12, atol=0)
    # without query channels the learned "no channel" row is used
    x.pop("query_channels")
    assert layer(**x).mean.shape == (2, 3, d_out)


def test_default_float32_runs() -> None:
    layer = LevyAttention(num_channels=3, d_model=16, num_heads=4, out_features=1)
    x = {k: (v.float() if v.is_floating_point() else v) for k, v in make_inputs().items()}
    out = layer(**x)
    assert out.mean.dtype == torch.float32 and bool(torch.isfinite(out.sigma).all())


def test_folded_sigma_is_exact_per_output_dim() -> None:
    """Folding W_o into the values gives diag(sum_h W_o^h Sigma_V,h W_o^h^T phi_h) exactly.

    Checked against the loop reference's *full* per-head covariance in the unfolded value space.
    """
    layer = make_layer(out_features=2)
    x = make_inputs()
    out = layer(**x)
    # unfolded per-head values and D: a^h = W_v^h u + b_v^h, D_unf^h; folded D^h = W_o^h D_unf^h
    H, dh = layer.num_heads, layer.d_head
    P = 2
    assert layer.out_proj is not None and layer.D is not None
    wo = layer.out_proj.weight.detach().view(P, H, dh).permute(1, 0, 2)  # (H, P, dh)
    d_unf = torch.randn(H, dh, layer.n_fourier, dtype=F64)
    with torch.no_grad():
        layer.D.copy_(torch.einsum("hpe,hek->hpk", wo, d_unf))
    out = layer(**x)
    times, channels, values, _ = layer._check(
        x["times"], x["channels"], x["values"], x["mask"], x["query_times"], x["query_channels"]
    )
    with torch.no_grad():
        q, k, _ = layer._embed(times, channels, values, x["query_times"], x["query_channels"])
        u = torch.nn.functional.gelu(layer.value_in(values) + layer.value_channel(channels))
        a_unf = layer.w_v(u).view(2, -1, H, dh).transpose(1, 2)
    kw = {"alpha": layer.alpha.detach(), "beta": layer.beta.detach(), "h": layer.h.detach(),
          "omega": layer.omega.detach(), "phase": layer.phase.detach(), "D": d_unf}
    ref = ref_levy(q, k, a_unf, times, x["mask"], **kw)
    phi = levy_attention(q, k, a_unf, times, x["mask"], **kw).phi.numpy()  # (B, H, Q)
    won = wo.numpy()
    pred_var = np.einsum("hpe,bhqef,hpf,bhq->bqp", won, ref["cov"], won, phi)
    mean = np.einsum("hpe,bhqe->bqp", won, ref["mean"]) + layer.out_proj.bias.detach().numpy()
    np.testing.assert_allclose(out.mean.detach().numpy(), mean, atol=1e-11)
    np.testing.assert_allclose(out.sigma_dim.detach().numpy() ** 2, pred_var, atol=1e-11)


@pytest.mark.slow
def test_module_sampler_matches_folded_sigma() -> None:
    """Heads are independent Poisson measures: Var of the summed sample = sigma_dim^2.

    z-test on each output dim's sample variance (standard error sqrt((m4 - s^4) / n)) and mean,
    |z| <= 5 over 2 queries x 2 dims x 2 statistics = 8 comparisons: false-failure < 5e-6.
    Draws with an empty head are dropped (conditioning each independent head on N_h >= 1).
    """
    layer = make_layer(out_features=2)
    x = make_inputs(B=1, Q=2)
    out = layer(**x)
    gen = torch.Generator().manual_seed(3)
    smp, nonempty = layer.sample(**x, num_samples=40_000, generator=gen)
    for qq in range(2):
        keep = nonempty[:, 0, qq].all(-1)
        y = smp[keep, 0, qq]  # (n, P)
        n = y.shape[0]
        mu = out.mean[0, qq].detach()
        z_mean = (y.mean(0) - mu) / (y.std(0) / math.sqrt(n))
        assert bool((z_mean.abs() <= 5).all()), z_mean
        dev2 = (y - mu) ** 2
        target = out.sigma_dim[0, qq].detach() ** 2
        z_var = (dev2.mean(0) - target) / (dev2.std(0) / math.sqrt(n))
        assert bool((z_var.abs() <= 5).all()), z_var


@pytest.mark.parametrize("out_features", [None, 1])
def test_gradcheck_inputs_and_every_parameter(out_features: int | None) -> None:
    layer = make_layer(
        d_model=4, num_heads=2, n_fourier=2, num_channels=2, out_features=out_features
    )
    x = make_inputs(B=1, N=3, Q=2, C=2)
    x["mask"] = torch.tensor([[True, False, True]])
    names = [n for n, _ in layer.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for _, p in layer.named_parameters()]
    inputs = [x[n].clone().requires_grad_(True) for n in ("times", "values", "query_times")]

    def f(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t, v, qt = xs[:3]
        pd = dict(zip(names, xs[3:], strict=True))
        out = torch.func.functional_call(
            layer, pd, args=(t, x["channels"], v, x["mask"], qt, x["query_channels"])
        )
        return out.mean, out.sigma

    # every parameter and input actually receives a gradient (so the check is not vacuous)
    outs = f(*inputs, *params)
    grads = torch.autograd.grad(sum(o.sum() for o in outs), [*inputs, *params])
    for n, g in zip(["times", "values", "query_times", *names], grads, strict=True):
        assert bool((g != 0).any()), n
    assert torch.autograd.gradcheck(f, (*inputs, *params), eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("out_features", [None, 2])
def test_masked_padding_bit_identical_and_permutation(out_features: int | None) -> None:
    layer = make_layer(out_features=out_features)
    x = make_inputs(N=9)
    out = layer(**x)
    B, extra = 2, 130
    y = dict(x)
    y["times"] = torch.cat([x["times"], torch.full((B, extra), math.nan, dtype=F64)], 1)
    y["values"] = torch.cat([x["values"], torch.full((B, extra), math.inf, dtype=F64)], 1)
    y["channels"] = torch.cat([x["channels"], torch.full((B, extra), 99)], 1)
    y["mask"] = torch.cat([x["mask"], torch.zeros(B, extra, dtype=torch.bool)], 1)
    out2 = layer(**y)
    for f in ("mean", "sigma", "sigma_dim", "evidence", "p_empty"):
        assert torch.equal(getattr(out, f), getattr(out2, f)), f
    perm = torch.randperm(9, generator=torch.Generator().manual_seed(1))
    z = dict(x)
    for n in ("times", "values", "channels", "mask"):
        z[n] = x[n][:, perm]
    out3 = layer(**z)
    for f in ("mean", "sigma", "sigma_dim", "evidence", "p_empty"):
        torch.testing.assert_close(getattr(out, f), getattr(out3, f), atol=1e-12, rtol=0)


@pytest.mark.parametrize("out_features", [None, 2])
def test_empty_series(out_features: int | None) -> None:
    layer = make_layer(out_features=out_features)
    x = make_inputs()
    x["mask"] = x["mask"].clone()
    x["mask"][1] = False
    x["values"] = x["values"].clone().requires_grad_(True)
    out = layer(**x)
    assert bool((out.evidence[1] == 0).all()) and bool((out.p_empty[1] == 1).all())
    assert bool((out.sigma[1] == 0).all())
    expect = torch.zeros(3, out.mean.shape[-1], dtype=F64)
    if layer.out_proj is not None:
        expect = expect + layer.out_proj.bias.detach()
    torch.testing.assert_close(out.mean[1].detach(), expect, rtol=0, atol=0)
    (out.mean.sum() + out.sigma.sum() + out.evidence.sum()).backward()
    for p in [*layer.parameters(), x["values"]]:
        assert p.grad is None or bool(torch.isfinite(p.grad).all())


def test_cosine_softmax_limit_and_alpha_limit() -> None:
    """n_fourier = 0 (D = 0): mean is softmax(beta cos(q, k)) attention on the layer's embeddings;
    alpha -> infinity drives sigma -> 0 while the mean is unchanged."""
    layer = make_layer(n_fourier=0)
    x = make_inputs()
    out = layer(**x)
    with torch.no_grad():
        layer.beta_raw.fill_(2.0)
        q, k, a = layer._embed(
            x["times"], x["channels"], x["values"][..., None], x["query_times"],
            x["query_channels"],
        )
        beta = float(layer.beta[0])
        ref = ref_cosine_softmax(q, k, a, x["mask"], beta)  # (B, H, Q, dh)
        out = layer(**x)
    torch.testing.assert_close(out.mean, ref.transpose(1, 2).reshape(2, 3, -1), atol=1e-12, rtol=0)
    sig = []
    for raw in (0.0, 10.0, 1e3, 1e5):
        with torch.no_grad():
            layer.alpha_raw.fill_(raw)
            o = layer(**x)
        torch.testing.assert_close(o.mean, out.mean, atol=1e-12, rtol=0)
        sig.append(o.sigma)
    assert bool((sig[3] < 0.01 * sig[0]).all())


@pytest.mark.parametrize(
    ("field", "bad", "match"),
    [
        ("times", math.nan, "times contains"),
        ("values", math.nan, "values contains"),
        ("values", math.inf, "values contains"),
        ("channels", 7, "channels must lie"),
        ("query_times", math.nan, "query_times"),
    ],
)
def test_bad_input(field: str, bad: float, match: str) -> None:
    layer = make_layer()
    x = make_inputs()
    x[field] = x[field].clone()
    x[field][0, 0] = bad  # entry 0 is observed
    with pytest.raises(ValueError, match=match):
        layer(**x)


def test_bad_shapes_and_settings() -> None:
    layer = make_layer()
    x = make_inputs()
    with pytest.raises(ValueError, match="times must be"):
        layer(**dict(x, times=x["times"][:, :-1]))
    with pytest.raises(ValueError, match="values must be"):
        layer(**dict(x, values=x["values"][:, :, None].expand(-1, -1, 2)))
    with pytest.raises(ValueError, match="query_channels"):
        layer(**dict(x, query_channels=x["query_channels"] + 5))
    with pytest.raises(ValueError, match="mask"):
        layer(**dict(x, mask=x["mask"].long()))
    with pytest.raises(ValueError, match="divisible"):
        LevyAttention(num_channels=2, d_model=6, num_heads=4)
    with pytest.raises(ValueError, match=r"alpha must be a finite float > 0, got alpha=0\.0"):
        LevyAttention(num_channels=2, alpha=0.0)


def test_negative_unsorted_times_and_masked_nan_are_accepted() -> None:
    layer = make_layer()
    x = make_inputs()
    x["times"] = x["times"] - 50.0
    x["times"] = x["times"].clone()
    x["mask"] = x["mask"].clone()
    x["mask"][0, 1] = False
    x["times"][0, 1] = math.nan
    out = layer(**x)
    assert bool(torch.isfinite(out.mean).all()) and bool(torch.isfinite(out.sigma).all())


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize(("B", "N", "Q"), [(0, 6, 3), (2, 6, 0), (2, 0, 3), (0, 0, 0)])
def test_zero_sizes_give_empty_outputs(B: int, N: int, Q: int, grad: bool) -> None:
    """``B = 0``, ``Q = 0`` or ``N = 0`` (issue #23: obscure internal errors before): outputs of
    the documented shapes, empty series where there is no observation, and a backward pass that
    runs (zero gradients)."""
    layer = make_layer(out_features=2)
    x = make_inputs(B=max(B, 1), N=max(N, 1), Q=max(Q, 1))
    for name in ("times", "channels", "values", "mask"):
        x[name] = x[name][:B, :N]
    x["query_times"], x["query_channels"] = x["query_times"][:B, :Q], x["query_channels"][:B, :Q]
    with torch.set_grad_enabled(grad):
        out = layer(**x)
    assert out.mean.shape == out.sigma_dim.shape == (B, Q, 2)
    assert out.sigma.shape == (B, Q) and out.evidence.shape == out.p_empty.shape == (B, Q, 2)
    if N == 0:
        assert bool((out.p_empty == 1).all()) and bool((out.sigma == 0).all())
    if grad:
        (out.mean.sum() + out.sigma.sum()).backward()
        grads = [p.grad for p in layer.parameters() if p.grad is not None]
        assert grads and all(bool(torch.isfinite(g).all()) for g in grads)
    samples, nonempty = layer.sample(**x, num_samples=3)
    assert samples.shape == (3, B, Q, 2) and nonempty.shape == (3, B, Q, 2)


def test_float32_times_near_1e9_warn_and_shifted_times_do_not() -> None:
    """Unix seconds (``~1.7e9``) in float32 are spaced by 128: hourly observations keep their
    order but the time embedding loses its phase, and second-level times collapse. The layer
    warns (naming the resolution and the span); the same times minus the first observation, or
    in float64, do not warn."""
    layer = make_layer().float()
    x = make_inputs(B=2, N=6, Q=3)
    base = 1.7e9
    t = base + torch.arange(6, dtype=F64).expand(2, 6) * 3600.0
    qt = base + torch.tensor([1.0, 7.0, 9.0], dtype=F64).expand(2, 3) * 3600.0
    x32 = dict(x, values=x["values"].float())
    with pytest.warns(UserWarning, match=r"resolved only to about .* Subtract a reference time"):
        layer(**dict(x32, times=t.float(), query_times=qt.float()))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(**dict(x32, times=(t - base).float(), query_times=(qt - base).float()))
        make_layer()(**dict(x, times=t, query_times=qt))  # float64 layer and times


@pytest.mark.parametrize("n_fourier", [0, 3])
@pytest.mark.parametrize("per_dim", [True, False])
@pytest.mark.parametrize("out_features", [None, 2])
def test_levy_train_step_float32_matches_float64_torch_loops(
    n_fourier: int, per_dim: bool, out_features: int | None
) -> None:
    """The float32 training step (autograd on CPU: the flash path with its compiled row loops,
    csrc/levy_train.c, where they build) against the same layer in float64 with the compiled
    loops off (``_native.disabled()``: the torch fallback): outputs and the gradients of every
    parameter and of the input times, with masks, a series with no observation and one with a
    single one. The problem is big enough (B H Q N_obs >= 65536) for ``backend="auto"`` to take
    the flash path. Deterministic (no sampling): the tolerance covers float32 rounding only,
    eps = 6e-8 amplified by sums over ~300 observations, the second moment's cancellation
    (m2 - mu^2, values O(1)) and the normalisations; observed errors are ~5e-6 (two blocks of
    256 observations here), the bound 5e-4 * (1 + |x|) leaves margin for other CPUs' kernels."""
    from attnuq.ops import _native

    B, N, Q = 4, 300, 40
    x = make_inputs(B=B, N=N, Q=Q, seed=5)
    x["mask"][1] = False  # empty series
    x["mask"][2] = False
    x["mask"][2, 7] = True  # one observation
    layer64 = make_layer(seed=2, n_fourier=n_fourier, per_dim=per_dim, out_features=out_features)
    layer32 = make_layer(seed=2, n_fourier=n_fourier, per_dim=per_dim,
                         out_features=out_features).float()
    layer32.load_state_dict({k: v.float() for k, v in layer64.state_dict().items()})
    g = torch.Generator().manual_seed(9)
    D_out = out_features or 8
    w_mean, w_sig = torch.randn(B, Q, D_out, generator=g), torch.randn(B, Q, generator=g)
    w_dim = torch.randn(B, Q, D_out, generator=g)

    def step(layer: LevyAttention, dt: torch.dtype) -> tuple[list[torch.Tensor], ...]:
        xs = {k: (v.to(dt) if v.is_floating_point() else v) for k, v in x.items()}
        xs["times"] = xs["times"].clone().requires_grad_(True)
        out = layer(**xs)
        loss = (out.mean * w_mean.to(dt)).sum() + (out.sigma * w_sig.to(dt)).sum()
        if out.sigma_dim is not None:  # reads the per-dimension moments (full backward)
            loss = loss + (out.sigma_dim * w_dim.to(dt)).sum()
        grads = torch.autograd.grad(loss, [xs["times"], *layer.parameters()], allow_unused=True)
        vals = [out.mean, out.sigma, out.evidence, out.p_empty]
        vals += [] if out.sigma_dim is None else [out.sigma_dim]
        return vals, [gr for gr in grads if gr is not None]

    v32, g32 = step(layer32, torch.float32)
    with _native.disabled():
        v64, g64 = step(layer64, F64)
    assert len(g32) == len(g64)
    for a_, b_ in zip(v32 + g32, v64 + g64, strict=True):
        assert bool(torch.isfinite(a_).all())
        torch.testing.assert_close(a_.double(), b_, atol=5e-4, rtol=5e-4)
    # the empty series: mean 0 (the output bias with a folded projection), sigma and evidence 0
    bias = 0.0 if layer32.out_proj is None else layer32.out_proj.bias.detach()
    assert bool((v32[0][1] == bias).all()) and bool((v32[1][1] == 0).all())
    assert bool((v32[2][1] == 0).all())


@pytest.mark.parametrize("out_features", [None, 2])
def test_total_sigma_grows_as_evidence_vanishes(out_features: int | None) -> None:
    """#35.11: with every observation masked ``sigma_dim`` is 0 (no atom, a convention) but
    ``total_sigma_dim`` is the prior scale; one far observation gives a larger total spread
    than 50 observations around the query, while the conditional ``sigma_dim`` is smaller."""
    torch.manual_seed(0)
    layer = LevyAttention(num_channels=1, d_model=16, num_heads=2, out_features=out_features,
                          prior_std=0.5).double().requires_grad_(False)
    one = lambda n: torch.zeros(1, n, dtype=torch.long)  # noqa: E731
    q = torch.tensor([[40.0]], dtype=F64)
    empty = layer(torch.rand(1, 4, dtype=F64), one(4), torch.randn(1, 4, dtype=F64),
                  torch.zeros(1, 4, dtype=torch.bool), q)
    assert bool((empty.sigma_dim == 0).all())
    torch.testing.assert_close(empty.total_sigma_dim, torch.full_like(empty.mean, 0.5),
                               rtol=1e-12, atol=0)
    d_out = empty.mean.shape[-1]
    torch.testing.assert_close(empty.total_sigma, torch.full((1, 1), 0.5 * math.sqrt(d_out),
                                                             dtype=F64), rtol=1e-12, atol=0)
    g = torch.Generator().manual_seed(1)
    far = layer(torch.zeros(1, 1, dtype=F64), one(1), torch.randn(1, 1, generator=g, dtype=F64),
                torch.ones(1, 1, dtype=torch.bool), q)
    t50 = 40 + torch.randn(1, 50, generator=g, dtype=F64)
    near = layer(t50, one(50), torch.randn(1, 50, generator=g, dtype=F64),
                 torch.ones(1, 50, dtype=torch.bool), q)
    assert float(far.evidence.sum()) < float(near.evidence.sum())
    assert float(far.sigma) < float(near.sigma)  # the conditional spread: disagreement only
    assert float(far.total_sigma) > float(near.total_sigma)
    assert bool((far.total_sigma_dim > near.total_sigma_dim).all())
    # the identity behind it, per head (concatenated) or summed over heads (folded)
    p, H = far.heads.p_empty, layer.num_heads
    var = far.heads.var * far.heads.phi[..., None]  # (1, H, 1, Dv)
    td = (1 - p)[..., None] * var + p[..., None] * (0.25 if out_features is None else 0.25 / H)
    td = td.transpose(1, 2).reshape(1, 1, -1) if out_features is None else td.sum(1)
    torch.testing.assert_close(far.total_sigma_dim**2, td, rtol=1e-10, atol=1e-14)


def test_total_sigma_matches_draws_with_a_prior_for_empty_heads() -> None:
    """E|Y - mean|^2 per output dim = total_sigma_dim^2 when a head without atoms draws its
    block from N(mean, prior_std^2): the explicit sampler's draws (empty heads replaced by such
    prior draws) against the closed form. z-test per dim (standard error of the mean squared
    deviation), |z| <= 5 over 8 dims: false-failure probability < 8 * 5.8e-7 < 5e-6."""
    layer = make_layer(prior_std=0.7)
    x = make_inputs(B=1, N=2, Q=1)  # one or two observations: heads are often empty
    out = layer(**x)
    gen = torch.Generator().manual_seed(5)
    smp, nonempty = layer.sample(**x, num_samples=20_000, generator=gen)  # (S, 1, 1, D)
    H, D = layer.num_heads, out.mean.shape[-1]
    ne = nonempty[:, 0, 0].repeat_interleave(D // H, dim=-1)  # (S, D): the head of each dim
    assert 0.05 < float((~ne).double().mean()) < 0.95  # both kinds of draw occur
    mu = out.mean[0, 0].detach()
    prior = mu + 0.7 * torch.randn(smp.shape[0], D, generator=gen, dtype=F64)
    y = torch.where(ne, smp[:, 0, 0], prior)
    dev2 = (y - mu) ** 2
    target = out.total_sigma_dim[0, 0].detach() ** 2
    z = (dev2.mean(0) - target) / (dev2.std(0) / math.sqrt(dev2.shape[0]))
    assert bool((z.abs() <= 5).all()), z


def test_bad_prior_std() -> None:
    for bad in (-1.0, math.nan, math.inf, True):
        with pytest.raises(ValueError, match="prior_std"):
            LevyAttention(num_channels=2, prior_std=bad)  # type: ignore[arg-type]
