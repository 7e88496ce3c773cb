"""GPU speed and memory of the Triton sampled attention (issue #22), run by scripts/gpu_check.sh.

Measures, on one CUDA device:

* Speed: ``sampled_attention`` (Triton kernel, ``nu`` in {1, 4, 16}) against
  ``F.scaled_dot_product_attention`` with the flash backend on the same tensors, ``B=4, H=16,
  D=64``, bfloat16, ``L = Lq = Lk`` in {1024, 4096, 16384}; the torch path (the same operator with
  the Triton dispatch off) and ``attention_moments`` for comparison. Each repeat times SDPA and
  the candidate back to back (CUDA events, after warm-up); the table gives medians and the median
  of the per-repeat ratios. Goal: ratio <= 1.2 at ``L=4096``.
* Peak memory: ``torch.cuda.max_memory_allocated`` during one call minus the memory allocated
  before it (inputs excluded), for SDPA, the Triton sampler and the torch path.
* The ``nu=4`` overhead of two Hugging Face models with random weights (BERT-base width, 4
  layers, L=512; a Llama-style decoder with GQA, 4 layers, L=1024), bfloat16: forward with SDPA
  against the same forward under ``attnuq.stochastic(model, nu=4)`` (two blocks of repeats:
  entering the block patches the model), ratio of the medians.

Every section records its error instead of stopping the run. Writes ``gpu.md`` and
``gpu.json`` (atomically) into the output folder.

Usage::

    python benchmarks/bench_triton.py [--out-dir DIR] [--repeats 10] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from attnuq._io import atomic_write_json, atomic_write_text
from attnuq._runtime import run_info
from attnuq.ops import _triton, attention_moments, sampled_attention

B, H, D = 4, 16, 64
LENGTHS = (1024, 4096, 16384)
NUS = (1, 4, 16)
TORCH_PATH_MAX_L = 4096  # the torch path holds chunks of Lk scores: long L is slow


def _cuda_ms(fn: Callable[[], Any]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end))


def _pair(ref: Callable[[], Any], cand: Callable[[], Any], repeats: int) -> dict[str, float]:
    for _ in range(2):
        ref()
        cand()
    torch.cuda.synchronize()
    tr, tc, ratios = [], [], []
    for _ in range(repeats):
        a = _cuda_ms(ref)
        b = _cuda_ms(cand)
        tr.append(a)
        tc.append(b)
        ratios.append(b / a)
    return {
        "ref_ms": statistics.median(tr),
        "ms": statistics.median(tc),
        "ratio": statistics.median(ratios),
    }


def _times(fn: Callable[[], Any], repeats: int) -> list[float]:
    for _ in range(2):
        fn()
    return [_cuda_ms(fn) for _ in range(repeats)]


def _peak(fn: Callable[[], Any]) -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return int(peak)


def _torch_path(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` with the Triton dispatch off (the torch path on CUDA tensors)."""

    def run() -> Any:
        orig = _triton.usable
        _triton.usable = lambda q, needs_grad: False  # type: ignore[assignment]
        try:
            return fn()
        finally:
            _triton.usable = orig  # type: ignore[assignment]

    return run


def _ops_for_length(L: int, repeats: int, gen: torch.Generator) -> list[dict[str, Any]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = torch.randn(3, B, H, L, D, device="cuda", dtype=torch.bfloat16).unbind(0)

    def sdpa() -> Any:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)

    def sa(nu: int) -> Callable[[], Any]:
        return lambda: sampled_attention(q, k, v, nu=nu, generator=gen)

    cands: list[tuple[str, Callable[[], Any]]] = [(f"triton nu={nu}", sa(nu)) for nu in NUS]
    cands.append(("triton moments", lambda: attention_moments(q, k, v)))
    if L <= TORCH_PATH_MAX_L:
        cands.append(("torch path nu=4", _torch_path(sa(4))))
    rows: list[dict[str, Any]] = []
    sdpa_peak = _peak(sdpa)
    for name, fn in cands:
        row: dict[str, Any] = {"L": L, "variant": name}
        try:
            row.update(_pair(sdpa, fn, repeats))
            row["peak_bytes"] = _peak(fn)
            row["sdpa_peak_bytes"] = sdpa_peak
        except Exception as exc:  # recorded on the page, the run goes on
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        print(row, flush=True)
    return rows


