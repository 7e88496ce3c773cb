"""Tests of the Triton kernels (``attnuq.ops._triton``): sampled attention and its moments.

Without a GPU they run under triton's interpreter on CPU tensors (``tests/conftest.py`` sets
``TRITON_INTERPRET=1`` before triton is first imported); ``scripts/gpu_check.sh`` runs the same
tests compiled on CUDA tensors (``TRITON_INTERPRET=0``). Shapes are tiny (the interpreter runs
every program in numpy). Lk = 40 with the kernel's 32-key tiles: every row sees a full and a
partial tile, so the running choice across tiles is exercised.

Statistical tests fix their seeds and state their false-failure probability: the chi-square
tests compare each row's index counts with the float64 softmax and fail when a row's p-value is
below ``1e-4 / rows`` (Bonferroni): at most 1e-4 per test.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.attnuq.ops._reference_sampled import chi2_gof_pvalue, ref_moments, ref_probs

from attnuq.ops import _rng, _triton, attention_moments, sampled_attention

# The additive-mask case holds finfo(float32).min, whose log2(e) multiple overflows to -inf in
# the kernel before it is replaced by the finite -FLT_MAX; numpy (the interpreter) warns.
OVERFLOW_OK = pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
ALPHA = 1e-4  # false-failure probability of one chi-square test (Bonferroni over its rows)
LK = 40


def _device() -> str:
    if _triton.interpreting():
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.fail(
        "the Triton tests need TRITON_INTERPRET=1 set before triton is imported (tests/conftest.py "
        "does it) or a CUDA device"
    )


DEV = _device()


def _inputs(
    b: int = 1, hq: int = 2, hk: int = 2, lq: int = 8, lk: int = LK, d: int = 8, dv: int = 4,
    dtype: torch.dtype = torch.float32, seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g)
    k = torch.randn(b, hk, lk, d, generator=g)
    v = torch.randn(b, hk, lk, dv, generator=g)
    return q.to(DEV, dtype), k.to(DEV, dtype), v.to(DEV, dtype)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _masks(case: str, b: int, hq: int, lq: int, lk: int) -> torch.Tensor | None:
    g = torch.Generator().manual_seed(7)
    if case == "bool":
        m = torch.rand(b, hq, lq, lk, generator=g) < 0.6
        m[..., 0] = True  # no empty row
        return m.to(DEV)
    if case == "additive":
        m = torch.randn(b, 1, lq, lk, generator=g)
        m[torch.rand(b, 1, lq, lk, generator=g) < 0.3] = -math.inf
        m[..., 3] = 0.0
        m[..., 5] = torch.finfo(torch.float32).min  # finite: an ordinary (tiny) score
        return m.to(DEV)
    if case == "padding":  # key padding (B, 1, 1, Lk)
        m = torch.ones(b, 1, 1, lk, dtype=torch.bool)
        m[..., lk - 11 :] = False
        return m.to(DEV)
    return None


CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "causal-lq-gt-lk": {"is_causal": True, "lq": LK + 4},
    "bool-mask": {"mask": "bool"},
    "additive-mask": {"mask": "additive"},
    "gqa-padding": {"hq": 4, "hk": 2, "enable_gqa": True, "mask": "padding"},
    "scale": {"scale": 0.9},
    "bf16": {"dtype": torch.bfloat16},
    "fp16-causal": {"dtype": torch.float16, "is_causal": True},
}


def _case(name: str) -> tuple[tuple[torch.Tensor, ...], dict[str, object]]:
    c = dict(CASES[name])
    shape = {key: c.pop(key) for key in ("hq", "hk", "lq", "dtype") if key in c}
    q, k, v = _inputs(**shape)  # type: ignore[arg-type]
    mask = _masks(str(c.pop("mask", "")), q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return (q, k, v), {"attn_mask": mask, **c}


def _probs(q: torch.Tensor, k: torch.Tensor, kw: dict[str, object]) -> torch.Tensor:
    mask = kw.get("attn_mask")
    return ref_probs(
        q.cpu(), k.cpu(), attn_mask=None if mask is None else mask.cpu(),  # type: ignore[union-attr]
        is_causal=bool(kw.get("is_causal", False)), scale=kw.get("scale"),  # type: ignore[arg-type]
        enable_gqa=bool(kw.get("enable_gqa", False)),
    )


@OVERFLOW_OK
@pytest.mark.parametrize("name", list(CASES))
def test_triton_index_counts_match_softmax(name: str) -> None:
    """Index counts of 256 draws per row against the float64 softmax (chi-square per row, cells
    of expected count < 5 pooled; false-failure probability <= 1e-4 by Bonferroni); keys of zero
    weight (masked, padded, future) are never drawn (exact)."""
    (q, k, v), kw = _case(name)
    nu = 256
    idx, empty = _triton.sample_indices(q, k, v, nu=nu, generator=_gen(1), **kw)  # type: ignore[arg-type]
    assert idx.shape == (*q.shape[:-1], nu) and not bool(empty.any())
    p = _probs(q, k, kw).reshape(-1, k.shape[-2]).numpy()
    flat = idx.cpu().reshape(-1, nu).numpy()
    assert flat.min() >= 0 and flat.max() < k.shape[-2]
    rows = p.shape[0]
    worst = 1.0
    for i in range(rows):
        counts = np.bincount(flat[i], minlength=p.shape[1])
        pos = p[i] > 0
        assert counts[~pos].sum() == 0, f"row {i} drew a key of zero weight"
        worst = min(worst, chi2_gof_pvalue(counts[pos], p[i][pos]))
    assert worst > ALPHA / rows, f"smallest per-row chi-square p-value {worst:.3g}"


def test_triton_same_generator_state_same_draws() -> None:
    """Draws are a function of the generator state: equal states give equal indices and outputs
    (the same kernel on the same inputs); the generator advances, so a second call differs."""
    q, k, v = _inputs()
    mask = _masks("bool", 1, 2, 8, LK)
    a, _ = _triton.sample_indices(q, k, v, nu=16, attn_mask=mask, generator=_gen(3))
    b, _ = _triton.sample_indices(q, k, v, nu=16, attn_mask=mask, generator=_gen(3))
    assert torch.equal(a, b)
    g = _gen(3)
    c1, _ = _triton.sample_indices(q, k, v, nu=16, attn_mask=mask, generator=g)
    c2, _ = _triton.sample_indices(q, k, v, nu=16, attn_mask=mask, generator=g)
    assert torch.equal(c1, a) and not torch.equal(c2, a)
    y1 = _triton.sampled_attention(q, k, v, nu=16, attn_mask=mask, generator=_gen(4))
    y2 = _triton.sampled_attention(q, k, v, nu=16, attn_mask=mask, generator=_gen(4))
    assert torch.equal(y1, y2)


@pytest.mark.parametrize("name", ["plain", "gqa-padding", "bf16"])
def test_triton_output_is_mean_of_drawn_values(name: str) -> None:
    """The output is the mean of the value rows at the drawn indices (the same generator state
    gives the indices); float32 sums, so agreement to float32 rounding (or the 16-bit output's)."""
    (q, k, v), kw = _case(name)
    nu = 12
    y = _triton.sampled_attention(q, k, v, nu=nu, generator=_gen(5), **kw)  # type: ignore[arg-type]
    idx, _ = _triton.sample_indices(q, k, v, nu=nu, generator=_gen(5), **kw)  # type: ignore[arg-type]
    hq, hk = q.shape[1], k.shape[1]
    vv = v.cpu().double().repeat_interleave(hq // hk, dim=1)  # (B, Hq, Lk, Dv)
    ref = torch.stack(
        [vv[0, h][idx[0, h].cpu()].mean(-2) for h in range(hq)]
    ).unsqueeze(0)  # (1, Hq, Lq, Dv)
    assert y.dtype == q.dtype and y.shape == ref.shape
    tol = 1e-6 if q.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.cpu().double(), ref, rtol=tol, atol=tol)


@OVERFLOW_OK
@pytest.mark.parametrize("name", list(CASES))
def test_triton_moments_match_closed_form(name: str) -> None:
    """Mean and per-dimension variance against the float64 closed form (two-pass variance),
    to float32 rounding (bf16/fp16: to the output's rounding); the mean equals SDPA's output."""
    (q, k, v), kw = _case(name)
    mean, var = _triton.attention_moments(q, k, v, **kw)  # type: ignore[arg-type]
    p = _probs(q, k, kw)
    rm, rv = ref_moments(p, v.cpu())
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}[q.dtype]
    assert mean.dtype == q.dtype and var.dtype == q.dtype
    torch.testing.assert_close(mean.cpu().double(), rm, rtol=tol, atol=tol)
    torch.testing.assert_close(var.cpu().double(), rv, rtol=tol, atol=tol)


