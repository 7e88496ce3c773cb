"""SAClassifier on tiny models: probabilities, the huge-nu limit, the NLL search, temperature
scaling, conformal sets, save/load, per-token language-model logits, and every bad input."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from attnuq import SAClassifier
from attnuq import metrics as M
from attnuq.categorical import fit_temperature, mc_nll
from attnuq.estimators._common import EstimatorWarning


class Tiny(nn.Module):
    """A one-layer transformer classifier over 6 tokens of 2 features."""

    def __init__(self, c: int = 3, d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(2, d)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(d, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.inp(x)).mean(1))


class Scaled(nn.Module):
    """``base`` with its logits multiplied by ``k`` (``k > 1``: over-confident)."""

    def __init__(self, base: nn.Module, k: float) -> None:
        super().__init__()
        self.base, self.k = base, k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.k * self.base(x)


def synth(n: int, g: torch.Generator, c: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels from a noisy score of the first feature's mean (classes by thresholds)."""
    x = torch.randn(n, 6, 2, generator=g)
    s = 3 * x[..., 0].mean(1) + 0.7 * torch.randn(n, generator=g)
    if c == 2:
        return x, (s > 0).long()
    return x, (s > -0.5).long() + (s > 0.5).long()


def train(c: int = 3, epochs: int = 80) -> nn.Module:
    torch.manual_seed(0)
    m = Tiny(c=1 if c == 2 else c)
    x, y = synth(600, torch.Generator().manual_seed(0), c)
    opt = torch.optim.Adam(m.parameters(), 2e-2)
    for _ in range(epochs):
        opt.zero_grad()
        out = m(x)
        loss = (nn.functional.binary_cross_entropy_with_logits(out[:, 0], y.float()) if c == 2
                else nn.functional.cross_entropy(out, y))
        loss.backward()
        opt.step()
    return m.eval()


@pytest.fixture(scope="module")
def model() -> nn.Module:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train()
    finally:
        torch.set_num_threads(n)


def quiet_fit(clf: SAClassifier, val: Any, cal: Any = None) -> SAClassifier:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EstimatorWarning)
        return clf.fit(val, cal)


# ------------------------------------------------------------------------------ the predictive
def test_probabilities_and_uncertainty_decomposition(model: nn.Module) -> None:
    g = torch.Generator().manual_seed(1)
    val, cal = synth(200, g), synth(200, g)
    clf = quiet_fit(SAClassifier(model, nu=4, n_samples=16, progress=False), [val], [cal])
    x, _ = synth(50, g)
    pred = clf.predict(x)
    assert pred.samples.shape == (16, 50, 3) and pred.probs.shape == (50, 3)
    assert torch.allclose(pred.samples.sum(-1), torch.ones(16, 50), atol=1e-6)
    assert torch.allclose(pred.probs.sum(-1), torch.ones(50), atol=1e-6)
    assert torch.allclose(pred.entropy, pred.expected_entropy + pred.mutual_information,
                          atol=1e-5)
    assert bool((pred.mutual_information >= 0).all()) and float(pred.mutual_information.max()) > 0
    # the probability draws are softmax of the temperature-scaled logit draws
    assert pred.logits is not None
    assert torch.allclose(pred.samples, pred.logits.softmax(-1))
    t = clf.diagnostics["temperature"]
    with torch.no_grad():
        frozen = (model(x) / t).softmax(-1)
    assert pred.frozen is not None and torch.allclose(pred.frozen, frozen, atol=1e-6)


