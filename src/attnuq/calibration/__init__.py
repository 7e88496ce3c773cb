r"""Calibrate the number of draws ``nu`` of stochastic attention on held-out data.

``report = attnuq.calibrate(model, data, criterion="paper", search="bo")``; ``report.nu``.

Notation (METHODS.md, SA section): frozen output ``f(x)``, a stochastic pass ``f_nu(x)``,
perturbation size ``R_nu(x) = |f_nu(x) - f(x)|_2`` and residual ``Z(x, y) = |y - f(x)|_2``
(norms over all non-batch dimensions of one example); ``M = n_passes`` stochastic passes per
example give ``r(x) = mean_m R``, ``v(x) = var_m R`` (unbiased) and the M-member ensemble
``f_nu^{(1..M)}(x)``. The mean perturbation scale is ``s(nu) = E_cal[r]`` and the residual scale
``s_0 = E_cal[Z]``.

Criteria (the objective is minimised; each evaluation also reports the standard error):

* ``"paper"``: ``L_SA(nu) = E_cal[v(x) + (r(x) - Z)^2]`` (the paper's eq. 9, M passes per x).
* ``"scale"``: ``|ln(s(nu) / s_0)|`` -- mean perturbation scale equals residual scale.
* ``"crps"``: mean fair CRPS (:func:`attnuq.metrics.crps_samples`) of the M-pass ensemble,
  averaged over the elements of each example, then over examples.
* ``"coverage"``: ``|cov(nu) - level|`` where ``cov`` is the fraction of elements inside the
  Student-t prediction interval of the M-member ensemble,
  ``mean_m f_nu ± t_{M-1, (1+level)/2} sd_m(f_nu) sqrt(1 + 1/M)``, which has coverage exactly
  ``level`` when the target and the M draws are i.i.d. normal (for any ``M``). An
  empirical-quantile interval of only ``M`` draws would under-cover even for a calibrated
  ensemble, and a randomised-PIT band cannot resolve ``level`` with ``M + 1`` rank bins.

Search ``"grid"``: every integer of a log-spaced grid over ``nu_range``; the choice is the
minimum of the measured objective, and the *noise band* is every grid ``nu`` whose objective
exceeds the minimum by at most ``2`` standard errors of the paired difference (same examples,
so the example-to-example variation cancels).

Search ``"bo"``: the paper's 1-D Bayesian optimisation with the log-linear surrogate

.. math:: \ln s(\nu) = a \ln \nu + \ln b + \varepsilon,

a Bayesian linear regression in ``x = ln nu`` (prior ``a ~ N(-1/2, 1/2^2)`` -- one SA layer has
``Cov ∝ 1/nu`` -- and a broad ``ln b ~ N(0, 10^2)``; observation variance = the squared standard
error of ``ln s`` plus a misfit ``tau^2``). Every criterion is mapped to a *target scale*
``s_*`` so that the surrogate of ``s(nu)`` targets ``ln s_*``:

* ``"scale"``: ``s_* = s_0``.
* ``"paper"``: rescaling all perturbations by ``t`` turns the estimator into the quadratic
  ``t^2 E[v + r^2] - 2t E[r Z] + E[Z^2]`` (exact algebra), minimised at
  ``t_* = E[rZ] / E[v + r^2]``; so ``s_* = t_* s(nu)``.
* ``"crps"`` / ``"coverage"``: ``s_* = k_* s(nu)`` with ``k_*`` the factor that, applied to the
  perturbations ``f_nu - f`` of the evaluated passes about ``f``, minimises the criterion
  (searched over ``k`` in ``[2^-6, 2^6]`` on a log grid of step ``2^{1/4}``, refined with step
  ``2^{1/64}`` around the minimum; plateaus resolve to their geometric middle; no forward passes).

This assumes that changing ``nu`` mainly rescales the perturbation (exact for a single SA layer
in the Gaussian limit); ``s_*`` is re-estimated after every evaluation and the estimate from the
evaluated ``nu`` closest to it (smallest ``|ln k_*|``) is used, so the assumption is only needed
locally. The first ``nu`` is the geometric middle ``round(sqrt(lo * hi))`` of the range; each
next ``nu`` minimises the posterior expected loss
``E[(ln s(nu) - ln s_*)^2] = (m(nu) - ln s_*)^2 + var(nu)`` over the integers in ``nu_range``;
the search stops when that ``nu`` was already evaluated or after ``max_evals`` evaluations. The
choice: among the evaluated ``nu`` inside the 95 % posterior interval of the surrogate's root
(:attr:`CalibrationReport.nu_interval`), the one with the smallest measured objective (as on
the grid); if none is inside, the evaluated ``nu`` with the smallest posterior expected loss.

NOTE(paper): the paper gives the surrogate and the scale matching for ``L_SA``; the mapping of
``L_SA``, CRPS and coverage to a target scale by rescaling perturbations is ours.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from attnuq._validation import check_finite, check_positive_int
from attnuq.prediction import (
    Inputs,
    OutputFn,
    batch_size,
    call_model,
    extract,
    replicas_per_call,
    stochastic_passes,
)

__all__ = ["CalibrationReport", "Evaluation", "calibrate", "log_grid"]

Criterion = Literal["paper", "scale", "crps", "coverage"]
Search = Literal["bo", "grid"]
CRITERIA = ("paper", "scale", "crps", "coverage")
SEARCHES = ("bo", "grid")
_K_COARSE = 2.0 ** torch.linspace(-6, 6, 49, dtype=torch.float64)  # perturbation rescaling


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------
@dataclass
class Evaluation:
    """One evaluated ``nu``.

    Attributes
    ----------
    nu, objective, se
        The value, the criterion's objective and its standard error (over examples).
    scale, scale_se
        ``s(nu)`` (mean perturbation size) and its standard error.
    target_scale
        This evaluation's estimate of the criterion's target scale ``s_*``.
    values
        Every criterion's raw value at this ``nu``: ``l_sa``, ``crps``, ``coverage``,
        ``scale_ratio`` (``s / s_0``).
    passes, model_calls, seconds
        Stochastic passes over the calibration set, model calls and wall time.

    Examples
    --------
    Normally made by :func:`calibrate` (``report.evaluations``); by hand:

    >>> e = Evaluation(nu=8, objective=0.12, se=0.01, scale=0.3, scale_se=0.02,
    ...                target_scale=0.28, values={"l_sa": 0.12}, passes=10, model_calls=10,
    ...                seconds=0.5)
    >>> d = e.to_dict()  # JSON-ready, without the per-example influence
    >>> d["nu"], d["values"], "influence" in d
    (8, {'l_sa': 0.12}, False)
    """

    nu: int
    objective: float
    se: float
    scale: float
    scale_se: float
    target_scale: float
    values: dict[str, float]
    passes: int
    model_calls: int
    seconds: float
    influence: np.ndarray | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("influence")
        return d


@dataclass
class CalibrationReport:
    """Result of :func:`calibrate`: the chosen ``nu`` and everything evaluated on the way.

    Attributes
    ----------
    nu
        Chosen number of draws.
    criterion, search, level, n_passes, nu_range, seed
        The settings used.
    evaluations
        Every evaluated ``nu`` in evaluation order (:class:`Evaluation`).
    residual_scale
        ``s_0 = E_cal |y - f(x)|_2``.
    target_scale
        The target scale ``s_*`` used by the surrogate (see module docstring).
    surrogate
        Posterior of the log-linear surrogate: ``mean`` and ``cov`` of ``(ln b, a)`` with
        ``x = ln nu - x_center``, ``x_center``, ``tau``, ``target_log_scale``; for ``"grid"``
        it is fitted to the grid points for display only.
    nu_interval
        BO: 95 % posterior interval of the ``nu`` where the surrogate mean meets the target
        (the target treated as fixed).
    noise_band
        Grid: every grid ``nu`` within 2 paired standard errors of the best objective.
    forward_passes
        Passes over the calibration set: ``1`` frozen + ``n_passes`` per evaluation.
    model_calls, wall_time, n_examples
        Model calls (chunks), seconds, calibration examples.

    Examples
    --------
    >>> import pathlib, tempfile
    >>> import torch
    >>> _ = torch.manual_seed(0)
    >>> mha = torch.nn.MultiheadAttention(4, 1, batch_first=True).eval()
    >>> x = torch.randn(8, 3, 4)
    >>> with torch.no_grad():
    ...     y = mha(x, x, x)[0] + 0.1 * torch.randn(8, 3, 4)
    >>> report = calibrate(mha, [((x, x, x), y)], criterion="scale", n_passes=2, max_evals=3,
    ...                    nu_range=(1, 64), output_fn=lambda out: out[0], progress=False)
    >>> report.chosen.nu == report.nu, report.n_examples
    (True, 8)
    >>> report.forward_passes == 1 + report.n_passes * len(report.evaluations)
    True
    >>> with tempfile.TemporaryDirectory() as d:
    ...     back = CalibrationReport.load(report.save(pathlib.Path(d) / "report.json"))
    >>> back.to_dict() == report.to_dict()
    True
    """

    nu: int
    criterion: str
    search: str
    level: float
    n_passes: int
    nu_range: tuple[int, int]
    seed: int | None
    evaluations: list[Evaluation]
    residual_scale: float
    target_scale: float
    surrogate: dict[str, Any] | None
    nu_interval: tuple[float, float] | None
    noise_band: list[int] | None
    forward_passes: int
    model_calls: int
    wall_time: float
    n_examples: int

    def evaluation(self, nu: int) -> Evaluation:
        """The :class:`Evaluation` of ``nu`` (``KeyError`` if it was not evaluated)."""
        for e in self.evaluations:
            if e.nu == nu:
                return e
        raise KeyError(f"nu={nu} was not evaluated; evaluated: {[e.nu for e in self.evaluations]}")

    @property
    def chosen(self) -> Evaluation:
        return self.evaluation(self.nu)

    def surrogate_log_scale(self, nu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Posterior mean and sd of ``ln s(nu)`` (mean function, without ``tau``)."""
        if self.surrogate is None:
            raise ValueError("this report has no surrogate fit")
        m = np.asarray(self.surrogate["mean"])
        v = np.asarray(self.surrogate["cov"])
        x = np.log(np.asarray(nu, dtype=float)) - self.surrogate["x_center"]
        phi = np.stack([np.ones_like(x), x], -1)
        return phi @ m, np.sqrt(np.einsum("...i,ij,...j->...", phi, v, phi))

    def plot(self, ax: Any = None, *, show_surrogate: bool = True) -> Any:
        """Objective against ``nu`` (see :func:`attnuq.plots.calibration_curve`)."""
        from attnuq.plots import calibration_curve

        return calibration_curve(self, ax=ax, show_surrogate=show_surrogate)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "evaluations"}
        d["evaluations"] = [e.to_dict() for e in self.evaluations]
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | Path) -> Path:
        """Write :meth:`to_json` to ``path`` atomically (temporary file + ``os.replace``)."""
        from attnuq._io import atomic_write_text

        p = Path(path)
        atomic_write_text(p, self.to_json())
        return p

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CalibrationReport:
        d = dict(d)
        d["evaluations"] = [Evaluation(**e) for e in d["evaluations"]]
        d["nu_range"] = tuple(d["nu_range"])
        if d.get("nu_interval") is not None:
            d["nu_interval"] = tuple(d["nu_interval"])
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> CalibrationReport:
        return cls.from_dict(json.loads(text))

    @classmethod
    def load(cls, path: str | Path) -> CalibrationReport:
        return cls.from_json(Path(path).read_text())


