"""Uncertainty baselines behind one interface: ``make_method(name).fit(task).predict(inputs)``.

A :class:`Task` holds the frozen trained model, its data (``train``/``val``/``cal`` batches of
``(inputs, targets)``), ``forward_fn`` and, for methods that retrain, ``make_model(seed)`` and
``train_fn``; it is generic over inputs (tensor, tuple, dict) and output shapes (``(B,)``,
``(B, horizon, channels)``, ``(B, lat, lon)``). ``predict`` returns a
:class:`~attnuq.predictive.Predictive` (samples ``(S, B, ...)``) or a
:class:`~attnuq.predictive.GaussianPredictive`; ``method.cost`` books the extra cost.

Registered names (:func:`available_methods`):

============== =============================================================================
``sa``         the recommended SA: ``nu`` by the ``"auto"`` criterion (debiased ``L_SA`` on
               low-dimensional outputs), draws recentred on the frozen output, a conformal
               floor under the spread (``beta`` on ``val``, factor on ``cal``)
``sa-centre``  ``sa`` with ``recentre="auto"``: the centre (frozen output or the draws' mean)
               chosen with the form by the cross-fitted validation CRPS
``sa-paper``   stochastic attention, ``nu`` by the paper's ``L_SA`` (BO search)
``sa-debiased`` SA, ``nu`` by the debiased ``L_SA`` (``"paper-debiased"``)
``sa-recentred`` ``sa-paper`` with its draws recentred on the frozen output (mean)
``sa-floor``   ``sa-paper`` with the conformal floor of ``sa``
``sa-scale``   SA, ``nu`` by matching the perturbation scale to the residual scale
``sa-crps``    SA, ``nu`` by minimum CRPS
``sa-coverage`` SA, ``nu`` by the val coverage of the passes' Student-t 95 % interval
``sa-conformal`` SA (``L_SA``) + split-conformal scaling on the ``cal`` part
``sa-layer``   SA with a per-layer ``nu_l = nu_0 r^(l/(L-1))`` (CRPS; ablation of ``sa-crps``)
``mc-dropout`` dropout active at test time on the frozen model
``ensemble``   deep ensemble of 5 retrained backbones (Gaussian over members)
``swag``       SWAG around the frozen model (own code; agrees with torch-uncertainty's)
``multiswag``  SWAG around each of 5 ensemble members
``ivon``       IVON variational training (``ivon-opt``)
``laplace``    exact closed-form last-layer Laplace (agrees with laplace-torch)
``hsa``        Gumbel-softmax attention trained end to end (after Pei et al. 2022)
``conformal``  split conformal on absolute residuals, per output coordinate
``gaussian``   homoscedastic Gaussian, sigma from validation residuals
============== =============================================================================

Classification (a :class:`Task` with ``kind="classification"``: logits in, class ids as
targets; each returns a :class:`~attnuq.methods.classification.ClassPredictive`):
``softmax`` (frozen), ``temperature``, ``mc-dropout-cls``, ``ensemble-cls``, ``laplace-cls``
(laplace-torch), ``conformal-cls`` (sets on the frozen softmax), ``sa-cls``
(:class:`attnuq.SAClassifier`), ``levy`` (the Levy classifier's probit pass); see
:mod:`attnuq.methods.classification`.

One name is one method in every suite (UCI, ETT, ERA5, PhysioNet choose methods by name only):
``conformal`` is per output coordinate, so the multi-output suites use it as it is;
``make_method("sa-conformal", base=sa)`` shares a fitted ``sa-paper``'s ``nu`` and its test
draws (``derive``: one set of draws scores both rows); batches may be objects with ``targets``
(PhysioNet's ``ForecastBatch``) and model outputs objects with ``mean`` (the Levy
forecaster's ``ForecastOutput``), so ``mc-dropout`` and ``ensemble`` run on the PhysioNet
forecasters. Methods train backbones through :mod:`attnuq_bench.training` and never import
:mod:`attnuq.models`.

Examples
--------
>>> from attnuq_bench.methods import make_method
>>> make_method("sa-crps").criterion
'crps'
"""

