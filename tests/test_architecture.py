"""The package's layering, checked on the source (docs/architecture.md states the rules).

Every module of ``src/attnuq`` is parsed (nothing is imported) and its imports are resolved to
attnuq modules. Module-level imports (outside functions, classes and ``if TYPE_CHECKING:``)
must form no cycle and must not reach a higher layer; some rules hold for imports anywhere in a
module (also inside functions): only ``bench`` and ``cli`` import ``bench``, no suite imports
another suite, methods and models do not import each other.

Each rule is also run on a small synthetic tree that breaks it, so that a checker which found
nothing could not pass silently.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"

#: top-level component of attnuq -> layer; a module may import its own layer or lower ones
LAYERS: dict[str, int] = {
    "_validation": 0, "_io": 0, "_runtime": 0,
    "ops": 1, "data": 1, "metrics": 1, "predictive": 1, "categorical": 1, "distributed": 1,
    "nn": 2, "patching": 2, "models": 2,
    "training": 3, "calibration": 3, "prediction": 3, "conformal": 3, "conformal_sets": 3,
    "plots": 3, "report": 3,
    "methods": 4, "baselines": 4,
    "bench": 5,
    "cli": 6,
}
#: the package root (``attnuq/__init__.py``, the lazy facade) counts as the top layer
ROOT_LAYER = 7
SUITES = ("uci", "ett", "era5", "physionet", "calibration")


@dataclass
class Module:
    name: str  # dotted, e.g. "attnuq.bench.uci"
    is_package: bool
    top: set[str] = field(default_factory=set)  # module-level imports (attnuq modules)
    anywhere: set[str] = field(default_factory=set)  # every import, also inside functions


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(node: ast.Import | ast.ImportFrom, mod: Module) -> list[str]:
    """Dotted names an import statement refers to (modules, or ``module.attr`` candidates)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = mod.name.split(".")
        if not mod.is_package:
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    return [prefix] + [f"{prefix}.{a.name}" for a in node.names]


