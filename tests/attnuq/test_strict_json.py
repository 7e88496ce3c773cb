"""Results files are strict JSON (RFC 8259): no bare ``NaN`` / ``Infinity`` tokens.

Python's ``json`` writes non-finite floats as bare tokens that ``jq``, JavaScript's
``JSON.parse`` and most other parsers refuse; :func:`attnuq._io.atomic_write_json` spells them
as strings and :func:`attnuq._io.read_json` / ``read_json_or_none`` decode them again.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from attnuq._io import (
    atomic_write_json,
    decode_nonfinite,
    encode_nonfinite,
    read_json,
    read_json_or_none,
)

ROOT = Path(__file__).resolve().parents[2]


def _strict(text: str) -> Any:
    """``json.loads`` that refuses the non-standard constants (NaN, Infinity, -Infinity)."""
    def refuse(token: str) -> Any:
        raise ValueError(f"non-standard JSON constant {token}")

    return json.loads(text, parse_constant=refuse)


def test_strict_parser_refuses_bare_tokens() -> None:
    """The checker itself can fail: a bare token, as plain ``json.dumps`` writes it."""
    with pytest.raises(ValueError, match="Infinity"):
        _strict(json.dumps({"beta": math.inf}))


def test_non_finite_floats_round_trip(tmp_path: Path) -> None:
    obj = {"beta": math.inf, "low": -math.inf, "acc": [0.5, math.nan], "t": (1.0, 2),
           "name": "Infinity-ish", "nested": {"x": [{"y": math.nan}]}}
    p = tmp_path / "r.json"
    atomic_write_json(p, obj, indent=1)
    raw = _strict(p.read_text())  # a strict parser reads it
    assert raw["beta"] == "Infinity" and raw["low"] == "-Infinity" and raw["acc"][1] == "NaN"
    for back in (read_json(p), read_json_or_none(p, "run")):
        assert back["beta"] == math.inf and back["low"] == -math.inf
        assert back["acc"][0] == 0.5 and math.isnan(back["acc"][1])
        assert math.isnan(back["nested"]["x"][0]["y"])
        assert back["t"] == [1.0, 2] and back["name"] == "Infinity-ish"
    assert decode_nonfinite(encode_nonfinite([math.inf])) == [math.inf]


def test_old_files_with_bare_tokens_still_read(tmp_path: Path) -> None:
    p = tmp_path / "old.json"
    p.write_text('{"beta": Infinity, "acc": NaN}')
    back = read_json(p)
    assert back["beta"] == math.inf and math.isnan(back["acc"])


def test_every_committed_json_file_is_strict() -> None:
    """Every JSON file under docs/ and src/ (results, records, bundled data) parses strictly."""
    files = [p for d in ("docs", "src", "harness") for p in (ROOT / d).rglob("*.json")]
    assert files, "no JSON files found under docs/ or src/"
    bad = []
    for p in files:
        try:
            _strict(p.read_text(encoding="utf-8"))
        except ValueError as exc:
            bad.append(f"{p.relative_to(ROOT)}: {exc}")
    assert not bad, "\n".join(bad)
