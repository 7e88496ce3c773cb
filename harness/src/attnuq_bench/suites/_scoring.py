"""Scores shared by the suites: streamed scores over chunks, per-target scores of one part.

* :class:`StreamScores` accumulates MSE, MAE, coverage and width of the central interval, PIT
  W1, CRPS and the mean spread over chunks of targets (ETT, ERA5: too many windows for one
  tensor of samples).
* :func:`sample_scores` scores one predictive on one part at once (UCI): the PIT values, their
  W1 distance to ``U(0, 1)`` before and after one pooled spread factor, native coverage and
  width of the central interval, CRPS and a Gaussian NLL, in target units.
* :func:`to_cpu` moves a predictive's tensors to the CPU (scoring uses CPU generators).

For a :class:`~attnuq.predictive.GaussianPredictive` the PIT is ``Phi((y - m) / s)`` (exact,
no randomisation); for samples it is the randomised PIT of :func:`attnuq.metrics.pit_samples`.

Examples
--------
>>> import torch
>>> from attnuq.predictive import GaussianPredictive
>>> g = torch.Generator().manual_seed(0)
>>> y = torch.randn(2000, generator=g)
>>> sc = sample_scores(GaussianPredictive(mean=torch.zeros(2000), std=torch.ones(2000)), y,
...                    y_std=1.0, generator=g)
>>> abs(sc["coverage_native"] - 0.95) < 0.03, len(sc["pit"])
(True, 2000)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from attnuq._validation import check_finite
from attnuq.predictive import GaussianPredictive, Predictive

__all__ = ["StreamScores", "mean_std", "mean_std_n", "sample_scores", "to_cpu"]

AnyPred = Predictive | GaussianPredictive


def _normal_cdf(z: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1.0 + torch.erf(z / math.sqrt(2.0)))


def mean_std(values: Any) -> tuple[float, float]:
    """Mean and sample std (ddof 1; ``0.0`` for one value) of the finite values (``None`` and
    non-finite ones dropped); ``(nan, nan)`` when none is left.

    >>> mean_std([1.0, 3.0, None, float("nan")]), mean_std([2.0]), mean_std([])
    ((2.0, 1.4142135623730951), (2.0, 0.0), (nan, nan))
    """
    v = [float(x) for x in values if x is not None and math.isfinite(float(x))]
    if not v:
        return math.nan, math.nan
    m = sum(v) / len(v)
    s = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else 0.0
    return m, s


def mean_std_n(values: Any) -> list[float]:
    """``[mean, std (ddof 1; 0 for one value), n]`` of ``values`` (all kept, numpy semantics:
    a non-finite value makes the mean non-finite), the aggregate
    :func:`~attnuq_bench.suites._page.fmt` shows as ``"mean ± std"``.

    >>> mean_std_n([1.0, 3.0])
    [2.0, 1.4142135623730951, 2]
    """
    import numpy as np

    vals = np.array(list(values), dtype=float)
    if vals.size == 0:
        raise ValueError("mean_std_n needs at least one value")
    sd = float(vals.std(ddof=1)) if len(vals) > 1 else 0.0
    return [float(vals.mean()), sd, len(vals)]


def to_cpu(pred: Any) -> Any:
    """``pred`` (a Predictive or GaussianPredictive) with its tensors on the CPU.

    >>> to_cpu(Predictive(samples=torch.zeros(2, 3))).samples.device.type
    'cpu'
    """
    if isinstance(pred, GaussianPredictive):
        return GaussianPredictive(mean=pred.mean.cpu(), std=pred.std.cpu())
    if isinstance(pred, Predictive):
        return Predictive(samples=pred.samples.cpu(),
                          frozen=None if pred.frozen is None else pred.frozen.cpu())
    raise TypeError(f"pred must be a Predictive or GaussianPredictive, got {type(pred)}")


def sample_scores(pred: AnyPred, y: torch.Tensor, *, y_std: float, generator: torch.Generator,
                  level: float = 0.95) -> dict[str, Any]:
    """Scores of ``pred`` on targets ``y`` ``(N,)`` (standardised), in target units.

    Returns ``pit`` ``(N,)``, ``w1_native`` (W1 of the PIT to ``U(0, 1)``), ``w1_scaled``
    (:func:`attnuq.metrics.pit_w1_scaled`; a Gaussian enters by 1000 draws; ``nan`` for one
    sample), ``coverage_native`` / ``width_native`` of the central ``level`` interval, ``crps``
    (fair ensemble CRPS for samples, closed form for a Gaussian) and ``nll`` (Gaussian; of the
    sample mean and std for samples, std floored at 1e-6). Width and CRPS are multiplied by
    ``y_std``, and ``log(y_std)`` is added to the NLL.
    """
    from attnuq import metrics

    if not (float(y_std) > 0 and math.isfinite(float(y_std))):
        raise ValueError(f"y_std must be a positive finite number, got {y_std=!r}")
    check_finite(y, "targets")
    y64 = y.double()
    if isinstance(pred, GaussianPredictive):
        m, s = pred.mean.double(), pred.std.double()
        z = (y64 - m) / s.clamp_min(1e-12)
        pit = _normal_cdf(z)
        draws = pred.sample(1000, generator=generator).samples.double()
        w1s = float(metrics.pit_w1_scaled(draws, y64, generator=generator))
        crps = float(metrics.crps_normal(m, s.clamp_min(1e-12), y64))
        nll = float(metrics.nll_normal(m, s.clamp_min(1e-6), y64))
    elif isinstance(pred, Predictive):
        smp = pred.samples.double()
        pit = metrics.pit_samples(smp, y64, generator=generator)
        w1s = (float(metrics.pit_w1_scaled(smp, y64, generator=generator))
               if smp.shape[0] > 1 else math.nan)
        crps = float(metrics.crps_samples(smp, y64))
        nll = float(metrics.nll_normal(smp.mean(0), smp.std(0).clamp_min(1e-6), y64))
    else:
        raise TypeError(f"pred must be a Predictive or GaussianPredictive, got {type(pred)}")
    lo, hi = pred.interval(level)
    return {
        "pit": pit,
        "w1_native": float(metrics.pit_w1(pit)),
        "w1_scaled": w1s,
        "coverage_native": float(metrics.coverage(lo.double(), hi.double(), y64)),
        "width_native": float(metrics.interval_width(lo.double(), hi.double())) * y_std,
        "crps": crps * y_std,
        "nll": nll + math.log(y_std),
    }


@dataclass
class StreamScores:
    """Scores of a predictive distribution accumulated over chunks of targets ``(B, ...)``.

    ``update(pred, y)`` adds a chunk; :meth:`result` returns MSE and MAE of the predictive mean,
    coverage and mean width of the central ``level`` interval, W1 of the pooled PIT values to
    U(0, 1) (:func:`attnuq.metrics.pit_w1`), mean CRPS (fair ensemble CRPS for samples,
    closed form for a Gaussian) and the mean predictive standard deviation.

    For a :class:`~attnuq.predictive.GaussianPredictive` the PIT is ``Phi((y - m) / s)`` (exact,
    no randomisation needed); for samples it is the randomised PIT of
    :func:`attnuq.metrics.pit_samples`.

    Examples
    --------
    >>> import torch
    >>> g = torch.Generator().manual_seed(0)
    >>> sc = StreamScores()
    >>> y = torch.randn(2000, generator=g)
    >>> sc.update(GaussianPredictive(mean=torch.zeros(2000), std=torch.ones(2000)), y)
    >>> abs(sc.result()["coverage"] - 0.95) < 0.03
    True
    """

    level: float = 0.95
    seed: int = 0
    n: int = 0
    se: float = 0.0
    ae: float = 0.0
    covered: float = 0.0
    width: float = 0.0
    crps: float = 0.0
    spread: float = 0.0
    pits: list[torch.Tensor] = field(default_factory=list)
    _gen: torch.Generator | None = None

    def update(self, pred: AnyPred, y: torch.Tensor) -> None:
        from attnuq import metrics

        if self._gen is None:
            self._gen = torch.Generator().manual_seed(self.seed)
        check_finite(y, "targets")
        y = y.double()
        if isinstance(pred, GaussianPredictive):
            m, s = pred.mean.double(), pred.std.double()
            if m.shape != y.shape:
                raise ValueError(f"prediction {tuple(m.shape)} and targets {tuple(y.shape)} differ")
            s = s.clamp_min(1e-12)
            lo, hi = GaussianPredictive(mean=m, std=s).interval(self.level)
            pit = _normal_cdf((y - m) / s)
            crps = metrics.crps_normal(m, s, y, reduction="none")
            spread = s
        elif isinstance(pred, Predictive):
            smp = pred.samples.double()
            if smp.shape[1:] != y.shape:
                raise ValueError(
                    f"samples {tuple(smp.shape)} do not match targets {tuple(y.shape)}"
                )
            m = smp.mean(0)
            lo, hi = Predictive(samples=smp).interval(self.level)
            pit = metrics.pit_samples(smp, y, generator=self._gen)
            crps = metrics.crps_samples(smp, y, reduction="none")
            spread = smp.std(0) if smp.shape[0] > 1 else torch.zeros_like(m)
        else:
            raise TypeError(f"pred must be a Predictive or GaussianPredictive, got {type(pred)}")
        self.n += y.numel()
        self.se += float(((m - y) ** 2).sum())
        self.ae += float((m - y).abs().sum())
        self.covered += float(((y >= lo) & (y <= hi)).sum())
        self.width += float((hi - lo).sum())
        self.crps += float(crps.sum())
        self.spread += float(spread.sum())
        self.pits.append(pit.reshape(-1).float())

    def result(self) -> dict[str, float]:
        from attnuq import metrics

        if self.n == 0:
            raise ValueError("no predictions were scored (0 targets)")
        pit = torch.cat(self.pits).double()
        return {
            "mse": self.se / self.n,
            "mae": self.ae / self.n,
            "coverage": self.covered / self.n,
            "width": self.width / self.n,
            "pit_w1": float(metrics.pit_w1(pit)),
            "crps": self.crps / self.n,
            "mean_std": self.spread / self.n,
            "n_scored": float(self.n),
        }