from attnuq_bench.methods._base import (
    Cost,
    Method,
    PredictiveLike,
    Task,
    available_methods,
    collect,
    make_method,
    method_implementation,
    register_method,
)
from attnuq_bench.methods.classification import (
    ClassPredictive,
    ConformalSets,
    DeepEnsembleClassifier,
    FrozenSoftmax,
    LaplaceClassifier,
    LevyProbit,
    LevyProbitTemperature,
    LevySigmaScale,
    MCDropoutClassifier,
    SAClassifierAfter,
    SAClassifierMethod,
    TemperatureScaling,
)
from attnuq_bench.methods.coverage import coverage_scale, needed_scales
from attnuq_bench.methods.ensemble import DeepEnsemble
from attnuq_bench.methods.hsa import HSA, gumbel_attention
from attnuq_bench.methods.ivon import IVONMethod
from attnuq_bench.methods.laplace import LastLayerLaplace
from attnuq_bench.methods.sa import (
    RecommendedSA,
    RecommendedSAAutoCentre,
    StochasticAttention,
)
from attnuq_bench.methods.simple import (
    HomoscedasticGaussian,
    MCDropout,
    ResidualQuantiles,
    SplitConformal,
)
from attnuq_bench.methods.swag import SWAG, MultiSWAG, SWAGCollector

register_method("sa", RecommendedSA)
register_method("sa-paper", StochasticAttention, criterion="paper")
register_method("sa-debiased", StochasticAttention, criterion="paper-debiased")
register_method("sa-recentred", StochasticAttention, criterion="paper", recentre="mean")
register_method("sa-floor", StochasticAttention, criterion="paper", floor=True)
register_method("sa-scale", StochasticAttention, criterion="scale")
register_method("sa-crps", StochasticAttention, criterion="crps")
register_method("sa-coverage", StochasticAttention, criterion="coverage")
register_method("sa-conformal", StochasticAttention, criterion="paper", conformal=True)
register_method("sa-layer", StochasticAttention, criterion="crps", per_layer="geometric")
register_method("sa-centre", RecommendedSAAutoCentre)
register_method("mc-dropout", MCDropout)
register_method("ensemble", DeepEnsemble)
register_method("swag", SWAG)
register_method("multiswag", MultiSWAG)
register_method("ivon", IVONMethod)
register_method("laplace", LastLayerLaplace)
register_method("hsa", HSA)
register_method("conformal", SplitConformal)
register_method("gaussian", HomoscedasticGaussian)
# classification (Task(kind="classification"); attnuq.methods.classification)
register_method("softmax", FrozenSoftmax)
register_method("temperature", TemperatureScaling)
register_method("mc-dropout-cls", MCDropoutClassifier)
register_method("ensemble-cls", DeepEnsembleClassifier)
register_method("laplace-cls", LaplaceClassifier)
register_method("conformal-cls", ConformalSets)
register_method("sa-cls", SAClassifierMethod)
register_method("sa-cls-after", SAClassifierAfter)
register_method("levy", LevyProbit)
register_method("levy-temperature", LevyProbitTemperature)
register_method("levy-sigma", LevySigmaScale)

__all__ = [
    "HSA",
    "SWAG",
    "ClassPredictive",
    "ConformalSets",
    "Cost",
    "DeepEnsemble",
    "DeepEnsembleClassifier",
    "FrozenSoftmax",
    "HomoscedasticGaussian",
    "IVONMethod",
    "LaplaceClassifier",
    "LastLayerLaplace",
    "LevyProbit",
    "LevyProbitTemperature",
    "LevySigmaScale",
    "MCDropout",
    "MCDropoutClassifier",
    "Method",
    "MultiSWAG",
    "PredictiveLike",
    "RecommendedSA",
    "RecommendedSAAutoCentre",
    "ResidualQuantiles",
    "SAClassifierAfter",
    "SAClassifierMethod",
    "SWAGCollector",
    "SplitConformal",
    "StochasticAttention",
    "Task",
    "TemperatureScaling",
    "available_methods",
    "collect",
    "coverage_scale",
    "gumbel_attention",
    "make_method",
    "method_implementation",
    "needed_scales",
    "register_method",
]
