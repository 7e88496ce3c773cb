"""The HTML report renderer and the provenance helper."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnuq._runtime import machine_line, run_info
from attnuq.html_report import load_results, render_report

# a 1x1 PNG
_PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c489"
    "0000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082"
)


def _write(tmp: Path, data: dict) -> Path:
    p = tmp / "results.json"
    p.write_text(json.dumps(data))
    return p


def test_report_embeds_tables_figures_and_meta(tmp_path: Path) -> None:
    (tmp_path / "fig.png").write_bytes(_PNG)
    p = _write(
        tmp_path,
        {
            "title": "Demo <b>",
            "summary": {"nu": 4, "coverage": 0.951234},
            "tables": [{"title": "Scores", "columns": ["method", "crps"],
                        "rows": [["SA", 0.12345678], ["MC dropout", float("nan")],
                                 ["conformal", None]],
                        "note": "lower is better"}],
            "figures": [{"file": "fig.png", "caption": "PIT"}],
            "meta": {"command": "attnuq demo"},
        },
    )
    page = render_report(p).read_text()
    assert "Demo &lt;b&gt;" in page  # escaped
    assert "0.1235" in page and "0.9512" in page and "–" in page
    assert "<td>n/a</td>" in page  # None: undefined, e.g. a rank correlation of a constant
    assert "data:image/png;base64," in page
    assert "lower is better" in page and "attnuq demo" in page


def test_report_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="results file not found"):
        load_results(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_results(bad)
    no_title = _write(tmp_path, {"summary": {}})
    with pytest.raises(ValueError, match="a 'title' key"):
        load_results(no_title)
    missing_fig = _write(tmp_path, {"title": "t", "figures": [{"file": "nope.png"}]})
    with pytest.raises(FileNotFoundError, match=r"nope\.png"):
        render_report(missing_fig)


@pytest.mark.parametrize(("change", "match"), [
    ({"tables": ["abc"]}, r"tables\[0\] must be an object with a list 'columns'"),
    ({"tables": 3}, r"tables must be a list, got 3"),
    ({"tables": [{"rows": [[1]]}]}, r"tables\[0\] must be an object"),
    ({"tables": [{"columns": ["a", "b"], "rows": [[1]]}]},
     r"tables\[0\]\.rows\[0\] must be a list of 2 cells"),
    ({"meta": [1, 2]}, r"meta must be an object, got \[1, 2\]"),
    ({"summary": "x"}, r"summary must be an object or a list of \[key, value\] pairs"),
    ({"figures": ["a.png"]}, r"figures\[0\] must be an object whose 'file' names a \.png"),
    ({"figures": [{"file": 3}]}, r"figures\[0\] must be an object whose 'file'"),
    ({"figures": [{"file": "/etc/hostname"}]}, r"figures\[0\] must be an object whose 'file'"),
    ({"figures": [{"file": "/tmp/x.png"}]}, r"figures\[0\]\.file must be a \.png inside"),
    ({"figures": [{"file": "../x.png"}]}, r"figures\[0\]\.file must be a \.png inside"),
])
def test_malformed_results_are_named_by_field(tmp_path: Path, change: dict, match: str) -> None:
    """Malformed fields fail with one line naming the file and the field, never an
    AttributeError, and no file outside the results' folder is embedded."""
    p = _write(tmp_path, {"title": "t", **change})
    with pytest.raises(ValueError, match=match):
        load_results(p)
    with pytest.raises(ValueError, match=match):
        render_report(p)
    assert not (tmp_path / "report.html").exists()


def test_run_info_has_command_date_machine() -> None:
    info = run_info(["attnuq", "bench", "uci", "--splits", "5"])
    assert info["command"] == "attnuq bench uci --splits 5"
    assert info["date"].endswith("UTC")
    assert "torch=" in info["machine"] and "cores=" in info["machine"]
    assert machine_line() == info["machine"]
    # run as ``python -m attnuq.cli``: the command names the entry point, not __main__.py
    py_m = run_info(["/x/attnuq/__main__.py", "bench", "uci"])
    assert py_m["command"] == "attnuq bench uci"
