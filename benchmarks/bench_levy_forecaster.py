"""Inference cost of the Levy forecaster's ``sigma_total`` (issue #36: "one pass, no extra cost").

Issue #36 added one output to :meth:`attnuq.models.levy_forecaster.LevyForecaster.forward`:
``sigma_total = sqrt((1 - p_empty) sigma^2 + p_empty s0_c^2)`` (the per-channel prior scale
``s0_c = softplus(raw_prior)[c_q]`` gathered per query, then a few element-wise operations per
query), on top of the same single ``levy_attention`` call. Its goal: stays/s within 10 % of the
forward without it. This script measures that on the PhysioNet suite's own test batches.

What each side computes (inference: ``eval()``, ``torch.no_grad()``, float32, CPU)
---------------------------------------------------------------------------------
* ``(a) forward`` -- ``LevyForecaster.forward`` as shipped: input checks, encoder, query map,
  keys / queries / output-space values, one ``levy_attention`` call (the compiled kernel on
  CPU), the per-query gathers of ``mu``, ``Sigma_V,cc``, ``sigma``, then ``p_empty``, ``s0_c`` and
  ``sigma_total``.
* ``(b) pre-#36 forward`` (the reference) -- :func:`forward_without_total`: the same model's
  pieces called in the same order (``_qka``, ``layer_params``, ``levy_attention``, the same
  gathers) with the two lines of ``sigma_total`` (``s0 = prior_std[c_q]`` and the root) left out:
  it returns ``mean``, ``sigma``, ``sigma_nophi``, ``evidence`` and ``p_empty``, which is the
  forward's output before issue #36. Before timing, the script checks that these five outputs
  equal (a)'s bit for bit on every batch (the same kernels on the same inputs), so (b) is (a)
  less ``sigma_total`` and nothing else.
* ``(c) softmax control`` -- ``SoftmaxForecaster.forward`` (same encoder, query and value maps,
  softmax attention, no spread), for scale only.

Each repeat times one pass over every test batch with each side, back to back, (a) and (b) in
alternating order, then (c); stays/s = test stays / median pass time; the ratio is the median
of the per-repeat ratios stays/s(a) / stays/s(b) (= time(b) / time(a) of the same repeat), with
its interquartile range. Target (issue #36): ``stays/s (a) >= 0.9 x stays/s (b)``.

Clock: with ``--threads 1`` (default) the CPU time of the calling thread (``time.thread_time``;
with one intra-op thread every kernel runs in it), so other processes on a loaded machine do
not enter the times; else wall time.

Data and model: the PhysioNet 2012 test split of the suite (``load_physionet2012``, split seed
0, optionally ``--max-stays`` as the suite subsamples), in batches of 64 stays grouped by length
(``ds.batches(test, 64, by_length=True)``, as the suite scores them), so the observations per
stay in ``[0, 24]`` h and the forecast queries per stay in ``(24, 48]`` h are the real ones;
``d = 32``, no encoder layer, dropout 0.1 (the suite's defaults), 40 channels (the data's).
Weights: random (``torch.manual_seed(0)``) by default. Inference time does not depend on the
weights' values: the kernel does the same work for every observed entry and query whatever the
scores are (no early exit, no data-dependent sparsity; only ``phi(Lambda)``, once per query,
takes one of a few short branches by the range of ``Lambda``); ``--levy-checkpoint`` /
``--softmax-checkpoint`` (the suite's cached ``{"state", "info"}`` files) add the same rows with
trained weights, to show it.

Usage::

    .venv/bin/python benchmarks/bench_levy_forecaster.py [--repeats 15] [--threads 1]
        [--data-dir /work/shared/data] [--levy-checkpoint PATH --softmax-checkpoint PATH]
        [--out docs/benchmarks/levy_forecaster.md] [--json ...json] [--png ...png]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnuq._io import atomic_savefig, atomic_write_json, atomic_write_text
from attnuq._runtime import run_info
from attnuq.models.levy_forecaster import (
    ForecastOutput,
    LevyForecaster,
    SoftmaxForecaster,
    _safe_sqrt,
)
from attnuq.ops import _native
from attnuq.ops.levy import levy_attention

#: issue #36: stays/s with sigma_total at least this fraction of stays/s without it
TARGET = 0.9
#: the outputs the forward had before issue #36 (all of them equal in (a) and (b))
PRE36_FIELDS = ("mean", "sigma", "sigma_nophi", "evidence", "p_empty")
# the clock of the timings ("thread": time.thread_time, "wall": time.perf_counter)
CLOCK = "thread"
#: repetitions of the sigma_total lines per timing (they take well under a millisecond a pass)
INNER = 20


def forward_without_total(
    model: LevyForecaster,
    obs_times: torch.Tensor,
    obs_channels: torch.Tensor,
    obs_values: torch.Tensor,
    obs_mask: torch.Tensor,
    query_times: torch.Tensor,
    query_channels: torch.Tensor,
) -> ForecastOutput:
    """(b): ``LevyForecaster.forward``'s pieces without the ``sigma_total`` lines (the pre-#36
    output: ``mean``, ``sigma``, ``sigma_nophi``, ``evidence``, ``p_empty``)."""
    q, k, a = model._qka(
        obs_times, obs_channels, obs_values, obs_mask, query_times, query_channels
    )
    lp = model.layer_params()
    res = levy_attention(
        q, k, a, torch.where(obs_mask, obs_times, 0), obs_mask, alpha=lp["alpha"],
        beta=lp["beta"], h=lp["h"], omega=lp["omega"], phase=lp["phase"], D=lp["D"],
    )
    if res.var is None or res.sigma_dim is None:
        raise RuntimeError("levy_attention returned no per-dimension variance")
    idx = query_channels[..., None]  # (B, Q, 1)
    mu = res.mean[:, 0].gather(-1, idx)[..., 0] + model.backbone.bias[query_channels]
    var = res.var[:, 0].gather(-1, idx)[..., 0].clamp_min(0)  # Sigma_V,cc  (B, Q)
    sd_nophi = _safe_sqrt(var)
    sigma = res.sigma_dim[:, 0].gather(-1, idx)[..., 0]
    return ForecastOutput(mean=mu, sigma=sigma, sigma_nophi=sd_nophi,
                          evidence=res.evidence[:, 0], p_empty=res.p_empty[:, 0])


def _inputs(b: Any) -> tuple[torch.Tensor, ...]:
    return (b.obs_times, b.obs_channels, b.obs_values, b.obs_mask, b.query_times,
            b.query_channels)


def load_batches(data_dir: str | None, cache_dir: str | None, max_stays: int | None,
                 batch_size: int) -> tuple[list[Any], dict[str, Any]]:
    """The suite's test batches and a description of their sizes."""
    from attnuq_bench.data.physionet import load_physionet2012
    from attnuq_bench.suites.physionet import data_source

    src = data_source(data_dir)
    if not src.exists():
        raise SystemExit(f"no PhysioNet 2012 data at {src} (--data-dir {data_dir!r})")
    ds = load_physionet2012(src, cache_dir=cache_dir, errors="warn", seed=0)
    splits = {k: ds.split_indices(k) for k in ("train", "val", "test")}
    if max_stays:  # as the suite's --max-stays (same generator and order)
        rng = np.random.default_rng(12345)
        splits = {k: np.sort(rng.choice(v, min(len(v), max_stays), replace=False))
                  for k, v in splits.items()}
    te = splits["test"]
    bs = list(ds.batches(te, batch_size, by_length=True))
    n_obs = np.concatenate([b.obs_mask.sum(1).numpy() for b in bs])
    n_q = np.concatenate([b.query_mask.sum(1).numpy() for b in bs])
    shape = {
        "source": src.name, "n_channels": ds.n_channels, "test_stays": len(te),
        "batch_size": batch_size, "batches": len(bs),
        "obs_per_stay_median": float(np.median(n_obs)), "obs_per_stay_max": int(n_obs.max()),
        "queries_per_stay_median": float(np.median(n_q)), "queries_per_stay_max": int(n_q.max()),
        "observations": int(n_obs.sum()), "queries": int(n_q.sum()),
        "padded_L_per_batch": [int(b.obs_mask.shape[1]) for b in bs],
        "padded_Q_per_batch": [int(b.query_mask.shape[1]) for b in bs],
    }
    return bs, shape


