r"""Per-layer ``nu``: a calibrated number of draws for each attention site.

``report = attnuq.calibrate(model, data, per_layer="geometric")``; ``report.nu_map`` is
``{site name: nu}`` over every patchable site of :func:`attnuq.find_attention` (its order,
``named_modules()`` order, is the layer order ``l = 0 .. L - 1``), ready for
``attnuq.stochastic(model, nu=report.nu_map)`` and ``attnuq.predict(..., nu=report.nu_spec)``.

**The family** ``"geometric"``: with a centre ``nu_c`` and a ratio ``r`` (last over first site),

.. math:: \nu_l = \mathrm{clip}\big(\mathrm{round}(\nu_c\, r^{\,l/(L-1) - 1/2}),
          \ \mathrm{lo},\ \mathrm{hi}\big), \qquad l = 0, \dots, L - 1,

that is ``nu_l = nu_0 r^(l / (L - 1))`` with ``nu_0 = nu_c / sqrt(r)``: ``nu_c`` is the
geometric mean of the sites' ``nu`` (before rounding), so changing ``r`` at a fixed ``nu_c``
mainly changes the *shape* (which layers are noisier) and little the overall perturbation
scale. ``r = 1`` is the shared ``nu``. ``L = 1`` leaves nothing to shape: the map is the
shared ``nu``.

**The search** (two dimensions, ``(nu_c, r)``, at most twice the shared search's cost):

1. the shared search of :func:`attnuq.calibrate` (``"bo"`` or ``"grid"``) runs unchanged,
   ``n`` evaluations, giving ``nu_shared`` (so the shared report's fields are bit-identical);
2. the scale is profiled out: at an evaluated shape the criterion's own target rescaling
   ``k_* = s_* / s`` (:mod:`attnuq.calibration.criteria`) is applied to the perturbations of
   the evaluated passes, and the criterion at ``k_*`` (:func:`profile`, no forward pass) says
   how good that shape would be at its best scale;
3. a pattern search over ``x = log_4 r`` in ``[-3, 3]`` (``r`` from ``1/64`` to ``64``) at
   ``nu_c = nu_shared``: from ``x = 0`` (the shared choice, already evaluated) try ``x +- 1``,
   move to any improvement of the profiled criterion and try again at the same step, else halve
   the step (``1, 1/2, 1/4``), until ``n - 1`` evaluations are spent (maps that round to one
   already evaluated cost nothing);
4. if the best shape is not ``r = 1``, one evaluation at its scale-corrected centre
   ``nu_c' = nu_shared k_*^{1/a}`` (``a`` the shared surrogate's slope of ``ln s`` in
   ``ln nu``, at most ``-0.05``);
5. the choice, on the calibration data only: the smallest *measured* objective among the
   shared choice, the best shape's evaluation and the scale-corrected one (so the map is the
   shared ``nu`` on every site unless a per-layer map measured better).

Cost: the frozen pass is shared and steps 3-4 take at most ``n`` evaluations of ``M`` passes,
so ``forward_passes <= 1 + 2 M n < 2 (1 + M n)``, twice the shared search's
(``report.per_layer["shared_forward_passes"]`` holds the latter). Criteria that any shape meets
by rescaling (``"scale"``, ``"coverage"``: their profiled value is 0 for every shape) cannot
rank shapes and are refused.

NOTE(paper): the paper shares one ``nu`` over all layers and names per-layer concentration as
future work; the geometric per-layer family ``nu_l = nu_0 r^(l/(L-1))`` over the attention
sites in ``attnuq.find_attention`` order, the scale profiled out by the criterion's rescaling,
the pattern search over ``log_4 r`` and the budget of at most twice the shared calibration's
forward passes (``1 + 2 M n`` against ``1 + M n`` for ``n`` shared evaluations) are ours.

Examples
--------
>>> geometric_nus(16, 16.0, 3, (1, 1024))  # nu_c = 16, r = 16: nu_0 = 4
[4, 16, 64]
>>> geometric_nus(16, 1.0, 3, (1, 1024))  # r = 1 is the shared nu
[16, 16, 16]
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from attnuq.calibration.criteria import PassStats, summarise
from attnuq.calibration.report import Evaluation
from attnuq.calibration.search import SearchResult, check_nu_range

__all__ = [
    "PER_LAYER",
    "LayerSearch",
    "check_per_layer",
    "geometric_nus",
    "layer_search",
    "profile",
    "seed_key",
]

#: the ``per_layer=`` values, for type checkers (tests check it equals :data:`PER_LAYER`)
PerLayer = Literal["geometric"]

#: the per-layer families: the one list ``attnuq.calibrate`` and ``attnuq calibrate --per-layer``
#: read
PER_LAYER: tuple[PerLayer, ...] = ("geometric",)

#: criteria whose profiled value is 0 for every shape (any shape meets them by rescaling)
_SCALE_ONLY = ("scale", "coverage")

#: the pattern search's steps in ``x = log_4 r`` and its bound ``|x| <= X_MAX``
_STEPS = (1.0, 0.5, 0.25)
_X_MAX = 3.0
#: the slope ``a`` of ``ln s`` in ``ln nu`` used to move the centre is at most this
_MAX_SLOPE = -0.05


def check_per_layer(per_layer: object, criterion: str) -> PerLayer | None:
    """``per_layer`` validated: ``None`` / ``False`` (shared ``nu``) or one of
    :data:`PER_LAYER`; ``ValueError`` naming it, or the criterion that cannot rank shapes.

    Examples
    --------
    >>> check_per_layer("geometric", "paper"), check_per_layer(None, "scale")
    ('geometric', None)
    >>> check_per_layer("geometric", "scale")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: per_layer='geometric' needs a criterion that ranks shapes ...
    """
    if per_layer is None or per_layer is False:
        return None
    if not isinstance(per_layer, str) or per_layer not in PER_LAYER:
        raise ValueError(f"per_layer must be None or one of {PER_LAYER}, got {per_layer=!r}")
    if criterion in _SCALE_ONLY:
        raise ValueError(
            f"per_layer={per_layer!r} needs a criterion that ranks shapes (not 'scale' or "
            f"'coverage', which every shape meets by rescaling), got {criterion=!r}"
        )
    fam: PerLayer = "geometric"
    return fam


def geometric_nus(
    center: float, ratio: float, n_sites: int, nu_range: tuple[int, int]
) -> list[int]:
    """``nu_l = clip(round(center * ratio^(l / (L - 1) - 1/2)), lo, hi)`` for ``l < L``.

    ``L = n_sites``; for ``L = 1`` the one site gets ``clip(round(center))``.

    Examples
    --------
    >>> geometric_nus(8, 4.0, 5, (1, 64))
    [4, 6, 8, 11, 16]
    >>> geometric_nus(8, 1 / 64, 2, (2, 64))  # clipped to nu_range
    [64, 2]
    """
    lo, hi = check_nu_range(nu_range)
    if not (isinstance(center, (int, float)) and math.isfinite(center) and center > 0):
        raise ValueError(f"center must be a positive finite number, got {center=!r}")
    if not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and ratio > 0):
        raise ValueError(f"ratio must be a positive finite number, got {ratio=!r}")
    if isinstance(n_sites, bool) or not isinstance(n_sites, int) or n_sites < 1:
        raise ValueError(f"n_sites must be an int >= 1, got {n_sites=!r}")
    if n_sites == 1:
        return [min(hi, max(lo, round(center)))]
    out = []
    for layer in range(n_sites):
        v = center * ratio ** (layer / (n_sites - 1) - 0.5)
        out.append(min(hi, max(lo, round(v))))
    return out


def seed_key(nus: list[int]) -> int:
    """The integer that keys the draws of a per-layer evaluation (in place of ``nu`` in
    ``seed * 1000003 + nu``): ``2^31 + crc32`` of the map, so it never equals a shared ``nu``.

    Examples
    --------
    >>> seed_key([4, 16, 64]) == seed_key([4, 16, 64]) != seed_key([16, 16, 16])
    True
    """
    return (1 << 31) + zlib.crc32(",".join(str(int(v)) for v in nus).encode())


def profile(st: PassStats, criterion: str, level: float, s0: float) -> tuple[float, float]:
    """The criterion at its best rescaling of the evaluated perturbations, and that factor.

    With the target scale ``s_*`` of ``criterion`` at these passes and ``k_* = s_* / s``, the
    passes' deviations ``f_nu - f`` are multiplied by ``k_*`` and the criterion is evaluated
    again (no forward pass): ``(objective(k_* d), k_*)``; ``(nan, nan)`` if no perturbation was
    measured. For ``"paper"`` this is ``E[Z^2] - E[rZ]^2 / E[v + r^2]`` exactly.

    Examples
    --------
    >>> import torch
    >>> d = torch.tensor([[[1.0], [2.0]], [[-1.0], [0.0]]], dtype=torch.float64)  # (2, 2, 1)
    >>> e = torch.tensor([[2.0], [2.0]], dtype=torch.float64)
    >>> obj, k = profile(PassStats.from_deviations([d], [e]), "paper", 0.9, s0=2.0)
    >>> round(obj, 6), round(k, 6)  # E[Z^2] = 4, E[rZ] = 2, E[v + r^2] = 2
    (2.0, 1.0)
    """
    sm = summarise(st, criterion, level, s0)
    if not (sm.scale > 0 and math.isfinite(sm.target_scale) and sm.target_scale > 0):
        return float("nan"), float("nan")
    k = sm.target_scale / sm.scale
    scaled = PassStats.from_deviations([d * k for d in st.dev], list(st.resid))
    return summarise(scaled, criterion, level, s0).objective, k


#: ``evaluate_map(nus, center, ratio) -> (evaluation, profiled objective, k_*)``
EvaluateMap = Callable[[list[int], int, float], tuple[Evaluation, float, float]]


@dataclass
class LayerSearch:
    """What :func:`layer_search` returns: the chosen ``{site: nu}``, the report's ``per_layer``
    info and the shape search's evaluations (in order).

    Examples
    --------
    >>> LayerSearch(nu_map={"a": 4}, info={"family": "geometric"}, evaluations=[]).nu_map
    {'a': 4}
    """

    nu_map: dict[str, int]
    info: dict[str, Any]
    evaluations: list[Evaluation]


def layer_search(
    evaluate_map: EvaluateMap,
    sites: list[str],
    shared: SearchResult,
    shared_profile: tuple[float, float],
    *,
    nu_range: tuple[int, int],
    n_passes: int,
) -> LayerSearch:
    """The shape search of the module docstring (steps 3-5) after a shared search ``shared``.

    Parameters
    ----------
    evaluate_map
        ``evaluate_map(nus, center, ratio) -> (Evaluation, profiled objective, k_*)``: ``M``
        passes with site ``sites[l]`` drawing ``nus[l]``.
    sites
        The patchable site names in :func:`attnuq.find_attention` order (``L >= 1``).
    shared
        The shared search's result (its ``len(evaluations)`` is the budget ``n``).
    shared_profile
        :func:`profile` at the shared choice ``shared.nu``.
    nu_range, n_passes
        The calibration's ``(lo, hi)`` and ``M`` (for the cost bookkeeping).

    Returns
    -------
    LayerSearch
        At most ``n`` evaluations; the map is ``{site: shared.nu}`` unless a per-layer map
        measured a smaller objective.

    Examples
    --------
    A synthetic ``evaluate_map`` whose profiled objective is smallest at ``r = 16``
    (``x = 2``), after a shared search of four evaluations (so a budget of four more; the
    search tries ``x = 1, -1, 2``):

    >>> def ev(nu, obj):
    ...     return Evaluation(nu=nu, objective=obj, se=0.0, scale=1.0, scale_se=0.0,
    ...                       target_scale=1.0, values={}, passes=2, model_calls=1, seconds=0.0)
    >>> shared = SearchResult(nu=16, evaluations=[ev(v, 4.0) for v in (32, 20, 16, 12)],
    ...                       target_log_scale=0.0, surrogate={"mean": [0.0, -0.5]},
    ...                       nu_interval=None, noise_band=None)
    >>> def evaluate_map(nus, center, ratio):
    ...     prof = (math.log(ratio, 4) - 2) ** 2
    ...     return ev(center, prof), prof, 1.0
    >>> res = layer_search(evaluate_map, ["a", "b", "c"], shared, (4.0, 1.0), nu_range=(1, 256),
    ...                    n_passes=2)
    >>> res.nu_map, [t["ratio"] for t in res.info["trace"]], res.info["shared_forward_passes"]
    ({'a': 4, 'b': 16, 'c': 64}, [1.0, 4.0, 0.25, 16.0], 9)
    """
    lo, hi = check_nu_range(nu_range)
    if not sites:
        raise ValueError("sites is empty: per-layer nu needs at least one attention site")
    n_sites = len(sites)
    budget = len(shared.evaluations)
    nu_shared = int(shared.nu)
    chosen_shared = next(e for e in shared.evaluations if e.nu == nu_shared)
    slope = min(_MAX_SLOPE, float(shared.surrogate["mean"][1]))
    evals: list[Evaluation] = []
    cache: dict[tuple[int, ...], tuple[Evaluation | None, float, float]] = {
        tuple([nu_shared] * n_sites): (None, *shared_profile)
    }
    trace: list[dict[str, Any]] = [{
        "x": 0.0, "ratio": 1.0, "nu_center": nu_shared, "nus": [nu_shared] * n_sites,
        "profiled_objective": shared_profile[0], "rescale": shared_profile[1],
        "objective": chosen_shared.objective,
    }]

    def run(nus: list[int], center: int, ratio: float) -> tuple[Evaluation | None, float, float]:
        key = tuple(nus)
        if key not in cache:
            ev, prof, k = evaluate_map(nus, center, ratio)
            evals.append(ev)
            cache[key] = (ev, prof, k)
            trace.append({"x": math.log(ratio, 4), "ratio": ratio, "nu_center": center,
                          "nus": list(nus), "profiled_objective": prof, "rescale": k,
                          "objective": ev.objective})
        return cache[key]

    def better(a: float, b: float) -> bool:
        return math.isfinite(a) and (not math.isfinite(b) or a < b)

    best_x, best_prof = 0.0, shared_profile[0]
    if n_sites > 1:
        step_i = 0
        while step_i < len(_STEPS) and len(evals) < budget - 1:
            step = _STEPS[step_i]
            improved = False
            for x in (best_x + step, best_x - step):
                if abs(x) > _X_MAX + 1e-9 or len(evals) >= budget - 1:
                    continue
                nus = geometric_nus(nu_shared, 4.0**x, n_sites, (lo, hi))
                if tuple(nus) in cache and cache[tuple(nus)][0] is None:
                    continue  # rounds to the shared map
                _, prof, _k = run(nus, nu_shared, 4.0**x)
                if better(prof, best_prof):
                    best_x, best_prof, improved = x, prof, True
            if not improved:
                step_i += 1
    candidates: list[tuple[float, Evaluation | None, list[int], float, int]] = [
        (chosen_shared.objective, None, [nu_shared] * n_sites, 1.0, nu_shared)
    ]
    if best_x != 0.0:
        ratio = 4.0**best_x
        nus_best = geometric_nus(nu_shared, ratio, n_sites, (lo, hi))
        ev_best, _, k_best = cache[tuple(nus_best)]
        assert ev_best is not None
        candidates.append((ev_best.objective, ev_best, nus_best, ratio, nu_shared))
        if math.isfinite(k_best) and len(evals) < budget:
            center = min(float(hi), max(float(lo), nu_shared * k_best ** (1.0 / slope)))
            nus_k = geometric_nus(center, ratio, n_sites, (lo, hi))
            ev_k, _, _ = run(nus_k, round(center), ratio)
            if ev_k is not None:
                candidates.append((ev_k.objective, ev_k, nus_k, ratio, round(center)))
    finite = [c for c in candidates if math.isfinite(c[0])]
    obj, ev, nus, ratio, center = min(finite or candidates[:1], key=lambda c: c[0])
    assert len(evals) <= budget
    info = {
        "family": "geometric",
        "formula": "nu_l = clip(round(nu_c * r^(l/(L-1) - 1/2)), lo, hi), l in "
                   "attnuq.find_attention order",
        "sites": list(sites),
        "ratio": ratio,
        "nu_center": center,
        "nu_0": center / math.sqrt(ratio),
        "kept_shared": ev is None,
        "objective": obj,
        "best_shape_ratio": 4.0**best_x,
        "slope": slope,
        "budget_evaluations": budget,
        "shared_evaluations": budget,
        "layer_evaluations": len(evals),
        "shared_forward_passes": 1 + n_passes * budget,
        "trace": trace,
    }
    return LayerSearch(nu_map=dict(zip(sites, (int(v) for v in nus), strict=True)),
                       info=_jsonable(info), evaluations=evals)


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    """Floats as plain floats (numpy scalars would not serialise)."""

    def conv(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, np.generic):
            return v.item()
        return v

    return conv(d)  # type: ignore[no-any-return]
