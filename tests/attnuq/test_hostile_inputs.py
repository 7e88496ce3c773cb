"""Hostile inputs to the public API that used to pass silently, give wrong numbers, or fail
deep inside torch: each is now refused at the entry, naming the argument and its value (or,
for low-precision metrics, computed in float32)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import attnuq
from attnuq import metrics
from attnuq.conformal_sets import ConformalSets, fit_sets
from attnuq.montecarlo import batch_size
from attnuq.nn import LevyAttention
from attnuq.nn.sampled import SampledAttention
from attnuq.predictive import GaussianPredictive, Predictive


def _encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()


# ----------------------------------------------------------------------------- predictives


def test_integer_predictives_are_refused() -> None:
    """An int mean would cast the level to 0 and give (-inf, -inf) intervals."""
    with pytest.raises(TypeError, match=r"mean must be a floating-point tensor, got "
                                        r"mean.dtype=torch.int64"):
        GaussianPredictive(mean=torch.zeros(3, dtype=torch.long), std=torch.ones(3))
    with pytest.raises(TypeError, match=r"std must be a floating-point tensor"):
        GaussianPredictive(mean=torch.zeros(3), std=torch.ones(3, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"samples must be a floating-point tensor"):
        Predictive(samples=torch.ones(4, 3, dtype=torch.long))


@pytest.mark.parametrize("factor", [-1.0, float("nan"), float("inf"), torch.tensor([1.0, -0.5])])
def test_negative_or_non_finite_scale_factor_is_refused(factor: object) -> None:
    g = GaussianPredictive(mean=torch.zeros(2), std=torch.ones(2))
    p = Predictive(samples=torch.randn(5, 2))
    for pred in (g, p):
        with pytest.raises(ValueError, match=r"factor must be finite and >= 0"):
            pred.scaled(factor)  # type: ignore[arg-type]
    # a valid factor still scales the spread
    assert torch.equal(g.scaled(2.0).std, torch.full((2,), 2.0))


@pytest.mark.parametrize("n", [0, -1, 2.5, True])
def test_gaussian_sample_count_is_checked(n: object) -> None:
    g = GaussianPredictive(mean=torch.zeros(2), std=torch.ones(2))
    with pytest.raises((TypeError, ValueError), match=rf"n must be a positive int, got n={n}"):
        g.sample(n)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- metrics


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_metrics_are_computed_in_float32(dtype: torch.dtype) -> None:
    """S = 2000 draws near 100: the pair sum overflows float16 (NaN before) and bfloat16's
    8-bit mantissa moved the CRPS by 6 %; now the inputs are rounded once to ``dtype`` and
    the metric computed in float32, so it matches float64 on the same rounded inputs to
    float32 precision."""
    g = torch.Generator().manual_seed(0)
    s = (torch.randn(2000, 10, generator=g) * 3 + 100).to(dtype)
    y = torch.full((10,), 100.0).to(dtype)
    got = metrics.crps_samples(s, y)
    want = metrics.crps_samples(s.double(), y.double())
    assert got.dtype == torch.float32
    assert math.isfinite(float(got))
    assert float(got) == pytest.approx(float(want), rel=1e-4)
    rmse = metrics.lat_weighted_rmse(torch.full((2, 3, 4), 300.0).to(dtype),
                                     torch.zeros(2, 3, 4).to(dtype), torch.tensor([0.0, 10, 20]))
    assert float(rmse) == pytest.approx(300.0, rel=1e-5)


def test_entropy_and_mutual_information_refuse_non_probabilities() -> None:
    with pytest.raises(ValueError, match=r"probs must lie in \[0, 1\]"):
        metrics.entropy_probs(torch.tensor([5.0, 3.0]))
    with pytest.raises(ValueError, match=r"every row of probs .* must sum to 1, got sum=0.5 "
                                         r"at probs\[\(1,\)\]"):
        metrics.entropy_probs(torch.tensor([[0.5, 0.5], [0.25, 0.25]]))
    with pytest.raises(ValueError, match=r"prob_samples must lie in \[0, 1\]"):
        metrics.mutual_information_samples(torch.tensor([[[2.0, -1.0]], [[0.5, 0.5]]]))
    # probabilities still pass: two confident, opposite draws carry ln 2 nats
    s = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])
    assert float(metrics.mutual_information_samples(s)[0]) == pytest.approx(math.log(2))


def test_latitude_weights_refuse_only_the_poles() -> None:
    """cos(90 deg) rounds to 6e-17: the poles-only guard never fired and gave [1, 1]."""
    with pytest.raises(ValueError, match=r"only the poles given"):
        metrics.latitude_weights(torch.tensor([90.0, -90.0]))
    w = metrics.latitude_weights(torch.tensor([-90.0, 0.0, 90.0]))
    assert w.tolist() == [0.0, 3.0, 0.0]


# ----------------------------------------------------------------------------- sets, flags


def test_set_rule_from_dict_checks_every_field() -> None:
    base = fit_sets(torch.tensor([[0.7, 0.3]] * 10 + [[0.2, 0.8]] * 9),
                    torch.tensor([0] * 10 + [1] * 9), alpha=0.1, score="lac").to_dict()
    assert ConformalSets.from_dict(base).to_dict() == base
    cases = [({"threshold": float("nan")}, ValueError, "finite float threshold"),
             ({"threshold": True}, ValueError, "threshold=True"),
             ({"n": True}, ValueError, "int n >= 1, got n=True"),
             ({"n": 5}, ValueError, r"n=5 examples support alpha >= 1/\(n\+1\)"),
             ({"randomized": "no"}, TypeError, "randomized must be a bool, got randomized='no'"),
             ({"nonempty": 1}, TypeError, "nonempty must be a bool, got nonempty=1")]
    for change, err, match in cases:
        with pytest.raises(err, match=match):
            ConformalSets.from_dict({**base, **change})
    with pytest.raises(TypeError, match="d must be a dict"):
        ConformalSets.from_dict([base])  # type: ignore[arg-type]


def test_flags_are_bools_not_truthy_values() -> None:
    p = torch.tensor([[0.7, 0.3], [0.2, 0.8]] * 10)
    y = torch.tensor([0, 1] * 10)
    with pytest.raises(TypeError, match="randomized must be a bool, got randomized='no'"):
        fit_sets(p, y, randomized="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="stochastic must be a bool, got stochastic='no'"):
        SampledAttention(nu=2, stochastic="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="enable_gqa must be a bool, got enable_gqa=1"):
        SampledAttention(nu=2, enable_gqa=1)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- models, inputs


def test_meta_device_model_is_refused_before_any_pass() -> None:
    with torch.device("meta"):
        m = _encoder()
    x = torch.randn(3, 5, 8)
    match = r"model has parameters or buffers on the meta device \(no data\), e.g. 'layers"
    with pytest.raises(ValueError, match=match):
        attnuq.predict(m, x, nu=4, n_samples=2)
    with pytest.raises(ValueError, match=match):
        attnuq.calibrate(m, [(x, x)], n_passes=2)
    with pytest.raises(ValueError, match=match):
        attnuq.SARegressor(m)


def test_batch_size_skips_zero_dim_tensors() -> None:
    """A 0-d keyword (a scale) before the batched input no longer hides the batch."""
    x = torch.randn(4, 5, 8)
    assert batch_size({"scale": torch.tensor(2.0), "x": x}) == 4
    assert batch_size((torch.tensor(1.0), x)) == 4
    with pytest.raises(ValueError, match="no tensor with a batch dimension"):
        batch_size({"scale": torch.tensor(2.0)})

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = _encoder()

        def forward(self, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return self.enc(x).mean((1, 2)) * scale

    pred = attnuq.predict(Scaled().eval(), {"scale": torch.tensor(2.0), "x": x}, nu=4,
                          n_samples=2)
    assert pred.samples.shape == (2, 4)


@pytest.mark.parametrize(("value", "err"), [(float("inf"), ValueError), (True, ValueError),
                                            ("x", ValueError), (0.0, ValueError)])
def test_levy_max_period_must_be_a_finite_positive_float(value: object, err: type) -> None:
    with pytest.raises(err, match=rf"max_period must be a finite float > 0, got "
                                  rf"max_period={value!r}"):
        LevyAttention(3, 16, 4, max_period=value)  # type: ignore[arg-type]


def test_levy_inputs_of_another_dtype_are_named() -> None:
    layer = LevyAttention(3, 16, 4, out_features=1)
    B, N = 2, 10
    t = torch.rand(B, N) * 48
    c = torch.randint(0, 3, (B, N))
    v = torch.randn(B, N)
    mk = torch.ones(B, N, dtype=torch.bool)
    qt = torch.linspace(0, 48, 3).expand(B, 3)
    with pytest.raises(ValueError, match=r"must have the layer's dtype torch.float32 .* got "
                                         r"times.dtype=torch.float64"):
        layer(t.double(), c, v, mk, qt)
    out = layer.double()(t.double(), c, v.double(), mk, qt.double())  # one dtype: fine
    assert out.mean.dtype == torch.float64


def test_calibrate_settings_check_has_calibrates_names_and_defaults() -> None:
    """``check_calibrate_settings`` checks the settings ``calibrate`` takes, with its defaults:
    the two signatures may not drift apart."""
    import inspect

    from attnuq.calibration import calibrate, check_calibrate_settings

    def params(f: object) -> dict[str, object]:
        sig = inspect.signature(f)  # type: ignore[arg-type]
        return {n: p.default for n, p in sig.parameters.items()
                if n not in ("model", "data") and not n.startswith("_")}

    assert params(check_calibrate_settings) == params(calibrate)


def test_predict_refuses_a_model_in_training_mode_before_any_pass() -> None:
    """Its frozen pass would already be random (dropout): refused at the entry, where it used
    to run the frozen pass and fail only inside the first stochastic pass."""
    calls = []
    m = _encoder()
    m.register_forward_hook(lambda *_: calls.append(1))
    m.train()
    with pytest.raises(ValueError, match=r"model is in training mode .* call model.eval\(\)"):
        attnuq.predict(m, torch.randn(2, 5, 8), nu=2, n_samples=2)
    assert calls == []
    assert attnuq.predict(m.eval(), torch.randn(2, 5, 8), nu=2, n_samples=2).samples.shape \
        == (2, 2, 5, 8)


# ----------------------------------------------------------------------------- classification


class _Clf(nn.Module):
    """A one-layer encoder classifier: ``(B, 5, 8) -> (B, C)`` (``C = 1``: one binary logit),
    or per-token logits ``(B, 5, C)`` with ``tokens``."""

    def __init__(self, c: int, tokens: bool = False) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(8, c)
        self.tokens = tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(x)
        return 3 * self.head(h if self.tokens else h.mean(1))


def test_prediction_sets_score_test_inputs_as_the_calibration_inputs_were() -> None:
    """The calibration scores were float64, the test scores came from float32 probabilities:
    APS scores of 1 + 3e-8 fell above a threshold of 1.0 and the sets of the calibration inputs
    themselves covered 0.87 at alpha = 0.02. Re-predicting the calibration part (same seed,
    same draws) must now cover at least ceil((n + 1)(1 - alpha)) of its n labels, exactly."""
    torch.manual_seed(0)
    net = _Clf(1).eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 5, 8, generator=g)
    y = torch.randint(0, 2, (200,), generator=g)
    clf = attnuq.SAClassifier(net, nu=4, n_samples=4, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an untrained net at a fixed nu: diagnostics warn
        clf.fit([(x[:100], y[:100])], [(x[100:], y[100:])])
    for alpha in (0.02, 0.05, 0.1):
        sets = clf.predict_set(x[100:], alpha)
        covered = int(sets[torch.arange(100), y[100:]].sum())
        assert covered >= math.ceil(101 * (1 - alpha) - 1e-9), (alpha, covered)


def test_a_batch_without_labels_is_skipped_not_refused() -> None:
    """A batch whose every target is ignore_index (a prompt-only batch) holds no row; the fit
    goes on with the other batches, and refuses only a part without any label."""
    torch.manual_seed(0)
    net = _Clf(4, tokens=True).eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(30, 5, 8, generator=g)
    y = torch.randint(0, 4, (30, 5), generator=g)
    none = torch.full((10, 5), -100)
    clf = attnuq.SAClassifier(net, nu=2, n_samples=4, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clf.fit([(x[:10], y[:10]), (x[10:20], none)], [(x[20:], y[20:])])
    assert clf.diagnostics["n_val"] == 50
    with pytest.raises(ValueError, match="ignore_index"):
        attnuq.SAClassifier(net, nu=2, n_samples=4, progress=False).fit(
            [(x[10:20], none)], [(x[20:], y[20:])])
    with pytest.raises(ValueError, match=r"every target of data equals ignore_index=-100"):
        attnuq.calibrate(net, [(x[10:20], none)], criterion="nll", n_passes=2)


def test_categorical_helpers_refuse_what_they_cannot_score() -> None:
    from attnuq.categorical import CategoricalPredictive, fit_temperature, mc_nll

    g = torch.Generator().manual_seed(0)
    z = torch.randn(4, 10, 3, generator=g)
    y = torch.randint(0, 3, (10,), generator=g)
    with pytest.raises(ValueError, match=r"labels must be \(N,\) with N = .* = 10, got "
                                         r"labels.shape=\(5,\)"):
        mc_nll(z, y[:5])
    for t in (0.0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="temperature must be a finite float > 0"):
            mc_nll(z, y, t)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\)|labels"):
        mc_nll(z, torch.full((10,), -100))
    with pytest.raises(ValueError, match="logit_samples holds NaN or inf"):
        fit_temperature(torch.full((10, 3), float("nan")), y)
    with pytest.raises(ValueError, match="non-empty"):
        fit_temperature(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))
    with pytest.raises(TypeError, match="samples must be floating-point probabilities"):
        CategoricalPredictive(samples=torch.ones(2, 3, 2, dtype=torch.long))
    # low-precision logits: the softmax in float32, so the rows sum to 1 and entropy works
    pred = CategoricalPredictive.from_logits(z.bfloat16() * 20)
    assert pred.samples.dtype == torch.float32
    assert torch.isfinite(pred.entropy).all()


# ----------------------------------------------------------------------------- Levy side


def test_float32_sampler_picks_observations_with_their_probabilities_on_many_rows() -> None:
    """The sampler searched ``r + cdf`` in the input dtype: in float32 the rows past ~1e5 could
    not tell their observations apart (frequencies 0.073 against p = 0.037 at 2^21 rows). Each
    atom's observation frequency must match p: |z| < 5 on each of the 6 observations (a
    false failure has probability below 6 x 6e-7)."""
    from attnuq.ops.levy import levy_attention, levy_attention_sample

    n, rows = 6, 1 << 20
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, 4, generator=g).expand(1, 1, rows, 4).contiguous()
    k = torch.randn(1, 1, n, 4, generator=g)
    a = torch.eye(n)[None, None]  # a_i = e_i: an atom's value names its observation
    t = torch.zeros(1, n)
    m = torch.ones(1, n, dtype=torch.bool)
    kw = {"alpha": 1.0, "beta": 8.0, "h": 0.0}
    p = levy_attention(q[:, :, :1], k, a, t, m, **kw).mean[0, 0, 0].double()
    s = levy_attention_sample(q, k, a, t, m, num_samples=1,
                              generator=torch.Generator().manual_seed(1), **kw)
    cnt = s.counts[0, 0, 0].double()
    freq = (s.values[0, 0, 0].double() * cnt[:, None]).sum(0) / cnt.sum()
    se = (p * (1 - p) / cnt.sum()).sqrt().clamp_min(1e-12)
    assert float(((freq - p) / se).abs().max()) < 5, (freq.tolist(), p.tolist())


def test_forecast_loss_ignores_padding_and_checks_sigma() -> None:
    from attnuq.models.levy_forecaster import LevyForecaster, forecast_loss

    torch.manual_seed(0)
    model = LevyForecaster(3, d=16).eval()
    B, L, Q = 2, 5, 4
    out = model(torch.rand(B, L), torch.randint(0, 3, (B, L)), torch.rand(B, L),
                torch.ones(B, L, dtype=torch.bool), torch.rand(B, Q), torch.randint(0, 3, (B, Q)))
    y = torch.randn(B, Q)
    mask = torch.tensor([[True, True, False, False], [True, True, True, False]])
    padded = torch.where(mask, y, torch.full_like(y, float("nan")))
    for w in (0.0, 1.0):
        assert torch.equal(forecast_loss(out, padded, mask, weight=w),
                           forecast_loss(out, y, mask, weight=w))
    one_nan = y.clone()
    one_nan[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"targets holds 1 NaN/inf value\(s\) at observed"):
        forecast_loss(out, one_nan, mask, weight=0.0)
    from dataclasses import replace

    with pytest.raises(ValueError, match=r"out.sigma_total must have the targets' shape"):
        forecast_loss(replace(out, sigma_total=out.sigma_total[:, :1]), y, mask, weight=1.0)
    with pytest.raises(ValueError, match=r"out.sigma_total must be finite and >= 0"):
        forecast_loss(replace(out, sigma_total=-out.sigma_total), y, mask, weight=1.0)


def test_levy_forecaster_takes_empty_batches_and_checks_its_settings() -> None:
    from attnuq.models.levy_forecaster import LevyForecaster

    model = LevyForecaster(3, d=16).eval()  # one encoder layer by default
    qt, qc = torch.rand(2, 4), torch.randint(0, 3, (2, 4))
    for b, n in ((2, 0), (0, 5)):
        out = model(torch.rand(b, n), torch.zeros(b, n, dtype=torch.long), torch.rand(b, n),
                    torch.ones(b, n, dtype=torch.bool), qt[:b], qc[:b])
        assert out.mean.shape == (b, 4)
    alpha = LevyForecaster(3, alpha=800.0).layer_params()["alpha"].detach()
    assert float(alpha) == pytest.approx(800)
    for kw, match in (({"d": 33}, "d must be divisible"), ({"encoder_layers": 1.5},
                      "encoder_layers must be an int"), ({"dropout": "x"}, "dropout must be")):
        with pytest.raises(ValueError, match=match):
            LevyForecaster(3, **kw)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="obs_channels must be an integer tensor"):
        model(torch.rand(2, 5), torch.zeros(2, 5), torch.rand(2, 5),
              torch.ones(2, 5, dtype=torch.bool), qt, qc)


def test_sampler_with_no_value_dimension_and_a_field() -> None:
    from attnuq.ops.levy import levy_attention_sample

    q, k = torch.randn(1, 2, 2, 4), torch.randn(1, 2, 3, 4)
    out = levy_attention_sample(q, k, torch.zeros(1, 2, 3, 0), torch.rand(1, 3),
                                torch.ones(1, 3, dtype=torch.bool), alpha=1.0, beta=2.0, h=0.1,
                                omega=torch.ones(2), phase=torch.zeros(2),
                                D=torch.zeros(2, 0, 2), num_samples=3)
    assert out.values.shape == (3, 1, 2, 2, 0)


def test_reference_keeps_an_overflowed_variance_and_takes_the_field_in_q_dtype() -> None:
    """An overflowed variance (inf - inf) read as sigma = 0 in the reference, a confident
    spread; it is NaN there now, as on the fast path. A float64 field with float32 inputs is
    cast as levy_attention casts it."""
    from attnuq.ops.levy import levy_attention, levy_attention_reference

    f64 = torch.float64
    q, k = torch.randn(1, 1, 1, 4, dtype=f64), torch.randn(1, 1, 3, 4, dtype=f64)
    sign = torch.tensor([1.0, -1.0, 1.0], dtype=f64)[:, None]
    a = torch.full((1, 1, 3, 2), 1e200, dtype=f64) * sign  # squares overflow to inf
    t, m = torch.rand(1, 3, dtype=f64), torch.ones(1, 3, dtype=torch.bool)
    kw = {"alpha": 1.0, "beta": 2.0, "h": 0.1}
    assert torch.isnan(levy_attention_reference(q, k, a, t, m, **kw).sigma).all()
    field = {"omega": torch.rand(3, dtype=f64), "phase": torch.rand(3, dtype=f64),
             "D": torch.randn(2, 3, dtype=f64)}
    args = [x.float() for x in (q, k, torch.randn(1, 1, 3, 2, dtype=f64), t)]
    ref = levy_attention_reference(*args, m, **kw, **field)
    fast = levy_attention(*args, m, **kw, **field)
    assert ref.mean.dtype == torch.float32
    torch.testing.assert_close(ref.mean, fast.mean, rtol=1e-4, atol=1e-5)


def test_levy_messages_name_the_argument() -> None:
    from attnuq.ops.levy import levy_attention

    q, k, a = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 2)
    t, m = torch.rand(1, 3), torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match="alpha must be a float or a tensor, got alpha='1'"):
        levy_attention(q, k, a, t, m, alpha="1", beta=2.0, h=0.1)  # type: ignore[arg-type]
    layer = LevyAttention(3, 16, 4, out_features=1)
    with pytest.raises(ValueError, match=r"query_channels must be an int64 tensor .* got "
                                         r"torch.int32 of shape \(2, 3\)"):
        layer(torch.rand(2, 4), torch.zeros(2, 4, dtype=torch.long), torch.randn(2, 4),
              torch.ones(2, 4, dtype=torch.bool), torch.rand(2, 3),
              query_channels=torch.zeros(2, 3, dtype=torch.int32))
