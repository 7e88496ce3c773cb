"""``nu`` as :func:`attnuq.patch` accepts it, resolved to one validated value per site.

This is the one place ``nu`` is checked on its way to the kernel: :func:`resolve_nu` turns an
int, a per-head sequence or a mapping from name patterns into an int ``>= 1``, a tuple of those
(or None entries), or None for every site; the adapter and the operator take it as it is.
"""

from __future__ import annotations

import fnmatch
import numbers
from collections.abc import Mapping, Sequence
from typing import TypeAlias

from attnuq._validation import check_nu
from attnuq.ops import MAX_NU
from attnuq.patching._sites import AttentionSite

__all__ = ["NuSpec", "SiteNu", "resolve_nu", "site_nu"]

#: ``nu`` for one site: an int, a per-head sequence (entries int or None), or None (deterministic).
SiteNu: TypeAlias = "int | tuple[int | None, ...] | None"
#: what :func:`attnuq.patch` accepts: one site nu for all sites, or a mapping from name
#: patterns to them.
NuSpec: TypeAlias = "int | Sequence[int | None] | Mapping[str, int | Sequence[int | None] | None]"


def _bounded(value: object) -> int:
    """``check_nu`` and ``nu <= MAX_NU`` (the operator's limit), checked when patching."""
    n = check_nu(value)
    if n > MAX_NU:
        raise ValueError(
            f"nu must be at most MAX_NU = 2**31 - 1 (one query's draws go to one embedding_bag "
            f"call, which counts its indices in 32 bits), got nu={value!r}"
        )
    return n


def site_nu(value: object, where: str) -> int | tuple[int | None, ...] | None:
    """One site's ``nu`` validated: an int ``>= 1``, a per-head tuple of those or None, or None.

    ``where`` names the spec in the messages (``"every site"``, ``"pattern 'layers.0.*'"``).

    Examples
    --------
    >>> site_nu(8, "every site"), site_nu([4, None], "every site"), site_nu(None, "every site")
    (8, (4, None), None)
    >>> site_nu(0, "every site")
    Traceback (most recent call last):
    ...
    ValueError: nu must be a positive int, got nu=0 (for every site)
    """
    if value is None:
        return None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        try:
            return _bounded(value)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{e} (for {where})") from None
    if isinstance(value, Sequence) and not isinstance(value, str):
        out: list[int | None] = []
        for i, x in enumerate(value):
            if x is None:
                out.append(None)
                continue
            try:
                out.append(_bounded(x))
            except (TypeError, ValueError) as e:
                raise type(e)(f"{e} (head {i} of {where})") from None
        if not out:
            raise ValueError(f"per-head nu for {where} is empty, got nu={value!r}")
        return tuple(out)
    raise TypeError(
        f"nu must be a positive int, a per-head sequence of ints/None, None, or a mapping from "
        f"module-name patterns to those, got nu={value!r} for {where}"
    )


def resolve_nu(
    nu: object, sites: list[AttentionSite]
) -> dict[str, int | tuple[int | None, ...] | None]:
    """Map each patchable site name to its validated ``nu`` (first matching pattern wins).

    Examples
    --------
    >>> from attnuq.patching._sites import AttentionSite
    >>> sites = [AttentionSite(f"layers.{i}.attn", "mha", "MultiheadAttention", 2) for i in (0, 1)]
    >>> resolve_nu({"layers.0.*": 4}, sites)
    {'layers.0.attn': 4, 'layers.1.attn': None}
    >>> resolve_nu([2, None], sites)
    {'layers.0.attn': (2, None), 'layers.1.attn': (2, None)}
    """
    if isinstance(nu, Mapping):
        if not nu:
            raise ValueError(f"nu mapping is empty, got nu={nu!r}")
        pats = {}
        for pat, val in nu.items():
            if not isinstance(pat, str):
                raise TypeError(f"nu mapping keys must be str patterns, got {pat!r}")
            pats[pat] = site_nu(val, f"pattern {pat!r}")
        used: set[str] = set()
        out: dict[str, int | tuple[int | None, ...] | None] = {}
        for s in sites:
            for pat, val in pats.items():
                if fnmatch.fnmatchcase(s.name, pat):
                    out[s.name] = val
                    used.add(pat)
                    break
            else:
                out[s.name] = None
        unused = [p for p in pats if p not in used]
        if unused:
            raise ValueError(
                f"nu pattern(s) {unused} match no attention site; sites are "
                f"{[s.name for s in sites]}"
            )
        return out
    val = site_nu(nu, "every site")
    return {s.name: val for s in sites}
