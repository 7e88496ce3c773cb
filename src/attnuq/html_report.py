"""Self-contained HTML reports from a ``results.json`` file.

A results file is a JSON object with (all optional but ``title``):

* ``title``: str
* ``summary``: list of ``[label, value]`` pairs or an object, shown first;
* ``tables``: list of ``{"title": str, "columns": [str], "rows": [[...]], "note": str}``;
* ``figures``: list of ``{"file": "name.png", "caption": str}``, paths relative to the JSON file;
* ``meta``: an object (command line, date, machine), shown last.

:func:`render_report` writes ``report.html`` with the PNGs embedded (base64), so the page can be
mailed or opened anywhere.

Examples
--------
>>> import json, pathlib, tempfile
>>> with tempfile.TemporaryDirectory() as tmp:
...     d = pathlib.Path(tmp)
...     _ = (d / "results.json").write_text(json.dumps({"title": "t", "summary": {"nu": 4}}))
...     print(render_report(d / "results.json").name)
report.html
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path
from typing import Any

from attnuq._io import atomic_write_text, decode_nonfinite

__all__ = ["load_results", "render_report"]

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1100px;
margin:2em auto;padding:0 1em;color:#1d1d1f;line-height:1.45}
h1{font-size:1.6em;border-bottom:2px solid #3b6ea5;padding-bottom:.3em}
h2{font-size:1.2em;margin-top:1.8em;color:#3b6ea5}
table{border-collapse:collapse;margin:.6em 0;font-size:.92em}
th,td{border:1px solid #d0d7de;padding:.3em .7em;text-align:right}
th{background:#f3f6f9}td:first-child,th:first-child{text-align:left}
figure{display:inline-block;margin:.6em;vertical-align:top;max-width:48%}
figure img{max-width:100%;border:1px solid #e1e4e8}
figcaption{font-size:.85em;color:#555}
.note{color:#555;font-size:.9em}
code{background:#f3f6f9;padding:0 .2em}
"""


def load_results(path: str | Path) -> dict[str, Any]:
    """Read and validate a results file; raise ``ValueError`` naming the problem.

    Returns the JSON object; a missing file raises ``FileNotFoundError``, invalid JSON or an
    object without ``title`` raises ``ValueError``.

    Examples
    --------
    >>> import json, pathlib, tempfile
    >>> tmp = tempfile.TemporaryDirectory()
    >>> path = pathlib.Path(tmp.name) / "results.json"
    >>> _ = path.write_text(json.dumps({"title": "UCI", "summary": {"nu": 16}}))
    >>> load_results(path)["summary"]
    {'nu': 16}
    >>> _ = path.write_text(json.dumps({"summary": {}}))
    >>> load_results(path)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: ...results.json must hold a JSON object with a 'title' key
    >>> tmp.cleanup()
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"results file not found: {p}")
    try:
        data = decode_nonfinite(json.loads(p.read_bytes().decode("utf-8")))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{p} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or "title" not in data:
        raise ValueError(f"{p} must hold a JSON object with a 'title' key")
    _check_layout(data, p)
    return data


def _check_layout(data: dict[str, Any], p: Path) -> None:
    """Refuse a results object whose fields the page cannot show, naming the field: ``summary``
    an object or a list of ``[key, value]`` pairs; ``tables`` a list of objects with a list
    ``columns`` and a list ``rows`` of lists of that length; ``figures`` a list of objects whose
    ``file`` is a ``.png`` inside the results' folder; ``meta`` an object."""
    def bad(field: str, want: str, got: Any) -> ValueError:
        shown = repr(got) if len(repr(got)) <= 60 else repr(got)[:57] + "..."
        return ValueError(f"{p}: {field} must be {want}, got {shown}")

    summary = data.get("summary")
    if summary is not None and not isinstance(summary, dict):
        if not isinstance(summary, list) or not all(
                isinstance(kv, list) and len(kv) == 2 for kv in summary):
            raise bad("summary", "an object or a list of [key, value] pairs", summary)
    tables = data.get("tables", [])
    if not isinstance(tables, list):
        raise bad("tables", "a list", tables)
    for i, t in enumerate(tables):
        if not isinstance(t, dict) or not isinstance(t.get("columns"), list) \
                or not isinstance(t.get("rows"), list):
            raise bad(f"tables[{i}]", "an object with a list 'columns' and a list 'rows'", t)
        for j, r in enumerate(t["rows"]):
            if not isinstance(r, list) or len(r) != len(t["columns"]):
                raise bad(f"tables[{i}].rows[{j}]",
                          f"a list of {len(t['columns'])} cells (one per column)", r)
    figures = data.get("figures", [])
    if not isinstance(figures, list):
        raise bad("figures", "a list", figures)
    base = p.parent.resolve()
    for i, f in enumerate(figures):
        name = f.get("file") if isinstance(f, dict) else None
        if not isinstance(name, str) or not name.lower().endswith(".png"):
            raise bad(f"figures[{i}]", "an object whose 'file' names a .png", f)
        where = (p.parent / name).resolve()
        if Path(name).is_absolute() or base not in where.parents:
            raise bad(f"figures[{i}].file", "a .png inside the results' folder", name)
    meta = data.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise bad("meta", "an object", meta)