# --------------------------------------------------------------------------------------------
# data and one evaluation
# --------------------------------------------------------------------------------------------
@dataclass
class _Batch:
    inputs: Inputs
    targets: torch.Tensor  # (B, ...)
    frozen: torch.Tensor  # (B, ...)
    b: int


def _prepare(model: nn.Module, data: Iterable[Any], output_fn: OutputFn | None) -> list[_Batch]:
    if isinstance(data, (torch.Tensor, str, bytes)) or not isinstance(data, Iterable):
        raise TypeError(
            f"data must be an iterable of (inputs, targets) pairs, got {type(data).__name__}"
        )
    out: list[_Batch] = []
    for i, item in enumerate(data):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(
                "data must yield (inputs, targets) pairs, got item "
                f"{i} of type {type(item).__name__}"
            )
        x, y = item
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"targets of batch {i} must be a tensor, got {type(y).__name__}")
        if y.numel() == 0:
            raise ValueError(f"targets of batch {i} are empty, got shape={tuple(y.shape)}")
        check_finite(y, f"targets (batch {i})")
        b = batch_size(x)
        f = extract(call_model(model, x), output_fn)
        if f.shape != y.shape:
            raise ValueError(
                f"prediction and targets must have the same shape, got prediction.shape="
                f"{tuple(f.shape)} and targets.shape={tuple(y.shape)} (batch {i})"
            )
        check_finite(f, f"frozen prediction (batch {i})")
        out.append(_Batch(inputs=x, targets=y, frozen=f, b=b))
    if not out:
        raise ValueError("data is empty: it yielded no (inputs, targets) batch")
    return out


