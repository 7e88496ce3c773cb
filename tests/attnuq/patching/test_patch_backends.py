"""Backend-specific and API checks of ``attnuq.patching`` (the shared contract is in
``test_patch_contract.py``)."""

from __future__ import annotations

import sys
import threading
import types

import pytest
import torch
import torch.nn.functional as F
from _patch_cases import SDPANet, bert_case, rtdl_case
from torch import nn

import attnuq
from attnuq.ops import attention_moments
from attnuq.patching import find_attention, patch, stochastic

# ------------------------------------------------------------------------------------------------
# API: nu resolution and validation
# ------------------------------------------------------------------------------------------------
_BERT = bert_case()


@pytest.fixture(scope="module")
def bert() -> nn.Module:
    return _BERT.build()


def _mha(**kw: object) -> nn.MultiheadAttention:
    torch.manual_seed(0)
    return nn.MultiheadAttention(8, 2, **kw).eval()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("nu", "exc", "msg"),
    [
        (0, ValueError, "nu=0"),
        (-3, ValueError, "nu=-3"),
        (True, TypeError, "nu=True"),
        (1.5, TypeError, "nu=1.5"),
        ("4", TypeError, "nu='4'"),
        ({}, ValueError, "empty"),
        ({"nope.*": 2}, ValueError, "match no attention site"),
        ({"*": 0}, ValueError, "nu=0"),
        ((1, 2, 3), ValueError, "3 entries but it has 2 heads"),
        ((1, 0), ValueError, "head 1"),
        ([], ValueError, "empty"),
    ],
)
def test_bad_nu_is_named(nu: object, exc: type, msg: str) -> None:
    with pytest.raises(exc, match=msg):
        patch(_mha(batch_first=True), nu=nu)  # type: ignore[arg-type]


