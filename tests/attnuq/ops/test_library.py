"""The operators as ``torch.library`` custom ops: opcheck, torch.compile, torch.export.

Randomness enters the ops as a seed tensor (``attnuq.ops._rng``): eager calls and compiled graphs
draw that seed from the same generator with the same ``torch.randint`` call, so the same
generator state gives the same draws. Compiled results are compared bit for bit with eager ones
under the ``aot_eager`` backend (the same ATen kernels run on the same inputs; tests/README.md);
every compile uses ``fullgraph=True``, so a graph break anywhere (the sampler included) fails.
The backends are ``eager`` / ``aot_eager`` (dynamo tracing, fake tensors, functionalisation and
the autograd graph) rather than Inductor, which takes tens of seconds per model on this machine
and re-rounds the other layers' float arithmetic.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import attnuq
from attnuq.nn.sampled import SampledAttention
from attnuq.ops import _rng, attention_moments, levy_attention, sampled_attention
from attnuq.ops.levy import _levy_op
from attnuq.ops.sampled import (
    _moments_op,
    _sample_indices,
    _sampled_op,
    sampled_attention_unchecked,
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _qkv(b=2, h=2, lq=5, lk=6, d=4, dtype=torch.float64, seed=0):
    g = _gen(seed)
    return (
        torch.randn(b, h, lq, d, generator=g, dtype=dtype),
        torch.randn(b, h, lk, d, generator=g, dtype=dtype),
        torch.randn(b, h, lk, d, generator=g, dtype=dtype),
    )


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- opcheck


@pytest.mark.parametrize(
    "case",
    ["plain", "grad_causal", "mask_blocked", "gqa_bool_mask"],
)
def test_opcheck_sampled_attention(case: str) -> None:
    q, k, v = _qkv()
    seed = torch.tensor(123)
    mask: torch.Tensor | None = None
    causal, scale, gqa, block = False, None, False, None
    if case == "grad_causal":
        v.requires_grad_(True)
        causal = True
    elif case == "mask_blocked":
        mask = torch.randn(5, 6, generator=_gen(1), dtype=q.dtype)
        v.requires_grad_(True)
        scale, block = 0.3, 2
    elif case == "gqa_bool_mask":
        q = torch.randn(2, 4, 5, 4, generator=_gen(2), dtype=q.dtype)
        mask = torch.rand(2, 1, 1, 6, generator=_gen(3)) > 0.3
        mask[..., 0] = True
        gqa = True
    v_grad = v.requires_grad
    torch.library.opcheck(
        _sampled_op, (q, k, v, mask, seed, 4, causal, scale, gqa, block, "error", v_grad)
    )


@pytest.mark.parametrize("block", [None, 3])
def test_opcheck_attention_moments(block: int | None) -> None:
    q, k, v = (t.requires_grad_(True) for t in _qkv())
    torch.library.opcheck(_moments_op, (q, k, v, None, True, None, False, block, "error"))


@pytest.mark.parametrize("per_dim", [True, False])
def test_opcheck_levy_attention(per_dim: bool) -> None:
    g = _gen(4)
    B, H, Q, N, E, Dv, K = 2, 3, 4, 7, 5, 3, 4
    mask = torch.rand(B, N, generator=g) > 0.3
    mask[:, 0] = True
    args = (
        torch.randn(B, H, Q, E, generator=g), torch.randn(B, H, N, E, generator=g),
        torch.randn(B, H, N, Dv, generator=g), torch.rand(B, N, generator=g) * 10, mask,
        torch.tensor(1.5), torch.tensor(3.0), torch.tensor(0.5), torch.rand(K, generator=g),
        torch.rand(K, generator=g), torch.randn(Dv, K, generator=g), per_dim, 256, "auto",
    )  # fmt: skip
    torch.library.opcheck(_levy_op, args)


def test_next_seed_op_draws_as_eager() -> None:
    """``attnuq::next_seed`` is impure by design (it advances a generator), so only the checks
    that do not compare two runs apply; the draw itself equals the eager one."""
    like = torch.zeros(3)
    torch.library.opcheck(
        torch.ops.attnuq.next_seed.default, (like, -1), test_utils=("test_schema",
                                                                    "test_faketensor"),
    )
    torch.manual_seed(11)
    a = int(torch.ops.attnuq.next_seed(like, -1))
    torch.manual_seed(11)
    assert a == _rng.draw_seed(None, like.device)

    class Pool:
        def __init__(self) -> None:
            self.g = _gen(5)

        def get(self, device: torch.device) -> torch.Generator:
            return self.g

    pool = Pool()
    key = _rng.register_source(pool)
    b = int(torch.ops.attnuq.next_seed(like, key))
    assert b == _rng.draw_seed(_gen(5), like.device)
    assert torch.ops.attnuq.next_seed.default._schema.name == "attnuq::next_seed"
    assert torch.Tag.nondeterministic_seeded in torch.ops.attnuq.next_seed.default.tags
    with pytest.raises(ValueError, match="no generator source is registered under key 0"):
        _rng.resolve(0, like.device)


# ----------------------------------------------------------------------------- eager == op


def test_op_equals_eager_path_with_gradient() -> None:
    """The op with the seed the eager path draws gives the eager output bit for bit (the same
    kernel on the same uniforms), and its backward (draws recomputed from the seed) the same
    gradient for ``v``; the eager draws are ``_sample_indices``' for the same state."""
    q, k, v = _qkv(lq=7, lk=9)
    v1 = v.clone().requires_grad_(True)
    y1 = sampled_attention(q, k, v1, nu=5, is_causal=True, generator=_gen(8))
    w = torch.randn(y1.shape, generator=_gen(9), dtype=y1.dtype)
    (g1,) = torch.autograd.grad((y1 * w).sum(), v1)
    v2 = v.clone().requires_grad_(True)
    seed = torch.tensor(_rng.draw_seed(_gen(8), q.device))
    y2 = _sampled_op(q, k, v2, None, seed, 5, True, None, False, None, "error", True)
    (g2,) = torch.autograd.grad((y2 * w).sum(), v2)
    assert torch.equal(y1, y2)
    torch.testing.assert_close(g2, g1, rtol=1e-12, atol=1e-12)
    # the gradient is the count of each key's draws / nu, weighted by w: check via the indices
    idx, _ = _sample_indices(q, k, v, nu=5, is_causal=True, generator=_gen(8))
    expect = torch.zeros_like(v)
    flat_w = w.unsqueeze(-2).expand(*idx.shape, w.shape[-1]) / 5  # (B, H, Lq, nu, Dv)
    expect.scatter_add_(2, idx.reshape(2, 2, -1, 1).expand(-1, -1, -1, v.shape[-1]),
                        flat_w.reshape(2, 2, -1, v.shape[-1]))
    torch.testing.assert_close(g1, expect, rtol=1e-12, atol=1e-12)