def test_huge_nu_reproduces_frozen_probabilities(model: nn.Module) -> None:
    """Deviation from the frozen softmax shrinks like 1/sqrt(nu): a factor ~64 from nu = 1 to
    nu = 4096; we ask for 8 (and an absolute 0.02)."""
    g = torch.Generator().manual_seed(2)
    val = synth(100, g)
    x, _ = synth(40, g)
    with torch.no_grad():
        frozen = model(x).softmax(-1)
    dev = {}
    for nu in (1, 4096):
        clf = quiet_fit(SAClassifier(model, nu=nu, temperature=None, n_samples=8,
                                     progress=False), [val])
        dev[nu] = float((clf.predict(x).probs - frozen).abs().max())
    assert dev[4096] < 0.02 and dev[4096] < dev[1] / 8, dev


def test_nll_search_picks_nu_and_reports(model: nn.Module) -> None:
    g = torch.Generator().manual_seed(3)
    val = synth(200, g)
    clf = quiet_fit(SAClassifier(model, nu_range=(1, 256), n_samples=8, n_passes=6,
                                 progress=False, max_evals=4), [val])
    rep = clf.report
    assert rep.criterion == "nll-temperature" and clf.diagnostics["criterion"] == "nll-temperature"
    evals = {e.nu: e for e in rep.evaluations}
    assert clf.diagnostics["nu"] == rep.nu in evals and 1 <= rep.nu <= 256
    # each evaluation's objective is the NLL of the MC mean at that nu's best temperature,
    # which no fixed T = 1 beats
    for e in rep.evaluations:
        assert e.objective <= e.values["nll"] + 1e-9
        assert e.objective == pytest.approx(e.values["nll_temperature"])
    after = quiet_fit(SAClassifier(model, nu_range=(1, 256), temperature="after", n_samples=8,
                                   n_passes=6, progress=False, max_evals=4), [val])
    assert after.report.criterion == "nll"


def test_calibrate_takes_integer_labels_with_a_classification_criterion(model: nn.Module) -> None:
    """The low-level search on a classifier (integer labels, logits (B, C)): the issue's
    ``calibrate`` failure with integer labels is gone for the classification criteria."""
    from attnuq import calibrate

    g = torch.Generator().manual_seed(12)
    x, y = synth(100, g)
    rep = calibrate(model, [(x, y)], criterion="nll", n_passes=4, max_evals=3, progress=False)
    assert 1 <= rep.nu <= 1024 and rep.n_examples == 100
    assert set(rep.evaluations[0].values) == {"nll", "nll_temperature", "temperature",
                                              "scale_ratio"}
    with pytest.raises(ValueError, match="prediction and targets must have the same shape"):
        calibrate(model, [(x, y)], criterion="auto", n_passes=4, max_evals=2, progress=False)
    with pytest.raises(ValueError, match=r"per_layer='geometric' is not available with the "
                                         r"classification criterion='nll'"):
        calibrate(model, [(x, y)], criterion="nll", per_layer="geometric")


def test_nll_criterion_matches_a_direct_computation() -> None:
    """The registered criterion's objective is -mean ln(mean_m softmax(f + d_m))_y."""
    from sklearn.metrics import log_loss

    from attnuq.calibration.criteria import PassStats, get_criterion

    g = torch.Generator().manual_seed(4)
    f = torch.randn(30, 4, generator=g, dtype=torch.float64)
    d = 0.5 * torch.randn(5, 30, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (30,), generator=g)
    oh = nn.functional.one_hot(y, 4).double()
    st = PassStats.from_deviations([d], [oh - f.softmax(-1)], logits=[f], labels=[y])
    v = get_criterion("nll").objective(st, 0.9, 1.0)
    pbar = (f + d).softmax(-1).mean(0)
    assert v.objective == pytest.approx(log_loss(y.numpy(), pbar.numpy(), labels=range(4)),
                                        rel=1e-10)
    t = fit_temperature(f + d, y)
    vt = get_criterion("nll-temperature").objective(st, 0.9, 1.0)
    assert vt.objective == pytest.approx(float(mc_nll(f + d, y, t).mean()), rel=1e-10)
    assert vt.objective <= v.objective + 1e-12


