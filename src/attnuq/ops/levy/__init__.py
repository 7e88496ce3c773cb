"""Levy attention: continuous-time Poisson cross-attention with single-pass uncertainty.

API (stable; ``attnuq.nn.LevyAttention`` is the module wrapper)
---------------------------------------------------------------
``levy_attention(q, k, a, times, mask, *, alpha, beta, h, omega=None, phase=None, D=None,
per_dim=True, block_size=256, backend="auto") -> LevyResult``

* ``q``     ``(B, H, Q, E)`` query embeddings (one per query time and head).
* ``k``     ``(B, H, N, E)`` key embeddings of the observations ``(t_i, c_i)``.
* ``a``     ``(B, H, N, Dv)`` value embeddings ``a_i`` of ``(x_i, c_i)``.
* ``times`` ``(B, N)`` observation times ``t_i`` (any real numbers; order does not matter).
* ``mask``  ``(B, N)`` bool, ``True`` = observed. Masked entries are ignored and may hold
  anything, NaN included.
* ``alpha``, ``beta`` ``> 0`` and ``h >= 0``: floats or tensors of shape ``()`` or ``(H,)``.
* ``omega``, ``phase``: ``(K,)`` or ``(H, K)`` Fourier frequencies ``omega_k`` and phases ``b_k``;
  ``D``: ``(Dv, K)`` or ``(H, Dv, K)``. Either all three or none (``D = 0``).

``LevyResult`` (frozen dataclass), shapes in the ``F.scaled_dot_product_attention`` convention
``(B, H, Q, ...)``:

* ``mean``      ``(B, H, Q, Dv)`` ``mu_q = sum_i p_qi (a_i + D m_i)``.
* ``var``       ``(B, H, Q, Dv)`` ``diag Sigma_V(q)``: the per-atom value covariance
  (``None`` with ``per_dim=False``, which computes only the trace and is cheaper).
* ``evidence``  ``(B, H, Q)`` ``Lambda_q = sum_i w_qi``.
* ``p_empty``   ``(B, H, Q)`` ``exp(-Lambda_q)``.
* ``phi``       ``(B, H, Q)`` ``phi(Lambda_q) = E[1/N | N >= 1]``.
* ``sigma``     ``(B, H, Q)`` ``sqrt(tr Sigma_V(q) phi(Lambda_q))``.
* ``sigma_dim`` ``(B, H, Q, Dv)`` ``sqrt(Sigma_V,jj(q) phi(Lambda_q))`` (``None`` with
  ``per_dim=False``).

``levy_attention_sample(q, k, a, times, mask, *, alpha, beta, h, omega, phase, D,
num_samples, generator=None) -> LevySamples`` draws the Poisson random measure explicitly:
``values`` ``(S, B, H, Q, Dv)``, ``counts`` ``(S, B, H, Q)`` (atoms ``N_q``), ``nonempty``
``(S, B, H, Q)`` (``N_q >= 1``; ``values`` is 0 where it is False).

Math (METHODS.md section 2), per batch element, head and query ``q``
-------------------------------------------------------------------
* ``w_qi = alpha exp(beta (cos(q, k_i) - 1))`` for observed ``i`` (0 for masked ``i``),
  ``Lambda_q = sum_i w_qi``, ``p_qi = w_qi / Lambda_q``.
* An atom spawned by ``i`` sits at ``t ~ N(t_i, h^2)`` and carries ``V_i(t) = a_i + D g(t)`` with
  ``g_k(t) = cos(omega_k t + b_k)``. Under the mollifier
  ``E g_k = m_ik = exp(-omega_k^2 h^2 / 2) cos(omega_k t_i + b_k)`` and, with ``z_k = omega_k t_i
  + b_k``, ``e_kl = exp(-(omega_k^2 + omega_l^2) h^2 / 2)`` and ``u_kl = omega_k omega_l h^2``,

      Cov(g)_kl = e_kl [ (cosh u_kl - 1) cos z_k cos z_l + sinh u_kl sin z_k sin z_l ],

  which is METHODS' ``E[g g^T] - m m^T`` rewritten without cancellation (``cosh u - 1 =
  2 sinh^2(u/2)``). Hence ``vbar_i = a_i + D m_i`` and the within-atom variance
  ``s_ij = D_j Cov(g) D_j^T`` are closed-form, and

      mu_q = sum_i p_qi vbar_i,      Sigma_V,jj(q) = sum_i p_qi (vbar_ij^2 + s_ij) - mu_qj^2.

* ``Y_q = (1/N_q) sum_m V_{i_m}(t_m)`` with ``N_q ~ Poisson(Lambda_q)``: conditional on
  ``N_q >= 1``, ``E Y_q = mu_q`` and ``E|Y_q - mu_q|^2 = tr Sigma_V(q) phi(Lambda_q)``.

Layout of the package
---------------------
* :mod:`~attnuq.ops.levy.reference`: :func:`levy_attention_reference`, the formulas above in
  plain torch (no blocks, shifts or fused kernels), the oracle every strategy is tested
  against in float64, values and gradients (tests/attnuq/ops/test_levy_reference.py).
* ``_validate``: the checks, run once per public call at its entry.
* ``_dispatch``: the table of execution strategies (:data:`STRATEGIES`: ``native``,
  ``flash_grad``, ``triton``, ``flash``, ``sentinel``, ``explicit``), each implementing one
  ``backend``, and the one dispatcher over it; the torch strategies share their start (blocks,
  value field, reference) and their end (the outputs from the moments).
* ``_field`` (the value field's moments), ``_native_path`` (the compiled forward), ``_flash``
  (the differentiable CPU path), ``_sdpa`` (fused inference and sentinel paths), ``_explicit``,
  ``_op`` (the ``torch.library`` custom op), ``_sample`` (the explicit sampler).

Implementation notes
--------------------
* Compiled path (``backend="native"``; what ``"auto"`` runs on CPU without autograd):
  ``csrc/levy.c`` through :mod:`attnuq.ops._native`, everything after the time features
  (torch's ``cos``/``sin``) in one pass per series: the observed entries are gathered in order,
  keys normalised, ``vbar`` and the within-atom variance formed (field weights derived from
  ``D``, ``omega``, ``h`` in double), the rows ``[vbar - ref, second moment]`` kept in cache, then
  per head and tile of queries the scores, ``2^(s - max)``, the weighted rows, ``Lambda``,
  ``phi`` (the tables of :mod:`attnuq.ops.phi`) and the outputs. float32 and float64; any
  ``beta`` (max-shifted like the explicit path); sums over observations in index order, so
  appended masked entries change no bit. It reads only observed rows of ``k`` and ``a`` and
  checks them (and ``q``) itself: a non-finite value sends the call to the detailed checks of
  the torch path, which raise (or, for finite values whose squares overflow, run the torch path).
  Tested against the explicit path at 1e-12 in float64.
* Fused torch path (``backend="sdpa"``, chosen by ``"auto"`` otherwise when
  ``beta <= log(finfo.max) / 4``, i.e. 22 in float32 and 177 in float64): the sums
  ``sum_i e^{beta cos_qi} [v_i, v_i^2 + s_i]`` and the normaliser come from ONE fused attention
  call per block.

  - Without autograd (inference) on CPU: the flash-attention kernel behind
    ``F.scaled_dot_product_attention`` also returns ``lse_q = log sum_i e^{beta cos_qi}``, so
    ``Lambda_q = alpha e^{lse_q - beta}`` needs no extra key or column. Values are
    ``[v - ref, (v - ref)^2 + s]`` (width ``2 Dv``; ``Dv + 1`` for the trace), queries
    ``[beta qn, 0]`` and keys ``[kn, *]`` padded to that width (the kernel needs equal
    widths); keys and values are overlapping views of one ``[kn | v - ref | second moment]``
    buffer, the keys' padding being met by the queries' zeros. Masked keys get an additive
    ``-1e4`` (weight exactly 0).
  - With autograd on CPU (float32, float64): the same flash kernel and its log-sum-exp in a
    custom autograd function with a hand-derived backward (``_flash._FlashBlock``): key
    normalisation, centred values and the attention per block, and ONE call of the kernel's
    backward, handed a zero value column whose gradient carries ``dL/d lse`` (verified by
    gradcheck in float64). No sentinel key, no extra normaliser column.
  - With autograd elsewhere (or a torch build without the CPU flash backward): a sentinel key
    with known score ``-beta`` and value ``e_0`` is prepended; its output weight ``o_q`` gives
    ``Z_q e^{beta} = (1 - o_q) / o_q`` (every observed term is ``>= 1`` relative to the
    sentinel, so ``o_q <= 1/2`` and there is no cancellation), and
    ``Lambda_q = alpha e^{-2 beta} (1 - o_q) / o_q``. Masked keys get score ``-1e4``.

  The two agree to rounding (tested at 1e-12 in float64).
* Explicit path (``backend="explicit"``, any ``beta``): scores, the exact max ``M_q`` over
  observed ``i``, ``exp(beta cos - M_q)`` and GEMMs; ``Lambda_q = alpha e^{M_q - beta} Z_q``.
  Tests check that both paths agree (values and gradients) to 1e-12 in float64.
* Within-atom variance without ``2 K^2`` products per observation: the summand of
  ``s_ij = sum_{k,l} D_jk D_jl Cov(g)_kl`` is symmetric in ``(k, l)``, so it is one GEMM of the
  ``K (K + 1)`` products ``c_k c_l``, ``s_k s_l`` with ``k <= l`` (off-diagonal weights doubled);
  for the trace only (``per_dim=False``) the weights are summed over ``j`` before the GEMM
  (see ``_field._field``).
* Masked entries: ``times`` are zeroed; ``k`` and ``a`` are zeroed only where needed (some
  non-finite entry in ``k``, or ``a`` not bounded by ``finfo.max ** (1/4)`` in norm, checked by
  one reduction each); otherwise their masked rows stay finite through every step and get
  weight exactly 0, contributing exact zeros. Every sum over observations runs over
  fixed-size, zero-padded blocks of ``block_size`` accumulated in order, so the same
  numbers meet the same kernels whatever the padded length: appending masked observations
  leaves every output bit-identical (tested with 3 and 300 extra entries, NaN and finite
  garbage, float64 and float32).
* The second moment is accumulated about a per-series reference (the plain mean of ``vbar`` over
  observed ``i``), which removes most of the cancellation of ``E v^2 - (E v)^2`` in float32.
* Empty series (no observed entry): ``evidence = 0``, ``p_empty = 1``, ``mean = 0``, ``var = 0``,
  ``phi = 1``, ``sigma = 0``; gradients are finite (zero where the output is constant). ``N = 0``
  (no entry at all) is the same: one masked entry is appended. ``B``, ``H`` or ``Q = 0`` give
  empty outputs.
  NOTE(paper): the moments conditional on ``N >= 1`` do not exist when ``Lambda = 0``; these
  values are a convention, and ``p_empty = 1`` is the signal to act on.

* Times are plain real numbers: negative and unsorted times are accepted (the operator is
  permutation invariant; tested to 1e-12).
* ``sqrt`` has an infinite derivative at 0: ``sigma`` and ``sigma_dim`` use a guarded square
  root whose gradient is 0 where the variance is exactly 0.
* NOTE(paper): the paper states the variance identity for the trace; the per-dimension
  ``sigma_dim`` uses the same identity per coordinate, which holds because the atoms are i.i.d.
"""

