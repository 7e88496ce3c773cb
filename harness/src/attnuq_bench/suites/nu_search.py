"""``attnuq bench calibration``: Bayesian optimisation against the grid for choosing ``nu``.

For every benchmark model, criterion (``paper``, ``scale``, ``crps``, ``coverage``) and seed,
:func:`attnuq.calibrate` runs once with ``search="grid"`` (the reference: a log-spaced integer
grid over ``nu_range``) and once with ``search="bo"`` (the log-linear surrogate), on the same
held-out calibration set and with the same seed, so both see identical draws at a shared ``nu``.

Reported per run: the grid's choice and its noise band (every grid ``nu`` within 2 paired
standard errors of the grid minimum), BO's choice, whether BO *lands in the band* -- BO's nu is
the grid's choice, or BO's measured objective exceeds the grid minimum by at most 2 standard
errors of the paired difference (same examples) --, and the forward passes (passes over the
calibration set: 1 frozen + ``n_passes`` per evaluated ``nu``) of both. Target: in band with at
most a third of the grid's passes.

Models (trained here in seconds, deterministic seeds):

* ``uniform-mha``: one attention head with uniform weights over Hadamard value rows; the
  perturbation law is exact (``Cov = c^2/nu I``) and the scale/CRPS/coverage optimum is
  ``nu* = c^2/sigma^2 = 36`` (a check with a known answer);
* ``encoder``: a 2-layer ``nn.TransformerEncoder`` regressor (d=32, 4 heads, CLS-token
  readout) trained on a synthetic sequence-regression task with heteroscedastic noise;
* ``ft-concrete``: an FT-Transformer (rtdl, 1 block) trained on UCI concrete, split 0
  (calibrated on the ``val`` part), when the data and ``rtdl_revisiting_models`` are available.

The criteria are the calibration registry's (:data:`attnuq.calibration.CRITERIA`). Runs on the
bench spine: one JSON per (model, criterion, seed) item under ``<out>/runs/<model>/`` (reused
when the settings that shape it match, so an interrupted run resumes; a model whose extras or
data are missing is skipped and named on the page), the model's build record
``runs/<model>/model.json``, one report JSON per search under ``<out>/reports/``, then
``<out>/results.json`` (every row, the settings, the models), calibration curves
``<out>/<model>_<criterion>.png`` and the table ``--table`` (default ``<out>.md``) with its JSON
twin, written by :func:`render_page` from ``results.json`` (``--render-only``: only that).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from attnuq._io import atomic_savefig, atomic_write_json, read_json_or_none
from attnuq.calibration import CRITERIA, get_criterion
from attnuq.distributed import is_writer
from attnuq_bench.suites import register
from attnuq_bench.suites._page import Page, Table, twin_path
from attnuq_bench.suites._runner import Group, RunStore, SkipGroup, reuse_key, run_items

__all__ = ["MODELS", "build_model", "render_page", "run"]

MODELS = ("uniform-mha", "encoder", "ft-concrete")

Data = list[tuple[Any, torch.Tensor]]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS,
                   help="benchmark models to calibrate")
    p.add_argument("--criteria", nargs="+", default=list(CRITERIA), choices=CRITERIA,
                   help="calibration criteria to compare")
    p.add_argument(
        "--seeds", type=int, default=3,
        help="number of calibration seeds: SEED..SEED+N-1 (default 3)",
    )
    p.add_argument("--n-passes", type=int, default=10, help="M passes per evaluation")
    p.add_argument("--nu-max", type=int, default=1024, help="nu_range = (1, NU_MAX)")
    p.add_argument("--grid-size", type=int, default=21, help="log-spaced grid points")
    p.add_argument("--max-evals", type=int, default=6, help="BO evaluation budget")
    p.add_argument("--data-dir", default=None,
                   help="data folder for UCI concrete (default: $ATTNUQ_DATA_DIR, else "
                        "../shared/data)")
    p.add_argument("--out", default="docs/results/calibration", help="results folder")
    p.add_argument("--table", default=None, help="markdown table (default: <out>.md)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--render-only", action="store_true",
                   help="only write the table again from <out>/results.json")


# --------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------
def _hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


class _UniformMHA(nn.Module):
    def __init__(self, e: int) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(e, 1, bias=False, batch_first=True)
        with torch.no_grad():
            w = torch.cat([torch.zeros(e, e), torch.eye(e), torch.eye(e)])  # q = 0: uniform
            self.mha.in_proj_weight.copy_(w)
            self.mha.out_proj.weight.copy_(torch.eye(e))

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        q = torch.zeros(v.shape[0], 1, v.shape[2], dtype=v.dtype)
        return self.mha(q, v, v, need_weights=False)[0][:, 0]


def _uniform_mha(seed: int = 0) -> tuple[nn.Module, Data, dict[str, Any]]:
    n, length, e, c, sigma = 512, 32, 8, 6.0, 1.0
    g = torch.Generator().manual_seed(seed)
    h = _hadamard(length)[:, 1 : e + 1]
    signs = torch.randint(0, 2, (n, 1, e), generator=g).double() * 2 - 1
    v = (c * h[None] * signs).float()
    model = _UniformMHA(e).eval()
    with torch.no_grad():
        y = model(v) + sigma * torch.randn(n, e, generator=g)
    data = [(v[i : i + 128], y[i : i + 128]) for i in range(0, n, 128)]
    return model, data, {"n_cal": n, "nu_star_scale": c**2 / sigma**2}


class _EncoderRegressor(nn.Module):
    """Tokens ``(B, L, F)`` -> linear embedding (+ learned positions) with a CLS token in front
    -> ``nn.TransformerEncoder`` -> linear head on the CLS output, ``(B,)``. The readout sees the
    sequence only through attention, so the attention carries the aggregation."""

    def __init__(self, f: int, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(f, d)
        self.cls = nn.Parameter(torch.randn(1, 1, d) * 0.1)
        self.pos = nn.Parameter(torch.randn(1, 16, d) * 0.1)
        layer = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) + self.pos[:, : x.shape[1]]
        h = torch.cat([self.cls.expand(x.shape[0], -1, -1), h], 1)
        return self.head(self.enc(h)[:, 0])[:, 0]


def _synthetic_sequences(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """x (n, 16, 4); y = smooth interaction of the tokens + noise whose sd depends on x."""
    x = torch.randn(n, 16, 4, generator=g)
    sig = torch.tanh(x[..., 0]) * x[..., 1]  # (n, 16)
    mean = sig.mean(1) * 2 + (x[..., 2].max(1).values - 1.5) * 0.5
    sd = 0.2 + 0.3 * x[..., 3].abs().mean(1)
    return x, mean + sd * torch.randn(n, generator=g)


def _encoder(seed: int = 0) -> tuple[nn.Module, Data, dict[str, Any]]:
    from attnuq_bench.training import evaluate_rmse, fit

    g = torch.Generator().manual_seed(1234)
    x_tr, y_tr = _synthetic_sequences(3000, g)
    x_va, y_va = _synthetic_sequences(500, g)
    x_ca, y_ca = _synthetic_sequences(256, g)
    torch.manual_seed(seed)
    model = _EncoderRegressor(4)
    fit(model, (x_tr, y_tr), (x_va, y_va), max_epochs=40, patience=8, lr=1e-3, batch_size=128,
        seed=seed, progress=False)
    model.eval()
    data = [(x_ca[i : i + 128], y_ca[i : i + 128]) for i in range(0, 256, 128)]
    rmse = float(evaluate_rmse(model, (x_ca, y_ca)))
    return model, data, {"n_cal": 256, "cal_rmse": rmse, "target_sd": float(y_ca.std())}


def _ft_concrete(
    seed: int = 0, data_dir: str | None = None
) -> tuple[nn.Module, Data, dict[str, Any]]:
    from attnuq_bench.data.uci import load_uci
    from attnuq_bench.models.ft import make_ft_transformer
    from attnuq_bench.training import evaluate_rmse, fit

    d = load_uci("concrete", 0, data_dir=data_dir)
    model = make_ft_transformer(d.n_features, n_blocks=1, seed=seed)
    fit(model, (d.x_fit, d.y_fit), (d.x_val, d.y_val), max_epochs=150, patience=16, lr=1e-3,
        batch_size=128, seed=seed, progress=False)
    model.eval()
    x = torch.cat([d.x_val, d.x_cal])
    y = torch.cat([d.y_val, d.y_cal])
    rmse = float(evaluate_rmse(model, (x, y)))
    return model, [(x, y)], {"n_cal": len(y), "cal_rmse": rmse, "note": "val+cal parts"}


def build_model(
    name: str, data_dir: str | None = None, seed: int = 0
) -> tuple[nn.Module, Data, dict[str, Any]]:
    """Build (and train) the benchmark model ``name``; returns model, calibration data, info.

    ``seed`` seeds the model's data (``uniform-mha``) or its training (the trained models); 0 is
    the seed of the committed results.
    """
    builders: dict[str, Callable[[], tuple[nn.Module, Data, dict[str, Any]]]] = {
        "uniform-mha": lambda: _uniform_mha(seed),
        "encoder": lambda: _encoder(seed),
        "ft-concrete": lambda: _ft_concrete(seed, data_dir=data_dir),
    }
    if name not in builders:
        raise ValueError(f"unknown benchmark model {name=}; known: {list(builders)}")
    return builders[name]()


def _to_device(
    model: nn.Module, data: Data, device: torch.device
) -> tuple[nn.Module, Data]:
    """Move the model and every tensor of the calibration batches to ``device``."""
    moved = [tuple(t.to(device) for t in batch) for batch in data]
    return model.to(device), moved  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------
# run
# --------------------------------------------------------------------------------------------
def _compare(grid: Any, bo: Any) -> dict[str, Any]:
    gi, bi = grid.chosen.influence, bo.chosen.influence
    diff = bi - gi
    se_d = float(np.std(diff, ddof=1)) / math.sqrt(len(diff))
    excess = bo.chosen.objective - grid.chosen.objective
    in_band = bo.nu == grid.nu or excess <= 2.0 * se_d
    return {
        "grid_nu": grid.nu,
        "grid_band": grid.noise_band,
        "grid_passes": grid.forward_passes,
        "grid_objective": grid.chosen.objective,
        "bo_nu": bo.nu,
        "bo_evaluated": [e.nu for e in bo.evaluations],
        "bo_passes": bo.forward_passes,
        "bo_objective": bo.chosen.objective,
        "bo_nu_interval": bo.nu_interval,
        "excess_objective": excess,
        "paired_se": se_d,
        "in_band": bool(in_band),
        "passes_ratio": bo.forward_passes / grid.forward_passes,
        "grid_seconds": grid.wall_time,
        "bo_seconds": bo.wall_time,
        "bo_slope": bo.surrogate["mean"][1],
    }


#: options that do not shape a row (which models/criteria/seeds run, where, how fast)
_FREE = ("models", "criteria", "seeds", "out", "table", "threads", "device", "render_only",
         "command", "suite", "no_progress", "data_dir")


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items()
            if not k.startswith("_") and isinstance(v, (int, float, str, list, type(None)))}


def run(args: argparse.Namespace) -> Path:
    from attnuq._runtime import resolve_device, run_info
    from attnuq.calibration import calibrate

    out = Path(args.out)
    table = Path(args.table) if args.table else out.with_suffix(".md")
    twin_path(table)  # a --table that cannot have a JSON twin is refused before any work
    if getattr(args, "render_only", False):
        render_page(out, table).write(table)
        return out
    torch.set_num_threads(args.threads)
    device = resolve_device(getattr(args, "device", "cpu"))
    seed0 = int(getattr(args, "seed", 0))
    seeds = range(seed0, seed0 + args.seeds)
    (out / "reports").mkdir(parents=True, exist_ok=True)
    info = run_info()
    settings = _settings(args)
    kw = {"n_passes": args.n_passes, "nu_range": (1, args.nu_max), "progress": False}
    store = RunStore(out / "runs", suite="calibration", info=info)
    groups = [Group(parts=(name,), methods=[f"{c}_seed{s}" for c in args.criteria for s in seeds],
                    reuse=reuse_key(settings, _FREE)) for name in args.models]

    def setup(g: Group) -> tuple[nn.Module, Data]:
        t0 = time.perf_counter()
        try:
            model, data, minfo = build_model(g.parts[0], args.data_dir, seed=seed0)
        except (ImportError, FileNotFoundError) as exc:
            print(f"skipping {g.parts[0]}: {exc}")
            raise SkipGroup(str(exc)) from exc
        minfo["build_seconds"] = time.perf_counter() - t0
        if is_writer():  # under torchrun: the group's first holder (attnuq.distributed)
            atomic_write_json(out / "runs" / g.parts[0] / "model.json", minfo, indent=1)
        return _to_device(model, data, device)

    def one(ctx: tuple[nn.Module, Data], g: Group, item: str) -> dict[str, Any]:
        (model, data), name = ctx, g.parts[0]
        crit_s, seed_s = item.rsplit("_seed", 1)
        crit, seed = get_criterion(crit_s).name, int(seed_s)
        grid = calibrate(model, data, criterion=crit, search="grid", seed=seed,
                         grid_size=args.grid_size, **kw)
        bo = calibrate(model, data, criterion=crit, search="bo", seed=seed,
                       max_evals=args.max_evals, **kw)
        grid.save(out / "reports" / f"{name}_{crit}_grid_seed{seed}.json")
        bo.save(out / "reports" / f"{name}_{crit}_bo_seed{seed}.json")
        row = {"model": name, "criterion": crit, "seed": seed, **_compare(grid, bo)}
        print(f"{name:12s} {crit:9s} seed {seed}: grid nu={grid.nu} band={grid.noise_band} "
              f"| bo nu={bo.nu} evals={row['bo_evaluated']} in_band={row['in_band']} "
              f"passes {bo.forward_passes}/{grid.forward_passes}")
        return {"method": item, "row": row}

    done = run_items(store, groups, setup, one, progress=False)
    if groups and len(done.skipped) == len(groups):  # nothing could run: not a success
        raise ValueError("every model was skipped (" + "; ".join(
            f"{g[0]}: {why}" for g, why in done.skipped.items()) + ")")
    rows: list[dict[str, Any]] = []
    model_info: dict[str, Any] = {}
    for g in groups:
        name = g.parts[0]
        if g.parts in done.skipped:
            model_info[name] = {"skipped": done.skipped[g.parts]}
            continue
        model_info[name] = read_json_or_none(out / "runs" / name / "model.json", "model record")
        for item in g.methods:
            rec = store.load(g.parts, item, check=False)
            if rec is not None and store.reuse_of(rec) == g.reuse:
                rows.append(rec["row"])
        for crit in args.criteria:
            _plot(out, name, crit, seed0)
    results = {"run": info, "settings": settings, "models": model_info, "rows": rows}
    atomic_write_json(out / "results.json", results, indent=2, default=str)
    render_page(out, table).write(table)
    return out


def _plot(out: Path, name: str, crit: str, seed: int) -> None:
    """The calibration curves of one (model, criterion) at ``seed``: grid left, BO right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from attnuq.calibration import CalibrationReport

    paths = [out / "reports" / f"{name}_{crit}_{s}_seed{seed}.json" for s in ("grid", "bo")]
    if not all(p.is_file() for p in paths):
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    CalibrationReport.load(paths[0]).plot(ax=axes[0], show_surrogate=False)
    CalibrationReport.load(paths[1]).plot(ax=axes[1])
    fig.suptitle(f"{name}: {crit}")
    fig.tight_layout()
    atomic_savefig(fig, out / f"{name}_{crit}.png", dpi=90)
    plt.close(fig)


