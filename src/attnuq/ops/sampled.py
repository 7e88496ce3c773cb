r"""Sampled (stochastic) attention and the closed-form moments of its output.

For one query of one head let :math:`\pi = \mathrm{softmax}(s)` be its attention weights over
``Lk`` keys and :math:`V` the ``(Lk, Dv)`` value matrix. Stochastic attention (SA, arXiv
2604.19530) replaces the output :math:`\mu = \pi^\top V` by

.. math:: Y = \frac{1}{\nu} W^\top V, \qquad W \sim \mathrm{Multinomial}(\nu, \pi),

i.e. the mean of ``nu`` value rows drawn i.i.d. from :math:`\pi`. Exactly:

* :math:`E[W/\nu] = \pi`, :math:`\mathrm{Cov}(W/\nu) = (\mathrm{diag}\,\pi - \pi\pi^\top)/\nu`;
* :math:`E[Y] = \mu` and :math:`\mathrm{Cov}(Y) = \frac{1}{\nu} V^\top(\mathrm{diag}\,\pi -
  \pi\pi^\top) V = \Sigma_V / \nu` with :math:`\Sigma_V = \sum_j \pi_j (v_j - \mu)(v_j - \mu)^\top`;
* :math:`\nu \to \infty` recovers the deterministic attention output.

:func:`attention_moments` returns :math:`\mu` and :math:`\mathrm{diag}\,\Sigma_V` in one pass
over the keys. Both functions take ``block_size`` to stream over key blocks without ever holding
an ``Lq x Lk`` probability matrix.

Implementation (dense path, ``block_size=None``): per group of heads the scores are turned into
probabilities, cumulated along the keys, and each draw is an inverse-CDF lookup
(``searchsorted``) of a uniform from ``torch.rand(generator=...)``; the value rows are then
averaged with ``embedding_bag`` (or, when ``nu`` is large compared to ``Lk``, through the count
matrix ``W``). No tensor of ``B*H*Lq*Lk*nu`` elements is formed.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from attnuq._validation import check_nu, check_positive_int
from attnuq.ops._attn_common import Attn, empty_rows_error, prepare

__all__ = ["EmptyRows", "attention_moments", "sampled_attention"]

EmptyRows = Literal["error", "zero"]

# Elements of score / probability storage allowed per chunk of groups on the dense path (the
# chunk always holds at least one group's full ``M x Lk`` matrix).
_DENSE_CHUNK_ELEMS = 1 << 19
# Elements allowed per chunk of groups on the blocked path (``M * (block_size + nu)`` per group).
_BLOCKED_CHUNK_ELEMS = 1 << 22


def _check_empty_rows(empty_rows: object) -> EmptyRows:
    if empty_rows not in ("error", "zero"):
        raise ValueError(f"empty_rows must be 'error' or 'zero', got {empty_rows=!r}")
    return empty_rows  # type: ignore[return-value]


def _check_block_size(block_size: object) -> int | None:
    if block_size is None:
        return None
    return check_positive_int(block_size, "block_size")


def _group_chunks(total: int, per_group: int, budget: int) -> list[tuple[int, int]]:
    step = max(1, budget // max(1, per_group))
    return [(g0, min(total, g0 + step)) for g0 in range(0, total, step)]


def _inverse_cdf(c: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Indices ``j`` with ``c[j-1] <= u * c[-1] < c[j]`` for cumulative masses ``c`` ``(..., n)``
    and uniforms ``u`` ``(..., nu)`` in ``[0, 1)``. Keys of zero mass are never returned; rows of
    zero total mass return garbage in ``[0, n)`` (callers handle them)."""
    total = c[..., -1:]
    x = u * total
    # u < 1 but u * total may round up to total: keep it strictly below.
    x = torch.minimum(x, torch.nextafter(total, torch.zeros_like(total)))
    idx = torch.searchsorted(c, x, right=True)
    return idx.clamp_max_(c.shape[-1] - 1)


