"""Tests of the fused CPU kernels (``csrc/fused.c``, :func:`attnuq.ops._native.fused_call`).

The scores are made exact in float32 (small integer queries and keys, scale 1 in log2 units,
boolean masks), so every draw can be checked against the exact (float64) inverse CDF in the
kernel's key order with the uniforms the kernel derives from its seed (SplitMix64, re-derived
here in Python): a wrong key order, block, uniform or lookup fails deterministically. The
statistical checks of the fused path (chi-square against the softmax, moments against the
closed form, masks, causal, GQA, the same generator state giving the same draws) are the
sampler tests of ``test_sampled.py`` and ``test_sampled_sizes.py``, which run every CPU path
(``tests/attnuq/ops/conftest.py``).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from attnuq.ops import _native

needs_kernel = pytest.mark.skipif(
    not _native.available(),
    reason=f"native kernels unavailable: {_native.status()['reason']}",
)

LANES, MAXBL = 8, 16  # the CDF layout of csrc/cdf.h
_M64 = (1 << 64) - 1
# tolerance of a uniform's distance to a CDF edge: the kernel's 2^x is within 2e-7 (relative)
# and its sums have at most nb + 16 float32 terms; the largest miss measured in
# test_native.py's row-kernel test was 4.2e-7
TOL = 1e-6


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _uniforms(seed: int, row: int, n: int) -> list[float]:
    """The first ``n`` uniforms of global query row ``row`` (``g * M + i``), as csrc/fused.c
    derives them: a SplitMix64 stream per row, the top 24 bits of each output."""
    rk = _mix64((seed + (row + 1) * 0xD1B54A32D192ED03) & _M64)
    return [(_mix64((rk + (c + 1) * 0x9E3779B97F4A7C15) & _M64) >> 40) * 2.0**-24
            for c in range(n)]


def _kernel_order(lk: int) -> list[int]:
    """The CDF order of csrc/cdf.h: ``nb = 8 ceil(L / 128)`` blocks, key ``j = l nb + b`` is
    entry ``l`` of block ``b``; blocks in order, entries in order."""
    nb = max(LANES, LANES * -(-lk // (LANES * MAXBL)))
    return sorted(range(lk), key=lambda j: (j % nb, j // nb))


def _inverse_cdf(w: list[float], x: float) -> tuple[int | None, bool]:
    """``(key, sure)``: the key of threshold ``x`` in ``[0, 1)`` under weights ``w`` taken in the
    kernel order, and whether ``x`` is farther than TOL from every CDF edge."""
    order = _kernel_order(len(w))
    total = math.fsum(w)
    c = 0.0
    for j in order:
        lo, c = c, c + w[j] / total
        if w[j] > 0 and lo <= x < c:
            return j, abs(x - lo) > TOL and abs(c - x) > TOL
    return None, False


def _case(g: int, m: int, lk: int, d: int, dv: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-3, 4, (g, m, d), generator=gen).float()
    k = torch.randint(-3, 4, (g, lk, d), generator=gen).float()
    v = torch.randn(g * lk, dv, generator=gen)
    offs = torch.arange(g, dtype=torch.int64) * lk
    return q, k, v, offs


def _run(q, k, v, offs, nu, *, keep=None, causal_lq=0, block=0, seed=12345, idt=torch.int64):
    g, m, _ = q.shape
    bias = None
    if keep is not None:  # (G, 1 | M, Lk) boolean -> additive log2 bias
        bias = torch.where(keep, 0.0, float("-inf")).float()
    idx = torch.empty(g, m, nu, dtype=idt)
    out = torch.empty(g, m, v.shape[1])
    empty = torch.empty(g, m, dtype=torch.bool)
    _native.fused_call("sample", q, k, 1.0, bias, causal_lq, (0, g, 0, m), v, offs, 1,
                       v.shape[1], empty, seed=seed, nu=nu, block=block, out=out, idx=idx)
    return idx, out, empty, bias


def _exact_scores(q, k, bias, causal_lq):
    """float64 scores ``(G, M, Lk)`` (exact: small integers) and each row's key count."""
    s = q.double() @ k.double().transpose(1, 2)
    if bias is not None:
        s = s + bias.double()
    m, lk = q.shape[1], k.shape[1]
    nk = [min(lk, i % causal_lq + 1) if causal_lq else lk for i in range(m)]
    return s, nk


