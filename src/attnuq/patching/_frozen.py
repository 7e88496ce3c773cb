"""Pickling a patched object stores the frozen one (private to the patcher).

Every change :mod:`attnuq.patching._install` makes to an object is recorded here (the instance
attribute's previous value, or the id of an added hook), and the object's class is routed
through a ``copyreg.dispatch_table`` reducer while any record of its instances exists: ``pickle``,
``torch.save`` and ``copy.deepcopy`` of a patched object then store it as it was before the
patch, so the file loads without attnuq and a deep copy is unpatched.
"""

from __future__ import annotations

import copyreg
import pickle
import threading
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from attnuq.patching._undo import SharedInstall, Undo

__all__ = ["remember_attr", "remember_hook"]

_MISSING = object()


class _Frozen:
    """What one patched object looked like before the patch (for :func:`_frozen_reduce`)."""

    __slots__ = ("attrs", "hooks", "ref")

    def __init__(self, obj: object) -> None:
        self.ref = weakref.ref(obj)
        self.attrs: dict[str, object] = {}  # instance attribute -> value before (or _MISSING)
        self.hooks: set[int] = set()  # ids of hooks the patch added


#: id(obj) -> record; an entry lives exactly as long as some undo that refers to obj.
_FROZEN: dict[int, _Frozen] = {}
_FROZEN_LOCK = threading.RLock()
_REDUCERS = SharedInstall()


def _record(obj: object) -> _Frozen:
    rec = _FROZEN.get(id(obj))
    if rec is None or rec.ref() is not obj:
        rec = _FROZEN[id(obj)] = _Frozen(obj)
    return rec


def _drop_if_empty(obj: object) -> None:
    rec = _FROZEN.get(id(obj))
    if rec is not None and rec.ref() is obj and not rec.attrs and not rec.hooks:
        del _FROZEN[id(obj)]


def _remember(obj: object, add: Callable[[_Frozen], Callable[[_Frozen], object]]) -> Undo:
    """Record part of ``obj``'s pre-patch state and route its class through the frozen reducer.

    ``add(record)`` notes the part and returns how to take it back out; the returned undo does
    that (if the record is still ``obj``'s), drops an empty record and releases the reducer.
    """
    with _FROZEN_LOCK:
        remove = add(_record(obj))
    release = _REDUCERS.acquire(type(obj), lambda: _install_reducer(type(obj)))

    def forget() -> None:
        with _FROZEN_LOCK:
            rec = _FROZEN.get(id(obj))
            if rec is not None and rec.ref() is obj:
                remove(rec)
            _drop_if_empty(obj)
        release()

    return forget


def remember_attr(obj: object, name: str, had: bool, old: object) -> Undo:
    """Record ``obj.<name>``'s value before the patch (the first record wins); the undo."""

    def add(rec: _Frozen) -> Callable[[_Frozen], object]:
        if name in rec.attrs:  # recorded by an earlier holder, which also takes it out
            return lambda r: None
        rec.attrs[name] = old if had else _MISSING
        return lambda r: r.attrs.pop(name, None)

    return _remember(obj, add)


def remember_hook(module: nn.Module, hook_id: int) -> Undo:
    """Record that the patch added hook ``hook_id`` to ``module``; the undo."""

    def add(rec: _Frozen) -> Callable[[_Frozen], object]:
        rec.hooks.add(hook_id)
        return lambda r: r.hooks.discard(hook_id)

    return _remember(module, add)


def _install_reducer(cls: type) -> Undo:
    """Route pickling of ``cls`` instances through :func:`_frozen_reduce`; the exact undo.

    ``copyreg.dispatch_table`` is what ``pickle`` (hence ``torch.save``) and ``copy`` consult
    by exact type before an object's own ``__reduce_ex__``; an entry that was there before is
    kept and called first.
    """
    table = copyreg.dispatch_table
    had, prev = cls in table, table.get(cls)

    def reduce(obj: Any) -> Any:
        return _frozen_reduce(obj, prev)

    table[cls] = reduce

    def undo() -> None:
        if table.get(cls) is reduce:
            if had:
                table[cls] = prev  # type: ignore[assignment]
            else:
                del table[cls]

    return undo


def _frozen_reduce(obj: Any, prev: Callable[[Any], Any] | None) -> Any:
    """``obj``'s reduce value with the patch taken out of its state (the frozen object).

    An object that is not patched reduces exactly as it would without attnuq. For a patched
    one the instance attributes the patch set are put back to their previous values (or left
    out) and the hooks it added are dropped from the hook dicts; nothing of attnuq is stored,
    so the file loads without attnuq and gives the frozen model. A class whose state is not a
    ``__dict__`` copy cannot be frozen this way and is refused.
    """
    rv = prev(obj) if prev is not None else obj.__reduce_ex__(2)
    with _FROZEN_LOCK:
        rec = _FROZEN.get(id(obj))
        if rec is None or rec.ref() is not obj:
            return rv
        attrs, hooks = dict(rec.attrs), set(rec.hooks)
    if isinstance(rv, str):  # pickled by reference
        return rv
    if not isinstance(rv, tuple) or len(rv) < 3 or not isinstance(rv[2], dict):
        raise pickle.PicklingError(
            f"attnuq: cannot pickle {type(obj).__name__} while stochastic attention is active "
            "on it (its pickled state is not an attribute dict, so the patch cannot be left "
            "out); pickle or torch.save it after the block"
        )
    state = dict(rv[2])
    for name, old in attrs.items():
        if old is _MISSING:
            state.pop(name, None)
        else:
            state[name] = old
    for name, val in list(state.items()):
        if "hooks" in name and isinstance(val, dict) and any(h in val for h in hooks):
            kept = type(val)()
            for k, v in val.items():
                if k not in hooks:
                    kept[k] = v
            state[name] = kept
    return (rv[0], rv[1], state, *rv[3:])
