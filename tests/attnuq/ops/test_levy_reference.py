"""Every execution strategy of Levy attention against the plain-torch reference
(:func:`attnuq.ops.levy.levy_attention_reference`, the formulas of docs/methods.md) in float64:
all seven outputs and the gradients of every input.

Each strategy is forced by leaving it alone in the dispatcher's table (``STRATEGIES``) and
calling its backend; a counter proves it ran. The reference forms ``E v^2 - mu^2`` directly
and the value field's covariance from ``E[g g^T] - m m^T``; the strategies centre the values
and use a cancellation-free covariance, so they agree to float64 rounding amplified by that
cancellation (values of order 1: ``1e-10``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tests.attnuq.ops._reference_levy import ref_levy
from tests.attnuq.ops.test_levy import FIELDS, make_problem

from attnuq.ops import _native, levy_attention
from attnuq.ops.levy import STRATEGIES, _common, _dispatch, levy_attention_reference

TOL = {"rtol": 1e-9, "atol": 1e-10}
# strategies that differentiate (the compiled kernel and the lse inference path do not)
GRAD = {"flash_grad", "sentinel", "explicit"}


def _problem(fourier: str, empty_series: bool) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
    args, kw = make_problem(B=3, H=2, Q=4, N=9, E=4, Dv=5, K=3, fourier=fourier != "none",
                            seed=7)
    if fourier == "shared":  # (K,) frequencies and phases, (Dv, K) loading: one set for all heads
        kw["omega"], kw["phase"], kw["D"] = kw["omega"][0], kw["phase"][0], kw["D"][0]
    if empty_series:
        args[4][2] = False  # series 2: nothing observed
    return args, kw


def _force(monkeypatch: pytest.MonkeyPatch, name: str, needs_grad: bool) -> list[int]:
    """Leave only strategy ``name`` in the table; returns a list that counts its runs."""
    (strategy,) = [s for s in STRATEGIES if s.name == name]
    ran: list[int] = []
    if name == "native":
        if not _native.available():
            pytest.skip(f"native kernels unavailable: {_native.status()['reason']}")
        real = _dispatch._native_forward
        monkeypatch.setattr(_dispatch, "_native_forward",
                            lambda *a: (ran.append(1), real(*a))[1])
        return ran
    if name == "triton":
        pytest.skip("the Triton strategy runs on CUDA only (tests/attnuq/ops/test_triton.py)")
    if name in ("flash", "flash_grad") and (_common._FLASH is None or _common._FLASH_BWD is None):
        pytest.fail("this torch build lacks the CPU flash-attention kernels")
    assert strategy.sums is not None
    real_sums = strategy.sums

    def counted(*a: Any) -> Any:
        ran.append(1)
        return real_sums(*a)

    monkeypatch.setattr(_dispatch, "STRATEGIES", (strategy._replace(sums=counted),))
    return ran


@pytest.mark.parametrize("empty_series", [False, True])
@pytest.mark.parametrize("fourier", ["none", "shared", "per_head"])
@pytest.mark.parametrize("per_dim", [True, False])
@pytest.mark.parametrize("name", [s.name for s in STRATEGIES])
def test_every_strategy_agrees_with_the_reference(
    monkeypatch: pytest.MonkeyPatch, name: str, per_dim: bool, fourier: str, empty_series: bool,
) -> None:
    args, kw = _problem(fourier, empty_series)
    with torch.no_grad():
        ref = levy_attention_reference(*args, **kw)
    needs_grad = name in GRAD
    ran = _force(monkeypatch, name, needs_grad)
    backend = next(s.backend for s in STRATEGIES if s.name == name)
    leaves = [t.clone().requires_grad_(needs_grad) for t in (*args[:4], *kw.values())]
    names = ["q", "k", "a", "times", *kw]
    inputs = dict(zip(names, leaves, strict=True))
    got = levy_attention(*leaves[:4], args[4], **{n: inputs[n] for n in kw},
                         per_dim=per_dim, backend=backend)
    assert ran, f"strategy {name} did not run"
    compared = [f for f in FIELDS if per_dim or f not in ("var", "sigma_dim")]
    for f in compared:
        torch.testing.assert_close(getattr(got, f), getattr(ref, f), **TOL, msg=f)
    if not needs_grad:
        return
    # gradients of a random weighting of every output, reference against strategy
    g = torch.Generator().manual_seed(1)
    weights = {f: torch.randn(getattr(ref, f).shape, generator=g, dtype=torch.float64)
               for f in compared}
    ref_leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    ref_in = dict(zip(names, ref_leaves, strict=True))
    ref_res = levy_attention_reference(*ref_leaves[:4], args[4], **{n: ref_in[n] for n in kw})

    def loss(res: Any) -> torch.Tensor:
        return sum((getattr(res, f) * w).sum() for f, w in weights.items())  # type: ignore[return-value]

    g_got = torch.autograd.grad(loss(got), leaves, allow_unused=True)
    g_ref = torch.autograd.grad(loss(ref_res), ref_leaves, allow_unused=True)
    for n, t, x, y in zip(names, leaves, g_got, g_ref, strict=True):
        # an input the outputs do not depend on (times and h without a value field) has no
        # gradient, or an exact 0 where a path multiplies it by 0
        x = torch.zeros_like(t) if x is None else x
        y = torch.zeros_like(t) if y is None else y
        torch.testing.assert_close(x, y, **TOL, msg=f"gradient of {n}")


def test_the_table_covers_every_backend() -> None:
    assert {s.backend for s in STRATEGIES} == {"native", "sdpa", "explicit"}
    assert [s.name for s in STRATEGIES] == [
        "native", "flash_grad", "triton", "flash", "sentinel", "explicit"]


@pytest.mark.parametrize("fourier", ["none", "shared", "per_head"])
def test_the_reference_is_the_definition(fourier: str) -> None:
    """The torch reference against the independent loop reference of
    tests/attnuq/ops/_reference_levy.py (numpy, explicit loops, the field's moments by 80-point
    Gauss-Hermite quadrature instead of the closed form): mean, diagonal covariance and
    evidence to 1e-10."""
    args, kw = _problem(fourier, empty_series=True)
    got = levy_attention_reference(*args, **kw)
    want = ref_levy(*args, **kw)
    torch.testing.assert_close(got.mean, torch.from_numpy(want["mean"]), **TOL)
    torch.testing.assert_close(got.evidence, torch.from_numpy(want["evidence"]), **TOL)
    var = torch.from_numpy(want["cov"]).diagonal(dim1=-2, dim2=-1)
    torch.testing.assert_close(got.var, var, **TOL)


def test_sdpa_inference_with_values_narrower_than_the_keys() -> None:
    """``backend="sdpa"`` without autograd, ``per_dim=False`` and ``Dv + 1 < E``: the flash
    strategy shares one buffer between keys and value rows, which needs the value rows at
    least as wide as the keys; such calls take the sentinel strategy (they raised an
    AssertionError before)."""
    args, kw = make_problem(E=8, Dv=3, fourier=True)
    with torch.no_grad():
        got = levy_attention(*args, **kw, per_dim=False, backend="sdpa")
        ref = levy_attention_reference(*args, **kw)
    for f in ("mean", "evidence", "phi", "sigma"):
        torch.testing.assert_close(getattr(got, f), getattr(ref, f), **TOL, msg=f)


@pytest.mark.parametrize("case", ["auto", "grad", "explicit", "no_observations", "native_off"])
def test_one_validation_per_call(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """The inputs are checked once, at the entry, whichever strategy runs (no second pass for
    the padding of ``N = 0`` or a compiled kernel that turns out not to run)."""
    calls: list[int] = []
    real = _dispatch._validate
    monkeypatch.setattr(_dispatch, "_validate",
                        lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    args, kw = make_problem()
    if case == "no_observations":  # N = 0: no observation at all
        args = (args[0], args[1][:, :, :0], args[2][:, :, :0], args[3][:, :0], args[4][:, :0])
    backend = "explicit" if case == "explicit" else "auto"
    if case == "native_off":
        monkeypatch.setattr(_dispatch, "_native_unusable", lambda q, needs_grad: "switched off")
    q = args[0].clone().requires_grad_(case == "grad")
    levy_attention(q, *args[1:], **kw, backend=backend)
    assert len(calls) == 1