def test_bad_seed_and_model() -> None:
    with pytest.raises(TypeError, match=r"seed=1\.5"):
        patch(_mha(), nu=2, seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        patch("model", nu=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        find_attention(3)  # type: ignore[arg-type]


def test_mapping_first_match_wins(bert: nn.Module) -> None:
    names = [s.name for s in find_attention(bert)]
    assert names == ["encoder.layer.0.attention.self", "encoder.layer.1.attention.self"]
    with patch(bert, nu={"encoder.layer.0.*": 3, "encoder.layer.*": 5}) as h:
        assert h.nus == {names[0]: 3, names[1]: 5}
    with patch(bert, nu={"encoder.layer.1.*": 7}) as h:  # unmatched sites stay deterministic
        assert h.nus == {names[0]: None, names[1]: 7}
    # "*" first swallows every site, so the second pattern matches nothing: an error, not silence
    with pytest.raises(ValueError, match=r"\['encoder.layer.0.\*'\] match no"):
        patch(bert, nu={"*": 2, "encoder.layer.0.*": 3})


def test_per_layer_nu_changes_only_that_layer(bert: nn.Module) -> None:
    x = _BERT.batch()
    with torch.no_grad():
        y0 = bert(**x).last_hidden_state
        with stochastic(bert, nu={"encoder.layer.1.*": 1}, seed=0):
            hs = bert(**x, output_hidden_states=True).hidden_states
        ref = bert(**x, output_hidden_states=True).hidden_states
    # layer 0's output (hidden_states[1]) is untouched; the final one is not
    torch.testing.assert_close(hs[1], ref[1], rtol=0, atol=1e-6)
    assert not torch.allclose(hs[2], y0, atol=1e-4)


def test_per_head_nu_only_perturbs_its_head() -> None:
    m = _mha(batch_first=True)
    with torch.no_grad():
        m.out_proj.weight.copy_(torch.eye(8))
        m.out_proj.bias.zero_()
    x = torch.randn(3, 5, 8)
    y0 = m(x, x, x, need_weights=False)[0]
    with stochastic(m, nu=(1, None), seed=0):
        y = m(x, x, x, need_weights=False)[0]
    # head 1 (output coords 4..7) is exactly deterministic; head 0 (coords 0..3) is sampled
    torch.testing.assert_close(y[..., 4:], y0[..., 4:], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(y[..., :4], y0[..., :4], atol=1e-3)


# ------------------------------------------------------------------------------------------------
# nothing patchable
# ------------------------------------------------------------------------------------------------
class MyInlineAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v


def test_nothing_patchable_lists_what_was_found() -> None:
    with pytest.raises(ValueError, match=r"modules found: Sequential, Linear x2, ReLU"):
        patch(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)), nu=2)
    model = nn.Sequential(MyInlineAttention(), nn.ReLU())
    sites = find_attention(model)
    assert [(s.name, s.backend, s.patchable) for s in sites] == [("0", "none", False)]
    msg = r"unpatchable: 0 \(MyInlineAttention\): no attnuq backend"
    with pytest.raises(ValueError, match=msg):
        patch(model, nu=2)


def test_subclass_overriding_forward_is_reported() -> None:
    class MyMHA(nn.MultiheadAttention):
        def forward(self, *a, **k):  # type: ignore[no-untyped-def]
            return super().forward(*a, **k)

    sites = find_attention(nn.Sequential(MyMHA(8, 2)))
    assert len(sites) == 1 and not sites[0].patchable
    assert "overrides MultiheadAttention.forward" in str(sites[0].reason)


# ------------------------------------------------------------------------------------------------
# nn.MultiheadAttention: every call pattern goes through the adapter exactly
# ------------------------------------------------------------------------------------------------
MHA_VARIANTS = {
    "plain": ({}, {}),
    "kpm_bool": ({}, {"kpm": "bool"}),
    "kpm_float": ({}, {"kpm": "float"}),
    "mask2d_bool": ({}, {"mask": "2d_bool"}),
    "mask3d_float": ({}, {"mask": "3d_float"}),
    "causal": ({}, {"mask": "causal", "is_causal": True}),
    "mask_and_kpm": ({}, {"mask": "2d_bool", "kpm": "bool"}),
    "bias_kv": ({"add_bias_kv": True}, {"kpm": "bool", "mask": "2d_bool"}),
    "zero_attn": ({"add_zero_attn": True}, {"kpm": "bool"}),
    "kdim_vdim": ({"kdim": 6, "vdim": 5}, {"kpm": "bool"}),
    "no_bias": ({"bias": False}, {}),
    "unbatched": ({}, {"unbatched": True}),
}


def _mha_inputs(m: nn.MultiheadAttention, opts: dict[str, object], bf: bool) -> tuple:
    g = torch.Generator().manual_seed(4)
    b, lq, lk, heads = 3, 5, 6, m.num_heads
    q = torch.randn(b, lq, m.embed_dim, generator=g)
    k = torch.randn(b, lk, m.kdim, generator=g)
    v = torch.randn(b, lk, m.vdim, generator=g)
    kw: dict[str, object] = {}
    if opts.get("kpm") == "bool":
        kpm = torch.zeros(b, lk, dtype=torch.bool)
        kpm[0, 4:] = True
        kw["key_padding_mask"] = kpm
    elif opts.get("kpm") == "float":
        kpm_f = torch.zeros(b, lk)
        kpm_f[1, :2] = float("-inf")
        kpm_f[2] = -0.5
        kw["key_padding_mask"] = kpm_f
    if opts.get("mask") == "2d_bool":
        mk = torch.zeros(lq, lk, dtype=torch.bool)
        mk[0, 3:] = True
        kw["attn_mask"] = mk
    elif opts.get("mask") == "3d_float":
        kw["attn_mask"] = torch.randn(b * heads, lq, lk, generator=g)
    elif opts.get("mask") == "causal":
        q = k = v = q[:, :, :]
        kw["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(lq)
        kw["is_causal"] = True
    if opts.get("unbatched"):
        q, k, v = q[0], k[0], v[0]
    elif not bf:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    return (q, k, v), kw


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("variant", list(MHA_VARIANTS))
def test_mha_adapter_matches_torch(variant: str, batch_first: bool) -> None:
    ctor, opts = MHA_VARIANTS[variant]
    torch.manual_seed(0)
    m = nn.MultiheadAttention(8, 2, batch_first=batch_first, **ctor).eval()  # type: ignore[arg-type]
    args, kw = _mha_inputs(m, opts, batch_first)
    for avg in (True, False):
        with torch.no_grad():
            y0, w0 = m(*args, **kw, need_weights=True, average_attn_weights=avg)
            with stochastic(m, nu=(None, None)):
                y, w = m(*args, **kw, need_weights=True, average_attn_weights=avg)
            with stochastic(m, nu=3, seed=0):
                y3, w3 = m(*args, **kw, need_weights=True, average_attn_weights=avg)
        torch.testing.assert_close(y, y0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(w, w0, rtol=1e-5, atol=1e-6)
        assert y3.shape == y0.shape and w3.shape == w0.shape
        torch.testing.assert_close(w3, w0, rtol=1e-5, atol=1e-6)  # softmax weights, documented
        assert not torch.allclose(y3, y0)


def test_mha_output_moments_match_closed_form() -> None:
    """Mean and per-coordinate variance of the patched MHA output over S=2000 passes equal the
    closed forms mu and diag(Sigma_V)/nu (METHODS.md), checked at 5 standard errors each; SEs
    come from the sample (variance SE from the fourth central moment). With 3*5*8=120 coordinates
    x 2 statistics at 5 sigma (two-sided normal tail 5.7e-7) the false-failure chance is < 2e-4.
    """
    torch.manual_seed(0)
    m = nn.MultiheadAttention(8, 2, batch_first=True).eval().double()
    with torch.no_grad():
        m.out_proj.weight.copy_(torch.eye(8))
        m.out_proj.bias.zero_()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    nu, s = 3, 2000
    with torch.no_grad():
        wq, wk, wv = m.in_proj_weight.chunk(3)
        bq, bk, bv = m.in_proj_bias.chunk(3)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(3, 5, 2, 4).transpose(1, 2)

        q, k, v = heads(x @ wq.T + bq), heads(x @ wk.T + bk), heads(x @ wv.T + bv)
        mean, var = attention_moments(q, k, v)  # (B, H, L, D)
        mean = mean.transpose(1, 2).reshape(3, 5, 8)
        var = (var / nu).transpose(1, 2).reshape(3, 5, 8)
        xr = x.repeat(s, 1, 1)  # S copies in one batch: every row gets its own draws
        with stochastic(m, nu=nu, seed=0):
            ys = m(xr, xr, xr, need_weights=False)[0].view(s, 3, 5, 8)
    emp_mean, emp_var = ys.mean(0), ys.var(0)
    se_mean = (emp_var / s).sqrt()
    m4 = ((ys - emp_mean) ** 4).mean(0)
    se_var = ((m4 - emp_var**2).clamp_min(0) / s).sqrt()
    assert bool(((emp_mean - mean).abs() <= 5 * se_mean + 1e-6).all())
    assert bool(((emp_var - var).abs() <= 5 * se_var + 1e-6).all())


def test_mha_fully_masked_row_gives_zero_attention() -> None:
    m = _mha(batch_first=True)
    x = torch.randn(2, 4, 8)
    kpm = torch.zeros(2, 4, dtype=torch.bool)
    kpm[1] = True
    with torch.no_grad(), stochastic(m, nu=2, seed=0):
        y, w = m(x, x, x, key_padding_mask=kpm)
    assert bool(torch.isfinite(y).all())
    torch.testing.assert_close(y[1], m.out_proj.bias.expand(4, 8))
    assert bool((w[1] == 0).all())


def test_mha_training_mode_with_dropout_is_refused() -> None:
    m = nn.MultiheadAttention(8, 2, dropout=0.2, batch_first=True)
    x = torch.randn(1, 3, 8)
    with stochastic(m, nu=2), pytest.raises(RuntimeError, match=r"model.eval\(\)"):
        m(x, x, x)


def test_encoder_fast_path_is_disabled_and_restored() -> None:
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2).eval()
    assert enc.use_nested_tensor
    attn = enc.layers[0].self_attn
    with stochastic(enc, nu=2):
        assert enc.use_nested_tensor is False
        assert len(attn._forward_pre_hooks) == 1
        assert "forward" in vars(attn)
    assert enc.use_nested_tensor is True
    assert len(attn._forward_pre_hooks) == 0 and "forward" not in vars(attn)


def test_previous_instance_forward_is_put_back() -> None:
    m = _mha(batch_first=True)
    sentinel = m.forward  # a bound method stored as an instance attribute
    m.forward = sentinel  # type: ignore[method-assign]
    with stochastic(m, nu=2):
        assert m.forward is not sentinel
    assert vars(m)["forward"] is sentinel


# ------------------------------------------------------------------------------------------------
# rtdl
# ------------------------------------------------------------------------------------------------
def test_rtdl_training_mode_with_attention_dropout_is_refused() -> None:
    c = rtdl_case()
    m = c.build().train()
    with stochastic(m, nu=2), pytest.raises(RuntimeError, match="attention dropout"):
        c.forward(m, c.batch())


# ------------------------------------------------------------------------------------------------
# scoped F.scaled_dot_product_attention
# ------------------------------------------------------------------------------------------------
def test_sdpa_calls_outside_the_model_are_untouched() -> None:
    torch.manual_seed(0)
    net = SDPANet().eval()
    q = torch.randn(2, 2, 5, 4)
    orig = F.scaled_dot_product_attention
    ref = orig(q, q, q)
    seen: list[torch.Tensor] = []

    def other_thread() -> None:
        seen.append(F.scaled_dot_product_attention(q, q, q))

    with stochastic(net, nu=1, seed=0):
        assert F.scaled_dot_product_attention is not orig
        assert torch.equal(F.scaled_dot_product_attention(q, q, q), ref)
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        net(torch.randn(2, 5, 16))
    assert torch.equal(seen[0], ref)
    assert F.scaled_dot_product_attention is orig


def test_sdpa_imported_by_name_is_scoped_too() -> None:
    src = (
        "import torch\n"
        "from torch.nn.functional import scaled_dot_product_attention\n"
        "class NamedSDPA(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        q = x[:, None]\n"
        "        return scaled_dot_product_attention(q, q, q)[:, 0]\n"
    )
    mod = types.ModuleType("attnuq_test_named_sdpa")
    sys.modules[mod.__name__] = mod
    try:
        exec(compile(src, mod.__name__, "exec"), mod.__dict__)
        net = nn.Sequential(mod.NamedSDPA(), mod.NamedSDPA()).eval()
        x = torch.randn(2, 6, 4)
        y0 = net(x)
        orig = mod.scaled_dot_product_attention
        with stochastic(net, nu=1, seed=0):
            y = net(x)
        assert mod.scaled_dot_product_attention is orig is F.scaled_dot_product_attention
        assert not torch.allclose(y, y0)
    finally:
        del sys.modules[mod.__name__]


# ------------------------------------------------------------------------------------------------
# Hugging Face
# ------------------------------------------------------------------------------------------------
def test_hf_registry_and_config_switched_and_restored(bert: nn.Module) -> None:
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    from attnuq.patching.hf import IMPLEMENTATION

    before = bert.config._attn_implementation
    assert IMPLEMENTATION not in AttentionInterface._global_mapping
    with stochastic(bert, nu=2):
        assert bert.config._attn_implementation == IMPLEMENTATION
        assert IMPLEMENTATION in AttentionInterface._global_mapping
        assert IMPLEMENTATION in AttentionMaskInterface._global_mapping
    assert bert.config._attn_implementation == before
    assert IMPLEMENTATION not in AttentionInterface._global_mapping
    assert IMPLEMENTATION not in AttentionMaskInterface._global_mapping


def test_hf_eager_model_is_restored_to_eager() -> None:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, attn_implementation="eager")
    m = BertModel(cfg).eval()
    ids = torch.randint(0, 30, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, 4:] = 0
    with torch.no_grad():
        y0 = m(ids, attention_mask=mask).last_hidden_state
        with stochastic(m, nu=4096, seed=0):
            y = m(ids, attention_mask=mask).last_hidden_state
    assert m.config._attn_implementation == "eager"
    assert (y - y0)[1].abs().max() < 0.1 and (y - y0)[0, :4].abs().max() < 0.1


def test_hf_two_models_patched_at_once(bert: nn.Module) -> None:
    from transformers.modeling_utils import AttentionInterface

    from attnuq.patching.hf import IMPLEMENTATION

    other = _BERT.build()
    x = _BERT.batch()
    h1 = patch(bert, nu=1, seed=0)
    h2 = patch(other, nu=1, seed=0)
    h1.remove()
    assert IMPLEMENTATION in AttentionInterface._global_mapping  # still used by `other`
    with torch.no_grad():
        torch.testing.assert_close(bert(**x).last_hidden_state, bert(**x).last_hidden_state)
        a, b = other(**x).last_hidden_state, other(**x).last_hidden_state
    assert not torch.equal(a, b)
    h2.remove()
    assert IMPLEMENTATION not in AttentionInterface._global_mapping


def test_patch_is_callable_as_attribute() -> None:
    m = _mha(batch_first=True)
    h = attnuq.patch(m, nu=2)
    assert isinstance(h, attnuq.patching.PatchHandle)
    h.remove()
    assert "forward" not in vars(m)


def test_seed_none_follows_torch_global_rng_and_manual_seed() -> None:
    m = _mha(batch_first=True)
    x = torch.randn(2, 5, 8)
    with torch.no_grad(), stochastic(m, nu=1) as h:
        assert h.seed is None
        torch.manual_seed(5)
        a = m(x, x, x)[0]
        torch.manual_seed(5)
        b = m(x, x, x)[0]
        h.manual_seed(7)
        c = m(x, x, x)[0]
        h.manual_seed(7)
        d = m(x, x, x)[0]
    assert torch.equal(a, b) and torch.equal(c, d) and not torch.equal(a, c)
    with pytest.raises(TypeError, match="seed="):
        h.manual_seed(0.5)  # type: ignore[arg-type]


def test_hf_training_mode_with_attention_dropout_is_refused(bert: nn.Module) -> None:
    bert.train()
    try:
        with stochastic(bert, nu=2), pytest.raises(RuntimeError, match=r"model.eval\(\)"):
            bert(**_BERT.batch())
    finally:
        bert.eval()


def test_sdpa_site_with_inline_softmax_path_is_reported() -> None:
    from _patch_cases import TimmLikeAttention

    class Unregistered(TimmLikeAttention):  # forward owner is TimmLikeAttention -> timm backend
        pass

    class OwnForward(TimmLikeAttention):  # own forward, fused path off: no backend can patch it
        def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
            if self.fused_attn:
                return F.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None])[:, 0]
            return x

    from attnuq.patching.timm import register_class

    register_class(TimmLikeAttention)
    assert find_attention(nn.Sequential(Unregistered(8, 2, fused=False)))[0].backend == "timm"
    site = find_attention(nn.Sequential(OwnForward(8, 2, fused=False)))[0]
    assert site.backend == "sdpa" and not site.patchable and "fused_attn" in str(site.reason)
    assert find_attention(nn.Sequential(OwnForward(8, 2, fused=True)))[0].patchable


