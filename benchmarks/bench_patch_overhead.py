"""Forward latency of stochastic attention (nu=4) over the frozen model, per backend.

For every model the frozen forward and the patched forward (``attnuq.stochastic(model, nu=4)``)
are timed alternately (frozen, patched, frozen, patched, ...) so that drifts in machine load hit
both equally; the ratio of the medians is reported. Models have random weights and moderate,
realistic sizes (BERT-base width with reduced depth at sequence 128, ViT-B/16 width at 224 px, ...).
Target from the issue: ratio <= 1.15 (the paper reports +11 % on ClimaX).

Usage::

    .venv/bin/python benchmarks/bench_patch_overhead.py [--repeats 15] [--threads 1]
        [--out docs/benchmarks/patch_overhead.md] [--json docs/benchmarks/patch_overhead.json]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import attnuq
from attnuq._runtime import cpu_name
from attnuq.ops import _native

Bench = tuple[str, str, str, Callable[[], tuple[nn.Module, Callable[[nn.Module], Any]]]]


def _bert() -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(hidden_size=768, num_attention_heads=12, num_hidden_layers=4,
                     intermediate_size=3072, vocab_size=30522)
    m = BertModel(cfg).eval()
    ids = torch.randint(0, 30522, (8, 128))
    mask = torch.ones(8, 128, dtype=torch.long)
    mask[::2, 100:] = 0
    return m, lambda mm: mm(input_ids=ids, attention_mask=mask).last_hidden_state


def _vit() -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(hidden_size=768, num_attention_heads=12, num_hidden_layers=4,
                    intermediate_size=3072, image_size=224, patch_size=16)
    m = ViTModel(cfg, add_pooling_layer=False).eval()
    x = torch.randn(4, 3, 224, 224)
    return m, lambda mm: mm(pixel_values=x).last_hidden_state


def _patchtst() -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    from transformers import PatchTSTConfig, PatchTSTForPrediction

    cfg = PatchTSTConfig(num_input_channels=7, context_length=512, patch_length=16,
                         patch_stride=8, prediction_length=96, d_model=128,
                         num_attention_heads=16, num_hidden_layers=3, ffn_dim=256)
    m = PatchTSTForPrediction(cfg).eval()
    x = torch.randn(16, 512, 7).cumsum(1)
    return m, lambda mm: mm(past_values=x).prediction_outputs


def _timesfm() -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    from transformers import TimesFmConfig, TimesFmModelForPrediction

    cfg = TimesFmConfig(patch_length=32, context_length=512, horizon_length=128,
                        num_hidden_layers=4, hidden_size=512, intermediate_size=512,
                        head_dim=64, num_attention_heads=8)
    m = TimesFmModelForPrediction(cfg).eval()
    xs = [torch.randn(512).cumsum(0) for _ in range(16)]
    return m, lambda mm: mm(past_values=xs, freq=[0] * len(xs)).mean_predictions


def _llama() -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                      num_hidden_layers=4, intermediate_size=1408, vocab_size=32000)
    m = LlamaModel(cfg).eval()
    ids = torch.randint(0, 32000, (8, 128))
    return m, lambda mm: mm(input_ids=ids).last_hidden_state


def _rtdl() -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    import rtdl_revisiting_models as r

    m = r.FTTransformer(n_cont_features=8, cat_cardinalities=[], d_out=1,
                        **r.FTTransformer.get_default_kwargs(n_blocks=3)).eval()
    x = torch.randn(512, 8)
    return m, lambda mm: mm(x, None)


def _encoder() -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    layer = nn.TransformerEncoderLayer(256, 8, 1024, batch_first=True)
    m = nn.TransformerEncoder(layer, 4).eval()
    x = torch.randn(16, 128, 256)
    kpm = torch.zeros(16, 128, dtype=torch.bool)
    kpm[::2, 100:] = True
    return m, lambda mm: mm(x, src_key_padding_mask=kpm)


def _encoder_slow() -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    """Same model and input; the frozen reference also runs without torch's fused fast path."""
    m, fwd = _encoder()

    def run(mm: nn.Module) -> Any:
        prev = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            return fwd(mm)
        finally:
            torch.backends.mha.set_fastpath_enabled(prev)

    return m, run