def _fmt(v: Any) -> str:
    if v is None:  # undefined (e.g. a rank correlation of a constant spread)
        return "n/a"
    if isinstance(v, float):
        if math.isnan(v):
            return "–"
        a = abs(v)
        if a != 0 and (a < 1e-3 or a >= 1e5):
            return f"{v:.3e}"
        return f"{v:.4g}"
    return html.escape(str(v))


def _table(columns: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(x)}</td>" for x in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_report(results: str | Path, out: str | Path | None = None) -> Path:
    """Write an HTML page for ``results`` (a results.json path); return the page's path.

    The page goes to ``out`` (default: ``report.html`` beside ``results``); figures listed in
    the file are embedded as base64 PNGs, so the page is self-contained.

    Examples
    --------
    >>> import json, pathlib, tempfile
    >>> results = {"title": "demo", "summary": {"nu": 16},
    ...            "tables": [{"title": "CRPS", "columns": ["method", "crps"],
    ...                        "rows": [["sa", 0.41], ["gaussian", 0.47]]}]}
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     path = pathlib.Path(tmp) / "results.json"
    ...     _ = path.write_text(json.dumps(results))
    ...     page = render_report(path, pathlib.Path(tmp) / "demo.html")
    ...     text = page.read_text()
    >>> page.name, "<h2>CRPS</h2>" in text, "<td>0.41</td>" in text
    ('demo.html', True, True)
    """
    results = Path(results)
    out_path = Path(out) if out is not None else results.parent / "report.html"
    if out_path.is_dir():
        raise ValueError(f"report path {str(out_path)!r} is a folder; name the HTML file")
    data = load_results(results)
    base = results.parent
    parts = [f"<h1>{html.escape(str(data['title']))}</h1>"]
    summary = data.get("summary")
    if summary:
        items = summary.items() if isinstance(summary, dict) else summary
        parts.append(_table(["", ""], [[k, v] for k, v in items]))
    for t in data.get("tables", []):
        parts.append(f"<h2>{html.escape(str(t.get('title', '')))}</h2>")
        parts.append(_table(list(t["columns"]), list(t["rows"])))
        if t.get("note"):
            parts.append(f"<p class='note'>{html.escape(str(t['note']))}</p>")
    figs = data.get("figures", [])
    if figs:
        parts.append("<h2>Figures</h2>")
        for f in figs:
            fp = base / f["file"]
            if not fp.is_file():
                raise FileNotFoundError(f"figure listed in {results.name} is missing: {fp}")
            b64 = base64.b64encode(fp.read_bytes()).decode()
            cap = html.escape(str(f.get("caption", f["file"])))
            parts.append(
                f"<figure><img src='data:image/png;base64,{b64}' alt='{cap}'>"
                f"<figcaption>{cap}</figcaption></figure>"
            )
    meta = data.get("meta")
    if meta:
        parts.append("<h2>How this was made</h2>")
        parts.append(_table(["", ""], [[k, v] for k, v in meta.items()]))
    page = (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(str(data['title']))}</title><style>{_CSS}</style></head>"
        f"<body>{''.join(parts)}</body></html>"
    )
    atomic_write_text(out_path, page)
    return out_path