@needs_kernel
@pytest.mark.parametrize("lk", [1, 17, 100, 300])
@pytest.mark.parametrize("variant", ["plain", "key-mask", "row-mask", "causal"])
def test_dense_draws_are_the_exact_inverse_cdf_of_the_seeded_uniforms(lk, variant):
    """Every draw of the dense fused sampler is the key whose CDF interval (kernel order, over
    the keys the row may see) holds its uniform; masked and future keys are never drawn; rows
    with no key are flagged empty with zero output; the output row is the mean of the drawn
    value rows (float32 sums of nu = 24 rows: 1e-5)."""
    g, m, d, dv, nu = 2, 21, 5, 7, 24
    q, k, v, offs = _case(g, m, lk, d, dv, seed=lk)
    keep, causal_lq = None, 0
    gen = torch.Generator().manual_seed(lk + 1)
    if variant == "key-mask":
        keep = torch.rand(g, 1, lk, generator=gen) < 0.7
        keep[1] = False  # every row of group 1 is empty
    elif variant == "row-mask":
        keep = torch.rand(g, m, lk, generator=gen) < 0.5
        keep[0, 3] = False
    elif variant == "causal":
        causal_lq = 7  # M = 3 query heads of Lq = 7 (GQA folding)
    idx, out, empty, bias = _run(q, k, v, offs, nu, keep=keep, causal_lq=causal_lq,
                                 idt=torch.int32 if lk == 17 else torch.int64)
    s, nk = _exact_scores(q, k, bias, causal_lq)
    checked = 0
    for gi in range(g):
        for i in range(m):
            row = s[gi, i, : nk[i]]
            if not bool(torch.isfinite(row).any()):
                assert empty[gi, i] and (idx[gi, i] == 0).all() and (out[gi, i] == 0).all()
                continue
            assert not empty[gi, i]
            w = torch.exp2(row - row.max()).tolist()
            us = _uniforms(12345, gi * m + i, nu)
            for kk in range(nu):
                j = int(idx[gi, i, kk])
                assert j < nk[i] and w[j] > 0, (gi, i, j)  # neither future nor masked
                want, sure = _inverse_cdf(w, us[kk])
                if sure:
                    assert j == want, (gi, i, kk, j, want)
                    checked += 1
            mean = v[offs[gi] + idx[gi, i].long()].double().mean(0)
            torch.testing.assert_close(out[gi, i].double(), mean, rtol=0, atol=1e-5)
    assert checked > 0.95 * nu * sum(1 for x in nk if x) * (1 if variant == "plain" else 0.3)


