"""The result of a calibration: :class:`Evaluation` (one ``nu``) and :class:`CalibrationReport`
(the choice and everything evaluated on the way), with their JSON I/O.

Plotting lives in :mod:`attnuq.plots` (:func:`attnuq.plots.calibration_curve`, which reads a
report's fields and knows nothing of this module); :meth:`CalibrationReport.plot` delegates to it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from attnuq._io import atomic_write_text, decode_nonfinite, encode_nonfinite
from attnuq.plots import calibration_curve

__all__ = ["CalibrationReport", "Evaluation"]


@dataclass
class Evaluation:
    """One evaluated ``nu``.

    Attributes
    ----------
    nu, objective, se
        The value, the criterion's objective and its standard error (over examples).
    scale, scale_se
        ``s(nu)`` (mean perturbation size) and its standard error.
    target_scale
        This evaluation's estimate of the criterion's target scale ``s_*``.
    values
        Every criterion's raw value at this ``nu``: ``l_sa``, ``crps``, ``coverage``,
        ``scale_ratio`` (``s / s_0``).
    passes, model_calls, seconds
        Stochastic passes over the calibration set, model calls and wall time.
    nu_map, ratio
        Only for an evaluation of the per-layer search (:mod:`attnuq.calibration.layers`):
        the ``{site name: nu}`` evaluated and the family's ratio ``r``; ``nu`` is then the
        family's centre ``nu_c``. ``None`` (and left out of :meth:`to_dict`) otherwise.

    Examples
    --------
    Normally made by :func:`attnuq.calibrate` (``report.evaluations``); by hand:

    >>> e = Evaluation(nu=8, objective=0.12, se=0.01, scale=0.3, scale_se=0.02,
    ...                target_scale=0.28, values={"l_sa": 0.12}, passes=10, model_calls=10,
    ...                seconds=0.5)
    >>> d = e.to_dict()  # JSON-ready, without the per-example influence
    >>> d["nu"], d["values"], "influence" in d
    (8, {'l_sa': 0.12}, False)
    """

    nu: int
    objective: float
    se: float
    scale: float
    scale_se: float
    target_scale: float
    values: dict[str, float]
    passes: int
    model_calls: int
    seconds: float
    influence: np.ndarray | None = field(default=None, repr=False, compare=False)
    nu_map: dict[str, int] | None = None
    ratio: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("influence")
        for k in _OPTIONAL_EVALUATION:  # absent for the shared search: its JSON is unchanged
            if d[k] is None:
                d.pop(k)
        return d


_OPTIONAL_EVALUATION = ("nu_map", "ratio")
_OPTIONAL_REPORT = ("nu_map", "per_layer", "layer_evaluations", "edge")


@dataclass
class CalibrationReport:
    """Result of :func:`attnuq.calibrate`: the chosen ``nu`` and everything evaluated on the way.

    Attributes
    ----------
    nu
        Chosen number of draws.
    criterion, search, level, n_passes, nu_range, seed
        The settings used.
    evaluations
        Every evaluated ``nu`` in evaluation order (:class:`Evaluation`).
    residual_scale
        ``s_0 = E_cal |y - f(x)|_2``.
    target_scale
        The target scale ``s_*`` used by the surrogate (:mod:`attnuq.calibration.criteria`).
    surrogate
        Posterior of the log-linear surrogate: ``mean`` and ``cov`` of ``(ln b, a)`` with
        ``x = ln nu - x_center``, ``x_center``, ``tau``, ``target_log_scale``; for ``"grid"``
        it is fitted to the grid points for display only.
    nu_interval
        BO: 95 % posterior interval of the ``nu`` where the surrogate mean meets the target
        (the target treated as fixed).
    noise_band
        Grid: every grid ``nu`` within 2 paired standard errors of the best objective.
    forward_passes
        Passes over the calibration set: ``1`` frozen + ``n_passes`` per evaluation.
    model_calls, wall_time, n_examples
        Model calls (chunks), seconds, calibration examples.
    nu_map
        Per-layer calibration only (``calibrate(..., per_layer="geometric")``, see
        :mod:`attnuq.calibration.layers`): the chosen ``{site name: nu}`` over every patchable
        site in :func:`attnuq.find_attention` order, ready for
        ``attnuq.stochastic(model, nu=report.nu_map)``; ``nu`` stays the shared search's
        choice. ``None`` for a shared-``nu`` report (then :attr:`nu_spec` is ``nu``).
    per_layer
        Per-layer calibration only: the family, its sites, the chosen ``r``, ``nu_0`` and
        centre, the shape search's trace and the passes of the shared part.
    layer_evaluations
        Per-layer calibration only: the evaluations of the shape search, in order
        (:class:`Evaluation` with ``nu_map`` and ``ratio``); ``forward_passes`` and
        ``model_calls`` count them too.
    edge
        ``None`` unless the chosen ``nu`` is an end of ``nu_range``: then ``side``
        (``"lower"`` / ``"upper"``), ``nu``, ``nu_range``, SA's ``spread`` ``s(nu)`` there and
        the criterion's ``target_scale`` (:func:`attnuq.calibration.edge_info`).

    Examples
    --------
    >>> import pathlib, tempfile
    >>> import torch
    >>> _ = torch.manual_seed(0)
    >>> mha = torch.nn.MultiheadAttention(4, 1, batch_first=True).eval()
    >>> x = torch.randn(8, 3, 4)
    >>> with torch.no_grad():
    ...     y = mha(x, x, x)[0] + 0.1 * torch.randn(8, 3, 4)
    >>> from attnuq.calibration import calibrate
    >>> report = calibrate(mha, [((x, x, x), y)], criterion="scale", n_passes=2, max_evals=3,
    ...                    nu_range=(1, 64), output_fn=lambda out: out[0], progress=False)
    >>> report.chosen.nu == report.nu, report.n_examples
    (True, 8)
    >>> report.forward_passes == 1 + report.n_passes * len(report.evaluations)
    True
    >>> with tempfile.TemporaryDirectory() as d:
    ...     back = CalibrationReport.load(report.save(pathlib.Path(d) / "report.json"))
    >>> back.to_dict() == report.to_dict()
    True
    >>> report.nu_map is None, report.nu_spec == report.nu  # a shared-nu report
    (True, True)
    """

    nu: int
    criterion: str
    search: str
    level: float
    n_passes: int
    nu_range: tuple[int, int]
    seed: int | None
    evaluations: list[Evaluation]
    residual_scale: float
    target_scale: float
    surrogate: dict[str, Any] | None
    nu_interval: tuple[float, float] | None
    noise_band: list[int] | None
    forward_passes: int
    model_calls: int
    wall_time: float
    n_examples: int
    nu_map: dict[str, int | tuple[int | None, ...]] | None = None
    per_layer: dict[str, Any] | None = None
    layer_evaluations: list[Evaluation] | None = None
    edge: dict[str, Any] | None = None

    @property
    def nu_spec(self) -> int | dict[str, int | tuple[int | None, ...]]:
        """What to pass as ``nu=`` to :func:`attnuq.stochastic` / :func:`attnuq.predict`:
        :attr:`nu_map` for a per-layer report, else :attr:`nu`."""
        return self.nu if self.nu_map is None else dict(self.nu_map)

    @property
    def layer_choice(self) -> Evaluation | None:
        """The evaluation of :attr:`nu_map` (per-layer reports; ``None`` otherwise): the
        shape search's evaluation of the chosen map, or the shared choice when the search
        kept the shared ``nu``."""
        if self.nu_map is None:
            return None
        for e in self.layer_evaluations or []:
            if e.nu_map == self.nu_map:
                return e
        return self.chosen

    def evaluation(self, nu: int) -> Evaluation:
        """The :class:`Evaluation` of ``nu`` (``KeyError`` if it was not evaluated)."""
        for e in self.evaluations:
            if e.nu == nu:
                return e
        raise KeyError(f"nu={nu} was not evaluated; evaluated: {[e.nu for e in self.evaluations]}")

    @property
    def chosen(self) -> Evaluation:
        return self.evaluation(self.nu)

    def surrogate_log_scale(self, nu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Posterior mean and sd of ``ln s(nu)`` (mean function, without ``tau``)."""
        if self.surrogate is None:
            raise ValueError("this report has no surrogate fit")
        m = np.asarray(self.surrogate["mean"])
        v = np.asarray(self.surrogate["cov"])
        x = np.log(np.asarray(nu, dtype=float)) - self.surrogate["x_center"]
        phi = np.stack([np.ones_like(x), x], -1)
        return phi @ m, np.sqrt(np.einsum("...i,ij,...j->...", phi, v, phi))

    def plot(self, ax: Any = None, *, show_surrogate: bool = True) -> Any:
        """Objective against ``nu`` (see :func:`attnuq.plots.calibration_curve`)."""
        return calibration_curve(self, ax=ax, show_surrogate=show_surrogate)

    def to_dict(self) -> dict[str, Any]:
        skip = {"evaluations", "layer_evaluations"}
        d = {k: v for k, v in asdict(self).items() if k not in skip}
        d["evaluations"] = [e.to_dict() for e in self.evaluations]
        if self.layer_evaluations is not None:
            d["layer_evaluations"] = [e.to_dict() for e in self.layer_evaluations]
        for k in _OPTIONAL_REPORT:  # absent for a shared-nu report: its JSON is unchanged
            if d.get(k, 0) is None:
                d.pop(k)
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(encode_nonfinite(self.to_dict()), indent=indent, allow_nan=False)

    def save(self, path: str | Path) -> Path:
        """Write :meth:`to_json` to ``path`` atomically (temporary file + ``os.replace``)."""
        p = Path(path)
        atomic_write_text(p, self.to_json())
        return p

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CalibrationReport:
        d = dict(d)
        d["evaluations"] = [Evaluation(**e) for e in d["evaluations"]]
        if d.get("layer_evaluations") is not None:
            d["layer_evaluations"] = [Evaluation(**e) for e in d["layer_evaluations"]]
        if d.get("nu_map") is not None:  # JSON stores a per-head tuple as a list
            d["nu_map"] = {k: tuple(v) if isinstance(v, list) else v
                           for k, v in d["nu_map"].items()}
        d["nu_range"] = tuple(d["nu_range"])
        if d.get("nu_interval") is not None:
            d["nu_interval"] = tuple(d["nu_interval"])
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> CalibrationReport:
        return cls.from_dict(decode_nonfinite(json.loads(text)))

    @classmethod
    def load(cls, path: str | Path) -> CalibrationReport:
        return cls.from_json(Path(path).read_text())
