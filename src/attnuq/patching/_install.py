"""The changes a backend makes, each returning its exact undo (private to the patcher).

A backend changes a model only through these: an instance attribute (:func:`set_attr`, or
:func:`set_attr_shared` for objects several handles touch at once), a bound ``forward``
(:func:`swap_forward`) or a hook (:func:`track_hook`). Each change is recorded so that pickling
the object stores it unpatched (:mod:`attnuq.patching._frozen`).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from attnuq.patching._frozen import remember_attr, remember_hook
from attnuq.patching._undo import SharedInstall, Undo

__all__ = ["set_attr", "set_attr_shared", "swap_forward", "track_hook"]


def swap_forward(module: nn.Module, forward: Callable[..., Any]) -> Undo:
    """Bind ``forward`` as ``module.forward`` on this instance only; return the exact undo.

    The undo deletes the instance attribute when there was none before (so the class's
    ``forward`` shows through again), or puts back the previous instance attribute. While it is
    installed, pickling ``module`` stores the previous state (see :mod:`attnuq.patching._frozen`).

    Examples
    --------
    >>> import copy, torch
    >>> lin = torch.nn.Linear(2, 2)
    >>> undo = swap_forward(lin, lambda self, x: x * 0)
    >>> lin(torch.ones(1, 2)).tolist(), "forward" in vars(lin)
    ([[0.0, 0.0]], True)
    >>> "forward" in vars(copy.deepcopy(lin))  # a copy is the module from before
    False
    >>> undo(); "forward" in vars(lin)
    False
    """
    if not isinstance(module, nn.Module) or not callable(forward):
        raise TypeError(
            f"swap_forward needs an nn.Module and a callable, got {type(module).__name__} and "
            f"{forward!r}"
        )
    return set_attr(module, "forward", types.MethodType(forward, module))


def set_attr(obj: object, name: str, value: object) -> Undo:
    """Set ``obj.<name>`` in its instance ``__dict__`` and return the exact undo.

    Until the undo runs, ``pickle`` / ``torch.save`` / ``copy.deepcopy`` of ``obj`` store the
    value from before (the patch is not carried into the copy); module objects (``sys.modules``
    entries such as ``torch.nn.functional``) are not pickled and are not recorded.

    Examples
    --------
    >>> class Box:
    ...     x = 0
    >>> box = Box()
    >>> undo = set_attr(box, "x", 2)
    >>> box.x, vars(box)
    (2, {'x': 2})
    >>> undo(); box.x, vars(box)  # the class attribute shows through again
    (0, {})
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {name=!r}")
    d = obj.__dict__
    had = name in d
    old = d.get(name)
    forget = None if isinstance(obj, types.ModuleType) else remember_attr(obj, name, had, old)
    d[name] = value

    def undo() -> None:
        if had:
            d[name] = old
        else:
            d.pop(name, None)
        if forget is not None:
            forget()

    return undo


_SHARED_ATTRS = SharedInstall()
_SHARED_VALUES: dict[tuple[int, str], object] = {}


def set_attr_shared(obj: object, name: str, value: object) -> Undo:
    """:func:`set_attr` reference-counted per ``(obj, name)``: safe for objects several handles
    touch at once (a Hugging Face config shared by two models, in any removal order).

    The first holder records the previous value and sets ``value``; later holders only count;
    the previous value comes back when the last holder releases, whatever the order of the
    releases (each release is idempotent). Two holders asking for different values is an error.
    Thread-safe.

    Examples
    --------
    >>> class Cfg:
    ...     impl = "sdpa"
    >>> cfg = Cfg()
    >>> r1 = set_attr_shared(cfg, "impl", "x")
    >>> r2 = set_attr_shared(cfg, "impl", "x")
    >>> r1(); cfg.impl  # released out of order: still held by r2
    'x'
    >>> r2(); cfg.impl, "impl" in vars(cfg)
    ('sdpa', False)
    """
    key = (id(obj), name)  # obj stays alive while held (the undo refers to it): id is unique

    def install() -> Undo:
        undo = set_attr(obj, name, value)
        _SHARED_VALUES[key] = value

        def release() -> None:
            _SHARED_VALUES.pop(key, None)
            undo()

        return release

    with _SHARED_ATTRS._lock:
        held = _SHARED_VALUES.get(key, value)
        if _SHARED_ATTRS.holders(key) and held is not value and held != value:
            raise RuntimeError(
                f"{type(obj).__name__}.{name} is set to {held!r} by another active attnuq "
                f"handle; cannot set it to {value!r} at the same time"
            )
        return _SHARED_ATTRS.acquire(key, install)


def track_hook(module: nn.Module, hook: RemovableHandle) -> Undo:
    """Undo for a hook registered on ``module``; pickling ``module`` leaves the hook out.

    The backends register forward (pre-)hooks with torch's ``register_forward_*hook`` and hand
    the returned handle here: the undo removes the hook, and until then ``pickle`` /
    ``torch.save`` / ``copy.deepcopy`` of ``module`` store it without the hook.

    Examples
    --------
    >>> import pickle, torch
    >>> lin = torch.nn.Linear(2, 2)
    >>> undo = track_hook(lin, lin.register_forward_hook(lambda m, a, out: torch.zeros_like(out)))
    >>> lin(torch.ones(1, 2)).tolist()
    [[0.0, 0.0]]
    >>> len(pickle.loads(pickle.dumps(lin))._forward_hooks)  # stored without the hook
    0
    >>> undo(); len(lin._forward_hooks)
    0
    """
    if not isinstance(module, nn.Module) or not isinstance(hook, RemovableHandle):
        raise TypeError(
            f"track_hook needs an nn.Module and the RemovableHandle its register_*hook "
            f"returned, got {type(module).__name__} and {type(hook).__name__}"
        )
    forget = remember_hook(module, hook.id)

    def undo() -> None:
        hook.remove()
        forget()

    return undo
