"""One contract, every backend: each case in ``_patch_cases.CASES`` only builds a model.

Statistical tests fix their seeds; false-failure probabilities are stated where they are used.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _patch_cases import Case, case_params, to_dtype
from scipy import stats
from torch import nn

import attnuq
from attnuq.patching import find_attention, patch, stochastic

_MODELS: dict[str, nn.Module] = {}


def model_of(case: Case) -> nn.Module:
    """Build once per session (tests that change the model work on a deep copy)."""
    if case.name not in _MODELS:
        _MODELS[case.name] = case.build()
    return _MODELS[case.name]


def run(case: Case, m: nn.Module, inputs: dict[str, Any] | None = None) -> torch.Tensor:
    with torch.no_grad():
        return case.forward(m, case.batch() if inputs is None else inputs)


def valid(case: Case, out: torch.Tensor) -> torch.Tensor:
    """Concatenate the valid parts of every example of a batch output (float32)."""
    return torch.cat(
        [case.example(out, i, i).float().reshape(-1) for i in range(case.batch_size)]
    )


# ------------------------------------------------------------------------------------------------
# state snapshots
# ------------------------------------------------------------------------------------------------
def _hf_registries() -> dict[str, dict[str, Any]]:
    # transformers is installed (the hf cases need it): a failed import fails, never {}
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    return {
        "attn": dict(AttentionInterface._global_mapping),
        "mask": dict(AttentionMaskInterface._global_mapping),
    }


def snapshot(model: nn.Module) -> dict[str, Any]:
    mods = {}
    for name, m in model.named_modules():
        entries = {}
        for k, v in vars(m).items():
            if isinstance(v, dict):
                entries[k] = ("dict", dict(v))
            else:
                entries[k] = ("id", id(v), v if isinstance(v, (bool, int, float, str)) else None)
        mods[name] = (type(m), entries)
    configs = {}
    for name, m in model.named_modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "to_dict"):
            configs[name] = dict(vars(cfg))
    return {
        "state": {k: (v.dtype, v.detach().clone()) for k, v in model.state_dict().items()},
        "params": {k: id(p) for k, p in model.named_parameters()},
        "mods": mods,
        "configs": configs,
        "sdpa": F.scaled_dot_product_attention,
        "hf": _hf_registries(),
        "training": [m.training for m in model.modules()],
    }


def assert_same_state(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before["state"].keys() == after["state"].keys()
    for k, (dt, t) in before["state"].items():
        dt2, t2 = after["state"][k]
        assert dt == dt2 and torch.equal(t, t2), f"tensor {k} changed"
    assert before["params"] == after["params"], "parameter objects replaced"
    assert before["mods"].keys() == after["mods"].keys()
    for name, (cls, entries) in before["mods"].items():
        cls2, entries2 = after["mods"][name]
        assert cls is cls2, f"class of {name!r} changed"
        assert entries.keys() == entries2.keys(), (
            f"instance attributes of {name!r} changed: {entries.keys() ^ entries2.keys()}"
        )
        for k, v in entries.items():
            assert v == entries2[k], f"{name!r}.{k} changed"
    for name, d in before["configs"].items():
        assert d == after["configs"][name], f"config of {name!r} changed"
    assert before["sdpa"] is after["sdpa"] is F.scaled_dot_product_attention
    assert before["hf"] == after["hf"], "HF attention registries changed"
    assert before["training"] == after["training"]


# ------------------------------------------------------------------------------------------------
# the contract
# ------------------------------------------------------------------------------------------------
pytestmark = pytest.mark.parametrize("case", case_params())


def test_find_attention_names_the_backend(case: Case) -> None:
    sites = find_attention(model_of(case))
    ok = [s for s in sites if s.patchable]
    assert len(ok) >= 1, sites
    assert {s.backend for s in ok} == {case.backend}


def test_state_bit_identical_after_block(case: Case) -> None:
    m = model_of(case)
    before = snapshot(m)
    with stochastic(m, nu=1, seed=0) as h:
        assert h.active
        run(case, m)
    assert_same_state(before, snapshot(m))


def test_state_restored_when_exception_escapes(case: Case) -> None:
    m = model_of(case)
    before = snapshot(m)
    with pytest.raises(KeyError, match="boom"), stochastic(m, nu=1, seed=0):
        run(case, m)
        raise KeyError("boom")
    assert_same_state(before, snapshot(m))
    # an exception raised inside the model's forward, after a patched attention has run
    last = [s for s in find_attention(m) if s.patchable][-1]

    def boom(mod: nn.Module, args: Any, out: Any) -> None:
        raise RuntimeError("boom in forward")

    hook = m.get_submodule(last.name).register_forward_hook(boom)
    try:
        before = snapshot(m)
        with pytest.raises(RuntimeError, match="boom in forward"), stochastic(m, nu=1, seed=0):
            run(case, m)
        assert_same_state(before, snapshot(m))
    finally:
        hook.remove()
    from attnuq.patching import sdpa

    assert sdpa._stack() == []


def test_nu_none_reproduces_frozen(case: Case) -> None:
    m = model_of(case)
    y0 = run(case, m)
    with stochastic(m, nu=None, seed=0):
        y = run(case, m)
    torch.testing.assert_close(valid(case, y), valid(case, y0), rtol=1e-5, atol=1e-5)


def test_per_head_none_goes_through_adapter_exactly(case: Case) -> None:
    """Every head deterministic (per-head nu all None) runs each backend's own replacement code
    with the genuine SDPA kernel: it must reproduce the frozen model to float rounding."""
    m = model_of(case)
    sites = [s for s in find_attention(m) if s.patchable]
    heads = {s.name: s.num_heads or case.extra.get("heads") for s in sites}
    y0 = run(case, m)
    nu = {name: (None,) * h for name, h in heads.items()}
    with stochastic(m, nu=nu, seed=0):
        y = run(case, m)
    torch.testing.assert_close(valid(case, y), valid(case, y0), rtol=1e-4, atol=1e-5)


def test_large_nu_converges_to_frozen(case: Case) -> None:
    """Mean absolute deviation from the frozen output shrinks like 1/sqrt(nu): 16 -> 4096 should
    divide it by ~16; we ask for a factor 6, and a relative deviation below 5 % at nu=4096."""
    m = model_of(case)
    y0 = valid(case, run(case, m))
    err = {}
    for nu in (16, 4096):
        with stochastic(m, nu=nu, seed=0):
            err[nu] = (valid(case, run(case, m)) - y0).abs().mean().item()
    scale = y0.abs().mean().item()
    assert err[16] > 0
    assert err[4096] < err[16] / 6, err
    assert err[4096] < 0.05 * scale, (err, scale)


def test_nu1_passes_differ_and_seed_reproduces(case: Case) -> None:
    m = model_of(case)
    with stochastic(m, nu=1, seed=0):
        a = run(case, m)
        b = run(case, m)
    with stochastic(m, nu=1, seed=0):
        a2 = run(case, m)
    with stochastic(m, nu=1, seed=1):
        c = run(case, m)
    assert not torch.equal(valid(case, a), valid(case, b))
    assert torch.equal(a, a2)
    assert not torch.equal(valid(case, a), valid(case, c))


def replicate(inputs: dict[str, Any], reps: int) -> dict[str, Any]:
    """Stack ``reps`` copies of a batch along the batch dim (row ``r * B + i`` is example i)."""
    out: dict[str, Any] = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.repeat(reps, *[1] * (v.dim() - 1))
        elif isinstance(v, list):
            out[k] = v * reps
        else:
            out[k] = v
    return out


def test_batch_matches_one_at_a_time_in_distribution(case: Case) -> None:
    """Per example, a fixed random projection of its output is drawn S=200 times in the batch
    (the batch, padding included, stacked 200 times: every row gets its own draws) and S times
    alone (the example without padding, stacked 200 times), with independent seeds; a two-sample
    Kolmogorov-Smirnov test compares the two. Each test has size 1e-4; with at most 3 examples
    per case and 16 cases the chance of any false failure is below 16 * 3 * 1e-4 = 0.5 %."""
    m = model_of(case)
    reps, b = 200, case.batch_size
    y0 = run(case, m)
    dirs = [
        torch.randn(case.example(y0, i, i).shape, generator=torch.Generator().manual_seed(i))
        for i in range(b)
    ]
    with stochastic(m, nu=2, seed=1):
        yb = run(case, m, replicate(case.batch(), reps))
    with stochastic(m, nu=2, seed=2):
        ys = [run(case, m, replicate(case.single(i), reps)) for i in range(b)]
    for i in range(b):
        in_batch = [
            float((case.example(yb, r * b + i, i).float() * dirs[i]).sum()) for r in range(reps)
        ]
        alone = [
            float((case.example(ys[i], r, i).float() * dirs[i]).sum())
            for r in range(reps)
        ]
        res = stats.ks_2samp(in_batch, alone)
        assert res.pvalue > 1e-4, (i, res)
        assert len(set(in_batch)) > reps // 2 and len(set(alone)) > reps // 2  # not one draw


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "grad"])
def test_grad_modes(case: Case, mode: str) -> None:
    m = model_of(case)
    y0 = run(case, m)
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode)
    with stochastic(m, nu=1, seed=0):
        if ctx is None:
            y = case.forward(m, case.batch())
        else:
            with ctx():
                y = case.forward(m, case.batch())
    assert y.shape == y0.shape and bool(torch.isfinite(valid(case, y)).all())
    assert not torch.equal(valid(case, y), valid(case, y0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_dtypes(case: Case, dtype: torch.dtype) -> None:
    """Every case runs in bfloat16 and float64 (none is excluded: each frozen model runs in both
    dtypes, so a failure here is a failure, never a skip)."""
    m = copy.deepcopy(model_of(case)).to(dtype)
    xb = to_dtype(case.batch(), dtype)
    y0 = run(case, m, xb)
    with stochastic(m, nu=4, seed=0):
        y4 = run(case, m, xb)
    with stochastic(m, nu=4096, seed=0):
        y_big = run(case, m, xb)
    assert y4.dtype == y0.dtype
    e4 = (valid(case, y4) - valid(case, y0)).abs().mean()
    e_big = (valid(case, y_big) - valid(case, y0)).abs().mean()
    assert bool(torch.isfinite(valid(case, y4)).all())
    # 1/sqrt(nu) predicts a factor 32 between nu=4 and 4096; bf16 rounding adds a floor
    assert e_big < e4 / 4, (e4, e_big)


def test_survives_eval_to_dtype_and_pickle(case: Case) -> None:
    m = copy.deepcopy(model_of(case))
    y0 = run(case, m)
    with stochastic(m, nu=1, seed=0):
        m.eval()
        m.to(torch.float64)
        y = run(case, m, to_dtype(case.batch(), torch.float64))
        assert y.dtype == torch.float64
        assert not torch.equal(valid(case, y), valid(case, y0).double())
    m.to(torch.float32)
    m2 = pickle.loads(pickle.dumps(m))
    torch.testing.assert_close(valid(case, run(case, m2)), valid(case, y0))


def test_nesting_is_refused_and_reentry_works(case: Case) -> None:
    m = model_of(case)
    block = stochastic(m, nu=1, seed=3)
    with block:
        a = run(case, m)
        with pytest.raises(RuntimeError, match="already patched"):
            patch(m, nu=2)
        with pytest.raises(RuntimeError, match="already active"):
            block.__enter__()
    with block:  # the same block object again, after it exited
        b = run(case, m)
    assert torch.equal(a, b)
    h = attnuq.patch(m, nu=1, seed=3)
    c = run(case, m)
    h.remove()
    h.remove()  # idempotent
    assert torch.equal(a, c)