@torch.no_grad()
def _indices_dense(
    att: Attn, nu: int, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw indices ``(G, M, nu)`` (int64) and flag empty rows ``(G, M)`` on the dense path."""
    dev, dt = att.q.device, att.q.dtype
    idx = torch.empty(att.groups, att.rows, nu, dtype=torch.long, device=dev)
    empty = torch.empty(att.groups, att.rows, dtype=torch.bool, device=dev)
    for g0, g1 in _group_chunks(att.groups, att.rows * att.lk, _DENSE_CHUNK_ELEMS):
        s = att.scores(g0, g1, 0, att.lk)  # (g, M, Lk)
        p = torch.softmax(s, dim=-1)  # NaN on rows with every key masked
        del s
        c = p.cumsum_(-1)
        tot = c[..., -1]
        empty[g0:g1] = ~(tot > 0)
        u = torch.rand((g1 - g0, att.rows, nu), generator=generator, device=dev, dtype=dt)
        idx[g0:g1] = _inverse_cdf(c, u)
    return idx, empty


@torch.no_grad()
def _indices_blocked(
    att: Attn, nu: int, block_size: int, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw indices ``(G, M, nu)`` streaming over key blocks of ``block_size``.

    Each draw keeps a running choice. With running log-mass ``L`` of the keys seen so far and
    block log-mass ``l_b``, the choice is replaced by a draw from the block (inverse CDF within it)
    with probability ``p_b = exp(l_b - logaddexp(L, l_b))``. By induction the choice after block
    ``b`` is distributed as ``softmax`` restricted to blocks ``1..b``, so after the last block it
    is an exact draw from the full softmax. One uniform ``u`` per draw and block serves both the
    coin (``u < p_b``) and, given replacement, the within-block position (``u / p_b`` is then
    uniform on ``[0, 1)``).
    """
    dev, dt = att.q.device, att.q.dtype
    idx = torch.zeros(att.groups, att.rows, nu, dtype=torch.long, device=dev)
    empty = torch.empty(att.groups, att.rows, dtype=torch.bool, device=dev)
    neg_inf = torch.tensor(float("-inf"), dtype=dt, device=dev)
    one = torch.tensor(1.0, dtype=dt, device=dev)
    for g0, g1 in _group_chunks(att.groups, att.rows * (block_size + nu), _BLOCKED_CHUNK_ELEMS):
        g = g1 - g0
        run = torch.full((g, att.rows, 1), float("-inf"), dtype=dt, device=dev)  # log-mass
        choice = idx[g0:g1]
        for j0 in range(0, att.lk, block_size):
            j1 = min(att.lk, j0 + block_size)
            s = att.scores(g0, g1, j0, j1)  # (g, M, nb)
            mb = s.amax(-1, keepdim=True)
            mb = torch.where(torch.isfinite(mb), mb, torch.zeros_like(mb))
            c = s.sub_(mb).exp_().cumsum_(-1)  # unnormalised block CDF
            tot = c[..., -1:]
            lb = torch.where(tot > 0, tot.log() + mb, neg_inf)  # (g, M, 1)
            new_run = torch.logaddexp(run, lb)
            p = torch.where(lb > neg_inf, (lb - new_run).exp(), torch.zeros_like(lb))
            p = torch.minimum(p, one)
            run = new_run
            u = torch.rand((g, att.rows, nu), generator=generator, device=dev, dtype=dt)
            take = u < p  # (g, M, nu)
            local = _inverse_cdf(c, (u / torch.where(p > 0, p, one)).clamp_max_(1.0)) + j0
            choice.copy_(torch.where(take, local, choice))
        empty[g0:g1] = (run == neg_inf).squeeze(-1)
    return idx, empty


def _sample_indices(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    nu: int,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    block_size: int | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Private: the key indices drawn by :func:`sampled_attention` (for tests and benchmarks).

    Returns ``idx`` ``(*batch, Hq, Lq, nu)`` int64 and ``empty`` ``(*batch, Hq, Lq)`` bool
    (rows with every key masked; their indices are meaningless).
    """
    nu = check_nu(nu)
    block_size = _check_block_size(block_size)
    att = prepare(q, k, v, attn_mask, is_causal, scale, enable_gqa)
    idx, empty = _draw(att, nu, block_size, generator)
    return att.unfold(idx), att.unfold(empty.unsqueeze(-1)).squeeze(-1)


def _draw(
    att: Attn, nu: int, block_size: int | None, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if att.lk == 0:
        z = torch.zeros(att.groups, att.rows, nu, dtype=torch.long, device=att.q.device)
        return z, torch.ones(att.groups, att.rows, dtype=torch.bool, device=att.q.device)
    if block_size is None or block_size >= att.lk:
        return _indices_dense(att, nu, generator)
    return _indices_blocked(att, nu, block_size, generator)


def sampled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    nu: int,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    block_size: int | None = None,
    generator: torch.Generator | None = None,
    empty_rows: EmptyRows = "error",
) -> torch.Tensor:
    r"""Stochastic attention: the mean of ``nu`` value rows drawn i.i.d. from the softmax weights.

    For every query (and head) with weights :math:`\pi = \mathrm{softmax}(q K^\top \cdot
    \mathrm{scale} + \mathrm{mask})` this returns :math:`Y = W^\top V / \nu` with
    :math:`W \sim \mathrm{Multinomial}(\nu, \pi)`, so that

    * :math:`E[Y] = \pi^\top V` (the ordinary attention output, exactly),
    * :math:`\mathrm{Cov}(Y) = \frac{1}{\nu} V^\top(\mathrm{diag}\,\pi - \pi\pi^\top)V`
      (from :math:`E[W/\nu] = \pi` and
      :math:`\mathrm{Cov}(W/\nu) = (\mathrm{diag}\,\pi - \pi\pi^\top)/\nu`).

    The closed-form mean and per-dimension variance are :func:`attention_moments` (divide its
    ``var`` by ``nu``). Draws are independent across queries, heads and batch entries.

    Parameters
    ----------
    q : Tensor
        Queries ``(*batch, Hq, Lq, D)`` (also ``(Lq, D)``), float32, float64, float16 or bfloat16.
    k : Tensor
        Keys ``(*batch, Hk, Lk, D)``, same dtype and device as ``q``.
    v : Tensor
        Values ``(*batch, Hk, Lk, Dv)``.
    nu : int
        Number of draws per query, ``>= 1``.
    attn_mask : Tensor, optional
        Boolean (``True`` = key takes part) or additive float mask broadcastable to
        ``(*batch, Hq, Lq, Lk)``, as in :func:`torch.nn.functional.scaled_dot_product_attention`.
    is_causal : bool
        Query ``i`` sees keys ``j <= i`` (top-left aligned when ``Lq != Lk``, like SDPA). May be
        combined with ``attn_mask`` (both apply; SDPA itself refuses the combination).
    scale : float, optional
        Score scale, default ``1 / sqrt(D)``.
    enable_gqa : bool
        Grouped-query attention: ``Hq`` a multiple of ``Hk``; query head ``h`` uses key/value
        head ``h // (Hq // Hk)``.
    block_size : int, optional
        Stream over key blocks of this size (a running categorical choice per draw, exact in
        distribution), never holding an ``Lq x Lk`` matrix: extra memory
        ``O(B * H * Lq * (nu + block_size))``. ``None`` (default) is the dense path, which holds
        the ``Lq x Lk`` probabilities of a few heads at a time and is faster for short sequences.
    generator : torch.Generator, optional
        Source of the uniforms; the same generator state (and the same arguments) gives the same
        draws.
    empty_rows : {"error", "zero"}
        What to do with a query whose every key is masked: ``"error"`` (default) raises a
        ``ValueError`` naming the count and the first ``(batch, head, query)``; ``"zero"`` returns
        a zero row, which is what ``F.scaled_dot_product_attention`` returns for such rows in
        torch 2.5+ (checked on 2.13), e.g. for left-padded queries.

    Returns
    -------
    Tensor
        ``(*batch, Hq, Lq, Dv)`` in the dtype of ``q``. Sampling runs in float32 (float64 for
        float64 inputs). Differentiable with respect to ``v`` (the sampled counts are constants);
        no gradient flows to ``q`` or ``k``.

    Examples
    --------
    >>> import torch
    >>> from attnuq.ops import sampled_attention
    >>> q, k, v = torch.randn(3, 2, 4, 5, 8).unbind(0)  # (B=2, H=4, L=5, D=8)
    >>> g = torch.Generator().manual_seed(0)
    >>> y = sampled_attention(q, k, v, nu=8, is_causal=True, generator=g)
    >>> y.shape
    torch.Size([2, 4, 5, 8])
    >>> torch.allclose(y[..., 0, :], v[..., 0, :])  # the first query can only see key 0
    True
    """
    nu = check_nu(nu)
    block_size = _check_block_size(block_size)
    empty_rows = _check_empty_rows(empty_rows)
    att = prepare(q, k, v, attn_mask, is_causal, scale, enable_gqa)
    if att.groups * att.rows == 0:
        return torch.zeros(att.out_shape, dtype=att.out_dtype, device=q.device)
    idx, empty = _draw(att, nu, block_size, generator)
    has_empty = bool(empty.any())
    if has_empty and empty_rows == "error":
        raise empty_rows_error(att, empty)
    g, m, lk = att.groups, att.rows, att.lk
    offs = torch.arange(g, device=idx.device).mul_(lk).view(g, 1, 1)
    flat = (idx + offs).view(g * m, nu)
    out = F.embedding_bag(flat, att.v.reshape(g * lk, att.dv), mode="mean")  # (G*M, Dv)
    out = out.view(g, m, att.dv)
    if has_empty:
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return att.unfold(out).to(att.out_dtype)


def _moments(att: Attn, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online-softmax moments over key blocks: mean, var ``(G, M, Dv)`` and empty ``(G, M)``.

    Values are centred on their unweighted mean per group (``vbar``) to limit cancellation in
    ``E[v^2] - E[v]^2``; the shift cancels exactly (variance is shift-invariant).
    """
    dt = att.q.dtype
    lk = att.lk
    per_group = att.rows * min(block_size, lk)
    means, vars_, empties = [], [], []
    for g0, g1 in _group_chunks(att.groups, per_group, _DENSE_CHUNK_ELEMS):
        v = att.v[g0:g1]
        vbar = v.mean(dim=1, keepdim=True)  # (g, 1, Dv)
        vc = v - vbar
        vc2 = vc * vc
        g = g1 - g0
        run_max: torch.Tensor | None = None
        l_acc = a1 = a2 = None
        for j0 in range(0, lk, block_size):
            j1 = min(lk, j0 + block_size)
            s = att.scores(g0, g1, j0, j1)  # (g, M, nb)
            with torch.no_grad():
                bm = s.amax(-1, keepdim=True)
                new_max = bm if run_max is None else torch.maximum(run_max, bm)
                shift = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
            e = torch.exp(s - shift)  # (g, M, nb); masked keys -> 0
            le = e.sum(-1, keepdim=True)
            b1 = torch.bmm(e, vc[:, j0:j1])
            b2 = torch.bmm(e, vc2[:, j0:j1])
            if run_max is None:
                l_acc, a1, a2 = le, b1, b2
            else:
                assert l_acc is not None and a1 is not None and a2 is not None
                with torch.no_grad():
                    old = torch.where(torch.isfinite(run_max), run_max, torch.zeros_like(run_max))
                    alpha = torch.where(torch.isfinite(run_max), torch.exp(old - shift), 0.0)
                l_acc = l_acc * alpha + le
                a1 = a1 * alpha + b1
                a2 = a2 * alpha + b2
            run_max = new_max
        assert l_acc is not None and a1 is not None and a2 is not None
        emp = ~(l_acc > 0)  # (g, M, 1)
        denom = torch.where(emp, torch.ones_like(l_acc), l_acc)
        mc = a1 / denom
        var = (a2 / denom - mc * mc).clamp_min(0.0)
        mean = torch.where(emp, torch.zeros((), dtype=dt, device=mc.device), mc + vbar)
        var = torch.where(emp, torch.zeros((), dtype=dt, device=mc.device), var)
        means.append(mean)
        vars_.append(var)
        empties.append(emp.squeeze(-1))
        del g
    return torch.cat(means), torch.cat(vars_), torch.cat(empties)


def attention_moments(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    block_size: int | None = None,
    empty_rows: EmptyRows = "error",
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Attention output and per-dimension value variance, in one pass over the keys.

    For each query with weights :math:`\pi` and values :math:`v_j`:

    * ``mean`` :math:`= \mu = \sum_j \pi_j v_j` (equals ``F.scaled_dot_product_attention``),
    * ``var`` :math:`= \mathrm{diag}\,\Sigma_V = \sum_j \pi_j v_j^{\odot 2} - \mu^{\odot 2}`,
      so ``var.sum(-1)`` is :math:`\mathrm{tr}\,\Sigma_V` and
      ``var / nu`` is the per-dimension variance of :func:`sampled_attention`'s output.

    Accumulation uses one extra accumulator for :math:`\sum_j \pi_j v_j^2` (with values centred
    on their unweighted mean to limit cancellation), online softmax (running max and normaliser)
    over key blocks when ``block_size`` is given. Float64 inputs accumulate in float64, others in
    float32. Differentiable in ``q``, ``k`` and ``v``.

    Parameters
    ----------
    q, k, v, attn_mask, is_causal, scale, enable_gqa
        As in :func:`sampled_attention` (SDPA conventions, ``(*batch, H, L, D)``).
    block_size : int, optional
        Key block size of the online-softmax pass; never holds an ``Lq x Lk`` matrix. ``None``
        processes all keys at once (a few heads at a time).
    empty_rows : {"error", "zero"}
        Rows with every key masked: raise (default) or return zero mean and zero variance
        (SDPA returns a zero output for them).

    Returns
    -------
    mean, var : Tensor
        Both ``(*batch, Hq, Lq, Dv)`` in the dtype of ``q``.

    Examples
    --------
    >>> import torch
    >>> from attnuq.ops import attention_moments
    >>> q, k, v = torch.randn(3, 2, 4, 16, 8, dtype=torch.float64).unbind(0)
    >>> mean, var = attention_moments(q, k, v, block_size=4)
    >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    >>> bool(torch.allclose(mean, ref)), var.shape
    (True, torch.Size([2, 4, 16, 8]))
    """
    block_size = _check_block_size(block_size)
    empty_rows = _check_empty_rows(empty_rows)
    att = prepare(q, k, v, attn_mask, is_causal, scale, enable_gqa)
    if att.groups * att.rows == 0 or att.lk == 0:
        if att.groups * att.rows > 0 and empty_rows == "error":
            raise empty_rows_error(att, torch.ones(att.groups, att.rows, dtype=torch.bool))
        z = torch.zeros(att.out_shape, dtype=att.out_dtype, device=q.device)
        return z, z.clone()
    mean, var, empty = _moments(att, block_size or att.lk)
    if empty_rows == "error" and bool(empty.any()):
        raise empty_rows_error(att, empty)
    return att.unfold(mean).to(att.out_dtype), att.unfold(var).to(att.out_dtype)
