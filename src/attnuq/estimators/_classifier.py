r"""``SAClassifier``: stochastic attention on a frozen classifier, with a temperature and
conformal prediction sets.

The recipe (:meth:`SAClassifier.fit`; every choice on ``val_data``, the set threshold on
``cal_data``):

1. ``nu`` by the validation NLL of the Monte Carlo mean probability
   ``p_bar = mean_s softmax(z^(s) / T)`` (a proper score), with :func:`attnuq.calibrate`'s
   search and the registered criterion ``"nll-temperature"`` (or ``"nll"``).
2. A temperature ``T`` on the logits, fitted on ``val_data`` by the same NLL.
3. The prediction-set threshold: split conformal on ``cal_data``'s ``p_bar``
   (:mod:`attnuq.conformal_sets`; ``lac``, ``aps`` or ``raps``), kept as the sorted
   calibration scores, so :meth:`SAClassifier.predict_set` works at any ``alpha``.

The temperature rule (fixed in advance): ``temperature="joint"`` (default) -- ``T`` is fitted
together with ``nu``: every ``nu`` the search evaluates is scored at its own best ``T``
(the NLL profiled over ``T``), and ``T`` is refitted on the final draws at the chosen ``nu``.
Why: ``nu`` and ``T`` both widen the predictive, and a temperature is the cheaper, better-known
fix for a frozen model's over-confidence. Scored at ``T = 1`` (``"after"``: ``nu`` first, then
``T``), an over-confident model makes the search pick a small ``nu`` whose noise merely does
the temperature's job (SA then looks useful when it is not, and its draws are noisier than
needed); profiled over ``T``, ``nu`` is chosen for what SA adds beyond one temperature
(the NLL of ``softmax(c z / T)`` depends on ``c / T`` only, so rescaling the frozen logits by
``c`` leaves the chosen ``nu`` unchanged and multiplies ``T`` by ``c``), and as
``nu -> inf`` SA becomes the frozen model, so temperature scaling alone is a member of the
family searched (up to Monte Carlo noise SA then cannot be worse than it on validation).
``"after"`` is kept as the ablation, ``None`` for no temperature (``T = 1``).

Binary models (one logit ``z``) are read as the two classes ``[0, z]``; per-token logits of
a language model ``(B, L, V)`` with targets ``(B, L)`` (``-100`` left out) work as well
(:func:`attnuq.categorical.labelled_rows`).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from attnuq.categorical import (
    TEMPERATURE_RANGE,
    CategoricalPredictive,
    class_logits,
    fit_temperature,
    labelled_rows,
    mc_nll,
)
from attnuq.conformal_sets import (
    SET_SCORES,
    ConformalSets,
    SetScore,
    check_alpha,
    conformal_rank,
    set_scores,
)
from attnuq.estimators._common import (
    check_model,
    check_settings,
    jsonable,
    read_fitted,
    read_pairs,
    require_fitted,
    warn_and_record,
    write_envelope,
)

__all__ = ["TEMPERATURE_RULES", "SAClassifier"]

TemperatureRule = Literal["joint", "after"]
#: the ``temperature=`` values besides ``None``
TEMPERATURE_RULES: tuple[TemperatureRule, ...] = ("joint", "after")


class _Rows:
    """Labelled rows of one data part: SA logit draws ``(S, N, C)``, frozen logits
    ``(N, C)`` and labels ``(N,)`` (float64 / int64, CPU)."""

    def __init__(self, draws: torch.Tensor, frozen: torch.Tensor, labels: torch.Tensor) -> None:
        self.draws, self.frozen, self.labels = draws, frozen, labels


def _draw_logits(s: torch.Tensor) -> torch.Tensor:
    """Class logits of SA draws ``(S, B, ...)``: :func:`class_logits` of every draw."""
    zs = class_logits(s.reshape(s.shape[0] * s.shape[1], *s.shape[2:]))
    return zs.reshape(s.shape[0], s.shape[1], *zs.shape[1:])


def _calibration(logit_draws: torch.Tensor, labels: torch.Tensor, t: float
                 ) -> dict[str, Any]:
    """ECE (15 equal-width bins) of the Monte Carlo mean probability at temperature ``t``, and
    its bins (what a reliability diagram draws: :func:`attnuq.plots.confidence_reliability`)."""
    from attnuq.metrics import calibration_bins

    bins = calibration_bins((logit_draws / t).softmax(-1).mean(0), labels)
    return {"ece": float(bins.ece), "reliability": bins.to_dict()}


class SAClassifier:
    r"""Stochastic attention on a frozen classifier: ``fit(val_data, cal_data)``,
    ``predict(inputs)``, ``predict_set(inputs, alpha)``, ``save`` / ``load``.

    The recipe and the temperature rule are in :mod:`attnuq.estimators._classifier`'s module
    docstring; the defaults are the recommendation.

    Parameters
    ----------
    model
        The frozen classifier (put in ``eval()`` mode by :meth:`fit`); never changed.
    output_fn
        Maps the model's output to the logits: ``(B, C)``, ``(B,)`` / ``(B, 1)`` for a binary
        model, or ``(B, L, C)`` per token (e.g. ``lambda out: out.logits``); default: the
        tensor, ``.logits`` or the first element.
    nu
        A fixed number of draws, or ``None`` (default): chosen on ``val_data``.
    temperature
        ``"joint"`` (default), ``"after"`` or ``None`` (module docstring).
    score
        The conformal score of the prediction sets: ``"aps"`` (default), ``"lac"`` or
        ``"raps"`` (:mod:`attnuq.conformal_sets`; deterministic, non-empty sets).
    nu_range
        The search range of ``nu``.
    n_samples
        ``S``, stochastic passes per example at prediction (and on the validation and
        calibration parts, so that calibration and test probabilities are alike).
    n_passes
        ``M``, passes per example and evaluation of the search.
    seed
        Seeds every draw: the same seed gives the same numbers.
    ignore_index
        Target value left out (padding / prompt tokens), ``None`` for none.
    progress
        tqdm bars (``None``: only on a terminal).
    **calibrate_kwargs
        Passed to :func:`attnuq.calibrate` (``search``, ``max_evals``, ``nu_tol``,
        ``batch_replicas``, ``max_rows``, ...).

    Attributes
    ----------
    diagnostics
        After :meth:`fit` (and in the JSON): ``nu``, ``nu_at_edge`` (``None``, ``"lower"``,
        ``"upper"``), ``temperature`` and ``temperature_rule``, ``val`` with the validation
        ``nll``, ``ece`` and ``reliability`` (its bins:
        :meth:`attnuq.metrics.CalibrationBins.to_dict`) of ``"frozen"`` (``T = 1``),
        ``"temperature_scaling"`` (the frozen model at its own best ``T``) and ``"sa"`` (the
        fitted estimator), the mean validation
        mutual information, ``n_val`` / ``n_cal`` (labelled rows), ``n_classes``,
        ``forward_passes`` (per example), ``fit_seconds`` and ``warnings``.
    metadata
        Free-form, JSON-ready; saved by :meth:`save` and restored by :meth:`load` (``attnuq
        calibrate`` keeps the file names and options there for ``attnuq predict``).

    Examples
    --------
    A one-layer encoder classifier (untrained: the numbers only show the API):

    >>> import torch, warnings
    >>> from torch import nn
    >>> _ = torch.manual_seed(0)
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    ...         self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
    ...         self.head = nn.Linear(8, 3)
    ...     def forward(self, x):
    ...         return self.head(self.enc(x).mean(1))
    >>> net = Net().eval()
    >>> x, y = torch.randn(120, 5, 8), torch.randint(0, 3, (120,))
    >>> clf = SAClassifier(net, nu_range=(1, 64), n_samples=8, progress=False)
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")  # an untrained net: nu may sit at an edge
    ...     clf = clf.fit([(x[:60], y[:60])], [(x[60:], y[60:])])
    >>> pred = clf.predict(x[:4])
    >>> pred.probs.shape, pred.samples.shape, pred.mutual_information.shape
    (torch.Size([4, 3]), torch.Size([8, 4, 3]), torch.Size([4]))
    >>> bool(torch.allclose(pred.probs.sum(-1), torch.ones(4)))
    True
    >>> clf.predict_set(x[:4], alpha=0.2).shape
    torch.Size([4, 3])
    >>> sorted(clf.diagnostics["val"])
    ['frozen', 'sa', 'temperature_scaling']
    """

    def __init__(
        self,
        model: nn.Module,
        output_fn: Any = None,
        *,
        nu: int | None = None,
        temperature: TemperatureRule | None = "joint",
        score: SetScore = "aps",
        nu_range: tuple[int, int] = (1, 1024),
        n_samples: int = 32,
        n_passes: int = 10,
        seed: int = 0,
        ignore_index: int | None = -100,
        progress: bool | None = None,
        **calibrate_kwargs: Any,
    ) -> None:
        from attnuq._validation import check_positive_int
        from attnuq.calibration import check_calibrate_kwargs
        from attnuq.calibration.search import check_nu_range

        self.model = check_model(model)
        counts = check_settings(output_fn, seed, n_samples=n_samples, n_passes=n_passes)
        self.output_fn = output_fn
        self.n_samples, self.n_passes, self.seed = counts["n_samples"], counts["n_passes"], seed
        self.nu = None if nu is None else check_positive_int(nu, "nu")
        if temperature is not None and temperature not in TEMPERATURE_RULES:
            raise ValueError(
                f"temperature must be None or one of {TEMPERATURE_RULES}, got {temperature=!r}"
            )
        self.temperature_rule = temperature
        if score not in SET_SCORES:
            raise ValueError(f"score must be one of {SET_SCORES}, got {score=!r}")
        self.score: SetScore = score
        self.nu_range = check_nu_range(nu_range)
        if ignore_index is not None and (isinstance(ignore_index, bool)
                                         or not isinstance(ignore_index, int)):
            raise TypeError(f"ignore_index must be an int or None, got {ignore_index=!r}")
        self.ignore_index = ignore_index
        self.calibrate_kwargs = {"nu_tol": 0.25, **calibrate_kwargs}
        # per_layer and distributed are not available for classification
        check_calibrate_kwargs(
            "SAClassifier", self.calibrate_kwargs,
            reserved=("criterion", "n_passes", "nu_range", "seed", "output_fn", "progress",
                      "level", "per_layer", "distributed", "ignore_index"),
            criterion="nll", n_passes=self.n_passes, nu_range=self.nu_range, seed=seed,
            output_fn=output_fn, progress=progress, ignore_index=ignore_index)
        self.progress = progress
        self._fitted: dict[str, Any] | None = None
        self.diagnostics: dict[str, Any] = {}
        self.report: Any = None
        self.metadata: dict[str, Any] = {}  # free-form, saved with the estimator

    # ------------------------------------------------------------------ fit
    @property
    def criterion(self) -> str:
        """The search criterion the temperature rule implies."""
        return "nll-temperature" if self.temperature_rule == "joint" else "nll"

    def fit(self, val_data: Iterable[Any], cal_data: Iterable[Any] | None = None
            ) -> SAClassifier:
        """Choose ``nu`` and ``T`` on ``val_data``; the set threshold on ``cal_data``.

        Parameters
        ----------
        val_data, cal_data
            Iterables of ``(inputs, targets)`` pairs (a ``DataLoader`` works; one
            ``(inputs, targets)`` tuple is one batch): ``inputs`` as the model takes them,
            ``targets`` integer class ids ``(B,)`` (or ``(B, L)`` per token). Disjoint
            held-out parts, neither used in training. Without ``cal_data`` there are no
            prediction sets.

        Returns
        -------
        SAClassifier
            ``self``, fitted.

        Raises
        ------
        ValueError
            Empty data, targets outside ``[0, C)`` or not whole numbers, a model output that
            is not logits of the stated shape, fewer than 2 validation rows.
        """
        from attnuq.calibration import EdgeWarning, calibrate, edge_message

        t0 = time.perf_counter()
        val = read_pairs(val_data, "val_data", finite=False)
        cal = None if cal_data is None else read_pairs(cal_data, "cal_data", finite=False)
        self.model.eval()
        passes = 0
        # the frozen pass first: checks every label and the output's shape, naming the part
        with torch.no_grad():
            frozen_val, tokens, n_classes = self._frozen(val, "val_data")
        passes += 1
        if cal is not None:
            with torch.no_grad():
                _, tok_c, c_cal = self._frozen(cal, "cal_data")
            passes += 1
            if (tok_c, c_cal) != (tokens, n_classes):
                raise ValueError(
                    f"val_data and cal_data disagree: {n_classes} classes"
                    f"{' per token' if tokens else ''} on val_data, {c_cal}"
                    f"{' per token' if tok_c else ''} on cal_data"
                )
        fy = torch.cat([y for _, y in frozen_val], 0)
        if fy.numel() < 2:
            raise ValueError(f"val_data has {fy.numel()} labelled row(s) (targets other than "
                             f"ignore_index={self.ignore_index}): at least 2 are needed")
        edge = None
        if self.nu is None:
            with warnings.catch_warnings():  # shown below, once, in classification words
                warnings.simplefilter("ignore", EdgeWarning)
                self.report = calibrate(
                    self.model, val, criterion=self.criterion,  # type: ignore[arg-type]
                    n_passes=self.n_passes, nu_range=self.nu_range, output_fn=self.output_fn,
                    seed=self.seed, progress=self.progress, distributed=False,
                    ignore_index=self.ignore_index, **self.calibrate_kwargs,
                )
            nu = int(self.report.nu)
            passes += self.report.forward_passes
            edge = self.report.edge
        else:
            nu = self.nu
        val_rows = self._rows(val, nu)
        passes += 1 + self.n_samples
        # the temperature: on the final draws at the chosen nu
        t_frozen = fit_temperature(val_rows.frozen, val_rows.labels)
        if self.temperature_rule is None:
            t = 1.0
        else:
            t = fit_temperature(val_rows.draws, val_rows.labels)
        diag: dict[str, Any] = {
            "nu": nu, "nu_range": list(self.nu_range),
            "nu_at_edge": None if edge is None else edge["side"],
            "criterion": self.criterion if self.nu is None else None,
            "temperature": t, "temperature_rule": self.temperature_rule,
            "n_classes": n_classes, "per_token": tokens, "n_samples": self.n_samples,
        }
        fr = val_rows.frozen[None]
        nll_sa = float(mc_nll(val_rows.draws, val_rows.labels, t).mean())
        nll_ts = float(mc_nll(fr, val_rows.labels, t_frozen).mean())
        diag["val"] = {
            "frozen": {"nll": float(mc_nll(fr, val_rows.labels).mean()),
                       **_calibration(fr, val_rows.labels, 1.0)},
            "temperature_scaling": {"temperature": t_frozen, "nll": nll_ts,
                                    **_calibration(fr, val_rows.labels, t_frozen)},
            "sa": {"nll": nll_sa, **_calibration(val_rows.draws, val_rows.labels, t)},
        }
        pred_val = CategoricalPredictive.from_logits(val_rows.draws, temperature=t)
        diag["val_mean_mutual_information"] = float(pred_val.mutual_information.mean())
        diag["n_val"] = int(val_rows.labels.numel())
        cal_scores = None
        if cal is not None:
            cal_rows = self._rows(cal, nu)
            passes += 1 + self.n_samples
            probs = (cal_rows.draws / t).softmax(-1).mean(0)
            cal_scores = torch.sort(set_scores(probs, cal_rows.labels, score=self.score)).values
            diag["n_cal"] = int(cal_scores.numel())
        else:
            diag["n_cal"] = 0
        self._fitted = {"nu": nu, "temperature": t, "n_classes": n_classes, "tokens": tokens,
                        "cal_scores": cal_scores}
        diag["forward_passes"] = int(passes)
        diag["fit_seconds"] = time.perf_counter() - t0
        self.diagnostics = diag
        if edge is not None:
            side = edge["side"]
            why = ("SA's largest spread (fewest draws) is what the validation NLL asks for: "
                   "SA may need more noise than nu >= 1 gives" if side == "lower" else
                   "the validation NLL prefers SA's smallest spread: SA adds little beyond "
                   "the frozen model with a temperature")
            warn_and_record(
                diag,
                f"SAClassifier.fit: nu = {nu} sits at the {side} edge of nu_range="
                f"{tuple(self.nu_range)}: {why} (validation NLL: SA {nll_sa:.4g}, temperature "
                f"scaling alone {nll_ts:.4g}; {edge_message(edge, self.criterion)})",
            )
        if self.temperature_rule is not None and not (
            TEMPERATURE_RANGE[0] * 1.01 < t < TEMPERATURE_RANGE[1] / 1.01
        ):
            warn_and_record(diag, f"SAClassifier.fit: the temperature T = {t:.4g} sits at an "
                                  f"end of its range {TEMPERATURE_RANGE}")
        if nll_sa > nll_ts:
            warn_and_record(
                diag,
                f"SAClassifier.fit: SA's validation NLL {nll_sa:.4g} is above temperature "
                f"scaling's alone ({nll_ts:.4g}, T = {t_frozen:.4g}): on this data SA's spread "
                "does not improve the probabilities",
            )
        return self

    def _outputs(self, x: Any) -> torch.Tensor:
        from attnuq.montecarlo import call_model, extract

        return extract(call_model(self.model, x), self.output_fn)

    def _frozen(self, pairs: list[tuple[Any, torch.Tensor]], name: str
                ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], bool, int]:
        """Frozen logit rows and labels of every batch; the kind (per token?) and ``C``."""
        out = []
        n_classes: int | None = None
        tokens: bool | None = None
        for i, (x, y) in enumerate(pairs):
            f = self._outputs(x)
            z, mask, labels = labelled_rows(
                f, y, ignore_index=self.ignore_index, n_classes=n_classes,
                name=f"{name} targets (batch {i})",
            )
            if not bool(torch.isfinite(z).all()):
                raise ValueError(f"{name}: the frozen logits of batch {i} are not finite")
            n_classes, tokens = int(z.shape[-1]), y.dim() == 2
            out.append((z[mask].double().cpu(), labels.cpu()))
        assert n_classes is not None and tokens is not None
        return out, tokens, n_classes

    def _rows(self, pairs: list[tuple[Any, torch.Tensor]], nu: int) -> _Rows:
        from attnuq.montecarlo import predict

        ds, fs, ys = [], [], []
        for x, y in pairs:
            pred = predict(self.model, x, nu=nu, n_samples=self.n_samples, seed=self.seed,
                           output_fn=self.output_fn, progress=self.progress,
                           **self._predict_kwargs())
            assert pred.frozen is not None
            fz, mask, labels = labelled_rows(pred.frozen, y, ignore_index=self.ignore_index)
            zs = _draw_logits(pred.samples)
            ds.append(zs[:, mask].double().cpu())
            fs.append(fz[mask].double().cpu())
            ys.append(labels.cpu())
        return _Rows(torch.cat(ds, 1), torch.cat(fs, 0), torch.cat(ys, 0))

    def _predict_kwargs(self) -> dict[str, Any]:
        return {k: self.calibrate_kwargs[k] for k in ("batch_replicas", "max_rows")
                if k in self.calibrate_kwargs}

    # -------------------------------------------------------------- predict
    def _require_fitted(self) -> dict[str, Any]:
        return require_fitted(self._fitted, "SAClassifier")

    def predict(self, inputs: Any) -> CategoricalPredictive:
        """The predictive of one batch of ``inputs`` (a tensor, tuple or dict as the model
        takes them): ``n_samples`` stochastic passes with the fitted ``nu`` and ``T``.

        Returns
        -------
        CategoricalPredictive
            ``probs`` ``(B, [L,] C)`` (the Monte Carlo mean), ``samples`` ``(S, B, [L,] C)``
            (probability draws ``softmax(z^(s) / T)``; their logits in ``.logits``),
            ``frozen`` (the frozen model's probabilities at ``T``), ``entropy``,
            ``expected_entropy``, ``mutual_information`` ``(B, [L])``. A binary model has
            ``C = 2`` columns ``[1 - p, p]``.

        Raises
        ------
        ValueError
            The model's output is not logits of the shape seen at :meth:`fit`.
        """
        fit = self._require_fitted()
        zs, fz = self._draws(inputs)
        return CategoricalPredictive.from_logits(zs, temperature=fit["temperature"],
                                                 frozen_logits=fz)

    def _draws(self, inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The logit draws ``(S, B, [L,] C)`` and frozen logits ``(B, [L,] C)`` of ``inputs``
        at the fitted ``nu`` (before the temperature)."""
        from attnuq.montecarlo import predict

        fit = self._require_fitted()
        pred = predict(self.model, inputs, nu=fit["nu"], n_samples=self.n_samples,
                       seed=self.seed, output_fn=self.output_fn, progress=self.progress,
                       **self._predict_kwargs())
        assert pred.frozen is not None
        fz = class_logits(pred.frozen, tokens=fit["tokens"])
        if fz.shape[-1] != fit["n_classes"]:
            raise ValueError(
                f"the model output must be logits with {fit['n_classes']} classes (as at fit), "
                f"got output shape={tuple(pred.frozen.shape)}"
            )
        return _draw_logits(pred.samples), fz

    def set_rule(self, alpha: float = 0.1) -> ConformalSets:
        """The split-conformal set rule at ``alpha`` from the calibration scores of :meth:`fit`
        (no forward pass): its ``threshold``, ``n`` and ``score``.

        Raises
        ------
        ValueError
            ``alpha`` outside ``(0, 1)``, or below the smallest ``1/(n_cal + 1)`` that the
            calibration part supports (the message names it).
        RuntimeError
            Not fitted with ``cal_data``.
        """
        alpha = check_alpha(alpha)
        fit = self._require_fitted()
        scores = fit["cal_scores"]
        if scores is None:
            raise RuntimeError("prediction sets need the calibration part: "
                               "fit(val_data, cal_data)")
        k = conformal_rank(int(scores.numel()), alpha)
        return ConformalSets(threshold=float(scores[k - 1]), alpha=alpha,
                             n=int(scores.numel()), score=self.score)

    def predict_set(self, inputs: Any, alpha: float = 0.1) -> torch.Tensor:
        r"""Conformal prediction sets ``(B, [L,] C)`` (bool) holding the label with marginal
        probability at least ``1 - alpha`` (split conformal on ``cal_data``; finite-sample).
        A bad ``alpha`` or a missing calibration part raises as :meth:`set_rule` says, before
        any forward pass."""
        return self.predict_with_set(inputs, alpha)[1]

    def predict_with_set(self, inputs: Any, alpha: float = 0.1
                         ) -> tuple[CategoricalPredictive, torch.Tensor]:
        """:meth:`predict` and :meth:`predict_set` of the same ``inputs`` from one set of
        stochastic passes (the two calls draw the same samples, at twice the cost).

        Examples
        --------
        >>> import torch, warnings
        >>> from torch import nn
        >>> _ = torch.manual_seed(0)
        >>> class Net(nn.Module):  # one attention layer, mean-pooled, 3 classes (untrained)
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        ...         self.head = nn.Linear(4, 3)
        ...     def forward(self, x):
        ...         return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))
        >>> x, y = torch.randn(60, 5, 4), torch.randint(0, 3, (60,))
        >>> clf = SAClassifier(Net().eval(), nu=4, n_samples=4, progress=False)
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     clf = clf.fit([(x[:30], y[:30])], [(x[30:], y[30:])])
        >>> pred, sets = clf.predict_with_set(x[:5], alpha=0.2)
        >>> pred.probs.shape, sets.shape
        (torch.Size([5, 3]), torch.Size([5, 3]))
        >>> bool(torch.equal(sets, clf.predict_set(x[:5], alpha=0.2)))
        True
        """
        rule = self.set_rule(alpha)  # alpha and the calibration part checked before any pass
        fit = self._require_fitted()
        zs, fz = self._draws(inputs)
        pred = CategoricalPredictive.from_logits(zs, temperature=fit["temperature"],
                                                 frozen_logits=fz)
        # the scores exactly as the calibration scores were computed at fit (float64 softmax
        # of the draws over T, then their mean): a float32 mean sums to 1 + 3e-8, and APS
        # scores of 1 + 3e-8 fall above a threshold of 1.0, dropping classes the guarantee
        # needs
        probs = (zs.double() / fit["temperature"]).softmax(-1).mean(0)
        flat = probs.reshape(-1, probs.shape[-1])
        return pred, rule.predict(flat).reshape(probs.shape).to(zs.device)

    # ------------------------------------------------------------ save/load
    def to_dict(self) -> dict[str, Any]:
        """The fitted estimator as a JSON-ready dict (settings, fitted values, diagnostics)."""
        fit = self._require_fitted()
        scores = fit["cal_scores"]
        return {
            "settings": {
                "nu": self.nu, "temperature": self.temperature_rule, "score": self.score,
                "nu_range": list(self.nu_range), "n_samples": self.n_samples,
                "n_passes": self.n_passes, "seed": self.seed, "ignore_index": self.ignore_index,
                "calibrate_kwargs": {k: v for k, v in self.calibrate_kwargs.items()
                                     if v is None or isinstance(v, (bool, int, float, str))},
            },
            "fitted": {
                "nu": fit["nu"], "temperature": fit["temperature"],
                "n_classes": fit["n_classes"], "tokens": fit["tokens"],
                "cal_scores": None if scores is None else scores.tolist(),
            },
            "diagnostics": self.diagnostics,
        }

    def save(self, path: str | Path, *, metadata: Mapping[str, Any] | None = None) -> Path:
        """Write the fitted estimator to ``path`` as JSON, atomically: settings, ``nu``,
        ``T``, the sorted calibration scores, the seed, the library version, the model's
        digest and the diagnostics. Never the weights. ``metadata`` (JSON-ready) is stored as
        is and comes back as :attr:`metadata` after :meth:`load`."""
        payload = self.to_dict()
        meta = dict(self.metadata if metadata is None else metadata)
        if meta:
            payload["metadata"] = jsonable(meta)
        return write_envelope(path, "SAClassifier", self.model, payload)

    @classmethod
    def load(cls, path: str | Path, model: nn.Module, output_fn: Any = None, *,
             strict: bool = True, progress: bool | None = None) -> SAClassifier:
        """Read an estimator written by :meth:`save` for ``model`` (same digest unless
        ``strict=False``). ``output_fn`` is not saved: pass the one used at fit time."""

        def build(obj: dict[str, Any]) -> SAClassifier:
            st, ft = obj["settings"], obj["fitted"]
            est = cls(model, output_fn, nu=st["nu"], temperature=st["temperature"],
                      score=st["score"], nu_range=tuple(st["nu_range"]),
                      n_samples=st["n_samples"], n_passes=st["n_passes"], seed=st["seed"],
                      ignore_index=st["ignore_index"], progress=progress,
                      **dict(st.get("calibrate_kwargs") or {}))
            nu, t, c = ft["nu"], float(ft["temperature"]), ft["n_classes"]
            if isinstance(nu, bool) or not isinstance(nu, int) or nu < 1:
                raise ValueError(f"fitted.nu must be an int >= 1, got {nu!r}")
            if not (math.isfinite(t) and t > 0):
                raise ValueError(f"fitted.temperature must be a finite float > 0, got {t!r}")
            if isinstance(c, bool) or not isinstance(c, int) or c < 2:
                raise ValueError(f"fitted.n_classes must be an int >= 2, got {c!r}")
            raw = ft["cal_scores"]
            scores = None
            if raw is not None:
                scores = torch.tensor([float(v) for v in raw], dtype=torch.float64)
                if (scores.numel() == 0 or not bool(torch.isfinite(scores).all())
                        or bool((scores[1:] < scores[:-1]).any())):
                    raise ValueError("fitted.cal_scores must be a non-empty sorted list of "
                                     "finite floats")
            est._fitted = {"nu": nu, "temperature": t, "n_classes": c,
                           "tokens": bool(ft["tokens"]), "cal_scores": scores}
            meta = obj.get("metadata") or {}
            if not isinstance(meta, dict):
                raise ValueError(f"metadata must be a JSON object, got {type(meta).__name__}")
            est.metadata = dict(meta)
            return est

        return read_fitted(path, "SAClassifier", model, strict=strict, build=build)

    def __repr__(self) -> str:
        state = "unfitted" if self._fitted is None else (
            f"nu={self._fitted['nu']}, temperature={self._fitted['temperature']:.4g}")
        return f"SAClassifier({type(self.model).__name__}, {state})"