def test_temperature_scaling_reduces_nll_of_an_overconfident_model(model: nn.Module) -> None:
    over = Scaled(model, 4.0).eval()
    g = torch.Generator().manual_seed(5)
    val, test = synth(300, g), synth(1000, g)
    clf = quiet_fit(SAClassifier(over, nu=8, n_samples=8, progress=False), [val])
    d = clf.diagnostics
    assert d["temperature"] > 2.0  # undoes most of the factor 4
    assert d["val"]["temperature_scaling"]["nll"] < d["val"]["frozen"]["nll"]
    assert d["val"]["sa"]["nll"] < d["val"]["frozen"]["nll"]
    with torch.no_grad():
        frozen_test = over(test[0]).softmax(-1)
    nll_frozen = float(M.nll_probs(frozen_test, test[1]))
    nll_sa = float(M.nll_probs(clf.predict(test[0]).probs, test[1]))
    assert nll_sa < nll_frozen, (nll_sa, nll_frozen)  # on fresh data too


def test_joint_rule_is_invariant_to_logit_scale_and_after_is_not(model: nn.Module) -> None:
    """The temperature rule's justification, checked: profiled over T ("joint"), the NLL of
    softmax(c z_s / T) depends on c / T only, so rescaling the frozen logits by c = 4 leaves
    the grid's choice of nu unchanged and multiplies T by 4 (same seeds: same draws). Scored at
    T = 1 ("after"), the over-confident model makes the search buy spread with fewer draws."""
    g = torch.Generator().manual_seed(11)
    val = synth(300, g)
    over = Scaled(model, 4.0).eval()
    kw: dict[str, Any] = {"search": "grid", "grid_size": 7, "n_samples": 8, "n_passes": 8,
                          "progress": False}
    joint = quiet_fit(SAClassifier(model, **kw), [val])
    joint_over = quiet_fit(SAClassifier(over, **kw), [val])
    after_over = quiet_fit(SAClassifier(over, temperature="after", **kw), [val])
    assert joint_over.diagnostics["nu"] == joint.diagnostics["nu"]
    assert joint_over.diagnostics["temperature"] == pytest.approx(
        4 * joint.diagnostics["temperature"], rel=1e-3)  # Brent's tolerance on ln T: 1e-4
    assert after_over.diagnostics["nu"] < joint_over.diagnostics["nu"]


def test_sets_cover_at_the_nominal_rate(model: nn.Module) -> None:
    """Mean coverage over R = 8 random cal/test splits of a pool is within 5 sd of
    k/(n+1) = ceil(0.9 (n+1))/(n+1): one split's coverage has variance at most
    Var(Beta(k, n+1-k)) + 1/(4 m); 5 sd of the mean: false failure < 6e-7 (normal tail)."""
    g = torch.Generator().manual_seed(6)
    val = synth(200, g)
    pool_x, pool_y = synth(1400, g)
    n, m, r, alpha = 300, 1100, 8, 0.1
    covs = []
    for i in range(r):
        perm = torch.randperm(1400, generator=torch.Generator().manual_seed(100 + i))
        ci, ti = perm[:n], perm[n:]
        clf = quiet_fit(SAClassifier(model, nu=4, n_samples=8, progress=False), [val],
                        [(pool_x[ci], pool_y[ci])])
        sets = clf.predict_set(pool_x[ti], alpha=alpha)
        assert sets.shape == (m, 3) and sets.dtype == torch.bool
        covs.append(float(M.set_coverage(sets, pool_y[ti])))
    k = math.ceil((n + 1) * (1 - alpha))
    a, b = k, n + 1 - k
    sd = math.sqrt((a * b / ((a + b) ** 2 * (a + b + 1)) + 0.25 / m) / r)
    mean = sum(covs) / r
    assert mean >= 1 - alpha - 5 * sd, (mean, sd)
    assert mean <= k / (n + 1) + 5 * sd + 0.02, (mean, sd)  # + non-empty sets' extra cover


