"""Tests of ``attnuq.ops.sampled``: sampled attention and its closed-form moments.

Statistical tests fix their seeds and state their false-failure probability; tolerances come from
the sample size (z = 5 standard errors, two-sided normal tail 5.7e-7 per compared entry, or
chi-square p-value thresholds of 1e-6 per test).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tests.attnuq.ops._reference_sampled import (
    chi2_gof_pvalue,
    chi2_two_sample_pvalue,
    expand_kv,
    ref_moments,
    ref_output_cov,
    ref_probs,
)

from attnuq.nn.sampled import SampledAttention
from attnuq.ops import attention_moments, sampled_attention
from attnuq.ops._attn_common import LOG2E
from attnuq.ops.sampled import _sample_indices

Z = 5.0  # two-sided normal tail at 5 sigma: 5.7e-7 per compared entry
P_MIN = 1e-6  # chi-square p-value threshold: false-failure probability 1e-6 per test


# every test runs with both samplers (tests/attnuq/ops/conftest.py)
pytestmark = pytest.mark.usefixtures("sampler")


def _qkv(b, hq, hk, lq, lk, d, dv=None, seed=0, dtype=torch.float64, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g, dtype=torch.float64) * scale
    k = torch.randn(b, hk, lk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hk, lk, dv or d, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# closed-form mean and covariance with >= 1e5 draws
# ---------------------------------------------------------------------------------------------
def _draws(q, k, v, n, nu, block_size, **kw):
    """``n`` independent outputs ``(n, H, Lq, Dv)`` of sampled attention.

    Dense path: the batch is replicated ``n`` times and ``sampled_attention`` runs end to end.
    Blocked path: one call draws ``n * nu`` i.i.d. indices per query (``_sample_indices``), cut
    into ``n`` groups of ``nu`` whose value rows are averaged (the same average
    ``sampled_attention`` takes; ``test_sampled_gradient_wrt_v_is_counts`` ties the two), which
    avoids ``n``-fold batches of tiny matrices on the slow blocked path.
    """
    if block_size is None:
        qn, kn, vn = (t.expand(n, *t.shape[1:]) for t in (q, k, v))
        return sampled_attention(qn, kn, vn, nu=nu, generator=_gen(2), **kw)
    idx, _ = _sample_indices(q, k, v, nu=n * nu, block_size=block_size, generator=_gen(2), **kw)
    hq, lq = idx.shape[1], idx.shape[2]
    vv = expand_kv(v, hq)[0]  # (Hq, Lk, Dv)
    rows = torch.stack([vv[h][idx[0, h]] for h in range(hq)])  # (Hq, Lq, n * nu, Dv)
    y = rows.view(hq, lq, n, nu, -1).mean(3)  # (Hq, Lq, n, Dv)
    return y.permute(2, 0, 1, 3)


@pytest.mark.parametrize("block_size", [None, 2])
def test_weights_mean_and_covariance_match_multinomial(block_size):
    """With one-hot values the output *is* W / nu: E = pi, Cov = (diag pi - pi pi^T) / nu."""
    n, nu, lk = 100_000, 3, 5
    q, k, _ = _qkv(1, 1, 1, 2, lk, 4, seed=1)
    mask = torch.tensor([True, True, False, True, True])  # key 2 padded
    v = torch.eye(lk, dtype=torch.float64).expand(1, 1, lk, lk)
    y = _draws(q, k, v, n, nu, block_size, attn_mask=mask)  # (N, H, Lq, Lk) = W / nu
    p = ref_probs(q, k, mask)[0]  # (H, Lq, Lk)
    assert (y[..., 2] == 0).all()  # the padded key is never drawn
    # W / nu takes values in {0, 1/nu, ..., 1}: exact lattice
    assert torch.equal(torch.round(y * nu), y * nu)
    mean = y.mean(0)
    se = (p * (1 - p) / nu / n).sqrt()
    assert ((mean - p).abs() <= Z * se + 1e-12).all(), (mean - p).abs().max()
    yc = y - mean
    cov = torch.einsum("nhia,nhib->hiab", yc, yc) / (n - 1)
    want = (torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)) / nu
    prod = yc.unsqueeze(-1) * yc.unsqueeze(-2)
    se_cov = prod.std(0) / math.sqrt(n)  # standard error of each covariance entry
    # 2 queries x 25 entries: false failure <= 50 * 5.7e-7
    assert ((cov - want).abs() <= Z * se_cov + 1e-12).all(), (cov - want).abs().max()


@pytest.mark.parametrize("block_size", [None, 3])
def test_output_mean_and_covariance_match_closed_form(block_size):
    """E[Y] = pi^T V and Cov(Y) = (1/nu) V^T (diag pi - pi pi^T) V, 1e5 draws per query."""
    n, nu = 100_000, 4
    q, k, v = _qkv(1, 2, 1, 3, 7, 4, dv=3, seed=3)  # GQA: 2 query heads on 1 kv head
    kw = dict(is_causal=True, enable_gqa=True)
    y = _draws(q, k, v, n, nu, block_size, **kw)  # (N, 2, 3, 3)
    p = ref_probs(q, k, **kw)
    mu, var = ref_moments(p, v)
    cov = ref_output_cov(p, v, nu)[0]  # (H, Lq, Dv, Dv)
    assert torch.allclose(torch.diagonal(cov, dim1=-2, dim2=-1), var[0] / nu, atol=1e-12)
    mean = y.mean(0)
    se = (var[0] / nu / n).sqrt()
    # query 0 sees only key 0: zero variance, the output is exactly v_0
    assert torch.equal(y[:, :, 0], expand_kv(v, 2)[:, :, 0].expand(n, 2, 3))
    assert ((mean - mu[0]).abs() <= Z * se + 1e-12).all()
    yc = y - mean
    emp = torch.einsum("nhia,nhib->hiab", yc, yc) / (n - 1)
    se_cov = (yc.unsqueeze(-1) * yc.unsqueeze(-2)).std(0) / math.sqrt(n)
    # 2 heads x 3 queries x 9 entries: false failure <= 54 * 5.7e-7
    assert ((emp - cov).abs() <= Z * se_cov + 1e-12).all(), (emp - cov).abs().max()


# ---------------------------------------------------------------------------------------------
# blocked == dense in distribution (chi-square on index counts)
# ---------------------------------------------------------------------------------------------
def _counts(idx: torch.Tensor, lk: int) -> np.ndarray:
    """(..., nu) indices -> (..., Lk) counts."""
    return F.one_hot(idx, lk).sum(-2).numpy()


@pytest.mark.parametrize("block_size", [1, 2, 3, 6])
def test_blocked_and_dense_draw_from_the_softmax(block_size):
    nu, lk = 40_000, 7
    q, k, v = _qkv(2, 2, 1, 3, lk, 4, seed=5, scale=0.7)
    mask = torch.zeros(2, 1, 3, lk, dtype=torch.float64)
    mask[0, ..., 5] = float("-inf")  # a padded key in batch 0
    mask[1, ..., 1] = -0.5  # an additive bias in batch 1
    kw = dict(nu=nu, attn_mask=mask, is_causal=False, enable_gqa=True)
    dense, e1 = _sample_indices(q, k, v, generator=_gen(6), **kw)
    blocked, e2 = _sample_indices(q, k, v, generator=_gen(7), block_size=block_size, **kw)
    assert not e1.any() and not e2.any()
    p = ref_probs(q, k, mask, enable_gqa=True).numpy()
    cd, cb = _counts(dense, lk), _counts(blocked, lk)
    for ix in itertools.product(range(2), range(2), range(3)):
        assert (cd[ix][p[ix] == 0] == 0).all() and (cb[ix][p[ix] == 0] == 0).all()
        pos = p[ix] > 0
        # 12 queries x 3 tests, each with false-failure probability P_MIN
        assert chi2_gof_pvalue(cd[ix][pos], p[ix][pos]) > P_MIN
        assert chi2_gof_pvalue(cb[ix][pos], p[ix][pos]) > P_MIN
        assert chi2_two_sample_pvalue(cd[ix], cb[ix]) > P_MIN


def test_blocked_long_row_matches_softmax():
    """One query over 300 keys in blocks of 32 (several chunks of the running choice)."""
    lk, nu = 300, 60_000
    q, k, v = _qkv(1, 1, 1, 1, lk, 8, seed=8, scale=0.3)
    idx, _ = _sample_indices(q, k, v, nu=nu, block_size=32, generator=_gen(9))
    p = ref_probs(q, k).numpy()[0, 0, 0]
    assert chi2_gof_pvalue(_counts(idx, lk)[0, 0, 0], p) > P_MIN


# ---------------------------------------------------------------------------------------------
# attention_moments: dense == reference == SDPA; blocked == dense to 1e-10
# ---------------------------------------------------------------------------------------------
MASK_CASES = ["none", "bool", "additive", "causal", "causal+bool"]


def _mask(case: str, b: int, hq: int, lq: int, lk: int, seed: int = 0):
    g = _gen(seed)
    if case in ("bool", "causal+bool"):
        m = torch.rand(b, 1, lq, lk, generator=g) > 0.3
        m[..., 0] = True  # keep one key per row so no row is empty
        return m, case == "causal+bool"
    if case == "additive":
        m = torch.randn(b, hq, 1, lk, generator=g, dtype=torch.float64)
        m[..., -1] = float("-inf")
        return m, False
    return None, case == "causal"


@pytest.mark.parametrize("case", MASK_CASES)
@pytest.mark.parametrize("gqa", [False, True])
def test_moments_match_reference_and_sdpa(case, gqa):
    hq, hk = (4, 2) if gqa else (3, 3)
    lq, lk = 5, 9
    q, k, v = _qkv(2, hq, hk, lq, lk, 6, dv=5, seed=10)
    mask, causal = _mask(case, 2, hq, lq, lk)
    kw = dict(attn_mask=mask, is_causal=causal, enable_gqa=gqa, scale=0.37)
    mean, var = attention_moments(q, k, v, **kw)
    p = ref_probs(q, k, mask, causal, 0.37, gqa)
    mu, var_ref = ref_moments(p, v)
    torch.testing.assert_close(mean, mu, rtol=0, atol=1e-12)
    torch.testing.assert_close(var, var_ref, rtol=0, atol=1e-12)
    if not causal:  # SDPA refuses is_causal together with a mask
        sd = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.37, enable_gqa=gqa)
        torch.testing.assert_close(mean, sd, rtol=0, atol=1e-12)
    for bs in (1, 2, 4, 8, 100):
        mb, vb = attention_moments(q, k, v, block_size=bs, **kw)
        assert (mb - mean).abs().max() <= 1e-10
        assert (vb - var).abs().max() <= 1e-10


def test_moments_causal_top_left_when_lq_differs_from_lk():
    q, _, _ = _qkv(1, 2, 2, 6, 4, 3, seed=11)
    for lq, lk in ((6, 4), (3, 8)):
        qq, kk, vv = q[:, :, :lq], *(_qkv(1, 2, 2, 1, lk, 3, seed=12)[1:])
        mean, _ = attention_moments(qq, kk, vv, is_causal=True)
        sd = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
        torch.testing.assert_close(mean, sd, rtol=0, atol=1e-12)
        mb, _ = attention_moments(qq, kk, vv, is_causal=True, block_size=3)
        torch.testing.assert_close(mb, sd, rtol=0, atol=1e-12)


def test_moments_long_keys_blocked_matches_dense_and_many_row_chunks():
    """Shapes that split rows into several chunks on both paths."""
    q, k, v = _qkv(1, 2, 1, 300, 700, 8, seed=13)
    mean, var = attention_moments(q, k, v, is_causal=True, enable_gqa=True)
    mb, vb = attention_moments(q, k, v, is_causal=True, enable_gqa=True, block_size=64)
    assert (mb - mean).abs().max() <= 1e-10 and (vb - var).abs().max() <= 1e-10
    sd = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(mean, sd, rtol=0, atol=1e-12)


def test_moments_variance_is_accurate_for_offset_values_in_float32():
    """Values with a large common offset: centring keeps E[v^2] - E[v]^2 from cancelling."""
    q, k, v = _qkv(1, 1, 1, 4, 16, 8, seed=14)
    v = v + 1000.0
    _, var64 = attention_moments(q, k, v)
    _, var32 = attention_moments(q.float(), k.float(), v.float())
    torch.testing.assert_close(var32.double(), var64, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# masks: exhaustive small shapes, causal never draws the future, padded keys never drawn
# ---------------------------------------------------------------------------------------------
def check_padding_and_causal(q: torch.Tensor, k: torch.Tensor, pats: torch.Tensor) -> None:
    """Every key-padding pattern of ``pats`` ``(nb, Lk)`` (one per batch element) with causal
    queries (``q`` ``(nb, 2, Lq, E)``): padded and future keys never drawn, empty rows flagged
    (zero output / the error), each output row a mean of one-hot value rows; every block size.
    """
    nb, lk = pats.shape
    lq = q.shape[2]
    v = torch.eye(lk, dtype=q.dtype).expand(nb, 2, lk, lk)  # output = W / nu
    pad = pats.view(nb, 1, 1, lk)
    allowed = pad & torch.ones(lq, lk, dtype=torch.bool).tril()  # causal, top-left
    empty_ref = ~allowed.any(-1).expand(nb, 2, lq)
    for bs in [None, *range(1, lk + 1)]:
        idx, empty = _sample_indices(q, k, v, nu=16, attn_mask=pad, is_causal=True,
                                     block_size=bs, generator=_gen(bs or 0))
        assert torch.equal(empty, empty_ref)
        drawn = F.one_hot(idx, lk).sum(-2) > 0  # (nb, 2, lq, lk)
        ok = allowed.expand(nb, 2, lq, lk) | empty_ref.unsqueeze(-1)
        assert not (drawn & ~ok).any(), f"{lq=} {lk=} {bs=}"
        y = sampled_attention(q, k, v, nu=16, attn_mask=pad, is_causal=True,
                              block_size=bs, generator=_gen(1), empty_rows="zero")
        assert not ((y > 0) & ~allowed.expand_as(y)).any()
        assert (y[empty_ref] == 0).all()
        torch.testing.assert_close(y.sum(-1)[~empty_ref],
                                   torch.ones(int((~empty_ref).sum()), dtype=y.dtype))
        if empty_ref.any():
            with pytest.raises(ValueError, match="every key masked"):
                sampled_attention(q, k, v, nu=2, attn_mask=pad, is_causal=True, block_size=bs)


@pytest.mark.parametrize("lk", [1, 2, 3, 4])
def test_exhaustive_causal_and_padding_never_draw_excluded_keys(lk):
    pats = torch.tensor(list(itertools.product([False, True], repeat=lk)))  # (2^Lk, Lk)
    for lq in range(1, 5):
        q, k, _ = _qkv(pats.shape[0], 2, 2, lq, lk, 3, seed=lk * 10 + lq)
        check_padding_and_causal(q, k, pats)


def test_dense_causal_row_chunks_on_long_sequences():
    """Several causal row chunks (each reading only its leading keys) with GQA."""
    lq = lk = 600
    q, k, _ = _qkv(1, 2, 1, lq, lk, 4, seed=15)
    v = torch.arange(lk, dtype=torch.float64).view(1, 1, lk, 1)
    y = sampled_attention(q, k, v, nu=32, is_causal=True, enable_gqa=True, generator=_gen(0))
    pos = torch.arange(lq, dtype=torch.float64).view(1, 1, lq, 1)
    # each draw's value is its key index; every key index must be <= the query position
    idx, _ = _sample_indices(q, k, v, nu=32, is_causal=True, enable_gqa=True, generator=_gen(0))
    assert (idx <= pos.long()).all()
    torch.testing.assert_close(y, idx.double().mean(-1, keepdim=True))


# ---------------------------------------------------------------------------------------------
# fully masked rows
# ---------------------------------------------------------------------------------------------
def test_empty_rows_error_names_count_and_first_index():
    q, k, v = _qkv(2, 3, 3, 4, 5, 4, seed=16)
    mask = torch.ones(2, 3, 4, 5, dtype=torch.bool)
    mask[1, 2, 1] = False
    mask[1, 2, 3] = False
    for fn in (lambda **kw: sampled_attention(q, k, v, nu=2, **kw),
               lambda **kw: attention_moments(q, k, v, **kw)):
        for bs in (None, 2):
            with pytest.raises(ValueError, match=r"2 query row\(s\).*batch index \(1,\), "
                                                 r"head 2, query 1.*empty_rows='zero'"):
                fn(attn_mask=mask, block_size=bs)


def test_empty_rows_zero_matches_sdpa():
    q, k, v = _qkv(1, 2, 2, 3, 4, 4, seed=17)
    mask = torch.ones(1, 2, 3, 4, dtype=torch.bool)
    mask[0, 1, 2] = False
    sd = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert (sd[0, 1, 2] == 0).all()  # what torch itself returns for a fully masked row
    for bs in (None, 2):
        mean, var = attention_moments(q, k, v, attn_mask=mask, block_size=bs, empty_rows="zero")
        torch.testing.assert_close(mean, sd, rtol=0, atol=1e-12)
        assert (var[0, 1, 2] == 0).all()
        y = sampled_attention(q, k, v, nu=5, attn_mask=mask, block_size=bs, empty_rows="zero")
        assert (y[0, 1, 2] == 0).all() and (y[0, 0] != 0).any()


# ---------------------------------------------------------------------------------------------
# generator, dtypes, shapes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [None, 3])
def test_generator_reproducibility(block_size):
    q, k, v = _qkv(2, 2, 2, 5, 8, 4, seed=18)
    a = sampled_attention(q, k, v, nu=6, generator=_gen(123), block_size=block_size)
    b = sampled_attention(q, k, v, nu=6, generator=_gen(123), block_size=block_size)
    c = sampled_attention(q, k, v, nu=6, generator=_gen(124), block_size=block_size)
    assert torch.equal(a, b) and not torch.equal(a, c)
    torch.manual_seed(5)
    d = sampled_attention(q, k, v, nu=6, block_size=block_size)
    torch.manual_seed(5)
    e = sampled_attention(q, k, v, nu=6, block_size=block_size)
    assert torch.equal(d, e)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_samples_in_float32(dtype):
    q, k, v = _qkv(2, 2, 2, 6, 10, 8, dtype=dtype, seed=19)
    for bs in (None, 4):
        y = sampled_attention(q, k, v, nu=8, generator=_gen(3), block_size=bs)
        assert y.dtype == dtype and y.shape == (2, 2, 6, 8)
        # same generator state and the same float32 inputs -> the same draws
        y32 = sampled_attention(q.float(), k.float(), v.float(), nu=8, generator=_gen(3),
                                block_size=bs)
        assert torch.equal(y, y32.to(dtype))
        mean, var = attention_moments(q, k, v, block_size=bs)
        assert mean.dtype == dtype and var.dtype == dtype
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
        tol = 2e-2 if dtype != torch.float32 else 1e-5
        torch.testing.assert_close(mean.double(), ref, rtol=tol, atol=tol)


def test_arbitrary_batch_dims_and_2d_inputs():
    q, k, v = _qkv(6, 2, 2, 3, 4, 5, seed=20)
    q5, k5, v5 = (t.reshape(2, 3, 2, *t.shape[2:]) for t in (q, k, v))
    y4 = sampled_attention(q, k, v, nu=3, generator=_gen(0))
    y5 = sampled_attention(q5, k5, v5, nu=3, generator=_gen(0))
    assert torch.equal(y5.reshape(y4.shape), y4)
    m4, v4 = attention_moments(q, k, v)
    m5, v5_ = attention_moments(q5, k5, v5)
    assert torch.equal(m5.reshape(m4.shape), m4) and torch.equal(v5_.reshape(v4.shape), v4)
    y2 = sampled_attention(q[0, 0], k[0, 0], v[0, 0], nu=3, generator=_gen(0))
    assert y2.shape == (3, 5)
    m2, _ = attention_moments(q[0, 0], k[0, 0], v[0, 0], is_causal=True)
    torch.testing.assert_close(m2, F.scaled_dot_product_attention(
        q[0, 0], k[0, 0], v[0, 0], is_causal=True), rtol=0, atol=1e-12)


def test_grad_and_no_grad_paths_agree_and_large_nu_limit():
    """Recording a gradient for v does not change the draws; nu -> large gives the mean."""
    q, k, v = _qkv(1, 2, 2, 4, 8, 3, seed=21)
    a = sampled_attention(q, k, v, nu=50, generator=_gen(1))
    vg = v.clone().requires_grad_(True)
    b = sampled_attention(q, k, vg, nu=50, generator=_gen(1))
    assert b.requires_grad
    torch.testing.assert_close(a, b.detach(), rtol=0, atol=1e-12)
    y = sampled_attention(q, k, v, nu=200_000, generator=_gen(2))
    mean, var = attention_moments(q, k, v)
    # 24 entries at 5 sigma: false failure <= 24 * 5.7e-7
    assert ((y - mean).abs() <= Z * (var / 200_000).sqrt() + 1e-12).all()


# ---------------------------------------------------------------------------------------------
# gradients
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [None, 2])
def test_moments_gradcheck(block_size):
    q, k, v = _qkv(1, 2, 1, 3, 5, 3, dv=2, seed=22)
    mask = torch.tensor([True, True, True, False, True])
    args = [t.clone().requires_grad_(True) for t in (q, k, v)]

    def fn(q_, k_, v_):
        m, var = attention_moments(q_, k_, v_, attn_mask=mask, is_causal=True,
                                   enable_gqa=True, block_size=block_size)
        return m, var

    assert torch.autograd.gradcheck(fn, args)

    # and the gradients equal those of the brute-force reference
    m, var = fn(*args)
    w1, w2 = torch.randn_like(m), torch.randn_like(var)
    g = torch.autograd.grad((m * w1).sum() + (var * w2).sum(), args)
    ref_args = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    s = ref_args[0] @ expand_kv(ref_args[1], 2).transpose(-1, -2) / math.sqrt(3)
    allowed = mask & torch.ones(3, 5, dtype=torch.bool).tril()
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
    mu_r, var_r = ref_moments(p, ref_args[2])
    gr = torch.autograd.grad((mu_r * w1).sum() + (var_r * w2).sum(), ref_args)
    for a, b in zip(g, gr, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("block_size", [None, 3])
def test_sampled_gradient_wrt_v_is_counts(block_size):
    q, k, v = _qkv(1, 2, 2, 4, 6, 3, seed=23)
    vg = v.clone().requires_grad_(True)
    y = sampled_attention(q, k, vg, nu=7, generator=_gen(4), block_size=block_size)
    w = torch.randn_like(y)
    (gv,) = torch.autograd.grad((y * w).sum(), vg)
    idx, _ = _sample_indices(q, k, v, nu=7, generator=_gen(4), block_size=block_size)
    counts = F.one_hot(idx, 6).sum(-2).double() / 7  # (B, H, Lq, Lk) = W / nu
    torch.testing.assert_close(gv, counts.transpose(-1, -2) @ w, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# input errors
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nu", [0, -2, 2.5, True, None, "4"])
def test_bad_nu(nu):
    q, k, v = _qkv(1, 1, 1, 2, 3, 2)
    with pytest.raises((ValueError, TypeError), match=r"nu="):
        sampled_attention(q, k, v, nu=nu)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_non_finite_inputs(bad, which):
    t = dict(zip("qkv", _qkv(1, 1, 1, 2, 3, 2), strict=True))
    t[which] = t[which].clone()
    t[which][0, 0, 1, 1] = bad
    for fn in (lambda: sampled_attention(t["q"], t["k"], t["v"], nu=2),
               lambda: attention_moments(t["q"], t["k"], t["v"])):
        with pytest.raises(ValueError, match=rf"^{which} contains non-finite"):
            fn()


def test_shape_and_option_errors():
    q, k, v = _qkv(2, 4, 2, 3, 5, 4)
    with pytest.raises(ValueError, match=r"enable_gqa=True.*q.shape=\(2, 4, 3, 4\)"):
        sampled_attention(q, k, v, nu=2)
    q3, k3, v3 = _qkv(2, 3, 2, 3, 5, 4)
    with pytest.raises(ValueError, match=r"multiple.*Hq=3 and Hk=2"):
        sampled_attention(q3, k3, v3, nu=2, enable_gqa=True)
    with pytest.raises(ValueError, match=r"last \(feature\) dim D.*k.shape=\(2, 2, 5, 3\)"):
        attention_moments(q, k[..., :3], v, enable_gqa=True)
    with pytest.raises(ValueError, match=r"number of keys Lk.*v.shape=\(2, 2, 4, 4\)"):
        sampled_attention(q, k, v[:, :, :4], nu=2, enable_gqa=True)
    with pytest.raises(ValueError, match=r"attn_mask of shape \(3, 4\) does not broadcast"):
        sampled_attention(q, k, v, nu=2, enable_gqa=True, attn_mask=torch.ones(3, 4) > 0)
    with pytest.raises(ValueError, match=r"attn_mask of shape \(3, 3, 5\)"):
        attention_moments(q, k, v, enable_gqa=True, attn_mask=torch.zeros(3, 3, 5))
    with pytest.raises(ValueError, match=r"NaN or \+inf"):
        attention_moments(q, k, v, enable_gqa=True,
                          attn_mask=torch.full((3, 5), float("nan"), dtype=torch.float64))
    for bs in (0, -1):
        with pytest.raises(ValueError, match=rf"block_size={bs}"):
            sampled_attention(q, k, v, nu=2, enable_gqa=True, block_size=bs)
        with pytest.raises(ValueError, match=rf"block_size={bs}"):
            attention_moments(q, k, v, enable_gqa=True, block_size=bs)
    with pytest.raises(TypeError, match=r"block_size=2.0"):
        sampled_attention(q, k, v, nu=2, enable_gqa=True, block_size=2.0)
    with pytest.raises(ValueError, match=r"empty_rows='nan'"):
        sampled_attention(q, k, v, nu=2, enable_gqa=True, empty_rows="nan")
    with pytest.raises(TypeError, match=r"share one dtype"):
        sampled_attention(q.float(), k, v, nu=2, enable_gqa=True)
    with pytest.raises(TypeError, match=r"floating-point.*torch.int64"):
        sampled_attention(q.long(), k, v, nu=2, enable_gqa=True)
    with pytest.raises(ValueError, match=r"scale=nan"):
        attention_moments(q, k, v, enable_gqa=True, scale=float("nan"))
    with pytest.raises(ValueError, match=r"batch dims"):
        attention_moments(q, k[:1], v[:1], enable_gqa=True)


# ---------------------------------------------------------------------------------------------
# the nn wrapper
# ---------------------------------------------------------------------------------------------
def test_sampled_attention_module():
    q, k, v = _qkv(2, 4, 2, 5, 6, 4, seed=24)
    layer = SampledAttention(nu=5, enable_gqa=True, block_size=4)
    assert "nu=5" in repr(layer)
    y = layer(q, k, v, is_causal=True, generator=_gen(9))
    want = sampled_attention(q, k, v, nu=5, enable_gqa=True, block_size=4, is_causal=True,
                             generator=_gen(9))
    assert torch.equal(y, want)
    layer.stochastic = False
    torch.testing.assert_close(
        layer(q, k, v, is_causal=True),
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        rtol=0, atol=1e-12,
    )
    with pytest.raises(ValueError, match="nu=0"):
        SampledAttention(nu=0)
    with pytest.raises(ValueError, match="empty_rows='x'"):
        SampledAttention(nu=1, empty_rows="x")  # type: ignore[arg-type]


def test_sampled_attention_module_validates_settings_when_they_are_set():
    """The module checks nu, block_size and empty_rows once, when set (also by assignment after
    construction, with the operator's messages); forward then passes them on unchecked, so a
    bad value never reaches the kernel."""
    q, k, v = _qkv(1, 2, 2, 4, 4, 4, seed=25)
    layer = SampledAttention(nu=3)
    with pytest.raises(ValueError, match=r"nu must be a positive int, got nu=0"):
        layer.nu = 0
    with pytest.raises(TypeError, match=r"nu must be a positive int, got nu=2\.5"):
        layer.nu = 2.5  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"block_size must be a positive int, got block_size=0"):
        layer.block_size = 0
    with pytest.raises(ValueError, match="empty_rows='x'"):
        layer.empty_rows = "x"  # type: ignore[assignment]
    assert (layer.nu, layer.block_size, layer.empty_rows) == (3, None, "error")  # unchanged
    layer.nu, layer.block_size, layer.empty_rows = 6, 2, "zero"
    assert "nu=6, enable_gqa=False, block_size=2, empty_rows='zero'" in repr(layer)
    want = sampled_attention(q, k, v, nu=6, block_size=2, empty_rows="zero", generator=_gen(3))
    assert torch.equal(layer(q, k, v, generator=_gen(3)), want)


@pytest.mark.parametrize("bound", ["cheap", "norms"])
def test_dense_paths_with_and_without_max_shift_agree(bound):
    """Small scores skip the row-max shift (bound |q||k| scale <= 64 in log2 units); an additive
    zero mask forces the shift. Same uniforms -> the same draws (up to CDF rounding).
    ``cheap``: D max|q| max|k| scale is already <= 64; ``norms``: that bound is ~170 (one large
    entry per query) and only the row norms show that no shift is needed."""
    if bound == "cheap":
        q, k, v = _qkv(2, 2, 2, 16, 40, 8, seed=25)
    else:
        _, k, v = _qkv(2, 2, 2, 16, 40, 64, seed=25)
        q = torch.zeros(2, 2, 16, 64, dtype=torch.float64)
        q[..., 0] = 5.0
        scale = LOG2E / 8.0
        cheap = 64 * 5.0 * float(k.abs().max()) * scale
        norms = 5.0 * float(k.norm(dim=-1).max()) * scale
        assert cheap > 64 >= norms, (cheap, norms)
    a, _ = _sample_indices(q, k, v, nu=64, generator=_gen(1))
    b, _ = _sample_indices(q, k, v, nu=64, generator=_gen(1),
                           attn_mask=torch.zeros(40, dtype=torch.float64))
    assert (a == b).double().mean() > 0.999


def test_dense_large_scores_match_softmax():
    """Scores far beyond the no-shift bound (|s| ~ 100): exact draws via the max shift."""
    lk, nu = 6, 40_000
    q, k, v = _qkv(1, 1, 1, 2, lk, 4, seed=26)
    q = q * 15.0
    p = ref_probs(q, k).numpy()[0, 0]
    idx, empty = _sample_indices(q, k, v, nu=nu, generator=_gen(2))
    assert not empty.any()
    for i in range(2):
        cnt = _counts(idx, lk)[0, 0, i]
        assert (cnt[p[i] == 0] == 0).all()
        assert chi2_gof_pvalue(cnt, p[i]) > P_MIN  # false failure 1e-6 per query


def test_degenerate_sizes():
    q, k, v = _qkv(1, 2, 2, 3, 4, 5, seed=27)
    with pytest.raises(ValueError, match="6 query row"):
        sampled_attention(q, k[:, :, :0], v[:, :, :0], nu=2)
    with pytest.raises(ValueError, match="6 query row"):
        attention_moments(q, k[:, :, :0], v[:, :, :0])
    y = sampled_attention(q, k[:, :, :0], v[:, :, :0], nu=2, empty_rows="zero")
    assert y.shape == (1, 2, 3, 5) and (y == 0).all()
    assert sampled_attention(q[:, :, :0], k, v, nu=2).shape == (1, 2, 0, 5)
    m, var = attention_moments(q[:, :, :0], k, v)
    assert m.shape == var.shape == (1, 2, 0, 5)


# ---------------------------------------------------------------------------------------------
# memory: no (G, M, nu) tensor without a gradient
# ---------------------------------------------------------------------------------------------
def _largest_allocation(fn) -> tuple[int, list[int]]:
    """Run ``fn`` under the torch profiler with memory recording; return the largest single CPU
    allocation in bytes and the sizes of all allocations (the profiler sees every allocation of
    torch's CPU allocator, so this does not depend on timing or on the system allocator)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes = [e.nbytes() for e in prof.profiler.kineto_results.events()
             if e.name() == "[memory]" and e.nbytes() > 0]
    assert sizes, "the profiler recorded no allocation: the memory check would be vacuous"
    return max(sizes), sizes


@pytest.mark.parametrize("block_size", [32, None])
def test_sampler_never_holds_all_draws_without_gradient(monkeypatch, block_size):
    """Without a gradient for ``v`` neither the key-blocked nor the dense path allocates a
    tensor of ``G * M * nu`` elements (uniforms, indices or flags of all draws): every
    allocation stays below ``G * M * nu`` bytes, so not even a boolean one exists. Small chunk
    and gather budgets force several query chunks per group and one gather per chunk; a
    positive control (``_sample_indices``, which does collect all indices) shows that the check
    sees such a tensor. Deterministic: allocation sizes do not depend on the data. (Before the
    dense path gathered chunk by chunk it held all ``G * M * nu`` indices: issue #23, the 19 GB
    call.)"""
    from attnuq.ops import sampled as mod

    monkeypatch.setattr(mod, "_BLOCKED_SAMPLE_ELEMS", 64 * (32 + 64))  # 64 rows per chunk
    monkeypatch.setattr(mod, "_DENSE_CHUNK_ELEMS", 64 * (128 + 2 * 64))  # 64 rows per chunk
    monkeypatch.setattr(mod, "_DENSE_MIN_ROWS", 64)
    monkeypatch.setattr(mod, "_GATHER_ELEMS", 64 * 64)  # one chunk's indices per gather
    g, m, lk, nu, dv = 2, 512, 128, 64, 4
    q, k, v = _qkv(1, g, g, m, lk, 8, dv=dv, seed=28, dtype=torch.float32)
    all_draws = g * m * nu  # 65536
    gen = _gen(5)
    kw = dict(nu=nu, block_size=block_size, is_causal=True)
    big, sizes = _largest_allocation(lambda: sampled_attention(q, k, v, generator=gen, **kw))
    assert big < all_draws, (big, all_draws)
    assert g * m * dv * 4 in sizes  # the output itself (float32) was seen
    big_ref, _ = _largest_allocation(lambda: _sample_indices(q, k, v, generator=gen, **kw))
    assert big_ref >= all_draws * 4  # int32 or int64 indices of all draws
    # and the chunked forward gives what the all-indices (autograd) path gives
    y = sampled_attention(q, k, v, generator=_gen(6), **kw)
    y_grad = sampled_attention(q, k, v.clone().requires_grad_(True), generator=_gen(6), **kw)
    assert torch.equal(y, y_grad.detach())


@pytest.mark.parametrize("block_size", [None, 32])
def test_uniforms_are_drawn_chunk_by_chunk(monkeypatch, block_size, sampler):
    """Neither path asks ``torch.rand`` for the uniforms of all ``G * M * nu`` draws at once:
    with several query chunks per group every call covers one chunk (and, blocked, one key
    block), and together they cover every draw (once per key block when blocked). The fused
    kernel makes no uniform tensor at all: one int64 seed from the generator, the uniforms
    derived in the kernel."""
    from attnuq.ops import sampled as mod

    monkeypatch.setattr(mod, "_BLOCKED_SAMPLE_ELEMS", 64 * (32 + 64))  # 64 rows per chunk
    monkeypatch.setattr(mod, "_DENSE_CHUNK_ELEMS", 64 * 128)
    monkeypatch.setattr(mod, "_DENSE_MIN_ROWS", 64)
    g, m, lk, nu = 2, 512, 128, 64
    q, k, v = _qkv(1, g, g, m, lk, 8, dv=4, seed=29, dtype=torch.float32)
    calls: list[int] = []  # sizes of the torch.rand draws
    seeds: list[int] = []  # sizes of the torch.randint draws (the per-call seeds)

    def counting(f, log):  # f wrapped so that each call logs the size of its result
        def wrapped(*args, **kwargs):
            out = f(*args, **kwargs)
            log.append(out.numel())
            return out

        return wrapped

    monkeypatch.setattr(torch, "rand", counting(torch.rand, calls))
    monkeypatch.setattr(torch, "randint", counting(torch.randint, seeds))
    sampled_attention(q, k, v, nu=nu, block_size=block_size, generator=_gen(0))
    if sampler == "fused":
        assert calls == [] and seeds and set(seeds) == {1}, (calls, seeds)  # only seeds
        return
    blocks = 1 if block_size is None else lk // block_size
    assert sum(calls) == g * m * nu * blocks
    assert max(calls) <= 64 * nu < g * m * nu, calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finfo_min_additive_mask_is_an_ordinary_score_like_sdpa(dtype):
    """Hugging Face masks with ``torch.finfo(dtype).min``: a key with that bias is an ordinary
    (negligible) score, not an exclusion. A row masked this way everywhere gets uniform weights
    in SDPA, so no row is empty here and the moments equal SDPA's output (in float32 the mask
    times log2(e) would overflow to -inf if it were not kept finite)."""
    q, k, v = _qkv(2, 2, 2, 6, 5, 4, seed=41, dtype=dtype)
    big = torch.finfo(dtype).min
    m = torch.zeros(2, 1, 6, 5, dtype=dtype)
    m[:, :, :3] = big  # rows 0-2: every key at finfo.min -> uniform weights in SDPA
    m[:, :, 3:, 1:] = big  # rows 3-5: only key 0 has a non-negligible weight
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=m.float())
    mean, _ = attention_moments(q, k, v, attn_mask=m)  # raises if any row were empty
    torch.testing.assert_close(mean.float(), ref, atol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                               rtol=0)
    idx, empty = _sample_indices(q, k, v, nu=400, attn_mask=m, generator=_gen(2))
    assert not empty.any()
    assert (idx[:, :, 3:] == 0).all()  # the finite-0 key takes all the mass
    # uniform rows: each of the 5 keys drawn; P(a given key missing in 400 draws) = 0.8^400
    for key in range(5):
        assert (idx[:, :, :3] == key).any(-1).all(), key


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_repeated_over_queries_gives_the_draws_of_the_key_mask(kind):
    """A key-padding mask materialised per query (as Hugging Face passes it, ``(B, 1, Lq, Lk)``)
    gives exactly the draws and moments of the same mask as ``(B, 1, 1, Lk)``; changing one
    query's row still applies that row (the per-query path)."""
    q, k, v = _qkv(2, 3, 3, 7, 9, 4, seed=43, dtype=torch.float32)
    keep = torch.rand(2, 1, 1, 9, generator=_gen(4)) < 0.6
    keep[..., 2] = True
    key_mask = keep if kind == "bool" else torch.where(keep, 0.0, float("-inf")) + 0.5
    full = key_mask.expand(2, 1, 7, 9).contiguous()
    for fn in (_sample_indices, sampled_attention):
        a = fn(q, k, v, nu=6, attn_mask=key_mask, generator=_gen(9))
        for m in (full, key_mask.expand(2, 1, 7, 9)):  # materialised, and an expanded view
            b = fn(q, k, v, nu=6, attn_mask=m, generator=_gen(9))
            for x, y in zip(a if isinstance(a, tuple) else (a,),
                            b if isinstance(b, tuple) else (b,), strict=True):
                assert torch.equal(x, y)
    m_a, v_a = attention_moments(q, k, v, attn_mask=key_mask)
    m_b, v_b = attention_moments(q, k, v, attn_mask=full)
    assert torch.equal(m_a, m_b) and torch.equal(v_a, v_b)
    # one query row differs: only key 2 for query 3 -> its draws are all key 2
    one = full.clone()
    if kind == "bool":
        one[:, :, 3] = False
        one[:, :, 3, 2] = True
    else:
        one[:, :, 3] = float("-inf")
        one[:, :, 3, 2] = 0.0
    idx, _ = _sample_indices(q, k, v, nu=50, attn_mask=one, generator=_gen(1))
    assert (idx[:, :, 3] == 2).all()
    assert not (idx[:, :, [0, 1, 2, 4, 5, 6]] == 2).all()  # the other rows are not restricted