def _load(model: torch.nn.Module, path: str | None) -> str:
    if path is None:
        return "random (torch.manual_seed(0))"
    blob = torch.load(path, weights_only=False, map_location="cpu")
    if not (isinstance(blob, dict) and isinstance(blob.get("state"), dict)):
        raise SystemExit(f"{path} is not a suite checkpoint ({{'state', 'info'}})")
    model.load_state_dict(blob["state"])
    return f"trained ({path})"


def build_models(n_channels: int, args: argparse.Namespace, trained: bool
                 ) -> tuple[LevyForecaster, SoftmaxForecaster, str]:
    kw = {"d": args.d, "encoder_layers": args.encoder_layers, "dropout": args.dropout}
    torch.manual_seed(0)
    levy = LevyForecaster(n_channels, **kw)
    torch.manual_seed(0)
    ctrl = SoftmaxForecaster(n_channels, **kw)
    lw = _load(levy, args.levy_checkpoint if trained else None)
    cw = _load(ctrl, args.softmax_checkpoint if trained else None)
    return levy.eval(), ctrl.eval(), f"Levy: {lw}; control: {cw}"


def short_label(label: str) -> str:
    """``random`` or ``trained`` (the table's first column; the JSON keeps the paths)."""
    return "trained" if "trained (" in label else "random"