def test_binary_model_has_two_columns() -> None:
    m = train(c=2, epochs=40)
    g = torch.Generator().manual_seed(7)
    val, cal = synth(150, g, c=2), synth(150, g, c=2)
    clf = quiet_fit(SAClassifier(m, nu=4, n_samples=8, progress=False), [val], [cal])
    x, _ = synth(10, g, c=2)
    pred = clf.predict(x)
    assert pred.probs.shape == (10, 2)
    t = clf.diagnostics["temperature"]
    with torch.no_grad():
        p1 = torch.sigmoid(m(x)[:, 0] / t)
    assert pred.frozen is not None and torch.allclose(pred.frozen[:, 1], p1, atol=1e-6)
    assert clf.predict_set(x, alpha=0.2).shape == (10, 2)


# ------------------------------------------------------------------------------ save / load
def test_save_load_round_trip(model: nn.Module, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(8)
    val, cal = synth(120, g), synth(120, g)
    clf = quiet_fit(SAClassifier(model, nu_range=(1, 64), n_samples=8, n_passes=4,
                                 max_evals=3, progress=False), [val], [cal])
    p = clf.save(tmp_path / "clf.json")
    back = SAClassifier.load(p, model)
    x, _ = synth(20, g)
    assert torch.equal(back.predict(x).samples, clf.predict(x).samples)  # same seed, same draws
    assert torch.equal(back.predict_set(x, alpha=0.15), clf.predict_set(x, alpha=0.15))
    assert back.diagnostics["nu"] == clf.diagnostics["nu"]
    other = Tiny()
    with pytest.raises(ValueError, match="was fitted on another model"):
        SAClassifier.load(p, other)
    obj = json.loads(p.read_text())
    obj["fitted"]["temperature"] = -1.0
    (tmp_path / "bad.json").write_text(json.dumps(obj))
    with pytest.raises(ValueError, match=r"fitted\.temperature must be a finite float > 0"):
        SAClassifier.load(tmp_path / "bad.json", model)
    (tmp_path / "torn.json").write_text(p.read_text()[:50])
    with pytest.raises(ValueError, match="not valid JSON"):
        SAClassifier.load(tmp_path / "torn.json", model)


# ------------------------------------------------------------------------------ language models
def _lm(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(vocab_size=13, n_positions=16, n_embd=16, n_layer=1,
                                          n_head=2, initializer_range=0.5,
                                          bos_token_id=0, eos_token_id=0)).eval()
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=13, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, max_position_embeddings=16,
        initializer_range=0.5, bos_token_id=0, eos_token_id=0, pad_token_id=0)).eval()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_per_token_language_model(kind: str) -> None:
    m = _lm(kind)
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 13, (30, 8), generator=g)
    am = torch.ones_like(ids)
    am[::3, 6:] = 0  # padded rows
    tgt = torch.full_like(ids, -100)
    tgt[:, :-1] = ids[:, 1:]  # next-token targets, aligned with the logits
    tgt[am == 0] = -100
    x = {"input_ids": ids, "attention_mask": am}

    def part(sl: slice) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        return [({k: v[sl] for k, v in x.items()}, tgt[sl])]

    clf = quiet_fit(SAClassifier(m, output_fn=lambda o: o.logits, nu=2, temperature=None,
                                 n_samples=8, progress=False), part(slice(0, 15)),
                    part(slice(15, 30)))
    assert clf.diagnostics["per_token"] and clf.diagnostics["n_classes"] == 13
    assert clf.diagnostics["n_val"] == int((tgt[:15] != -100).sum())  # -100 left out
    xb = {k: v[:4] for k, v in x.items()}
    pred = clf.predict(xb)
    assert pred.probs.shape == (4, 8, 13) and pred.samples.shape == (8, 4, 8, 13)
    assert pred.entropy.shape == (4, 8) and pred.mutual_information.shape == (4, 8)
    assert torch.allclose(pred.probs.sum(-1), torch.ones(4, 8), atol=1e-5)
    mi = pred.mutual_information
    assert bool((mi >= 0).all()) and float(mi.max()) > 1e-4  # SA moves the token probabilities
    with torch.no_grad():
        frozen = m(**xb).logits.softmax(-1)
    assert pred.frozen is not None and torch.allclose(pred.frozen, frozen, atol=1e-5)
    sets = clf.predict_set(xb, alpha=0.3)
    assert sets.shape == (4, 8, 13) and bool(sets.any(-1).all())