class _SDPABlock(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, n, 3, self.h, c // self.h).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.out(a.transpose(1, 2).reshape(b, n, c))
        return x + self.ff(self.n2(x))


def _sdpa() -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    m = nn.Sequential(*[_SDPABlock(384, 6) for _ in range(4)]).eval()
    x = torch.randn(8, 197, 384)
    return m, lambda mm: mm(x)


def _timm_fused(model: nn.Module, fused: bool) -> nn.Module:
    """Set timm's attention path on every attention module of ``model`` (per instance)."""
    for mod in model.modules():
        if hasattr(mod, "fused_attn"):
            mod.fused_attn = fused
    return model


def _timm_vit(fused: bool) -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    import timm

    m = _timm_fused(timm.create_model("vit_tiny_patch16_224", pretrained=False).eval(), fused)
    x = torch.randn(8, 3, 224, 224)
    return m, lambda mm: mm.forward_features(x)


def _timm_swin() -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    import timm

    m = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False).eval()
    x = torch.randn(2, 3, 224, 224)
    return m, lambda mm: mm.forward_features(x)


BENCHES: list[Bench] = [
    ("HF BERT", "hf", "hidden 768, 12 heads, 4 layers, batch 8 x seq 128 (padding mask)", _bert),
    ("HF ViT", "hf", "hidden 768, 12 heads, 4 layers, batch 4 x 224 px / 16 (197 tokens)", _vit),
    ("HF PatchTST", "hf", "d 128, 16 heads, 3 layers, batch 16 x 7 ch x 512 steps", _patchtst),
    ("HF TimesFM", "hf", "hidden 512, 8 heads, 4 layers, batch 16 x 512 steps", _timesfm),
    ("HF Llama (GQA 8q/2kv)", "hf", "hidden 512, 4 layers, batch 8 x seq 128 (causal)", _llama),
    ("rtdl FT-Transformer", "rtdl", "default 3 blocks (d 192, 8 heads), batch 512 x 8 feats",
     _rtdl),
    ("nn.TransformerEncoder", "mha", "d 256, 8 heads, 4 layers, batch 16 x seq 128 (padding); "
     "frozen runs torch's fused fast path", _encoder),
    ("nn.TransformerEncoder, fast path off", "mha", "same; the frozen reference also runs "
     "without the fast path (torch.backends.mha.set_fastpath_enabled(False))", _encoder_slow),
    ("F.sdpa direct", "sdpa", "d 384, 6 heads, 4 blocks, batch 8 x 197 tokens", _sdpa),
    ("timm vit_tiny_patch16_224", "timm", "timm defaults (d 192, 3 heads, 12 blocks), batch 8 x "
     "224 px / 16 (197 tokens); frozen on the fused path (F.sdpa)",
     functools.partial(_timm_vit, True)),
    ("timm vit_tiny_patch16_224, inline softmax", "timm", "same; fused_attn = False on every "
     "block, so the frozen reference runs timm's inline softmax",
     functools.partial(_timm_vit, False)),
    ("timm swin_tiny_patch4_window7_224", "timm", "timm defaults (d 96-768, depths 2-2-6-2, "
     "7x7 windows of 49 tokens), batch 2 x 224 px; frozen on timm's default inline softmax",
     _timm_swin),
]


def _time(fwd: Callable[[nn.Module], Any], model: nn.Module) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one forward."""
    t0, c0 = time.perf_counter(), time.process_time()
    fwd(model)
    return time.perf_counter() - t0, time.process_time() - c0


def _paired(frozen: list[tuple[float, float]], patched: list[tuple[float, float]],
            j: int) -> list[float]:
    """Per-pair ratios patched / frozen of clock ``j`` (0 wall, 1 cpu): each pair ran back to
    back, so a change of the machine's speed between pairs cancels out of its ratio."""
    return [p[j] / f[j] for f, p in zip(frozen, patched, strict=True)]


