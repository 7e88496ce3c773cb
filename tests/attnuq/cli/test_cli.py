"""The ``attnuq`` command line, end to end on tiny inputs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from tests._cli import TinyRegressor, assert_one_line_exit_2, heldout, run, saved_regressor
from torch import nn

from attnuq.cli import main


@pytest.mark.parametrize("args", [[], ["calibrate"], ["report"]])
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
    model_path, model = saved_regressor(tmp_path)
    x, y = heldout(model)
    np.savez(tmp_path / "heldout.npz", x=x, y=y)
    out_dir = tmp_path / "cal"
    rc, out, err = run(
        ["calibrate", str(model_path), str(tmp_path / "heldout.npz"), "--search", "grid",
         "--n-passes", "4", "--out", str(out_dir)],
        capsys,
    )
    assert rc == 0, err
    res = json.loads((out_dir / "results.json").read_text())
    nu = res["summary"]["chosen nu"]
    assert isinstance(nu, int) and nu >= 1
    assert f"chosen nu = {nu}" in out
    assert (out_dir / "report.html").is_file()
    # the figure needs the extra `plots`; without it the command says so and still succeeds
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    assert (out_dir / "calibration_curve.png").is_file() == has_mpl
    assert ("calibration_curve.png not drawn" in out) == (not has_mpl)
    cal = json.loads((out_dir / "calibration.json").read_text())
    assert cal["nu"] == nu

    header = ",".join([f"x{i}" for i in range(x.shape[1])] + ["target"])
    np.savetxt(tmp_path / "heldout.csv", np.column_stack([x, y]), delimiter=",",
               header=header, comments="")
    rc, out, err = run(
        ["calibrate", str(model_path), str(tmp_path / "heldout.csv"), "--target", "target",
         "--n-passes", "4", "--out", str(tmp_path / "cal2")],
        capsys,
    )
    assert rc == 0, err


_NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def _tiny_bert_folder(tmp: Path, layers: int = 1, **dropout: float) -> Path:
    """A 16-wide BERT regressor (one output) of seed 0, saved as ``tmp/bert``."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=layers,
                     num_attention_heads=2, intermediate_size=32, num_labels=1, **dropout)
    BertForSequenceClassification(cfg).eval().save_pretrained(tmp / "bert")
    return tmp / "bert"


def _token_ids_npz(tmp: Path) -> Path:
    """32 sequences of 8 token ids and a target each, as ``tmp/ids.npz``."""
    ids = torch.randint(1, 50, (32, 8), generator=torch.Generator().manual_seed(0))
    np.savez(tmp / "ids.npz", input_ids=ids.numpy(),
             y=np.random.default_rng(0).normal(size=(32, 1)).astype(np.float32))
    return tmp / "ids.npz"


def test_calibrate_hf_model_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _tiny_bert_folder(tmp_path, layers=1, **_NO_DROPOUT)
    _token_ids_npz(tmp_path)
    rc, out, err = run(
        ["calibrate", str(tmp_path / "bert"), str(tmp_path / "ids.npz"), "--output-key",
         "logits", "--search", "grid", "--n-passes", "3", "--out", str(tmp_path / "c")],
        capsys,
    )
    assert rc == 0, err
    assert "chosen nu" in out