@dataclass
class _Stats:
    """Per-example statistics of one evaluation (all float64, examples concatenated)."""

    r_mean: torch.Tensor  # (N,)
    r_var: torch.Tensor  # (N,)
    z: torch.Tensor  # (N,)
    dev: list[torch.Tensor]  # per batch (M, B, P): f_nu - f
    resid: list[torch.Tensor]  # per batch (B, P): y - f
    pairs: list[torch.Tensor]  # per batch (B, P): sum_{i,j} |d_i - d_j|
    calls: int
    max_change: float


def _sample(
    model: nn.Module,
    batches: list[_Batch],
    nu: int,
    m: int,
    seed: int | None,
    output_fn: OutputFn | None,
    batch_replicas: int | None,
    max_rows: int,
) -> _Stats:
    from attnuq.patching import stochastic

    dev, resid, pairs = [], [], []
    r_mean, r_var, zs = [], [], []
    calls = 0
    max_change = 0.0
    s = None if seed is None else seed * 1_000_003 + nu
    with torch.no_grad(), stochastic(model, nu=nu, seed=s) as handle:
        reached = 0
        for ib, bt in enumerate(batches):
            reps = replicas_per_call(bt.b, m, batch_replicas, max_rows)
            samples, c = stochastic_passes(
                model, bt.inputs, m, output_fn=output_fn, replicas=reps, b=bt.b
            )
            calls += c
            # "reached" from the patch's own call counts, never from output differences
            reached = handle.require_calls(reached, where=f"calibrate (nu={nu}, batch {ib})")
            check_finite(samples, f"stochastic prediction at nu={nu}")
            d = (samples - bt.frozen).reshape(m, bt.b, -1).double().cpu()  # (M, B, P)
            e = (bt.targets - bt.frozen).reshape(bt.b, -1).double().cpu()  # (B, P)
            max_change = max(max_change, float(d.abs().max()))
            rr = d.norm(dim=-1)  # (M, B)
            r_mean.append(rr.mean(0))
            r_var.append(rr.var(0, unbiased=True))
            zs.append(e.norm(dim=-1))
            ds = torch.sort(d, dim=0).values
            i = torch.arange(1, m + 1, dtype=torch.float64)[:, None, None]
            pairs.append(2.0 * ((2 * i - m - 1) * ds).sum(0))
            dev.append(d)
            resid.append(e)
    return _Stats(
        r_mean=torch.cat(r_mean), r_var=torch.cat(r_var), z=torch.cat(zs), dev=dev,
        resid=resid, pairs=pairs, calls=calls, max_change=max_change,
    )