@OVERFLOW_OK
def test_triton_moments_agree_with_torch_path() -> None:
    """The Triton moments and the torch path of ``attention_moments`` (on CPU copies of the
    same inputs), to float32 rounding."""
    (q, k, v), kw = _case("additive-mask")
    mt, vt = _triton.attention_moments(q, k, v, **kw)  # type: ignore[arg-type]
    mask = kw.pop("attn_mask")
    mc, vc = attention_moments(q.cpu(), k.cpu(), v.cpu(), attn_mask=mask.cpu(), **kw)  # type: ignore[union-attr, arg-type]
    torch.testing.assert_close(mt.cpu(), mc, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vt.cpu(), vc, rtol=1e-5, atol=1e-5)


def test_triton_strided_inputs_give_the_same_draws() -> None:
    """Hugging Face's layout (``(B, L, H, D)`` memory seen as ``(B, H, L, D)``) and a
    non-contiguous mask give the draws and output of contiguous copies (the kernel reads
    strides; the same kernel on the same values, so bit for bit), and their moments."""
    g = torch.Generator().manual_seed(11)
    shapes = ((8, 8), (LK, 8), (LK, 4))
    qt, kt, vt = (torch.randn(1, n, 2, d, generator=g).to(DEV) for n, d in shapes)
    q, k, v = (t.transpose(1, 2) for t in (qt, kt, vt))  # (1, 2, L, D) views
    assert not q.is_contiguous()
    mask = (torch.rand(1, 2, LK, 8, generator=g) < 0.7).to(DEV).transpose(-1, -2)
    mask[..., 0] = True
    a = _triton.sampled_attention(q, k, v, nu=8, attn_mask=mask, generator=_gen(2))
    b = _triton.sampled_attention(q.contiguous(), k.contiguous(), v.contiguous(), nu=8,
                                  attn_mask=mask.contiguous(), generator=_gen(2))
    assert torch.equal(a, b)
    ma, va = _triton.attention_moments(q, k, v, attn_mask=mask)
    mb, vb = _triton.attention_moments(q.contiguous(), k.contiguous(), v.contiguous(),
                                       attn_mask=mask.contiguous())
    # the moments centre the values on torch's mean over keys, whose summation order depends
    # on the layout: equal to float32 rounding, not bit for bit
    torch.testing.assert_close(ma, mb, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(va, vb, rtol=1e-6, atol=1e-6)


def test_triton_memory_budget(monkeypatch) -> None:
    """A call whose indices and output exceed ``$ATTNUQ_MAX_BYTES`` is refused before anything
    is allocated, naming the bytes it needs."""
    q, k, v = _inputs()
    monkeypatch.setenv("ATTNUQ_MAX_BYTES", "1000")
    # 16 rows * (4 * 64 + 4 * 4 + 2) = 4,384 bytes
    with pytest.raises(ValueError, match=r"nu=64 needs about 4,384 bytes.*budget of 1,000"):
        _triton.sampled_attention(q, k, v, nu=64)


def test_triton_empty_rows() -> None:
    """A query with every key masked: ``empty_rows='error'`` names it, ``'zero'`` gives zeros
    (sampler and moments), the other rows are untouched."""
    q, k, v = _inputs(lq=4)
    mask = torch.ones(1, 2, 4, LK, dtype=torch.bool, device=DEV)
    mask[0, 1, 2] = False
    msg = r"1 query row\(s\) have every key masked.*head 1, query 2"
    with pytest.raises(ValueError, match=msg):
        _triton.sampled_attention(q, k, v, nu=4, attn_mask=mask, generator=_gen(0))
    with pytest.raises(ValueError, match=r"head 1, query 2"):
        _triton.attention_moments(q, k, v, attn_mask=mask)
    y = _triton.sampled_attention(q, k, v, nu=4, attn_mask=mask, generator=_gen(0),
                                  empty_rows="zero")
    assert torch.all(y[0, 1, 2] == 0) and bool((y[0, 0] != 0).any())
    m, s2 = _triton.attention_moments(q, k, v, attn_mask=mask, empty_rows="zero")
    assert torch.all(m[0, 1, 2] == 0) and torch.all(s2[0, 1, 2] == 0)
    _, empty = _triton.sample_indices(q, k, v, nu=4, attn_mask=mask, generator=_gen(0))
    assert empty.tolist() == mask.any(-1).logical_not().tolist()


def test_triton_bad_input_messages() -> None:
    """Bad values are refused with messages naming them (the checks of the public operators)."""
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="nu"):
        _triton.sampled_attention(q, k, v, nu=0)
    with pytest.raises(ValueError, match="empty_rows"):
        _triton.attention_moments(q, k, v, empty_rows="drop")
    with pytest.raises(TypeError, match="float64"):
        _triton.sampled_attention(q.double(), k.double(), v.double(), nu=2)
    bad = q.clone()
    bad[0, 0, 0, 0] = math.nan
    with pytest.raises(ValueError, match="q"):
        _triton.sampled_attention(bad, k, v, nu=2)


