r"""``SARegressor``: calibrated predictive intervals from a frozen transformer regressor.

The recommended stochastic-attention recipe as one estimator::

    sa = attnuq.SARegressor(model).fit(val_data, cal_data)
    pred = sa.predict(x)          # pred.mean, pred.std, pred.interval(0.9), pred.samples
    sa.save("sa.json"); sa = attnuq.SARegressor.load("sa.json", model)

What :meth:`SARegressor.fit` does (every choice on validation data, fixed in advance):

1. ``nu`` by :func:`attnuq.calibrate` on ``val_data`` with the criterion ``"auto"`` (the
   debiased ``L_SA`` on outputs of fewer than 28 elements, the paper's above), ``n_passes =
   n_samples`` passes per evaluated ``nu``, at most 3 evaluations and the BO stopping rule
   ``nu_tol=0.25``.
2. The spread: ``S = n_samples`` stochastic passes give the centre ``f`` (the frozen output
   when ``recentre=True``, else the draws' mean) and ``sigma`` (the draws' sd) per element.
   On ``val_data`` the passes of the search at the chosen ``nu`` are reused.
3. The form (and, with ``recentre="auto"``, the centre), by the 2-fold cross-fitted
   validation CRPS: for every ``beta`` of
   :data:`attnuq.conformal.FLOOR_GRID` (in units of the validation residual scale; ``0`` is
   SA-normalised, ``inf`` plain split conformal on ``|y - f|``) the normalised scores

   .. math:: r = \frac{|y - f|}{\sqrt{\sigma^2 + \beta^2}}

   of one half of the validation examples (even / odd index) define the predictive of the other
   half (below), whose mean CRPS is measured; both directions are averaged. With
   ``gaussian=True`` (default) one more candidate is scored the same way: the Gaussian residual
   model ``N(f, s^2)``, ``s`` the RMS of ``y - f`` of the other half (constant width, Gaussian
   shape). The candidate of the lowest CRPS is kept (ties: the first in grid order, the
   Gaussian last). ``floor=False`` keeps ``beta = 0``. With ``recentre="auto"`` every
   candidate is scored about both centres, the frozen output ``f`` and the draws' mean
   ``m`` (the same passes; ``sigma`` is the same for both), and the lowest of the lot is kept
   (ties: the frozen centre). The draws' mean is an average over the attention's sampling
   noise, and on some models it predicts better than ``f``; with few passes it also carries
   Monte Carlo noise of variance ``sigma^2 / n_samples``: the validation CRPS weighs both.
4. The calibration: the scores of ``cal_data`` at that ``beta``, sorted (at most
   :data:`MAX_SCORES` order statistics kept); for the Gaussian form, ``s`` is the RMS of
   ``y - f`` on ``cal_data``.

The predictive (:class:`SAPredictive`) of an element with centre ``f`` and spread
``w = sqrt(sigma^2 + beta^2)`` (``w = 1`` for ``beta = inf``) is ``f + w T`` with ``T``
symmetric about 0, ``|T|`` distributed as the calibration scores. Its central interval at ANY
level ``L`` in (0, 1) is

.. math:: f \pm w\, r_{(k)}, \qquad k = \lceil (n + 1) L \rceil,

``r_{(k)}`` the ``k``-th smallest of the ``n`` calibration scores: split-conformal, so for a
test pair exchangeable with the calibration pairs ``P(y \in [f - w r_{(k)}, f + w r_{(k)}]) >=
L`` (finite-sample; marginal over a random element). A level with ``k > n`` is refused (too few
calibration scores). ``quantile(q)`` is the same construction (``L = |2q - 1|``, sign of
``q - 1/2``); ``std`` and ``crps`` are those of ``f + w T`` with ``|T|`` the empirical
distribution of the scores.

The Gaussian form (``form == "gaussian"``, chosen only when the cross-fitted validation CRPS
prefers it) is the same object with ``w = 1`` and, as its "scores", ``s`` times the
:data:`GAUSS_ATOMS` midpoint quantiles of ``|Z|``, ``Z ~ N(0, 1)`` (``T`` is ``N(0, 1)``
discretised): its intervals are Gaussian, ``f +- s z``, **without** the finite-sample
split-conformal guarantee. ``gaussian=False`` keeps every form split-conformal.

NOTE(paper): the conformal step, the floor and the choice of the form by cross-fitted CRPS are
ours (#20, #32, #34); the paper reports raw SA draws with ``nu`` by ``L_SA``. The Gaussian
residual form (#34) is a candidate because on small validation parts its smooth shape can beat
the empirical one in CRPS; its intervals are not finite-sample calibrated, so it is taken only
when the validation CRPS prefers it, and ``gaussian=False`` excludes it.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from attnuq._validation import check_finite, check_positive_int, check_scale_factor
from attnuq.conformal import FLOOR_GRID
from attnuq.estimators._common import (
    check_model,
    check_settings,
    jsonable,
    read_fitted,
    read_pairs,
    require_fitted,
    spearman,
    warn_and_record,
    write_envelope,
)
from attnuq.predictive import Predictive, check_level, check_probability

__all__ = ["GAUSS_ATOMS", "MAX_SCORES", "SAPredictive", "SARegressor"]

#: most calibration order statistics an estimator keeps (and writes to its JSON); with more
#: scores, the ``ceil(j n / MAX_SCORES)``-th smallest (``j = 1 .. MAX_SCORES``) are kept and a
#: level's rank is rounded up to the next kept one (wider, so coverage still ``>= L``)
MAX_SCORES = 1 << 14

#: raw validation coverage levels reported in the diagnostics
RAW_LEVELS = (0.5, 0.9, 0.95)

#: atoms of the Gaussian form: ``|T|`` takes the values ``sqrt(2) erfinv((j - 1/2) / K)``,
#: ``j = 1 .. K``, the midpoint quantiles of ``|Z|``; the symmetrised atoms are the ``2K``
#: midpoint quantiles of ``N(0, 1)`` (CRPS within ``1e-4`` relative of the exact Gaussian one)
GAUSS_ATOMS = 1000


def _gauss_abs_quantiles(k: int = GAUSS_ATOMS) -> torch.Tensor:
    """``(k,)`` ascending midpoint quantiles of ``|Z|``, ``Z ~ N(0, 1)`` (float64)."""
    j = torch.arange(1, k + 1, dtype=torch.float64)
    return math.sqrt(2.0) * torch.erfinv((j - 0.5) / k)


def _form_name(beta_units: float) -> str:
    if beta_units == 0:
        return "sa-normalised"
    if math.isinf(beta_units):
        return "conformal"
    return "sa-floor"


def _spread(sigma: torch.Tensor, beta: float) -> torch.Tensor:
    """``sqrt(sigma^2 + beta^2)`` (float64); ones for ``beta = inf``."""
    s = sigma.double()
    if math.isinf(beta):
        return torch.ones_like(s)
    return torch.sqrt(s * s + beta * beta)


def _scores(centre: torch.Tensor, sigma: torch.Tensor, y: torch.Tensor, beta: float
            ) -> torch.Tensor:
    """``|y - f| / w`` (float64), ``0`` where ``y == f``, ``inf`` where ``w = 0 < |y - f|``."""
    err = (y.double() - centre.double()).abs()
    w = _spread(sigma, beta)
    return torch.where(err > 0, err / w, torch.zeros_like(err))


def _table(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted scores as ``(values, ranks)``: every one for ``n <= MAX_SCORES``, else the
    ``ceil(j n / MAX_SCORES)``-th smallest (1-based ``ranks``)."""
    s = torch.sort(scores.reshape(-1).double()).values
    n = s.numel()
    if n <= MAX_SCORES:
        return s, torch.arange(1, n + 1, dtype=torch.int64)
    j = torch.arange(1, MAX_SCORES + 1, dtype=torch.float64)
    ranks = torch.ceil(j * n / MAX_SCORES).to(torch.int64).clamp(1, n)
    return s[ranks - 1], ranks


