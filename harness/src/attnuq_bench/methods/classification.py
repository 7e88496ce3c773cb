r"""Classification methods on a frozen classifier: one class each, same interface as regression.

A classification :class:`~attnuq_bench.methods.Task` has ``kind="classification"``: its
``forward_fn(model, inputs)`` returns logits ``(B, K)`` (``K = 1``: one binary logit, the
probability of class 1 is its sigmoid; ``(B,)`` is read as ``(B, 1)``), or an output object
with a ``mean`` logit (the Levy classifier's :class:`~attnuq_bench.models.classifiers.LevyLogit`),
and its targets are class ids ``(B,)`` in ``[0, C)``, ``C = max(K, 2)``. Every method here
returns a :class:`ClassPredictive`: probabilities ``(B, C)`` (binary: ``[1 - p, p]``) and, for
the Monte Carlo ones, the per-draw probabilities ``(S, B, C)``.

============== ===========================================================================
``softmax``    the frozen model's softmax (sigmoid for one logit); the max-softmax baseline
``temperature`` temperature scaling (Guo et al. 2017): ``softmax(z / T)``, ``T`` by validation
               NLL (golden-section search on ``log T``; the NLL is convex in ``1 / T``)
``mc-dropout-cls`` the frozen model's dropout modules active at test time, ``S`` passes, the
               mean of the draws' probabilities
``ensemble-cls`` deep ensemble: ``M`` members retrained by the task's recipe, mean probability
``laplace-cls`` last-layer Laplace of laplace-torch (full Hessian, prior precision by marginal
               likelihood, GLM predictive with the probit link); one binary logit ``z`` is
               written as the two logits ``(0, z)``
``conformal-cls`` split conformal prediction sets on the frozen softmax (``score`` ``lac``,
               ``aps`` or ``raps``); its probabilities are the frozen softmax's
``sa-cls``     stochastic attention through :class:`attnuq.SAClassifier` (thin wrapper)
``levy``       the Levy classifier's one pass: ``sigmoid(mu / sqrt(1 + pi sigma^2 / 8))``
``levy-temperature`` the same divided by one temperature (validation NLL)
``levy-sigma`` sigma rescaled by ``k`` and a temperature, both by the validation NLL
============== ===========================================================================

Examples
--------
>>> import torch
>>> from torch import nn
>>> from attnuq_bench.methods import Task, make_method
>>> _ = torch.manual_seed(0)
>>> net = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3)).eval()
>>> x, y = torch.randn(60, 2), torch.randint(0, 3, (60,))
>>> task = Task(model=net, train=(x, y), val=(x, y), cal=(x, y), kind="classification")
>>> pred = make_method("temperature").fit(task).predict(x[:4])
>>> pred.probs.shape, bool(torch.allclose(pred.probs.sum(1), torch.ones(4).double()))
(torch.Size([4, 3]), True)
>>> make_method("mc-dropout-cls", n_samples=5).fit(task).predict(x[:4]).samples.shape
torch.Size([5, 4, 3])
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attnuq._validation import check_positive_int
from attnuq_bench.methods._base import Cost, Method, Task, seeded, split_batch
from attnuq_bench.methods.ensemble import DeepEnsemble
from attnuq_bench.methods.simple import MCDropout, dropout_active
from attnuq_bench.training import as_batches

__all__ = ["ClassPredictive", "ConformalSets", "DeepEnsembleClassifier", "FrozenSoftmax",
           "LaplaceClassifier", "LevyProbit", "LevyProbitTemperature", "LevySigmaScale",
           "MCDropoutClassifier", "SAClassifierAfter", "SAClassifierMethod",
           "TemperatureScaling", "collect_logits", "logits_of", "probs_from_logits"]


@dataclass
class ClassPredictive:
    """A categorical predictive: ``probs`` ``(B, C)`` and optional per-draw ``samples``
    ``(S, B, C)`` (probabilities of each draw; ``probs`` is their mean for the Monte Carlo
    methods).

    Entropies in nats: :attr:`entropy` ``H[p]`` ``(B,)``; :attr:`expected_entropy`
    ``E_s H[p_s]`` and :attr:`mutual_information` ``H[p] - E_s H[p_s]`` (``None`` without
    draws).

    >>> p = ClassPredictive(probs=torch.tensor([[0.5, 0.5]]),
    ...                     samples=torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]]))
    >>> round(float(p.entropy[0]), 4), float(p.expected_entropy[0]), round(float(
    ...     p.mutual_information[0]), 4)
    (0.6931, 0.0, 0.6931)
    """

    probs: torch.Tensor
    samples: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.probs.dim() != 2 or self.probs.shape[1] < 2:
            raise ValueError(f"probs must be (B, C) with C >= 2, got {tuple(self.probs.shape)}")
        if self.samples is not None and self.samples.shape[1:] != self.probs.shape:
            raise ValueError(f"samples must be (S, *{tuple(self.probs.shape)}), got "
                             f"{tuple(self.samples.shape)}")

    @staticmethod
    def _h(p: torch.Tensor) -> torch.Tensor:
        return -(p * torch.log(p.clamp_min(1e-12))).sum(-1)

    @property
    def entropy(self) -> torch.Tensor:
        return self._h(self.probs)

    @property
    def expected_entropy(self) -> torch.Tensor | None:
        return None if self.samples is None else self._h(self.samples).mean(0)

    @property
    def mutual_information(self) -> torch.Tensor | None:
        ee = self.expected_entropy
        return None if ee is None else (self.entropy - ee).clamp_min(0)


def probs_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Class probabilities ``(..., C)`` of logits ``(..., K)``: softmax, or for ``K = 1`` the
    sigmoid written as ``[1 - p, p]``; logits are divided by ``temperature`` first.

    >>> probs_from_logits(torch.tensor([[0.0]])).tolist()
    [[0.5, 0.5]]
    """
    z = logits.double() / temperature
    if z.shape[-1] == 1:
        p = torch.sigmoid(z)
        return torch.cat([1 - p, p], dim=-1)
    return torch.softmax(z, dim=-1)