from __future__ import annotations

import torch

from attnuq._validation import check_positive_int
from attnuq.ops import _rng
from attnuq.ops.levy._common import _FLASH as _FLASH
from attnuq.ops.levy._common import _FLASH_BWD as _FLASH_BWD
from attnuq.ops.levy._common import _safe_sqrt as _safe_sqrt
from attnuq.ops.levy._common import _weights
from attnuq.ops.levy._dispatch import STRATEGIES, levy_attention_impl
from attnuq.ops.levy._field import _pair_index as _pair_index
from attnuq.ops.levy._field import _SharedField as _SharedField
from attnuq.ops.levy._flash import _FlashBlock as _FlashBlock
from attnuq.ops.levy._op import _levy_op as _levy_op
from attnuq.ops.levy._op import _levy_via_op
from attnuq.ops.levy._sample import levy_attention_sample
from attnuq.ops.levy._types import LevyResult, LevySamples, _Args, _Call
from attnuq.ops.levy._validate import _validate
from attnuq.ops.levy.reference import levy_attention_reference

__all__ = [
    "STRATEGIES",
    "LevyResult",
    "LevySamples",
    "levy_attention",
    "levy_attention_reference",
    "levy_attention_sample",
    "levy_weights",
]


def levy_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor,
    *,
    alpha: float | torch.Tensor,
    beta: float | torch.Tensor,
) -> torch.Tensor:
    """Compatibilities ``w_qi = alpha exp(beta (cos(q, k_i) - 1))``, 0 for masked ``i``.

    Parameters
    ----------
    q : ``(B, H, Q, E)``; k : ``(B, H, N, E)``; mask : ``(B, N)`` bool (True = observed).
    alpha, beta : ``> 0``, scalars or ``(H,)``.

    Returns
    -------
    torch.Tensor
        ``(B, H, Q, N)``; ``evidence = w.sum(-1)``. May underflow to 0 for very large ``beta``
        (``levy_attention`` itself works in a shifted form that does not).

    Examples
    --------
    >>> import torch
    >>> q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4)
    >>> levy_weights(q, k, torch.ones(1, 5, dtype=torch.bool), alpha=1.0, beta=2.0).shape
    torch.Size([1, 2, 3, 5])
    """
    B, H = q.shape[:2]
    N = k.shape[2]
    dummy_a = k.new_zeros(B, H, N, 1)
    args = _Args(q, k, dummy_a, k.new_zeros(B, N), mask, alpha, beta, 0.0, None, None, None)
    return _weights(_validate(args))


