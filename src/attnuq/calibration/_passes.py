"""The model side of calibration: cache the held-out batches with their frozen outputs, and run
the ``M`` stochastic passes at one ``nu`` into :class:`~attnuq.calibration.criteria.PassStats`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attnuq._validation import check_finite
from attnuq.calibration.criteria import PassStats
from attnuq.montecarlo import (
    CPU_MAX_ACTIVATION,
    Inputs,
    OutputFn,
    batch_size,
    call_model,
    extract,
    on_cpu,
    replicas_per_call,
    stochastic_passes,
    widest_output,
)


@dataclass
class Batch:
    """One held-out batch: its inputs, targets ``(B, ...)`` and frozen prediction ``(B, ...)``."""

    inputs: Inputs
    targets: torch.Tensor  # (B, ...)
    frozen: torch.Tensor  # (B, ...)
    b: int
    widest: int = 0  # elements of the widest module output of the frozen pass (CPU batching cap)


def check_data(data: Iterable[Any]) -> None:
    """``TypeError`` unless ``data`` is an iterable (not a tensor or a string)."""
    if isinstance(data, (torch.Tensor, str, bytes)) or not isinstance(data, Iterable):
        raise TypeError(
            f"data must be an iterable of (inputs, targets) pairs, got {type(data).__name__}"
        )


def check_pair(i: int, item: Any) -> tuple[Inputs, torch.Tensor]:
    """Item ``i`` of the data as ``(inputs, targets)``: a pair, finite non-empty targets."""
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
    return x, y


def prepare(model: nn.Module, data: Iterable[Any], output_fn: OutputFn | None) -> list[Batch]:
    """Read ``data`` once: check every ``(inputs, targets)`` pair and run the frozen pass."""
    check_data(data)
    out: list[Batch] = []
    for i, item in enumerate(data):
        x, y = check_pair(i, item)
        b = batch_size(x)
        raw, widest = widest_output(model, x) if on_cpu(model, x) else (call_model(model, x), 0)
        f = extract(raw, output_fn)
        if f.shape != y.shape:
            raise ValueError(
                f"prediction and targets must have the same shape, got prediction.shape="
                f"{tuple(f.shape)} and targets.shape={tuple(y.shape)} (batch {i})"
            )
        check_finite(f, f"frozen prediction (batch {i})")
        out.append(Batch(inputs=x, targets=y, frozen=f, b=b, widest=widest))
    if not out:
        raise ValueError("data is empty: it yielded no (inputs, targets) batch")
    return out


def residual_scale(batches: list[Batch]) -> float:
    """``s_0 = E_cal |y - f(x)|_2`` (norm over the non-batch dimensions of one example)."""
    return float(
        torch.cat([(bt.targets - bt.frozen).reshape(bt.b, -1).double().norm(dim=-1)
                   for bt in batches]).mean()
    )


def sample(
    model: nn.Module,
    batches: list[Batch],
    nu: int,
    m: int,
    seed: int | None,
    output_fn: OutputFn | None,
    batch_replicas: int | None,
    max_rows: int,
    *,
    nu_spec: Any = None,
) -> PassStats:
    """``m`` stochastic passes at ``nu`` over every batch (seed ``seed * 1000003 + nu``).

    ``nu_spec`` (a per-site mapping, see :func:`attnuq.patch`) is patched instead of ``nu``
    when given; ``nu`` then only keys the seed and names the evaluation in messages.
    """
    from attnuq.patching import stochastic

    dev, resid = [], []
    calls = 0
    s = None if seed is None else seed * 1_000_003 + nu
    spec = nu if nu_spec is None else nu_spec
    with torch.no_grad(), stochastic(model, nu=spec, seed=s) as handle:
        reached = 0
        for ib, bt in enumerate(batches):
            reps = replicas_per_call(bt.b, m, batch_replicas, max_rows)
            if batch_replicas is None and bt.widest:  # on the CPU, as predict's default
                reps = max(1, min(reps, CPU_MAX_ACTIVATION // bt.widest))
            samples, c = stochastic_passes(
                model, bt.inputs, m, output_fn=output_fn, replicas=reps, b=bt.b
            )
            calls += c
            # "reached" from the patch's own call counts, never from output differences
            reached = handle.require_calls(reached, where=f"calibrate (nu={nu}, batch {ib})")
            check_finite(samples, f"stochastic prediction at nu={nu}")
            dev.append((samples - bt.frozen).reshape(m, bt.b, -1).double().cpu())  # (M, B, P)
            resid.append((bt.targets - bt.frozen).reshape(bt.b, -1).double().cpu())  # (B, P)
    return PassStats.from_deviations(dev, resid, calls=calls)
