"""Every public function and class of the covered modules has a runnable docstring example.

"Public" means: named in the module's ``__all__``, a function or class, and defined in that
module (re-exports are checked where they are defined). "Runnable example" means a ``>>>``
line in the object's own docstring; ``pytest --doctest-modules src/attnuq`` runs them.

Modules are added to ``COVERED`` once all their public objects have examples.
"""

from __future__ import annotations

import importlib
import inspect
import types

import pytest

COVERED = (
    "attnuq_bench.methods._base",
    "attnuq_bench.methods.coverage",
    "attnuq_bench.methods.ensemble",
    "attnuq_bench.methods.hsa",
    "attnuq_bench.methods.laplace",
    "attnuq_bench.methods.sa",
    "attnuq_bench.methods.simple",
    "attnuq_bench.methods.swag",
    "attnuq.calibration",
    "attnuq.calibration.criteria",
    "attnuq.calibration.layers",
    "attnuq.calibration.report",
    "attnuq.calibration.search",
    "attnuq.conformal",
    "attnuq.distributed",
    "attnuq.patching._adapter",
    "attnuq.patching._handle",
    "attnuq.patching._nu",
    "attnuq.patching._registry",
    "attnuq.patching._sites",
    "attnuq.patching._undo",
    "attnuq.patching._install",
    "attnuq.patching.hf",
    "attnuq.patching.sdpa",
    "attnuq.patching.timm",
    "attnuq.plots",
    "attnuq.montecarlo",
    "attnuq.predictive",
    "attnuq.html_report",
    "attnuq_bench.training",
)


def public_objects(module: types.ModuleType) -> list[tuple[str, object]]:
    """``(name, obj)`` for each function or class in ``module.__all__`` defined in ``module``."""
    names = getattr(module, "__all__", None)
    if names is None:
        raise AssertionError(f"{module.__name__} has no __all__")
    out: list[tuple[str, object]] = []
    for name in names:
        if not hasattr(module, name):
            raise AssertionError(f"{module.__name__}.__all__ lists {name!r}, which is undefined")
        obj = getattr(module, name)
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and getattr(
            obj, "__module__", None
        ) == module.__name__:
            out.append((name, obj))
    return out


def missing_examples(module: types.ModuleType) -> list[str]:
    """Public objects of ``module`` whose own docstring has no ``>>>`` line."""
    # obj.__doc__, not inspect.getdoc: a class must not pass on its base class's example
    return [
        name for name, obj in public_objects(module) if ">>>" not in (obj.__doc__ or "")
    ]


@pytest.mark.parametrize("modname", COVERED)
def test_public_objects_have_examples(modname: str) -> None:
    module = importlib.import_module(modname)
    assert public_objects(module), f"{modname} has no public function or class to check"
    offenders = missing_examples(module)
    assert not offenders, f"{modname}: public objects without a '>>>' example: {offenders}"


def test_checker_flags_missing_and_inherited_examples() -> None:
    """The checker itself: it must catch a bare function and a subclass relying on its base."""
    mod = types.ModuleType("fake_docs_module")
    src = '''
class Base:
    """Base.

    >>> Base()  # doctest: +ELLIPSIS
    <...>
    """

class Child(Base):
    pass

def documented():
    """Doc.

    >>> 1 + 1
    2
    """

def bare():
    """No example here."""

def _private():
    pass

from json import dumps as imported  # a function defined elsewhere, without example
__all__ = ["Base", "Child", "bare", "documented", "imported"]
'''
    exec(compile(src, "<fake>", "exec"), mod.__dict__)
    assert [n for n, _ in public_objects(mod)] == ["Base", "Child", "bare", "documented"]
    assert missing_examples(mod) == ["Child", "bare"]


def test_checker_rejects_undefined_all_entry() -> None:
    mod = types.ModuleType("fake_bad_all")
    mod.__all__ = ["nowhere"]  # type: ignore[attr-defined]
    with pytest.raises(AssertionError, match="nowhere"):
        public_objects(mod)
