"""Every plot renders to a PNG file and returns its Axes; bad inputs are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("matplotlib")

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tests.attnuq._reference_calibration import make_uniform_problem

from attnuq import metrics, plots
from attnuq.calibration import calibrate
from attnuq.predictive import GaussianPredictive, Predictive


def _save(ax, path: Path) -> None:  # type: ignore[no-untyped-def]
    ax.figure.savefig(path)
    plt.close(ax.figure)
    assert path.stat().st_size > 1000
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pit_histogram_and_reliability(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(30, 400, generator=g), torch.randn(400, generator=g)
    pit = metrics.pit_samples(x, y, generator=g)
    _save(plots.pit_histogram(pit, label="SA"), tmp_path / "p.png")
    ax = plots.reliability_diagram(Predictive(samples=x), y, label="samples")
    ax = plots.reliability_diagram(GaussianPredictive(torch.zeros(400), torch.ones(400)), y, ax=ax)
    assert len(ax.lines) == 4  # a diagonal and a curve per call
    _save(ax, tmp_path / "r.png")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        plots.pit_histogram(torch.tensor([0.5, 2.0]))
    with pytest.raises(TypeError, match="Predictive"):
        plots.reliability_diagram(x, y)  # type: ignore[arg-type]


def test_calibration_curve_from_report(tmp_path: Path) -> None:
    model, v, y = make_uniform_problem(n=64)
    for search in ("grid", "bo"):
        rep = calibrate(model, [(v, y)], criterion="scale", search=search, nu_range=(2, 128),
                        grid_size=7, progress=False)
        _save(rep.plot(), tmp_path / f"cal_{search}.png")


@pytest.mark.parametrize(("max_evals", "stopped_early"), [(1, False), (6, True)])
def test_calibration_curve_counts_what_the_progress_bar_counted(
    monkeypatch: pytest.MonkeyPatch, max_evals: int, stopped_early: bool
) -> None:
    """Issue #32 (the demo report): the search's progress bar ends at the number of
    evaluations, which is the number of dots of the plot and the count in its title, whether
    the budget runs out or the stopping rule ends the search before it (the bar's total
    shrinks to the evaluations made)."""
    import io

    from tqdm import tqdm

    from attnuq.calibration import search as search_mod

    bars: list[object] = []

    def recording_bar(progress: bool | None, desc: str, total: int) -> object:
        bar = tqdm(total=total, desc=desc, file=io.StringIO())  # enabled: it counts
        bars.append(bar)
        return bar

    monkeypatch.setattr(search_mod, "_bar", recording_bar)
    model, v, y = make_uniform_problem(n=64)
    rep = calibrate(model, [(v, y)], criterion="scale", search="bo", nu_range=(2, 128),
                    max_evals=max_evals, nu_tol=0.25, progress=False)
    n = len(rep.evaluations)
    assert (n < max_evals) == stopped_early
    assert len(bars) == 1
    assert bars[0].n == bars[0].total == n  # type: ignore[attr-defined]
    ax = rep.plot()
    assert len(ax.lines[0].get_xdata()) == n  # one dot per evaluation
    assert f"{n} evaluations of nu" in ax.get_title()
    plt.close(ax.figure)


def test_fan_chart_and_spread_map(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    seq = Predictive(samples=torch.randn(50, 2, 24, 3, generator=g).cumsum(2),
                     frozen=torch.zeros(2, 24, 3))
    ax = plots.fan_chart(seq, index=1, channel=2, targets=torch.randn(2, 24, 3, generator=g))
    _save(ax, tmp_path / "fan.png")
    with pytest.raises(ValueError, match="channel"):
        plots.fan_chart(seq)
    fields = Predictive(samples=torch.randn(20, 2, 5, 7, generator=g))
    lat, lon = torch.linspace(50, 58, 5), torch.linspace(-10, 2, 7)
    _save(plots.spread_map(fields, index=0, lat=lat, lon=lon), tmp_path / "map.png")
    _save(plots.spread_map(fields.std[1]), tmp_path / "map2.png")
    with pytest.raises(ValueError, match="lat/lon"):
        plots.spread_map(fields, lat=lat[:3], lon=lon)


def test_confidence_reliability_draws_the_bins(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    p = (3 * torch.randn(300, 3, generator=g, dtype=torch.float64)).softmax(-1)
    y = torch.multinomial(p, 1, generator=g)[:, 0]
    bins = metrics.calibration_bins(p, y, n_bins=10)
    ax = plots.confidence_reliability(bins, title="toy")
    keep = bins.count > 0
    heights = [bar.get_height() for bar in ax.patches]
    assert heights == pytest.approx(bins.accuracy[keep].tolist(), abs=1e-12)
    lefts = [bar.get_x() for bar in ax.patches]  # equal-width bins: one bar over each
    assert lefts == pytest.approx(bins.edges[:-1][keep].tolist(), abs=1e-12)  # type: ignore[index]
    assert ax.get_title() == f"toy: ECE {float(metrics.ece_probs(p, y, n_bins=10)):.4f}"
    _save(ax, tmp_path / "conf.png")
    mass = plots.confidence_reliability(metrics.calibration_bins(p, y, binning="mass"))
    assert len(mass.patches) == 15
    plt.close(mass.figure)
    with pytest.raises(TypeError, match=r"bins must be attnuq\.metrics\.CalibrationBins"):
        plots.confidence_reliability((p, y))  # type: ignore[arg-type]
