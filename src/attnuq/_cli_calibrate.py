"""``attnuq calibrate``: calibrate ``nu`` for a user's saved model on a CSV or NPZ file."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

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

        cfg = transformers.AutoConfig.from_pretrained(p, local_files_only=True)
        archs = getattr(cfg, "architectures", None) or []
        if not archs or not hasattr(transformers, archs[0]):
            raise ValueError(
                f"config.json in {p} names no known architecture (architectures={archs!r})"
            )
        model = getattr(transformers, archs[0]).from_pretrained(p, local_files_only=True)
    else:
        try:
            model = torch.load(p, map_location=device, weights_only=False)
        except Exception as exc:  # any unpickling failure means a bad input file
            raise ValueError(f"could not load {p} with torch.load: {exc}") from exc
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"{p} holds a {type(model).__name__}, not an nn.Module; save the module itself "
                "with torch.save(model, path)"
            )
    return model.to(device).eval()


def load_heldout(
    path: str | Path, targets: list[str] | None = None
) -> tuple[torch.Tensor | dict[str, torch.Tensor], torch.Tensor]:
    """Read held-out ``(inputs, targets)`` from ``.npz`` or ``.csv``.

    NPZ: ``y`` holds the targets; ``x`` the inputs, or else every other array is passed to the
    model as a keyword argument of that name. CSV: a header row; the ``targets`` columns (default:
    the last column) are the targets, all others the inputs. NaN targets are refused.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data file not found: {p}")
    if p.suffix == ".npz":
        with np.load(p) as z:
            arrays = {k: z[k] for k in z.files}
        if "y" not in arrays:
            raise ValueError(f"{p} has no array 'y' (found {sorted(arrays)})")
        y = torch.as_tensor(arrays.pop("y"), dtype=torch.float32)
        if not arrays:
            raise ValueError(f"{p} has no input arrays besides 'y'")
        inputs: torch.Tensor | dict[str, torch.Tensor]
        if "x" in arrays:
            inputs = torch.as_tensor(arrays["x"], dtype=torch.float32)
        else:
            inputs = {k: torch.as_tensor(v) for k, v in arrays.items()}
            inputs = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}
    elif p.suffix == ".csv":
        with p.open() as fh:
            header = [c.strip() for c in fh.readline().strip().split(",")]
        if not header or header == [""]:
            raise ValueError(f"{p} is empty or has no header row")
        cols = targets or [header[-1]]
        missing = [c for c in cols if c not in header]
        if missing:
            raise ValueError(f"target columns {missing} not in {p} (columns: {header})")
        try:
            table = np.loadtxt(p, delimiter=",", skiprows=1, ndmin=2, dtype=np.float64)
        except ValueError as exc:
            raise ValueError(f"{p}: non-numeric value ({exc})") from exc
        if table.shape[1] != len(header):
            raise ValueError(f"{p}: rows have {table.shape[1]} fields, header has {len(header)}")
        t_idx = [header.index(c) for c in cols]
        x_idx = [i for i in range(len(header)) if i not in t_idx]
        if not x_idx:
            raise ValueError(f"{p} has no input columns besides the targets {cols}")
        inputs = torch.as_tensor(table[:, x_idx], dtype=torch.float32)
        y = torch.as_tensor(table[:, t_idx], dtype=torch.float32)
        if y.shape[1] == 1:
            y = y[:, 0]
    else:
        raise ValueError(f"data file must end in .npz or .csv, got {p.name!r}")
    n = len(y)
    if n == 0:
        raise ValueError(f"{p} holds no rows")
    if bool(torch.isnan(y).any()):
        raise ValueError(f"{p}: {int(torch.isnan(y).sum())} NaN target value(s)")
    sizes = [len(v) for v in (inputs.values() if isinstance(inputs, dict) else [inputs])]
    if any(s != n for s in sizes):
        raise ValueError(f"{p}: inputs have {sizes} rows but targets have {n}")
    return inputs, y


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


def _iter(batches: list[tuple[Any, torch.Tensor]]) -> Iterator[tuple[Any, torch.Tensor]]:
    yield from batches


def calibrate_saved_model(args: argparse.Namespace) -> Path:
    """Run the ``calibrate`` command; returns the report folder."""
    import attnuq

    if args.n_passes < 2:
        raise ValueError(f"--n-passes must be at least 2, got {args.n_passes}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be positive, got {args.batch_size}")
    torch.manual_seed(args.seed)
    model = load_saved_model(args.model, args.device)
    inputs, y = load_heldout(args.data, args.target)
    batches = _batches(inputs, y, args.batch_size)
    report = attnuq.calibrate(
        model,
        batches,
        criterion=args.criterion,
        search=args.search,
        n_passes=args.n_passes,
        output_fn=make_output_fn(args.output_key),
        seed=args.seed,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report.save(out / "calibration.json")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    report.plot(ax=ax)
    fig.tight_layout()
    fig.savefig(out / "calibration_curve.png", dpi=120)
    plt.close(fig)
    from attnuq._runinfo import run_info
    from attnuq.report import render_report

    info = run_info()
    results = {
        "title": f"attnuq calibration of {Path(args.model).name}",
        "summary": {
            "chosen nu": report.nu,
            "criterion": args.criterion,
            "search": args.search,
            "held-out rows": len(y),
            "forward passes": report.forward_passes,
        },
        "tables": [],
        "figures": [{"file": "calibration_curve.png", "caption": "objective against nu"}],
        "meta": info,
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    render_report(out / "results.json")
    print(f"chosen nu = {report.nu}")
    return out
