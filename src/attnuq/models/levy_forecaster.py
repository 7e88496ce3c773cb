"""Irregular-time-series forecaster whose last layer is Levy attention, and its softmax control.

Architecture (shared by both models, ``d`` = width, ``C`` = channels)
---------------------------------------------------------------------
* time features ``f(t) = [sin(2 pi t / P_k), cos(2 pi t / P_k)]``, learned periods, ``t`` in hours;
* encoder: each observation ``(t_i, c_i, x_i)`` -> ``e_i = MLP([f(t_i), E_c[c_i], x_i])`` ``(d,)``,
  optionally followed by ``encoder_layers`` pre-norm transformer layers over the observations of a
  stay (key-padding mask);
* query ``(t_q, c_q)`` -> ``u_q = MLP([f(t_q), E_c[c_q]])``;
* last layer (one head): keys ``k_i = W_k e_i``, queries ``W_q u_q``, values in *output space*
  ``a_i = W_a e_i`` ``(C,)``: the output projection is folded into the value map, so the forecast of
  query ``q`` is component ``c_q`` of the attention output plus a per-channel bias ``b_c``.

:class:`LevyForecaster` uses :func:`attnuq.ops.levy_attention` in that layer (cosine
compatibility ``w = alpha exp(beta (cos - 1))``, Gaussian mollifier ``h``, Fourier value field
``V_i(t) = a_i + D g(t)``) and returns, per query, ``mu = mean[c_q] + b_c`` and the exact
``sigma = sqrt(Sigma_V,cc(q) phi(Lambda_q))`` (the bias is deterministic, so it does not change
the variance), the evidence ``Lambda_q`` and ``sqrt(Sigma_V,cc)`` (``sigma`` without ``phi``).
:class:`SoftmaxForecaster` is the matched control: same encoder, query map and value map, scaled
dot-product softmax attention with attention dropout, no uncertainty of its own (MC dropout and
ensembles give it one).

Training: :func:`forward_batch` runs a model on a batch of stays; the loss is the masked MSE of
``mu`` over every forecast point of a batch (exact gradients through the expected output), plus,
for the Levy model, ``nll_weight`` times the Gaussian NLL of ``N(mu, sigma^2 + eps)``. The
benchmark harness trains both models this way with Adam, the gradient norm clipped to 5 and early
stopping on the validation masked MSE.
:func:`fit_temperature` fits the one temperature ``T`` of
``N(mu, (T sigma)^2)`` on validation in closed form, ``T^2 = mean((y - mu)^2 / sigma^2)``, which is
the exact minimiser of the Gaussian NLL over ``T``.

``alpha`` and the MSE loss: ``p_qi = w_qi / Lambda_q`` and ``w_qi`` is proportional to ``alpha``,
so ``mu`` does not depend on ``alpha`` and MSE-only training leaves it at its initial value
(zero gradient). ``alpha`` only enters ``sigma`` through ``phi(Lambda_q)``, ``Lambda_q = alpha
S_q`` with ``S_q = sum_i exp(beta (cos - 1))``. Two ways to fit it: a training NLL term
(``nll_weight > 0``), or the two-stage fit :func:`fit_alpha_temperature` (``alpha`` and ``T``
jointly by validation NLL after MSE training, the same way ``T`` alone is fitted), applied to a
model with :meth:`LevyForecaster.set_alpha`.

Examples
--------
>>> import torch
>>> from attnuq.models.levy_forecaster import LevyForecaster
>>> m = LevyForecaster(n_channels=3, d=16)
>>> B, L, Q = 2, 5, 4
>>> out = m(torch.rand(B, L) * 24, torch.randint(0, 3, (B, L)), torch.rand(B, L),
...         torch.ones(B, L, dtype=torch.bool), 24 + torch.rand(B, Q) * 24,
...         torch.randint(0, 3, (B, Q)))
>>> out.mean.shape, out.sigma.shape
(torch.Size([2, 4]), torch.Size([2, 4]))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from attnuq._validation import check_finite, check_positive_int
from attnuq.ops.levy import levy_attention, levy_attention_sample

__all__ = [
    "ForecastOutput",
    "LevyForecaster",
    "SoftmaxForecaster",
    "fit_alpha_temperature",
    "fit_temperature",
    "forecast_loss",
    "forward_batch",
]

#: the training scores of :func:`forecast_loss`
SCORES = ("crps", "nll")

@dataclass(frozen=True)
class ForecastOutput:
    """Per-query forecasts, all ``(B, Q)`` (padding positions hold finite junk).

    ``sigma`` is ``sqrt(Sigma_V,cc phi(Lambda))`` for the Levy model and ``None`` for the control:
    the spread of the sampled operator conditional on at least one atom; ``sigma_nophi`` is
    ``sqrt(Sigma_V,cc)`` (the disagreement term alone); ``evidence`` is ``Lambda_q``, ``p_empty``
    ``exp(-Lambda_q)``; ``sigma_total`` is ``sqrt((1 - p_empty) sigma^2 + p_empty s0_c^2)``, the
    spread when an empty measure (no atom, probability ``p_empty``) falls back on the channel's
    prior scale ``s0_c`` (:attr:`LevyForecaster.prior_std`): it grows as the evidence vanishes.
    """

    mean: torch.Tensor
    sigma: torch.Tensor | None = None
    sigma_nophi: torch.Tensor | None = None
    evidence: torch.Tensor | None = None
    p_empty: torch.Tensor | None = None
    sigma_total: torch.Tensor | None = None


class _Batch(Protocol):
    obs_times: torch.Tensor
    obs_channels: torch.Tensor
    obs_values: torch.Tensor
    obs_mask: torch.Tensor
    query_times: torch.Tensor
    query_channels: torch.Tensor
    targets: torch.Tensor
    query_mask: torch.Tensor


def _check_inputs(
    n_channels: int,
    obs_times: torch.Tensor,
    obs_channels: torch.Tensor,
    obs_values: torch.Tensor,
    obs_mask: torch.Tensor,
    query_times: torch.Tensor,
    query_channels: torch.Tensor,
) -> None:
    if obs_times.dim() != 2:
        raise ValueError(f"obs_times must be (B, L), got shape {tuple(obs_times.shape)}")
    pairs = ((obs_channels, "obs_channels"), (obs_values, "obs_values"), (obs_mask, "obs_mask"))
    for t, n in pairs:
        if t.shape != obs_times.shape:
            raise ValueError(
                f"{n} must have the shape of obs_times {tuple(obs_times.shape)}, "
                f"got {tuple(t.shape)}"
            )
    if query_times.dim() != 2 or query_channels.shape != query_times.shape:
        raise ValueError(
            "query_times and query_channels must be (B, Q) of one shape, got "
            f"{tuple(query_times.shape)} and {tuple(query_channels.shape)}"
        )
    if query_times.shape[0] != obs_times.shape[0]:
        raise ValueError(
            f"batch sizes differ: obs B={obs_times.shape[0]}, query B={query_times.shape[0]}"
        )
    if obs_mask.dtype != torch.bool:
        raise TypeError(f"obs_mask must be bool, got {obs_mask.dtype}")
    for t, n in ((obs_channels, "obs_channels"), (query_channels, "query_channels")):
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{n} must be an integer tensor of channel ids, got dtype={t.dtype}")
    check_finite(torch.where(obs_mask, obs_times, 0), "obs_times")
    check_finite(torch.where(obs_mask, obs_values, 0), "obs_values")
    check_finite(query_times, "query_times")
    for t, n in ((obs_channels[obs_mask], "obs_channels"), (query_channels, "query_channels")):
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= n_channels):
            raise ValueError(
                f"{n} must lie in [0, {n_channels}), got range [{int(t.min())}, {int(t.max())}]"
            )


class _Backbone(nn.Module):
    """Encoder, query map and output-space value map shared by both forecasters."""

    def __init__(
        self,
        n_channels: int,
        d: int,
        n_time_features: int,
        encoder_layers: int,
        dropout: float,
    ) -> None:
        super().__init__()
        self.n_channels = check_positive_int(n_channels, "n_channels")
        self.d = check_positive_int(d, "d")
        nf = check_positive_int(n_time_features, "n_time_features")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) \
                or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be a float in [0, 1), got {dropout=!r}")
        if isinstance(encoder_layers, bool) or not isinstance(encoder_layers, int) \
                or encoder_layers < 0:
            raise ValueError(f"encoder_layers must be an int >= 0, got {encoder_layers=!r}")
        if encoder_layers and d % max(1, d // 16):
            raise ValueError(f"d must be divisible by the encoder's max(1, d // 16) = "
                             f"{max(1, d // 16)} heads, got {d=}")
        # periods from 1 h to 96 h, log-spaced (learned)
        self.log_period = nn.Parameter(torch.linspace(0.0, math.log(96.0), nf))
        self.chan = nn.Embedding(n_channels, d)
        self.enc = nn.Sequential(
            nn.Linear(2 * nf + d + 1, d), nn.GELU(), nn.Dropout(dropout), nn.Linear(d, d)
        )
        self.qry = nn.Sequential(
            nn.Linear(2 * nf + d, d), nn.GELU(), nn.Dropout(dropout), nn.Linear(d, d)
        )
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d, nhead=max(1, d // 16), dim_feedforward=2 * d, dropout=dropout,
                batch_first=True, norm_first=True,
            )
            for _ in range(encoder_layers)
        )
        self.w_k = nn.Linear(d, d)
        self.w_q = nn.Linear(d, d)
        self.w_a = nn.Linear(d, n_channels)
        self.bias = nn.Parameter(torch.zeros(n_channels))

    def time_features(self, t: torch.Tensor) -> torch.Tensor:
        ang = 2 * math.pi * t[..., None] / torch.exp(self.log_period)
        return torch.cat([torch.sin(ang), torch.cos(ang)], dim=-1)

    def encode(
        self, t: torch.Tensor, c: torch.Tensor, x: torch.Tensor, m: torch.Tensor
    ) -> torch.Tensor:
        t = torch.where(m, t, 0)
        x = torch.where(m, x, 0)
        c = torch.where(m, c, 0)
        e = self.enc(torch.cat([self.time_features(t), self.chan(c), x[..., None]], dim=-1))
        if len(self.layers) and e.shape[0] and e.shape[1]:  # B = 0 or L = 0: nothing to mix
            # rows with no observation would make attention NaN; give them one dummy key
            empty = ~m.any(dim=1)
            pad = ~m
            if bool(empty.any()):
                pad = pad.clone()
                pad[empty, 0] = False
            for layer in self.layers:
                e = layer(e, src_key_padding_mask=pad)
        return e  # (B, L, d)

    def query(self, t: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return self.qry(torch.cat([self.time_features(t), self.chan(c)], dim=-1))  # (B, Q, d)


class LevyForecaster(nn.Module):
    r"""Forecaster with a Levy-attention last layer and exact per-query ``sigma``.

    Parameters
    ----------
    n_channels
        number of channels ``C`` (values live in ``R^C``; a query reads its channel).
    d
        width of embeddings and keys.
    n_time_features
        Fourier features of the encoder/query time embedding (each gives sin and cos).
    n_value_features
        ``K``, Fourier features ``g_k(t) = cos(omega_k t + b_k)`` of the Levy value field.
    encoder_layers
        transformer layers over observations after the per-observation MLP (0 = MLP only).
    dropout
        dropout in encoder/query MLPs and transformer layers (training only for this model).
    alpha, beta, h
        initial ``alpha`` (atoms per fully compatible observation), ``beta`` (sharpness) and
        mollifier bandwidth ``h`` (hours); all three are learned (softplus-parametrised).
    prior_std
        initial per-channel prior scale ``s0_c > 0`` of ``sigma_total`` (learned,
        softplus-parametrised; in the target's units).

    Notes
    -----
    ``forward`` returns ``mu_q = [sum_i p_qi (a_i + D m_i)]_{c_q} + b_{c_q}`` and
    ``sigma_q = sqrt(Sigma_V,{c_q c_q}(q) phi(Lambda_q))``, exact for the sampled operator
    (the bias is a deterministic shift). NOTE(paper): the paper's values are generic embeddings;
    here they are the ``C`` output channels (output projection folded in, as METHODS asks) and
    the per-channel bias is added after the layer.

    ``sigma_total = sqrt((1 - p_q) sigma_q^2 + p_q s0_c^2)``, ``p_q = exp(-Lambda_q)``, is the
    root-mean-square distance of the sampled output from ``mu_q`` when a query whose measure has
    no atom draws its value from ``N(mu_q, s0_c^2)`` (the channel's prior scale around the point
    forecast): ``sigma`` alone is conditional on ``N_q >= 1`` and shrinks with the evidence only
    through ``phi``, while ``sigma_total -> s0_c`` as ``Lambda_q -> 0``. The temperature
    ``T = exp(log_temperature)`` of the predictive ``N(mu, (T sigma_total)^2)`` is a parameter so
    that a training score (:func:`forecast_loss`) can use it; scoring refits ``T`` on validation.

    NOTE(paper): the paper defines the output and its moments conditional on ``N >= 1`` and
    reports ``p_empty`` beside them; ``sigma_total`` (a per-channel prior scale weighted by
    ``p_empty``) is ours, so that the spread grows as the evidence vanishes.
    """

    def __init__(
        self,
        n_channels: int,
        d: int = 32,
        *,
        n_time_features: int = 8,
        n_value_features: int = 8,
        encoder_layers: int = 1,
        dropout: float = 0.1,
        alpha: float = 1.0,
        beta: float = 4.0,
        h: float = 1.0,
        prior_std: float = 0.1,
    ) -> None:
        super().__init__()
        for v, n in ((alpha, "alpha"), (beta, "beta"), (h, "h"), (prior_std, "prior_std")):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{n} must be a finite float > 0, got {n}={v!r}")
        self.backbone = _Backbone(n_channels, d, n_time_features, encoder_layers, dropout)
        K = check_positive_int(n_value_features, "n_value_features")
        inv = lambda x: x + math.log(-math.expm1(-x))  # noqa: E731 - inverse softplus, stable
        self.raw_alpha = nn.Parameter(torch.tensor(inv(alpha)))
        self.raw_beta = nn.Parameter(torch.tensor(inv(beta)))
        self.raw_h = nn.Parameter(torch.tensor(inv(h)))
        self.omega = nn.Parameter(2 * math.pi / torch.exp(torch.linspace(0.0, math.log(48.0), K)))
        self.phase = nn.Parameter(torch.zeros(K))
        self.D = nn.Parameter(torch.zeros(n_channels, K))
        # created last and without random numbers: the other parameters' initial values do not
        # depend on them
        self.raw_prior = nn.Parameter(torch.full((n_channels,), inv(prior_std)))
        self.log_temperature = nn.Parameter(torch.zeros(()))

    @property
    def prior_std(self) -> torch.Tensor:
        """``(C,)`` prior scale ``s0_c`` of ``sigma_total``, ``softplus(raw_prior)``."""
        return F.softplus(self.raw_prior)

    @property
    def temperature(self) -> torch.Tensor:
        """``T = exp(log_temperature)`` (a training score's temperature; see the class notes)."""
        return self.log_temperature.exp()

    @property
    def n_channels(self) -> int:
        return self.backbone.n_channels

    def layer_params(self) -> dict[str, torch.Tensor]:
        """Current ``alpha, beta, h, omega, phase, D`` of the Levy layer."""
        return {
            "alpha": F.softplus(self.raw_alpha), "beta": F.softplus(self.raw_beta),
            "h": F.softplus(self.raw_h), "omega": self.omega, "phase": self.phase, "D": self.D,
        }

    @torch.no_grad()
    def set_alpha(self, alpha: float) -> None:
        """Set ``alpha`` (e.g. the value of :func:`fit_alpha_temperature`); ``mu`` is unchanged.

        Raises ``ValueError`` unless ``alpha`` is a finite float > 0.
        """
        if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
            raise ValueError(f"alpha must be a finite float > 0, got alpha={alpha!r}")
        raw = alpha + math.log(-math.expm1(-alpha))  # inverse softplus, stable for any alpha
        self.raw_alpha.fill_(raw)

    def _qka(
        self, obs_times, obs_channels, obs_values, obs_mask, query_times, query_channels
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        _check_inputs(
            self.n_channels, obs_times, obs_channels, obs_values, obs_mask, query_times,
            query_channels,
        )
        bb = self.backbone
        e = bb.encode(obs_times, obs_channels, obs_values, obs_mask)
        u = bb.query(query_times, query_channels)
        q = bb.w_q(u)[:, None]  # (B, 1, Q, d)
        k = bb.w_k(e)[:, None]  # (B, 1, L, d)
        a = bb.w_a(e)[:, None]  # (B, 1, L, C)
        return q, k, a

    def forward(
        self,
        obs_times: torch.Tensor,
        obs_channels: torch.Tensor,
        obs_values: torch.Tensor,
        obs_mask: torch.Tensor,
        query_times: torch.Tensor,
        query_channels: torch.Tensor,
    ) -> ForecastOutput:
        """Forecast ``(B, Q)`` queries from ``(B, L)`` padded observations (see class notes)."""
        q, k, a = self._qka(
            obs_times, obs_channels, obs_values, obs_mask, query_times, query_channels
        )
        lp = self.layer_params()
        res = levy_attention(
            q, k, a, torch.where(obs_mask, obs_times, 0), obs_mask, alpha=lp["alpha"],
            beta=lp["beta"], h=lp["h"], omega=lp["omega"], phase=lp["phase"], D=lp["D"],
        )
        if res.var is None or res.sigma_dim is None:  # pragma: no cover - per_dim=True default
            raise RuntimeError("levy_attention returned no per-dimension variance")
        idx = query_channels[..., None]  # (B, Q, 1)
        mu = res.mean[:, 0].gather(-1, idx)[..., 0] + self.backbone.bias[query_channels]
        var = res.var[:, 0].gather(-1, idx)[..., 0].clamp_min(0)  # Sigma_V,cc  (B, Q)
        sd_nophi = _safe_sqrt(var)
        sigma = res.sigma_dim[:, 0].gather(-1, idx)[..., 0]
        p0 = res.p_empty[:, 0]
        s0 = self.prior_std[query_channels]
        total = _safe_sqrt((1 - p0) * sigma**2 + p0 * s0**2)
        return ForecastOutput(
            mean=mu, sigma=sigma, sigma_nophi=sd_nophi, evidence=res.evidence[:, 0],
            p_empty=p0, sigma_total=total,
        )

    @torch.no_grad()
    def sample(
        self,
        obs_times: torch.Tensor,
        obs_channels: torch.Tensor,
        obs_values: torch.Tensor,
        obs_mask: torch.Tensor,
        query_times: torch.Tensor,
        query_channels: torch.Tensor,
        *,
        num_samples: int = 50,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Explicit Poisson draws of this model's last layer (the 50-draw sampler baseline).

        Returns ``values`` ``(S, B, Q)`` (bias added) and ``nonempty`` ``(S, B, Q)`` bool; a draw
        with ``N_q = 0`` atoms has no value (``nonempty`` False, value = bias).
        """
        check_positive_int(num_samples, "num_samples")
        q, k, a = self._qka(
            obs_times, obs_channels, obs_values, obs_mask, query_times, query_channels
        )
        lp = self.layer_params()
        s = levy_attention_sample(
            q, k, a, torch.where(obs_mask, obs_times, 0), obs_mask, num_samples=num_samples,
            generator=generator, alpha=lp["alpha"], beta=lp["beta"], h=lp["h"],
            omega=lp["omega"], phase=lp["phase"], D=lp["D"],
        )
        idx = query_channels[None, ..., None].expand(num_samples, -1, -1, 1)
        vals = s.values[:, :, 0].gather(-1, idx)[..., 0] + self.backbone.bias[query_channels]
        return vals, s.nonempty[:, :, 0]


class SoftmaxForecaster(nn.Module):
    """Matched control: :class:`LevyForecaster`'s encoder, query and value maps, softmax attention.

    Attention ``softmax(q . k / sqrt(d))`` over the observed points with dropout on the
    attention probabilities (the MC-dropout baseline keeps every dropout active at test time).
    Same constructor arguments as :class:`LevyForecaster` minus the Levy layer's.
    """

    def __init__(
        self,
        n_channels: int,
        d: int = 32,
        *,
        n_time_features: int = 8,
        encoder_layers: int = 1,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.backbone = _Backbone(n_channels, d, n_time_features, encoder_layers, dropout)
        self.attn_dropout = nn.Dropout(dropout)

    @property
    def n_channels(self) -> int:
        return self.backbone.n_channels

    def forward(
        self,
        obs_times: torch.Tensor,
        obs_channels: torch.Tensor,
        obs_values: torch.Tensor,
        obs_mask: torch.Tensor,
        query_times: torch.Tensor,
        query_channels: torch.Tensor,
    ) -> ForecastOutput:
        """``(B, Q)`` point forecasts; an empty stay (no observation) predicts the bias."""
        _check_inputs(
            self.n_channels, obs_times, obs_channels, obs_values, obs_mask, query_times,
            query_channels,
        )
        bb = self.backbone
        e = bb.encode(obs_times, obs_channels, obs_values, obs_mask)
        u = bb.query(query_times, query_channels)
        q, k, a = bb.w_q(u), bb.w_k(e), bb.w_a(e)
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, Q, L)
        s = s.masked_fill(~obs_mask[:, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1)
        p = torch.nan_to_num(p, nan=0.0)  # empty rows: all -inf -> weight 0
        out = self.attn_dropout(p) @ a  # (B, Q, C)
        mu = out.gather(-1, query_channels[..., None])[..., 0] + bb.bias[query_channels]
        return ForecastOutput(mean=mu)


def _safe_sqrt(x: torch.Tensor) -> torch.Tensor:
    pos = x > 0
    return torch.where(pos, torch.sqrt(torch.where(pos, x, 1)), 0)


def _forward(model: nn.Module, b: _Batch) -> ForecastOutput:
    out: ForecastOutput = model(
        b.obs_times, b.obs_channels, b.obs_values, b.obs_mask, b.query_times, b.query_channels
    )
    return out


def forward_batch(model: nn.Module, b: _Batch) -> ForecastOutput:
    """``model(b.obs_times, b.obs_channels, b.obs_values, b.obs_mask, b.query_times,
    b.query_channels)``: the ``forward_fn`` of either forecaster over a ``ForecastBatch``
    (for :func:`attnuq_bench.training.fit` and the methods' ``Task``).

    Examples
    --------
    >>> import torch
    >>> from types import SimpleNamespace
    >>> m = SoftmaxForecaster(n_channels=2, d=16).eval()
    >>> b = SimpleNamespace(obs_times=torch.rand(1, 3), obs_channels=torch.zeros(1, 3).long(),
    ...                     obs_values=torch.rand(1, 3), obs_mask=torch.ones(1, 3).bool(),
    ...                     query_times=torch.rand(1, 2), query_channels=torch.ones(1, 2).long())
    >>> forward_batch(m, b).mean.shape
    torch.Size([1, 2])
    """
    return _forward(model, b)


def fit_temperature(
    mean: torch.Tensor | np.ndarray,
    sigma: torch.Tensor | np.ndarray,
    targets: torch.Tensor | np.ndarray,
    *,
    floor: float = 1e-6,
) -> float:
    r"""Closed-form NLL-optimal temperature of ``N(mu, (T sigma)^2)``.

    .. math:: T^2 = \frac1n \sum_i \frac{(y_i - \mu_i)^2}{\max(\sigma_i, \epsilon)^2}

    (the derivative of the summed Gaussian NLL in ``T`` vanishes there). ``sigma`` is floored
    at ``floor`` so that a zero spread cannot make ``T`` infinite.

    Examples
    --------
    >>> import torch
    >>> round(fit_temperature(torch.zeros(2), torch.ones(2), torch.tensor([1.0, -3.0])), 4)
    2.2361
    """
    mu = torch.as_tensor(mean, dtype=torch.float64).reshape(-1)
    sd = torch.as_tensor(sigma, dtype=torch.float64).reshape(-1)
    y = torch.as_tensor(targets, dtype=torch.float64).reshape(-1)
    if not (mu.shape == sd.shape == y.shape) or mu.numel() == 0:
        raise ValueError(
            f"mean, sigma, targets must be non-empty and of one length, got {mu.numel()}, "
            f"{sd.numel()}, {y.numel()}"
        )
    for t, n in ((mu, "mean"), (sd, "sigma"), (y, "targets")):
        check_finite(t, n)
    if bool((sd < 0).any()):
        raise ValueError("sigma must be >= 0")
    t2 = float((((y - mu) / sd.clamp_min(floor)) ** 2).mean())
    return math.sqrt(max(t2, 1e-300))


def fit_alpha_temperature(
    mean: torch.Tensor | np.ndarray,
    var: torch.Tensor | np.ndarray,
    strength: torch.Tensor | np.ndarray,
    targets: torch.Tensor | np.ndarray,
    *,
    floor: float = 1e-6,
    log_range: tuple[float, float] = (-12.0, 12.0),
    grid: int = 97,
) -> tuple[float, float]:
    r"""Two-stage calibration: ``alpha`` and ``T`` of ``N(mu, T^2 Sigma_V phi(alpha S))`` by NLL.

    With ``s_i(alpha) = max(sqrt(var_i phi(alpha S_i)), floor)`` the Gaussian NLL, minimised over
    ``T`` in closed form (``T^2 = mean(r_i^2 / s_i^2)``, :func:`fit_temperature`), is the profile

    .. math:: \ell(\alpha) = \tfrac12 \log \overline{r^2 / s(\alpha)^2}
              + \overline{\log s(\alpha)} + \text{const},

    minimised over ``log alpha`` in ``log_range`` on a grid of ``grid`` points, then refined by
    golden-section search between the grid neighbours of the best point. ``alpha -> 0`` gives
    ``phi -> 1`` (no evidence term); ``alpha -> inf`` gives ``s^2 ~ var / (alpha S)``.
    ``S_q = Lambda_q / alpha_model`` is the evidence per unit ``alpha`` (``mu`` does not depend
    on ``alpha``, so this is exact).

    Parameters
    ----------
    mean, var, strength, targets
        ``(n,)`` each: ``mu``, ``Sigma_V,cc`` (``sigma_nophi ** 2``), ``S``, ``y``.

    Returns
    -------
    (alpha, T)

    Examples
    --------
    >>> import torch
    >>> from attnuq.ops.phi import poisson_phi
    >>> g = torch.Generator().manual_seed(0)
    >>> S = torch.rand(4000, generator=g, dtype=torch.float64) * 20 + 0.1
    >>> sd = (0.04 * poisson_phi(2.0 * S)).sqrt()
    >>> y = sd * torch.randn(4000, generator=g, dtype=torch.float64)
    >>> a, T = fit_alpha_temperature(torch.zeros(4000), torch.full((4000,), 0.04), S, y)
    >>> 1.5 < a < 2.7 and 0.9 < T < 1.1
    True
    """
    from attnuq.ops.phi import poisson_phi

    cols = [torch.as_tensor(x, dtype=torch.float64).reshape(-1)
            for x in (mean, var, strength, targets)]
    mu, v, S, y = cols
    if not (mu.shape == v.shape == S.shape == y.shape) or mu.numel() == 0:
        raise ValueError(
            "mean, var, strength, targets must be non-empty and of one length, got "
            f"{[c.numel() for c in cols]}"
        )
    for t, n in zip(cols, ("mean", "var", "strength", "targets"), strict=True):
        check_finite(t, n)
    if bool((v < 0).any()) or bool((S < 0).any()):
        raise ValueError("var and strength must be >= 0")
    lo, hi = log_range
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"log_range must be finite with lo < hi, got {log_range=}")
    check_positive_int(grid, "grid")
    if grid < 3:
        raise ValueError(f"grid must be >= 3, got {grid=}")
    r2 = (y - mu) ** 2

    def profile(la: float) -> float:
        s = (v * poisson_phi(math.exp(la) * S)).sqrt().clamp_min(floor)
        return float(0.5 * torch.log((r2 / s**2).mean().clamp_min(1e-300)) + torch.log(s).mean())

    xs = np.linspace(lo, hi, grid)
    fs = [profile(float(x)) for x in xs]
    k = int(np.argmin(fs))
    a, b = float(xs[max(k - 1, 0)]), float(xs[min(k + 1, grid - 1)])
    gr = (math.sqrt(5) - 1) / 2
    c, d = b - gr * (b - a), a + gr * (b - a)
    fc, fd = profile(c), profile(d)
    for _ in range(40):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - gr * (b - a)
            fc = profile(c)
        else:
            a, c, fc = c, d, fd
            d = a + gr * (b - a)
            fd = profile(d)
    la = c if fc <= fd else d
    if fs[k] < min(fc, fd):
        la = float(xs[k])
    alpha = math.exp(la)
    sd = (v * poisson_phi(alpha * S)).sqrt()
    return alpha, fit_temperature(mu, sd, y, floor=floor)


def check_score_weight(weight: object, name: str = "weight") -> float:
    """``weight`` as a float, or ``ValueError`` naming it unless it is finite and ``>= 0``.

    >>> check_score_weight(0.1)
    0.1
    """
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (
            math.isfinite(weight) and weight >= 0):
        raise ValueError(f"{name} must be a finite float >= 0, got {name}={weight!r}")
    return float(weight)


def forecast_loss(
    out: ForecastOutput,
    targets: torch.Tensor,
    mask: torch.Tensor,
    *,
    weight: float,
    score: str = "crps",
    temperature: torch.Tensor | float = 1.0,
    log_alpha: torch.Tensor | None = None,
    alpha_prior: float = 1e-3,
    floor: float = 1e-3,
) -> torch.Tensor:
    r"""Training loss that teaches ``sigma``: masked MSE of ``mu`` plus ``weight`` times a score.

    .. math::

        L = \overline{(y - \mu)^2} + w \Big[ \overline{S\big(N(\mu, s^2), y\big)}
            + \kappa \log^2 \alpha \Big],
        \qquad s^2 = (T \sigma_{\text{total}})^2 + \epsilon^2,

    means over the masked points (``mask``), ``S`` the closed-form Gaussian CRPS
    (``score="crps"``, Gneiting et al. 2005) or NLL (``"nll"``), ``T`` the model's temperature,
    ``epsilon = floor``. ``kappa log^2 alpha`` (``alpha_prior``, with ``log_alpha``) is a
    Gaussian prior on ``log alpha`` centred at ``alpha = 1`` (one atom per fully compatible
    observation): where the evidence is large, ``phi(Lambda) ~ 1/Lambda`` and only
    ``T / sqrt(alpha)`` is identified by the data, and the prior fixes the rest. Gradients reach
    ``Sigma_V``, ``Lambda`` (hence ``alpha``, ``beta``, the keys and values) and the prior scale
    through ``sigma_total``. ``weight = 0`` is the masked MSE alone.

    NOTE(paper): the paper trains the expected output on the MSE only and fits ``T`` afterwards;
    the score term (and with it a trained ``alpha`` under a prior) is ours (issue #36).

    Parameters
    ----------
    out
        The Levy forecaster's output (``mean``, ``sigma_total`` ``(B, Q)``).
    targets, mask
        ``(B, Q)`` targets and bool mask of the forecast points.
    weight
        ``w >= 0``.
    score
        ``"crps"`` or ``"nll"``.
    temperature
        ``T > 0`` (a tensor to learn it).
    log_alpha
        ``log alpha`` (a tensor; ``None``: no prior term).
    alpha_prior
        ``kappa >= 0``.
    floor
        ``epsilon > 0``.

    Examples
    --------
    >>> import torch
    >>> out = ForecastOutput(mean=torch.zeros(1, 2), sigma_total=torch.ones(1, 2))
    >>> y, m = torch.tensor([[1.0, 5.0]]), torch.tensor([[True, False]])
    >>> float(forecast_loss(out, y, m, weight=0.0))
    1.0
    >>> round(float(forecast_loss(out, y, m, weight=1.0, floor=1e-12)), 4)  # 1 + CRPS(N(0,1), 1)
    1.6024
    """
    w = check_score_weight(weight)
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score=!r}")
    check_score_weight(alpha_prior, "alpha_prior")
    if not (isinstance(floor, (int, float)) and math.isfinite(floor) and floor > 0):
        raise ValueError(f"floor must be a finite float > 0, got {floor=!r}")
    if not isinstance(temperature, torch.Tensor) and not (
            isinstance(temperature, (int, float)) and math.isfinite(temperature)
            and temperature > 0):
        raise ValueError(f"temperature must be a finite float > 0, got {temperature=!r}")
    if mask.shape != targets.shape or out.mean.shape != targets.shape:
        raise ValueError(
            f"out.mean, targets and mask must have one shape, got {tuple(out.mean.shape)}, "
            f"{tuple(targets.shape)}, {tuple(mask.shape)}"
        )
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor, got {getattr(mask, 'dtype', mask)!r}")
    bad = mask & ~torch.isfinite(targets)
    if bool(bad.any()):
        raise ValueError(f"targets holds {int(bad.sum())} NaN/inf value(s) at observed "
                         "(mask=True) positions")
    n = mask.sum().clamp_min(1)
    # padded targets may hold anything (NaN included): they are zeroed, not multiplied by 0
    err = torch.where(mask, targets - out.mean, torch.zeros_like(out.mean))
    loss = (err**2).sum() / n
    if w == 0:
        return loss
    if out.sigma_total is None:
        raise ValueError("out.sigma_total is None: a score needs the Levy forecaster's output")
    if out.sigma_total.shape != targets.shape:
        raise ValueError(f"out.sigma_total must have the targets' shape {tuple(targets.shape)}, "
                         f"got {tuple(out.sigma_total.shape)}")
    if bool((out.sigma_total < 0).any()) or not bool(torch.isfinite(out.sigma_total).all()):
        raise ValueError("out.sigma_total must be finite and >= 0")
    if log_alpha is not None and log_alpha.numel() != 1:
        raise ValueError(f"log_alpha must be a scalar, got shape {tuple(log_alpha.shape)}")
    sd = ((temperature * out.sigma_total) ** 2 + floor**2).sqrt()
    z = torch.where(mask, err / sd, torch.zeros_like(err))
    if score == "crps":
        cdf = 0.5 * (1 + torch.erf(z / math.sqrt(2)))
        pdf = torch.exp(-0.5 * z**2) / math.sqrt(2 * math.pi)
        sc = sd * (z * (2 * cdf - 1) + 2 * pdf - 1 / math.sqrt(math.pi))
    else:
        sc = torch.log(sd) + 0.5 * z**2 + 0.5 * math.log(2 * math.pi)
    loss = loss + w * (sc * mask).sum() / n
    if log_alpha is not None and alpha_prior > 0:
        loss = loss + w * alpha_prior * log_alpha**2
    return loss
