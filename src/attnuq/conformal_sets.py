r"""Split-conformal prediction sets for classifiers: scores ``lac``, ``aps`` and ``raps``.

Given class probabilities ``p(x)`` (a frozen softmax, temperature-scaled, or SA's Monte Carlo
mean) on a held-out calibration part of ``n`` labelled examples, :func:`fit_sets` returns a
threshold ``q`` such that for a new exchangeable pair ``(x, y)`` the set
``C(x) = {c : s(x, c) <= q}`` holds ``y`` with probability at least ``1 - alpha`` (marginal,
finite-sample; Vovk et al. 2005, Angelopoulos & Bates 2023).

Scores (lower: the class conforms better). Sort the classes by decreasing probability (ties by
class index), ``o(x, c)`` the 1-based rank of ``c`` and ``p_(1) >= p_(2) >= ...``:

* ``"lac"`` (least ambiguous set-valued classifier, Sadinle et al. 2019): ``s = 1 - p_c``.
* ``"aps"`` (adaptive prediction sets, Romano et al. 2020): the mass of the classes ranked at
  or above ``c``, ``s = sum_{j <= o(x,c)} p_(j)``; randomised, ``s = sum_{j < o(x,c)} p_(j) +
  U p_c`` with one ``U ~ Uniform(0, 1)`` per example.
* ``"raps"`` (regularised APS, Angelopoulos et al. 2021): the APS score plus
  ``lam * max(0, o(x, c) - k_reg)``.

Threshold: ``q`` is the ``k``-th smallest calibration score, ``k = ceil((n + 1)(1 - alpha))``.
Then ``P(y in C(x)) >= 1 - alpha``, and ``< 1 - alpha + 1/(n + 1)`` when the scores have no
ties (randomised APS/RAPS, or LAC/APS on continuous probabilities). ``k <= n`` needs
``alpha >= 1/(n + 1)``: a smaller ``alpha`` is refused with an error naming the smallest
``alpha`` the calibration part supports.

Randomisation. ``randomized=False`` (the default) gives the same set for the same input and
keeps the guarantee (the scores are a deterministic function of ``(x, y)``); the sets are
slightly larger than the randomised ones, whose coverage is exact in expectation.
``nonempty=True`` (the default) adds the most probable class to an empty set; sets only grow,
so the coverage guarantee is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from attnuq._validation import check_bool
from attnuq.metrics._classification import check_probs, row_labels

__all__ = ["SET_SCORES", "ConformalSets", "check_alpha", "fit_sets", "set_scores"]

SetScore = Literal["lac", "aps", "raps"]
#: the ``score=`` values
SET_SCORES: tuple[SetScore, ...] = ("lac", "aps", "raps")


def check_alpha(alpha: object) -> float:
    """``alpha`` as a float in ``(0, 1)``, or ``ValueError`` naming it.

    Examples
    --------
    >>> check_alpha(0.1)
    0.1
    """
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
        raise ValueError(f"alpha must be a float in (0, 1), got {alpha=!r}")
    return float(alpha)


def conformal_rank(n: int, alpha: float) -> int:
    """``k = ceil((n + 1)(1 - alpha))``, or ``ValueError`` naming the smallest ``alpha`` that
    ``n`` calibration examples support (``1 / (n + 1)``) when ``k > n``.

    The product is rounded down by ``1e-9`` before the ceiling, so that a mathematically whole
    ``(n + 1)(1 - alpha)`` (e.g. ``n = 9``, ``alpha = 0.1``) is not pushed up by float rounding.

    Examples
    --------
    >>> conformal_rank(9, 0.1), conformal_rank(99, 0.1)
    (9, 90)
    """
    alpha = check_alpha(alpha)
    k = math.ceil((n + 1) * (1.0 - alpha) - 1e-9)
    if k > n:
        need = math.ceil(1.0 / alpha - 1.0 - 1e-9)
        raise ValueError(
            f"the calibration part is too small for alpha={alpha}: n={n} examples support "
            f"alpha >= 1/(n+1) = {1.0 / (n + 1):.4g} (coverage at most {n / (n + 1):.4g}); "
            f"alpha={alpha} needs at least {need} calibration examples"
        )
    return max(k, 1)


def _check_score(score: object, lam: object, k_reg: object) -> tuple[SetScore, float, int]:
    if score not in SET_SCORES:
        raise ValueError(f"score must be one of {SET_SCORES}, got {score=!r}")
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not (
        math.isfinite(lam) and lam >= 0
    ):
        raise ValueError(f"lam must be a finite float >= 0, got {lam=!r}")
    if isinstance(k_reg, bool) or not isinstance(k_reg, int) or k_reg < 0:
        raise ValueError(f"k_reg must be an int >= 0, got {k_reg=!r}")
    return score, float(lam), int(k_reg)  # type: ignore[return-value]


def set_scores(
    probs: torch.Tensor,
    targets: torch.Tensor | None = None,
    *,
    score: SetScore = "aps",
    randomized: bool = False,
    lam: float = 0.1,
    k_reg: int = 1,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Conformity scores (module docstring) of every class ``(B, C)``, or of the true class
    ``(B,)`` when ``targets`` are given.

    Parameters
    ----------
    probs
        ``(B, C)`` class probabilities (or ``(B,)`` binary ``P(y = 1)``).
    targets
        ``(B,)`` class ids, or ``None`` for every class.
    score
        ``"lac"``, ``"aps"`` or ``"raps"``.
    randomized
        APS/RAPS: one ``U ~ Uniform(0, 1)`` per example (from ``generator``) replaces the full
        mass of the class itself by ``U p_c``. LAC ignores it.
    lam, k_reg
        RAPS penalty ``lam * max(0, rank - k_reg)``.

    Examples
    --------
    >>> import torch
    >>> p = torch.tensor([[0.6, 0.3, 0.1]], dtype=torch.float64)
    >>> [round(v, 4) for v in set_scores(p, score="lac").tolist()[0]]
    [0.4, 0.7, 0.9]
    >>> [round(v, 4) for v in set_scores(p, score="aps").tolist()[0]]
    [0.6, 0.9, 1.0]
    >>> [round(v, 4) for v in set_scores(p, score="raps", lam=0.1, k_reg=1).tolist()[0]]
    [0.6, 1.0, 1.2]
    >>> round(float(set_scores(p, torch.tensor([1]), score="aps")[0]), 4)
    0.9
    """
    score, lam, k_reg = _check_score(score, lam, k_reg)
    randomized = check_bool(randomized, "randomized")
    p = check_probs(probs)
    y = None if targets is None else row_labels(targets, p)
    if score == "lac":
        s = 1.0 - p
    else:
        order = torch.sort(-p, dim=-1, stable=True).indices  # (B, C): classes, most probable first
        ranked = p.gather(-1, order)
        cum = ranked.cumsum(-1).clamp_max(1.0)  # the full mass is 1, not 1 + a rounding
        if randomized:
            u = torch.rand(p.shape[0], 1, generator=generator, dtype=p.dtype)
            cum = cum - ranked * (1.0 - u.to(p.device))  # mass above + U p_c
        if score == "raps":
            rank = torch.arange(1, p.shape[-1] + 1, dtype=p.dtype, device=p.device)
            cum = cum + lam * (rank - k_reg).clamp_min(0)
        s = torch.empty_like(p).scatter_(-1, order, cum)  # back to class order
    return s if y is None else s.gather(-1, y[:, None])[:, 0]


