"""Batched against looped Monte Carlo passes in :func:`attnuq.predict`.

``predict`` cuts the work into units of 16 examples by 16 passes, replicates a unit's examples
along dim 0 and runs its passes in as few model calls as the caps (``max_rows``, on the CPU the
widest activation) allow; the reference runs the same ``S``
passes as a Python loop of ``S`` calls (``batch_replicas=1``). Both produce ``(S, B, ...)``
samples from the same patched model. The two are timed alternately (batched, looped, batched,
...) so that drifts in machine load hit both; the ratio of the medians is the speed-up.

Models: a 2-layer ``nn.TransformerEncoder`` regressor, small (d=16, sequence 8, batch 4: per-call
overhead dominates) and medium (d=64, 4 heads, sequence 32, batch 16), and an rtdl
FT-Transformer (3 blocks, 8 features, batch 64) when ``rtdl_revisiting_models`` is installed.
``S = 32`` passes at ``nu = 8``. On a CPU with one thread a compute-bound model gains little from
batching (the arithmetic is the same); the gain is the per-call overhead, and on parallel
hardware the occupancy.

Usage::

    .venv/bin/python benchmarks/bench_predict_batched.py [--repeats 7] [--threads 1]
        [--out docs/benchmarks/predict.md] [--json docs/benchmarks/predict.json]
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnuq._io import atomic_write_json, atomic_write_text
from attnuq._runtime import run_info
from attnuq.montecarlo import CPU_MAX_ACTIVATION, predict, unit_replicas, widest_output

S, NU = 32, 8
_DEFAULTS = inspect.signature(predict).parameters
CHUNK_EXAMPLES = int(_DEFAULTS["chunk_examples"].default)
CHUNK_PASSES = int(_DEFAULTS["chunk_passes"].default)
MAX_ROWS = int(_DEFAULTS["max_rows"].default)


class _Encoder(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x).mean(1))[:, 0]


def _models() -> list[tuple[str, nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    out: list[tuple[str, nn.Module, torch.Tensor]] = [
        ("TransformerEncoder (B=4, L=8, d=16)", _Encoder(16).eval(), torch.randn(4, 8, 16)),
        ("TransformerEncoder (B=16, L=32, d=64)", _Encoder().eval(), torch.randn(16, 32, 64)),
    ]
    try:
        from attnuq_bench.models.ft import make_ft_transformer

        ft = make_ft_transformer(8, n_blocks=3, seed=0).eval()
        out.append(("FT-Transformer (B=64, 8 features, 3 blocks)", ft, torch.randn(64, 8)))
    except ImportError as exc:  # pragma: no cover - optional extra
        print(f"FT-Transformer skipped: {exc}", file=sys.stderr)
    return out


CLOCK = "thread"


def _time(fn: Callable[[], Any]) -> float:
    """Seconds of ``fn()``: CPU time of the calling thread (with one intra-op thread every kernel
    runs in it, so other processes on a loaded machine do not enter it), or wall time."""
    clock = time.thread_time if CLOCK == "thread" else time.perf_counter
    t0 = clock()
    fn()
    return clock() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="docs/benchmarks/predict.md")
    p.add_argument("--json", default="docs/benchmarks/predict.json")
    p.add_argument("--clock", choices=("thread", "wall"), default=None,
                   help="default: thread CPU time with --threads 1, else wall")
    p.add_argument("--chunk-passes", type=int, default=None,
                   help=f"passes per unit of predict (default: predict's, {CHUNK_PASSES})")
    args = p.parse_args(argv)
    if args.chunk_passes is not None and args.chunk_passes < 1:
        p.error(f"--chunk-passes must be >= 1, got {args.chunk_passes}")
    cp = CHUNK_PASSES if args.chunk_passes is None else args.chunk_passes
    torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = args.clock or ("thread" if args.threads == 1 else "wall")
    load0 = os.getloadavg()[0]
    info = run_info(sys.argv if argv is None else ["bench_predict_batched.py", *argv])
    rows: list[dict[str, Any]] = []
    for name, model, x in _models():
        def batched() -> Any:
            return predict(model, x, nu=NU, n_samples=S, chunk_passes=cp,  # noqa: B023
                           progress=False)

        def looped() -> Any:
            return predict(model, x, nu=NU, n_samples=S, batch_replicas=1,  # noqa: B023
                           chunk_passes=cp, progress=False)

        a, b = batched(), looped()  # warm-up, and both give (S, B, ...)
        assert a.samples.shape == b.samples.shape == (S, *a.frozen.shape)  # type: ignore[union-attr]
        # predict's units: chunks of CHUNK_EXAMPLES examples by cp passes, batched inside
        # (first unit)
        chunk = x[:CHUNK_EXAMPLES]
        _, widest = widest_output(model, chunk)
        reps = unit_replicas(int(chunk.shape[0]), min(S, cp), None, MAX_ROWS, CPU_MAX_ACTIVATION,
                             widest)
        tb, tl = [], []
        for i in range(args.repeats):  # pairs, in alternating order
            if i % 2 == 0:
                tb.append(_time(batched))
            tl.append(_time(looped))
            if i % 2 == 1:
                tb.append(_time(batched))
        mb, ml = statistics.median(tb), statistics.median(tl)
        pair = [lo / ba for ba, lo in zip(tb, tl, strict=True)]
        sp = statistics.median(pair)
        q = statistics.quantiles(pair, n=4, method="inclusive")
        rows.append({"model": name, "batched_s": mb, "looped_s": ml, "speedup": sp,
                     "speedup_iqr": [q[0], q[2]], "replicas_per_call": reps, "chunk_passes": cp,
                     "widest_output": widest, "batched_all": tb, "looped_all": tl})
        print(f"{name}: batched {mb * 1e3:.1f} ms ({reps} replicas per call), looped "
              f"{ml * 1e3:.1f} ms, speed-up {sp:.2f}x (IQR {q[0]:.2f}-{q[2]:.2f})")
    clock_text = ("CPU time of the calling thread (time.thread_time)" if CLOCK == "thread"
                  else "wall (time.perf_counter)")
    lines = [
        "# Batched vs looped Monte Carlo passes in `attnuq.predict`",
        "",
        f"* command: `{info['command']}`",
        f"* date: {info['date']}",
        f"* machine: {info['machine']}",
        f"* S = {S} passes at nu = {NU}; {args.repeats} pairs (batched, looped; the order "
        "alternates from pair to pair); speed-up = median over the pairs of looped / batched "
        "time (the pair's two calls run back to back, so a drift of the machine's speed "
        "cancels out), with the IQR of the per-pair speed-ups; times are medians, for scale. "
        "batched = `predict`'s default batching (the work cut into units of "
        f"{CHUNK_EXAMPLES} examples by {cp} passes; inside a unit its examples replicated up "
        "to the unit's passes per call, within `max_rows` rows and, on the CPU, "
        f"`max_activation` = {CPU_MAX_ACTIVATION} elements of the widest module output, "
        "measured in the frozen pass: the replicas per call of the first unit below), looped "
        "= S calls (`batch_replicas=1`).",
        f"* clock: {clock_text}; "
        f"1-min load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
        f"(on {os.cpu_count()} cores shared with other jobs).",
        "",
        "| model | widest module output (1 replica) | replicas per call | batched (ms) | "
        "looped (ms) | speed-up | speed-up IQR |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        lines.append(f"| {r['model']} | {r['widest_output']} | {r['replicas_per_call']} | "
                     f"{r['batched_s'] * 1e3:.1f} | {r['looped_s'] * 1e3:.1f} | "
                     f"{r['speedup']:.2f}x | {r['speedup_iqr'][0]:.2f}-"
                     f"{r['speedup_iqr'][1]:.2f} |")
    slower = [r["model"] for r in rows if r["speedup_iqr"][1] < 1.0]
    noisy = [r["model"] for r in rows if r["speedup"] < 1.0 <= r["speedup_iqr"][1]]
    lines += ["", "Target (issue #22): batched never slower than its loop. A model counts as "
              "slower when at least three pairs in four show the batched call slower (the upper "
              "quartile of the per-pair speed-ups below 1): on this machine two runs of the same "
              "call differ by several per cent, and with one replica per call the batched path "
              "makes exactly the loop's calls (plus one hooked frozen pass). "
              + ("**met** on every model" if not slower else
                 f"**NOT met** for {', '.join(slower)}")
              + (f"; median below 1 within the noise: {', '.join(noisy)}." if noisy else ".")]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, "\n".join(lines) + "\n")
    atomic_write_json(args.json, {"run": info, "rows": rows, "clock": CLOCK}, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
