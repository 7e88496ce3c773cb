"""The "Implementations" block of a results page: which code produced each row.

Rows that are registered methods take their text from the registry
(:func:`attnuq_bench.methods.method_implementation`, i.e. each class's ``implementation``
attribute); rows a suite computes itself (a seasonal-naive forecast, a GP) take the suite's own
text. The scores line says where the metrics come from and how they were checked.

A block is stored as data (:func:`implementation_block`: ``{"intro": str, "rows": [[row, text],
...], "scores": str | None}``; ``rows`` may also be read as a ``{row: text}`` mapping) in the
page's JSON twin, so a page re-rendered later from its stored results says which code produced
*those* rows, not what today's registry says: :func:`block_lines` renders a stored block,
:func:`block_from_page` reads one back from a committed page (the migration of results stored
before blocks were), and :func:`merge_block` builds a page's block from the texts its runs
recorded, falling back to an earlier block and then to the registry.

Examples
--------
>>> lines = implementation_lines(["laplace", "seasonal-naive"],
...                              local={"seasonal-naive": "this suite (ett.py)"})
>>> lines[0], lines[6].startswith("| laplace | attnuq closed form")
('## Implementations', True)
>>> lines[7]
'| seasonal-naive | this suite (ett.py) |'
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["INTRO_TEXT", "SCORES_TEXT", "block_from_page", "block_lines", "implementation_block",
           "implementation_lines", "implementation_texts", "merge_block"]

#: where every suite's scores come from
SCORES_TEXT = (
    "Scores: `attnuq.metrics`; `crps_samples` (fair ensemble CRPS), `crps_normal`, "
    "`nll_normal` and `interval_score` agree with scoringrules 0.10 to 1e-12 "
    "(tests/attnuq/metrics/test_metrics.py); PIT, W1 and coverage are attnuq's "
    "(no library counterpart used)."
)

#: the sentence above the table
INTRO_TEXT = ("Which code produced each row (registered methods: the `implementation` text of "
              "their class in `harness/src/attnuq_bench/methods/`, from the code that rendered "
              "this page; docs/methods.md, section 5):")


def implementation_texts(rows: Iterable[str], local: Mapping[str, str] | None = None
                         ) -> dict[str, str]:
    """Today's text per row name (``local`` first, then the registry), repeats dropped.

    Raises ``ValueError`` for a row that is neither in ``local`` nor registered.
    """
    from attnuq_bench.methods import available_methods, method_implementation

    local = dict(local or {})
    known = set(available_methods())
    out: dict[str, str] = {}
    for name in rows:
        if name in out:
            continue
        if name in local:
            out[name] = local[name]
        elif name in known:
            out[name] = method_implementation(name)
        else:
            raise ValueError(f"no implementation text for row {name=!r}: register it as a "
                             "method or give the suite's own text in local")
    return out


def implementation_block(rows: Iterable[str], local: Mapping[str, str] | None = None,
                         *, scores: str | None = SCORES_TEXT) -> dict[str, Any]:
    """The block of today's code for ``rows``, as data: ``{"intro", "rows", "scores"}``.

    ``rows`` is a list of ``[row name, text]`` in page order (see :func:`implementation_texts`).
    """
    return {"intro": INTRO_TEXT, "rows": [[k, v] for k, v in implementation_texts(
        rows, local).items()], "scores": scores}


def _row_items(rows: Any) -> list[tuple[str, str]]:
    """``[[row, text], ...]`` or ``{row: text}`` as a list of pairs."""
    items = list(rows.items()) if isinstance(rows, Mapping) else [tuple(r) for r in rows]
    if not all(len(r) == 2 and all(isinstance(x, str) for x in r) for r in items):
        raise ValueError(f"block rows must be [row, text] string pairs, got {rows!r}")
    return [(r[0], r[1]) for r in items]


def block_lines(block: Mapping[str, Any]) -> list[str]:
    """Markdown lines of a stored block: heading, intro, the table, the scores line, ``""``.

    >>> block_lines({"intro": "Which code:", "rows": [["a", "x"]], "scores": None})
    ['## Implementations', '', 'Which code:', '', '| row | implementation |', '|---|---|', \
'| a | x |', '']
    """
    if not isinstance(block, Mapping) or not {"intro", "rows"} <= set(block):
        raise ValueError(f"an Implementations block needs intro and rows, got {block!r}")
    lines = ["## Implementations", "", str(block["intro"]), "",
             "| row | implementation |", "|---|---|"]
    lines += [f"| {name} | {text} |" for name, text in _row_items(block["rows"])]
    if block.get("scores"):
        lines += ["", str(block["scores"])]
    return [*lines, ""]


def block_from_page(lines: Sequence[str]) -> dict[str, Any] | None:
    """The block of a committed page's lines (``None`` when it has none); the inverse of
    :func:`block_lines` for pages it wrote.

    >>> block_from_page(block_lines({"intro": "I", "rows": [["a", "x | y"]], "scores": "S"}))
    {'intro': 'I', 'rows': [['a', 'x | y']], 'scores': 'S'}
    """
    if "## Implementations" not in lines:
        return None
    i = list(lines).index("## Implementations")
    intro = lines[i + 2]
    rows: list[list[str]] = []
    j = i + 6
    while j < len(lines) and lines[j].startswith("| "):
        name, text = lines[j][2:-2].split(" | ", 1)
        rows.append([name, text])
        j += 1
    scores = lines[j + 1] if j + 1 < len(lines) and lines[j] == "" and lines[j + 1] else None
    return {"intro": intro, "rows": rows, "scores": scores}


def merge_block(rows: Iterable[str], recorded: Mapping[str, str | None],
                previous: Mapping[str, Any] | None = None,
                local: Mapping[str, str] | None = None,
                *, scores: str | None = SCORES_TEXT) -> dict[str, Any]:
    """A page's block: per row the text its runs recorded (``recorded[name]``), else the text
    of the ``previous`` block of this page (results stored before runs recorded theirs), else
    today's (:func:`implementation_texts`). The intro and scores line are the previous block's
    when any row text comes from it, else today's.

    >>> prev = {"intro": "old", "rows": [["a", "old a"]], "scores": "old s"}
    >>> merge_block(["a", "gaussian"], {"gaussian": "g"}, prev)
    {'intro': 'old', 'rows': [['a', 'old a'], ['gaussian', 'g']], 'scores': 'old s'}
    """
    prev_rows = dict(_row_items((previous or {}).get("rows") or []))
    out: dict[str, str] = {}
    from_prev = False
    for name in rows:
        if name in out:
            continue
        text = recorded.get(name)
        if text is None and name in prev_rows:
            text, from_prev = prev_rows[name], True
        if text is None:
            text = implementation_texts([name], local)[name]
        out[name] = text
    pairs = [[k, v] for k, v in out.items()]
    if from_prev and previous is not None:
        return {"intro": previous["intro"], "rows": pairs, "scores": previous.get("scores")}
    return {"intro": INTRO_TEXT, "rows": pairs, "scores": scores}


def implementation_lines(rows: Iterable[str], local: Mapping[str, str] | None = None,
                         *, scores: str | None = SCORES_TEXT) -> list[str]:
    """Markdown lines: a ``## Implementations`` table, one line per row name, then ``scores``.

    Parameters
    ----------
    rows
        Row names of the page's tables, in page order (repeats are dropped).
    local
        Texts for rows the suite computes itself. A name here wins over the registry: a suite
        row may share a registered name without running that class (ETT's ``conformal`` is
        the suite's per-element residual quantiles, not
        :class:`~attnuq_bench.methods.SplitConformal`).
    scores
        A closing line on the metrics (``None``: none).

    Raises
    ------
    ValueError
        A row that is neither in ``local`` nor registered.
    """
    return block_lines(implementation_block(rows, local, scores=scores))