def test_moments_op_gradient_equals_eager() -> None:
    q, k, v = _qkv(lq=6, lk=8, seed=3)
    leaves1 = [t.clone().requires_grad_(True) for t in (q, k, v)]
    leaves2 = [t.clone().requires_grad_(True) for t in (q, k, v)]
    m1, s1 = attention_moments(*leaves1, is_causal=True, block_size=3)
    m2, s2 = _moments_op(*leaves2, None, True, None, False, 3, "error")
    assert torch.equal(m1, m2) and torch.equal(s1, s2)
    gm = torch.randn(m1.shape, generator=_gen(1), dtype=m1.dtype)
    gs = torch.randn(s1.shape, generator=_gen(2), dtype=s1.dtype)
    r1 = torch.autograd.grad((m1 * gm + s1 * gs).sum(), leaves1)
    r2 = torch.autograd.grad((m2 * gm + s2 * gs).sum(), leaves2)
    for a, b in zip(r1, r2, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- torch.compile


def _encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()


@pytest.mark.parametrize("seed", [0, None])
def test_compile_fullgraph_patched_mha_same_samples(seed: int | None) -> None:
    """A patched nn.TransformerEncoder compiles with fullgraph=True and, from the same generator
    state (the handle's, or the global one), gives the eager samples bit for bit; the handle
    still counts the calls. A second compiled call draws anew (different output)."""
    enc = _encoder()
    x = torch.randn(3, 7, 16, generator=_gen(1))
    h = attnuq.patch(enc, nu=4, seed=seed)

    def reseed() -> None:
        if seed is None:
            torch.manual_seed(5)
        else:
            h.manual_seed(5)

    compiled = torch.compile(enc, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        reseed()
        eager = enc(x)
        reseed()
        first = compiled(x)
        second = compiled(x)
    assert torch.equal(first, eager)
    assert not torch.equal(second, first)
    assert h.calls == {"layers.0.self_attn": 3}
    h.remove()


def _ft_transformer() -> nn.Module:
    """The harness's small FT-Transformer (rtdl), in eval mode; skips without the harness."""
    ft = pytest.importorskip("attnuq_bench.models.ft", reason="needs the harness attnuq-bench")
    return ft.make_ft_transformer(4, n_blocks=1, seed=0).eval()


def test_compile_fullgraph_ft_transformer_same_samples() -> None:
    ft = _ft_transformer()
    x = torch.randn(5, 4, generator=_gen(2))
    h = attnuq.patch(ft, nu=3, seed=7)
    compiled = torch.compile(ft, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        h.manual_seed(1)
        eager = ft(x)
        h.manual_seed(1)
        got = compiled(x)
    assert torch.equal(got, eager)
    h.remove()


def test_compile_fullgraph_sampled_backward() -> None:
    """Training through the op under compile: the gradient for ``v`` equals eager's."""
    q, k, v = _qkv(lq=6, lk=6, dtype=torch.float32, seed=4)

    def loss(v: torch.Tensor) -> torch.Tensor:
        return (sampled_attention(q, k, v, nu=6, is_causal=True) ** 2).sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    v1 = v.clone().requires_grad_(True)
    torch.manual_seed(3)
    (g1,) = torch.autograd.grad(loss(v1), v1)
    v2 = v.clone().requires_grad_(True)
    torch.manual_seed(3)
    (g2,) = torch.autograd.grad(compiled(v2), v2)
    torch.testing.assert_close(g2, g1, rtol=1e-6, atol=1e-6)


def test_compile_fullgraph_moments_module_and_levy() -> None:
    """``SampledAttention(stochastic=False)`` (the moments op) and the Levy inference forward
    compile without a graph break and give the eager numbers."""
    q, k, v = _qkv(dtype=torch.float32, seed=6)
    layer = SampledAttention(nu=4, stochastic=False)
    got = torch.compile(layer, fullgraph=True, backend="aot_eager")(q, k, v, is_causal=True)
    assert torch.equal(got, layer(q, k, v, is_causal=True))

    g = _gen(7)
    B, H, Q, N, E, Dv, K = 2, 2, 3, 6, 4, 3, 5
    omega, phase, D = torch.rand(K, generator=g), torch.rand(K, generator=g), torch.randn(Dv, K)
    data = (torch.randn(B, H, Q, E, generator=g), torch.randn(B, H, N, E, generator=g),
            torch.randn(B, H, N, Dv, generator=g), torch.rand(B, N, generator=g) * 9,
            torch.ones(B, N, dtype=torch.bool))

    def f(q, k, a, t, m):
        r = levy_attention(q, k, a, t, m, alpha=1.0, beta=3.0, h=0.5, omega=omega, phase=phase,
                           D=D)
        return r.mean, r.var, r.sigma

    with torch.no_grad():
        eager = f(*data)
        got2 = torch.compile(f, fullgraph=True, backend="aot_eager")(*data)
    for a, b in zip(eager, got2, strict=True):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- torch.export


def test_export_round_trip_patched_model() -> None:
    """torch.export of a patched model (global RNG: the program does not depend on this
    process's generator registry) keeps the ops as nodes, survives save/load, and the loaded
    program gives the eager samples from the same global generator state."""
    ft = _ft_transformer()
    x = torch.randn(5, 4, generator=_gen(3))
    h = attnuq.patch(ft, nu=3)
    with torch.no_grad():
        ep = torch.export.export(ft, (x,))
        buf = io.BytesIO()
        torch.export.save(ep, buf)
        buf.seek(0)
        loaded = torch.export.load(buf)
        targets = {str(n.target) for n in loaded.graph.nodes}
        assert "attnuq.sampled_attention.default" in targets
        assert "attnuq.next_seed.default" in targets
        torch.manual_seed(21)
        eager = ft(x)
        torch.manual_seed(21)
        got = loaded.module()(x)
    assert torch.equal(got, eager)
    h.remove()


def test_traced_call_with_generator_object_is_refused() -> None:
    """Inside a compiled graph a torch.Generator cannot be used: the message says what to
    pass instead (the patcher passes a registered key)."""
    q, k, v = _qkv(dtype=torch.float32)

    def f(q, k, v):
        return sampled_attention_unchecked(q, k, v, 2, None, False, None, False, None, G,
                                           "error")

    G = _gen(0)
    with pytest.raises(Exception, match="Generator"):
        torch.compile(f, fullgraph=True, backend="eager")(q, k, v)
