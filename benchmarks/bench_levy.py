"""Cost of Levy attention's single-pass mean + uncertainty (issue 6 targets).

Setting (from the issue): B=32 series, 256 observations each (about 15 % padding), 64 query
times, 4 heads, d_model=64, 41 channels (PhysioNet-like), float32, CPU.

Compared, each timed alternately with its reference so that machine-load drifts hit both:

* ``levy module`` -- ``LevyAttention.forward`` (embeddings + mean, evidence, var, sigma) against a
  matched softmax cross-attention: the *same* module's query/key/value embeddings followed by
  ``F.scaled_dot_product_attention`` with the key-padding mask (scaled dot product, no
  uncertainty). Target: ratio <= 1.3.
* ``levy op`` -- the functional ``levy_attention(q, k, a, ...)`` against
  ``F.scaled_dot_product_attention(q, k, a)`` on the same precomputed tensors (informational:
  here the attention itself is tiny, so the fixed per-observation work of the value field shows).
* ``50 draws`` -- the same variance estimated from 50 explicit draws of the Poisson random
  measure (``LevyAttention.sample(num_samples=50)`` then the variance over draws) against the
  closed form. Target: >= 20x slower than the closed form.
* ``train step`` -- forward + backward of ``mean.sum() + sigma.sum()`` against the softmax
  reference's ``mean.sum()`` (informational).

Rows are repeated for ``n_fourier`` = 8 (the module default) and 0 (no ``D g(t)`` term).

Usage::

    .venv/bin/python benchmarks/bench_levy.py [--repeats 21] [--threads 1]
        [--out docs/benchmarks/levy.md] [--json docs/benchmarks/levy.json]
"""

from __future__ import annotations

import argparse
import datetime as _dt
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

from attnuq.nn import LevyAttention
from attnuq.ops import levy_attention

B, N, Q, H, D_MODEL, C = 32, 256, 64, 4, 64, 41


def make_data(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n_obs = torch.randint(int(0.7 * N), N + 1, (B,), generator=g)
    mask = torch.arange(N)[None, :] < n_obs[:, None]
    times = torch.rand(B, N, generator=g).sort(-1).values * 24.0
    return {
        "times": times,
        "channels": torch.randint(0, C, (B, N), generator=g),
        "values": torch.randn(B, N, generator=g),
        "mask": mask,
        "query_times": 24.0 + torch.rand(B, Q, generator=g) * 24.0,
        "query_channels": torch.randint(0, C, (B, Q), generator=g),
    }


def softmax_reference(layer: LevyAttention, x: dict[str, torch.Tensor]) -> torch.Tensor:
    """Matched softmax cross-attention: same embeddings, SDPA, heads concatenated."""
    times, channels, values, qc = layer._check(
        x["times"], x["channels"], x["values"], x["mask"], x["query_times"], x["query_channels"]
    )
    q, k, a = layer._embed(times, channels, values, x["query_times"], qc)
    out = F.scaled_dot_product_attention(q, k, a, attn_mask=x["mask"][:, None, None, :])
    return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)


def sampled_variance(layer: LevyAttention, x: dict[str, torch.Tensor], s: int) -> torch.Tensor:
    """Per-dimension variance of the layer output from ``s`` explicit draws."""
    smp, _ = layer.sample(**x, num_samples=s)
    return smp.var(0)


def time_pair(
    f: Callable[[], Any], g: Callable[[], Any], repeats: int
) -> tuple[float, float, float]:
    """Alternate f, g; return (median f, median g, median of per-pair ratios f/g) in seconds."""
    f()
    g()
    tf, tg, ratios = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        t1 = time.perf_counter()
        g()
        t2 = time.perf_counter()
        tf.append(t1 - t0)
        tg.append(t2 - t1)
        ratios.append((t1 - t0) / (t2 - t1))
    return statistics.median(tf), statistics.median(tg), statistics.median(ratios)


def run(repeats: int, draws_repeats: int) -> list[dict[str, Any]]:
    x = make_data()
    rows: list[dict[str, Any]] = []
    for n_fourier in (8, 0):
        rows += run_config(n_fourier, x, repeats, draws_repeats)
    return rows


