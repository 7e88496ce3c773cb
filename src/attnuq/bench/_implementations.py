"""The "Implementations" block of a results page: which code produced each row.

Rows that are registered methods take their text from the registry
(:func:`attnuq.methods.method_implementation`, i.e. each class's ``implementation``
attribute); rows a suite computes itself (a seasonal-naive forecast, a GP) take the suite's own
text. The scores line says where the metrics come from and how they were checked.

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

from collections.abc import Iterable, Mapping

__all__ = ["SCORES_TEXT", "implementation_lines"]

#: where every suite's scores come from
SCORES_TEXT = (
    "Scores: `attnuq.metrics`; `crps_samples` (fair ensemble CRPS), `crps_normal`, "
    "`nll_normal` and `interval_score` agree with scoringrules 0.10 to 1e-12 "
    "(tests/test_metrics.py); PIT, W1 and coverage are attnuq's (no library counterpart used)."
)


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
        the suite's per-element residual quantiles, not :class:`~attnuq.methods.SplitConformal`).
    scores
        A closing line on the metrics (``None``: none).

    Raises
    ------
    ValueError
        A row that is neither in ``local`` nor registered.
    """
    from attnuq.methods import available_methods, method_implementation

    local = dict(local or {})
    known = set(available_methods())
    lines = ["## Implementations", "",
             "Which code produced each row (registered methods: the `implementation` text of "
             "their class in `src/attnuq/methods/`, from the code that rendered this page; "
             "docs/methods.md, section 5):",
             "", "| row | implementation |", "|---|---|"]
    seen: set[str] = set()
    for name in rows:
        if name in seen:
            continue
        seen.add(name)
        if name in local:
            text = local[name]
        elif name in known:
            text = method_implementation(name)
        else:
            raise ValueError(f"no implementation text for row {name=!r}: register it as a "
                             "method or give the suite's own text in local")
        lines.append(f"| {name} | {text} |")
    if scores:
        lines += ["", scores]
    return [*lines, ""]
