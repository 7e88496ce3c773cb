"""The model side of calibration for classifiers: cache the held-out batches with their frozen
logits and labels, and run the ``M`` stochastic passes at one ``nu`` into
:class:`~attnuq.calibration.criteria.PassStats` whose ``dev`` are logit deviations ``(M, N, C)``
over the ``N`` labelled rows (examples, or tokens of a language model)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attnuq._validation import check_finite
from attnuq.calibration._passes import check_data
from attnuq.calibration.criteria import PassStats
from attnuq.categorical import class_logits, labelled_rows
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
class ClassBatch:
    """A held-out batch of a classifier: its inputs, targets ``(B, [L])``, ``frozen`` the
    canonical logits ``(B, [L,] C)``, ``b`` its examples, ``widest`` the elements of the widest
    module output of its frozen pass (the CPU batching cap), ``mask`` ``(B, [L])`` the labelled
    positions, ``labels`` ``(N,)`` their class ids and ``rows`` ``(N, C)`` their frozen logits
    (float64, CPU)."""

    inputs: Inputs
    targets: torch.Tensor
    frozen: torch.Tensor
    b: int
    widest: int = 0
    mask: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    rows: torch.Tensor | None = None


def prepare_classes(
    model: nn.Module, data: Iterable[Any], output_fn: OutputFn | None, *,
    ignore_index: int | None = -100,
) -> list[ClassBatch]:
    """Read ``data`` once: check every ``(inputs, labels)`` pair and run the frozen pass."""
    check_data(data)
    out: list[ClassBatch] = []
    n_classes: int | None = None
    for i, item in enumerate(data):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(
                f"data must yield (inputs, targets) pairs, got item {i} of type "
                f"{type(item).__name__}"
            )
        x, y = item
        b = batch_size(x)
        raw, widest = widest_output(model, x) if on_cpu(model, x) else (call_model(model, x), 0)
        f = extract(raw, output_fn)
        check_finite(f, f"frozen logits (batch {i})")
        z, mask, labels = labelled_rows(f, y, ignore_index=ignore_index, n_classes=n_classes,
                                        name=f"targets (batch {i})")
        n_classes = int(z.shape[-1])
        rows = z[mask].double().cpu()
        out.append(ClassBatch(inputs=x, targets=y, frozen=z, b=b, widest=widest, mask=mask,
                              labels=labels.cpu(), rows=rows))
    if not out:
        raise ValueError("data is empty: it yielded no (inputs, targets) batch")
    if not any(bt.labels is not None and bt.labels.numel() for bt in out):
        raise ValueError(f"every target of data equals ignore_index={ignore_index}: no label "
                         f"in {len(out)} batch(es)")
    return out


def onehot_resid(bt: ClassBatch) -> torch.Tensor:
    """``onehot(y) - softmax(f)`` ``(N, C)`` float64 of one batch."""
    assert bt.rows is not None and bt.labels is not None
    oh = torch.nn.functional.one_hot(bt.labels, bt.rows.shape[-1]).double()
    return oh - bt.rows.softmax(-1)


def class_residual_scale(batches: list[ClassBatch]) -> float:
    """``s_0 = E |onehot(y) - softmax(f)|_2`` over the labelled rows."""
    return float(torch.cat([onehot_resid(bt).norm(dim=-1) for bt in batches]).mean())


def sample_classes(
    model: nn.Module,
    batches: list[ClassBatch],
    nu: int,
    m: int,
    seed: int | None,
    output_fn: OutputFn | None,
    batch_replicas: int | None,
    max_rows: int,
) -> PassStats:
    """``m`` stochastic passes at ``nu`` over every batch (seed ``seed * 1000003 + nu``, as
    for regression)."""
    from attnuq.patching import stochastic

    dev, resid, logits, labels = [], [], [], []
    calls = 0
    s = None if seed is None else seed * 1_000_003 + nu
    with torch.no_grad(), stochastic(model, nu=nu, seed=s) as handle:
        reached = 0
        for ib, bt in enumerate(batches):
            assert bt.mask is not None and bt.rows is not None and bt.labels is not None
            reps = replicas_per_call(bt.b, m, batch_replicas, max_rows)
            if batch_replicas is None and bt.widest:
                reps = max(1, min(reps, CPU_MAX_ACTIVATION // bt.widest))
            raw, c = stochastic_passes(model, bt.inputs, m, output_fn=output_fn, replicas=reps,
                                       b=bt.b)
            calls += c
            reached = handle.require_calls(reached, where=f"calibrate (nu={nu}, batch {ib})")
            check_finite(raw, f"stochastic logits at nu={nu}")
            z = class_logits(raw.reshape(m * bt.b, *raw.shape[2:]))
            z = z.reshape(m, bt.b, *z.shape[1:])  # (M, B, [L,] C)
            rows = z[:, bt.mask].double().cpu()  # (M, N, C)
            dev.append(rows - bt.rows)
            resid.append(onehot_resid(bt))
            logits.append(bt.rows)
            labels.append(bt.labels)
    return PassStats.from_deviations(dev, resid, calls=calls, logits=logits, labels=labels)
