"""The model side of calibration under a ``torch.distributed`` process group.

The held-out examples are cut into units: each batch ``k`` of the data into chunks of
``chunk_examples`` examples, in data order. Rank ``r`` keeps the inputs of its contiguous block
of units only (:func:`attnuq.distributed.shard`), runs their frozen pass and, at each ``nu``,
their ``M`` stochastic passes, unit ``u`` drawing from a generator seeded by
:func:`attnuq.distributed.unit_seed` ``(seed * 1000003 + nu, u)``. The residuals ``y - f`` and
the deviations ``f_nu - f`` of every unit are gathered to every rank, in unit order, so every
rank builds the same :class:`~attnuq.calibration.criteria.PassStats` (and so the same search and
the same ``nu``) at every world size.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from attnuq import distributed as _dist
from attnuq._validation import check_finite
from attnuq.calibration._passes import check_data, check_pair
from attnuq.calibration.criteria import PassStats
from attnuq.montecarlo import (
    Inputs,
    OutputFn,
    batch_size,
    call_model,
    extract,
    model_digest,
    named_tensors,
    replicas_per_call,
    stochastic_passes,
    take,
)


@dataclass
class Shards:
    """The units of the held-out data: ``units[u] = (batch, slice)``; this rank's inputs and
    frozen outputs (``mine``: unit -> ``(inputs, frozen)``); every unit's residual ``y - f``
    ``(b_u, P)`` float64 (CPU), and the base seed (rank 0's draw when ``seed`` is None)."""

    units: list[tuple[int, slice]]
    mine: dict[int, tuple[Inputs, torch.Tensor]] = field(default_factory=dict)
    resid: list[torch.Tensor] = field(default_factory=list)
    seed: int = 0

    @property
    def n_examples(self) -> int:
        return sum(sl.stop - sl.start for _, sl in self.units)

    def residual_scale(self) -> float:
        """``s_0 = E_cal |y - f(x)|_2`` over every unit (the same on every rank)."""
        return float(torch.cat([r.norm(dim=-1) for r in self.resid]).mean())


def prepare_sharded(
    model: nn.Module,
    data: Iterable[Any],
    output_fn: OutputFn | None,
    *,
    chunk_examples: int,
    seed: int | None,
    settings: dict[str, Any],
) -> Shards:
    """Read ``data`` once (every rank reads all of it), check the ranks agree (model and data
    checksums, ``settings``), run this rank's frozen passes and gather the residuals."""
    check_data(data)
    rank, world = _dist.rank_world()
    batches: list[tuple[Inputs, torch.Tensor, int]] = []
    named: list[tuple[str, torch.Tensor]] = []
    for i, item in enumerate(data):
        x, y = check_pair(i, item)
        b = batch_size(x)
        if y.dim() == 0 or y.shape[0] != b:
            raise ValueError(
                f"targets of batch {i} must have dim 0 = B = {b}, got targets.shape="
                f"{tuple(y.shape)}"
            )
        batches.append((x, y, b))
        named += [(f"{i}.{k}", t) for k, t in named_tensors(x)] + [(f"{i}.y", y)]
    if not batches:
        raise ValueError("data is empty: it yielded no (inputs, targets) batch")
    agreed = _dist.check_same(
        "calibrate",
        {"model": model_digest(model), "inputs": _dist.tensor_digest(named), "seed": seed,
         "chunk_examples": chunk_examples, **settings},
        from_rank0={"drawn": int(torch.randint(0, 1 << 62, (1,)).item()) if seed is None
                    else seed},
    )
    units = [(k, sl) for k, (_, _, b) in enumerate(batches)
             for sl in _dist.chunk_slices(b, chunk_examples)]
    sh = Shards(units=units, seed=int(agreed["drawn"]))
    own = list(_dist.shard(len(units), rank, world))

    def work() -> dict[int, torch.Tensor]:
        out: dict[int, torch.Tensor] = {}
        for u in own:
            k, sl = units[u]
            x, y, b = batches[k]
            xu, yu = take(x, sl, b), y[sl]
            f = extract(call_model(model, xu), output_fn)
            if f.shape != yu.shape:
                raise ValueError(
                    f"prediction and targets must have the same shape, got prediction.shape="
                    f"{tuple(f.shape)} and targets.shape={tuple(yu.shape)} (batch {k}, "
                    f"examples {sl.start}..{sl.stop - 1})"
                )
            check_finite(f, f"frozen prediction (batch {k})")
            sh.mine[u] = (xu, f)
            out[u] = (yu - f).reshape(sl.stop - sl.start, -1).double().cpu()
        return out

    with torch.no_grad():
        got = _dist.phase("calibrate: frozen pass", work)
    resid: dict[int, torch.Tensor] = {}
    for g in got:
        resid.update(g)
    sh.resid = [resid[u] for u in range(len(units))]
    return sh


def sample_sharded(
    model: nn.Module,
    sh: Shards,
    nu: int,
    m: int,
    output_fn: OutputFn | None,
    batch_replicas: int | None,
    max_rows: int,
    *,
    nu_spec: Any = None,
) -> PassStats:
    """``m`` stochastic passes at ``nu`` over this rank's units, every unit's deviations
    gathered (unit ``u`` seeded by ``unit_seed(seed * 1000003 + nu, u)``); ``nu_spec`` (a
    per-site mapping) is patched instead of ``nu`` when given, as in ``_passes.sample``."""
    from attnuq.patching import stochastic

    base = sh.seed * 1_000_003 + nu

    def work() -> tuple[dict[int, torch.Tensor], int]:
        dev: dict[int, torch.Tensor] = {}
        calls = 0
        if not sh.mine:
            return dev, calls
        with stochastic(model, nu=nu if nu_spec is None else nu_spec, seed=0) as handle:
            reached = 0
            for u, (xu, f) in sh.mine.items():
                handle.manual_seed(_dist.unit_seed(base, u))
                bu = int(f.shape[0])
                samples, c = stochastic_passes(
                    model, xu, m, output_fn=output_fn,
                    replicas=replicas_per_call(bu, m, batch_replicas, max_rows), b=bu,
                )
                calls += c
                reached = handle.require_calls(reached, where=f"calibrate (nu={nu}, unit {u})")
                check_finite(samples, f"stochastic prediction at nu={nu}")
                dev[u] = (samples - f).reshape(m, bu, -1).double().cpu()  # (M, b_u, P)
        return dev, calls

    with torch.no_grad():
        got = _dist.phase(f"calibrate: passes at nu={nu}", work)
    dev_all: dict[int, torch.Tensor] = {}
    for d, _ in got:
        dev_all.update(d)
    return PassStats.from_deviations(
        [dev_all[u] for u in range(len(sh.units))], sh.resid, calls=sum(c for _, c in got)
    )