def check_pre36(levy: LevyForecaster, bs: Sequence[Any]) -> None:
    """(b)'s outputs equal (a)'s on every batch (else (b) is not (a) less sigma_total)."""
    with torch.no_grad():
        for b in bs:
            full, ref = levy(*_inputs(b)), forward_without_total(levy, *_inputs(b))
            for f in PRE36_FIELDS:
                if not torch.equal(getattr(full, f), getattr(ref, f)):
                    raise RuntimeError(f"(b) differs from (a) in {f}: not the same pieces")
            if ref.sigma_total is not None or full.sigma_total is None:
                raise RuntimeError("(a) must return sigma_total and (b) must not")


def _time(fn: Callable[[], Any]) -> float:
    clock = time.thread_time if CLOCK == "thread" else time.perf_counter
    t0 = clock()
    fn()
    return clock() - t0


def measure(levy: LevyForecaster, ctrl: SoftmaxForecaster, bs: Sequence[Any], repeats: int,
            label: str) -> dict[str, Any]:
    """Paired, interleaved passes over ``bs``; stays/s, ratio (a)/(b) and its IQR."""
    from tqdm import tqdm

    @torch.no_grad()
    def a() -> None:
        for b in bs:
            levy(*_inputs(b))

    @torch.no_grad()
    def b_() -> None:
        for b in bs:
            forward_without_total(levy, *_inputs(b))

    @torch.no_grad()
    def c() -> None:
        for b in bs:
            ctrl(*_inputs(b))

    # the two sigma_total lines alone, on each batch's stored (b) outputs, repeated INNER times
    # per timing (the clock's resolution): an upper bound on (a) - (b) without the pass's noise
    held: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for b in bs:
            o = forward_without_total(levy, *_inputs(b))
            if o.p_empty is None or o.sigma is None:
                raise RuntimeError("(b) returned no p_empty or sigma")
            held.append((o.p_empty, o.sigma, b.query_channels))

    @torch.no_grad()
    def total_lines() -> None:
        for _ in range(INNER):
            for p0, sigma, qc in held:
                s0 = levy.prior_std[qc]
                _safe_sqrt((1 - p0) * sigma**2 + p0 * s0**2)

    a(), b_(), c(), total_lines()  # warm-up (kernel build, allocator)
    tl: list[float] = []
    ta: list[float] = []
    tb: list[float] = []
    tc: list[float] = []
    for i in tqdm(range(repeats), desc=label, file=sys.stderr):
        if i % 2 == 0:
            ta.append(_time(a))
            tb.append(_time(b_))
        else:
            tb.append(_time(b_))
            ta.append(_time(a))
        tc.append(_time(c))
        tl.append(_time(total_lines) / INNER)
    n = sum(int(b.obs_times.shape[0]) for b in bs)
    nq = sum(int(b.query_mask.sum()) for b in bs)
    r_ab = [y / x for x, y in zip(ta, tb, strict=True)]  # stays/s (a) / stays/s (b)
    r_cb = [y / x for x, y in zip(tc, tb, strict=True)]
    q = lambda v, p: float(np.quantile(v, p))  # noqa: E731
    return {
        "weights": label, "repeats": repeats, "stays": n,
        "stays_per_s": {k: n / statistics.median(t) for k, t in
                        (("a", ta), ("b", tb), ("c", tc))},
        "ms_per_pass": {k: 1e3 * statistics.median(t) for k, t in
                        (("a", ta), ("b", tb), ("c", tc))},
        "ratio_ab": statistics.median(r_ab), "ratio_ab_q25": q(r_ab, 0.25),
        "ratio_ab_q75": q(r_ab, 0.75),
        "ratio_cb": statistics.median(r_cb),
        "extra_us_per_query": 1e6 * statistics.median(
            [(x - y) / nq for x, y in zip(ta, tb, strict=True)]),
        "lines_ms_per_pass": 1e3 * statistics.median(tl),
        "lines_fraction_of_b": statistics.median(tl) / statistics.median(tb),
        "met": statistics.median(r_ab) >= TARGET,
        "times_s": {"a": ta, "b": tb, "c": tc, "lines": tl},
    }


