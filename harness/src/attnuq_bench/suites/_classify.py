"""The classification spine of the suites (``mortality``, ``digits``): predictions stored per
item, scores computed from them by the library's metrics, sets, figures.

A run item (one method on one backbone and seed) stores its predictions beside its JSON record
(``<method>.npz``: class probabilities of the calibration part and of every evaluation set,
the mutual information and expected entropy where the method draws samples, and the labels),
written atomically before the record; the page is computed from these files alone
(:func:`scores_of`), so ``--render-only`` and the page-regeneration test need nothing else.

Scores (:func:`class_scores`, :mod:`attnuq.metrics`): NLL, Brier, ECE (15 equal-width bins of
the top-label confidence), accuracy, AURC and error-AUROC of the method's uncertainty score
(``1 - max_c p_c``); binary sets also AUROC and AUPRC of ``p_1`` and the AUROC on the 80 %
most confident examples (confidence ``max(p, 1 - p)``). Sets (:func:`set_scores_of`): split
conformal on the method's own calibration-part probabilities (:func:`attnuq.conformal_sets.
fit_sets`), coverage and mean size on each evaluation set.
"""

from __future__ import annotations

import functools
import io
import math
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["class_scores", "compute_line", "covers_more", "equal_coverage_note", "fit_method",
           "lac_size_at_coverage", "load_predictions", "predict_all", "reliability_figure",
           "save_predictions", "seed_members", "set_scores_of", "start_run", "uncertainty_of"]

#: the uncertainty score a method is ranked by for OOD detection: the mutual information for
#: methods that draw samples, else ``1 - max_c p_c`` (max-softmax)
OOD_SCORE = "mutual information (methods with draws), else 1 - max softmax"


def start_run(args: Any) -> tuple[Path, dict[str, Any]]:
    """What a classification suite does before its items, once its own options are checked:
    refuse an unknown ``--methods`` name, set ``--threads``, create ``--out`` (with a
    ``.gitignore`` of the backbone cache and error files). Returns the backbone cache folder
    (``--cache-dir``, default ``<out>/_models``) and the run's provenance."""
    from attnuq._io import atomic_write_text
    from attnuq._runtime import run_info
    from attnuq_bench.suites._options import check_method_names

    check_method_names(args.methods)
    torch.set_num_threads(max(1, int(args.threads)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / ".gitignore", "_models/\n*.err.txt\n")
    return (Path(args.cache_dir) if args.cache_dir else out / "_models"), run_info()


def seed_members(backbone: Callable[[int], tuple[torch.nn.Module, dict[str, Any]]], seed: int
                 ) -> tuple[Callable[[int], torch.nn.Module], dict[int, dict[str, Any]]]:
    """Deep-ensemble members from the backbone cache: member ``k`` is ``backbone(seed + k)``
    (a model and its training record). Returns the ``make_model`` of a
    :class:`~attnuq_bench.methods.Task` and the records of the members it has made so far
    (what :func:`fit_method` books)."""
    members: dict[int, dict[str, Any]] = {}

    def make_model(k: int) -> torch.nn.Module:
        model, info = backbone(seed + k)
        members[k] = info
        return model

    return make_model, members


def fit_method(method: str, task: Any, seed: int, members: Mapping[int, Mapping[str, Any]], *,
               mc_samples: int, ensemble: int) -> tuple[Any, dict[str, Any]]:
    """The registered classification ``method`` (``mc_samples`` MC-dropout passes,
    ``ensemble`` members) fitted on ``task`` after ``torch.manual_seed(1234 + seed)``, and its
    cost. The ensemble's members come trained from the backbone cache: their training seconds
    (member 0 is the backbone itself, not booked) are added to its fit time."""
    from attnuq_bench.methods import make_method

    torch.manual_seed(1234 + seed)
    kw = {"mc-dropout-cls": {"n_samples": mc_samples},
          "ensemble-cls": {"n_members": ensemble}}.get(method, {})
    m = make_method(method, **kw)
    m.fit(task)
    cost = m.cost.to_dict()
    if method == "ensemble-cls":
        cost["fit_seconds"] += sum(float(v.get("seconds", 0.0)) for k, v in members.items()
                                   if k != 0)
    return m, cost


def predict_all(method: Any, batches: Sequence[Any]) -> dict[str, np.ndarray]:
    """Probabilities ``(N, C)`` (float64) of a fitted classification method over ``batches``
    (inputs only, or ``(inputs, targets)`` pairs), and its per-example mutual information and
    expected entropy ``(N,)`` when it draws samples."""
    probs, mi, ee = [], [], []
    for b in batches:
        x = b[0] if isinstance(b, tuple) else b
        pred = method.predict(x)
        probs.append(pred.probs.double().cpu())
        if pred.samples is not None:
            mi.append(pred.mutual_information.double().cpu())
            ee.append(pred.expected_entropy.double().cpu())
    out = {"probs": torch.cat(probs).numpy()}
    if mi:
        out["mi"] = torch.cat(mi).numpy()
        out["ee"] = torch.cat(ee).numpy()
    return out


def save_predictions(path: Path, arrays: Mapping[str, np.ndarray]) -> Path:
    """Write ``arrays`` to ``path`` (``.npz``, compressed) atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.savez_compressed(buf, **{k: np.asarray(v) for k, v in arrays.items()})  # type: ignore[arg-type]
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(buf.getvalue())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_predictions(path: Path) -> dict[str, np.ndarray]:
    """The arrays of a predictions file (raises ``FileNotFoundError`` naming it)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"predictions file {path} is missing: rerun the item")
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def uncertainty_of(probs: np.ndarray) -> np.ndarray:
    """``1 - max_c p_c`` ``(N,)``."""
    return 1.0 - np.asarray(probs).max(-1)