def logits_of(task: Task, model: nn.Module, inputs: Any) -> torch.Tensor:
    """The logits ``(B, K)`` of ``model`` on ``inputs`` through the task's ``forward_fn`` (an
    output object gives its ``mean``; ``(B,)`` becomes ``(B, 1)``)."""
    out = task.forward(model, inputs)
    if out.dim() == 1:
        out = out[:, None]
    if out.dim() != 2:
        raise ValueError(f"a classifier's forward_fn must give logits (B, K), got "
                         f"{tuple(out.shape)}")
    return out


def collect_logits(task: Task, model: nn.Module, batches: Any
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``(N, K)`` (float64, eval mode, no gradients) and targets ``(N,)`` over
    ``batches``; the targets are checked to be class ids in ``[0, max(K, 2))``."""
    zs, ys = [], []
    was = model.training
    model.eval()
    with torch.no_grad():
        for batch in as_batches(batches):
            x, y = split_batch(batch)
            zs.append(logits_of(task, model, x).double().cpu())
            ys.append(y.cpu())
    model.train(was)
    if not zs:
        raise ValueError("empty data: no batches")
    z, y = torch.cat(zs), torch.cat(ys)
    check_targets(y, max(z.shape[1], 2))
    return z, y.long()


def check_targets(y: torch.Tensor, n_classes: int) -> None:
    """Raise unless ``y`` holds integer class ids in ``[0, n_classes)``."""
    if y.is_floating_point():
        if not bool((y == y.round()).all()):
            raise ValueError(f"targets must be integer class ids, got e.g. "
                             f"{y[y != y.round()][0].item()!r}")
    bad = (y < 0) | (y >= n_classes)
    if bool(bad.any()):
        raise ValueError(f"targets must lie in [0, {n_classes}), got {y[bad][0].item()!r}")


def _nll(z: torch.Tensor, y: torch.Tensor, temperature: float) -> float:
    p = probs_from_logits(z, temperature)
    return float(-torch.log(p.gather(1, y[:, None]).clamp_min(1e-300)).mean())


def fit_temperature_nll(z: torch.Tensor, y: torch.Tensor, *, log_range: tuple[float, float] = (
        -4.0, 4.0), iters: int = 80) -> float:
    """The temperature minimising the NLL of ``softmax(z / T)`` (golden section on ``log T``;
    the NLL is convex in ``1 / T``, so unimodal in ``log T``).

    >>> g = torch.Generator().manual_seed(0)
    >>> z = torch.randn(4000, 3, generator=g, dtype=torch.float64)
    >>> y = torch.multinomial(torch.softmax(z, 1), 1, generator=g)[:, 0]
    >>> 0.9 < fit_temperature_nll(3 * z, y) / 3 < 1.1   # logits 3x too sharp
    True
    """
    a, b = log_range
    gr = (math.sqrt(5) - 1) / 2
    c, d = b - gr * (b - a), a + gr * (b - a)
    fc, fd = _nll(z, y, math.exp(c)), _nll(z, y, math.exp(d))
    for _ in range(iters):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - gr * (b - a)
            fc = _nll(z, y, math.exp(c))
        else:
            a, c, fc = c, d, fd
            d = a + gr * (b - a)
            fd = _nll(z, y, math.exp(d))
    return math.exp((a + b) / 2)


class _ClassMethod(Method):
    """Base of the classification methods: refuses regression tasks."""

    task_kinds = ("classification",)

    def predict(self, inputs: Any) -> ClassPredictive:  # type: ignore[override]
        return super().predict(inputs)  # type: ignore[return-value]


class FrozenSoftmax(_ClassMethod):
    """The frozen model's class probabilities (one pass)."""

    implementation = "attnuq (softmax / sigmoid of the frozen logits)"

    def _fit(self, task: Task) -> Cost | None:
        return None

    def _predict(self, task: Task, inputs: Any) -> tuple[Any, int]:
        with torch.no_grad():
            z = logits_of(task, task.model.eval(), inputs)
        return ClassPredictive(probs=probs_from_logits(z)), 1


class TemperatureScaling(_ClassMethod):
    """``softmax(z / T)`` with ``T`` minimising the validation NLL (:func:`fit_temperature_nll`)."""

    implementation = ("attnuq (golden section on log T over the validation NLL); agrees with "
                      "torch-uncertainty 0.13 TemperatureScaler (tests/attnuq_bench/methods/"
                      "test_classification_methods.py)")

    def __init__(self) -> None:
        super().__init__()
        self.temperature: float | None = None

    def _fit(self, task: Task) -> Cost | None:
        z, y = collect_logits(task, task.model, task.val)
        self.cost.fit_forward += y.shape[0]
        self.temperature = fit_temperature_nll(z, y)
        return None

    def _predict(self, task: Task, inputs: Any) -> tuple[Any, int]:
        assert self.temperature is not None
        with torch.no_grad():
            z = logits_of(task, task.model.eval(), inputs)
        return ClassPredictive(probs=probs_from_logits(z, self.temperature)), 1

    def info(self) -> dict[str, Any]:
        return {"temperature": self.temperature}


class MCDropoutClassifier(_ClassMethod, MCDropout):
    """MC dropout (as :class:`~attnuq_bench.methods.MCDropout`): only the dropout modules
    active, ``n_samples`` seeded passes; the draws' probabilities ``(S, B, C)`` and their
    mean."""

    implementation = ("attnuq (attnuq_bench.methods.simple.dropout_active, as mc-dropout; "
                      "mean of the passes' probabilities)")

    def __init__(self, n_samples: int = 50, seed: int = 0) -> None:
        super().__init__(n_samples, seed)

    def _predict(self, task: Task, inputs: Any) -> tuple[Any, int]:
        model = task.model.eval()
        with seeded(self.seed), torch.no_grad(), dropout_active(model):
            s = torch.stack([probs_from_logits(logits_of(task, model, inputs))
                             for _ in range(self.n_samples)])  # (S, B, C)
        return ClassPredictive(probs=s.mean(0), samples=s), self.n_samples


class DeepEnsembleClassifier(_ClassMethod, DeepEnsemble):
    """Deep ensemble of ``n_members`` backbones (member 0 = the frozen model; the others from
    ``task.member(seed)``, as :class:`~attnuq_bench.methods.DeepEnsemble`); the members'
    probabilities and their mean."""

    implementation = "attnuq (members retrained with the suite's recipe; mean probability)"

    def _predict(self, task: Task, inputs: Any) -> tuple[Any, int]:
        with torch.no_grad():
            s = torch.stack([probs_from_logits(logits_of(task, m.eval(), inputs))
                             for m in self._models])  # (M, B, C)
        return ClassPredictive(probs=s.mean(0), samples=s), len(self._models)


def _two_logit_copy(model: nn.Module) -> nn.Module:
    """A copy of a one-logit model whose last ``nn.Linear`` gives ``(0, z)`` instead of ``z``
    (softmax of ``(0, z)`` is ``sigmoid(z)``), so a K-class method can treat it."""
    from attnuq_bench.methods.laplace import find_last_linear

    m = copy.deepcopy(model).eval()
    name, lin = find_last_linear(m)
    two = nn.Linear(lin.in_features, 2, bias=lin.bias is not None).to(lin.weight)
    with torch.no_grad():
        two.weight.zero_()
        two.weight[1] = lin.weight[0]
        if lin.bias is not None:
            two.bias.zero_()
            two.bias[1] = lin.bias[0]
    parent, _, attr = name.rpartition(".")
    setattr(m.get_submodule(parent) if parent else m, attr, two)
    return m


class LaplaceClassifier(_ClassMethod):
    """Last-layer Laplace from laplace-torch: ``Laplace(model, "classification",
    subset_of_weights="last_layer", hessian_structure="full")`` fitted on the training part,
    prior precision by ``optimize_prior_precision(method="marglik")``, predictive
    ``pred_type="glm", link_approx="probit"``. The model must take a tensor input and return
    its logits (``model(x)``, laplace-torch's convention); a one-logit model is rewritten
    with the two logits ``(0, z)`` (:func:`_two_logit_copy`)."""

    implementation = ("laplace-torch 0.3 (Laplace(..., 'classification', last_layer, full), "
                      "marglik prior precision, GLM predictive, probit link)")

    def __init__(self, batch_size: int = 256) -> None:
        super().__init__()
        self.batch_size = check_positive_int(batch_size, "batch_size")
        self._la: Any = None
        self.prior_precision: float | None = None

    def _fit(self, task: Task) -> Cost | None:
        from laplace import Laplace
        from torch.utils.data import DataLoader, TensorDataset

        xs, ys = [], []
        for batch in as_batches(task.train):
            x, y = split_batch(batch)
            if not isinstance(x, torch.Tensor):
                raise NotImplementedError(
                    f"laplace-cls needs tensor inputs (laplace-torch calls model(x)), got "
                    f"{type(x).__name__}")
            xs.append(x)
            ys.append(y.long())
        x, y = torch.cat(xs), torch.cat(ys)
        with torch.no_grad():
            k = logits_of(task, task.model.eval(), x[:2]).shape[1]
        model = _two_logit_copy(task.model) if k == 1 else copy.deepcopy(task.model).eval()
        with torch.no_grad():  # laplace-torch calls model(x): check it gives the task's logits
            ref = probs_from_logits(logits_of(task, task.model, x[:4]))
            got = torch.softmax(model(x[:4]).double(), -1)
        if not torch.allclose(ref, got, atol=1e-5):
            raise NotImplementedError("laplace-cls needs model(x) to be the task's logits")
        loader = DataLoader(TensorDataset(x, y), batch_size=self.batch_size)
        la = Laplace(model, "classification", subset_of_weights="last_layer",
                     hessian_structure="full")
        la.fit(loader)
        la.optimize_prior_precision(method="marglik", pred_type="glm", link_approx="probit")
        self._la = la
        self.prior_precision = float(la.prior_precision.reshape(-1)[0])
        self.cost.fit_forward += int(y.shape[0])
        return None

    def _predict(self, task: Task, inputs: Any) -> tuple[Any, int]:
        with torch.no_grad():
            p = self._la(inputs, pred_type="glm", link_approx="probit")
        return ClassPredictive(probs=p.double()), 1

    def info(self) -> dict[str, Any]:
        return {"prior_precision": self.prior_precision}


class ConformalSets(FrozenSoftmax):
    """Split conformal prediction sets on the frozen softmax (:meth:`predict_set`), the
    threshold from the ``cal`` part by the library's conformal scores (``lac``, ``aps``,
    ``raps``); :meth:`predict` is the frozen softmax."""

    implementation = "attnuq.conformal (split conformal sets on the frozen softmax)"

    def __init__(self, score: str = "lac") -> None:
        super().__init__()
        if score not in ("lac", "aps", "raps"):
            raise ValueError(f"score must be 'lac', 'aps' or 'raps', got {score=!r}")
        self.score = score
        self._cal: tuple[torch.Tensor, torch.Tensor] | None = None

    def _fit(self, task: Task) -> Cost | None:
        z, y = collect_logits(task, task.model, task.cal)
        self.cost.fit_forward += y.shape[0]
        self._cal = (probs_from_logits(z), y)
        return None

    def cal_probs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The calibration part's frozen probabilities ``(n, C)`` and labels ``(n,)``."""
        if self._cal is None:
            raise RuntimeError("conformal-cls is not fitted: call fit(task) first")
        return self._cal


class SAClassifierMethod(_ClassMethod):
    """Stochastic attention through :class:`attnuq.SAClassifier` (a thin wrapper):
    ``SAClassifier(task.model, output_fn=...).fit(task.val, task.cal)``; ``predict`` gives its
    Monte Carlo mean probability and the draws, :meth:`predict_set` its sets. Keywords go to
    the estimator (``score``, ``n_samples``, ...). The fit's example-forward passes are the
    estimator's ``diagnostics["forward_passes"]`` (per example) times the validation and
    calibration rows."""

    implementation = ("attnuq.SAClassifier (fit(val, cal): nu by the validation NLL of the MC "
                      "mean probability with a joint temperature; predict; predict_set)")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.kwargs = {"progress": False, **kwargs}
        self.clf: Any = None

    def _fit(self, task: Task) -> Cost | None:
        import attnuq

        self.clf = attnuq.SAClassifier(task.model, output_fn=_logits_output(task),  # type: ignore[attr-defined]
                                       **self.kwargs)
        self.clf.fit(list(as_batches(task.val)), list(as_batches(task.cal)))
        d = self.clf.diagnostics
        rows = int(d.get("n_val", 0)) + int(d.get("n_cal", 0))
        self.cost.fit_forward += int(d.get("forward_passes", 0)) * rows
        return None

    def _predict(self, task: Task, inputs: Any) -> tuple[Any, int]:
        pred = self.clf.predict(inputs)
        return (ClassPredictive(probs=pred.probs.double(), samples=pred.samples.double()),
                int(pred.samples.shape[0]) + 1)

    def predict_set(self, inputs: Any, alpha: float) -> torch.Tensor:
        return self.clf.predict_set(inputs, alpha=alpha)

    def info(self) -> dict[str, Any]:
        if self.clf is None:
            return {}
        d = self.clf.diagnostics
        keep = ("nu", "nu_at_edge", "temperature", "temperature_rule", "forward_passes",
                "fit_seconds", "val", "val_mean_mutual_information", "n_val", "n_cal")
        return {k: d[k] for k in keep if k in d}


def _logits_output(task: Task) -> Any:
    """``output_fn`` of the estimator: the task's ``forward_fn`` reads the model's output the
    same way (a tensor of logits, or an object's ``mean``)."""
    from attnuq_bench.training import output_mean

    def output_fn(out: Any) -> torch.Tensor:
        return output_mean(out)

    return output_fn


class SAClassifierAfter(SAClassifierMethod):
    """The temperature-rule ablation of :class:`SAClassifierMethod`: ``temperature="after"``
    (``nu`` chosen on the validation NLL at ``T = 1``, then ``T`` fitted at that ``nu``)."""

    implementation = ("attnuq.SAClassifier(temperature='after') (ablation: nu by the validation "
                      "NLL at T = 1, then the temperature)")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{"temperature": "after", **kwargs})


