"""``attnuq calibrate --task classification`` and ``attnuq predict`` with a fitted
:class:`attnuq.SAClassifier`: the classification side of the two commands.

The held-out file's targets are integer class ids (``y`` of an ``.npz``, or one ``--target``
column of a ``.csv``); ``y`` of shape ``(N, L)`` in an ``.npz`` holds per-token labels.
``calibrate`` writes the same folder as for regression (``estimator.json`` with the options in
its ``metadata``, ``calibration.json``, the curve, ``results.json``, ``report.html``);
``predict`` writes, per input row, the Monte Carlo mean probabilities, the predicted class,
the uncertainty scores (max probability, entropy, its expected part and the mutual
information) and the split-conformal prediction set at ``--level``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnuq.data import DataFormatError

__all__ = ["TASKS", "calibrate_classifier", "class_csv", "class_ids", "fitted_kind",
           "predict_classes", "resolve_task_options", "set_rule_at"]

#: the values of ``attnuq calibrate --task``
TASKS = ("regression", "classification")
#: the options of one task only, with their defaults (``None``: off)
TASK_OPTIONS: dict[str, dict[str, Any]] = {
    "regression": {"criterion": "auto", "centre": "frozen", "per_layer": None},
    "classification": {"score": "aps", "temperature": "joint"},
}
#: ``--n-passes`` when not given: regression's passes per input (search and spread)
REGRESSION_PASSES = 6


def resolve_task_options(args: argparse.Namespace) -> None:
    """Refuse an option of the other task (it would be ignored) and fill in the defaults of
    ``args.task``'s own options, in place.

    Examples
    --------
    >>> ns = argparse.Namespace(task="classification", criterion=None, centre=None,
    ...                         per_layer=None, score=None, temperature=None, n_passes=None)
    >>> resolve_task_options(ns)
    >>> ns.score, ns.temperature, ns.n_passes
    ('aps', 'joint', None)
    >>> ns = argparse.Namespace(task="regression", criterion=None, centre=None,
    ...                         per_layer=None, score="lac", temperature=None, n_passes=None)
    >>> resolve_task_options(ns)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: --score applies to --task classification only, got --score lac with ...
    """
    task = getattr(args, "task", "regression")
    if task not in TASKS:
        raise ValueError(f"--task must be one of {TASKS}, got {task!r}")
    for other, options in TASK_OPTIONS.items():
        if other == task:
            continue
        for name in options:
            value = getattr(args, name, None)
            if value is not None:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} applies to --task {other} only, got {flag} {value} "
                                 f"with --task {task}")
    for name, default in TASK_OPTIONS[task].items():
        if getattr(args, name, None) is None:
            setattr(args, name, default)
    if task == "regression" and getattr(args, "n_passes", None) is None:
        args.n_passes = REGRESSION_PASSES


def class_ids(y: torch.Tensor, path: str | Path) -> torch.Tensor:
    """The held-out targets ``y`` (as read, float) as integer class ids (``int64``), or a
    :class:`~attnuq.data.DataFormatError` naming the first value that is not a whole number.

    A ``.csv`` file gives one target column (the class id); an ``.npz`` array ``y`` of shape
    ``(N, L)`` holds per-token labels. The range ``[0, C)`` is checked by the estimator
    against the model's number of classes.

    Examples
    --------
    >>> class_ids(torch.tensor([0.0, 2.0, 1.0]), "held.npz")
    tensor([0, 2, 1])
    >>> class_ids(torch.tensor([0.0, 0.5]), "held.npz")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    attnuq.data.DataFormatError: held.npz: ... must be integer class ids; row 1 holds 0.5
    """
    p = Path(path)
    if p.suffix == ".csv" and y.dim() == 2:
        raise ValueError(f"--task classification takes one --target column (the class id); "
                         f"{p.name} gives {y.shape[1]} target columns")
    frac = y != torch.round(y)
    if bool(frac.any()):
        i = int(frac.reshape(len(y), -1).any(1).nonzero()[0, 0])
        raise DataFormatError(p, f"classification targets must be integer class ids; row {i} "
                                 f"holds {_fmt_row(y[i])}")
    if bool((y.abs() > 2**24).any()):  # beyond float32's whole numbers: not a class id
        raise DataFormatError(p, f"classification target {float(y.abs().max()):g} is too large "
                                 "to be a class id")
    return y.long()


def _fmt_row(v: torch.Tensor) -> str:
    return f"{float(v):g}" if v.dim() == 0 else str([float(a) for a in v.reshape(-1)])


def calibrate_classifier(args: argparse.Namespace, model: torch.nn.Module, val: list[Any],
                         cal: list[Any], output_fn: Any, n_val_rows: int, n_cal_rows: int,
                         out: Path) -> Path:
    """Fit :class:`attnuq.SAClassifier` on the ``val`` and ``cal`` batches and write the
    calibration folder ``out`` (rank 0 only under ``torchrun``; the fit itself is repeated on
    every rank, with the same numbers); returns ``out``."""
    import warnings

    from attnuq._io import staged_dir
    from attnuq.distributed import is_primary, local
    from attnuq.estimators._classifier import SAClassifier
    from attnuq.estimators._common import EstimatorWarning

    passes = {} if args.n_passes is None else {"n_passes": args.n_passes,
                                               "n_samples": args.n_passes}
    # under torchrun each rank fits the whole estimator by itself (SAClassifier's search is
    # not sharded; the seed makes every rank's fit the same), and rank 0 writes it
    with warnings.catch_warnings(record=True) as caught, local():
        warnings.simplefilter("always")
        clf = SAClassifier(
            model, output_fn, temperature=None if args.temperature == "none"
            else args.temperature, score=args.score, seed=args.seed, search=args.search,
            progress=None, **passes,
        ).fit(val, cal)
    if not is_primary():
        return out
    from attnuq.cli._calibrate import _show_warnings

    _show_warnings([w for w in caught if issubclass(w.category, EstimatorWarning)])
    d = clf.diagnostics
    with staged_dir(out) as stage:  # out appears only once every file is written
        _write(stage, clf, args, n_val_rows, n_cal_rows)
    edge = f" (at the {d['nu_at_edge']} edge of nu_range)" if d["nu_at_edge"] else ""
    v = d["val"]
    print(f"chosen nu = {d['nu']}{edge}; temperature T = {d['temperature']:.4g} "
          f"({d['temperature_rule'] or 'none'}); validation NLL: frozen "
          f"{v['frozen']['nll']:.4g}, temperature scaling {v['temperature_scaling']['nll']:.4g}, "
          f"SA {v['sa']['nll']:.4g}")
    n_cal = d["n_cal"]
    print(f"prediction sets ({args.score}) from {n_cal} calibration rows: --level up to "
          f"{n_cal / (n_cal + 1):.4g}")
    print(f"fitted estimator written to {out / 'estimator.json'} "
          f"(attnuq predict MODEL {out / 'estimator.json'} INPUTS --out FILE)")
    return out


def _write(out: Path, clf: Any, args: argparse.Namespace, n_val_rows: int,
           n_cal_rows: int) -> None:
    """``estimator.json``, ``calibration.json``, the curve, ``results.json`` and the report
    of a fitted classification ``calibrate`` run, into ``out``."""
    from attnuq._io import atomic_write_json, atomic_write_text
    from attnuq._runtime import run_info
    from attnuq.cli._calibrate import draw_calibration_curve
    from attnuq.html_report import render_report

    d = clf.diagnostics
    clf.save(out / "estimator.json", metadata={
        "command": "attnuq calibrate", "task": "classification",
        "model": str(Path(args.model).resolve()), "data": str(Path(args.data).resolve()),
        "head": None if args.head is None else str(Path(args.head).resolve()),
        "pool": args.pool, "output_key": args.output_key, **args.columns,
        "cal_fraction": args.cal_fraction, "n_val_rows": n_val_rows, "n_cal_rows": n_cal_rows,
        "squeeze": False,
    })
    report = clf.report
    if report is not None:
        atomic_write_text(out / "calibration.json", report.to_json())
    figures = draw_calibration_curve(out, report) + _draw_reliability(out, d["val"])
    v = d["val"]
    n_cal = d["n_cal"]
    results = {
        "title": f"attnuq calibration of {Path(args.model).name} (classification)",
        "summary": {
            "chosen nu": d["nu"],
            "nu at an edge of its range": d["nu_at_edge"] or "no",
            "temperature T": d["temperature"],
            "temperature rule": d["temperature_rule"] or "none",
            "classes": d["n_classes"],
            "per token": d["per_token"],
            "val NLL (frozen / temperature scaling / SA)":
                " / ".join(f"{v[k]['nll']:.4g}" for k in ("frozen", "temperature_scaling", "sa")),
            "val ECE (frozen / temperature scaling / SA)":
                " / ".join(f"{v[k]['ece']:.4g}" for k in ("frozen", "temperature_scaling", "sa")),
            "val mean mutual information (nats)": d["val_mean_mutual_information"],
            "set score": args.score,
            "largest set level the calibration part supports": n_cal / (n_cal + 1),
            "search": args.search,
            "held-out rows (val / cal)": f"{n_val_rows} / {n_cal_rows}",
            "labelled rows (val / cal)": f"{d['n_val']} / {n_cal}",
            "forward passes per example": d["forward_passes"],
            **({"head": f"{Path(args.head).name} on the {args.pool}-pooled embedding"}
               if args.head is not None else {}),
            **({"warnings": " | ".join(d["warnings"])} if d.get("warnings") else {}),
        },
        "tables": [],
        "figures": figures,
        "meta": run_info(),
    }
    atomic_write_json(out / "results.json", results, indent=2)
    render_report(out / "results.json")


def _draw_reliability(out: Path, val: dict[str, Any]) -> list[dict[str, str]]:
    """``out/reliability.png``: the validation reliability diagrams of the frozen model,
    temperature scaling alone and SA (the bins in the fit's diagnostics); nothing without
    matplotlib (the extra ``plots``)."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        print("reliability.png not drawn: matplotlib is not installed "
              "(pip install 'attnuq[plots]')")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from attnuq._io import atomic_savefig
    from attnuq.metrics import CalibrationBins
    from attnuq.plots import confidence_reliability

    names = {"frozen": "frozen", "temperature_scaling": "temperature scaling", "sa": "SA"}
    fig, axes = plt.subplots(1, 3, figsize=(9.6, 3.4))
    for ax, (key, name) in zip(axes, names.items(), strict=True):
        confidence_reliability(CalibrationBins.from_dict(val[key]["reliability"]), ax=ax,
                               title=name)
    fig.suptitle("validation part: accuracy against confidence", fontsize=9)
    fig.tight_layout()
    atomic_savefig(fig, out / "reliability.png", dpi=100)
    plt.close(fig)
    return [{"file": "reliability.png",
             "caption": "validation reliability: frozen, temperature scaling alone, SA"}]