# ------------------------------------------------------------------------------------------------
# timm (real timm; the contract cases are in _patch_cases.py)
# ------------------------------------------------------------------------------------------------
def _count_sdpa_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = F.scaled_dot_product_attention

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        calls[0] += 1
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    return calls


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("family", ["vit", "swin"])
def test_timm_frozen_reference_takes_the_path_its_case_names(
    family: str, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The contract cases compare against timm's own forward: make sure the fused case really
    calls F.scaled_dot_product_attention (once per block) and the unfused one never does."""
    from _patch_cases import timm_swin_case, timm_vit_case

    case = (timm_vit_case if family == "vit" else timm_swin_case)(fused)
    m = case.build()
    calls = _count_sdpa_calls(monkeypatch)
    with torch.no_grad():
        case.forward(m, case.batch())
    blocks = 2 if family == "vit" else 4
    assert calls[0] == (blocks if fused else 0)


@pytest.mark.parametrize("fused", [True, False])
def test_timm_attention_gate_norms_masks_and_causal(fused: bool) -> None:
    """timm.layers.Attention with every option the replacement forward repeats (qk_norm,
    scale_norm, gated, dim_out, a bool attn_mask, is_causal): per-head None runs the replacement
    with the genuine SDPA and must reproduce timm's forward to rounding, on both paths."""
    from timm.layers import Attention

    torch.manual_seed(0)
    attn = Attention(
        32, num_heads=4, dim_out=24, qkv_bias=True, qk_norm=True, scale_norm=True, gated=True,
        norm_layer=nn.LayerNorm,
    ).eval()
    attn.fused_attn = fused
    for p in attn.parameters():  # LayerNorm weights away from 1 so that every norm matters
        torch.nn.init.normal_(p, 0.0, 0.5, generator=torch.Generator().manual_seed(p.numel()))
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(1))
    allow = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    allow[1, ..., 5:] = False  # example 1: last two keys padded
    with torch.no_grad():
        for kw in ({}, {"attn_mask": allow}, {"is_causal": True}):
            y0 = attn(x, **kw)
            with stochastic(attn, nu=(None,) * 4, seed=0):
                y = attn(x, **kw)
            torch.testing.assert_close(y, y0, rtol=1e-5, atol=1e-5)
            with stochastic(attn, nu=4, seed=0):
                y4 = attn(x, **kw)
            assert y4.shape == (2, 7, 24) and not torch.allclose(y4, y0)


def test_timm_swin_window_mask_of_wrong_shape_is_named() -> None:
    from timm.models.swin_transformer import WindowAttention

    torch.manual_seed(0)
    attn = WindowAttention(16, num_heads=2, window_size=2).eval()
    x = torch.randn(6, 4, 16)  # 6 windows of 2x2 tokens
    bad = torch.zeros(4, 4, 4)  # 4 does not divide 6 windows
    with stochastic(attn, nu=2, seed=0):
        with pytest.raises(ValueError, match=r"mask\.shape=\(4, 4, 4\)"):
            attn(x, mask=bad)


def test_timm_backend_claims_only_the_classes_it_repeats() -> None:
    """Swin v2's WindowAttention (cosine attention, log-spaced position MLP) and BEiT's Attention
    share names with supported classes but compute other weights: not claimed by the timm
    backend."""
    from timm.models.beit import Attention as BeitAttention
    from timm.models.swin_transformer_v2 import WindowAttention as WindowAttentionV2

    for mod in (WindowAttentionV2(16, window_size=(2, 2), num_heads=2), BeitAttention(16, 2)):
        site = find_attention(nn.Sequential(mod))[0]
        assert site.backend != "timm", site
