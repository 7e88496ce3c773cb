"""Tiny random models, one per backend, for the shared contract tests of ``attnuq.patching``.

Each :class:`Case` only builds a model and its inputs; every check lives in
``test_patch_contract.py`` and runs against all cases (gpytorch-style: the adapter tests only say
how to build the model).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

Inputs = dict[str, Any]


@dataclass
class Case:
    """A model, its inputs, and how to read one example's output.

    ``forward(model, inputs)`` returns a tensor whose first dim is the batch. ``lengths[i]`` (if
    set) is the number of valid positions of example ``i`` along dim 1 of the output; ``single(i)``
    returns the inputs of example ``i`` alone (trimmed of its padding).
    """

    name: str
    backend: str
    build: Callable[[], nn.Module]
    batch: Callable[[], Inputs]
    forward: Callable[[nn.Module, Inputs], torch.Tensor]
    single: Callable[[int], Inputs]
    lengths: list[int] | None = None
    batch_size: int = 2
    extra: dict[str, Any] = field(default_factory=dict)

    def example(self, out: torch.Tensor, row: int, i: int) -> torch.Tensor:
        """Valid part of example ``i`` found at row ``row`` of ``out``."""
        r = out[row]
        if self.lengths is not None:
            r = r[: self.lengths[i]]
        return r


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def to_dtype(inputs: Inputs, dtype: torch.dtype) -> Inputs:
    def conv(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(dtype)
        if isinstance(x, list):
            return [conv(t) for t in x]
        return x

    return {k: conv(v) for k, v in inputs.items()}


# ------------------------------------------------------------------------------------------------
# Hugging Face
# ------------------------------------------------------------------------------------------------
def _token_case(name: str, make: Callable[[], nn.Module], lengths: list[int], vocab: int) -> Case:
    seq = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), seq), generator=_g(1))
    mask = torch.zeros(len(lengths), seq, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1

    def batch() -> Inputs:
        return {"input_ids": ids, "attention_mask": mask}

    def single(i: int) -> Inputs:
        n = lengths[i]
        return {"input_ids": ids[i : i + 1, :n], "attention_mask": mask[i : i + 1, :n]}

    def fwd(m: nn.Module, x: Inputs) -> torch.Tensor:
        return m(**x).last_hidden_state

    return Case(name, "hf", make, batch, fwd, single, lengths=lengths)


def bert_case() -> Case:
    def make() -> nn.Module:
        from transformers import BertConfig, BertModel

        torch.manual_seed(0)
        cfg = BertConfig(
            vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=32,
        )
        return BertModel(cfg).eval()

    return _token_case("hf_bert", make, [5, 8], 50)


def llama_case() -> Case:
    def make() -> nn.Module:
        from transformers import LlamaConfig, LlamaModel

        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32,
        )
        return LlamaModel(cfg).eval()

    return _token_case("hf_llama_gqa", make, [5, 8], 50)


def vit_case() -> Case:
    x = torch.randn(2, 3, 16, 16, generator=_g(2))

    def make() -> nn.Module:
        from transformers import ViTConfig, ViTModel

        torch.manual_seed(0)
        cfg = ViTConfig(
            image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=64,
        )
        return ViTModel(cfg, add_pooling_layer=False).eval()

    return Case(
        "hf_vit", "hf", make, lambda: {"pixel_values": x},
        lambda m, inp: m(**inp).last_hidden_state,
        lambda i: {"pixel_values": x[i : i + 1]},
    )


def patchtst_case() -> Case:
    x = torch.randn(2, 32, 2, generator=_g(3))

    def make() -> nn.Module:
        from transformers import PatchTSTConfig, PatchTSTForPrediction

        torch.manual_seed(0)
        cfg = PatchTSTConfig(
            num_input_channels=2, context_length=32, patch_length=8, patch_stride=8,
            prediction_length=8, d_model=32, num_attention_heads=4, num_hidden_layers=2,
            ffn_dim=64, init_std=0.2,
        )
        return PatchTSTForPrediction(cfg).eval()

    return Case(
        "hf_patchtst", "hf", make, lambda: {"past_values": x},
        lambda m, inp: m(**inp).prediction_outputs,
        lambda i: {"past_values": x[i : i + 1]},
    )


def timesfm_case() -> Case:
    series = [torch.randn(32, generator=_g(4)).cumsum(0), torch.randn(24, generator=_g(5))]

    def make() -> nn.Module:
        from transformers import TimesFmConfig, TimesFmModelForPrediction

        torch.manual_seed(0)
        cfg = TimesFmConfig(
            patch_length=8, context_length=32, horizon_length=8, num_hidden_layers=2,
            hidden_size=32, intermediate_size=32, head_dim=8, num_attention_heads=4,
        )
        return TimesFmModelForPrediction(cfg).eval()

    def fwd(m: nn.Module, inp: Inputs) -> torch.Tensor:
        xs = inp["past_values"]
        return m(past_values=xs, freq=[0] * len(xs)).mean_predictions

    # transformers>=5 (the hf extra, installed by scripts/setup.sh) ships TimesFM: a failed
    # import fails the case, it is not skipped
    return Case(
        "hf_timesfm", "hf", make, lambda: {"past_values": series}, fwd,
        lambda i: {"past_values": [series[i]]},
    )


# ------------------------------------------------------------------------------------------------
# torch / rtdl / sdpa / timm
# ------------------------------------------------------------------------------------------------
def rtdl_case() -> Case:
    x = torch.randn(3, 4, generator=_g(6))

    def make() -> nn.Module:
        import rtdl_revisiting_models as r

        torch.manual_seed(0)
        return r.FTTransformer(
            n_cont_features=4, cat_cardinalities=[], d_out=2, n_blocks=2, d_block=32,
            attention_n_heads=4, attention_dropout=0.1, ffn_d_hidden_multiplier=2.0,
            ffn_dropout=0.1, residual_dropout=0.0,
        ).eval()

    return Case(
        "rtdl_ft", "rtdl", make, lambda: {"x_cont": x},
        lambda m, inp: m(inp["x_cont"], None), lambda i: {"x_cont": x[i : i + 1]}, batch_size=3,
    )


def _seq_inputs(batch_first: bool, lengths: list[int], dim: int, seed: int) -> tuple[Any, ...]:
    seq = max(lengths)
    x = torch.randn(len(lengths), seq, dim, generator=_g(seed))
    kpm = torch.ones(len(lengths), seq, dtype=torch.bool)
    for i, n in enumerate(lengths):
        kpm[i, :n] = False
    return x, kpm


def encoder_case() -> Case:
    lengths = [4, 6]
    x, kpm = _seq_inputs(True, lengths, 16, 7)

    def make() -> nn.Module:
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        return nn.TransformerEncoder(layer, 2).eval()

    return Case(
        "torch_encoder_fastpath", "mha", make,
        lambda: {"src": x, "src_key_padding_mask": kpm},
        lambda m, inp: m(**inp),
        lambda i: {"src": x[i : i + 1, : lengths[i]]},
        lengths=lengths,
    )


def mha_case(batch_first: bool) -> Case:
    lengths = [4, 6]
    x, kpm = _seq_inputs(batch_first, lengths, 16, 8)

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.MultiheadAttention(16, 4, dropout=0.1, batch_first=batch_first).eval()

    def fwd(m: nn.Module, inp: Inputs) -> torch.Tensor:
        xx = inp["x"] if batch_first else inp["x"].transpose(0, 1)
        out = m(xx, xx, xx, key_padding_mask=inp.get("kpm"), need_weights=False)[0]
        return out if batch_first else out.transpose(0, 1)

    return Case(
        f"torch_mha_batch_first_{batch_first}", "mha", make,
        lambda: {"x": x, "kpm": kpm}, fwd,
        lambda i: {"x": x[i : i + 1, : lengths[i]]}, lengths=lengths,
    )


class SDPABlock(nn.Module):
    """A small self-attention block calling ``F.scaled_dot_product_attention`` directly."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, c // self.heads).permute(
            2, 0, 3, 1, 4
        )
        m = None if mask is None else mask[:, None, None, :]  # (B, 1, 1, N), True = attend
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        return x + self.out(a.transpose(1, 2).reshape(b, n, c))


