"""Sizes of ``attnuq.ops.sampled``: the memory budget, the 2**31 limit of one ``embedding_bag``
call, degenerate shapes (issue #23, items 2 and 8).

The statistical check (the > 2**31-draw call) states its false-failure probability.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from attnuq.ops import MAX_NU, attention_moments, max_bytes, sampled_attention
from attnuq.ops import sampled as mod
from attnuq.ops.sampled import _sample_indices

ROOT = Path(__file__).resolve().parents[3]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _qkv(shape_q, lk, dv, seed=0, dtype=torch.float32):
    g = _gen(seed)
    *batch, lq, d = shape_q
    q = torch.randn(*batch, lq, d, generator=g, dtype=dtype)
    k = torch.randn(*batch, lk, d, generator=g, dtype=dtype)
    v = torch.randn(*batch, lk, dv, generator=g, dtype=dtype)
    return q, k, v


# ---------------------------------------------------------------------------------------------
# one embedding_bag call never sees 2**31 indices
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [None, 8])
def test_gather_calls_are_bounded_and_give_the_single_call_result(monkeypatch, sampler,
                                                                  block_size):
    """Without a gradient the value rows are summed by several ``embedding_bag`` calls, each
    with at most ``_GATHER_ELEMS`` indices plus one chunk's; together they cover every draw
    once, and the output equals that of one call over all indices (the same generator state;
    the same per-bag sums). This is the arithmetic that keeps each call below torch's 2**31
    limit ('Expected i < index_size' on one thread) for any number of draws in the call."""
    q, k, v = _qkv((3, 2, 40, 8), 24, 4, seed=1)
    nu = 16
    monkeypatch.setattr(mod, "_DENSE_CHUNK_ELEMS", 16 * (24 + 2 * nu))  # 16 rows per chunk
    monkeypatch.setattr(mod, "_DENSE_MIN_ROWS", 16)
    monkeypatch.setattr(mod, "_BLOCKED_SAMPLE_ELEMS", 16 * (8 + nu))
    monkeypatch.setattr(mod, "_BLOCKED_MIN_ROWS", 16)
    ref = sampled_attention(q, k, v, nu=nu, block_size=block_size, generator=_gen(7))

    calls: list[int] = []
    bag = mod.F.embedding_bag

    def counting(inp, *args, **kwargs):
        calls.append(inp.numel())
        return bag(inp, *args, **kwargs)

    monkeypatch.setattr(mod, "_GATHER_ELEMS", 40 * nu)
    monkeypatch.setattr(mod.F, "embedding_bag", counting)
    y = sampled_attention(q, k, v, nu=nu, block_size=block_size, generator=_gen(7))
    if sampler == "fused":  # the kernel gathers the drawn rows itself: no embedding_bag call
        assert calls == []
        torch.testing.assert_close(y, ref, rtol=0, atol=0)
        return
    chunk = 16 * nu
    assert len(calls) > 1, calls
    assert max(calls) <= 40 * nu + chunk, calls
    assert sum(calls) == 3 * 2 * 40 * nu  # every draw gathered once
    torch.testing.assert_close(y, ref, rtol=0, atol=0)


def test_gradient_path_splits_its_gather_below_the_limit(monkeypatch, sampler):
    """With a gradient for ``v`` all indices are drawn at once; the gather is split into calls
    of at most ``_MAX_BAG_INDICES`` indices (shrunk here from 2**31 - 1); the output equals that
    of one call and so does the gradient, to float64 rounding."""
    q, k, v = _qkv((2, 3, 10, 4), 7, 3, seed=2, dtype=torch.float64)
    nu = 5
    w = torch.randn(2, 3, 10, 3, generator=_gen(3), dtype=torch.float64)

    def run():
        vv = v.clone().requires_grad_(True)
        y = sampled_attention(q, k, vv, nu=nu, generator=_gen(4))
        (y * w).sum().backward()
        return y.detach(), vv.grad

    y1, g1 = run()
    calls: list[int] = []
    bag = mod.F.embedding_bag

    def counting(inp, *args, **kwargs):
        calls.append(inp.numel())
        return bag(inp, *args, **kwargs)

    monkeypatch.setattr(mod, "_MAX_BAG_INDICES", 4 * nu + 3)  # 4 bags per call
    monkeypatch.setattr(mod.F, "embedding_bag", counting)
    y2, g2 = run()
    assert max(calls) <= 4 * nu and len(calls) == -(-2 * 3 * 10 // 4), calls
    torch.testing.assert_close(y2, y1, rtol=0, atol=0)
    # the pieces' gradients are added in another order: equal to float64 rounding
    torch.testing.assert_close(g2, g1, rtol=1e-12, atol=1e-12)


_BIG_CALL = textwrap.dedent(
    """
    import resource, sys, torch
    resource.setrlimit(resource.RLIMIT_DATA, (4 << 30, 4 << 30))  # safety net: 4 GiB of heap
    torch.set_num_threads(1)  # one thread: one embedding_bag range covers every bag
    from attnuq.ops import sampled_attention
    rows, nu = 1 << 16, (1 << 15) + 1
    q = torch.zeros(64, 2, rows // 128, 1)
    k = torch.zeros(64, 2, 2, 1)  # both keys score 0: each is drawn with probability 1/2
    v = torch.tensor([0.0, 1.0]).view(1, 1, 2, 1).expand(64, 2, 2, 1).contiguous()
    y = sampled_attention(q, k, v, nu=nu, generator=torch.Generator().manual_seed(0))
    ones = float(y.double().mul(nu).round().sum())  # draws of key 1
    # VmHWM: the peak RSS of this process's own memory map. (ru_maxrss would also count the
    # parent's RSS: Linux carries the old map's high-water mark across execve, and subprocess
    # execs from the parent's map -- a loaded pytest worker -- so it read 1.8 GiB there.)
    status = open("/proc/self/status").read().split("VmHWM:")[1]
    peak = int(status.split()[0]) * 1024
    print(rows * nu, ones, peak, tuple(y.shape))
    """
)


@pytest.mark.slow
def test_one_call_beyond_2_31_draws_has_bounded_memory():
    """One call with ``2**31 + 2**16`` draws (65536 queries, ``nu = 2**15 + 1``, ``Lk = 2``,
    ``Dv = 1``) on one thread, in a fresh process: it succeeds (before the fix it needed all
    ``2**31`` int32 indices, 8 GiB, in one ``embedding_bag`` call, which torch refuses with
    'Expected i < index_size'), its peak resident memory stays below 1.5 GiB (the index tensor
    alone would be 8 GiB; a 4 GiB heap limit in the child makes a regression fail fast instead
    of filling the machine), and the drawn counts are right: the keys have weight 1/2 each, so
    the number of draws of key 1 is Binomial(n, 1/2); |z| < 5 fails falsely with probability
    5.7e-7. Measured: 50 s on one core, peak RSS (VmHWM) 0.88 GiB, most of it importing torch."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _BIG_CALL], capture_output=True, text=True, cwd=ROOT, env=env,
        timeout=900, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    n_s, ones_s, peak_s, shape = proc.stdout.strip().split(" ", 3)
    n, ones, peak = int(n_s), float(ones_s), int(peak_s)
    assert n == 2**31 + 2**16 and n > 2**31
    assert shape == "(64, 2, 512, 1)"
    z = (ones - n / 2) / (n / 4) ** 0.5
    assert abs(z) < 5.0, z
    assert peak < 1.5 * 2**30, f"peak RSS {peak / 2**30:.2f} GiB"


# ---------------------------------------------------------------------------------------------
# the memory budget
# ---------------------------------------------------------------------------------------------
def test_huge_nu_on_one_query_is_refused_with_the_bytes_it_needs(monkeypatch):
    """``nu = 2**31`` on one query needs tens of GiB for its uniforms and indices alone: refused
    before anything is allocated, with the estimate and the budget in the message."""
    monkeypatch.delenv("ATTNUQ_MAX_BYTES", raising=False)
    q, k, v = _qkv((1, 8), 4, 8)
    with pytest.raises(ValueError, match=r"nu=2147483648 needs about [\d,]+ bytes") as exc:
        sampled_attention(q, k, v, nu=2**31)
    msg = str(exc.value)
    assert f"memory budget of {max_bytes():,} bytes" in msg and "ATTNUQ_MAX_BYTES" in msg
    need = int(msg.split("needs about ")[1].split(" bytes")[0].replace(",", ""))
    assert need >= 2**31 * (4 + 4)  # at least the uniforms and the indices of the one row
    with pytest.raises(ValueError, match="memory budget"):
        _sample_indices(q, k, v, nu=2**31)


def test_budget_comes_from_the_environment(monkeypatch):
    """``ATTNUQ_MAX_BYTES`` sets the budget: a call under it runs, the same call over it is
    refused naming both numbers; a non-positive or non-integer value is an error naming it."""
    q, k, v = _qkv((2, 2, 16, 4), 16, 4)
    monkeypatch.setenv("ATTNUQ_MAX_BYTES", str(10**9))
    assert max_bytes() == 10**9
    sampled_attention(q, k, v, nu=64, generator=_gen(0))
    monkeypatch.setenv("ATTNUQ_MAX_BYTES", "1000")
    with pytest.raises(ValueError, match=r"memory budget of 1,000 bytes"):
        sampled_attention(q, k, v, nu=64, generator=_gen(0))
    with pytest.raises(ValueError, match=r"memory budget of 1,000 bytes"):
        sampled_attention(q, k, v, nu=64, block_size=4, generator=_gen(0))
    for bad in ("abc", "0", "-5", "1e9"):
        monkeypatch.setenv("ATTNUQ_MAX_BYTES", bad)
        with pytest.raises(ValueError, match=rf"ATTNUQ_MAX_BYTES='{bad}'"):
            max_bytes()


def test_gradient_path_counts_every_index(monkeypatch):
    """With a gradient for ``v`` every index is held, so the estimate grows with
    ``G * M * nu``: a budget that the no-gradient call fits is too small with a gradient."""
    q, k, v = _qkv((2, 2, 64, 4), 16, 4)
    parts_nograd = mod._estimate_bytes(mod.prepare(q, k, v, None, False, None, False), 256,
                                       None, False)
    budget = sum(parts_nograd.values())
    monkeypatch.setenv("ATTNUQ_MAX_BYTES", str(budget))
    sampled_attention(q, k, v, nu=256, generator=_gen(0))
    with pytest.raises(ValueError, match="all indices"):
        sampled_attention(q, k, v.clone().requires_grad_(True), nu=256, generator=_gen(0))


def test_nu_above_max_nu_is_refused_whatever_the_budget(monkeypatch):
    """``nu > MAX_NU = 2**31 - 1`` cannot be summed by one ``embedding_bag`` call; refused even
    when the budget would allow the memory."""
    monkeypatch.setenv("ATTNUQ_MAX_BYTES", str(10**15))
    q, k, v = _qkv((1, 4), 2, 1)
    assert MAX_NU == 2**31 - 1
    with pytest.raises(ValueError, match=r"at most MAX_NU = 2\*\*31 - 1 .*got nu=2147483648"):
        sampled_attention(q, k, v, nu=2**31)


# ---------------------------------------------------------------------------------------------
# degenerate shapes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [None, 2])
@pytest.mark.parametrize("grad", [False, True])
def test_zero_value_width_gives_an_empty_output(block_size, grad):
    """``Dv = 0``: the output (and the moments) are ``(*batch, Hq, Lq, 0)``, as SDPA returns."""
    q, k, v = _qkv((2, 3, 5, 4), 6, 0)
    v.requires_grad_(grad)
    y = sampled_attention(q, k, v, nu=4, block_size=block_size, generator=_gen(0))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v.detach())
    assert y.shape == ref.shape == (2, 3, 5, 0)
    mean, var = attention_moments(q, k, v, block_size=block_size)
    assert mean.shape == var.shape == (2, 3, 5, 0)
