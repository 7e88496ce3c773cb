"""Undo primitives of the patcher: an undo is a callable that puts back exactly one change.

Everything a backend installs (:mod:`attnuq.patching._install`) returns an :data:`Undo`;
:func:`chain` composes them in reverse order, and :class:`SharedInstall` reference-counts an
install several handles need at once (``F.scaled_dot_product_attention``, a registry entry).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeAlias

__all__ = ["SharedInstall", "Undo", "chain"]

Undo: TypeAlias = Callable[[], None]


def chain(undos: list[Undo]) -> Undo:
    """One undo that runs ``undos`` in reverse order (the backends' ``apply`` returns it).

    Examples
    --------
    >>> log = []
    >>> undo = chain([lambda: log.append("first"), lambda: log.append("second")])
    >>> undo(); log
    ['second', 'first']
    """
    if not isinstance(undos, list) or not all(callable(u) for u in undos):
        raise TypeError(f"undos must be a list of callables, got {undos=!r}")

    def undo() -> None:
        for u in reversed(undos):
            u()

    return undo


class SharedInstall:
    """Global state installed once for any number of holders and undone when the last leaves.

    ``acquire(key, install)`` runs ``install()`` (which returns its exact undo) only when nobody
    holds ``key`` yet, and returns a release function (idempotent: a second call does nothing).
    The undo runs when the last holder of ``key`` releases. Thread-safe. Used for process-wide
    hooks (``F.scaled_dot_product_attention``, a module's imported name, the Hugging Face
    attention registries) that several patched models may need at the same time.

    Examples
    --------
    >>> log = []
    >>> shared = SharedInstall()
    >>> install = lambda: (log.append("on"), lambda: log.append("off"))[1]
    >>> r1, r2 = shared.acquire("k", install), shared.acquire("k", install)
    >>> r1(); r1(); log
    ['on']
    >>> r2(); log
    ['on', 'off']
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._count: dict[object, int] = {}
        self._undo: dict[object, Undo] = {}

    def acquire(self, key: object, install: Callable[[], Undo]) -> Undo:
        with self._lock:
            if self._count.get(key, 0) == 0:
                self._undo[key] = install()  # raises before anything is counted
            self._count[key] = self._count.get(key, 0) + 1
        done = False

        def release() -> None:
            nonlocal done
            with self._lock:
                if done:
                    return
                done = True
                self._count[key] -= 1
                if self._count[key] == 0:
                    del self._count[key]
                    self._undo.pop(key)()

        return release

    def holders(self, key: object) -> int:
        """How many holders ``key`` has now."""
        with self._lock:
            return self._count.get(key, 0)