@dataclass(frozen=True)
class ConformalSets:
    """A fitted split-conformal set rule; :meth:`predict` gives boolean sets ``(B, C)``.

    Attributes
    ----------
    threshold
        ``q``, the ``k``-th smallest calibration score.
    alpha
        Miscoverage: sets hold the label with probability ``>= 1 - alpha``.
    n
        Calibration examples.
    score, randomized, lam, k_reg, nonempty
        The rule (module docstring).

    Examples
    --------
    >>> import torch
    >>> g = torch.Generator().manual_seed(0)
    >>> p = torch.randn(500, 4, generator=g).mul(2).softmax(-1)
    >>> y = torch.multinomial(p, 1, generator=g)[:, 0]
    >>> rule = fit_sets(p, y, alpha=0.1, score="aps")
    >>> rule.n, rule.score, rule.predict(p[:3]).shape
    (500, 'aps', torch.Size([3, 4]))
    """

    threshold: float
    alpha: float
    n: int
    score: SetScore
    randomized: bool = False
    lam: float = 0.1
    k_reg: int = 1
    nonempty: bool = True

    def predict(
        self, probs: torch.Tensor, *, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Boolean sets ``(B, C)``: the classes whose score is at most :attr:`threshold`
        (plus the most probable class where that is empty, if :attr:`nonempty`)."""
        p = check_probs(probs)
        s = set_scores(p, score=self.score, randomized=self.randomized, lam=self.lam,
                       k_reg=self.k_reg, generator=generator)
        sets = s <= self.threshold
        if self.nonempty:
            empty = ~sets.any(-1)
            top = torch.nn.functional.one_hot(p.argmax(-1), p.shape[-1]).to(torch.bool)
            sets = sets | (empty[:, None] & top)
        return sets

    def to_dict(self) -> dict[str, object]:
        """The rule as JSON-ready values (:meth:`from_dict` reads them back)."""
        return {"threshold": self.threshold, "alpha": self.alpha, "n": self.n,
                "score": self.score, "randomized": self.randomized, "lam": self.lam,
                "k_reg": self.k_reg, "nonempty": self.nonempty}

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> ConformalSets:
        """Inverse of :meth:`to_dict` (values checked)."""
        if not isinstance(d, dict):
            raise TypeError(f"d must be a dict (from to_dict), got {type(d).__name__}")
        score, lam, k_reg = _check_score(d.get("score"), d.get("lam"), d.get("k_reg"))
        thr = d.get("threshold")
        n = d.get("n")
        if (isinstance(thr, bool) or not isinstance(thr, (int, float))
                or not math.isfinite(thr)):
            raise ValueError(f"a set rule needs a finite float threshold, got threshold={thr!r}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"a set rule needs an int n >= 1, got n={n!r}")
        alpha = check_alpha(d.get("alpha"))
        conformal_rank(n, alpha)  # n examples must support alpha (ValueError naming both)
        return cls(threshold=float(thr), alpha=alpha, n=n, score=score,
                   randomized=check_bool(d.get("randomized", False), "randomized"),
                   lam=lam, k_reg=k_reg, nonempty=check_bool(d.get("nonempty", True), "nonempty"))


def fit_sets(
    probs: torch.Tensor,
    targets: torch.Tensor,
    *,
    alpha: float = 0.1,
    score: SetScore = "aps",
    randomized: bool = False,
    lam: float = 0.1,
    k_reg: int = 1,
    nonempty: bool = True,
    generator: torch.Generator | None = None,
) -> ConformalSets:
    r"""Fit the split-conformal threshold on a calibration part (module docstring).

    Parameters
    ----------
    probs, targets
        ``(n, C)`` calibration probabilities (or ``(n,)`` binary) and ``(n,)`` class ids.
    alpha
        Miscoverage in ``(0, 1)``, at least ``1/(n + 1)``.
    score, randomized, lam, k_reg
        See :func:`set_scores`.
    nonempty
        Add the most probable class to an empty set (coverage kept).
    generator
        Randomised scores only: the calibration part's ``U``.

    Returns
    -------
    ConformalSets

    Raises
    ------
    ValueError
        ``alpha`` outside ``(0, 1)``, a calibration part too small for it (the message names
        the smallest ``alpha`` it supports), labels outside ``[0, C)`` or not whole numbers.

    Examples
    --------
    >>> import torch
    >>> p = torch.tensor([[0.7, 0.3], [0.4, 0.6], [0.9, 0.1]] * 10, dtype=torch.float64)
    >>> rule = fit_sets(p, torch.tensor([0, 1, 0] * 10), alpha=0.1, score="lac")
    >>> round(rule.threshold, 4), rule.predict(torch.tensor([[0.55, 0.45]])).tolist()
    (0.4, [[True, False]])
    >>> fit_sets(p[:5], torch.tensor([0, 1, 0, 0, 1]), alpha=0.1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: the calibration part is too small for alpha=0.1: n=5 examples support alpha >= ...
    """
    alpha = check_alpha(alpha)
    score, lam, k_reg = _check_score(score, lam, k_reg)
    randomized = check_bool(randomized, "randomized")
    nonempty = check_bool(nonempty, "nonempty")
    s = set_scores(probs, targets, score=score, randomized=randomized, lam=lam, k_reg=k_reg,
                   generator=generator)
    n = int(s.numel())
    k = conformal_rank(n, alpha)
    q = float(torch.sort(s).values[k - 1])
    return ConformalSets(threshold=q, alpha=alpha, n=n, score=score, randomized=randomized,
                         lam=lam, k_reg=k_reg, nonempty=nonempty)
