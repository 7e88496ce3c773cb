"""Classification metrics against independent implementations (torchmetrics, torch-uncertainty,
scikit-learn) and brute-force definitions, float64, plus every bad input."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from attnuq import metrics as M

D = torch.float64


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_probs(
    b: int, c: int, seed: int, sharp: float = 3.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax of scaled Gaussian logits and labels drawn from a tempered version of them (so
    the probabilities are miscalibrated and the ECE is not ~0)."""
    g = gen(seed)
    z = sharp * torch.randn(b, c, generator=g, dtype=D)
    p = z.softmax(-1)
    y = torch.multinomial((z / 2).softmax(-1), 1, generator=g)[:, 0]
    return p, y


# --------------------------------------------------------------------------- NLL and Brier
def test_nll_and_brier_match_torch_uncertainty_and_sklearn() -> None:
    from sklearn.metrics import brier_score_loss, log_loss
    from torch_uncertainty.metrics.classification import BrierScore, CategoricalNLL

    p, y = random_probs(500, 7, seed=1)
    nll = M.nll_probs(p, y)
    ref = log_loss(y.numpy(), p.numpy(), labels=list(range(7)))
    assert float(nll) == pytest.approx(ref, rel=1e-12)
    tu = CategoricalNLL()
    tu.update(p, y)
    # torch-uncertainty accumulates in float32: agreement to float32 rounding
    assert float(nll) == pytest.approx(float(tu.compute()), rel=1e-6)

    bs = BrierScore(num_classes=7)
    bs.update(p, y)
    assert float(M.brier_probs(p, y)) == pytest.approx(float(bs.compute()), rel=1e-6)
    # binary (B,) input: scikit-learn's convention (p - y)^2
    pb, yb = p[:, 0], (y == 0).long()
    assert float(M.brier_probs(pb, yb)) == pytest.approx(
        brier_score_loss(yb.numpy(), pb.numpy()), rel=1e-12)
    assert float(M.nll_probs(pb, yb)) == pytest.approx(log_loss(yb.numpy(), pb.numpy()), rel=1e-12)
    per = M.nll_probs(p, y, reduction="none")
    assert per.shape == (500,) and torch.allclose(per.mean(), nll)


# --------------------------------------------------------------------------- ECE
@pytest.mark.parametrize("c", [2, 10])
def test_ece_width_matches_torchmetrics(c: int) -> None:
    from torchmetrics.functional.classification import multiclass_calibration_error

    for seed in range(3):
        p, y = random_probs(1000, c, seed=10 + seed)
        ours = float(M.ece_probs(p, y))
        ref = float(multiclass_calibration_error(p, y, num_classes=c, n_bins=15, norm="l1"))
        # same bins (no confidence falls on an edge for continuous draws); torchmetrics
        # computes in float32: agreement to float32 rounding
        assert ours == pytest.approx(ref, rel=1e-5)
        assert ours > 0.01  # the draws are miscalibrated on purpose: a real comparison


def test_ece_mass_matches_torch_uncertainty_adaptive() -> None:
    from torch_uncertainty.metrics.classification import AdaptiveCalibrationError

    for c, n in ((10, 1000), (3, 997)):  # 997: bins of unequal size (997 = 15 * 66 + 7)
        p, y = random_probs(n, c, seed=c)
        ace = AdaptiveCalibrationError(task="multiclass", num_bins=15, num_classes=c)
        ace.update(p, y)
        assert float(M.ece_probs(p, y, binning="mass")) == pytest.approx(
            float(ace.compute()), rel=1e-5)  # torch-uncertainty keeps float32 confidences


def test_ece_brute_force_and_edges() -> None:
    p, y = random_probs(300, 4, seed=3)
    conf, pred = p.max(-1)
    total = 0.0
    for m in range(15):  # Guo et al.: bins (m/15, (m+1)/15]
        lo, hi = m / 15, (m + 1) / 15
        inb = (conf > lo) & (conf <= hi)
        if inb.any():
            total += float(inb.sum()) / 300 * abs(
                float((pred[inb] == y[inb]).double().mean()) - float(conf[inb].mean()))
    assert float(M.ece_probs(p, y)) == pytest.approx(total, rel=1e-12)
    # a confidence exactly on an edge falls in the bin it closes: 0.6 is in (8/15, 9/15]
    edge = torch.tensor([[0.6, 0.4]], dtype=D)
    assert float(M.ece_probs(edge, torch.tensor([0]))) == pytest.approx(0.4)
    # perfect one-hot right predictions: ECE 0
    assert float(M.ece_probs(torch.eye(3, dtype=D), torch.arange(3))) == 0.0