def levy_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    a: torch.Tensor,
    times: torch.Tensor,
    mask: torch.Tensor,
    *,
    alpha: float | torch.Tensor,
    beta: float | torch.Tensor,
    h: float | torch.Tensor,
    omega: torch.Tensor | None = None,
    phase: torch.Tensor | None = None,
    D: torch.Tensor | None = None,
    per_dim: bool = True,
    block_size: int = 256,
    backend: str = "auto",
) -> LevyResult:
    r"""Expected Levy attention output and its closed-form uncertainty in one pass.

    .. math::

        w_{qi} = \alpha e^{\beta(\cos(q, k_i) - 1)},\quad \Lambda_q = \sum_i w_{qi},\quad
        p_{qi} = w_{qi} / \Lambda_q,\quad
        \mu_q = \sum_i p_{qi} (a_i + D m_i),\quad
        \hat\sigma_q = \sqrt{\operatorname{tr}\Sigma_V(q)\,\phi(\Lambda_q)},

    with ``m_ik = exp(-omega_k^2 h^2/2) cos(omega_k t_i + b_k)`` and ``Sigma_V(q)`` the covariance
    of one atom's value ``a_i + D g(t)``, ``i ~ p_q``, ``t ~ N(t_i, h^2)`` (module docstring).

    Parameters
    ----------
    q : torch.Tensor
        ``(B, H, Q, E)`` query embeddings.
    k : torch.Tensor
        ``(B, H, N, E)`` key embeddings of the observations.
    a : torch.Tensor
        ``(B, H, N, Dv)`` value embeddings ``a_i``.
    times : torch.Tensor
        ``(B, N)`` observation times (any real values, any order).
    mask : torch.Tensor
        ``(B, N)`` bool, ``True`` = observed; masked entries are ignored (may be NaN).
    alpha, beta : float or torch.Tensor
        ``> 0``, scalar or ``(H,)``: atoms per fully compatible observation, sharpness.
    h : float or torch.Tensor
        ``>= 0``, scalar or ``(H,)``: bandwidth of the Gaussian mollifier.
    omega, phase : torch.Tensor, optional
        ``(K,)`` or ``(H, K)`` Fourier frequencies and phases of ``g(t)``.
    D : torch.Tensor, optional
        ``(Dv, K)`` or ``(H, Dv, K)`` loading of ``g`` in the value field (None means ``D = 0``).
    per_dim : bool
        Compute ``var`` and ``sigma_dim`` per value dimension (default). ``False`` computes only
        the trace (``sigma``), which halves the width of the weighted value rows.
    block_size : int
        Observations per block in the sums over ``N`` of the torch paths (see module
        docstring); the compiled path sums in index order and ignores it.
    backend : {"auto", "native", "sdpa", "explicit"}
        ``"native"``: the compiled CPU kernel (inference only; float32 or float64; see the
        module docstring); raises ``ValueError`` where it cannot run (autograd, another device
        or dtype, no C compiler / ``ATTNUQ_NATIVE=0``). ``"sdpa"``: one fused attention call
        per block; on CPU (float32, float64) the flash kernel, whose log-sum-exp gives the
        normaliser (with autograd through a custom function whose backward is one call of the
        kernel's backward), elsewhere (or for value rows narrower than the keys)
        ``F.scaled_dot_product_attention`` with a sentinel key that recovers it; needs
        ``beta <= log(finfo.max) / 4`` (22 in float32, 177 in float64). ``"explicit"``:
        scores, a max shift, ``exp`` and GEMMs (any ``beta``). The strategies behind each
        backend: :data:`attnuq.ops.levy.STRATEGIES`. ``"auto"``: ``"native"`` for float32 and
        float64 on CPU without autograd when the kernel is available; otherwise ``"sdpa"``
        when ``beta`` allows and ``B * H * Q * N_obs >= 65536`` (``N_obs``: most observed
        entries in a series; below that the fused kernel's thread start-up costs more than it
        saves), else ``"explicit"``.

    Returns
    -------
    LevyResult
        ``mean``, ``var``, ``evidence``, ``p_empty``, ``phi``, ``sigma``, ``sigma_dim``, shaped
        ``(B, H, Q, ...)`` (on the compiled path: transposed views of ``(B, Q, H, ...)`` memory,
        so that concatenating the heads is free).

    Raises
    ------
    ValueError
        NaN/inf in observed ``times``, ``k``, ``a`` or in ``q``; ``alpha <= 0``, ``beta <= 0``,
        ``h < 0``; inconsistent shapes.

    Examples
    --------
    >>> import torch
    >>> from attnuq.ops import levy_attention
    >>> B, H, Q, N, E, Dv, K = 2, 4, 3, 10, 8, 5, 6
    >>> r = levy_attention(torch.randn(B, H, Q, E), torch.randn(B, H, N, E),
    ...                    torch.randn(B, H, N, Dv), torch.rand(B, N) * 48,
    ...                    torch.ones(B, N, dtype=torch.bool), alpha=1.0, beta=3.0, h=0.5,
    ...                    omega=torch.rand(K), phase=torch.rand(K), D=torch.randn(Dv, K))
    >>> r.mean.shape, r.sigma.shape, bool((r.p_empty == torch.exp(-r.evidence)).all())
    (torch.Size([2, 4, 3, 5]), torch.Size([2, 4, 3]), True)
    """
    block_size = check_positive_int(block_size, "block_size")
    if backend not in ("auto", "native", "sdpa", "explicit"):
        raise ValueError(
            f"backend must be 'auto', 'native', 'sdpa' or 'explicit', got {backend=!r}"
        )
    if not isinstance(per_dim, bool):
        raise TypeError(f"per_dim must be a bool, got {per_dim=!r}")
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad
        for t in (q, k, a, times, alpha, beta, h, omega, phase, D))
    call = _Call(_Args(q, k, a, times, mask, alpha, beta, h, omega, phase, D), per_dim,
                 block_size, backend)
    if not needs_grad and isinstance(q, torch.Tensor) and _rng.tracing(q):
        # traced inference (torch.compile, torch.export): one opaque custom op
        return _levy_via_op(call)
    return levy_attention_impl(call, needs_grad)
