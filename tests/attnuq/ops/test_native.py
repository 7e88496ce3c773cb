"""Tests of ``attnuq.ops._native``: the build and loading of the compiled kernels, and the dense
sampler's kernel (the Levy-attention kernel: ``tests/ops/test_levy_native.py``).

Every draw is checked against the exact (float64) inverse CDF in the kernel's key order, so a
wrong block, a wrong entry or an inaccurate ``2^x`` fails deterministically. The chi-square
tests have false-failure probability ``P_MIN = 1e-6`` each.
"""

from __future__ import annotations

import math
import os
import shutil

import numpy as np
import pytest
import torch
from tests.attnuq.ops._reference_sampled import chi2_gof_pvalue

from attnuq.ops import _native

P_MIN = 1e-6
LANES, MAXBL = 8, 16  # blocks come in multiples of LANES, of at most MAXBL entries

needs_kernel = pytest.mark.skipif(
    not _native.available(),
    reason=f"native sampling kernel unavailable: {_native.status()['reason']}",
)


def _kernel_order(lk: int) -> list[int]:
    """The kernel's CDF order (csrc/sample_rows.c): ``nb = 8 ceil(Lk / 128)`` blocks; key
    ``j = l * nb + b`` is entry ``l`` of block ``b``; blocks in order, entries in order."""
    nb = max(LANES, LANES * -(-lk // (LANES * MAXBL)))
    return sorted(range(lk), key=lambda j: (j % nb, j // nb))


def _scores(rows: int, lk: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(rows, lk, generator=g, dtype=torch.float64) * 4
    s[torch.rand(rows, lk, generator=g) < 0.3] = float("-inf")
    s[0] = float("-inf")  # an empty row
    s[1] = float("-inf")
    s[1, -1] = 0.0  # a row whose only key is the last one
    return s.to(dtype)


def _run(s: torch.Tensor, u: torch.Tensor, idt: torch.dtype = torch.long):
    out = torch.empty(*u.shape, dtype=idt)
    empty = torch.empty(s.shape[0], dtype=torch.bool)
    _native.sample_rows(s, u, out, empty)
    return out, empty


def test_a_compiler_means_the_kernel_is_used():
    """No silent fallback: where a C compiler exists (as on CI) the kernel must compile."""
    if os.environ.get("ATTNUQ_NATIVE", "1").strip() == "0":
        pytest.skip("ATTNUQ_NATIVE=0: the kernel is switched off on purpose")
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler {cc!r}: the pure-torch path runs ({_native.status()})")
    st = _native.status()
    assert st["available"], st


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lk", [1, 3, 16, 17, 100, 512, 1100])
@pytest.mark.parametrize("idt", [torch.int32, torch.long])
def test_every_draw_is_the_exact_inverse_cdf(dtype, lk, idt):
    """Key of u = the key whose CDF interval (in the kernel's key order) holds u, up to the
    kernel's float32 rounding: 2^x to 2e-7 and sums of at most nb + 16 terms. The largest miss
    measured over 360k float32 draws (Lk up to 4000) was 4.2e-7; tol = 1e-6. A 1e-4 error in
    the ln 2 coefficient of the 2^x polynomial misses by 5e-6 and fails here."""
    rows, nu = 200, 50
    s = _scores(rows, lk, dtype, seed=lk)
    u = torch.rand(rows, nu, generator=torch.Generator().manual_seed(1), dtype=dtype)
    idx, empty = _run(s, u, idt)
    assert idx.dtype == idt
    order = _kernel_order(lk)
    pos = torch.empty(lk, dtype=torch.long)
    pos[torch.tensor(order)] = torch.arange(lk)
    p = torch.softmax(s.double()[:, order] * math.log(2), -1)  # (rows, lk) in kernel order
    p = torch.nan_to_num(p, nan=0.0)
    cdf = p.cumsum(-1)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    for r in range(rows):
        if torch.isneginf(s[r]).all():
            assert empty[r] and (idx[r] == 0).all()
            continue
        assert not empty[r]
        i = pos[idx[r].long()]  # entries in kernel order
        assert (p[r, i] > 0).all(), "a key of zero weight was drawn"
        lo = torch.where(i > 0, cdf[r, (i - 1).clamp_min(0)], torch.zeros_like(i, dtype=p.dtype))
        hi = cdf[r, i]
        x = u[r].double()
        assert ((lo - tol <= x) & (x <= hi + tol)).all(), (r, x, lo, hi)
    assert bool(empty[0]) and int(idx[1].unique()) == lk - 1


@needs_kernel
@pytest.mark.parametrize("lk", [300, 1100])
def test_long_rows_follow_the_softmax(lk):
    """200k draws of one row of 300 keys (block count) and 1100 keys (binary search)."""
    g = torch.Generator().manual_seed(lk)
    s = torch.randn(1, lk, generator=g, dtype=torch.float64) * 0.8
    s[0, :: 7] = float("-inf")
    n = 200_000
    u = torch.rand(1, n, generator=g, dtype=torch.float32)
    idx, _ = _run(s.float(), u)
    counts = np.bincount(idx[0].numpy(), minlength=lk)
    p = torch.softmax(s[0] * math.log(2), -1).numpy()
    assert (counts[p == 0] == 0).all()
    assert chi2_gof_pvalue(counts[p > 0], p[p > 0]) > P_MIN


@needs_kernel
@pytest.mark.parametrize("openmp", [True, False])
def test_rows_split_over_threads_give_the_same_draws(monkeypatch, openmp):
    """Each row's draws depend only on its scores and uniforms: splitting the rows over two
    threads (OpenMP inside the kernel, or Python threads) changes nothing."""
    s = _scores(4000, 64, torch.float32, seed=3)
    u = torch.rand(4000, 5, generator=torch.Generator().manual_seed(4))
    one, e1 = _run(s, u)
    monkeypatch.setattr(_native, "_has_openmp", lambda lib: openmp)
    torch.set_num_threads(2)  # the conftest fixture restores the count
    two, e2 = _run(s, u)
    assert torch.equal(one, two) and torch.equal(e1, e2)


@needs_kernel
def test_sample_rows_rejects_bad_buffers():
    s = torch.zeros(3, 4)
    u = torch.rand(3, 2)
    with pytest.raises(ValueError, match=r"float16"):
        _native.sample_rows(s.half(), u.half(), torch.empty(3, 2, dtype=torch.long),
                            torch.empty(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"out \(3, 3\)"):
        _native.sample_rows(s, u, torch.empty(3, 3, dtype=torch.long),
                            torch.empty(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"stride \(1, 3\)"):
        _native.sample_rows(s.t().contiguous().t()[:, :3], u, torch.empty(3, 2, dtype=torch.long),
                            torch.empty(3, dtype=torch.bool))


def test_switches_and_failures_fall_back_with_a_reason(monkeypatch, tmp_path):
    load = _native._load.__wrapped__  # the uncached loader
    monkeypatch.setenv("ATTNUQ_NATIVE", "0")
    assert load() == (None, "disabled by ATTNUQ_NATIVE=0")
    monkeypatch.delenv("ATTNUQ_NATIVE")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    lib, reason = load()
    assert lib is None and "no C compiler" in reason and "no-such-cc" in reason
    with _native.disabled():
        assert not _native.available()
        assert _native.status()["enabled"] is False


@needs_kernel
def test_compiles_into_the_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNUQ_CACHE_DIR", str(tmp_path))
    lib, reason = _native._load.__wrapped__()
    assert lib is not None, reason
    built = list(tmp_path.glob("kernels-*.so"))
    assert len(built) == 1 and str(built[0]) in reason
    assert not list(tmp_path.glob("tmp*"))  # the atomic rename left no temporary file


def test_an_unwritable_cache_dir_falls_back_with_a_reason(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("ATTNUQ_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.delenv("ATTNUQ_NATIVE", raising=False)
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler: the compile step is never reached")
    lib, reason = _native._load.__wrapped__()
    assert lib is None and "cannot write to the cache directory" in reason


@needs_kernel
def test_an_unwritable_user_cache_falls_back_to_a_temporary_dir(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.delenv("ATTNUQ_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # <blocker>/attnuq cannot be created
    monkeypatch.setattr(_native.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    lib, reason = _native._load.__wrapped__()
    assert lib is not None, reason
    assert str(tmp_path / "tmp") in reason


# ---- the kernel cache: a folder another user could write to is refused ---------------------


@pytest.fixture
def fresh_load(monkeypatch):
    """Let ``_native._load`` run again under the test's environment; the process's own
    kernel (cached load) is restored afterwards."""
    saved = _native._load.cache_info().currsize
    _native._load.cache_clear()
    yield monkeypatch
    monkeypatch.undo()  # the environment first, so the reload below sees the real one
    _native._load.cache_clear()
    if saved:
        _native._load()


def test_native_status_is_public_and_says_which_path_runs():
    """(Run after the refusal tests in a worker, this also checks they restored the kernel.)"""
    import attnuq.ops

    st = attnuq.ops.native_status()
    assert set(st) == {"available", "enabled", "openmp", "fused", "simd", "reason"}
    assert st["available"] == _native.status()["available"]
    assert st["reason"] == _native.status()["reason"]
    if st["available"]:
        assert "compiled with" in str(st["reason"])
        assert st["simd"] in ("avx512", "portable") and st["fused"] is True
        with _native.unfused():
            assert attnuq.ops.native_status()["fused"] is False
    else:
        assert st["simd"] is None and st["fused"] is False


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="no user ids on this platform")
def test_a_cache_folder_writable_by_others_is_refused(tmp_path, fresh_load):
    folder = tmp_path / "shared-cache"
    folder.mkdir()
    folder.chmod(0o777)
    fresh_load.setenv("ATTNUQ_CACHE_DIR", str(folder))
    st = _native.native_status()
    assert st["available"] is False
    assert "refusing the kernel cache" in str(st["reason"]) and "writable by group" in str(
        st["reason"])
    assert list(folder.iterdir()) == []  # nothing was compiled into it


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="no user ids on this platform")
def test_a_cache_folder_of_another_user_is_refused(tmp_path, fresh_load):
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    me = os.getuid()
    fresh_load.setattr(_native.os, "getuid", lambda: me + 1)  # the folder is now someone else's
    fresh_load.setenv("ATTNUQ_CACHE_DIR", str(folder))
    st = _native.native_status()
    assert st["available"] is False
    assert f"owned by uid {me}, not by this user (uid {me + 1})" in str(st["reason"])
    assert list(folder.iterdir()) == []


def test_a_library_planted_in_a_folder_of_ours_but_owned_by_another_is_refused(tmp_path):
    folder = tmp_path / "ours"
    folder.mkdir(mode=0o700)
    lib = folder / "kernels-0123.so"
    lib.write_bytes(b"not a library")
    lib.chmod(0o644)
    assert _native._unsafe(folder) is None and _native._unsafe(lib) is None
    lib.chmod(0o666)
    assert "writable by group or others" in str(_native._unsafe(lib))
    assert _native._unsafe(folder / "absent.so") is None  # nothing there yet: may be built


def test_a_new_cache_folder_is_private(tmp_path, fresh_load):
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler: nothing is built")
    folder = tmp_path / "new" / "cache"
    fresh_load.setenv("ATTNUQ_CACHE_DIR", str(folder))
    old = os.umask(0o002)  # a permissive umask must not make the cache group-writable
    try:
        st = _native.native_status()
    finally:
        os.umask(old)
    if os.environ.get("ATTNUQ_NATIVE", "1").strip() == "0":
        assert not st["available"]
        return
    assert st["available"], st
    assert folder.stat().st_mode & 0o077 == 0


def test_the_refusal_tests_leave_the_process_kernel_in_place(tmp_path, monkeypatch):
    before = _native.status()
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(0o777)
    gen = fresh_load.__wrapped__(monkeypatch)  # the fixture's body, driven by hand
    next(gen)
    monkeypatch.setenv("ATTNUQ_CACHE_DIR", str(folder))
    assert _native.native_status()["available"] is False
    with pytest.raises(StopIteration):
        next(gen)
    assert _native.status() == before


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lk", [1, 17, 128, 300])
def test_block_kernel_is_the_dense_lookup_behind_an_exact_coin(dtype, lk):
    """``sample_block`` on one key block: the running log-mass becomes
    ``logaddexp2(run, lb)``; a draw is replaced iff ``u < p = 2^(lb - run')`` and then by
    ``j0`` plus the dense kernel's key for the threshold ``u / p`` (the same CDF layout and
    lookup, so the same key exactly); otherwise it is kept. Compared with a float64 reference
    of ``lb`` and ``p``; draws within 1e-5 (float32; 1e-12 float64) of the coin's edge are
    not compared (the kernel rounds ``p`` in its own dtype)."""
    rows, nu, j0 = 120, 40, 1000
    s = _scores(rows, lk, dtype, seed=7 + lk)
    g = torch.Generator().manual_seed(lk)
    u = torch.rand(rows, nu, generator=g, dtype=dtype)
    run0 = (torch.randn(rows, generator=g, dtype=torch.float64) * 3).to(dtype)
    run0[::5] = float("-inf")  # rows before their first block
    choice0 = torch.randint(0, 999, (rows, nu), generator=g)
    run, choice = run0.clone(), choice0.clone()
    _native.sample_block(s, u, run, choice, j0)
    sd = s.double()
    lb = torch.logsumexp(sd * math.log(2), -1) / math.log(2)  # block log2-mass, -inf if empty
    new = torch.logaddexp2(run0.double(), lb)
    tol_run = 1e-5 if dtype == torch.float32 else 1e-12
    fin = torch.isfinite(new)
    assert torch.equal(torch.isneginf(run), ~fin)
    torch.testing.assert_close(run.double()[fin], new[fin], rtol=tol_run, atol=tol_run)
    p = torch.exp2(lb - new).nan_to_num(nan=0.0)  # (rows,)
    edge = 1e-5 if dtype == torch.float32 else 1e-12
    below = 1.0 - torch.finfo(dtype).eps / 2
    x = (u / p.to(dtype).unsqueeze(-1).clamp_min(torch.finfo(dtype).tiny)).clamp_max(below)
    dense, _ = _run(s, x.contiguous())
    take = u.double() < p.unsqueeze(-1)
    sure = (u.double() - p.unsqueeze(-1)).abs() > edge
    assert bool(sure.float().mean() > 0.99)
    assert torch.equal(choice[take & sure], dense[take & sure] + j0)
    assert torch.equal(choice[~take & sure], choice0[~take & sure])
    assert torch.equal(choice[torch.isneginf(lb)], choice0[torch.isneginf(lb)])  # empty block
