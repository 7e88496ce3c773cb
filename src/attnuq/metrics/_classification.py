r"""Scores for class-probability predictions, selective prediction and prediction sets.

Shapes. ``probs`` is ``(B, C)`` with ``C >= 2`` rows of class probabilities, or ``(B,)`` for a
binary problem (the probability of class 1; read as the two columns ``[1 - p, p]``).
``targets`` are integer class ids ``(B,)`` in ``[0, C)``. ``sets`` are boolean ``(B, C)``.
Selective-prediction scores take an ``uncertainty`` score ``(B,)`` (higher: less sure) and
``errors`` ``(B,)`` (1 where the prediction is wrong, 0 where right; any loss in ``[0, 1]``).

All scores are computed in float64 and returned as 0-d tensors (``reduction="mean"``) or per
example (``reduction="none"``) where a per-example form exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from attnuq.metrics._checks import Reduction, as_tensor, check_reduction, check_tensor, reduce

__all__ = [
    "CalibrationBins",
    "auprc",
    "aurc",
    "auroc",
    "auroc_error",
    "brier_probs",
    "calibration_bins",
    "ece_probs",
    "entropy_probs",
    "mutual_information_samples",
    "nll_probs",
    "risk_coverage",
    "set_coverage",
    "set_size",
]

D = torch.float64
#: rows of ``probs`` must sum to 1 within this (float32 softmax outputs pass)
_SUM_TOL = 1e-4
Binning = Literal["width", "mass"]


def check_probs(probs: object, name: str = "probs") -> torch.Tensor:
    """``(B, C)`` float64 class probabilities: a ``(B,)`` binary input becomes ``[1 - p, p]``.

    Entries must lie in ``[0, 1]`` and rows sum to 1 (within ``1e-4``); errors name the first
    bad row and its value.
    """
    p = check_tensor(probs, name, min_dim=1).to(D)
    if p.dim() == 1:
        p = torch.stack([1.0 - p, p], -1)
    if p.dim() != 2 or p.shape[-1] < 2:
        raise ValueError(
            f"{name} must be (B, C) with C >= 2 or (B,) binary probabilities, got "
            f"{name}.shape={tuple(as_tensor(probs, name).shape)}"
        )
    bad = (p < 0) | (p > 1)
    if bool(bad.any()):
        i = int(torch.nonzero(bad.any(-1))[0])
        raise ValueError(
            f"{name} must lie in [0, 1], got {name}[{i}]={p[i].tolist()} (row {i})"
        )
    s = p.sum(-1)
    off = (s - 1).abs() > _SUM_TOL
    if bool(off.any()):
        i = int(torch.nonzero(off)[0])
        raise ValueError(
            f"every row of {name} must sum to 1, got sum={float(s[i])!r} in row {i} "
            "(pass probabilities, e.g. logits.softmax(-1), not logits)"
        )
    return p


def check_labels(targets: object, n_classes: int, name: str = "targets") -> torch.Tensor:
    """Integer class ids ``(B, ...)`` in ``[0, n_classes)`` as ``int64``.

    Integer and boolean tensors pass; a floating tensor passes only if every entry is a whole
    number (labels read from a float array). Errors name the first bad entry and its value.
    """
    if isinstance(targets, torch.Tensor):
        t = targets
    else:
        try:
            t = torch.as_tensor(targets)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(
                f"{name} must be a tensor of integer class ids, got {type(targets).__name__}"
            ) from exc
    if t.numel() == 0:
        raise ValueError(f"{name} is empty, got {name}.shape={tuple(t.shape)}")
    if t.is_complex():
        raise TypeError(f"{name} must hold integer class ids, got dtype={t.dtype}")
    if t.is_floating_point():
        frac = ~torch.isfinite(t) | (t != torch.round(t))
        if bool(frac.any()):
            i = int(torch.nonzero(frac.reshape(-1))[0])
            raise ValueError(
                f"{name} must be integer class ids, got {name}={t.reshape(-1)[i].item()!r} "
                f"at flat index {i} (dtype={t.dtype})"
            )
    t = t.to(torch.int64)
    out = (t < 0) | (t >= n_classes)
    if bool(out.any()):
        i = int(torch.nonzero(out.reshape(-1))[0])
        raise ValueError(
            f"{name} must be class ids in [0, {n_classes}), got {name}="
            f"{int(t.reshape(-1)[i])} at flat index {i}"
        )
    return t


def row_labels(targets: object, table: torch.Tensor, name: str = "probs") -> torch.Tensor:
    """``targets`` as ``(B,)`` class ids for a ``(B, C)`` ``table`` (probabilities, scores or
    sets), on its device; errors name both shapes."""
    y = check_labels(targets, table.shape[-1])
    if y.shape != table.shape[:1]:
        raise ValueError(
            f"targets must be (B,) class ids for {name} (B, C), got "
            f"targets.shape={tuple(y.shape)} and {name}.shape={tuple(table.shape)}"
        )
    return y.to(table.device)


def _probs_labels(probs: object, targets: object) -> tuple[torch.Tensor, torch.Tensor]:
    p = check_probs(probs)
    return p, row_labels(targets, p)


def nll_probs(
    probs: torch.Tensor, targets: torch.Tensor, *, reduction: Reduction = "mean"
) -> torch.Tensor:
    r"""Negative log-likelihood (log loss) of class probabilities; lower is better.

    .. math:: \mathrm{NLL} = -\frac1B \sum_i \ln p_{i, y_i}.

    A zero probability on the true class gives a large finite value: ``p`` is clamped at
    ``1e-300`` (``-ln 1e-300 = 690.8``), so one such example dominates the mean but the mean
    stays comparable.

    Parameters
    ----------
    probs
        ``(B, C)`` probabilities (or ``(B,)`` binary ``P(y = 1)``).
    targets
        ``(B,)`` class ids in ``[0, C)``.
    reduction
        ``"mean"`` (0-d) or ``"none"`` (``(B,)``).

    Examples
    --------
    >>> import torch
    >>> p = torch.tensor([[0.5, 0.5], [0.9, 0.1]])
    >>> round(float(nll_probs(p, torch.tensor([0, 0]))), 4)  # (ln 2 - ln 0.9) / 2
    0.3993
    """
    check_reduction(reduction)
    p, y = _probs_labels(probs, targets)
    py = p.gather(-1, y[:, None])[:, 0]
    return reduce(-torch.log(py.clamp_min(1e-300)), reduction)


def brier_probs(
    probs: torch.Tensor, targets: torch.Tensor, *, reduction: Reduction = "mean"
) -> torch.Tensor:
    r"""Brier score; lower is better.

    Multi-class ``(B, C)`` input: the sum over classes (Brier 1950),

    .. math:: \mathrm{BS} = \frac1B \sum_i \sum_c (p_{ic} - \mathbf 1\{y_i = c\})^2 \in [0, 2].

    Binary ``(B,)`` input ``p = P(y = 1)``: ``(p - y)^2`` (the binary convention, scikit-learn's
    ``brier_score_loss``), which is half the two-class sum.

    Examples
    --------
    >>> import torch
    >>> float(brier_probs(torch.tensor([[1.0, 0.0], [0.5, 0.5]]), torch.tensor([0, 1])))
    0.25
    >>> float(brier_probs(torch.tensor([0.5, 1.0]), torch.tensor([1, 1])))
    0.125
    """
    check_reduction(reduction)
    binary = as_tensor(probs, "probs").dim() == 1
    p, y = _probs_labels(probs, targets)
    onehot = torch.nn.functional.one_hot(y, p.shape[-1]).to(D)
    bs = ((p - onehot) ** 2).sum(-1)
    return reduce(bs / 2 if binary else bs, reduction)


@dataclass(frozen=True)
class CalibrationBins:
    """Top-label calibration statistics per confidence bin (:func:`calibration_bins`).

    Attributes
    ----------
    count
        ``(M,)`` examples per bin (float64).
    sum_confidence, sum_accuracy
        ``(M,)`` sums of the top-label confidence and of the 0/1 correctness per bin.
    edges
        ``(M + 1,)`` bin edges for ``binning="width"``; ``None`` for ``"mass"`` (the bins
        are groups of ranks, not intervals).

    Examples
    --------
    >>> import torch
    >>> p = torch.tensor([[0.9, 0.1], [0.9, 0.1], [0.6, 0.4], [0.6, 0.4]])
    >>> b = calibration_bins(p, torch.tensor([0, 1, 0, 0]), n_bins=5)
    >>> b.count.tolist(), [round(v, 3) for v in b.accuracy.nan_to_num(-1).tolist()]
    ([0.0, 0.0, 0.0, 2.0, 2.0], [-1.0, -1.0, -1.0, 1.0, 0.5])
    >>> round(float(b.ece), 4)
    0.4
    """

    count: torch.Tensor
    sum_confidence: torch.Tensor
    sum_accuracy: torch.Tensor
    edges: torch.Tensor | None = None

    @property
    def n_bins(self) -> int:
        return int(self.count.numel())

    @property
    def confidence(self) -> torch.Tensor:
        """``(M,)`` mean confidence per bin (NaN where a bin is empty)."""
        return self.sum_confidence / self.count

    @property
    def accuracy(self) -> torch.Tensor:
        """``(M,)`` accuracy per bin (NaN where a bin is empty)."""
        return self.sum_accuracy / self.count

    @property
    def ece(self) -> torch.Tensor:
        r"""``sum_m |B_m| / B * |acc(B_m) - conf(B_m)|``, a 0-d float64 tensor."""
        return (self.sum_accuracy - self.sum_confidence).abs().sum() / self.count.sum()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CalibrationBins:
        """Inverse of :meth:`to_dict` (the sums rebuilt as mean x count)."""
        count = torch.tensor([float(c) for c in d["count"]], dtype=D)

        def sums(key: str) -> torch.Tensor:
            vals = d[key]
            if len(vals) != count.numel():
                raise ValueError(f"{key} has {len(vals)} bins, count has {count.numel()}")
            return torch.tensor([0.0 if v is None else float(v) for v in vals], dtype=D) * count

        edges = d.get("edges")
        return cls(count=count, sum_confidence=sums("confidence"),
                   sum_accuracy=sums("accuracy"),
                   edges=None if edges is None else torch.tensor(edges, dtype=D))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready lists: ``count``, ``confidence`` and ``accuracy`` per bin (``None``
        where a bin is empty), and ``edges``."""
        empty = [c == 0 for c in self.count.tolist()]

        def means(t: torch.Tensor) -> list[float | None]:
            return [None if e else float(v) for v, e in zip(t.tolist(), empty, strict=True)]

        return {"count": [int(c) for c in self.count.tolist()],
                "confidence": means(self.confidence), "accuracy": means(self.accuracy),
                "edges": None if self.edges is None else [float(v) for v in self.edges.tolist()]}


