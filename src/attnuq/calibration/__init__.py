"""Calibrate the number of draws ``nu`` of stochastic attention on held-out data.

``report = attnuq.calibrate(model, data, criterion="paper", search="bo")``; ``report.nu``.

The package, bottom up (each module imports only ones listed before it):

* :mod:`~attnuq.calibration.criteria`: the one registry of criteria (:data:`CRITERIA`,
  :func:`get_criterion`): name, description and the function of the passes' statistics
  (:class:`~attnuq.calibration.criteria.PassStats`) giving the objective, its per-example
  influence and the target scale ``s_*``;
* :mod:`~attnuq.calibration.report`: :class:`Evaluation` and :class:`CalibrationReport` with
  their JSON I/O (plotting is :func:`attnuq.plots.calibration_curve`);
* :mod:`~attnuq.calibration.search`: the searches (:func:`grid_search`, :func:`bo_search`,
  :data:`SEARCHES`) as plain functions of an ``evaluate(nu) -> Evaluation`` callable;
* ``_passes``: the model side -- the frozen pass over the held-out batches and the ``M``
  stochastic passes at one ``nu``;
* :mod:`~attnuq.calibration.layers`: per-layer ``nu`` (``per_layer="geometric"``): the family
  ``nu_l = nu_0 r^(l/(L-1))``, the scale-profiled shape search after the shared one;
* here, :func:`calibrate`: validates the settings, builds ``evaluate`` from the model and the
  data, runs the chosen search (and the per-layer one) and assembles the report.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from attnuq import distributed as _dist
from attnuq._validation import check_positive_int
from attnuq.calibration._passes import prepare, residual_scale, sample
from attnuq.calibration._sharded import Shards, prepare_sharded, sample_sharded
from attnuq.calibration.criteria import (
    CRITERIA,
    CalibrationCriterion,
    Criterion,
    get_criterion,
    summarise,
)
from attnuq.calibration.layers import PER_LAYER, PerLayer, check_per_layer, layer_search, seed_key
from attnuq.calibration.layers import profile as profile_criterion
from attnuq.calibration.report import CalibrationReport, Evaluation
from attnuq.calibration.search import (
    SEARCHES,
    Search,
    SearchResult,
    bo_search,
    check_grid_size,
    check_nu_range,
    check_surrogate_noise,
    grid_search,
    log_grid,
)
from attnuq.montecarlo import OutputFn

__all__ = [
    "CRITERIA",
    "PER_LAYER",
    "SEARCHES",
    "CalibrationCriterion",
    "CalibrationReport",
    "Evaluation",
    "SearchResult",
    "bo_search",
    "calibrate",
    "get_criterion",
    "grid_search",
    "log_grid",
]


def calibrate(
    model: nn.Module,
    data: Iterable[Any],
    *,
    criterion: Criterion = "paper",
    search: Search = "bo",
    n_passes: int = 10,
    nu_range: tuple[int, int] = (1, 1024),
    level: float = 0.9,
    output_fn: OutputFn | None = None,
    seed: int | None = 0,
    grid_size: int = 21,
    max_evals: int = 6,
    surrogate_noise: float = 0.05,
    batch_replicas: int | None = None,
    max_rows: int = 8192,
    progress: bool | None = None,
    per_layer: PerLayer | None = None,
    distributed: bool | None = None,
    chunk_examples: int = 16,
) -> CalibrationReport:
    r"""Choose ``nu`` for :func:`attnuq.stochastic` on held-out ``(inputs, targets)`` pairs.

    See :mod:`attnuq.calibration.criteria` for the exact criteria and the target scales, and
    :mod:`attnuq.calibration.search` for the surrogate and the searches.

    Parameters
    ----------
    model
        Frozen model (``eval()`` mode) with batch-first inputs and output.
    data
        Iterable of ``(inputs, targets)``; ``inputs`` a tensor, tuple of tensors or dict of
        keyword arguments, ``targets`` ``(B, ...)`` of the prediction's shape. It is read once:
        batches and their frozen outputs are cached.
    criterion
        ``"paper"``, ``"scale"``, ``"crps"``, ``"coverage"``, ``"paper-debiased"`` or
        ``"auto"`` (:data:`CRITERIA`). ``"auto"`` is ``"paper-debiased"`` for outputs of fewer
        than 28 elements per example (at ``n_passes=10``), where the paper's ``L_SA`` sits
        measurably below the scale match (0.61 of it for a scalar), and ``"paper"`` above
        (:func:`~attnuq.calibration.criteria.resolve_criterion`). The default stays the paper's.
    search
        ``"bo"`` (surrogate-guided, few evaluations; :func:`bo_search`) or ``"grid"``
        (reference; :func:`grid_search`).
    n_passes
        ``M``, stochastic passes per example and evaluation (``>= 2``).
    nu_range
        Integer search interval ``(lo, hi)``, ``1 <= lo < hi``.
    level
        Central interval level for ``"coverage"`` (also reported for every criterion).
    output_fn
        Maps the model output to the prediction tensor.
    seed
        Seeds the draws: the evaluation at ``nu`` uses ``seed * 1000003 + nu``, so grid and BO
        see the same draws at the same ``nu``. ``None``: fresh draws from the global generator;
        under a process group, rank 0 draws the seed from its global generator and every rank
        uses it, so the ranks agree (the same report as a world of one with rank 0's state).
    grid_size
        Log-spaced points of the grid (duplicates after rounding dropped).
    max_evals
        BO budget of evaluations (default 6: at most a third of the default 20-point grid).
    surrogate_noise
        ``tau``, the misfit sd of the log-linear surrogate (in ``ln s``).
    batch_replicas, max_rows
        Batching of the passes (see :func:`attnuq.predict`; on the CPU, without
        ``batch_replicas``, also predict's default ``max_activation`` cap, measured in the
        frozen pass of each batch).
    progress
        tqdm bar over evaluations (``None``: only on a terminal).
    per_layer
        ``None`` (or ``False``): one ``nu`` shared by every site. ``"geometric"``
        (:data:`PER_LAYER`): after the shared search, a per-layer ``nu_l = nu_0 r^(l/(L-1))``
        over the patchable sites in :func:`attnuq.find_attention` order, searched at most at
        the shared search's cost again (:mod:`attnuq.calibration.layers`); the report's
        ``nu_map`` holds ``{site: nu}`` (``report.nu_spec`` for :func:`attnuq.stochastic`).
        Needs a criterion that ranks shapes (not ``"scale"`` or ``"coverage"``).
    distributed, chunk_examples
        Share the passes across the ranks of the default ``torch.distributed`` process group
        (``None``: when one is initialised; ``False``: never): each batch is cut into units of
        ``chunk_examples`` examples, shared by the ranks, each unit drawing from its own
        generator (:func:`attnuq.distributed.unit_seed`); the statistics are gathered, so every
        rank returns the same report, and the same ``nu`` at every world size. Every rank
        passes the same model, data and settings (checked by checksums). See
        :mod:`attnuq.distributed`.

    Returns
    -------
    CalibrationReport

    Raises
    ------
    ValueError
        Empty data, NaN targets, prediction/target shape mismatch, bad settings.
    RuntimeError
        If the model's forward never calls its patched attention (for some batch; counted by the
        patch itself, :attr:`PatchHandle.calls`), or if it does but the output does not
        change under sampling (every reached attention one-hot, or ``output_fn`` reads an output
        the attention does not affect).

    Examples
    --------
    >>> import torch
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    >>> model = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()
    >>> x = torch.randn(16, 5, 8)
    >>> with torch.no_grad():
    ...     y = model(x) + 0.1 * torch.randn(16, 5, 8)
    >>> report = calibrate(model, [(x, y)], criterion="scale", nu_range=(1, 256))
    >>> 1 <= report.nu <= 256
    True

    Per-layer ``nu`` on two layers (the map covers both sites, at most twice the passes):

    >>> enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    >>> with torch.no_grad():
    ...     y2 = enc(x) + 0.1 * torch.randn(16, 5, 8)
    >>> rep = calibrate(enc, [(x, y2)], nu_range=(1, 256), n_passes=4, per_layer="geometric",
    ...                 progress=False)
    >>> sorted(rep.nu_map), all(1 <= v <= 256 for v in rep.nu_map.values())
    (['layers.0.self_attn', 'layers.1.self_attn'], True)
    >>> rep.forward_passes <= 2 * rep.per_layer["shared_forward_passes"]
    True
    """
    t_start = time.perf_counter()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    get_criterion(criterion)  # ValueError naming the bad value
    if search not in SEARCHES:
        raise ValueError(f"search must be one of {SEARCHES}, got {search=!r}")
    m = check_positive_int(n_passes, "n_passes")
    if m < 2:
        raise ValueError(f"n_passes must be >= 2 (a spread needs two passes), got {n_passes=}")
    lo, hi = check_nu_range(nu_range)
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0 < level < 1:
        raise ValueError(f"level must be a float in (0, 1), got {level=!r}")
    # the search settings are checked again by the search itself; here, before any pass
    check_grid_size(grid_size)
    check_positive_int(max_evals, "max_evals")
    check_surrogate_noise(surrogate_noise)
    family = check_per_layer(per_layer, criterion)
    sites: list[str] = []
    if family is not None:
        from attnuq.patching import find_attention

        sites = [s.name for s in find_attention(model) if s.patchable]
        if not sites:
            raise ValueError(
                f"per_layer={per_layer!r}: {type(model).__name__} has no patchable attention site"
            )
        odd = [n for n in sites if any(c in n for c in "*?[")]
        if odd:  # the map's keys are patterns of attnuq.patch: they must match only themselves
            raise ValueError(f"per_layer needs site names without '*', '?' or '[', got {odd}")
    if model.training:
        warnings.warn(
            "calibrate: model is in training mode; dropout would add noise (call model.eval())",
            stacklevel=2,
        )

    sharded = _dist.is_active(distributed)
    shards: Shards | None = None
    if sharded:
        shards = prepare_sharded(
            model, data, output_fn, seed=seed,
            chunk_examples=check_positive_int(chunk_examples, "chunk_examples"),
            settings={"criterion": criterion, "search": search, "n_passes": m,
                      "nu_range": (lo, hi), "level": level, "grid_size": grid_size,
                      "max_evals": max_evals, "surrogate_noise": surrogate_noise,
                      "batch_replicas": batch_replicas, "max_rows": max_rows,
                      "per_layer": per_layer},
        )
        batches: list[Any] = []
        n_examples, frozen_calls = shards.n_examples, len(shards.units)
        if not _dist.is_primary():
            progress = False  # one bar, on rank 0
    else:
        with torch.no_grad():
            batches = prepare(model, data, output_fn)
        n_examples, frozen_calls = sum(bt.b for bt in batches), len(batches)
    if n_examples < 2:
        raise ValueError(
            f"calibration data has {n_examples} example: the standard errors of the criterion "
            "(and the grid's noise band) need at least 2 examples"
        )
    s0 = shards.residual_scale() if shards is not None else residual_scale(batches)
    if s0 <= 0:
        raise ValueError("the frozen model fits every calibration target exactly (s_0 = 0)")

    profiles: dict[int, tuple[float, float]] = {}  # per-layer search: profile per shared nu

    def passes(nu: int, nu_spec: dict[str, int] | None = None) -> tuple[Evaluation, Any]:
        t0 = time.perf_counter()
        st = (sample_sharded(model, shards, nu, m, output_fn, batch_replicas, max_rows,
                             nu_spec=nu_spec)
              if shards is not None
              else sample(model, batches, nu, m, seed, output_fn, batch_replicas, max_rows,
                          nu_spec=nu_spec))
        if st.max_change == 0.0:
            where = f"nu={nu}" if nu_spec is None else f"nu={nu_spec}"
            raise RuntimeError(
                f"the model output did not change under stochastic attention ({where}, {m} "
                "passes) although its patched attention was called: every reached attention "
                "is one-hot, or output_fn reads an output the attention does not affect"
            )
        sm = summarise(st, criterion, float(level), s0)
        return Evaluation(
            nu=nu, objective=sm.objective, se=sm.se, scale=sm.scale, scale_se=sm.scale_se,
            target_scale=sm.target_scale, values=sm.values, passes=m, model_calls=st.calls,
            seconds=time.perf_counter() - t0, influence=sm.influence,
        ), st

    def evaluate(nu: int) -> Evaluation:
        ev, st = passes(nu)
        if family is not None:
            profiles[nu] = profile_criterion(st, criterion, float(level), s0)
        return ev

    def evaluate_map(nus: list[int], center: int, ratio: float) -> tuple[Evaluation, float, float]:
        key = seed_key(nus)
        ev, st = passes(key, dict(zip(sites, nus, strict=True)))
        ev.nu, ev.nu_map, ev.ratio = center, dict(zip(sites, nus, strict=True)), float(ratio)
        return (ev, *profile_criterion(st, criterion, float(level), s0))

    res: SearchResult
    if search == "grid":
        res = grid_search(evaluate, (lo, hi), grid_size=grid_size, surrogate_noise=surrogate_noise,
                          progress=progress, desc=f"calibrate grid ({criterion})")
    else:
        res = bo_search(evaluate, (lo, hi), max_evals=max_evals, surrogate_noise=surrogate_noise,
                        seed=seed, progress=progress, desc=f"calibrate bo ({criterion})")
    layers = None
    if family is not None:
        layers = layer_search(evaluate_map, sites, res, profiles[res.nu], nu_range=(lo, hi),
                              n_passes=m)
    n_evals = len(res.evaluations) + (0 if layers is None else len(layers.evaluations))
    calls = sum(e.model_calls for e in res.evaluations)
    if layers is not None:
        calls += sum(e.model_calls for e in layers.evaluations)
    return CalibrationReport(
        nu=res.nu,
        criterion=criterion,
        search=search,
        level=float(level),
        n_passes=m,
        nu_range=(lo, hi),
        seed=seed,
        evaluations=res.evaluations,
        residual_scale=s0,
        target_scale=math.exp(res.target_log_scale),
        surrogate=res.surrogate,
        nu_interval=res.nu_interval,
        noise_band=res.noise_band,
        forward_passes=1 + m * n_evals,
        model_calls=frozen_calls + calls,
        wall_time=time.perf_counter() - t_start,
        n_examples=n_examples,
        nu_map=None if layers is None else dict(layers.nu_map),
        per_layer=None if layers is None else layers.info,
        layer_evaluations=None if layers is None else layers.evaluations,
    )