def class_scores(probs: np.ndarray, y: np.ndarray, *, keep: float = 0.8) -> dict[str, float]:
    """The scores of one method on one evaluation set (module docstring)."""
    from attnuq import metrics

    p = torch.as_tensor(np.asarray(probs, dtype=np.float64))
    t = torch.as_tensor(np.asarray(y, dtype=np.int64))
    out = {k: one_score(probs, y, k) for k in SCORE_KEYS}
    out["accuracy"] = float(1 - (p.argmax(1) != t).double().mean())
    if p.shape[1] == 2:
        unc = torch.as_tensor(uncertainty_of(p.numpy()))
        out["auroc"] = float(metrics.auroc(p[:, 1], t))
        out["auprc"] = float(metrics.auprc(p[:, 1], t))
        k = max(2, math.floor(keep * len(t)))
        order = torch.sort(unc, stable=True).indices[:k]
        ys = t[order]
        out[f"auroc_top{round(100 * keep)}"] = (float(metrics.auroc(p[order, 1], ys))
                                               if 0 < int(ys.sum()) < k else math.nan)
    return out


#: the scores :func:`one_score` computes alone
SCORE_KEYS = ("nll", "brier", "ece", "aurc", "auroc_error")


def one_score(probs: np.ndarray, y: np.ndarray, key: str) -> float:
    """One of :func:`class_scores`' ``nll``, ``brier``, ``ece``, ``aurc``, ``auroc_error``
    alone (the same definitions, without computing the others: bootstrap replicates)."""
    from attnuq import metrics

    if key not in SCORE_KEYS:
        raise ValueError(f"key must be nll, brier, ece, aurc or auroc_error, got {key=!r}")
    p = torch.as_tensor(np.asarray(probs, dtype=np.float64))
    t = torch.as_tensor(np.asarray(y, dtype=np.int64))
    pin = p[:, 1] if p.shape[1] == 2 else p
    if key == "nll":
        return float(metrics.nll_probs(pin, t))
    if key == "brier":
        return float(metrics.brier_probs(pin, t))
    if key == "ece":
        return float(metrics.ece_probs(pin, t))
    wrong = (p.argmax(1) != t).double()
    unc = torch.as_tensor(uncertainty_of(p.numpy()))
    if key == "aurc":
        return float(metrics.aurc(unc, wrong))
    return (float(metrics.auroc_error(unc, wrong)) if 0 < float(wrong.sum()) < len(wrong)
            else math.nan)