def fitted_kind(path: str | Path) -> str:
    """The estimator class a fitted JSON file names: ``"SAClassifier"`` or ``"SARegressor"``
    (also for a file that is not a fitted estimator at all, whose loading then says why).

    Raises
    ------
    FileNotFoundError, ValueError
        No such file; a folder, a pipe or a device (read by no one, so never blocking).
    """
    from attnuq._io import check_input_file

    p = check_input_file(path, "fitted estimator file")
    try:
        obj = json.loads(p.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return "SARegressor"
    kind = obj.get("estimator") if isinstance(obj, dict) else None
    return "SAClassifier" if kind == "SAClassifier" else "SARegressor"


def set_rule_at(clf: Any, level: float) -> Any:
    """The fitted classifier's set rule at ``level`` (``alpha = 1 - level``), checked before
    any forward pass; ``None`` for an estimator fitted without a calibration part.

    Raises
    ------
    ValueError
        ``level`` above ``n / (n + 1)`` for the ``n`` calibration rows (the message names the
        largest supported level and the rows ``level`` needs).
    """
    try:
        return clf.set_rule(1.0 - level)
    except RuntimeError:
        return None
    except ValueError:
        n = len(clf.to_dict()["fitted"]["cal_scores"] or [])
        raise ValueError(
            f"--level {level} is above what the calibration part supports: its n = {n} rows "
            f"give prediction sets up to --level {n / (n + 1):.4g} (--level {level} needs at "
            f"least {math.ceil(level / (1 - level) - 1e-9)} rows: calibrate on more held-out "
            "rows or a larger --cal-fraction)"
        ) from None


def predict_classes(clf: Any, rule: Any, inputs: Any, batch_size: int, level: float,
                    samples: bool) -> dict[str, np.ndarray]:
    """The arrays ``attnuq predict`` writes for a classifier, over every input row in
    batches of ``batch_size``: ``probs`` ``(N, [L,] C)``, ``label``, ``confidence``,
    ``entropy``, ``expected_entropy``, ``mutual_information`` ``(N, [L])``, ``set``
    ``(N, [L,] C)`` (bool; absent when ``rule`` is ``None``) and ``samples`` ``(S, N, [L,] C)``
    when asked."""
    from attnuq.cli._calibrate import input_batches

    parts: dict[str, list[torch.Tensor]] = {}
    for _, xb in input_batches(inputs, batch_size):
        if rule is None:
            pred, sets = clf.predict(xb), None
        else:
            pred, sets = clf.predict_with_set(xb, 1.0 - level)
        got = {"probs": pred.probs, "label": pred.prediction, "confidence": pred.confidence,
               "entropy": pred.entropy, "expected_entropy": pred.expected_entropy,
               "mutual_information": pred.mutual_information}
        if sets is not None:
            got["set"] = sets
        if samples:
            got["samples"] = pred.samples
        for k, t in got.items():
            parts.setdefault(k, []).append(t.detach().cpu())
    return {k: torch.cat(v, 1 if k == "samples" else 0).numpy() for k, v in parts.items()}


def class_csv(res: dict[str, np.ndarray]) -> str:
    """One row per input: ``label``, ``prob_<c>``, ``confidence``, ``entropy``,
    ``expected_entropy``, ``mutual_information``, then ``set_size`` and ``set_<c>`` (0/1)
    when the sets were computed.

    Examples
    --------
    >>> res = {"probs": np.array([[0.25, 0.75]]), "label": np.array([1]),
    ...        "confidence": np.array([0.75]), "entropy": np.array([0.56]),
    ...        "expected_entropy": np.array([0.5]), "mutual_information": np.array([0.06]),
    ...        "set": np.array([[False, True]])}
    >>> print(class_csv(res), end="")
    label,prob_0,prob_1,confidence,entropy,expected_entropy,mutual_information,set_size,set_0,set_1
    1,0.25,0.75,0.75,0.56,0.5,0.06,1,0,1
    """
    from attnuq.cli._calibrate import csv_text

    probs = res["probs"]
    cols: list[tuple[str, np.ndarray]] = [("label", res["label"].astype(int))]
    cols += [(f"prob_{k}", probs[:, k]) for k in range(probs.shape[1])]
    cols += [(k, res[k]) for k in ("confidence", "entropy", "expected_entropy",
                                   "mutual_information")]
    if "set" in res:
        s = res["set"].astype(int)
        cols.append(("set_size", s.sum(1)))
        cols += [(f"set_{k}", s[:, k]) for k in range(probs.shape[1])]
    return csv_text(cols)
