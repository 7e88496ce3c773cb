"""predict(): samples-first shapes, exact first two moments on a known model, batching."""

from __future__ import annotations

import math

import pytest
import torch
from tests.attnuq._reference_calibration import make_uniform_problem
from torch import nn

from attnuq.montecarlo import predict
from attnuq.predictive import Predictive

C = 4.0


@pytest.fixture(scope="module")
def uniform() -> tuple[nn.Module, torch.Tensor]:
    model, v, _ = make_uniform_problem(n=6, e=8, c=C)
    return model, v


@pytest.mark.parametrize(("batch_replicas", "s"), [(None, 2000), (1, 60), (20, 400)])
def test_moments_match_closed_form(uniform, batch_replicas, s) -> None:  # type: ignore[no-untyped-def]
    # f_nu - f has mean 0 and covariance (c^2/nu) I exactly (Hadamard values, uniform weights),
    # whether the S passes run in one replicated call, one call each (loop) or chunks of 20.
    model, v = uniform
    nu = 4
    pred = predict(model, v, nu=nu, n_samples=s, batch_replicas=batch_replicas, progress=False)
    assert isinstance(pred, Predictive)
    assert pred.samples.shape == (s, 6, 8) and pred.frozen is not None
    torch.testing.assert_close(pred.frozen, model(v).detach())
    var = C**2 / nu
    # mean: 48 elements, each within 5 se (Bonferroni: false failure < 48 * 6e-7 = 3e-5)
    z = (pred.samples.mean(0) - pred.frozen) / math.sqrt(var / s)
    assert z.abs().max().item() < 5
    # variance pooled over 48 elements (independent across the 6 examples): relative sd of a
    # sample variance <= sqrt(2/(S-1)) (the mean of 4 +-1 draws is platykurtic); 5 sd of the
    # pooled mean over 6 independent examples -> false failure < 1e-6
    v_hat = pred.samples.var(0).mean().item()
    assert abs(v_hat / var - 1) < 5 * math.sqrt(2 / (s - 1)) / math.sqrt(6)


def test_replicas_draw_independently_and_seed_reproduces(uniform) -> None:  # type: ignore[no-untyped-def]
    model, v = uniform
    a = predict(model, v, nu=2, n_samples=5, seed=3, progress=False)
    b = predict(model, v, nu=2, n_samples=5, seed=3, progress=False)
    c = predict(model, v, nu=2, n_samples=5, seed=4, progress=False)
    assert torch.equal(a.samples, b.samples)
    assert not torch.equal(a.samples, c.samples)
    assert not torch.equal(a.samples[0], a.samples[1])  # replicas are not copies
    d = predict(model, v, nu=2, n_samples=7, batch_replicas=3, progress=False)
    assert d.samples.shape == (7, 6, 8)
    e = predict(model, v, nu=2, n_samples=7, max_rows=12, progress=False)  # 2 replicas per call
    assert e.samples.shape == (7, 6, 8)


def test_input_forms_and_sequence_outputs() -> None:
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(3, 5, 8)
    mask = torch.zeros(5, 5, dtype=torch.bool)  # not batch-sized: passed unchanged
    p1 = predict(enc, x, nu=3, n_samples=4, progress=False)
    p2 = predict(enc, (x, mask), nu=3, n_samples=4, progress=False)
    p3 = predict(enc, {"src": x, "mask": mask}, nu=3, n_samples=4, progress=False)
    assert p1.samples.shape == (4, 3, 5, 8)
    assert torch.equal(p1.samples, p2.samples) and torch.equal(p2.samples, p3.samples)
    p4 = predict(enc, x, nu=3, n_samples=4, output_fn=lambda o: o[:, 0], progress=False)
    assert p4.samples.shape == (4, 3, 8)


