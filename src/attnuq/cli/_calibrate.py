"""``attnuq calibrate``: calibrate ``nu`` for a user's saved model on a CSV or NPZ file."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from torch import nn

from attnuq._io import (
    atomic_savefig,
    atomic_write_json,
    atomic_write_text,
    check_input_file,
    check_out_dir,
    check_out_file,
    staged_dir,
)
from attnuq.data import DataFormatError

__all__ = ["HeldOut", "calibrate_saved_model", "load_heldout", "load_inputs", "load_saved_model",
           "make_output_fn", "predict_saved_model", "read_heldout"]


def load_saved_model(path: str | Path, device: str = "cpu") -> nn.Module:
    """Load a Hugging Face model folder or a ``torch.save``-d ``nn.Module``, in eval mode.

    A folder must hold ``config.json``; its class is the first entry of ``config.architectures``
    (e.g. ``PatchTSTForPrediction``), read with ``from_pretrained`` from the local folder only.
    """
    p = Path(path)
    if not p.is_dir():
        check_input_file(p, "model")  # not found, a FIFO (torch.load would block), /dev/null
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ValueError(f"model folder {p} has no config.json (not a Hugging Face model)")
        import transformers

        try:
            cfg = transformers.AutoConfig.from_pretrained(p, local_files_only=True)
        except Exception as exc:  # invalid JSON, unknown model_type, ...: a bad input folder
            raise ValueError(f"could not read {p / 'config.json'}: {_first_line(exc)}") from exc
        archs = getattr(cfg, "architectures", None) or []
        if not archs or not hasattr(transformers, archs[0]):
            raise ValueError(
                f"config.json in {p} names no known architecture (architectures={archs!r})"
            )
        from transformers.utils import logging as hf_logging

        # the CLI's stderr holds its own lines only (an error is one line): no loading bar
        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            model = getattr(transformers, archs[0]).from_pretrained(p, local_files_only=True)
        except Exception as exc:  # no weights, torn safetensors, shapes unlike config.json
            raise ValueError(
                f"could not load the weights of {archs[0]} from {p}: {_first_line(exc)}"
            ) from exc
        finally:
            if bar:
                hf_logging.enable_progress_bar()
    else:
        try:
            model = torch.load(p, map_location=device, weights_only=False)
        except Exception as exc:  # any unpickling failure means a bad input file
            raise ValueError(f"could not load {p} with torch.load: {_first_line(exc)}") from exc
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"{p} holds a {type(model).__name__}, not an nn.Module; save the module itself "
                "with torch.save(model, path)"
            )
    return model.to(device).eval()


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")


class HeldOut(NamedTuple):
    """Held-out data as :func:`read_heldout` reads it: ``inputs`` (a tensor or named arrays),
    targets ``y``, and for a ``.csv`` the input and target column names (``None`` for an
    ``.npz``)."""

    inputs: torch.Tensor | dict[str, torch.Tensor]
    y: torch.Tensor
    input_columns: list[str] | None
    target_columns: list[str] | None


def load_heldout(
    path: str | Path, targets: list[str] | None = None
) -> tuple[torch.Tensor | dict[str, torch.Tensor], torch.Tensor]:
    """``(inputs, targets)`` of :func:`read_heldout`."""
    held = read_heldout(path, targets)
    return held.inputs, held.y


def read_heldout(path: str | Path, targets: list[str] | None = None) -> HeldOut:
    """Read held-out ``(inputs, targets)`` from ``.npz`` or ``.csv``.

    NPZ: ``y`` holds the targets; ``x`` the inputs, or else every other array is passed to the
    model as a keyword argument of that name (with ``x`` present no other array is allowed, as
    it would be ignored). CSV: a header row of distinct, non-numeric column names; the
    ``targets`` columns (default: the last column) are the targets, all others the inputs.

    Raises
    ------
    FileNotFoundError
        No such file.
    ValueError
        The path is a folder, a named pipe or a device (``/dev/null``), not a regular file.
    attnuq.data.DataFormatError
        Malformed content (a ``ValueError`` naming the file and, for a CSV, the line): duplicate
        or missing header, a file without data rows, ragged or non-numeric rows, NaN/inf
        targets, non-numeric or scalar arrays, row counts that disagree.
    """
    p = check_input_file(path, "data file")  # not found, a folder, a FIFO, /dev/null
    x_names: list[str] | None = None
    y_names: list[str] | None = None
    if p.suffix == ".npz":
        inputs, y = _read_npz(p)
    elif p.suffix == ".csv":
        inputs, y, x_names, y_names = _read_csv(p, targets)
    else:
        raise ValueError(f"data file must end in .npz or .csv, got {p.name!r}")
    n = len(y)
    if n == 0:
        raise DataFormatError(p, "holds no rows")
    for bad, kind in ((torch.isnan(y), "NaN"), (torch.isinf(y), "infinite")):
        if bool(bad.any()):
            raise DataFormatError(p, f"{int(bad.sum())} {kind} target value(s) in array 'y'")
    sizes = [len(v) for v in (inputs.values() if isinstance(inputs, dict) else [inputs])]
    if any(s != n for s in sizes):
        raise DataFormatError(p, f"inputs have {sizes} rows but targets have {n}")
    return HeldOut(inputs, y, x_names, y_names)


def _read_npz(p: Path) -> tuple[torch.Tensor | dict[str, torch.Tensor], torch.Tensor]:
    """NPZ part of :func:`load_heldout`: numeric arrays of at least one axis, ``y`` required."""
    with p.open("rb") as fh:
        magic = fh.read(6)
    if magic[:2] != b"PK" and magic != b"\x93NUMPY":
        # numpy would try it as a pickle and say "contains pickled data"
        raise DataFormatError(
            p, f"is not a valid .npz file (a zip archive of .npy arrays): it starts with "
            f"{magic!r}" if magic else "is empty, not a valid .npz file"
        )
    try:
        # our own handle: np.load leaks its file when the zip directory is torn (numpy 2.4)
        with p.open("rb") as fh:
            z = np.load(fh, allow_pickle=False)
            if not isinstance(z, np.lib.npyio.NpzFile):
                raise DataFormatError(p, "holds a single .npy array, not an .npz archive")
            with z:
                arrays = {k: np.asarray(z[k]) for k in z.files}
    except DataFormatError:
        raise
    except Exception as exc:  # not a zip, truncated, pickled objects: a bad data file
        raise DataFormatError(p, f"could not read as .npz: {_first_line(exc)}") from exc
    if "y" not in arrays:
        raise DataFormatError(p, f"has no array 'y' (found {sorted(arrays)})")
    for k, v in arrays.items():
        if v.dtype.kind not in "biuf":
            raise DataFormatError(p, f"array {k!r} has dtype {v.dtype}; numbers are required")
        if v.ndim == 0:
            raise DataFormatError(p, f"array {k!r} is a scalar; expected one row per example")
    y = torch.as_tensor(arrays.pop("y"), dtype=torch.float32)
    if not arrays:
        raise DataFormatError(p, "has no input arrays besides 'y'")
    if "x" in arrays:
        if len(arrays) > 1:
            extra = sorted(set(arrays) - {"x"})
            raise DataFormatError(
                p, f"has 'x' and also the arrays {extra}, which would be ignored; keep only "
                "'x' and 'y', or drop 'x' to pass every array as a keyword argument"
            )
        return torch.as_tensor(arrays["x"], dtype=torch.float32), y
    inputs = {k: torch.as_tensor(v) for k, v in arrays.items()}
    return {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}, y


def _read_csv(p: Path, targets: list[str] | None
              ) -> tuple[torch.Tensor, torch.Tensor, list[str], list[str]]:
    """CSV part of :func:`read_heldout`: a strict header table (file and line in every error);
    inputs, targets, and the input and target column names."""
    from attnuq.data.readers import read_csv_table

    table = read_csv_table(p)
    cols = list(targets) if targets else [table.header[-1]]
    twice = sorted({c for c in cols if cols.count(c) > 1})
    if twice:
        raise ValueError(f"--target names the columns {twice} more than once")
    missing = [c for c in cols if c not in table.header]
    if missing:
        raise DataFormatError(
            p, f"target columns {missing} not in the header (columns: {list(table.header)})",
            line=table.header_line,
        )
    x_names = [c for c in table.header if c not in cols]
    if not x_names:
        raise DataFormatError(p, f"has no input columns besides the targets {cols}",
                              line=table.header_line)
    yv = table.floats(cols)  # (N, T)
    finite = np.isfinite(yv)
    if not finite.all():
        i, j = (int(a[0]) for a in np.nonzero(~finite))
        kind = "NaN" if np.isnan(yv[i, j]) else "infinite"
        raise DataFormatError(
            p, f"{kind} target value in column {cols[j]!r} ({int((~finite).any(1).sum())} "
            "row(s) with a non-finite target)", line=table.lines[i],
        )
    x = torch.as_tensor(table.floats(x_names), dtype=torch.float32)
    y = torch.as_tensor(yv, dtype=torch.float32)
    return x, (y[:, 0] if y.shape[1] == 1 else y), x_names, cols


def make_output_fn(key: str | None) -> Callable[[Any], torch.Tensor]:
    """Map a model output (tensor, tuple or Hugging Face ``ModelOutput``) to the prediction."""

    def output_fn(out: Any) -> torch.Tensor:
        if isinstance(out, torch.Tensor):
            if key is not None:  # a key the output cannot have: refused, not ignored
                raise ValueError(
                    f"--output-key {key!r} names a field, but the model output is a tensor of "
                    f"shape {tuple(out.shape)} (no fields): drop --output-key"
                )
            return out
        if key is not None:
            try:
                val = out[key]
            except (KeyError, TypeError, IndexError):
                val = getattr(out, key, None)
            if not isinstance(val, torch.Tensor):
                raise ValueError(f"model output has no tensor field {key!r}")
            return val
        values = list(out.values()) if hasattr(out, "values") else list(out)
        for v in values:
            if isinstance(v, torch.Tensor):
                return v
        raise ValueError("model output holds no tensor; pass --output-key")

    return output_fn


def input_batches(inputs: torch.Tensor | dict[str, torch.Tensor], batch_size: int
                  ) -> Iterator[tuple[slice, torch.Tensor | dict[str, torch.Tensor]]]:
    """The consecutive row slices of ``inputs`` (a tensor, or named arrays of one row count),
    ``batch_size`` rows each (the last may be shorter), with the slice they come from."""
    n = len(next(iter(inputs.values()))) if isinstance(inputs, dict) else len(inputs)
    for i in range(0, n, batch_size):
        sl = slice(i, min(i + batch_size, n))
        yield sl, _rows(inputs, sl)


def _batches(
    inputs: torch.Tensor | dict[str, torch.Tensor], y: torch.Tensor, batch_size: int
) -> list[tuple[Any, torch.Tensor]]:
    return [(xb, y[sl]) for sl, xb in input_batches(inputs, batch_size)]


def _probe(model: nn.Module, xb: Any, output_fn: Callable[[Any], torch.Tensor],
           model_path: str, data_path: str) -> None:
    """One plain forward on the first batch ``xb``: a model that cannot take the data fails
    here, before any work.

    Raises ``ValueError`` naming the model, the data file and the model's own error (e.g. a
    wrong number of input features) instead of a traceback from deep inside calibration or
    prediction.
    """
    from attnuq.montecarlo import call_model

    shape = ({k: tuple(v.shape) for k, v in xb.items()} if isinstance(xb, dict)
             else tuple(xb.shape))
    try:
        with torch.no_grad():
            out = call_model(model, xb)
    except Exception as exc:  # the user's model rejecting the user's data is bad input
        raise ValueError(
            f"model {Path(model_path).name} fails on the inputs of {Path(data_path).name} "
            f"(first batch, shape {shape}): {_first_line(exc)}"
        ) from exc
    output_fn(out)  # an output without the asked field (or a key on a tensor): its own message


def _check_csv_only_and_head_options(args: argparse.Namespace, data: str, head: Any) -> None:
    """Refuse options the command would otherwise ignore: ``--target`` names CSV columns (an
    ``.npz`` file's targets are its array ``y``), and ``--pool`` shapes the input of a
    ``--head``."""
    if getattr(args, "target", None) and Path(data).suffix == ".npz":
        raise ValueError(f"--target names CSV columns; {Path(data).name} is .npz (its targets "
                         f"are the array 'y'), got --target {' '.join(args.target)}")
    if getattr(args, "pool", None) is not None and head is None:
        raise ValueError(f"--pool shapes the input of --head; without a head it does nothing, "
                         f"got --pool {args.pool}")


def check_fresh_out(out: Path, overwrite: bool, option: str = "--out") -> None:
    """Refuse an output that already holds something unless ``overwrite`` (a folder with
    files, or an existing file), before any work."""
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{option} {str(out)!r} already holds files; pass --overwrite to "
                         "replace them")
    if out.is_file() and not overwrite:
        raise ValueError(f"{option} {str(out)!r} exists; pass --overwrite to replace it")


def split_val_cal(n: int, cal_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices of the validation and calibration parts: a permutation seeded by ``seed``,
    the last ``round(n * cal_fraction)`` rows to calibration (each part at least 2 rows)."""
    if not 0 < cal_fraction < 1:
        raise ValueError(f"--cal-fraction must lie in (0, 1), got {cal_fraction}")
    n_cal = round(n * cal_fraction)
    if n_cal < 2 or n - n_cal < 2:
        raise ValueError(
            f"the held-out data has {n} rows: with --cal-fraction {cal_fraction} the "
            f"validation and calibration parts need at least 2 rows each"
        )
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return perm[: n - n_cal], perm[n - n_cal:]


def _rows(inputs: torch.Tensor | dict[str, torch.Tensor], idx: torch.Tensor | slice
          ) -> torch.Tensor | dict[str, torch.Tensor]:
    return {k: v[idx] for k, v in inputs.items()} if isinstance(inputs, dict) else inputs[idx]


def _show_warnings(caught: list[Any]) -> None:
    """Print each warning a fit showed as one ``attnuq: warning: ...`` line on stderr."""
    seen: set[str] = set()
    for w in caught:
        msg = " ".join(str(w.message).split())
        if msg not in seen:
            seen.add(msg)
            print(f"attnuq: warning: {msg}", file=sys.stderr)


def calibrate_saved_model(args: argparse.Namespace) -> Path:
    """Run the ``calibrate`` command: fit :class:`attnuq.SARegressor` on the held-out file
    (split into validation and calibration parts) and write ``estimator.json`` (for
    ``attnuq predict``), ``calibration.json`` (the nu search), a plot and a report; returns
    the folder."""
    import warnings

    from attnuq.cli._classify import calibrate_classifier, class_ids, resolve_task_options
    from attnuq.estimators._regressor import SARegressor

    resolve_task_options(args)  # an option of the other task is refused, not ignored
    classify = args.task == "classification"
    if args.n_passes is not None and args.n_passes < 2:
        raise ValueError(f"--n-passes must be at least 2, got {args.n_passes}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be positive, got {args.batch_size}")
    if not 0 <= args.seed < 2**63:
        raise ValueError(f"--seed must be in [0, 2**63), got {args.seed}")
    from attnuq.calibration.layers import check_per_layer

    if not classify:
        check_per_layer(getattr(args, "per_layer", None), args.criterion)  # before any loading
    _check_csv_only_and_head_options(args, args.data, head=getattr(args, "head", None))
    args.pool = args.pool or "mean"
    out = check_out_dir(args.out)  # before any work: a file named as --out fails now
    check_fresh_out(out, getattr(args, "overwrite", False))
    torch.manual_seed(args.seed)
    model = load_saved_model(args.model, args.device)
    held = read_heldout(args.data, args.target)
    inputs, y = held.inputs, held.y
    # predict drops the target columns from a CSV of new inputs and checks the rest
    args.columns = {"target": held.target_columns, "input_columns": held.input_columns,
                    "input_arrays": None if held.input_columns is not None else
                    sorted(inputs) if isinstance(inputs, dict) else ["x"]}
    if classify:
        y = class_ids(y, args.data)
    val_idx, cal_idx = split_val_cal(len(y), args.cal_fraction, args.seed)
    if getattr(args, "head", None) is not None:  # encoder -> pooled embedding -> the user's head
        from attnuq.cli._head import attach_head

        # a regression head's (B, 1) is squeezed to the targets' (B,); a classifier's logits
        # keep their class axis
        model = attach_head(model, args.head, pool=args.pool, field=args.output_key,
                            squeeze=y.dim() == 1 and not classify, device=args.device)
    dev = torch.device(args.device)  # the model is there; so go the data
    inputs = ({k: v.to(dev) for k, v in inputs.items()} if isinstance(inputs, dict)
              else inputs.to(dev))
    y = y.to(dev)
    val = _batches(_rows(inputs, val_idx), y[val_idx], args.batch_size)
    cal = _batches(_rows(inputs, cal_idx), y[cal_idx], args.batch_size)
    # with --head, --output-key names the encoder's field, which the head reads itself
    key = None if getattr(args, "head", None) is not None else args.output_key
    _probe(model, val[0][0], make_output_fn(key), args.model, args.data)
    if classify:
        return calibrate_classifier(args, model, val, cal, make_output_fn(key), len(val_idx),
                                    len(cal_idx), out)
    extra = {} if getattr(args, "per_layer", None) is None else {"per_layer": args.per_layer}
    centres: dict[str, bool | Literal["auto"]] = {"frozen": True, "mean": False, "auto": "auto"}
    recentre = centres[getattr(args, "centre", "frozen")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sa = SARegressor(
            model, make_output_fn(key), criterion=args.criterion,
            n_samples=args.n_passes, seed=args.seed, search=args.search, progress=None,
            recentre=recentre, **extra,
        ).fit(val, cal)
    from attnuq.distributed import is_primary

    if not is_primary():  # under torchrun: every rank has the fit, rank 0 writes it
        return out
    from attnuq.estimators._common import EstimatorWarning

    _show_warnings([w for w in caught if issubclass(w.category, EstimatorWarning)])
    report = sa.report
    d = sa.diagnostics
    with staged_dir(out) as stage:  # out appears only once every file is written
        _write_calibration(stage, sa, args, y, val_idx, cal_idx)
    edge = f" (at the {d['nu_at_edge']} edge of nu_range)" if d["nu_at_edge"] else ""
    print(f"chosen nu = {d['nu'] if d['nu_map'] is None else report.nu}{edge}; form: "
          f"{d['form']} (beta = {d['floor_beta_units']} x the val residual scale); centre: "
          f"{d['centre']}")
    if d["nu_map"] is not None:
        print("nu per layer: " + ", ".join(f"{k or '(root)'}={v}" for k, v in
                                           d["nu_map"].items()))
    print(f"fitted estimator written to {out / 'estimator.json'} "
          f"(attnuq predict MODEL {out / 'estimator.json'} INPUTS --out FILE)")
    return out


def _write_calibration(out: Path, sa: Any, args: argparse.Namespace, y: torch.Tensor,
                       val_idx: torch.Tensor, cal_idx: torch.Tensor) -> None:
    """``estimator.json``, ``calibration.json``, the curve, ``results.json`` and the report of
    a fitted ``calibrate`` run, into ``out``."""
    report = sa.report
    d = sa.diagnostics
    sa.save(out / "estimator.json", metadata={
        "command": "attnuq calibrate", "model": str(Path(args.model).resolve()),
        "data": str(Path(args.data).resolve()), "head": None if args.head is None
        else str(Path(args.head).resolve()), "pool": args.pool, "output_key": args.output_key,
        **args.columns, "cal_fraction": args.cal_fraction,
        "n_val_rows": len(val_idx), "n_cal_rows": len(cal_idx), "squeeze": y.dim() == 1,
    })
    if report is not None:
        atomic_write_text(out / "calibration.json", report.to_json())
    figures = draw_calibration_curve(out, report)
    from attnuq._runtime import run_info
    from attnuq.html_report import render_report

    info = run_info()
    nu_line = d["nu"] if d["nu_map"] is None else None
    results = {
        "title": f"attnuq calibration of {Path(args.model).name}",
        "summary": {
            "chosen nu": nu_line,
            "nu at an edge of its range": d["nu_at_edge"] or "no",
            "criterion": args.criterion,
            "criterion resolved": d["criterion_resolved"],
            "form": d["form"],
            "centre": d["centre"],
            **({"val CRPS by centre": ", ".join(f"{k} {v:.4g}" for k, v in
                                                d["val_crps_by_centre"].items())}
               if "val_crps_by_centre" in d else {}),
            "floor beta (x val residual scale; inf = plain conformal)": d["floor_beta_units"],
            "val Spearman(spread, |error|)": d["spearman_spread_abs_error"],
            "search": args.search,
            "held-out rows": len(y),
            "held-out rows (val / cal)": f"{len(val_idx)} / {len(cal_idx)}",
            "forward passes": None if report is None else report.forward_passes,
            **({"nu per layer": ", ".join(f"{k or '(root)'}={v}" for k, v in
                                          report.nu_map.items()),
                "per-layer ratio r": report.per_layer["ratio"] if report.per_layer else None,
                "shared-nu forward passes": report.per_layer["shared_forward_passes"]
                if report.per_layer else None}
               if report is not None and report.nu_map is not None else {}),
            **({"head": f"{Path(args.head).name} on the {args.pool}-pooled embedding"}
               if getattr(args, "head", None) is not None else {}),
            **({"warnings": " | ".join(d["warnings"])} if d.get("warnings") else {}),
        },
        "tables": [],
        "figures": figures,
        "meta": info,
    }
    atomic_write_json(out / "results.json", results, indent=2)
    render_report(out / "results.json")


def draw_calibration_curve(out: Path, report: Any) -> list[dict[str, str]]:
    """Draw ``out/calibration_curve.png`` (the search's objective against ``nu``) and return
    its entry for ``results.json``'s figures; nothing without a search (``report`` is
    ``None``) or without matplotlib (the extra ``plots``: said on stdout)."""
    try:  # the figure needs the extra `plots`; the report and the JSON do not
        import matplotlib
    except ModuleNotFoundError:
        print("calibration_curve.png not drawn: matplotlib is not installed "
              "(pip install 'attnuq[plots]')")
        return []
    if report is None:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    report.plot(ax=ax)
    fig.tight_layout()
    atomic_savefig(fig, out / "calibration_curve.png", dpi=120)
    plt.close(fig)
    return [{"file": "calibration_curve.png", "caption": "objective against nu"}]


def load_inputs(path: str | Path, drop: list[str] | None = None, *,
                expect: list[str] | None = None, expect_arrays: list[str] | None = None
                ) -> torch.Tensor | dict[str, torch.Tensor]:
    """Inputs for ``attnuq predict``: ``.npz`` (``x``, or every array as a keyword argument;
    an array ``y`` is ignored) or ``.csv`` (every column, except the ``drop`` columns).

    ``expect``: the input columns the model was calibrated on (``attnuq calibrate`` records
    them); a ``.csv`` whose remaining columns differ in names or order is refused, naming
    them, rather than fed to the model column by column. ``expect_arrays``: the input arrays
    of a calibration ``.npz``; an ``.npz`` with other arrays is refused (a model may take a
    missing keyword argument, e.g. an attention mask, and answer for other inputs)."""
    from attnuq.data.readers import read_csv_table

    p = check_input_file(path, "inputs file")
    if p.suffix == ".npz":
        try:
            with p.open("rb") as fh:
                z = np.load(fh, allow_pickle=False)
                if not isinstance(z, np.lib.npyio.NpzFile):
                    raise DataFormatError(p, "holds a single .npy array, not an .npz archive")
                with z:
                    arrays = {k: np.asarray(z[k]) for k in z.files if k != "y"}
        except DataFormatError:
            raise
        except Exception as exc:
            raise DataFormatError(p, f"could not read as .npz: {_first_line(exc)}") from exc
        for k, v in arrays.items():
            if v.dtype.kind not in "biuf" or v.ndim == 0:
                raise DataFormatError(p, f"array {k!r} must be numeric with one row per "
                                         f"example, got dtype {v.dtype}, shape {v.shape}")
            if len(v) == 0:
                raise DataFormatError(p, f"array {k!r} has no rows (shape {v.shape})")
        if not arrays:
            raise DataFormatError(p, "has no input arrays")
        if expect_arrays is not None and sorted(arrays) != sorted(expect_arrays):
            raise DataFormatError(p, f"has the input arrays {sorted(arrays)}, but the "
                                     f"calibration's were {sorted(expect_arrays)}")
        if "x" in arrays:
            if len(arrays) > 1:
                raise DataFormatError(p, f"has 'x' and also {sorted(set(arrays) - {'x'})}")
            return torch.as_tensor(arrays["x"], dtype=torch.float32)
        ts = {k: torch.as_tensor(v) for k, v in arrays.items()}
        ts = {k: v.float() if v.is_floating_point() else v for k, v in ts.items()}
        sizes = {len(v) for v in ts.values()}
        if len(sizes) != 1:
            raise DataFormatError(p, f"input arrays have different row counts {sorted(sizes)}")
        return ts
    if p.suffix == ".csv":
        table = read_csv_table(p)
        cols = [c for c in table.header if c not in (drop or [])]
        if not cols:
            raise DataFormatError(p, "has no input columns", line=table.header_line)
        if expect is not None and cols != list(expect):
            missing = [c for c in expect if c not in cols]
            extra = [c for c in cols if c not in expect]
            why = (f"lacks {missing}" if missing else "") + (
                f"{' and ' if missing else ''}has {extra} besides them" if extra else "")
            raise DataFormatError(
                p, f"input columns {cols} are not the calibration's {list(expect)} (in that "
                f"order): {why or 'the order differs'}", line=table.header_line)
        x = torch.as_tensor(table.floats(cols), dtype=torch.float32)
        if len(x) == 0:
            raise DataFormatError(p, "has no rows")
        return x
    raise ValueError(f"inputs file must end in .npz or .csv, got {p.name!r}")


def predict_saved_model(args: argparse.Namespace) -> Path:
    """Run the ``predict`` command: mean, lower, upper (and samples) of every input row."""
    from attnuq.cli._classify import class_csv, fitted_kind, predict_classes, set_rule_at
    from attnuq.estimators._classifier import SAClassifier
    from attnuq.estimators._common import read_envelope
    from attnuq.estimators._regressor import SARegressor
    from attnuq.predictive import check_level

    try:
        level = check_level(args.level)
    except ValueError:
        raise ValueError(f"--level must lie in (0, 1), got {args.level}") from None
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be positive, got {args.batch_size}")
    out = Path(args.out)
    if out.suffix not in (".npz", ".csv"):
        raise ValueError(f"--out must end in .npz or .csv, got {out.name!r}")
    check_out_file(out)
    check_fresh_out(out, args.overwrite)
    kind = fitted_kind(args.fitted)
    classify = kind == "SAClassifier"
    if classify and args.samples and out.suffix == ".csv":
        raise ValueError("--samples with a .csv --out: a classifier's draws are (S, N, C) "
                         "probabilities; use an .npz --out")
    env = read_envelope(args.fitted, kind, None)
    fitted = env.get("fitted")
    if classify and out.suffix == ".csv" and isinstance(fitted, dict) and fitted.get("tokens"):
        raise ValueError("--out .csv holds one row per input; this classifier predicts per "
                         "token ((N, L, C) probabilities): use an .npz --out")
    meta = env.get("metadata") or {}
    if not isinstance(meta, dict):
        raise ValueError(f"{args.fitted}: field 'metadata' must be a JSON object, got "
                         f"{type(meta).__name__}")
    head = args.head if args.head is not None else meta.get("head")
    _check_csv_only_and_head_options(args, args.input, head=head)
    pool = args.pool if args.pool is not None else meta.get("pool") or "mean"
    key = args.output_key if args.output_key is not None else meta.get("output_key")
    drop = args.target if args.target is not None else meta.get("target")
    model = load_saved_model(args.model, args.device)
    expect = meta.get("input_columns") if args.target is None else None
    inputs = load_inputs(args.input, drop, expect=expect,
                         expect_arrays=meta.get("input_arrays"))
    if head is not None:
        from attnuq.cli._head import attach_head

        model = attach_head(model, head, pool=pool, field=key,
                            squeeze=bool(meta.get("squeeze", not classify)),
                            device=args.device)
    # with a head, the key names the encoder's field, which the head reads itself
    import warnings

    from attnuq.estimators._common import EstimatorWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", EstimatorWarning)
        try:
            est_cls: Any = SAClassifier if classify else SARegressor
            sa = est_cls.load(args.fitted, model,
                              make_output_fn(None if head is not None else key),
                              strict=not args.no_strict, progress=None)
        except ValueError as exc:
            if "pass strict=False" not in str(exc):
                raise
            raise ValueError(str(exc).replace("pass strict=False", "pass --no-strict")) from None
    _show_warnings([w for w in caught if issubclass(w.category, EstimatorWarning)])
    rule = set_rule_at(sa, level) if classify else None
    if classify and rule is None:
        print(f"attnuq: warning: {Path(args.fitted).name} was fitted without a calibration "
              "part: no prediction sets are written", file=sys.stderr)
    dev = torch.device(args.device)
    inputs = ({k: v.to(dev) for k, v in inputs.items()} if isinstance(inputs, dict)
              else inputs.to(dev))
    _, first = next(input_batches(inputs, args.batch_size))
    _probe(sa.model, first, sa.output_fn or (lambda o: o), args.model, args.input)
    res: dict[str, Any]
    if classify:
        res = predict_classes(sa, rule, inputs, args.batch_size, level, args.samples)
        to_csv = class_csv
    else:
        res = _predict_intervals(sa, inputs, args.batch_size, level, args.samples)
        to_csv = _csv
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".npz":
        from attnuq._io import atomic_np_savez

        atomic_np_savez(out, level=np.asarray(level), **res)
    else:
        atomic_write_text(out, to_csv(res))
    return out


def _predict_intervals(sa: Any, inputs: Any, batch_size: int, level: float,
                       samples: bool) -> dict[str, Any]:
    """``mean``, ``lower``, ``upper`` (and ``samples`` ``(S, N, ...)`` when asked) of every
    input row, in batches of ``batch_size``."""
    means, lows, highs, draws = [], [], [], []
    for _, xb in input_batches(inputs, batch_size):
        pred = sa.predict(xb)
        lo, hi = pred.interval(level)
        means.append(pred.mean.cpu())
        lows.append(lo.cpu())
        highs.append(hi.cpu())
        if samples:
            draws.append(pred.samples.cpu())
    res: dict[str, Any] = {"mean": torch.cat(means).numpy(), "lower": torch.cat(lows).numpy(),
                           "upper": torch.cat(highs).numpy()}
    if samples:
        res["samples"] = torch.cat(draws, 1).numpy()
    return res


def _csv(res: dict[str, np.ndarray]) -> str:
    """One row per example: mean, lower, upper (``_k`` suffixes for a vector output), then
    ``sample_s`` columns (scalar outputs only)."""
    n = len(res["mean"])
    cols: list[tuple[str, np.ndarray]] = []
    for name in ("mean", "lower", "upper"):
        a = res[name].reshape(n, -1)
        if a.shape[1] == 1:
            cols.append((name, a[:, 0]))
        else:
            cols += [(f"{name}_{k}", a[:, k]) for k in range(a.shape[1])]
    if "samples" in res:
        smp = res["samples"]
        if smp.reshape(smp.shape[0], n, -1).shape[2] != 1:
            raise ValueError("--samples with a .csv --out needs a scalar output per row; use "
                             ".npz for vector outputs")
        cols += [(f"sample_{s}", smp[s].reshape(n)) for s in range(smp.shape[0])]
    return csv_text(cols)


def csv_text(cols: list[tuple[str, np.ndarray]]) -> str:
    """A CSV table of named columns ``(name, (N,) array)``: a header, then one line per row;
    integer columns as integers, the others as the shortest repr of their float value.

    Examples
    --------
    >>> print(csv_text([("label", np.array([1, 0])), ("p", np.array([0.25, 0.5]))]), end="")
    label,p
    1,0.25
    0,0.5
    """
    cells = [[str(int(v)) for v in a] if a.dtype.kind in "biu" else [repr(float(v)) for v in a]
             for _, a in cols]
    lines = [",".join(c for c, _ in cols)]
    lines += [",".join(row) for row in zip(*cells, strict=True)]
    return "\n".join(lines) + "\n"