def _sym_atoms(values: torch.Tensor) -> torch.Tensor:
    """The atoms ``-v_K .. -v_1, v_1 .. v_K`` of the symmetrised distribution (sorted)."""
    return torch.cat([-values.flip(0), values])


def _crps_atoms(atoms: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    r"""CRPS of the equally weighted sorted ``atoms`` ``(M,)`` at each ``u`` (float64):
    ``E|T - u| - E|T - T'| / 2`` by prefix sums (``O(N log M)``)."""
    m = atoms.numel()
    prefix = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(atoms, 0)])
    flat = u.reshape(-1)
    k = torch.searchsorted(atoms, flat)  # atoms strictly below u
    below = flat * k - prefix[k]
    above = (prefix[m] - prefix[k]) - flat * (m - k)
    e_abs = (below + above) / m
    i = torch.arange(1, m + 1, dtype=torch.float64)
    gini = 2.0 * float(((2 * i - m - 1) * atoms).sum()) / (m * m)
    return (e_abs - 0.5 * gini).reshape(u.shape)


@dataclass(frozen=True)
class SAPredictive:
    r"""The calibrated predictive of :class:`SARegressor` (see the module docstring).

    Attributes
    ----------
    mean
        ``(B, ...)`` the centre ``f`` (the frozen output when recentred).
    spread
        ``(B, ...)`` ``w = sqrt(sigma^2 + beta^2)`` (ones for plain conformal), float64.
    scores, ranks
        The kept calibration order statistics (float64, ascending) and their 1-based ranks
        among the ``n`` scores.
    n
        Number of calibration scores.
    samples
        ``(S, B, ...)`` the raw SA draws (recentred when the estimator recentres): not
        calibrated, for inspection.
    frozen
        ``(B, ...)`` the frozen model's output.
    form
        ``"sa-normalised"``, ``"sa-floor"``, ``"conformal"`` or ``"gaussian"`` (module
        docstring).

    Examples
    --------
    Two calibration scores 1 and 3, centre 0, spread 2:

    >>> import torch
    >>> p = SAPredictive(mean=torch.zeros(1), spread=torch.full((1,), 2.0, dtype=torch.float64),
    ...                  scores=torch.tensor([1.0, 3.0], dtype=torch.float64),
    ...                  ranks=torch.tensor([1, 2]), n=2, samples=torch.zeros(2, 1),
    ...                  frozen=torch.zeros(1), form="sa-normalised")
    >>> [t.item() for t in p.interval(0.5)]  # k = ceil(3 * 0.5) = 2: +- 2 * 3
    [-6.0, 6.0]
    >>> p.interval(0.9)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: level=0.9 needs ceil((n + 1) level) = 3 <= n calibration scores, got n=2; ...
    """

    mean: torch.Tensor
    spread: torch.Tensor
    scores: torch.Tensor
    ranks: torch.Tensor
    n: int
    samples: torch.Tensor
    frozen: torch.Tensor
    form: str

    def _factor(self, level: torch.Tensor) -> torch.Tensor:
        """``r_(k)`` for each level (float64 tensor), ``k = ceil((n + 1) L)`` rounded up to a
        kept rank; ``0`` for ``k = 0``."""
        k = torch.ceil((self.n + 1) * level).to(torch.int64).to(self.ranks.device)
        kmax = int(k.max()) if k.numel() else 0
        if kmax > self.n:
            worst = float(level.max())
            raise ValueError(
                f"level={worst:g} needs ceil((n + 1) level) = {kmax} <= n calibration scores, "
                f"got n={self.n}; the largest level this fit supports is n / (n + 1) = "
                f"{self.n / (self.n + 1):.4g} (calibrate on more data for wider levels)"
            )
        j = torch.searchsorted(self.ranks, k.clamp_min(1))
        vals = self.scores[j.clamp_max(self.scores.numel() - 1)]
        return torch.where(k > 0, vals, torch.zeros_like(vals))

    def quantile(self, q: float | torch.Tensor) -> torch.Tensor:
        """Quantile(s) ``f + sign(q - 1/2) w r_(k)``, ``k = ceil((n + 1) |2q - 1|)``:
        ``(B, ...)`` for a float, ``(len(q), B, ...)`` for a 1-d tensor of levels."""
        qt = check_probability(q)
        lev = (2.0 * qt - 1.0).abs()
        sign = torch.sign(qt - 0.5).to(self.scores.device)
        fac = self._factor(lev.reshape(-1)).reshape(qt.shape) * sign
        fac = fac.to(self.spread.device)
        shape = qt.shape + (1,) * self.mean.dim()
        out = self.mean.double() + fac.reshape(shape) * self.spread
        return out.to(self.mean.dtype)

    def interval(self, level: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
        """Central ``level`` interval ``(lower, upper)``, each ``(B, ...)``: split-conformal
        coverage ``>= level`` at any ``level`` in (0, 1) (module docstring)."""
        lev = check_level(level)
        fac = self._factor(torch.tensor([lev], dtype=torch.float64))[0]
        half = fac.to(self.spread.device) * self.spread
        m = self.mean.double()
        return (m - half).to(self.mean.dtype), (m + half).to(self.mean.dtype)

    @property
    def std(self) -> torch.Tensor:
        """``(B, ...)`` sd of ``f + w T``: ``w sqrt(mean r^2)`` over the kept scores."""
        rms = float(self.scores.double().pow(2).mean().sqrt())
        return (self.spread * rms).to(self.mean.dtype)

    def crps(self, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """CRPS of ``f + w T`` (``|T|`` the empirical distribution of the kept scores, made
        symmetric), exact: ``w crps_T((y - f) / w)``; ``|y - f|`` where ``w = 0``.

        ``reduction``: ``"mean"`` (a 0-d tensor) or ``"none"`` (``(B, ...)``), float64.
        """
        if reduction not in ("mean", "none"):
            raise ValueError(f"reduction must be 'mean' or 'none', got {reduction=!r}")
        y = self._check_targets(targets)
        err = y - self.mean.double()
        w = self.spread
        pos = w > 0
        u = torch.where(pos, err / torch.where(pos, w, torch.ones_like(w)), torch.zeros_like(w))
        atoms = _sym_atoms(self.scores.to(u.device))
        c = torch.where(pos, w * _crps_atoms(atoms, u), err.abs())
        return c.mean() if reduction == "mean" else c

    def pit(self, targets: torch.Tensor, generator: torch.Generator | None = None
            ) -> torch.Tensor:
        """``(B, ...)`` randomised PIT ``F(y-) + U (F(y) - F(y-))`` of ``f + w T``."""
        y = self._check_targets(targets)
        atoms = _sym_atoms(self.scores.cpu())
        m = atoms.numel()
        w = self.spread
        pos = w > 0
        u = torch.where(pos, (y - self.mean.double()) / torch.where(pos, w, torch.ones_like(w)),
                        torch.zeros_like(w)).reshape(-1).cpu()  # the PIT is computed on the CPU
        lo = torch.searchsorted(atoms, u, right=False).double()
        hi = torch.searchsorted(atoms, u, right=True).double()
        v = torch.rand(u.shape, generator=generator, dtype=torch.float64)
        return ((lo + v * (hi - lo)) / m).reshape(y.shape).to(y.device)

    def sample(self, n: int, generator: torch.Generator | None = None) -> Predictive:
        """``n`` draws of ``f + w T`` as a :class:`~attnuq.predictive.Predictive`
        ``(n, B, ...)``."""
        n = check_positive_int(n, "n")
        atoms = _sym_atoms(self.scores.cpu())
        idx = torch.randint(0, atoms.numel(), (n, *self.mean.shape), generator=generator)
        draws = self.mean.double() + atoms[idx].to(self.spread.device) * self.spread
        return Predictive(samples=draws.to(self.mean.dtype), frozen=self.frozen)

    def scaled(self, factor: float | torch.Tensor) -> SAPredictive:
        """The same predictive with its spread ``w`` multiplied by ``factor`` (about the
        centre; e.g. a further conformal factor)."""
        f = torch.as_tensor(check_scale_factor(factor), dtype=torch.float64,
                            device=self.spread.device)
        return SAPredictive(mean=self.mean, spread=self.spread * f, scores=self.scores,
                            ranks=self.ranks, n=self.n, samples=self.samples,
                            frozen=self.frozen, form=self.form)

    def select(self, index: Any) -> SAPredictive:
        """The predictive of ``mean[index]`` (any index of the ``(B, ...)`` dimensions; the
        raw samples are indexed as ``samples[:, index]``)."""
        idx = index if isinstance(index, tuple) else (index,)
        return SAPredictive(mean=self.mean[idx], spread=self.spread[idx], scores=self.scores,
                            ranks=self.ranks, n=self.n, samples=self.samples[(slice(None), *idx)],
                            frozen=self.frozen[idx], form=self.form)

    def to(self, device: Any) -> SAPredictive:
        """The predictive with its per-example tensors on ``device``."""
        return SAPredictive(mean=self.mean.to(device), spread=self.spread.to(device),
                            scores=self.scores.to(device), ranks=self.ranks.to(device), n=self.n,
                            samples=self.samples.to(device), frozen=self.frozen.to(device),
                            form=self.form)

    def nll(self, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Gaussian NLL of the targets under ``N(mean, std^2)`` (the empirical score
        distribution has no density; this is the usual moment summary)."""
        from attnuq.metrics import nll_normal

        y = self._check_targets(targets)
        return nll_normal(self.mean.double(), self.std.double().clamp_min(1e-12), y,
                          reduction=reduction)  # type: ignore[arg-type]

    def _check_targets(self, targets: torch.Tensor) -> torch.Tensor:
        if not isinstance(targets, torch.Tensor):
            raise TypeError(f"targets must be a torch.Tensor, got {type(targets).__name__}")
        if targets.shape != self.mean.shape:
            raise ValueError(
                f"targets must have the prediction's shape {tuple(self.mean.shape)}, got "
                f"targets.shape={tuple(targets.shape)}"
            )
        check_finite(targets, "targets")
        return targets.double().to(self.mean.device)


@dataclass
class _Part:
    """One data part, flattened per example: centre, sigma, targets ``(N, P)`` (float64) and
    the fraction of elements inside the raw draws' central intervals at :data:`RAW_LEVELS`
    (the draws themselves are not kept)."""

    centre: torch.Tensor
    sigma: torch.Tensor
    y: torch.Tensor
    raw_coverage: dict[str, float]


class _Coverage:
    """Counts of elements inside the raw draws' empirical central intervals, batch by batch."""

    def __init__(self) -> None:
        self.inside = dict.fromkeys(RAW_LEVELS, 0.0)
        self.n = 0

    def add(self, draws: torch.Tensor, y: torch.Tensor) -> None:
        """``draws`` ``(S, B, P)``, ``y`` ``(B, P)``, float64 on one device."""
        for lev in RAW_LEVELS:
            a = (1.0 - lev) / 2.0
            q = torch.quantile(draws, torch.tensor([a, 1.0 - a], dtype=torch.float64,
                                                   device=draws.device), 0)
            self.inside[lev] += float(((y >= q[0]) & (y <= q[1])).double().sum())
        self.n += y.numel()

    def result(self) -> dict[str, float]:
        return {_key(lev): v / max(1, self.n) for lev, v in self.inside.items()}


class SARegressor:
    r"""Stochastic attention on a frozen regressor, calibrated: ``fit(val_data, cal_data)``,
    ``predict(inputs)``, ``save`` / ``load``.

    The recipe and the predictive are described in :mod:`attnuq.estimators._regressor`'s
    module docstring; the defaults are the recommendation.

    Parameters
    ----------
    model
        The frozen model (put in ``eval()`` mode by :meth:`fit`); never changed.
    output_fn
        Maps the model's output to the prediction ``(B, ...)`` (e.g.
        ``lambda out: out.logits``); default: the tensor, ``.logits`` or the first element.
    nu
        Fixed number of draws (an int or a per-layer map for :func:`attnuq.stochastic`), or
        ``None`` (default): chosen by :func:`attnuq.calibrate` on ``val_data``.
    criterion
        :func:`attnuq.calibrate`'s criterion (default ``"auto"``).
    recentre
        Centre on the frozen output (``True``, default: SA never moves the point prediction),
        on the draws' mean (``False``), or ``"auto"``: the one of the two whose best form has
        the lower cross-fitted validation CRPS (ties: the frozen output;
        ``diagnostics["centre"]`` says which, ``diagnostics["val_crps_by_centre"]`` both
        scores).
    floor
        ``True`` (default): choose ``beta`` (and so the form: SA-normalised, SA with a floor,
        plain conformal) by the cross-fitted validation CRPS; ``False``: ``beta = 0``.
    gaussian
        ``True`` (default, with ``floor=True``): the Gaussian residual model ``N(f, s^2)``
        (constant ``s``) is one more candidate of that choice; its intervals are not
        split-conformal. ``False``: every form is split-conformal.
    nu_range
        The search range of ``nu``.
    n_samples
        Stochastic passes per example, at every step (search, spread, prediction): the
        spread of a test element is estimated exactly as the calibration one (needed for
        split-conformal validity).
    seed
        Seeds every draw (search and prediction): the same seed gives the same numbers.
    progress
        tqdm bars (``None``: only on a terminal).
    **calibrate_kwargs
        Passed to :func:`attnuq.calibrate` (``search``, ``max_evals`` (default ``3`` here),
        ``nu_tol`` (default ``0.25`` here), ``per_layer``, ``batch_replicas``, ``max_rows``,
        ...). Defaults chosen for cost: with 6 passes, at most 3 evaluations and the stopping
        rule, a fit takes at most ``0.5 + 3 * 6 / 2 + 0.5 + 6 / 2 = 13`` passes over the
        held-out data (equal parts; ``docs/benchmarks/calibrate.md`` measures the time).
        More passes (``n_samples=``) estimate each element's spread better, at that cost.

    Attributes
    ----------
    diagnostics
        After :meth:`fit` (and in the JSON): ``nu`` (and ``nu_map``), ``nu_at_edge``
        (``None``, ``"lower"`` or ``"upper"``) with SA's ``edge_spread`` and
        ``edge_target_scale``, ``criterion_resolved``, ``spearman_spread_abs_error`` (on
        ``val_data``), ``floor_beta`` (absolute; ``inf`` = constant width: plain conformal or
        the Gaussian form), ``floor_beta_units``, ``form``, ``centre`` (``"frozen"`` or
        ``"mean"``), ``val_crps_by_beta`` (about that centre; the key
        ``"gaussian"`` for the Gaussian form), ``raw_val_coverage`` at 50/90/95 %, ``n_val`` /
        ``n_cal`` (elements), ``forward_passes`` and ``fit_seconds``, and ``warnings``.

    Examples
    --------
    A one-layer encoder regressor (untrained: the numbers only show the API):

    >>> import torch
    >>> from torch import nn
    >>> _ = torch.manual_seed(0)
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    ...         self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
    ...         self.head = nn.Linear(8, 1)
    ...     def forward(self, x):
    ...         return self.head(self.enc(x).mean(1)).squeeze(-1)
    >>> net = Net().eval()
    >>> x = torch.randn(120, 5, 8)
    >>> with torch.no_grad():
    ...     y = net(x) + 0.1 * torch.randn(120)
    >>> sa = SARegressor(net, nu_range=(1, 64), progress=False)
    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")  # an untrained net: nu may sit at an edge
    ...     sa = sa.fit([(x[:60], y[:60])], [(x[60:], y[60:])])
    >>> pred = sa.predict(x[:4])
    >>> lo, hi = pred.interval(0.8)
    >>> lo.shape, bool((lo <= pred.mean).all() and (pred.mean <= hi).all())
    (torch.Size([4]), True)
    >>> sorted(sa.diagnostics["raw_val_coverage"])
    ['0.5', '0.9', '0.95']
    """

    def __init__(
        self,
        model: nn.Module,
        output_fn: Any = None,
        *,
        nu: int | Mapping[str, Any] | None = None,
        criterion: str = "auto",
        recentre: bool | Literal["auto"] = True,
        floor: bool = True,
        gaussian: bool = True,
        nu_range: tuple[int, int] = (1, 1024),
        n_samples: int = 6,
        seed: int = 0,
        progress: bool | None = None,
        **calibrate_kwargs: Any,
    ) -> None:
        from attnuq.calibration import check_calibrate_kwargs, get_criterion
        from attnuq.calibration.search import check_nu_range

        self.model = check_model(model)
        self.n_samples = check_settings(output_fn, seed, n_samples=n_samples)["n_samples"]
        self.output_fn, self.seed = output_fn, seed
        if nu is not None and not isinstance(nu, Mapping):
            check_positive_int(nu, "nu")
        self.nu = nu
        self.criterion = get_criterion(criterion).name
        if not (isinstance(recentre, bool) or (isinstance(recentre, str) and recentre == "auto")):
            raise TypeError(f"recentre must be a bool or 'auto', got recentre={recentre!r}")
        for name, v in (("floor", floor), ("gaussian", gaussian)):
            if not isinstance(v, bool):
                raise TypeError(f"{name} must be a bool, got {name}={v!r}")
        self.recentre = recentre
        self.floor = floor
        self.gaussian = gaussian
        self.nu_range = check_nu_range(nu_range)
        self.calibrate_kwargs = {"nu_tol": 0.25, "max_evals": 3, **calibrate_kwargs}
        check_calibrate_kwargs(
            "SARegressor", self.calibrate_kwargs,
            reserved=("criterion", "n_passes", "nu_range", "seed", "output_fn", "progress",
                      "level"),
            criterion=self.criterion, n_passes=self.n_samples, nu_range=self.nu_range,
            seed=seed, output_fn=output_fn, progress=progress)
        self.progress = progress
        self._fitted: dict[str, Any] | None = None
        self.diagnostics: dict[str, Any] = {}
        self.report: Any = None  # the CalibrationReport of the search (None when nu is given)
        self.metadata: dict[str, Any] = {}  # free-form, saved with the estimator

    # ------------------------------------------------------------------ fit
    def fit(self, val_data: Iterable[Any], cal_data: Iterable[Any]) -> SARegressor:
        """Choose ``nu`` and the form on ``val_data``, the conformal scores on ``cal_data``.

        Parameters
        ----------
        val_data, cal_data
            Iterables of ``(inputs, targets)`` pairs (a ``DataLoader`` works; one
            ``(inputs, targets)`` tuple is one batch): ``inputs`` a tensor, a tuple of tensors
            or a dict of keyword arguments, as the model takes them; ``targets`` ``(B, ...)``
            of the prediction's shape. Two disjoint held-out parts, neither used in training.

        Returns
        -------
        SARegressor
            ``self``, fitted.

        Raises
        ------
        ValueError
            Empty data, NaN targets, targets whose shape differs from the prediction's,
            fewer than 2 validation examples, too few calibration scores.
        """
        from attnuq.calibration import calibrate
        from attnuq.calibration.criteria import resolve_criterion

        t0 = time.perf_counter()
        val = read_pairs(val_data, "val_data")
        cal = read_pairs(cal_data, "cal_data")
        if tuple(val[0][1].shape[1:]) != tuple(cal[0][1].shape[1:]):
            raise ValueError(
                f"val_data and cal_data targets must share one shape beyond dim 0, got "
                f"{tuple(val[0][1].shape)} and {tuple(cal[0][1].shape)}"
            )
        self.model.eval()
        diag: dict[str, Any] = {}
        passes = 0
        seen: dict[Any, Any] = {}

        def observe(key: Any, value: Any) -> None:
            """The search's frozen units, then each evaluated nu's passes, summarised at
            once (centre, sigma, raw coverage: no draws kept). Under a process group a rank
            holds its own units' frozen outputs only: the validation part is then re-run."""
            if key == "shards":
                if len(value.mine) == len(value.units):
                    seen["shards"] = value
            elif "shards" in seen:
                seen[key] = self._part_from_stats(seen["shards"], value)

        val_parts: dict[str, _Part] | None = None
        if self.nu is None:
            from attnuq.calibration import EdgeWarning

            with warnings.catch_warnings():  # shown below, once, and recorded
                warnings.simplefilter("ignore", EdgeWarning)
                self.report = calibrate(
                    self.model, val, criterion=self.criterion,  # type: ignore[arg-type]
                    n_passes=self.n_samples, nu_range=self.nu_range, output_fn=self.output_fn,
                    seed=self.seed, progress=self.progress, _observe=observe,
                    **self.calibrate_kwargs,
                )
            nu_spec: Any = self.report.nu_spec
            passes += self.report.forward_passes * self.report.n_examples
            edge = self.report.edge
            if self.report.nu_map is None and self.report.nu in seen:
                val_parts = seen[self.report.nu]
            seen.clear()
        else:
            nu_spec = dict(self.nu) if isinstance(self.nu, Mapping) else int(self.nu)
            edge = None
        if val_parts is None:
            val_parts = self._part(val, nu_spec, "val_data")
            passes += (1 + self.n_samples) * next(iter(val_parts.values())).y.shape[0]
        cal_parts = self._part(cal, nu_spec, "cal_data")
        passes += (1 + self.n_samples) * next(iter(cal_parts.values())).y.shape[0]
        y_val = next(iter(val_parts.values())).y
        if y_val.shape[1:] != next(iter(cal_parts.values())).y.shape[1:]:
            raise ValueError("val_data and cal_data predictions differ in shape")
        d = int(y_val.shape[1])
        diag["nu"] = nu_spec if not isinstance(nu_spec, dict) else None
        diag["nu_map"] = nu_spec if isinstance(nu_spec, dict) else None
        diag["nu_range"] = list(self.nu_range)
        diag["nu_at_edge"] = None if edge is None else edge["side"]
        diag["edge_spread"] = None if edge is None else edge["spread"]
        diag["edge_target_scale"] = None if edge is None else edge["target_scale"]
        diag["criterion_resolved"] = (resolve_criterion(self.criterion, d, self.n_samples)
                                      if self.nu is None else None)
        # the form (and with recentre="auto" the centre): by the cross-fitted validation CRPS
        forms = {c: self._forms(part, c) for c, part in val_parts.items()}
        order = [(c, b) for c in forms for b in forms[c][1]]  # tie-break: centres, then grid
        finite = [(c, b) for c, b in order if math.isfinite(forms[c][1][b])]
        if not finite:
            raise ValueError(
                "every form has an infinite validation CRPS: SA's spread is 0 where the "
                "frozen output misses the target; use floor=True"
            )
        centre, chosen = min(finite, key=lambda cb: (forms[cb[0]][1][cb[1]], order.index(cb)))
        scale, crps = forms[centre]
        val_part, cal_part = val_parts[centre], cal_parts[centre]
        err = (val_part.y - val_part.centre).abs()
        diag["centre"] = centre
        diag["spearman_spread_abs_error"] = spearman(val_part.sigma, err)
        diag["raw_val_coverage"] = dict(val_part.raw_coverage)
        n_cal = int(cal_part.y.numel())
        if chosen == "gaussian":  # N(f, s^2), s from cal: unit spread, s |Z| as the scores
            units, form = math.inf, "gaussian"
            s_cal = float((cal_part.y - cal_part.centre).pow(2).mean().sqrt())
            values = s_cal * _gauss_abs_quantiles()
            ranks = torch.arange(1, values.numel() + 1, dtype=torch.int64)
        else:
            units = float(chosen)
            form = _form_name(units)
            cal_scores = _scores(cal_part.centre, cal_part.sigma, cal_part.y, units * scale)
            if bool(torch.isinf(cal_scores).any()):
                raise ValueError(
                    f"cal_data: {int(torch.isinf(cal_scores).sum())} calibration target(s) "
                    "lie off the centre where SA's spread is 0 (beta = 0): no finite "
                    "conformal factor"
                )
            values, ranks = _table(cal_scores)
        beta = units * scale
        self._fitted = {
            "nu": nu_spec, "beta": beta, "beta_units": units, "form": form, "centre": centre,
            "residual_scale": scale, "n_cal": int(ranks[-1]),
            "scores": values, "ranks": ranks,
            "criterion_resolved": diag["criterion_resolved"],
        }
        diag.update(
            floor_beta=beta, floor_beta_units=units, form=form,
            val_residual_scale=scale,
            val_crps_by_beta={b if isinstance(b, str) else _key(b): c
                              for b, c in crps.items()},
            n_val=int(val_part.y.numel()), n_cal=n_cal,
            forward_passes=int(passes), fit_seconds=time.perf_counter() - t0,
        )
        if len(forms) > 1:
            diag["val_crps_by_centre"] = {c: min(f[1].values()) for c, f in forms.items()}
        self.diagnostics = diag
        if edge is not None:
            from attnuq.calibration import edge_message

            warn_and_record(diag, "SARegressor.fit: " + edge_message(edge, self.criterion))
        if math.isinf(units) and self.floor:
            sa_best = min((c for b, c in crps.items() if not isinstance(b, str)
                           and not math.isinf(b) and math.isfinite(c)), default=math.nan)
            what = ("plain split conformal (beta = inf" if form == "conformal" else
                    "the Gaussian residual model (N(f, s^2), not split-conformal")
            warn_and_record(
                diag,
                f"SARegressor.fit: the validation scores chose {what}, constant width): "
                f"cross-fitted validation CRPS {crps[chosen]:.4g} against {sa_best:.4g} for "
                f"the best SA-normalised form; SA's spread added nothing here (validation "
                f"Spearman(spread, |error|) = {diag['spearman_spread_abs_error']:.3f})",
            )
        return self

    def _forms(self, part: _Part, centre: str) -> tuple[float, dict[float | str, float]]:
        """The validation residual scale about ``part``'s centre and the cross-fitted CRPS of
        every candidate form (``beta`` in units of that scale, ``"gaussian"``)."""
        scale = float((part.y - part.centre).pow(2).mean().sqrt())
        if not scale > 0:
            what = "the frozen model" if centre == "frozen" else "the draws' mean"
            raise ValueError(f"val_data: {what} fits every validation target exactly "
                             "(residual scale 0); nothing to calibrate")
        grid = FLOOR_GRID if self.floor else (0.0,)
        crps: dict[float | str, float] = {
            float(b): self._crossfit_crps(part, float(b) * scale) for b in grid}
        if self.floor and self.gaussian:
            crps["gaussian"] = self._crossfit_gaussian(part)
        return scale, crps

    def _centres(self) -> tuple[str, ...]:
        """The candidate centres, in tie-break order: ``"frozen"`` (the frozen output, the draws
        recentred on it) and / or ``"mean"`` (the draws' mean, the draws as drawn)."""
        if self.recentre == "auto":
            return ("frozen", "mean")
        return ("frozen",) if self.recentre else ("mean",)

    def _part(self, pairs: list[tuple[Any, torch.Tensor]], nu: Any, name: str
              ) -> dict[str, _Part]:
        """Per candidate centre (:meth:`_centres`): centre, sigma, targets and the raw draws'
        coverage of every pair (``n_samples`` passes each, shared by the centres)."""
        from attnuq.montecarlo import predict
        from attnuq.predictive import recentre

        centres = self._centres()
        cols: dict[str, list[torch.Tensor]] = {c: [] for c in centres}
        ss, ys = [], []
        cov = {c: _Coverage() for c in centres}
        # one centre: the draws come from predict as that centre has them (recentred there)
        rec = "mean" if centres == ("frozen",) else None
        for i, (x, y) in enumerate(pairs):
            pred = predict(self.model, x, nu=nu, n_samples=self.n_samples, seed=self.seed,
                           output_fn=self.output_fn, progress=self.progress,
                           recentre=rec, **self._predict_kwargs())
            if pred.samples.shape[1:] != y.shape:
                raise ValueError(
                    f"{name}: the prediction and the targets of batch {i} differ in shape: "
                    f"prediction.shape={tuple(pred.samples.shape[1:])}, "
                    f"targets.shape={tuple(y.shape)}"
                )
            b = y.shape[0]
            yb = y.reshape(b, -1).double().to(pred.samples.device)
            ys.append(yb)
            for c in centres:
                p = pred
                if c == "frozen" and rec is None:
                    assert pred.frozen is not None
                    p = Predictive(samples=recentre(pred.samples, pred.frozen, "mean"),
                                   frozen=pred.frozen)
                centre, s = self._centre_sigma(p, c)
                cols[c].append(centre.reshape(b, -1))
                if c == centres[0]:
                    ss.append(s.reshape(b, -1))
                cov[c].add(p.samples.double().reshape(self.n_samples, b, -1), yb)
        sigma, yy = torch.cat(ss).cpu(), torch.cat(ys).cpu()
        return {c: _Part(torch.cat(cols[c]).cpu(), sigma, yy, cov[c].result())
                for c in centres}

    def _part_from_stats(self, shards: Any, st: Any) -> dict[str, _Part]:
        """The validation part from the search's own passes at the chosen ``nu`` (no new
        pass): ``f_nu - f`` per unit ``(M, b_u, P)``, the cached frozen outputs and the
        residuals ``y - f``; per candidate centre as :meth:`_part`."""
        centres = self._centres()
        cols: dict[str, list[torch.Tensor]] = {c: [] for c in centres}
        ss, ys = [], []
        cov = {c: _Coverage() for c in centres}
        for u, dev in enumerate(st.dev):
            f_u = shards.mine[u][1]
            b = int(f_u.shape[0])
            f = f_u.reshape(b, -1).double().cpu()
            raw = f + dev  # (M, b_u, P)
            yb = f + shards.resid[u]
            ys.append(yb)
            for c in centres:
                draws = raw - raw.mean(0) + f if c == "frozen" else raw
                cols[c].append(f if c == "frozen" else raw.mean(0))
                if c == centres[0]:  # the sd of the first centre's draws (equal up to rounding)
                    ss.append(draws.std(0, unbiased=True))
                cov[c].add(draws, yb)
        sigma, yy = torch.cat(ss), torch.cat(ys)
        return {c: _Part(torch.cat(cols[c]), sigma, yy, cov[c].result()) for c in centres}

    @staticmethod
    def _centre_sigma(pred: Predictive, centre: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``centre`` (the frozen output or the draws' mean) and the draws' sd, float64."""
        smp = pred.samples.double()
        sigma = smp.std(0, unbiased=True)
        if centre == "frozen":
            assert pred.frozen is not None
            return pred.frozen.double(), sigma
        return smp.mean(0), sigma

    def _predict_kwargs(self) -> dict[str, Any]:
        keys = ("batch_replicas", "max_rows", "distributed", "chunk_examples")
        return {k: self.calibrate_kwargs[k] for k in keys if k in self.calibrate_kwargs}

    @staticmethod
    def _crossfit_gaussian(part: _Part) -> float:
        """Mean CRPS over the validation elements of the Gaussian form, each half (even / odd
        example index) predicted as ``N(f, s^2)`` with ``s`` the RMS of ``y - f`` of the other
        half (discretised by :data:`GAUSS_ATOMS`, as predicted); ``inf`` if ``s = 0``."""
        n = part.y.shape[0]
        idx = torch.arange(n)
        folds = [idx[idx % 2 == 0], idx[idx % 2 == 1]]
        if min(len(f) for f in folds) == 0:
            raise ValueError(f"val_data needs at least 2 examples for the form's choice, got {n}")
        atoms = _sym_atoms(_gauss_abs_quantiles())
        total, count = 0.0, 0
        for a, b in ((folds[0], folds[1]), (folds[1], folds[0])):
            s = float((part.y[a] - part.centre[a]).pow(2).mean().sqrt())
            if not s > 0:
                return math.inf
            c = s * _crps_atoms(atoms, (part.y[b] - part.centre[b]) / s)
            total += float(c.sum())
            count += c.numel()
        return total / count

    @staticmethod
    def _crossfit_crps(part: _Part, beta: float) -> float:
        """Mean CRPS over the validation elements, each half (even / odd example index)
        predicted with the scores of the other half; ``inf`` if a score is infinite."""
        n = part.y.shape[0]
        idx = torch.arange(n)
        folds = [idx[idx % 2 == 0], idx[idx % 2 == 1]]
        if min(len(f) for f in folds) == 0:
            raise ValueError(f"val_data needs at least 2 examples for the form's choice, got {n}")
        total, count = 0.0, 0
        for a, b in ((folds[0], folds[1]), (folds[1], folds[0])):
            sc = _scores(part.centre[a], part.sigma[a], part.y[a], beta).reshape(-1)
            if bool(torch.isinf(sc).any()):
                return math.inf
            atoms = _sym_atoms(torch.sort(sc).values)
            w = _spread(part.sigma[b], beta)
            err = part.y[b] - part.centre[b]
            pos = w > 0
            u = torch.where(pos, err / torch.where(pos, w, torch.ones_like(w)), torch.zeros_like(w))
            c = torch.where(pos, w * _crps_atoms(atoms, u), err.abs())
            total += float(c.sum())
            count += c.numel()
        return total / count

    # -------------------------------------------------------------- predict
    def _require_fitted(self) -> dict[str, Any]:
        return require_fitted(self._fitted, "SARegressor")

    def predict(self, inputs: Any) -> SAPredictive:
        """The calibrated predictive of one batch of ``inputs`` (a tensor, tuple or dict as
        the model takes them): ``n_samples`` stochastic passes with the fitted ``nu``.

        Returns
        -------
        SAPredictive
            ``mean``, ``std``, ``interval(level)`` (any level), ``quantile(q)``, ``crps``,
            ``pit``, raw ``samples`` ``(S, B, ...)``.
        """
        from attnuq.montecarlo import predict

        fit = self._require_fitted()
        pred = predict(self.model, inputs, nu=fit["nu"], n_samples=self.n_samples,
                       seed=self.seed, output_fn=self.output_fn, progress=self.progress,
                       recentre="mean" if fit["centre"] == "frozen" else None,
                       **self._predict_kwargs())
        centre, sigma = self._centre_sigma(pred, fit["centre"])
        assert pred.frozen is not None
        dev = pred.frozen.device
        return SAPredictive(
            mean=centre.to(pred.frozen.dtype), spread=_spread(sigma, fit["beta"]),
            scores=fit["scores"].to(dev), ranks=fit["ranks"].to(dev), n=fit["n_cal"],
            samples=pred.samples, frozen=pred.frozen, form=fit["form"],
        )

    # ------------------------------------------------------------ save/load
    def to_dict(self) -> dict[str, Any]:
        """The fitted estimator as a JSON-ready dict (settings, fitted values, diagnostics)."""
        fit = self._require_fitted()
        return {
            "settings": {
                "nu": self.nu if not isinstance(self.nu, Mapping) else dict(self.nu),
                "criterion": self.criterion, "recentre": self.recentre, "floor": self.floor,
                "gaussian": self.gaussian,
                "nu_range": list(self.nu_range), "n_samples": self.n_samples,
                "seed": self.seed, "calibrate_kwargs": jsonable(self.calibrate_kwargs),
            },
            "fitted": {
                "nu": fit["nu"], "criterion_resolved": fit["criterion_resolved"],
                "beta": fit["beta"], "beta_units": fit["beta_units"], "form": fit["form"],
                "centre": fit["centre"], "residual_scale": fit["residual_scale"],
                "n_cal": fit["n_cal"],
                "ranks": fit["ranks"].tolist(), "scores": fit["scores"].tolist(),
            },
            "diagnostics": jsonable(self.diagnostics),
        }

    def save(self, path: str | Path, *, metadata: Mapping[str, Any] | None = None) -> Path:
        """Write the fitted estimator to ``path`` as JSON, atomically: the settings, ``nu``
        (or the per-layer map), the resolved criterion, ``beta``, the calibration order
        statistics, the seed, the library version, the model's digest and the diagnostics.
        Never the weights. ``metadata`` (JSON-ready) is stored as is and comes back as
        :attr:`metadata` after :meth:`load`."""
        payload = self.to_dict()
        meta = dict(self.metadata if metadata is None else metadata)
        if meta:
            payload["metadata"] = jsonable(meta)
        return write_envelope(path, "SARegressor", self.model, payload)

    @classmethod
    def load(cls, path: str | Path, model: nn.Module, output_fn: Any = None, *,
             strict: bool = True, progress: bool | None = None) -> SARegressor:
        """Read an estimator written by :meth:`save` for ``model``.

        ``model`` must have the digest recorded in the file (the same parameters and buffers)
        unless ``strict=False`` (then a warning). A torn, foreign or malformed file raises
        ``ValueError`` naming the file and the field. ``output_fn`` is not saved (a function):
        pass the one used at fit time.
        """

        def build(obj: dict[str, Any]) -> SARegressor:
            st, ft = obj["settings"], obj["fitted"]
            kwargs = dict(st.get("calibrate_kwargs") or {})
            est = cls(model, output_fn, nu=st["nu"], criterion=st["criterion"],
                      recentre=st["recentre"], floor=st["floor"],
                      gaussian=bool(st.get("gaussian", False)),
                      nu_range=tuple(st["nu_range"]), n_samples=st["n_samples"],
                      seed=st["seed"], progress=progress, **kwargs)
            nu = ft["nu"]
            if isinstance(nu, dict):
                nu = {k: tuple(v) if isinstance(v, list) else v for k, v in nu.items()}
            elif isinstance(nu, bool) or not isinstance(nu, int) or nu < 1:
                raise ValueError(f"fitted.nu must be an int >= 1 or a map, got {nu!r}")
            # files written before the centre was a fitted value: the setting decides it
            implied = {True: "frozen", False: "mean"}.get(st["recentre"])
            centre = ft.get("centre", implied)
            if centre not in ("frozen", "mean") or (implied is not None and centre != implied):
                raise ValueError(f"fitted.centre must be 'frozen' or 'mean' (and agree with "
                                 f"settings.recentre={st['recentre']!r}), got {centre!r}")
            beta = float(ft["beta"])
            if not beta >= 0:
                raise ValueError(f"fitted.beta must be >= 0, got {beta!r}")
            scores = torch.tensor([float(v) for v in ft["scores"]], dtype=torch.float64)
            ranks = torch.tensor([int(v) for v in ft["ranks"]], dtype=torch.int64)
            n = int(ft["n_cal"])
            if (scores.numel() == 0 or scores.numel() != ranks.numel()
                    or not bool(torch.isfinite(scores).all()) or bool((scores < 0).any())
                    or bool((scores[1:] < scores[:-1]).any())
                    or bool((ranks[1:] <= ranks[:-1]).any())
                    or int(ranks[0]) < 1 or int(ranks[-1]) != n):
                raise ValueError("fitted.scores / fitted.ranks must be equally long, sorted, "
                                 f"finite, >= 0, with ranks in [1, n_cal={n}] ending at n_cal")
            est._fitted = {
                "nu": nu, "beta": beta, "beta_units": float(ft["beta_units"]),
                "form": str(ft["form"]), "centre": centre,
                "residual_scale": float(ft["residual_scale"]),
                "n_cal": n, "scores": scores, "ranks": ranks,
                "criterion_resolved": ft.get("criterion_resolved"),
            }
            est.metadata = dict(obj.get("metadata") or {})
            return est

        return read_fitted(path, "SARegressor", model, strict=strict, build=build)

    def __repr__(self) -> str:
        state = "unfitted" if self._fitted is None else (
            f"nu={self._fitted['nu']!r}, form={self._fitted['form']!r}")
        return f"SARegressor({type(self.model).__name__}, {state})"


def _key(v: float) -> str:
    """A float as a JSON key: ``"inf"`` for infinity, else its shortest repr."""
    return "inf" if math.isinf(v) else repr(float(v))

