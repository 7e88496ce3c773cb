"""Split-conformal prediction sets: coverage (statistical, fixed seed), agreement with
torch-uncertainty's scores and sets, the smallest-alpha error, bad inputs."""

from __future__ import annotations

import math

import pytest
import torch

from attnuq import metrics as M
from attnuq.conformal_sets import SET_SCORES, ConformalSets, fit_sets, set_scores

D = torch.float64


def draw(n: int, c: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Over-confident probabilities: labels from softmax(z / 2), predictions softmax(z)."""
    z = 2.0 * torch.randn(n, c, generator=g, dtype=D)
    y = torch.multinomial((z / 2).softmax(-1), 1, generator=g)[:, 0]
    return z.softmax(-1), y


@pytest.mark.parametrize("score", SET_SCORES)
@pytest.mark.parametrize("randomized", [False, True])
def test_coverage_is_k_over_n_plus_one(score: str, randomized: bool) -> None:
    """Mean test coverage over R independent calibration/test draws equals k/(n+1).

    With continuous scores (no ties: continuous probabilities, or randomised scores), the
    coverage of one calibration draw is Beta(k, n + 1 - k), ``k = ceil((n + 1)(1 - alpha))``
    (mean k/(n+1) >= 1 - alpha), and the m test points add binomial noise: one trial's
    coverage has variance at most Var(Beta) + 1/(4m). The mean of R trials is then within
    5 sd of k/(n+1) except with probability 5.7e-7 (normal tail; R = 150 trials of m = 200).
    """
    g = torch.Generator().manual_seed(hash((score, randomized)) % 1000)
    n, m, r, alpha, c = 199, 200, 150, 0.1, 6
    k = math.ceil((n + 1) * (1 - alpha))  # 180
    covs, sizes = [], []
    for _ in range(r):
        pc, yc = draw(n, c, g)
        pt, yt = draw(m, c, g)
        rule = fit_sets(pc, yc, alpha=alpha, score=score, randomized=randomized,  # type: ignore[arg-type]
                        nonempty=False, generator=g)
        sets = rule.predict(pt, generator=g)
        covs.append(float(M.set_coverage(sets, yt)))
        sizes.append(float(M.set_size(sets)))
    a, b = k, n + 1 - k
    var_beta = a * b / ((a + b) ** 2 * (a + b + 1))
    sd = math.sqrt((var_beta + 0.25 / m) / r)
    mean = sum(covs) / r
    assert abs(mean - k / (n + 1)) <= 5 * sd, (mean, k / (n + 1), sd)
    assert mean >= 1 - alpha - 5 * sd
    assert 1.0 < sum(sizes) / r < c  # informative sets: not all classes


def test_nonempty_only_grows_and_randomised_sets_are_smaller() -> None:
    g = torch.Generator().manual_seed(3)
    pc, yc = draw(500, 5, g)
    pt, _ = draw(2000, 5, g)
    for score in SET_SCORES:
        base = fit_sets(pc, yc, alpha=0.2, score=score, nonempty=False)
        filled = ConformalSets(**{**base.__dict__, "nonempty": True})
        a, b = base.predict(pt), filled.predict(pt)
        assert bool((b | a).eq(b).all()) and bool(b.any(-1).all())
    det = fit_sets(pc, yc, alpha=0.1, score="aps")
    rnd = fit_sets(pc, yc, alpha=0.1, score="aps", randomized=True,
                   generator=torch.Generator().manual_seed(0))
    size_det = float(M.set_size(det.predict(pt)))
    size_rnd = float(M.set_size(rnd.predict(pt, generator=torch.Generator().manual_seed(1))))
    assert size_rnd < size_det  # randomisation removes the conservative whole-mass step


@pytest.mark.parametrize("score", ["aps", "raps", "lac"])
def test_scores_and_sets_agree_with_torch_uncertainty(score: str) -> None:
    """Same scores as torch-uncertainty's ConformalCls{APS,RAPS,THR} (non-randomised), and the
    same sets at the same threshold (its own threshold is the plain empirical quantile)."""
    from torch_uncertainty.post_processing import (
        ConformalClsAPS,
        ConformalClsRAPS,
        ConformalClsTHR,
    )

    g = torch.Generator().manual_seed(5)
    p, y = draw(300, 7, g)
    ours_all = set_scores(p, score=score, lam=0.1, k_reg=1)  # type: ignore[arg-type]
    ours_y = set_scores(p, y, score=score, lam=0.1, k_reg=1)  # type: ignore[arg-type]
    if score == "lac":
        ref_all = 1.0 - p  # THR scores 1 - p in its fit (no all-label method)
        ConformalClsTHR(alpha=0.1, enable_ts=False)  # constructible: the rule is p >= 1 - q
    else:
        cls = ConformalClsAPS if score == "aps" else ConformalClsRAPS
        kw = {"penalty": 0.1, "regularization_rank": 1} if score == "raps" else {}
        tu = cls(alpha=0.1, randomized=False, enable_ts=False, **kw)
        ref_all = tu._calculate_all_labels(p)
        assert torch.allclose(ours_y, tu._calculate_single_label(p, y), atol=1e-12)
    assert torch.allclose(ours_all, ref_all, atol=1e-12)
    rule = fit_sets(p, y, alpha=0.1, score=score, nonempty=False)  # type: ignore[arg-type]
    pt, _ = draw(300, 7, g)  # fresh points: none sits on the threshold itself
    ref_t = 1.0 - pt if score == "lac" else tu._calculate_all_labels(pt)
    assert torch.equal(rule.predict(pt), ref_t <= rule.threshold)


def test_too_small_calibration_names_smallest_alpha() -> None:
    p, y = draw(9, 3, torch.Generator().manual_seed(0))
    assert fit_sets(p, y, alpha=0.1).n == 9  # n = 9 is exactly enough for alpha = 0.1
    with pytest.raises(ValueError, match=r"n=9 examples support alpha >= 1/\(n\+1\) = 0.1 .*"
                                         r"alpha=0.05 needs at least 19 calibration examples"):
        fit_sets(p, y, alpha=0.05)


def test_bad_inputs() -> None:
    p, y = draw(50, 3, torch.Generator().manual_seed(0))
    for bad in (0, 1, 1.5, -0.1, True, "0.1"):
        with pytest.raises(ValueError, match=r"alpha must be a float in \(0, 1\), got alpha="):
            fit_sets(p, y, alpha=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"score must be one of \('lac', 'aps', 'raps'\)"):
        fit_sets(p, y, score="thr")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"targets must be class ids in \[0, 3\), got targets=3"):
        fit_sets(p, torch.full((50,), 3))
    with pytest.raises(ValueError, match=r"integer class ids, got targets=0.5"):
        fit_sets(p, torch.full((50,), 0.5))
    with pytest.raises(ValueError, match=r"lam must be a finite float >= 0, got lam=-1"):
        fit_sets(p, y, score="raps", lam=-1)
    with pytest.raises(ValueError, match=r"must sum to 1"):
        fit_sets(torch.rand(50, 3, dtype=D), y)
    rule = fit_sets(p, y)
    assert ConformalSets.from_dict(rule.to_dict()) == rule
