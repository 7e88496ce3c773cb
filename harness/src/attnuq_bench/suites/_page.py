"""The results page of a suite: one object writes the markdown page and its JSON twin.

A suite builds a :class:`Page` line by line, in page order: the title, the provenance header
(:meth:`Page.provenance`: command, date, machine), free text, section headings, tables
(:class:`Table`), headline lines (:meth:`Page.headline`: the lines the README copies), and the
Implementations block (:meth:`Page.implementations`, a stored block of
:mod:`attnuq_bench.suites._implementations`). :meth:`Page.write` writes ``<page>.md`` and the twin
``<page>.json`` atomically. The twin holds the title, the provenance, the headline lines (or
table), every table as data (columns, formatted cells and, where the suite gives them, the raw
numbers), the Implementations block and the suite's ``state``: what its render path needs,
beside the stored run JSON, to write the same page again (``attnuq bench <suite>
--render-only``). ``scripts/update_readme_results.py`` reads the README headline from the twins.

Numbers on every page go through one formatter, :func:`fmt`.

:func:`update_summary` writes one suite's key of ``docs/results/summary.json`` (issue #19's
machine-readable summary) and leaves the other suites' keys as they are.

Examples
--------
>>> page = Page("demo", "Demo: two methods")
>>> page.provenance({"command": "attnuq bench demo", "date": "d", "machine": "m"})
>>> page.section("Scores")
>>> t = Table(["method", "CRPS"])
>>> t.add("sa-paper", fmt(0.12345), values={"crps": 0.12345})
>>> page.table(t)
>>> page.headline("Best CRPS: **sa-paper**.")
>>> print(page.markdown())
# Demo: two methods
<BLANKLINE>
* command: `attnuq bench demo`
* date: d
* machine: m
## Scores
<BLANKLINE>
| method | CRPS |
|---|---|
| sa-paper | 0.1235 |
Best CRPS: **sa-paper**.
<BLANKLINE>
>>> twin = page.to_dict()
>>> twin["headline"], twin["sections"][0]["tables"][0]["values"]
(['Best CRPS: **sa-paper**.'], [{'crps': 0.12345}])
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from attnuq._io import atomic_write_json, atomic_write_text, read_json_or_none

__all__ = ["Page", "Table", "error_lines", "fmt", "gap_lines", "pit_figure", "plain",
           "read_twin", "require_twin", "runs_lines", "twin_path", "update_summary"]

#: keys every JSON twin has
TWIN_KEYS = ("suite", "title", "provenance", "headline", "headline_table", "sections",
             "implementations", "state")


def fmt(value: Any, digits: int = 4, *, std: float | None = None, scale: float = 1.0,
        missing: str = "-", nan: str | None = None, big: float | None = 1000.0) -> str:
    """The one number formatter of the results pages.

    Parameters
    ----------
    value
        A number, ``None`` (shown as ``missing``), a ``[mean, std, n]`` triple (aggregated over
        ``n`` seeds or splits: ``"mean ± std"`` when ``n > 1``, else ``"mean"``), or anything
        else (shown as ``str(value)``; ints and bools are shown as they are).
    digits
        Decimals of a float (and of ``std``).
    std
        When given: ``"mean ± std"`` (both times ``scale``, ``digits`` decimals).
    scale
        Factor applied to ``value`` and ``std`` before formatting (e.g. ``1e3`` for a column
        headed ``x1e-3``).
    missing
        Text for ``None``.
    nan
        Text for a non-finite float (``None``: Python's own ``nan``/``inf``/``-inf``).
    big
        Floats with ``abs(value) >= big`` get one decimal (``None``: never).

    Examples
    --------
    >>> fmt(0.123456), fmt(12345.678), fmt(None), fmt(36), fmt(float("inf"))
    ('0.1235', '12345.7', '-', '36', 'inf')
    >>> fmt(3.5621, 3, std=0.8251, big=None), fmt(float("nan"), 3, std=0.1, nan="n/a")
    ('3.562 ± 0.825', 'n/a')
    >>> fmt(0.006905, 3, scale=1e3, big=None)
    '6.905'
    >>> fmt([0.5, 0.1, 3], 3, big=None), fmt([0.5, 0.0, 1], 3, big=None)
    ('0.500 ± 0.100', '0.500')
    """
    if isinstance(digits, bool) or not isinstance(digits, int) or digits < 0:
        raise ValueError(f"digits must be an int >= 0, got {digits=!r}")
    if value is None:
        return missing
    if isinstance(value, (list, tuple)):
        if len(value) != 3:
            raise ValueError(f"an aggregate must be [mean, std, n], got {value!r}")
        mean, sd, n = value
        if not math.isfinite(float(mean)):
            return str(float(mean)) if nan is None else nan
        return fmt(float(mean), digits, std=float(sd) if n > 1 else None, scale=scale,
                   missing=missing, nan=nan, big=big)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) and std is None and scale == 1.0:
        return str(value)
    v = float(value) * scale
    if not math.isfinite(v):
        return str(float(value)) if nan is None else nan
    if std is not None:
        return f"{v:.{digits}f} ± {float(std) * scale:.{digits}f}"
    if big is not None and abs(v) >= big:
        return f"{v:.1f}"
    return f"{v:.{digits}f}"


class Table:
    """A markdown table: header ``columns``, rows of formatted cells, optional raw numbers.

    ``spaced=True`` writes the separator row as ``| --- | --- |`` (else ``|---|---|``).
    ``values`` (one dict per row, optional) go into the JSON twin beside the cells.

    >>> t = Table(["a", "b"], spaced=True)
    >>> t.add("x", "1")
    >>> t.lines()
    ['| a | b |', '| --- | --- |', '| x | 1 |']
    """

    def __init__(self, columns: Sequence[str], *, spaced: bool = False) -> None:
        if not columns:
            raise ValueError("a table needs at least one column")
        self.columns = [str(c) for c in columns]
        self.spaced = spaced
        self.rows: list[list[str]] = []
        self.values: list[dict[str, Any] | None] = []

    def add(self, *cells: str, values: Mapping[str, Any] | None = None) -> None:
        """Append one row (``len(cells) == len(columns)``), with its raw numbers if given."""
        if len(cells) != len(self.columns):
            raise ValueError(f"row has {len(cells)} cells, the table {len(self.columns)} "
                             f"columns: {cells!r}")
        self.rows.append([str(c) for c in cells])
        self.values.append(None if values is None else dict(values))

    def lines(self) -> list[str]:
        sep = ("| " + " | ".join("---" for _ in self.columns) + " |" if self.spaced
               else "|" + "---|" * len(self.columns))
        return ["| " + " | ".join(self.columns) + " |", sep,
                *["| " + " | ".join(r) + " |" for r in self.rows]]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"columns": self.columns, "rows": self.rows}
        if any(v is not None for v in self.values):
            out["values"] = self.values
        return out


class Page:
    """A results page under construction (see the module docstring).

    Parameters
    ----------
    suite
        The suite's name (``uci``, ``ett``, ...), recorded in the twin.
    title
        The page title (the ``# `` heading and the README's bold title).
    state
        What the suite's render path needs to write this page again from the stored run JSON
        (e.g. the command's budget); stored in the twin as is (must be JSON-serialisable).
    """

    def __init__(self, suite: str, title: str, *, state: Mapping[str, Any] | None = None
                 ) -> None:
        if not suite or not title:
            raise ValueError(f"suite and title must be non-empty, got {suite=!r}, {title=!r}")
        self.suite, self.title = suite, title
        self.state: dict[str, Any] = dict(state or {})
        self.lines: list[str] = [f"# {title}", ""]
        self.prov: dict[str, Any] = {}
        self.heads: list[str] = []
        self.head_table: list[str] | None = None
        self.sections: list[dict[str, Any]] = [{"heading": None, "tables": []}]
        self.impl: dict[str, Any] | None = None

    # -- building ---------------------------------------------------------------------------
    def add(self, *lines: str) -> None:
        """Append text lines as they are (``""`` is a blank line)."""
        self.lines += [str(x) for x in lines]

    def provenance(self, info: Mapping[str, Any], *, label: str = "command") -> None:
        """The header lines ``* <label>: `command```, ``* date: ...``, ``* machine: ...``.

        ``info`` is :func:`attnuq._runtime.run_info`'s dict (or the stored one of an earlier
        run); it is recorded as the twin's ``provenance``.
        """
        missing = [k for k in ("command", "date", "machine") if k not in info]
        if missing:
            raise ValueError(f"provenance lacks {missing}: {dict(info)!r}")
        self.prov = dict(info)
        self.add(f"* {label}: `{info['command']}`", f"* date: {info['date']}",
                 f"* machine: {info['machine']}")

    def section(self, heading: str, *, blank: bool = True) -> None:
        """A ``## heading`` line (and a blank line after it unless ``blank=False``)."""
        self.add(f"## {heading}", *([""] if blank else []))
        self.sections.append({"heading": heading, "tables": []})

    def table(self, table: Table, *, headline: bool = False) -> None:
        """Append ``table``; ``headline=True`` makes it the README's headline table."""
        self.add(*table.lines())
        self.sections[-1]["tables"].append(table.to_dict())
        if headline:
            self.head_table = table.lines()

    def headline(self, text: str, *, readme: str | None = None) -> None:
        """Append the line ``text`` and record it as a README headline (as ``readme`` if given:
        e.g. prefixed with the section it belongs to)."""
        self.add(text)
        self.heads.append(text if readme is None else readme)

    def implementations(self, block: Mapping[str, Any], *, trailing_blank: bool = True) -> None:
        """Append a stored Implementations block
        (:func:`~attnuq_bench.suites._implementations.block_lines`), recorded in the twin;
        ``trailing_blank=False`` drops its last blank."""
        from attnuq_bench.suites._implementations import block_lines

        lines = block_lines(block)
        self.add(*(lines if trailing_blank else lines[:-1]))
        self.impl = dict(block)

    # -- output -----------------------------------------------------------------------------
    def markdown(self, *, end: str = "\n") -> str:
        """The page text: the lines joined by newlines, then ``end``."""
        return "\n".join(self.lines) + end

    def to_dict(self) -> dict[str, Any]:
        """The JSON twin (keys :data:`TWIN_KEYS`), strict JSON data (:func:`plain`)."""
        return plain({"suite": self.suite, "title": self.title, "provenance": self.prov,
                      "headline": self.heads, "headline_table": self.head_table,
                      "sections": [s for s in self.sections
                                   if s["heading"] is not None or s["tables"]],
                      "implementations": self.impl, "state": self.state})

    def write(self, md: str | Path, twin: str | Path | None = None, *, end: str = "\n") -> Path:
        """Write the page to ``md`` and its twin to ``twin`` (default: ``md`` with ``.json``),
        both atomically; returns ``md``."""
        md = Path(md)
        atomic_write_json(twin_path(md) if twin is None else Path(twin), self.to_dict(),
                          indent=1, allow_nan=False)
        atomic_write_text(md, self.markdown(end=end))
        return md


def plain(obj: Any) -> Any:
    """``obj`` as strict JSON data: non-finite floats become ``None`` (JSON has no NaN), tuples
    lists, mapping keys strings; numpy scalars and other numbers become floats.

    >>> plain({"a": float("nan"), "b": (1, 2.5), 3: [float("inf")]})
    {'a': None, 'b': [1, 2.5], '3': [None]}
    """
    if isinstance(obj, Mapping):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if obj is None or isinstance(obj, (str, bool, int)):
        return obj
    if isinstance(obj, numbers.Integral):
        return int(obj)
    try:
        v = float(obj)
    except (TypeError, ValueError):
        return str(obj)
    return v if math.isfinite(v) else None


def twin_path(md: str | Path) -> Path:
    """The JSON twin of the page ``md``: the same path with ``.json`` (a page named ``*.json``
    is refused: it would be its own twin).

    >>> twin_path("docs/results/uci.md").as_posix()
    'docs/results/uci.json'
    """
    md = Path(md)
    if md.suffix == ".json":
        raise ValueError(f"a results page cannot end in .json (its twin does): {str(md)!r}")
    return md.with_suffix(".json")


def _valid_twin(t: Any) -> bool:
    return isinstance(t, dict) and all(k in t for k in TWIN_KEYS)


def read_twin(md: str | Path) -> dict[str, Any] | None:
    """The JSON twin of the page ``md``, or ``None`` when there is none (a torn or invalid one:
    ``None`` with a :class:`~attnuq._io.CorruptFileWarning`)."""
    return read_json_or_none(twin_path(md), "results page twin", validate=_valid_twin)


def require_twin(md: str | Path, hint: str = "") -> dict[str, Any]:
    """The JSON twin of the page ``md`` to render it from; ``ValueError`` naming the page when
    there is none (``hint``: what to run first)."""
    twin = read_twin(md)
    if twin is None:
        raise ValueError(f"no JSON twin of {str(md)!r} to render from{hint}")
    return twin


def runs_lines(records: Sequence[Mapping[str, Any]], key_of: Any, *,
               label: str = "run budgets") -> list[str]:
    """Header lines on the stored records a page aggregates: the commands that produced them,
    their date range and machines, and the distinct ``key_of(record)`` (budgets, configs).

    >>> r = {"run_info": {"command": "c", "date": "d1", "machine": "m"}, "b": 1}
    >>> runs_lines([r], lambda x: x["b"])
    ['* runs produced by: `c`', '* run dates: d1 to d1; machines: m', '* run budgets: 1']
    """
    import json

    if not records:
        return []
    info = [r.get("run_info") or {} for r in records]
    dates = sorted(i.get("date", "?") for i in info)
    keys = sorted({json.dumps(key_of(r)) for r in records})
    return [f"* runs produced by: "
            f"{', '.join(f'`{c}`' for c in sorted({i.get('command', '?') for i in info}))}",
            f"* run dates: {dates[0]} to {dates[-1]}; machines: "
            f"{'; '.join(sorted({i.get('machine', '?') for i in info}))}",
            f"* {label}: {'; '.join(keys)}"]


def gap_lines(have: Mapping[str, Mapping[str, set[int]]], *, min_splits: int = 5) -> list[str]:
    """The page's line on what is below the full suite: sets with fewer than ``min_splits``
    splits and methods lacking a split of their set (``have[set][method]`` = splits run).

    >>> gap_lines({"a": {"m": {0, 1}, "n": {0}}})
    ['Below the full suite (>= 5 splits, every method on every split): a has 2 split(s); \
a/n lacks split(s) [1].', '']
    """
    short = []
    for ds, by_m in have.items():
        all_sp = set().union(*by_m.values()) if by_m else set()
        if len(all_sp) < min_splits:
            short.append(f"{ds} has {len(all_sp)} split(s)")
        short += [f"{ds}/{m} lacks split(s) {sorted(all_sp - got)}" for m, got in by_m.items()
                  if got != all_sp]
    if not short:
        return []
    return [f"Below the full suite (>= {min_splits} splits, every method on every split): "
            f"{'; '.join(short)}.", ""]


def error_lines(errors: Sequence[Path], root: Path) -> list[str]:
    """The page's list of failed items (their ``.err.txt``, first line), ``[]`` when none."""
    if not errors:
        return []
    lines = ["Runs that failed (no JSON written; re-running the command retries them):", ""]
    for e in errors:
        first = (e.read_text(errors="replace").splitlines() or ["(empty)"])[0][:200]
        lines.append(f"* `{e.relative_to(root)}`: {first}")
    return [*lines, ""]


def pit_figure(path: str | Path, title: str, panels: Mapping[str, Sequence[float]]) -> Path:
    """One PNG of PIT histograms, one panel per ``label -> PIT values`` (10 bins, density, the
    uniform density dashed), at most 4 per row; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from attnuq._io import atomic_savefig

    if not panels:
        raise ValueError(f"no PIT panels for {str(path)!r}")
    ncol = min(4, len(panels))
    nrow = math.ceil(len(panels) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.2 * ncol, 2.4 * nrow), squeeze=False)
    for ax, (label, pit) in zip(axes.flat, panels.items(), strict=False):
        ax.hist(list(pit), bins=10, range=(0, 1), density=True, color="#3b6ea5",
                edgecolor="white")
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_title(label, fontsize=9)
        ax.set_xlim(0, 1)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=90)
    plt.close(fig)
    return Path(path)


#: the backbone metrics of summary.json: regression (lower is better), classification (higher)
BACKBONE_METRICS = ("rmse", "mse", "auroc", "accuracy")

#: the keys issue #19 names per method (lower is better except coverage)
SUMMARY_METRICS = ("rmse", "mse", "crps", "pi95_width_cal", "coverage95_native", "w1_native")


def update_summary(path: str | Path, suite: str, datasets: Mapping[str, Any]) -> Path:
    """Set ``suite``'s key of the summary JSON at ``path`` to ``datasets``; keep the others.

    ``datasets`` maps a data set name to ``{"backbone": {"metric": "rmse" | "mse" | "auroc" |
    "accuracy", "value", "reference", "reference_name"}, "splits": int, "methods": {method:
    {metric: float}}}`` (issue #19; lower is better for ``rmse``/``mse``, higher for the
    classification backbones' ``auroc``/``accuracy``, issue #33). Written atomically; a torn
    file is rebuilt with this suite's key only.

    Examples
    --------
    >>> import tempfile, json, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "summary.json"
    >>> entry = {"a": {"backbone": {"metric": "rmse", "value": 1.0, "reference": None,
    ...                "reference_name": None}, "splits": 1, "methods": {"frozen": {"rmse": 1.0}}}}
    >>> _ = update_summary(p, "uci", entry); _ = update_summary(p, "ett", {})
    >>> sorted(json.loads(p.read_text()))
    ['ett', 'uci']
    """
    for ds, e in datasets.items():
        if not isinstance(e, Mapping) or not {"backbone", "splits", "methods"} <= set(e):
            raise ValueError(f"summary entry of {ds!r} needs backbone, splits and methods: {e!r}")
        if e["backbone"].get("metric") not in BACKBONE_METRICS:
            raise ValueError(f"backbone metric of {ds!r} must be one of {BACKBONE_METRICS}: "
                             f"{e['backbone']}")
    path = Path(path)
    old = read_json_or_none(path, "results summary", validate=lambda d: isinstance(d, dict))
    new = {**(old or {}), suite: plain(datasets)}
    atomic_write_json(path, dict(sorted(new.items())), indent=1, allow_nan=False)
    return path
