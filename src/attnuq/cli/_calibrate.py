"""``attnuq calibrate``: calibrate ``nu`` for a user's saved model on a CSV or NPZ file."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from attnuq._io import atomic_savefig, atomic_write_json, atomic_write_text, check_out_dir
from attnuq.calibration import calibrate
from attnuq.data import DataFormatError

__all__ = ["calibrate_saved_model", "load_heldout", "load_saved_model", "make_output_fn"]


def load_saved_model(path: str | Path, device: str = "cpu") -> nn.Module:
    """Load a Hugging Face model folder or a ``torch.save``-d ``nn.Module``, in eval mode.

    A folder must hold ``config.json``; its class is the first entry of ``config.architectures``
    (e.g. ``PatchTSTForPrediction``), read with ``from_pretrained`` from the local folder only.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model not found: {p}")
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


def load_heldout(
    path: str | Path, targets: list[str] | None = None
) -> tuple[torch.Tensor | dict[str, torch.Tensor], torch.Tensor]:
    """Read held-out ``(inputs, targets)`` from ``.npz`` or ``.csv``.

    NPZ: ``y`` holds the targets; ``x`` the inputs, or else every other array is passed to the
    model as a keyword argument of that name (with ``x`` present no other array is allowed, as
    it would be ignored). CSV: a header row of distinct, non-numeric column names; the
    ``targets`` columns (default: the last column) are the targets, all others the inputs.

    Raises
    ------
    FileNotFoundError
        No such file.
    attnuq.data.DataFormatError
        Malformed content (a ``ValueError`` naming the file and, for a CSV, the line): duplicate
        or missing header, a file without data rows, ragged or non-numeric rows, NaN/inf
        targets, non-numeric or scalar arrays, row counts that disagree.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data file not found: {p}")
    if p.suffix == ".npz":
        inputs, y = _read_npz(p)
    elif p.suffix == ".csv":
        inputs, y = _read_csv(p, targets)
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
    return inputs, y


def _read_npz(p: Path) -> tuple[torch.Tensor | dict[str, torch.Tensor], torch.Tensor]:
    """NPZ part of :func:`load_heldout`: numeric arrays of at least one axis, ``y`` required."""
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


def _read_csv(p: Path, targets: list[str] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """CSV part of :func:`load_heldout`: a strict header table (file and line in every error)."""
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
    return x, (y[:, 0] if y.shape[1] == 1 else y)


def make_output_fn(key: str | None) -> Callable[[Any], torch.Tensor]:
    """Map a model output (tensor, tuple or Hugging Face ``ModelOutput``) to the prediction."""

    def output_fn(out: Any) -> torch.Tensor:
        if isinstance(out, torch.Tensor):
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


def _batches(
    inputs: torch.Tensor | dict[str, torch.Tensor], y: torch.Tensor, batch_size: int
) -> list[tuple[Any, torch.Tensor]]:
    n = len(y)
    out: list[tuple[Any, torch.Tensor]] = []
    for i in range(0, n, batch_size):
        sl = slice(i, min(i + batch_size, n))
        xb = {k: v[sl] for k, v in inputs.items()} if isinstance(inputs, dict) else inputs[sl]
        out.append((xb, y[sl]))
    return out


def _probe(model: nn.Module, batch: tuple[Any, torch.Tensor],
           output_fn: Callable[[Any], torch.Tensor], args: argparse.Namespace) -> None:
    """One plain forward on the first batch: a model that cannot take the data fails here.

    Raises ``ValueError`` naming the model, the data file and the model's own error (e.g. a
    wrong number of input features) instead of a traceback from deep inside calibration.
    """
    from attnuq.montecarlo import call_model

    xb, _ = batch
    shape = ({k: tuple(v.shape) for k, v in xb.items()} if isinstance(xb, dict)
             else tuple(xb.shape))
    try:
        with torch.no_grad():
            output_fn(call_model(model, xb))
    except Exception as exc:  # the user's model rejecting the user's data is bad input
        raise ValueError(
            f"model {Path(args.model).name} fails on the inputs of {Path(args.data).name} "
            f"(first batch, shape {shape}): {_first_line(exc)}"
        ) from exc


def calibrate_saved_model(args: argparse.Namespace) -> Path:
    """Run the ``calibrate`` command; returns the report folder."""
    if args.n_passes < 2:
        raise ValueError(f"--n-passes must be at least 2, got {args.n_passes}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be positive, got {args.batch_size}")
    from attnuq.calibration.layers import check_per_layer

    check_per_layer(getattr(args, "per_layer", None), args.criterion)  # before loading anything
    out = check_out_dir(args.out)  # before any work: a file named as --out fails now
    torch.manual_seed(args.seed)
    model = load_saved_model(args.model, args.device)
    inputs, y = load_heldout(args.data, args.target)
    if getattr(args, "head", None) is not None:  # encoder -> pooled embedding -> the user's head
        from attnuq.cli._head import attach_head

        model = attach_head(model, args.head, pool=args.pool, field=args.output_key,
                            squeeze=y.dim() == 1, device=args.device)
    dev = torch.device(args.device)  # the model is there; so go the data
    inputs = ({k: v.to(dev) for k, v in inputs.items()} if isinstance(inputs, dict)
              else inputs.to(dev))
    batches = _batches(inputs, y.to(dev), args.batch_size)
    _probe(model, batches[0], make_output_fn(args.output_key), args)
    report = calibrate(
        model,
        batches,
        criterion=args.criterion,
        search=args.search,
        n_passes=args.n_passes,
        output_fn=make_output_fn(args.output_key),
        seed=args.seed,
        per_layer=getattr(args, "per_layer", None),
    )
    from attnuq.distributed import is_primary

    if not is_primary():  # under torchrun: every rank has the report, rank 0 writes it
        return out
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "calibration.json", report.to_json())
    figures = []
    try:  # the figure needs the extra `plots`; the report and the JSON do not
        import matplotlib
    except ModuleNotFoundError:
        print("calibration_curve.png not drawn: matplotlib is not installed "
              "(pip install 'attnuq[plots]')")
    else:
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        report.plot(ax=ax)
        fig.tight_layout()
        atomic_savefig(fig, out / "calibration_curve.png", dpi=120)
        plt.close(fig)
        figures.append({"file": "calibration_curve.png", "caption": "objective against nu"})
    from attnuq._runtime import run_info
    from attnuq.html_report import render_report

    info = run_info()
    results = {
        "title": f"attnuq calibration of {Path(args.model).name}",
        "summary": {
            "chosen nu": report.nu,
            "criterion": args.criterion,
            "search": args.search,
            "held-out rows": len(y),
            "forward passes": report.forward_passes,
            **({"nu per layer": ", ".join(f"{k or '(root)'}={v}" for k, v in
                                          report.nu_map.items()),
                "per-layer ratio r": report.per_layer["ratio"] if report.per_layer else None,
                "shared-nu forward passes": report.per_layer["shared_forward_passes"]
                if report.per_layer else None}
               if report.nu_map is not None else {}),
            **({"head": f"{Path(args.head).name} on the {args.pool}-pooled embedding"}
               if getattr(args, "head", None) is not None else {}),
        },
        "tables": [],
        "figures": figures,
        "meta": info,
    }
    atomic_write_json(out / "results.json", results, indent=2)
    render_report(out / "results.json")
    print(f"chosen nu = {report.nu}")
    if report.nu_map is not None:
        print("nu per layer: " + ", ".join(f"{k or '(root)'}={v}" for k, v in
                                           report.nu_map.items()))
    return out