def _iqr(xs: list[float]) -> tuple[float, float]:
    """Lower and upper quartile (the middle half of the per-pair ratios)."""
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def _op_bench(nu: int, repeats: int = 15) -> list[dict[str, Any]]:
    """CPU time of the operator alone against SDPA at the attention shapes of the models."""
    from attnuq.ops import sampled_attention

    shapes = [  # (B, Hq, Hkv, L, D, causal, padding mask): BERT, ViT, Llama, encoder, PatchTST,
        # TimesFM, FT-Transformer
        (8, 12, 12, 128, 64, False, True),
        (4, 12, 12, 197, 64, False, False),
        (8, 8, 2, 128, 64, True, False),
        (16, 8, 8, 128, 32, False, True),
        (112, 16, 16, 63, 8, False, False),
        (16, 8, 8, 16, 64, True, True),
        (512, 8, 8, 9, 24, False, False),
    ]
    g = torch.Generator().manual_seed(0)
    out = []
    for b, hq, hk, n, d, causal, pad in shapes:
        q, k, v = torch.randn(b, hq, n, d), torch.randn(b, hk, n, d), torch.randn(b, hk, n, d)
        mask = None
        if pad:  # every other row padded after position 100 (as the models), or its last quarter
            mask = torch.ones(b, 1, 1, n, dtype=torch.bool)
            mask[::2, ..., 100 if n > 100 else n - n // 4:] = False
        is_causal = causal
        if causal and mask is not None:  # SDPA refuses attn_mask with is_causal: fold it in
            mask = mask & torch.ones(n, n, dtype=torch.bool).tril()
            is_causal = False
        gqa = hq != hk

        kw = {"attn_mask": mask, "is_causal": is_causal, "enable_gqa": gqa}
        sdpa = functools.partial(F.scaled_dot_product_attention, q, k, v, **kw)
        sampled = functools.partial(sampled_attention, q, k, v, nu=nu, generator=g, **kw)
        ts: dict[str, list[float]] = {"sdpa": [], "sampled": []}
        with torch.inference_mode():
            sdpa(), sampled()
            for _ in range(repeats):
                for key, fn in (("sdpa", sdpa), ("sampled", sampled)):
                    c0 = time.process_time()
                    fn()
                    ts[key].append(time.process_time() - c0)
        a, s_ = statistics.median(ts["sdpa"]), statistics.median(ts["sampled"])
        out.append({"shape": f"({b}, {hq}/{hk}, {n}, {d})",
                    "mask": " + ".join(n_ for n_, on in (("causal", causal), ("padding", pad))
                                       if on) or "none",
                    "sdpa_ms": 1e3 * a, "sampled_ms": 1e3 * s_, "ratio": s_ / a})
    return out


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename it over ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--nu", type=int, default=4)
    ap.add_argument("--only", default=None, help="comma-separated backend names")
    ap.add_argument("--out", default="docs/benchmarks/patch_overhead.md")
    ap.add_argument("--json", default="docs/benchmarks/patch_overhead.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        def tqdm(x: Any, **_: Any) -> Any:  # type: ignore[no-redef]
            return x

    load_start = os.getloadavg()
    rows: list[dict[str, Any]] = []
    benches = [b for b in BENCHES if args.only is None or b[1] in args.only.split(",")]
    timings: dict[str, dict[str, list[list[tuple[float, float]]]]] = {
        b[0]: {"frozen": [], "patched": []} for b in benches
    }
    # rounds go over all models in turn, so a change of machine load shows up as a spread
    # between rounds rather than as a bias of one model
    for rnd in range(args.rounds):
        for name, _backend, _size, make in tqdm(benches, desc=f"round {rnd + 1}/{args.rounds}"):
            model, fwd = make()
            frozen: list[tuple[float, float]] = []
            patched: list[tuple[float, float]] = []
            with torch.inference_mode():
                for _ in range(args.warmup):
                    fwd(model)
                    with attnuq.stochastic(model, nu=args.nu, seed=0):
                        fwd(model)
                for i in range(args.repeats):
                    # pairs in alternating order (frozen first, then patched first), so that a
                    # drift of the machine's speed within a pair does not favour either side
                    if i % 2 == 0:
                        frozen.append(_time(fwd, model))
                    with attnuq.stochastic(model, nu=args.nu, seed=0):
                        patched.append(_time(fwd, model))
                    if i % 2 == 1:
                        frozen.append(_time(fwd, model))
            timings[name]["frozen"].append(frozen)
            timings[name]["patched"].append(patched)
            fw, pw = (statistics.median(t[0] for t in ts) for ts in (frozen, patched))
            fc, pc = (statistics.median(t[1] for t in ts) for ts in (frozen, patched))
            rw, rc = (statistics.median(_paired(frozen, patched, j)) for j in (0, 1))
            print(f"[round {rnd + 1}] {name:24s} wall {1e3 * fw:8.1f} -> {1e3 * pw:8.1f} ms "
                  f"(paired x{rw:.3f})  cpu {1e3 * fc:8.1f} -> {1e3 * pc:8.1f} ms "
                  f"(paired x{rc:.3f})", flush=True)
    for name, backend, size, _make in benches:
        fr = [t for rd in timings[name]["frozen"] for t in rd]
        pa = [t for rd in timings[name]["patched"] for t in rd]
        fw, pw = (statistics.median(t[0] for t in ts) for ts in (fr, pa))
        fc, pc = (statistics.median(t[1] for t in ts) for ts in (fr, pa))
        wall_r, cpu_r = _paired(fr, pa, 0), _paired(fr, pa, 1)
        per_round = [
            statistics.median(_paired(f_, p_, 0))
            for f_, p_ in zip(timings[name]["frozen"], timings[name]["patched"], strict=True)
        ]
        rows.append({
            "model": name, "backend": backend, "size": size,
            "frozen_ms": 1e3 * fw, "patched_ms": 1e3 * pw, "ratio": statistics.median(wall_r),
            "frozen_cpu_ms": 1e3 * fc, "patched_cpu_ms": 1e3 * pc,
            "cpu_ratio": statistics.median(cpu_r), "cpu_ratio_iqr": _iqr(cpu_r),
            "wall_ratio_per_round": per_round,
            "frozen_ms_all": [1e3 * t[0] for t in fr],
            "patched_ms_all": [1e3 * t[0] for t in pa],
        })

    op_rows = _op_bench(args.nu)
    load = os.getloadavg()
    machine = (f"{platform.platform()}, {cpu_name()}, "
               f"{os.cpu_count()} CPUs (torch threads {args.threads}), torch {torch.__version__}, "
               f"python {platform.python_version()}; load average at start "
               f"{load_start[0]:.1f}, at end {load[0]:.1f} (machine shared with other jobs)")
    st = _native.status()
    sampler = (f"C kernel ({st['reason']})" if st["available"]
               else f"pure torch ({st['reason']})")
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cmd = "python benchmarks/bench_patch_overhead.py " + " ".join(sys.argv[1:] if argv is None
                                                                  else argv)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(Path(args.json), json.dumps({"command": cmd, "date": date, "machine": machine,
                                           "sampler": sampler,
                                           "nu": args.nu, "repeats": args.repeats,
                                           "rows": rows, "op_rows": op_rows}, indent=1))
    lines = [
        "# Overhead of `attnuq.stochastic` (forward latency, patched / frozen)",
        "",
        f"* command: `{cmd.strip()}`",
        f"* date: {date}",
        f"* machine: {machine}",
        f"* sampler (dense inverse-CDF step of `sampled_attention`): {sampler}",
        f"* nu = {args.nu}; {args.rounds} rounds over all models, each with {args.repeats} "
        f"timed pairs of forwards (frozen, patched; the order alternates from pair to pair) "
        f"after {args.warmup} warm-up pairs; `torch.inference_mode()`, random weights. Each "
        "ratio is the median over all pairs of all rounds of the per-pair ratio patched / "
        "frozen: the two forwards of a pair run back to back, so a change of the machine's "
        "speed between pairs (on this shared machine it moves by more than 10 % within "
        "minutes) cancels out of the ratio; `cpu ratio IQR` is the middle half of the per-pair "
        "cpu ratios. The times are medians pooled over rounds, for scale only (not comparable "
        "between runs).",
        "* wall = `time.perf_counter`, cpu = `time.process_time` of the single-threaded process "
        "(less sensitive to the other jobs on a shared machine); the target is judged on both.",
        "* target (issue 3): ratio <= 1.15 (the paper reports +11 % latency on ClimaX at nu=4); "
        "issue #22's target, ratio <= 1.05, is judged on the cpu ratio (the wall ratio of a "
        "loaded machine moves by more than 5 % between rounds).",
        "",
        "| model | backend | size | frozen wall (ms) | nu=4 wall (ms) | wall ratio | "
        "frozen cpu (ms) | nu=4 cpu (ms) | cpu ratio | cpu ratio IQR | wall ratio per round | "
        "<= 1.15 | cpu <= 1.05 (#22) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|---|:---:|:---:|",
    ]
    for r in rows:
        worst = max(r["ratio"], r["cpu_ratio"])
        ok = "yes" if worst <= 1.15 else "**no**"
        lines.append(f"| {r['model']} | {r['backend']} | {r['size']} | {r['frozen_ms']:.1f} | "
                     f"{r['patched_ms']:.1f} | {r['ratio']:.3f} | {r['frozen_cpu_ms']:.1f} | "
                     f"{r['patched_cpu_ms']:.1f} | {r['cpu_ratio']:.3f} | "
                     f"{r['cpu_ratio_iqr'][0]:.3f}-{r['cpu_ratio_iqr'][1]:.3f} | "
                     f"{', '.join(f'{x:.3f}' for x in r['wall_ratio_per_round'])} | {ok} | "
                     f"{'yes' if r['cpu_ratio'] <= 1.05 else '**no**'} |")
    over = [r["model"] for r in rows if max(r["ratio"], r["cpu_ratio"]) > 1.15]
    over22 = [r["model"] for r in rows if r["cpu_ratio"] > 1.05]
    lines += [
        "",
        "## Notes",
        "",
        f"* Above the 1.15 target in this run: {', '.join(over) if over else 'none'}.",
        "* Above issue #22's 1.05 (cpu ratio) in this run: "
        f"{', '.join(over22) if over22 else 'none'}. The operator table below gives the "
        "sampler's cost against SDPA at each model's attention shape: at the larger shapes the "
        "fused float32 kernel (attnuq.ops.native_status()['fused']) is as fast as SDPA, at "
        "short sequences (few keys per query, many heads) its per-call cost dominates; the "
        "cpu ratio of a whole model also moves by a few percent between runs on the loaded "
        "machine (the per-round wall ratios show how much).",
        "* `nn.TransformerEncoder`: the frozen model runs torch's fused encoder-layer kernel on a "
        "nested tensor (padding skipped); the patch must leave that fast path (the fused kernel "
        "has no attention hook), so its row measures the fast path's loss as well as sampling. "
        "The `fast path off` row separates the two.",
        "* Attention operator alone (attnuq.ops.sampled_attention at nu=4 vs "
        "F.scaled_dot_product_attention, CPU ms, single thread, shapes of the models above):",
        "",
        "| shape (B, Hq/Hkv, L, D) | mask | SDPA cpu (ms) | sampled cpu (ms) | ratio |",
        "|---|---|---:|---:|---:|",
    ]
    for r in op_rows:
        lines.append(f"| {r['shape']} | {r['mask']} | {r['sdpa_ms']:.1f} | "
                     f"{r['sampled_ms']:.1f} | {r['ratio']:.2f} |")
    _write_atomic(Path(args.out), "\n".join(lines) + "\n")
    print(f"wrote {args.out} and {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
