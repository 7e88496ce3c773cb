"""The harness's ``attnuq bench`` and ``attnuq demo`` commands: arguments, one-line errors, and
output paths checked before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests._cli import assert_one_line_exit_2, run

from attnuq.cli import main


@pytest.mark.parametrize("args", [["demo"], ["bench"], ["bench", "uci"]])
def test_help_everywhere(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*args, "--help"])
    assert exc.value.code == 0
    assert "usage: attnuq" in capsys.readouterr().out


def test_demo_out_naming_a_file_fails_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--out`` that is an existing file is refused before training starts."""
    import attnuq_bench.data.uci

    def no_work(*_: object, **__: object) -> None:
        raise AssertionError("work started although --out is a file")

    monkeypatch.setattr(attnuq_bench.data.uci, "load_uci", no_work)
    taken = tmp_path / "taken.txt"
    taken.write_text("not a folder")
    rc, _, err = run(["demo", "--out", str(taken)], capsys)
    assert_one_line_exit_2(rc, err, "is not a folder")
    assert taken.read_text() == "not a folder"


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



def test_calibration_suite_seed_and_device(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--seed`` shifts the calibration seeds (and the model's seed); ``--device cpu`` runs."""
    pytest.importorskip("matplotlib")
    args = ["bench", "calibration", "--models", "uniform-mha", "--criteria", "scale",
            "--seeds", "1", "--nu-max", "16", "--grid-size", "3", "--max-evals", "2",
            "--threads", "1", "--device", "cpu", "--seed", "5",
            "--out", str(tmp_path / "cal")]
    rc, out, _ = run(args, capsys)
    assert rc == 0, out
    res = json.loads((tmp_path / "cal" / "results.json").read_text())
    assert [r["seed"] for r in res["rows"]] == [5]
    assert res["settings"]["seed"] == 5 and res["settings"]["device"] == "cpu"
    assert "seeds 5..5" in (tmp_path / "cal.md").read_text()



def test_text_file_given_as_grib_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("cfgrib", reason="the 'weather' extra (cfgrib) is not installed")
    grib = tmp_path / "field.grib"
    grib.write_text("this is a text file, not GRIB\n")
    rc, _, err = run(["bench", "era5", "--file", str(grib), "--out", str(tmp_path / "r"),
                       "--no-progress"], capsys)
    assert_one_line_exit_2(rc, err, "could not read 'field.grib' as GRIB")



def test_truncated_physionet_archive_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for rid in range(132539, 132549):
            text = f"Time,Parameter,Value\n00:00,RecordID,{rid}\n" + "".join(
                f"{h:02d}:00,HR,{60 + (h * rid) % 37}\n" for h in range(48))
            info = tarfile.TarInfo(f"set-a/{rid}.txt")
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    root = tmp_path / "data" / "physionet2012"
    root.mkdir(parents=True)
    blob = buf.getvalue()
    (root / "set-a.tar.gz").write_bytes(blob[: len(blob) // 2])
    rc, _, err = run(["bench", "physionet", "--data-dir", str(tmp_path / "data"),
                       "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "r")],
                      capsys)
    assert_one_line_exit_2(rc, err, "could not read the archive")



@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bench", "calibration", "--out", "{file}"], "--out '{file}' is not a folder"),
        (["bench", "uci", "--table", "{dir}", "--datasets", "concrete"], "--table '{dir}' is a"),
        (["bench", "uci", "--cache-dir", "{file}/sub"], "its parent '{file}' is a file"),
        (["bench", "physionet", "--md", "{dir}"], "--md '{dir}' is a folder"),
    ],
)
def test_bench_output_paths_checked_before_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    """Output paths that cannot be written fail at once, not after the suite ran."""
    file = tmp_path / "taken.txt"
    file.write_text("x")
    fill = {"file": str(file), "dir": str(tmp_path)}
    rc, _, err = run([a.format(**fill) for a in args], capsys)
    assert_one_line_exit_2(rc, err, message.format(**fill))
    assert file.read_text() == "x" and sorted(tmp_path.iterdir()) == [file]