def ops_section(repeats: int, lengths: tuple[int, ...]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for L in lengths:
        rows += _ops_for_length(L, repeats, gen)
        torch.cuda.empty_cache()
    return rows


def hf_section(repeats: int) -> list[dict[str, Any]]:
    import attnuq

    rows: list[dict[str, Any]] = []

    def bert() -> Any:
        from transformers import BertConfig, BertModel

        cfg = BertConfig(hidden_size=768, num_hidden_layers=4, num_attention_heads=12,
                         intermediate_size=3072, max_position_embeddings=512,
                         attn_implementation="sdpa")
        return BertModel(cfg)

    def llama() -> Any:
        from transformers import LlamaConfig, LlamaModel

        cfg = LlamaConfig(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
                          num_key_value_heads=4, intermediate_size=2816, vocab_size=32000,
                          max_position_embeddings=2048, attn_implementation="sdpa")
        return LlamaModel(cfg)

    specs: list[tuple[str, Callable[[], Any], int]] = [
        ("bert-base width, 4 layers, L=512", bert, 512),
        ("llama-style GQA 16/4 heads, 4 layers, L=1024", llama, 1024),
    ]
    for name, build, L in specs:
        row: dict[str, Any] = {"model": name, "batch": 8, "L": L}
        try:
            model = build().to("cuda", torch.bfloat16).eval()
            ids = torch.randint(0, 1000, (8, L), device="cuda")

            def frozen(model: Any = model, ids: torch.Tensor = ids) -> Any:
                with torch.no_grad():
                    return model(input_ids=ids).last_hidden_state

            # the patch is applied once (entering stochastic() patches the model), so frozen and
            # patched forwards are timed in two blocks instead of alternately
            ref_ms = _times(frozen, repeats)
            with attnuq.stochastic(model, nu=4, seed=0):
                ms = _times(frozen, repeats)
            row.update(ref_ms=statistics.median(ref_ms), ms=statistics.median(ms))
            row["ratio"] = row["ms"] / row["ref_ms"]
            del model
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        print(row, flush=True)
        torch.cuda.empty_cache()
    return rows


def tests_summary(path: Path | None) -> str:
    if path is None or not path.is_file():
        return "not run"
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1] if lines else "no output"


def _mib(x: Any) -> str:
    return "n/a" if not isinstance(x, int) else f"{x / 2**20:,.0f}"


def render(info: dict[str, Any], ops: list[dict[str, Any]], hf: list[dict[str, Any]],
           tests: str) -> str:
    out = [
        "# Triton sampled attention on a GPU",
        "",
        f"Written by `{info.get('command', 'benchmarks/bench_triton.py')}` on "
        f"{info.get('date', '?')}, {info.get('machine', '?')}; device: {info.get('gpu', '?')}.",
        "",
        f"CUDA tests (`pytest tests/attnuq/ops/test_triton.py`, compiled, TRITON_INTERPRET=0): "
        f"{tests}",
        "",
        f"## Speed and peak memory (B={B}, H={H}, D={D}, bfloat16, Lq = Lk = L)",
        "",
        "Median over repeats of CUDA-event times; ratio = median of per-repeat ratios to SDPA "
        "(flash backend). Peak = extra memory allocated during one call (inputs excluded). "
        "Goal: ratio <= 1.2 at L = 4096 for `triton nu=4`.",
        "",
        "| L | variant | SDPA ms | ms | ratio | SDPA peak MiB | peak MiB |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in ops:
        if "error" in r:
            out.append(f"| {r['L']} | {r['variant']} | error: {r['error']} | | | | |")
            continue
        out.append(
            f"| {r['L']} | {r['variant']} | {r['ref_ms']:.3f} | {r['ms']:.3f} | "
            f"{r['ratio']:.2f} | {_mib(r.get('sdpa_peak_bytes'))} | {_mib(r.get('peak_bytes'))} |"
        )
    goal = [r for r in ops if r.get("L") == 4096 and r.get("variant") == "triton nu=4"]
    if goal and "ratio" in goal[0]:
        verdict = "met" if goal[0]["ratio"] <= 1.2 else "NOT met"
        out += ["", f"Goal (ratio <= 1.2 at L=4096, nu=4): **{verdict}** "
                f"({goal[0]['ratio']:.2f})."]
    out += [
        "",
        "## nu = 4 overhead on two Hugging Face models (random weights, bfloat16, batch 8)",
        "",
        "| model | SDPA forward ms | nu=4 forward ms | ratio |",
        "| --- | --- | --- | --- |",
    ]
    for r in hf:
        if "error" in r:
            out.append(f"| {r['model']} | error: {r['error']} | | |")
        else:
            out.append(f"| {r['model']} | {r['ref_ms']:.2f} | {r['ms']:.2f} | {r['ratio']:.2f} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=os.environ.get("OUT") or "docs/benchmarks")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="L in {1024, 4096} only, 3 repeats")
    ap.add_argument("--tests-log", default=None, help="pytest output to summarise on the page")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_triton: no CUDA device", file=sys.stderr)
        return 2
    if args.repeats < 1:
        print(f"bench_triton: --repeats must be >= 1, got {args.repeats}", file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    repeats = 3 if args.quick else args.repeats
    lengths = LENGTHS[:2] if args.quick else LENGTHS
    info = run_info(sys.argv if argv is None else ["bench_triton.py", *argv])
    info["gpu"] = torch.cuda.get_device_name()
    info["triton"] = _triton.available()
    ops: list[dict[str, Any]] = []
    hf: list[dict[str, Any]] = []
    try:
        ops = ops_section(repeats, lengths)
    except Exception:
        ops = [{"L": 0, "variant": "section", "error": traceback.format_exc()[-300:]}]
    try:
        hf = hf_section(repeats)
    except Exception:
        hf = [{"model": "section", "error": traceback.format_exc()[-300:]}]
    tests = tests_summary(Path(args.tests_log) if args.tests_log else None)
    atomic_write_json(out_dir / "gpu.json", {"info": info, "ops": ops, "hf": hf, "tests": tests},
                      indent=1, default=str)
    atomic_write_text(out_dir / "gpu.md", render(info, ops, hf, tests))
    print(f"wrote {out_dir / 'gpu.md'} and {out_dir / 'gpu.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