def _layouts(v: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same values ``(B, H, L, Dv)`` in other memory layouts."""
    b, h, lk, dv = v.shape
    wide = torch.zeros(b, h, lk, 2 * dv + 1, dtype=v.dtype)
    wide[..., 1 : dv + 1] = v
    odd = torch.zeros(b, h, lk, dv + 1, dtype=v.dtype)
    odd[..., :dv] = v
    return {
        "hf transposed": v.transpose(1, 2).contiguous().transpose(1, 2),  # (B, L, H, Dv) memory
        "gaps": torch.cat([v, torch.zeros_like(v)], -1)[..., :dv],  # row stride 2 Dv
        "offset, odd stride": wide[..., 1 : dv + 1],  # stride 2 Dv + 1: not a multiple of Dv
        "odd stride": odd[..., :dv],
    }


@pytest.mark.parametrize("block_size", [None, 4])
@pytest.mark.parametrize("gqa", [False, True])
def test_value_layout_does_not_change_the_output(block_size, gqa):
    """Values are gathered straight from v's memory when every row is contiguous at a multiple
    of Dv (HF's transposed layout: no copy); any layout gives exactly the output of a
    contiguous v."""
    from attnuq.ops._attn_common import prepare

    q, k, v = _qkv(2, 4, 2 if gqa else 4, 6, 9, 5, dv=3, seed=47, dtype=torch.float32)
    kw = {"nu": 7, "block_size": block_size, "enable_gqa": gqa}
    ref = sampled_attention(q, k, v, generator=_gen(5), **kw)
    for name, vl in _layouts(v).items():
        assert torch.equal(vl, v)
        out = sampled_attention(q, k, vl, generator=_gen(5), **kw)
        assert torch.equal(out, ref), name
        w, _, step = prepare(q, k, vl, None, False, None, gqa).value_rows()
        strided = name in ("hf transposed", "gaps")  # rows at multiples of Dv: gathered in place
        assert (step != 1) == strided, (name, step)
        if strided:
            assert w.untyped_storage().data_ptr() == vl.untyped_storage().data_ptr()


# ---------------------------------------------------------------------------------------------
# CUDA (runs wherever a CUDA device exists; these machines have none)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cuda_matches_the_closed_forms(dtype, sampler):
    """On CUDA: moments equal SDPA; 20k draws per query match the closed-form mean (z = 5, 48
    entries: false failure <= 48 * 5.7e-7); padded and future keys are never drawn; the same
    CUDA generator state gives the same draws; the key-blocked path agrees in distribution."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    if sampler != "torch":
        pytest.skip("the C kernels are CPU-only; CUDA always takes the torch path")
    dev = torch.device("cuda")
    q, k, v = (t.to(dev) for t in _qkv(1, 2, 2, 4, 6, 8, seed=51, dtype=dtype))
    pad = torch.tensor([True, True, False, True, True, True], device=dev)
    mean, _ = attention_moments(q, k, v, attn_mask=pad, is_causal=True)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                         attn_mask=pad & torch.ones(4, 6, dtype=torch.bool,
                                                                    device=dev).tril())
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(mean.float(), ref, atol=tol, rtol=0)
    # the draws run in float32 on inputs that are exact in float32: compare with float32 moments
    mean32, var32 = attention_moments(q.float(), k.float(), v.float(), attn_mask=pad,
                                      is_causal=True)
    n, nu = 20_000, 4
    for bs in (None, 2):
        gen = torch.Generator(device=dev).manual_seed(3)
        idx, empty = _sample_indices(q, k, v, nu=n * nu, attn_mask=pad, is_causal=True,
                                     block_size=bs, generator=gen)
        assert idx.device.type == "cuda" and not empty.any()
        allowed = pad & torch.ones(4, 6, dtype=torch.bool, device=dev).tril()  # (Lq, Lk)
        drawn = F.one_hot(idx, 6).sum(-2) > 0
        assert not (drawn & ~allowed).any()
        rows = torch.stack([v[0, h].float()[idx[0, h]] for h in range(2)])  # (H, Lq, n nu, D)
        y = rows.view(2, 4, n, nu, -1).mean(3)
        se = (var32[0] / nu / n).sqrt()
        assert ((y.mean(2) - mean32[0]).abs() <= Z * se + 1e-6).all()
        again, _ = _sample_indices(q, k, v, nu=n * nu, attn_mask=pad, is_causal=True,
                                   block_size=bs, generator=torch.Generator(dev).manual_seed(3))
        assert torch.equal(idx, again)
    out = sampled_attention(q, k, v, nu=8, attn_mask=pad, is_causal=True)
    assert out.device.type == "cuda" and out.dtype == dtype and out.shape == q.shape


@pytest.mark.parametrize("shape", [(2, 1, 5, 9), (2, 4, 5, 9), (1, 4, 5, 9), (5, 9)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_per_query_mask_as_one_bias_equals_the_per_chunk_gather(monkeypatch, shape, kind,
                                                                 sampler):
    """A per-query ``attn_mask`` (broadcast over batch, heads or both; GQA folds 2 query heads
    per key head) is converted once to a ``(G, M, Lk)`` bias; with that disabled every chunk
    gathers its own rows. Both must give the same draws and moments, bit for bit. (The fused
    kernels read the bias table only: without one the call takes the row-kernel path, whose
    draws differ; the fused draws then respect the mask and its moments equal the row path's
    to float32 rounding, 1e-5 on values of order 1.)"""
    from attnuq.ops import _attn_common

    q, k, v = _qkv(2, 4, 2, 5, 9, 4, seed=61, dtype=torch.float32)
    g = _gen(7)
    keep = torch.rand(shape, generator=g) < 0.6
    keep[..., 0] = True
    m = keep if kind == "bool" else torch.where(keep, torch.randn(shape, generator=g),
                                                float("-inf"))
    kw = dict(nu=7, attn_mask=m, enable_gqa=True, is_causal=True)
    a = _sample_indices(q, k, v, generator=_gen(3), **kw)
    ma = attention_moments(q, k, v, attn_mask=m, enable_gqa=True, is_causal=True)
    monkeypatch.setattr(_attn_common, "_FULL_BIAS_ELEMS", 0)
    b = _sample_indices(q, k, v, generator=_gen(3), **kw)
    mb = attention_moments(q, k, v, attn_mask=m, enable_gqa=True, is_causal=True)
    if sampler == "fused":
        assert torch.equal(a[1], b[1])
        torch.testing.assert_close(ma, mb, rtol=0, atol=1e-5)
    else:
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert torch.equal(ma[0], mb[0]) and torch.equal(ma[1], mb[1])
    # and the draws respect the mask (mask broadcast to (B, Hq, Lq, Lk), then causal)
    allowed = keep.expand(2, 4, 5, 9) & torch.ones(5, 9, dtype=torch.bool).tril()
    drawn = F.one_hot(a[0], 9).sum(-2) > 0
    assert not (drawn & ~allowed).any()


def test_causal_row_blocks_of_several_groups_follow_the_softmax():
    """Causal with Lq > 128: each chunk is one block of query rows of several groups (batched
    GEMM). Every draw is at or before its query and a few rows from different blocks and groups
    follow the softmax (chi-square, false failure 1e-6 each)."""
    from attnuq.ops import sampled as mod
    from attnuq.ops._attn_common import prepare

    lq = 160
    q, k, v = _qkv(1, 2, 2, lq, lq, 8, seed=71, scale=0.5)
    att = prepare(q, k, v, None, True, None, False)
    chunks = att.chunks(lq, mod._DENSE_CHUNK_ELEMS, mod._DENSE_MIN_ROWS, 128, batch_groups=True)
    assert any(g1 - g0 > 1 and i1 - i0 < lq for g0, g1, i0, i1 in chunks), chunks
    nu = 8_000
    idx, empty = _sample_indices(q, k, v, nu=nu, is_causal=True, generator=_gen(8))
    assert not empty.any()
    pos = torch.arange(lq).view(1, 1, lq, 1)
    assert (idx <= pos).all()
    p = ref_probs(q, k, is_causal=True).numpy()
    for b, h, i in [(0, 0, 5), (0, 1, 100), (0, 0, 140), (0, 1, 159)]:
        cnt = _counts(idx[b, h, i], lq)
        assert (cnt[p[b, h, i] == 0] == 0).all()
        pos_p = p[b, h, i] > 0
        assert chi2_gof_pvalue(cnt[pos_p], p[b, h, i][pos_p]) > P_MIN
