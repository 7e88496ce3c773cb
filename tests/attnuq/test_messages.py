"""Issue #35 item 12: each refusal names the argument (or file) and its value, and says what
is wrong: not a misleading internal name or a generic "not found"."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tests._cli import heldout, saved_regressor
from torch import nn

import attnuq
from attnuq.cli import main


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    model_path, model = saved_regressor(tmp_path)
    x, y = heldout(model, 24)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    return {"model": model_path, "data": tmp_path / "d.npz", "dir": tmp_path}


def _cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = main(args)
    err = capsys.readouterr().err
    return rc, err


def _one_line_exit_2(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_data_that_is_not_a_regular_file_says_what_it_is(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["calibrate", str(files["model"])]
    tail = ["--n-passes", "2", "--out", str(files["dir"] / "o")]
    folder = files["dir"] / "folder.npz"
    folder.mkdir()
    rc, err = _cli([*base, str(folder), *tail], capsys)
    _one_line_exit_2(rc, err, str(folder), "is a folder, not a regular file")
    rc, err = _cli([*base, "/dev/null", *tail], capsys)
    _one_line_exit_2(rc, err, "/dev/null is a character device, not a regular file")
    fifo = files["dir"] / "pipe.npz"
    os.mkfifo(fifo)  # a reader would block forever on it
    rc, err = _cli([*base, str(fifo), *tail], capsys)
    _one_line_exit_2(rc, err, "is a named pipe (FIFO), not a regular file")
    rc, err = _cli(["calibrate", str(fifo), str(files["data"]), *tail], capsys)
    _one_line_exit_2(rc, err, "model", "is a named pipe (FIFO)")
    rc, err = _cli([*base, str(files["dir"] / "missing.npz"), *tail], capsys)
    _one_line_exit_2(rc, err, "data file not found")


def test_a_non_zip_npz_is_called_not_a_valid_npz(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    bad = files["dir"] / "text.npz"
    bad.write_text("x,y\n1,2\n")
    rc, err = _cli(["calibrate", str(files["model"]), str(bad), "--n-passes", "2",
                    "--out", str(files["dir"] / "o")], capsys)
    _one_line_exit_2(rc, err, "not a valid .npz file")
    assert "pickled" not in err


def test_output_key_on_a_tensor_output_is_refused(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    rc, err = _cli(["calibrate", str(files["model"]), str(files["data"]), "--n-passes", "2",
                    "--output-key", "logits", "--out", str(files["dir"] / "o")], capsys)
    _one_line_exit_2(rc, err, "--output-key 'logits'", "the model output is a tensor")


@pytest.mark.parametrize("seed", ["-1", "9223372036854775808", "1.5"])
def test_cli_seed_is_checked_by_the_parser(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str], seed: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["calibrate", str(files["model"]), str(files["data"]), "--seed", seed])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --seed: must be an int" in err and repr(seed) in err, err


@pytest.mark.parametrize("name", ["alpha", "beta", "h"])
def test_levy_attention_names_its_bad_initial_value(name: str) -> None:
    with pytest.raises(ValueError, match=f"{name} must be a finite float > 0, got {name}=-1"):
        attnuq.nn.LevyAttention(2, 8, 2, **{name: -1})


def test_dropout_p_in_eval_mode_is_named() -> None:
    class Block(nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)

    m = Block().eval()
    q = torch.randn(1, 2, 4, 8)
    with attnuq.stochastic(m, nu=2), pytest.raises(
            RuntimeError, match=r"dropout_p=0\.1 passed in eval mode.*must pass dropout_p=0\.0"):
        m(q)
    m.train()
    with attnuq.stochastic(m, nu=2), pytest.raises(
            RuntimeError, match=r"dropout_p=0\.1, module in training mode.*model\.eval\(\)"):
        m(q)
