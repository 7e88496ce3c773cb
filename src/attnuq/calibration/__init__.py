"""Calibrate the number of draws ``nu`` of stochastic attention on held-out data.

``report = attnuq.calibrate(model, data)`` (criterion ``"auto"``, search ``"bo"``); ``report.nu``.

For calibrated intervals from a frozen model in three lines, use the estimator
:class:`attnuq.SARegressor` (which runs this search and a conformal step).

The package, bottom up (each module imports only ones listed before it):

* :mod:`~attnuq.calibration.criteria`: the one registry of criteria (:data:`CRITERIA`,
  :func:`get_criterion`): name, description and the function of the passes' statistics
  (:class:`~attnuq.calibration.criteria.PassStats`) giving the objective, its per-example
  influence and the target scale ``s_*``;
* :mod:`~attnuq.calibration.report`: :class:`Evaluation` and :class:`CalibrationReport` with
  their JSON I/O (plotting is :func:`attnuq.plots.calibration_curve`);
* :mod:`~attnuq.calibration.search`: the searches (:func:`grid_search`, :func:`bo_search`,
  :data:`SEARCHES`) as plain functions of an ``evaluate(nu) -> Evaluation`` callable;
* ``_passes``, ``_sharded``: the model side -- the checks of the held-out data, the frozen
  pass over its units and the ``M`` stochastic passes at one ``nu`` (the same units, seeds and
  numbers with and without a process group);
* :mod:`~attnuq.calibration.layers`: per-layer ``nu`` (``per_layer="geometric"``): the family
  ``nu_l = nu_0 r^(l/(L-1))``, the scale-profiled shape search after the shared one;
* here, :func:`calibrate`: validates the settings, builds ``evaluate`` from the model and the
  data, runs the chosen search (and the per-layer one) and assembles the report.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from attnuq import distributed as _dist
from attnuq._validation import check_module, check_positive_int, check_seed
from attnuq.calibration._sharded import Shards, prepare_sharded, sample_sharded
from attnuq.calibration.criteria import (
    CLASSIFICATION_CRITERIA,
    CRITERIA,
    CalibrationCriterion,
    ClassificationCriterion,
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
    "CLASSIFICATION_CRITERIA",
    "CRITERIA",
    "PER_LAYER",
    "SEARCHES",
    "CalibrationCriterion",
    "CalibrationReport",
    "EdgeWarning",
    "Evaluation",
    "SearchResult",
    "bo_search",
    "calibrate",
    "check_calibrate_kwargs",
    "check_calibrate_settings",
    "edge_info",
    "edge_message",
    "get_criterion",
    "grid_search",
    "log_grid",
]


def calibrate(
    model: nn.Module,
    data: Iterable[Any],
    *,
    criterion: Criterion | ClassificationCriterion = "auto",
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
    nu_tol: float = 0.0,
    ignore_index: int | None = -100,
    _observe: Callable[[Any, Any], None] | None = None,
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
        batches and their frozen outputs are cached, in units of ``chunk_examples`` examples.
    criterion
        ``"paper"``, ``"scale"``, ``"crps"``, ``"coverage"``, ``"paper-debiased"`` or
        ``"auto"`` (:data:`CRITERIA`). ``"auto"`` is ``"paper-debiased"`` for outputs of fewer
        than 28 elements per example (at ``n_passes=10``), where the paper's ``L_SA`` sits
        measurably below the scale match (0.61 of it for a scalar), and ``"paper"`` above
        (:func:`~attnuq.calibration.criteria.resolve_criterion`). The default is ``"auto"``
        (the recommended criterion; it was ``"paper"`` before 0.2, see CHANGELOG.md).
        For a classifier, ``"nll"`` or ``"nll-temperature"`` (:data:`CLASSIFICATION_CRITERIA`):
        ``targets`` are then integer class ids ``(B,)`` (or ``(B, L)`` per token, ``-100``
        left out) and the prediction logits ``(B, C)``, ``(B,)`` / ``(B, 1)`` binary, or
        ``(B, L, C)``; not with ``per_layer`` or ``distributed``.
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
        Seeds the draws, ``0 <= seed < 2**63``: the evaluation at ``nu`` seeds unit ``u`` with
        :func:`attnuq.distributed.unit_seed` ``(seed * 1000003 + nu, u)``, so grid and BO see
        the same draws at the same ``nu``, with or without a process group. ``None``: the seed
        is drawn once from torch's global generator (under a process group, rank 0's, used by
        every rank: the same report as one process with rank 0's state).
    grid_size
        Log-spaced points of the grid (duplicates after rounding dropped).
    max_evals
        BO budget of evaluations (default 6: at most a third of the default 20-point grid).
    surrogate_noise
        ``tau``, the misfit sd of the log-linear surrogate (in ``ln s``).
    batch_replicas, max_rows
        Batching of the passes inside a unit (see :func:`attnuq.predict`; on the CPU, without
        ``batch_replicas``, also predict's default ``max_activation`` cap, measured in the
        frozen pass of each unit).
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
        Each batch is cut into units of ``chunk_examples`` examples, each unit drawing from its
        own generator (:func:`attnuq.distributed.unit_seed`). ``distributed`` shares the units
        across the ranks of the default ``torch.distributed`` process group (``None``: when one
        is initialised; ``False``: never); the statistics are gathered, so every rank returns
        the same report, the one a single process computes, at every world size. Every rank
        passes the same model, data and settings (checked by checksums). See
        :mod:`attnuq.distributed`.

    ignore_index
        Classification criteria only: the target value left out (``None``: none).
    nu_tol
        BO only: also stop when the next ``nu`` the surrogate proposes lies within a factor
        ``1 + nu_tol`` of one already evaluated (``0``: only when it equals one; see
        :func:`bo_search`).

    Returns
    -------
    CalibrationReport
        When the chosen ``nu`` is an end of ``nu_range``, ``report.edge`` says which, with SA's
        spread there and the criterion's target scale, and an :class:`EdgeWarning` is shown
        (at the lower end SA's largest spread falls short of the error scale; at the upper end
        its smallest spread exceeds it).

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
    check_module(model)
    checked = check_calibrate_settings(
        criterion=criterion, search=search, n_passes=n_passes, nu_range=nu_range, level=level,
        output_fn=output_fn, seed=seed, grid_size=grid_size, max_evals=max_evals,
        surrogate_noise=surrogate_noise, batch_replicas=batch_replicas, max_rows=max_rows,
        progress=progress, per_layer=per_layer, distributed=distributed,
        chunk_examples=chunk_examples, nu_tol=nu_tol, ignore_index=ignore_index)
    m, (lo, hi), seed = checked["n_passes"], checked["nu_range"], checked["seed"]
    chunk_examples, classify = checked["chunk_examples"], checked["classify"]
    family = checked["per_layer_family"]
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
    if classify and sharded:
        raise ValueError(f"criterion={criterion!r} (classification) does not run distributed; "
                         "pass distributed=False")
    shards: Shards | None = None
    batches: list[Any] = []
    if classify:
        from attnuq.calibration._classify import prepare_classes

        with torch.no_grad():
            cbatches = prepare_classes(model, data, output_fn, ignore_index=ignore_index)
        batches = list(cbatches)
        n_examples = sum(0 if cb.labels is None else int(cb.labels.numel()) for cb in cbatches)
        frozen_calls = len(batches)
    else:
        shards = prepare_sharded(
            model, data, output_fn, seed=seed, chunk_examples=chunk_examples, active=sharded,
            n_passes=m,
            settings={"criterion": criterion, "search": search, "n_passes": m,
                      "nu_range": (lo, hi), "level": level, "grid_size": grid_size,
                      "max_evals": max_evals, "surrogate_noise": surrogate_noise,
                      "batch_replicas": batch_replicas, "max_rows": max_rows,
                      "per_layer": per_layer},
        )
        n_examples, frozen_calls = shards.n_examples, len(shards.units)
        if _observe is not None:  # private hook (attnuq.SARegressor): the frozen units
            _observe("shards", shards)
        if sharded and not _dist.is_primary():
            progress = False  # one bar, on rank 0
    if n_examples < 2:
        raise ValueError(
            f"calibration data has {n_examples} example: the standard errors of the criterion "
            "(and the grid's noise band) need at least 2 examples"
        )
    if classify:
        from attnuq.calibration._classify import class_residual_scale, sample_classes

        s0 = class_residual_scale(batches)
    else:
        assert shards is not None
        s0 = shards.residual_scale()
    if s0 <= 0:
        raise ValueError("the frozen model fits every calibration target exactly (s_0 = 0)")

    profiles: dict[int, tuple[float, float]] = {}  # per-layer search: profile per shared nu

    def passes(nu: int, nu_spec: dict[str, int] | None = None) -> tuple[Evaluation, Any]:
        t0 = time.perf_counter()
        if classify:
            st = sample_classes(model, batches, nu, m, seed, output_fn, batch_replicas, max_rows)
        else:
            assert shards is not None
            st = sample_sharded(model, shards, nu, m, output_fn, batch_replicas, max_rows,
                                nu_spec=nu_spec)
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
        if _observe is not None:  # ... and the passes at each evaluated nu
            _observe(nu, st)
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
                        seed=seed, progress=progress, desc=f"calibrate bo ({criterion})",
                        nu_tol=float(nu_tol))
    layers = None
    if family is not None:
        layers = layer_search(evaluate_map, sites, res, profiles[res.nu], nu_range=(lo, hi),
                              n_passes=m)
    n_evals = len(res.evaluations) + (0 if layers is None else len(layers.evaluations))
    calls = sum(e.model_calls for e in res.evaluations)
    if layers is not None:
        calls += sum(e.model_calls for e in layers.evaluations)
    edge = edge_info(res.nu, (lo, hi), res.evaluations)
    if edge is not None:
        warnings.warn(edge_message(edge, criterion), EdgeWarning, stacklevel=2)
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
        edge=edge,
    )



def check_calibrate_settings(
    *,
    criterion: object = "auto",
    search: object = "bo",
    n_passes: object = 10,
    nu_range: object = (1, 1024),
    level: object = 0.9,
    output_fn: object = None,
    seed: object = 0,
    grid_size: object = 21,
    max_evals: object = 6,
    surrogate_noise: object = 0.05,
    batch_replicas: object = None,
    max_rows: object = 8192,
    progress: object = None,
    per_layer: object = None,
    distributed: object = None,
    chunk_examples: object = 16,
    nu_tol: object = 0.0,
    ignore_index: object = -100,
) -> dict[str, Any]:
    """Check every setting of :func:`calibrate` that does not need the model or the data
    (the same names and defaults), before any pass; raise naming the first bad one.

    Returns the normalised values :func:`calibrate` goes on with: ``n_passes``, ``nu_range``
    ``(lo, hi)``, ``seed``, ``chunk_examples``, ``classify`` (the criterion's task is
    classification) and ``per_layer_family``. The estimators call it when they are built, so
    that a bad ``calibrate_kwargs`` value fails there and not at ``fit``.

    Examples
    --------
    >>> check_calibrate_settings(max_evals=3)["nu_range"]
    (1, 1024)
    >>> check_calibrate_settings(max_evals=0)
    Traceback (most recent call last):
    ...
    ValueError: max_evals must be a positive int, got max_evals=0
    """
    get_criterion(criterion)  # type: ignore[arg-type]  # ValueError naming the bad value
    if search not in SEARCHES:
        raise ValueError(f"search must be one of {SEARCHES}, got {search=!r}")
    m = check_positive_int(n_passes, "n_passes")
    if m < 2:
        raise ValueError(f"n_passes must be >= 2 (a spread needs two passes), got {n_passes=}")
    lo, hi = check_nu_range(nu_range)  # type: ignore[arg-type]
    seed = check_seed(seed)
    if batch_replicas is not None:
        check_positive_int(batch_replicas, "batch_replicas")
    check_positive_int(max_rows, "max_rows")
    chunk_examples = check_positive_int(chunk_examples, "chunk_examples")
    if output_fn is not None and not callable(output_fn):
        raise TypeError(f"output_fn must be callable or None, got {output_fn=!r}")
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0 < level < 1:
        raise ValueError(f"level must be a float in (0, 1), got {level=!r}")
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress must be a bool or None, got {progress=!r}")
    if distributed is not None and not isinstance(distributed, bool):
        raise TypeError(f"distributed must be a bool or None, got {distributed=!r}")
    if ignore_index is not None and (isinstance(ignore_index, bool)
                                     or not isinstance(ignore_index, int)):
        raise TypeError(f"ignore_index must be an int or None, got {ignore_index=!r}")
    # the search settings are checked again by the search itself; here, before any pass
    check_grid_size(grid_size)
    check_positive_int(max_evals, "max_evals")
    check_surrogate_noise(surrogate_noise)  # type: ignore[arg-type]
    if isinstance(nu_tol, bool) or not isinstance(nu_tol, (int, float)) or not nu_tol >= 0:
        raise ValueError(f"nu_tol must be a float >= 0, got {nu_tol=!r}")
    classify = get_criterion(criterion).task == "classification"  # type: ignore[arg-type]
    if classify and per_layer not in (None, False):
        raise ValueError(f"per_layer={per_layer!r} is not available with the classification "
                         f"criterion={criterion!r}")
    family = check_per_layer(per_layer, criterion)  # type: ignore[arg-type]
    return {"n_passes": m, "nu_range": (lo, hi), "seed": seed, "chunk_examples": chunk_examples,
            "classify": classify, "per_layer_family": family}


def check_calibrate_kwargs(owner: str, kwargs: dict[str, Any], reserved: Iterable[str],
                           **fixed: Any) -> None:
    """Check an estimator's ``**calibrate_kwargs`` when it is built: every name a setting of
    :func:`calibrate` that ``owner`` does not set itself (``reserved``), and every value with
    ``fixed`` (the estimator's own settings) by :func:`check_calibrate_settings`.

    Examples
    --------
    >>> check_calibrate_kwargs(  # doctest: +ELLIPSIS
    ...     "SARegressor", {"max_rowz": 1}, reserved=("seed",))
    Traceback (most recent call last):
    ...
    TypeError: SARegressor got unknown calibrate_kwargs ['max_rowz']; calibrate takes ...
    """
    import inspect

    taken = set(reserved)
    allowed = [n for n in inspect.signature(calibrate).parameters
               if n not in ("model", "data") and not n.startswith("_") and n not in taken]
    bad_reserved = sorted(set(kwargs) & taken)
    if bad_reserved:
        raise TypeError(f"set {bad_reserved} as {owner} arguments, not as calibrate_kwargs")
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise TypeError(f"{owner} got unknown calibrate_kwargs {unknown}; calibrate takes "
                        f"{sorted(allowed)}")
    check_calibrate_settings(**{**fixed, **kwargs})

class EdgeWarning(UserWarning):
    """The chosen ``nu`` is an end of ``nu_range``: no ``nu`` in the range matched the
    criterion's target scale (see :func:`edge_info`).

    Examples
    --------
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warnings.warn("nu = 1 sits at the lower edge", EdgeWarning)
    >>> caught[0].category.__name__
    'EdgeWarning'
    """


def edge_info(nu: int, nu_range: tuple[int, int], evaluations: list[Evaluation]
              ) -> dict[str, Any] | None:
    """``None`` unless ``nu`` is an end of ``nu_range``; then ``{"side": "lower" | "upper",
    "nu", "nu_range", "spread", "target_scale"}`` with SA's spread ``s(nu)`` at that end and
    the target scale ``s_*`` estimated there (the same evaluation).

    At the lower end ``s(lo)`` is the largest spread SA reaches in the range (fewer draws,
    more noise); at the upper end ``s(hi)`` is the smallest.

    Examples
    --------
    >>> from attnuq.calibration.search import _demo_evaluate
    >>> edge_info(1, (1, 64), [_demo_evaluate(1)])["side"]
    'lower'
    >>> edge_info(16, (1, 64), [_demo_evaluate(16)]) is None
    True
    """
    lo, hi = nu_range
    if nu not in (lo, hi):
        return None
    ev = next((e for e in evaluations if e.nu == nu), None)
    spread = float("nan") if ev is None else float(ev.scale)
    target = float("nan") if ev is None else float(ev.target_scale)
    return {"side": "lower" if nu == lo else "upper", "nu": int(nu), "nu_range": [lo, hi],
            "spread": spread, "target_scale": target}


def edge_message(edge: dict[str, Any], criterion: str) -> str:
    """One sentence for :func:`edge_info`'s record, naming both numbers.

    Examples
    --------
    >>> print(edge_message({"side": "lower", "nu": 1, "nu_range": [1, 1024], "spread": 1.9,
    ...                     "target_scale": 563.0}, "auto"))  # doctest: +ELLIPSIS
    calibrate: nu = 1 sits at the lower edge of nu_range=(1, 1024): SA's largest spread s(1) ...
    """
    lo, hi = edge["nu_range"]
    s, t = edge["spread"], edge["target_scale"]
    classify = get_criterion(criterion).task == "classification"
    if edge["side"] == "lower":
        what = (f"SA's largest spread s({edge['nu']}) = {s:.4g} against the target scale "
                f"{t:.4g} of criterion {criterion!r}")
        why = ("the NLL asks for more spread than SA gives" if classify and s < t else
               "SA's spread cannot reach the error scale: its raw intervals under-cover (a "
               "conformal step, as in attnuq.SARegressor, is needed)" if s < t else
               "the criterion's minimum lies at the range's end")
    else:
        what = (f"SA's smallest spread s({edge['nu']}) = {s:.4g} against the target scale "
                f"{t:.4g} of criterion {criterion!r}")
        why = ("the NLL prefers less spread than SA's smallest: SA adds little beyond the "
               "frozen model" if classify and s > t else
               "even the most draws leave SA's spread above the error scale: widen nu_range "
               "upwards" if s > t else "the criterion's minimum lies at the range's end")
    return (f"calibrate: nu = {edge['nu']} sits at the {edge['side']} edge of "
            f"nu_range=({lo}, {hi}): {what}; {why}")
