"""Diagnostic plots: PIT histogram, reliability diagrams (interval coverage; class confidence),
calibration curve, fan chart, spread map.

matplotlib is imported lazily (extra ``bench``). Every function takes ``ax=None`` (a new figure
is made) and returns the ``Axes`` it drew on.

Examples
--------
>>> import matplotlib
>>> matplotlib.use("Agg")
>>> import matplotlib.pyplot as plt
>>> import torch
>>> from attnuq.predictive import Predictive
>>> pred = Predictive(samples=torch.randn(100, 50))
>>> ax = reliability_diagram(pred, torch.randn(50))
>>> ax.get_xlabel()
'nominal coverage'
>>> plt.close(ax.figure)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from attnuq.predictive import GaussianPredictive, Predictive

if TYPE_CHECKING:
    from attnuq.metrics import CalibrationBins

__all__ = [
    "calibration_curve",
    "confidence_reliability",
    "fan_chart",
    "pit_histogram",
    "reliability_diagram",
    "spread_map",
]

DEFAULT_LEVELS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


class _Evaluated(Protocol):
    """What :func:`calibration_curve` reads of one evaluated ``nu``."""

    @property
    def nu(self) -> int: ...
    @property
    def objective(self) -> float: ...
    @property
    def se(self) -> float: ...
    @property
    def scale(self) -> float: ...


class _CalibrationResult(Protocol):
    """What :func:`calibration_curve` reads of an :class:`attnuq.CalibrationReport` (this module
    does not import the calibration package, which imports it)."""

    @property
    def nu(self) -> int: ...
    @property
    def criterion(self) -> str: ...
    @property
    def search(self) -> str: ...
    @property
    def forward_passes(self) -> int: ...
    @property
    def nu_range(self) -> tuple[int, int]: ...
    @property
    def noise_band(self) -> Sequence[int] | None: ...
    @property
    def surrogate(self) -> dict[str, Any] | None: ...
    @property
    def evaluations(self) -> Sequence[_Evaluated]: ...

    def surrogate_log_scale(self, nu: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


def _axes(ax: Any) -> Any:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(figsize=(5, 4))
    return ax


def _np(x: Any, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().double().numpy()
    arr = np.asarray(x, dtype=float)
    if arr.size == 0:
        raise ValueError(f"{name} is empty, got shape={arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains non-finite values")
    return arr


def pit_histogram(
    pit: torch.Tensor | np.ndarray, *, bins: int = 10, ax: Any = None, label: str | None = None
) -> Any:
    """Density histogram of PIT values with the uniform density and its binomial 2-sd band.

    Parameters
    ----------
    pit
        PIT values in ``[0, 1]`` (any shape; pooled), e.g. from
        :func:`attnuq.metrics.pit_samples`.
    bins
        Number of equal-width bins.

    The band is ``1 +- 2 sqrt(n p (1 - p)) / (n p)`` with ``p = 1 / bins`` and ``n`` PIT values:
    two binomial standard deviations of a bin's density under ``U(0, 1)``.

    Examples
    --------
    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> import matplotlib.pyplot as plt
    >>> import torch
    >>> pit = torch.rand(200, generator=torch.Generator().manual_seed(0))
    >>> ax = pit_histogram(pit, bins=5)
    >>> len(ax.containers[0]), ax.get_xlabel()  # 5 bars
    (5, 'PIT')
    >>> plt.close(ax.figure)
    """
    u = _np(pit, "pit").reshape(-1)
    if np.any((u < 0) | (u > 1)):
        raise ValueError("pit values must lie in [0, 1]")
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"bins must be a positive int, got {bins=!r}")
    ax = _axes(ax)
    ax.hist(u, bins=bins, range=(0, 1), density=True, alpha=0.7, label=label, edgecolor="white")
    n, p = u.size, 1.0 / bins
    band = 2 * np.sqrt(n * p * (1 - p)) / (n * p)  # 2 sd of a bin's density under U(0,1)
    ax.axhline(1.0, color="k", lw=1)
    ax.axhspan(1 - band, 1 + band, color="k", alpha=0.1, lw=0)
    ax.set_xlim(0, 1)
    ax.set_xlabel("PIT")
    ax.set_ylabel("density")
    if label:
        ax.legend()
    return ax


def reliability_diagram(
    pred: Predictive | GaussianPredictive,
    targets: torch.Tensor,
    *,
    levels: Sequence[float] = DEFAULT_LEVELS,
    ax: Any = None,
    label: str | None = None,
) -> Any:
    """Observed against nominal coverage of the predictive's central intervals.

    Parameters
    ----------
    pred
        :class:`Predictive` or :class:`GaussianPredictive` with ``(B, ...)`` predictions.
    targets
        ``(B, ...)``.
    levels
        Nominal central levels in ``(0, 1)``.

    Examples
    --------
    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> import matplotlib.pyplot as plt
    >>> import torch
    >>> from attnuq.predictive import Predictive
    >>> g = torch.Generator().manual_seed(0)
    >>> pred = Predictive(samples=torch.randn(100, 50, generator=g))  # (S, B)
    >>> ax = reliability_diagram(pred, torch.randn(50, generator=g), levels=(0.5, 0.9))
    >>> curve = ax.lines[1]  # lines[0] is the diagonal
    >>> [float(v) for v in curve.get_xdata()], [round(float(v), 2) for v in curve.get_ydata()]
    ([0.5, 0.9], [0.4, 0.96])
    >>> plt.close(ax.figure)
    """
    from attnuq.metrics import coverage

    if not isinstance(pred, (Predictive, GaussianPredictive)) and not hasattr(pred, "interval"):
        raise TypeError(
            "pred must be a Predictive, GaussianPredictive or another predictive with "
            f"interval(level) (e.g. attnuq.SAPredictive), got {type(pred).__name__}"
        )
    lv = [float(v) for v in levels]
    if not lv:
        raise ValueError("levels is empty")
    obs = [float(coverage(*pred.interval(v), targets)) for v in lv]
    ax = _axes(ax)
    ax.plot([0, 1], [0, 1], color="k", lw=1, ls="--")
    ax.plot(lv, obs, marker="o", label=label)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("nominal coverage")
    ax.set_ylabel("observed coverage")
    if label:
        ax.legend()
    return ax


def confidence_reliability(
    bins: CalibrationBins,
    *,
    ax: Any = None,
    title: str | None = None,
) -> Any:
    """Reliability diagram of class probabilities: accuracy against top-label confidence per
    bin of :func:`attnuq.metrics.calibration_bins` (a bar over each non-empty equal-width bin,
    or ``1/M`` wide at the mean confidence of a ``"mass"`` bin, and a dot at (mean confidence,
    accuracy)), the diagonal of perfect calibration, and the ECE of the same bins in the title
    (after ``title``).

    Examples
    --------
    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> import matplotlib.pyplot as plt
    >>> import torch
    >>> from attnuq.metrics import calibration_bins
    >>> g = torch.Generator().manual_seed(0)
    >>> p = (2 * torch.randn(200, 3, generator=g)).softmax(-1)
    >>> y = torch.multinomial(p, 1, generator=g)[:, 0]
    >>> ax = confidence_reliability(calibration_bins(p, y, n_bins=10), title="toy")
    >>> ax.get_title().startswith("toy: ECE "), ax.get_xlabel()
    (True, 'confidence')
    >>> plt.close(ax.figure)
    """
    from attnuq.metrics import CalibrationBins as _Bins

    if not isinstance(bins, _Bins):
        raise TypeError(f"bins must be attnuq.metrics.CalibrationBins (from calibration_bins), "
                        f"got {type(bins).__name__}")
    keep = (bins.count > 0).cpu()
    conf = bins.confidence.cpu()[keep].numpy()
    acc = bins.accuracy.cpu()[keep].numpy()
    ax = _axes(ax)
    ax.plot([0, 1], [0, 1], "k--", lw=0.8)
    if bins.edges is not None:  # equal-width bins: a bar over each bin, a dot at its mean
        e = bins.edges.cpu().numpy()
        left = e[:-1][keep.numpy()]
        ax.bar(left, acc, width=np.diff(e)[keep.numpy()], align="edge", alpha=0.6,
               color="#3b6ea5", edgecolor="white", label="accuracy")
    else:
        ax.bar(conf, acc, width=1.0 / bins.n_bins, alpha=0.6, color="#3b6ea5",
               edgecolor="white", label="accuracy")
    ax.plot(conf, acc, "o", ms=3, color="#b03a2e", label="(mean confidence, accuracy)")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("confidence")
    ax.set_ylabel("accuracy")
    ece = f"ECE {float(bins.ece):.4f}"
    ax.set_title(f"{title}: {ece}" if title else ece, fontsize=9)
    return ax


def calibration_curve(
    report: _CalibrationResult, *, ax: Any = None, show_surrogate: bool = True
) -> Any:
    """Objective (+- 1 standard error) against ``nu`` from a :class:`attnuq.CalibrationReport`.

    Marks the chosen ``nu``, shades the grid's noise band, and (``show_surrogate``) draws the
    log-linear surrogate of ``ln s(nu)`` with its 2-sd band and the target ``ln s_*`` on a
    second y axis.

    Examples
    --------
    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> import matplotlib.pyplot as plt
    >>> import torch
    >>> from attnuq.calibration import calibrate
    >>> _ = torch.manual_seed(0)
    >>> mha = torch.nn.MultiheadAttention(4, 1, batch_first=True).eval()
    >>> x = torch.randn(8, 3, 4)  # self-attention: inputs (x, x, x), targets x
    >>> report = calibrate(mha, [((x, x, x), x)], criterion="scale", n_passes=2, max_evals=3,
    ...                    nu_range=(1, 64), output_fn=lambda out: out[0], progress=False)
    >>> ax = calibration_curve(report)
    >>> ax.get_xscale(), len(ax.figure.axes)  # objective axis + surrogate axis
    ('log', 2)
    >>> plt.close(ax.figure)
    """
    evs = sorted(report.evaluations, key=lambda e: e.nu)
    if not evs:
        raise ValueError("report has no evaluations")
    ax = _axes(ax)
    nus = np.array([e.nu for e in evs], dtype=float)
    obj = np.array([e.objective for e in evs])
    se = np.array([e.se for e in evs])
    ax.errorbar(
        nus, obj, yerr=se, marker="o", ms=4, capsize=2, label=f"{report.criterion} objective"
    )
    ax.axvline(report.nu, color="C3", lw=1.5, label=f"chosen nu={report.nu}")
    if report.noise_band:
        ax.axvspan(min(report.noise_band), max(report.noise_band), color="C3", alpha=0.12,
                   label="noise band")
    ax.set_xscale("log")
    ax.set_xlabel("nu")
    ax.set_ylabel("objective")
    # the count of dots, as the search's progress bar counts them (one step per evaluation)
    ax.set_title(f"calibration ({report.search}: {len(evs)} evaluations of nu, "
                 f"{report.forward_passes} passes)")
    if show_surrogate and report.surrogate is not None:
        ax2 = ax.twinx()
        lo, hi = report.nu_range
        grid = np.geomspace(lo, hi, 200)
        m, sd = report.surrogate_log_scale(grid)
        ax2.plot(grid, m, color="C2", lw=1, label="surrogate ln s(nu)")
        ax2.fill_between(grid, m - 2 * sd, m + 2 * sd, color="C2", alpha=0.15)
        ax2.scatter(nus, np.log([e.scale for e in evs]), color="C2", s=12, marker="x")
        ax2.axhline(report.surrogate["target_log_scale"], color="C2", ls=":", lw=1,
                    label="target ln s*")
        ax2.set_ylabel("ln s(nu)")
        ax2.legend(loc="upper right", fontsize="small")
    ax.legend(loc="upper left", fontsize="small")
    return ax


def fan_chart(
    pred: Predictive,
    *,
    index: int = 0,
    channel: int | None = None,
    targets: torch.Tensor | None = None,
    x: Sequence[float] | np.ndarray | None = None,
    levels: Sequence[float] = (0.5, 0.8, 0.95),
    ax: Any = None,
) -> Any:
    """Fan chart of a sequence forecast: nested central bands, median and frozen output.

    Parameters
    ----------
    pred
        :class:`Predictive` with samples ``(S, B, L)`` or ``(S, B, L, C)``.
    index
        Which example ``b`` to draw.
    channel
        Which channel for ``(S, B, L, C)`` samples.
    targets
        Optional ``(B, L)`` / ``(B, L, C)`` observations, drawn as points.
    x
        Optional ``(L,)`` positions (default ``0..L-1``).
    levels
        Central levels of the bands, drawn widest first.

    Examples
    --------
    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> import matplotlib.pyplot as plt
    >>> import torch
    >>> from attnuq.predictive import Predictive
    >>> s = torch.randn(50, 2, 12, generator=torch.Generator().manual_seed(0)).cumsum(-1)
    >>> pred = Predictive(samples=s, frozen=s.mean(0))  # (S=50, B=2, L=12)
    >>> ax = fan_chart(pred, index=0, targets=s[0])
    >>> len(ax.collections), [t.get_text() for t in ax.get_legend().get_texts()]
    (3, ['95 %', '80 %', '50 %', 'median', 'frozen', 'target'])
    >>> plt.close(ax.figure)
    """
    if not isinstance(pred, Predictive):
        raise TypeError(f"pred must be a Predictive, got {type(pred).__name__}")
    s = pred.samples
    if s.dim() not in (3, 4):
        raise ValueError(f"fan_chart needs samples (S, B, L) or (S, B, L, C), got {tuple(s.shape)}")
    if not 0 <= index < s.shape[1]:
        raise ValueError(f"index must be in [0, {s.shape[1]}), got {index=}")
    if s.dim() == 4 and channel is None:
        raise ValueError(f"samples have channels {tuple(s.shape)}: pass channel=")

    def pick(t: torch.Tensor) -> np.ndarray:
        t = t[index]
        if t.dim() == 2:
            assert channel is not None
            t = t[:, channel]
        return t.detach().cpu().double().numpy()

    draws = s[:, index] if s.dim() == 3 else s[:, index, :, channel]  # (S, L)
    d = draws.detach().cpu().double().numpy()
    xs = np.arange(d.shape[1]) if x is None else _np(x, "x")
    ax = _axes(ax)
    for i, lv in enumerate(sorted(levels, reverse=True)):
        a = (1 - lv) / 2
        lo, hi = np.quantile(d, [a, 1 - a], axis=0)
        ax.fill_between(xs, lo, hi, color="C0", alpha=0.15 + 0.15 * i, lw=0,
                        label=f"{round(lv * 100)} %")
    ax.plot(xs, np.median(d, 0), color="C0", lw=1.5, label="median")
    if pred.frozen is not None:
        ax.plot(xs, pick(pred.frozen), color="k", lw=1, ls="--", label="frozen")
    if targets is not None:
        ax.plot(xs, pick(targets), "o", color="C3", ms=3, label="target")
    ax.set_xlabel("step")
    ax.legend(fontsize="small")
    return ax


def spread_map(
    field: torch.Tensor | Predictive,
    *,
    index: int = 0,
    lat: Sequence[float] | np.ndarray | torch.Tensor | None = None,
    lon: Sequence[float] | np.ndarray | torch.Tensor | None = None,
    ax: Any = None,
    cmap: str = "viridis",
    title: str | None = "predictive spread",
) -> Any:
    """Map of a gridded spread field ``(n_lat, n_lon)``, or of ``pred.std[index]``.

    Parameters
    ----------
    field
        ``(n_lat, n_lon)`` tensor, or a :class:`Predictive` with samples ``(S, B, n_lat, n_lon)``.
    lat, lon
        Optional coordinates in degrees (default: grid indices).

    Examples
    --------
    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> import matplotlib.pyplot as plt
    >>> import torch
    >>> from attnuq.predictive import Predictive
    >>> pred = Predictive(samples=torch.randn(10, 2, 4, 6))  # (S, B, n_lat, n_lon)
    >>> ax = spread_map(pred, index=1, lat=torch.linspace(-45, 45, 4),
    ...                 lon=torch.linspace(0, 300, 6))
    >>> ax.collections[0].get_array().shape, len(ax.figure.axes)  # map + colour bar
    ((4, 6), 2)
    >>> ax.get_xlabel(), ax.get_title()
    ('longitude', 'predictive spread')
    >>> plt.close(ax.figure)
    """
    if isinstance(field, Predictive):
        if field.samples.dim() != 4:
            raise ValueError(
                f"spread_map needs samples (S, B, n_lat, n_lon), got {tuple(field.samples.shape)}"
            )
        field = field.std[index]
    f = _np(field, "field")
    if f.ndim != 2:
        raise ValueError(f"field must be (n_lat, n_lon), got shape={f.shape}")
    ax = _axes(ax)
    la = np.arange(f.shape[0]) if lat is None else _np(lat, "lat")
    lo = np.arange(f.shape[1]) if lon is None else _np(lon, "lon")
    if la.shape != (f.shape[0],) or lo.shape != (f.shape[1],):
        raise ValueError(
            f"lat/lon must have shapes ({f.shape[0]},) and ({f.shape[1]},), got {la.shape} "
            f"and {lo.shape}"
        )
    mesh = ax.pcolormesh(lo, la, f, cmap=cmap, shading="auto")
    ax.figure.colorbar(mesh, ax=ax)
    ax.set_xlabel("longitude" if lon is not None else "lon index")
    ax.set_ylabel("latitude" if lat is not None else "lat index")
    if title:
        ax.set_title(title)
    return ax