# --------------------------------------------------------------------------- AURC
def test_aurc_against_torch_uncertainty_and_brute_force() -> None:
    from torch_uncertainty.metrics.classification import AURC

    p, y = random_probs(400, 5, seed=5)
    conf, pred = p.max(-1)
    err = (pred != y).to(D)
    ours = float(M.aurc(1 - conf, err))
    # brute force: sort by confidence (no ties in continuous draws), mean of running risks
    e = err[torch.argsort(conf, descending=True)]
    brute = float((e.cumsum(0) / torch.arange(1, 401, dtype=D)).mean())
    assert ours == pytest.approx(brute, rel=1e-12)
    tu = AURC()
    tu.update(p.float(), y)
    r = M.risk_coverage(1 - conf, err)[1]
    n = 400
    # torch-uncertainty: trapezoid over k/N, rescaled to unit support (documented in aurc)
    assert float(tu.compute()) == pytest.approx(
        float((r.sum() - (r[0] + r[-1]) / 2) / (n - 1)), rel=1e-5)


def test_risk_coverage_ties_are_order_free() -> None:
    u = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0])
    e = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0])
    a = M.aurc(u, e)
    # every order of the tied examples, averaged: the expectation the metric reports
    brute = []
    for p1 in itertools.permutations([0, 1]):
        for p2 in itertools.permutations([2, 3, 4]):
            es = e[list(p1) + list(p2)].double()
            brute.append(float((es.cumsum(0) / torch.arange(1, 6, dtype=D)).mean()))
    assert float(a) == pytest.approx(float(np.mean(brute)), rel=1e-12)
    perm = torch.tensor([4, 2, 0, 3, 1])
    assert float(M.aurc(u[perm], e[perm])) == pytest.approx(float(a), rel=1e-12)


# --------------------------------------------------------------------------- AUROC / AUPRC
def test_auroc_auprc_match_sklearn_and_torchmetrics_with_ties() -> None:
    from sklearn.metrics import average_precision_score, roc_auc_score
    from torchmetrics.functional.classification import binary_auroc

    g = gen(7)
    for rounding in (None, 1):  # continuous scores, then heavy ties
        s = torch.rand(600, generator=g, dtype=D)
        y = (torch.rand(600, generator=g, dtype=D) < 0.3 + 0.4 * s).long()
        if rounding is not None:
            s = torch.round(s * 10**rounding) / 10**rounding
        assert float(M.auroc(s, y)) == pytest.approx(roc_auc_score(y, s), rel=1e-12)
        assert float(M.auprc(s, y)) == pytest.approx(average_precision_score(y, s), rel=1e-12)
        assert float(M.auroc(s, y)) == pytest.approx(float(binary_auroc(s, y)), rel=1e-6)
    err = torch.tensor([0, 1, 0, 1])
    u = torch.tensor([0.1, 0.9, 0.2, 0.3])
    assert float(M.auroc_error(u, err)) == pytest.approx(roc_auc_score(err, u))


# --------------------------------------------------------------------------- entropy, MI, sets
def test_entropy_and_mutual_information_against_torch_uncertainty() -> None:
    from torch_uncertainty.metrics.classification import Entropy, MutualInformation

    g = gen(9)
    s = torch.randn(8, 50, 6, generator=g, dtype=D).mul(2).softmax(-1)  # (S, B, C)
    mi = M.mutual_information_samples(s)
    assert mi.shape == (50,) and bool((mi >= 0).all())
    tu = MutualInformation(reduction="none")
    tu.update(s.permute(1, 0, 2))  # torch-uncertainty: (B, S, C)
    assert torch.allclose(mi, tu.compute().to(D), rtol=1e-5, atol=1e-6)
    ent = Entropy(reduction="none")
    ent.update(s.mean(0))
    assert torch.allclose(M.entropy_probs(s.mean(0)), ent.compute().to(D), rtol=1e-5, atol=1e-6)


def test_set_coverage_and_size_against_torch_uncertainty() -> None:
    from torch_uncertainty.metrics.classification import CoverageRate, SetSize

    g = gen(11)
    sets = torch.rand(200, 5, generator=g) < 0.4
    y = torch.randint(0, 5, (200,), generator=g)
    cr = CoverageRate(num_classes=5)
    cr.update(sets.float(), y)
    assert float(M.set_coverage(sets, y)) == pytest.approx(float(cr.compute()), rel=1e-6)
    ss = SetSize()
    ss.update(sets.float())
    assert float(M.set_size(sets)) == pytest.approx(float(ss.compute()), rel=1e-6)
    assert float(M.set_size(sets)) == pytest.approx(float(sets.sum()) / 200)