def _k_chunks(k: torch.Tensor, d: torch.Tensor) -> list[torch.Tensor]:
    """Split the ``k`` values so that one chunk times ``d`` stays under ~4M elements."""
    step = max(1, (1 << 22) // max(1, d.numel()))
    return list(torch.split(k, step))


def _crps_k(st: _Stats, k: torch.Tensor) -> torch.Tensor:
    """Per-example fair CRPS of ``f + k (f_nu - f)`` for each ``k``: ``(K, N)``.

    The draws ``f + k d_m`` of one element share ``f`` and are ordered like ``d_m`` for
    ``k > 0``, so the pair term is ``k`` times that of ``d``.
    """
    m = st.dev[0].shape[0]
    out = []
    for d, e, ps in zip(st.dev, st.resid, st.pairs, strict=True):
        per_k = []
        for kc in _k_chunks(k, d):
            t1 = (kc[:, None, None, None] * d[None] - e[None, None]).abs().mean(1)  # (K, B, P)
            crps = t1 - kc[:, None, None] * ps[None] / (2.0 * m * (m - 1))
            per_k.append(crps.mean(-1))
        out.append(torch.cat(per_k, 0))
    return torch.cat(out, 1)


def _cov_k(st: _Stats, k: torch.Tensor, level: float) -> torch.Tensor:
    """Per-example fraction of elements inside the Student-t prediction interval of the
    ensemble ``f + k (f_nu - f)``: ``|e - k mean(d)| <= k t sd(d) sqrt(1 + 1/M)``; ``(K, N)``."""
    from scipy.stats import t as student_t

    m = st.dev[0].shape[0]
    half = float(student_t.ppf(0.5 + level / 2, m - 1)) * math.sqrt(1.0 + 1.0 / m)
    out = []
    for d, e in zip(st.dev, st.resid, strict=True):
        mu, sd = d.mean(0), d.std(0, unbiased=True)  # (B, P)
        inside = (e[None] - k[:, None, None] * mu[None]).abs() <= k[:, None, None] * half * sd[None]
        out.append(inside.to(torch.float64).mean(-1))
    return torch.cat(out, 1)


def _argmin_k(fn: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """Minimiser of ``fn`` over ``k`` in ``[2^-6, 2^6]``: coarse log grid (step ``2^{1/4}``),
    then a fine one (step ``2^{1/64}``) over the coarse minimisers +- one step; ties (plateaus)
    resolve to the geometric middle of the minimisers."""

    def minimisers(k: torch.Tensor) -> tuple[float, float]:
        v = fn(k)
        idx = torch.nonzero(v <= v.min() + 1e-12).reshape(-1)
        return float(k[idx[0]]), float(k[idx[-1]])

    lo, hi = minimisers(_K_COARSE)
    step = 2.0**0.25
    a, b = math.log2(lo / step), math.log2(hi * step)
    fine = 2.0 ** torch.linspace(a, b, max(2, round((b - a) * 64) + 1), dtype=torch.float64)
    lo, hi = minimisers(fine)
    return math.sqrt(lo * hi)


def _summarise(
    st: _Stats, criterion: str, level: float, s0: float
) -> tuple[float, float, np.ndarray, float, float, float, dict[str, float]]:
    """objective, se, influence, scale, scale_se, target scale, raw values."""
    n = st.r_mean.numel()
    sqn = math.sqrt(n)

    def se(x: torch.Tensor) -> float:
        return float(x.std(unbiased=True)) / sqn if n > 1 else float("nan")

    s = float(st.r_mean.mean())
    s_se = se(st.r_mean)
    one = torch.ones(1, dtype=torch.float64)
    g_paper = st.r_var + (st.r_mean - st.z) ** 2
    crps1 = _crps_k(st, one)[0]
    cov1 = _cov_k(st, one, level)[0]
    values = {
        "l_sa": float(g_paper.mean()),
        "crps": float(crps1.mean()),
        "coverage": float(cov1.mean()),
        "scale_ratio": s / s0 if s0 > 0 else float("inf"),
    }
    if s <= 0:
        return float("nan"), float("nan"), np.zeros(n), s, s_se, float("nan"), values
    if criterion == "paper":
        g = g_paper
        obj = float(g.mean())
        t_star = float((st.r_mean * st.z).sum() / (st.r_var + st.r_mean**2).sum())
        target = t_star * s
    elif criterion == "scale":
        lr = math.log(s / s0)
        g = (1.0 if lr >= 0 else -1.0) * (st.r_mean / s - st.z / s0)
        obj = abs(lr)
        target = s0
    elif criterion == "crps":
        g = crps1
        obj = float(g.mean())
        target = _argmin_k(lambda k: _crps_k(st, k).mean(1)) * s
    else:  # coverage
        c = float(cov1.mean())
        g = (1.0 if c >= level else -1.0) * cov1
        obj = abs(c - level)
        target = _argmin_k(lambda k: (_cov_k(st, k, level).mean(1) - level).abs()) * s
    return obj, se(g), g.numpy(), s, s_se, target, values


# --------------------------------------------------------------------------------------------
# surrogate
# --------------------------------------------------------------------------------------------
class _LogLinear:
    """Bayesian linear regression of ``y = ln s`` on ``(1, ln nu - x_center)``."""

    def __init__(self, x_center: float, tau: float) -> None:
        self.x_center = x_center
        self.tau = tau
        self.m0 = np.array([0.0, -0.5])
        self.v0 = np.diag([10.0**2, 0.5**2])
        self.mean = self.m0.copy()
        self.cov = self.v0.copy()

    def phi(self, nu: np.ndarray) -> np.ndarray:
        x = np.log(np.asarray(nu, dtype=float)) - self.x_center
        return np.stack([np.ones_like(x), x], -1)

    def fit(self, nus: list[int], y: list[float], var: list[float]) -> None:
        phi = self.phi(np.array(nus))
        prec = 1.0 / (np.asarray(var) + self.tau**2)
        p0 = np.linalg.inv(self.v0)
        post_prec = p0 + phi.T @ (prec[:, None] * phi)
        self.cov = np.linalg.inv(post_prec)
        self.mean = self.cov @ (p0 @ self.m0 + phi.T @ (prec * np.asarray(y)))

    def predict(self, nu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        phi = self.phi(nu)
        return phi @ self.mean, np.einsum("...i,ij,...j->...", phi, self.cov, phi)

    def root_interval(self, target: float, lo: int, hi: int, seed: int) -> tuple[float, float]:
        rng = np.random.default_rng(seed)
        w = rng.multivariate_normal(self.mean, self.cov, size=4000)
        a = np.minimum(w[:, 1], -1e-6)  # scale decreases with nu
        x = (target - w[:, 0]) / a + self.x_center
        nu = np.clip(np.exp(np.clip(x, -50, 50)), lo, hi)
        q = np.quantile(nu, [0.025, 0.975])
        return float(q[0]), float(q[1])

    def as_dict(self, target: float) -> dict[str, Any]:
        return {
            "mean": self.mean.tolist(),
            "cov": self.cov.tolist(),
            "x_center": self.x_center,
            "tau": self.tau,
            "target_log_scale": target,
            "prior_mean": self.m0.tolist(),
            "prior_cov": self.v0.tolist(),
        }


def _check_nu_range(nu_range: object) -> tuple[int, int]:
    if (
        not isinstance(nu_range, (tuple, list))
        or len(nu_range) != 2
        or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in nu_range)
        or not 1 <= nu_range[0] < nu_range[1]
    ):
        raise ValueError(f"nu_range must be two ints 1 <= lo < hi, got {nu_range=!r}")
    from attnuq.ops.sampled import MAX_NU

    if nu_range[1] > MAX_NU:  # each call is also checked against the memory budget
        raise ValueError(
            f"nu_range must end at most at MAX_NU = 2**31 - 1 (one query's draws are summed by "
            f"one embedding_bag call), got {nu_range=!r}"
        )
    return int(nu_range[0]), int(nu_range[1])


def log_grid(nu_range: tuple[int, int], size: int) -> list[int]:
    """Unique integers of ``size`` log-spaced points over ``nu_range`` (both ends included).

    For ``size >= 2`` the points are ``round(lo * (hi / lo)^(i / (size - 1)))``,
    ``i = 0 .. size - 1``, sorted, duplicates dropped (so the list can be shorter than ``size``).

    Examples
    --------
    >>> log_grid((1, 1024), 11)
    [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    >>> log_grid((1, 4), 8)
    [1, 2, 3, 4]
    """
    lo, hi = _check_nu_range(nu_range)
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 2:
        raise ValueError(f"size must be an int >= 2, got {size=!r}")
    return sorted({round(v) for v in np.geomspace(lo, hi, size)})


def _candidates(lo: int, hi: int) -> np.ndarray:
    if hi - lo <= 20000:
        return np.arange(lo, hi + 1)
    return np.unique(np.round(np.geomspace(lo, hi, 20000)).astype(np.int64))


# --------------------------------------------------------------------------------------------
# calibrate
# --------------------------------------------------------------------------------------------
def calibrate(
    model: nn.Module,
    data: Iterable[Any],
    *,
    criterion: Criterion = "paper",
    search: Search = "bo",
    n_passes: int = 10,
    nu_range: tuple[int, int] = (1, 1024),
    level: float = 0.9,
    output_fn: OutputFn | None = None,
    seed: int | None = 0,
    grid_size: int = 21,
    max_evals: int = 6,
    surrogate_noise: float = 0.05,
    batch_replicas: int | None = None,
    max_rows: int = 8192,
    progress: bool | None = None,
) -> CalibrationReport:
    r"""Choose ``nu`` for :func:`attnuq.stochastic` on held-out ``(inputs, targets)`` pairs.

    See the module docstring for the exact criteria, the surrogate and the search.

    Parameters
    ----------
    model
        Frozen model (``eval()`` mode) with batch-first inputs and output.
    data
        Iterable of ``(inputs, targets)``; ``inputs`` a tensor, tuple of tensors or dict of
        keyword arguments, ``targets`` ``(B, ...)`` of the prediction's shape. It is read once:
        batches and their frozen outputs are cached.
    criterion
        ``"paper"``, ``"scale"``, ``"crps"`` or ``"coverage"``.
    search
        ``"bo"`` (surrogate-guided, few evaluations) or ``"grid"`` (reference).
    n_passes
        ``M``, stochastic passes per example and evaluation (``>= 2``).
    nu_range
        Integer search interval ``(lo, hi)``, ``1 <= lo < hi``.
    level
        Central interval level for ``"coverage"`` (also reported for every criterion).
    output_fn
        Maps the model output to the prediction tensor.
    seed
        Seeds the draws: the evaluation at ``nu`` uses ``seed * 1000003 + nu``, so grid and BO
        see the same draws at the same ``nu``.
    grid_size
        Log-spaced points of the grid (duplicates after rounding dropped).
    max_evals
        BO budget of evaluations (default 6: at most a third of the default 20-point grid).
    surrogate_noise
        ``tau``, the misfit sd of the log-linear surrogate (in ``ln s``).
    batch_replicas, max_rows
        Batching of the passes (see :func:`attnuq.predict`).
    progress
        tqdm bar over evaluations (``None``: only on a terminal).

    Returns
    -------
    CalibrationReport

    Raises
    ------
    ValueError
        Empty data, NaN targets, prediction/target shape mismatch, bad settings.
    RuntimeError
        If the model's forward never calls its patched attention (for some batch; counted by the
        patch itself, :attr:`PatchHandle.calls`), or if it does but the output does not
        change under sampling (every reached attention one-hot, or ``output_fn`` reads an output
        the attention does not affect).

    Examples
    --------
    >>> import torch
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    >>> model = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()
    >>> x = torch.randn(16, 5, 8)
    >>> with torch.no_grad():
    ...     y = model(x) + 0.1 * torch.randn(16, 5, 8)
    >>> report = calibrate(model, [(x, y)], criterion="scale", nu_range=(1, 256))
    >>> 1 <= report.nu <= 256
    True
    """
    t_start = time.perf_counter()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if criterion not in CRITERIA:
        raise ValueError(f"criterion must be one of {CRITERIA}, got {criterion=!r}")
    if search not in SEARCHES:
        raise ValueError(f"search must be one of {SEARCHES}, got {search=!r}")
    m = check_positive_int(n_passes, "n_passes")
    if m < 2:
        raise ValueError(f"n_passes must be >= 2 (a spread needs two passes), got {n_passes=}")
    lo, hi = _check_nu_range(nu_range)
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0 < level < 1:
        raise ValueError(f"level must be a float in (0, 1), got {level=!r}")
    if check_positive_int(grid_size, "grid_size") < 2:
        raise ValueError(f"grid_size must be >= 2, got {grid_size=!r}")
    check_positive_int(max_evals, "max_evals")
    if not surrogate_noise >= 0:
        raise ValueError(f"surrogate_noise must be >= 0, got {surrogate_noise=}")
    if model.training:
        warnings.warn(
            "calibrate: model is in training mode; dropout would add noise (call model.eval())",
            stacklevel=2,
        )

    with torch.no_grad():
        batches = _prepare(model, data, output_fn)
    n_examples = sum(bt.b for bt in batches)
    if n_examples < 2:
        raise ValueError(
            f"calibration data has {n_examples} example: the standard errors of the criterion "
            "(and the grid's noise band) need at least 2 examples"
        )
    s0 = float(
        torch.cat([(bt.targets - bt.frozen).reshape(bt.b, -1).double().norm(dim=-1)
                   for bt in batches]).mean()
    )
    if s0 <= 0:
        raise ValueError("the frozen model fits every calibration target exactly (s_0 = 0)")
    evals: list[Evaluation] = []
    total_calls = len(batches)

    def evaluate(nu: int) -> Evaluation:
        nonlocal total_calls
        t0 = time.perf_counter()
        st = _sample(model, batches, nu, m, seed, output_fn, batch_replicas, max_rows)
        total_calls += st.calls
        if st.max_change == 0.0:
            raise RuntimeError(
                f"the model output did not change under stochastic attention (nu={nu}, {m} "
                "passes) although its patched attention was called: every reached attention "
                "is one-hot, or output_fn reads an output the attention does not affect"
            )
        obj, se, infl, s, s_se, target, values = _summarise(st, criterion, float(level), s0)
        ev = Evaluation(
            nu=nu, objective=obj, se=se, scale=s, scale_se=s_se, target_scale=target,
            values=values, passes=m, model_calls=st.calls,
            seconds=time.perf_counter() - t0, influence=infl,
        )
        evals.append(ev)
        return ev

    from tqdm.auto import tqdm

    disable = None if progress is None else not progress
    surrogate = _LogLinear(x_center=0.5 * (math.log(lo) + math.log(hi)), tau=surrogate_noise)

    def fit() -> float:
        ok = [e for e in evals if e.scale > 0]
        ys = [math.log(e.scale) for e in ok]
        var = [(e.scale_se / e.scale) ** 2 if math.isfinite(e.scale_se) else 0.0 for e in ok]
        surrogate.fit([e.nu for e in ok], ys, var)
        best = min(ok, key=lambda e: abs(math.log(e.target_scale / e.scale)))
        return math.log(best.target_scale)

    noise_band: list[int] | None = None
    nu_interval: tuple[float, float] | None = None
    if search == "grid":
        grid = log_grid((lo, hi), grid_size)
        with tqdm(grid, desc=f"calibrate grid ({criterion})", disable=disable, leave=False) as bar:
            for nu in bar:
                ev = evaluate(int(nu))
                bar.set_postfix(nu=nu, objective=f"{ev.objective:.4g}")
        finite = [e for e in evals if math.isfinite(e.objective)]
        best = min(finite, key=lambda e: e.objective)
        chosen = best.nu
        noise_band = []
        for e in finite:
            assert e.influence is not None and best.influence is not None
            diff = e.influence - best.influence
            se_d = float(np.std(diff, ddof=1)) / math.sqrt(len(diff)) if len(diff) > 1 else 0.0
            if e.objective - best.objective <= 2.0 * se_d + 1e-12:
                noise_band.append(e.nu)
        target_log = fit()
    else:
        cands = _candidates(lo, hi)
        nu = round(math.sqrt(lo * hi))
        with tqdm(total=max_evals, desc=f"calibrate bo ({criterion})", disable=disable,
                  leave=False) as bar:
            while True:
                ev = evaluate(int(nu))
                bar.update(1)
                bar.set_postfix(nu=nu, objective=f"{ev.objective:.4g}")
                target_log = fit()
                mean, var = surrogate.predict(cands)
                loss = (mean - target_log) ** 2 + var
                nxt = int(cands[int(np.argmin(loss))])
                if nxt in {e.nu for e in evals} or len(evals) >= max_evals:
                    break
                nu = nxt
        done = np.array([e.nu for e in evals])
        mean, var = surrogate.predict(done)
        chosen = int(done[int(np.argmin((mean - target_log) ** 2 + var))])
        nu_interval = surrogate.root_interval(target_log, lo, hi, 0 if seed is None else seed)
        # among the evaluated nu that the surrogate finds plausible (inside the 95 % interval of
        # its root), the measured objective decides -- as on the grid
        plausible = [
            e for e in evals
            if nu_interval[0] <= e.nu <= nu_interval[1] and math.isfinite(e.objective)
        ]
        if plausible:
            chosen = min(plausible, key=lambda e: e.objective).nu
    return CalibrationReport(
        nu=chosen,
        criterion=criterion,
        search=search,
        level=float(level),
        n_passes=m,
        nu_range=(lo, hi),
        seed=seed,
        evaluations=evals,
        residual_scale=s0,
        target_scale=math.exp(target_log),
        surrogate=surrogate.as_dict(target_log),
        nu_interval=nu_interval,
        noise_band=noise_band,
        forward_passes=1 + m * len(evals),
        model_calls=total_calls,
        wall_time=time.perf_counter() - t_start,
        n_examples=n_examples,
    )