def _private(g: torch.Generator) -> torch.Generator:
    """The generator the public operators hand to the kernel (:mod:`attnuq.ops._rng`): one seed
    drawn from the caller's ``g`` seeds a private generator on the same device."""
    return _rng.generator_from_seed(_rng.draw_seed(g, g.device), g.device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_triton_cuda_dispatch() -> None:
    """CUDA tensors take the Triton kernels in the public operators (same generator state: the
    same output as the Triton function; the same kernel on the same inputs), float64 and a
    gradient for ``v`` take the torch path."""
    q, k, v = (t.cuda() for t in _inputs(dtype=torch.float32))
    g1 = torch.Generator(device="cuda").manual_seed(9)
    g2 = torch.Generator(device="cuda").manual_seed(9)
    y = sampled_attention(q, k, v, nu=8, is_causal=True, generator=g1)
    ref = _triton.sampled_attention(q, k, v, nu=8, is_causal=True, generator=_private(g2))
    assert torch.equal(y, ref)
    mean, var = attention_moments(q, k, v, is_causal=True)
    mt, vt = _triton.attention_moments(q, k, v, is_causal=True)
    assert torch.equal(mean, mt) and torch.equal(var, vt)
    assert _triton.usable(q, needs_grad=False) and not _triton.usable(q, needs_grad=True)
    assert not _triton.usable(q.double(), needs_grad=False)
    vg = v.clone().requires_grad_(True)
    sampled_attention(q, k, vg, nu=8, generator=g1).sum().backward()  # torch path, differentiable
    assert vg.grad is not None


def test_public_operators_pass_their_arguments_to_the_triton_entries(monkeypatch) -> None:
    """Where the public operators take the Triton path (forced here with ``usable``, so that
    the wiring is also checked under the interpreter), they pass every argument through: the
    same output as the Triton functions called directly with the same (non-default) options."""
    monkeypatch.setattr(_triton, "usable", lambda q, needs_grad: True)
    q, k, v = _inputs(hq=2, hk=2, lq=6, seed=4)
    mask = torch.rand(1, 1, 6, LK, generator=torch.Generator().manual_seed(5)) > 0.3
    mask[..., 0] = True
    opts = {"attn_mask": mask.to(q.device), "is_causal": True, "scale": 0.3, "enable_gqa": False}
    g1 = torch.Generator(device=q.device).manual_seed(9)
    g2 = torch.Generator(device=q.device).manual_seed(9)
    y = sampled_attention(q, k, v, nu=5, generator=g1, empty_rows="zero", **opts)
    ref = _triton.sampled_attention(q, k, v, nu=5, generator=_private(g2), empty_rows="zero",
                                    **opts)
    assert torch.equal(y, ref)
    plain = _triton.sampled_attention(q, k, v, nu=5, generator=_private(g2.manual_seed(9)))
    assert not torch.equal(y, plain)  # the options changed the output: they were not dropped
    mean, var = attention_moments(q, k, v, empty_rows="zero", **opts)
    mt, vt = _triton.attention_moments(q, k, v, empty_rows="zero", **opts)
    assert torch.equal(mean, mt) and torch.equal(var, vt)


def test_triton_kernels_compile_for_sm90(tmp_path) -> None:
    """The kernels go through triton's compiler down to a cubin for sm_90 (no GPU needed; the
    interpreter checks none of this): bfloat16 with a boolean mask and float32 with an additive
    one, causal, at the launch shapes of ``attnuq.ops._triton``, and Levy's float32
    ``flash_lse`` kernel (a subprocess without ``TRITON_INTERPRET``, a fresh triton cache)."""
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    script = Path(__file__).with_name("_triton_aot.py")
    res = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env,
        check=False,
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    lines = res.stdout.split("\n")
    assert sum(line.startswith("ok ") for line in lines) == 7, res.stdout


def test_triton_package_imports_without_triton() -> None:
    """``import attnuq`` does not import triton, and the CPU operators run when triton cannot be
    imported at all (a subprocess whose import of triton fails)."""
    code = (
        "import sys\n"
        "import torch, attnuq\n"
        "from attnuq.ops import _triton, sampled_attention\n"
        "assert 'triton' not in sys.modules, 'import attnuq imported triton'\n"
        "sys.modules['triton'] = None  # from here on, import triton raises ImportError\n"
        "q = torch.randn(1, 2, 5, 4)\n"
        "y = sampled_attention(q, q, q, nu=3)\n"
        "assert not _triton.available() and not _triton.usable(q, needs_grad=False)\n"
        "print('ok', tuple(y.shape))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "ok (1, 2, 5, 4)"


def test_triton_flash_lse_matches_torch() -> None:
    """``flash_lse`` (Levy attention's CUDA inference kernel) against softmax in float64: output
    and log-sum-exp with a per-key bias holding ``-1e4`` (weight 0) and, for one series, only
    ``-inf`` (zero row, ``lse = -inf``); float32 rounding."""
    g = torch.Generator().manual_seed(21)
    b, h, lq, lk, d, dv = 2, 2, 5, LK, 8, 6
    q, k, v = (torch.randn(b, h, n, w, generator=g) for n, w in ((lq, d), (lk, d), (lk, dv)))
    bias = torch.where(torch.rand(b, lk, generator=g) < 0.7, 0.0, -1e4)
    bias[1] = -math.inf
    out, lse = _triton.flash_lse(q.to(DEV), k.to(DEV), v.to(DEV), bias.to(DEV))
    s = (q.double() @ k.double().transpose(-1, -2)) + bias.double()[:, None, None, :]
    ref_lse = torch.logsumexp(s, -1)
    p = torch.softmax(s[:1], -1)
    torch.testing.assert_close(out.cpu()[:1].double(), p @ v[:1].double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.cpu()[:1].double(), ref_lse[:1], rtol=1e-5, atol=1e-5)
    assert torch.all(out.cpu()[1] == 0) and torch.all(lse.cpu()[1] == -math.inf)
    with pytest.raises(ValueError, match="key_bias must be"):
        _triton.flash_lse(q.to(DEV), k.to(DEV), v.to(DEV), bias[:, :3].to(DEV))


def test_triton_levy_forward_through_the_kernel(monkeypatch) -> None:
    """Levy attention's fused inference backend with the Triton kernel in place of torch's CPU
    flash kernel (what CUDA float32 runs) gives the same result to float32 rounding."""
    if DEV != "cpu":
        pytest.skip("swaps the CPU flash kernel; on CUDA test_triton_levy_cuda_dispatch runs")
    from attnuq.ops import levy as levy_mod

    g = torch.Generator().manual_seed(5)
    b, h, nq, n, e, dv = 2, 2, 6, 45, 8, 4
    q, k = torch.randn(b, h, nq, e, generator=g), torch.randn(b, h, n, e, generator=g)
    a = torch.randn(b, h, n, dv, generator=g)
    times = torch.rand(b, n, generator=g) * 10
    mask = torch.rand(b, n, generator=g) < 0.8
    kw = {"alpha": 2.0, "beta": 3.0, "h": 0.1, "backend": "sdpa"}
    with torch.no_grad():
        ref = levy_mod.levy_attention(q, k, a, times, mask, **kw)  # type: ignore[arg-type]
        monkeypatch.setattr(levy_mod, "_FLASH", _triton._flash_like)
        got = levy_mod.levy_attention(q, k, a, times, mask, **kw)  # type: ignore[arg-type]
    for name in ("mean", "var", "evidence", "sigma"):
        torch.testing.assert_close(getattr(got, name), getattr(ref, name), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_triton_levy_cuda_dispatch() -> None:
    """On CUDA, float32 Levy attention without autograd takes the Triton kernel and agrees
    with the CPU result to float32 rounding."""
    from attnuq.ops.levy import levy_attention

    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 2, 6, 8, generator=g), torch.randn(2, 2, 45, 8, generator=g)
    a = torch.randn(2, 2, 45, 4, generator=g)
    times, mask = torch.rand(2, 45, generator=g) * 10, torch.rand(2, 45, generator=g) < 0.8
    kw = {"alpha": 2.0, "beta": 3.0, "h": 0.1, "backend": "sdpa"}
    assert _triton.levy_flash(False, q.cuda()) is not None
    with torch.no_grad():
        ref = levy_attention(q, k, a, times, mask, **kw)  # type: ignore[arg-type]
        got = levy_attention(q.cuda(), k.cuda(), a.cuda(), times.cuda(), mask.cuda(), **kw)  # type: ignore[arg-type]
    for name in ("mean", "var", "evidence", "sigma"):
        torch.testing.assert_close(getattr(got, name).cpu(), getattr(ref, name), rtol=1e-4,
                                   atol=1e-4)