class _Flat(nn.Module):
    """Returns samples flattened: batch not in dim 0."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mha(x, x, x)[0].reshape(-1)


def test_errors(uniform) -> None:  # type: ignore[no-untyped-def]
    model, v = uniform
    with pytest.raises(ValueError, match="nu must be a positive int, got nu=0"):
        predict(model, v, nu=0, n_samples=2)
    with pytest.raises(ValueError, match="n_samples"):
        predict(model, v, nu=2, n_samples=0)
    with pytest.raises(ValueError, match="empty"):
        predict(model, v[:0], nu=2, n_samples=2)
    with pytest.raises(ValueError, match="batch-first"):
        predict(_Flat().eval(), torch.randn(2, 3, 8), nu=2, n_samples=2)
    with pytest.raises(TypeError, match="output_fn"):
        predict(model, v, nu=2, n_samples=2, output_fn=lambda o: {"x": o})
    with pytest.raises(TypeError, match="inputs must be"):
        predict(model, 3.0, nu=2, n_samples=2)


def test_one_sample_is_refused_where_a_spread_is_needed(uniform) -> None:  # type: ignore[no-untyped-def]
    """``n_samples=1`` gives no spread: ``predict`` refuses it up front (it used to fail later,
    inside CRPS), and a one-draw ``Predictive`` refuses ``std``, ``interval`` and ``crps`` with
    a message naming ``S`` instead of returning zeros or a zero-width interval (issue #23)."""
    model, v = uniform
    with pytest.raises(ValueError, match=r"n_samples must be >= 2.*n_samples=1"):
        predict(model, v, nu=2, n_samples=1)
    one = Predictive(samples=torch.randn(1, 6, 8))
    for what, fn in (("std", lambda: one.std), ("interval", lambda: one.interval(0.9)),
                     ("crps", lambda: one.crps(torch.zeros(6, 8)))):
        with pytest.raises(ValueError, match=rf"{what} needs at least 2 samples .*S=1"):
            fn()
    two = Predictive(samples=torch.randn(2, 6, 8))
    assert two.std.shape == two.interval(0.9)[0].shape == (6, 8)
    assert torch.isfinite(two.crps(torch.zeros(6, 8)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_recentre_mean_and_median_are_the_center(dtype: torch.dtype) -> None:
    """Mean: computed in float64 and rounded once, so the mean of the result is ``center`` up
    to half an ulp (of the dtype) of the largest recentred draw; median (the lower median):
    bit for bit. The spread is unchanged up to the same rounding."""
    from attnuq.predictive import recentre

    g = torch.Generator().manual_seed(0)
    for s in (1, 2, 7, 8):
        x = (3.0 + 10 * torch.randn(s, 5, 3, generator=g, dtype=torch.float64)).to(dtype)
        c = torch.randn(5, 3, generator=g, dtype=torch.float64).to(dtype)
        rm = recentre(x, c, "mean")
        assert rm.dtype == dtype and rm.shape == x.shape
        big = torch.maximum(rm.abs().amax(0), x.abs().amax(0)).to(torch.float64)  # (B, ...)
        ulp = torch.finfo(dtype).eps * big
        err = (rm.to(torch.float64).mean(0) - c.to(torch.float64)).abs()
        # the one rounding to dtype, plus the float64 means' own rounding (4 S ulps of float64)
        tol = 0.5 * ulp + 4 * s * torch.finfo(torch.float64).eps * big
        assert bool((err <= tol).all())
        rd = recentre(x, c, "median")
        assert torch.equal(rd.median(0).values, c)
        if s > 1:  # the spread is kept (differences of draws move by one rounding at most)
            torch.testing.assert_close(rm - rm[:1], x - x[:1], rtol=0, atol=float(4 * ulp.max()))
    with pytest.raises(ValueError, match="got how='mode'"):
        recentre(x, c, "mode")
    with pytest.raises(ValueError, match=r"center.shape=\(5,\)"):
        recentre(x, c[:, 0], "mean")


def test_predict_recentre_keeps_the_point_prediction(uniform) -> None:  # type: ignore[no-untyped-def]
    model, v = uniform
    raw = predict(model, v, nu=2, n_samples=9, seed=5, progress=False)
    for how in ("mean", "median"):
        rec = predict(model, v, nu=2, n_samples=9, seed=5, progress=False, recentre=how)
        assert rec.frozen is not None and raw.frozen is not None
        assert torch.equal(rec.frozen, raw.frozen)
        from attnuq.predictive import recentre

        assert torch.equal(rec.samples, recentre(raw.samples, raw.frozen, how))  # same draws
        if how == "median":
            assert torch.equal(rec.samples.median(0).values, rec.frozen)
        else:
            torch.testing.assert_close(rec.mean, rec.frozen, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="got recentre='yes'"):
        predict(model, v, nu=2, n_samples=3, recentre="yes")


@pytest.mark.parametrize(
    ("nu", "err", "match"),
    [(0, ValueError, "nu=0"), ("8", TypeError, "nu='8'"), ({"nope.*": 4}, ValueError, "nope"),
     ([4, 4, 4], ValueError, "3 entries")],
)
def test_bad_nu_is_refused_before_any_forward_pass(nu, err, match) -> None:  # type: ignore[no-untyped-def]
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    calls = []
    mha.register_forward_pre_hook(lambda *a: calls.append(1))

    class Wrap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = mha

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn(x, x, x, need_weights=False)[0]

    with pytest.raises(err, match=match):
        predict(Wrap().eval(), torch.randn(2, 3, 8), nu=nu, n_samples=2)
    assert calls == []  # the frozen pass never ran


def _encoder(d: int, ffn: int) -> nn.Module:
    layer = nn.TransformerEncoderLayer(d, 2, ffn, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()


def _calls(model: nn.Module, **kw: object) -> tuple[list[int], torch.Tensor]:
    """Batch sizes of the model calls of one predict (the frozen pass first)."""
    sizes: list[int] = []
    h = model.register_forward_pre_hook(lambda _m, args: sizes.append(int(args[0].shape[0])))
    try:
        x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(0))
        pred = predict(model, x, nu=2, n_samples=16, progress=False, **kw)  # type: ignore[arg-type]
    finally:
        h.remove()
    return sizes, pred.samples


def test_cpu_replicas_are_capped_by_the_widest_activation() -> None:
    """On the CPU the frozen pass measures the widest module output (here the feed-forward's
    (4, 6, 64) = 1536 elements for one replica) and each batched call keeps it under
    max_activation: 6144 allows 4 replicas, so 16 passes take 4 calls; the default cap
    (CPU_MAX_ACTIVATION) allows all 16 at once; batch_replicas overrides the cap; the hooks
    that measured it are gone afterwards."""
    from attnuq.montecarlo import CPU_MAX_ACTIVATION

    model = _encoder(8, 64)
    sizes, _ = _calls(model, max_activation=6144)
    assert sizes == [4] + [16] * 4
    sizes, _ = _calls(model, max_activation=1)  # below one replica: one replica per call
    assert sizes == [4] + [4] * 16
    assert CPU_MAX_ACTIVATION >= 16 * 1536
    sizes, _ = _calls(model)
    assert sizes == [4, 64]
    sizes, _ = _calls(model, max_activation=1, batch_replicas=8)
    assert sizes == [4, 32, 32]
    assert all(not m._forward_hooks for m in model.modules())
    with pytest.raises(ValueError, match="max_activation"):
        _calls(model, max_activation=0)


def test_widest_output_removes_its_hooks_when_the_call_raises() -> None:
    from attnuq.montecarlo import widest_output

    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    model = nn.Sequential(nn.Linear(3, 5), Boom())
    with pytest.raises(RuntimeError, match="boom"):
        widest_output(model, torch.randn(2, 3))
    assert all(not m._forward_hooks for m in model.modules())