class SDPANet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([SDPABlock(16, 2), SDPABlock(16, 2)])

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        for b in self.blocks:
            x = b(x, mask)
        return x


def sdpa_case() -> Case:
    lengths = [4, 6]
    x, kpm = _seq_inputs(True, lengths, 16, 9)

    def make() -> nn.Module:
        torch.manual_seed(0)
        return SDPANet().eval()

    return Case(
        "sdpa_direct", "sdpa", make, lambda: {"x": x, "mask": ~kpm},
        lambda m, inp: m(**inp), lambda i: {"x": x[i : i + 1, : lengths[i]]}, lengths=lengths,
        extra={"heads": 2},  # the SDPA backend cannot read the head count from the module
    )


class TimmLikeAttention(nn.Module):
    """Written for these tests: the attribute layout and both forward paths of timm's Attention
    (fused ``qkv``; ``F.scaled_dot_product_attention`` when ``fused_attn``, inline softmax
    otherwise). Registered with ``attnuq.patching.timm.register_class``."""

    def __init__(self, dim: int, num_heads: int, fused: bool) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.fused_attn = fused
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.q_norm = nn.LayerNorm(self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim)
        self.attn_drop = nn.Dropout(0.1)
        self.norm = nn.Identity()
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, c = x.shape
        t = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = t.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.fused_attn:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        else:
            s = (q * self.scale) @ k.transpose(-2, -1)
            if attn_mask is not None:
                s = s.masked_fill(~attn_mask, -math.inf)
            a = self.attn_drop(s.softmax(-1)) @ v
        y = self.norm(a.transpose(1, 2).reshape(b, n, c))
        return self.proj_drop(self.proj(y))