@needs_kernel
@pytest.mark.parametrize("lk,block", [(50, 16), (300, 128), (33, 32)])
def test_blocked_draws_follow_the_running_choice_with_the_seeded_uniforms(lk, block):
    """The key-blocked fused sampler against a float64 replay of its algorithm: per key block
    b (in order) the share p_b of the block in the mass of blocks 0..b; draw k is replaced iff
    its uniform u (number b nu + k of the row's stream) is below p_b, by the block's
    inverse-CDF key of u / p_b. Draws whose coin or lookup is within TOL of an edge in any
    block are not compared (float32 rounding of p_b); at least 90 % are."""
    g, m, d, dv, nu = 2, 9, 4, 3, 16
    q, k, v, offs = _case(g, m, lk, d, dv, seed=lk + block)
    keep = torch.rand(g, 1, lk, generator=torch.Generator().manual_seed(2)) < 0.8
    keep[0, 0, :block] = False  # group 0: the first block is empty
    idx, _, empty, bias = _run(q, k, v, offs, nu, keep=keep, block=block)
    s, _ = _exact_scores(q, k, bias, 0)
    nblk = -(-lk // block)
    compared = total = 0
    for gi in range(g):
        for i in range(m):
            us = _uniforms(12345, gi * m + i, nblk * nu)
            row = s[gi, i]
            mx = float(row.max())
            w_all = torch.exp2(row - mx).tolist()
            for kk in range(nu):
                choice, sure, seen = 0, True, 0.0
                for b in range(nblk):
                    wb = w_all[b * block: (b + 1) * block]
                    mass = math.fsum(wb)
                    if mass == 0:
                        continue
                    seen += mass
                    p = mass / seen
                    u = us[b * nu + kk]
                    sure = sure and abs(u - p) > TOL
                    if u < p:
                        j, ok = _inverse_cdf(wb, min(u / p, 1 - 2**-24))
                        sure = sure and ok
                        choice = b * block + (j if j is not None else 0)
                total += 1
                if sure:
                    compared += 1
                    assert int(idx[gi, i, kk]) == choice, (gi, i, kk)
            assert not empty[gi, i]
    assert compared >= 0.9 * total


@needs_kernel
def test_threads_and_index_width_change_no_draw():
    """Tiles are split over OpenMP threads; each row's draws depend on its scores and its own
    uniform stream only, so two threads give the same keys and output, and int32 indices the
    int64 ones."""
    q, k, v, offs = _case(3, 200, 150, 8, 5, seed=9)  # 600 rows x 150 keys: 2 workers
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = _run(q, k, v, offs, 6)
        torch.set_num_threads(2)
        assert _native._row_workers(600, 150, 6) == 2
        two = _run(q, k, v, offs, 6)
    finally:
        torch.set_num_threads(threads)
    narrow = _run(q, k, v, offs, 6, idt=torch.int32)
    for a, b in zip(one[:3], two[:3], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(one[0], narrow[0].long()) and torch.equal(one[1], narrow[1])


@needs_kernel
def test_fused_call_rejects_bad_buffers():
    q, k, v, offs = _case(1, 4, 6, 3, 2, seed=1)
    empty = torch.empty(1, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="inconsistent buffers"):
        _native.fused_call("sample", q.double(), k, 1.0, None, 0, (0, 1, 0, 4), v, offs, 1, 2,
                           empty, seed=1, nu=2)
    with pytest.raises(ValueError, match="seed -1"):
        _native.fused_call("sample", q, k, 1.0, None, 0, (0, 1, 0, 4), v, offs, 1, 2, empty,
                           seed=-1, nu=2)
    with pytest.raises(ValueError, match="inconsistent buffers"):
        _native.fused_call("moments", q, k, 1.0, None, 0, (0, 1, 0, 4), v, offs, 1, 2, empty,
                           out=torch.empty(1, 4, 2))  # no var
    with pytest.raises(ValueError, match="inconsistent buffers"):
        _native.fused_call("softmax", q, k, 1.0, None, 0, (0, 1, 0, 4), v, offs, 1, 2, empty)


def _portable_case():
    from attnuq.ops import attention_moments
    from attnuq.ops.sampled import _sample_indices

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 50, 40, generator=gen), torch.randn(2, 3, 150, 40, generator=gen)
    v = torch.randn(2, 3, 150, 24, generator=gen)
    keep = torch.rand(2, 1, 1, 150, generator=gen) > 0.2
    draws = [
        _sample_indices(q, k, v, nu=30, generator=torch.Generator().manual_seed(3), **kw)[0]
        for kw in ({}, {"is_causal": True}, {"attn_mask": keep, "block_size": 32})
    ]
    return draws, attention_moments(q, k, v, attn_mask=keep)


@needs_kernel
def test_the_portable_build_draws_what_the_vector_build_draws(monkeypatch):
    """``ATTNUQ_NATIVE_PORTABLE=1`` builds the fused kernels without AVX-512 (8 lanes, the
    AVX2 path; on an AVX2 machine both builds are that one). Every score is the same sequence
    of float32 fused multiply-adds over the features in both (one lane per key), 2^x and the
    lookup are the same operations, so the draws are the same keys; the moments sum their
    lanes in another order: equal to 1e-6 (values of order 1)."""
    ref_draws, ref_moments = _portable_case()
    saved = _native._load.cache_info().currsize
    monkeypatch.setenv("ATTNUQ_NATIVE_PORTABLE", "1")
    _native._load.cache_clear()
    try:
        st = _native.native_status()
        assert st["available"] and st["simd"] == "portable", st
        assert "-mno-avx512f" in str(st["reason"])
        draws, moments = _portable_case()
    finally:
        monkeypatch.undo()
        _native._load.cache_clear()
        if saved:
            _native._load()
    assert _native.native_status()["simd"] in ("avx512", "portable")
    for a, b in zip(draws, ref_draws, strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(moments, ref_moments, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# the fused path through the public operators, float32 (most of test_sampled.py is float64,
# which the fused kernels leave to the other paths)
# ---------------------------------------------------------------------------------------------
P_MIN = 1e-6  # chi-square p-value threshold: false-failure probability 1e-6 per test


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _qkv32(b, hq, hk, lq, lk, d, dv=None, seed=0, scale=1.0):
    g = _gen(seed)
    q = torch.randn(b, hq, lq, d, generator=g) * scale
    k = torch.randn(b, hk, lk, d, generator=g)
    v = torch.randn(b, hk, lk, dv or d, generator=g)
    return q, k, v


@pytest.fixture
def fused_on():
    if not _native.fused_available():
        pytest.skip(f"fused kernels unavailable: {_native.native_status()}")
    assert _native.native_status()["fused"]


@pytest.mark.parametrize("block_size", [None, 1, 3, 16])
def test_float32_draws_follow_the_softmax(fused_on, block_size):
    """40k draws per query (float32, GQA, key padding and causal, Lq = 5 < Lk = 37) against the
    float64 softmax of the same float32 inputs: excluded keys never drawn; chi-square per query
    (20 queries, each with false-failure probability P_MIN)."""
    import numpy as np
    from tests.attnuq.ops._reference_sampled import chi2_gof_pvalue, ref_probs

    from attnuq.ops.sampled import _sample_indices

    lk, nu = 37, 40_000
    q, k, v = _qkv32(2, 2, 1, 5, lk, 8, seed=3, scale=0.6)
    pad = torch.ones(2, 1, 1, lk, dtype=torch.bool)
    pad[0, ..., 2] = False
    pad[1, ..., 30:] = False
    idx, empty = _sample_indices(q, k, v, nu=nu, attn_mask=pad, is_causal=True,
                                 enable_gqa=True, block_size=block_size, generator=_gen(4))
    assert not empty.any()
    p = ref_probs(q, k, pad, True, None, True).numpy()
    counts = torch.nn.functional.one_hot(idx, lk).sum(-2).numpy()
    for b in range(2):
        for h in range(2):
            for i in range(5):
                c, pr = counts[b, h, i], p[b, h, i]
                assert (c[pr == 0] == 0).all(), (b, h, i)
                assert chi2_gof_pvalue(c[pr > 0], pr[pr > 0]) > P_MIN, (b, h, i)
    assert np.isclose(counts.sum(), 2 * 2 * 5 * nu)


@pytest.mark.parametrize("case", ["none", "bool", "per-query", "additive", "causal",
                                  "causal+bool"])
@pytest.mark.parametrize("gqa", [False, True])
def test_float32_moments_match_the_closed_form(fused_on, case, gqa):
    """Fused moments (float32) against the float64 closed form of the same inputs: 2e-5 on
    values of order 1 (float32 scores and sums over 40 keys)."""
    from tests.attnuq.ops._reference_sampled import ref_moments, ref_probs

    from attnuq.ops import attention_moments

    hq, hk = (4, 2) if gqa else (3, 3)
    q, k, v = _qkv32(2, hq, hk, 6, 40, 16, dv=5, seed=11)
    g = _gen(12)
    mask, causal = None, case.startswith("causal")
    if case in ("bool", "causal+bool"):
        mask = torch.rand(2, 1, 1, 40, generator=g) > 0.3
    elif case == "per-query":
        mask = torch.rand(2, hq, 6, 40, generator=g) > 0.5
        mask[..., 0] = True
    elif case == "additive":
        mask = torch.randn(2, hq, 1, 40, generator=g)
        mask[..., -3:] = float("-inf")
    mean, var = attention_moments(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    p = ref_probs(q, k, None if mask is None else mask.double() if mask.is_floating_point()
                  else mask, causal, None, gqa)
    mu, var_ref = ref_moments(p, v)
    torch.testing.assert_close(mean.double(), mu, rtol=0, atol=2e-5)
    torch.testing.assert_close(var.double(), var_ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("lk,d", [(20, 8), (70, 32)])
def test_float32_non_finite_inputs_are_reported(fused_on, bad, which, masked, lk, d):
    """In float32 the check of q and k is the fused kernel's (it reads every entry): the error
    names the tensor as the other paths' check does, for either sampler and the moments; a
    boolean mask keeps the deferred check, an additive one the up-front check. (Lk = 70,
    D = 32: the bad key sits in a full panel of 32 keys, packed by the AVX-512 transposes;
    Lk = 20, D = 8: the scalar packing.)"""
    from attnuq.ops import attention_moments, sampled_attention

    t = dict(zip("qkv", _qkv32(1, 2, 2, 9, lk, d), strict=True))
    t[which][0, 1, 7, 3] = bad
    mask = (torch.rand(1, 1, 1, lk, generator=_gen(1)) > 0.5) if masked else None
    if masked:
        mask[..., 0] = True
    calls = (
        lambda: sampled_attention(t["q"], t["k"], t["v"], nu=2, attn_mask=mask),
        lambda: sampled_attention(t["q"], t["k"], t["v"], nu=2, attn_mask=mask, block_size=4),
        lambda: attention_moments(t["q"], t["k"], t["v"], attn_mask=mask),
        lambda: attention_moments(t["q"], t["k"], t["v"], attn_mask=mask.float().log()
                                  if masked else None),
    )
    for fn in calls:
        with pytest.raises(ValueError, match=rf"^{which} contains non-finite"):
            fn()


@pytest.mark.parametrize("block_size", [None, 3])
def test_float32_same_generator_state_same_draws(fused_on, block_size):
    """The same generator state gives the same output (one seed, the uniforms derived from it);
    another state other draws; the gradient path (the kernel's indices, then embedding_bag)
    gives the no-gradient path's output."""
    from attnuq.ops import sampled_attention

    q, k, v = _qkv32(2, 2, 2, 30, 50, 8, seed=18)
    kw = dict(nu=6, block_size=block_size, is_causal=True)
    a = sampled_attention(q, k, v, generator=_gen(123), **kw)
    b = sampled_attention(q, k, v, generator=_gen(123), **kw)
    c = sampled_attention(q, k, v, generator=_gen(124), **kw)
    assert torch.equal(a, b) and not torch.equal(a, c)
    vg = v.clone().requires_grad_(True)
    y = sampled_attention(q, k, vg, generator=_gen(123), **kw)
    torch.testing.assert_close(y.detach(), a, rtol=0, atol=1e-6)  # sum order: embedding_bag
    y.sum().backward()
    assert vg.grad is not None and vg.grad.sum().item() == pytest.approx(2 * 2 * 30 * 1.0 * 8)


@pytest.mark.parametrize("lk", [1, 2, 3, 4])
def test_float32_exhaustive_padding_and_causal(fused_on, lk):
    """Every key-padding pattern of Lk keys with causal queries (Lq 1-4), float32: padded and
    future keys never drawn, empty rows flagged (zero output / the error), each output row a
    mean of one-hot value rows."""
    from tests.attnuq.ops.test_sampled import check_padding_and_causal

    pats = torch.tensor(list(itertools.product([False, True], repeat=lk)))
    for lq in range(1, 5):
        q, k, _ = _qkv32(pats.shape[0], 2, 2, lq, lk, 3, seed=lk * 10 + lq)
        check_padding_and_causal(q, k, pats)


def _hf_layout(b, hq, hk, lq, lk, d, seed):
    """q, k, v as (B, H, L, D) views of (B, L, H, D) memory (what Hugging Face passes)."""
    g = _gen(seed)
    q = torch.randn(b, lq, hq, d, generator=g).transpose(1, 2)
    k = torch.randn(b, lk, hk, d, generator=g).transpose(1, 2)
    v = torch.randn(b, lk, hk, d + 3, generator=g).transpose(1, 2)
    return q, k, v


def _hf_mask(b, lq, lk, seed):
    """Additive (B, 1, Lq, Lk) float mask as Hugging Face builds it: finfo.min on padded keys
    and above the causal diagonal, and one row of -inf (a query with no key)."""
    lo = torch.finfo(torch.float32).min
    m = torch.zeros(b, 1, lq, lk)
    m[0, ..., lk - lk // 3:] = lo  # padding of batch entry 0
    m = m.masked_fill(torch.ones(lq, lk, dtype=torch.bool).triu(1), lo)
    m += 0.5 * torch.randn(b, 1, lq, lk, generator=_gen(seed))  # a per-query bias as well
    m[-1, :, -1] = float("-inf")
    return m


@pytest.mark.parametrize("lk", [1, 9, 16, 40])
@pytest.mark.parametrize("gqa", [False, True])
def test_strided_inputs_give_the_draws_of_contiguous_copies(fused_on, lk, gqa):
    """The fused kernels read q, k, v and the mask's bias through their (N, H, L) strides:
    on Hugging Face's transposed memory (with a head-broadcast per-query float mask, GQA, and a
    query with no key) the draws, the output and the moments equal bit for bit those of
    contiguous copies of the same inputs (the same kernel on the same numbers and rows); the
    output comes back in SDPA's (N, Lq, Hq, Dv) memory, the empty row is zero."""
    from attnuq.ops import attention_moments, sampled_attention
    from attnuq.ops.sampled import _sample_indices

    hq, hk = (4, 2) if gqa else (3, 3)
    q, k, v = _hf_layout(2, hq, hk, lk, lk, 8, seed=lk)
    mask = _hf_mask(2, lk, lk, seed=lk + 1)
    qc, kc, vc, mc = (t.contiguous() for t in (q, k, v, mask))
    kw = dict(nu=7, enable_gqa=gqa, empty_rows="zero")
    a = sampled_attention(q, k, v, attn_mask=mask, generator=_gen(5), **kw)
    c = sampled_attention(qc, kc, vc, attn_mask=mc, generator=_gen(5), **kw)
    assert torch.equal(a, c)
    assert a.transpose(1, 2).is_contiguous()  # (N, Lq, Hq, Dv) memory, as SDPA returns
    assert torch.equal(a[-1, :, -1], torch.zeros_like(a[-1, :, -1]))
    with pytest.raises(ValueError, match="every key masked"):
        sampled_attention(q, k, v, attn_mask=mask, nu=7, enable_gqa=gqa)
    ia, ea = _sample_indices(q, k, v, nu=7, attn_mask=mask, enable_gqa=gqa, generator=_gen(6))
    ic, ec = _sample_indices(qc, kc, vc, nu=7, attn_mask=mc, enable_gqa=gqa,
                             generator=_gen(6))
    assert torch.equal(ea, ec) and torch.equal(ia[~ea], ic[~ec])
    ma = attention_moments(q, k, v, attn_mask=mask, enable_gqa=gqa, empty_rows="zero")
    mo = attention_moments(qc, kc, vc, attn_mask=mc, enable_gqa=gqa, empty_rows="zero")
    assert all(torch.equal(x, y) for x, y in zip(ma, mo, strict=True))


@pytest.mark.parametrize("lk", [9, 16])
def test_short_rows_strided_draws_follow_the_softmax(fused_on, lk):
    """Short rows (Lk = 9, 16: one partial key panel, blocks of <= 2 entries) on Hugging
    Face's transposed memory with GQA and an additive per-query mask (finfo.min padding and
    causal triangle plus a random bias): 20k draws per query against the float64 softmax of
    the same float32 inputs; keys of zero weight are never drawn; chi-square per query
    (2 x 4 x Lk - 1 queries with a key, each with false-failure probability P_MIN: at most
    6.3e-5 for the test)."""
    from tests.attnuq.ops._reference_sampled import chi2_gof_pvalue, ref_probs

    from attnuq.ops.sampled import _sample_indices

    nu = 20_000
    q, k, v = _hf_layout(2, 4, 2, lk, lk, 8, seed=10 + lk)
    mask = _hf_mask(2, lk, lk, seed=11 + lk)
    idx, empty = _sample_indices(q, k, v, nu=nu, attn_mask=mask, enable_gqa=True,
                                 generator=_gen(12))
    p = ref_probs(q, k, mask, False, None, True)
    assert torch.equal(empty, p.sum(-1) == 0)
    counts = torch.zeros(*idx.shape[:-1], lk, dtype=torch.long).scatter_add_(
        -1, idx, torch.ones_like(idx)).numpy()
    p = p.numpy()
    for b in range(2):
        for h in range(4):
            for i in range(lk):
                c, pr = counts[b, h, i], p[b, h, i]
                if empty[b, h, i]:
                    continue
                assert (c[pr == 0] == 0).all(), (b, h, i)
                assert chi2_gof_pvalue(c[pr > 0], pr[pr > 0]) > P_MIN, (b, h, i)


@pytest.mark.parametrize("block", [0, 5])
def test_float_mask_read_in_place_equals_its_log2_table(fused_on, block):
    """A float32 additive mask is handed to the kernels as it is (``bias_natural``: the kernel
    converts each entry as it reads it) instead of as a log2 table made by torch first
    (:meth:`Attn.bias5`). Both give the same draws and moments bit for bit, including
    entries at ``finfo.min`` and below ``-FLT_MAX / log2(e)`` (whose log2 multiple overflows:
    kept finite, an ordinary score), ``-inf`` (excluded) and a whole row of ``-inf``; a
    per-query, head-broadcast mask on Hugging Face's memory, dense and key-blocked."""
    from attnuq.ops._attn_common import prepare

    lk = 13
    q, k, v = _hf_layout(2, 4, 2, lk, lk, 8, seed=31)
    mask = _hf_mask(2, lk, lk, seed=32)
    mask[1, 0, 2, :4] = -3.0e38  # finite, but times log2(e) below -FLT_MAX
    mask[1, 0, 3, :] = torch.finfo(torch.float32).min  # a row of ordinary, equal scores
    mask[0, 0, 4, ::3] = float("-inf")
    att = prepare(q, k, v, mask, False, None, True)
    natural, is_natural = att.kernel_bias()
    table = att.bias5(torch.float32)
    assert is_natural and natural is not None and table is not None
    assert natural.data_ptr() == mask.data_ptr()  # no copy of the mask
    g, m = att.groups, att.rows
    outs = []
    for bias, nat in ((natural, True), (table, False)):
        idx = torch.empty(g, m, 9, dtype=torch.int64)
        empty = torch.empty(g, m, dtype=torch.bool)
        _native.fused_call_4d("sample", att.q4, att.k4, att.v4(), att.scale, bias, False,
                              empty, seed=11, nu=9, block=block, idx=idx, bias_natural=nat)
        mean = torch.empty(2, 4, lk, v.shape[-1])
        var = torch.empty_like(mean)
        empty2 = torch.empty(g, m, dtype=torch.bool)
        _native.fused_call_4d("moments", att.q4, att.k4, att.v4(), att.scale, bias, False,
                              empty2, out=mean, var=var, bias_natural=nat)
        outs.append((idx, empty, mean, var, empty2))
    (ia, ea, ma, va, fa), (ib, eb, mb, vb, fb) = outs
    assert torch.equal(ea, eb) and torch.equal(fa, fb) and int(ea.sum()) == 4  # 4 heads
    assert torch.equal(ia[~ea], ib[~eb])
    assert torch.equal(ma, mb) and torch.equal(va, vb)
    # the row at finfo.min everywhere has uniform weights (as in SDPA), not an empty row
    uniform = v[1].mean(dim=1).repeat_interleave(2, dim=0)  # (Hq, Dv)
    torch.testing.assert_close(ma[1, :, 3], uniform, atol=1e-5, rtol=0)