def paired_bootstrap_se(diffs: Sequence[tuple[int, Callable[[np.ndarray], float]]], *,
                        n_boot: int = 200, seed: int = 0) -> float:
    """Bootstrap standard error of a mean over seeds of paired score differences.

    ``diffs``: per model seed ``k``, the test-set size ``n_k`` and ``f_k(idx)``, the score of
    method A minus that of method B on the examples ``idx`` (the same rows for both: paired).
    Each of ``n_boot`` replicates draws ``n_k`` rows with replacement per seed and averages
    ``f_k`` over the seeds; the result is the replicates' standard deviation, the noise a
    difference of seed-mean scores carries from the finite test set alone (not from the seeds).
    With 200 replicates the SE itself is known to about 5 % (``1 / sqrt(2 (n_boot - 1))``).

    >>> rng = np.random.default_rng(0)
    >>> a, b = rng.normal(size=400), rng.normal(size=400)
    >>> se = paired_bootstrap_se([(400, lambda i: float(a[i].mean() - b[i].mean()))])
    >>> bool(0.8 < se / np.sqrt(2 / 400) < 1.2)  # the SE of a difference of independent means
    True
    """
    if not diffs:
        raise ValueError("diffs must name at least one seed, got an empty sequence")
    if n_boot < 2:
        raise ValueError(f"n_boot must be at least 2, got {n_boot=}")
    rng = np.random.default_rng(seed)
    reps = [float(np.mean([f(rng.integers(0, n, n)) for n, f in diffs])) for _ in range(n_boot)]
    return float(np.std(reps, ddof=1))


def set_sizes_of(cal_probs: np.ndarray, cal_y: np.ndarray, probs: np.ndarray, alpha: float,
                 score: str = "lac") -> np.ndarray:
    """Per-example sizes ``(N,)`` of the split-conformal sets fitted on the calibration part."""
    from attnuq.conformal_sets import fit_sets

    rule = fit_sets(torch.as_tensor(cal_probs), torch.as_tensor(cal_y), alpha=alpha,
                    score=score)  # type: ignore[arg-type]
    return rule.predict(torch.as_tensor(probs)).sum(-1).numpy().astype(np.float64)


def _size_diff(i: np.ndarray, *, sa: np.ndarray, sb: np.ndarray) -> float:
    return float(sa[i].mean() - sb[i].mean())


def _score_diff(i: np.ndarray, *, qa: np.ndarray, qb: np.ndarray, y: np.ndarray, key: str
                ) -> float:
    return one_score(qa[i], y[i], key) - one_score(qb[i], y[i], key)


def lac_size_at_coverage(probs: np.ndarray, y: np.ndarray, coverage: float) -> float:
    r"""Mean LAC set size where the sets cover ``coverage`` of ``(probs, y)``.

    LAC sets are ``{k : 1 - p_k <= q}``; with the scores ``s_i = 1 - p_{i, y_i}`` sorted, the
    smallest threshold covering at least ``coverage`` of the ``n`` rows is
    ``q = s_(ceil(coverage n))``, and the result is ``mean_i |{k : 1 - p_ik <= q}|``. Read on
    an evaluation set, this puts two methods' size-coverage trade-offs side by side at exactly
    equal coverage (without the calibration quantile's own noise): a diagnostic, never a
    threshold to use.

    ``probs`` ``(N, C)``, ``y`` ``(N,)`` integer labels, ``coverage`` in ``(0, 1]``.

    >>> p = np.array([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.45, 0.55]])
    >>> y = np.array([0, 1, 1, 0])  # scores 0.1, 0.6, 0.3, 0.55; at 50 %: q = 0.3, two empty sets
    >>> lac_size_at_coverage(p, y, 0.5), lac_size_at_coverage(p, y, 1.0)
    (0.5, 1.5)
    """
    probs, y = np.asarray(probs), np.asarray(y)
    if probs.ndim != 2 or y.shape != probs.shape[:1] or not len(y):
        raise ValueError("probs must be (N, C) and y (N,) with N >= 1, got shapes "
                         f"{probs.shape} and {y.shape}")
    if not 0.0 < coverage <= 1.0:
        raise ValueError(f"coverage must lie in (0, 1], got {coverage=}")
    s = 1.0 - probs[np.arange(len(y)), y]
    k = min(len(y), max(1, math.ceil(coverage * len(y) - 1e-9)))
    q = np.sort(s)[k - 1]
    return float(((1.0 - probs) <= q).sum(1).mean())


