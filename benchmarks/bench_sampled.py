"""Speed and memory of sampled attention (issue 2 targets).

Speed (CPU, float32, ``B=8, H=8, Lq=Lk=512, D=64``): ``sampled_attention`` against
``F.scaled_dot_product_attention`` on the same tensors, each repeat timing the reference and the
candidate back to back so that load drifts on a shared machine hit both; the table gives the
median of the per-repeat ratios. With one thread the clock is the calling thread's CPU time
(``--clock thread``, the default then), which other processes on a loaded machine do not
inflate. Rows: ``nu`` in {1, 4, 8, 16, 64, 256}, plus ``nu=8`` causal (against causal SDPA),
``nu=8`` key-blocked (``block_size=128``), ``attention_moments`` (mean and variance), and the
pure-torch paths of each for comparison. Issue #22 targets: ``nu=8`` <= 0.7, moments <= 1.5,
key-blocked <= 1.2 (the page states each verdict, and why where one is not met).

Memory (``B=1, H=8, Lq=Lk=16384, D=64, nu=16``): every variant runs once in a fresh subprocess;
the peak extra resident memory of the call is ``VmHWM`` after the call minus ``VmRSS`` just
before it, with the high-water mark reset (``/proc/self/clear_refs``) after the inputs are built
and after a warm-up call of the same variant on ``L=256`` followed by ``malloc_trim(0)`` (so that
library code paged in and one-time initialisation by the first call are not counted, and no heap
memory freed by the warm-up is left resident for the measured call to reuse; the method actually
used is printed with the table). Variants: the dense path as shipped
(query-chunked), the key-blocked path (``block_size=512``; target: <= 1/4 of dense), the dense
path with query chunking disabled (one head's ``Lq x Lk`` matrix at a time, i.e. what a dense
operator that materialises the probabilities costs) and SDPA for context. Each variant is
reported twice: peak extra memory including the output, and working memory excluding the output
(the same for every variant); the target verdict is stated for both definitions against
both dense variants.

Usage::

    .venv/bin/python benchmarks/bench_sampled.py [--repeats 15] [--threads 1] [--skip-memory]
        [--out docs/benchmarks/sampled.md] [--json docs/benchmarks/sampled.json]
        [--png docs/benchmarks/sampled.png]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from attnuq._io import atomic_savefig, atomic_write_json, atomic_write_text
from attnuq._runtime import run_info
from attnuq.ops import _native, attention_moments, sampled_attention
from attnuq.ops import sampled as _sampled

SPEED_SHAPE = (8, 8, 512, 64)
MEM_SHAPE = (1, 8, 16384, 64)
MEM_NU = 16
MEM_BLOCK = 512
NUS = (1, 4, 8, 16, 64, 256)


# ---------------------------------------------------------------------------------------------
# speed
# ---------------------------------------------------------------------------------------------
# the clock of the speed timings: "thread" (CPU time of the calling thread, time.thread_time)
# or "wall" (time.perf_counter). With one intra-op thread all the work runs in the calling thread
# (torch's kernels and the C kernels alike), so its CPU time is the cost of the call without the
# time the scheduler gives other processes on a shared, loaded machine.
CLOCK = "thread"
# the fused sampler's kernel call alone (no input checks, allocation or Python around it)
KERNEL_ROW = "sampled_attention nu=8: the fused kernel call only"
# issue #22's CPU targets, each a ratio to SDPA on the same tensors
TARGETS = {
    "sampled_attention nu=8": 0.7,
    "attention_moments (mean + var)": 1.5,
    "sampled_attention nu=8, block_size=128": 1.2,
}
WHY_NOT = {
    "sampled_attention nu=8": (
        "the fused kernel (`csrc/fused.c`: per tile of 8 query rows a register-blocked "
        "micro-GEMM of the scores, then max, 2^x, the block CDF, the draws and the gather in "
        "L1/L2) does the score GEMM (2 L D flops per query, the same as SDPA's first of two "
        "GEMMs), one 2^x per score, the CDF pass and the lookups; the GEMM runs at roughly the "
        "efficiency of SDPA's, so the exponentials, the CDF and the gather of the drawn value "
        "rows are what is left above half of SDPA"
    ),
    "attention_moments (mean + var)": (
        "the fused kernel does the score GEMM and one GEMM of the weights with `[vc, vc^2]` "
        "(width 2 Dv): 3 L D (D + 2 Dv) / D flops per query against SDPA's 2 GEMMs of the "
        "same width as its scores, so its floor at equal GEMM efficiency is 1.5x SDPA"
    ),
    "sampled_attention nu=8, block_size=128": (
        "the fused kernel computes each key block's score tile with the same micro-GEMM and "
        "runs the running-choice update per block (block max, 2^x, block CDF, one exp2f for "
        "the running mass, one uniform per draw and block, the coin and the lookup); the cost "
        "over the dense kernel is the per-block work on 4 blocks of 128 keys and about twice "
        "the lookups (a draw is replaced in block b with probability ~1/b)"
    ),
}


def _time(fn: Callable[[], Any]) -> float:
    clock = time.thread_time if CLOCK == "thread" else time.perf_counter
    t0 = clock()
    fn()
    return clock() - t0


def speed(repeats: int) -> list[dict[str, Any]]:
    from tqdm import tqdm

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, *SPEED_SHAPE, generator=g).unbind(0)
    gen = torch.Generator().manual_seed(1)

    def sdpa(causal: bool = False) -> Callable[[], Any]:
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def sa(nu: int, **kw: Any) -> Callable[[], Any]:
        return lambda: sampled_attention(q, k, v, nu=nu, generator=gen, **kw)

    rows: list[tuple[str, int | None, Callable[[], Any], Callable[[], Any], str]] = [
        (f"sampled_attention nu={nu}", nu, sa(nu), sdpa(), "SDPA") for nu in NUS
    ]
    rows += [
        ("sampled_attention nu=8, is_causal", 8, sa(8, is_causal=True), sdpa(True), "SDPA causal"),
        ("sampled_attention nu=8, block_size=128", 8, sa(8, block_size=128), sdpa(), "SDPA"),
        ("attention_moments (mean + var)", None, lambda: attention_moments(q, k, v), sdpa(),
         "SDPA"),
        # the torch path of the moments (online softmax over one block of all 512 keys: what
        # block_size=None ran before the fused SDPA path), for comparison in the same run
        ("attention_moments, torch path (block_size=512)", None,
         lambda: attention_moments(q, k, v, block_size=512), sdpa(), "SDPA"),
    ]
    if _native.available():  # the row kernels (torch's score GEMM), for comparison

        def unfused(fn: Callable[[], Any]) -> Callable[[], Any]:
            def run() -> Any:
                with _native.unfused():
                    return fn()

            return run

        from attnuq.ops._attn_common import prepare

        att = prepare(q, k, v, None, False, None, False)
        qq, kk, w, offs, step = _sampled._fused_inputs(att)
        out_buf = torch.empty(att.groups, att.rows, att.dv)
        empty_buf = torch.empty(att.groups, att.rows, dtype=torch.bool)

        def kernel_only() -> Any:  # the fused kernel on prepared inputs: its own floor
            return _native.fused_call(
                "sample", qq, kk, att.scale, None, 0, (0, att.groups, 0, att.rows), w, offs,
                step, att.dv, empty_buf, seed=1, nu=8, out=out_buf,
            )  # fmt: skip

        rows += [
            (KERNEL_ROW, 8, kernel_only, sdpa(), "SDPA"),
            ("sampled_attention nu=8, row kernels (unfused)", 8, unfused(sa(8)), sdpa(), "SDPA"),
            ("sampled_attention nu=8, block_size=128, row kernels (unfused)", 8,
             unfused(sa(8, block_size=128)), sdpa(), "SDPA"),
            ("attention_moments, two SDPA calls (unfused)", None,
             unfused(lambda: attention_moments(q, k, v)), sdpa(), "SDPA"),
        ]
    if _native.available():  # the pure-torch sampler, for comparison with the C kernel

        def torch_path(nu: int) -> Callable[[], Any]:
            def fn() -> Any:
                with _native.disabled():
                    return sampled_attention(q, k, v, nu=nu, generator=gen)

            return fn

        rows += [
            (f"sampled_attention nu={nu}, pure-torch sampler", nu, torch_path(nu), sdpa(), "SDPA")
            for nu in (1, 8, 64)
        ]

        def torch_blocked() -> Any:
            with _native.disabled():
                return sampled_attention(q, k, v, nu=8, generator=gen, block_size=128)

        rows.append(("sampled_attention nu=8, block_size=128, pure-torch sampler", 8,
                     torch_blocked, sdpa(), "SDPA"))
    out = []
    for name, nu, fn, ref, ref_name in tqdm(rows, desc="speed", file=sys.stderr):
        fn()
        ref()  # warm-up
        t_ref, t_fn, ratio = [], [], []
        for _ in range(repeats):
            a = _time(ref)
            b = _time(fn)
            t_ref.append(a)
            t_fn.append(b)
            ratio.append(b / a)
        out.append(
            {
                "variant": name,
                "nu": nu,
                "reference": ref_name,
                "ms": statistics.median(t_fn) * 1e3,
                "ref_ms": statistics.median(t_ref) * 1e3,
                "ratio": statistics.median(ratio),
                "ratio_q25": statistics.quantiles(ratio, n=4)[0],
                "ratio_q75": statistics.quantiles(ratio, n=4)[2],
            }
        )
    return out


# ---------------------------------------------------------------------------------------------
# memory (one subprocess per variant)
# ---------------------------------------------------------------------------------------------
def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _child(variant: str, threads: int) -> None:
    import gc
    import resource

    torch.set_num_threads(threads)
    b, h, n, d = MEM_SHAPE
    q = torch.randn(b, h, n, d)
    k = torch.randn(b, h, n, d)
    v = torch.randn(b, h, n, d)
    gen = torch.Generator().manual_seed(0)

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int) -> torch.Tensor:
        if variant == "sdpa":
            return F.scaled_dot_product_attention(q, k, v)
        bs = block if variant == "blocked" else None
        return sampled_attention(q, k, v, nu=MEM_NU, generator=gen, block_size=bs)

    if variant in ("dense-unchunked", "dense-rows"):
        _native._fused_enabled = False  # torch's score GEMM and the row kernel
    if variant == "dense-unchunked":
        # one whole head (Lq x Lk) per chunk instead of 128-query chunks
        _sampled._DENSE_MIN_ROWS = n
    # Warm-up on a tiny input through the same code path (the blocked one with 4 key blocks),
    # so that pages of library code and one-time initialisations touched by the first call are
    # not counted; then hand freed heap memory back to the OS so that the measured call cannot
    # reuse memory the warm-up made resident.
    wq, wk, wv = (t[:, :, :256] for t in (q, k, v))
    call(wq, wk, wv, 64)
    del wq, wk, wv
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        warm = "after a warm-up call on L=256 and malloc_trim(0)"
    except (OSError, AttributeError):
        warm = "after a warm-up call on L=256 (malloc_trim unavailable)"
    fns: dict[str, Callable[[], Any]] = {variant: lambda: call(q, k, v, MEM_BLOCK)}
    gc.collect()
    method = f"VmHWM reset via /proc/self/clear_refs {warm}"
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        method = "ru_maxrss (high-water mark NOT reset: includes input creation)"
    before = _status_kb("VmRSS")
    t0 = time.perf_counter()
    y = fns[variant]()
    secs = time.perf_counter() - t0
    if method.startswith("VmHWM"):
        peak = _status_kb("VmHWM")
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out_mb = y.numel() * y.element_size() / 2**20
    print(
        json.dumps(
            {
                "variant": variant,
                "peak_extra_mb": (peak - before) / 1024,
                "rss_before_mb": before / 1024,
                "output_mb": out_mb,
                "seconds": secs,
                "method": method,
            }
        )
    )


def memory(threads: int) -> list[dict[str, Any]]:
    from tqdm import tqdm

    out = []
    for variant in tqdm(["dense", "blocked", "dense-rows", "dense-unchunked", "sdpa"],
                        desc="memory",
                        file=sys.stderr):
        res = subprocess.run(
            [sys.executable, __file__, "--_child", variant, "--threads", str(threads)],
            capture_output=True, text=True, check=True,
        )
        out.append(json.loads(res.stdout.strip().splitlines()[-1]))
    return out


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def render(info: dict[str, Any], sp: list[dict[str, Any]], mem: list[dict[str, Any]]) -> str:
    lines = [
        "# Sampled attention: speed and memory",
        "",
        f"* command: `{info['command']}`",
        f"* date: {info['date']}",
        f"* machine: {info['machine']}",
        f"* load: {info['load']}",
        f"* sampler: {info.get('sampler', 'not recorded')}",
        *(f"* speed rows kept from an earlier run: `{info['speed command']}` on "
          f"{info.get('speed date', '?')}, {info.get('speed load', '')}"
          for _ in [0] if "speed command" in info),
        "",
        f"## Speed: CPU float32, B, H, L, D = {SPEED_SHAPE}",
        "",
        "Median over repeats of (candidate time / reference time), each repeat timing both back "
        f"to back; clock: {info.get('clock', 'wall (time.perf_counter)')}. Targets (issue #22): "
        + ", ".join(f"`{k}` <= {v}" for k, v in TARGETS.items()) + ".",
        "",
        "| variant | reference | time ms | reference ms | ratio | ratio IQR |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in sp:
        lines.append(
            f"| {r['variant']} | {r['reference']} | {r['ms']:.1f} | {r['ref_ms']:.1f} | "
            f"{r['ratio']:.2f} | {r['ratio_q25']:.2f}-{r['ratio_q75']:.2f} |"
        )
    lines += [""]
    by = {r["variant"]: r for r in sp}
    for name, target in TARGETS.items():
        r = by[name]
        ok = r["ratio"] <= target
        line = f"* `{name}` (target <= {target}): **{'met' if ok else 'NOT met'}** " \
               f"(ratio {r['ratio']:.2f})"
        lines.append(line + ("." if ok else f": {WHY_NOT[name]}."))
        if name == "sampled_attention nu=8" and KERNEL_ROW in by:
            lines.append(
                f"  The fused kernel call alone (row `{KERNEL_ROW}`) is "
                f"{by[KERNEL_ROW]['ratio']:.2f}x SDPA; the rest of the call is the input check "
                "of `v` (one sum; `q` and `k` are checked by the kernel as it packs them), the "
                "output allocation and Python. On this shared machine the ratio moves by a few "
                "hundredths between runs (SDPA's own time varies by more than 20 % within one "
                "run: compare the reference column), so a ratio within about 0.05 of the target "
                "is met or missed by the load of the other jobs, not by the code."
                + (f" This run: median {r['ratio']:.2f}, IQR {r['ratio_q25']:.2f}-"
                   f"{r['ratio_q75']:.2f}, {'met' if ok else 'missed'} by less than that spread."
                   if abs(r["ratio"] - target) < 0.05 else "")
            )
    lines += [""]
    if mem:
        lines += _render_memory(mem)
    return "\n".join(lines) + "\n"


def _verdict(ratio: float) -> str:
    return f"**{ratio:.3f}** (target <= 0.25: {'met' if ratio <= 0.25 else 'NOT met'})"


def _render_memory(mem: list[dict[str, Any]]) -> list[str]:
    """The memory section: both definitions of "peak memory" and the target verdict for each."""
    by = {m["variant"]: m for m in mem}
    out_mb = mem[0]["output_mb"]
    b, h, n, _ = MEM_SHAPE
    g, rows_all = b * h, n  # groups and query rows per group (no GQA)
    # working-set components implied by the shapes and the module's chunking constants
    dense_rows = max(min(rows_all, _sampled._DENSE_MIN_ROWS), _sampled._DENSE_CHUNK_ELEMS // n)
    dense_buf_mb = dense_rows * n * 4 / 2**20
    flush_bags = min(g * rows_all, max(1, _sampled._GATHER_OUT_ELEMS // MEM_SHAPE[3]))
    idx_mb = flush_bags * MEM_NU * 4 / 2**20
    y_mb = flush_bags * MEM_SHAPE[3] * 4 / 2**20
    # fused kernels (csrc/fused.c): keys packed in panels of 32 (AVX-512), tiles of 8 rows whose
    # score rows are padded to the CDF layout (at most Lk + nb(Lk) + 16 floats)
    kp_mb = -(-n // 32) * 32 * MEM_SHAPE[3] * 4 / 2**20
    nb_all, nb_blk = 8 * -(-n // 128), 8 * -(-MEM_BLOCK // 128)
    tile_mb = 8 * (n + nb_all + 16) * 4 / 2**20
    tile_blk_mb = 8 * (MEM_BLOCK + nb_blk + 16) * 4 / 2**20
    lines = [
        f"## Peak memory: B, H, L, D = {MEM_SHAPE}, nu = {MEM_NU}",
        "",
        f"One fresh subprocess per variant; method: {mem[0]['method']}. *Peak extra* = peak "
        "resident memory during the call minus resident memory just before it (inputs "
        f"excluded, output included; the output itself is {out_mb:.0f} MiB for every variant). "
        "*Working* = peak extra minus the output: the memory a variant needs besides the "
        "unavoidable result. Variants: `dense` is the shipped dense path (the fused kernel); "
        f"`blocked` is `block_size={MEM_BLOCK}` (the fused kernel); `dense-rows` is the dense "
        "path with torch's score GEMM into query chunks and the row kernel (what ran before "
        "the fused kernels, `_native.unfused()`); `dense-unchunked` is that path with one "
        "whole head's `Lq x Lk` matrix per chunk (what a dense operator that materialises the "
        "probabilities costs); `sdpa` is `F.scaled_dot_product_attention` for context.",
        "",
        "| variant | peak extra MiB (incl. output) | working MiB (excl. output) | seconds |",
        "|---|---:|---:|---:|",
    ]
    for m in mem:
        lines.append(
            f"| {m['variant']} | {m['peak_extra_mb']:.1f} | {m['peak_extra_mb'] - out_mb:.1f} | "
            f"{m['seconds']:.1f} |"
        )

    def ratio(a: str, ref: str, minus: float) -> float:
        return (by[a]["peak_extra_mb"] - minus) / (by[ref]["peak_extra_mb"] - minus)

    work = [by[v]["peak_extra_mb"] - out_mb for v in ("dense", "blocked", "dense-unchunked")]
    if min(work) > 0 and max(work) / min(work) < 1.15:
        lines += [
            "",
            f"**Note:** the three sampler variants' working sets are within 15 % of one another "
            f"in this run ({', '.join(f'{w:.1f}' for w in work)} MiB), the materialising one "
            "included, so the method does not separate them here: an allocation common to "
            "every sampler call, not identified in this round, dominates. (The materialising "
            "variant is capped at "
            f"`_CHUNK_MAX_ELEMS` = {_sampled._CHUNK_MAX_ELEMS:,} elements per chunk, "
            f"{_sampled._CHUNK_MAX_ELEMS * 4 / 2**20:.0f} MiB of float32, so it no longer holds a "
            "whole head's matrix at this size.) The verdicts below are printed as measured; "
            "they say nothing about the sampler until that common cost is found.",
        ]
    lines += [
        "",
        "Issue 2 target: the blocked version's peak memory at most 1/4 of the dense version's. "
        "Blocked / dense under each definition (which definition and which dense version the "
        "target means is the lead's call; nothing here is redefined to pass):",
        "",
        "| blocked / ... | peak extra (incl. output) | working (excl. output) |",
        "|---|---|---|",
        f"| dense as shipped (fused) | {_verdict(ratio('blocked', 'dense', 0.0))} | "
        f"{_verdict(ratio('blocked', 'dense', out_mb))} |",
        f"| dense with the row kernels (query-chunked) | "
        f"{_verdict(ratio('blocked', 'dense-rows', 0.0))} | "
        f"{_verdict(ratio('blocked', 'dense-rows', out_mb))} |",
        f"| dense with query chunking disabled (materialising) | "
        f"{_verdict(ratio('blocked', 'dense-unchunked', 0.0))} | "
        f"{_verdict(ratio('blocked', 'dense-unchunked', out_mb))} |",
        "",
        "What the working sets hold (sizes computed from the shapes and the constants in "
        "`attnuq.ops.sampled` and `csrc/fused.c`, not measured): the fused paths (`dense`, "
        f"`blocked`) hold the packed keys of one group ({kp_mb:.1f} MiB: `Lk x D` floats, the "
        f"size of one head's `k`), per thread one tile of 8 query rows' scores ({tile_mb:.2f} "
        f"MiB dense, {tile_blk_mb:.3f} MiB blocked) and 8 rows of drawn keys; no uniforms "
        "(derived from one seed in the kernel), no index tensor and no gather buffer (the "
        "kernel averages the drawn value rows into the output). So the blocked path saves only "
        "the dense tile here; both are bounded by one head's keys, independent of the number of "
        "queries. The row-kernel dense path keeps one chunk of "
        f"{dense_rows} query rows' scores against all {n} keys ({dense_buf_mb:.1f} MiB) and "
        f"gathers the drawn value rows in `embedding_bag` calls of at most {flush_bags} "
        f"queries (`_GATHER_OUT_ELEMS`): their int32 indices ({idx_mb:.1f} MiB) and gathered "
        f"rows ({y_mb:.1f} MiB, copied into the output), besides embedding_bag's own int64 "
        "bookkeeping; its uniforms are drawn chunk by chunk. The materialising variant holds "
        "one chunk of at most `_CHUNK_MAX_ELEMS` elements.",
    ]
    return lines


def plot(sp: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(r["nu"], r["ratio"]) for r in sp if r["variant"] == f"sampled_attention nu={r['nu']}"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label="sampled_attention / SDPA")
    ax.axhline(TARGETS["sampled_attention nu=8"], color="grey", ls="--", label="target at nu=8")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("nu")
    ax.set_ylabel("time ratio")
    ax.set_title(f"CPU float32, B,H,L,D={SPEED_SHAPE}")
    ax.legend()
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--clock", choices=("thread", "wall"), default=None,
                    help="speed clock (default: thread CPU time with --threads 1, else wall)")
    ap.add_argument("--out", default="docs/benchmarks/sampled.md")
    ap.add_argument("--json", default="docs/benchmarks/sampled.json")
    ap.add_argument("--png", default="docs/benchmarks/sampled.png")
    ap.add_argument("--skip-speed", action="store_true",
                    help="keep the speed rows (and their run details) of --json, measure memory")
    ap.add_argument("--from-json", action="store_true",
                    help="re-render the page (and plot) from --json without measuring")
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._child:
        _child(args._child, args.threads)
        return
    if args.from_json:
        data = json.loads(Path(args.json).read_text())
        sp, mem = data.pop("speed"), data.pop("memory")
        atomic_write_text(args.out, render(data, sp, mem))
        plot(sp, Path(args.png))
        return
    torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = args.clock or ("thread" if args.threads == 1 else "wall")
    info = run_info([".venv/bin/python", "benchmarks/bench_sampled.py", *sys.argv[1:]])
    st = _native.native_status()
    info["sampler"] = (
        f"C kernels, fused={st['fused']}, simd={st['simd']} ({st['reason']})"
        if st["available"] else f"pure torch ({st['reason']})"
    )
    info["clock"] = (
        "CPU time of the calling thread (time.thread_time; with 1 intra-op thread every kernel "
        "runs in it), so that other processes on the loaded machine do not enter the times"
        if CLOCK == "thread" else "wall (time.perf_counter)"
    )
    load0 = os.getloadavg()
    if args.skip_speed:
        old = json.loads(Path(args.json).read_text())
        sp = old["speed"]
        for key in ("command", "date", "load", "clock"):
            if key in old:
                info[f"speed {key}"] = old[key]
    else:
        sp = speed(args.repeats)
    load1 = os.getloadavg()
    mem = [] if args.skip_memory else memory(args.threads)
    info["load"] = (
        f"1-min load average {load0[0]:.1f} before the speed runs, {load1[0]:.1f} after "
        f"(on {os.cpu_count()} cores shared with other jobs)"
    )
    if args.skip_speed:
        info["load"] = f"memory run: 1-min load average {load0[0]:.1f} at its start"
    text = render(info, sp, mem)
    print(text)
    for p in (args.out, args.json, args.png):
        Path(p).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, text)
    atomic_write_json(args.json, {**info, "speed": sp, "memory": mem}, indent=2)
    plot(sp, Path(args.png))


if __name__ == "__main__":
    main()