def calibration_bins(
    probs: torch.Tensor,
    targets: torch.Tensor,
    *,
    n_bins: int = 15,
    binning: Binning = "width",
) -> CalibrationBins:
    r"""The bins of :func:`ece_probs` (its arguments, binnings and checks): per bin of the
    top-label confidence ``c_i = max_k p_ik``, the number of examples and the sums of
    confidence and of correctness (prediction ``argmax_k p_ik``, first maximum); what a
    reliability diagram draws (:func:`attnuq.plots.confidence_reliability`).

    Examples
    --------
    >>> import torch
    >>> p = torch.tensor([[0.95, 0.05], [0.7, 0.3], [0.2, 0.8], [0.45, 0.55]])
    >>> b = calibration_bins(p, torch.tensor([0, 1, 1, 1]), n_bins=2, binning="mass")
    >>> b.count.tolist(), b.accuracy.tolist()  # confidences 0.55, 0.7 | 0.8, 0.95
    ([2.0, 2.0], [0.5, 1.0])
    """
    if isinstance(n_bins, bool) or not isinstance(n_bins, int) or n_bins < 1:
        raise ValueError(f"n_bins must be a positive int, got {n_bins=!r}")
    if binning not in ("width", "mass"):
        raise ValueError(f"binning must be 'width' or 'mass', got {binning=!r}")
    p, y = _probs_labels(probs, targets)
    conf, pred = p.max(-1)
    acc = (pred == y).to(D)
    n = conf.numel()
    edges = None
    if binning == "width":
        edges = torch.linspace(0.0, 1.0, n_bins + 1, dtype=D, device=conf.device)
        idx = (torch.bucketize(conf, edges, right=False) - 1).clamp(0, n_bins - 1)  # (lo, hi]
    else:
        order = torch.sort(conf, stable=True).indices
        idx = torch.empty(n, dtype=torch.int64, device=conf.device)
        sizes = [n // n_bins + (1 if k < n % n_bins else 0) for k in range(n_bins)]
        idx[order] = torch.repeat_interleave(torch.arange(n_bins, device=conf.device),
                                             torch.tensor(sizes, device=conf.device))
    count = torch.zeros(n_bins, dtype=D, device=conf.device)
    count.index_add_(0, idx, torch.ones_like(conf))
    s_conf = torch.zeros_like(count).index_add_(0, idx, conf)
    s_acc = torch.zeros_like(count).index_add_(0, idx, acc)
    return CalibrationBins(count=count, sum_confidence=s_conf, sum_accuracy=s_acc, edges=edges)


def ece_probs(
    probs: torch.Tensor,
    targets: torch.Tensor,
    *,
    n_bins: int = 15,
    binning: Binning = "width",
) -> torch.Tensor:
    r"""Expected calibration error of the top-label confidence (L1); lower is better.

    With confidence ``c_i = max_k p_ik``, prediction ``argmax_k p_ik`` (first maximum) and bins
    ``B_1..B_M`` of the examples,

    .. math:: \mathrm{ECE} = \sum_m \frac{|B_m|}{B}\,
              \bigl|\mathrm{acc}(B_m) - \mathrm{conf}(B_m)\bigr|.

    ``binning="width"``: ``M`` equal-width bins ``(m/M, (m+1)/M]`` of the confidence (Guo et
    al. 2017; the first bin also holds 0). ``binning="mass"``: adaptive bins of (nearly) equal
    count, the confidences sorted and cut into ``M`` consecutive groups whose sizes differ by
    at most one (the first ``B mod M`` groups one larger; Nixon et al. 2019, "adaptive
    calibration error"). Empty bins contribute nothing.

    Binary ``(B,)`` input is read as the two columns ``[1 - p, p]``: the top-label confidence
    is ``max(p, 1 - p)``.

    Parameters
    ----------
    probs, targets
        ``(B, C)`` (or ``(B,)``) and ``(B,)``.
    n_bins
        ``M``, at least 1 (default 15).
    binning
        ``"width"`` or ``"mass"``.

    Examples
    --------
    >>> import torch
    >>> p = torch.tensor([[0.9, 0.1], [0.9, 0.1], [0.6, 0.4], [0.6, 0.4]])
    >>> round(float(ece_probs(p, torch.tensor([0, 1, 0, 0]))), 4)  # |0.5-0.9|/2 + |1-0.6|/2
    0.4
    """
    return calibration_bins(probs, targets, n_bins=n_bins, binning=binning).ece


def entropy_probs(probs: torch.Tensor) -> torch.Tensor:
    r"""Shannon entropy in nats over the last dimension: ``H[p] = -sum_c p_c ln p_c``
    (``0 ln 0 = 0``); ``(..., C) -> (...)``.

    Examples
    --------
    >>> import torch
    >>> round(float(entropy_probs(torch.tensor([0.5, 0.5]))), 4)
    0.6931
    """
    p = _check_simplex(probs, "probs", min_dim=1)
    return _entropy(p)


def _entropy(p: torch.Tensor) -> torch.Tensor:
    return -torch.xlogy(p, p).sum(-1)


def _check_simplex(x: object, name: str, *, min_dim: int) -> torch.Tensor:
    """``(..., C)`` probabilities: entries in ``[0, 1]``, each last-dim row summing to 1
    (within ``1e-4``, summed in float64); errors name the first bad row's index."""
    p = check_tensor(x, name, min_dim=min_dim)
    bad = (p < 0) | (p > 1)
    if bool(bad.any()):
        i = tuple(int(v) for v in torch.nonzero(bad)[0][:-1])
        raise ValueError(f"{name} must lie in [0, 1], got {name}[{i}]={p[i].tolist()}")
    tot = p.to(D).sum(-1)
    off = (tot - 1).abs() > _SUM_TOL
    if bool(off.any()):
        i = tuple(int(v) for v in torch.nonzero(off)[0])
        raise ValueError(
            f"every row of {name} (its last dimension) must sum to 1, got sum={float(tot[i])!r} "
            f"at {name}[{i}] (pass probabilities, e.g. logits.softmax(-1), not logits)"
        )
    return p


def mutual_information_samples(prob_samples: torch.Tensor) -> torch.Tensor:
    r"""Mutual information between the label and the draw (epistemic part, BALD), in nats.

    .. math:: I = H\Bigl[\frac1S \sum_s p^{(s)}\Bigr] - \frac1S \sum_s H\bigl[p^{(s)}\bigr] \ge 0,

    ``(S, B, ..., C) -> (B, ...)``; clamped at 0 against rounding.

    Examples
    --------
    >>> import torch
    >>> s = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])  # two confident, opposite draws
    >>> round(float(mutual_information_samples(s)[0]), 4)  # ln 2
    0.6931
    """
    s = _check_simplex(prob_samples, "prob_samples", min_dim=2)
    total = _entropy(s.mean(0))
    expected = _entropy(s).mean(0)
    return (total - expected).clamp_min(0)


def _check_score_pair(
    scores: object, flags: object, names: tuple[str, str]
) -> tuple[torch.Tensor, torch.Tensor]:
    s = check_tensor(scores, names[0], min_dim=1).to(D)
    f = check_tensor(flags, names[1], min_dim=1).to(D)
    if s.dim() != 1 or s.shape != f.shape:
        raise ValueError(
            f"{names[0]} and {names[1]} must be 1-D of one length, got "
            f"{names[0]}.shape={tuple(s.shape)} and {names[1]}.shape={tuple(f.shape)}"
        )
    return s, f.to(s.device)


def _check_binary(labels: torch.Tensor, name: str) -> None:
    bad = (labels != 0) & (labels != 1)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise ValueError(f"{name} must be 0 or 1, got {name}={labels[i].item()!r} at index {i}")


def risk_coverage(
    uncertainty: torch.Tensor, errors: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Selective risk against coverage, keeping the most certain examples first.

    Sort by ``uncertainty`` ascending; keeping the ``k`` most certain gives coverage ``k / B``
    and risk ``r_k = (1/k) sum_{j <= k} e_(j)``. Tied uncertainties are ordered at random in
    expectation: the errors inside a tie group are replaced by the group mean (the expected
    cumulative error under a uniformly random order of the ties), so the curve does not depend
    on the input order.

    Returns
    -------
    coverage, risk
        ``(B,)`` each: ``k / B`` and ``r_k`` for ``k = 1..B``.

    Examples
    --------
    >>> import torch
    >>> cov, risk = risk_coverage(torch.tensor([0.1, 0.9, 0.5]), torch.tensor([0.0, 1.0, 0.0]))
    >>> cov.tolist(), [round(r, 4) for r in risk.tolist()]
    ([0.3333333333333333, 0.6666666666666666, 1.0], [0.0, 0.0, 0.3333])
    """
    u, e = _check_score_pair(uncertainty, errors, ("uncertainty", "errors"))
    if bool(((e < 0) | (e > 1)).any()):
        raise ValueError("errors must lie in [0, 1] (1 for a wrong prediction, 0 for a right one)")
    order = torch.sort(u, stable=True).indices
    us, es = u[order], e[order]
    _, inverse, counts = torch.unique_consecutive(us, return_inverse=True, return_counts=True)
    group_mean = torch.zeros(counts.numel(), dtype=D, device=u.device).index_add_(0, inverse, es)
    es = (group_mean / counts.to(D))[inverse]
    k = torch.arange(1, u.numel() + 1, dtype=D, device=u.device)
    return k / u.numel(), es.cumsum(0) / k


def aurc(uncertainty: torch.Tensor, errors: torch.Tensor) -> torch.Tensor:
    r"""Area under the risk-coverage curve (Geifman & El-Yaniv 2017); lower is better.

    .. math:: \mathrm{AURC} = \frac1B \sum_{k=1}^{B} r_k

    with ``r_k`` of :func:`risk_coverage` (ties in expectation). torch-uncertainty's ``AURC``
    integrates the same ``r_k`` by the trapezoid rule and rescales to a unit support,
    ``(sum_k r_k - (r_1 + r_B) / 2) / (B - 1)``; the two agree up to ``O(1/B)``.

    Parameters
    ----------
    uncertainty
        ``(B,)``, higher means less sure (e.g. ``1 - max_c p_c``, the entropy, the mutual
        information).
    errors
        ``(B,)`` in ``[0, 1]``: 1 where the prediction is wrong.

    Examples
    --------
    >>> import torch
    >>> round(float(aurc(torch.tensor([0.1, 0.9, 0.5]), torch.tensor([0.0, 1.0, 0.0]))), 4)
    0.1111
    """
    return risk_coverage(uncertainty, errors)[1].mean()


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    r"""Area under the ROC curve of ``scores`` for binary ``labels`` (higher score: class 1).

    The Mann-Whitney form with ties counted one half,

    .. math:: \mathrm{AUROC} = \frac{1}{n_1 n_0} \sum_{i: y_i=1} \sum_{j: y_j=0}
              \Bigl(\mathbf 1\{s_i > s_j\} + \tfrac12 \mathbf 1\{s_i = s_j\}\Bigr),

    computed from mid-ranks in ``O(B log B)``.

    Raises
    ------
    ValueError
        If ``labels`` are not 0/1 or hold only one class.

    Examples
    --------
    >>> import torch
    >>> float(auroc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])))
    0.75
    """
    s, y = _check_score_pair(scores, labels, ("scores", "labels"))
    _check_binary(y, "labels")
    n1 = float(y.sum())
    n0 = y.numel() - n1
    if n1 == 0 or n0 == 0:
        raise ValueError(
            f"labels must hold both classes for an AUROC, got {int(n1)} ones and {int(n0)} zeros"
        )
    order = torch.sort(s, stable=True).indices
    ss = s[order]
    _, inverse, counts = torch.unique_consecutive(ss, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).to(D)
    mid = ends - (counts.to(D) - 1) / 2  # mid-rank of each tie group (1-based)
    ranks = torch.empty_like(s)
    ranks[order] = mid[inverse]
    u = float((ranks * y).sum()) - n1 * (n1 + 1) / 2
    return torch.tensor(u / (n1 * n0), dtype=D)


def auprc(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    r"""Area under the precision-recall curve as average precision (higher score: class 1).

    With the distinct score values as thresholds, from the highest down,

    .. math:: \mathrm{AP} = \sum_n (R_n - R_{n-1}) P_n,

    ``P_n``, ``R_n`` the precision and recall of predicting 1 at or above the ``n``-th threshold
    (the step-wise form of scikit-learn's ``average_precision_score``; ties form one step).

    Examples
    --------
    >>> import torch
    >>> round(float(auprc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]))), 4)
    0.8333
    """
    s, y = _check_score_pair(scores, labels, ("scores", "labels"))
    _check_binary(y, "labels")
    n1 = float(y.sum())
    if n1 == 0:
        raise ValueError("labels hold no positive (1): precision-recall is undefined")
    order = torch.sort(-s, stable=True).indices
    ss, ys = s[order], y[order]
    _, counts = torch.unique_consecutive(ss, return_counts=True)
    last = counts.cumsum(0) - 1  # last index of each threshold's group
    tp = ys.cumsum(0)[last]
    kept = (last + 1).to(D)
    precision, recall = tp / kept, tp / n1
    prev = torch.cat([torch.zeros(1, dtype=D, device=s.device), recall[:-1]])
    return ((recall - prev) * precision).sum()


def auroc_error(uncertainty: torch.Tensor, errors: torch.Tensor) -> torch.Tensor:
    r"""AUROC of an uncertainty score for telling wrong predictions (``errors = 1``) from right
    ones: :func:`auroc` ``(uncertainty, errors)``; 0.5 is chance, higher is better.

    Examples
    --------
    >>> import torch
    >>> float(auroc_error(torch.tensor([0.1, 0.9, 0.5]), torch.tensor([0, 1, 0])))
    1.0
    """
    return auroc(uncertainty, errors)


def _check_sets(sets: object) -> torch.Tensor:
    t = sets if isinstance(sets, torch.Tensor) else torch.as_tensor(sets)
    if t.dim() != 2 or t.numel() == 0:
        raise ValueError(f"sets must be a non-empty (B, C) boolean tensor, got sets.shape="
                         f"{tuple(t.shape)}")
    if t.dtype != torch.bool:
        if t.is_floating_point() or t.is_complex():
            raise TypeError(f"sets must be a boolean (B, C) tensor, got dtype={t.dtype}")
        _check_binary(t.reshape(-1).to(D), "sets")
        t = t.to(torch.bool)
    return t


def set_coverage(
    sets: torch.Tensor, targets: torch.Tensor, *, reduction: Reduction = "mean"
) -> torch.Tensor:
    r"""Fraction of examples whose set holds the true class: ``(1/B) sum_i 1{y_i in C_i}``.

    Examples
    --------
    >>> import torch
    >>> sets = torch.tensor([[True, False], [True, True], [False, True]])
    >>> round(float(set_coverage(sets, torch.tensor([1, 0, 1]))), 4)
    0.6667
    """
    check_reduction(reduction)
    c = _check_sets(sets)
    y = row_labels(targets, c, "sets")
    return reduce(c.gather(-1, y[:, None])[:, 0].to(D), reduction)


def set_size(sets: torch.Tensor, *, reduction: Reduction = "mean") -> torch.Tensor:
    """Number of classes in each set (mean by default).

    Examples
    --------
    >>> import torch
    >>> float(set_size(torch.tensor([[True, False], [True, True]])))
    1.5
    """
    check_reduction(reduction)
    c = _check_sets(sets)
    return reduce(c.sum(-1).to(D), reduction)