# ------------------------------------------------------------------------------ bad input
def test_bad_inputs_name_the_value(model: nn.Module) -> None:
    g = torch.Generator().manual_seed(10)
    x, y = synth(40, g)
    clf = SAClassifier(model, nu=2, n_samples=4, progress=False)
    with pytest.raises(ValueError, match=r"class ids in \[0, 3\), got .*=3"):
        clf.fit([(x, torch.full((40,), 3))])
    with pytest.raises(ValueError, match=r"class ids in \[0, 3\), got .*=-2"):
        clf.fit([(x, torch.full((40,), -2))])
    with pytest.raises(ValueError, match=r"integer class ids, got .*=0.5"):
        clf.fit([(x, torch.full((40,), 0.5))])
    with pytest.raises(ValueError, match=r"logits of shape \(B, L, C\) for val_data targets "
                                         r"\(batch 0\).shape=\(40, 6\), got output "
                                         r"shape=\(40, 3\)"):
        clf.fit([(x, torch.zeros(40, 6, dtype=torch.long))])
    with pytest.raises(ValueError, match=r"must be logits of shape \(B,\), \(B, C\) or "
                                         r"\(B, L, C\), got shape=\(40, 3, 1, 1\)"):
        SAClassifier(lambda_module(lambda z: z[..., None, None]), nu=2).fit([(x, y)])
    with pytest.raises(RuntimeError, match="not fitted"):
        clf.predict(x)
    quiet_fit(clf, [(x[:20], y[:20])], [(x[20:], y[20:])])
    for bad in (0, 1, -0.5, 2.0, True):
        with pytest.raises(ValueError, match=r"alpha must be a float in \(0, 1\), got alpha="):
            clf.predict_set(x, alpha=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"n=20 examples support alpha >= 1/\(n\+1\) = 0.04762"):
        clf.predict_set(x, alpha=0.01)
    with pytest.raises(ValueError, match=r"temperature must be None or one of \('joint', "
                                         r"'after'\), got temperature='before'"):
        SAClassifier(model, temperature="before")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"score must be one of .*got score='thr'"):
        SAClassifier(model, score="thr")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="per_layer"):
        SAClassifier(model, per_layer="geometric")
    # calibrate_kwargs are checked when the estimator is built, not at fit
    with pytest.raises(TypeError, match=r"unknown calibrate_kwargs \['bogus'\]"):
        SAClassifier(model, bogus=1)
    with pytest.raises(ValueError, match="max_evals must be a positive int, got max_evals=0"):
        SAClassifier(model, max_evals=0)
    with pytest.raises(TypeError, match="progress must be a bool or None, got progress='yes'"):
        SAClassifier(model, progress="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="val_data is empty"):
        clf.fit([])
    # a model whose output changes class count after fit: one clear error
    fitted = quiet_fit(SAClassifier(Tiny(c=3).eval(), nu=2, n_samples=4, progress=False),
                       [(x, y)])
    fitted.model.head = nn.Linear(16, 5)
    with pytest.raises(ValueError, match=r"logits with 3 classes \(as at fit\), got output "
                                         r"shape=\(40, 5\)"):
        fitted.predict(x)


class lambda_module(nn.Module):
    """A transformer classifier whose output is passed through ``fn`` (to make bad shapes)."""

    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.inner = Tiny()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self.inner(x))