class TimmLikeNet(nn.Module):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([TimmLikeAttention(16, 4, fused) for _ in range(2)])
        self.norms = nn.ModuleList([nn.LayerNorm(16) for _ in range(2)])

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        m = None if mask is None else mask[:, None, None, :]
        for blk, nrm in zip(self.blocks, self.norms, strict=True):
            x = x + blk(nrm(x), attn_mask=m)
        return x


def timm_standin_case(fused: bool) -> Case:
    lengths = [4, 6]
    x, kpm = _seq_inputs(True, lengths, 16, 10)

    def make() -> nn.Module:
        from attnuq.patching.timm import register_class

        register_class(TimmLikeAttention)
        torch.manual_seed(0)
        return TimmLikeNet(fused).eval()

    return Case(
        f"timm_standin_fused_{fused}", "timm", make, lambda: {"x": x, "mask": ~kpm},
        lambda m, inp: m(**inp), lambda i: {"x": x[i : i + 1, : lengths[i]]}, lengths=lengths,
    )


def _set_fused_attn(model: nn.Module, fused: bool) -> int:
    """Pick timm's attention path per instance (``module.fused_attn``; no global flag is
    touched, unlike ``timm.layers.set_fused_attn``); returns how many modules were set."""
    n = 0
    for mod in model.modules():
        if hasattr(mod, "fused_attn"):
            mod.fused_attn = fused
            n += 1
    assert n > 0, f"no module with fused_attn in {type(model).__name__}"
    return n


def timm_vit_case(fused: bool) -> Case:
    """``vit_tiny_patch16_224`` (timm ``Attention``), random weights, 48 px (9 patches + cls),
    2 blocks; ``fused`` picks F.scaled_dot_product_attention or timm's inline softmax."""
    x = torch.randn(2, 3, 48, 48, generator=_g(11))

    def make() -> nn.Module:
        import timm  # a failed import fails the test: scripts/setup.sh installs timm

        torch.manual_seed(0)
        m = timm.create_model(
            "vit_tiny_patch16_224", pretrained=False, img_size=48, depth=2, num_classes=3
        ).eval()
        assert _set_fused_attn(m, fused) == 2
        return m

    return Case(
        f"timm_vit_tiny_fused_{fused}", "timm", make, lambda: {"x": x},
        lambda m, inp: m.forward_features(inp["x"]), lambda i: {"x": x[i : i + 1]},
    )


def timm_swin_case(fused: bool) -> Case:
    """``swin_tiny_patch4_window7_224`` shrunk (timm ``WindowAttention``: relative position bias,
    shifted-window mask), random weights: 32 px / 4 = 8x8 tokens, window 4, depths (2, 2), so
    the second block of stage 1 is shifted (4 windows, mask entries 0 / -100) and stage 2 is one
    4x4 window. The bias tables are redrawn with std 0.5 (timm initialises them at 0.02) so that
    the bias visibly moves the weights. timm's default for this class is the inline softmax
    (``fused=False``)."""
    x = torch.randn(2, 3, 32, 32, generator=_g(12))

    def make() -> nn.Module:
        import timm

        torch.manual_seed(0)
        m = timm.create_model(
            "swin_tiny_patch4_window7_224", pretrained=False, img_size=32, embed_dim=32,
            depths=(2, 2), num_heads=(2, 4), window_size=4, num_classes=3,
        ).eval()
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith("relative_position_bias_table"):
                    p.normal_(0.0, 0.5, generator=_g(13))
        assert _set_fused_attn(m, fused) == 4
        return m

    return Case(
        f"timm_swin_fused_{fused}", "timm", make, lambda: {"x": x},
        lambda m, inp: m.forward_features(inp["x"]), lambda i: {"x": x[i : i + 1]},
    )


CASES: list[Case] = [
    bert_case(),
    vit_case(),
    patchtst_case(),
    timesfm_case(),
    llama_case(),
    rtdl_case(),
    encoder_case(),
    mha_case(True),
    mha_case(False),
    sdpa_case(),
    timm_standin_case(True),
    timm_standin_case(False),
    timm_vit_case(True),
    timm_vit_case(False),
    timm_swin_case(False),
    timm_swin_case(True),
]


def case_params() -> list[Any]:
    """Every case, by name; none is skipped (a case that cannot build or run fails)."""
    return [pytest.param(c, id=c.name) for c in CASES]