def render(info: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """Markdown page from one run's record (every number from the run)."""
    s = info["shape"]
    lines = [
        "# Levy forecaster: inference cost of sigma_total (issue #36)",
        "",
        f"* command: `{info['command']}`",
        f"* date: {info['date']}",
        f"* machine: {info['machine']}; Levy kernel: {info['kernel']}",
        f"* load: {info['load']}",
        f"* clock: {info['clock']}",
        "",
        f"Data: the PhysioNet suite's test split ({s['test_stays']} stays of `{s['source']}`, "
        f"{s['n_channels']} channels) in {s['batches']} batches of {s['batch_size']} stays "
        f"grouped by length, as the suite scores them: observations per stay in [0, 24] h "
        f"median {s['obs_per_stay_median']:g} (max {s['obs_per_stay_max']}), forecast queries "
        f"per stay in (24, 48] h median {s['queries_per_stay_median']:g} (max "
        f"{s['queries_per_stay_max']}); {s['observations']} observations and {s['queries']} "
        f"queries in all. Models: d = {info['model']['d']}, encoder layers "
        f"{info['model']['encoder_layers']}, dropout {info['model']['dropout']} (the suite's "
        "settings), `eval()`, `torch.no_grad()`, float32, CPU.",
        "",
        "Sides: **(a)** `LevyForecaster.forward` as shipped (mean, sigma and sigma_total); "
        "**(b)** the same model's pieces called in the same order without the two sigma_total "
        "lines (`forward_without_total` in the script: the pre-#36 output, checked bit-equal to "
        f"(a) in {', '.join(PRE36_FIELDS)} on every batch before timing); **(c)** the softmax "
        "control `SoftmaxForecaster` (for scale). One pass = every test batch once; each repeat "
        "times (a) and (b) back to back in alternating order, then (c). stays/s = stays / "
        "median pass time; ratio = median over repeats of stays/s (a) / stays/s (b) in the "
        "same repeat, with its interquartile range.",
        "",
        *([f"![stays/s of this run]({info['png']})", ""] if info.get("png") else []),
        "| weights | repeats | (a) stays/s | (b) pre-#36 stays/s | (c) softmax stays/s | "
        "(a) / (b) | IQR | (a) - (b) per query (us) | sigma_total lines alone, ms per pass "
        "(share of (b)) | (c) / (b) | target (a) >= 0.9 x (b) |",
        "|---|---:|---:|---:|---:|---:|---|---:|---|---:|---|",
    ]
    for r in rows:
        sp = r["stays_per_s"]
        lines.append(
            f"| {short_label(r['weights'])} | {r['repeats']} | {sp['a']:.1f} | {sp['b']:.1f} | "
            f"{sp['c']:.1f} | {r['ratio_ab']:.3f} | {r['ratio_ab_q25']:.3f}-"
            f"{r['ratio_ab_q75']:.3f} | {r['extra_us_per_query']:.3f} | "
            f"{r['lines_ms_per_pass']:.3f} ({100 * r['lines_fraction_of_b']:.3f} %) | "
            f"{r['ratio_cb']:.3f} | " + ("met" if r["met"] else "**NOT met**") + " |")
    lines += ["", *(f"* {short_label(r['weights'])}: {r['weights']}" for r in rows), "",
              "The column *sigma_total lines alone* times the two lines that (a) runs and (b) "
              f"does not (`s0 = prior_std[c_q]` and the root), {INNER} times per timing on "
              "each batch's stored outputs: the cost the ratio (a) / (b) measures, without the "
              "pass-to-pass noise of the whole forward that its IQR shows. (a) / (b) is the "
              "median of the per-repeat ratios, not the ratio of the two median stays/s columns; "
              "they differ by that noise."]
    main_row = rows[0]
    lines += [
        "",
        f"**Issue #36, one pass at no extra cost:** stays/s with sigma_total / without = "
        f"{main_row['ratio_ab']:.3f} (IQR {main_row['ratio_ab_q25']:.3f}-"
        f"{main_row['ratio_ab_q75']:.3f}; target >= {TARGET}) -> "
        + ("**met**." if main_row["met"] else "**NOT met**."),
        "",
        "Weights: the first row uses random weights. The forward's work does not depend on "
        "their values (the kernel visits every observed entry for every query, with no early "
        "exit or data-dependent sparsity; only phi(Lambda), once per query, branches on the "
        "range of Lambda; sigma_total is element-wise)"
        + (", and the row with trained weights (the suite's cached checkpoints) shows it."
           if len(rows) > 1 else "; `--levy-checkpoint` / `--softmax-checkpoint` add a row "
           "with trained weights."),
        "",
        "The absolute stays/s depend on the machine and its load (the clock above takes out "
        "most of the other processes' share); the ratio pairs (a) and (b) repeat by repeat. "
        "The PhysioNet page's in-run stays/s (taken at different moments of a long training "
        "run on a shared machine, with the results gathered and concatenated) are context, "
        "not this measurement.",
        "",
    ]
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Bars of stays/s per side and weight set, the target line at 0.9 x (b)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 1.2 + 1.1 * len(rows)))
    names = [("a", "(a) forward (with sigma_total)"), ("b", "(b) pre-#36 forward"),
             ("c", "(c) softmax control")]
    colours = {"a": "tab:blue", "b": "tab:grey", "c": "tab:orange"}
    y = 0.0
    ticks, labels = [], []
    for r in rows:
        for k, lab in names:
            v = r["stays_per_s"][k]
            ax.barh(y, v, color=colours[k], label=lab if r is rows[0] else None)
            ax.text(v, y, f" {v:.0f}", va="center", fontsize=7)
            ticks.append(y)
            labels.append(f"{short_label(r['weights'])}: {k}")
            y -= 1
        ax.plot([TARGET * r["stays_per_s"]["b"]] * 2, [y + 3.5, y + 0.5], color="black",
                ls="--", lw=1, label="target 0.9 x (b)" if r is rows[0] else None)
        y -= 0.6
    ax.set_yticks(ticks, labels, fontsize=7)
    ax.set_xlabel("test stays per second (1 thread)")
    ax.set_title(f"Levy forecaster inference, ratio (a)/(b) = {rows[0]['ratio_ab']:.3f}",
                 fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--trained-repeats", type=int, default=7,
                    help="repeats of the trained-weights row (with the checkpoints)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("thread", "wall"), default=None,
                    help="clock (default: thread CPU time with --threads 1, else wall)")
    ap.add_argument("--data-dir", default=None, help="as `attnuq bench physionet --data-dir`")
    ap.add_argument("--cache-dir", default=None, help="parsed-array cache of the data")
    ap.add_argument("--max-stays", type=int, default=None,
                    help="as the suite's --max-stays (subsample each split)")
    ap.add_argument("--batch-size", type=int, default=64,
                    help="stays per batch (the suite scores in batches of 64)")
    ap.add_argument("--d", type=int, default=32)
    ap.add_argument("--encoder-layers", type=int, default=0)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--levy-checkpoint", default=None,
                    help="a suite checkpoint of the Levy model: adds a trained-weights row")
    ap.add_argument("--softmax-checkpoint", default=None,
                    help="a suite checkpoint of the softmax control (with --levy-checkpoint)")
    ap.add_argument("--out", default="docs/benchmarks/levy_forecaster.md")
    ap.add_argument("--json", default="docs/benchmarks/levy_forecaster.json")
    ap.add_argument("--png", default="docs/benchmarks/levy_forecaster.png")
    args = ap.parse_args(argv)
    for name in ("repeats", "trained_repeats", "threads", "batch_size", "d"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if (args.levy_checkpoint is None) != (args.softmax_checkpoint is None):
        ap.error("--levy-checkpoint and --softmax-checkpoint go together")
    torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = args.clock or ("thread" if args.threads == 1 else "wall")
    info = run_info([".venv/bin/python", "benchmarks/bench_levy_forecaster.py",
                     *(sys.argv[1:] if argv is None else argv)])
    info["kernel"] = str(_native.status()["reason"]).split(": /")[0]
    info["clock"] = (
        "CPU time of the calling thread (time.thread_time; with 1 intra-op thread every kernel "
        "runs in it), so that other processes on the loaded machine do not enter the times"
        if CLOCK == "thread" else "wall (time.perf_counter)")
    info["model"] = {"d": args.d, "encoder_layers": args.encoder_layers,
                     "dropout": args.dropout}
    info["target"] = f"stays/s (a) >= {TARGET} x stays/s (b)"
    bs, info["shape"] = load_batches(args.data_dir, args.cache_dir, args.max_stays,
                                     args.batch_size)
    load0 = os.getloadavg()[0]
    rows = []
    sets = [(False, args.repeats)] + ([(True, args.trained_repeats)]
                                      if args.levy_checkpoint else [])
    for trained, reps in sets:
        levy, ctrl, label = build_models(info["shape"]["n_channels"], args, trained)
        check_pre36(levy, bs)
        rows.append(measure(levy, ctrl, bs, reps, label))
        r = rows[-1]
        print(f"{label}: stays/s a {r['stays_per_s']['a']:.1f} b {r['stays_per_s']['b']:.1f} "
              f"c {r['stays_per_s']['c']:.1f}; a/b {r['ratio_ab']:.4f} "
              f"(IQR {r['ratio_ab_q25']:.4f}-{r['ratio_ab_q75']:.4f})", flush=True)
    info["load"] = (f"1-min load average {load0:.1f} before the timings, "
                    f"{os.getloadavg()[0]:.1f} after (on {os.cpu_count()} cores, shared)")
    info["png"] = Path(os.path.relpath(args.png, Path(args.out).parent)).as_posix()
    for p in (args.out, args.json, args.png):
        Path(p).parent.mkdir(parents=True, exist_ok=True)
    text = render(info, rows)
    atomic_write_text(args.out, text)
    atomic_write_json(args.json, {**info, "rows": rows, "ratio": rows[0]["ratio_ab"],
                                  "ratio_q25": rows[0]["ratio_ab_q25"],
                                  "ratio_q75": rows[0]["ratio_ab_q75"],
                                  "met": rows[0]["met"]}, indent=1)
    plot(rows, Path(args.png))
    print(text)


if __name__ == "__main__":
    main()
