"""``attnuq bench digits``: a tiny timm ViT on scikit-learn's digits, in distribution, under
shift and out of distribution (after Ovadia et al. 2019).

Data: ``sklearn.datasets.load_digits`` (1,797 8x8 images, 10 classes, pixel values 0..16,
scaled to ``[0, 1]``; shipped in the scikit-learn wheel, nothing downloads), split once by
``--split-seed``: test 20 %, validation 12 %, calibration 12 %, training the rest. Evaluation
sets, built from the test images with fixed seeds:

* ``clean``; ``noise-1..3``: additive Gaussian noise of sd ``NOISE`` (0.1, 0.25, 0.5) on
  ``[0, 1]`` pixels, clipped to ``[0, 1]``; ``rotation-1..3``: rotation by ``ANGLES`` (15, 30,
  45 degrees; bilinear, zero fill, :func:`scipy.ndimage.rotate`);
* ``ood``: images that are not digits, the test images with their 64 pixels shuffled (a fixed
  permutation per image) and uniform-noise images, one of each per test image; detection is
  the AUROC of each method's uncertainty score (mutual information for methods that draw
  samples, else ``1 - max p``) for telling them from the clean test images.

Backbone: :func:`attnuq_bench.models.classifiers.tiny_vit` (patch 2: 16 tokens + a class token),
trained by :func:`attnuq_bench.training.fit` (AdamW, cross-entropy, early stopping on validation
NLL) on training images shifted by up to ``--shift`` pixels each way (a fresh seeded draw per
image and epoch, zero fill: 8x8 digits are not centred alike), ``--seeds`` model seeds, cached
under ``--cache-dir``. Methods as for ``mortality``
(:mod:`attnuq_bench.methods.classification`); prediction sets at 90 % and 95 % are split conformal
on each method's clean calibration-part probabilities (LAC; the frozen softmax also APS, RAPS)
and scored on every evaluation set.

Each (seed, method) item stores its record and predictions (``<method>.npz``) under
``<out>/runs/digits/seed<S>/``; the page ``<out>.md`` (+ twin, PNGs: reliability diagrams,
NLL against severity) is computed from them alone (``--render-only``) and writes the
``digits`` key of ``summary.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnuq_bench.suites import register
from attnuq_bench.suites._classify import (
    OOD_SCORE,
    class_scores,
    compute_line,
    covers_more,
    equal_coverage_note,
    fit_method,
    load_predictions,
    predict_all,
    reliability_figure,
    save_predictions,
    seed_members,
    set_scores_of,
    start_run,
    uncertainty_of,
)
from attnuq_bench.suites._options import add_methods_argument
from attnuq_bench.suites._page import (
    Page,
    Table,
    error_lines,
    fmt,
    require_twin,
    twin_path,
    update_summary,
)
from attnuq_bench.suites._runner import Group, RunStore, run_items
from attnuq_bench.suites._scoring import mean_std_n

__all__ = ["DEFAULT_METHODS", "EVAL_SETS", "add_arguments", "digits_data", "render_page", "run"]

DEFAULT_METHODS = ["softmax", "temperature", "mc-dropout-cls", "ensemble-cls", "laplace-cls",
                   "sa-cls", "sa-cls-after"]
NOISE = (0.1, 0.25, 0.5)
ANGLES = (15.0, 30.0, 45.0)
EVAL_SETS = ("clean", *[f"noise-{k}" for k in (1, 2, 3)],
             *[f"rotation-{k}" for k in (1, 2, 3)])
_RECIPE = ("digits v2: tiny timm ViT, AdamW, cross-entropy, early stopping on validation NLL, "
           "random-shift augmentation")
FIT_GOAL_SECONDS = 120.0
SCORES = ("Scores: attnuq.metrics (nll_probs, brier_probs (sum over classes), ece_probs with 15 "
          "equal-width bins of the top-label confidence, aurc and auroc_error of 1 - max p, "
          "auroc for OOD); sets: attnuq.conformal_sets.fit_sets on the clean calibration part.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="docs/results/digits", help="results folder")
    p.add_argument("--md", default=None, help="markdown page (default <out>.md)")
    p.add_argument("--cache-dir", default=None, help="backbone cache (default <out>/_models)")
    add_methods_argument(p, default=DEFAULT_METHODS,
                         help=f"methods to run (default: {', '.join(DEFAULT_METHODS)})")
    p.add_argument("--seeds", type=int, default=5, help="model seeds --seed .. --seed + N - 1")
    p.add_argument("--split-seed", type=int, default=0,
                   help="seed of the train/val/cal/test split of the images")
    p.add_argument("--max-images", type=int, default=None,
                   help="subsample (quick runs; default: every image)")
    p.add_argument("--embed-dim", type=int, default=48, help="ViT width")
    p.add_argument("--depth", type=int, default=3, help="ViT blocks")
    p.add_argument("--heads", type=int, default=4, help="attention heads per block")
    p.add_argument("--dropout", type=float, default=0.1, help="ViT dropout rate")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    p.add_argument("--batch-size", type=int, default=64, help="training batch size")
    p.add_argument("--max-epochs", type=int, default=200,
                   help="training epochs at most (early stopping on val)")
    p.add_argument("--patience", type=int, default=20, help="early-stopping patience in epochs")
    p.add_argument("--shift", type=int, default=1,
                   help="training images shifted by up to this many pixels (0: no augmentation)")
    p.add_argument("--ensemble", type=int, default=5, help="deep-ensemble members")
    p.add_argument("--mc-samples", type=int, default=50, help="MC-dropout passes")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument("--render-only", action="store_true",
                   help="only rewrite the page, its twin, figures and summary key from <out>")


# ----------------------------------------------------------------------------- data


def digits_data(split_seed: int = 0, max_images: int | None = None) -> dict[str, Any]:
    """Parts ``train / val / cal / test`` as ``(x (N, 1, 8, 8) in [0, 1], y (N,))`` float32 /
    int64 tensors, the shifted test sets and the OOD images (module docstring).

    >>> d = digits_data(max_images=200)
    >>> d["clean"][0].shape[1:], sorted(d)[:3]
    (torch.Size([1, 8, 8]), ['cal', 'clean', 'noise-1'])
    """
    from scipy.ndimage import rotate
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).reshape(-1, 1, 8, 8).astype(np.float32)
    rng = np.random.default_rng(split_seed)
    idx = rng.permutation(len(y))
    if max_images is not None:
        idx = idx[:max_images]
    n = len(idx)
    n_test, n_val, n_cal = round(0.2 * n), round(0.12 * n), round(0.12 * n)
    cut = {"test": idx[:n_test], "val": idx[n_test:n_test + n_val],
           "cal": idx[n_test + n_val:n_test + n_val + n_cal],
           "train": idx[n_test + n_val + n_cal:]}
    out: dict[str, Any] = {k: (torch.from_numpy(X[v]), torch.from_numpy(y[v]).long())
                           for k, v in cut.items() if k != "test"}
    xt, yt = X[cut["test"]], torch.from_numpy(y[cut["test"]]).long()
    out["clean"] = (torch.from_numpy(xt), yt)
    for k, sd in enumerate(NOISE, 1):
        g = np.random.default_rng(1000 + k)
        out[f"noise-{k}"] = (torch.from_numpy(np.clip(
            xt + sd * g.standard_normal(xt.shape), 0, 1).astype(np.float32)), yt)
    for k, ang in enumerate(ANGLES, 1):
        r = np.stack([rotate(im[0], ang, reshape=False, order=1, mode="constant", cval=0.0)
                      for im in xt])[:, None]
        out[f"rotation-{k}"] = (torch.from_numpy(np.clip(r, 0, 1).astype(np.float32)), yt)
    g = np.random.default_rng(2000)
    shuf = np.stack([im.reshape(-1)[g.permutation(64)].reshape(1, 8, 8) for im in xt])
    unif = g.random(xt.shape).astype(np.float32)
    out["ood"] = (torch.from_numpy(np.concatenate([shuf, unif]).astype(np.float32)), None)
    return out


def shifted(x: torch.Tensor, shift: int, generator: torch.Generator) -> torch.Tensor:
    """Images ``(N, 1, H, W)`` each moved by its own ``(dy, dx)``, uniform in
    ``[-shift, shift]^2`` (drawn from ``generator``), with zeros shifted in; ``shift=0``
    returns ``x``.

    >>> x = torch.zeros(1, 1, 3, 3); x[0, 0, 1, 1] = 1
    >>> y = shifted(x, 1, torch.Generator().manual_seed(0))
    >>> float(y.sum()), y.shape   # the one lit pixel moved at most one step, still inside
    (1.0, torch.Size([1, 1, 3, 3]))
    """
    if shift < 0:
        raise ValueError(f"shift must be >= 0, got {shift=}")
    if shift == 0:
        return x
    n, _, h, w = x.shape
    pad = torch.nn.functional.pad(x, (shift,) * 4)
    off = torch.randint(0, 2 * shift + 1, (n, 2), generator=generator)
    return torch.stack([pad[i, :, off[i, 0]:off[i, 0] + h, off[i, 1]:off[i, 1] + w]
                        for i in range(n)])


class _Scaled(torch.nn.Module):
    """The backbone with its input scaling inside: ``[0, 1]`` pixels -> ``(x - 0.5) / 0.5``."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x - 0.5) / 0.5)