def _collect(body: list[ast.stmt], mod: Module, top_level: bool, runtime: bool = True) -> None:
    """Record the imports of ``body``: ``top_level`` outside functions and classes, ``runtime``
    outside ``if TYPE_CHECKING:`` (imports only a type checker runs are not recorded)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if runtime:
                names = _targets(node, mod)
                mod.anywhere.update(names)
                if top_level:
                    mod.top.update(names)
        elif isinstance(node, ast.If):
            tc = _is_type_checking(node.test)
            _collect(node.body, mod, top_level, runtime and not tc)
            _collect(node.orelse, mod, top_level, runtime)
        elif isinstance(node, (ast.Try, ast.With)):
            for part in ("body", "orelse", "finalbody"):
                _collect(getattr(node, part, []), mod, top_level, runtime)
            for h in getattr(node, "handlers", []):
                _collect(h.body, mod, top_level, runtime)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            _collect(node.body, mod, False, runtime)
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    _collect([child], mod, top_level, runtime)


def load_tree(src: Path) -> dict[str, Module]:
    """Parse every module under ``src/attnuq``; imports resolved to known attnuq modules."""
    mods: dict[str, Module] = {}
    for path in sorted((src / "attnuq").rglob("*.py")):
        rel = path.relative_to(src).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        m = Module(".".join(parts), is_pkg)
        _collect(ast.parse(path.read_text(), str(path)).body, m, True)
        mods[m.name] = m
    for m in mods.values():  # keep attnuq modules only; `from pkg import name` -> pkg.name
        m.top = _resolve(m.top, mods) - {m.name}
        m.anywhere = _resolve(m.anywhere, mods) - {m.name}
    return mods


def _resolve(names: set[str], mods: dict[str, Module]) -> set[str]:
    """Known modules among ``names``; ``pkg`` of ``from pkg import sub`` only if it also names
    something that is not a submodule (then the package's ``__init__`` is what is used)."""
    out = {n for n in names if n in mods}
    for n in list(out):
        if mods[n].is_package:
            subs = {x for x in names if x.startswith(n + ".") and x.count(".") == n.count(".") + 1}
            attrs = subs - set(mods)
            if subs and not attrs:
                out.discard(n)
    return out


def _component(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def _layer(name: str) -> int:
    comp = _component(name)
    if comp is None:
        return ROOT_LAYER
    if comp not in LAYERS:
        raise KeyError(f"module {name} belongs to no layer: add {comp!r} to LAYERS and to "
                       "docs/architecture.md")
    return LAYERS[comp]


def _ancestors(name: str) -> set[str]:
    """Packages whose ``__init__`` runs when ``name`` is imported (not counting the root)."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(2, len(parts))}


def cycles(mods: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components (size > 1, or a self-loop) of the module-level graph."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(mods[v].top):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(mods):
            if v not in index:
                strong(v)
    finally:
        sys.setrecursionlimit(limit)
    return out


def upward(mods: dict[str, Module]) -> list[str]:
    """Module-level imports of a higher layer (a package importing its own parts is fine)."""
    bad = []
    for m in mods.values():
        if _component(m.name) is None:
            continue  # the lazy facade may name anything
        for t in sorted(m.top):
            if t in _ancestors(m.name):
                continue
            if _layer(t) > _layer(m.name):
                bad.append(f"{m.name} (layer {_layer(m.name)}) imports {t} "
                           f"(layer {_layer(t)}) at module level")
    return bad


def _suite(name: str) -> str | None:
    """The suite a bench module belongs to: ``bench.ett`` and its own ``bench._ett_page``."""
    leaf = name.split(".")[-1]
    for s in SUITES:
        if leaf == s or leaf.startswith(f"_{s}_"):
            return s
    return None


def anywhere_rules(mods: dict[str, Module]) -> list[str]:
    """Rules on every import, also inside functions."""
    bad = []
    for m in mods.values():
        comp = _component(m.name)
        for t in sorted(m.anywhere):
            tcomp = _component(t)
            if tcomp == "bench" and comp not in ("bench", "cli"):
                bad.append(f"{m.name} imports {t}: only bench and cli import bench")
            suite_m = _suite(m.name) if comp == "bench" else None
            suite_t = _suite(t) if tcomp == "bench" else None
            if (suite_m in SUITES and suite_t in SUITES and suite_m != suite_t):
                bad.append(f"suite {m.name} imports suite {t}")
            if {comp, tcomp} in ({"methods", "models"}, {"baselines", "models"}):
                bad.append(f"{m.name} imports {t}: methods and models do not import each other")
    return bad


@pytest.fixture(scope="module")
def tree() -> dict[str, Module]:
    return load_tree(SRC)


def test_every_module_has_a_layer(tree: dict[str, Module]) -> None:
    assert len(tree) > 50  # the whole package was read
    missing = sorted({c for n in tree if (c := _component(n)) is not None and c not in LAYERS})
    assert not missing, f"components without a layer: {missing}"


def test_module_level_imports_form_no_cycle(tree: dict[str, Module]) -> None:
    assert cycles(tree) == []


def test_module_level_imports_go_downward(tree: dict[str, Module]) -> None:
    assert upward(tree) == []


def test_only_bench_and_cli_import_bench_and_no_suite_imports_another(
    tree: dict[str, Module],
) -> None:
    assert anywhere_rules(tree) == []


def test_the_checks_catch_a_tree_that_breaks_each_rule(tmp_path: Path) -> None:
    pkg = tmp_path / "attnuq"
    files = {
        "__init__.py": "",
        "ops/__init__.py": "from attnuq.ops import a\n",
        "ops/a.py": "from . import b\n",
        "ops/b.py": "from attnuq.ops.a import x\n",  # cycle a <-> b
        "data/__init__.py": "from attnuq.methods import make\n",  # upward
        "methods/__init__.py": "def make():\n    from attnuq.models import m\n",
        "models/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from attnuq.bench import uci\n",  # allowed: TYPE_CHECKING
        "models/m.py": "def f():\n    import attnuq.bench.uci\n",
        "bench/__init__.py": "",
        "bench/uci.py": "def f():\n    from attnuq.bench import ett\n",
        "bench/ett.py": "from attnuq.bench import _ett_page\n",  # a suite's own part: fine
        "bench/_ett_page.py": "",
        "bench/_uci_page.py": "from attnuq.bench._ett_page import x\n",  # another suite's part
    }
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    mods = load_tree(tmp_path)
    assert cycles(mods) == [["attnuq.ops.a", "attnuq.ops.b"]]
    assert upward(mods) == ["attnuq.data (layer 1) imports attnuq.methods (layer 4) at module "
                            "level"]
    assert sorted(anywhere_rules(mods)) == [
        "attnuq.methods imports attnuq.models.m: methods and models do not import each other",
        "attnuq.models.m imports attnuq.bench.uci: only bench and cli import bench",
        "suite attnuq.bench._uci_page imports suite attnuq.bench._ett_page",
        "suite attnuq.bench.uci imports suite attnuq.bench.ett",
    ]
