"""Explicit draws of the Poisson random measure behind Levy attention."""

from __future__ import annotations

import torch

from attnuq._validation import check_positive_int
from attnuq.ops.levy._common import _weights
from attnuq.ops.levy._types import LevySamples, _Args
from attnuq.ops.levy._validate import _pad_one_masked, _validate


@torch.no_grad()
def levy_attention_sample(
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
    num_samples: int,
    generator: torch.Generator | None = None,
    max_atoms_per_chunk: int = 4_000_000,
) -> LevySamples:
    r"""Draw the Poisson random measure explicitly (the sampled operator the layer averages).

    For each draw, query and head: ``N_q ~ Poisson(Lambda_q)``; each atom picks
    ``i ~ p_q`` and ``t ~ N(t_i, h^2)`` and carries ``V_i(t) = a_i + D g(t)``;
    ``Y_q = (1/N_q) sum_m V_{i_m}(t_m)`` if ``N_q >= 1``. Vectorised: counts first, then all
    atoms of a chunk of draws at once (inverse CDF on a row-offset global CDF), then a
    scatter-add per draw. Memory is ``O(max_atoms_per_chunk * (Dv + K))``.

    Parameters
    ----------
    q, k, a, times, mask, alpha, beta, h, omega, phase, D
        As in :func:`levy_attention`.
    num_samples : int
        ``S``, the number of independent draws.
    generator : torch.Generator, optional
        Source of randomness (on the inputs' device).
    max_atoms_per_chunk : int
        Draws are processed in chunks holding about this many atoms.

    Returns
    -------
    LevySamples
        ``values`` ``(S, B, H, Q, Dv)``, ``counts`` ``(S, B, H, Q)``, ``nonempty``
        ``(S, B, H, Q)``.

    Examples
    --------
    >>> import torch
    >>> from attnuq.ops import levy_attention_sample
    >>> out = levy_attention_sample(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4),
    ...                             torch.randn(1, 2, 5, 2), torch.rand(1, 5),
    ...                             torch.ones(1, 5, dtype=torch.bool),
    ...                             alpha=1.0, beta=2.0, h=0.1, num_samples=100)
    >>> out.values.shape
    torch.Size([100, 1, 2, 3, 2])
    """
    S = check_positive_int(num_samples, "num_samples")
    chunk_atoms = check_positive_int(max_atoms_per_chunk, "max_atoms_per_chunk")
    inp = _validate(_Args(q, k, a, times, mask, alpha, beta, h, omega, phase, D))
    if k.shape[2] == 0:  # N = 0: one masked entry; every draw is then empty
        inp = _pad_one_masked(inp)
        q, k, a, times, mask = inp.q, inp.k, inp.a, inp.times, inp.mask
    B, H, Q, _ = q.shape
    N, Dv = a.shape[2], a.shape[3]
    dt, dev = q.dtype, q.device
    # weights directly from the definition (a separate path from levy_attention's shifted form)
    w = _weights(inp)  # (B, H, Q, N)
    lam = w.sum(-1)  # (B, H, Q)
    R = B * H * Q
    cdf = w.reshape(R, N).cumsum(-1)
    tot = cdf[:, -1:]
    cdf = cdf / torch.where(tot > 0, tot, torch.ones_like(tot))  # last entry exactly 1
    # the search runs in float64 whatever the dtype: r + cdf in float32 cannot tell the
    # observations of row r apart once r reaches ~1e5 (2^24 / N)
    f64 = torch.float64
    gcdf = (cdf.to(f64) + torch.arange(R, device=dev, dtype=f64)[:, None]).reshape(-1)
    # flat position r * N + i  ->  source row (b * H + h) * N + i of a, times and the head
    r_idx = torch.arange(R, device=dev)
    bh_of_row = r_idx // Q  # b * H + h
    src_of_pos = (bh_of_row[:, None] * N + torch.arange(N, device=dev)).reshape(-1)
    head_of_pos = (bh_of_row % H).repeat_interleave(N)
    # last position with positive weight per row (guards u + r rounding up to r + 1)
    pos_w = (w.reshape(R, N) > 0).to(torch.long) * torch.arange(1, N + 1, device=dev)
    last_pos = r_idx * N + (pos_w.amax(-1) - 1).clamp_min(0)
    a_flat = torch.where(mask[:, None, :, None], a, torch.zeros_like(a)).reshape(B * H * N, Dv)
    t_flat = torch.where(mask, times, torch.zeros_like(times))[:, None, :].expand(B, H, N)
    t_flat = t_flat.reshape(-1)
    # Dv = 0: no value to add a field to (and the field's (H * Dv, K) matrix is empty)
    fourier = inp.omega is not None and inp.phase is not None and inp.D is not None and Dv > 0

    counts = torch.poisson(lam.reshape(1, R).expand(S, R).contiguous(), generator=generator)
    counts = counts.to(torch.long)  # (S, R)
    values = torch.zeros(S, R, Dv, dtype=dt, device=dev)
    per_draw = counts.sum(-1)  # (S,)
    biggest = int(per_draw.max()) if S else 0
    if biggest > chunk_atoms:
        raise ValueError(
            f"one draw holds {biggest} atoms (total evidence sum(Lambda) = "
            f"{float(lam.sum()):.4g} over {R} query rows), more than "
            f"max_atoms_per_chunk={chunk_atoms}: the explicit sampler costs O(Lambda) memory and "
            "time per draw; raise max_atoms_per_chunk if that memory is available, or use the "
            "closed form (levy_attention)"
        )
    s0 = 0
    while s0 < S:
        # grow the chunk of draws until it holds about chunk_atoms atoms (at least one draw)
        csum = torch.cumsum(per_draw[s0:], 0)
        s1 = s0 + max(1, int((csum <= chunk_atoms).sum()))
        cnt = counts[s0:s1].reshape(-1)  # ((s1 - s0) * R,)
        n_atoms = int(cnt.sum())
        if n_atoms:
            slot = torch.repeat_interleave(cnt)  # draw-row slot of every atom
            row = slot % R if R > 1 else torch.zeros_like(slot)
            u = torch.rand(n_atoms, generator=generator, dtype=f64, device=dev)
            pos = torch.searchsorted(gcdf, u.add_(row), right=True)
            pos = torch.minimum(pos, last_pos[row])  # atom's (row, i) in the flat CDF
            src = src_of_pos[pos]
            v = a_flat[src]  # (n_atoms, Dv)
            if fourier:
                assert inp.omega is not None and inp.phase is not None and inp.D is not None
                eps = torch.randn(n_atoms, generator=generator, dtype=dt, device=dev)
                if H == 1:
                    t = t_flat[src] + inp.h[0] * eps
                    g = torch.cos(t[:, None] * inp.omega[0] + inp.phase[0])  # (n_atoms, K)
                    v = v + g @ inp.D[0].transpose(0, 1)
                else:
                    hd = head_of_pos[pos]
                    t = t_flat[src] + inp.h[hd] * eps
                    om_h, ph_h = inp.omega.expand(H, -1), inp.phase.expand(H, -1)
                    g = torch.cos(t[:, None] * om_h[hd] + ph_h[hd])  # (n_atoms, K)
                    full = (g @ inp.D.reshape(H * Dv, -1).transpose(0, 1)).view(-1, H, Dv)
                    v = v + full.gather(1, hd[:, None, None].expand(-1, 1, Dv))[:, 0]
            sums = torch.zeros(cnt.numel(), Dv, dtype=dt, device=dev).index_add_(0, slot, v)
            values[s0:s1] = sums.reshape(s1 - s0, R, Dv)
        s0 = s1
    nonempty = counts >= 1
    values = values / counts.clamp_min(1).to(dt)[..., None]
    return LevySamples(
        values=values.reshape(S, B, H, Q, Dv),
        counts=counts.reshape(S, B, H, Q),
        nonempty=nonempty.reshape(S, B, H, Q),
    )