def covers_more(met: bool, coverage_a: float | None, coverage_b: float | None) -> str:
    """``"; why: ..."`` when sets fitted to the same level are larger but also cover more (the
    calibration quantiles landed apart), pointing to the equal-coverage comparison; else ``""``.

    >>> covers_more(False, 0.959, 0.956)[:30]
    '; why: these sets also cover m'
    >>> covers_more(True, 0.959, 0.956), covers_more(False, 0.95, 0.956)
    ('', '')
    """
    if met or coverage_a is None or coverage_b is None or coverage_a <= coverage_b:
        return ""
    return (f"; why: these sets also cover more of the test set ({coverage_a:.3f} against "
            f"{coverage_b:.3f}: each method's calibration quantile lands on its own score), so "
            "the sizes are compared at equal coverage in the lines below")


def equal_coverage_note(by: Mapping[str, Sequence[Mapping[str, Any]]], a: str, b: str,
                        coverage: float, probs_key: str, unit: str
                        ) -> tuple[float, float, str] | None:
    """Sizes of ``a``'s and ``b``'s LAC sets at equal test coverage, and the paired noise.

    Per seed both have, :func:`lac_size_at_coverage` of each method's ``probs_key``
    predictions (labels ``test_y``) at ``coverage``; returns the seed means ``(size_a,
    size_b)`` and ``"; difference d, paired bootstrap SE s over the N <unit>: ..."`` (rows
    resampled, both thresholds re-read on every resample); ``None`` when they share no seed.
    """
    rb = {r["seed"]: r for r in by.get(b, [])}
    pairs = [(r["_pred"], rb[r["seed"]]["_pred"]) for r in by.get(a, []) if r["seed"] in rb]
    if not pairs:
        return None
    diffs: list[tuple[int, Callable[[np.ndarray], float]]] = [
        (len(pa["test_y"]), functools.partial(_equal_cov_diff, pa=pa[probs_key],
                                              pb=pb[probs_key], y=pa["test_y"],
                                              coverage=coverage))
        for pa, pb in pairs]
    size_a = float(np.mean([lac_size_at_coverage(pa[probs_key], pa["test_y"], coverage)
                            for pa, _ in pairs]))
    size_b = float(np.mean([lac_size_at_coverage(pb[probs_key], pb["test_y"], coverage)
                            for _, pb in pairs]))
    return size_a, size_b, _difference_note(size_a - size_b, paired_bootstrap_se(diffs),
                                            len(pairs[0][0]["test_y"]), unit)


def _difference_note(d: float, se: float, n: int, unit: str) -> str:
    """``"; difference d, paired bootstrap SE s over the n <unit>: <verdict>"``."""
    if d == 0.0 and se == 0.0:
        verdict = "identical on every resample"
    else:
        verdict = "within noise (|difference| < 2 SE)" if abs(d) < 2 * se else "beyond noise"
    return f"; difference {d:+.4f}, paired bootstrap SE {se:.2g} over the {n} {unit}: {verdict}"


def _equal_cov_diff(i: np.ndarray, *, pa: np.ndarray, pb: np.ndarray, y: np.ndarray,
                    coverage: float) -> float:
    return (lac_size_at_coverage(pa[i], y[i], coverage)
            - lac_size_at_coverage(pb[i], y[i], coverage))


def noise_note(by: Mapping[str, Sequence[Mapping[str, Any]]], a: str, b: str, key: str,
               probs_key: str, unit: str) -> str:
    """``"; difference d, paired bootstrap SE s over the N <unit>: within / beyond noise"``.

    Method ``a`` against ``b`` (records grouped by method in ``by``, each with its
    predictions under ``"_pred"``: ``probs_key``, ``test_y``, ``cal_probs``, ``cal_y``), on
    ``key``: a score of :func:`one_score`, or ``size_90`` / ``size_95`` (the mean size of the
    LAC sets fitted on each method's calibration part), over the seeds both have; the SE is
    :func:`paired_bootstrap_se`'s. Empty when the two share no seed.
    """
    rb = {r["seed"]: r for r in by.get(b, [])}
    pairs = [(r["_pred"], rb[r["seed"]]["_pred"]) for r in by.get(a, []) if r["seed"] in rb]
    if not pairs:
        return ""
    diffs: list[tuple[int, Callable[[np.ndarray], float]]] = []
    for pa, pb in pairs:
        y = pa["test_y"]
        if key.startswith("size_"):
            alpha = 1 - int(key.split("_")[1]) / 100
            sa, sb = (set_sizes_of(p["cal_probs"], p["cal_y"], p[probs_key], alpha)
                      for p in (pa, pb))
            diffs.append((len(y), functools.partial(_size_diff, sa=sa, sb=sb)))
        else:
            diffs.append((len(y), functools.partial(_score_diff, qa=pa[probs_key],
                                                    qb=pb[probs_key], y=y, key=key)))
    d = float(np.mean([f(np.arange(n)) for n, f in diffs]))
    return _difference_note(d, paired_bootstrap_se(diffs), len(pairs[0][0]["test_y"]), unit)