class LevyProbit(_ClassMethod):
    """The Levy classifier's one pass: ``sigmoid(mu / sqrt(1 + pi sigma^2 / 8))`` of the
    logit's mean and sigma (:func:`attnuq_bench.models.classifiers.probit_probability`'s formula;
    ``forward_fn`` must return an object with ``mean`` and ``sigma`` ``(B,)``)."""

    implementation = "attnuq (LevyAttention closed-form mean and sigma, probit approximation)"

    def _fit(self, task: Task) -> Cost | None:
        return None

    def _mean_sigma(self, task: Task, inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The logit's mean and sigma ``(B,)`` float64 (eval mode, no gradients)."""
        with torch.no_grad():
            out = task.forward_fn(task.model.eval(), inputs)
        mu, sd = getattr(out, "mean", None), getattr(out, "sigma", None)
        if not isinstance(mu, torch.Tensor) or not isinstance(sd, torch.Tensor):
            raise TypeError(f"levy needs a forward_fn output with mean and sigma tensors, got "
                            f"{type(out).__name__}")
        return mu.double().reshape(-1), sd.double().reshape(-1)

    @staticmethod
    def _probit(mu: torch.Tensor, sd: torch.Tensor, k: float = 1.0) -> torch.Tensor:
        """``mu / sqrt(1 + pi (k sigma)^2 / 8)`` ``(B,)``, sigma scaled by ``k``."""
        return mu / torch.sqrt(1.0 + math.pi * (k * sd) ** 2 / 8.0)

    def _probit_logit(self, task: Task, inputs: Any) -> torch.Tensor:
        """``mu / sqrt(1 + pi sigma^2 / 8)`` ``(B,)`` float64 (eval mode, no gradients)."""
        return self._probit(*self._mean_sigma(task, inputs))

    def _val_mean_sigma(self, task: Task) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The logit's mean and sigma and the class ids ``(N,)`` over the validation part
        (its forward passes counted in the fit cost)."""
        mus, sds, ys = [], [], []
        for batch in as_batches(task.val):
            x, y = split_batch(batch)
            mu, sd = self._mean_sigma(task, x)
            mus.append(mu)
            sds.append(sd)
            ys.append(y.reshape(-1).long().cpu())
        y = torch.cat(ys)
        self.cost.fit_forward += y.shape[0]
        return torch.cat(mus), torch.cat(sds), y

    def _predict(self, task: Task, inputs: Any) -> tuple[Any, int]:
        z = self._probit_logit(task, inputs)
        return ClassPredictive(probs=probs_from_logits(z[:, None])), 1


class LevyProbitTemperature(LevyProbit):
    """:class:`LevyProbit` with a temperature: ``sigmoid(mu / (T sqrt(1 + pi sigma^2 / 8)))``,
    ``T`` minimising the validation NLL (:func:`fit_temperature_nll`).

    The Levy counterpart of :class:`attnuq.SAClassifier`'s temperature: the closed-form sigma
    widens each prediction by its own amount, one temperature corrects the over- or
    under-confidence the training left everywhere. ``T = 1`` is in the searched range, so on
    the validation part it is never worse than the one-pass probit."""

    implementation = ("attnuq (LevyAttention closed-form mean and sigma, probit approximation, "
                      "one temperature by golden section on the validation NLL)")

    def __init__(self) -> None:
        super().__init__()
        self.temperature: float | None = None

    def _fit(self, task: Task) -> Cost | None:
        mu, sd, y = self._val_mean_sigma(task)
        self.temperature = fit_temperature_nll(self._probit(mu, sd)[:, None], y)
        return None

    def _predict(self, task: Task, inputs: Any) -> tuple[Any, int]:
        assert self.temperature is not None
        z = self._probit_logit(task, inputs)
        return ClassPredictive(probs=probs_from_logits(z[:, None], self.temperature)), 1

    def info(self) -> dict[str, Any]:
        return {"temperature": self.temperature}


#: the sigma scales :class:`LevySigmaScale` searches, fixed before any score was read: 0 drops
#: sigma (the mean logit), 1 is sigma as trained (``levy-temperature``), then powers of 2
SIGMA_SCALES: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


class LevySigmaScale(LevyProbit):
    r"""The one-pass probit with the logit's sigma rescaled and a temperature, both by the
    validation NLL: ``sigmoid(mu / (T sqrt(1 + pi (k sigma)^2 / 8)))``.

    The closed-form sigma of a logit summed over many queries is small next to its mean (the
    queries' independent noises average out), so as trained it barely moves the probability.
    ``k`` asks the validation data how much of it to use: every ``k`` of :data:`SIGMA_SCALES`
    (``0``: the mean logit; ``1``: :class:`LevyProbitTemperature`) gets its NLL-optimal ``T``,
    and the ``k`` of the lowest validation NLL is kept (ties: the smaller ``k``). With ``k > 1``
    sigma acts as a per-example temperature; whether it also ranks the errors is what
    ``info()`` reports on the validation part: the Spearman correlation of sigma with
    ``|y - p|`` and the AUROC of sigma for separating wrong from right predictions (0.5: no
    information), beside the same AUROC of ``1 - max p`` (``p`` the one-pass probit). Where
    the inputs carry an observation ``mask`` ``(B, N)`` (the irregular series' events), also
    why: the Spearman correlation of sigma with the number of observations ``n_obs`` (sigma
    shrinks as the Poisson evidence grows) and of ``n_obs`` with ``|y - p|`` (whether the
    well-observed examples are the easy ones); ``None`` without a mask.

    >>> import torch
    >>> from types import SimpleNamespace as NS
    >>> from attnuq_bench.methods import Task
    >>> g = torch.Generator().manual_seed(0)
    >>> mu, sd = 3 * torch.randn(400, generator=g), torch.rand(400, generator=g)
    >>> y = (torch.rand(400, generator=g) < torch.sigmoid(mu / 2)).long()
    >>> task = Task(model=torch.nn.Identity(), train=(mu, y), val=(mu, y), cal=(mu, y),
    ...             forward_fn=lambda m, x: NS(mean=x, sigma=sd[: len(x)]),
    ...             kind="classification")
    >>> m = LevySigmaScale().fit(task)
    >>> sorted(m.info()) == ["error_auroc_max_p_val", "error_auroc_sigma_val", "nll_by_scale",
    ...                      "sigma_scale", "spearman_nobs_error_val", "spearman_sigma_error_val",
    ...                      "spearman_sigma_nobs_val", "temperature"]
    True
    >>> m.info()["spearman_sigma_nobs_val"] is None  # these inputs carry no mask
    True
    >>> m.info()["sigma_scale"] in SIGMA_SCALES
    True
    """

    implementation = ("attnuq (LevyAttention closed-form mean and sigma, probit approximation; "
                      "sigma's scale k from a fixed grid and one temperature by the validation "
                      "NLL)")

    def __init__(self) -> None:
        super().__init__()
        self.temperature: float | None = None
        self.sigma_scale: float | None = None
        self._info: dict[str, Any] = {}

    def _fit(self, task: Task) -> Cost | None:
        from attnuq import metrics
        from attnuq.estimators._common import spearman

        mu, sd, y = self._val_mean_sigma(task)
        nlls: dict[float, tuple[float, float]] = {}
        for k in SIGMA_SCALES:
            z = self._probit(mu, sd, k)[:, None]
            t = fit_temperature_nll(z, y)
            nlls[k] = (_nll(z, y, t), t)
        best = min(SIGMA_SCALES, key=lambda k: (nlls[k][0], k))
        self.sigma_scale, self.temperature = best, nlls[best][1]
        p1 = probs_from_logits(self._probit(mu, sd)[:, None])[:, 1]
        wrong = ((p1 > 0.5).long() != y).long()
        both = bool(0 < int(wrong.sum()) < len(wrong))
        err = (y.double() - p1).abs()
        n_obs = self._val_n_obs(task)
        self._info = {
            "nll_by_scale": {f"{k:g}": round(v[0], 6) for k, v in nlls.items()},
            "spearman_sigma_error_val": spearman(sd, err),
            "spearman_sigma_nobs_val": None if n_obs is None else spearman(sd, n_obs),
            "spearman_nobs_error_val": None if n_obs is None else spearman(n_obs, err),
            "error_auroc_sigma_val": float(metrics.auroc(sd, wrong)) if both else None,
            "error_auroc_max_p_val": (float(metrics.auroc(1 - torch.maximum(p1, 1 - p1), wrong))
                                      if both else None),
        }
        return None

    @staticmethod
    def _val_n_obs(task: Task) -> torch.Tensor | None:
        """Observations per validation example ``(N,)`` float64 from the inputs' ``mask``
        (an attribute or a dict key, ``(B, N)``), or ``None`` where a batch has none."""
        counts = []
        for batch in as_batches(task.val):
            x, _ = split_batch(batch)
            mask = x.get("mask") if isinstance(x, dict) else getattr(x, "mask", None)
            if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
                return None
            counts.append(mask.reshape(mask.shape[0], -1).double().sum(1).cpu())
        return torch.cat(counts) if counts else None

    def _predict(self, task: Task, inputs: Any) -> tuple[Any, int]:
        assert self.temperature is not None and self.sigma_scale is not None
        z = self._probit(*self._mean_sigma(task, inputs), self.sigma_scale)
        return ClassPredictive(probs=probs_from_logits(z[:, None], self.temperature)), 1

    def info(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "sigma_scale": self.sigma_scale, **self._info}
