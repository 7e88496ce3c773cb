"""The ``attnuq`` command line, end to end on tiny inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from attnuq.cli import main


class _TinyRegressor(nn.Module):
    """Tokens from features, one self-attention layer, mean-pool, linear head: (B, F) -> (B,)."""

    def __init__(self, n_features: int = 3, d: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(1, d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x.unsqueeze(-1))  # (B, F, d)
        h, _ = self.attn(t, t, t, need_weights=False)
        return self.head(h.mean(1)).squeeze(-1)


def _saved_model(tmp: Path) -> tuple[Path, nn.Module]:
    torch.manual_seed(0)
    model = _TinyRegressor().eval()
    path = tmp / "model.pt"
    torch.save(model, path)
    return path, model


def _heldout(model: nn.Module, n: int = 48) -> tuple[np.ndarray, np.ndarray]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 3, generator=g)
    with torch.no_grad():
        y = model(x) + 0.1 * torch.randn(n, generator=g)
    return x.numpy(), y.numpy()


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(args)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize(
    "args", [[], ["demo"], ["bench"], ["calibrate"], ["report"], ["bench", "uci"]]
)
def test_help_everywhere(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*args, "--help"])
    assert exc.value.code == 0
    assert "usage: attnuq" in capsys.readouterr().out


def test_console_entry_point_runs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "attnuq.cli", "--version"], capture_output=True, text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("attnuq "), proc.stderr


def test_calibrate_npz_and_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_path, model = _saved_model(tmp_path)
    x, y = _heldout(model)
    np.savez(tmp_path / "heldout.npz", x=x, y=y)
    out_dir = tmp_path / "cal"
    rc, out, err = _run(
        ["calibrate", str(model_path), str(tmp_path / "heldout.npz"), "--search", "grid",
         "--n-passes", "4", "--out", str(out_dir)],
        capsys,
    )
    assert rc == 0, err
    res = json.loads((out_dir / "results.json").read_text())
    nu = res["summary"]["chosen nu"]
    assert isinstance(nu, int) and nu >= 1
    assert f"chosen nu = {nu}" in out
    assert (out_dir / "report.html").is_file() and (out_dir / "calibration_curve.png").is_file()
    cal = json.loads((out_dir / "calibration.json").read_text())
    assert cal["nu"] == nu

    header = ",".join([f"x{i}" for i in range(x.shape[1])] + ["target"])
    np.savetxt(tmp_path / "heldout.csv", np.column_stack([x, y]), delimiter=",",
               header=header, comments="")
    rc, out, err = _run(
        ["calibrate", str(model_path), str(tmp_path / "heldout.csv"), "--target", "target",
         "--n-passes", "4", "--out", str(tmp_path / "cal2")],
        capsys,
    )
    assert rc == 0, err


def test_calibrate_hf_model_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, num_labels=1, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    BertForSequenceClassification(cfg).eval().save_pretrained(tmp_path / "bert")
    ids = torch.randint(1, 50, (32, 8), generator=torch.Generator().manual_seed(0))
    np.savez(tmp_path / "ids.npz", input_ids=ids.numpy(),
             y=np.random.default_rng(0).normal(size=(32, 1)).astype(np.float32))
    rc, out, err = _run(
        ["calibrate", str(tmp_path / "bert"), str(tmp_path / "ids.npz"), "--output-key",
         "logits", "--search", "grid", "--n-passes", "3", "--out", str(tmp_path / "c")],
        capsys,
    )
    assert rc == 0, err
    assert "chosen nu" in out


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing-model", "model not found"),
        ("missing-data", "data file not found"),
        ("wrong-column", "target columns ['nope'] not in"),
        ("nan-target", "NaN target"),
        ("bad-suffix", "must end in .npz or .csv"),
        ("not-a-module", "not an nn.Module"),
    ],
)
def test_bad_input_gives_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, message: str
) -> None:
    model_path, model = _saved_model(tmp_path)
    x, y = _heldout(model, 8)
    csv = tmp_path / "d.csv"
    np.savetxt(csv, np.column_stack([x, y]), delimiter=",", header="a,b,c,t", comments="")
    args = ["calibrate", str(model_path), str(csv), "--target", "t", "--out", str(tmp_path / "o")]
    if case == "missing-model":
        args[1] = str(tmp_path / "nope.pt")
    elif case == "missing-data":
        args[2] = str(tmp_path / "nope.csv")
    elif case == "wrong-column":
        args[4] = "nope"
    elif case == "nan-target":
        y2 = y.copy()
        y2[3] = np.nan
        np.savetxt(csv, np.column_stack([x, y2]), delimiter=",", header="a,b,c,t", comments="")
    elif case == "bad-suffix":
        bad = tmp_path / "d.txt"
        bad.write_text("1 2 3")
        args[2] = str(bad)
    elif case == "not-a-module":
        torch.save({"weights": torch.zeros(2)}, model_path)
    rc, _, err = _run(args, capsys)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnuq: error: "), err
    assert message in lines[0]


def test_report_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "results.json").write_text(json.dumps({"title": "x", "summary": {"a": 1}}))
    rc, _, _ = _run(["report", str(tmp_path / "results.json")], capsys)
    assert rc == 0 and (tmp_path / "report.html").is_file()
    rc, _, err = _run(["report", str(tmp_path / "missing.json")], capsys)
    assert rc == 2 and "results file not found" in err


def test_unknown_bench_suite_is_an_argparse_error() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "nope"])
    assert exc.value.code == 2


@pytest.mark.parametrize("suite", ["uci", "ett", "era5", "physionet", "calibration"])
def test_every_bench_suite_takes_seed_and_device(
    suite: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", suite, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "--seed" in text and "--device" in text, text


@pytest.mark.parametrize(
    ("device", "message"),
    [("tpu:7", "unknown device 'tpu:7'"), ("cuda:99", "cuda:99")],
)
def test_bad_device_gives_one_line_and_exit_2(
    device: str, message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rc, _, err = _run(
        ["bench", "calibration", "--device", device, "--out", str(tmp_path / "c")], capsys
    )
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnuq: error: ") and message in lines[0]


def test_resolve_device() -> None:
    from attnuq._device import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected and resolve_device(None).type == expected
    with pytest.raises(ValueError, match="unknown device 'gpu0'"):
        resolve_device("gpu0")


def test_calibration_suite_seed_and_device(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--seed`` shifts the calibration seeds (and the model's seed); ``--device cpu`` runs."""
    pytest.importorskip("matplotlib")
    args = ["bench", "calibration", "--models", "uniform-mha", "--criteria", "scale",
            "--seeds", "1", "--nu-max", "16", "--grid-size", "3", "--max-evals", "2",
            "--threads", "1", "--device", "cpu", "--seed", "5",
            "--out", str(tmp_path / "cal")]
    rc, out, _ = _run(args, capsys)
    assert rc == 0, out
    res = json.loads((tmp_path / "cal" / "results.json").read_text())
    assert [r["seed"] for r in res["rows"]] == [5]
    assert res["settings"]["seed"] == 5 and res["settings"]["device"] == "cpu"
    assert "seeds 5..5" in (tmp_path / "cal.md").read_text()