def _recipe(args: argparse.Namespace) -> dict[str, Any]:
    return {"recipe": _RECIPE, "split_seed": args.split_seed, "max_images": args.max_images,
            "embed_dim": args.embed_dim, "depth": args.depth, "heads": args.heads,
            "dropout": args.dropout, "lr": args.lr, "batch_size": args.batch_size,
            "max_epochs": args.max_epochs, "patience": args.patience, "shift": args.shift}


def _budget(args: argparse.Namespace) -> dict[str, Any]:
    return {"ensemble": args.ensemble, "mc_samples": args.mc_samples}


def _make(args: argparse.Namespace, seed: int) -> torch.nn.Module:
    from attnuq_bench.models.classifiers import tiny_vit

    torch.manual_seed(seed)
    return _Scaled(tiny_vit(10, embed_dim=args.embed_dim, depth=args.depth,
                            num_heads=args.heads, dropout=args.dropout))


def _log(msg: str) -> None:
    import sys

    print(f"[digits {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _train(model: torch.nn.Module, data: dict[str, Any], args: argparse.Namespace, seed: int,
           checkpoint: Path) -> dict[str, Any]:
    from attnuq import metrics
    from attnuq_bench.training import fit

    def ce(model: torch.nn.Module, b: Any) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(b[0]), b[1])

    def val_nll(model: torch.nn.Module, val: Any) -> float:
        with torch.no_grad():
            p = torch.cat([torch.softmax(model(x).double(), -1) for x, _ in val])
        return float(metrics.nll_probs(p, torch.cat([y for _, y in val])))

    x_tr, y_tr = data["train"]

    def epoch_batches(epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(1000 * seed + epoch)
        x = shifted(x_tr, args.shift, g)
        perm = torch.randperm(len(x), generator=g)
        bs = args.batch_size
        return [(x[perm[s:s + bs]], y_tr[perm[s:s + bs]]) for s in range(0, len(x), bs)]

    rep = fit(model, epoch_batches, data["val"], loss=ce, metric=val_nll, optimizer="adamw",
              lr=args.lr, weight_decay=0.05, max_epochs=args.max_epochs,
              patience=args.patience, batch_size=args.batch_size, val_batch_size=512,
              seed=seed, seed_torch=True, checkpoint=checkpoint,
              progress=(lambda s: _log(f"seed {seed} {s}")) if not args.no_progress else False)
    return {"epochs_run": rep.epochs_run, "best_epoch": rep.best_epoch,
            "best_val_nll": rep.best_val, "seconds": rep.seconds, "n_forward": rep.n_forward,
            "stopped_by": rep.stopped_by}


def _backbone(data: dict[str, Any], args: argparse.Namespace, seed: int, cache: Path
              ) -> tuple[torch.nn.Module, dict[str, Any]]:
    from attnuq._io import tensor_digest
    from attnuq_bench.suites._members import cached_backbone

    spec = {**_recipe(args), "data": tensor_digest(*data["train"], *data["val"])}
    return cached_backbone(cache, spec, seed, lambda: _make(args, seed),
                           lambda m, ckpt: _train(m, data, args, seed, ckpt))


# ----------------------------------------------------------------------------- items


def _batches(x: torch.Tensor, bs: int = 256) -> list[torch.Tensor]:
    return [x[s:s + bs] for s in range(0, len(x), bs)]


def _run_one(ctx: Any, g: Group, method: str, args: argparse.Namespace,
             store: RunStore) -> dict[str, Any]:
    from attnuq_bench.methods import method_implementation

    data, task, info, members = ctx
    seed = g.payload
    m, cost = fit_method(method, task, seed, members, mc_samples=args.mc_samples,
                         ensemble=args.ensemble)
    arrays: dict[str, np.ndarray] = {"cal_y": data["cal"][1].numpy()}
    pc = predict_all(m, _batches(data["cal"][0]))
    arrays["cal_probs"] = pc["probs"].astype(np.float32)
    for name in (*EVAL_SETS, "ood"):
        pr = predict_all(m, _batches(data[name][0]))
        for k, v in pr.items():
            arrays[f"{name}_{k}"] = v.astype(np.float32)  # float32: the files are committed
    arrays["test_y"] = data["clean"][1].numpy()
    npz = store.path(g.parts, method).with_suffix(".npz")
    save_predictions(npz, arrays)
    return {"method": method, "seed": seed, "backbone_info": info, "cost": cost,
            "info": m.info(), "config": {**m.config(), "budget": _budget(args)},
            "sizes": {k: len(data[k][0]) for k in ("train", "val", "cal", "clean", "ood")},
            "predictions": npz.name, "implementation": method_implementation(method)}


def _valid(r: Any) -> bool:
    return isinstance(r, dict) and all(k in r for k in ("method", "seed", "cost", "predictions"))


def _store(out: Path, info: dict[str, Any] | None = None) -> RunStore:
    return RunStore(out / "runs", suite="digits", info=info or {}, valid=_valid)


def run(args: argparse.Namespace) -> Path:
    """Run the suite (or only render it); return the results folder."""
    from attnuq_bench.methods import Task

    out = Path(args.out)
    md = Path(args.md) if args.md else out.with_suffix(".md")
    twin_path(md)
    if args.render_only:
        page = render_page(out, md)
        page.write(md)
        _figures_and_summary(out, md, _rows(out))
        return out
    if args.seeds < 1 or args.ensemble < 2:
        raise ValueError(f"need --seeds >= 1 and --ensemble >= 2, got {args.seeds=}, "
                         f"{args.ensemble=}")
    cache, info = start_run(args)
    store = _store(out, info)
    held: dict[str, Any] = {}
    groups = [Group(parts=("digits", f"seed{args.seed + k}"), methods=list(args.methods),
                    reuse={**_recipe(args), "budget": _budget(args)}, payload=args.seed + k)
              for k in range(args.seeds)]

    def setup(g: Group) -> Any:
        if "d" not in held:
            held["d"] = digits_data(args.split_seed, args.max_images)
        data = held["d"]
        seed = g.payload
        model, binfo = _backbone(data, args, seed, cache)
        make_model, members = seed_members(lambda s: _backbone(data, args, s, cache), seed)
        task = Task(model=model, train=data["train"], val=data["val"], cal=data["cal"],
                    make_model=make_model, train_fn=lambda *a: None, batch_size=256,
                    kind="classification")
        return data, task, binfo, members

    run_items(store, groups, setup, lambda c, g, m: _run_one(c, g, m, args, store),
              progress=not args.no_progress, desc="digits runs")
    page = build_page(out, _rows(out), info, {"args": _state_args(args)},
                      errors=store.errors())
    page.write(md)
    _figures_and_summary(out, md, _rows(out))
    return out


def _state_args(args: argparse.Namespace) -> dict[str, Any]:
    keep = ("seeds", "seed", "split_seed", "max_images", "embed_dim", "depth", "heads",
            "dropout", "lr", "batch_size", "max_epochs", "patience", "shift", "ensemble",
            "mc_samples", "threads")
    return {k: getattr(args, k) for k in keep}


# ----------------------------------------------------------------------------- scoring, page


def _ood_score(pr: dict[str, np.ndarray], name: str) -> np.ndarray:
    mi = pr.get(f"{name}_mi")
    return mi.astype(np.float64) if mi is not None else uncertainty_of(pr[f"{name}_probs"])


def _rows(out: Path) -> list[dict[str, Any]]:
    """Every stored record with its scores per evaluation set (from its predictions file)."""
    from attnuq import metrics

    store = _store(out)
    rows = []
    for r in store.records("digits/seed*/*.json"):
        pr = load_predictions(store.path(("digits", f"seed{r['seed']}"), r["method"]).parent
                              / r["predictions"])
        y = pr["test_y"]
        ev = {k: (pr[f"{k}_probs"], y) for k in EVAL_SETS}
        scores = {k: class_scores(p, yy) for k, (p, yy) in ev.items()}
        sets = set_scores_of(pr["cal_probs"], pr["cal_y"], ev)
        for k in EVAL_SETS:
            scores[k].update(sets[k])
        if r["method"] == "softmax":
            for sc in ("aps", "raps"):
                for k, v in set_scores_of(pr["cal_probs"], pr["cal_y"], ev, score=sc).items():
                    scores[k].update({f"{sc}_{kk}": vv for kk, vv in v.items()})
        n_in, n_out = len(y), len(pr["ood_probs"])
        lab = torch.cat([torch.zeros(n_in), torch.ones(n_out)])
        own = np.concatenate([_ood_score(pr, "clean"), _ood_score(pr, "ood")])
        msp = np.concatenate([uncertainty_of(pr["clean_probs"]), uncertainty_of(pr["ood_probs"])])
        scores["ood"] = {"auroc_ood": float(metrics.auroc(torch.as_tensor(own), lab)),
                         "auroc_ood_msp": float(metrics.auroc(torch.as_tensor(msp), lab))}
        rows.append({**r, "scores": scores, "_pred": pr})
    return sorted(rows, key=lambda r: (r["seed"], r["method"]))


def _by(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["method"], []).append(r)
    return by


def _agg(rows: list[dict[str, Any]], ds: str, key: str) -> list[float]:
    return mean_std_n([r["scores"][ds][key] for r in rows])


def _mean(by: dict[str, list[dict[str, Any]]], m: str, ds: str, key: str,
          seeds: set[int] | None = None) -> float | None:
    """Mean over seeds (only ``seeds`` when given) of ``key`` on ``ds``; ``None`` without rows."""
    rs = [r for r in by.get(m, []) if seeds is None or r["seed"] in seeds]
    return _agg(rs, ds, key)[0] if rs else None


def _cmp(a: float | None, b: float | None, lower: bool = True, strict: bool = False) -> str:
    if a is None or b is None:
        return "**not checked** (a row is missing)"
    ok = (a < b if strict else a <= b) if lower else (a > b if strict else a >= b)
    return "**met**" if ok else "**not met**"


def _noise(by: dict[str, list[dict[str, Any]]], a: str, b: str, key: str, ds: str) -> str:
    """:func:`~attnuq_bench.suites._classify.noise_note` of ``a`` against ``b`` on the
    evaluation set ``ds``."""
    from attnuq_bench.suites._classify import noise_note

    return noise_note(by, a, b, key, f"{ds}_probs", f"{ds} test images")


def _goal_lines(by: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The issue's goals, met / not met with the numbers (on the seeds SA has)."""
    sa, t, mc = "sa-cls", "temperature", "mc-dropout-cls"
    if sa not in by:
        return ["* SA: no rows yet (not run or failed), so its goals are **not checked**"]
    common = {r["seed"] for r in by[sa]}
    by = {m: [r for r in rs if r["seed"] in common] for m, rs in by.items()}

    L = [f"Compared on the seeds SA has: {sorted(common)} (means over them)."]
    for key, name in (("nll", "NLL"), ("ece", "ECE")):
        a, b = _mean(by, sa, "clean", key), _mean(by, t, "clean", key)
        L.append(f"* clean: SA {name} no worse than temperature scaling's: {_cmp(a, b)} "
                 f"({fmt(a, 4)} vs {fmt(b, 4)}{_noise(by, sa, t, key, 'clean')})")
    for ds in ("noise-3", "rotation-3"):
        for key, name in (("nll", "NLL"), ("ece", "ECE")):
            a = _mean(by, sa, ds, key)
            for other in (t, mc):
                b = _mean(by, other, ds, key)
                L.append(f"* {ds}: SA {name} better than {other}'s: "
                         f"{_cmp(a, b, strict=True)} ({fmt(a, 4)} vs {fmt(b, 4)}"
                         f"{_noise(by, sa, other, key, ds)})")
    a, b = _mean(by, sa, "ood", "auroc_ood"), _mean(by, "softmax", "ood", "auroc_ood")
    L.append(f"* OOD: AUROC of SA's mutual information above the max-softmax baseline's: "
             f"{_cmp(a, b, lower=False, strict=True)} ({fmt(a, 4)} vs {fmt(b, 4)})")
    for lv in (90, 95):
        a, b = _mean(by, sa, "clean", f"size_{lv}"), _mean(by, "softmax", "clean", f"size_{lv}")
        ca = _mean(by, sa, "clean", f"coverage_{lv}")
        cb = _mean(by, "softmax", "clean", f"coverage_{lv}")
        L.append(f"* clean {lv} % sets (LAC): SA's no larger than the frozen softmax's: "
                 f"{_cmp(a, b)} (size {fmt(a, 4)} vs {fmt(b, 4)}; coverage {fmt(ca, 3)} vs "
                 f"{fmt(cb, 3)}{_noise(by, sa, 'softmax', f'size_{lv}', 'clean')}"
                 f"{covers_more(a is not None and b is not None and a <= b, ca, cb)})")
    for lv in (90, 95):
        eq = equal_coverage_note(by, sa, "softmax", lv / 100, "clean_probs",
                                 "clean test images")
        if eq is not None:
            a, b, note = eq
            L.append(f"* clean {lv} % sets (LAC) at equal coverage (each method's threshold "
                     f"read where its sets cover {lv} % of the clean test images): SA's no "
                     f"larger than the frozen softmax's: {_cmp(a, b)} (size {a:.4f} vs "
                     f"{b:.4f}{note})")
    fit_s = [r["cost"]["fit_seconds"] for r in by[sa]]
    fwd = [r["cost"]["fit_forward"] for r in by[sa]]
    L.append(f"* SA fit under {FIT_GOAL_SECONDS:.0f} s: "
             f"{'**met**' if max(fit_s) < FIT_GOAL_SECONDS else '**not met**'} (slowest seed "
             f"{max(fit_s):.1f} s, mean {np.mean(fit_s):.1f} s; {int(np.mean(fwd))} "
             f"example-forward passes on average)")
    return L


def _after_cell(r: dict[str, Any] | None) -> str:
    """``nu, T, noise-3 NLL`` of a ``sa-cls-after`` record (empty without one)."""
    if r is None:
        return ""
    i = r.get("info", {})
    return (f"{i.get('nu')}, {fmt(i.get('temperature'), 3)}, "
            f"{fmt(r['scores']['noise-3']['nll'], 3)}")


def _per_seed_lines(by: dict[str, list[dict[str, Any]]]) -> list[str]:
    """SA seed by seed next to temperature scaling: where the shift and OOD goals are decided.

    Every number comes from the stored records: SA's chosen ``nu`` and joint temperature, the
    temperature of temperature scaling, the validation mean mutual information, the NLL under
    the strongest shifts and the OOD AUROCs of the same seed.
    """
    sa, t = "sa-cls", "temperature"
    if sa not in by or t not in by:
        return []
    ts = {r["seed"]: r for r in by[t]}
    fz = {r["seed"]: r for r in by.get("softmax", [])}
    rows = [r for r in sorted(by[sa], key=lambda r: r["seed"]) if r["seed"] in ts]
    if not rows:
        return []
    after = {r["seed"]: r for r in by.get("sa-cls-after", [])}
    tab = Table(["seed", "nu", "T (SA, joint)", "T (temperature)", "val mean MI",
                 "noise-3 NLL SA / temp", "rotation-3 NLL SA / temp",
                 "OOD AUROC SA MI / SA 1-max p / frozen 1-max p",
                 *(["sa-cls-after: nu, T, noise-3 NLL"] if after else [])])
    for r in rows:
        i, o = r.get("info", {}), ts[r["seed"]]
        edge = f" ({i['nu_at_edge']} edge)" if i.get("nu_at_edge") else ""
        f = fz.get(r["seed"])
        tab.add(str(r["seed"]), f"{i.get('nu')}{edge}", fmt(i.get("temperature"), 3),
                fmt(o.get("info", {}).get("temperature"), 3),
                fmt(i.get("val_mean_mutual_information"), 4),
                *[f"{fmt(r['scores'][ds]['nll'], 3)} / {fmt(o['scores'][ds]['nll'], 3)}"
                  for ds in ("noise-3", "rotation-3")],
                f"{fmt(r['scores']['ood']['auroc_ood'], 3)} / "
                f"{fmt(r['scores']['ood']['auroc_ood_msp'], 3)} / "
                f"{fmt(f['scores']['ood']['auroc_ood'], 3) if f else ''}",
                *([_after_cell(after.get(r["seed"]))] if after else []))
    L = ["", "SA seed by seed next to temperature scaling (what decides the shift and OOD "
         "goals above):", "", *tab.lines(), ""]
    n = len(rows)
    wins = {ds: [r["seed"] for r in rows
                 if r["scores"][ds]["nll"] < ts[r["seed"]]["scores"][ds]["nll"]]
            for ds in ("noise-3", "rotation-3")}
    gaps = {r["seed"]: r["scores"]["noise-3"]["nll"] - ts[r["seed"]]["scores"]["noise-3"]["nll"]
            for r in rows}
    worst = max(gaps, key=lambda k: gaps[k])
    wr = next(r for r in rows if r["seed"] == worst)
    t_sa, t_ts = wr["info"].get("temperature"), ts[worst]["info"].get("temperature")
    line = (f"* SA's NLL is below temperature scaling's on {len(wins['noise-3'])} of {n} seeds "
            f"under noise-3 and {len(wins['rotation-3'])} of {n} under rotation-3; the largest "
            f"noise-3 gap against SA is seed {worst} ({gaps[worst]:+.3f}; nu = "
            f"{wr['info'].get('nu')}, joint temperature {fmt(t_sa, 3)} against temperature "
            f"scaling's {fmt(t_ts, 3)})")
    if gaps[worst] > 0 and t_sa is not None and t_ts is not None and t_sa < t_ts:
        if t_sa < 1:
            line += (": the joint fit sharpened the logits (T below 1) to offset the attention "
                     "noise, which the clean validation images reward; under this shift the "
                     "sharpened logits are over-confident and the noise does not make up for it")
        else:
            line += (": on the clean validation images attention noise and a temperature "
                     "flatten the probabilities alike, so the joint fit took part of the "
                     "flattening from the noise; under this shift the noise flattens less than "
                     "the temperature it replaced")
    L.append(line + ".")
    below = [r["seed"] for r in rows
             if r["scores"]["ood"]["auroc_ood"] < r["scores"]["ood"]["auroc_ood_msp"]]
    nus = sorted(int(r["info"]["nu"]) for r in rows if r.get("info", {}).get("nu") is not None)
    line = (f"* OOD: SA's mutual information separates the OOD images less well than SA's own "
            f"1 - max p on {len(below)} of {n} seeds")
    if nus:
        line += f" (chosen nu {nus[0]} to {nus[-1]})"
    if len(below) == n:
        line += (": with the noise chosen on clean validation NLL, the draws of an OOD image "
                 "disagree little more than those of a clean one, while the model's confidence "
                 "already separates them; with this backbone 1 - max p of SA's mean "
                 "probability, not its mutual information, is the better OOD score")
    L.append(line + ".")
    return [*L, ""]


_COLS = [("acc", "accuracy"), ("NLL", "nll"), ("Brier", "brier"), ("ECE", "ece"),
         ("AURC", "aurc"), ("err-AUROC", "auroc_error"), ("cov 90", "coverage_90"),
         ("size 90", "size_90"), ("cov 95", "coverage_95"), ("size 95", "size_95")]


def build_page(out: Path, rows: list[dict[str, Any]], info: dict[str, Any],
               state: dict[str, Any], *, errors: list[Path] | None = None) -> Page:
    """The page from the scored records ``rows`` (no training, no writes)."""
    from attnuq_bench.suites._implementations import implementation_block
    from attnuq_bench.suites._page import runs_lines

    a = state.get("args", {})
    page = Page("digits", "Digits (tiny ViT): SA in distribution, under shift, out of "
                "distribution", state=state)
    page.provenance(info)
    page.add(*runs_lines(rows, lambda r: r.get("reuse", {}).get("budget")), "")
    if not rows:
        page.headline("No runs stored yet.")
        page.implementations(implementation_block([], scores=SCORES))
        return page
    by = _by(rows)
    order = [m for m in DEFAULT_METHODS if m in by] + sorted(set(by) - set(DEFAULT_METHODS))
    sz = rows[0]["sizes"]
    bi = [r["backbone_info"] for r in by.get("softmax", rows)]
    page.add(f"Data: scikit-learn `load_digits`, images: train {sz['train']}, validation "
             f"{sz['val']}, calibration {sz['cal']}, test {sz['clean']} (split seed "
             f"{a.get('split_seed')}{', subsampled' if a.get('max_images') else ''}); shifts on "
             f"the test images: Gaussian noise sd {list(NOISE)}, rotation {list(ANGLES)} "
             f"degrees; OOD: {sz['ood']} shuffled-pixel and uniform-noise images. Model seeds "
             f"{sorted({r['seed'] for r in rows})}. Backbone: timm VisionTransformer, embed "
             f"{a.get('embed_dim')}, depth {a.get('depth')}, {a.get('heads')} heads, patch 2, "
             f"trained on images shifted by up to {a.get('shift', 0)} pixel(s); "
             f"epochs run per seed {[int(b['epochs_run']) for b in bi]}, "
             f"{fmt(mean_std_n([b['seconds'] for b in bi]), 1)} s per backbone.", "")
    for ds in ("clean", "noise-3", "rotation-3"):
        page.section(f"{ds} (mean ± std over seeds)")
        t = Table(["method", *[c for c, _ in _COLS], "seeds", "fit s", "fit fwd"])
        for m in order:
            g = by[m]
            t.add(m, *[fmt(_agg(g, ds, k), 4) for _, k in _COLS], str(len(g)),
                  fmt(mean_std_n([r["cost"]["fit_seconds"] for r in g]), 1),
                  str(int(np.mean([r["cost"]["fit_forward"] for r in g]))),
                  values={k: _agg(g, ds, k)[0] for _, k in _COLS})
        for sc in ("aps", "raps"):
            g = by.get("softmax", [])
            if g:
                t.add(f"softmax ({sc} sets)", *["" for _ in _COLS[:6]],
                      *[fmt(_agg(g, ds, f"{sc}_{k}"), 4) for _, k in _COLS[6:]], str(len(g)),
                      "", "")
        page.table(t)
        page.add("")
    page.section("Every severity: NLL, ECE, 90 % set coverage / size")
    t = Table(["method", *[f"{ds} NLL" for ds in EVAL_SETS]])
    for m in order:
        t.add(m, *[fmt(_agg(by[m], ds, "nll"), 3) for ds in EVAL_SETS])
    page.table(t)
    page.add("")
    t = Table(["method", *[f"{ds} ECE" for ds in EVAL_SETS]])
    for m in order:
        t.add(m, *[fmt(_agg(by[m], ds, "ece"), 3) for ds in EVAL_SETS])
    page.table(t)
    page.add("")
    t = Table(["method", *[f"{ds} cov/size 90" for ds in EVAL_SETS]])
    for m in order:
        t.add(m, *[f"{fmt(_agg(by[m], ds, 'coverage_90')[0], 3)} / "
                   f"{fmt(_agg(by[m], ds, 'size_90')[0], 2)}" for ds in EVAL_SETS])
    page.table(t)
    page.add("", f"![NLL against severity]({out.name}/nll_severity.png)",
             f"![reliability clean]({out.name}/reliability_clean.png)",
             f"![reliability noise-3]({out.name}/reliability_noise-3.png)", "")
    page.section("Out-of-distribution detection (AUROC, OOD = positive)")
    page.add(f"Score: {OOD_SCORE}; the max-softmax column is each method's own 1 - max p.", "")
    t = Table(["method", "AUROC (own score)", "AUROC (1 - max p)"])
    for m in order:
        t.add(m, fmt(_agg(by[m], "ood", "auroc_ood"), 4),
              fmt(_agg(by[m], "ood", "auroc_ood_msp"), 4),
              values={"auroc_ood": _agg(by[m], "ood", "auroc_ood")[0]})
    page.table(t)
    page.add("")
    page.section("Goals of issue #33 (digits, tiny ViT)")
    page.add(*_goal_lines(by), "")
    page.add(*_per_seed_lines(by))
    if "sa-cls" in by and "temperature" in by:
        page.headline(f"digits: noise-3 NLL SA {fmt(_mean(by, 'sa-cls', 'noise-3', 'nll'), 3)} vs "
                      f"temperature {fmt(_mean(by, 'temperature', 'noise-3', 'nll'), 3)}; OOD "
                      f"AUROC SA (MI) {fmt(_mean(by, 'sa-cls', 'ood', 'auroc_ood'), 3)} vs "
                      f"max-softmax {fmt(_mean(by, 'softmax', 'ood', 'auroc_ood'), 3)}.")
    else:
        page.headline(f"digits: clean accuracy "
                      f"{fmt(_mean(by, 'softmax', 'clean', 'accuracy'), 3)} (SA not run yet).")
    budgets = sorted({json.dumps(r.get("reuse", {}).get("budget")) for r in rows})
    page.add("", compute_line(rows, a.get("threads")) + f" Budget: {'; '.join(budgets)}.", "")
    page.add(*error_lines(errors or [], out / "runs"))
    page.implementations(implementation_block(order, scores=SCORES))
    return page


def _figures_and_summary(out: Path, md: Path, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from attnuq._io import atomic_savefig

    by = _by(rows)
    order = [m for m in DEFAULT_METHODS if m in by]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, kind, sev in ((axes[0], "noise", (0.0, *NOISE)), (axes[1], "rotation",
                                                              (0.0, *ANGLES))):
        for m in order:
            ys = [_mean(by, m, ds, "nll") for ds in ("clean", *[f"{kind}-{k}" for k in (1, 2,
                                                                                       3)])]
            ax.plot(sev, ys, marker="o", label=m)
        ax.set_xlabel("noise sd" if kind == "noise" else "rotation (degrees)")
        ax.set_ylabel("test NLL")
        ax.set_title(f"{kind}: NLL against severity", fontsize=9)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    atomic_savefig(fig, out / "nll_severity.png", dpi=80)
    plt.close(fig)
    for ds in ("clean", "noise-3"):
        panels = {f"{m} ({len(by[m])} seeds)": (
            np.concatenate([r["_pred"][f"{ds}_probs"] for r in by[m]]),
            np.concatenate([r["_pred"]["test_y"] for r in by[m]])) for m in order}
        reliability_figure(out / f"reliability_{ds}.png", f"digits/{ds}: reliability", panels)
    if md.parent.is_dir():
        update_summary(md.parent / "summary.json", "digits", summary(rows))


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``digits`` key of ``summary.json``: the evaluation sets and ``ood``."""
    by = _by(rows)
    if "softmax" not in by:
        return {}
    clean_acc = _mean(by, "softmax", "clean", "accuracy")
    out: dict[str, Any] = {}
    for ds in EVAL_SETS:
        out[ds] = {"backbone": {"metric": "accuracy",
                                "value": _mean(by, "softmax", ds, "accuracy"),
                                "reference": 0.98 if ds == "clean" else clean_acc,
                                "reference_name": ("a small transformer on clean digits "
                                                   "(issue #33)" if ds == "clean" else
                                                   "the same backbone on the clean test set")},
                   "splits": len(by["softmax"]),
                   "methods": {m: {**{k: _agg(g, ds, k)[0] for k in (
                       "nll", "brier", "ece", "aurc", "auroc_error")},
                       "set_coverage_90": _agg(g, ds, "coverage_90")[0],
                       "set_size_90": _agg(g, ds, "size_90")[0]} for m, g in by.items()}}
    out["ood"] = {"backbone": {"metric": "accuracy", "value": clean_acc, "reference": 0.98,
                               "reference_name": "clean accuracy; a small transformer reaches "
                                                 "0.98 (issue #33)"},
                  "splits": len(by["softmax"]),
                  "methods": {m: {"auroc_ood": _agg(g, "ood", "auroc_ood")[0]}
                              for m, g in by.items()}}
    return out


def render_page(out: Path, table: Path) -> Page:
    """The page ``table`` again from the stored records and predictions under ``out``."""
    twin = require_twin(table)
    out = Path(out)
    return build_page(out, _rows(out), twin["provenance"], twin["state"],
                      errors=_store(out).errors())


register("digits", help="scikit-learn digits with a tiny timm ViT: SA in distribution, under "
         "shift and out of distribution", add_arguments=add_arguments, run=run)