def _fmt_band(band: list[int] | None) -> str:
    if not band:
        return "-"
    return f"{min(band)}-{max(band)} ({len(band)})" if len(band) > 1 else str(band[0])


_TEXT = ("Grid band: grid nu within 2 paired standard errors of the grid minimum (range and "
         "count). *In band*: BO's nu equals the grid's choice or its measured objective exceeds "
         "the grid minimum by at most 2 paired standard errors. Passes: passes over the "
         "calibration set (1 frozen + M per evaluated nu). Produced by the command above; "
         "raw numbers in `results.json`, per-run reports in `reports/`.")
_HEADER = ("model", "criterion", "seed", "grid nu", "grid band", "grid passes", "BO nu",
           "BO evaluated", "BO passes", "passes ratio", "excess / paired se", "in band")


def build_page(results: dict[str, Any], out: Path) -> Page:
    """The page of ``results`` (the content of ``results.json``); ``out`` names the figures."""
    r, s, rows = results["run"], results["settings"], results["rows"]
    s0 = int(s.get("seed", 0))
    page = Page("calibration", "Calibration of nu: Bayesian optimisation vs grid",
                state={"results": "results.json"})
    page.provenance(r)
    page.add(f"* attnuq {r['attnuq']}; nu_range = (1, {s['nu_max']}), grid of {s['grid_size']} "
             f"log-spaced points, M = {s['n_passes']} passes per evaluation, BO budget "
             f"{s['max_evals']} evaluations, seeds {s0}..{s0 + s['seeds'] - 1}", "", _TEXT, "")
    t = Table(_HEADER, spaced=True)
    for row in rows:
        ratio = row["excess_objective"] / row["paired_se"] if row["paired_se"] > 0 else 0.0
        t.add(row["model"], row["criterion"], str(row["seed"]), str(row["grid_nu"]),
              _fmt_band(row["grid_band"]), str(row["grid_passes"]), str(row["bo_nu"]),
              ", ".join(map(str, row["bo_evaluated"])), str(row["bo_passes"]),
              f"{row['passes_ratio']:.2f}", f"{ratio:.2f}", "yes" if row["in_band"] else "**no**",
              values=row)
    page.table(t)
    n = len(rows)
    ok = sum(r_["in_band"] for r_ in rows)
    cheap = sum(r_["passes_ratio"] <= 1 / 3 + 1e-12 for r_ in rows)
    both = sum(r_["in_band"] and r_["passes_ratio"] <= 1 / 3 + 1e-12 for r_ in rows)
    page.add("")
    page.headline(f"Summary: BO in band in {ok}/{n} runs; at most a third of the grid's passes "
                  f"in {cheap}/{n}; both in {both}/{n}.")
    page.add("", "Models:", "")
    for name, mi in results["models"].items():
        page.add(f"* `{name}`: " + ", ".join(f"{k}={_short(v)}" for k, v in (mi or {}).items()))
    page.add("", "Calibration curves (seed 0; left grid, right BO with its surrogate):", "")
    for name, mi in results["models"].items():
        if "skipped" in (mi or {}):
            continue
        for crit in sorted({r_["criterion"] for r_ in rows if r_["model"] == name}):
            page.add(f"![{name} {crit}]({(Path(out.name) / f'{name}_{crit}.png').as_posix()})")
    return page


def write_table(results: dict[str, Any], path: Path, out: Path) -> Path:
    """Markdown table (and its JSON twin) from ``results.json`` content."""
    return build_page(results, out).write(path)


def render_page(out: Path, table: Path) -> Page:
    """The page again from ``<out>/results.json`` (the twin of ``table`` is not needed: the
    results file holds the provenance)."""
    results = read_json_or_none(Path(out) / "results.json", "calibration results",
                                validate=lambda d: isinstance(d, dict) and "rows" in d)
    if results is None:
        raise ValueError(f"no results.json under {str(out)!r} to render {str(table)!r} from")
    return build_page(results, Path(out))


def _short(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


register(
    "calibration",
    help="BO vs grid search for nu on the benchmark models (choice, noise band, forward passes)",
    add_arguments=add_arguments,
    run=run,
)
