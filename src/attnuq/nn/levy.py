"""``LevyAttention``: multi-head Levy cross-attention from query times to irregular observations.

API (stable)
------------
``LevyAttention(num_channels, d_model=64, num_heads=4, *, value_features=1, out_features=None,
n_fourier=8, alpha=1.0, beta=2.0, h=0.1, max_period=100.0, per_dim=True, block_size=256,
prior_std=1.0)``

``forward(times, channels, values, mask, query_times, query_channels=None)
-> LevyAttentionOutput`` with

* ``times``          ``(B, N)`` float observation times (any real values, any order).
* ``channels``       ``(B, N)`` int64 channel ids in ``[0, num_channels)``.
* ``values``         ``(B, N)`` or ``(B, N, value_features)`` observed values.
* ``mask``           ``(B, N)`` bool, ``True`` = observed. Masked entries (padding) are ignored
  and may hold anything, NaN included.
* ``query_times``    ``(B, Q)`` float.
* ``query_channels`` ``(B, Q)`` int64 target channel per query, or ``None``.

``LevyAttentionOutput`` fields (``D_out = out_features`` if given, else ``d_model``):

* ``mean``      ``(B, Q, D_out)`` expected output.
* ``sigma_dim`` ``(B, Q, D_out)`` standard deviation per output dimension of the sampled
  output given that every head has at least one atom (exact): ``sqrt(sum_h Sigma_V,h,jj
  phi(Lambda_h))``. It measures how much the attended values disagree, shrunk by ``phi`` as
  evidence accumulates; it does NOT grow as evidence vanishes (one observation: only its
  time jitter; no observation: 0 by convention).
* ``sigma``     ``(B, Q)`` ``sqrt`` of the summed conditional variance (``sigma_hat``).
* ``total_sigma_dim`` ``(B, Q, D_out)`` the spread that also counts the chance of no evidence:
  ``sqrt(sum_h [(1 - p_h) Sigma_V,h,jj phi(Lambda_h) + p_h s0^2 / H_j])`` with
  ``p_h = exp(-Lambda_h)``, ``s0 = prior_std`` and ``H_j`` the number of heads that feed
  output ``j`` (1 with concatenated heads, ``H`` with a folded projection): an empty head's
  contribution is drawn from a prior of scale ``s0 / sqrt(H_j)`` around its point output, so
  ``total_sigma_dim -> s0`` as every ``Lambda_h -> 0`` (all observations masked: exactly
  ``s0``) and ``-> sigma_dim`` as the evidence grows. ``total_sigma`` ``(B, Q)``: its summed
  version.
* ``evidence``  ``(B, Q, H)`` ``Lambda_q`` per head (the evidence signal: about the number of
  compatible observations times ``alpha``); ``p_empty`` ``(B, Q, H)`` ``exp(-Lambda_q)``.
* ``heads``     the per-head :class:`attnuq.ops.LevyResult` (shapes ``(B, H, Q, Dv)``).

``sample(..., num_samples, generator=None) -> (samples (S, B, Q, D_out), nonempty (S, B, Q, H))``
draws the Poisson random measure explicitly (heads independent).

Architecture (per head ``h``)
-----------------------------
* time embedding ``tau(t) = [w_0 t + b_0, sin(W t + b)]`` (learnable, mTAN style), ``d_model``;
* key ``k_i = W_k (tau(t_i) + E_k[c_i])``, query ``q = W_q (tau(t_q) + E_q[c_q])`` (``E_q`` has
  one extra "no channel" row used when ``query_channels`` is None); ``E = d_model / H``;
* value embedding ``a_i = W_v GELU(W_x x_i + E_v[c_i] + b_x) + b_v``;
* value field ``V_i(t) = a_i + D g(t)``, ``g_k(t) = cos(omega_k t + b_k)``, ``K = n_fourier``;
* ``alpha, beta, h`` per head, positive through ``softplus``.

Output space. With ``out_features=None`` the heads are concatenated: ``D_out = H * (d_model/H)``
and the per-dimension variance is exact because each output coordinate is one head's value
coordinate. With ``out_features=P`` the output projection ``W_o`` is folded into the values:
head ``h`` carries ``W_o^h a_i`` in ``R^P`` (and its own ``D^h`` in ``R^{P x K}``), the output is
``sum_h mu_h + b_o``, and the per-output-dimension variance ``sum_h Sigma_V,h,jj phi(Lambda_h)``
is exact (no cross terms are dropped).

NOTE(paper): heads are modelled as independent Poisson random measures, so their variances add;
the paper states the operator for one head.

NOTE(paper): ``total_sigma_dim`` (the prior scale ``prior_std`` weighted by ``p_empty``) is ours;
the paper reports the moments conditional on ``N >= 1`` and ``p_empty`` beside them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from attnuq._validation import check_positive_int
from attnuq.ops.levy import LevyResult, _safe_sqrt, levy_attention, levy_attention_sample

__all__ = ["LevyAttention", "LevyAttentionOutput"]


@dataclass(frozen=True)
class LevyAttentionOutput:
    """Output of :class:`LevyAttention` (see the module docstring for shapes).

    Attributes
    ----------
    mean : ``(B, Q, D_out)``.
    sigma_dim : ``(B, Q, D_out)`` std per output dimension given at least one atom per head
        (``None`` if the layer was built with ``per_dim=False``).
    sigma : ``(B, Q)`` ``sqrt(sum_j sigma_dim_j^2)``.
    evidence : ``(B, Q, H)``.
    p_empty : ``(B, Q, H)``.
    heads : :class:`attnuq.ops.LevyResult` with ``(B, H, Q, Dv)`` tensors.
    total_sigma_dim : ``(B, Q, D_out)`` std per output dimension with the prior term weighted by
        ``p_empty`` (grows to ``prior_std`` as the evidence vanishes; ``None`` with
        ``per_dim=False``).
    total_sigma : ``(B, Q)`` ``sqrt`` of the summed total variance.
    """

    mean: torch.Tensor
    sigma_dim: torch.Tensor | None
    sigma: torch.Tensor
    evidence: torch.Tensor
    p_empty: torch.Tensor
    heads: LevyResult
    total_sigma_dim: torch.Tensor | None = None
    total_sigma: torch.Tensor | None = None


#: a warning is given when the float resolution of a series' times exceeds this part of its span
_COARSE_TIMES = 1e-4


def _warn_coarse_times(
    times: torch.Tensor, mask: torch.Tensor, query_times: torch.Tensor, stacklevel: int
) -> None:
    """Warn when times of a low-precision dtype are so large that their rounding is more than
    :data:`_COARSE_TIMES` of a series' time span (observed and query times together).

    float32 spaces numbers near ``1e9`` (Unix seconds) by 64, so distinct observation times
    collapse and the time embedding ``sin(W t + b)`` of absolute times loses its phase. The
    layer cannot undo that rounding (it happened before the call) and does not shift times
    itself (the embedding is of absolute time, so a shift would change the model's output): it
    says how to avoid it. Series whose times are all equal (span 0) are not judged.
    """
    if times.dtype == torch.float64:
        return
    allt = torch.cat([times, query_times.to(times.dtype)], 1)  # (B, N + Q)
    allm = torch.cat([mask, torch.ones_like(query_times, dtype=torch.bool)], 1)
    if allt.numel() == 0:
        return
    with torch.no_grad():
        inf = torch.tensor(float("inf"), dtype=allt.dtype, device=allt.device)
        hi = torch.where(allm, allt, -inf).amax(-1)  # (B,)
        lo = torch.where(allm, allt, inf).amin(-1)
        span = hi - lo
        res = torch.maximum(hi.abs(), lo.abs()) * torch.finfo(allt.dtype).eps
        judged = torch.isfinite(span) & (span > 0)
        ratio = torch.where(judged, res / torch.where(judged, span, inf), 0.0)
        worst = int(ratio.argmax())
        if not float(ratio[worst]) > _COARSE_TIMES:
            return
    import warnings

    warnings.warn(
        f"LevyAttention: {times.dtype} times as large as {float(hi[worst].abs()):.4g} are "
        f"resolved only to about {float(res[worst]):.3g}, {float(ratio[worst]):.2g} of the "
        f"time span {float(span[worst]):.4g} of series {worst}: distinct times may have "
        "collapsed and the time embedding loses precision. Subtract a reference time (e.g. "
        "each series' first observation) before the cast to float32, or run the layer in "
        "float64 (layer.double())",
        stacklevel=stacklevel,
    )


def _inv_softplus(x: float) -> float:
    if x <= 0:
        raise ValueError(f"initial value must be > 0, got {x=}")
    return x + math.log(-math.expm1(-x))


class LevyAttention(nn.Module):
    r"""Multi-head Levy attention with single-pass mean and uncertainty.

    Parameters
    ----------
    num_channels : int
        Number of observation channels (variables), ``C``.
    d_model : int
        Width of the embeddings; must be divisible by ``num_heads``.
    num_heads : int
        ``H``.
    value_features : int
        ``F``, features per observation value (1 for a scalar series).
    out_features : int, optional
        If given, fold an output projection to this many dimensions into the values (exact
        per-output ``sigma_dim``); else concatenate heads (``D_out = d_model``).
    n_fourier : int
        ``K``, Fourier time features of the value field (0 disables the ``D g(t)`` term).
    alpha, beta, h : float
        Initial ``alpha > 0`` (atoms per fully compatible observation), ``beta > 0``
        (sharpness), ``h > 0`` (mollifier bandwidth, in time units).
    max_period : float
        Longest initial period of the time embedding and the Fourier features (time units).
    per_dim : bool
        Compute ``sigma_dim`` per output dimension (default); ``False`` gives only ``sigma``
        (cheaper: see :func:`attnuq.ops.levy_attention`).
    block_size : int
        Block size of the sums over observations (see :func:`attnuq.ops.levy_attention`).
    prior_std : float
        ``s0 >= 0``, the std per output dimension of ``total_sigma_dim`` when no observation
        supports the query (module docstring); in the output's units. ``0`` makes
        ``total_sigma_dim = sqrt(1 - p_empty) sigma_dim`` per head.

    Examples
    --------
    >>> import torch
    >>> from attnuq.nn import LevyAttention
    >>> layer = LevyAttention(num_channels=3, d_model=16, num_heads=2, out_features=1)
    >>> B, N, Q = 2, 7, 4
    >>> out = layer(torch.rand(B, N) * 24, torch.randint(0, 3, (B, N)), torch.randn(B, N),
    ...             torch.rand(B, N) > 0.3, torch.rand(B, Q) * 24 + 24,
    ...             query_channels=torch.randint(0, 3, (B, Q)))
    >>> out.mean.shape, out.sigma_dim.shape, out.evidence.shape
    (torch.Size([2, 4, 1]), torch.Size([2, 4, 1]), torch.Size([2, 4, 2]))
    >>> empty = layer(torch.rand(1, 3), torch.zeros(1, 3, dtype=torch.long), torch.randn(1, 3),
    ...               torch.zeros(1, 3, dtype=torch.bool), torch.rand(1, 2))
    >>> empty.sigma_dim.flatten().tolist(), empty.total_sigma_dim.flatten().tolist()
    ([0.0, 0.0], [1.0, 1.0])
    """

    def __init__(
        self,
        num_channels: int,
        d_model: int = 64,
        num_heads: int = 4,
        *,
        value_features: int = 1,
        out_features: int | None = None,
        n_fourier: int = 8,
        alpha: float = 1.0,
        beta: float = 2.0,
        h: float = 0.1,
        max_period: float = 100.0,
        per_dim: bool = True,
        block_size: int = 256,
        prior_std: float = 1.0,
    ) -> None:
        super().__init__()
        if isinstance(prior_std, bool) or not isinstance(prior_std, (int, float)) or not (
                math.isfinite(prior_std) and prior_std >= 0):
            raise ValueError(f"prior_std must be a finite float >= 0, got {prior_std=!r}")
        self.prior_std = float(prior_std)
        self.num_channels = check_positive_int(num_channels, "num_channels")
        self.d_model = check_positive_int(d_model, "d_model")
        self.num_heads = check_positive_int(num_heads, "num_heads")
        if d_model % num_heads:
            raise ValueError(
                f"d_model must be divisible by num_heads, got {d_model=}, {num_heads=}"
            )
        self.value_features = check_positive_int(value_features, "value_features")
        self.out_features = (
            None if out_features is None else check_positive_int(out_features, "out_features")
        )
        if isinstance(n_fourier, bool) or not isinstance(n_fourier, int) or n_fourier < 0:
            raise ValueError(f"n_fourier must be an int >= 0, got {n_fourier=}")
        for name, val in (("max_period", max_period), ("alpha", alpha), ("beta", beta),
                          ("h", h)):
            if isinstance(val, bool) or not isinstance(val, (int, float)) or not (
                    math.isfinite(val) and val > 0):
                raise ValueError(f"{name} must be a finite float > 0, got {name}={val!r}")
        self.n_fourier = n_fourier
        if not isinstance(per_dim, bool):
            raise TypeError(f"per_dim must be a bool, got {per_dim=!r}")
        self.per_dim = per_dim
        self.block_size = check_positive_int(block_size, "block_size")
        H, dh = num_heads, d_model // num_heads
        self.d_head = dh
        self.d_value = dh if out_features is None else out_features

        # time embedding tau(t) = [w0 t + b0, sin(W t + b)]
        periods = torch.logspace(0.0, math.log10(max_period), d_model - 1) if d_model > 1 else None
        self.time_lin = nn.Parameter(torch.tensor([1.0 / max_period, 0.0]))
        self.time_freq = nn.Parameter(
            2 * math.pi / periods if periods is not None else torch.zeros(0)
        )
        self.time_phase = nn.Parameter(torch.zeros(max(d_model - 1, 0)))
        self.key_channel = nn.Embedding(num_channels, d_model)
        self.query_channel = nn.Embedding(num_channels + 1, d_model)  # last row: no channel
        self.w_q = nn.Linear(d_model, H * dh, bias=False)
        self.w_k = nn.Linear(d_model, H * dh, bias=False)
        # value embedding a_i = W_v GELU(W_x x_i + E_v[c_i] + b_x) + b_v
        self.value_in = nn.Linear(value_features, d_model)
        self.value_channel = nn.Embedding(num_channels, d_model)
        self.w_v = nn.Linear(d_model, H * dh)
        if out_features is not None:
            self.out_proj: nn.Linear | None = nn.Linear(H * dh, out_features)
        else:
            self.out_proj = None
        # value field D g(t)
        K = n_fourier
        if K > 0:
            fperiods = torch.logspace(0.0, math.log10(max_period), K)
            self.omega: nn.Parameter | None = nn.Parameter(2 * math.pi / fperiods)
            self.phase: nn.Parameter | None = nn.Parameter(torch.rand(K) * 2 * math.pi)
            self.D: nn.Parameter | None = nn.Parameter(
                torch.randn(H, self.d_value, K) * (0.1 / math.sqrt(K))
            )
        else:
            self.omega = self.phase = self.D = None
        # positive per-head scalars through softplus
        self.alpha_raw = nn.Parameter(torch.full((H,), _inv_softplus(alpha)))
        self.beta_raw = nn.Parameter(torch.full((H,), _inv_softplus(beta)))
        self.h_raw = nn.Parameter(torch.full((H,), _inv_softplus(h)))

    # ------------------------------------------------------------------ parameters
    @property
    def alpha(self) -> torch.Tensor:
        """``(H,)`` atoms per fully compatible observation, ``softplus(alpha_raw)``."""
        return F.softplus(self.alpha_raw)

    @property
    def beta(self) -> torch.Tensor:
        """``(H,)`` sharpness, ``softplus(beta_raw)``."""
        return F.softplus(self.beta_raw)

    @property
    def h(self) -> torch.Tensor:
        """``(H,)`` mollifier bandwidth, ``softplus(h_raw)``."""
        return F.softplus(self.h_raw)

    def time_embedding(self, t: torch.Tensor) -> torch.Tensor:
        """``tau(t)``: ``(...)`` -> ``(..., d_model)``."""
        lin = (t * self.time_lin[0] + self.time_lin[1])[..., None]
        per = torch.sin(t[..., None] * self.time_freq + self.time_phase)
        return torch.cat([lin, per], dim=-1)

    # ------------------------------------------------------------------ inputs
    def _check(
        self,
        times: torch.Tensor,
        channels: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor,
        query_times: torch.Tensor,
        query_channels: torch.Tensor | None,
        stacklevel: int = 4,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
            raise ValueError(
                f"mask must be a (B, N) bool tensor, got {getattr(mask, 'dtype', type(mask))} "
                f"of shape {tuple(getattr(mask, 'shape', ()))}"
            )
        B, N = mask.shape
        for t, n in ((times, "times"), (query_times, "query_times")):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != 2:
                raise ValueError(f"{n} must be a 2-D floating tensor, got {type(t).__name__}")
        if times.shape != (B, N):
            raise ValueError(f"times must be (B, N) = {(B, N)}, got {tuple(times.shape)}")
        if query_times.shape[0] != B:
            raise ValueError(
                f"query_times must be (B, Q) with B={B}, got {tuple(query_times.shape)}"
            )
        if not isinstance(values, torch.Tensor) or not values.is_floating_point():
            raise ValueError(f"values must be a floating tensor, got {type(values).__name__}")
        dt = self.w_q.weight.dtype
        if (times.dtype, values.dtype, query_times.dtype) != (dt, dt, dt):
            raise ValueError(
                f"times, values and query_times must have the layer's dtype {dt} (cast the "
                f"inputs, or the layer with .to(dtype)), got times.dtype={times.dtype}, "
                f"values.dtype={values.dtype}, query_times.dtype={query_times.dtype}"
            )
        if values.dim() == 2:
            values = values[..., None]
        if values.shape != (B, N, self.value_features):
            raise ValueError(
                f"values must be (B, N) or (B, N, F) = {(B, N, self.value_features)}, "
                f"got {tuple(values.shape)}"
            )
        if not isinstance(channels, torch.Tensor) or channels.dtype != torch.long:
            raise ValueError(
                f"channels must be an int64 tensor, got {getattr(channels, 'dtype', channels)}"
            )
        if channels.shape != (B, N):
            raise ValueError(f"channels must be (B, N) = {(B, N)}, got {tuple(channels.shape)}")
        bad_t = ~torch.isfinite(times) & mask
        if bool(bad_t.any()):
            raise ValueError(
                f"times contains {int(bad_t.sum())} NaN/inf entries at observed (mask=True) "
                f"positions, e.g. times={times[bad_t][0].item()!r}"
            )
        bad_v = ~torch.isfinite(values) & mask[..., None]
        if bool(bad_v.any()):
            raise ValueError(
                f"values contains {int(bad_v.sum())} NaN/inf entries at observed (mask=True) "
                f"positions, e.g. values={values[bad_v][0].item()!r}"
            )
        bad_c = ((channels < 0) | (channels >= self.num_channels)) & mask
        if bool(bad_c.any()):
            raise ValueError(
                f"channels must lie in [0, {self.num_channels}) at observed positions, got "
                f"channels={channels[bad_c][0].item()}"
            )
        if not bool(torch.isfinite(query_times).all()):
            raise ValueError(f"query_times contains NaN/inf, got shape {tuple(query_times.shape)}")
        if query_channels is not None:
            if (
                not isinstance(query_channels, torch.Tensor)
                or query_channels.dtype != torch.long
                or query_channels.shape != query_times.shape
            ):
                got = (f"{query_channels.dtype} of shape {tuple(query_channels.shape)}"
                       if isinstance(query_channels, torch.Tensor)
                       else type(query_channels).__name__)
                raise ValueError(
                    "query_channels must be an int64 tensor shaped like query_times "
                    f"{tuple(query_times.shape)}, got {got}"
                )
            if bool(((query_channels < 0) | (query_channels >= self.num_channels)).any()):
                raise ValueError(
                    f"query_channels must lie in [0, {self.num_channels}), got values in "
                    f"[{int(query_channels.min())}, {int(query_channels.max())}]"
                )
        _warn_coarse_times(times, mask, query_times, stacklevel)
        zero = torch.zeros((), dtype=times.dtype, device=times.device)
        times = torch.where(mask, times, zero)
        values = torch.where(mask[..., None], values, zero.to(values.dtype))
        channels = torch.where(mask, channels, torch.zeros_like(channels))
        return times, channels, values, query_channels

    def _embed(
        self,
        times: torch.Tensor,
        channels: torch.Tensor,
        values: torch.Tensor,
        query_times: torch.Tensor,
        query_channels: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q (B, H, Q, E)``, ``k (B, H, N, E)``, ``a (B, H, N, Dv)``."""
        B, N = times.shape
        Q = query_times.shape[1]
        H, dh = self.num_heads, self.d_head
        qc = (
            torch.full_like(query_times, self.num_channels, dtype=torch.long)
            if query_channels is None
            else query_channels
        )
        qf = self.time_embedding(query_times) + self.query_channel(qc)
        kf = self.time_embedding(times) + self.key_channel(channels)
        q = self.w_q(qf).view(B, Q, H, dh).transpose(1, 2)
        k = self.w_k(kf).view(B, N, H, dh).transpose(1, 2)
        u = F.gelu(self.value_in(values) + self.value_channel(channels))  # (B, N, d_model)
        if self.out_proj is None:
            a = self.w_v(u).view(B, N, H, dh).transpose(1, 2)
        else:
            P = self.out_proj.out_features
            wo = self.out_proj.weight.view(P, H, dh)  # (P, H, dh)
            wv = self.w_v.weight.view(H, dh, self.d_model)
            bv = self.w_v.bias.view(H, dh)
            wf = torch.einsum("phe,hed->hpd", wo, wv)  # (H, P, d_model)
            bf = torch.einsum("phe,he->hp", wo, bv)  # (H, P)
            a = torch.einsum("bnd,hpd->bhnp", u, wf) + bf[None, :, None, :]
        return q, k, a

    def _op_kwargs(self) -> dict[str, torch.Tensor | None]:
        return {
            "alpha": self.alpha,
            "beta": self.beta,
            "h": self.h,
            "omega": self.omega,
            "phase": self.phase,
            "D": self.D,
        }

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        times: torch.Tensor,
        channels: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor,
        query_times: torch.Tensor,
        query_channels: torch.Tensor | None = None,
    ) -> LevyAttentionOutput:
        """Mean and closed-form uncertainty at ``query_times`` (shapes in the module docstring)."""
        times, channels, values, query_channels = self._check(
            times, channels, values, mask, query_times, query_channels, stacklevel=6
        )
        q, k, a = self._embed(times, channels, values, query_times, query_channels)
        res = levy_attention(
            q, k, a, times, mask, per_dim=self.per_dim, block_size=self.block_size,
            **self._op_kwargs(),  # type: ignore[arg-type]
        )
        B, H, Q, Dv = res.mean.shape
        if self.out_proj is None:
            mean = res.mean.transpose(1, 2).reshape(B, Q, H * Dv)
        else:
            mean = res.mean.sum(1) + self.out_proj.bias
        sigma_dim: torch.Tensor | None = None
        # sqrt with gradient 0 at 0 when differentiating; the same values either way
        root = _safe_sqrt if torch.is_grad_enabled() else torch.sqrt
        if res.var is None or self.out_proj is None:
            # heads' predictive trace variances add: sum_h sigma_h^2 = sum_h tr Sigma_V,h phi_h
            total = (res.sigma**2).sum(1)
            if res.sigma_dim is not None:  # sqrt(var * phi) per head, from the operator
                sigma_dim = res.sigma_dim.transpose(1, 2).reshape(B, Q, H * Dv)
        else:
            # folded output projection: heads add per output dimension
            tot_dim = (res.var * res.phi[..., None]).sum(1)  # (B, Q, P)
            sigma_dim = root(tot_dim)
            total = tot_dim.sum(-1)
        # the chance of no atom: head h is empty with probability p_h and then contributes a
        # prior draw of variance s0^2 / H_j per output dimension it feeds
        p = res.p_empty  # (B, H, Q)
        s2 = self.prior_std**2
        if self.out_proj is None:
            cond_h = res.sigma**2  # (B, H, Q) trace per head
            tot_all = ((1 - p) * cond_h + p * (s2 * Dv)).sum(1)
            tot_dim_all = None
            if res.sigma_dim is not None:
                td = (1 - p)[..., None] * res.sigma_dim**2 + p[..., None] * s2
                tot_dim_all = td.transpose(1, 2).reshape(B, Q, H * Dv)
        else:
            P = self.out_proj.out_features
            if res.var is not None:
                td = ((1 - p)[..., None] * res.var * res.phi[..., None] + p[..., None] * (s2 / H))
                tot_dim_all = td.sum(1)
                tot_all = tot_dim_all.sum(-1)
            else:
                tot_dim_all = None
                tot_all = ((1 - p) * res.sigma**2 + p * (s2 * P / H)).sum(1)
        return LevyAttentionOutput(
            mean=mean,
            sigma_dim=sigma_dim,
            sigma=root(total),
            evidence=res.evidence.transpose(1, 2),
            p_empty=res.p_empty.transpose(1, 2),
            heads=res,
            total_sigma_dim=None if tot_dim_all is None else root(tot_dim_all),
            total_sigma=root(tot_all),
        )

    @torch.no_grad()
    def sample(
        self,
        times: torch.Tensor,
        channels: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor,
        query_times: torch.Tensor,
        query_channels: torch.Tensor | None = None,
        *,
        num_samples: int,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Explicit draws of the layer's sampled operator.

        Returns
        -------
        samples : ``(S, B, Q, D_out)`` (a head with no atom contributes 0 in that draw).
        nonempty : ``(S, B, Q, H)`` bool, whether each head had at least one atom.
        """
        times, channels, values, query_channels = self._check(
            times, channels, values, mask, query_times, query_channels
        )
        q, k, a = self._embed(times, channels, values, query_times, query_channels)
        smp = levy_attention_sample(
            q, k, a, times, mask, num_samples=num_samples, generator=generator,
            **self._op_kwargs(),  # type: ignore[arg-type]
        )
        S, B, H, Q, Dv = smp.values.shape
        if self.out_proj is None:
            out = smp.values.transpose(2, 3).reshape(S, B, Q, H * Dv)
        else:
            out = smp.values.sum(2) + self.out_proj.bias
        return out, smp.nonempty.transpose(2, 3)
