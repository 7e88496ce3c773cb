"""Brute-force float64 references for ``attnuq.ops.sampled`` (slow, obvious, loop-based)."""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy import stats


def ref_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Softmax weights ``(B, Hq, Lq, Lk)`` in float64, one query at a time.

    Fully masked rows are all zeros.
    """
    q, k = q.double(), k.double()
    b, hq, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    sc = 1.0 / math.sqrt(d) if scale is None else scale
    mask = None
    if attn_mask is not None:
        mask = attn_mask.expand(b, hq, lq, lk)
    p = torch.zeros(b, hq, lq, lk, dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            hkv = h // (hq // hk) if enable_gqa else h
            for i in range(lq):
                w = []
                for j in range(lk):
                    s = float(q[bi, h, i] @ k[bi, hkv, j]) * sc
                    if is_causal and j > i:
                        s = -math.inf
                    if mask is not None:
                        m = mask[bi, h, i, j]
                        if m.dtype == torch.bool:
                            s = s if bool(m) else -math.inf
                        else:
                            s = s + float(m)
                    w.append(s)
                mx = max(w)
                if mx == -math.inf:
                    continue
                e = [math.exp(x - mx) for x in w]
                tot = sum(e)
                p[bi, h, i] = torch.tensor([x / tot for x in e], dtype=torch.float64)
    return p


def expand_kv(x: torch.Tensor, hq: int) -> torch.Tensor:
    """Repeat key/value heads to ``hq`` heads (GQA: head h reads h // (hq // hk))."""
    return x.double().repeat_interleave(hq // x.shape[1], dim=1)


def ref_moments(p: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean ``sum_j p_j v_j`` and two-pass variance ``sum_j p_j (v_j - mu)^2``."""
    v = expand_kv(v, p.shape[1])  # (B, Hq, Lk, Dv)
    mean = p @ v
    dev = v.unsqueeze(2) - mean.unsqueeze(3)  # (B, Hq, Lq, Lk, Dv)
    var = (p.unsqueeze(-1) * dev**2).sum(3)
    return mean, var


def ref_output_cov(p: torch.Tensor, v: torch.Tensor, nu: int) -> torch.Tensor:
    """Covariance ``(1/nu) V^T (diag(p) - p p^T) V`` per query: ``(B, Hq, Lq, Dv, Dv)``."""
    v = expand_kv(v, p.shape[1])
    c = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)  # (B, Hq, Lq, Lk, Lk)
    return v.transpose(-1, -2).unsqueeze(2) @ c @ v.unsqueeze(2) / nu


def chi2_gof_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness-of-fit p-value; cells with expected count < 5 are pooled."""
    n = counts.sum()
    exp = probs * n
    keep = exp >= 5
    obs = list(counts[keep])
    ex = list(exp[keep])
    if (~keep).any():
        obs.append(counts[~keep].sum())
        ex.append(exp[~keep].sum())
    obs_a, ex_a = np.asarray(obs, float), np.asarray(ex, float)
    if len(obs_a) < 2:
        return 1.0
    stat = float(((obs_a - ex_a) ** 2 / ex_a).sum())
    return float(stats.chi2.sf(stat, len(obs_a) - 1))


def chi2_two_sample_pvalue(a: np.ndarray, b: np.ndarray) -> float:
    """Chi-square homogeneity p-value of two count vectors (cells empty in both dropped)."""
    keep = (a + b) > 0
    table = np.stack([a[keep], b[keep]])
    if table.shape[1] < 2:
        return 1.0
    return float(stats.chi2_contingency(table, correction=False).pvalue)