# --------------------------------------------------------------------------- bad input
def test_bad_inputs_name_the_value() -> None:
    p = torch.tensor([[0.7, 0.3], [0.2, 0.8]])
    with pytest.raises(ValueError, match=r"targets must be class ids in \[0, 2\), got targets=2"):
        M.nll_probs(p, torch.tensor([0, 2]))
    with pytest.raises(ValueError, match=r"targets=-1"):
        M.brier_probs(p, torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match=r"integer class ids, got targets=0.5"):
        M.ece_probs(p, torch.tensor([0.5, 1.0]))
    assert float(M.nll_probs(p, torch.tensor([0.0, 1.0]))) > 0  # whole-number floats are labels
    with pytest.raises(ValueError, match=r"must sum to 1, got sum=1.8 in row 0"):
        M.nll_probs(torch.tensor([[0.9, 0.9]], dtype=D), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"must lie in \[0, 1\]"):
        M.nll_probs(torch.tensor([[1.5, -0.5]]), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"targets.shape=\(3,\) and probs.shape=\(2, 2\)"):
        M.nll_probs(p, torch.tensor([0, 1, 1]))
    with pytest.raises(ValueError, match=r"n_bins must be a positive int, got n_bins=0"):
        M.ece_probs(p, torch.tensor([0, 1]), n_bins=0)
    with pytest.raises(ValueError, match=r"binning must be 'width' or 'mass', got binning='x'"):
        M.ece_probs(p, torch.tensor([0, 1]), binning="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"labels must hold both classes"):
        M.auroc(torch.tensor([0.1, 0.2]), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"labels must be 0 or 1, got labels=2"):
        M.auroc(torch.tensor([0.1, 0.2]), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"errors must lie in \[0, 1\]"):
        M.aurc(torch.tensor([0.1, 0.2]), torch.tensor([2.0, 0.0]))
    with pytest.raises(ValueError, match=r"uncertainty and errors must be 1-D of one length"):
        M.aurc(torch.tensor([0.1, 0.2]), torch.tensor([0.0]))
    with pytest.raises(ValueError, match=r"contains non-finite"):
        M.auroc(torch.tensor([float("nan"), 0.2]), torch.tensor([0, 1]))
    with pytest.raises(TypeError, match=r"sets must be a boolean"):
        M.set_size(torch.rand(2, 3))
    with pytest.raises(ValueError, match=r"targets must be class ids in \[0, 3\), got targets=3"):
        M.set_coverage(torch.ones(2, 3, dtype=torch.bool), torch.tensor([0, 3]))


@pytest.mark.parametrize("binning", ["width", "mass"])
def test_calibration_bins_match_a_direct_count(binning: str) -> None:
    """Per-bin counts, mean confidence and accuracy equal a loop over the examples (numpy,
    the bins' own definition); their ECE is ece_probs's, and to_dict/from_dict round-trip."""
    g = torch.Generator().manual_seed(3)
    p = (2 * torch.randn(157, 4, generator=g, dtype=torch.float64)).softmax(-1)
    y = torch.multinomial(p, 1, generator=g)[:, 0]
    b = M.calibration_bins(p, y, n_bins=7, binning=binning)  # type: ignore[arg-type]
    conf, pred = p.max(-1)
    conf_np, ok_np = conf.numpy(), (pred == y).numpy().astype(float)
    if binning == "width":
        idx = np.clip(np.searchsorted(np.linspace(0, 1, 8), conf_np, side="left") - 1, 0, 6)
    else:  # 157 = 7 x 22 + 3: the three lowest-confidence groups hold 23
        idx = np.empty(157, dtype=int)
        idx[np.argsort(conf_np, kind="stable")] = np.repeat(np.arange(7), [23] * 3 + [22] * 4)
    for m in range(7):
        sel = idx == m
        assert float(b.count[m]) == sel.sum()
        if sel.any():
            assert float(b.confidence[m]) == pytest.approx(conf_np[sel].mean(), abs=1e-12)
            assert float(b.accuracy[m]) == pytest.approx(ok_np[sel].mean(), abs=1e-12)
        else:
            assert math.isnan(float(b.accuracy[m]))
    assert torch.equal(b.ece, M.ece_probs(p, y, n_bins=7, binning=binning))  # type: ignore[arg-type]
    d = b.to_dict()
    assert (d["edges"] is None) == (binning == "mass")
    back = M.CalibrationBins.from_dict(d)
    assert torch.equal(back.count, b.count)
    assert float(back.ece) == pytest.approx(float(b.ece), abs=1e-12)