def set_scores_of(cal_probs: np.ndarray, cal_y: np.ndarray,
                  evals: Mapping[str, tuple[np.ndarray, np.ndarray]], *,
                  alphas: Sequence[float] = (0.1, 0.05), score: str = "lac"
                  ) -> dict[str, dict[str, float]]:
    """Split-conformal sets fitted on ``(cal_probs, cal_y)``: ``{eval set: {"coverage_90",
    "size_90", ...}}`` for each ``alpha`` (the level ``round(100 (1 - alpha))``); ``nan`` for
    an ``alpha`` below ``1 / (n + 1)``, which a calibration part of ``n`` cannot support."""
    from attnuq import metrics
    from attnuq.conformal_sets import fit_sets

    out: dict[str, dict[str, float]] = {k: {} for k in evals}
    n = len(cal_y)
    for a in alphas:
        lv = round(100 * (1 - a))
        if a < 1.0 / (n + 1):
            for name in evals:
                out[name][f"coverage_{lv}"] = out[name][f"size_{lv}"] = math.nan
            continue
        rule = fit_sets(torch.as_tensor(cal_probs), torch.as_tensor(cal_y), alpha=a,
                        score=score)  # type: ignore[arg-type]
        for name, (p, y) in evals.items():
            sets = rule.predict(torch.as_tensor(p))
            out[name][f"coverage_{lv}"] = float(metrics.set_coverage(sets, torch.as_tensor(y)))
            out[name][f"size_{lv}"] = float(metrics.set_size(sets))
    return out


def compute_line(rows: Sequence[Mapping[str, Any]], threads: Any) -> str:
    """The page's line on what the stored items cost: the items' wall time (fits and
    predictions), the distinct backbones' training time (each once), the threads.

    >>> line = compute_line([{"wall_seconds": 60.0, "seed": 0, "backbone_info": {
    ...     "seconds": 30.0, "cache_key": "k"}}], 1)
    >>> "1 stored items took 1.0 min" in line, "1 backbones trained in 0.5 min" in line
    (True, True)
    """
    items = sum(float(r.get("wall_seconds", 0.0)) for r in rows)
    bb = {(r.get("backbone", ""), r["seed"], r["backbone_info"].get("cache_key")):
          float(r["backbone_info"].get("seconds", 0.0)) for r in rows}
    return (f"Compute: {len(rows)} stored items took {items / 60:.1f} min of wall time (fits and "
            f"predictions); their {len(bb)} backbones trained in {sum(bb.values()) / 60:.1f} min;"
            f" {threads} thread(s).")


def reliability_figure(path: Path, title: str, panels: Mapping[str, tuple[np.ndarray, np.ndarray]],
                       n_bins: int = 15) -> Path:
    """One PNG of reliability diagrams (:func:`attnuq.plots.confidence_reliability`: accuracy
    against top-label confidence, equal-width bins, the ECE in each title), one panel per
    ``label -> (probs, labels)``; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from attnuq._io import atomic_savefig
    from attnuq.metrics import calibration_bins
    from attnuq.plots import confidence_reliability

    if not panels:
        raise ValueError(f"no reliability panels for {str(path)!r}")
    ncol = min(4, len(panels))
    nrow = math.ceil(len(panels) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.0 * ncol, 2.9 * nrow), squeeze=False)
    for ax, (label, (p, y)) in zip(axes.flat, panels.items(), strict=False):
        bins = calibration_bins(torch.as_tensor(p), torch.as_tensor(y), n_bins=n_bins)
        confidence_reliability(bins, ax=ax, title=label)
        ax.title.set_fontsize(8)
        ax.xaxis.label.set_fontsize(7)
        ax.yaxis.label.set_fontsize(7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=80)
    plt.close(fig)
    return Path(path)