def test_calibrate_per_layer_writes_the_map(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _tiny_bert_folder(tmp_path, layers=2, **_NO_DROPOUT)
    _token_ids_npz(tmp_path)
    rc, out, err = run(
        ["calibrate", str(tmp_path / "bert"), str(tmp_path / "ids.npz"), "--output-key",
         "logits", "--criterion", "crps", "--per-layer", "geometric", "--n-passes", "3",
         "--out", str(tmp_path / "c")],
        capsys,
    )
    assert rc == 0, err
    cal = json.loads((tmp_path / "c" / "calibration.json").read_text())
    sites = ["bert.encoder.layer.0.attention.self", "bert.encoder.layer.1.attention.self"]
    assert list(cal["nu_map"]) == sites and cal["per_layer"]["sites"] == sites
    assert cal["forward_passes"] <= 2 * cal["per_layer"]["shared_forward_passes"]
    res = json.loads((tmp_path / "c" / "results.json").read_text())
    assert res["summary"]["nu per layer"].startswith(f"{sites[0]}=")
    assert "nu per layer: " in out
    # a criterion that cannot rank shapes is refused with the reason, exit code 2
    rc, out, err = run(
        ["calibrate", str(tmp_path / "bert"), str(tmp_path / "ids.npz"), "--output-key",
         "logits", "--criterion", "scale", "--per-layer", "geometric", "--out",
         str(tmp_path / "c2")],
        capsys,
    )
    assert rc != 0 and "criterion='scale'" in err


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing-model", "model not found"),
        ("missing-data", "data file not found"),
        ("wrong-column", "target columns ['nope'] not in"),
        ("nan-target", "NaN target"),
        ("bad-suffix", "must end in .npz or .csv"),
        ("not-a-module", "not an nn.Module"),
        ("empty-csv", "has a header row but no data rows"),
        ("empty-npz", "holds no rows"),
        ("one-row", "need at least 2 rows each"),
    ],
)
def test_bad_input_gives_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, message: str
) -> None:
    model_path, model = saved_regressor(tmp_path)
    x, y = heldout(model, 8)
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
    elif case == "empty-csv":
        csv.write_text("a,b,c,t\n")
    elif case == "empty-npz":
        np.savez(tmp_path / "e.npz", x=np.zeros((0, 3), np.float32), y=np.zeros(0, np.float32))
        args[2] = str(tmp_path / "e.npz")
        del args[3:5]  # --target names CSV columns (refused with .npz)
    elif case == "one-row":
        np.savetxt(csv, np.column_stack([x, y])[:1], delimiter=",", header="a,b,c,t",
                   comments="")
    rc, _, err = run(args, capsys)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnuq: error: "), err
    assert message in lines[0]


def test_report_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "results.json").write_text(json.dumps({"title": "x", "summary": {"a": 1}}))
    rc, _, _ = run(["report", str(tmp_path / "results.json")], capsys)
    assert rc == 0 and (tmp_path / "report.html").is_file()
    rc, _, err = run(["report", str(tmp_path / "missing.json")], capsys)
    assert rc == 2 and "results file not found" in err


@pytest.mark.parametrize(
    ("device", "message"),
    [("tpu:7", "unknown device 'tpu:7'"), ("cuda:99", "cuda:99")],
)
def test_bad_device_gives_one_line_and_exit_2(
    device: str, message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rc, _, err = run(
        ["calibrate", "m.pt", "d.npz", "--device", device, "--out", str(tmp_path / "c")], capsys
    )
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnuq: error: ") and message in lines[0]


def test_resolve_device() -> None:
    from attnuq._runtime import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected and resolve_device(None).type == expected
    with pytest.raises(ValueError, match="unknown device 'gpu0'"):
        resolve_device("gpu0")


class _FourFeatures(nn.Module):
    """A model for 4 input features: a 3-feature data file makes its first Linear raise."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.body = TinyRegressor(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.inp(x))


class _AttentionIgnored(TinyRegressor):
    """Runs its attention but returns a function of the embeddings only: calibrate's
    documented RuntimeError (the output does not change under stochastic attention)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x.unsqueeze(-1))
        self.attn(t, t, t, need_weights=False)
        return self.head(t.mean(1)).squeeze(-1)