def run_config(
    n_fourier: int, x: dict[str, torch.Tensor], repeats: int, draws_repeats: int
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    torch.manual_seed(0)
    layer = LevyAttention(C, D_MODEL, H, n_fourier=n_fourier).eval()
    tag = f"K={n_fourier}"

    with torch.no_grad():
        tl, ts, r = time_pair(lambda: layer(**x), lambda: softmax_reference(layer, x), repeats)
    rows.append({"case": f"levy module (mean, sigma, per-dim var) vs softmax ({tag})",
                 "levy_ms": tl * 1e3, "ref_ms": ts * 1e3, "ratio": r, "target": "<= 1.3",
                 "met": r <= 1.3})
    layer.per_dim = False
    with torch.no_grad():
        tl, ts, r = time_pair(lambda: layer(**x), lambda: softmax_reference(layer, x), repeats)
    layer.per_dim = True
    rows.append({"case": f"levy module (mean, sigma; per_dim=False) vs softmax ({tag})",
                 "levy_ms": tl * 1e3, "ref_ms": ts * 1e3, "ratio": r, "target": "<= 1.3",
                 "met": r <= 1.3})

    with torch.no_grad():
        times, channels, values, qc = layer._check(
            x["times"], x["channels"], x["values"], x["mask"], x["query_times"],
            x["query_channels"],
        )
        q, k, a = layer._embed(times, channels, values, x["query_times"], qc)
        kw = {"alpha": layer.alpha, "beta": layer.beta, "h": layer.h, "omega": layer.omega,
              "phase": layer.phase, "D": layer.D}
        m4 = x["mask"][:, None, None, :]
        tl, ts, r = time_pair(
            lambda: levy_attention(q, k, a, times, x["mask"], **kw),  # type: ignore[arg-type]
            lambda: F.scaled_dot_product_attention(q, k, a, attn_mask=m4),
            repeats,
        )
    rows.append({"case": f"levy op vs SDPA op ({tag})", "levy_ms": tl * 1e3,
                 "ref_ms": ts * 1e3, "ratio": r, "target": "(info)", "met": None})

    with torch.no_grad():
        td, tl, r = time_pair(
            lambda: sampled_variance(layer, x, 50), lambda: layer(**x), draws_repeats
        )
    rows.append({"case": f"50 explicit draws vs closed form ({tag})", "levy_ms": tl * 1e3,
                 "ref_ms": td * 1e3, "ratio": r, "target": ">= 20 (draws / closed form)",
                 "met": r >= 20})

    def train_levy() -> None:
        layer.zero_grad(set_to_none=True)
        out = layer(**x)
        (out.mean.sum() + out.sigma.sum()).backward()

    def train_ref() -> None:
        layer.zero_grad(set_to_none=True)
        softmax_reference(layer, x).sum().backward()

    tl, ts, r = time_pair(train_levy, train_ref, max(5, repeats // 2))
    rows.append({"case": f"train step fwd+bwd vs softmax ({tag})", "levy_ms": tl * 1e3,
                 "ref_ms": ts * 1e3, "ratio": r, "target": "(info)", "met": None})
    for row in rows:
        print(f"{row['case']:62s} levy {row['levy_ms']:9.2f} ms  ref {row['ref_ms']:9.2f} ms"
              f"  ratio {row['ratio']:7.2f}  target {row['target']}", flush=True)
    return rows


def machine_line() -> str:
    return (f"{platform.platform()}, {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} CPUs, torch {torch.__version__}, "
            f"{torch.get_num_threads()} torch thread(s), "
            f"load average {os.getloadavg()[0]:.1f} at start")


NOTES = """\
## Reading the numbers

* The 1.3x target for mean + uncertainty against a matched softmax cross-attention is **not
  met** on this machine. What remains after the work described below is memory-bound
  elementwise work around the attention kernel (building the widened query/key/value blocks,
  the value field's ``K^2`` time-feature products, ``phi``), which a fused kernel would remove.
* How the closed form is computed (``attnuq.ops.levy_attention``, ``backend="sdpa"``): one fused
  ``F.scaled_dot_product_attention`` call per block of 256 observations with a sentinel key that
  recovers the softmax normaliser (the evidence), values ``[1, v - ref, (v - ref)^2 + s]`` so
  that mean, second moment and evidence come out of the same pass. The fused CPU kernel needs
  equal query/key/value widths, so queries and keys are zero-padded to the value width
  (``2 Dv + 1`` with per-dimension variances, ``Dv + 2`` with ``per_dim=False``).
* ``K`` is ``n_fourier``, the number of Fourier time features of the value field. Its
  within-atom variance costs ``O(N K^2 Dv)`` per series (independent of the number of queries),
  which at ``K = 8`` is of the same order as the attention itself; ``K = 0`` removes it.
* The machine was heavily oversubscribed while this ran (see the load average in the machine
  line: other jobs shared the 2 cores), which inflates memory-bound operations more than the
  fused kernel; both sides of each ratio were timed alternately to share the load, but the
  absolute times are noisy.
* The sampler rows are an honest explicit draw of the Poisson random measure (atom counts, an
  observation and a Gaussian-jittered time per atom, the value field at each atom), vectorised
  over draws; its cost grows with the number of atoms (``Lambda`` per query), not with 50 alone.
"""


def render(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """Markdown report from one run's metadata and rows (numbers only from the run)."""
    lines = [
        "# Levy attention: cost of single-pass mean + uncertainty",
        "",
        f"Command: `{meta['command']}`  ",
        f"Date: {meta['date']}  ",
        f"Machine: {meta['machine']}",
        "",
        f"Setting: B={B}, N={N} observations (70-100 % observed), Q={Q} queries, H={H} heads, "
        f"d_model={D_MODEL}, {C} channels, float32. Times are medians over alternating runs; "
        "`ratio` is the median of per-pair ratios (levy / reference, or draws / closed form).",
        "",
        "| case | Levy / closed form (ms) | reference (ms) | ratio | target | met |",
        "|---|---:|---:|---:|---|---|",
    ]
    for r in rows:
        met = "" if r["met"] is None else ("yes" if r["met"] else "**no**")
        lines.append(f"| {r['case']} | {r['levy_ms']:.2f} | {r['ref_ms']:.2f} | "
                     f"{r['ratio']:.2f} | {r['target']} | {met} |")
    lines += [
        "",
        "For the `50 explicit draws` rows the reference column is the sampler and the ratio is "
        "sampler time / closed-form time.",
        "",
        NOTES,
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--draws-repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/levy.md"))
    ap.add_argument("--json", type=Path, default=Path("docs/benchmarks/levy.json"))
    ap.add_argument("--render-only", action="store_true",
                    help="re-render --out from the rows already stored in --json (no timing)")
    args = ap.parse_args()
    if args.render_only:
        data = json.loads(args.json.read_text())
        args.out.write_text(render(data, data["rows"]))
        print(f"re-rendered {args.out} from {args.json}")
        return
    torch.set_num_threads(args.threads)
    machine = machine_line()
    cmd = "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(machine, flush=True)
    rows = run(args.repeats, args.draws_repeats)
    meta = {"command": cmd, "date": date, "machine": machine}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(meta, rows))
    args.json.write_text(json.dumps({**meta, "rows": rows}, indent=2))
    print(f"wrote {args.out} and {args.json}")


if __name__ == "__main__":
    main()