@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("wrong-feature-count", "fails on the inputs of d.npz"),
        ("attention-ignored", "did not change under stochastic attention"),
        ("hf-invalid-config", "could not read"),
        ("hf-no-weights", "could not load the weights of BertForSequenceClassification"),
        ("hf-truncated-safetensors", "could not load the weights of"),
        ("torn-npz", "could not read"),
    ],
)
def test_calibrate_failures_are_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, message: str
) -> None:
    """Issue #23 item 4: each of these gave a traceback and exit 1 before."""
    torch.manual_seed(0)
    model: nn.Module = {"wrong-feature-count": _FourFeatures,
                        "attention-ignored": _AttentionIgnored}.get(case, TinyRegressor)()
    model_path = tmp_path / "model.pt"
    torch.save(model.eval(), model_path)
    g = torch.Generator().manual_seed(1)
    data = tmp_path / "d.npz"
    np.savez(data, x=torch.randn(16, 3, generator=g).numpy(),
             y=torch.randn(16, generator=g).numpy())
    if case.startswith("hf-"):
        model_path = _tiny_bert_folder(tmp_path)
        np.savez(data, input_ids=np.ones((8, 4), dtype=np.int64), y=np.zeros((8, 1)))
        weights = model_path / "model.safetensors"
        if case == "hf-invalid-config":
            (model_path / "config.json").write_text("{not json")
        elif case == "hf-no-weights":
            weights.unlink()
        else:
            weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    if case == "torn-npz":
        data.write_bytes(data.read_bytes()[:100])
    key = ["--output-key", "logits"] if case.startswith("hf-") else []  # tensor outputs: none
    rc, _, err = run(["calibrate", str(model_path), str(data), "--search", "grid",
                       "--n-passes", "2", *key, "--out", str(tmp_path / "o")], capsys)
    assert_one_line_exit_2(rc, err, message)


def test_out_naming_a_file_fails_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--out`` that is an existing file is refused before calibration starts."""
    import attnuq

    def no_work(*_: object, **__: object) -> None:
        raise AssertionError("work started although --out is a file")

    monkeypatch.setattr(attnuq, "calibrate", no_work)
    model_path, model = saved_regressor(tmp_path)
    x, y = heldout(model, 8)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    taken = tmp_path / "taken.txt"
    taken.write_text("not a folder")
    args = ["calibrate", str(model_path), str(tmp_path / "d.npz")]
    rc, _, err = run([*args, "--out", str(taken)], capsys)
    assert_one_line_exit_2(rc, err, "is not a folder")
    assert taken.read_text() == "not a folder"


def test_report_out_naming_a_folder_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "results.json").write_text(json.dumps({"title": "x"}))
    rc, _, err = run(["report", str(tmp_path / "results.json"), "--out", str(tmp_path)], capsys)
    assert_one_line_exit_2(rc, err, "is a folder")
    (tmp_path / "torn.json").write_text("")
    rc, _, err = run(["report", str(tmp_path / "torn.json")], capsys)
    assert_one_line_exit_2(rc, err, "torn.json is not valid JSON")




@pytest.mark.parametrize("command", ["bench", "demo"])
def test_harness_commands_without_the_harness_say_how_to_install_it(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No plugin declares ``bench`` / ``demo``: one line naming the package to install, exit 2."""
    import attnuq.cli

    monkeypatch.setattr(attnuq.cli, "plugin_commands", lambda: {})
    rc, out, err = run([command, "uci", "--out", "x"], capsys)
    assert rc == 2 and out == "", (out, err)
    assert err.count("\n") == 1 and err.startswith(f"attnuq: error: 'attnuq {command}' needs")
    assert "pip install attnuq-bench" in err


class _EchoCommand:
    """A plugin command: ``attnuq echo WORD`` prints WORD; ``argv`` is what follows ``echo``."""

    help = "print a word"
    distributed = False
    seen: ClassVar[list[list[str]]] = []

    def add_arguments(self, parser: object, argv: list[str]) -> None:
        self.seen.append(list(argv))
        parser.add_argument("word")  # type: ignore[attr-defined]

    def run(self, args: object) -> int:
        print(args.word)  # type: ignore[attr-defined]
        return 3


class _EntryPoint:
    def __init__(self, obj: object) -> None:
        self.obj, self.loads = obj, 0

    def load(self) -> object:
        self.loads += 1
        return self.obj


def test_plugin_commands_are_found_and_only_the_one_asked_for_is_loaded(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import attnuq.cli

    echo, other = _EntryPoint(_EchoCommand()), _EntryPoint(None)
    monkeypatch.setattr(attnuq.cli, "plugin_commands", lambda: {"echo": echo, "other": other})
    rc, out, _ = run(["echo", "hello"], capsys)
    assert (rc, out) == (3, "hello\n")
    assert (echo.loads, other.loads) == (1, 0) and _EchoCommand.seen[-1] == ["hello"]
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "echo" in capsys.readouterr().out and other.loads == 0
